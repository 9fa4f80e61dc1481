"""Hostile and careless clients (docs/SECURITY.md): each case gets a precise
status and a log line, changes no state, and Health keeps answering within
1 s while it runs (a prober thread on its own connection)."""
import os
import re
import signal
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest

import amaxd
from amaxd import pb
from amaxd_proc import BIN
from h2raw import RawConn
from test_bad_input import SVC, call, f32, raw, send, snapshot, spec

# The state backend the daemons of this run use (tests/gpu/run.sh: cuda).
BACKEND = os.environ.get("AMAXD_BACKEND", "host")

C = grpc.StatusCode


class HealthProber:
    """Calls Health every 50 ms on its own channel; records each latency (a
    call that fails counts as its full time)."""

    def __init__(self, d, period=0.05):
        self.d, self.period = d, period
        self.lat = []
        self.failures = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with amaxd.Client("probe", 0, 1, socket=self.d.socket, timeout=5) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    h = c.health()
                    if h != "SERVING":
                        self.failures.append(h)
                except amaxd.AmaxdError as e:
                    self.failures.append(str(e))
                self.lat.append(time.monotonic() - t0)
                self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(10)

    def check(self, limit=1.0):
        assert self.lat, "the prober made no call"
        assert not self.failures, f"Health failed: {self.failures[:3]}"
        assert max(self.lat) < limit, f"Health took {max(self.lat):.3f} s (limit {limit} s)"


def rss_peak_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    raise AssertionError("no VmHWM")


@pytest.fixture
def bad(start_daemon):
    d = start_daemon("--max-message-bytes=65536", "--max-cells=4096")
    with d.client("bad", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [4], amaxd.Recipe.fp8_current())])
        c.send({"w": [1, 2, 3, 4]})
        c.reconcile()
        c.send({"w": [5, 1, 1, 1]})
    return d


# ---- 1 and 2: names with NUL or control bytes ----

def named(**kw):
    s = spec("p", [1])
    for k, v in kw.items():
        setattr(s, k, v)
    return pb.RegisterRequest(job="bad", quantizers=[s])


NAME_CASES = [
    ("nul-quantizer", "RegisterQuantizers", named(name="a\x00b"), "QuantizerSpec.name holds a NUL byte at offset 1"),
    ("nul-peer-group", "RegisterQuantizers", named(peer_group="g\x00h"), "QuantizerSpec.peer_group holds a NUL"),
    ("nul-scale-group", "RegisterQuantizers", named(scale_group="g\x00"), "QuantizerSpec.scale_group holds a NUL"),
    ("nul-join", "Join", pb.JoinRequest(job="bad\x00y", rank=0, world_size=1), "JoinRequest.job holds a NUL"),
    ("nul-drop-job", "Reset", pb.ResetRequest(job="bad\x00junk", drop_job=True), "ResetRequest.job holds a NUL"),
    ("nul-send-name", "SendAmax", send("w\x00junk", f32(9, 9, 9, 9)), "AmaxUpdate.name holds a NUL"),
    ("nul-reconcile-name", "Reconcile", pb.ReconcileRequest(job="bad", names=["w\x00"]), "ReconcileRequest.names holds a NUL"),
    ("newline-job", "Join", pb.JoinRequest(job="x\n2026-01-01T00:00:00.000Z error main: forged", rank=0, world_size=1),
     "JoinRequest.job holds a control byte 0x0a"),
    ("tab-name", "GetScales", pb.GetScalesRequest(job="bad", names=["w\t"]), "GetScalesRequest.names holds a control byte 0x09"),
]


def test_names_with_nul_or_control_bytes_are_refused(bad):
    before = snapshot(bad)
    with HealthProber(bad) as p:
        for case_id, method, req, text in NAME_CASES:
            code, details = call(bad, method, req)
            assert code == C.INVALID_ARGUMENT, f"{case_id}: got {code} ({details})"
            assert text in details, f"{case_id}: {details!r} lacks {text!r}"
            assert details in bad.log(), f"{case_id}: no log line for {details!r}"
            assert snapshot(bad) == before, f"{case_id} changed the state"
    p.check()
    # Job "bad" is still there (the NUL did not make "bad\0junk" drop it),
    # and its quantizer "w" got none of the 9s.
    with bad.client("bad", 0, 1) as c:
        assert c.reconcile()["w"].amax.tolist() == [5, 2, 3, 4]


def test_log_lines_cannot_be_forged(bad):
    forged = "2026-01-01T00:00:00.000Z error main: forged"
    call(bad, "Join", pb.JoinRequest(job="x\n" + forged, rank=0, world_size=1))
    log = bad.log()
    assert not any(line.startswith(forged) for line in log.splitlines()), "a forged line"
    assert "x\\x0a2026-01-01T00:00:00.000Z" in log   # escaped, on the refusal's line


def test_journald_priority_prefix_cannot_be_forged(start_daemon):
    d = start_daemon(env={"JOURNAL_STREAM": "8:1234"})
    call(d, "Join", pb.JoinRequest(job="x\n<0>amaxd: forged emergency", rank=0, world_size=1))
    lines = d.log().splitlines()
    assert all(not line.startswith("<0>") for line in lines), "a forged priority"
    assert any("\\x0a<0>amaxd: forged" in line for line in lines)


# ---- 3: signals while the daemon starts ----

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_while_starting(tmp_path, sig):
    """The signal arrives the moment the socket appears (before 'ready'):
    SIGTERM/SIGINT stop the daemon cleanly (exit 0, socket removed), SIGHUP
    leaves it running."""
    for attempt in range(3):
        sock = tmp_path / f"s{attempt}.sock"
        log = open(tmp_path / f"log{attempt}", "wb")
        p = subprocess.Popen([BIN, f"--socket={sock}", "--log-level=debug"], stdout=log,
                             stderr=subprocess.STDOUT)
        end = time.time() + 20
        while not sock.exists() and time.time() < end and p.poll() is None:
            pass
        assert sock.exists(), "the socket never appeared"
        p.send_signal(sig)
        if sig == signal.SIGHUP:
            time.sleep(0.5)
            assert p.poll() is None, "SIGHUP killed the daemon"
            with amaxd.Client("probe", 0, 1, socket=str(sock), timeout=5) as c:
                assert c.health() == "SERVING"
            p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
        log.close()
        text = open(tmp_path / f"log{attempt}", "rb").read().decode(errors="replace")
        assert rc == 0, f"exit {rc} after signal {sig}:\n{text[-3000:]}"
        assert not sock.exists(), "socket left behind"


# ---- 6: requests that would take a lot of memory to decode ----

def test_decoding_is_bounded(start_daemon):
    d = start_daemon("--max-request-memory=67108864", "--max-quantizers=100000")
    with d.client("j", 0, 1) as c:
        c.join()
    peak0 = rss_peak_mb(d.proc.pid)
    # 12M empty QuantizerSpecs: 24 MB on the wire, ~2 GB once decoded.
    bomb = b"\x0a\x01j" + b"\x1a\x00" * 12_000_000
    # 200k of them: more elements than max_quantizers, little memory.
    many = b"\x0a\x01j" + b"\x1a\x00" * 200_000
    with HealthProber(d) as p:
        code, details = raw(d, SVC + "RegisterQuantizers", bomb, timeout=60)
        assert code == C.RESOURCE_EXHAUSTED, details
        assert "would take more than 67108864 bytes of memory unpacked" in details
        assert details in d.log()
        code, details = raw(d, SVC + "RegisterQuantizers", many, timeout=60)
        assert code == C.RESOURCE_EXHAUSTED, details
        assert "RegisterRequest.quantizers has more than 100000 elements" in details
        assert details in d.log()
    p.check()
    grown = rss_peak_mb(d.proc.pid) - peak0
    assert grown < 200, f"peak RSS grew by {grown:.0f} MB"
    with d.client("j", 0, 1) as c:
        assert c.status("j").jobs[0].quantizers == 0


def test_malformed_wire_is_refused_precisely(bad):
    cases = [
        (b"\x0a\x05ab", "a length past the end of the message"),
        (b"\x0a\x01j\x1a\x80", "a length past the end"),
        (b"\x0b", "a group or an unknown wire type"),
        (b"\x0d\x00\x00\x00\x00", "a wire type that does not match its field"),
        (b"\x00\x01", "field number 0"),
        # A length as a 10-byte varint (protobuf-c takes at most 5): found
        # by the fuzzer (tests/fuzz/regress/overlong-length-prefix).
        (b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x00", "a length past the end"),
        (b"\x80\x80\x80\x80\x80\x08\x00", "overlong field tag"),
    ]
    for payload, text in cases:
        code, details = raw(bad, SVC + "RegisterQuantizers", payload)
        assert code == C.INVALID_ARGUMENT, (payload, details)
        assert "not a valid amaxd.v1.RegisterRequest" in details and text in details, details


# ---- 9: the socket is never wider than socket_mode ----

def test_socket_mode_from_the_start(tmp_path):
    """Started under umask 0: the socket is 0660 from the first moment it
    exists (it used to be 0777 until a chmod)."""
    sock = tmp_path / "s.sock"
    log = open(tmp_path / "log", "wb")
    p = subprocess.Popen([BIN, f"--socket={sock}", "--socket-mode=0660"], stdout=log,
                         stderr=subprocess.STDOUT, preexec_fn=lambda: os.umask(0))
    try:
        modes = []
        end = time.time() + 20
        while time.time() < end and p.poll() is None and len(modes) < 2000:
            try:
                modes.append(os.stat(sock).st_mode & 0o777)
            except FileNotFoundError:
                pass
        assert modes, "the socket never appeared"
        assert set(modes) == {0o660}, f"socket modes seen: {sorted({oct(m) for m in modes})}"
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        log.close()


# ---- 7: answers are bounded, and so are answers nobody reads ----

def big_job(d, cells):
    """Job "big": quantizer "big" of `cells` cells, reconciled once."""
    vals = np.random.default_rng(0).random(cells, dtype=np.float32) + 0.5
    with d.client("big", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("big", [cells], amaxd.Recipe.fp8_current()),
                    amaxd.Quantizer("small", [4], amaxd.Recipe.fp8_current())])
        c.send({"big": vals, "small": [1, 2, 3, 4]})
        c.reconcile(names=["small"])
    return vals


def test_answers_are_bounded(start_daemon):
    d = start_daemon("--max-message-bytes=65536")
    vals = big_job(d, 15000)
    peak0 = rss_peak_mb(d.proc.pid)
    with HealthProber(d) as p:
        code, details = call(d, "GetScales", pb.GetScalesRequest(job="big", names=["big"]))
        assert code == C.RESOURCE_EXHAUSTED, details
        assert "more than max_message_bytes=65536" in details and details in d.log()
        # Amplification: a 300-byte request naming the big quantizer 64 times.
        req = pb.GetScalesRequest(job="big", names=["big"] * 64)
        assert len(req.SerializeToString()) < 400
        code, details = call(d, "GetScales", req)
        assert code == C.RESOURCE_EXHAUSTED and "64 quantizers, 960000 cells" in details
        # A Reconcile whose answer would not fit is refused before the rank
        # enters the epoch (the epoch stays open).
        with d.client("big", 0, 1) as c:
            epoch = c.status("big").jobs[0].epoch
            with pytest.raises(amaxd.errors.ResourceExhausted) as e:
                c.reconcile()
            assert "name fewer quantizers in Reconcile" in e.value.message
            st = c.status("big").jobs[0]
            assert st.epoch == epoch and st.ranks_in_reconcile == 0
        # Windows: the client fetches the big answer in pieces.
        with d.client("big", 0, 1, max_message_bytes=65536) as c:
            r = c.get_scales(["small", "big"])
            assert r["small"].amax.tolist() == [1, 2, 3, 4]
            np.testing.assert_array_equal(r["big"].amax, vals)
            w = c.get_scales(["big"], whole=True, window_cells=777)
            np.testing.assert_array_equal(w["big"].amax, vals)
            np.testing.assert_array_equal(w["big"].scale, r["big"].scale)
            assert w["big"].missing == 0
    p.check()
    grown = rss_peak_mb(d.proc.pid) - peak0
    assert grown < 64, f"peak RSS grew by {grown:.0f} MB"


def test_windows_cover_exactly(start_daemon):
    """Every window of a multi-quantizer answer holds the right cells."""
    d = start_daemon()
    vals = big_job(d, 1000)
    with d.client("big", 0, 1) as c:
        for start, n in [(0, 1), (3, 2), (4, 1), (0, 4), (2, 600), (999, 10), (1003, 5), (5000, 5)]:
            r = c._unary("GetScales", pb.GetScalesRequest(job="big", names=["small", "big"],
                                                          start_cell=start, max_cells=n),
                         pb.GetScalesResponse)
            assert r.total_cells == 1004
            want = np.concatenate([np.float32([1, 2, 3, 4]), vals])[start:start + n]
            got = np.frombuffer(b"".join(q.amax for q in r.results), "<f4")
            np.testing.assert_array_equal(got, want)
            firsts = [(q.name, q.first_cell) for q in r.results]
            if start < 4:
                assert firsts[0] == ("small", start)
            elif start < 1004:
                assert firsts[0] == ("big", start - 4)
            else:
                assert firsts == []


def test_unread_answers_are_capped(start_daemon):
    d = start_daemon("--max-queued-bytes=1048576")
    vals = big_job(d, 60000)                       # an answer of ~780 kB
    req = pb.GetScalesRequest(job="big", names=["big"]).SerializeToString()
    slow = RawConn(d.socket, window=0)             # never lets an answer through
    try:
        slow.unary(SVC + "GetScales", req)         # held by the daemon
        time.sleep(0.5)
        s2 = slow.unary(SVC + "GetScales", req)    # would pass 1 MiB
        code, msg = slow.status_of(s2)
        assert code == C.RESOURCE_EXHAUSTED.value[0], (code, msg)
        assert "clients have not read yet" in msg
        assert "max_queued_bytes=1048576" in d.log()
        with d.client("big", 0, 1) as c:           # small answers still go out
            assert c.get_scales(["small"])["small"].amax.tolist() == [1, 2, 3, 4]
    finally:
        slow.close()
    time.sleep(0.5)                                # the held answer is dropped
    with d.client("big", 0, 1) as c:
        np.testing.assert_array_equal(c.get_scales(["big"])["big"].amax, vals)


# ---- 8: abandoned jobs give their slots back ----

def test_idle_jobs_expire(start_daemon):
    d = start_daemon("--max-jobs=2", "--job-idle-timeout-ms=1500")
    for name in ("a", "b"):
        with d.client(name, 0, 1) as c:
            c.join()
    code, details = call(d, "Join", pb.JoinRequest(job="c", rank=0, world_size=1))
    assert code == C.RESOURCE_EXHAUSTED and "max_jobs" in details
    # Job "b" stays busy; job "a" is abandoned.
    with d.client("b", 0, 1) as c:
        for _ in range(12):
            c.register([amaxd.Quantizer("w", [1], amaxd.Recipe.fp8_current())])
            time.sleep(0.2)
        names = [j.name for j in c.status().jobs]
    assert names == ["b"], names
    assert re.search(r"job a dropped \(0 quantizers\): no rank of it called this daemon for "
                     r"\d+ ms \(job_idle_timeout_ms\)", d.log())
    with d.client("c", 0, 1) as c:     # the slot is free again
        c.join()


# ---- 6: one memory budget for all jobs ----

def test_memory_budget_across_jobs(start_daemon):
    # 1 MiB of state = 21845 cells at 48 bytes a cell.
    d = start_daemon("--memory-budget=1048576")
    with d.client("a", 0, 1) as a, d.client("b", 0, 1) as b:
        a.join()
        b.join()
        a.register([amaxd.Quantizer("w", [12000], amaxd.Recipe.fp8_current())])
        # After the first job's state exists: the CUDA backend's context
        # (host memory of the CUDA runtime, not job state) is made by then.
        peak0 = rss_peak_mb(d.proc.pid)
        with HealthProber(d) as p:
            # 22 bytes on the wire asking for 2^27 cells (6 GiB of state).
            req = pb.RegisterRequest(job="b", quantizers=[spec("huge", [134217728])])
            code, details = call(d, "RegisterQuantizers", req)
            assert code == C.RESOURCE_EXHAUSTED, details
            assert "more than memory_budget=1 MiB (configured)" in details and details in d.log()
            # The budget is shared: job b cannot take what job a holds.
            with pytest.raises(amaxd.errors.ResourceExhausted):
                b.register([amaxd.Quantizer("w", [12000], amaxd.Recipe.fp8_current())])
            # 4000 cells fit beside a's 12000 (the CUDA backend holds 16384:
            # it reserves pending cells in powers of two, and the budget
            # counts what a backend holds).
            b.register([amaxd.Quantizer("w", [4000], amaxd.Recipe.fp8_current())])
        p.check()
        st = b.status("b").jobs[0]
        assert st.quantizers + st.proposals == 1
    assert rss_peak_mb(d.proc.pid) - peak0 < 50
    assert "memory budget for job state" not in d.log()   # explicit: no default to report


# ---- 9: a failed state backend is reported by Health ----

@pytest.mark.skipif(BACKEND != "host", reason="the fault is simulated in the host backend only")
def test_device_fault_makes_health_not_serving(start_daemon):
    """AMAXD_TEST_DEVICE_FAULT makes the host backend fail every finish the
    way a sticky CUDA error fails the CUDA backend."""
    d = start_daemon(env={"AMAXD_TEST_DEVICE_FAULT": "1"})
    with d.client("j", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [2], amaxd.Recipe.fp8_current())])
        c.send({"w": [1, 2]})
        assert c.health() == "SERVING"
        with pytest.raises(amaxd.AmaxdError) as e:
            c.reconcile()
        assert "simulated device fault" in e.value.message
        assert c.health() == "NOT_SERVING"
    assert "state backend fault: " in d.log() and "restart the daemon" in d.log()


def test_late_update_is_refused_not_moved(start_daemon):
    """The Python client sends for the epoch it saw open: an update that
    arrives after that epoch was reconciled is refused, not merged into the
    next epoch."""
    d = start_daemon()
    with d.client("j", 0, 2) as a, d.client("j", 1, 2) as b:
        t = threading.Thread(target=a.join)
        t.start()
        b.join()
        t.join()
        a.register([amaxd.Quantizer("w", [1], amaxd.Recipe.fp8_current())])
        b.register([amaxd.Quantizer("w", [1], amaxd.Recipe.fp8_current())])
        late = d.client("j", 1, 2)             # a sender of rank 1 that saw epoch 1
        late.epoch = b.epoch
        res = {}
        t = threading.Thread(target=lambda: res.update(a=a.reconcile()))
        t.start()
        res["b"] = b.reconcile()
        t.join()
        with pytest.raises(amaxd.errors.FailedPrecondition) as e:
            late.send({"w": [99.0]})
        assert "already reconciled" in e.value.message
        late.close()
        a.send({"w": [1.0]})
        b.send({"w": [2.0]})
        t = threading.Thread(target=lambda: res.update(a=a.reconcile()))
        t.start()
        r = b.reconcile()
        t.join()
        assert r["w"].amax.tolist() == [2.0]   # the 99 never landed


# ---- 6: a large catalog does not stall the daemon ----

def test_large_registration_does_not_stall(start_daemon):
    """32M cells: the pending buffers grow on a thread of their own and the
    loop only copies at the first epoch; Health stays fast throughout."""
    d = start_daemon()
    cells = 32 << 20
    rss0 = rss_peak_mb(d.proc.pid)
    with HealthProber(d, period=0.02) as p:
        with d.client("big", 0, 1) as c:
            c.join()
            c.register([amaxd.Quantizer("huge", [cells], amaxd.Recipe.fp8_current()),
                        amaxd.Quantizer("s", [4], amaxd.Recipe.fp8_current())])
            c.send({"s": [1, 2, 3, 4]})
            assert c.reconcile(names=["s"])["s"].amax.tolist() == [1, 2, 3, 4]
            st = c.status("big").jobs[0]
            assert st.cells == cells + 4
    p.check()
    # The host backend grows on its own thread (the loop would have spent
    # ~0.3 s filling 2 x 128 MiB here); the CUDA backend allocates and
    # fills device memory from the loop, which takes milliseconds. The
    # latency bound only catches a gross stall on a loaded 2-core CI
    # machine; the precise figures are measured in docs/SECURITY.md (35 ms
    # at 128M cells, 1.2 s before).
    if BACKEND == "host":
        assert "growing pending buffers to" in d.log()
        assert "pending buffers grown to" in d.log()
    assert max(p.lat) < 1.0, f"Health took {max(p.lat):.3f} s"
    grown = rss_peak_mb(d.proc.pid) - rss0
    assert grown < cells * 48 / 2**20, f"peak RSS grew by {grown:.0f} MB"


def test_drop_while_growing(start_daemon):
    d = start_daemon()
    with d.client("g", 0, 1) as c:
        c.join()
    out = {}

    def register():
        with d.client("g", 0, 1) as c:
            try:
                c.register([amaxd.Quantizer("huge", [16 << 20], amaxd.Recipe.fp8_current())])
                out["ok"] = True
            except amaxd.AmaxdError as e:
                out["err"] = e
    t = threading.Thread(target=register)
    t.start()
    for _ in range(200):
        if "growing pending buffers" in d.log():
            break
        time.sleep(0.005)
    with d.client("g", 0, 1) as c:
        c.reset(drop_job=True)
    t.join(30)
    assert "ok" in out or isinstance(out.get("err"), amaxd.errors.Aborted), out
    with d.client("g", 0, 1) as c:
        assert c.health() == "SERVING"
        assert [j.name for j in c.status().jobs] == []


# ---- 4 and 5: header floods and connection storms ----

@pytest.mark.parametrize("attack", ["split", "many", "connect", "split-x8"])
def test_health_answers_during_a_flood(start_daemon, attack):
    """One client floods the socket (endless CONTINUATION frames, huge header
    lists, 10^4 connect/close, or 8 connections at once): Health on another
    connection answers within 1 s throughout, header memory stays bounded,
    a new connection works afterwards, and the jobs are untouched."""
    import h2flood
    d = start_daemon()
    with d.client("keep", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [2], amaxd.Recipe.fp8_current())])
        c.send({"w": [1, 2]})
        c.reconcile()
    r = h2flood.measure(d.socket, attack, duration=4.0, timeout=5.0)
    assert r["failed"] == 0 and r["max"] < 1.0, (r["max"], r["attacker"])
    assert r["fresh"] is not None, "no new connection after the flood"
    assert rss_peak_mb(d.proc.pid) < 512, "header memory is not bounded"
    if attack in ("split", "many", "split-x8"):
        assert "closing a connection whose HTTP/2 header block exceeds 65536 bytes" in d.log()
    with d.client("keep", 0, 1) as c:
        assert c.get_scales(["w"])["w"].amax.tolist() == [1, 2]


def test_descriptor_exhaustion_recovers(tmp_path):
    """At a soft and hard limit of 1024 descriptors, 1100 idle connections
    then closed: new connections are served again at once (gRPC 1.51's own
    listener stops accepting for good after one EMFILE). The guard's budget
    (256 connections at this limit, 128 a user) is reached, and the oldest
    idle connections make room (tests/e2e/test_crowd.py)."""
    import fdstorm
    sock = str(tmp_path / "amaxd.sock")
    p = fdstorm.start_daemon(BIN, sock, ["--backend=host"], nofile=(1024, 1024))
    try:
        r = fdstorm.exhaust(sock, n=1100, recover=10.0)
    finally:
        rc = fdstorm.stop_daemon(p)
    log = open(sock + ".log", "rb").read().decode(errors="replace")
    assert rc == 0, log[-3000:]
    assert r["recovered_after"] is not None and r["recovered_after"] < 1.0, r
    assert r["health_old"] is not None, r
    assert "max_connections_per_uid=128 reached: evicting the oldest idle connection" in log


def test_soft_descriptor_limit_is_raised(tmp_path):
    import fdstorm
    sock = str(tmp_path / "amaxd.sock")
    p = fdstorm.start_daemon(BIN, sock, ["--backend=host"], nofile=(1024, 4096))
    try:
        with open(f"/proc/{p.pid}/limits") as f:
            line = next(x for x in f if x.startswith("Max open files"))
        assert line.split()[3] == "4096", line
    finally:
        assert fdstorm.stop_daemon(p) == 0
    assert "RLIMIT_NOFILE raised from 1024 to 4096" in open(sock + ".log").read()
