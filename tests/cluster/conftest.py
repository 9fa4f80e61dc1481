"""Fixtures: a cluster of real amaxd processes on loopback.

Each daemon gets its own Unix socket, its own peer port on 127.0.0.1, the
same cluster secret file, and by default the Gloo collective with the host
backend (CPU). Trainer processes talk to "their" daemon's socket. At
teardown every daemon still running gets SIGTERM and must exit 0 with no
sanitizer report.

On a GPU host (tests/gpu/cluster.sh) the same tests run over NCCL with the
CUDA backend, one daemon per GPU:
  AMAXD_CLUSTER_COLLECTIVE=nccl AMAXD_CLUSTER_BACKEND=cuda AMAXD_CLUSTER_GPUS=2
Tests that need more daemons than AMAXD_CLUSTER_GPUS allows are skipped.
"""
import os
import signal
import socket
import sys
import tempfile

import pytest

COLLECTIVE = os.environ.get("AMAXD_CLUSTER_COLLECTIVE", "gloo")
BACKEND = os.environ.get("AMAXD_CLUSTER_BACKEND", "host")
GPUS = int(os.environ.get("AMAXD_CLUSTER_GPUS", "0"))

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "e2e"))
from amaxd_proc import Daemon  # noqa: E402


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Cluster:
    """n daemons; daemon i listens for peers on 127.0.0.1:ports[i]."""

    def __init__(self, root, n, *args, secret=b"0123456789abcdef-cluster-secret", env=None,
                 state=False, candidates=1):
        """state: each daemon snapshots its jobs under state_dir(i);
        candidates: daemons 0..candidates-1 are the coordinator list."""
        self.root = root
        self.state = state
        self.candidates = candidates
        self.n = n
        self.args = list(args)
        self.env = env
        self.ports = free_ports(n)
        self.secret_path = os.path.join(root, "secret")
        with open(self.secret_path, "wb") as f:
            f.write(secret)
        os.chmod(self.secret_path, 0o600)
        self.daemons = [None] * n
        self.dirs = [os.path.join(root, f"d{i}") for i in range(n)]
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        for i in range(n):
            self.start(i)

    def flags(self, i):
        return [f"--cluster-size={self.n}", f"--cluster-rank={i}",
                "--coordinator=" + ",".join(f"127.0.0.1:{self.ports[k]}"
                                            for k in range(self.candidates)),
                f"--peer-listen=127.0.0.1:{self.ports[i]}",
                f"--peer-advertise=127.0.0.1:{self.ports[i]}",
                f"--cluster-secret-file={self.secret_path}",
                "--gloo-host=127.0.0.1", f"--collective={COLLECTIVE}", f"--backend={BACKEND}",
                *([f"--cuda-device={i % GPUS}"] if GPUS else []),
                *([f"--state-dir={self.state_dir(i)}"] if self.state else []), *self.args]

    def state_dir(self, i):
        d = os.path.join(self.dirs[i], "state")
        os.makedirs(d, exist_ok=True)
        return d

    def start(self, i, extra=()):
        d = Daemon(self.dirs[i], *self.flags(i), *extra, env=self.env,
                   socket=os.path.join(self.dirs[i], "amaxd.sock"))
        self.daemons[i] = d
        return d

    def __getitem__(self, i):
        return self.daemons[i]

    def socket(self, i):
        return self.daemons[i].socket

    def kill(self, i):
        """kill -9: no clean exit, the socket file stays (a restart replaces it)."""
        d = self.daemons[i]
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        d._log.close()

    def stop_all(self):
        for d in self.daemons:
            if d is not None and (d.proc.poll() is None or not d._log.closed):
                rc = d.stop()
                d.check_clean_exit(rc)

    def logs(self):
        return "\n".join(f"---- daemon {i} ----\n{d.log()[-6000:]}"
                         for i, d in enumerate(self.daemons) if d is not None)


@pytest.fixture
def make_cluster():
    """Factory: make_cluster(n, *extra_args) -> Cluster; stopped at teardown."""
    made = []
    tmp = tempfile.TemporaryDirectory(prefix="amaxd-cluster-")

    def make(n, *args, **kw):
        if GPUS and n > GPUS:
            pytest.skip(f"needs {n} daemons, one per GPU; this host has {GPUS} GPUs")
        c = Cluster(tempfile.mkdtemp(dir=tmp.name), n, *args, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop_all()
    tmp.cleanup()


def max_daemons(want):
    """`want` daemons, or as many as there are GPUs on a GPU run."""
    return min(want, GPUS) if GPUS else want
