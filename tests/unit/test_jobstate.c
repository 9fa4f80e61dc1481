/*
 * test_jobstate.c - a job's replicated state as one checksummed byte
 * string: export and parse round trips (history rings and their heads,
 * front and back results), and refusals: any flipped bit, truncation,
 * misalignment, and well-sealed blobs whose magic, version, history head
 * or catalog order is wrong.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "jobstate.h"
#include "log.h"
#include "unit.h"

/* A host state laid out for `cat` (desc filled), with `vals` (ncells
 * cells) merged into the active buffer. */
static amx_state_t *state_for(const amx_catalog_t *cat, amx_qdesc_t *d)
{
    amx_err_t err = {0};
    amx_state_t *st;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    amx_catalog_layout(cat, d);
    amx_layout_change_t lc = {
        .ncells = cat->ncells, .nhist = cat->nhist, .nq = cat->n, .nslices = cat->nslices};
    ck_assert_int_eq(st->ops->reserve_pending(st, cat->ncells, &err), AMX_OK);
    ck_assert_int_eq(st->ops->remap(st, &lc, &err), AMX_OK);
    return st;
}

/* One epoch of `vals` through the backend: merge, flip, finish (the back
 * results); published when `publish`. */
static void epoch(amx_state_t *st, const amx_catalog_t *cat, amx_qdesc_t *d, const float *vals,
                  int publish)
{
    amx_err_t err = {0};
    amx_run_t run = {0, 0, cat->ncells};
    ck_assert_int_eq(st->ops->merge(st, vals, cat->ncells, &run, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    ck_assert_int_eq(
        st->ops->finish(st, d, cat->n, cat->ncells, cat->npeer, cat->nscale, 1, 1, &err), AMX_OK);
    if (publish)
        st->ops->publish(st);
}

/* Recomputes the checksum of a blob whose body a test changed. */
static void reseal(void *blob, size_t len)
{
    uint64_t sum = amx_checksum64(blob, len - 8);
    memcpy((unsigned char *)blob + len - 8, &sum, 8);
}

START_TEST(jobstate_round_trip_and_corruption)
{
    amx_err_t err = {0};
    amx_qspec_t *q[2] = {unit_spec("x", 3, NULL), unit_spec("y", 0, NULL)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 2, &cat, &err), AMX_OK);
    amx_qdesc_t d[2];
    amx_state_t *st = state_for(cat, d);
    float v[4] = {1, 2, 3, 9};
    epoch(st, cat, d, v, 1);
    void *blob;
    size_t len;
    ck_assert_int_eq(amx_jobstate_export("job", 7, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    ck_assert_uint_eq(len % 8, 0);
    amx_jobstate_t js;
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    ck_assert_str_eq(js.job, "job");
    ck_assert_uint_eq(js.last_reconciled, 7);
    ck_assert_uint_eq(js.cat->hash, cat->hash);
    ck_assert_float_eq(js.a.accum[3], 9.0f);
    ck_assert_float_eq(js.a.out_amax[1], 2.0f);
    ck_assert_float_eq(js.a.g_amax[0], 3.0f);
    ck_assert_float_eq(js.a.out_scale[3], 448.0f / 9.0f);
    amx_jobstate_free(&js);
    /* Every single flipped bit is caught. */
    unsigned char *b = blob;
    for (size_t i = 0; i < len; i += 7) {
        b[i] ^= 0x10;
        amx_err_clear(&err);
        ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
        b[i] ^= 0x10;
    }
    amx_err_clear(&err);
    ck_assert_int_eq(amx_jobstate_parse(blob, len - 8, &js, &err), AMX_EINVAL);
    ck_assert_int_eq(amx_jobstate_parse(blob, 3, &js, &err), AMX_EINVAL);
    free(blob);
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* A PER_EPOCH quantizer's history ring travels with its head. */
START_TEST(history_ring_and_head_round_trip)
{
    amx_err_t err = {0};
    amx_qspec_t *q[2] = {unit_spec("h", 2, NULL), unit_spec("r", 1, NULL)};
    q[0]->accumulation = AMX_ACC_PER_EPOCH;
    q[0]->recipe.rule = AMX_RULE_DELAYED;
    q[0]->recipe.history_len = 3;
    q[0]->recipe.history_convention = AMX_HISTCONV_TE;
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 2, &cat, &err), AMX_OK);
    ck_assert_uint_eq(cat->nhist, 6);
    amx_qdesc_t d[2];
    amx_state_t *st = state_for(cat, d);
    /* Two epochs, the head moving as the engine moves it. */
    float e1[3] = {4, 1, 7}, e2[3] = {2, 5, 3};
    epoch(st, cat, d, e1, 1);
    d[0].hist_head = 1;
    epoch(st, cat, d, e2, 1);
    d[0].hist_head = 2;
    void *blob;
    size_t len;
    ck_assert_int_eq(amx_jobstate_export("j", 2, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    amx_jobstate_t js;
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    ck_assert_uint_eq(js.hist_head[0], 2);
    ck_assert_uint_eq(js.hist_head[1], 0);
    ck_assert_uint_eq(js.cat->q[0]->recipe.history_len, 3);
    ck_assert_int_eq(js.cat->q[0]->accumulation, AMX_ACC_PER_EPOCH);
    /* TE's history: the ring shifts, the newest epoch in the last slot
     * (slot k of cell c at k * ncells + c), the oldest still -inf. */
    amx_state_arrays_t a = js.a;
    ck_assert_float_eq(a.hist[2 * 2 + 0], 2.0f);
    ck_assert_float_eq(a.hist[2 * 2 + 1], 5.0f);
    ck_assert_float_eq(a.hist[1 * 2 + 0], 4.0f);
    ck_assert_float_eq(a.hist[1 * 2 + 1], 1.0f);
    ck_assert_msg(a.hist[0] == -INFINITY, "slot 0 of cell 0 holds %g", (double)a.hist[0]);
    /* PER_EPOCH: the window's max; RUNNING_MAX: the max of all. */
    ck_assert_float_eq(a.out_amax[0], 4.0f);
    ck_assert_float_eq(a.out_amax[1], 5.0f);
    ck_assert_float_eq(a.out_amax[2], 7.0f);
    amx_jobstate_free(&js);
    free(blob);
    /* A head outside its ring is refused. */
    d[0].hist_head = 3;
    ck_assert_int_eq(amx_jobstate_export("j", 2, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "job state is malformed");
    free(blob);
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* The back results (finished, not published) or the front ones. */
START_TEST(export_front_or_back)
{
    amx_err_t err = {0};
    amx_qspec_t *q[1] = {unit_spec("a", 2, NULL)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 1, &cat, &err), AMX_OK);
    amx_qdesc_t d[1];
    amx_state_t *st = state_for(cat, d);
    float e1[2] = {1, 2}, e2[2] = {8, 0};
    epoch(st, cat, d, e1, 1);
    epoch(st, cat, d, e2, 0); /* finished into the back set */
    for (int back = 0; back < 2; back++) {
        void *blob;
        size_t len;
        ck_assert_int_eq(amx_jobstate_export("j", 1, cat, d, st, back, &blob, &len, &err), AMX_OK);
        amx_jobstate_t js;
        ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
        ck_assert_float_eq(js.a.out_amax[0], back ? 8.0f : 1.0f);
        ck_assert_float_eq(js.a.g_amax[0], back ? 8.0f : 2.0f);
        /* The replicated state is the same either way: after epoch 2. */
        ck_assert_float_eq(js.a.accum[0], 8.0f);
        amx_jobstate_free(&js);
        free(blob);
    }
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* Blobs that pass the checksum but are not what this daemon can use. */
START_TEST(sealed_but_wrong)
{
    amx_err_t err = {0};
    amx_qspec_t *q[2] = {unit_spec("a", 1, NULL), unit_spec("b", 1, NULL)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 2, &cat, &err), AMX_OK);
    amx_qdesc_t d[2];
    amx_state_t *st = state_for(cat, d);
    float v[2] = {1, 2};
    epoch(st, cat, d, v, 1);
    void *blob;
    size_t len;
    ck_assert_int_eq(amx_jobstate_export("j", 1, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    amx_jobstate_t js;
    uint32_t *w = blob;
    uint32_t magic = w[0], ver = w[1];
    w[0] = 0x4a584d42u;
    reseal(blob, len);
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "not a job state (bad magic)");
    w[0] = magic;
    w[1] = 2; /* format 5 reads 3 and 4 too (issue 23); 2 is refused */
    reseal(blob, len);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "job state format 2 is not one of the supported 3 to 5");
    w[1] = 6; /* a newer daemon's: refused, not read in part */
    reseal(blob, len);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "job state format 6 is not one of the supported 3 to 5");
    w[1] = ver;
    reseal(blob, len);
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    amx_jobstate_free(&js);
    /* Truncated (8 bytes short) with a fresh checksum: the body ends
     * early. */
    reseal(blob, len - 8);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_jobstate_parse(blob, len - 8, &js, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "job state is malformed");
    /* Not 8-byte aligned in memory. */
    unsigned char *copy = malloc(len + 8);
    memcpy(copy + 4, blob, len);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_jobstate_parse(copy + 4, len, &js, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "is truncated");
    free(copy);
    free(blob);
    /* Specs out of name order: a layout no daemon would make. */
    amx_qspec_t *t = cat->q[0];
    cat->q[0] = cat->q[1];
    cat->q[1] = t;
    ck_assert_int_eq(amx_jobstate_export("j", 1, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "job state is malformed");
    cat->q[1] = cat->q[0];
    cat->q[0] = t;
    free(blob);
    /* A field out of its range (a peer mode no daemon knows), and a peer
     * mode without a group. */
    for (int k = 0; k < 2; k++) {
        cat->q[0]->peer_mode = k == 0 ? 3 : AMX_PEER_FILL;
        cat->q[0]->peer_group = k == 0 ? "g" : "";
        ck_assert_int_eq(amx_jobstate_export("j", 1, cat, d, st, 0, &blob, &len, &err), AMX_OK);
        amx_err_clear(&err);
        ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
        AMX_ASSERT_HAS(err.msg, "job state is malformed");
        free(blob);
    }
    cat->q[0]->peer_mode = 0;
    cat->q[0]->peer_group = "";
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* Format 5 carries the globals of the epoch before the last (what a daemon
 * that catches up answers as previous_global_*: issue 21's session, a
 * restarted daemon's GetScales); format 4 (without) still reads. */
START_TEST(previous_globals_round_trip)
{
    amx_err_t err = {0};
    amx_qspec_t *q[2] = {unit_spec("a", 2, NULL), unit_spec("b", 0, NULL)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 2, &cat, &err), AMX_OK);
    amx_qdesc_t d[2];
    amx_state_t *st = state_for(cat, d);
    float v[3] = {1, 2, 3};
    epoch(st, cat, d, v, 1);
    float pga[2] = {5.0f, NAN}, pgs[2] = {89.6f, NAN};
    void *blob;
    size_t len;
    ck_assert_int_eq(
        amx_jobstate_export_prev("j", 2, cat, d, st, 0, NULL, pga, pgs, &blob, &len, &err), AMX_OK);
    amx_jobstate_t js;
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    ck_assert_ptr_nonnull(js.pprev_ga);
    ck_assert(js.pprev_ga[0] == 5.0f && js.pprev_gs[0] == 89.6f);
    ck_assert(isnan(js.pprev_ga[1]) && isnan(js.pprev_gs[1]));
    amx_jobstate_free(&js);
    free(blob);
    /* Without them: NaN, none. */
    ck_assert_int_eq(amx_jobstate_export("j", 2, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    ck_assert(isnan(js.pprev_ga[0]) && isnan(js.pprev_gs[1]));
    amx_jobstate_free(&js);
    /* A format 4 blob: the same bytes without the two trailing arrays
     * (8-byte aligned each: 8 bytes for two quantizers). */
    uint32_t *w = blob;
    w[1] = 4;
    size_t len4 = len - 16;
    reseal(blob, len4);
    ck_assert_int_eq(amx_jobstate_parse(blob, len4, &js, &err), AMX_OK);
    ck_assert_ptr_null(js.pprev_ga);
    ck_assert_ptr_null(js.pprev_gs);
    ck_assert_uint_eq(js.last_reconciled, 2);
    amx_jobstate_free(&js);
    free(blob);
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

START_TEST(checksum_sees_length_and_every_bit)
{
    unsigned char z[64] = {0};
    /* Zeros of different lengths differ (the length is mixed in). */
    for (size_t n = 1; n < 64; n++)
        ck_assert_uint_ne(amx_checksum64(z, n), amx_checksum64(z, n - 1));
    uint64_t h = amx_checksum64(z, 64);
    for (size_t i = 0; i < 64 * 8; i++) {
        z[i / 8] ^= (unsigned char)(1u << (i % 8));
        ck_assert_uint_ne(amx_checksum64(z, 64), h);
        z[i / 8] ^= (unsigned char)(1u << (i % 8));
    }
    ck_assert_uint_eq(amx_checksum64(z, 64), h);
}
END_TEST

int main(void)
{
    amx_log_level = AMX_LOG_ERROR;
    Suite *s = suite_create("jobstate");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, jobstate_round_trip_and_corruption);
    tcase_add_test(tc, history_ring_and_head_round_trip);
    tcase_add_test(tc, export_front_or_back);
    tcase_add_test(tc, sealed_but_wrong);
    tcase_add_test(tc, previous_globals_round_trip);
    tcase_add_test(tc, checksum_sees_length_and_every_bit);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
