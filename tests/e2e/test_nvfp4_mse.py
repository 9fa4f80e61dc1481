"""The NVFP4 per-block search (Calibrator.nvfp4_mse, issue 23 item 3):
phase 1 reconciles the max and fixes the global amax, phase 2 the rank
that owns each block sends the amax it chose; every rank reads the same
blocks, the global amax stays phase 1's, and bad input is refused whole
with a precise status. The search itself (ModelOpt 0.47's
NVFP4MSECalibrator, calib/mse.py) is checked against ModelOpt in
tests/modelopt/test_nvfp4_mse.py."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import amaxd
from amaxd import calib
from amaxd.errors import FailedPrecondition, InvalidArgument

CAL = amaxd.Calibrator.nvfp4_mse()
R, C = 8, 64  # weight rows, columns: blocks [8, 4]


def weight(seed=3):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((R, C)).astype(np.float32)
    w *= np.exp2(rng.integers(-6, 6, (R, 1))).astype(np.float32)
    w[rng.random(w.shape) < 0.1] = 0
    w[0, :16] = 0  # an all-zero block
    return w


def block_max(w):
    return np.abs(w).reshape(w.shape[0], -1, 16).max(axis=-1)


def spec(name, tp, rank, scale_group=""):
    shape = (R, C // 16)
    pl = amaxd.placement.column_parallel(shape, rank, tp) if tp > 1 else None
    return amaxd.Quantizer(name, shape, amaxd.Recipe.nvfp4("modelopt_static", output="modelopt"),
                           pl, scale_group=scale_group, calibrator=CAL)


def run_tp(daemon, job, w, tp):
    """Both phases over `tp` column-parallel ranks (rows split)."""
    def rank(r):
        rows = slice(r * R // tp, (r + 1) * R // tp)
        with daemon.client(job, r, tp) as c:
            c.join()
            c.register([spec("w", tp, r)])
            c.send({"w": block_max(w[rows])})
            r1 = c.reconcile()["w"]
            assert r1.stat_state == amaxd.pb.STAT_AGREED and r1.stat_epoch == 1
            amax = calib.nvfp4_mse_amax(w[rows], r1.stat_basis)
            c.send({"w": amaxd.Stat(amax, r1.stat_epoch)})
            return r1, c.reconcile()["w"], amax

    with ThreadPoolExecutor(tp) as ex:
        return list(ex.map(rank, range(tp)))


def test_two_phases_tp1_tp2(daemon):
    w = weight()
    g = np.float32(np.abs(w).max())
    whole = calib.nvfp4_mse_amax(w, [g]).astype(np.float32)
    for tp in (1, 2):
        outs = run_tp(daemon, f"fp4mse-tp{tp}", w, tp)
        for r, (r1, res, sent) in enumerate(outs):
            rows = slice(r * R // tp, (r + 1) * R // tp)
            assert np.all(r1.stat_basis == g)  # the basis: the global amax, per block
            assert res.stat_state == amaxd.pb.STAT_COMPUTED
            assert res.stat_total == R * C // 16 and res.stat_overflow == 0
            assert res.amax.tobytes() == whole[rows].tobytes()
            assert np.float32(res.global_amax) == g  # phase 1's, not the blocks' max
            # The block scales are the recipe's on the searched amax.
            assert res.amax.tobytes() == sent.astype(np.float32).tobytes()
        # Every rank's global scale is the same (ModelOpt's weight_scale_2).
        assert len({o[1].global_scale_inv for o in outs}) == 1


def test_global_amax_of_blocks_below_the_max(daemon):
    """A block whose search picks less than its max: the global amax (and
    global scale) stay phase 1's."""
    w = np.zeros((R, C), np.float32)
    w[:, :] = 0.01
    w[3, 5] = 100.0  # one outlier: its block's best amax is below 100?
    with daemon.client("fp4mse-global", 0, 1) as c:
        c.join()
        c.register([spec("w", 1, 0)])
        c.send({"w": block_max(w)})
        r1 = c.reconcile()["w"]
        g = np.float32(r1.stat_basis.reshape(-1)[0])
        lower = np.full((R, C // 16), g * calib.nvfp4_mse_candidates()[100], np.float32)
        c.send({"w": amaxd.Stat(lower.astype(np.float64), r1.stat_epoch)})
        res = c.reconcile()["w"]
        assert res.amax.tobytes() == lower.tobytes()
        assert np.float32(res.global_amax) == g == np.float32(100.0)


def test_bad_input_changes_nothing(daemon):
    with daemon.client("fp4mse-bad", 0, 1) as c:
        c.join()
        c.register([spec("w", 1, 0), amaxd.Quantizer("plain", [], amaxd.Recipe.fp8_current())])
        good = np.full((R, C // 16), 1.0)
        # Phase 2 before phase 1: no basis yet.
        with pytest.raises(FailedPrecondition, match="has no agreed basis yet"):
            c.send({"w": amaxd.Stat(good, 1)})
        w = weight()
        c.send({"w": block_max(w), "plain": 1.0})
        r1 = c.reconcile()["w"]
        ep, g = r1.stat_epoch, np.float32(r1.stat_basis.reshape(-1)[0])
        ok = calib.nvfp4_mse_amax(w, r1.stat_basis)
        cand = (g * calib.nvfp4_mse_candidates()).astype(np.float32)
        cases = [
            (ok.reshape(-1)[:-1], InvalidArgument,
             "has 32 blocks; its statistic is one amax per block \\(got 31 values\\)"),
            (np.r_[ok.reshape(-1), 1.0], InvalidArgument, "got 33 values"),
            (np.r_[ok.reshape(-1)[:-1], np.nan], InvalidArgument,
             "statistic\\[31\\] = nan; block amaxes must be finite and >= 0"),
            (np.r_[ok.reshape(-1)[:-1], -cand[3]], InvalidArgument, "statistic\\[31\\] = -"),
            (np.r_[ok.reshape(-1)[:-1], np.inf], InvalidArgument, "must be finite"),
            (np.r_[ok.reshape(-1)[:-1], float(g) * 2], InvalidArgument,
             "block 31 of rank 0's block: amax .* is above the global amax"),
            (np.r_[ok.reshape(-1)[:-1], (float(cand[40]) + float(cand[41])) / 2],
             InvalidArgument, "is not one of the candidates"),
            # A float32 candidate's float64 neighbour is not a candidate.
            (np.r_[ok.reshape(-1)[:-1], np.nextafter(float(cand[40]), 0.0)],
             InvalidArgument, "is not one of the candidates"),
        ]
        for vals, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                c.send({"w": amaxd.Stat(np.asarray(vals, float), ep)})
        with pytest.raises(FailedPrecondition, match="basis of epoch 7"):
            c.send({"w": amaxd.Stat(ok, 7)})
        # One bad update refuses the whole request, the good one and the max too.
        with pytest.raises(InvalidArgument, match="above the global amax"):
            c.send({"w": amaxd.Stat(ok * 0 + float(g) * 4, ep), "plain": 9.0})
        r = c.reconcile()
        assert r["w"].stat_state == amaxd.pb.STAT_AGREED and r["w"].stat_total == 0
        assert r["w"].amax.tobytes() == block_max(w).tobytes()  # still the max
        assert r["plain"].amax.tolist() == 1.0
        # Specs: NVFP4 blocks only, RUNNING_MAX, no peer group or slices, no options.
        nv = amaxd.Recipe.nvfp4("modelopt_static", output="modelopt")
        for q, msg in [
            (amaxd.Quantizer("a", [4], amaxd.Recipe.fp8_current(), calibrator=CAL),
             "needs format NVFP4 and a global_shape of blocks"),
            (amaxd.Quantizer("b", [], nv, calibrator=CAL), "with 0 dimensions"),
            (amaxd.Quantizer("c", [4, 2], nv, calibrator=CAL, peer_group="p"),
             "cannot be combined with a peer_group or global_axes"),
            (amaxd.Quantizer("d", [4, 2], nv, calibrator=CAL, global_axes=1),
             "cannot be combined with a peer_group or global_axes"),
            (amaxd.Quantizer("e", [4, 2], nv, calibrator=CAL, accumulation=amaxd.pb.PER_EPOCH),
             "needs accumulation RUNNING_MAX"),
            (amaxd.Quantizer("f", [4, 2], nv, calibrator=amaxd.Calibrator(
                kind=amaxd.pb.CALIBRATOR_NVFP4_MSE, step_size=0.1)), "takes no other field"),
        ]:
            with pytest.raises(InvalidArgument, match=msg):
                c.register([q])
        # The good statistic still goes in, and is what the answer says.
        c.send({"w": amaxd.Stat(ok, ep)})
        r = c.reconcile()["w"]
        assert r.stat_state == amaxd.pb.STAT_COMPUTED
        assert r.amax.tobytes() == ok.astype(np.float32).tobytes()
        # Sent again with the same amaxes (a replica, or a retry): harmless.
        c.send({"w": amaxd.Stat(ok, ep)})
        r = c.reconcile()["w"]
        assert r.stat_state == amaxd.pb.STAT_COMPUTED and r.stat_overflow == 0
        assert r.amax.tobytes() == ok.astype(np.float32).tobytes()


def test_replicas_and_disagreement(daemon):
    """Two DP ranks holding the same whole weight: both may send the same
    amaxes; blocks for which they differ keep their max and are counted in
    stat_overflow on every rank; a Reset starts the quantizer over."""
    w = weight(5)

    def rank(r):
        with daemon.client("fp4mse-dp", r, 2) as c:
            c.join()
            q = spec("w", 1, 0)
            c.register([amaxd.Quantizer(q.name, q.global_shape, q.recipe,
                                        amaxd.placement.replicated(q.global_shape),
                                        calibrator=CAL)])
            c.send({"w": block_max(w)})
            r1 = c.reconcile()["w"]
            amax = calib.nvfp4_mse_amax(w, r1.stat_basis)
            c.send({"w": amaxd.Stat(amax, r1.stat_epoch)})
            agree = c.reconcile()["w"]
            if r == 1:  # rank 1 now sends another amax for block (2, 1)
                other = amax.copy()
                g = np.float32(r1.stat_basis.reshape(-1)[0])
                other[2, 1] = g  # the largest candidate
                if other[2, 1] == amax[2, 1]:
                    other[2, 1] = g * calib.nvfp4_mse_candidates()[0]
                c.send({"w": amaxd.Stat(other, r1.stat_epoch)})
            clash = c.reconcile()["w"]
            c.reset(["w"])
            c.send({"w": block_max(w)})
            after = c.reconcile()["w"]
            return amax, agree, clash, after

    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(rank, range(2)))
    amax = outs[0][0].astype(np.float32)
    for _, agree, clash, after in outs:
        assert agree.stat_state == amaxd.pb.STAT_COMPUTED and agree.stat_overflow == 0
        assert agree.amax.tobytes() == amax.tobytes()
        assert clash.stat_state == amaxd.pb.STAT_AGREED and clash.stat_overflow == 1
        want = amax.copy()
        want[2, 1] = block_max(w)[2, 1]
        assert clash.amax.tobytes() == want.tobytes()
        assert clash.stat_total == amax.size - 1
        assert after.stat_overflow == 0 and after.stat_epoch > agree.stat_epoch
        assert after.amax.tobytes() == block_max(w).tobytes()


def test_packed_form(daemon):
    """SendPacked carries the block amaxes in the stat slab (one float64
    per block of the rank's block), as the named form does."""
    w = weight(7)
    with daemon.client("fp4mse-packed", 0, 1) as c:
        c.join()
        c.register([spec("w", 1, 0)])
        L = c.layout()
        assert L.calibrators == [amaxd.pb.CALIBRATOR_NVFP4_MSE]
        assert L.total_stats == R * C // 16
        c.send_packed(block_max(w).reshape(-1))
        r1 = c.reconcile_packed()["w"]
        amax = calib.nvfp4_mse_amax(w, r1.stat_basis)
        c.send_packed(np.zeros(R * C // 16, np.float32), np.zeros(R * C // 16, np.uint8),
                      stats={"w": amaxd.Stat(amax, r1.stat_epoch)})
        res = c.reconcile_packed()["w"]
        assert res.stat_state == amaxd.pb.STAT_COMPUTED
        assert np.asarray(res.amax).tobytes() == amax.astype(np.float32).tobytes()
