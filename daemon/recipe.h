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
 * Each formula follows a peer's source (TransformerEngine main, ModelOpt
 * 0.47), with older or other peers' rules kept as named conventions;
 * docs/NUMERICS.md names the file and function of each and its edge cases.
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
/* FP8 scale rules: TE current scaling (compute_scale_from_amax, an
 * overflowing scale becomes FLT_MAX; also FP8 block scaling as TE's
 * master-weight cast computes it), delayed scaling, and TE's FP8
 * block-scaling quantizer kernels on bf16 / fp16 input
 * (compute_scale_from_types<IType, OType>: an overflowing scale becomes
 * the input type's largest value). */
enum {
    AMX_RULE_CURRENT = 1,
    AMX_RULE_DELAYED = 2,
    AMX_RULE_BLOCK_BF16 = 3,
    AMX_RULE_BLOCK_FP16 = 4
};
enum { AMX_HIST_MAX = 1, AMX_HIST_MOST_RECENT = 2 };
/* NVFP4 block rule: current TE, ModelOpt's dynamic (fake-quant and
 * weight-export) path, TE <= 2.13, ModelOpt's static-quantizer export,
 * TE's cast of data-parallel-sharded master weights to NVFP4 2D
 * (recipe/nvfp4.cu; its own global encode scale). */
enum {
    AMX_NVFP4_TE = 1,
    AMX_NVFP4_MODELOPT = 2,
    AMX_NVFP4_TE_LEGACY = 3,
    AMX_NVFP4_MODELOPT_STATIC = 4,
    AMX_NVFP4_TE_PARTIAL_CAST = 5
};
/* Whose dequantization factors (scale_inv, global_scale_inv) an answer carries. */
enum { AMX_OUT_TE = 1, AMX_OUT_MODELOPT = 2 };
/* How an epoch enters a delayed-scaling history: TE's fused update after
 * the amax reduction (the default of TE's PyTorch recipe: an epoch whose
 * amax is 0 leaves the history alone), or TE's unfused per-tensor update
 * (every epoch rolls the window). */
enum { AMX_HISTCONV_TE = 1, AMX_HISTCONV_TE_UNFUSED = 2 };
/* MXFP8: every TE convention takes TE's E8M0 exponent (float_to_e8m0, rounded
 * up) and differs only in the scales of bytes 0 and 254 (docs/NUMERICS.md):
 * TE main (>= 2.19: 2^(127-e) / 2^(e-127) for every byte, byte 0 is 2^-127),
 * OCP MX (the same scales), ModelOpt (ceil of the float32 log2,
 * MXFP8QTensor._compute_e8m0_exponent; scales as OCP), TE <= 2.12 (byte 0
 * encodes 1.0 and decodes 0.0, byte 254 encodes 0.0), TE 2.13-2.18 (byte 0
 * encodes 2^127 but decodes 0.0). */
enum {
    AMX_MX_TE = 1,
    AMX_MX_OCP = 2,
    AMX_MX_MODELOPT = 3,
    AMX_MX_TE_LEGACY = 4,
    AMX_MX_TE_2_18 = 5
};
enum { AMX_ACC_RUNNING_MAX = 1, AMX_ACC_PER_EPOCH = 2 };
/* Peer group modes: fill cells without data with the group's max, or give
 * every cell the group's max (ModelOpt's MoE rule). */
enum { AMX_PEER_FILL = 1, AMX_PEER_SHARE = 2 };

#define AMX_E4M3_MAX 448.0f
#define AMX_E5M2_MAX 57344.0f
#define AMX_E2M1_MAX 6.0f
#define AMX_NVFP4_GLOBAL 2688.0f /* 6 * 448 */
/* The largest finite bfloat16 and float16 values as float32, TE's
 * TypeExtrema<bf16>::max = 0x1.FEp127 and TypeExtrema<fp16>::max =
 * 0x1.FFCp15 (common/common.h). */
#define AMX_BF16_MAX_BITS 0x7f7f0000u
#define AMX_FP16_MAX 65504.0f
#define AMX_HISTORY_MAX 1024u

/* A recipe with every default resolved (see amx_recipe_normalize). */
typedef struct amx_recipe {
    uint8_t format;
    uint8_t rule;
    uint8_t history_reduce;
    uint8_t nvfp4_convention;
    uint8_t power_of_2;
    uint8_t output_convention;  /* AMX_OUT_* */
    uint8_t history_convention; /* AMX_HISTCONV_* (FP8 delayed; else 0) */
    uint8_t mxfp8_convention;   /* AMX_MX_* (MXFP8; else 0) */
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
 * float_to_e8m0, the software branch that GPUs before Blackwell run;
 * Blackwell's branch is the instruction cvt.rp.satfinite.ue8m0x2.f32. In
 * common/util/ptx_arch_spec.cuh since #3392, before in util/ptx.cuh, the
 * same body in every TE 2.x): NaN -> 0xff, inf -> 0xfe, 0 -> 0x00, at most
 * 2^-127 -> 0x00, a finite value above 2^127 saturates at 0xfe.
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
 * TransformerEngine compute_scale_from_amax (common/recipe/recipe_common.cuh):
 * amax below eps becomes eps; 0, inf or NaN amax give 1; scale = fp8_max /
 * amax (__fdiv_rn); a scale that is infinite becomes value_for_inf;
 * power_of_2 then keeps only sign and exponent.
 */
AMX_HD float amx_fp8_scale_from_amax(float amax, float fp8_max, int power_of_2, float eps,
                                     float value_for_inf)
{
    if (amax < eps)
        amax = eps;
    if (!amx_isfinite(amax) || amax == 0.0f)
        return 1.0f;
    float scale = fp8_max / amax;
    if (!amx_isfinite(scale))
        scale = value_for_inf;
    if (power_of_2)
        scale = amx_u2f(amx_f2u(scale) & 0xff800000u);
    return scale;
}

/*
 * FP8 current scaling: compute_scale_from_amax with value_for_inf =
 * FLT_MAX, as current_scaling.cu and multi_tensor_compute_scale_and_scale_inv
 * (TE's master-weight cast of current and block scaling) call it.
 */
AMX_HD float amx_fp8_current_scale(float amax, float fp8_max, int power_of_2, float eps)
{
    return amx_fp8_scale_from_amax(amax, fp8_max, power_of_2, eps, FLT_MAX);
}

/*
 * What an overflowing scale becomes under FP8 rule `rule`: TE's block
 * quantizer kernels call compute_scale_from_types<IType, OType>, whose
 * value_for_inf is TypeExtrema<IType>::max (the input's largest value);
 * everything else FLT_MAX (float32 input, current scaling, the cast path).
 */
AMX_HD float amx_fp8_value_for_inf(int rule)
{
    if (rule == AMX_RULE_BLOCK_BF16)
        return amx_u2f(AMX_BF16_MAX_BITS);
    if (rule == AMX_RULE_BLOCK_FP16)
        return AMX_FP16_MAX;
    return FLT_MAX;
}

/* The current-scaling scale of an FP8 cell under rule `rule` (not DELAYED). */
AMX_HD float amx_fp8_current_scale_rule(int rule, float amax, float fp8_max, int power_of_2,
                                        float eps)
{
    return amx_fp8_scale_from_amax(amax, fp8_max, power_of_2, eps, amx_fp8_value_for_inf(rule));
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

/*
 * NVFP4 second-level encode scale of TE's master-weight cast to NVFP4 2D
 * (common/recipe/nvfp4.cu nvfp4_compute_global_scale_kernel, and the same
 * lines in nvfp4_fused_scale_kernel): safe = fmaxf(g, FLT_MIN); S_enc =
 * g > 0 ? fminf(2688 / safe, FLT_MAX) : 1. For every finite g >= 0 this is
 * amx_nvfp4_global_encode's value; g = inf gives 0 (not 1) and NaN 1 (not
 * FLT_MAX).
 */
AMX_HD float amx_nvfp4_global_encode_partial_cast(float global_amax)
{
    float safe = global_amax > FLT_MIN ? global_amax : FLT_MIN; /* fmaxf: NaN -> FLT_MIN */
    float q = AMX_NVFP4_GLOBAL / safe;
    q = q < FLT_MAX ? q : FLT_MAX;
    return global_amax > 0.0f ? q : 1.0f;
}

/* The NVFP4 global encode scale S_enc of convention `conv`. */
AMX_HD float amx_nvfp4_global_encode_conv(int conv, float global_amax)
{
    return conv == AMX_NVFP4_TE_PARTIAL_CAST ? amx_nvfp4_global_encode_partial_cast(global_amax)
                                             : amx_nvfp4_global_encode(global_amax);
}

/* float(1/6) and float(1/2688), rounded once as the references' constexprs are. */
#define AMX_RCP_6 ((float)(1.0 / 6.0))       /* 0x3e2aaaab */
#define AMX_RCP_2688 ((float)(1.0 / 2688.0)) /* 0x39c30c31 */

/*
 * TE (current main, cast/nvfp4/core_nvfp4.cuh compute_decoding_scaling_factor):
 * e4m3(min(block_amax * (S_enc * float(1/6)), FLT_MAX)).
 */
AMX_HD uint8_t amx_nvfp4_block_te(float block_amax, float s_enc)
{
    float k = s_enc * AMX_RCP_6;
    float s_dec_b = block_amax * k;
    s_dec_b = s_dec_b < FLT_MAX ? s_dec_b : FLT_MAX;
    return amx_e4m3_from_float(s_dec_b);
}

/* TE <= 2.13 (the same function then): e4m3(min(block_amax / 6 * S_enc, FLT_MAX)). */
AMX_HD uint8_t amx_nvfp4_block_te_legacy(float block_amax, float s_enc)
{
    float s_dec_b = block_amax / AMX_E2M1_MAX * s_enc;
    s_dec_b = s_dec_b < FLT_MAX ? s_dec_b : FLT_MAX;
    return amx_e4m3_from_float(s_dec_b);
}

/* ModelOpt's final step (_cast_per_block_scale_to_fp8): clamp to [2^-9, 448], E4M3. */
AMX_HD uint8_t amx_modelopt_fp8_cast(float p)
{
    if (!(p >= 0.001953125f))
        p = 0.001953125f; /* 2^-9, the smallest E4M3 subnormal */
    if (p > AMX_E4M3_MAX)
        p = AMX_E4M3_MAX;
    return amx_e4m3_from_float(p);
}

/*
 * ModelOpt dynamic path (NVFP4QTensor.get_weights_scaling_factor): with
 * wsf2 = global_amax / 2688, per_block = block_amax / (6 * wsf2); a zero
 * result becomes 1.0; clamped to [2^-9, 448] and cast to E4M3. ModelOpt
 * computes 0/0 = NaN for a zero block when wsf2 is 0 (global amax 0, or so
 * small that g/2688 underflows); amaxd answers 1.0 there, as for any zero
 * block.
 */
AMX_HD uint8_t amx_nvfp4_block_modelopt(float block_amax, float global_amax)
{
    float wsf2 = global_amax / AMX_NVFP4_GLOBAL;
    float per_block = block_amax / (AMX_E2M1_MAX * wsf2);
    if (per_block == 0.0f || amx_isnan(per_block))
        per_block = 1.0f;
    return amx_modelopt_fp8_cast(per_block);
}

/*
 * ModelOpt static path (get_weights_scaling_factor_from_quantizer with a
 * global_amax): per_block = block_amax / 6, a zero becomes 1.0, then
 * per_block * 448 / (global_amax / 6), clamped to [2^-9, 448], E4M3. A
 * zero global amax gives inf, clamped to 448: never NaN (per_block > 0).
 */
AMX_HD uint8_t amx_nvfp4_block_modelopt_static(float block_amax, float global_amax)
{
    float max_scale = global_amax / AMX_E2M1_MAX;
    float per_block = block_amax / AMX_E2M1_MAX;
    if (per_block == 0.0f)
        per_block = 1.0f;
    return amx_modelopt_fp8_cast(per_block * AMX_E4M3_MAX / max_scale);
}

/* The E4M3 block byte of an NVFP4 cell under convention `conv`. */
AMX_HD uint8_t amx_nvfp4_block(int conv, float block_amax, float global_amax, float s_enc)
{
    switch (conv) {
    case AMX_NVFP4_MODELOPT:
        return amx_nvfp4_block_modelopt(block_amax, global_amax);
    case AMX_NVFP4_MODELOPT_STATIC:
        return amx_nvfp4_block_modelopt_static(block_amax, global_amax);
    case AMX_NVFP4_TE_LEGACY:
        return amx_nvfp4_block_te_legacy(block_amax, s_enc);
    case AMX_NVFP4_TE_PARTIAL_CAST: /* nvfp4_fused_scale_kernel: the TE expression */
    default:
        return amx_nvfp4_block_te(block_amax, s_enc);
    }
}

/*
 * NVFP4 global dequantization factor: TE's dequantize kernel
 * (cast/nvfp4/dequantize_nvfp4.cuh) multiplies by amax * float(1/2688);
 * ModelOpt's export writes weight_scale_2 = amax / 2688.
 */
AMX_HD float amx_nvfp4_global_decode(int output, float global_amax)
{
    return output == AMX_OUT_MODELOPT ? global_amax / AMX_NVFP4_GLOBAL : global_amax * AMX_RCP_2688;
}

/*
 * ModelOpt's FP8 export scale (quant_utils.get_scaling_factor): export_amax
 * (0 -> maxbound, then clamped to [FLT_MIN, FLT_MAX]) / maxbound.
 */
AMX_HD float amx_fp8_scale_inv_modelopt(float amax, float fp8_max)
{
    float a = amax == 0.0f ? fp8_max : amax;
    a = a < FLT_MIN ? FLT_MIN : a;
    a = a > FLT_MAX ? FLT_MAX : a;
    return a / fp8_max;
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

/*
 * The same encode scale as TE's master-weight cast uses it
 * (nvfp4_2d_partial_cast_kernel): a global encode scale <= 0 reads 1,
 * global_decode = 1 / S_enc, tile_encode = tile_decode > 0 ?
 * 1 / (tile_decode * global_decode) : FLT_MAX, then fminf(., FLT_MAX).
 * Equal to amx_nvfp4_block_encode(s_dec_b, 1 / s_enc) for every s_enc > 0.
 */
AMX_HD float amx_nvfp4_partial_cast_encode(float s_dec_b, float s_enc)
{
    float ges = s_enc <= 0.0f ? 1.0f : s_enc;
    float gds = 1.0f / ges;
    float r = s_dec_b > 0.0f ? 1.0f / (s_dec_b * gds) : FLT_MAX;
    return r < FLT_MAX ? r : FLT_MAX;
}

/* MXFP8: the E8M0 exponent of amax * float(1/448) rounded up (TE's quantize
 * kernels: float_to_e8m0(amax * Quantized_Limits<fp8e4m3>::max_norm_rcp)). */
AMX_HD uint8_t amx_mxfp8_e8m0(float amax)
{
    return amx_e8m0_from_float(amax * (float)(1.0 / 448.0));
}

/*
 * The largest 23-bit fraction j for which log2((1 + j 2^-23) 2^k), rounded
 * to float32 (nearest even), is the integer k itself; k is the exponent of
 * a normal float, -126..127. The exact log2 is k + d with d = log2(1 + j
 * 2^-23) in (0, 1); it rounds to k when d is below half the gap from k to
 * the next float towards k + d: 2^(n-24) with n = floor(log2 |k|) (0..6), one less
 * when k < 0 and |k| is a power of two (k + d then lies in the binade
 * below |k|). d < 2^(n-24) <=> j < (2^(2^(n-24)) - 1) 2^23 =
 * 0.35, 0.69, 1.39, 2.77, 5.55, 11.09, 22.18 for n = 0..6 (never an
 * integer, so no ties); k = 0 and k = -1 (n < 0) never round down.
 */
AMX_HD uint32_t amx_log2_to_k_max(int k)
{
    uint32_t a = (uint32_t)(k < 0 ? -k : k);
    int n = -1;
    for (uint32_t t = a; t != 0; t >>= 1)
        n++;
    if (k < 0 && (a & (a - 1u)) == 0)
        n--;
    switch (n) {
    case 2:
        return 1;
    case 3:
        return 2;
    case 4:
        return 5;
    case 5:
        return 11;
    case 6:
        return 22;
    default:
        return 0;
    }
}

/*
 * MXFP8 the ModelOpt way (nvidia-modelopt 0.47,
 * MXFP8QTensor._compute_e8m0_exponent): q = amax / 448 (float32 division),
 * e = ceil(float32 log2(q)) where q > 0 and -127 otherwise, clamped to
 * [-127, 127]; the byte is e + 127. The float32 log2 is characterized
 * exactly instead of calling log2f (whose last bit differs between libm
 * and CUDA): for q = (1 + j 2^-23) 2^k, e = k when j = 0 or j <=
 * amx_log2_to_k_max(k), else k + 1 (TE's rule gives k + 1 for every j > 0).
 * A subnormal q lies in (0, 2^-126): e is -127 (byte 0) unless q is in
 * [2^-127, 2^-126) with a 22-bit fraction j = bits - 2^22 whose log2
 * rounds up, j >= 12 (the bound 11.09 of n = 6 at 22 bits), e = -126.
 * NaN gives byte 0 and inf 254 as in ModelOpt (amaxd never passes them).
 */
AMX_HD uint8_t amx_mxfp8_e8m0_modelopt(float amax)
{
    float q = amax / AMX_E4M3_MAX;
    if (!(q > 0.0f))
        return 0;
    if (!amx_isfinite(q))
        return 254;
    uint32_t u = amx_f2u(q);
    uint32_t be = u >> 23, j = u & 0x7fffffu;
    if (be == 0)
        return u >= 0x0040000cu ? 1 : 0;
    int k = (int)be - 127;
    int e = j <= amx_log2_to_k_max(k) ? k : k + 1;
    e = e > 127 ? 127 : e;
    return (uint8_t)(e + 127);
}

/* The E8M0 byte of an MXFP8 amax under convention `conv`. */
AMX_HD uint8_t amx_mxfp8_e8m0_conv(int conv, float amax)
{
    return conv == AMX_MX_MODELOPT ? amx_mxfp8_e8m0_modelopt(amax) : amx_mxfp8_e8m0(amax);
}

/* 2^-127, the float32 subnormal 0x00400000: the value of E8M0 byte 0. */
#define AMX_E8M0_MIN_BITS 0x00400000u

/*
 * MXFP8 encode scale from the E8M0 byte e: 2^(127-e), the factor a
 * quantizer multiplies by.
 * - TE main (util/ptx.cuh exp2f_rcp<float>, unchanged since #2647, TE 2.13):
 *   the bit pattern (254 - e) << 23, except e = 254 -> 2^-127 (0x00400000)
 *   and e = 255 -> NaN (0x7fffffff); e = 0 gives 2^127. TE 2.13-2.18
 *   (`te_2_18`) had the same function.
 * - TE <= 2.12 (`te_legacy`): e = 0 -> 1, else (254 - e) << 23, which is
 *   0.0 for e = 254.
 * - OCP MX and ModelOpt (MXFP8QTensor.quantize_with_scale: exp2(127 - e)):
 *   2^(127-e) for every byte amaxd produces (0..254).
 * Byte 255 (NaN) never comes out of a finite amax.
 */
AMX_HD float amx_e8m0_encode_conv(int conv, uint8_t e)
{
    switch (conv) {
    case AMX_MX_TE_LEGACY:
        return e == 0 ? 1.0f : amx_u2f((uint32_t)(254u - e) << 23);
    case AMX_MX_TE:
    case AMX_MX_TE_2_18:
        if (e == 255)
            return amx_u2f(0x7fffffffu);
        /* fall through */
    default:
        return e == 254 ? amx_u2f(AMX_E8M0_MIN_BITS) : amx_u2f((uint32_t)(254u - e) << 23);
    }
}

/*
 * MXFP8 decode scale from the E8M0 byte e: 2^(e-127), the factor a
 * dequantizer multiplies by.
 * - TE main (util/ptx.cuh exp2f, since #3262 of 2026-08-05, TE 2.19): the bit
 *   pattern e << 23, except e = 0 -> 2^-127 and e = 255 -> NaN.
 * - TE <= 2.18 (`te_legacy`, `te_2_18`): e << 23, which is 0.0 for e = 0.
 * - OCP MX and ModelOpt (MXFP8QTensor.dequantize: exp2(e - 127)): 2^(e-127).
 */
AMX_HD float amx_e8m0_decode_conv(int conv, uint8_t e)
{
    switch (conv) {
    case AMX_MX_TE_LEGACY:
    case AMX_MX_TE_2_18:
        return amx_u2f((uint32_t)e << 23);
    case AMX_MX_TE:
        if (e == 255)
            return amx_u2f(0x7fffffffu);
        /* fall through */
    default:
        return e == 0 ? amx_u2f(AMX_E8M0_MIN_BITS) : amx_u2f((uint32_t)e << 23);
    }
}

#endif
