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


def fp8_current(amax, fp8_max=448.0, pow2=False, eps=0.0):
    a = f32(amax).copy()
    a = np.where(a < F32(eps), F32(eps), a)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = F32(fp8_max) / a
    s = np.where(np.isinf(s), FLT_MAX, s).astype(np.float32)
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


def nvfp4_global(g):
    g = f32(g)
    with np.errstate(divide="ignore", over="ignore"):
        s = F32(2688.0) / g
    s = np.minimum(s, FLT_MAX).astype(np.float32)
    return np.where((g == 0) | (s == 0), F32(1.0), s).astype(np.float32)


def nvfp4_te(block_amax, s_enc):
    with np.errstate(over="ignore"):
        v = f32(block_amax) / F32(6.0) * f32(s_enc)
    return e4m3_bits(np.minimum(v, FLT_MAX))


def nvfp4_modelopt(block_amax, g):
    b, g = f32(block_amax), f32(g)
    with np.errstate(divide="ignore", invalid="ignore"):
        wsf2 = g / F32(2688.0)
        pb = b / (F32(6.0) * wsf2)
    pb = np.where(pb == 0, F32(1.0), pb)
    pb = np.where(g > 0, pb, F32(1.0))
    pb = np.clip(pb, F32(2.0 ** -9), F32(448.0)).astype(np.float32)
    return e4m3_bits(pb)


def nvfp4_block_encode(s_dec_b, s_enc):
    with np.errstate(divide="ignore", over="ignore"):
        r = F32(1.0) / (f32(s_dec_b) * (F32(1.0) / f32(s_enc)))
    return np.minimum(r, FLT_MAX).astype(np.float32)


def mxfp8(amax):
    return e8m0(f32(amax) * F32(1.0 / 448.0))


def e8m0_encode(e):
    e = np.asarray(e, dtype=np.uint32)
    return np.where(e == 0, F32(1.0), ((254 - e) << 23).astype(np.uint32).view(np.float32)).astype(np.float32)


def e8m0_decode(e):
    return (np.asarray(e, dtype=np.uint32) << 23).astype(np.uint32).view(np.float32)


def scales(fmt, amax, g, rule="current"):
    """(scale, scale_inv, block_bytes, global_scale, global_scale_inv) for
    reconciled amax cells `amax` and (group) global amax `g`, first epoch."""
    amax, g = f32(amax), F32(g)
    if fmt == "fp8_e4m3" or fmt == "fp8_e5m2":
        m = 448.0 if fmt == "fp8_e4m3" else 57344.0
        if rule == "delayed":
            s, gs = fp8_delayed(amax, 1.0, m), fp8_delayed(g, 1.0, m)
        else:
            s, gs = fp8_current(amax, m), fp8_current(g, m)
        return s, F32(1.0) / s, np.zeros(amax.shape, np.uint8), gs, F32(1.0) / gs
    if fmt == "nvfp4":
        s_enc = nvfp4_global(g)
        b = nvfp4_te(amax, s_enc)
        dec = e4m3_value(b)
        return nvfp4_block_encode(dec, s_enc), dec, b, s_enc, F32(1.0) / s_enc
    if fmt == "mxfp8":
        e = mxfp8(amax)
        ge = mxfp8(g)
        return e8m0_encode(e), e8m0_decode(e), e, e8m0_encode(ge), e8m0_decode(ge)
    raise ValueError(fmt)
