"""Start-up, signals, timeouts, cancellation and listening sockets."""
import os
import signal
import socket as pysocket
import stat
import subprocess
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

import amaxd
from conftest import BIN


def test_health_serving_and_unknown_service(daemon):
    # The standard grpc.health.v1 messages (grpcio-health-checking), called
    # without its generated stub so that any grpcio version works.
    with daemon.channel() as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                               response_deserializer=health_pb2.HealthCheckResponse.FromString)
        assert check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert check(health_pb2.HealthCheckRequest(service="amaxd.v1.Calibration"), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_zero_and_removes_socket(daemon, sig):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o660
    daemon.check_clean_exit(daemon.stop(sig))


def test_sigterm_fails_waiting_calls_unavailable(daemon):
    errs = []

    def join():
        try:
            with daemon.client("w", 0, 2) as c:
                c.join()
        except amaxd.AmaxdError as e:
            errs.append(e)

    t = threading.Thread(target=join)
    t.start()
    time.sleep(0.5)
    rc = daemon.stop()
    t.join(10)
    daemon.check_clean_exit(rc)
    assert isinstance(errs[0], amaxd.errors.Unavailable), errs
    assert "shutting down" in errs[0].message


def test_join_timeout_names_missing_ranks(start_daemon):
    d = start_daemon("--join-timeout-ms=300")
    with d.client("jt", 1, 3) as c:
        with pytest.raises(amaxd.errors.DeadlineExceeded) as e:
            c.join()
    assert "ranks 0, 2 never joined" in e.value.message


def test_reconcile_timeout_keeps_state_and_recovers(start_daemon):
    d = start_daemon("--reconcile-timeout-ms=1000")
    out = {}
    first_timed_out = threading.Event()

    def rank(r):
        with d.client("rt", r, 2) as c:
            c.join()
            c.register([amaxd.Quantizer("a", [], amaxd.Recipe.fp8_current())])
            if r == 0:
                c.send({"a": 4.0})
                try:
                    c.reconcile()
                except amaxd.errors.DeadlineExceeded as e:
                    out["err"] = e.message
                first_timed_out.set()
                time.sleep(0.2)  # rank 1 is waiting in Reconcile by now
            else:
                first_timed_out.wait(30)  # misses rank 0's first attempt
            out[r] = c.reconcile()["a"].amax[()]

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(30) for t in ts]
    assert "ranks 1 did not enter it" in out["err"]
    assert out[0] == out[1] == 4.0


def test_client_cancel_leaves_barrier(daemon):
    with daemon.client("cc", 0, 2) as c0, daemon.client("cc", 1, 2) as c1:
        t = threading.Thread(target=c1.join)
        t.start()
        c0.join()
        t.join()
        for c in (c0, c1):
            c.register([amaxd.Quantizer("a", [], amaxd.Recipe.fp8_current())])
        c0.send({"a": 2.0})
        # Rank 0 gives up after 0.3 s (its client deadline): it must leave the barrier.
        with pytest.raises(amaxd.errors.DeadlineExceeded):
            c0.reconcile(timeout=0.3)
        time.sleep(0.2)
        assert c0.status("cc").jobs[0].ranks_in_reconcile == 0
        res = {}
        t = threading.Thread(target=lambda: res.setdefault(1, c1.reconcile()))
        t.start()
        res[0] = c0.reconcile()
        t.join()
        assert res[0]["a"].amax[()] == res[1]["a"].amax[()] == 2.0
    assert "left Reconcile of epoch 1 (client went away)" in daemon.log()


def test_rejoin_keeps_state(daemon):
    with daemon.client("rj", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("a", [], amaxd.Recipe.fp8_current())])
        c.send({"a": 3.0})
        c.reconcile()
    with daemon.client("rj", 0, 1) as c:  # a restarted trainer
        assert c.join().rejoined
        assert c.get_scales()["a"].amax[()] == 3.0


def test_stale_socket_is_replaced_and_live_one_refused(start_daemon, tmp_path):
    path = str(tmp_path / "s.sock")
    s = pysocket.socket(pysocket.AF_UNIX)
    s.bind(path)
    s.close()  # a stale socket file nobody listens on
    d = start_daemon(socket=path)
    assert "removing stale socket" in d.log()
    p = subprocess.run([BIN, f"--socket={path}"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 1 and "already listening" in p.stderr


def test_sighup_reopens_log(start_daemon, tmp_path):
    log = tmp_path / "amaxd.log"
    d = start_daemon(f"--log-file={log}")
    os.rename(log, str(log) + ".1")
    d.proc.send_signal(signal.SIGHUP)
    for _ in range(100):
        if log.exists() and "log re-opened" in log.read_text():
            break
        time.sleep(0.05)
    assert "log re-opened" in log.read_text()


def test_tcp_loopback_only(start_daemon):
    port = 20000 + os.getpid() % 20000
    d = start_daemon(f"--tcp=127.0.0.1:{port}")
    with amaxd.Client("t", 0, 1, address=f"127.0.0.1:{port}", timeout=5) as c:
        assert c.health() == "SERVING"
    p = subprocess.run([BIN, "--socket=", "--tcp=0.0.0.0:1"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 1 and "not a loopback address" in p.stderr


def test_command_line(tmp_path):
    assert subprocess.run([BIN, "--help"], capture_output=True, timeout=10).returncode == 0
    v = subprocess.run([BIN, "--version"], capture_output=True, text=True, timeout=10)
    assert v.returncode == 0 and v.stdout.startswith("amaxd ")
    p = subprocess.run([BIN, "--bogus=1"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 2 and "unknown option" in p.stderr
    p = subprocess.run([BIN, f"--socket={tmp_path}/nodir/x.sock"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 1 and "does not exist" in p.stderr


def test_cuda_backend_refused_cleanly_without_gpu(tmp_path):
    """--backend=cuda on a host without a usable GPU (or a build without
    CUDA) must exit 1 at start with a sentence, not crash or limp on."""
    if os.environ.get("AMAXD_BACKEND") == "cuda":
        pytest.skip("this run has a GPU and uses the CUDA backend")
    p = subprocess.Popen([BIN, f"--socket={tmp_path}/c.sock", "--backend=cuda"],
                         stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.terminate()
        p.wait()
        pytest.skip("a usable GPU is present: the CUDA backend started")
    assert p.returncode == 1
    assert "without CUDA" in err or "no usable CUDA device" in err, err


def test_client_health_long_service_name(daemon):
    """The client encodes the service name's length as a varint (> 127 bytes)."""
    with daemon.client("h", 0, 1) as c:
        assert c.health("amaxd.v1.Calibration") == "SERVING"
        with pytest.raises(amaxd.errors.NotFound) as e:
            c.health("s" * 300)
    assert "unknown service 'sss" in e.value.message


def test_sigterm_after_a_large_answer_exits_promptly(start_daemon):
    """gRPC 1.51 can keep an executor thread polling for 10 s after a large
    answer, and its blocking shutdown waits for it; the daemon gives that
    wait 1 s and exits (a restart under systemd must not take 10 s)."""
    import numpy as np
    d = start_daemon()
    n = 26000
    with d.client("big", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [n], amaxd.Recipe.fp8_current())])
        c.send({"w": np.ones(n, np.float32)})
        c.reconcile()
    t = time.monotonic()
    d.check_clean_exit(d.stop(timeout=8))
    elapsed = time.monotonic() - t
    assert elapsed < 8, f"amaxd took {elapsed:.1f} s to stop"
