"""The NVFP4 per-block search on transformers' fused 3-D MoE experts
through the daemons against a single-process ModelOpt 0.47 (issue 23,
item 3 for ``_QuantFusedExperts``).

ModelOpt 0.47 searches fused experts expert by expert:
``mse_calibrate`` (model_calib.py, ``_mse_calibrate_weights``) walks
``_QuantFusedExperts.iter_weights_for_calibration``
(plugins/huggingface.py), which yields each expert's 2-D slice
``weight[i]`` with that expert's own TensorQuantizer, and the
NVFP4MSECalibrator of each searches the slice's blocks against that
expert's global amax (the max of its blocks,
``promote_static_block_weight_quantizers`` in utils/core_utils.py).
amaxd.modelopt registers one NVFP4_MSE quantizer per expert and
projection (``..._weight_quantizers.<global expert>.mse``), placed as the
rank's expert-TP part of that expert's block grid.

The reference is ``mtq.quantize`` with algorithm ``{"method": "mse",
"fp8_scale_sweep": True}`` on the whole block (fused_toy.py); the shards
are max-calibrated by ModelOpt, then ``amaxd.modelopt.sync`` and
``sync_mse(fp8_scale_sweep=True)`` run over EP=2, expert-TP=2 x EP=2,
EP=4, and EP=2 with two expert-data-parallel replicas (world 4: one
replica of each expert searches, the other only reads). Every per-expert
weight quantizer's ``_amax`` (its shard's blocks) and ``_global_amax``
must be the reference's bytes. As in test_nvfp4_mse.py, ModelOpt's static
NVFP4 fake quantization (a Triton kernel) is replaced on this CPU tier by
the torch transcription ``cpu_static_fp4``.
"""
import copy
import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mtq = pytest.importorskip("modelopt.torch.quantization")
pytest.importorskip("transformers")

import amaxd  # noqa: E402
import amaxd.modelopt as amo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import fused_toy as ft  # noqa: E402
from amaxd_proc import Daemon  # noqa: E402
from common import (CONFIGS, TQM, block, cpu_kernel, cpu_static_fp4,  # noqa: E402,F401
                    quantizers, same)

torch.set_num_threads(1)
FUSED = "mlp.experts"
PROJS = ("gate_up_proj", "down_proj")
# (fused_toy layout, expert-data-parallel replicas)
CASES = [("ep2", 1), ("etp2ep2", 1), ("ep4", 1), ("ep2", 2)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("nvfp4msefused")))
    yield d
    d.check_clean_exit(d.stop())


def _mse_cfg():
    cfg = copy.deepcopy(CONFIGS["nvfp4_static"])
    cfg["algorithm"] = {"method": "mse", "fp8_scale_sweep": True}
    return cfg


@functools.lru_cache(maxsize=None)
def reference():
    """(the single-process model after the per-block search, the inputs
    each expert's quantizers saw), with the CPU kernel."""
    saved = TQM.static_blockwise_fp4_fake_quant
    TQM.static_blockwise_fp4_fake_quant = cpu_static_fp4
    try:
        return ft.calibrate_full(lambda m, loop: mtq.quantize(m, _mse_cfg(), loop))
    finally:
        TQM.static_blockwise_fp4_fake_quant = saved


def _layout(layout, rank, dp):
    """Rank r = replica * (etp * ep) + ep_rank * etp + etp_rank; EP carved
    out of DP as Megatron does (dp_rank = replica * ep + ep_rank)."""
    etp, ep = ft.LAYOUTS[layout]
    er, epr, rep = rank % etp, (rank // etp) % ep, rank // (etp * ep)
    return amo.Layout(tp_rank=er, tp_size=etp, ep_rank=epr, ep_size=ep,
                      dp_rank=rep * ep + epr, dp_size=dp * ep)


def _run(daemon, layout, dp):
    _, captured = reference()
    etp, ep = ft.LAYOUTS[layout]
    n = etp * ep
    world = n * dp
    models = []
    for r in range(world):
        m = ft.shard_model(ft.full_model(), layout, r % n)
        mtq.quantize(m, copy.deepcopy(CONFIGS["nvfp4_static"]),
                     lambda mm, r=r: ft.replay(mm, captured, layout, r % n))
        models.append(m)
    job = f"fp4mse-fused-{layout}-dp{dp}"

    def rank(r):
        lay = _layout(layout, r, dp)
        with daemon.client(job, r, world) as c:
            c.join()
            amo.sync(c, models[r], lay)
            entries = amo.plan_nvfp4_mse(models[r], lay)
            res = amo.sync_mse(c, models[r], lay, fp8_scale_sweep=True)
        return lay, entries, res

    with ThreadPoolExecutor(world) as ex:
        outs = list(ex.map(rank, range(world)))
    return models, outs


@pytest.mark.parametrize("layout,dp", CASES)
def test_fused_experts_equal_single_process(daemon, cpu_kernel, layout, dp):
    ref_model, _ = reference()
    ref_q = quantizers(ref_model)
    models, outs = _run(daemon, layout, dp)
    checked = moved = owners = 0
    for r, (m, (lay, entries, res)) in enumerate(zip(models, outs)):
        fused = {e.local_name: e for e in amo.plan(m, lay) if e.fused}
        by_name = {e.name: e for e in entries}
        assert len(entries) == 2 * m.get_submodule(FUSED).num_experts
        for proj in PROJS:
            fe = fused[f"{FUSED}.{proj}_weight_quantizers"]
            gshape = fe.grid[0]
            whole = np.stack([ref_q[f"{FUSED}.{proj}_weight_quantizers.{g}"]._amax.detach()
                              .float().numpy().reshape(gshape[1:]) for g in range(gshape[0])])
            want_blocks = block(whole, fe.grid)
            for i, q in enumerate(getattr(m.get_submodule(FUSED), f"{proj}_weight_quantizers")):
                g = amo.global_name(m, f"{FUSED}.{proj}_weight_quantizers.{i}", lay)
                rq = ref_q[g]
                where = f"{layout} dp{dp} rank {r} {g}"
                want = want_blocks[i]
                assert q._amax.shape == (want.size, 1), where
                same(q._amax.reshape(want.shape), want, where + " _amax")
                same(q._global_amax, rq._global_amax, where + " _global_amax")
                e = by_name[g + ".mse"]
                owners += int(e.owner)
                rr = res[g + ".mse"]
                assert rr.stat_state == amaxd.pb.STAT_COMPUTED and rr.stat_overflow == 0, where
                assert np.float32(rr.global_amax) == rq._global_amax.float().numpy(), where
                blk = amo._block_amax(e.weight, 16).reshape(want.shape).numpy()
                moved += int((want != blk).sum())
                checked += 1
    etp, ep = ft.LAYOUTS[layout]
    assert checked == dp * etp * ft.E * len(PROJS)
    assert owners == etp * ft.E * len(PROJS)  # one replica of each expert part searches
    assert moved > 1000  # the search moved blocks off their max


def test_plan_names_and_placements():
    """One NVFP4_MSE quantizer per expert and projection: the expert axis
    dropped, the expert-TP part of the expert's block grid placed."""
    m = ft.shard_model(ft.full_model(), "etp2ep2", 3)  # etp rank 1, ep rank 1
    mtq.quantize(m, copy.deepcopy(CONFIGS["nvfp4_static"]), None)
    lay = _layout("etp2ep2", 3, 1)
    entries = {e.name: e for e in amo.plan_nvfp4_mse(m, lay)}
    half, nb_h, nb_i = ft.I // 2, ft.H // 16, ft.I // 16 // 2
    gu = entries[f"{FUSED}.gate_up_proj_weight_quantizers.5.mse"]
    assert gu.spec.global_shape == (2, ft.I, nb_h)
    assert gu.spec.placement.offset == (0, half, 0)
    assert gu.spec.placement.local_shape == (2, half, nb_h)
    assert gu.spec.global_axes == 0 and gu.spec.calibrator.kind == amaxd.pb.CALIBRATOR_NVFP4_MSE
    dn = entries[f"{FUSED}.down_proj_weight_quantizers.4.mse"]
    assert dn.spec.global_shape == (ft.H, 2 * nb_i)
    assert dn.spec.placement.offset == (0, nb_i)
    assert tuple(dn.weight.shape) == (ft.H, ft.I // 2)
    assert len(entries) == 2 * ft.E // 2
