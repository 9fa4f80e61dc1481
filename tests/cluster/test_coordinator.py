"""The coordinator (cluster rank 0) killed with kill -9 and restarted:
between epochs, during an epoch, and during an agreement round, with and
without state_dir. Three daemons host six trainer ranks unevenly (daemon 0:
rank 0; daemon 1: ranks 1-3; daemon 2: ranks 4-5), and some quantizers are
registered only by the ranks of one non-coordinator daemon. A restart must
lose no quantizer, crash no daemon, and the first epoch after it must give
every daemon the bytes of an uninterrupted run (docs/CLUSTER.md,
"Coordinator loss")."""
import threading
import time

import numpy as np
import pytest

import amaxd
from conftest import max_daemons
from test_basic import run_threads

WORLD = 6
HOME = {0: 0, 1: 1, 2: 1, 3: 1, 4: 2, 5: 2}  # rank -> daemon
TIMEOUT_MS = 6000


def quantizers(r):
    qs = [
        amaxd.Quantizer("x", [], amaxd.Recipe.fp8_current()),
        amaxd.Quantizer("w", [WORLD], amaxd.Recipe.fp8_current(),
                        placement=amaxd.placement.shard([WORLD], 0, r, WORLD)),
        amaxd.Quantizer("h", [], amaxd.Recipe.fp8_delayed(history_len=3),
                        accumulation=amaxd.PER_EPOCH),
    ]
    if HOME[r] == 1:  # only daemon 1's ranks know these
        qs.append(amaxd.Quantizer("only1", [], amaxd.Recipe.fp8_current()))
        qs.append(amaxd.Quantizer("only1.n", [3, 2], amaxd.Recipe.nvfp4(),
                                  placement=amaxd.placement.shard([3, 2], 0, r - 1, 3)))
    if HOME[r] == 2:  # and these daemon 2's
        qs.append(amaxd.Quantizer("only2", [2], amaxd.Recipe.fp8_current(),
                                  placement=amaxd.placement.shard([2], 0, r - 4, 2)))
    return qs


def values(r, e):
    rng = np.random.default_rng(7919 * e + r)
    v = {"x": np.float32(rng.uniform(0, 10)),
         "w": np.float32(rng.uniform(0.1, 100)).reshape(1),
         "h": np.float32(rng.uniform(1, 50))}
    if HOME[r] == 1:
        v["only1"] = np.float32(rng.uniform(0, 5))
        v["only1.n"] = rng.uniform(0.01, 30, (1, 2)).astype(np.float32)
    if HOME[r] == 2:
        v["only2"] = np.float32(rng.uniform(0, 7)).reshape(1)
    return v


ALL = {"x", "w", "h", "only1", "only1.n", "only2"}


def whole(cl):
    """Every quantizer's whole tensor as bytes, previous-epoch globals included."""
    out = {}
    for k, v in cl.get_scales(whole=True).items():
        out[k] = (v.amax.tobytes(), v.scale.tobytes(), v.scale_inv.tobytes(),
                  v.block_scales.tobytes(), np.float32(v.global_amax).tobytes(),
                  np.float32(v.global_scale).tobytes(),
                  None if v.previous_global_amax is None
                  else np.float32(v.previous_global_amax).tobytes(),
                  None if v.previous_global_scale is None
                  else np.float32(v.previous_global_scale).tobytes())
    return out


def clients(c):
    return {r: amaxd.Client("co", r, WORLD, socket=c.socket(HOME[r]), timeout=60)
            for r in range(WORLD)}


def run_epochs(cls, first, last, join=False):
    def rank(r):
        if join:
            cls[r].join()
            cls[r].register(quantizers(r))
        for e in range(first, last + 1):
            cls[r].send(values(r, e))
            cls[r].reconcile()
    out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(WORLD)})
    assert not errs, errs


def reference(make_cluster, upto):
    """Every daemon's whole tensors after an uninterrupted run of epochs 1..upto."""
    c = make_cluster(3, f"--reconcile-timeout-ms={TIMEOUT_MS}")
    cls = clients(c)
    run_epochs(cls, 1, upto, join=True)
    got = [whole(cls[r]) for r in (0, 1, 4)]
    assert got[0] == got[1] == got[2]
    for cl in cls.values():
        cl.close()
    c.stop_all()
    return got[0]


def retry(fn, errors, attempts=6, resend=None):
    """fn() until it succeeds; each failure must be a typed error, in time.
    FAILED_PRECONDITION (this rank's epoch was closed: its daemon restarted
    behind the others, the client learned the open epoch) calls resend()
    first, as a trainer sends again (docs/API.md); without resend it is
    raised."""
    for _ in range(attempts):
        try:
            return fn()
        except amaxd.errors.FailedPrecondition as e:
            if resend is None:
                raise
            errors.append(e)
            resend()
        except amaxd.AmaxdError as e:
            errors.append(e)
            time.sleep(0.2)
    raise AssertionError(f"still failing after {attempts} attempts: {errors[-3:]}")


def recover(c, cls, epoch):
    """The coordinator restarts: rank 0 comes back (Join, and Register when
    its daemon lost the job), sends its values of `epoch`, and every rank
    finishes that epoch. Returns the seconds from the restart to every
    rank's answer and the errors seen on the way."""
    errors = []
    t0 = time.monotonic()
    c.start(0)
    cls[0].close()
    cls[0] = amaxd.Client("co", 0, WORLD, socket=c.socket(0), timeout=60)

    def rank(r):
        if r == 0:
            rejoined = cls[0].join(timeout=TIMEOUT_MS / 1000 + 5).rejoined
            if not rejoined:
                cls[0].register(quantizers(0))
            cls[0].send(values(0, epoch))
            return retry(cls[0].reconcile, errors, resend=lambda: cls[0].send(values(0, epoch)))
        return retry(cls[r].reconcile, errors)
    out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(WORLD)}, timeout=120)
    assert not errs, f"{errs}\n{c.logs()}"
    took = time.monotonic() - t0
    for e in errors:  # what a trainer saw while the coordinator was away
        assert isinstance(e, (amaxd.errors.Unavailable, amaxd.errors.DeadlineExceeded,
                              amaxd.errors.Aborted, amaxd.errors.FailedPrecondition)), e
        if isinstance(e, amaxd.errors.FailedPrecondition):
            # Its restarted daemon's own epoch number, refused (never an
            # answer for another epoch), and only for its own rank.
            assert "had reconciled no epoch of the job" in e.message or "already reconciled" in e.message, e
    return took, errors


def check_everywhere(c, cls, want):
    for d, r in ((0, 0), (1, 1), (2, 4)):
        names = {q.name for q in cls[r].list_quantizers().quantizers}
        assert names == ALL, (d, names)
        assert whole(cls[r]) == want, f"daemon {d} differs from an uninterrupted run\n{c.logs()}"
    for i in range(3):
        assert c[i].proc.poll() is None, f"daemon {i} died\n{c.logs()}"


@pytest.mark.parametrize("state", [False, True], ids=["no_state_dir", "state_dir"])
def test_coordinator_killed_between_epochs(make_cluster, state):
    if max_daemons(3) < 3:
        pytest.skip("needs 3 daemons")
    want = reference(make_cluster, 3)
    c = make_cluster(3, f"--reconcile-timeout-ms={TIMEOUT_MS}", state=state)
    cls = clients(c)
    run_epochs(cls, 1, 2, join=True)
    c.kill(0)
    # The other ranks send epoch 3 while the coordinator is away.
    for r in range(1, WORLD):
        cls[r].send(values(r, 3))
    took, errors = recover(c, cls, 3)
    print(f"recovery: {took:.2f} s, {len(errors)} retried Reconcile(s)")
    check_everywhere(c, cls, want)
    if not state:
        assert "asking for it whole" in c[0].log(), c.logs()
        assert "caught up with daemon" in c[0].log(), c.logs()
    # The next epoch is an ordinary one: one collective, no agreement.
    run_epochs(cls, 4, 4)
    st = [cls[r].status("co").jobs[0] for r in (0, 1, 4)]
    assert all(s.last_collectives == 1 for s in st), st
    for cl in cls.values():
        cl.close()


@pytest.mark.parametrize("state", [False, True], ids=["no_state_dir", "state_dir"])
def test_coordinator_killed_during_an_epoch(make_cluster, state):
    if max_daemons(3) < 3:
        pytest.skip("needs 3 daemons")
    want = reference(make_cluster, 3)
    c = make_cluster(3, f"--reconcile-timeout-ms={TIMEOUT_MS}", state=state)
    cls = clients(c)
    run_epochs(cls, 1, 2, join=True)
    # Epoch 3: every rank but rank 0 is in Reconcile, the collective of
    # daemons 1 and 2 waits for daemon 0; then daemon 0 dies.
    res = {}

    def waiting(r):
        cls[r].send(values(r, 3))
        t = time.monotonic()
        try:
            res[r] = cls[r].reconcile()
        except amaxd.AmaxdError as e:
            res[r] = e
        res[r, "s"] = time.monotonic() - t
    ts = [threading.Thread(target=waiting, args=(r,)) for r in range(1, WORLD)]
    [t.start() for t in ts]
    time.sleep(0.5)
    c.kill(0)
    [t.join(TIMEOUT_MS / 1000 + 5) for t in ts]
    assert not any(t.is_alive() for t in ts), "a trainer hangs after the coordinator died"
    for r in range(1, WORLD):
        e = res[r]
        assert isinstance(e, (amaxd.errors.Unavailable, amaxd.errors.DeadlineExceeded)), (r, e)
        assert "daemon 0" in e.message, e.message
        assert res[r, "s"] < TIMEOUT_MS / 1000 + 0.5, res[r, "s"]
    took, errors = recover(c, cls, 3)
    print(f"recovery: {took:.2f} s, {len(errors)} retried Reconcile(s)")
    check_everywhere(c, cls, want)
    for cl in cls.values():
        cl.close()


@pytest.mark.parametrize("state", [False, True], ids=["no_state_dir", "state_dir"])
def test_coordinator_killed_during_agreement(make_cluster, state):
    """Epoch 1 (no communicator yet): daemons 1 and 2 wait at the
    coordinator's agreement barrier with their proposals when it dies."""
    if max_daemons(3) < 3:
        pytest.skip("needs 3 daemons")
    want = reference(make_cluster, 1)
    c = make_cluster(3, f"--reconcile-timeout-ms={TIMEOUT_MS}", state=state)
    cls = clients(c)
    run_threads({r: (lambda r=r: (cls[r].join(), cls[r].register(quantizers(r)),
                                  cls[r].send(values(r, 1)))) for r in range(WORLD)})
    res = {}

    def waiting(r):
        try:
            res[r] = cls[r].reconcile()
        except amaxd.AmaxdError as e:
            res[r] = e
    ts = [threading.Thread(target=waiting, args=(r,)) for r in range(1, WORLD)]
    [t.start() for t in ts]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
            "epoch 1 handed to its engine" in c[i].log() for i in (1, 2)):
        time.sleep(0.05)
    time.sleep(0.3)  # both members' Sync calls are at the barrier
    assert all("epoch 1 handed to its engine" in c[i].log() for i in (1, 2)), c.logs()
    c.kill(0)
    [t.join(TIMEOUT_MS / 1000 + 5) for t in ts]
    assert not any(t.is_alive() for t in ts), "a trainer hangs after the coordinator died"
    for r in range(1, WORLD):
        assert isinstance(res[r], (amaxd.errors.Unavailable, amaxd.errors.DeadlineExceeded)), \
            (r, res[r])
    took, errors = recover(c, cls, 1)
    print(f"recovery: {took:.2f} s, {len(errors)} retried Reconcile(s)")
    check_everywhere(c, cls, want)
    for cl in cls.values():
        cl.close()


@pytest.mark.parametrize("who", [0, 1], ids=["coordinator", "member"])
def test_restarted_daemon_keeps_a_new_quantizer_of_the_epoch_it_catches_up_in(make_cluster, who):
    """A daemon restarted without state_dir catches up from a donor in the
    same agreement that adopts a quantizer its trainer has just registered:
    that trainer's values of the epoch are kept (they were dropped with the
    layout of the donor's catalog, silently: amax 0, missing 1)."""
    c = make_cluster(2, f"--reconcile-timeout-ms={TIMEOUT_MS}")
    fp8 = amaxd.Recipe.fp8_current()
    a, late = amaxd.Quantizer("a", [], fp8), amaxd.Quantizer("late", [], fp8)
    cls = [amaxd.Client("nl", r, 2, socket=c.socket(r), timeout=30) for r in range(2)]
    out, errs = run_threads({r: (lambda r=r: (cls[r].join(), cls[r].register([a]),
                                              cls[r].send({"a": 1.0 + r}), cls[r].reconcile()))
                             for r in range(2)})
    assert not errs, errs
    other = 1 - who
    c.kill(who)
    c.start(who)
    cls[who].close()
    cls[who] = amaxd.Client("nl", who, 2, socket=c.socket(who), timeout=30)
    cls[other].send({"a": 3.0})
    errors = []

    def restarted():
        cls[who].join()
        cls[who].register([a, late])  # 'late' is new, registered here only
        cls[who].send({"a": 9.0, "late": 5.0})
        return retry(cls[who].reconcile, errors,
                     resend=lambda: cls[who].send({"a": 9.0, "late": 5.0}))
    fns = {who: restarted, other: lambda: retry(cls[other].reconcile, errors)}
    out, errs = run_threads(fns)
    assert not errs, f"{errs}\n{c.logs()}"
    assert "caught up with daemon" in c[who].log(), c.logs()
    got = out[who]["late"]
    assert got.amax[()] == 5.0 and got.missing == 0, (got, c.logs())
    for r in range(2):
        assert out[r]["a"].amax[()] == 9.0, out[r]["a"]
        w = cls[r].get_scales(whole=True)["late"]
        assert w.amax[()] == 5.0 and w.missing == 0, (r, w)
    # The running max keeps it.
    cls[who].send({"late": 1.0})
    out, errs = run_threads({r: (lambda r=r: cls[r].reconcile()) for r in range(2)})
    assert not errs, errs
    assert out[who]["late"].amax[()] == 5.0
    assert whole(cls[0]) == whole(cls[1])
    for cl in cls:
        cl.close()


def test_steady_epochs_go_on_without_the_coordinator(make_cluster):
    """A job on daemons 1 and 2 while the coordinator (daemon 0, hosting no
    rank of it) is dead: epochs in which nothing changes never call it and
    go on; one that needs it (a quantizer added) fails with UNAVAILABLE
    naming the coordinator, within the timeout, and changes nothing; once
    the coordinator is back, that epoch, tried again, agrees and reconciles
    (the first tries may still get UNAVAILABLE while the peer channel backs
    off, at most a second). The
    seconds from its restart to that epoch are printed (docs/CLUSTER.md,
    "Coordinator loss")."""
    c = make_cluster(3, f"--reconcile-timeout-ms={TIMEOUT_MS}")
    cls = {r: amaxd.Client("st", r, 2, socket=c.socket(r + 1), timeout=60) for r in range(2)}
    q = [amaxd.Quantizer("x", [], amaxd.Recipe.fp8_current())]

    def epoch(r, v, extra=()):
        if extra:
            cls[r].register(list(extra))
        cls[r].send({"x": float(v + r), **{e.name: 1.0 for e in extra}})
        return cls[r].reconcile()
    out, errs = run_threads({r: (lambda r=r: (cls[r].join(), cls[r].register(q),
                                              epoch(r, 1))[-1]) for r in range(2)})
    assert not errs, errs
    c.kill(0)
    for e in range(2, 6):
        out, errs = run_threads({r: (lambda r=r: epoch(r, e)) for r in range(2)})
        assert not errs, f"epoch {e} needed the coordinator: {errs}\n{c.logs()}"
        assert out[0]["x"].amax[()] == float(e + 1)
    extra = [amaxd.Quantizer("y", [], amaxd.Recipe.fp8_current())]
    t0 = time.monotonic()
    out, errs = run_threads({r: (lambda r=r: epoch(r, 6, extra if r == 0 else ())) for r in range(2)})
    took = time.monotonic() - t0
    assert set(errs) == {0, 1}, (out, errs)
    for r, e in errs.items():
        assert isinstance(e, amaxd.errors.Unavailable), (r, e)
        assert "coordinator" in str(e), (r, e)
    assert took < TIMEOUT_MS / 1000 + 5, took
    t0 = time.monotonic()
    c.start(0)
    seen = []

    def again(r):
        cls[r].send({"x": float(7 + r)})
        return retry(cls[r].reconcile, seen)
    out, errs = run_threads({r: (lambda r=r: again(r)) for r in range(2)})
    took = time.monotonic() - t0
    assert not errs, f"{errs}\n{c.logs()}"
    for e in seen:  # a channel still backing off from the dead coordinator
        assert isinstance(e, amaxd.errors.Unavailable), e
    print(f"coordinator restart to a reconciled epoch that needed it: {took:.2f} s "
          f"({len(seen)} UNAVAILABLE on the way)")
    for r in range(2):
        names = {x.name for x in cls[r].list_quantizers().quantizers}
        assert names == {"x", "y"}, (r, names)
        assert out[r]["x"].amax[()] == 8.0, out[r]
    assert out[0]["y"].amax[()] == 1.0, out[0]  # sent in the epoch that failed, kept
    for x in cls.values():
        x.close()
