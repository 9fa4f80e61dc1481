"""Helpers shared by the ModelOpt tier's tests: ModelOpt configs,
byte-exact comparisons, and ModelOpt's static NVFP4 fake quantization on
the CPU (``cpu_static_fp4``, the ``cpu_kernel`` fixture)."""
import copy

import numpy as np
import pytest
import torch
import modelopt.torch.quantization as mtq
from modelopt.torch.quantization import tensor_quant as TQ
from modelopt.torch.quantization.nn.modules import tensor_quantizer as TQM


def _nvfp4_static_cfg():
    """NVFP4_DEFAULT_CFG with static weight blocks (ModelOpt's nvfp4_static
    numerics): per-block `_amax` and a `_global_amax` per weight."""
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") == "*weight_quantizer":
            entry["cfg"]["block_sizes"]["type"] = "static"
    return cfg


CONFIGS = {
    "fp8": mtq.FP8_DEFAULT_CFG,
    "fp8_channel": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG,
    "nvfp4": mtq.NVFP4_DEFAULT_CFG,
    "nvfp4_static": _nvfp4_static_cfg(),
    "mxfp8": mtq.MXFP8_DEFAULT_CFG,
}


def quantize(model, cfg_name, loop):
    return mtq.quantize(model, copy.deepcopy(CONFIGS[cfg_name]), loop)


def quantizers(model):
    TQ = mtq.nn.TensorQuantizer
    return {n: q for n, q in model.named_modules() if isinstance(q, TQ)}


def _np(t):
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.detach().cpu().numpy()


def same(got, want, where):
    """Byte-identical (float32 or uint8 scales), with the first differing cell."""
    got, want = np.ascontiguousarray(_np(got)), np.ascontiguousarray(_np(want))
    assert got.shape == want.shape or got.size == want.size == 1, \
        f"{where}: shape {got.shape}, expected {want.shape}"
    g, w = got.reshape(-1), want.reshape(-1)
    if g.dtype != w.dtype:
        raise AssertionError(f"{where}: dtype {g.dtype}, expected {w.dtype}")
    if g.tobytes() != w.tobytes():
        i = int(np.flatnonzero(g.view(np.uint8 if g.itemsize == 1 else np.uint32)
                               != w.view(np.uint8 if w.itemsize == 1 else np.uint32))[0])
        raise AssertionError(f"{where}: cell {i} of {g.size}: got {g[i]!r}, expected {w[i]!r}")


def block(ref, grid):
    """The part of a whole tensor of the amax grid (global shape, placement)
    that the rank's placement covers."""
    shape, pl = grid
    ref = ref.reshape(shape)
    sl = tuple(slice(o, o + n) for o, n in zip(pl.offset, pl.local_shape))
    return ref[sl]


# nvfp4_quant.py fp4_round_magnitude: (threshold, "<=" or "<", value).
_FP4 = ((0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
        (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0))


def cpu_static_fp4(x, amax, global_amax=None, quantize_block_scales=True,
                   fp8_max_for_normalization=448.0, out_dtype=None, pass_through_bwd=False):
    """fp4_kernel.py static_blockwise_fp4_fake_quant on the CPU: its
    compute_fp4_scales (with tensor_quant._fp8_eager, what
    scaled_e4m3_impl runs off CUDA) and static_blockwise_fp4_fake_quant_kernel
    / nvfp4_scalar_quant, element for element in float32."""
    n = amax.numel()
    scale = amax.float() / 6.0
    q = global_amax.float() * (448.0 / fp8_max_for_normalization) / 6.0
    scale = TQ.fp8_eager(scale, q).contiguous().view(n, 1)
    xf = x.contiguous().view(n, -1).float()
    zero = scale == 0.0
    safe = torch.where(zero | torch.isnan(scale) | torch.isinf(scale), torch.ones_like(scale),
                       scale)
    a = xf.abs() / safe
    r = torch.full_like(a, 6.0)
    for t, le, v in reversed(_FP4):
        r = torch.where((a <= t) if le else (a < t), torch.full_like(a, v), r)
    r = r * safe
    y = torch.where(xf >= 0, r, -r)
    y = torch.where(zero, torch.zeros_like(y), y)
    return y.to(out_dtype or x.dtype).view(x.shape)


@pytest.fixture
def cpu_kernel(monkeypatch):
    monkeypatch.setattr(TQM, "static_blockwise_fp4_fake_quant", cpu_static_fp4)
