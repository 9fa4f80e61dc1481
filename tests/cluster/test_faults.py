"""Faults between daemons: a daemon killed during an epoch and restarted, a
trainer that never reconciles, a catalog conflict across daemons, a peer
without the cluster secret, and a job stuck on a hung peer while another
job goes on. Every trainer must get an error within its timeout (never a
hang), and the next epoch after recovery must succeed with the same bytes
everywhere."""
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

import amaxd
from conftest import COLLECTIVE, max_daemons
from test_basic import Q, reconcile_as_trainer, run_threads

TIMEOUT_MS = 4000


def _try(fn):
    """fn()'s result, or the amaxd error it raised (for trainer threads
    whose failure is the test's point)."""
    try:
        return fn()
    except amaxd.AmaxdError as e:
        return e


def test_daemon_killed_during_epoch_then_restarted(make_cluster):
    n = max_daemons(3)
    last = n - 1
    c = make_cluster(n, f"--reconcile-timeout-ms={TIMEOUT_MS}")
    qs = [Q("w", [3]), Q("x")]
    vals = lambda r, e: {"w": np.array([r + 1, 10 - r, e], np.float32) * e,
                         "x": np.float32(r * 2 + e)}
    clients = [amaxd.Client("k", r, n, socket=c.socket(r), timeout=30) for r in range(n)]
    for epoch in (1, 2):
        def rank(r, epoch=epoch):
            if epoch == 1:
                clients[r].join()
                clients[r].register(qs if r != 1 else qs[::-1])
            clients[r].send(vals(r, epoch))
            return clients[r].reconcile()
        out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(n)})
        assert not errs, f"{errs}\n{c.logs()}"
    # Epoch 3: the other ranks enter Reconcile; the last daemon dies before
    # its rank does.
    started = time.monotonic()
    res = {}

    def waiting(r):
        clients[r].send(vals(r, 3))
        res[r] = _try(clients[r].reconcile)
    ts = [threading.Thread(target=waiting, args=(r,)) for r in range(last)]
    [t.start() for t in ts]
    time.sleep(0.5)
    c.kill(last)
    [t.join(TIMEOUT_MS / 1000 + 5) for t in ts]
    assert not any(t.is_alive() for t in ts), "a trainer hangs after a daemon died"
    elapsed = time.monotonic() - started
    for r in range(last):
        e = res[r]
        assert isinstance(e, (amaxd.errors.Unavailable, amaxd.errors.DeadlineExceeded)), e
        assert f"daemon {last}" in e.message, e.message
    assert elapsed < TIMEOUT_MS / 1000 + 0.5, f"errors came after {elapsed:.1f} s"
    print(f"\n{COLLECTIVE}: the other ranks' errors {elapsed - 0.5:.2f} s after the kill: "
          f"{res[0].message[:300]}")
    if COLLECTIVE == "nccl":
        # NCCL does not notice a dead peer; the daemons' watch (pings while
        # a collective waits) does, before the deadline. (The trainers may
        # hear another daemon's account of it first: the collective its
        # abort cut short.)
        assert any("is gone: nothing listens at its peer service while the collective waited"
                   in c[i].log() for i in range(last)), c.logs()
        assert elapsed - 0.5 < 2.5, f"over NCCL the errors came {elapsed - 0.5:.2f} s after the kill"
    # The daemon restarts (empty); its trainer re-joins and registers again.
    # Its daemon numbers epochs from 1 again: that first attempt is refused
    # (FAILED_PRECONDITION naming the open epoch, never an answer labelled
    # with another epoch), the trainer sends again for the open epoch, and
    # the others call Reconcile again.
    c.start(last)
    clients[last].close()
    clients[last] = amaxd.Client("k", last, n, socket=c.socket(last), timeout=30)

    def again(r):
        if r == last:
            # Its daemon kept nothing of the rank: register again.
            assert not clients[last].join().rejoined
            clients[last].register(qs)
            clients[last].send(vals(last, 3))
            got, seen = reconcile_as_trainer(clients[last], resend=vals(last, 3))
            assert any(isinstance(e, amaxd.errors.FailedPrecondition) and
                       "had reconciled no epoch of the job" in e.message for e in seen), seen
            assert clients[last].epoch == 4, clients[last].epoch
            return got
        return reconcile_as_trainer(clients[r])[0]
    out, errs = run_threads({r: (lambda r=r: again(r)) for r in range(n)})
    assert not errs, f"{errs}\n{c.logs()}"
    w = np.max([vals(r, e)["w"] for r in range(n) for e in (1, 2, 3)], axis=0)
    for r in range(n):
        assert out[r]["w"].amax.tobytes() == w.tobytes(), (r, out[r]["w"].amax, w)
    assert len({out[r]["x"].amax.tobytes() for r in range(n)}) == 1
    assert "caught up with daemon" in c[last].log()
    # The daemon that caught up answers what the others answer, the previous
    # epoch's globals (epoch 2's, from its donor) included.
    from test_coordinator import whole
    wholes = [whole(clients[r]) for r in range(n)]
    assert all(w == wholes[0] for w in wholes), (wholes, c.logs())
    assert wholes[0]["x"][6] is not None
    # And the epoch after that is an ordinary one.
    out, errs = run_threads({r: (lambda r=r: (clients[r].send(vals(r, 4)),
                                             clients[r].reconcile())[1]) for r in range(n)})
    assert not errs, f"{errs}\n{c.logs()}"
    st = [clients[r].status("k").jobs[0] for r in range(n)]
    assert len({s.reconciled_epochs for s in st}) == 1
    assert all(s.last_collectives == 1 for s in st)
    for cl in clients:
        cl.close()


def test_daemon_killed_in_the_rendezvous(make_cluster):
    """A daemon that dies after the agreement, before it published its part
    of the rendezvous (its Gloo address; over NCCL it is then missing from
    the communicator's init): the others' trainers get UNAVAILABLE naming
    it once its ring neighbours' pings fail, far before the 20 s deadline
    (before, a rendezvous get waited for the deadline). The daemon's pause
    there is a test hook (AMAXD_TEST_RENDEZVOUS_PAUSE)."""
    n = max_daemons(4)  # daemon 1 is no ring neighbour of the last: it hears the Abort
    last = n - 1
    deadline_ms = 20000
    c = make_cluster(n, f"--reconcile-timeout-ms={deadline_ms}",
                     env={"AMAXD_TEST_RENDEZVOUS_PAUSE": f"{last}:60000"})
    qs = [Q("w", [3]), Q("x")]
    vals = lambda r: {"w": np.array([r + 1, 10 - r, 5], np.float32), "x": np.float32(r * 2)}
    clients = [amaxd.Client("rv", r, n, socket=c.socket(r), timeout=60) for r in range(n)]
    res = {}

    def rank(r):
        clients[r].join()
        clients[r].register(qs)
        clients[r].send(vals(r))
        res[r] = _try(clients[r].reconcile)
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    limit = time.monotonic() + 30
    while "waiting 60000 ms before the rendezvous" not in c[last].log():
        assert time.monotonic() < limit, c.logs()
        time.sleep(0.05)
    time.sleep(0.3)  # the others are in the rendezvous now
    killed = time.monotonic()
    c.kill(last)
    for r in range(last):
        ts[r].join(deadline_ms / 1000 + 10)
    assert not any(ts[r].is_alive() for r in range(last)), "a trainer hangs"
    elapsed = time.monotonic() - killed
    for r in range(last):
        e = res[r]
        assert isinstance(e, amaxd.errors.Unavailable), (r, e, c.logs())
        assert f"daemon {last}" in e.message, (r, e.message)
    print(f"\n{COLLECTIVE}: the others' errors {elapsed:.2f} s after the kill in the rendezvous: "
          f"{res[0].message[:300]}")
    assert elapsed < 6, f"the errors came {elapsed:.2f} s after the kill (deadline 20 s)"
    if COLLECTIVE == "gloo":
        assert any("while the rendezvous waited for" in c[i].log() for i in range(last)), c.logs()
    # Restarted without the pause, the daemon (empty) and its trainer join
    # again; every rank gets epoch 1.
    c.env = None
    c.start(last)
    ts[last].join(10)
    clients[last].close()
    clients[last] = amaxd.Client("rv", last, n, socket=c.socket(last), timeout=60)

    def again(r):
        if r == last:
            clients[r].join()
            clients[r].register(qs)
            clients[r].send(vals(r))
            return reconcile_as_trainer(clients[r], resend=vals(r))[0]
        return reconcile_as_trainer(clients[r], resend=vals(r))[0]
    out, errs = run_threads({r: (lambda r=r: again(r)) for r in range(n)})
    assert not errs, f"{errs}\n{c.logs()}"
    w = np.max([vals(r)["w"] for r in range(n)], axis=0)
    for r in range(n):
        assert out[r]["w"].amax.tobytes() == w.tobytes(), (r, out[r]["w"].amax, w)
    for cl in clients:
        cl.close()


def test_slow_daemon_in_the_rendezvous_is_waited_for(make_cluster):
    """A daemon alive but slow to publish its part of the rendezvous (1.5 s,
    several of the watch's 0.4 s slices): the others wait for it (their
    pings succeed) and the epoch is reconciled everywhere."""
    n = max_daemons(3)
    last = n - 1
    c = make_cluster(n, "--reconcile-timeout-ms=20000",
                     env={"AMAXD_TEST_RENDEZVOUS_PAUSE": f"{last}:1500"})
    qs = [Q("w", [3])]
    clients = [amaxd.Client("sl", r, n, socket=c.socket(r), timeout=60) for r in range(n)]

    def rank(r):
        clients[r].join()
        clients[r].register(qs)
        clients[r].send({"w": np.array([r, 2 * r, 7], np.float32)})
        return clients[r].reconcile()
    t0 = time.monotonic()
    out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(n)})
    assert not errs, f"{errs}\n{c.logs()}"
    assert time.monotonic() - t0 >= 1.5
    assert "waiting 1500 ms before the rendezvous" in c[last].log()
    want = np.array([last, 2 * last, 7], np.float32).tobytes()
    assert all(out[r]["w"].amax.tobytes() == want for r in range(n)), out
    for cl in clients:
        cl.close()


def test_trainer_that_never_reconciles_is_named(make_cluster):
    c = make_cluster(2, f"--reconcile-timeout-ms={TIMEOUT_MS}")
    clients = [amaxd.Client("n", r, 4, socket=c.socket(r // 2), timeout=30) for r in range(4)]

    def prep(r):
        clients[r].join()
        clients[r].register([Q("a")])
        clients[r].send({"a": float(r)})
    out, errs = run_threads({r: (lambda r=r: prep(r)) for r in range(4)})
    assert not errs, errs
    start = time.monotonic()
    out, errs = run_threads({r: (lambda r=r: clients[r].reconcile()) for r in range(3)},
                            timeout=TIMEOUT_MS / 1000 + 10)
    elapsed = time.monotonic() - start
    assert sorted(errs) == [0, 1, 2], (out, errs)
    for r, e in errs.items():
        assert isinstance(e, amaxd.errors.DeadlineExceeded), (r, e)
        assert "3" in e.message and ("rank 3" in e.message or "ranks 3" in e.message), e.message
    assert elapsed < TIMEOUT_MS / 1000 + 0.5
    # Everyone comes: the next attempt succeeds with every contribution.
    out, errs = run_threads({r: (lambda r=r: clients[r].reconcile()) for r in range(4)})
    assert not errs, f"{errs}\n{c.logs()}"
    assert all(out[r]["a"].amax[()] == 3.0 for r in range(4))
    for cl in clients:
        cl.close()


def test_catalog_conflict_reaches_every_trainer(make_cluster):
    c = make_cluster(2)
    clients = [amaxd.Client("cf", r, 2, socket=c.socket(r), timeout=30) for r in range(2)]

    def prep(r):
        clients[r].join()
        clients[r].register([Q("ok"), Q("w", [4] if r == 0 else [8])])
        clients[r].send({"ok": 1.0 + r})
    out, errs = run_threads({r: (lambda r=r: prep(r)) for r in range(2)})
    assert not errs, errs
    out, errs = run_threads({r: (lambda r=r: clients[r].reconcile()) for r in range(2)})
    assert sorted(errs) == [0, 1], out
    assert isinstance(errs[0], amaxd.errors.FailedPrecondition), errs[0]
    assert errs[0].message == errs[1].message
    assert "'w'" in errs[0].message and "[4] vs [8]" in errs[0].message
    assert "daemon 0" in errs[0].message and "daemon 1" in errs[0].message
    # The conflicting registrations were dropped; the others were agreed.
    for r in range(2):
        names = {q.name: q.agreed for q in clients[r].list_quantizers().quantizers}
        assert names == {"ok": True}, names
    # Declared consistently again, the next epoch works (contributions kept).
    clients[1].register([Q("w", [4])])
    clients[0].register([Q("w", [4])])
    out, errs = run_threads({r: (lambda r=r: clients[r].reconcile()) for r in range(2)})
    assert not errs, f"{errs}\n{c.logs()}"
    assert out[0]["ok"].amax[()] == out[1]["ok"].amax[()] == 2.0
    for cl in clients:
        cl.close()


def test_peer_without_secret_is_unauthenticated(make_cluster, tmp_path):
    c = make_cluster(2)
    # A raw call on the coordinator's peer port without a token.
    with grpc.insecure_channel(f"127.0.0.1:{c.ports[0]}") as ch:
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/amaxd.peer.v1.Peer/Progress")(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/amaxd.peer.v1.Peer/Join")(
                b"", timeout=5, metadata=[("x-amaxd-auth", "1:00")])
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "refused /amaxd.peer.v1.Peer/Progress" in c[0].log()
    # A daemon with another secret: its trainers learn why.
    c.stop_all()
    c2 = make_cluster(2)
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"another-secret-of-16-bytes")
    os.chmod(wrong, 0o600)
    c2[1].stop()
    c2.start(1, extra=[f"--cluster-secret-file={wrong}"])
    with amaxd.Client("s", 0, 1, socket=c2.socket(1), timeout=10) as cl:
        with pytest.raises(amaxd.errors.AmaxdError) as e:
            cl.join()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, e.value
    assert "cluster_secret_file" in e.value.message
    assert "wrong token" in c2[0].log()


def test_secret_file_is_checked_at_start(tmp_path):
    from amaxd_proc import BIN
    import subprocess
    loose = tmp_path / "s"
    loose.write_bytes(b"0123456789abcdef0123")
    os.chmod(loose, 0o644)
    args = [BIN, f"--socket={tmp_path}/x.sock", "--cluster-size=2", "--coordinator=127.0.0.1:1",
            f"--cluster-secret-file={loose}", "--collective=gloo", "--backend=host"]
    p = subprocess.run(args, capture_output=True, text=True, timeout=20)
    assert p.returncode == 1 and "chmod 600" in p.stderr, p.stderr
    os.chmod(loose, 0o600)
    loose.write_bytes(b"short")
    p = subprocess.run(args, capture_output=True, text=True, timeout=20)
    assert p.returncode == 1 and "at least 16" in p.stderr, p.stderr
    p = subprocess.run(args[:3], capture_output=True, text=True, timeout=20)
    assert p.returncode == 1 and "no coordinator address" in p.stderr, p.stderr


def health_ms(sock):
    with amaxd.Client("h", 0, 1, socket=sock, timeout=5) as cl:
        t = time.monotonic()
        assert cl.health() == "SERVING"
        return (time.monotonic() - t) * 1000


def test_job_stuck_on_hung_peer_does_not_stop_another(make_cluster):
    c = make_cluster(3, "--reconcile-timeout-ms=8000")
    a = [amaxd.Client("A", r, 3, socket=c.socket(r), timeout=30) for r in range(3)]
    b = [amaxd.Client("B", r, 2, socket=c.socket(r), timeout=30) for r in range(2)]

    def prep(cl, r):
        cl.join()
        cl.register([Q("v")])
    out, errs = run_threads({("A", r): (lambda r=r: prep(a[r], r)) for r in range(3)} |
                            {("B", r): (lambda r=r: prep(b[r], r)) for r in range(2)})
    assert not errs, errs
    out, errs = run_threads({r: (lambda r=r: (a[r].send({"v": 1.0}), a[r].reconcile())[1])
                             for r in range(3)})
    assert not errs, errs
    # Daemon 2 hangs (SIGSTOP): job A's collective on daemons 0 and 1 waits.
    c[2].proc.send_signal(signal.SIGSTOP)
    try:
        stuck = {}
        ts = [threading.Thread(target=lambda r=r: stuck.setdefault(
            r, (a[r].send({"v": 2.0}), _try(a[r].reconcile))[1])) for r in range(2)]
        [t.start() for t in ts]
        time.sleep(0.5)
        worst = 0.0
        for epoch in range(5):
            out, errs = run_threads({r: (lambda r=r: (b[r].send({"v": float(epoch)}),
                                                     b[r].reconcile())[1]) for r in range(2)},
                                    timeout=20)
            assert not errs, f"job B blocked: {errs}\n{c.logs()}"
            assert out[0]["v"].amax[()] == float(epoch) or epoch == 0
            worst = max(worst, health_ms(c.socket(0)), health_ms(c.socket(1)))
        assert all(t.is_alive() for t in ts), "job A should still be waiting on the hung peer"
        assert worst < 100, f"Health took {worst:.1f} ms"
    finally:
        c[2].proc.send_signal(signal.SIGCONT)
    [t.join(20) for t in ts]
    assert all(isinstance(stuck[r], amaxd.AmaxdError) for r in range(2)), stuck
    for cl in a + b:
        cl.close()


@pytest.mark.parametrize("where", [0, 1], ids=["reset_on_coordinator", "reset_on_member"])
def test_drop_while_joins_wait_on_several_daemons(make_cluster, where):
    """Reset(drop_job) before all ranks joined: every waiting Join, on this
    daemon and on the others, ends with ABORTED, and the name can be joined
    again at once (docs/API.md)."""
    c = make_cluster(2)
    res = {}

    def join(r):
        res[r] = _try(lambda: amaxd.Client("dj", r, 3, socket=c.socket(r), timeout=30).join())
    ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in ts]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(
            "job dj: rank %d joining" % r in c[r].log() for r in (0, 1)):
        time.sleep(0.05)
    with amaxd.Client("dj", 2, 3, socket=c.socket(where), timeout=10) as cl:
        cl.reset(drop_job=True)
    [t.join(5) for t in ts]
    assert not any(t.is_alive() for t in ts), "a Join still waits after the job was dropped"
    for r in (0, 1):
        assert isinstance(res[r], amaxd.errors.Aborted), (r, res[r])
        assert "dropped" in res[r].message, res[r].message
    # The same name, all three ranks: a fresh job.
    out, errs = run_threads({r: (lambda r=r: amaxd.Client("dj", r, 3, socket=c.socket(r % 2),
                                                          timeout=10).join())
                             for r in range(3)})
    assert not errs, f"{errs}\n{c.logs()}"
    for i in range(2):
        assert c[i].proc.poll() is None, c.logs()


def test_join_with_a_stopped_coordinator_names_it(make_cluster):
    """The coordinator hangs (SIGSTOP): a Join through another daemon ends
    within join_timeout_ms with DEADLINE_EXCEEDED naming the coordinator."""
    join_ms = 3000
    c = make_cluster(2, f"--join-timeout-ms={join_ms}")
    c[0].proc.send_signal(signal.SIGSTOP)
    try:
        with amaxd.Client("sj", 1, 2, socket=c.socket(1), timeout=30) as cl:
            t = time.monotonic()
            with pytest.raises(amaxd.errors.DeadlineExceeded) as e:
                cl.join()
            took = time.monotonic() - t
    finally:
        c[0].proc.send_signal(signal.SIGCONT)
    assert took < join_ms / 1000 + 0.5, f"answered after {took:.2f} s"
    assert f"127.0.0.1:{c.ports[0]}" in e.value.message and "did not answer" in e.value.message, \
        e.value.message
    # With the coordinator back, a genuine timeout still names the missing rank.
    with amaxd.Client("sj2", 1, 2, socket=c.socket(1), timeout=30) as cl:
        with pytest.raises(amaxd.errors.DeadlineExceeded) as e:
            cl.join()
    assert "ranks 0 never joined" in e.value.message, e.value.message


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _abort_request(job, gen, sender, reason, code, epoch=0, agreement=0, coord_inc=0):
    """amaxd.peer.v1.AbortRequest, encoded by hand (fields 1-8)."""
    def s(field, v):
        v = v.encode()
        return _varint(field << 3 | 2) + _varint(len(v)) + v
    out = (s(1, job) + _varint(2 << 3) + _varint(gen) + _varint(3 << 3) + _varint(sender) +
           s(4, reason) + _varint(5 << 3) + _varint(code))
    if epoch:
        out += _varint(6 << 3) + _varint(epoch)
    if agreement:
        out += _varint(7 << 3) + _varint(agreement)
    if coord_inc:
        out += _varint(8 << 3 | 1) + coord_inc.to_bytes(8, "little")
    return out


def _send_abort(c, daemon, request):
    method = "/amaxd.peer.v1.Peer/Abort"
    with open(c.secret_path, "rb") as f:
        secret = f.read()
    with grpc.insecure_channel(f"127.0.0.1:{c.ports[daemon]}") as ch:
        ch.unary_unary(method)(request, timeout=5,
                               metadata=[("x-amaxd-auth", _peer_token(secret, method))])


def _peer_token(secret, method):
    import hashlib
    import hmac
    now = int(time.time())
    mac = hmac.new(secret, f"{now}:{method}".encode(), hashlib.sha256).hexdigest()
    return f"{now}:{mac}"


def _wait_log(daemon, text, count=1, limit=10.0):
    """Until `text` is in the daemon's log `count` times (or `limit` s)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and daemon.log().count(text) < count:
        time.sleep(0.05)


def test_abort_from_a_peer_passes_on_its_cause(make_cluster):
    """A daemon whose collective waits is told by another (peer Abort) that
    the epoch failed with DEADLINE_EXCEEDED because daemon 2 did not come:
    its trainers get that status and sentence, not a bare ABORTED. (Over
    NCCL this is how a survivor learns of a dead peer; over Gloo the broken
    connections usually come first.)"""
    c = make_cluster(3, "--reconcile-timeout-ms=6000")
    cl = [amaxd.Client("pa", r, 3, socket=c.socket(r), timeout=60) for r in range(3)]
    out, errs = run_threads({r: (lambda r=r: (cl[r].join(), cl[r].register([Q("x")]),
                                              cl[r].send({"x": float(r)}),
                                              cl[r].reconcile())[-1]) for r in range(3)})
    assert not errs, errs
    c[2].proc.send_signal(signal.SIGSTOP)
    try:
        res = {}

        def waiting():
            cl[1].send({"x": 5.0})
            res[1] = _try(cl[1].reconcile)
        t = threading.Thread(target=waiting)
        t.start()
        _wait_log(c[1], "epoch 2 handed to its engine")
        time.sleep(0.3)
        reason = ("job 'pa', epoch 2: the nccl all-reduce of 1 cells across 3 daemons timed out; "
                  f"daemon 2 (127.0.0.1:{c.ports[2]}) did not answer")
        _send_abort(c, 1, _abort_request("pa", 0, 0, reason, 4))
        t.join(10)
        assert not t.is_alive(), "the aborted trainer still waits"
        e = res[1]
        assert isinstance(e, amaxd.errors.DeadlineExceeded), e
        assert "failed on daemon 0" in e.message and "daemon 2" in e.message, e.message
    finally:
        c[2].proc.send_signal(signal.SIGCONT)
    # Everyone back: the daemons that kept the old communicator find it
    # broken once, then the epoch completes with every contribution.
    def again(r):
        for _ in range(3):
            try:
                return cl[r].reconcile()
            except (amaxd.errors.Unavailable, amaxd.errors.Aborted,
                    amaxd.errors.DeadlineExceeded):
                pass
        return cl[r].reconcile()
    # (Over NCCL the daemons that kept the old communicator find it broken
    # only at their deadline: each attempt may take the 6 s.)
    out, errs = run_threads({r: (lambda r=r: again(r)) for r in range(3)}, timeout=120)
    assert not errs, f"{errs}\n{c.logs()}"
    assert all(out[r]["x"].amax[()] == 5.0 for r in range(3))
    for x in cl:
        x.close()


def test_late_abort_of_a_failed_attempt_is_ignored(make_cluster):
    """An Abort names the epoch and the agreement round its sender's
    attempt took part in. Epoch 2's first attempt fails on both daemons at
    its agreement (a catalog conflict); an Abort of that round that reaches
    daemon 0 late, while its next attempt of epoch 2 waits, must not fail
    that attempt: it is ignored, with a log line, and the epoch completes.
    An Abort of the round whose communicator daemon 0 still uses (a peer
    that failed after that round's collective, e.g. in its finish, and
    dropped it) must still fail the attempt that runs on it (epoch 3)."""
    import re
    c = make_cluster(2, "--reconcile-timeout-ms=20000")
    cl = [amaxd.Client("la", r, 2, socket=c.socket(r), timeout=60) for r in range(2)]
    out, errs = run_threads({r: (lambda r=r: (cl[r].join(), cl[r].register([Q("x")]),
                                              cl[r].send({"x": float(r)}),
                                              cl[r].reconcile())[-1]) for r in range(2)})
    assert not errs, errs

    def rounds():
        return [(int(s), int(g), int(i, 16)) for s, g, i in re.findall(
            r"job la: agreement (\d+): .*communicator generation (\d+).*coordinator "
            r"incarnation ([0-9a-f]{16})", c[0].log())]
    # Epoch 2, first attempt: a conflict fails it on both daemons.
    for r in range(2):
        cl[r].register([Q("w", [4] if r == 0 else [8])])
        cl[r].send({"x": 10.0 + r})
    out, errs = run_threads({r: cl[r].reconcile for r in range(2)})
    assert sorted(errs) == [0, 1] and all(isinstance(e, amaxd.errors.FailedPrecondition)
                                          for e in errs.values()), (out, errs)
    failed, _, inc = rounds()[-1]
    res = {}

    def waiting(r):
        res[r] = _try(cl[r].reconcile)
    # Epoch 2, next attempt: daemon 0 waits for daemon 1's rank when the
    # failed round's Abort comes.
    t = threading.Thread(target=waiting, args=(0,))
    t.start()
    _wait_log(c[0], "epoch 2 handed to its engine", 2)
    time.sleep(0.3)
    reason = "job 'la', epoch 2: a late account of the attempt that failed"
    _send_abort(c, 0, _abort_request("la", 0, 1, reason, 10, epoch=2, agreement=failed,
                                     coord_inc=inc))
    time.sleep(0.5)
    assert t.is_alive(), f"the late Abort ended the attempt: {res}"
    assert (f"the abort of epoch 2 from daemon 1 is about agreement {failed}, an attempt that "
            "has ended here: ignored") in c[0].log(), c[0].log()
    waiting(1)
    t.join(30)
    for r in range(2):
        assert not isinstance(res[r], Exception), f"rank {r}: {res[r]}\n{c.logs()}"
        assert res[r]["x"].amax[()] == 11.0, res[r]["x"].amax
    ok, gen, inc2 = rounds()[-1]
    assert ok > failed and inc2 == inc, rounds()
    # Epoch 3 runs on that round's communicator. Daemon 1 failing epoch 2
    # after its collective (in its finish) drops the communicator and says
    # so: its Abort names epoch 2, the round and the generation, and must
    # fail daemon 0's epoch 3, which would wait on that communicator.
    for r in range(2):
        cl[r].send({"x": 20.0 + r})
    t = threading.Thread(target=waiting, args=(0,))
    t.start()
    _wait_log(c[0], "epoch 3 handed to its engine")
    time.sleep(0.3)
    reason = "job 'la', epoch 2: daemon 1's finish failed after the collective"
    _send_abort(c, 0, _abort_request("la", gen, 1, reason, 10, epoch=2, agreement=ok,
                                     coord_inc=inc))
    t.join(10)
    assert not t.is_alive(), "an Abort of the communicator in use did not fail the attempt"
    assert isinstance(res[0], amaxd.errors.Aborted) and "finish failed" in res[0].message, res[0]
    out, errs = run_threads({r: cl[r].reconcile for r in range(2)})
    assert not errs, (errs, c.logs())
    assert out[0]["x"].amax[()] == out[1]["x"].amax[()] == 21.0, out
    for x in cl:
        x.close()


def _restart_in_flight(make_cluster, timeout_ms):
    """Two daemons, one rank each, job "jf" calibrated to epoch 1; rank 0
    sent 22 for epoch 2 and waits in Reconcile (daemon 0's epoch 2 in
    flight, waiting for daemon 1's rank) when its trainer dies. Returns the
    cluster, rank 1's client, and the new trainer's client and the result
    of its Join (a dict, filled by a thread once Join returns)."""
    c = make_cluster(2, f"--reconcile-timeout-ms={timeout_ms}")
    old = [amaxd.Client("jf", r, 2, socket=c.socket(r), timeout=60) for r in range(2)]
    out, errs = run_threads({r: (lambda r=r: (old[r].join(), old[r].register([Q("x")]),
                                              old[r].send({"x": float(r)}),
                                              old[r].reconcile())[-1]) for r in range(2)})
    assert not errs, errs
    old[0].send({"x": 22.0})
    t_old = threading.Thread(target=lambda: pytest_safe(old[0].reconcile))
    t_old.start()
    _wait_log(c[0], "epoch 2 handed to its engine")
    old[0].close()  # the trainer dies: its Reconcile call goes away
    t_old.join(10)
    fresh = amaxd.Client("jf", 0, 2, socket=c.socket(0), timeout=60)
    joined = {}
    t_join = threading.Thread(target=lambda: joined.update(j=pytest_safe(fresh.join)))
    t_join.start()
    _wait_log(c[0], "re-joined while epoch 2, which its earlier call entered, is in flight")
    time.sleep(0.2)
    assert t_join.is_alive(), joined  # Join waits for the epoch in flight
    return c, old[1], fresh, joined, t_join


def pytest_safe(fn):
    """fn(), or the exception it raised (for threads: no BaseException escapes)."""
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - the caller checks
        return e


def test_trainer_restarted_while_its_epoch_is_in_flight(make_cluster):
    """Rank 0's daemon has its epoch 2 in flight (its only rank entered
    Reconcile; it waits for daemon 1's rank) when rank 0's trainer dies and
    a new one starts. The new trainer's Join waits until epoch 2 has ended
    (which goes on with what the old trainer sent), then names epoch 3, the
    open one; GetScales reads epoch 2, and epoch 3 holds the new trainer's
    values. (Join used to name epoch 2 at once and SendAmax(2) was then
    refused: tests/cluster/outside/repro_join_inflight.py. Naming epoch 3 at
    once let the new trainer send for it while epoch 2 could still fail, and
    a failure carried those values into epoch 2's retry: the outside check
    chaos.py, scenarios rejoin-inflight/.../late.)"""
    c, rank1, fresh, joined, t_join = _restart_in_flight(make_cluster, 20000)
    # A second waiting Join whose client goes away is withdrawn: the
    # epoch's end must not answer it (the daemon would touch a freed call).
    gone = amaxd.Client("jf", 0, 2, socket=c.socket(0), timeout=60)
    t_gone = threading.Thread(target=lambda: pytest_safe(gone.join))
    t_gone.start()
    _wait_log(c[0], "re-joined while epoch 2, which its earlier call entered, is in flight", 2)
    gone.close()
    t_gone.join(10)
    # A client that learns its epoch from Status (after a refusal) learns
    # the one SendAmax adds to: 3 while epoch 2 is in flight.
    probe = amaxd.Client("jf", 0, 2, socket=c.socket(0), timeout=60)
    probe._learn_epoch()
    assert probe.epoch == 3, probe.epoch
    probe.close()
    rank1.send({"x": 21.0})
    got1 = rank1.reconcile()  # epoch 2 ends
    assert got1["x"].amax[()] == 22.0, got1["x"].amax  # the old trainer's value counted
    t_join.join(10)
    j = joined["j"]
    assert not isinstance(j, BaseException) and j.rejoined and j.epoch == 3, j
    assert c[0].log().count("re-joined; state kept (epoch 3 open)") == 1, c[0].log()
    assert fresh.get_scales()["x"].amax[()] == 22.0
    fresh.send({"x": 32.0})
    rank1.send({"x": 31.0})
    out, errs = run_threads({0: fresh.reconcile, 1: rank1.reconcile})
    assert not errs, (errs, c.logs())
    assert out[0]["x"].amax[()] == out[1]["x"].amax[()] == 32.0, (out, c.logs())
    assert fresh.epoch == 4 and rank1.epoch == 4
    fresh.close()
    rank1.close()


def test_trainer_restarted_while_its_epoch_fails(make_cluster):
    """As above, but epoch 2 then fails (daemon 1's rank does not come
    within the deadline): the new trainer's Join names epoch 2, still open,
    and what it sends goes there; epoch 2's retry holds the old trainer's 22
    and the new 23 (max 23), never a value meant for epoch 3."""
    c, rank1, fresh, joined, t_join = _restart_in_flight(make_cluster, 1500)
    t_join.join(15)
    j = joined["j"]
    assert not isinstance(j, BaseException) and j.rejoined and j.epoch == 2, (j, c.logs())
    fresh.send({"x": 23.0})
    rank1.send({"x": 21.0})

    def again(cl):
        for _ in range(5):
            try:
                return cl.reconcile()
            except (amaxd.errors.Aborted, amaxd.errors.DeadlineExceeded,
                    amaxd.errors.Unavailable):
                pass
        return cl.reconcile()
    out, errs = run_threads({0: lambda: again(fresh), 1: lambda: again(rank1)})
    assert not errs, (errs, c.logs())
    assert out[0]["x"].amax[()] == out[1]["x"].amax[()] == 23.0, (out, c.logs())
    assert fresh.epoch == 3
    fresh.close()
    rank1.close()
