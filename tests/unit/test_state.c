/*
 * test_state.c - what every state backend shares (state.c, postproc.h):
 * the factory by name, the per-quantizer and per-slice result arrays (their
 * growth, initial values and allocator hooks), and the per-cell rules of
 * postproc.h (accumulation with TE's and the unfused history, the peer
 * stage, slices).
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "postproc.h"
#include "state.h"
#include "unit.h"

START_TEST(factory_by_name)
{
    amx_err_t err = {0};
    amx_state_t *st = NULL;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    ck_assert_str_eq(st->ops->name, "host");
    amx_state_destroy(st);
    amx_state_destroy(NULL);
    ck_assert_int_eq(amx_state_create("tpu", 0, &st, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "unknown state backend 'tpu' (host or cuda)");
#ifndef AMX_HAVE_CUDA
    amx_err_clear(&err);
    ck_assert_int_eq(amx_state_create("cuda", 0, &st, &err), AMX_EUNAVAIL);
    AMX_ASSERT_HAS(err.msg, "built without CUDA");
    ck_assert_int_eq(amx_state_cuda_available(), 0);
    ck_assert_uint_eq(amx_state_memory("cuda", 0), 0);
#endif
    uint64_t mem = amx_state_memory("host", 0);
    ck_assert_uint_eq(mem, (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGE_SIZE));
}
END_TEST

static int nalloc, nfree;

static void *counting_alloc(amx_state_t *st, size_t bytes)
{
    (void)st;
    nalloc++;
    return malloc(bytes);
}

static void counting_free(amx_state_t *st, void *p)
{
    (void)st;
    nfree++;
    free(p);
}

START_TEST(result_arrays_grow_and_keep)
{
    amx_err_t err = {0};
    amx_state_t *st;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    st->host_alloc = counting_alloc;
    st->host_free = counting_free;
    /* New entries: amax 0, scale 1, inverse 1. */
    ck_assert_int_eq(amx__state_grow_globals(st, 1, 3, &err), AMX_OK);
    ck_assert_uint_eq(st->out_nq[1], 3);
    ck_assert_uint_eq(st->g_cap[1], 3);
    ck_assert_int_eq(nalloc, 3);
    for (int q = 0; q < 3; q++) {
        ck_assert_float_eq(st->g_amax[1][q], 0.0f);
        ck_assert_float_eq(st->g_scale[1][q], 1.0f);
        ck_assert_float_eq(st->g_inv[1][q], 1.0f);
        st->g_amax[1][q] = (float)(q + 10);
    }
    /* Growing keeps what is there; capacity doubles. */
    ck_assert_int_eq(amx__state_grow_globals(st, 1, 4, &err), AMX_OK);
    ck_assert_uint_eq(st->g_cap[1], 6);
    ck_assert_int_eq(nalloc, 6);
    ck_assert_int_eq(nfree, 3);
    ck_assert_float_eq(st->g_amax[1][2], 12.0f);
    ck_assert_float_eq(st->g_amax[1][3], 0.0f);
    /* Within capacity: no allocation; fewer: nothing changes. */
    ck_assert_int_eq(amx__state_grow_globals(st, 1, 6, &err), AMX_OK);
    ck_assert_int_eq(nalloc, 6);
    ck_assert_int_eq(amx__state_grow_globals(st, 1, 2, &err), AMX_OK);
    ck_assert_uint_eq(st->out_nq[1], 6);
    ck_assert_ptr_null(st->g_amax[0]); /* the other set is its own */
    /* Slices: sized exactly, shrinking too; kept entries unchanged. */
    ck_assert_int_eq(amx__state_size_slices(st, 0, 5, &err), AMX_OK);
    ck_assert_uint_eq(st->out_ns[0], 5);
    st->s_amax[0][1] = 3.0f;
    ck_assert_float_eq(st->s_scale[0][4], 1.0f);
    ck_assert_int_eq(amx__state_size_slices(st, 0, 2, &err), AMX_OK);
    ck_assert_uint_eq(st->out_ns[0], 2);
    ck_assert_int_eq(amx__state_size_slices(st, 0, 12, &err), AMX_OK);
    ck_assert_float_eq(st->s_amax[0][1], 3.0f);
    ck_assert_float_eq(st->s_amax[0][2], 0.0f); /* cut, then fresh again */
    ck_assert_float_eq(st->s_inv[0][11], 1.0f);
    /* Destroy frees every array through the hook. */
    int before = nfree;
    amx_state_destroy(st);
    ck_assert_int_eq(nfree - before, 6);
    ck_assert_int_eq(nalloc, nfree);
}
END_TEST

/* A descriptor of one quantizer of n cells with the given accumulation and
 * history. */
static amx_qdesc_t desc(uint64_t n, int acc, uint32_t hlen, int conv, int reduce)
{
    amx_qdesc_t q;
    memset(&q, 0, sizeof(q));
    q.ncells = n;
    q.accumulation = (uint8_t)acc;
    q.hist_len = hlen;
    q.recipe.format = AMX_FMT_FP8_E4M3;
    q.recipe.rule = AMX_RULE_DELAYED;
    q.recipe.history_len = hlen;
    q.recipe.history_convention = (uint8_t)conv;
    q.recipe.history_reduce = (uint8_t)reduce;
    return q;
}

START_TEST(accumulation_rules)
{
    /* Running max. */
    amx_qdesc_t r = desc(1, AMX_ACC_RUNNING_MAX, 1, 0, AMX_HIST_MAX);
    float acc = -INFINITY;
    ck_assert_float_eq(amx_pp_accumulate(&r, &acc, NULL, 0, 3.0f), 3.0f);
    ck_assert_float_eq(amx_pp_accumulate(&r, &acc, NULL, 0, 1.0f), 3.0f);
    ck_assert_float_eq(acc, 3.0f);
    /* TE's history: the window shifts only when the epoch has data. */
    amx_qdesc_t t = desc(1, AMX_ACC_PER_EPOCH, 3, AMX_HISTCONV_TE, AMX_HIST_MAX);
    float ring[3] = {-INFINITY, -INFINITY, -INFINITY};
    ck_assert_float_eq(amx_pp_accumulate(&t, &acc, ring, 0, 5.0f), 5.0f);
    ck_assert_float_eq(amx_pp_accumulate(&t, &acc, ring, 0, 2.0f), 5.0f);
    ck_assert_float_eq(amx_pp_accumulate(&t, &acc, ring, 0, 0.0f), 0.0f); /* left alone */
    ck_assert_float_eq(ring[2], 2.0f);
    ck_assert_float_eq(amx_pp_accumulate(&t, &acc, ring, 0, 1.0f), 5.0f);
    ck_assert_float_eq(amx_pp_accumulate(&t, &acc, ring, 0, 1.0f), 2.0f); /* 5 left the window */
    t.recipe.history_reduce = AMX_HIST_MOST_RECENT;
    ck_assert_float_eq(amx_pp_accumulate(&t, &acc, ring, 0, 0.5f), 0.5f);
    /* The unfused history: slot hist_head takes the epoch, empty or not. */
    amx_qdesc_t u = desc(2, AMX_ACC_PER_EPOCH, 2, AMX_HISTCONV_TE_UNFUSED, AMX_HIST_MAX);
    float ring2[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    u.hist_head = 1;
    ck_assert_float_eq(amx_pp_accumulate(&u, &acc, ring2, 1, 4.0f), 4.0f);
    ck_assert_float_eq(ring2[1 * 2 + 1], 4.0f);
    u.hist_head = 0;
    ck_assert_float_eq(amx_pp_accumulate(&u, &acc, ring2, 1, 0.0f), 4.0f);
    ck_assert_float_eq(ring2[0 * 2 + 1], 0.0f);
    u.hist_head = 1;
    ck_assert_float_eq(amx_pp_accumulate(&u, &acc, ring2, 1, 1.0f), 1.0f); /* 4 overwritten */
}
END_TEST

START_TEST(peer_stage_and_slices)
{
    const float X = -INFINITY;
    uint8_t r;
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_SHARE, 2.0f, 5.0f, &r), 5.0f);
    ck_assert_uint_eq(r, 1);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_SHARE, 7.0f, 5.0f, &r), 7.0f);
    ck_assert_uint_eq(r, 0);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_FILL, 2.0f, 5.0f, &r), 2.0f);
    ck_assert_uint_eq(r, 0);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_FILL, X, 3.0f, &r), 3.0f);
    ck_assert_uint_eq(r, 1);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_FILL, X, X, &r), X);
    ck_assert_uint_eq(r, 0);
    amx_qdesc_t q;
    memset(&q, 0, sizeof(q));
    q.gbase = 10;
    q.nslices = 4;
    q.slice_cells = 6;
    ck_assert_uint_eq(amx_pp_slice(&q, 0), 10);
    ck_assert_uint_eq(amx_pp_slice(&q, 5), 10);
    ck_assert_uint_eq(amx_pp_slice(&q, 6), 11);
    ck_assert_uint_eq(amx_pp_slice(&q, 23), 13);
    amx_qdesc_t two[2] = {q, q};
    two[1].gbase = 14;
    two[1].nslices = 0;
    ck_assert_uint_eq(amx_qdesc_slices(two, 2), 14);
    ck_assert_uint_eq(amx_qdesc_slices(two, 1), 14);
    ck_assert_uint_eq(amx_qdesc_slices(two, 0), 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("state");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, factory_by_name);
    tcase_add_test(tc, result_arrays_grow_and_keep);
    tcase_add_test(tc, accumulation_rules);
    tcase_add_test(tc, peer_stage_and_slices);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
