/* test_calib.c - calibrators beyond max (daemon/calib.c, catalog.c): the
 * torch / numpy primitives and the histogram methods against values that
 * torch 2.9.1 (AVX-512 host), numpy 2.4.6 and ModelOpt 0.47's
 * calib/histogram.py functions computed on the same inputs (the ModelOpt
 * tier, tests/modelopt/test_calib_methods.py, compares thousands more),
 * hand-derived edge cases, and the validation of calibrator specs. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "catalog.h"

/* The test's data: the LCG of the generating script, u in [0, 1) on a
 * 2^-24 grid. */
static void lcg(double *out, int n, uint64_t seed)
{
    uint64_t s = seed;
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        out[i] = (double)(s >> 40) / (double)(1u << 24);
    }
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

START_TEST(torch_sum_matches_torch)
{
    /* x = float32((u - 0.5) * 2^(floor(16 v) - 8)); torch.from_numpy(x[:n]).sum(). */
    enum { N = 2000 };
    double u[N], v[N];
    float x[N];
    lcg(u, N, 1);
    lcg(v, N, 2);
    for (int i = 0; i < N; i++)
        x[i] = (float)((u[i] - 0.5) * exp2(floor(v[i] * 16) - 8));
    ck_assert_uint_eq(bits(amx_torch_sum_f32(x, 7, 8)), 0x3f0e2b85u);
    ck_assert_uint_eq(bits(amx_torch_sum_f32(x, 100, 8)), 0xc34dabd1u);
    ck_assert_uint_eq(bits(amx_torch_sum_f32(x, 2000, 8)), 0xc284ade8u);
    /* Integers sum exactly whatever the order. */
    float ones[1000];
    for (int i = 0; i < 1000; i++)
        ones[i] = (float)(i % 7);
    ck_assert_float_eq(amx_torch_sum_f32(ones, 1000, 8), 2997.0f);
}
END_TEST

START_TEST(numpy_sum_matches_numpy)
{
    enum { N = 2000 };
    double u[N], v[N], d[N];
    lcg(u, N, 1);
    lcg(v, N, 2);
    for (int i = 0; i < N; i++)
        d[i] = (u[i] - 0.5) * exp2(floor(v[i] * 40) - 20);
    ck_assert(amx_numpy_sum_f64(d, 5) == 0x1.16705ca3bdb00p+9);
    ck_assert(amx_numpy_sum_f64(d, 128) == -0x1.15ec5c5260ef5p+19);
    ck_assert(amx_numpy_sum_f64(d, 2000) == -0x1.a13c05187aa48p+19);
}
END_TEST

START_TEST(linspace_as_torch)
{
    float c[39];
    amx_torch_linspace_f32(0.25f, 4.0f, 39, 1, c);
    /* torch.linspace(0.25, 4.0, 39) on the CPU (FMA-contracted). */
    ck_assert_uint_eq(bits(c[0]), 0x3e800000u);
    ck_assert_uint_eq(bits(c[1]), 0x3eb286bdu);
    ck_assert_uint_eq(bits(c[18]), 0x4001af29u);
    ck_assert_uint_eq(bits(c[19]), 0x40080000u);
    ck_assert_uint_eq(bits(c[20]), 0x400e50d7u);
    ck_assert_uint_eq(bits(c[37]), 0x4079af28u);
    ck_assert_uint_eq(bits(c[38]), 0x40800000u);
    /* Edges: 0 and g exactly at both ends; a single step is start. */
    float e[2049];
    amx_hist_edges(4.731958f, 2048, AMX_TORCH_AVX512, e);
    ck_assert_float_eq(e[0], 0.0f);
    ck_assert_float_eq(e[2048], 4.731958f);
    for (int i = 1; i <= 2048; i++)
        ck_assert(e[i] >= e[i - 1]);
    float one;
    amx_torch_linspace_f32(0.5f, 9.0f, 1, 1, &one);
    ck_assert_float_eq(one, 0.5f);
    /* Without FMA the upper half differs somewhere (two roundings). */
    float a[2049], b[2049];
    amx_torch_linspace_f32(0.0f, 6.1399936e-07f, 2048, 1, a);
    amx_torch_linspace_f32(0.0f, 6.1399936e-07f, 2048, 0, b);
    int differ = 0;
    for (int i = 0; i < 2048; i++)
        differ += a[i] != b[i];
    ck_assert_int_gt(differ, 0);
}
END_TEST

/* The histogram of the generating script: floor(1000 u) where v < 0.7. */
static void test_hist(double *h, float *e)
{
    double u[64], v[64];
    lcg(u, 64, 1);
    lcg(v, 64, 2);
    for (int i = 0; i < 64; i++)
        h[i] = v[i] < 0.7 ? floor(u[i] * 1000) : 0.0;
    amx_hist_edges(3.5f, 64, AMX_TORCH_AVX512, e);
}

START_TEST(methods_match_modelopt)
{
    double h[64];
    float e[65];
    test_hist(h, e);
    ck_assert_double_eq(h[2], 648.0);
    ck_assert_double_eq(h[63], 841.0);
    static char scratch[1 << 16];
    /* _compute_amax_entropy(h, e, 8, False, 1, 8), (4, True, 3, 5). */
    ck_assert_uint_eq(bits(amx_hist_entropy(h, 64, e, 8, 0, 1, 8, scratch)), 0x40600000u);
    ck_assert_uint_eq(bits(amx_hist_entropy(h, 64, e, 4, 1, 3, 5, scratch)), 0x40590000u);
    /* _compute_amax_mse with the call repaired (docs/NUMERICS.md):
     * (8, False, 1, 4), (4, True, 2, 0), ((4, 3), False, 1, 4). */
    ck_assert_uint_eq(
        bits(amx_hist_mse(h, 64, e, AMX_GRID_INT, 8, 0, 1, 4, AMX_TORCH_AVX512, scratch)),
        0x405e4000u);
    ck_assert_uint_eq(
        bits(amx_hist_mse(h, 64, e, AMX_GRID_INT, 4, 1, 2, 0, AMX_TORCH_AVX512, scratch)),
        0x405ac000u);
    ck_assert_uint_eq(
        bits(amx_hist_mse(h, 64, e, AMX_GRID_E4M3, 0, 0, 1, 4, AMX_TORCH_AVX512, scratch)),
        0x405e4000u);
    /* _compute_amax_percentile(h, e, 99.0). */
    ck_assert_uint_eq(bits(amx_hist_percentile(h, 64, e, 99.0)), 0x405c8000u);
}
END_TEST

START_TEST(percentile_edges)
{
    double h[16] = {0};
    float e[17];
    amx_hist_edges(8.0f, 16, AMX_TORCH_AVX2, e);
    h[5] = 1000;
    /* All mass in bin 5: cdf is 0 before it, 1 from it on. */
    ck_assert_float_eq(amx_hist_percentile(h, 16, e, 0.0), 0.0f);
    ck_assert_float_eq(amx_hist_percentile(h, 16, e, 50.0), e[5]);
    ck_assert_float_eq(amx_hist_percentile(h, 16, e, 100.0), e[5]);
    /* Empty histogram: 0/0 is NaN everywhere; searchsorted stops at 0. */
    memset(h, 0, sizeof(h));
    ck_assert_float_eq(amx_hist_percentile(h, 16, e, 99.99), 0.0f);
    /* A cdf that rounds below 1 at the end: index num_bins, the top edge. */
    for (int i = 0; i < 16; i++)
        h[i] = 3;
    float top = amx_hist_percentile(h, 16, e, 100.0);
    ck_assert(top == e[15] || top == e[16]);
}
END_TEST

START_TEST(hist_amax_dispatch)
{
    amx_calib_t c;
    memset(&c, 0, sizeof(c));
    c.kind = AMX_CAL_HISTOGRAM;
    c.method = AMX_HM_PERCENTILE;
    c.num_bins = 64;
    c.percentile = 99.0;
    c.torch_cpu = AMX_TORCH_AVX512;
    double h[65];
    float e[65];
    test_hist(h, e);
    h[64] = 0; /* the overflow count is not a bin */
    static char scratch[1 << 16];
    ck_assert_uint_eq(bits(amx_hist_amax(&c, h, 3.5f, scratch)), 0x405c8000u);
    /* A range of 0: every edge is 0. */
    ck_assert_float_eq(amx_hist_amax(&c, h, 0.0f, scratch), 0.0f);
    ck_assert_uint_eq(amx_calib_stat_values(&c, 1), 65);
}
END_TEST

START_TEST(mse_search)
{
    ck_assert_uint_eq(amx_mse_nsteps(0.25, 4.0, 0.1), 39);
    ck_assert_uint_eq(amx_mse_nsteps(1.0, 1.0, 0.1), 1);
    ck_assert_uint_eq(amx_mse_nsteps(0.25, 4.0, 0.0), 0);
    ck_assert_uint_eq(amx_mse_nsteps(4.0, 0.25, 0.1), 0);
    ck_assert_uint_eq(amx_mse_nsteps(0.0, 1e9, 1e-3), 0); /* too many */
    double l[5] = {3.0, 1.0, 2.0, 1.0, 0.5};
    ck_assert_uint_eq(amx_mse_argmin(l, 5), 4);
    l[4] = 1.0;
    ck_assert_uint_eq(amx_mse_argmin(l, 5), 1); /* ties: the first, as torch.argmin */
}
END_TEST

START_TEST(nvfp4_candidates)
{
    float c[AMX_NVFP4_MSE_STEPS];
    amx_nvfp4_mse_candidates(c);
    /* The first subnormal, the first normal, the largest: bytes 1, 8, 126
     * of E4M3 over 448 (fp8_scale_candidates). */
    ck_assert_float_eq(c[0], ldexpf(1.0f, -9) / 448.0f);
    ck_assert_float_eq(c[7], ldexpf(1.0f, -6) / 448.0f);
    ck_assert_float_eq(c[AMX_NVFP4_MSE_STEPS - 1], 1.0f);
    for (uint32_t k = 1; k < AMX_NVFP4_MSE_STEPS; k++)
        ck_assert_float_lt(c[k - 1], c[k]);
    const float gs[] = {3.0f, 0.3f, 1e-30f, 448.0f * 7.0f, 2.0e38f};
    for (size_t t = 0; t < sizeof(gs) / sizeof(gs[0]); t++) {
        float g = gs[t];
        for (uint32_t k = 0; k < AMX_NVFP4_MSE_STEPS; k++) {
            float a = g * c[k];
            int i = amx_nvfp4_mse_index(c, g, a);
            ck_assert_int_ge(i, 0);
            ck_assert_float_eq(g * c[i], a); /* the first of equal products */
            ck_assert_int_le(i, (int)k);
            ck_assert_int_eq(amx_nvfp4_mse_index(c, g, nextafter((double)a, INFINITY)), -1);
        }
        ck_assert_int_eq(amx_nvfp4_mse_index(c, g, (double)g * 1.5), -1);
        ck_assert_int_eq(amx_nvfp4_mse_index(c, g, -(double)(g * c[3])), -1);
        ck_assert_int_eq(amx_nvfp4_mse_index(c, g, NAN), -1);
    }
    /* g = 0: every candidate is 0; 0 is the first. */
    ck_assert_int_eq(amx_nvfp4_mse_index(c, 0.0f, 0.0), 0);
    ck_assert_int_eq(amx_nvfp4_mse_index(c, 0.0f, 1e-45), -1);
}
END_TEST

/* ---- specs ---- */

static amx_qspec_in_t base_in(const uint32_t *shape, size_t ndim)
{
    amx_qspec_in_t in;
    memset(&in, 0, sizeof(in));
    in.name = "q";
    in.global_shape = shape;
    in.ndim = ndim;
    in.recipe.present = 1;
    in.recipe.format = 1;
    in.peer_group = in.scale_group = "";
    return in;
}

static amx_status_t parse(const amx_qspec_in_t *in, amx_qspec_t *out, amx_err_t *err)
{
    amx_err_clear(err);
    return amx_qspec_parse(in, 1u << 30, out, err);
}

START_TEST(spec_validation)
{
    amx_qspec_t s;
    amx_err_t err;
    amx_qspec_in_t in = base_in(NULL, 0);
    in.calib.present = 1;
    in.calib.kind = AMX_CAL_HISTOGRAM;
    in.calib.num_bins = 2048;
    in.calib.method = AMX_HM_PERCENTILE;
    in.calib.percentile = 99.99;
    ck_assert_int_eq(parse(&in, &s, &err), AMX_OK);
    ck_assert_int_eq(s.calib.torch_cpu, AMX_TORCH_AVX2); /* the default */
    ck_assert_uint_eq(amx_qspec_stat_values(&s), 2049);
    ck_assert_uint_eq(amx_qspec_stat_cells(&s), 1);
    ck_assert_int_eq(amx_qspec_check_calib(&s), AMX_OK);
    /* Fields of other methods are refused. */
    amx_qspec_in_t bad = in;
    bad.calib.start_bin = 128;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "PERCENTILE takes percentile only"));
    bad = in;
    bad.calib.percentile = 100.5;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = in;
    bad.calib.num_bins = 0;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad.calib.num_bins = AMX_HIST_MAX_BINS + 1;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    /* Per-tensor only; RUNNING_MAX only; no groups. */
    uint32_t four = 4;
    bad = in;
    bad.global_shape = &four;
    bad.ndim = 1;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "global_shape []"));
    bad = in;
    bad.accumulation = AMX_ACC_PER_EPOCH;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = in;
    bad.scale_group = "qkv";
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    /* Entropy: num_bits, start_bin >= 1, stride >= 1. */
    amx_qspec_in_t ent = in;
    ent.calib.method = AMX_HM_ENTROPY;
    ent.calib.percentile = 0;
    ent.calib.num_bits = 8;
    ent.calib.start_bin = 128;
    ent.calib.stride = 1;
    ck_assert_int_eq(parse(&ent, &s, &err), AMX_OK);
    ck_assert_int_eq(amx_qspec_check_calib(&s), AMX_OK);
    bad = ent;
    bad.calib.start_bin = 0;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = ent;
    bad.calib.grid = AMX_GRID_E4M3;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    /* Histogram MSE on the E4M3 grid: no num_bits. */
    amx_qspec_in_t hm = ent;
    hm.calib.method = AMX_HM_MSE;
    hm.calib.grid = AMX_GRID_E4M3;
    hm.calib.num_bits = 0;
    ck_assert_int_eq(parse(&hm, &s, &err), AMX_OK);
    hm.calib.num_bits = 8;
    ck_assert_int_eq(parse(&hm, &s, &err), AMX_EINVAL);
    /* MSE search: any shape, (K + 1) values a cell. */
    uint32_t sh[2] = {3, 5};
    amx_qspec_in_t m = base_in(sh, 2);
    m.calib.present = 1;
    m.calib.kind = AMX_CAL_MSE;
    m.calib.start_mult = 0.25;
    m.calib.stop_mult = 4.0;
    m.calib.step_size = 0.1;
    ck_assert_int_eq(parse(&m, &s, &err), AMX_OK);
    ck_assert_uint_eq(s.calib.nsteps, 39);
    ck_assert_uint_eq(amx_qspec_stat_values(&s), 40 * 15);
    ck_assert_uint_eq(amx_qspec_stat_cells(&s), 15);
    bad = m;
    bad.calib.num_bins = 8;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = m;
    bad.calib.step_size = -1;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    /* Max with calibrator fields set. */
    bad = m;
    bad.calib.kind = AMX_CAL_MAX;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad.calib.kind = 7;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    /* NVFP4 per-block search: NVFP4 blocks, (amax, amax^2, count) a cell,
     * no options; a scale group is allowed, a peer group is not. */
    amx_qspec_in_t f = base_in(sh, 2);
    f.recipe.format = AMX_FMT_NVFP4;
    f.calib.present = 1;
    f.calib.kind = AMX_CAL_NVFP4_MSE;
    f.scale_group = "qkv";
    ck_assert_int_eq(parse(&f, &s, &err), AMX_OK);
    ck_assert_uint_eq(s.calib.nsteps, AMX_NVFP4_MSE_STEPS);
    ck_assert_uint_eq(amx_qspec_stat_values(&s), 3 * 15);
    ck_assert_uint_eq(amx_qspec_stat_cells(&s), 15);
    ck_assert_int_eq(amx_qspec_check_calib(&s), AMX_OK);
    bad = f;
    bad.recipe.format = 1;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "needs format NVFP4"));
    bad = f;
    bad.ndim = 0;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = f;
    bad.calib.torch_cpu = 1;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = f;
    bad.peer_group = "p";
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = f;
    bad.global_axes = 1;
    bad.scale_group = "";
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
    bad = f;
    bad.accumulation = AMX_ACC_PER_EPOCH;
    ck_assert_int_eq(parse(&bad, &s, &err), AMX_EINVAL);
}
END_TEST

START_TEST(spec_equality_and_hash)
{
    amx_qspec_t a, b;
    amx_err_t err;
    amx_qspec_in_t in = base_in(NULL, 0);
    ck_assert_int_eq(parse(&in, &a, &err), AMX_OK);
    /* A max quantizer hashes as before calibrators existed: the calibrator
     * is not hashed when it is the max. */
    amx_qspec_t *pa = &a;
    uint64_t h_max = amx_catalog_hash(&pa, 1);
    in.calib.present = 1; /* an explicit CALIBRATOR_MAX message: the same spec */
    ck_assert_int_eq(parse(&in, &b, &err), AMX_OK);
    ck_assert(amx_qspec_equal(&a, &b));
    in.calib.kind = AMX_CAL_HISTOGRAM;
    in.calib.num_bins = 128;
    in.calib.method = AMX_HM_PERCENTILE;
    in.calib.percentile = 50;
    ck_assert_int_eq(parse(&in, &b, &err), AMX_OK);
    ck_assert(!amx_qspec_equal(&a, &b));
    amx_qspec_t *pb = &b;
    ck_assert_uint_ne(amx_catalog_hash(&pb, 1), h_max);
    char diff[512];
    amx_qspec_diff(&a, &b, diff, sizeof(diff));
    ck_assert_ptr_nonnull(strstr(diff, "calibrator (max"));
    /* A normalized calibrator that lost a field is refused as stored state. */
    b.calib.percentile = -1;
    ck_assert_int_eq(amx_qspec_check_calib(&b), AMX_EINVAL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("calib");
    TCase *tc = tcase_create("calib");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, torch_sum_matches_torch);
    tcase_add_test(tc, numpy_sum_matches_numpy);
    tcase_add_test(tc, linspace_as_torch);
    tcase_add_test(tc, methods_match_modelopt);
    tcase_add_test(tc, percentile_edges);
    tcase_add_test(tc, hist_amax_dispatch);
    tcase_add_test(tc, mse_search);
    tcase_add_test(tc, nvfp4_candidates);
    tcase_add_test(tc, spec_validation);
    tcase_add_test(tc, spec_equality_and_hash);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? 0 : 1;
}
