"""The asynchronous device call's release of the trainer's stream, on CPU
(docs/API.md "Signals and the asynchronous variant"): fakes stand for the
doorbell, the device buffers and the stream memory operations, so that
every way an asynchronous call can fail is driven without a GPU.

- An error answer, a vanished daemon, an exception while the answer or
  its error is read: the done flag is written once (the stream is freed)
  and result() raises the cause.
- The release itself raises: result() raises StreamNotReleased, with the
  cause's code, saying the stream may stay blocked; the reader thread
  lives on and serves the next call.
- The reader thread's CUDA set-up fails: calls are still read and
  released.
- In Client.reconcile_device_async: a refused send, an unexpected
  exception after the stream was made to wait (it propagates), a failed
  release: always released or reported, never a silent hang.

On a GPU, tests/gpu/test_device.py::test_async_returns_while_the_kernel_runs
runs the real thing."""
import threading

import grpc
import pytest

import amaxd
from amaxd import device as dv, errors, pb


class FakeDoor:
    """Doorbell stand-in: recv() gives the queued outcomes in order."""

    def __init__(self, outcomes=(), path="/nowhere.door"):
        self.path = path
        self.outcomes = list(outcomes)
        self.sent = []
        self.send_error = None
        self.armed, self.conn = False, 1

    def send(self, req, seq=0, arm_fd=None):
        if self.send_error is not None:
            raise self.send_error
        self.sent.append((req, seq))

    def recv(self, timeout):
        o = self.outcomes.pop(0)
        if isinstance(o, BaseException):
            raise o
        return o

    def close(self):
        pass


class Release:
    """A release that counts its calls and may raise."""

    def __init__(self, error=None):
        self.calls = 0
        self.error = error

    def __call__(self):
        self.calls += 1
        if self.error is not None:
            raise self.error


def answer(epoch):
    return pb.ReconcileDeviceResponse(epoch=epoch, next_epoch=epoch + 1, layout_id=1)


def submit(reader, release, timeout=5):
    p = dv.PendingDevice(lambda r: r.epoch, lambda e: None)
    reader.submit(p, timeout, release)
    return p


def unavailable(msg="the doorbell closed"):
    return errors.Unavailable(grpc.StatusCode.UNAVAILABLE, msg)


def test_reader_releases_on_every_failure():
    door = FakeDoor([errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "cell 5 is NaN"),
                     unavailable(),
                     ValueError("mapping the error failed"),
                     answer(4)])
    r = dv.AsyncReader(door, 0, setup=lambda: None)
    rels = [Release() for _ in range(4)]
    ps = [submit(r, rel) for rel in rels]
    with pytest.raises(errors.InvalidArgument, match="cell 5"):
        ps[0].result(5)
    with pytest.raises(errors.Unavailable):
        ps[1].result(5)
    with pytest.raises(ValueError, match="mapping"):
        ps[2].result(5)
    assert ps[3].result(5) == 4
    assert [x.calls for x in rels] == [1, 1, 1, 0], "released once per failed call, never on OK"
    r.stop()


def test_failed_release_is_reported_and_the_reader_lives_on():
    door = FakeDoor([unavailable("the daemon is gone"), answer(7)])
    r = dv.AsyncReader(door, 0, setup=lambda: None)
    bad = Release(OSError("cuStreamWriteValue32 failed (CUresult 700)"))
    p = submit(r, bad)
    with pytest.raises(dv.StreamNotReleased) as ei:
        p.result(5)
    e = ei.value
    assert isinstance(e, errors.AmaxdError) and e.code == grpc.StatusCode.UNAVAILABLE
    assert "the daemon is gone" in e.message and "may stay blocked" in e.message
    assert "CUresult 700" in e.message
    assert isinstance(e.cause, errors.Unavailable) and isinstance(e.release_error, OSError)
    assert bad.calls == 1
    # The thread survived the failed release: the next call is served.
    assert r.alive()
    assert submit(r, Release()).result(5) == 7
    r.stop()


def test_reader_setup_failure_still_releases():
    def setup():
        raise RuntimeError("torch.cuda.set_device failed")
    door = FakeDoor([unavailable()])
    r = dv.AsyncReader(door, 0, setup=setup)
    rel = Release()
    with pytest.raises(errors.Unavailable):
        submit(r, rel).result(5)
    assert rel.calls == 1 and r.alive()
    r.stop()


def test_release_after_never_raises():
    class Odd(BaseException):
        pass
    cause = KeyError("x")  # no code, no message: still reported
    out = dv.release_after(Release(Odd("boom")), cause)
    assert isinstance(out, dv.StreamNotReleased) and out.code == grpc.StatusCode.UNKNOWN
    assert "may stay blocked" in out.message
    ok = unavailable()
    assert dv.release_after(Release(), ok) is ok


# ---- Client.reconcile_device_async with fakes ----

class FakeStream:
    cuda_stream = 0x5151

    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


class FakeBufs:
    def __init__(self):
        self.id, self.layout_id, self.dev = 9, 1, 0
        self.doorbell = "/nowhere.door"
        self.signals = True
        self.seq = 0
        self.ready_flag, self.done_flag = 0x1000, 0x2000
        self.side = FakeStream()
        self.answer = {}

    def release_stream(self):
        return self.side

    def next_seq(self):
        self.seq += 1
        return self.seq


class FakeMemOps:
    def __init__(self):
        self.ops = []
        self.fail_write_on = None  # a stream whose writes fail

    def write(self, dev, stream, ptr, value):
        if stream == self.fail_write_on:
            raise dv.DeviceUnavailable("cuStreamWriteValue32 failed (CUresult 999)")
        self.ops.append(("write", stream, ptr, value))

    def wait(self, dev, stream, ptr, value):
        self.ops.append(("wait", stream, ptr, value))


class FakeLayout:
    id = 1


@pytest.fixture
def fake_client(monkeypatch):
    mo = FakeMemOps()
    monkeypatch.setattr(dv, "memops", lambda: mo)
    c = amaxd.Client("j", 0, 1, socket="/nowhere.sock", timeout=5)
    c._layout = FakeLayout()
    c._dev = FakeBufs()
    c._door = FakeDoor(path=c._dev.doorbell)
    made = []

    class Reader(dv.AsyncReader):
        def __init__(self, door, dev):
            super().__init__(door, dev, setup=lambda: None)
            made.append(self)
    monkeypatch.setattr(dv, "AsyncReader", Reader)
    yield c, mo, made
    for r in made:
        r.stop()
    c._dev = None
    c._rpc.close()


def releases(mo, bufs):
    return [o for o in mo.ops if o[0] == "write" and o[1] == bufs.side.cuda_stream
            and o[2] == bufs.done_flag]


def test_client_async_ok_and_error(fake_client):
    c, mo, made = fake_client
    bufs = c._dev
    c._door.outcomes = [answer(1), errors.FailedPrecondition(
        grpc.StatusCode.FAILED_PRECONDITION, "layout changed")]
    p = c.reconcile_device_async(stream=77)
    assert ("write", 77, bufs.ready_flag, 1) in mo.ops and ("wait", 77, bufs.done_flag, 1) in mo.ops
    assert p.result(5).epoch == 1 and c.epoch == 2
    assert releases(mo, bufs) == []
    c._learn_epoch = lambda: None  # no daemon to ask
    p = c.reconcile_device_async(stream=77)
    with pytest.raises(errors.FailedPrecondition):
        p.result(5)
    assert releases(mo, bufs) == [("write", bufs.side.cuda_stream, bufs.done_flag, 2)]
    assert bufs.side.syncs == 1


def test_client_async_send_refused_releases(fake_client):
    c, mo, made = fake_client
    bufs = c._dev
    c._door.send_error = unavailable("connect failed")
    p = c.reconcile_device_async(stream=77)
    with pytest.raises(errors.Unavailable, match="connect failed"):
        p.result(5)
    assert releases(mo, bufs) == [("write", bufs.side.cuda_stream, bufs.done_flag, 1)]


def test_client_async_unexpected_exception_releases(fake_client):
    c, mo, made = fake_client
    bufs = c._dev
    c._door.send_error = TypeError("a bug after the stream was made to wait")
    with pytest.raises(TypeError, match="a bug"):
        c.reconcile_device_async(stream=77)
    assert ("wait", 77, bufs.done_flag, 1) in mo.ops
    assert releases(mo, bufs) == [("write", bufs.side.cuda_stream, bufs.done_flag, 1)]
    # The same with a release that fails too: the exception says so.
    mo.fail_write_on = bufs.side.cuda_stream
    with pytest.raises(dv.StreamNotReleased, match="may stay blocked") as ei:
        c.reconcile_device_async(stream=77)
    assert isinstance(ei.value.cause, TypeError)


def test_client_async_failed_release_reported(fake_client):
    c, mo, made = fake_client
    bufs = c._dev
    mo.fail_write_on = bufs.side.cuda_stream
    c._door.outcomes = [unavailable("the daemon is gone"), answer(3)]
    p = c.reconcile_device_async(stream=77)
    with pytest.raises(dv.StreamNotReleased, match="CUresult 999") as ei:
        p.result(5)
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    # The next call goes through the same reader thread.
    mo.fail_write_on = None
    p = c.reconcile_device_async(stream=77)
    assert p.result(5).epoch == 3
    assert len(made) == 1 and made[0].alive()
    assert threading.active_count() >= 1
