"""The NVFP4 per-block search through the daemons against a single-process
ModelOpt 0.47 (issue 23, item 3): ``mtq.quantize`` with algorithm
``{"method": "mse", "fp8_scale_sweep": True}`` on the whole toy model vs
max calibration per shard, ``amaxd.modelopt.sync`` and
``amaxd.modelopt.sync_mse(fp8_scale_sweep=True)`` at TP1 (tp1ep4: dense
weights replicated on 4 DP ranks, one of which searches) and TP2 (tp2ep2:
column- and row-parallel shards own disjoint blocks): every static NVFP4
weight quantizer's ``_amax`` (its blocks) and ``_global_amax`` are the
same bytes.

ModelOpt 0.47 fake-quantizes static NVFP4 blocks only with a Triton
kernel (tensor_quant.py StaticBlockwiseFP4FakeQuantFunction needs
triton_kernel.IS_AVAILABLE, i.e. CUDA), so on this CPU tier the
single-process reference runs with that kernel replaced by a torch
transcription of it built from ModelOpt's own pieces: compute_fp4_scales'
block scale (amax / 6, FP8-quantized against global / 6 with _fp8_eager)
and nvfp4_scalar_quant's rounding (fp4_round_magnitude's thresholds).
Everything else (the candidates, the losses, the argmin, the global amax,
the write-back) is ModelOpt's. amaxd.modelopt then uses amaxd.calib's own
transcription (no Triton either), so the bytes below also compare the two
transcriptions. test_fake_quant_is_modelopts compares them on many
blocks directly.
"""
import copy
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import modelopt.torch.quantization as mtq
from modelopt.torch.kernels.quantization.gemm._fp8_scale_candidates import fp8_scale_candidates

import amaxd
import amaxd.modelopt as amo
from amaxd import calib

import toy
from common import CONFIGS, cpu_kernel, cpu_static_fp4  # noqa: F401 (a fixture)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from amaxd_proc import Daemon  # noqa: E402


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("nvfp4mse")))
    yield d
    d.check_clean_exit(d.stop())


def test_candidates_are_modelopts():
    assert calib.nvfp4_mse_candidates().tobytes() == fp8_scale_candidates().numpy().tobytes()


def test_fake_quant_is_modelopts():
    """amaxd.calib's static NVFP4 fake quantization (numpy and torch) and the
    search on it against the transcription of ModelOpt's kernel above and
    a search that runs ModelOpt's NVFP4MSECalibrator on it."""
    from modelopt.torch.quantization.calib import NVFP4MSECalibrator
    g = torch.Generator().manual_seed(11)
    cand = calib.nvfp4_mse_candidates()
    for trial in range(12):
        w = torch.randn(32, 64, generator=g) * torch.exp2(
            torch.randint(-12, 12, (32, 1), generator=g).float())
        w[torch.rand(w.shape, generator=g) < 0.15] = 0
        w[:2] = 0  # all-zero blocks: every candidate ties, the first wins
        if trial == 1:
            w[5, 3] = 2.0 ** 20  # one block far above the rest
        gm = torch.tensor(float(w.abs().max()), dtype=torch.float32)
        xb = w.reshape(-1, 16)
        for c in cand[::5]:
            a = torch.full((xb.shape[0],), float(np.float32(gm.item() * c)))
            ref = cpu_static_fp4(xb, a.reshape(-1, 1), gm).numpy().tobytes()
            assert calib.nvfp4_static_fake_quant(xb, a, gm.item()).numpy().tobytes() == ref
            assert calib.nvfp4_static_fake_quant(xb.numpy(), a.numpy(), gm.item()).tobytes() == ref
        cal = NVFP4MSECalibrator(amax=xb.abs().amax(dim=1, keepdim=True), global_amax=gm, axis=0,
                                 quant_func=lambda x, amax: cpu_static_fp4(x, amax, gm))
        cal.collect(xb)
        want = cal.compute_amax().reshape(32, 4).numpy()
        got_t = calib.nvfp4_mse_amax(w, [gm.item()]).astype(np.float32)
        got_n = calib.nvfp4_mse_amax(w.numpy(), [gm.item()]).astype(np.float32)
        assert got_t.tobytes() == want.tobytes(), trial
        assert got_n.tobytes() == want.tobytes(), trial


def _static_weight_quantizers(m):
    return {n: q for n, q in m.named_modules()
            if n.endswith("weight_quantizer") and isinstance(q, mtq.nn.TensorQuantizer)
            and q.is_enabled and getattr(q, "is_nvfp4_static", False)}


@pytest.mark.parametrize("layout", ["tp1ep4", "tp2ep2"])
def test_sync_nvfp4_mse_equals_single_process(daemon, cpu_kernel, layout):
    cfg = copy.deepcopy(CONFIGS["nvfp4_static"])
    cfg["algorithm"] = {"method": "mse", "fp8_scale_sweep": True}
    ref, captured = toy.calibrate_full(
        lambda mm, loop: mtq.quantize(mm, cfg, loop))
    ref_q = _static_weight_quantizers(ref)
    assert ref_q
    want = {n: (q._amax.clone(), q.global_amax.clone(),
                ref.get_submodule(n.rsplit(".", 1)[0]).weight.shape) for n, q in ref_q.items()}

    def rank(r):
        lay = toy.amaxd_layout(layout, r)
        m = toy.shard_model(toy.full_model(), layout, r)
        mtq.quantize(m, copy.deepcopy(CONFIGS["nvfp4_static"]),
                     lambda mm: toy.replay(mm, captured, layout, r))
        with daemon.client(f"nvfp4mse-{layout}", r, toy.W) as c:
            c.join()
            amo.sync(c, m, lay, column=toy.COLUMN, row=toy.ROW, moe_share=amo.supports_share())
            res = amo.sync_mse(c, m, lay, fp8_scale_sweep=True, column=toy.COLUMN, row=toy.ROW)
        return lay, m, res

    with ThreadPoolExecutor(toy.W) as ex:
        shards = list(ex.map(rank, range(toy.W)))
    checked = moved = 0
    for lay, m, res in shards:
        tp, tpr = lay.tp_size, lay.tp_rank
        for n, q in _static_weight_quantizers(m).items():
            g = amo.global_name(m, n, lay)
            amax, gamax, (rows, cols) = want[g]
            blocks = amax.reshape(rows, cols // 16)
            last = n.rsplit(".", 2)[-2]
            if tp > 1 and last in toy.COLUMN:
                blocks = blocks[tpr * rows // tp:(tpr + 1) * rows // tp]
            elif tp > 1 and last in toy.ROW:
                k = cols // 16 // tp
                blocks = blocks[:, tpr * k:(tpr + 1) * k]
            got = q._amax.detach()
            assert got.shape == (blocks.numel(), 1), (layout, g, got.shape)
            assert got.numpy().tobytes() == blocks.contiguous().numpy().tobytes(), (layout, g)
            assert q.global_amax.numpy().tobytes() == gamax.numpy().tobytes(), (layout, g)
            r = res[g + ".mse"]
            assert r.stat_state == amaxd.pb.STAT_COMPUTED and r.stat_overflow == 0
            # The search moved blocks off their max (else this compares little).
            blk_max = amo._block_amax(m.get_submodule(n.rsplit(".", 1)[0]).weight, 16)
            moved += int((got.reshape(blk_max.shape) != blk_max).sum())
            checked += 1
    assert checked >= 4 * 10
    assert moved > 100
