/*
 * test_grow.c - the one array-growth rule (grow.h) and the buffers built
 * on it (bytebuf.h): doubling from a minimum, zero-fill of new elements,
 * refusal of sizes that overflow (the array left as it was), and the
 * bounds-checked reader and reference-counted reply buffers.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bytebuf.h"
#include "grow.h"

START_TEST(doubles_from_the_minimum)
{
    uint32_t *a = NULL;
    size_t cap = 0;
    ck_assert_int_eq(amx_grow(&a, &cap, 0, sizeof(*a), 8, 0), 0);
    ck_assert_ptr_null(a); /* nothing needed: nothing allocated */
    ck_assert_int_eq(amx_grow(&a, &cap, 1, sizeof(*a), 8, 0), 0);
    ck_assert_uint_eq(cap, 8);
    ck_assert_int_eq(amx_grow(&a, &cap, 8, sizeof(*a), 8, 0), 0);
    ck_assert_uint_eq(cap, 8);
    ck_assert_int_eq(amx_grow(&a, &cap, 9, sizeof(*a), 8, 0), 0);
    ck_assert_uint_eq(cap, 16);
    ck_assert_int_eq(amx_grow(&a, &cap, 100, sizeof(*a), 8, 0), 0);
    ck_assert_uint_eq(cap, 128);
    for (uint32_t i = 0; i < 128; i++)
        a[i] = i;
    ck_assert_int_eq(amx_grow(&a, &cap, 129, sizeof(*a), 8, 0), 0);
    ck_assert_uint_eq(cap, 256);
    for (uint32_t i = 0; i < 128; i++)
        ck_assert_uint_eq(a[i], i); /* kept across realloc */
    free(a);
    /* min 0 means 1. */
    char *c = NULL;
    cap = 0;
    ck_assert_int_eq(amx_grow(&c, &cap, 3, 1, 0, 0), 0);
    ck_assert_uint_eq(cap, 4);
    free(c);
}
END_TEST

START_TEST(new_elements_zeroed_on_request)
{
    uint64_t *a = NULL;
    size_t cap = 0;
    ck_assert_int_eq(amx_grow(&a, &cap, 4, sizeof(*a), 4, 1), 0);
    for (size_t i = 0; i < cap; i++) {
        ck_assert_uint_eq(a[i], 0);
        a[i] = UINT64_MAX;
    }
    ck_assert_int_eq(amx_grow(&a, &cap, 5, sizeof(*a), 4, 1), 0);
    ck_assert_uint_eq(cap, 8);
    for (size_t i = 0; i < 4; i++)
        ck_assert_uint_eq(a[i], UINT64_MAX); /* old ones kept */
    for (size_t i = 4; i < 8; i++)
        ck_assert_uint_eq(a[i], 0);
    free(a);
}
END_TEST

START_TEST(overflow_is_refused)
{
    uint32_t *a = NULL;
    size_t cap = 0;
    ck_assert_int_eq(amx_grow(&a, &cap, 10, sizeof(*a), 8, 1), 0);
    uint32_t *before = a;
    /* Elements x size past SIZE_MAX; a count past SIZE_MAX / 2 + 1. */
    ck_assert_int_eq(amx_grow(&a, &cap, SIZE_MAX / 2, sizeof(*a), 8, 1), -1);
    ck_assert_ptr_eq(a, before);
    ck_assert_uint_eq(cap, 16);
    ck_assert_int_eq(amx_grow(&a, &cap, SIZE_MAX, 1, 8, 1), -1);
    ck_assert_int_eq(amx_grow(&a, &cap, SIZE_MAX / 2 + 2, 1, 8, 1), -1);
    ck_assert_ptr_eq(a, before);
    ck_assert_uint_eq(cap, 16);
    free(a);
}
END_TEST

START_TEST(write_and_read_buffers)
{
    amx_wbuf_t w = {0};
    amx_put32(&w, 0xdeadbeef);
    amx_putstr(&w, "job");
    amx_put_align8(&w);
    ck_assert_uint_eq(w.len, 16);
    amx_put64(&w, 42);
    ck_assert_int_eq(w.oom, 0);
    ck_assert_uint_ge(w.cap, 1024);
    amx_rbuf_t r = {w.p, w.len, 0, 0};
    ck_assert_uint_eq(amx_get32(&r), 0xdeadbeef);
    ck_assert_uint_eq(amx_get32(&r), 3);
    ck_assert_int_eq(memcmp(amx_get(&r, 3), "job", 3), 0);
    ck_assert_ptr_nonnull(amx_get(&r, 5));
    ck_assert_uint_eq(amx_get64(&r), 42);
    ck_assert_int_eq(r.bad, 0);
    /* Past the end: NULL / 0, and bad stays set. */
    ck_assert_uint_eq(amx_get32(&r), 0);
    ck_assert_int_eq(r.bad, 1);
    r.off = 0;
    ck_assert_ptr_null(amx_get(&r, 1));
    /* A write that cannot grow marks the buffer; later puts do nothing.
     * A size near SIZE_MAX (len + n wraps) is refused too. */
    static const unsigned char src[1];
    ck_assert_int_eq(amx_wbuf_grow(&w, SIZE_MAX), -1);
    ck_assert_int_eq(w.oom, 1);
    w.oom = 0;
    amx_put(&w, src, SIZE_MAX / 2);
    ck_assert_int_eq(w.oom, 1);
    size_t len = w.len;
    amx_put32(&w, 1);
    ck_assert_uint_eq(w.len, len);
    free(w.p);
}
END_TEST

START_TEST(reply_buffers_are_reused_when_free)
{
    amx_replybuf_t *slot = NULL;
    amx_replybuf_t *a = amx_replybuf_take(&slot, 100);
    ck_assert_ptr_eq(a, slot);
    ck_assert_int_eq(atomic_load(&a->refs), 2);
    /* Still held by an answer in flight: a new one replaces it. */
    amx_replybuf_t *b = amx_replybuf_take(&slot, 100);
    ck_assert_ptr_ne(a, b);
    ck_assert_int_eq(atomic_load(&a->refs), 1); /* the slot let go of it */
    amx_replybuf_unref(a);                      /* the answer is gone: freed */
    amx_replybuf_unref(b);
    /* Free again: reused, unless too small. */
    amx_replybuf_t *c = amx_replybuf_take(&slot, 50);
    ck_assert_ptr_eq(c, b);
    amx_replybuf_unref(c);
    amx_replybuf_t *d = amx_replybuf_take(&slot, 200);
    ck_assert_ptr_ne(d, b);
    ck_assert_uint_ge(d->cap, 200);
    amx_replybuf_unref(d);
    amx_replybuf_unref(slot);
    amx_replybuf_unref(NULL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("grow");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, doubles_from_the_minimum);
    tcase_add_test(tc, new_elements_zeroed_on_request);
    tcase_add_test(tc, overflow_is_refused);
    tcase_add_test(tc, write_and_read_buffers);
    tcase_add_test(tc, reply_buffers_are_reused_when_free);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
