"""Calibrators beyond max through the daemon against a single-process
ModelOpt 0.47 (issue 23): the same data split over 1, 2, 4 and 8 ranks
(DP batches, TP feature slices, EP token routing) gives, byte for byte,
the amax of a HistogramCalibrator that saw all the data, and the MSE
search's amax is MseCalibrator's.

The single-process procedure (docs/MODELOPT.md): HistogramCalibrator fixes
its bin edges from the first batch it collects, torch.linspace(0,
max|x|, num_bins + 1); fed first the batch that holds the global max (here
every batch is fed, the one with the largest |x| first), its edges are the
daemons' agreed ones, later batches never grow them, and its float32
counts are the summed integer counts (every bin below 2^24). Its
compute_amax(method) then runs on the merged histogram the daemon has. The
histogram MSE method is compared with ModelOpt's _compute_amax_mse with
its quantizer calls repaired (test_calib_methods.py says why).
"""
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from modelopt.torch.quantization import tensor_quant as TQ
from modelopt.torch.quantization.calib import HistogramCalibrator, MseCalibrator
from modelopt.torch.quantization.calib import histogram as H

import amaxd
from amaxd import calib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from amaxd_proc import Daemon  # noqa: E402

SPLITS = {1: (1, 1, 1), 2: (1, 1, 2), 4: (2, 1, 2), 8: (2, 2, 2)}  # world: (tp, ep, dp)
BATCHES, TOKENS, FEAT = 8, 64, 48


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("calib")))
    yield d
    d.check_clean_exit(d.stop())


@pytest.fixture
def repaired(monkeypatch):
    monkeypatch.setattr(H, "fake_tensor_quant",
                        lambda x, amax, nb, u: TQ.fake_tensor_quant(x, amax, None, nb, u))
    monkeypatch.setattr(H, "scaled_e4m3", lambda x, amax, e, m: TQ.scaled_e4m3(x, amax, None, e, m))


def activations(seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-4, 5, (BATCHES, 1, 1), generator=g).float())
    x = torch.randn((BATCHES, TOKENS, FEAT), generator=g) * scale
    x[torch.rand(x.shape, generator=g) < 0.05] = 0.0
    route = torch.randint(0, 2, (BATCHES, TOKENS), generator=g)
    return x, route


def shard(x, route, world, rank):
    """This rank's values: DP ranks take whole batches, EP ranks the tokens
    routed to their experts, TP ranks a slice of the features."""
    tp, ep, dp = SPLITS[world]
    t, e, d = rank % tp, (rank // tp) % ep, rank // (tp * ep)
    parts = []
    for b in range(d, BATCHES, dp):
        toks = x[b] if ep == 1 else x[b][route[b] == e]
        parts.append(toks[:, t * FEAT // tp:(t + 1) * FEAT // tp].reshape(-1))
    return torch.cat(parts)


CASES = {
    # name: (method, histogram options, compute_amax kwargs, ModelOpt num_bits / unsigned)
    "pct9999": ("percentile", dict(percentile=99.99), dict(percentile=99.99), (4, 3), False),
    "pct0": ("percentile", dict(percentile=0.0), dict(percentile=0.0), (4, 3), False),
    "pct50": ("percentile", dict(percentile=50.0), dict(percentile=50.0), 8, False),
    "pct100": ("percentile", dict(percentile=100.0), dict(percentile=100.0), 8, False),
    "entropy": ("entropy", dict(num_bits=8, start_bin=128, stride=4),
                dict(start_bin=128, stride=4), 8, False),
    "entropy_u4": ("entropy", dict(num_bits=4, unsigned=True, start_bin=64, stride=8),
                   dict(start_bin=64, stride=8), 4, True),
    "mse_int8": ("mse", dict(grid="int", num_bits=8, start_bin=128, stride=2),
                 dict(start_bin=128, stride=2), 8, False),
    "mse_e4m3": ("mse", dict(grid="e4m3", start_bin=128, stride=2),
                 dict(start_bin=128, stride=2), (4, 3), False),
}


def single_process(x, case, num_bins, skip_zeros):
    method, _, kw, nb, uns = CASES[case]
    cal = HistogramCalibrator(num_bits=nb, axis=None, unsigned=uns, num_bins=num_bins,
                              skip_zeros=skip_zeros)
    order = sorted(range(BATCHES), key=lambda b: -float(x[b].abs().max()))
    for b in order:  # the batch with the global max first: its edges are the agreed ones
        cal.collect(x[b])
    assert float(cal._calib_bin_edges[-1]) == float(x.abs().max())
    return cal.compute_amax(method, **kw)


def run(daemon, job, x, route, world, cals):
    def rank(r):
        v = shard(x, route, world, r)
        with daemon.client(job, r, world) as c:
            c.join()
            c.register([amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current(), calibrator=k)
                        for n, k in cals.items()])
            m = float(v.abs().max())
            c.send({n: m for n in cals})
            r1 = c.reconcile()
            c.send({n: amaxd.Stat(calib.histogram(v, r1[n].stat_basis, k), r1[n].stat_epoch)
                    for n, k in cals.items()})
            return c.reconcile()

    with ThreadPoolExecutor(world) as ex:
        return list(ex.map(rank, range(world)))


@pytest.mark.parametrize("world", sorted(SPLITS))
def test_histograms_equal_single_process(daemon, repaired, world):
    x, route = activations(23 + world)
    cals = {}
    for case, (method, opts, _, _, _) in CASES.items():
        for nbins, skip in ((2048, False), (512, True)):
            cals[f"{case}.{nbins}.{int(skip)}"] = amaxd.Calibrator.histogram(
                method, nbins, skip_zeros=skip, **opts)
    out = run(daemon, f"hist-{world}", x, route, world, cals)
    for name in cals:
        case, nbins, skip = name.rsplit(".", 2)
        want = single_process(x, case, int(nbins), bool(int(skip)))
        for r in range(world):
            got = out[r][name]
            assert got.stat_state == amaxd.pb.STAT_COMPUTED
            assert got.amax.tobytes() == np.float32(want.item()).tobytes(), \
                f"{name}, rank {r} of {world}: {got.amax} vs ModelOpt {want.item()}"


def fp8_quant(x, amax):
    """The quantizer of the MSE search: ModelOpt's FP8 E4M3 fake quantization."""
    return TQ.scaled_e4m3(x, amax, None, 4, 3)


@pytest.mark.parametrize("per_channel", [False, True])
def test_mse_search_equals_single_process(daemon, per_channel):
    """MseCalibrator on the whole weight vs amaxd: TP ranks hold column
    blocks (row-parallel) of a [64, 96] weight; each sends its summed
    losses per candidate (and channel), the daemon sums them and takes the
    argmin. Equal unless two candidates' losses are within rounding of
    each other (docs/NUMERICS.md): asserted not to be the case here."""
    g = torch.Generator().manual_seed(31)
    w = torch.randn((64, 96), generator=g) * torch.exp2(torch.randint(-3, 3, (64, 1),
                                                                      generator=g).float())
    w[5, 7] = 20.0  # an outlier: the MSE amax is well below the max
    axis = 0 if per_channel else None
    init = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
    ref = MseCalibrator(amax=init, axis=axis, quant_func=fp8_quant)
    ref.collect(w)
    losses_ref = torch.stack([loss for loss in ref._losses_sum])
    want = ref.compute_amax()
    cal = amaxd.Calibrator.mse()
    shape = [64] if per_channel else []
    for world in (1, 2, 4):
        def rank(r):
            blk = w[:, r * 96 // world:(r + 1) * 96 // world]
            with daemon.client(f"mse-{int(per_channel)}-{world}", r, world) as c:
                c.join()
                c.register([amaxd.Quantizer("w", shape, amaxd.Recipe.fp8_current(),
                                            calibrator=cal)])
                c.send({"w": blk.abs().amax(dim=1).numpy() if per_channel
                        else float(blk.abs().max())})
                r1 = c.reconcile()["w"]
                losses = calib.mse_losses(blk, r1.stat_basis, cal, fp8_quant,
                                          axis=0 if per_channel else None)
                c.send({"w": amaxd.Stat(losses, r1.stat_epoch)})
                return c.reconcile()["w"]

        with ThreadPoolExecutor(world) as ex:
            res = list(ex.map(rank, range(world)))
        for r in res:
            assert r.stat_state == amaxd.pb.STAT_COMPUTED
            assert r.amax.tobytes() == want.reshape(r.amax.shape).numpy().tobytes(), world
    # The margin that makes the argmin safe from rounding: the runner-up's
    # float32 loss is larger by far more than float32 summation error.
    srt = torch.sort(losses_ref.reshape(losses_ref.shape[0], -1), dim=0).values
    assert torch.all(srt[1] - srt[0] > 1e-4 * srt[0])


# -- amaxd.modelopt.sync_histograms on the toy block --------------------------

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import copy  # noqa: E402

import modelopt.torch.quantization as mtq  # noqa: E402

import amaxd.modelopt as amo  # noqa: E402
import toy  # noqa: E402

ADAPTER = {
    # name: (num_bits of the input quantizers, num_bins, method, kwargs)
    "int8_pct": (8, 2048, "percentile", dict(percentile=99.9)),
    "int8_entropy": (8, 256, "entropy", dict(start_bin=128, stride=4)),
    "fp8_mse": ((4, 3), 1024, "mse", dict(start_bin=128, stride=8)),
}


def _histogram_model(model, case):
    """`model` with histogram calibrators on every linear's input quantizer
    (weights left unquantized), as ModelOpt configures them; no calibration."""
    nb, bins, _, _ = ADAPTER[case]
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    cfg["algorithm"] = None
    for e in cfg["quant_cfg"]:
        if e.get("quantizer_name") == "*weight_quantizer":
            e["enable"] = False
        if e.get("quantizer_name") == "*input_quantizer":
            e["cfg"] = {"num_bits": nb, "axis": None, "calibrator": "histogram"}
    mtq.quantize(model, cfg, None)
    for n, q in model.named_modules():
        if isinstance(q, mtq.nn.TensorQuantizer) and isinstance(q._calibrator, HistogramCalibrator):
            q._calibrator = HistogramCalibrator(nb, None, False, num_bins=bins)
    return model


def _reference(case):
    """One process: every histogram quantizer collects what its linear sees
    in one forward of the whole batch (one batch: its edges are the global
    max's), then load_calib_amax(method, ...) as ModelOpt's calibration ends.
    Returns (the model, what each linear saw)."""
    _, _, method, kw = ADAPTER[case]
    model = _histogram_model(toy.full_model(), case)
    hq = {n: q for n, q in model.named_modules() if isinstance(q, mtq.nn.TensorQuantizer)
          and isinstance(q._calibrator, HistogramCalibrator)}
    for q in hq.values():
        q.disable_quant()
        q.enable_calib()
    seen, remove = toy.capture_hooks(model)
    model(toy.batch())
    remove()
    for q in hq.values():
        if q._calibrator._calib_hist is not None:  # a cold expert's saw nothing
            q.load_calib_amax(method, **kw)
        q.enable_quant()
        q.disable_calib()
    return model, seen


@pytest.mark.parametrize("case", sorted(ADAPTER))
@pytest.mark.parametrize("layout", ["tp2ep2", "tp1ep4"])
def test_sync_histograms_equals_single_process(daemon, repaired, case, layout):
    ref, captured = _reference(case)
    want = {n: getattr(q, "_amax", None) for n, q in ref.named_modules()
            if isinstance(q, mtq.nn.TensorQuantizer) and isinstance(q._calibrator,
                                                                    HistogramCalibrator)}
    _, _, method, kw = ADAPTER[case]

    def rank(r):
        lay = toy.amaxd_layout(layout, r)
        m = _histogram_model(toy.shard_model(toy.full_model(), layout, r), case)
        with daemon.client(f"adapter-{case}-{layout}".replace("_", "-"), r, toy.W) as c:
            c.join()
            amo.sync_histograms(c, m, lay, lambda mm: toy.replay(mm, captured, layout, r), method,
                                column=toy.COLUMN, row=toy.ROW, **kw)
        return lay, m

    with ThreadPoolExecutor(toy.W) as ex:
        shards = list(ex.map(rank, range(toy.W)))
    checked = 0
    for lay, m in shards:
        for n, q in m.named_modules():
            if not isinstance(q, mtq.nn.TensorQuantizer) or not q.is_enabled:
                continue
            g = amo.global_name(m, n, lay)
            w = want[g]
            got = getattr(q, "_amax", None)
            if w is None:  # no rank fed it: none, as one process leaves it
                assert got is None, (layout, g)
                continue
            assert got is not None and got.numpy().tobytes() == w.numpy().tobytes(), \
                (case, layout, g, got, w)
            assert q._if_quant and not q._if_calib
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("cfg_name", ["fp8", "fp8_channel"])
@pytest.mark.parametrize("layout", ["tp2ep2", "tp1ep4"])
def test_sync_mse_equals_single_process(daemon, cfg_name, layout):
    """ModelOpt's mse_calibrate (multiplier search on the weights) in one
    process vs max calibration per shard, amaxd.modelopt.sync (the max),
    then amaxd.modelopt.sync_mse: every weight's _amax the same bytes."""
    from common import CONFIGS
    cfg = copy.deepcopy(CONFIGS[cfg_name])
    cfg["algorithm"] = "mse"
    ref, captured = toy.calibrate_full(
        lambda mm, loop: mtq.quantize(mm, cfg, loop))
    want = {n: q._amax.clone() for n, q in ref.named_modules()
            if n.endswith("weight_quantizer") and isinstance(q, mtq.nn.TensorQuantizer)
            and q.is_enabled}

    def rank(r):
        lay = toy.amaxd_layout(layout, r)
        m = toy.shard_model(toy.full_model(), layout, r)
        mtq.quantize(m, copy.deepcopy(CONFIGS[cfg_name]),
                     lambda mm: toy.replay(mm, captured, layout, r))
        with daemon.client(f"mse-{cfg_name}-{layout}".replace("_", "-"), r, toy.W) as c:
            c.join()
            amo.sync(c, m, lay, column=toy.COLUMN, row=toy.ROW, moe_share=amo.supports_share())
            res = amo.sync_mse(c, m, lay, column=toy.COLUMN, row=toy.ROW)
        return lay, m, res

    with ThreadPoolExecutor(toy.W) as ex:
        shards = list(ex.map(rank, range(toy.W)))
    checked = 0
    for lay, m, res in shards:
        tp, tpr = lay.tp_size, lay.tp_rank
        for n, q in m.named_modules():
            if not n.endswith("weight_quantizer") or not isinstance(q, mtq.nn.TensorQuantizer) \
                    or not q.is_enabled:
                continue
            g = amo.global_name(m, n, lay)
            w = want[g]
            if w.numel() > 1 and n.rsplit(".", 2)[-2] in toy.COLUMN and tp > 1:
                rows = w.shape[0] // tp
                w = w[tpr * rows:(tpr + 1) * rows]
            assert q._amax.numpy().tobytes() == w.numpy().tobytes(), (cfg_name, layout, g)
            assert res[g + ".mse"].stat_state == amaxd.pb.STAT_COMPUTED
            checked += 1
    assert checked >= 4 * 10
