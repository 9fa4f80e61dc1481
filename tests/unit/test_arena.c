/*
 * test_arena.c - the bump allocator of one response: zeroed, 16-byte
 * aligned memory, chunks chained when one is full (large requests get
 * their own), strings copied, everything freed at once.
 */
#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "arena.h"

/* Fails, naming the first byte, unless p[0, n) is all zero. */
static void assert_zero(const unsigned char *p, size_t n, const char *what)
{
    static const unsigned char zero[4096];
    for (size_t at = 0; at < n; at += sizeof(zero)) {
        size_t k = n - at < sizeof(zero) ? n - at : sizeof(zero);
        if (memcmp(p + at, zero, k) == 0)
            continue;
        for (size_t i = at; i < at + k; i++)
            ck_assert_msg(p[i] == 0, "%s: byte %zu of %zu is 0x%02x", what, i, n, p[i]);
    }
}

START_TEST(aligned_zeroed_and_disjoint)
{
    amx_arena_t a = {0};
    unsigned char *prev = NULL;
    size_t prev_n = 0;
    for (size_t n = 1; n < 3000; n += 37) {
        unsigned char *p = amx_arena_alloc(&a, n);
        ck_assert_ptr_nonnull(p);
        ck_assert_uint_eq((uintptr_t)p % 16, 0);
        assert_zero(p, n, "a new block");
        memset(p, 0xab, n);
        /* The previous block is untouched by this one. */
        if (prev != NULL)
            ck_assert_uint_eq(prev[prev_n - 1], 0xab);
        prev = p;
        prev_n = n;
    }
    /* Larger than a chunk: its own chunk, still usable. */
    unsigned char *big = amx_arena_alloc(&a, 1 << 20);
    ck_assert_ptr_nonnull(big);
    ck_assert_uint_eq(big[(1 << 20) - 1], 0);
    big[(1 << 20) - 1] = 1;
    /* And the arena goes on after it. */
    unsigned char *after = amx_arena_alloc(&a, 16);
    ck_assert_ptr_nonnull(after);
    ck_assert_uint_eq(after[15], 0);
    amx_arena_free(&a);
    ck_assert_ptr_null(a.head);
    amx_arena_free(&a); /* twice is fine */
    /* Memory that held something before (a freed chunk, reused by malloc)
     * comes back zeroed too. */
    for (int round = 0; round < 3; round++) {
        unsigned char *p = amx_arena_alloc(&a, 60000);
        ck_assert_ptr_nonnull(p);
        assert_zero(p, 60000, "a block in reused memory");
        memset(p, 0xab, 60000);
        amx_arena_free(&a);
    }
}
END_TEST

START_TEST(strings_and_zero_sizes)
{
    amx_arena_t a = {0};
    char *s = amx_arena_strdup(&a, "layer.0.w");
    ck_assert_str_eq(s, "layer.0.w");
    char *e = amx_arena_strdup(&a, "");
    ck_assert_str_eq(e, "");
    ck_assert_ptr_ne(s, e);
    void *z0 = amx_arena_alloc(&a, 0), *z1 = amx_arena_alloc(&a, 0);
    ck_assert_ptr_nonnull(z0);
    ck_assert_ptr_nonnull(z1);
    /* Many small strings across chunks keep their contents. */
    char *keep[5000];
    for (int i = 0; i < 5000; i++) {
        char b[32];
        snprintf(b, sizeof(b), "q%d", i);
        keep[i] = amx_arena_strdup(&a, b);
    }
    for (int i = 0; i < 5000; i += 499) {
        char b[32];
        snprintf(b, sizeof(b), "q%d", i);
        ck_assert_str_eq(keep[i], b);
    }
    ck_assert_str_eq(s, "layer.0.w");
    amx_arena_free(&a);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("arena");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, aligned_zeroed_and_disjoint);
    tcase_add_test(tc, strings_and_zero_sizes);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
