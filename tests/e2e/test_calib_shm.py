"""The statistics of calibrators beyond max through the packed form's
shared-memory buffer (SendPacked with shm_stats: the float64 stat slab and
its stat epochs in the slab file, docs/API.md "Packed form over shared
memory"): the same bytes as through gRPC messages for histogram, MSE-search
and NVFP4 per-block-search quantizers over 8 ranks; every bad statistic
refused with the status and sentence the message form gives, and the
shared-memory misuses (statistics in both places, shm_stats without a
buffer, a file that ends inside the statistics) refused precisely; nothing
of a refused request changes the state."""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import amaxd
import calib_workload as W
from amaxd import calib, errors, pb
from amaxd.transport import pwrite_all
from test_nvfp4_mse import R, block_max, spec, weight

RESULT_FIELDS = ("amax", "scale", "scale_inv", "block_scales", "global_amax", "global_scale",
                 "global_scale_inv", "missing", "stat_state", "stat_epoch", "stat_total",
                 "stat_overflow", "stat_basis")


def result_bytes(r):
    return tuple(np.asarray(getattr(r, f)).tobytes() if getattr(r, f) is not None else None
                 for f in RESULT_FIELDS)


def packed_bytes(res):
    """Every array of a PackedResult, as bytes."""
    return {k: np.asarray(v).tobytes() for k, v in vars(res).items()
            if isinstance(v, np.ndarray)}


@pytest.fixture
def shm_daemon(start_daemon, tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return start_daemon(f"--shm-dir={d}")


def test_statistics_through_shm_match_grpc(shm_daemon):
    """Histogram and MSE-search quantizers over 8 ranks (TP2 x EP2 x DP2):
    the packed form's statistics through the buffer give the bytes they
    give through the messages, in every rank's answers of both passes and
    in the whole state."""
    sock = [shm_daemon.socket]
    grpc_run = W.run_layout(sock, "stat-grpc", "tp2ep2dp2", packed=True)
    shm_run = W.run_layout(sock, "stat-shm", "tp2ep2dp2", packed=True, shm=True)
    for r, (a, b) in enumerate(zip(grpc_run, shm_run)):
        for ep in ("r1", "r2"):
            for q in a[ep]:
                assert result_bytes(a[ep][q]) == result_bytes(b[ep][q]), (r, ep, q)
        assert W.whole_bytes(a) == W.whole_bytes(b), r
        for q, x in b["r2"].items():
            assert x.stat_state == pb.STAT_COMPUTED, (r, q)
    # And equal to the named form's (tests/e2e/test_calib.py's reference).
    named = W.run_layout(sock, "stat-named", "tp2ep2dp2")
    assert W.whole_bytes(named[0]) == W.whole_bytes(shm_run[0])


def test_requests_carry_no_statistics(shm_daemon):
    """With a buffer the request holds only the flag: the statistics and
    their epochs are in the slab file at GetLayout's offsets."""
    cal = amaxd.Calibrator.histogram("percentile", 4, percentile=50.0, torch_cpu_build="avx2")
    with shm_daemon.client("stat-flag", 0, 1, shm=True) as c:
        c.join()
        c.register([amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(), calibrator=cal),
                    amaxd.Quantizer("p", [3], amaxd.Recipe.fp8_current())])
        L = c.layout()
        shm = c._shm
        # values 16 bytes, has-data 4: the statistics 8-aligned after them.
        assert (shm.has_data_offset, shm.stats_offset, shm.stat_epochs_offset) == (16, 24, 64)
        c.send_packed(np.array([4.0, 1, 1, 1], np.float32))
        e1 = c.reconcile_packed()["h"].stat_epoch
        raw = c._packed_req(np.zeros(4, np.float32), None, None,
                            stats={"h": amaxd.Stat(np.array([1.0, 0, 2, 3, 0]), e1)})
        m = pb.SendPackedRequest.FromString(raw)
        assert m.shm_stats and m.shm_id == shm.id and not m.stats and not m.stat_epochs
        got = os.pread(shm.slab_fd, 56, 24)
        assert got == np.array([1.0, 0, 2, 3, 0], "<f8").tobytes() + \
            np.array([e1, 0], "<u8").tobytes()
        c._raw("SendPacked", raw, pb.SendAmaxResponse.FromString)
        assert c.reconcile_packed()["h"].stat_total == 6
    # A layout without calibrators gives no offsets.
    with shm_daemon.client("stat-none", 0, 1, shm=True) as c:
        c.join()
        c.register([amaxd.Quantizer("p", [3], amaxd.Recipe.fp8_current())])
        c.layout()
        assert c._shm.stats_offset == 0 and c._shm.stat_epochs_offset == 0


def test_nvfp4_mse_through_shm_matches_grpc(shm_daemon):
    """The NVFP4 per-block search's two phases at TP2, the chosen block
    amaxes through the buffer and through the messages: the same bytes."""
    w = weight(11)

    def run(job, use_shm):
        def rank(r):
            rows = slice(r * R // 2, (r + 1) * R // 2)
            with shm_daemon.client(job, r, 2, shm=use_shm) as c:
                c.join()
                c.register([spec("w", 2, r)])
                L = c.layout()
                c.send_packed(block_max(w[rows]).reshape(-1))
                r1 = c.reconcile_packed()
                amax = calib.nvfp4_mse_amax(w[rows], r1["w"].stat_basis)
                c.send_packed(np.zeros(L.total_cells, np.float32),
                              np.zeros(L.total_cells, np.uint8),
                              stats={"w": amaxd.Stat(amax, r1["w"].stat_epoch)})
                r2 = c.reconcile_packed()
                assert r2["w"].stat_state == pb.STAT_COMPUTED
                return packed_bytes(r1), packed_bytes(r2), amax

        with ThreadPoolExecutor(2) as ex:
            return list(ex.map(rank, range(2)))

    a, b = run("fp4-grpc", False), run("fp4-shm", True)
    for r in range(2):
        assert a[r][0] == b[r][0] and a[r][1] == b[r][1], r
        assert b[r][1]["amax"] == a[r][2].astype(np.float32).tobytes()


def _stat_job(c):
    """A histogram, a max and an NVFP4 per-block-search quantizer; their
    bases agreed in epoch 1. Returns (layout, histogram epoch, block g)."""
    cal = amaxd.Calibrator.histogram("percentile", 4, percentile=50.0, torch_cpu_build="avx2")
    c.join()
    c.register([amaxd.Quantizer("h", [], amaxd.Recipe.fp8_current(), calibrator=cal),
                amaxd.Quantizer("p", [2], amaxd.Recipe.fp8_current()),
                amaxd.Quantizer("w", [2, 1],
                                amaxd.Recipe.nvfp4("modelopt_static", output="modelopt"),
                                calibrator=amaxd.Calibrator.nvfp4_mse())])
    L = c.layout()
    c.send_packed(np.array([4.0, 1.0, 1.0, 2.0, 3.0], np.float32))
    res = c.reconcile_packed()
    assert res["h"].stat_epoch == res["w"].stat_epoch == 1
    return L, float(res["w"].stat_basis.reshape(-1)[0])


def _shm_send(c, L, stats, epochs):
    """SendPacked with the statistics in the buffer (written raw)."""
    shm = c._shm
    pwrite_all(shm.slab_fd, np.zeros(L.total_cells, np.float32), 0)
    pwrite_all(shm.slab_fd, np.zeros(L.total_cells, np.uint8), shm.has_data_offset)
    # The file is as long as the longest write: cut it to what is written.
    os.ftruncate(shm.slab_fd, shm.stats_offset)
    pwrite_all(shm.slab_fd, np.ascontiguousarray(stats, "<f8"), shm.stats_offset)
    pwrite_all(shm.slab_fd, np.ascontiguousarray(epochs, "<u8"), shm.stat_epochs_offset)
    req = pb.SendPackedRequest(job=c.job, rank=c.rank, layout_id=L.id, shm_id=shm.id,
                               shm_has_data=True, shm_stats=True)
    return c._raw("SendPacked", req.SerializeToString(), pb.SendAmaxResponse.FromString)


def _inline_send(c, L, stats, epochs):
    req = pb.SendPackedRequest(job=c.job, rank=c.rank, layout_id=L.id,
                               values=np.zeros(L.total_cells, np.float32).tobytes(),
                               has_data=np.zeros(L.total_cells, np.uint8).tobytes(),
                               stats=np.ascontiguousarray(stats, "<f8").tobytes(),
                               stat_epochs=np.ascontiguousarray(epochs, "<u8").tobytes())
    return c._raw("SendPacked", req.SerializeToString(), pb.SendAmaxResponse.FromString)


def test_bad_statistics_in_shm_refused_as_inline(shm_daemon):
    """Each bad stat slab gets, through the buffer, the status and sentence
    it gets in the message; nothing of it is merged."""
    with shm_daemon.client("bad-inline", 0, 1) as ci, \
            shm_daemon.client("bad-shm", 0, 1, shm=True) as cs:
        Li, g = _stat_job(ci)
        Ls, gs = _stat_job(cs)
        assert g == gs == 3.0
        a_ok = np.float32(np.float32(g) * np.float32(256.0 / 448.0))  # byte 0x50 = 256
        good = np.array([1.0, 0, 2, 3, 0, a_ok, a_ok], np.float64)
        e1 = 1
        # (A wrong count has no form in the buffer: the daemon reads the
        # layout's total_stats values and one epoch per quantizer.)
        cases = [
            (good, [0, 0, e1], r"has a statistic .* but stat_epochs\[0\] is 0"),
            (good, [e1, 3, e1], r"stat_epochs\[1\] is 3 for quantizer 'p', which takes no"),
            (np.r_[good[:4], -1, good[5:]], [e1, 0, e1], r"statistic\[4\] = -1"),
            (np.r_[good[:4], np.nan, good[5:]], [e1, 0, e1], r"statistic\[4\] = nan"),
            (np.r_[good[:4], 2.5, good[5:]], [e1, 0, e1], "integers"),
            (np.r_[good[:4], 2.0 ** 60, good[5:]], [e1, 0, e1], "2\\^53"),
            (good, [e1 + 1, 0, e1], "names the basis of epoch 2"),
            (np.r_[good[:5], a_ok, 1.0], [e1, 0, e1], "'w' block 1 .* amax 1 is not one of the"),
            (np.r_[good[:5], a_ok, 4.0], [e1, 0, e1], "'w' block 1 .* amax 4 is above the global"),
        ]
        for stats, epochs, msg in cases:
            with pytest.raises((errors.InvalidArgument, errors.FailedPrecondition),
                               match=msg) as ei:
                _inline_send(ci, Li, stats, epochs)
            with pytest.raises(type(ei.value)) as es:
                _shm_send(cs, Ls, stats, epochs)
            # The same sentence but for the job's name.
            assert str(es.value).replace("bad-shm", "bad-inline") == str(ei.value), msg
        # Misuses of the buffer itself.
        shm = cs._shm
        both = pb.SendPackedRequest(job="bad-shm", rank=0, layout_id=Ls.id, shm_id=shm.id,
                                    shm_stats=True, stats=good.tobytes(),
                                    stat_epochs=np.array([e1, 0, e1], "<u8").tobytes())
        with pytest.raises(errors.InvalidArgument,
                           match="stats or stat_epochs given with shm_stats \\(56 and 24 bytes\\)"):
            cs._raw("SendPacked", both.SerializeToString(), pb.SendAmaxResponse.FromString)
        alone = pb.SendPackedRequest(job="bad-shm", rank=0, layout_id=Ls.id,
                                     values=np.zeros(Ls.total_cells, np.float32).tobytes(),
                                     shm_stats=True)
        with pytest.raises(errors.InvalidArgument, match="SendPacked: shm_stats without shm_id"):
            cs._raw("SendPacked", alone.SerializeToString(), pb.SendAmaxResponse.FromString)
        os.ftruncate(shm.slab_fd, shm.stats_offset + 20)
        cut = pb.SendPackedRequest(job="bad-shm", rank=0, layout_id=Ls.id, shm_id=shm.id,
                                   shm_stats=True)
        with pytest.raises(errors.FailedPrecondition,
                           match="ends 20 bytes into the statistics \\(56 bytes at offset "
                                 f"{shm.stats_offset}\\): it was truncated"):
            cs._raw("SendPacked", cut.SerializeToString(), pb.SendAmaxResponse.FromString)
        # Nothing of the above changed either job: both reconcile alike,
        # without statistics, and then take good ones alike.
        ri, rs = ci.reconcile_packed(), cs.reconcile_packed()
        assert packed_bytes(ri) == packed_bytes(rs)
        assert ri["h"].stat_total == 0 and ri["w"].stat_total == 0
        assert ri["h"].stat_state == ri["w"].stat_state == pb.STAT_AGREED
        _inline_send(ci, Li, good, [e1, 0, e1])
        _shm_send(cs, Ls, good, [e1, 0, e1])
        ri, rs = ci.reconcile_packed(), cs.reconcile_packed()
        assert packed_bytes(ri) == packed_bytes(rs)
        assert ri["h"].stat_total == 6 and ri["w"].stat_state == pb.STAT_COMPUTED
        assert rs["w"].amax.tobytes() == np.full((2, 1), a_ok, np.float32).tobytes()
