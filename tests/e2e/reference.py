"""An independent numpy reference of the scale recipes (docs/NUMERICS.md),
written from the published conventions, not from daemon/recipe.h. E4M3
rounding comes from ml_dtypes (round-to-nearest-even), after clamping to
+-448 for the saturating cast."""
import ml_dtypes
import numpy as np

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def f32(x):
    return np.asarray(x, dtype=np.float32)


def e4m3_bits(x):
    """float32 -> E4M3 byte, RN-even, saturating; NaN -> 0x7f (sign kept)."""
    x = f32(x)
    c = np.clip(x, -448.0, 448.0)
    out = c.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isnan(x), np.uint8(0x7F) | (np.signbit(x).astype(np.uint8) << 7), out).astype(np.uint8)


def e4m3_value(b):
    return np.asarray(b, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def e8m0(val):
    """Biased exponent of val rounded up (TE pre-Blackwell rule)."""
    v = f32(val)
    u = v.view(np.uint32).astype(np.int64)
    exp = (u >> 23) & 0xFF
    man = u & 0x7FFFFF
    up = (man > 0) & (exp != 0xFE) & ~((exp == 0) & (man <= 0x400000))
    out = exp + up
    out = np.where(v == 0, 0, out)
    out = np.where(np.isinf(v), 0xFE, out)
    out = np.where(np.isnan(v), 0xFF, out)
    return out.astype(np.uint8)


# TE common/common.h TypeExtrema<bf16>::max = 0x1.FEp127, <fp16>::max = 0x1.FFCp15:
# what compute_scale_from_types<IType, OType> (the FP8 block quantizer kernels)
# puts in place of an infinite scale; float32 input and TE's master-weight
# cast (multi_tensor_compute_scale_and_scale_inv) use FLT_MAX.
VALUE_FOR_INF = {"float32": FLT_MAX, "bfloat16": F32(float.fromhex("0x1.FEp127")),
                 "float16": F32(float.fromhex("0x1.FFCp15"))}


def fp8_current(amax, fp8_max=448.0, pow2=False, eps=0.0, input_dtype="float32"):
    """TE recipe_common.cuh compute_scale_from_amax(amax, max_fp8,
    force_pow_2_scales, epsilon, value_for_inf); FP8 block scaling is this
    per block, value_for_inf by the input dtype (VALUE_FOR_INF)."""
    a = f32(amax).copy()
    a = np.where(a < F32(eps), F32(eps), a)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(fp8_max) / a
    s = np.where(np.isinf(s), VALUE_FOR_INF[input_dtype], s).astype(np.float32)
    s = np.where((a == 0) | ~np.isfinite(a), F32(1.0), s).astype(np.float32)
    if pow2:
        s = (s.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return s


def fp8_delayed(amax, prev, fp8_max=448.0, margin=0.0):
    a = f32(amax)
    scaled_max = F32(fp8_max) * F32(np.power(F32(2.0), F32(-margin)))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = scaled_max / a
    s = np.where(np.isfinite(a) & (a > 0), s, f32(prev)).astype(np.float32)
    return np.where(np.isinf(s), FLT_MAX, s).astype(np.float32)


def delayed_history(epochs, history_len, reduce="max", conv="te"):
    """The raw amax (-inf = no data) of each epoch of a delayed-scaling cell
    tensor, `epochs` a list of arrays (nan = no data). conv "te": TE's fused
    update (common/recipe/delayed_scaling.cu kernel_bulk) rolls the history
    only when the epoch's amax is non-zero, and a zero epoch's amax is 0;
    "te_unfused" (its per-tensor `kernel`): the window is the last H epochs."""
    out = []
    shape = np.shape(epochs[0])
    windows = [[] for _ in range(int(np.prod(shape, dtype=np.int64)))]
    for k, ep in enumerate(epochs):
        v = np.where(np.isnan(ep), -np.inf, ep).astype(np.float32).reshape(-1)
        raw = np.empty_like(v)
        for i, x in enumerate(v):
            if conv == "te_unfused":
                win = [np.float32(e.reshape(-1)[i]) for e in epochs[max(0, k + 1 - history_len):k + 1]]
                win = [-np.inf if np.isnan(w) else w for w in win]
                raw[i] = win[-1] if reduce == "most_recent" else max(win)
            elif x > 0:
                windows[i] = (windows[i] + [x])[-history_len:]
                raw[i] = x if reduce == "most_recent" else max(windows[i])
            else:
                raw[i] = x
        out.append(raw.reshape(shape))
    return out


def nvfp4_global(g):
    """TE core_nvfp4.cuh compute_global_encode_scaling_factor_FP4: 2688 / g,
    fminf(., FLT_MAX) (NaN -> FLT_MAX, as numpy's fmin), 1 for g = 0 or a 0 quotient."""
    g = f32(g)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(2688.0) / g
    s = np.fmin(s, FLT_MAX).astype(np.float32)
    return np.where((g == 0) | (s == 0), F32(1.0), s).astype(np.float32)


def nvfp4_global_partial_cast(g):
    """TE common/recipe/nvfp4.cu nvfp4_compute_global_scale_kernel (TE's cast
    of sharded master weights to NVFP4 2D): S_enc = g > 0 ? fminf(2688 /
    fmaxf(g, FLT_MIN), FLT_MAX) : 1. numpy's fmax/fmin drop NaN as CUDA's do."""
    g = f32(g)
    safe = np.fmax(g, np.finfo(np.float32).tiny)
    with np.errstate(divide="ignore", over="ignore"):
        s = np.fmin(F32(2688.0) / safe, FLT_MAX).astype(np.float32)
    return np.where(g > 0, s, F32(1.0)).astype(np.float32)


def nvfp4_partial_cast(tile_amax, g):
    """nvfp4_fused_scale_kernel: e4m3(fminf(tile_amax * (S_enc * (1.0f / 6)), FLT_MAX))."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = f32(tile_amax) * (nvfp4_global_partial_cast(g) * RCP_6)
    return e4m3_bits(np.fmin(v, FLT_MAX).astype(np.float32))


def nvfp4_partial_cast_encode(tile_byte, s_enc):
    """nvfp4_2d_partial_cast_kernel: S_enc <= 0 reads 1; 1 / (tile_decode *
    (1 / S_enc)) for a tile decode scale > 0, else FLT_MAX; fminf FLT_MAX."""
    s = f32(s_enc)
    s = np.where(s <= 0, F32(1.0), s).astype(np.float32)
    dec = e4m3_value(tile_byte)
    with np.errstate(divide="ignore", over="ignore"):
        r = F32(1.0) / (dec * (F32(1.0) / s))
    r = np.where(dec > 0, r, FLT_MAX).astype(np.float32)
    return np.fmin(r, FLT_MAX).astype(np.float32)


# TransformerEngine main, transformer_engine/common/cast/nvfp4/core_nvfp4.cuh,
# compute_decoding_scaling_factor: block_amax * (S_enc * fp4_max_inv) with the
# constexpr float fp4_max_inv = 1.0f / 6.0f, clamped to FLT_MAX, cast to E4M3.
RCP_6 = F32(1.0) / F32(6.0)
# TE dequantize_nvfp4.cuh: constexpr float factor_inv = 1.0 / (6.0 * 448.0).
RCP_2688 = F32(1.0 / (6.0 * 448.0))


def nvfp4_te(block_amax, s_enc):
    with np.errstate(over="ignore"):
        v = f32(block_amax) * (f32(s_enc) * RCP_6)
    return e4m3_bits(np.minimum(v, FLT_MAX))


def nvfp4_te_legacy(block_amax, s_enc):
    """TE <= 2.13, the same function: block_amax / fp4_max * S_enc."""
    with np.errstate(over="ignore"):
        v = f32(block_amax) / F32(6.0) * f32(s_enc)
    return e4m3_bits(np.minimum(v, FLT_MAX))


def _modelopt_cast(p):
    """ModelOpt 0.47 qtensor/nvfp4_tensor.py _cast_per_block_scale_to_fp8:
    clamp(min=2**-9, max=448) then .to(float8_e4m3fn). NaN (0/0) is amaxd's
    documented 1.0, not ModelOpt's."""
    p = np.where(np.isnan(p), F32(1.0), p)
    return e4m3_bits(np.clip(p, F32(2.0 ** -9), F32(448.0)).astype(np.float32))


def nvfp4_modelopt(block_amax, g):
    """ModelOpt 0.47 NVFP4QTensor.get_weights_scaling_factor (dynamic path):
    wsf2 = amax / (6 * 448); per_block_amax / (6 * wsf2); == 0 -> 1.0."""
    b, g = f32(block_amax), f32(g)
    with np.errstate(divide="ignore", invalid="ignore"):
        wsf2 = g / F32(6.0 * 448.0)
        pb = b / (F32(6.0) * wsf2)
    pb = np.where(pb == 0, F32(1.0), pb)
    return _modelopt_cast(pb)


def nvfp4_modelopt_static(block_amax, g):
    """ModelOpt 0.47 NVFP4QTensor.get_weights_scaling_factor_from_quantizer,
    static path: per_block_scale_max = global_amax / 6; per_block_scale =
    per_block_amax / 6, == 0 -> 1.0; per_block_scale * 448 / per_block_scale_max."""
    b, g = f32(block_amax), f32(g)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        mx = g / F32(6.0)
        pb = b / F32(6.0)
        pb = np.where(pb == 0, F32(1.0), pb).astype(np.float32)
        v = (pb * F32(448.0)) / mx
    return _modelopt_cast(v.astype(np.float32))


def nvfp4_global_inv(g, output="te"):
    """TE: amax * factor_inv (dequantize_nvfp4.cuh); ModelOpt:
    weight_scale_2 = amax / (6 * 448) (get_weights_scaling_factor_2)."""
    g = f32(g)
    return (g / F32(2688.0) if output == "modelopt" else g * RCP_2688).astype(np.float32)


def fp8_inv_modelopt(amax, fp8_max=448.0):
    """ModelOpt 0.47 export: get_scaling_factor = export_amax() / maxbound,
    export_amax replacing 0 by maxbound and clamping to [tiny, max]."""
    a = f32(amax)
    a = np.where(a == 0, F32(fp8_max), a)
    a = np.clip(a, np.finfo(np.float32).tiny, FLT_MAX).astype(np.float32)
    return (a / F32(fp8_max)).astype(np.float32)


def nvfp4_block_encode(s_dec_b, s_enc):
    with np.errstate(divide="ignore", over="ignore"):
        r = F32(1.0) / (f32(s_dec_b) * (F32(1.0) / f32(s_enc)))
    return np.minimum(r, FLT_MAX).astype(np.float32)


def mxfp8(amax):
    return e8m0(f32(amax) * F32(1.0 / 448.0))


def mxfp8_modelopt(amax):
    """ModelOpt 0.47 MXFP8QTensor._compute_e8m0_exponent + 127: q = amax / 448
    in float32; where q > 0, ceil of log2(q) rounded to float32 (here the double
    log2 rounded once), else -127; clamped to [-127, 127]."""
    q = f32(amax) / F32(448.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lg = np.log2(q.astype(np.float64)).astype(np.float32)
    e = np.clip(np.ceil(np.where(q > 0, lg, F32(-127.0))), -127, 127)
    return (e + 127).astype(np.uint8)


# The float32 NaN TE's exp2f_rcp / exp2f return for byte 255 (0x7fffffff).
_NAN_7FFFFFFF = np.array([0x7FFFFFFF], dtype=np.uint32).view(np.float32)[0]


def e8m0_encode(e, conv="te"):
    """The encode scale 2^(127-e) of E8M0 byte e, as an exact power of two
    (float64 power rounded once to float32; 2^-127 is a float32 subnormal).
    te (TE main common/util/ptx.cuh exp2f_rcp<float>, since #2647 / TE 2.13),
    te_2_18 (the same function), ocp, modelopt (quantize_with_scale:
    exp2(127 - e)): that power for bytes 0..254; TE's byte 255 is NaN.
    te_legacy (TE <= 2.12 exp2f_rcp): byte 0 -> 1.0, byte 254 -> 0.0 (its
    bit pattern (254 - 254) << 23)."""
    e = np.asarray(e, dtype=np.int64)
    p = np.power(np.float64(2.0), (127 - e).astype(np.float64)).astype(np.float32)
    if conv == "te_legacy":
        return np.where(e == 0, F32(1.0), np.where(e == 254, F32(0.0), p)).astype(np.float32)
    if conv in ("te", "te_2_18"):
        return np.where(e == 255, _NAN_7FFFFFFF, p).astype(np.float32)
    return p


def e8m0_decode(e, conv="te"):
    """The decode scale 2^(e-127) of E8M0 byte e. te (TE main util/ptx.cuh
    exp2f, since #3262 of 2026-08-05 / TE 2.19), ocp, modelopt (dequantize:
    exp2(e - 127)): that power, 2^-127 for byte 0; TE's byte 255 is NaN.
    te_legacy and te_2_18 (TE <= 2.18 exp2f, the bit pattern e << 23): byte 0
    -> 0.0."""
    e = np.asarray(e, dtype=np.int64)
    with np.errstate(over="ignore"):
        p = np.power(np.float64(2.0), (e - 127).astype(np.float64)).astype(np.float32)
    if conv in ("te_legacy", "te_2_18"):
        return np.where(e == 0, F32(0.0), p).astype(np.float32)
    if conv == "te":
        return np.where(e == 255, _NAN_7FFFFFFF, p).astype(np.float32)
    return p


NVFP4_BLOCK = {"te": lambda a, g, s: nvfp4_te(a, s), "te_legacy": lambda a, g, s: nvfp4_te_legacy(a, s),
               "modelopt": lambda a, g, s: nvfp4_modelopt(a, g),
               "modelopt_static": lambda a, g, s: nvfp4_modelopt_static(a, g)}


# FP8 rules: current scaling, and TE's FP8 block quantizer kernels on 16-bit input.
RULE_INPUT = {"current": "float32", "block_bf16": "bfloat16", "block_fp16": "float16"}


def scales(fmt, amax, g, rule="current", nvfp4="te", output="te", mxfp8_conv="te", pow2=False,
           eps=0.0):
    """(scale, scale_inv, block_bytes, global_scale, global_scale_inv) for
    reconciled amax cells `amax` and (group) global amax `g`, first epoch."""
    amax, g = f32(amax), F32(g)
    if fmt == "fp8_e4m3" or fmt == "fp8_e5m2":
        m = 448.0 if fmt == "fp8_e4m3" else 57344.0
        if rule == "delayed":
            s, gs = fp8_delayed(amax, 1.0, m), fp8_delayed(g, 1.0, m)
        else:
            s = fp8_current(amax, m, pow2, eps, RULE_INPUT[rule])
            gs = fp8_current(g, m, pow2, eps, RULE_INPUT[rule])
        if output == "modelopt":
            return s, fp8_inv_modelopt(amax, m), np.zeros(amax.shape, np.uint8), gs, fp8_inv_modelopt(g, m)
        return s, F32(1.0) / s, np.zeros(amax.shape, np.uint8), gs, F32(1.0) / gs
    if fmt == "nvfp4" and nvfp4 == "te_partial_cast":
        s_enc = nvfp4_global_partial_cast(g)
        b = nvfp4_partial_cast(amax, g)
        return (nvfp4_partial_cast_encode(b, s_enc), e4m3_value(b), b, s_enc,
                nvfp4_global_inv(g, output))
    if fmt == "nvfp4":
        s_enc = nvfp4_global(g)
        b = NVFP4_BLOCK[nvfp4](amax, g, s_enc)
        dec = e4m3_value(b)
        return nvfp4_block_encode(dec, s_enc), dec, b, s_enc, nvfp4_global_inv(g, output)
    if fmt == "mxfp8":
        e8 = mxfp8_modelopt if mxfp8_conv == "modelopt" else mxfp8
        e = e8(amax)
        ge = e8(g)
        return (e8m0_encode(e, mxfp8_conv), e8m0_decode(e, mxfp8_conv), e,
                e8m0_encode(ge, mxfp8_conv), e8m0_decode(ge, mxfp8_conv))
    raise ValueError(fmt)
