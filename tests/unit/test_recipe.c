/* test_recipe.c - scale arithmetic: conformance vectors and properties. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "postproc.h"

static float bits(uint32_t u)
{
    return amx_u2f(u);
}

/* Evaluates one vector row; returns the result as bits (byte or float). */
static int eval_row(const char *kind, float x, float p, uint32_t *out)
{
    if (!strcmp(kind, "e4m3"))
        *out = amx_e4m3_from_float(x);
    else if (!strcmp(kind, "e8m0"))
        *out = amx_e8m0_from_float(x);
    else if (!strcmp(kind, "fp8_current"))
        *out = amx_f2u(amx_fp8_current_scale(x, AMX_E4M3_MAX, 0, p));
    else if (!strcmp(kind, "fp8_current_pow2"))
        *out = amx_f2u(amx_fp8_current_scale(x, AMX_E4M3_MAX, 1, p));
    else if (!strcmp(kind, "fp8_current_e5m2"))
        *out = amx_f2u(amx_fp8_current_scale(x, AMX_E5M2_MAX, 0, p));
    else if (!strcmp(kind, "fp8_delayed"))
        *out = amx_f2u(amx_fp8_delayed_scale(x, AMX_E4M3_MAX, p));
    else if (!strcmp(kind, "fp8_delayed_margin1"))
        *out = amx_f2u(amx_fp8_delayed_scale(x, AMX_E4M3_MAX * powf(2.0f, -1.0f), p));
    else if (!strcmp(kind, "nvfp4_global"))
        *out = amx_f2u(amx_nvfp4_global_encode(x));
    else if (!strcmp(kind, "nvfp4_te"))
        *out = amx_nvfp4_block_te(x, p);
    else if (!strcmp(kind, "nvfp4_modelopt"))
        *out = amx_nvfp4_block_modelopt(x, p);
    else if (!strcmp(kind, "nvfp4_te_legacy"))
        *out = amx_nvfp4_block_te_legacy(x, p);
    else if (!strcmp(kind, "nvfp4_modelopt_static"))
        *out = amx_nvfp4_block_modelopt_static(x, p);
    else if (!strcmp(kind, "nvfp4_gsi_te"))
        *out = amx_f2u(amx_nvfp4_global_decode(AMX_OUT_TE, x));
    else if (!strcmp(kind, "nvfp4_gsi_modelopt"))
        *out = amx_f2u(amx_nvfp4_global_decode(AMX_OUT_MODELOPT, x));
    else if (!strcmp(kind, "fp8_inv_modelopt"))
        *out = amx_f2u(amx_fp8_scale_inv_modelopt(x, AMX_E4M3_MAX));
    else if (!strcmp(kind, "e8m0_enc_te"))
        *out = amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_dec_te"))
        *out = amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_enc_ocp"))
        *out = amx_f2u(amx_e8m0_encode_conv(AMX_MX_OCP, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_dec_ocp"))
        *out = amx_f2u(amx_e8m0_decode_conv(AMX_MX_OCP, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "mxfp8"))
        *out = amx_mxfp8_e8m0(x);
    else
        return -1;
    return 0;
}

START_TEST(vectors_file)
{
    char path[1024];
    const char *dir = getenv("AMAXD_VECTORS");
    snprintf(path, sizeof(path), "%s/recipes.tsv", dir ? dir : AMX_VECTORS_DIR);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "cannot open %s", path);
    char line[512];
    int rows = 0;
    while (fgets(line, sizeof(line), f)) {
        if (line[0] == '#' || line[0] == '\n')
            continue;
        char kind[64], why[256] = "";
        unsigned x, p, want;
        int n = sscanf(line, "%63[^\t]\t%x\t%x\t%x\t%255[^\n]", kind, &x, &p, &want, why);
        ck_assert_int_ge(n, 4);
        uint32_t got;
        ck_assert_msg(eval_row(kind, bits(x), bits(p), &got) == 0, "unknown kind %s", kind);
        ck_assert_msg(got == want, "%s(0x%08x, 0x%08x) = 0x%x, expected 0x%x (%s)", kind, x, p, got,
                      want, why);
        rows++;
    }
    fclose(f);
    ck_assert_int_ge(rows, 60);
}
END_TEST

START_TEST(e4m3_roundtrip_all_codes)
{
    for (unsigned v = 0; v < 256; v++) {
        float f = amx_e4m3_to_float((uint8_t)v);
        if ((v & 0x7f) == 0x7f) {
            ck_assert(isnan(f));
            continue;
        }
        ck_assert_uint_eq(amx_e4m3_from_float(f), v);
    }
}
END_TEST

START_TEST(e4m3_monotonic)
{
    /* Over a sweep of positive floats, the code never decreases. */
    uint8_t prev = 0;
    for (uint32_t u = 0; u < 0x43f00000u; u += 4099) {
        uint8_t c = amx_e4m3_from_float(bits(u));
        ck_assert_uint_ge(c, prev);
        prev = c;
    }
}
END_TEST

START_TEST(no_recipe_returns_nonfinite)
{
    /* Every accepted amax (finite, >= 0) gives finite scales everywhere. */
    srand(7);
    for (int i = 0; i < 200000; i++) {
        uint32_t u = ((uint32_t)rand() << 16 ^ (uint32_t)rand()) & 0x7f7fffffu;
        float a = bits(u), g = bits(((uint32_t)rand() << 16 ^ (uint32_t)rand()) & 0x7f7fffffu);
        if (g < a)
            g = a;
        ck_assert(isfinite(amx_fp8_current_scale(a, AMX_E4M3_MAX, i & 1, 0.0f)));
        ck_assert(isfinite(amx_fp8_scale_inv(amx_fp8_current_scale(a, AMX_E5M2_MAX, 0, 0.0f))));
        float d = amx_fp8_delayed_scale(a, AMX_E4M3_MAX, 1.0f);
        ck_assert(isfinite(d) && isfinite(amx_fp8_scale_inv(d)));
        float s_enc = amx_nvfp4_global_encode(g);
        ck_assert(isfinite(s_enc) && s_enc > 0);
        uint8_t b = amx_nvfp4_block_te(a, s_enc);
        ck_assert(!isnan(amx_e4m3_to_float(b)));
        ck_assert(isfinite(amx_nvfp4_block_encode(amx_e4m3_to_float(b), 1.0f / s_enc)));
        ck_assert(!isnan(amx_e4m3_to_float(amx_nvfp4_block_modelopt(a, g))));
        ck_assert(!isnan(amx_e4m3_to_float(amx_nvfp4_block_modelopt(a, bits(u & 0x0000ffffu)))));
        ck_assert(!isnan(amx_e4m3_to_float(amx_nvfp4_block_modelopt_static(a, g))));
        ck_assert(!isnan(amx_e4m3_to_float(amx_nvfp4_block_te_legacy(a, s_enc))));
        ck_assert(isfinite(amx_nvfp4_global_decode(AMX_OUT_TE, g)));
        ck_assert(isfinite(amx_nvfp4_global_decode(AMX_OUT_MODELOPT, g)));
        ck_assert(isfinite(amx_fp8_scale_inv_modelopt(a, AMX_E4M3_MAX)));
        uint8_t e = amx_mxfp8_e8m0(a);
        ck_assert_uint_lt(e, 0xfe);
        ck_assert(isfinite(amx_e8m0_encode(e)) && isfinite(amx_e8m0_decode(e)));
        ck_assert(amx_e8m0_encode_conv(AMX_MX_OCP, e) > 0 &&
                  amx_e8m0_decode_conv(AMX_MX_OCP, e) > 0);
    }
}
END_TEST

START_TEST(delayed_keeps_previous_for_nonfinite)
{
    ck_assert_float_eq(amx_fp8_delayed_scale(NAN, 448.0f, 3.0f), 3.0f);
    ck_assert_float_eq(amx_fp8_delayed_scale(INFINITY, 448.0f, 3.0f), 3.0f);
    ck_assert_float_eq(amx_fp8_current_scale(NAN, 448.0f, 0, 0.0f), 1.0f);
    ck_assert_float_eq(amx_fp8_current_scale(INFINITY, 448.0f, 0, 0.0f), 1.0f);
}
END_TEST

START_TEST(modelopt_zero_global_is_one)
{
    ck_assert_uint_eq(amx_nvfp4_block_modelopt(0.0f, 0.0f), 0x38);
    ck_assert_float_eq(amx_nvfp4_global_encode(0.0f), 1.0f);
}
END_TEST

/*
 * One delayed-scaling cell (H = 3, MAX) through amx_pp_accumulate, epochs
 * 2, 0, 4, no data, 1, 1, 1. TE's fused update (delayed_scaling.cu
 * kernel_bulk: `if (last_amax != 0.0f)` around the roll) skips the zero and
 * the empty epoch: windows {2} {2} {2,4} {2,4} {2,4,1} {4,1,1} {1,1,1}.
 * The unfused rule rolls every epoch: {2} {2,0} {2,0,4} {0,4,-} {4,-,1}
 * {-,1,1} {1,1,1}. Scales are 448/amax, or the previous one for 0.
 */
START_TEST(delayed_history_conventions)
{
    static const float in[7] = {2, 0, 4, -INFINITY, 1, 1, 1};
    static const float want_te[7] = {224, 224, 112, 112, 112, 112, 448};
    static const float want_unfused[7] = {224, 224, 112, 112, 112, 448, 448};
    for (int conv = AMX_HISTCONV_TE; conv <= AMX_HISTCONV_TE_UNFUSED; conv++) {
        amx_qdesc_t q;
        memset(&q, 0, sizeof(q));
        q.ncells = 1;
        q.hist_len = 3;
        q.accumulation = AMX_ACC_PER_EPOCH;
        q.recipe.format = AMX_FMT_FP8_E4M3;
        q.recipe.rule = AMX_RULE_DELAYED;
        q.recipe.history_reduce = AMX_HIST_MAX;
        q.recipe.history_convention = (uint8_t)conv;
        q.recipe.history_len = 3;
        float ring[3] = {-INFINITY, -INFINITY, -INFINITY}, accum = -INFINITY, prev = 1.0f;
        for (int e = 0; e < 7; e++) {
            q.hist_head = (uint32_t)(e % 3);
            float a = amx_pp_accumulate(&q, &accum, ring, 0, in[e]);
            float v = a > 0.0f ? a : 0.0f;
            prev = amx_fp8_delayed_scale(v, AMX_E4M3_MAX, prev);
            float want = conv == AMX_HISTCONV_TE ? want_te[e] : want_unfused[e];
            ck_assert_msg(prev == want, "convention %d epoch %d: scale %g, expected %g", conv, e,
                          (double)prev, (double)want);
        }
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("recipe");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, vectors_file);
    tcase_add_test(tc, e4m3_roundtrip_all_codes);
    tcase_add_test(tc, e4m3_monotonic);
    tcase_add_test(tc, no_recipe_returns_nonfinite);
    tcase_add_test(tc, delayed_keeps_previous_for_nonfinite);
    tcase_add_test(tc, modelopt_zero_global_is_one);
    tcase_add_test(tc, delayed_history_conventions);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
