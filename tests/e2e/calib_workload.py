"""A calibration with calibrators beyond max (issue 23), run by W trainer
ranks in threads against one daemon or a cluster: the same data split over
the ranks in several ways, two passes through the API (the max, then the
statistic against the agreed basis), the results collected for comparison.

Quantizers:
  act.<method>   per-tensor histogram quantizers of one activation, one per
                 histogram method (entropy, percentile 99.9 and 0/50/100,
                 mse on the integer and E4M3 grids, skip_zeros)
  fc.weight      an MSE-search quantizer [C_OUT] of a weight [C_OUT, C_IN]
                 (per output channel), tensor-parallel: column-parallel
                 ranks own rows (a block of channels), row-parallel ranks
                 own columns (every channel, partial sums of its loss)
  fc.wtensor     an MSE-search quantizer [] of the same weight (per tensor)

Layouts split the activation's values (DP: whole batches per rank; TP: a
slice of every batch's features per rank; EP: tokens routed to experts, an
expert's tokens on its EP rank, some ranks none at all) and the weight
(column- or row-parallel over the TP ranks, replicated over DP: only DP
rank 0 of each TP rank sends the weight's losses, so that each element is
counted once).
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import amaxd
from amaxd import calib

BATCHES, TOKENS, FEATURES = 6, 96, 64
C_OUT, C_IN = 12, 40

# The torch CPU build whose arithmetic the calibrators reproduce: fixed, so
# that the tests do not depend on the host (both compute the same edges).
CPU = "avx2"

HIST = {
    "act.entropy": amaxd.Calibrator.histogram("entropy", 256, start_bin=16, stride=2,
                                              torch_cpu_build=CPU),
    "act.pct": amaxd.Calibrator.histogram("percentile", 2048, percentile=99.9,
                                          torch_cpu_build=CPU),
    "act.pct0": amaxd.Calibrator.histogram("percentile", 512, percentile=0.0, torch_cpu_build=CPU),
    "act.pct50": amaxd.Calibrator.histogram("percentile", 512, percentile=50.0,
                                            torch_cpu_build=CPU),
    "act.pct100": amaxd.Calibrator.histogram("percentile", 512, percentile=100.0,
                                             torch_cpu_build=CPU),
    "act.mse": amaxd.Calibrator.histogram("mse", 512, start_bin=32, torch_cpu_build=CPU),
    "act.mse_e4m3": amaxd.Calibrator.histogram("mse", 512, grid="e4m3", start_bin=32,
                                               torch_cpu_build=CPU),
    "act.skipz": amaxd.Calibrator.histogram("percentile", 1024, percentile=99.0, skip_zeros=True,
                                            torch_cpu_build=CPU),
}
MSE = amaxd.Calibrator.mse(0.25, 4.0, 0.1, torch_cpu_build=CPU)


def data(seed=0):
    """The global data: activation batches [BATCHES, TOKENS, FEATURES]
    (heavy-tailed, with zeros), expert routing per token, a weight."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3.0, size=(BATCHES, TOKENS, FEATURES)).astype(np.float32)
    x[rng.random(x.shape) < 0.1] = 0.0
    route = rng.integers(0, 4, size=(BATCHES, TOKENS))
    route[route == 3] = 2  # expert 3 gets no tokens: its EP rank sees nothing
    w = (rng.standard_normal((C_OUT, C_IN)) * np.exp(rng.uniform(-1, 1, (C_OUT, 1)))
         ).astype(np.float32)
    return x, route, w


def fake_quant_e4m3(x, amax):
    """The weight's quantizer: FP8 E4M3 fake quantization with scale
    448 / amax, float32, as ModelOpt's fp8_eager (numpy; ml_dtypes-free:
    round to nearest even on the E4M3 grid)."""
    x = np.asarray(x, np.float32)
    amax = np.asarray(amax, np.float32)
    scale = (np.float32(1.0) / np.where(amax <= 2.0 ** -24, np.float32(1.0), amax)).astype(
        np.float32) * np.float32(448.0)
    v = np.clip((x * scale).astype(np.float32), -448.0, 448.0)
    a = np.abs(v)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -9))).clip(-6, 8)
    step = np.exp2(e - 3)
    q = (np.round(a / step) * step).astype(np.float32)  # np.round: half to even
    q = np.minimum(q, 448.0)
    return (np.sign(v) * q).astype(np.float32) * (np.float32(1.0) / scale).astype(np.float32)


LAYOUTS = {
    # name: (world, tp, ep, dp)
    "single": (1, 1, 1, 1),
    "dp2": (2, 1, 1, 2),
    "tp4": (4, 4, 1, 1),
    "tp2dp2": (4, 2, 1, 2),
    "ep4dp2": (8, 1, 4, 2),
    "tp2ep2dp2": (8, 2, 2, 2),
    "dp8": (8, 1, 1, 8),
}


def coords(layout, rank):
    world, tp, ep, dp = LAYOUTS[layout]
    return rank % tp, (rank // tp) % ep, rank // (tp * ep)


def act_shard(layout, rank, x, route):
    """This rank's activation values: a partition of all of them."""
    world, tp, ep, dp = LAYOUTS[layout]
    t, e, d = coords(layout, rank)
    batches = [b for b in range(BATCHES) if b % dp == d]
    f0, f1 = t * FEATURES // tp, (t + 1) * FEATURES // tp
    parts = []
    for b in batches:
        toks = x[b] if ep == 1 else x[b][route[b] % ep == e]
        parts.append(toks[:, f0:f1].reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def weight_shard(layout, rank, w, row_parallel):
    """(block of the weight, placement of the [C_OUT] amax, sends losses?)"""
    world, tp, ep, dp = LAYOUTS[layout]
    t, e, d = coords(layout, rank)
    if row_parallel:
        c0, c1 = t * C_IN // tp, (t + 1) * C_IN // tp
        blk = w[:, c0:c1]
        pl = None  # every channel, max-merged, losses summed
    else:
        r0, r1 = t * C_OUT // tp, (t + 1) * C_OUT // tp
        blk = w[r0:r1]
        pl = amaxd.Placement([r0], [r1 - r0])
    return blk, pl, d == 0 and e == 0


def quantizers(pl):
    q = [amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current(), calibrator=c) for n, c in HIST.items()]
    q.append(amaxd.Quantizer("fc.weight", [C_OUT], amaxd.Recipe.fp8_current(), placement=pl,
                             calibrator=MSE))
    q.append(amaxd.Quantizer("fc.wtensor", [], amaxd.Recipe.fp8_current(), calibrator=MSE))
    return q


def run_rank(socket, job, layout, rank, seed=0, row_parallel=False, packed=False, shm=False):
    """One rank's two passes (named form, or `packed`: SendPacked with the
    statistics and ReconcilePacked, through the daemon's shared-memory
    buffer with `shm`); returns {name: Result} of both epochs."""
    world = LAYOUTS[layout][0]
    x, route, w = data(seed)
    act = act_shard(layout, rank, x, route)
    blk, pl, owner = weight_shard(layout, rank, w, row_parallel)
    with amaxd.Client(job, rank, world, socket=socket, shm=shm) as c:
        c.join()
        c.register(quantizers(pl))
        # Pass 1: the max.
        amax = np.abs(act).max() if act.size else None
        m = {n: (amaxd.Masked(0.0, True) if amax is None else float(amax)) for n in HIST}
        m["fc.weight"] = np.abs(blk).max(axis=1)
        m["fc.wtensor"] = float(np.abs(blk).max())
        if packed:
            L = c.layout()
            slab, has = L.pack(m)
            c.send_packed(slab, has)
            res = c.reconcile_packed()
            r1 = {n: res[n] for n in L.names}
        else:
            c.send(m)
            r1 = c.reconcile()
        # Pass 2: the statistic against the agreed basis.
        s = {}
        for n, cal in HIST.items():
            s[n] = amaxd.Stat(calib.histogram(act, r1[n].stat_basis, cal), r1[n].stat_epoch)
        if owner:
            # Per output channel: this rank's rows (column-parallel) or its
            # part of every row (row-parallel), against the agreed maxima.
            losses = calib.mse_losses(blk, r1["fc.weight"].stat_basis, MSE, fake_quant_e4m3,
                                      axis=0)
            s["fc.weight"] = amaxd.Stat(losses, r1["fc.weight"].stat_epoch)
            s["fc.wtensor"] = amaxd.Stat(
                calib.mse_losses(blk, r1["fc.wtensor"].stat_basis, MSE, fake_quant_e4m3),
                r1["fc.wtensor"].stat_epoch)
        if packed:
            L = c.layout()
            c.send_packed(L.empty(), np.zeros(L.total_cells, np.uint8), stats=s)
            res = c.reconcile_packed()
            r2 = {n: res[n] for n in L.names}
        else:
            c.send(s)
            r2 = c.reconcile()
        whole = c.get_scales(whole=True)
    return {"r1": r1, "r2": r2, "whole": whole}


def run_layout(sockets, job, layout, seed=0, row_parallel=False, packed=False, shm=False):
    """All ranks of a layout in threads; rank r talks to sockets[r % len]."""
    world = LAYOUTS[layout][0]
    with ThreadPoolExecutor(max_workers=world) as ex:
        futs = [ex.submit(run_rank, sockets[r % len(sockets)], job, layout, r, seed, row_parallel,
                          packed, shm)
                for r in range(world)]
        return [f.result(timeout=300) for f in futs]


def whole_bytes(res):
    """The bytes that must not depend on the layout: every quantizer's
    whole amax, scales and statistic."""
    out = {}
    for n, r in sorted(res["whole"].items()):
        out[n] = (r.amax.tobytes(), r.scale.tobytes(), r.scale_inv.tobytes(),
                  np.float32(r.global_amax).tobytes(), r.stat_state,
                  None if r.stat_basis is None else r.stat_basis.tobytes(), r.stat_total,
                  r.stat_overflow)
    return out


def reference(seed=0):
    """What one process that saw all the data computes, through the same
    helpers: the histogram of all activation values and the losses of the
    whole weight (the methods themselves are the daemon's; the ModelOpt
    tier compares those with ModelOpt)."""
    x, route, w = data(seed)
    allv = x.reshape(-1)
    g = np.float32(np.abs(allv).max())
    hists = {n: calib.histogram(allv, g, cal) for n, cal in HIST.items()}
    basis_c = np.abs(w).max(axis=1)
    losses_c = calib.mse_losses(w, basis_c, MSE, fake_quant_e4m3, axis=0)
    basis_t = np.float32(np.abs(w).max())
    losses_t = calib.mse_losses(w, basis_t, MSE, fake_quant_e4m3)
    return g, hists, basis_c, losses_c, basis_t, losses_t
