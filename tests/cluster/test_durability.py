"""Snapshots of a cluster job (docs/OPERATING.md "Durability"): every daemon
writes its own after each epoch; killed and restarted, the daemons restore
the job, wait for its trainers to re-join, and the next epoch equals an
uninterrupted run's byte for byte. A daemon whose snapshot is gone, or
older than its peers', catches up from a daemon further ahead."""
import os

import numpy as np
import pytest

import amaxd
from conftest import max_daemons
from test_basic import reconcile_as_trainer, run_threads

WORLD = 4
REC_DELAYED = amaxd.Recipe.fp8_delayed(history_len=3)


def quantizers(r):
    """Rank r of 4, two ranks per daemon: a TP=2 weight, a per-tensor input,
    a delayed-scaling quantizer with a history, an NVFP4 block tensor."""
    tp = r % 2
    return [
        amaxd.Quantizer("w", [4], amaxd.Recipe.fp8_current(),
                        placement=amaxd.placement.shard([4], 0, tp, 2)),
        amaxd.Quantizer("x", [], amaxd.Recipe.fp8_current()),
        amaxd.Quantizer("h", [], REC_DELAYED, accumulation=amaxd.PER_EPOCH),
        amaxd.Quantizer("n", [2, 2], amaxd.Recipe.nvfp4(),
                        placement=amaxd.placement.shard([2, 2], 0, tp, 2)),
    ]


def values(r, e):
    rng = np.random.default_rng(1000 * e + r)
    return {"w": rng.uniform(0.01, 100, 2).astype(np.float32),
            "x": np.float32(rng.uniform(0, 9)),
            "n": rng.uniform(0.01, 100, (1, 2)).astype(np.float32),
            # A zero epoch in the history (TE's rule leaves the window alone).
            "h": np.float32(0.0 if e == 2 else rng.uniform(1, 50))}


def daemon_of(r, n):
    return r * n // WORLD


def clients_for(c, n):
    return [amaxd.Client("dur", r, WORLD, socket=c.socket(daemon_of(r, n)), timeout=30)
            for r in range(WORLD)]


def result_bytes(res):
    """Every field of every result, previous epoch's globals included."""
    return {k: (v.amax.tobytes(), v.scale.tobytes(), v.scale_inv.tobytes(),
                v.block_scales.tobytes(), np.float32(v.global_scale).tobytes(),
                repr((v.previous_global_amax, v.previous_global_scale)))
            for k, v in res.items()}


def epochs(clients, first, last, join=False, register=False, as_trainer=False):
    """Runs epochs first..last on every rank; returns each rank's results of
    the last one as bytes. as_trainer: each Reconcile goes through what a
    trainer does after a fault (test_basic.reconcile_as_trainer)."""
    def rank(r):
        cl = clients[r]
        rejoined = None
        if join:
            rejoined = cl.join().rejoined
        if register:
            cl.register(quantizers(r))
        for e in range(first, last + 1):
            cl.send(values(r, e))
            res = reconcile_as_trainer(cl, values(r, e))[0] if as_trainer else cl.reconcile()
        return rejoined, result_bytes(res)
    out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(WORLD)})
    assert not errs, errs
    return {r: out[r][1] for r in range(WORLD)}, {r: out[r][0] for r in range(WORLD)}


def calibrated(make_cluster, n, upto, *args, **kw):
    """A cluster whose job ran epochs 1..upto; its clients (open) and the
    last epoch's results."""
    c = make_cluster(n, *args, **kw)
    cls = clients_for(c, n)
    epochs(cls, 1, 1, join=True, register=True)
    got, _ = epochs(cls, 2, upto)
    return c, cls, got


def reference(make_cluster, n, upto):
    """An uninterrupted run's results of epoch `upto`."""
    _, cls, got = calibrated(make_cluster, n, upto)
    for cl in cls:
        cl.close()
    return got


def restart_all(c, n, drop=()):
    for i in range(n):
        c.kill(i)
    for i in drop:
        for f in os.listdir(c.state_dir(i)):
            os.remove(os.path.join(c.state_dir(i), f))
    for i in range(n):
        c.start(i)


def test_cluster_killed_and_restarted_equals_uninterrupted(make_cluster):
    n = max_daemons(2)
    want = reference(make_cluster, n, 4)
    c, cls, _ = calibrated(make_cluster, n, 3, state=True)
    for i in range(n):
        assert os.path.exists(os.path.join(c.state_dir(i), "dur.amxs")), c.logs()
        st = amaxd.Client("dur", 0, WORLD, socket=c.socket(i)).status("dur").jobs[0]
        assert st.durable_epoch == 3 and st.participants == n, st
    for cl in cls:
        cl.close()
    restart_all(c, n)
    for i in range(n):
        assert "restored from" in c[i].log(), c.logs()
        st = amaxd.Client("dur", 0, WORLD, socket=c.socket(i)).status("dur").jobs[0]
        assert st.restored and not st.ready and st.reconciled_epochs == 3, st
    cls = clients_for(c, n)
    got, rejoined = epochs(cls, 4, 4, join=True)  # no Register: placements came back
    assert all(rejoined.values()), rejoined
    assert got == want, c.logs()
    for i in range(n):
        assert "caught up" not in c[i].log()
    for cl in cls:
        cl.close()


def test_daemon_without_snapshot_catches_up(make_cluster):
    n = max_daemons(2)
    want = reference(make_cluster, n, 5)
    c, cls, _ = calibrated(make_cluster, n, 4, state=True)
    for cl in cls:
        cl.close()
    # The last daemon's disk is gone: it starts empty, its trainers register
    # again, and it takes the state from a daemon that restored epoch 4. Its
    # trainers' first Reconcile was for its own epoch 1: refused, naming
    # epoch 5; they send again for it.
    restart_all(c, n, drop=[n - 1])
    cls = clients_for(c, n)
    got, _ = epochs(cls, 5, 5, join=True, register=True, as_trainer=True)
    assert got == want, c.logs()
    assert "caught up with daemon" in c[n - 1].log(), c.logs()
    assert "had reconciled no epoch of the job" in c[n - 1].log(), c.logs()
    for cl in cls:
        cl.close()


def test_one_daemon_restarted_from_its_snapshot(make_cluster):
    n = max_daemons(2)
    want = reference(make_cluster, n, 4)
    c, cls, _ = calibrated(make_cluster, n, 3, state=True)
    # Only the last daemon dies and comes back; the coordinator kept the
    # job's membership.
    last = n - 1
    c.kill(last)
    c.start(last)
    mine = [r for r in range(WORLD) if daemon_of(r, n) == last]
    for r in mine:
        cls[r].close()
        cls[r] = amaxd.Client("dur", r, WORLD, socket=c.socket(last), timeout=30)
        assert cls[r].join().rejoined
    got, _ = epochs(cls, 4, 4)
    assert got == want, c.logs()
    for cl in cls:
        cl.close()


def reference_4_5(make_cluster, n):
    """An uninterrupted run's results of epochs 4 and 5."""
    _, ref, want4 = calibrated(make_cluster, n, 4)
    want5, _ = epochs(ref, 5, 5)
    for cl in ref:
        cl.close()
    return want4, want5


def restored_behind(make_cluster, n, behind):
    """A cluster of n daemons calibrated to epoch 4, whose daemons `behind`
    were killed after epoch 4's collective and restarted from their
    snapshots of epoch 3 (as if killed before writing epoch 4's); its
    clients (those of the restarted daemons new), the ranks those host and
    every rank's epoch 4 results. Over NCCL a daemon stuck in a collective
    with a dead coordinator notices only at the epoch's deadline
    (docs/CLUSTER.md): it is kept short."""
    c, cls, _ = calibrated(make_cluster, n, 3, "--reconcile-timeout-ms=6000", state=True)
    old = {}
    for d in behind:
        with open(os.path.join(c.state_dir(d), "dur.amxs"), "rb") as f:
            old[d] = f.read()
    got4, _ = epochs(cls, 4, 4)
    for d in behind:
        c.kill(d)
        with open(os.path.join(c.state_dir(d), "dur.amxs"), "wb") as f:
            f.write(old[d])
        c.start(d)
    mine = [r for r in range(WORLD) if daemon_of(r, n) in behind]
    for r in mine:
        cls[r].close()
        cls[r] = amaxd.Client("dur", r, WORLD, socket=c.socket(daemon_of(r, n)), timeout=30)
    return c, cls, mine, got4


@pytest.mark.parametrize("who", ["member", "coordinator"])
def test_daemon_restored_behind_its_peers_drops_stale_contributions(make_cluster, who):
    """A daemon killed after an epoch's collective but before its snapshot
    of it restarts one epoch behind its peers; its trainers re-join at that
    epoch and send its values again. Those values were already reduced: the
    catch-up must not carry them into the next epoch (every rank would get
    it with stale data). Its ranks get FAILED_PRECONDITION naming the
    epoch, read the reconciled one with GetScales (the bytes the others
    got), and the next epoch equals an uninterrupted run's."""
    n = max_daemons(2)
    if n < 2:
        pytest.skip("needs two daemons")
    want4, want5 = reference_4_5(make_cluster, n)
    d = 0 if who == "coordinator" else n - 1
    c, cls, mine, got4 = restored_behind(make_cluster, n, [d])
    assert got4 == want4, c.logs()

    def restarted(r):
        cl = cls[r]
        j = cl.join()
        assert j.rejoined and j.epoch == 4, j
        cl.send(values(r, 4))
        # (No pytest.raises in a thread: its failure is not an Exception.)
        try:
            stale = cl.reconcile()
        except amaxd.errors.FailedPrecondition as e:
            why = str(e)
        else:
            raise AssertionError(f"rank {r}: epoch 4 sent again was answered: "
                                 f"{sorted(stale)}")
        assert cl.epoch == 5, cl.epoch  # the client learned the open epoch
        readable = result_bytes(cl.get_scales())
        cl.send(values(r, 5))
        return why, readable, result_bytes(cl.reconcile())

    def other(r):
        cl = cls[r]
        cl.send(values(r, 5))
        errs = []
        for _ in range(10):
            try:
                return errs, result_bytes(cl.reconcile())
            except (amaxd.errors.Aborted, amaxd.errors.Unavailable,
                    amaxd.errors.DeadlineExceeded) as e:
                errs.append(e)
        raise AssertionError(f"rank {r}: {errs}")

    out, errs = run_threads({r: (lambda r=r: restarted(r) if r in mine else other(r))
                             for r in range(WORLD)}, timeout=120)
    assert not errs, (errs, c.logs())
    for r in mine:
        why, readable, got5 = out[r]
        assert "epoch 4, which the cluster had already reconciled" in why, why
        assert readable == want4[r], c.logs()
        assert got5 == want5[r], c.logs()
    for r in range(WORLD):
        if r in mine:
            continue
        seen, got5 = out[r]
        assert got5 == want5[r], c.logs()
        if who == "member":
            # The coordinator's ranks hear why their attempt was aborted.
            assert any(isinstance(e, amaxd.errors.Aborted) and "was behind" in str(e)
                       for e in seen), seen
    assert "caught up with daemon" in c[d].log(), c.logs()
    for cl in cls:
        cl.close()


def test_conflict_in_the_catch_up_still_drops_stale_contributions(make_cluster):
    """Found by review: when the agreement that brings a restored daemon up
    to date fails for another reason first (here a catalog conflict), its
    ranks' contributions for the epoch the cluster had reconciled were kept
    and carried into the next epoch (every rank's epoch 5 amax became the
    7777 they had sent). They are dropped whatever fails the attempt, and
    its ranks hear both causes."""
    n = max_daemons(2)
    if n < 2:
        pytest.skip("needs two daemons")
    _, want5 = reference_4_5(make_cluster, n)
    c, cls, mine, _ = restored_behind(make_cluster, n, [n - 1])
    z = lambda shape: [amaxd.Quantizer("z", shape, amaxd.Recipe.fp8_current())]

    def rank(r):
        cl = cls[r]
        if r in mine:
            cl.join()
            cl.register(z([2]))  # another shape than the other daemon's: a conflict
            cl.send({k: np.full(np.shape(v), 7777, np.float32) for k, v in values(r, 4).items()})
            got, seen = reconcile_as_trainer(cl, values(r, 5))
        else:
            cl.register(z([3]))
            cl.send(values(r, 5))
            got, seen = reconcile_as_trainer(cl, values(r, 5))
        return [str(e) for e in seen], got, cl.epoch

    out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(WORLD)}, timeout=120)
    assert not errs, (errs, c.logs())
    for r in mine:
        seen, _, epoch = out[r]
        # Never answered for the reconciled epoch 4: the answer is epoch 5's.
        assert epoch == 6, (epoch, seen)
        assert any("'z'" in m and "which the cluster had already reconciled" in m
                   for m in seen), seen
    for r in range(WORLD):
        assert result_bytes(out[r][1]) == want5[r], (r, out[r][0], c.logs())
    for cl in cls:
        cl.close()


def test_two_daemons_restored_behind_at_once(make_cluster):
    """Both daemons behind fail the same attempt and abort it everywhere.
    Their ranks are refused once (FAILED_PRECONDITION), send again, and
    epoch 5 is an uninterrupted run's. An Abort that one of them sends is
    no longer kept by the other as pending for its next attempt (review),
    and one that arrives after a daemon already began the next attempt of
    the same epoch is ignored there: it names the agreement of the attempt
    that ended (before, its ranks saw one ABORTED more in 1 of 8 runs on
    the 2-core build machine)."""
    n = max_daemons(4)
    if n < 4:
        pytest.skip("needs four daemons")
    _, want5 = reference_4_5(make_cluster, n)
    c, cls, mine, _ = restored_behind(make_cluster, n, [2, 3])

    def rank(r):
        cl = cls[r]
        if r in mine:
            cl.join()
            cl.send(values(r, 4))
        else:
            cl.send(values(r, 5))
        got, seen = reconcile_as_trainer(cl, values(r, 5))
        return [type(e).__name__ for e in seen], result_bytes(got)

    out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(WORLD)}, timeout=120)
    assert not errs, (errs, c.logs())
    print("errors on the way:", {r: out[r][0] for r in range(WORLD)})
    for r in range(WORLD):
        assert out[r][1] == want5[r], (r, c.logs())
    for r in mine:
        assert out[r][0][0] == "FailedPrecondition", out[r][0]
        assert out[r][0].count("FailedPrecondition") == 1, out[r][0]
        assert out[r][0].count("Aborted") == 0, out[r][0]
    for cl in cls:
        cl.close()
