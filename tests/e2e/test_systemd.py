"""systemd integration: the sd_notify protocol on a NOTIFY_SOCKET this test
owns (a real AF_UNIX datagram socket, as systemd's), the generated unit
checked by systemd-analyze, and the sysusers.d / tmpfiles.d files applied
to an installed tree."""
import os
import re
import shutil
import signal
import socket
import subprocess

import pytest

import amaxd
from amaxd_proc import BIN

BUILD = os.environ.get("AMAXD_BUILD_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "build"))


class Notify:
    """The service manager's end of the notify protocol."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(30)
        self.msgs = []

    def recv(self):
        m = self.sock.recv(65536).decode()
        fields = dict(line.split("=", 1) for line in m.split("\n") if line)
        self.msgs.append(fields)
        return fields

    def wait_for(self, key, pred=lambda v: True):
        while True:
            f = self.recv()
            if key in f and pred(f[key]):
                return f


def start(tmp_path, *args, env=None):
    sock = str(tmp_path / "amaxd.sock")
    log = open(tmp_path / "amaxd.log", "wb")
    e = dict(os.environ)
    e.pop("JOURNAL_STREAM", None)
    e.update(env or {})
    p = subprocess.Popen([BIN, f"--socket={sock}", "--log-level=debug", *args], stdout=log,
                         stderr=subprocess.STDOUT, env=e)
    return p, sock


def read_log(tmp_path):
    return (tmp_path / "amaxd.log").read_text(errors="replace")


def test_ready_status_stopping(tmp_path):
    n = Notify(str(tmp_path / "notify"))
    p, sock = start(tmp_path, env={"NOTIFY_SOCKET": n.path})
    try:
        ready = n.wait_for("READY", lambda v: v == "1")
        # READY=1 comes once the socket listens: a call right now is served,
        # with no retry.
        assert ready["STATUS"].startswith("ready: listening on " + sock)
        with amaxd.Client("probe", 0, 1, socket=sock, timeout=10) as c:
            assert c.health() == "SERVING"
        with amaxd.Client("sd", 0, 1, socket=sock, timeout=30) as c:
            c.join()
            c.register([amaxd.Quantizer("w", [2], amaxd.Recipe.fp8_current())])
            c.send({"w": [1.0, 2.0]})
            c.reconcile()
        # The STATUS= line follows the daemon's state (sampled each second,
        # sent when it changed).
        st = n.wait_for("STATUS", lambda v: v.startswith("serving 1 job,"))
        assert "calls in progress" in st["STATUS"]
        p.send_signal(signal.SIGTERM)
        stop = n.wait_for("STOPPING", lambda v: v == "1")
        assert stop["STATUS"].startswith("stopping: signal 15")
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
    # No watchdog was asked for: no pings.
    assert not any("WATCHDOG" in m for m in n.msgs), n.msgs
    assert [k for m in n.msgs for k in m if k in ("READY", "STOPPING")] == ["READY", "STOPPING"]


def test_watchdog_pings(tmp_path):
    n = Notify(str(tmp_path / "notify"))
    # 300 ms: pinged every 150 ms from the loop thread's timer.
    p, sock = start(tmp_path, env={"NOTIFY_SOCKET": n.path, "WATCHDOG_USEC": "300000"})
    try:
        n.wait_for("READY")
        pings = 0
        while pings < 5:
            if n.recv().get("WATCHDOG") == "1":
                pings += 1
        # The pings go on while the daemon serves calls.
        with amaxd.Client("wd", 0, 1, socket=sock, timeout=30) as c:
            c.join()
        while n.recv().get("WATCHDOG") != "1":
            pass
        p.send_signal(signal.SIGTERM)
        n.wait_for("STOPPING")
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert "systemd watchdog: 300 ms, pinged every 150 ms from the loop" in read_log(tmp_path)


def test_watchdog_for_another_pid(tmp_path):
    """WATCHDOG_PID names another process (a forking parent): no pings."""
    n = Notify(str(tmp_path / "notify"))
    p, sock = start(tmp_path, env={"NOTIFY_SOCKET": n.path, "WATCHDOG_USEC": "300000",
                                   "WATCHDOG_PID": "1"})
    try:
        n.wait_for("READY")
        p.send_signal(signal.SIGTERM)
        n.wait_for("STOPPING")
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert not any("WATCHDOG" in m for m in n.msgs), n.msgs
    assert "systemd watchdog" not in read_log(tmp_path)


def test_failed_start_reports_status(tmp_path):
    n = Notify(str(tmp_path / "notify"))
    p, sock = start(tmp_path, "--metrics-listen=192.0.2.1:9464", env={"NOTIFY_SOCKET": n.path})
    assert p.wait(30) == 1
    f = n.wait_for("STATUS")
    assert f["STATUS"].startswith("failed: metrics_listen '192.0.2.1:9464' is not a loopback")
    assert "READY" not in f
    assert n.wait_for("ERRNO")["ERRNO"] == str(22)
    assert not os.path.exists(sock)


def unit_text():
    path = os.path.join(BUILD, "amaxd.service")
    with open(path) as f:
        return path, f.read()


def test_unit_generated_with_prefix():
    _, text = unit_text()
    prefix = os.environ.get("AMAXD_INSTALL_PREFIX", "/usr/local")
    m = re.search(r"^ExecStart=(\S+) --config=(\S+)$", text, re.M)
    assert m, text
    assert m.group(1) == os.path.join(prefix, "bin", "amaxd")
    assert m.group(2).endswith("/amaxd/amaxd.conf")
    for line in ("Type=notify", "WatchdogSec=30", "StateDirectory=amaxd", "RuntimeDirectory=amaxd",
                 "ReadWritePaths=/var/lib/amaxd", "LimitNOFILE=1048576", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "User=amaxd"):
        assert re.search("^" + re.escape(line) + "$", text, re.M), line
    # /dev/nvidia* must stay reachable: nothing that restricts devices.
    for bad in ("PrivateDevices=yes", "DeviceAllow=", "DevicePolicy=", "ProtectClock=yes",
                "ProcSubset=pid"):
        assert not re.search("^" + re.escape(bad), text, re.M), bad


def verifiable_unit(tmp_path):
    """The generated unit with ExecStart pointed at the build's binary:
    systemd-analyze checks that the command exists, and the build tree has
    no installed one. Every other line is the generated unit's."""
    _, text = unit_text()
    prefix = os.environ.get("AMAXD_INSTALL_PREFIX", "/usr/local")
    text = text.replace(os.path.join(prefix, "bin", "amaxd"), os.path.abspath(BIN))
    out = tmp_path / "amaxd.service"
    out.write_text(text)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package systemd)")
def test_unit_verifies(tmp_path):
    unit = verifiable_unit(tmp_path)
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "amaxd.service" not in p.stderr, p.stderr  # no warning about this unit either


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package systemd)")
def test_unit_security_exposure(tmp_path):
    unit = verifiable_unit(tmp_path)
    p = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for amaxd.service: (\d+\.\d+)", p.stdout)
    assert m, p.stdout + p.stderr
    # 1.9 ("OK") when written; a change that loosens the sandbox fails here.
    assert float(m.group(1)) <= 2.0, p.stdout


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or shutil.which("cmake") is None,
                    reason="systemd-sysusers or cmake is not installed")
def test_install_sysusers_tmpfiles(tmp_path):
    """cmake --install into a root, then what the README tells an operator
    to run, with --root: the amaxd user, /run/amaxd and /var/lib/amaxd."""
    root = tmp_path / "root"
    p = subprocess.run(["cmake", "--install", BUILD], env=dict(os.environ, DESTDIR=str(root)),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    installed = p.stdout
    unit = [ln.split()[-1] for ln in installed.splitlines() if ln.endswith("/amaxd.service")]
    assert unit and "/systemd/system/" in unit[0], installed
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    p = subprocess.run(["systemd-sysusers", f"--root={root}"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    users = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()}
    assert "amaxd" in users and users["amaxd"][5] == "/var/lib/amaxd", users
    uid, gid = int(users["amaxd"][2]), int(users["amaxd"][3])
    assert "amaxd:x:%d:" % gid in (root / "etc/group").read_text()
    p = subprocess.run(["systemd-tmpfiles", f"--root={root}", "--create", "amaxd.conf"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for d in ("run/amaxd", "var/lib/amaxd"):
        st = os.stat(root / d)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o750), d
    conf = [ln.split()[-1] for ln in installed.splitlines() if ln.endswith("/amaxd/amaxd.conf")]
    assert conf, installed


def test_shipped_config_starts(tmp_path):
    """deploy/amaxd.conf (what the unit reads) is accepted by the daemon;
    paths that need root are overridden by flags, which win over the file."""
    helptext = subprocess.run([BIN, "--help"], capture_output=True, text=True).stdout
    if "--state_dir=" not in helptext:
        pytest.skip("this build has no state_dir setting yet (it comes with snapshots); "
                    "deploy/amaxd.conf sets it")
    conf = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "amaxd.conf")
    n = Notify(str(tmp_path / "notify"))
    state = tmp_path / "state"
    state.mkdir()
    p, sock = start(tmp_path, f"--config={conf}", f"--socket={tmp_path / 'amaxd.sock'}",
                    "--metrics-listen=127.0.0.1:0", f"--state-dir={state}",
                    env={"NOTIFY_SOCKET": n.path})
    try:
        n.wait_for("READY")
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
