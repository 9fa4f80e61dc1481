/* test_recipe.c - scale arithmetic: conformance vectors and properties. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "postproc.h"
#include "state.h"

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
    else if (!strcmp(kind, "fp8_block_bf16"))
        *out = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_BF16, x, AMX_E4M3_MAX, 0, p));
    else if (!strcmp(kind, "fp8_block_bf16_pow2"))
        *out = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_BF16, x, AMX_E4M3_MAX, 1, p));
    else if (!strcmp(kind, "fp8_block_fp16"))
        *out = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_FP16, x, AMX_E4M3_MAX, 0, p));
    else if (!strcmp(kind, "fp8_block_fp16_pow2"))
        *out = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_FP16, x, AMX_E4M3_MAX, 1, p));
    else if (!strcmp(kind, "fp8_block_fp16_e5m2"))
        *out = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_FP16, x, AMX_E5M2_MAX, 0, p));
    else if (!strcmp(kind, "fp8_delayed"))
        *out = amx_f2u(amx_fp8_delayed_scale(x, AMX_E4M3_MAX, p));
    else if (!strcmp(kind, "fp8_delayed_margin1"))
        *out = amx_f2u(amx_fp8_delayed_scale(x, AMX_E4M3_MAX * powf(2.0f, -1.0f), p));
    else if (!strcmp(kind, "nvfp4_global"))
        *out = amx_f2u(amx_nvfp4_global_encode(x));
    else if (!strcmp(kind, "nvfp4_global_partial_cast"))
        *out = amx_f2u(amx_nvfp4_global_encode_partial_cast(x));
    else if (!strcmp(kind, "nvfp4_partial_cast"))
        *out = amx_nvfp4_block(AMX_NVFP4_TE_PARTIAL_CAST, x, p,
                               amx_nvfp4_global_encode_partial_cast(p));
    else if (!strcmp(kind, "nvfp4_enc_partial_cast"))
        *out = amx_f2u(amx_nvfp4_partial_cast_encode(
            amx_e4m3_to_float(amx_nvfp4_block(AMX_NVFP4_TE_PARTIAL_CAST, x, p,
                                              amx_nvfp4_global_encode_partial_cast(p))),
            amx_nvfp4_global_encode_partial_cast(p)));
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
    else if (!strcmp(kind, "e8m0_enc_te_legacy"))
        *out = amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE_LEGACY, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_dec_te_legacy"))
        *out = amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE_LEGACY, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_enc_te_2_18"))
        *out = amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE_2_18, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_dec_te_2_18"))
        *out = amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE_2_18, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_enc_modelopt"))
        *out = amx_f2u(amx_e8m0_encode_conv(AMX_MX_MODELOPT, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "e8m0_dec_modelopt"))
        *out = amx_f2u(amx_e8m0_decode_conv(AMX_MX_MODELOPT, (uint8_t)amx_f2u(x)));
    else if (!strcmp(kind, "mxfp8"))
        *out = amx_mxfp8_e8m0(x);
    else if (!strcmp(kind, "mxfp8_modelopt"))
        *out = amx_mxfp8_e8m0_modelopt(x);
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
        for (int mx = AMX_MX_TE; mx <= AMX_MX_TE_2_18; mx++) {
            uint8_t e = amx_mxfp8_e8m0_conv(mx, a);
            ck_assert_uint_lt(e, 0xfe);
            float es = amx_e8m0_encode_conv(mx, e), ds = amx_e8m0_decode_conv(mx, e);
            ck_assert(isfinite(es) && isfinite(ds));
            /* Only TE <= 2.18 read byte 0 as the scale 0.0; current TE, OCP
             * and ModelOpt give a non-zero scale for every byte. */
            if (mx == AMX_MX_TE || mx == AMX_MX_OCP || mx == AMX_MX_MODELOPT)
                ck_assert(es > 0 && ds > 0);
        }
    }
}
END_TEST

/* ModelOpt's E8M0 with the float32 log2 computed in double and rounded once
 * to float (the correctly rounded float32 log2 for every q here: the
 * decisive distance, below, is far above double's error). */
static uint8_t e8m0_modelopt_via_log2(float amax)
{
    float q = amax / 448.0f;
    float l = q > 0.0f ? (float)log2((double)q) : -127.0f;
    float e = ceilf(l);
    e = e < -127.0f ? -127.0f : e > 127.0f ? 127.0f : e;
    return (uint8_t)(int)(e + 127.0f);
}

/*
 * amx_log2_to_k_max's table, derived again: the float32 log2 of
 * (1 + j 2^-23) 2^k is k while log2(1 + j 2^-23) < h, half the gap from k
 * to the next float above it; j < (2^h - 1) 2^23 = expm1(h ln 2) 2^23, never
 * within 0.09 of an integer.
 */
START_TEST(mxfp8_modelopt_log2_table)
{
    for (int k = -126; k <= 127; k++) {
        double h = ((double)nextafterf((float)k, INFINITY) - (double)k) / 2.0;
        double bound = expm1(h * log(2.0)) * 8388608.0;
        ck_assert_msg(bound < 0.05 || fabs(bound - rint(bound)) > 0.05, "k %d: bound %.6f", k,
                      bound);
        ck_assert_msg(amx_log2_to_k_max(k) == (uint32_t)floor(bound), "k %d: table %u, bound %.6f",
                      k, amx_log2_to_k_max(k), bound);
    }
}
END_TEST

/*
 * amx_mxfp8_e8m0_modelopt against ModelOpt's formula with a correctly
 * rounded float32 log2: every float32 within 2^14 bit patterns of each
 * 448 * 2^k and of each 2^k (where the float32 quotient crosses a power of
 * two), every amax below 2^-100 step 7 (subnormal quotients), and random
 * bit patterns. (tests/modelopt/exhaustive_mxfp8.py checks all 2^31 against
 * ModelOpt itself.) Mismatches are counted, not asserted one by one (a
 * Check assertion costs a system call).
 */
static long e8m0_modelopt_bad;

static void e8m0_modelopt_check(uint32_t u)
{
    float a = bits(u);
    uint8_t got = amx_mxfp8_e8m0_modelopt(a), want = e8m0_modelopt_via_log2(a);
    if (got != want && e8m0_modelopt_bad++ < 10)
        fprintf(stderr, "amax 0x%08x: %u, log2 rule %u\n", (unsigned)u, got, want);
}

START_TEST(mxfp8_modelopt_is_ceil_log2)
{
    long n = 0;
    for (int k = -160; k <= 128; k++) {
        for (int which = 0; which < 2; which++) {
            double c = which ? ldexp(1.0, k) : ldexp(448.0, k);
            if (c < ldexp(1.0, -149) || c >= ldexp(1.0, 128))
                continue;
            uint32_t b = amx_f2u((float)c);
            for (int64_t d = -16384; d <= 16384; d++) {
                int64_t u = (int64_t)b + d;
                if (u < 0 || u >= 0x7f800000)
                    continue;
                e8m0_modelopt_check((uint32_t)u);
                n++;
            }
        }
    }
    for (uint32_t u = 0; u < amx_f2u(0x1p-100f); u += 7, n++)
        e8m0_modelopt_check(u);
    srand(11);
    for (int i = 0; i < 2000000; i++, n++)
        e8m0_modelopt_check(((uint32_t)rand() << 16 ^ (uint32_t)rand()) % 0x7f800000u);
    ck_assert_msg(e8m0_modelopt_bad == 0, "%ld of %ld differ", e8m0_modelopt_bad, n);
    ck_assert_int_gt(n, 10000000);
    /* The example of docs/NUMERICS.md: TE rounds up, ModelOpt's log2 is -14. */
    ck_assert_uint_eq(amx_mxfp8_e8m0(bits(0x3ce00001u)), 114);
    ck_assert_uint_eq(amx_mxfp8_e8m0_modelopt(bits(0x3ce00001u)), 113);
}
END_TEST

/*
 * The MXFP8 scales of every convention against its peer's functions,
 * transcribed here line for line (with __int_as_float as a bit copy) from
 * the source named on each, for every E8M0 byte. TE's functions give NaN
 * for byte 255 and so does `te`; OCP and ModelOpt are compared on the bytes
 * a finite amax can produce (0..254).
 */
static float i2f(int32_t i)
{
    float f;
    memcpy(&f, &i, 4);
    return f;
}

/* TransformerEngine main d0067d0da6cb (2026-08-22, build_tools/VERSION.txt
 * 2.20.0.dev0) and release_v2.19 b44757633 (2.19.0),
 * transformer_engine/common/util/ptx.cuh: exp2f_rcp<float> (unchanged since
 * 71971e33dc01, #2647, 2026-02-05) and exp2f (since 4ff5fdfed0c1, #3262,
 * 2026-08-05). */
static float te_main_exp2f_rcp(uint8_t biased_exp)
{
    if (biased_exp == 255)
        return i2f(0x7fffffff);
    if (biased_exp == 254)
        return i2f(0x00400000);
    return i2f((254 - biased_exp) << 23);
}

static float te_main_exp2f(uint8_t biased_exp)
{
    if (biased_exp == 255)
        return i2f(0x7fffffff);
    if (biased_exp == 0)
        return i2f(0x00400000);
    return i2f(biased_exp << 23);
}

/* TransformerEngine v2.12 (5671fd367590, 2026-01-27) util/ptx.cuh: exp2f_rcp
 * before #2647 and exp2f before #3262 (the latter also in v2.13..v2.18, e.g.
 * v2.18 27486e03cfc1, whose exp2f_rcp<float> is te_main_exp2f_rcp). */
static float te_2_12_exp2f_rcp(uint8_t biased_exp)
{
    /* (254 - 255) << 23 is -1 << 23, undefined in C (UBSan stops here) and
     * 0xff800000 on the device: shift the two's complement bits instead. */
    return (biased_exp == 0) ? 1 : i2f((int32_t)((uint32_t)(254 - biased_exp) << 23));
}

static float te_2_18_exp2f(uint8_t biased_exp)
{
    return i2f(biased_exp << 23);
}

/* ModelOpt 0.47.0 modelopt/torch/quantization/qtensor/mxfp8_tensor.py:
 * MXFP8QTensor.quantize_with_scale torch.exp2(127 - e) and dequantize
 * torch.exp2(e - 127) in float32: exact powers of two (2^-127 a float32
 * subnormal); the OCP MX scale X = 2^(e-127) is the same. */
static float pow2(int k)
{
    return (float)ldexp(1.0, k);
}

START_TEST(mxfp8_scales_match_peer_sources)
{
    struct {
        int conv;
        float (*enc)(uint8_t);
        float (*dec)(uint8_t);
        int last;
    } peers[] = {
        {AMX_MX_TE, te_main_exp2f_rcp, te_main_exp2f, 255},
        {AMX_MX_TE_2_18, te_main_exp2f_rcp, te_2_18_exp2f, 255},
        {AMX_MX_TE_LEGACY, te_2_12_exp2f_rcp, te_2_18_exp2f, 255},
        {AMX_MX_OCP, NULL, NULL, 254},
        {AMX_MX_MODELOPT, NULL, NULL, 254},
    };
    int bad = 0;
    for (size_t p = 0; p < sizeof(peers) / sizeof(peers[0]); p++) {
        for (int e = 0; e <= peers[p].last; e++) {
            float we = peers[p].enc ? peers[p].enc((uint8_t)e) : pow2(127 - e);
            float wd = peers[p].dec ? peers[p].dec((uint8_t)e) : pow2(e - 127);
            uint32_t ge = amx_f2u(amx_e8m0_encode_conv(peers[p].conv, (uint8_t)e));
            uint32_t gd = amx_f2u(amx_e8m0_decode_conv(peers[p].conv, (uint8_t)e));
            if (ge != amx_f2u(we) || gd != amx_f2u(wd)) {
                bad++;
                fprintf(stderr, "convention %d byte %d: 0x%08x/0x%08x, peer 0x%08x/0x%08x\n",
                        peers[p].conv, e, ge, gd, amx_f2u(we), amx_f2u(wd));
            }
        }
    }
    ck_assert_int_eq(bad, 0);
    /* The bytes that tell the TE conventions apart. */
    ck_assert_uint_eq(amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE, 0)), 0x7f000000u);
    ck_assert_uint_eq(amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE, 0)), 0x00400000u);
    ck_assert_uint_eq(amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE, 254)), 0x00400000u);
    ck_assert_uint_eq(amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE_2_18, 0)), 0u);
    ck_assert_uint_eq(amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE_LEGACY, 0)), 0x3f800000u);
    ck_assert_uint_eq(amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE_LEGACY, 254)), 0u);
}
END_TEST

/* TransformerEngine main d0067d0da6cb
 * transformer_engine/common/util/ptx_arch_spec.cuh float_to_e8m0 (moved
 * there from util/ptx.cuh by 4670342ae6c0, #3392, 2026-08-21; the software
 * branch unchanged since TE 2.0), transcribed. */
static uint8_t te_float_to_e8m0(float val)
{
    if (isnan(val))
        return 0xFF;
    if (isinf(val))
        return 0xFE;
    if (val == 0.0f)
        return 0x00;
    uint32_t val_u32 = amx_f2u(val);
    uint8_t exponent = (uint8_t)(val_u32 >> 23);
    uint32_t mantissa = val_u32 & 0x7FFFFF;
    if ((mantissa > 0 && exponent != 0xFE) && !(exponent == 0 && mantissa <= 0x400000))
        ++exponent;
    return exponent;
}

/* Every TE convention's byte is TE's float_to_e8m0(amax *
 * Quantized_Limits<fp8e4m3>::max_norm_rcp) (cast/mxfp8/quantize_mxfp8.cuh);
 * every amax below 2^-100 step 7 (the bytes 0 and 1 region), and a stride
 * over all the others, inf and NaN included. */
START_TEST(mxfp8_byte_matches_te_float_to_e8m0)
{
    const float rcp =
        (float)(1.0 / 448.0); /* static constexpr float max_norm_rcp = 1.0 / max_norm */
    long n = 0, bad = 0;
    for (uint64_t u = 0; u <= 0xffffffffull; u += (u < 0x0d800000u ? 7 : 997), n++) {
        float a = bits((uint32_t)u);
        uint8_t want = te_float_to_e8m0(a * rcp);
        if (amx_e8m0_from_float(a * rcp) != want)
            bad++;
        if (!isnan(a) && a >= 0 && a < INFINITY)
            for (int mx = AMX_MX_TE; mx <= AMX_MX_TE_2_18; mx++)
                if (mx != AMX_MX_MODELOPT && amx_mxfp8_e8m0_conv(mx, a) != want)
                    bad++;
    }
    ck_assert_msg(bad == 0, "%ld of %ld differ", bad, n);
}
END_TEST

/*
 * TransformerEngine main d0067d0da6cb (2026-08-22, 2.20.0.dev0),
 * transformer_engine/common/recipe/recipe_common.cuh, compute_scale_from_amax
 * (unchanged since 1bbeab1c563e, #1513, 2025-04-03), transcribed; __fdiv_rn
 * is the IEEE division.
 */
static float te_compute_scale_from_amax(float amax, float max_fp8, int force_pow_2_scales,
                                        float epsilon, float value_for_inf)
{
    if (amax < epsilon)
        amax = epsilon;
    float scale = 1.f;
    if (isinf(amax) || amax == 0.f || isnan(amax))
        return scale;
    scale = max_fp8 / amax;
    if (isinf(scale))
        scale = value_for_inf;
    if (force_pow_2_scales) {
        uint32_t scale_bits = amx_f2u(scale);
        scale_bits &= 0xFF800000;
        scale = amx_u2f(scale_bits);
    }
    return scale;
}

/* Its callers: multi_tensor/compute_scale.cu ComputeScaleAndScaleInvFunctor
 * (TE's master-weight cast of current and block scaling) passes
 * std::numeric_limits<float>::max() and writes scale_inv with
 * reciprocal<float> = __frcp_rn; compute_scale_from_types<IType, OType>
 * (the block quantizer kernels quantize_transpose_{square,vector}_blockwise.cu,
 * scale_inv = 1.0f / scale) passes TypeExtrema<IType>::max (common/common.h:
 * bf16 0x1.FEp127, fp16 0x1.FFCp15, float FLT_MAX). */
static const float te_value_for_inf[] = {FLT_MAX, 0x1.FEp127f, 0x1.FFCp15f};
static const int te_rule_of_input[] = {AMX_RULE_CURRENT, AMX_RULE_BLOCK_BF16, AMX_RULE_BLOCK_FP16};

/* Edge amaxes: 0, -0, subnormals, around 448/FLT_MAX (where the scale
 * overflows), FLT_MIN, ordinary, FLT_MAX, inf, NaN. */
static const float edge_amax[] = {0.0f,   -0.0f,       1e-45f,      1e-40f, 1e-38f, FLT_MIN,
                                  1e-36f, 1.3166e-36f, 1.3167e-36f, 2e-36f, 1e-30f, 1e-7f,
                                  0.5f,   1.0f,        3.0f,        448.0f, 5e4f,   57344.0f,
                                  1e30f,  FLT_MAX,     INFINITY,    NAN};
static const float edge_eps[] = {0.0f, 1e-45f, 1e-38f, 1e-12f, 0.25f, 1.0f};

static float rnd_float(void);

/* FP8 block scaling through amx_pp_cell / amx_pp_global: every rule gives
 * compute_scale_from_amax with its caller's value_for_inf and scale_inv
 * 1/scale, for both formats, with and without power-of-2 scales and eps. */
START_TEST(fp8_block_rules_match_te_compute_scale_from_amax)
{
    long n = 0, bad = 0, differ_bf16 = 0;
    for (int in = 0; in < 3; in++)
        for (int f = 0; f < 2; f++)
            for (int p2 = 0; p2 < 2; p2++)
                for (size_t e = 0; e < sizeof(edge_eps) / sizeof(edge_eps[0]); e++) {
                    amx_recipe_t r;
                    memset(&r, 0, sizeof(r));
                    r.format = f ? AMX_FMT_FP8_E5M2 : AMX_FMT_FP8_E4M3;
                    r.rule = (uint8_t)te_rule_of_input[in];
                    r.power_of_2 = (uint8_t)p2;
                    r.eps = edge_eps[e];
                    r.output_convention = AMX_OUT_TE;
                    float m = f ? 57344.0f : 448.0f;
                    for (int i = 0; i < 20000; i++, n++) {
                        size_t ne = sizeof(edge_amax) / sizeof(edge_amax[0]);
                        float a = i < (int)ne ? edge_amax[i] : fabsf(rnd_float());
                        float want =
                            te_compute_scale_from_amax(a, m, p2, r.eps, te_value_for_inf[in]);
                        float s, inv, gs, gsi, prev = 1.0f;
                        uint8_t b = 0xaa;
                        /* amx_pp_cell reads a < 0 and no data as 0; TE's
                         * amax is never negative. */
                        if (isnan(a) || isinf(a) || a < 0)
                            s = amx_fp8_current_scale_rule(r.rule, a, m, p2, r.eps), inv = 1 / s,
                            b = 0;
                        else
                            amx_pp_cell(&r, a, 0.0f, 1.0f, 1.0f, &prev, &s, &inv, &b);
                        if (!isnan(a) && !isinf(a) && a >= 0) {
                            amx_pp_global(&r, a, &prev, &gs, &gsi);
                            bad +=
                                amx_f2u(gs) != amx_f2u(want) || amx_f2u(gsi) != amx_f2u(1 / want);
                        }
                        bad += amx_f2u(s) != amx_f2u(want) ||
                               amx_f2u(inv) != amx_f2u(1.0f / want) || b != 0;
                        if (in == 1 && !p2 &&
                            amx_f2u(want) !=
                                amx_f2u(te_compute_scale_from_amax(a, m, p2, r.eps, FLT_MAX)))
                            differ_bf16++;
                    }
                }
    ck_assert_msg(bad == 0, "%ld of %ld differ", bad, n);
    /* The bf16 rule is not CURRENT: it differs where 448/amax overflows. */
    ck_assert_int_gt(differ_bf16, 0);
    ck_assert_uint_eq(
        amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_BF16, 1e-45f, 448.0f, 0, 0)),
        0x7f7f0000u);
    ck_assert_uint_eq(
        amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_FP16, 1e-45f, 448.0f, 1, 0)),
        0x47000000u); /* 65504 -> 2^15 */
}
END_TEST

/*
 * TransformerEngine main d0067d0da6cb, common/recipe/nvfp4.cu (last changed
 * by 4670342ae6c0, #3392, 2026-08-21; these kernels since a3bc04068, #2691,
 * 2026-03-03), transcribed: nvfp4_compute_global_scale_kernel,
 * nvfp4_fused_scale_kernel (the tile decode scale and its E4M3 byte, which
 * static_cast<fp8e4m3> rounds as cvt.rn.satfinite: amx_e4m3_from_float,
 * checked by the vectors), nvfp4_2d_partial_cast_kernel (the encode scale).
 */
static float te_nvfp4_compute_global_scale(float amax)
{
    const float fp4_max = 6.0f, fp8_max = 448.0f;
    const float flt_max = 3.402823466e+38F, tiny = 1.17549435e-38f; /* FLT_MIN */
    float safe_amax = fmaxf(amax, tiny);
    float scale = (amax > 0.0f) ? fminf((fp8_max * fp4_max) / safe_amax, flt_max) : 1.0f;
    return scale;
}

static float te_nvfp4_fused_scale_val(float amax_val, float g_amax)
{
    const float fp4_max = 6.0f, fp8_max = 448.0f;
    const float flt_max = 3.402823466e+38F, tiny = 1.17549435e-38f;
    float safe_global_amax = fmaxf(g_amax, tiny);
    float global_scale =
        (g_amax > 0.0f) ? fminf((fp8_max * fp4_max) / safe_global_amax, flt_max) : 1.0f;
    const float fp4_max_inv = 1.0f / fp4_max;
    const float global_scale_multiplier = global_scale * fp4_max_inv;
    return fminf(amax_val * global_scale_multiplier, flt_max);
}

static float te_nvfp4_partial_cast_encode(float decode_scale, float global_scale)
{
    float global_encode_scale = global_scale;
    if (global_encode_scale <= 0.f)
        global_encode_scale = 1.f;
    const float global_decode_scale = 1.0f / global_encode_scale;
    float tile_decode_scale = amx_e4m3_to_float(amx_e4m3_from_float(decode_scale));
    const float kFp32Max = 3.402823466e+38F;
    float tile_encode_val =
        (tile_decode_scale > 0.f) ? 1.0f / (tile_decode_scale * global_decode_scale) : kFp32Max;
    return fminf(tile_encode_val, kFp32Max);
}

/* The NVFP4 TE_PARTIAL_CAST convention is TE's partial-cast rule for every
 * tile and global amax, edges, inf and NaN included; through amx_pp_global
 * and amx_pp_cell (what both backends run) for every finite one. It gives
 * the bytes of TRANSFORMER_ENGINE for every finite global amax and differs
 * only at g = inf and NaN. */
START_TEST(nvfp4_partial_cast_matches_te_nvfp4_cu)
{
    amx_recipe_t r;
    memset(&r, 0, sizeof(r));
    r.format = AMX_FMT_NVFP4;
    r.nvfp4_convention = AMX_NVFP4_TE_PARTIAL_CAST;
    r.output_convention = AMX_OUT_TE;
    amx_recipe_t te = r;
    te.nvfp4_convention = AMX_NVFP4_TE;
    size_t ne = sizeof(edge_amax) / sizeof(edge_amax[0]);
    long n = 0, bad = 0, differ_te = 0, finite_differ_te = 0;
    for (int i = 0; i < 400000; i++) {
        float a = i < (int)(ne * ne) ? edge_amax[i % ne] : fabsf(rnd_float());
        float g = i < (int)(ne * ne) ? edge_amax[i / ne] : fabsf(rnd_float());
        if (i >= (int)(ne * ne) && (i & 1) && !isnan(a) && !isnan(g) && g < a)
            g = a; /* a reconciled global is >= its tiles */
        float want_g = te_nvfp4_compute_global_scale(g);
        float want_v = te_nvfp4_fused_scale_val(a, g);
        uint8_t want_b = amx_e4m3_from_float(want_v);
        float want_enc = te_nvfp4_partial_cast_encode(want_v, want_g);
        float s_enc = amx_nvfp4_global_encode_partial_cast(g);
        uint8_t b = amx_nvfp4_block(AMX_NVFP4_TE_PARTIAL_CAST, a, g, s_enc);
        float enc = amx_nvfp4_partial_cast_encode(amx_e4m3_to_float(b), s_enc);
        n++;
        if (amx_f2u(s_enc) != amx_f2u(want_g) || b != want_b || amx_f2u(enc) != amx_f2u(want_enc)) {
            if (bad++ < 5)
                fprintf(stderr, "a %a g %a: S_enc %a/%a byte %02x/%02x enc %a/%a\n", (double)a,
                        (double)g, (double)s_enc, (double)want_g, b, want_b, (double)enc,
                        (double)want_enc);
        }
        /* What the daemon holds: finite, >= 0, -0 read as +0 (TE's amax is
         * a fmaxf over fabs from 0.0f: never -0 either). */
        if (isfinite(g) && isfinite(a) && !signbit(a) && !signbit(g)) {
            float gs, gsi, prev = 1, s, inv, gs_te, gsi_te, s_te, inv_te;
            uint8_t bb, bb_te;
            amx_pp_global(&r, g, &prev, &gs, &gsi);
            amx_pp_cell(&r, a, g, gs, 1.0f / gs, &prev, &s, &inv, &bb);
            if (amx_f2u(gs) != amx_f2u(want_g) || bb != want_b || amx_f2u(s) != amx_f2u(want_enc) ||
                amx_f2u(inv) != amx_f2u(amx_e4m3_to_float(want_b)) ||
                amx_f2u(gsi) != amx_f2u(g * AMX_RCP_2688)) {
                if (bad++ < 5)
                    fprintf(stderr, "pp: a %a g %a: gs %a/%a byte %02x/%02x s %a/%a\n", (double)a,
                            (double)g, (double)gs, (double)want_g, bb, want_b, (double)s,
                            (double)want_enc);
            }
            amx_pp_global(&te, g, &prev, &gs_te, &gsi_te);
            amx_pp_cell(&te, a, g, gs_te, 1.0f / gs_te, &prev, &s_te, &inv_te, &bb_te);
            finite_differ_te += amx_f2u(gs) != amx_f2u(gs_te) || bb != bb_te ||
                                amx_f2u(s) != amx_f2u(s_te) || amx_f2u(inv) != amx_f2u(inv_te) ||
                                amx_f2u(gsi) != amx_f2u(gsi_te);
        } else {
            float s_te = amx_nvfp4_global_encode(g);
            differ_te +=
                amx_f2u(s_te) != amx_f2u(s_enc) || amx_nvfp4_block(AMX_NVFP4_TE, a, g, s_te) != b;
        }
    }
    ck_assert_msg(bad == 0, "%ld of %ld differ from TE's nvfp4.cu", bad, n);
    ck_assert_msg(finite_differ_te == 0, "%ld finite inputs differ from the te convention",
                  finite_differ_te);
    ck_assert_int_gt(differ_te, 0);
    ck_assert_uint_eq(amx_f2u(amx_nvfp4_global_encode_partial_cast(INFINITY)), 0u);
    ck_assert_uint_eq(amx_f2u(amx_nvfp4_global_encode(INFINITY)), 0x3f800000u);
    ck_assert_uint_eq(amx_f2u(amx_nvfp4_global_encode_partial_cast(NAN)), 0x3f800000u);
    ck_assert_uint_eq(amx_f2u(amx_nvfp4_global_encode(NAN)), 0x7f7fffffu);
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

/* The host backend's vector path for FP8 current scaling gives the bytes
 * of the scalar amx_pp_cell (which the CUDA kernel runs) for every input
 * class: no data (-inf), zero, negative, subnormal, eps-clamped, huge,
 * inf, NaN, and 1M random bit patterns; both formats, with and without
 * power-of-2 scales and eps; a length that is not a multiple of 4. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd32(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

/* A random float32 bit pattern (any sign, class and exponent). */
static float rnd_float(void)
{
    return amx_u2f(rnd32());
}

START_TEST(host_vector_fp8_current_matches_scalar)
{
    const size_t n = (1u << 20) + 3;
    float *amax = malloc(n * 4), *s = malloc(n * 4), *inv = malloc(n * 4);
    uint8_t *b = malloc(n);
    ck_assert(amax && s && inv && b);
    static const float edge[] = {-INFINITY, -1.0f,  -0.0f,   0.0f,     1e-45f, 1e-38f,
                                 FLT_MIN,   1e-12f, 1e-7f,   0.5f,     1.0f,   448.0f,
                                 57344.0f,  1e30f,  FLT_MAX, INFINITY, NAN};
    size_t ne = sizeof(edge) / sizeof(edge[0]);
    for (size_t i = 0; i < n; i++) {
        if (i < ne) {
            amax[i] = edge[i];
        } else {
            uint32_t u = rnd32();
            memcpy(&amax[i], &u, 4);
        }
    }
    static const uint8_t fmts[] = {AMX_FMT_FP8_E4M3, AMX_FMT_FP8_E5M2};
    static const float epss[] = {0.0f, 1e-45f, 1e-12f, 0.25f};
    static const uint8_t rules[] = {AMX_RULE_CURRENT, AMX_RULE_BLOCK_BF16, AMX_RULE_BLOCK_FP16};
    int vector = 0;
    for (int f = 0; f < 6; f++)
        for (int p2 = 0; p2 < 2; p2++)
            for (int e = 0; e < 4; e++) {
                amx_recipe_t r;
                memset(&r, 0, sizeof(r));
                r.format = fmts[f % 2];
                r.rule = rules[f / 2];
                r.power_of_2 = (uint8_t)p2;
                r.eps = epss[e];
                memset(b, 0xaa, n);
                vector = amx__host_fp8_current_cells(&r, amax, n, s, inv, b);
                size_t bad = 0, first = 0;
                for (size_t i = 0; i < n; i++) {
                    float s1, i1;
                    uint8_t b1;
                    amx_pp_cell(&r, amax[i], 0.0f, 1.0f, 1.0f, NULL, &s1, &i1, &b1);
                    if (amx_f2u(s[i]) != amx_f2u(s1) || amx_f2u(inv[i]) != amx_f2u(i1) ||
                        b[i] != b1) {
                        if (bad++ == 0)
                            first = i;
                    }
                }
                /* (one check per configuration: Check marks every assertion) */
                ck_assert_msg(bad == 0,
                              "format %d rule %d pow2 %d eps %g: %zu cells differ, the first "
                              "amax %a (0x%08x)",
                              r.format, r.rule, p2, (double)r.eps, bad, (double)amax[first],
                              amx_f2u(amax[first]));
            }
    printf("host FP8 current-scaling cells: %s path checked against amx_pp_cell\n",
           vector ? "SSE2" : "scalar");
    free(amax), free(s), free(inv), free(b);
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
    tcase_add_test(tc, mxfp8_modelopt_log2_table);
    tcase_add_test(tc, mxfp8_modelopt_is_ceil_log2);
    tcase_add_test(tc, mxfp8_scales_match_peer_sources);
    tcase_add_test(tc, mxfp8_byte_matches_te_float_to_e8m0);
    tcase_add_test(tc, host_vector_fp8_current_matches_scalar);
    tcase_add_test(tc, fp8_block_rules_match_te_compute_scale_from_amax);
    tcase_add_test(tc, nvfp4_partial_cast_matches_te_nvfp4_cu);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
