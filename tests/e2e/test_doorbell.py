"""The device doorbell (docs/API.md "The doorbell") on a daemon without
device state (CI: the host backend): the socket exists next to the Unix
socket with its permission bits; every malformed datagram (garbage, short,
oversized, wrong magic, a job length that does not match, unknown flags)
gets INVALID_ARGUMENT naming what is wrong and a log line; a well-formed
ReconcileDevice gets the same FAILED_PRECONDITION as the gRPC call; the
connection stays usable after each refusal, many connections come and go,
and nothing of the job changes (the packed form still works). On a GPU,
tests/gpu/test_device.py runs the device path through the doorbell."""
import array
import fcntl
import os
import socket
import stat
import struct

import grpc
import numpy as np
import pytest

import amaxd
from amaxd import errors, pb
from amaxd.device import Doorbell

pytestmark = pytest.mark.skipif(os.environ.get("AMAXD_BACKEND", "host") != "host",
                                reason="the refusal of a host-backend daemon")

REQ = struct.Struct("<IIQQQIIII")  # ..., rank, job_len, seq, reserved
ANS = struct.Struct("<IIQQQII")
MAGIC = 0x31424441


def connect(daemon):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(daemon.socket + ".door")
    return s


def ask(s, data):
    s.send(data)
    a = s.recv(ANS.size + 4096)
    magic, code, epoch, next_epoch, layout_id, n, _ = ANS.unpack_from(a)
    assert magic == MAGIC and len(a) == ANS.size + n
    return code, a[ANS.size:].decode()


def request(job=b"j", flags=1, device_id=2, epoch=0, layout_id=1, rank=0, job_len=None, seq=0,
            reserved=0):
    return REQ.pack(MAGIC, flags, device_id, epoch, layout_id, rank,
                    len(job) if job_len is None else job_len, seq, reserved) + job


def test_doorbell_socket_and_bad_datagrams(daemon):
    path = daemon.socket + ".door"
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    c = daemon.client("j", 0, 1)
    c.join()
    c.register([amaxd.Quantizer("q", [4], amaxd.Recipe.fp8_current())])
    lay = c.layout()
    bad = [
        (os.urandom(7), "a request is 49 to 303 bytes"),
        (b"\xff" * 4000, "not 4000"),
        (struct.pack("<I", 0xdeadbeef) + request()[4:], "not 0xdeadbeef"),
        (request(job_len=5), "names a job of 5 bytes but carries 1"),
        (request(job=b""), "names no job"),
        (request(job=b"", job_len=0) + b"x", "names no job"),
        (request(flags=16), "unknown request flags 0x10"),
        (request(flags=9), "unknown request flags 0x9"),
        (request(flags=4 | 1), "arm (flag 4) needs send (flag 1) and a signal (seq != 0)"),
        (request(flags=4 | 2, seq=3), "arm (flag 4) needs send (flag 1)"),
        (request(reserved=7), "bytes 44-47 of a request are reserved (0), not 0x7"),
    ]
    s = connect(daemon)
    inv = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for data, want in bad:
        code, msg = ask(s, data)  # the same connection answers every one
        assert code == inv and "doorbell:" in msg and want in msg, (data[:12], msg)
    # Well formed: the registry's answer, exactly as over gRPC.
    code, msg = ask(s, request(layout_id=lay.id))
    assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "ReconcileDevice: this daemon keeps its state on the host (backend 'host')" in msg
    # A disarm (flags 8 alone) on a connection that is not armed is
    # ignored: no answer; the next request is answered as before. An armed
    # request is refused as the plain one (no device state to arm).
    s.send(request(flags=8, layout_id=lay.id))
    code, msg2 = ask(s, request(flags=4 | 1, seq=1, layout_id=lay.id))
    assert code == inv and "needs its flag page" in msg2 and "none came" in msg2, msg2
    # A flag page that could shrink under the daemon's reads is refused;
    # a sealed one passes the doorbell (and the host backend refuses).
    for sealed in (False, True):
        fd = os.memfd_create("flags", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        if sealed:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        s.sendmsg([request(flags=4 | 1, seq=1, layout_id=lay.id)],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        os.close(fd)
        a = s.recv(ANS.size + 4096)
        code = ANS.unpack_from(a)[1]
        text = a[ANS.size:].decode()
        if sealed:
            assert code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and text == msg, text
        else:
            assert code == inv and "the one that came is not" in text, text
    s.close()
    with daemon.channel() as ch:
        fn = ch.unary_unary("/amaxd.v1.Calibration/ReconcileDevice",
                            request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=pb.ReconcileDeviceResponse.FromString)
        with pytest.raises(grpc.RpcError) as ei:
            fn(pb.ReconcileDeviceRequest(job="j", rank=0, layout_id=lay.id, device_id=2,
                                         send=True), timeout=10)
    assert ei.value.details() == msg
    log = daemon.log()
    assert "doorbell: unknown request flags 0x10" in log and "device doorbell on" in log
    # Many connections, some closed with a request unanswered (read).
    socks = [connect(daemon) for _ in range(64)]
    for k, t in enumerate(socks):
        if k % 2:
            t.send(request(layout_id=lay.id))
        t.close()
    # Nothing changed: epoch 1 is open, the packed form works.
    c.send_packed(np.array([1, 2, 3, 4], dtype=np.float32))
    res = c.reconcile_packed()
    assert res.epoch == 1 and res.amax.tolist() == [1, 2, 3, 4]
    c.close()


def test_doorbell_client_errors(daemon, tmp_path):
    # The client's Doorbell maps the status to the same exception.
    d = Doorbell(daemon.socket + ".door")
    req = pb.ReconcileDeviceRequest(job="nope", rank=0, layout_id=1, device_id=2, send=True)
    with pytest.raises(errors.FailedPrecondition, match="backend 'host'"):
        d.call(req, 10)
    with pytest.raises(errors.FailedPrecondition):
        d.call(req, 10)  # the connection is reused
    d.close()
    # No daemon behind the path: UNAVAILABLE, not a hang.
    gone = Doorbell(str(tmp_path / "none.door"))
    with pytest.raises(errors.Unavailable, match="failed"):
        gone.call(req, 1)


def test_doorbell_client_spin(tmp_path):
    """Doorbell.recv(spin=): the answer is read while polling, or after
    the poll gave up and the read slept; the call's timeout bounds the
    poll; a daemon that hangs up during the poll is UNAVAILABLE. A
    listener stands in for the daemon (what it answers is checked)."""
    import threading
    import time
    path = str(tmp_path / "d.door")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(path)
    srv.listen(4)
    plan = []  # per request: seconds to wait before answering, or None: hang up

    def serve():
        conn, _ = srv.accept()
        for delay in plan:
            data = conn.recv(4096)
            assert struct.unpack_from("<I", data)[0] == MAGIC
            if delay is None:
                conn.close()
                return
            time.sleep(delay)
            conn.send(ANS.pack(MAGIC, 0, 7, 8, 9, 0, 0))
        conn.close()
    plan[:] = [0.05, 0.2, 0.0]
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    d = Doorbell(path)
    req = pb.ReconcileDeviceRequest(job="j", rank=0, layout_id=1, device_id=2, send=True)
    r = d.call(req, 10, 1, spin=1.0)  # answered while polling
    assert (r.epoch, r.next_epoch, r.layout_id) == (7, 8, 9)
    r = d.call(req, 10, 2, spin=0.01)  # answered after the poll gave up
    assert (r.epoch, r.next_epoch, r.layout_id) == (7, 8, 9)
    r = d.call(req, 10, 3)  # no poll at all
    assert r.epoch == 7
    t.join(10)
    d.close()
    # The timeout bounds the poll: no answer within 0.2 s of a 5 s spin.
    plan[:] = [3.0]
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    d = Doorbell(path)
    t0 = time.perf_counter()
    with pytest.raises(errors.DeadlineExceeded):
        d.call(req, 0.2, 1, spin=5.0)
    assert time.perf_counter() - t0 < 2.5, "the poll outlived the call's timeout"
    t.join(10)
    # A daemon that hangs up while the client polls.
    plan[:] = [None]
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    d = Doorbell(path)
    with pytest.raises(errors.Unavailable, match="closed or answered 0 bytes"):
        d.call(req, 10, 1, spin=1.0)
    t.join(10)
    srv.close()


def test_doorbell_spin_setting(daemon, monkeypatch):
    """AMAXD_DOORBELL_SPIN_S: seconds from 0 to 10; anything else is a
    ValueError naming the variable when the client is made."""
    monkeypatch.setenv("AMAXD_DOORBELL_SPIN_S", "0.0005")
    assert daemon.client("sp", 0, 1).doorbell_spin == 0.0005
    for bad in ("fast", "-1", "nan", "1e9"):
        monkeypatch.setenv("AMAXD_DOORBELL_SPIN_S", bad)
        with pytest.raises(ValueError, match="AMAXD_DOORBELL_SPIN_S"):
            daemon.client("sp", 0, 1)
    monkeypatch.delenv("AMAXD_DOORBELL_SPIN_S")
    want = 0.002 if (os.cpu_count() or 1) >= 8 else 0.0
    assert daemon.client("sp", 0, 1).doorbell_spin == want


def test_client_refuses_register_and_reset_while_armed(daemon):
    """A Register or Reset of an armed rank would wait for the epoch in
    flight, which waits for that rank's next sync: the client refuses
    them while it holds an arming (docs/API.md "Armed epochs"). The state
    is set by hand here (arming needs a GPU; tests/gpu/test_armed.py)."""
    c = daemon.client("ar", 0, 1)
    c.join()
    c._armed = (None, 1, 7, 3, False)
    q = amaxd.Quantizer("q", [4], amaxd.Recipe.fp8_current())
    with pytest.raises(ValueError, match="register: epoch 3 is armed for this rank"):
        c.register([q])
    with pytest.raises(ValueError, match="reset: epoch 3 is armed"):
        c.reset(["q"])
    c._armed = None
    c.register([q])  # and nothing was sent before: the catalog takes it now
    assert [x.name for x in c.list_quantizers().quantizers] == ["q"]
    c.close()
