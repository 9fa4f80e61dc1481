"""Helpers shared by the ModelOpt tier's tests: ModelOpt configs and
byte-exact comparisons."""
import copy

import numpy as np
import torch
import modelopt.torch.quantization as mtq


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
