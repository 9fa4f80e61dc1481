"""Calibrators beyond max across daemons (issue 23): the workload of
tests/e2e/calib_workload.py (histogram quantizers of every method, MSE
searches per channel and per tensor) over 4 daemons, its ranks spread
over them (rank r on daemon r % 4), gives the bytes of one daemon and one
rank: the statistics are summed by the SUM collective beside the MAX one
(Gloo here; NCCL on GPUs, tests/gpu/calib_nccl.sh)."""
import amaxd
import calib_workload as W
from conftest import max_daemons

DAEMONS = max_daemons(4)


def test_four_daemons_same_bytes_as_one(make_cluster):
    one = W.run_layout([make_cluster(1).socket(0)], "calib-one", "single")
    ref = W.whole_bytes(one[0])
    c = make_cluster(DAEMONS, "--log-level=info")
    socks = [c.socket(i) for i in range(DAEMONS)]
    for layout in ("tp2ep2dp2", "dp8", "tp4"):
        out = W.run_layout(socks, f"calib-{layout}", layout)
        for r, res in enumerate(out):
            assert W.whole_bytes(res) == ref, f"{layout}: rank {r} (daemon {r % DAEMONS})"
    out = W.run_layout(socks, "calib-row", "tp4", row_parallel=True)
    for r, res in enumerate(out):
        assert W.whole_bytes(res) == ref, f"row-parallel rank {r}"
    # Both collectives ran where statistics were reduced: the last epoch of
    # a job with an agreed basis took the MAX and the SUM.
    for d in range(DAEMONS):
        with amaxd.Client("calib-dp8", 0, 8, socket=c.socket(d)) as cl:
            st = cl.status("calib-dp8").jobs[0]
        assert st.participants == DAEMONS and st.last_collectives == 2, st


def _phases(sockets, job, restart, register_again):
    """2 ranks per daemon over 2 daemons: the max (epoch 1), then `restart`
    (between the passes), one epoch without statistics, then the
    statistics; returns each rank's last answers."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from amaxd import calib

    layout, world = "tp2dp2", 4
    x, route, w = W.data(5)
    q = [amaxd.Quantizer("act.pct", [], amaxd.Recipe.fp8_current(), calibrator=W.HIST["act.pct"]),
         amaxd.Quantizer("fc.w", [W.C_OUT], amaxd.Recipe.fp8_current(), calibrator=W.MSE)]
    b1, b2, b3 = threading.Barrier(world), threading.Barrier(world), threading.Barrier(world)

    def rank(r):
        act = W.act_shard(layout, r, x, route)
        blk, _, owner = W.weight_shard(layout, r, w, row_parallel=True)
        sock = sockets[r // 2]
        with amaxd.Client(job, r, world, socket=sock, timeout=60) as c:
            c.join()
            c.register(q)
            c.send({"act.pct": float(np.abs(act).max()), "fc.w": np.abs(blk).max(axis=1)})
            c.reconcile()
        b1.wait()
        if r == 0:
            restart()
        b2.wait()
        with amaxd.Client(job, r, world, socket=sock, timeout=60) as c:
            c.join()
            if register_again and r >= 2:
                c.register(q)
            b3.wait()  # every rank back before an epoch starts
            for attempt in range(3):
                try:  # the epoch that brings a restarted daemon up to date
                    r1 = c.reconcile(epoch=0)
                    break
                except (amaxd.errors.Unavailable, amaxd.errors.Aborted,
                        amaxd.errors.FailedPrecondition) as e:
                    # (FAILED_PRECONDITION: the ranks of a daemon that lost
                    # the job, whose first attempt is refused.)
                    if attempt == 2 or (isinstance(e, amaxd.errors.FailedPrecondition) and
                                        "had reconciled no epoch of the job" not in e.message):
                        raise
            s = {"act.pct": amaxd.Stat(calib.histogram(act, r1["act.pct"].stat_basis,
                                                       W.HIST["act.pct"]),
                                       r1["act.pct"].stat_epoch)}
            if owner:
                s["fc.w"] = amaxd.Stat(calib.mse_losses(blk, r1["fc.w"].stat_basis, W.MSE,
                                                        W.fake_quant_e4m3, axis=0),
                                       r1["fc.w"].stat_epoch)
            c.send(s)
            return c.reconcile()

    with ThreadPoolExecutor(world) as ex:
        return list(ex.map(rank, range(world)))


def _digest(res):
    return {n: (r.amax.tobytes(), r.stat_basis.tobytes(), r.stat_total, r.stat_state)
            for n, r in sorted(res.items())}


def test_restarted_daemon_catches_up_statistics(make_cluster):
    """A daemon killed between the two passes and restarted without a
    snapshot fetches the bases and sums from a peer (the job state of
    docs/CLUSTER.md) and its ranks' statistics then count as if nothing
    had happened; with a snapshot it restores them itself."""
    if DAEMONS < 2:
        import pytest
        pytest.skip("needs 2 daemons")
    ref = make_cluster(2)
    want = _phases([ref.socket(0), ref.socket(1)], "calib-ref", lambda: None, False)
    for state in (False, True):
        c = make_cluster(2, state=state)

        def restart():
            c.kill(1)
            c.start(1)

        got = _phases([c.socket(0), c.socket(1)], f"calib-restart-{int(state)}", restart,
                      register_again=not state)
        for r in range(4):
            assert _digest(got[r]) == _digest(want[r]), (state, r)
            assert got[r]["act.pct"].stat_state == amaxd.pb.STAT_COMPUTED
        if not state:
            assert "caught up with daemon" in c[1].log(), c.logs()
