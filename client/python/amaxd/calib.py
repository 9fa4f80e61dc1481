"""What a rank computes for a calibrator beyond max (docs/API.md,
"Calibration beyond max"): its histogram of |x| against the agreed bin
edges, or its per-candidate losses of an MSE search, ready for
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

__all__ = ["edges", "histogram", "mse_candidates", "mse_losses"]

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
