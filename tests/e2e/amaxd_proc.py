"""The real amaxd binary as a child process on a temporary Unix socket.

AMAXD_BIN names the binary (CTest sets it); the daemon's stderr goes to a
log file that every test can read. Used by the fixtures of tests/e2e and
tests/cluster.
"""
import os
import signal
import subprocess
import time

import grpc

import amaxd

BIN = os.environ.get("AMAXD_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "amaxd"))


def open_files_under(pid, prefix):
    """Paths of process pid's open descriptors that start with prefix
    (linked or not: an unlinked file reads "... (deleted)")."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            t = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if t.startswith(prefix):
            out.append(t)
    return out


class Daemon:
    def __init__(self, tmpdir, *args, env=None, socket=None, preexec_fn=None):
        self.dir = tmpdir
        self.socket = socket or os.path.join(tmpdir, "amaxd.sock")
        self.log_path = os.path.join(tmpdir, "amaxd.log")
        self.args = [BIN, f"--socket={self.socket}", "--log-level=debug", *args]
        e = dict(os.environ)
        e.pop("JOURNAL_STREAM", None)
        e.update(env or {})
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=e,
                                     preexec_fn=preexec_fn)
        self._wait_ready()

    def _wait_ready(self, timeout=20.0):
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"amaxd exited with {self.proc.returncode}:\n{self.log()}")
            if os.path.exists(self.socket):
                try:
                    with amaxd.Client("probe", 0, 1, socket=self.socket, timeout=2) as c:
                        if c.health() == "SERVING":
                            return
                except amaxd.AmaxdError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"amaxd did not become ready:\n{self.log()}")

    def client(self, job, rank, world, **kw):
        kw.setdefault("timeout", 60)
        return amaxd.Client(job, rank, world, socket=self.socket, **kw)

    def channel(self):
        return grpc.insecure_channel("unix:" + self.socket)

    def log(self):
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            where = self.stacks()
            self.proc.kill()
            raise AssertionError(f"amaxd did not exit within {timeout}s of signal {sig}; "
                                 f"its threads:\n{where}\nlog:\n{self.log()[-3000:]}")
        self._log.close()
        return rc

    def stacks(self):
        """Where a hung daemon's threads are: gdb's backtraces where gdb is
        installed, else each thread's name and kernel wait channel."""
        import shutil
        pid = self.proc.pid
        if shutil.which("gdb"):
            try:
                r = subprocess.run(["gdb", "-batch", "-p", str(pid), "-ex", "thread apply all bt 12"],
                                   capture_output=True, text=True, timeout=60)
                return "\n".join(l for l in r.stdout.splitlines()
                                 if l.startswith(("Thread", "#")))[-12000:]
            except (subprocess.TimeoutExpired, OSError) as e:
                return f"(gdb failed: {e})"
        out = []
        for t in sorted(os.listdir(f"/proc/{pid}/task")):
            def rd(n):
                try:
                    with open(f"/proc/{pid}/task/{t}/{n}") as f:
                        return f.read().strip()
                except OSError:
                    return "?"
            out.append(f"{t} {rd('comm')} {rd('wchan')}")
        return "\n".join(out)

    def check_clean_exit(self, rc):
        log = self.log()
        assert rc == 0, f"amaxd exited with {rc}:\n{log[-4000:]}"
        assert not os.path.exists(self.socket), "socket file left behind"
        for bad in ("Sanitizer", "runtime error:", "LeakSanitizer"):
            assert bad not in log, f"sanitizer report in the daemon log:\n{log[-6000:]}"


