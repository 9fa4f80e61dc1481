"""Calibrators beyond max through one daemon (issue 23, docs/API.md
"Calibration beyond max"): histogram quantizers (every method) and
MSE-search quantizers fed the same data split over 1, 2, 4 and 8 ranks in
DP, TP, EP layouts give the same bytes, equal to what one process that saw
all the data computes; the protocol's states, Reset, overflow, snapshots;
and bad input gets a precise status and changes nothing. The methods
themselves are compared with ModelOpt in tests/modelopt."""
import ctypes
import json
import os
import subprocess

import numpy as np
import pytest

import amaxd
import calib_workload as W
from amaxd import calib
from amaxd.errors import FailedPrecondition, InvalidArgument

LIB = os.path.join(os.path.dirname(os.path.abspath(os.environ.get("AMAXD_BIN", "build/amaxd"))),
                   "libamaxd_calib.so")


def method_amax(cal, counts, g):
    """The daemon's own arithmetic on a histogram (libamaxd_calib.so)."""
    L = ctypes.CDLL(LIB)
    L.amx_hist_amax.restype = ctypes.c_float

    class Cal(ctypes.Structure):
        _fields_ = [("kind", ctypes.c_uint8), ("method", ctypes.c_uint8), ("grid", ctypes.c_uint8),
                    ("is_unsigned", ctypes.c_uint8), ("skip_zeros", ctypes.c_uint8),
                    ("torch_cpu", ctypes.c_uint8), ("pad", ctypes.c_uint16),
                    ("num_bins", ctypes.c_uint32), ("num_bits", ctypes.c_uint32),
                    ("start_bin", ctypes.c_uint32), ("stride", ctypes.c_uint32),
                    ("nsteps", ctypes.c_uint32), ("percentile", ctypes.c_double),
                    ("start_mult", ctypes.c_double), ("stop_mult", ctypes.c_double),
                    ("step_size", ctypes.c_double)]

    c = Cal(cal.kind, cal.method, cal.grid, int(cal.is_unsigned), int(cal.skip_zeros),
            cal.torch_cpu, 0, cal.num_bins, cal.num_bits, cal.start_bin, cal.stride, 0,
            cal.percentile, 0.0, 0.0, 0.0)
    h = np.ascontiguousarray(counts, dtype=np.float64)
    scratch = np.zeros(1 << 22, np.uint8)
    return np.float32(L.amx_hist_amax(ctypes.byref(c), h.ctypes.data_as(
        ctypes.POINTER(ctypes.c_double)), ctypes.c_float(g), scratch.ctypes.data_as(ctypes.c_void_p)))


@pytest.fixture(scope="module")
def layouts_run(tmp_path_factory):
    """Every layout of calib_workload through one daemon (its own job each)."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from amaxd_proc import Daemon
    d = Daemon(str(tmp_path_factory.mktemp("calib")))
    try:
        out = {}
        for name in W.LAYOUTS:
            out[name] = W.run_layout([d.socket], f"calib-{name}", name)
        out["tp4_row"] = W.run_layout([d.socket], "calib-tp4-row", "tp4", row_parallel=True)
        out["packed_tp2ep2dp2"] = W.run_layout([d.socket], "calib-packed", "tp2ep2dp2",
                                               packed=True)
        yield out
    finally:
        rc = d.stop()
        d.check_clean_exit(rc)


def test_layouts_give_the_same_bytes(layouts_run):
    ref = W.whole_bytes(layouts_run["single"][0])
    for name, ranks in layouts_run.items():
        for r, res in enumerate(ranks):
            assert W.whole_bytes(res) == ref, f"layout {name}, rank {r}"
            # Every rank's own answer is its block of the whole tensors.
            for q, x in res["r2"].items():
                assert x.stat_state == amaxd.pb.STAT_COMPUTED, (name, r, q)
                assert np.float32(x.global_amax) == np.float32(res["whole"][q].global_amax)


def test_methods_through_stat_hist(start_daemon, layouts_run):
    """The histogram methods through the state's stat_hist, as the CUDA
    backend runs them on the device (the host backend's test aid
    AMAXD_TEST_STAT_HIST runs the same steps, calib_core.h, one after the
    other, and leaves every other quantizer to the engine's host path):
    the same bytes as the host path, per rank and for the whole state."""
    d = start_daemon(env={"AMAXD_TEST_STAT_HIST": "1"})
    for name in ("tp2dp2", "ep4dp2"):
        ranks = W.run_layout([d.socket], f"stat-hist-{name}", name)
        for r, res in enumerate(ranks):
            assert W.whole_bytes(res) == W.whole_bytes(layouts_run[name][r]), (name, r)
            for q, x in res["r2"].items():
                assert x.amax.tobytes() == layouts_run[name][r]["r2"][q].amax.tobytes()


def test_packed_answers_equal_named(layouts_run):
    """The packed form's answers (ReconcilePacked) carry the same statistic
    fields and bytes as the named ones of the same layout."""
    named, packed = layouts_run["tp2ep2dp2"], layouts_run["packed_tp2ep2dp2"]
    for r in range(len(named)):
        for ep in ("r1", "r2"):
            for q, a in named[r][ep].items():
                b = packed[r][ep][q]
                assert a.amax.tobytes() == b.amax.tobytes(), (r, ep, q)
                assert (a.stat_state, a.stat_epoch, a.stat_total, a.stat_overflow) == \
                    (b.stat_state, b.stat_epoch, b.stat_total, b.stat_overflow), (r, ep, q)
                assert (a.stat_basis is None) == (b.stat_basis is None)
                if a.stat_basis is not None:
                    assert a.stat_basis.tobytes() == b.stat_basis.tobytes()


def test_packed_wire_and_bad_stats(daemon):
    """The hand-encoded SendPacked with statistics parses as protobuf does;
    malformed packed statistics are refused whole."""
    from amaxd import wire
    v = np.arange(3, dtype=np.float32)
    st, ep = np.array([1.0, 2.0, 0.5]), np.array([7, 0], dtype=np.uint64)
    raw = wire.encode_send_packed("j", 2, 5, 0x1234, v, None, st, ep)
    m = amaxd.pb.SendPackedRequest.FromString(raw)
    assert (m.job, m.rank, m.epoch, m.layout_id) == ("j", 2, 5, 0x1234)
    assert m.stats == st.tobytes() and m.stat_epochs == ep.tobytes() and m.values == v.tobytes()
    cal = amaxd.Calibrator.histogram("percentile", 4, percentile=50.0, torch_cpu_build="avx2")
    with daemon.client("packed-bad", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(), calibrator=cal),
                    amaxd.Quantizer("p", [2], amaxd.Recipe.fp8_current())])
        L = c.layout()
        assert L.calibrators == [amaxd.pb.CALIBRATOR_HISTOGRAM, amaxd.pb.CALIBRATOR_MAX]
        assert L.total_stats == 5 and L.stat_span("h") == (0, 5)
        c.send_packed(np.array([4.0, 1.0, 1.0], np.float32))
        res = c.reconcile_packed()
        e1 = res["h"].stat_epoch
        assert e1 == 1 and res["h"].stat_basis.tolist() == 4.0 and res["p"].stat_state == 0
        good = np.array([1.0, 0, 2, 3, 0])
        zeros = np.zeros(3, np.float32)
        for stats, epochs, msg in [
            (good[:4], [e1, 0], "32 bytes of stats and 16 of stat_epochs; the layout .* has 5"),
            (good, [e1], "and 8 of stat_epochs"),
            (good, [0, 0], r"has a statistic .* but stat_epochs\[0\] is 0"),
            (good, [e1, 3], r"stat_epochs\[1\] is 3 for quantizer 'p', which takes no"),
            (np.r_[good[:4], -1], [e1, 0], r"statistic\[4\] = -1"),
            (good, [e1 + 1, 0], "names the basis of epoch 2"),
        ]:
            s = np.asarray(stats, "<f8")
            raw = wire.encode_send_packed("packed-bad", 0, 0, L.id, zeros, np.zeros(3, np.uint8),
                                          s, np.asarray(epochs, "<u8"))
            with pytest.raises((InvalidArgument, FailedPrecondition), match=msg):
                c._raw("SendPacked", raw, amaxd.pb.SendAmaxResponse.FromString)
        c.send_packed(zeros, np.zeros(3, np.uint8), stats={"h": amaxd.Stat(good, e1)})
        res = c.reconcile_packed()
        assert res["h"].stat_total == 6 and res["h"].stat_overflow == 0


def test_equal_to_one_process(layouts_run):
    g, hists, basis_c, losses_c, basis_t, losses_t = W.reference()
    whole = layouts_run["dp8"][3]["whole"]
    for n, cal in W.HIST.items():
        r = whole[n]
        assert r.stat_basis.tolist() == g and r.stat_state == amaxd.pb.STAT_COMPUTED
        assert r.stat_total == hists[n][:-1].sum() and r.stat_overflow == 0.0
        want = method_amax(cal, hists[n], g)
        assert r.amax.tobytes() == want.tobytes(), n
        assert r.scale.tobytes() == np.float32(448.0 / want if want > 0 else 1.0).tobytes()
    # The percentile of the numpy formula itself (ModelOpt's, transcribed).
    h = hists["act.pct"][:-1]
    e = calib.edges(g, W.HIST["act.pct"])
    assert whole["act.pct"].amax.tolist() == e[np.searchsorted(np.cumsum(h / h.sum()), 0.999)]
    assert whole["act.pct0"].amax.tolist() == 0.0
    # MSE search: the argmin of the summed losses, the basis times its candidate.
    cand = calib.mse_candidates(W.MSE)
    k = np.argmin(losses_c, axis=1)
    assert whole["fc.weight"].amax.tobytes() == (basis_c * cand[k]).astype(np.float32).tobytes()
    assert whole["fc.wtensor"].amax.tobytes() == (basis_t * cand[np.argmin(losses_t[0])]).tobytes()
    # The margin of the argmin in this data: far above float64 rounding.
    srt = np.sort(losses_c, axis=1)
    assert np.all((srt[:, 1] - srt[:, 0]) > 1e-9 * srt[:, 0])


def test_protocol_states_reset_overflow(daemon):
    cal = amaxd.Calibrator.histogram("percentile", 64, percentile=100.0, torch_cpu_build="avx2")
    mse = amaxd.Calibrator.mse(0.5, 2.0, 0.5, torch_cpu_build="avx2")
    with daemon.client("states", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(), calibrator=cal),
                    amaxd.Quantizer("m", [3], amaxd.Recipe.fp8_current(), calibrator=mse),
                    amaxd.Quantizer("plain", [], amaxd.Recipe.fp8_current())])
        r = c.reconcile()
        assert r["h"].stat_state == amaxd.pb.STAT_WAITING and r["h"].stat_epoch == 0
        assert r["h"].stat_basis is None and r["plain"].stat_state == amaxd.pb.STAT_NONE
        # Before a basis: statistics are refused.
        with pytest.raises(FailedPrecondition, match="no agreed basis yet"):
            c.send({"h": amaxd.Stat(np.zeros(64), 1)})
        # A cell of "m" without data keeps its basis from being fixed.
        c.send({"h": 6.4, "m": amaxd.Masked(np.array([1.0, 2.0, 3.0], np.float32),
                                            np.array([False, True, False]))})
        r = c.reconcile()
        assert r["h"].stat_state == amaxd.pb.STAT_AGREED and r["h"].stat_epoch == 2
        assert r["h"].stat_basis.tolist() == np.float32(6.4)
        assert r["h"].amax.tolist() == np.float32(6.4)  # the max until counts arrive
        assert r["m"].stat_state == amaxd.pb.STAT_WAITING
        c.send({"m": np.array([1.0, 2.0, 3.0], np.float32)})
        r = c.reconcile()
        assert r["m"].stat_state == amaxd.pb.STAT_AGREED and r["m"].stat_epoch == 3
        assert r["h"].stat_epoch == 2
        # Values above the range: counted in the last bin and in the overflow.
        x = np.array([0.1, 3.2, 6.4, 9.0, 0.0], np.float32)
        counts = calib.histogram(x, r["h"].stat_basis, cal)
        assert counts[-1] == 1 and counts[63] == 2
        c.send({"h": amaxd.Stat(counts, 2),
                "m": amaxd.Stat(np.array([[3, 1, 2, 1], [0, 0, 0, 0], [5, 4, 1, 4]], float), 3)})
        r = c.reconcile()
        assert r["h"].stat_state == amaxd.pb.STAT_COMPUTED
        assert r["h"].stat_total == 5 and r["h"].stat_overflow == 1
        e = calib.edges(np.float32(6.4), cal)
        assert r["h"].amax.tolist() == e[63]  # percentile 100 of counts up to bin 63
        cand = calib.mse_candidates(mse)  # 0.5, 1.0, 1.5, 2.0
        assert r["m"].amax.tolist() == [np.float32(1.0) * cand[1], np.float32(2.0) * cand[0],
                                        np.float32(3.0) * cand[2]]
        # Statistics accumulate over epochs (ModelOpt's collect on every batch).
        c.send({"h": amaxd.Stat(counts, 2)})
        assert c.reconcile()["h"].stat_total == 10
        # Reset clears the statistic and the basis; the next max fixes a new one.
        c.reset(["h"])
        c.send({"h": amaxd.Stat(counts, 2)})  # sent in the reset's epoch: dropped
        r = c.reconcile()
        assert r["h"].stat_state == amaxd.pb.STAT_WAITING and r["h"].stat_total == 0
        c.send({"h": 3.0})
        r = c.reconcile()
        assert r["h"].stat_epoch == 7 and r["h"].stat_basis.tolist() == 3.0
        with pytest.raises(FailedPrecondition, match="basis of epoch 2, the agreed basis is that "
                                                     "of epoch 7"):
            c.send({"h": amaxd.Stat(counts, 2)})
        assert r["m"].stat_state == amaxd.pb.STAT_COMPUTED  # untouched by h's reset
        listed = {q.name: q for q in c.list_quantizers().quantizers}
        assert listed["h"].calibrator.kind == amaxd.pb.CALIBRATOR_HISTOGRAM
        assert listed["h"].calibrator.num_bins == 64
        assert not listed["plain"].HasField("calibrator")


def test_bad_input_changes_nothing(daemon):
    cal = amaxd.Calibrator.histogram("percentile", 16, percentile=90.0, torch_cpu_build="avx2")
    mse = amaxd.Calibrator.mse(0.5, 1.0, 0.25, torch_cpu_build="avx2")
    with daemon.client("bad", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(), calibrator=cal),
                    amaxd.Quantizer("m", [2], amaxd.Recipe.fp8_current(), calibrator=mse),
                    amaxd.Quantizer("plain", [], amaxd.Recipe.fp8_current())])
        c.send({"h": 4.0, "m": [1.0, 2.0], "plain": 1.0})
        r = c.reconcile()
        ep = r["h"].stat_epoch
        assert ep == r["m"].stat_epoch == 1  # registered, fed and agreed in epoch 1
        good = np.arange(16, dtype=float)
        ok_m = np.ones((2, 3))
        cases = [
            ({"h": amaxd.Stat(np.r_[good[:-1], -1.0], ep)}, InvalidArgument,
             r"statistic\[15\] = -1; bin counts must be integers"),
            ({"h": amaxd.Stat(np.r_[good[:-1], np.nan], ep)}, InvalidArgument,
             r"statistic\[15\] = nan"),
            ({"h": amaxd.Stat(np.r_[good[:-1], 2.5], ep)}, InvalidArgument, "integers"),
            ({"h": amaxd.Stat(np.r_[good[:-1], 2.0 ** 60], ep)}, InvalidArgument, "2\\^53"),
            ({"h": amaxd.Stat(good[:15], ep)}, InvalidArgument, "has 16 bins; its statistic is 16"),
            ({"h": amaxd.Stat(np.r_[good, 0, 0], ep)}, InvalidArgument, "got 18 values"),
            ({"plain": amaxd.Stat(good, ep)}, InvalidArgument,
             "'plain' is a max quantizer \\(calibrator CALIBRATOR_MAX\\) and takes no statistic"),
            ({"h": amaxd.Stat(good, ep + 5)}, FailedPrecondition, f"basis of epoch {ep + 5}"),
            ({"m": amaxd.Stat(np.ones((2, 2)), ep)}, InvalidArgument, "3 candidates"),
            ({"m": amaxd.Stat(np.r_[1, 1, 1, 1, 1, np.inf], ep)}, InvalidArgument,
             "losses must be finite"),
            # One bad update refuses the whole request: the good ones too.
            ({"m": amaxd.Stat(ok_m, ep), "h": amaxd.Stat(np.r_[good[:-1], -3.0], ep)},
             InvalidArgument, "statistic\\[15\\] = -3"),
        ]
        for req, exc, msg in cases:
            with pytest.raises(exc, match=msg):
                c.send(req)
        # Nothing of the above arrived: the next epoch has no statistic.
        r = c.reconcile()
        assert r["h"].stat_state == amaxd.pb.STAT_AGREED and r["h"].stat_total == 0
        assert r["m"].stat_state == amaxd.pb.STAT_AGREED
        # A stat_epoch without a statistic, and a statistic for a quantizer
        # named twice, are refused too.
        req = amaxd.pb.SendAmaxRequest(job="bad", rank=0, updates=[
            amaxd.pb.AmaxUpdate(name="h", values=np.float32(1).tobytes(), stat_epoch=ep)])
        with pytest.raises(InvalidArgument, match="stat_epoch but no statistic"):
            c._unary("SendAmax", req, amaxd.pb.SendAmaxResponse)
        u = amaxd.pb.AmaxUpdate(name="h", stat=good.tobytes(), stat_epoch=ep)
        with pytest.raises(InvalidArgument, match="named twice"):
            c._unary("SendAmax", amaxd.pb.SendAmaxRequest(job="bad", rank=0, updates=[u, u]),
                     amaxd.pb.SendAmaxResponse)
        # Specs: a histogram over a tensor shape, MSE with groups, fields of
        # another method.
        for q, msg in [
            (amaxd.Quantizer("x", [4], amaxd.Recipe.fp8_current(), calibrator=cal),
             "needs global_shape \\[\\]"),
            (amaxd.Quantizer("y", [4], amaxd.Recipe.fp8_current(), calibrator=mse,
                             peer_group="g"), "cannot be combined with a peer_group"),
            (amaxd.Quantizer("z", [], amaxd.Recipe.fp8_current(),
                             calibrator=amaxd.Calibrator(kind=amaxd.pb.CALIBRATOR_HISTOGRAM,
                                                         num_bins=8, method=amaxd.pb.PERCENTILE,
                                                         percentile=50, stride=1)),
             "PERCENTILE takes percentile only"),
        ]:
            with pytest.raises(InvalidArgument, match=msg):
                c.register([q])
        # The same name with another calibrator: a spec conflict.
        with pytest.raises(FailedPrecondition, match="another recipe or accumulation"):
            c.register([amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(),
                                        calibrator=amaxd.Calibrator.histogram(
                                            "percentile", 32, torch_cpu_build="avx2"))])
        c.send({"h": amaxd.Stat(good, ep)})
        r = c.reconcile()
        assert r["h"].stat_total == good.sum()


def test_snapshot_keeps_the_statistics(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    os.makedirs(state)
    cal = amaxd.Calibrator.histogram("percentile", 32, percentile=50.0, torch_cpu_build="avx2")
    mse = amaxd.Calibrator.mse(0.5, 1.5, 0.5, torch_cpu_build="avx2")
    d = start_daemon(f"--state-dir={state}")
    sock = d.socket
    qs = [amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(), calibrator=cal),
          amaxd.Quantizer("m", [2], amaxd.Recipe.fp8_current(), calibrator=mse)]
    with amaxd.Client("snap", 0, 1, socket=sock) as c:
        c.join()
        c.register(qs)
        c.send({"h": 8.0, "m": [1.0, 4.0]})
        r = c.reconcile()
        c.send({"h": amaxd.Stat(np.arange(32, dtype=float), r["h"].stat_epoch),
                "m": amaxd.Stat(np.array([[2.0, 1, 3], [0, 5, 1]]), r["m"].stat_epoch)})
        before = c.reconcile()
    rc = d.stop()
    d.check_clean_exit(rc)
    d2 = start_daemon(f"--state-dir={state}", socket=sock)
    with amaxd.Client("snap", 0, 1, socket=d2.socket) as c:
        assert c.join().rejoined
        after = c.get_scales()
        for n in ("h", "m"):
            a, b = after[n], before[n]
            assert a.amax.tobytes() == b.amax.tobytes() and a.stat_state == b.stat_state
            assert a.stat_epoch == b.stat_epoch and a.stat_total == b.stat_total
            assert a.stat_basis.tobytes() == b.stat_basis.tobytes()
        # The sums survived: one more histogram adds to them.
        c.send({"h": amaxd.Stat(np.arange(32, dtype=float), before["h"].stat_epoch)})
        r = c.reconcile()
        assert r["h"].stat_total == 2 * np.arange(32).sum()
        assert r["m"].amax.tobytes() == before["m"].amax.tobytes()


def test_export_writes_the_methods_amax(daemon, tmp_path):
    """Export (Python and amaxctl, the same bytes): NAME.amax is the
    calibrated amax and the metadata names the calibrator."""
    from safetensors.numpy import load_file
    from safetensors import safe_open
    cal = amaxd.Calibrator.histogram("percentile", 16, percentile=50.0, torch_cpu_build="avx2")
    mse = amaxd.Calibrator.mse(0.5, 1.5, 0.5, torch_cpu_build="avx2")
    with daemon.client("calexp", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(), calibrator=cal),
                    amaxd.Quantizer("m", [2], amaxd.Recipe.fp8_current(), calibrator=mse),
                    amaxd.Quantizer("p", [2], amaxd.Recipe.fp8_current())])
        c.send({"h": 8.0, "m": [1.0, 4.0], "p": [1.0, 2.0]})
        r = c.reconcile()
        c.send({"h": amaxd.Stat(np.arange(17, dtype=float), r["h"].stat_epoch),
                "m": amaxd.Stat(np.array([[2.0, 1, 3], [0, 5, 1]]), r["m"].stat_epoch)})
        r = c.reconcile()
        assert r["h"].stat_state == r["m"].stat_state == amaxd.pb.STAT_COMPUTED
        py, cl = str(tmp_path / "py.safetensors"), str(tmp_path / "ctl.safetensors")
        assert c.export(py) == 2
    ctl = os.environ.get("AMAXCTL_BIN", os.path.join(os.path.dirname(LIB), "amaxctl"))
    p = subprocess.run([ctl, "--socket", daemon.socket, "export", "calexp", cl],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert open(py, "rb").read() == open(cl, "rb").read()
    got = load_file(py)
    for n in ("h", "m", "p"):
        assert got[n + ".amax"].tobytes() == r[n].amax.tobytes()
        assert got[n + ".scale"].tobytes() == r[n].scale.tobytes()
    assert r["h"].amax.tolist() != np.float32(8.0)  # the method's, not the max
    with safe_open(py, framework="numpy") as f:
        qs = {q["name"]: q for q in json.loads(f.metadata()["amaxd.quantizers"])}
    assert qs["h"]["calibrator"] == "histogram/percentile"
    assert qs["m"]["calibrator"] == "mse" and "calibrator" not in qs["p"]
