"""Fixtures: start the real amaxd binary on a temporary Unix socket.

At teardown the daemon gets SIGTERM and must exit 0 (a sanitizer report
makes it exit non-zero), leave no socket behind and print no sanitizer
report. The process wrapper is amaxd_proc.Daemon.
"""
import tempfile

import pytest

from amaxd_proc import BIN, Daemon  # noqa: F401  (BIN is imported from here by tests)


@pytest.fixture
def start_daemon():
    """Factory: start_daemon(*extra_args) -> Daemon; all are stopped at teardown."""
    started = []
    tmp = tempfile.TemporaryDirectory(prefix="amaxd-e2e-")

    def start(*args, env=None, socket=None, preexec_fn=None):
        d = Daemon(tempfile.mkdtemp(dir=tmp.name), *args, env=env, socket=socket,
                   preexec_fn=preexec_fn)
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None or not d._log.closed:
            rc = d.stop()
            d.check_clean_exit(rc)
    tmp.cleanup()


@pytest.fixture
def daemon(start_daemon):
    return start_daemon()
