"""A crowd of connections that never call cannot lock trainers out (issue
19, item 7; docs/SECURITY.md "Connection budget"): past a cap, the socket
guard evicts the oldest connection that has no call open and never had one
answered, then the one idle longest; never one with a call open; one user
holds at most max_connections_per_uid connections."""
import os
import re
import socket
import subprocess
import tempfile
import threading
import time

import pytest

import amaxd
import crowd
from h2raw import RawConn

HEALTH = "/grpc.health.v1.Health/Check"
IDLE, PREFACE = 1000, 200
# The bound of the issue (a fresh connection's Health with 1,200 held). It
# takes 2-9 ms on the 2-core build machine (docs/SECURITY.md), ASan build
# included well under it: the margin is for a loaded CI machine, the bound
# is functional (before the fix there was no answer at all).
FRESH_LIMIT_S = 1.0


def need_descriptors(n):
    """Raises this process's descriptor limit for n sockets, or skips."""
    soft = crowd.raise_nofile(n + 512)
    if soft < n + 512:
        pytest.skip(f"RLIMIT_NOFILE allows {soft} descriptors; the crowd needs {n + 512}")


def wait_for(pred, what, limit=10.0):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_crowd_of_idle_connections_does_not_lock_trainers_out(start_daemon):
    need_descriptors(IDLE + PREFACE)
    d = start_daemon("--metrics-listen=127.0.0.1:0")
    # Before the crowd: a rank whose Join waits for its peer (a call open on
    # the oldest connection), and a connection that made one call and idles.
    joined = {}

    def join0():
        with d.client("held", 0, 2) as c:
            try:
                joined["r0"] = c.join(timeout=60)
            except amaxd.AmaxdError as e:
                joined["err"] = e
    t = threading.Thread(target=join0)
    t.start()
    with d.client("probe", 0, 1) as c:
        wait_for(lambda: [j.joined for j in c.status().jobs if j.name == "held"] == [1],
                 "rank 0 to join")
    used = RawConn(d.socket)
    assert used.status_of(used.unary(HEALTH, b""))[0] == 0

    c = crowd.hold(d.socket, idle=IDLE, preface=PREFACE)
    try:
        assert c.connect_errors == 0 and len(c.socks) == IDLE + PREFACE
        crowd.wait_settled(d.proc.pid)
        lat = crowd.fresh_health(d.socket, timeout=10.0)
        print(f"\nfresh-connection Health with {len(c.socks)} held: "
              + ("no answer" if lat is None else f"{lat * 1000:.1f} ms"))
        assert lat is not None, "a fresh connection's Health got no answer"
        assert lat < FRESH_LIMIT_S, f"Health on a fresh connection took {lat:.3f} s"

        # Evicted owners see their connection closed (EOF), at once: the
        # oldest of the crowd, as many as one user's cap (half of 1024 by
        # default) leaves no room for.
        gone = crowd.closed(c.socks, wait=2.0)
        assert len(gone) >= IDLE + PREFACE - 512, len(gone)
        assert gone == list(range(len(gone))), "not the oldest connections were evicted"
        held = [s for i, s in enumerate(c.socks) if i not in set(gone)]
        assert crowd.closed(held) == [], "connections closed that were not evicted"

        # The connection in a call and the idle one that had a call are
        # still there: rank 1 joins, and rank 0's Join (on its first
        # connection) returns; the idle connection answers another call.
        with d.client("held", 1, 2) as r1:
            r1.join()
        t.join(30)
        assert "r0" in joined, f"rank 0's Join failed: {joined.get('err')}"
        assert used.status_of(used.unary(HEALTH, b""))[0] == 0
    finally:
        c.close()
        used.close()

    log = d.log()
    assert re.search(r"max_connections_per_uid=512 reached: evicting the oldest idle connection "
                     r"\(user \d+, open [\d.]+ s, never completed a call\)", log), log[-3000:]
    # Rate-limited: a few lines, not one per eviction.
    assert log.count("evicting the oldest idle connection") < 50
    wait_for(lambda: metric(d, "amaxd_connections_evicted_total") >= IDLE + PREFACE - 512,
             "the evicted counter")


def test_a_full_budget_of_calls_refuses_the_newcomer(start_daemon):
    """Every connection has a call open: none is evicted for a new one, which
    is closed at once (EOF, not a hang)."""
    d = start_daemon("--max-connections=16", "--max-connections-per-uid=16",
                     "--join-timeout-ms=60000", "--metrics-listen=127.0.0.1:0")
    from amaxd import pb
    # The start-up probe's connection is gone (or it would be evicted).
    wait_for(lambda: metric(d, "amaxd_connections") == 0, "no connection")
    conns = [RawConn(d.socket) for _ in range(16)]
    try:
        for i, rc in enumerate(conns):    # Joins that wait for a rank 1
            rc.unary("/amaxd.v1.Calibration/Join",
                     pb.JoinRequest(job=f"j{i}", rank=0, world_size=2).SerializeToString())
        wait_for(lambda: metric(d, "amaxd_calls_waiting") == 16, "16 waiting Joins")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)
        s.connect(d.socket)
        assert s.recv(100) == b"", "the newcomer was not closed"
        s.close()
        wait_for(lambda: "each in a call" in d.log(), "the refusal's log line")
        assert "evicting" not in d.log()
        wait_for(lambda: metric(d, "amaxd_connections_refused_total") >= 1, "the refused counter")
        assert metric(d, "amaxd_calls_waiting") == 16
        assert metric(d, "amaxd_connections") == 16
        assert metric(d, "amaxd_connections_evicted_total") == 0
    finally:
        for rc in conns:
            rc.close()


def test_idle_connections_that_called_make_room_last(start_daemon):
    """Past the cap, a connection that never had a call answered goes
    first; when there is none, the one idle longest since its last call."""
    d = start_daemon("--max-connections=32", "--max-connections-per-uid=32",
                     "--metrics-listen=127.0.0.1:0")
    wait_for(lambda: metric(d, "amaxd_connections") == 0, "no connection")
    conns = [RawConn(d.socket) for _ in range(32)]
    try:
        for rc in conns:
            assert rc.status_of(rc.unary(HEALTH, b""))[0] == 0
            rc.sock.setblocking(False)
        newcomer = crowd.hold(d.socket, idle=1, preface=0)   # no fresh one: the oldest idle goes
        assert crowd.closed([rc.sock for rc in conns], wait=1.0) == [0]
        lat = crowd.fresh_health(d.socket, timeout=10.0)      # the fresh newcomer goes
        assert lat is not None and lat < FRESH_LIMIT_S, lat
        assert crowd.closed(newcomer.socks, wait=1.0) == [0]
        assert crowd.closed([rc.sock for rc in conns[1:]]) == []
        assert re.search(r"evicting the oldest idle connection \(user \d+, idle [\d.]+ s since "
                         r"its last call\)", d.log())
        newcomer.close()
    finally:
        for rc in conns:
            rc.close()


def metric(d, name):
    import test_metrics
    return test_metrics.scrape(test_metrics.port_of(d))[1].get((name, ()))


CHILD = r"""
import socket, sys
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.setblocking(False)
    socks.append(s)
print("held", flush=True)
gone = set()
while sys.stdin.readline():       # each line: how many were closed so far
    for i, s in enumerate(socks):
        try:
            while i not in gone:
                if not s.recv(65536):
                    gone.add(i)
        except BlockingIOError:
            pass
        except OSError:
            gone.add(i)
    print(len(gone), flush=True)
"""


class UserCrowd:
    """n idle connections held by a child process running as `uid`."""

    def __init__(self, sock, uid, n):
        self.p = subprocess.Popen(
            ["/usr/bin/python3", "-c", CHILD, sock, str(n)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
            preexec_fn=lambda: (os.setgroups([]), os.setgid(uid), os.setuid(uid)))
        assert self.p.stdout.readline().strip() == "held"

    def closed(self):
        self.p.stdin.write("\n")
        self.p.stdin.flush()
        return int(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(10)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as other users")
def test_one_user_cannot_take_another_users_connections(start_daemon):
    """User nobody's crowd is capped at max_connections_per_uid and evicts
    its own oldest connections, not the older idle ones of root (without
    the per-user cap, the guard-wide cap would take those first); at the
    guard-wide cap a third user's newcomer takes from the largest holder."""
    top = tempfile.mkdtemp(prefix="amaxd-crowd-")
    os.chmod(top, 0o711)
    sock = os.path.join(top, "amaxd.sock")
    d = start_daemon("--max-connections=64", "--max-connections-per-uid=32", "--socket-mode=0666",
                     socket=sock)
    mine = crowd.hold(sock, idle=8, preface=0)   # root's: older than the crowd, never call
    users = []
    try:
        nobody = UserCrowd(sock, 65534, 100)
        users.append(nobody)
        crowd.wait_settled(d.proc.pid)
        assert nobody.closed() == 100 - 32, "user nobody's crowd is not capped at 32"
        assert crowd.closed(mine.socks, wait=0.5) == [], "another user's crowd evicted root's"
        lat = crowd.fresh_health(sock, timeout=10.0)
        assert lat is not None and lat < FRESH_LIMIT_S, lat
        assert "max_connections_per_uid=32 reached: evicting the oldest idle connection " \
               "(user 65534" in d.log()
        # 8 + 32 + 24 = 64, the guard-wide cap; then one more of a fourth user.
        third = UserCrowd(sock, 65533, 24)
        users.append(third)
        crowd.wait_settled(d.proc.pid)
        time.sleep(1.1)   # past the eviction log's rate limit
        users.append(UserCrowd(sock, 65532, 1))
        crowd.wait_settled(d.proc.pid)
        assert nobody.closed() == 100 - 32 + 1, "the largest holder did not make room"
        assert third.closed() == 0
        assert crowd.closed(mine.socks) == []
        assert "max_connections=64 reached: evicting the oldest idle connection (user 65534" \
            in d.log()
    finally:
        for u in users:
            u.close()
        mine.close()
    d.check_clean_exit(d.stop())   # the socket is gone: the directory is empty
    os.rmdir(top)
