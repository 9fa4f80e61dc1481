"""A TP=2 x DP=2 job in 4 client processes, checked against numpy, then the
same data as TP=1: the reconciled bytes must be identical."""
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import numpy as np

import reference as ref
import workers


def run_job(daemon, job, tp, dp):
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=tp * dp, mp_context=ctx) as ex:
        futs = [ex.submit(workers.run_rank, daemon.socket, job, r, tp, dp) for r in range(tp * dp)]
        return [f.result(timeout=120) for f in futs]


def expected_global():
    """Reconciled global amax from the full model, in numpy."""
    w1, w2, x, tokens = workers.model()
    experts = np.array([np.abs(t).max() if t is not None else 0 for t in tokens], np.float32)
    experts[3] = experts[:3].max()  # peer-group fill of the expert that got no tokens
    return {
        "layer0.fc1.weight_quantizer": (np.abs(w1).max(axis=1), "fp8_e4m3"),
        "layer0.fc2.weight_quantizer": (np.abs(w2).max(axis=1), "mxfp8"),
        "layer0.fc1.input_quantizer": (np.array(max(np.abs(b).max() for b in x), np.float32), "nvfp4"),
        "layer0.experts.fc2.input_quantizer": (experts, "fp8_e5m2"),
    }


def test_tp2_dp2_matches_numpy_and_tp1(daemon):
    out = run_job(daemon, "tp2dp2", tp=2, dp=2)
    exp = expected_global()
    for rank, (mine, whole) in enumerate(out):
        for name, (amax, fmt) in exp.items():
            amax = amax.astype(np.float32)
            g = np.float32(amax.max())
            s, si, b, gs, gsi = ref.scales(fmt, amax, g)
            off, shape, a, sc, sci, bb, ga, gsc, gsci, missing = mine[name]
            # This rank's slice of the expected global tensors.
            sl = tuple(slice(o, o + n) for o, n in zip(off, shape))
            for got, want, what in ((a, amax, "amax"), (sc, s, "scale"), (sci, si, "scale_inv")):
                assert got == np.ascontiguousarray(np.asarray(want, np.float32)[sl]).tobytes(), \
                    f"rank {rank} {name} {what}"
            assert bb == np.ascontiguousarray(np.asarray(b, np.uint8)[sl]).tobytes(), f"rank {rank} {name} bytes"
            assert np.float32(ga) == g and np.float32(gsc) == np.float32(gs), f"rank {rank} {name} global"
            assert np.float32(gsci) == np.float32(gsi)
            assert missing == 0
    # Bit-identical on all ranks.
    wholes = [w for _, w in out]
    assert all(w == wholes[0] for w in wholes)
    # The same model and data as TP=1 (one rank sees everything): same bytes.
    single = run_job(daemon, "tp1", tp=1, dp=1)
    assert single[0][1] == wholes[0]


def test_tp2_dp1_also_identical(daemon):
    a = run_job(daemon, "tp2dp1", tp=2, dp=1)
    b = run_job(daemon, "tp1b", tp=1, dp=1)
    assert a[0][1] == b[0][1] == a[1][1]
