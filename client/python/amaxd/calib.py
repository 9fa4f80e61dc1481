"""What a rank computes for a calibrator beyond max (docs/API.md,
"Calibration beyond max"): its histogram of |x| against the agreed bin
edges, its per-candidate losses of an MSE search, or the amax of each
NVFP4 block it owns (the per-block FP8 scale search), ready for
amaxd.Stat. numpy arrays and torch tensors (CPU or CUDA; the work stays on
the tensor's device) are accepted.

    r = c.reconcile()[name]                     # after the max pass
    counts = calib.histogram(x, r.stat_basis, cal)
    c.send({name: amaxd.Stat(counts, r.stat_epoch)})

The bins are torch.histc's (aten/src/ATen/native/cpu/HistogramKernel.cpp
and cuda/SummaryOps.cu compute the same float32 expression): |x| falls in
bin trunc(fl(fl(|x| * num_bins) / g)), the top edge in the last bin, so
that counts summed over ranks equal what one process that saw all the
data counts with the same edges (torch.histc(x, num_bins, 0, g)). Values
above g land in the last bin and in the overflow count (the daemon
reports their sum: a non-zero overflow says the histogram covers data the
agreed range did not). Counts are exact integers (int64 on the device).
"""
import math
from fractions import Fraction
from typing import Any, Callable, Optional

import numpy as np

from .types import Calibrator

__all__ = ["edges", "histogram", "mse_candidates", "mse_losses", "nvfp4_mse_candidates",
           "nvfp4_static_fake_quant", "nvfp4_mse_amax"]

_TORCH_DEFAULT = 3  # pb.TORCH_CPU_DEFAULT: no FMA in torch.linspace


def _is_torch(x: object) -> bool:
    return hasattr(x, "detach") and hasattr(x, "cpu")


def _f32(x: Any) -> np.float32:
    return np.float32(x)


def _linspace(start: float, end: float, steps: int, torch_cpu: int) -> np.ndarray:
    """torch.linspace(start, end, steps) in float32 as torch's CPU kernel
    computes it (daemon/calib.c amx_torch_linspace_f32): step = (end -
    start) / (steps - 1) in float32; index i below steps // 2 is start +
    step * i, the others end - step * (steps - i - 1), each one fused
    multiply-add (one rounding) unless the build is the baseline one."""
    s, e = _f32(start), _f32(end)
    if steps == 1:
        return np.array([s], dtype=np.float32)
    step = _f32(_f32(e - s) / _f32(steps - 1))
    half = steps // 2
    i = np.arange(steps)
    k = np.where(i < half, i, steps - i - 1)
    base = np.where(i < half, s, e)
    sgn = np.where(i < half, 1, -1)
    if torch_cpu == _TORCH_DEFAULT:
        prod = (step * k.astype(np.float32)).astype(np.float32)
        return np.where(i < half, s + prod, e - prod).astype(np.float32)
    if np.finfo(np.longdouble).nmant >= 63:
        # step * k has at most 24 + 15 bits and the sum stays within 64
        # bits: exact in x87 extended precision, then rounded once.
        ld = base.astype(np.longdouble) + sgn * (np.longdouble(step) * k.astype(np.longdouble))
        return ld.astype(np.float32)
    out = np.empty(steps, dtype=np.float32)
    for j in range(steps):
        out[j] = _round_f32(Fraction(float(base[j])) + int(sgn[j]) * Fraction(float(step)) * int(k[j]))
    return out


def _round_f32(q: Fraction) -> np.float32:
    """A rational rounded once, to nearest even, to float32 (normal range)."""
    if q == 0:
        return np.float32(0.0)
    sign = -1 if q < 0 else 1
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    while Fraction(2) ** e > q:
        e -= 1
    while Fraction(2) ** (e + 1) <= q:
        e += 1
    e = max(e, -126)
    ulp = Fraction(2) ** (e - 23)
    m = q / ulp
    n = math.floor(m)
    rest = m - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    return np.float32(sign * float(n * ulp))


def edges(g: float, cal: Calibrator) -> np.ndarray:
    """The agreed bin edges of a histogram quantizer with range top g:
    torch.linspace(0, g, num_bins + 1) in float32, as the daemon and
    ModelOpt's HistogramCalibrator make them."""
    return _linspace(0.0, float(g), cal.num_bins + 1, cal.torch_cpu)


def mse_candidates(cal: Calibrator) -> np.ndarray:
    """The candidate multipliers of an MSE search, float32 (MseCalibrator's
    torch.linspace(start, stop, nsteps))."""
    return _linspace(cal.start_multiplier, cal.stop_multiplier, cal.nsteps, cal.torch_cpu)


def _basis(basis: Any) -> float:
    b = np.asarray(basis, dtype=np.float32).reshape(-1)
    if b.size != 1:
        raise ValueError(f"a histogram's basis is one value (its range top), got {b.size}")
    return float(b[0])


def histogram(x: Any, basis: Any, cal: Calibrator) -> np.ndarray:
    """This rank's counts of |x| for a histogram quantizer whose agreed
    range top is `basis` (Result.stat_basis): num_bins counts, then the
    overflow count, float64 (exact integers)."""
    g = np.float32(_basis(basis))
    nb = int(cal.num_bins)
    if _is_torch(x):
        import torch
        a = x.detach().abs().float().reshape(-1)
        if cal.skip_zeros:
            a = a[a != 0]
        a = a[~torch.isnan(a)]
        gt = torch.tensor(float(g), dtype=torch.float32, device=a.device)
        over = a > gt
        # Divided by a tensor: CUDA divides by a Python scalar as a
        # multiplication by its reciprocal, histc does not.
        if g > 0:
            idx = torch.trunc((a * nb) / gt)
        else:  # torch.histc widens an empty range to [-1, 1]
            idx = torch.trunc(((a + 1.0) * nb) / torch.full_like(gt, 2.0))
        idx = torch.clamp(idx, 0, nb - 1).to(torch.int64)
        idx = torch.where(over, torch.full_like(idx, nb - 1), idx)
        counts = torch.bincount(idx, minlength=nb).to(torch.float64).cpu().numpy()
        n_over = float(over.sum().item())
    else:
        a = np.abs(np.asarray(x, dtype=np.float32).reshape(-1))
        if cal.skip_zeros:
            a = a[a != 0]
        a = a[~np.isnan(a)]
        over = a > g
        with np.errstate(over="ignore", invalid="ignore"):
            if g > 0:
                q = np.trunc((a * np.float32(nb)) / g)
            else:
                q = np.trunc(((a + np.float32(1.0)) * np.float32(nb)) / np.float32(2.0))
        q = np.where(np.isfinite(q), q, nb - 1)
        idx = np.clip(q, 0, nb - 1).astype(np.int64)
        idx[over] = nb - 1
        counts = np.bincount(idx, minlength=nb).astype(np.float64)
        n_over = float(over.sum())
    return np.concatenate([counts, [n_over]])


def mse_losses(x: Any, basis: Any, cal: Calibrator,
               quant: Callable[[Any, Any], Any], axis: Optional[int] = None) -> np.ndarray:
    """This rank's summed squared quantization error per candidate, float64,
    shape [cells, nsteps] (cells: 1 per tensor, or the size of `axis`, the
    quantizer's channel axis in x): for candidate k the amax is
    float32(basis * candidate_k) per cell (MseCalibrator's
    initial_amax * candidate), xq = quant(x, amax) (the framework's fake
    quantization; amax shaped for broadcasting against x), and the loss of
    a cell is the sum over its elements of (x - xq)^2 (F.mse_loss's
    elements, summed in float64)."""
    cand = mse_candidates(cal)
    b = np.asarray(basis, dtype=np.float32).reshape(-1)
    if _is_torch(x):
        import torch
        xt = x.detach().float()
        bt = torch.as_tensor(b, device=xt.device)
        out = []
        for c in cand:
            amax = bt * torch.tensor(float(c), dtype=torch.float32, device=xt.device)
            if axis is None:
                amax = amax.reshape(())
            else:
                shape = [1] * xt.dim()
                shape[axis] = -1
                amax = amax.reshape(shape)
            err = (xt - quant(xt, amax).float()) ** 2
            if axis is None:
                out.append(err.double().sum().reshape(1))
            else:
                dims = [d for d in range(xt.dim()) if d != axis % xt.dim()]
                out.append(err.double().sum(dim=dims))
        return torch.stack(out, dim=1).cpu().numpy()
    xa = np.asarray(x, dtype=np.float32)
    out = []
    for c in cand:
        amax = (b * np.float32(c)).astype(np.float32)
        if axis is None:
            amax = amax.reshape(())
        else:
            shape = [1] * xa.ndim
            shape[axis] = -1
            amax = amax.reshape(shape)
        err = (xa - np.asarray(quant(xa, amax), dtype=np.float32)).astype(np.float32) ** 2
        if axis is None:
            out.append(np.array([err.astype(np.float64).sum()]))
        else:
            dims = tuple(d for d in range(xa.ndim) if d != axis % xa.ndim)
            out.append(err.astype(np.float64).sum(axis=dims))
    return np.stack(out, axis=1)


# -- NVFP4 per-block search (Calibrator.nvfp4_mse; docs/NUMERICS.md "NVFP4
# per-block MSE search"). ModelOpt 0.47: calib/mse.py NVFP4MSECalibrator,
# kernels/quantization/gemm/_fp8_scale_candidates.py fp8_scale_candidates,
# kernels/quantization/gemm/fp4_kernel.py static_blockwise_fp4_fake_quant
# (compute_fp4_scales + nvfp4_scalar_quant), tensor_quant.py _fp8_eager.

_FP4_STEPS = ((0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
              (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0))


def nvfp4_mse_candidates() -> np.ndarray:
    """The 126 candidate multipliers, float32, increasing: the finite
    positive FP8 E4M3 values (bytes 1..126) divided by 448 in float32. A
    candidate amax is float32(g * c_k), g the global amax (the basis)."""
    b = np.arange(1, 127)
    e, m = b >> 3, b & 7
    v = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0)).astype(np.float32)
    return (v / np.float32(448.0)).astype(np.float32)


def _e4m3(v: np.ndarray) -> np.ndarray:
    """float32 values in [-448, 448] rounded to FP8 E4M3 (nearest, ties to
    even; torch's .to(torch.float8_e4m3fn)), as float32."""
    a = np.abs(v).astype(np.float64)
    _, ex = np.frexp(a)  # a = f * 2^ex, f in [0.5, 1): 3 mantissa bits below 2^(ex-1)
    q = np.exp2(np.maximum(ex - 4, -9).astype(np.float64))
    return (np.sign(v) * (np.round(a / q) * q)).astype(np.float32)


def _fp4_round(a):
    """|x| / scale to the nearest E2M1 magnitude, with nvfp4_scalar_quant's
    thresholds (<= at 0.25, 1.25, 2.5, 5; < at 0.75, 1.75, 3.5)."""
    if _is_torch(a):
        import torch
        out = torch.full_like(a, 6.0)
        for t, le, val in reversed(_FP4_STEPS):
            out = torch.where((a <= t) if le else (a < t), torch.full_like(a, val), out)
        return out
    out = np.full_like(a, 6.0, dtype=np.float32)
    for t, le, val in reversed(_FP4_STEPS):
        out = np.where((a <= t) if le else (a < t), np.float32(val), out)
    return out.astype(np.float32)


def nvfp4_static_fake_quant(xb: Any, amax: Any, g: float) -> Any:
    """ModelOpt's static NVFP4 fake quantization (the CPU transcription of
    its Triton kernel): `xb` [..., n, 16] blocks, `amax` [..., n] their
    amaxes, `g` the global amax. Block scale s = e4m3-quantized amax/6
    relative to g/6 (_fp8_eager: scale 448/(g/6) computed as
    float32(float32(1/(g/6)) * 448), g/6 <= 2^-24 taken as 1),
    each element sign(x) * fp4(|x|/s) * s, a zero scale zeroing the block.
    float32 throughout; numpy or torch (on the tensor's device)."""
    if _is_torch(xb):
        import torch
        x = xb.detach().float()
        a = torch.as_tensor(amax, dtype=torch.float32, device=x.device).unsqueeze(-1)
        gt = torch.tensor(float(np.float32(g)), dtype=torch.float32, device=x.device)
        s = a / 6.0
        q = gt * 1.0 / 6.0
        q = torch.where(q <= 1.0 / (1 << 24), torch.ones_like(q), q)
        sc = 448.0 / q
        t = (s * sc).clamp(min=-448.0, max=448.0)
        sq = t.to(torch.float8_e4m3fn).to(torch.float32) * (1 / sc)
        zero = sq == 0.0
        safe = torch.where(zero | torch.isnan(sq) | torch.isinf(sq), torch.ones_like(sq), sq)
        y = _fp4_round(x.abs() / safe) * safe
        y = torch.where(x >= 0, y, -y)
        return torch.where(zero, torch.zeros_like(y), y)
    f32 = np.float32
    x = np.asarray(xb, dtype=f32)
    a = np.asarray(amax, dtype=f32)[..., None]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        s = (a / f32(6.0)).astype(f32)
        q = f32(f32(g) * f32(1.0)) / f32(6.0)
        q = f32(1.0) if q <= f32(1.0 / (1 << 24)) else q
        # torch computes a Python number over a tensor as the tensor's
        # reciprocal times the number: 448 / q is fl(fl(1/q) * 448).
        sc = f32(f32(f32(1.0) / q) * f32(448.0))
        sinv = f32(f32(1.0) / sc)
        t = np.clip((s * sc).astype(f32), -448.0, 448.0).astype(f32)
        sq = (_e4m3(t) * sinv).astype(f32)
        zero = sq == 0.0
        safe = np.where(zero | ~np.isfinite(sq), f32(1.0), sq).astype(f32)
        y = (_fp4_round((np.abs(x) / safe).astype(f32)) * safe).astype(f32)
        y = np.where(x >= 0, y, -y).astype(f32)
        return np.where(zero, f32(0.0), y).astype(f32)


def nvfp4_mse_amax(w: Any, basis: Any, quant: Optional[Callable[[Any, Any], Any]] = None,
                   block: int = 16) -> np.ndarray:
    """The phase-2 statistic of an NVFP4_MSE quantizer: the amax of each
    16-element block of this rank's weight block `w` ([..., C], blocks
    along the last axis; C a multiple of 16) that NVFP4MSECalibrator
    picks against the global amax g = basis (Result.stat_basis, every cell
    g): for each of the 126 candidates the amax float32(g * c_k), the
    blocks fake-quantized with it (`quant(xb, amax)` with xb [n, 16] and
    amax [n, 1], ModelOpt's own quantizer, or by default
    nvfp4_static_fake_quant), each block's loss the float32 sum of its 16
    squared errors (F.mse_loss, reduce_sum), and the first candidate with
    the smallest loss (torch.argmin). float64 array shaped like w's blocks
    ([..., C/16]), for amaxd.Stat. torch keeps the work on the tensor's
    device and sums as ModelOpt does; numpy sums its own way (float32
    pairwise), which can pick another candidate in an exact-looking
    float32 near-tie."""
    g = np.float32(np.asarray(basis, dtype=np.float32).reshape(-1)[0]) \
        if np.asarray(basis).size else np.float32(0.0)
    cand = nvfp4_mse_candidates()
    if _is_torch(w):
        import torch
        x = w.detach().float()
        shape = x.shape[:-1] + (x.shape[-1] // block,)
        xb = x.reshape(-1, block)
        gt = torch.tensor(float(g), dtype=torch.float32, device=x.device)
        ct = torch.as_tensor(cand, device=x.device)
        losses = []
        for k in range(len(cand)):
            a = (gt * ct[k]).expand(xb.shape[0]).reshape(-1, 1)
            xq = (quant(xb, a) if quant is not None else
                  nvfp4_static_fake_quant(xb, a.reshape(-1), float(g))).float()
            losses.append(((xb - xq) ** 2).sum(dim=(1,)))
        best = torch.argmin(torch.stack(losses), dim=0)
        amax = gt * ct[best]
        return amax.reshape(shape).double().cpu().numpy()
    x = np.asarray(w, dtype=np.float32)
    shape = x.shape[:-1] + (x.shape[-1] // block,)
    xb = x.reshape(-1, block)
    losses = np.empty((len(cand), xb.shape[0]), dtype=np.float32)
    for k, c in enumerate(cand):
        a = np.full((xb.shape[0], 1), np.float32(g * c), dtype=np.float32)
        xq = np.asarray(quant(xb, a) if quant is not None else
                        nvfp4_static_fake_quant(xb, a.reshape(-1), float(g)), dtype=np.float32)
        losses[k] = (((xb - xq).astype(np.float32)) ** 2).astype(np.float32).sum(axis=1,
                                                                                  dtype=np.float32)
    best = np.argmin(losses, axis=0)
    return (g * cand[best]).astype(np.float32).astype(np.float64).reshape(shape)
