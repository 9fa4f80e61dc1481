/*
 * recipe.h - the scale arithmetic of every recipe, one cell at a time.
 *
 * Header-only so that the host backend (C) and the CUDA kernels compile the
 * very same expressions: the two backends must produce identical bytes, and
 * sharing the source is how that is kept true. Every function here is pure,
 * uses only IEEE-754 single precision operations that are correctly rounded
 * on both sides (+, -, *, /, comparisons, rintf, bit casts), and never
 * returns NaN or infinity for a finite input.
 *
 * Conventions follow TransformerEngine (and ModelOpt for the NVFP4 option);
 * docs/NUMERICS.md gives each formula with its edge cases.
 */
#ifndef AMX_RECIPE_H
#define AMX_RECIPE_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define AMX_HD __host__ __device__ __forceinline__
#else
#define AMX_HD static inline
#endif

/* Values of the wire enums (proto/amaxd/v1/amaxd.proto). */
enum { AMX_FMT_FP8_E4M3 = 1, AMX_FMT_FP8_E5M2 = 2, AMX_FMT_NVFP4 = 3, AMX_FMT_MXFP8 = 4 };
enum { AMX_RULE_CURRENT = 1, AMX_RULE_DELAYED = 2 };
enum { AMX_HIST_MAX = 1, AMX_HIST_MOST_RECENT = 2 };
enum { AMX_NVFP4_TE = 1, AMX_NVFP4_MODELOPT = 2 };
enum { AMX_ACC_RUNNING_MAX = 1, AMX_ACC_PER_EPOCH = 2 };

#define AMX_E4M3_MAX 448.0f
#define AMX_E5M2_MAX 57344.0f
#define AMX_E2M1_MAX 6.0f
#define AMX_NVFP4_GLOBAL 2688.0f /* 6 * 448 */
#define AMX_HISTORY_MAX 1024u

/* A recipe with every default resolved (see amx_recipe_normalize). */
typedef struct amx_recipe {
    uint8_t format;
    uint8_t rule;
    uint8_t history_reduce;
    uint8_t nvfp4_convention;
    uint8_t power_of_2;
    uint8_t pad[3];
    uint32_t history_len;
    float margin;
    float eps;
    /* Derived at registration: fp8_max * 2^-margin (delayed scaling). */
    float scaled_max;
} amx_recipe_t;

AMX_HD uint32_t amx_f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

AMX_HD float amx_u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

AMX_HD int amx_isfinite(float x)
{
    return (amx_f2u(x) & 0x7f800000u) != 0x7f800000u;
}

AMX_HD int amx_isnan(float x)
{
    return (amx_f2u(x) & 0x7fffffffu) > 0x7f800000u;
}

AMX_HD float amx_fmaxf(float a, float b)
{
    return a > b ? a : b;
}

/* The largest finite value of an FP8 format. */
AMX_HD float amx_fp8_max(int format)
{
    return format == AMX_FMT_FP8_E5M2 ? AMX_E5M2_MAX : AMX_E4M3_MAX;
}

/*
 * float32 -> FP8 E4M3 (e4m3fn: no infinities, 0x7f/0xff NaN), rounding to
 * nearest even with saturation to +-448 (the PTX cvt.rn.satfinite rule).
 */
AMX_HD uint8_t amx_e4m3_from_float(float x)
{
    uint32_t u = amx_f2u(x);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (uint8_t)(sign | 0x7fu);
    if (a >= 0x43e00000u) /* |x| >= 448 (and inf): saturate */
        return (uint8_t)(sign | 0x7eu);
    if (a < 0x3c800000u) {
        /* |x| < 2^-6: subnormal E4M3, a multiple of 2^-9. Scaling by 2^9 is
         * exact and rintf rounds to nearest even; 8 is 2^-6, the smallest
         * normal, whose encoding is also 8. */
        float q = rintf(amx_u2f(a) * 512.0f);
        return (uint8_t)(sign | (uint8_t)q);
    }
    uint32_t e = (a >> 23) - 127u + 7u; /* biased E4M3 exponent, 1..15 */
    uint32_t m = (a >> 20) & 7u;
    uint32_t rest = a & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (m & 1u)))
        m++;
    if (m == 8u) {
        m = 0;
        e++;
    }
    return (uint8_t)(sign | (e << 3) | m);
}

/* FP8 E4M3 -> float32, exact. 0x7f/0xff decode to NaN. */
AMX_HD float amx_e4m3_to_float(uint8_t v)
{
    uint32_t sign = (uint32_t)(v & 0x80u) << 24;
    uint32_t e = (v >> 3) & 15u, m = v & 7u;
    if (e == 15u && m == 7u)
        return amx_u2f(sign | 0x7fc00000u);
    float mag = e == 0 ? (float)m * (1.0f / 512.0f) : amx_u2f(((e + 120u) << 23) | (m << 20));
    return amx_u2f(sign | amx_f2u(mag));
}

/*
 * float32 -> E8M0 biased exponent, rounding up (TransformerEngine's
 * float_to_e8m0 for pre-Blackwell GPUs): NaN -> 0xff, inf -> 0xfe,
 * 0 -> 0x00.
 */
AMX_HD uint8_t amx_e8m0_from_float(float val)
{
    if (amx_isnan(val))
        return 0xffu;
    if (!amx_isfinite(val))
        return 0xfeu;
    if (val == 0.0f)
        return 0x00u;
    uint32_t u = amx_f2u(val);
    uint32_t exponent = (u >> 23) & 0xffu;
    uint32_t mantissa = u & 0x7fffffu;
    if ((mantissa > 0 && exponent != 0xfeu) && !(exponent == 0 && mantissa <= 0x400000u))
        exponent++;
    return (uint8_t)exponent;
}

/*
 * FP8 current scaling (TransformerEngine compute_scale_from_amax): amax
 * below eps becomes eps; 0, inf or NaN amax give 1; an overflowing scale
 * becomes FLT_MAX; power_of_2 keeps only sign and exponent.
 */
AMX_HD float amx_fp8_current_scale(float amax, float fp8_max, int power_of_2, float eps)
{
    if (amax < eps)
        amax = eps;
    if (!amx_isfinite(amax) || amax == 0.0f)
        return 1.0f;
    float scale = fp8_max / amax;
    if (!amx_isfinite(scale))
        scale = FLT_MAX;
    if (power_of_2)
        scale = amx_u2f(amx_f2u(scale) & 0xff800000u);
    return scale;
}

/*
 * FP8 delayed scaling (TransformerEngine amax_and_scale_update): with
 * scaled_max = fp8_max * 2^-margin, scale = scaled_max / amax when amax is
 * finite and > 0, else the previous scale; infinity becomes FLT_MAX.
 */
AMX_HD float amx_fp8_delayed_scale(float amax, float scaled_max, float prev_scale)
{
    float scale = (amx_isfinite(amax) && amax > 0.0f) ? scaled_max / amax : prev_scale;
    if (!amx_isfinite(scale))
        scale = FLT_MAX;
    return scale;
}

/* scale_inv of an FP8 scale: 1/scale (scales are never 0 or non-finite). */
AMX_HD float amx_fp8_scale_inv(float scale)
{
    return 1.0f / scale;
}

/*
 * NVFP4 second-level encode scale (TransformerEngine
 * compute_global_encode_scaling_factor_FP4): S_enc = 2688 / global_amax,
 * clamped to FLT_MAX, and 1 when global_amax is 0 or the result is 0.
 */
AMX_HD float amx_nvfp4_global_encode(float global_amax)
{
    float s = AMX_E4M3_MAX * AMX_E2M1_MAX / global_amax;
    s = s < FLT_MAX ? s : FLT_MAX;
    if (global_amax == 0.0f || s == 0.0f)
        return 1.0f;
    return s;
}

/* TE: the E4M3 block decode scale e4m3(min(block_amax / 6 * S_enc, FLT_MAX)). */
AMX_HD uint8_t amx_nvfp4_block_te(float block_amax, float s_enc)
{
    float s_dec_b = block_amax / AMX_E2M1_MAX * s_enc;
    s_dec_b = s_dec_b < FLT_MAX ? s_dec_b : FLT_MAX;
    return amx_e4m3_from_float(s_dec_b);
}

/*
 * ModelOpt: with wsf2 = global_amax / 2688, per_block = block_amax /
 * (6 * wsf2); a zero result becomes 1.0; then clamped to [2^-9, 448] and
 * cast to E4M3. A zero global_amax (all blocks zero) gives 1.0 for every
 * block instead of ModelOpt's 0/0.
 */
AMX_HD uint8_t amx_nvfp4_block_modelopt(float block_amax, float global_amax)
{
    float per_block = 1.0f;
    if (global_amax > 0.0f) {
        float wsf2 = global_amax / AMX_NVFP4_GLOBAL;
        per_block = block_amax / (AMX_E2M1_MAX * wsf2);
        if (per_block == 0.0f)
            per_block = 1.0f;
    }
    if (!(per_block >= 0.001953125f))
        per_block = 0.001953125f; /* 2^-9, the smallest E4M3 subnormal */
    if (per_block > AMX_E4M3_MAX)
        per_block = AMX_E4M3_MAX;
    return amx_e4m3_from_float(per_block);
}

/*
 * NVFP4 block encode scale as TE's quantizer uses it:
 * min(1 / (S_dec_b * S_dec), FLT_MAX) with S_dec = 1 / S_enc (computed once
 * per quantizer by the caller); a zero block gives FLT_MAX.
 */
AMX_HD float amx_nvfp4_block_encode(float s_dec_b, float s_dec)
{
    float r = 1.0f / (s_dec_b * s_dec);
    return r < FLT_MAX ? r : FLT_MAX;
}

/* MXFP8: the E8M0 exponent of amax * (1/448) rounded up (TE). */
AMX_HD uint8_t amx_mxfp8_e8m0(float amax)
{
    return amx_e8m0_from_float(amax * (float)(1.0 / 448.0));
}

/* MXFP8 encode scale from the E8M0 exponent (TE exp2f_rcp): 2^(127-e), 1 for e=0. */
AMX_HD float amx_e8m0_encode(uint8_t e)
{
    return e == 0 ? 1.0f : amx_u2f((uint32_t)(254u - e) << 23);
}

/* MXFP8 decode scale 2^(e-127) as TE builds it (e=0 reads as 0.0: all-zero block). */
AMX_HD float amx_e8m0_decode(uint8_t e)
{
    return amx_u2f((uint32_t)e << 23);
}

#endif
