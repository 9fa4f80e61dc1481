"""What agreement costs the coordinator (docs/CLUSTER.md, "What agreement
costs"), read from its counters (Status.coordinator_status): daemons that
registered the same catalog send it once between them and get no catalog
back; a quantizer added by one rank costs one spec in and one spec per
other daemon out; an epoch in which nothing changed costs nothing; a
Reset is agreed without any spec."""
import numpy as np
import pytest

import amaxd
from conftest import max_daemons
from test_basic import run_threads

Q = 300  # more than a Sync carries inline: offers go by hash


def catalog(extra=()):
    qs = [amaxd.Quantizer(f"layer{i:03d}.w", [], amaxd.Recipe.fp8_current()) for i in range(Q)]
    return qs + [amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current()) for n in extra]


def coord(cl):
    return cl.status("").coordinator_status


def test_identical_members_send_hashes_and_get_deltas(make_cluster):
    n = max_daemons(4)
    if n < 3:
        pytest.skip("needs 3 daemons")
    c = make_cluster(n)
    # One rank per member daemon; the coordinator hosts none (it is not a
    # participant: what it does is only the coordinator's work).
    world = n - 1
    cls = {r: amaxd.Client("ac", r, world, socket=c.socket(r + 1), timeout=60)
           for r in range(world)}
    admin = amaxd.Client("admin", 0, 1, socket=c.socket(0), timeout=30)

    def first(r):
        cls[r].join()
        cls[r].register(catalog())
        cls[r].send({f"layer{i:03d}.w": float(r + i) for i in range(Q)})
        return cls[r].reconcile()
    out, errs = run_threads({r: (lambda r=r: first(r)) for r in range(world)})
    assert not errs, f"{errs}\n{c.logs()}"
    s1 = coord(admin)
    # One offer of Q specs for all of them; no catalog sent back (each made
    # it from its own registrations); one answer serialized and shared.
    assert s1.specs_received == Q, s1
    assert s1.specs_sent == 0, s1
    assert s1.rounds == 1 and s1.syncs >= world, s1
    assert s1.offers_asked == 1, s1  # asked of one daemon; the others waited for it
    assert s1.answers_built <= 2, s1
    # The answers carry no catalog: their size does not grow with it.
    assert s1.answer_bytes < 128 * s1.syncs, s1
    for r in range(world):
        assert out[r][f"layer{Q - 1:03d}.w"].amax[()] == float(world - 1 + Q - 1)

    # Steady epochs: the coordinator sees nothing.
    for e in range(3):
        out, errs = run_threads({r: (lambda r=r: (cls[r].send({"layer000.w": float(e)}),
                                                  cls[r].reconcile())[1]) for r in range(world)})
        assert not errs, errs
    s2 = coord(admin)
    assert (s2.syncs, s2.rounds, s2.specs_received, s2.specs_sent) == \
        (s1.syncs, s1.rounds, s1.specs_received, s1.specs_sent), (s1, s2)

    # One rank adds one quantizer: one spec in, one spec to each other daemon.
    def change(r):
        if r == 0:
            cls[0].register([amaxd.Quantizer("new.x", [], amaxd.Recipe.fp8_current())])
            cls[0].send({"new.x": 7.0})
        return cls[r].reconcile()
    out, errs = run_threads({r: (lambda r=r: change(r)) for r in range(world)})
    assert not errs, f"{errs}\n{c.logs()}"
    s3 = coord(admin)
    assert s3.rounds == s2.rounds + 1, (s2, s3)
    assert s3.specs_received - s2.specs_received == 1, (s2, s3)
    assert s3.specs_sent - s2.specs_sent == world - 1, (s2, s3)  # a delta of one spec each
    assert out[0]["new.x"].amax[()] == 7.0
    for r in range(world):
        names = {q.name for q in cls[r].list_quantizers().quantizers}
        assert "new.x" in names and len(names) == Q + 1, (r, len(names))

    # A Reset of one quantizer: agreed without any spec.
    cls[1].reset(["layer007.w"])
    out, errs = run_threads({r: (lambda r=r: (cls[r].send({"layer007.w": 0.5}),
                                              cls[r].reconcile())[1]) for r in range(world)})
    assert not errs, f"{errs}\n{c.logs()}"
    s4 = coord(admin)
    assert s4.specs_received == s3.specs_received and s4.specs_sent == s3.specs_sent, (s3, s4)
    for r in range(world):
        assert out[r]["layer007.w"].amax[()] == np.float32(0.5), out[r]["layer007.w"]
    # Every daemon has the same bytes.
    wholes = [{k: v.amax.tobytes() for k, v in cls[r].get_scales(whole=True).items()}
              for r in range(world)]
    assert all(w == wholes[0] for w in wholes)
    for x in list(cls.values()) + [admin]:
        x.close()


def test_agreed_catalog_over_one_daemons_limits_fails_everywhere_with_the_cause(make_cluster):
    """The agreed catalog holds what other daemons' ranks registered: a
    daemon configured with a lower max_quantizers fails the epoch with
    RESOURCE_EXHAUSTED naming its limit (it used to take the catalog
    silently), and its peers, which would otherwise wait for it in the
    rendezvous and then blame its ranks, fail at once with its sentence."""
    import time
    c = make_cluster(3)
    d = c[2]
    d.check_clean_exit(d.stop())
    c.start(2, extra=("--max-quantizers=5",))
    cls = {r: amaxd.Client("lim", r, 3, socket=c.socket(r), timeout=60) for r in range(3)}

    def run(r):
        cls[r].join()
        names = [f"q{i}" for i in (range(10) if r == 0 else range(2))]
        cls[r].register([amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current()) for n in names])
        cls[r].send({n: 1.0 + r for n in names})
        t0 = time.monotonic()
        try:
            cls[r].reconcile()
        except amaxd.AmaxdError as e:
            return e, time.monotonic() - t0
        return None, time.monotonic() - t0
    out, errs = run_threads({r: (lambda r=r: run(r)) for r in range(3)})
    assert not errs, errs
    for r in range(3):
        e, took = out[r]
        assert e is not None, f"rank {r} reconciled a catalog over daemon 2's limit\n{c.logs()}"
        assert isinstance(e, amaxd.errors.ResourceExhausted), (r, type(e), e, c.logs())
        assert "daemon 2's max_quantizers=5" in str(e), (r, e)
        assert "never entered" not in str(e), (r, e)
        assert took < 30, (r, took)  # not the 60 s deadline
    for x in cls.values():
        x.close()


def test_agreement_answers_are_not_refused_by_trainer_caps(make_cluster):
    """Daemons whose ranks registered little get the other ranks'
    quantizers as a delta bigger than max_queued_bytes (1 MiB): peer
    answers are not bounded by the caps meant for trainers' answers (before,
    the members got RESOURCE_EXHAUSTED and the coordinator's rank waited its
    whole timeout)."""
    c = make_cluster(3, "--max-queued-bytes=1048576")
    n = 40000
    cls = {r: amaxd.Client("big", r, 3, socket=c.socket(r), timeout=60) for r in range(3)}

    def run(r):
        cls[r].join()
        names = [f"blk{i:05d}.weight_quantizer" for i in (range(n) if r == 0 else range(1))]
        cls[r].register([amaxd.Quantizer(x, [], amaxd.Recipe.fp8_current()) for x in names])
        cls[r].send({x: 2.0 + r for x in names[:100]})
        return cls[r].reconcile(names=["blk00000.weight_quantizer"])
    out, errs = run_threads({r: (lambda r=r: run(r)) for r in range(3)})
    assert not errs, f"{errs}\n{c.logs()}"
    for r in range(3):
        assert out[r]["blk00000.weight_quantizer"].amax[()] == 4.0
    js = [cls[r].status("big").jobs[0] for r in range(3)]
    assert all(j.quantizers == n and j.catalog_hash == js[0].catalog_hash for j in js), js
    s = coord(cls[0])
    assert s.specs_sent >= 2 * (n - 1), s  # the two deltas were delivered
    assert s.answer_bytes > 2 * 1048576, s
    for x in cls.values():
        x.close()


def _fails_fast(cls, run, timeout_s):
    import time
    t0 = time.monotonic()
    out, errs = run_threads({r: (lambda r=r: run(r)) for r in cls})
    return out, errs, time.monotonic() - t0


def test_a_retry_over_one_daemons_limit_fails_everywhere_at_once(make_cluster):
    """The epoch that first brings the catalog over daemon 2's
    max_quantizers fails on every daemon at once, and so does every retry
    of it: the peers, agreeing on a new communicator, hear daemon 2's cause
    (it used to send its abort for the communicator it last held, which the
    peers ignored: they waited their whole timeout and blamed its rank)."""
    c = make_cluster(3, "--reconcile-timeout-ms=20000")
    c[2].check_clean_exit(c[2].stop())
    c.start(2, extra=("--max-quantizers=50",))
    cls = {r: amaxd.Client("rt", r, 3, socket=c.socket(r), timeout=60) for r in range(3)}
    base = [amaxd.Quantizer(f"b{i}", [], amaxd.Recipe.fp8_current()) for i in range(10)]
    more = [amaxd.Quantizer(f"m{i:02d}", [], amaxd.Recipe.fp8_current()) for i in range(60)]
    out, errs = run_threads({r: (lambda r=r: (cls[r].join(), cls[r].register(base),
                                              cls[r].send({"b0": 1.0}), cls[r].reconcile())[-1])
                             for r in range(3)})
    assert not errs, errs

    def add(r):
        if r == 0:
            cls[0].register(more)
        cls[r].send({"b0": 2.0})
        return cls[r].reconcile()
    for attempt, fn in enumerate((add, lambda r: cls[r].reconcile(), lambda r: cls[r].reconcile())):
        out, errs, took = _fails_fast(cls, fn, 20)
        assert set(errs) == {0, 1, 2}, (attempt, out, errs)
        for r, e in errs.items():
            assert isinstance(e, amaxd.errors.ResourceExhausted), (attempt, r, e)
            assert "daemon 2's max_quantizers=50" in str(e), (attempt, r, e)
            assert "did not enter" not in str(e), (attempt, r, e)
        assert took < 10, (attempt, took, c.logs())  # not the 20 s timeout
    for x in cls.values():
        x.close()


def test_a_peer_that_starts_the_epoch_later_hears_the_cause(make_cluster):
    """Daemon 1's agreement request is refused by the coordinator (its offer
    is over the coordinator's max_message_bytes) before daemon 2's trainer
    even entered the epoch: daemon 2 fails that epoch as it starts, with
    daemon 1's cause naming the coordinator and the setting, not after its
    whole timeout blaming daemon 1's rank. The coordinator's own
    max_quantizers does not bound the members' requests."""
    import time
    c = make_cluster(3, "--reconcile-timeout-ms=15000")
    c[0].check_clean_exit(c[0].stop())
    c.start(0, extra=("--max-message-bytes=1048576", "--max-quantizers=50"))
    cls = {r: amaxd.Client("late", r, 2, socket=c.socket(r + 1), timeout=60) for r in range(2)}
    qs = [amaxd.Quantizer(f"model.layers.{i:05d}.input_quantizer", [],
                          amaxd.Recipe.fp8_current()) for i in range(40000)]

    def run(r):
        cls[r].join()
        cls[r].register(qs)
        cls[r].send({qs[0].name: 1.0})
        if r == 1:
            time.sleep(1.0)
        t0 = time.monotonic()
        try:
            cls[r].reconcile(names=[qs[0].name])
        except amaxd.AmaxdError as e:
            return e, time.monotonic() - t0
        return None, time.monotonic() - t0
    out, errs = run_threads({r: (lambda r=r: run(r)) for r in range(2)})
    assert not errs, errs
    for r in range(2):
        e, took = out[r]
        assert isinstance(e, amaxd.errors.ResourceExhausted), (r, e)
        assert "coordinator (daemon 0" in str(e) and "max_message_bytes" in str(e), (r, e)
        assert "did not enter" not in str(e), (r, e)
        assert took < 5, (r, took)
    # Within max_message_bytes, more specs than the coordinator's
    # max_quantizers agree: that limit is the participants'.
    few = [amaxd.Quantizer(f"f{i:03d}", [], amaxd.Recipe.fp8_current()) for i in range(60)]
    cls2 = {r: amaxd.Client("few", r, 2, socket=c.socket(r + 1), timeout=60) for r in range(2)}
    out, errs = run_threads({r: (lambda r=r: (cls2[r].join(), cls2[r].register(few),
                                              cls2[r].send({"f000": 3.0 + r}),
                                              cls2[r].reconcile())[-1]) for r in range(2)})
    assert not errs, errs
    assert out[0]["f000"].amax[()] == 4.0
    for x in list(cls.values()) + list(cls2.values()):
        x.close()
