"""A crowd of held connections on amaxd's Unix socket (issue 19, item 7).

hold() opens `idle` connections that send nothing and `preface` connections
that send only the HTTP/2 client connection preface (the 24-byte magic and
an empty SETTINGS frame, RFC 9113 3.4) and then hold, all from this
process; it keeps them open. fresh_health() then measures a Health call on
a NEW connection (connect included), the way a trainer that starts while
the crowd is there would make it. closed() says which held connections the
daemon closed (they read EOF; a connection still held reads nothing).

As a library (pytest):
    c = crowd.hold(sock, idle=1000, preface=200)
    lat = crowd.fresh_health(sock, timeout=5.0)   # seconds, or None
    gone = crowd.closed(c.socks)                  # indexes of closed ones
    c.close()

As a script (the figures of docs/SECURITY.md):
    crowd.py --bin build/amaxd [--runs 5] [--idle 1000 --preface 200]
             [--timeout 5] [-- daemon args]
starts the daemon on a temporary socket for every run and prints each
run's fresh-connection Health latency (three fresh connections a run, the
first is the figure) and the median over the runs.
"""
import argparse
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HEALTH = "/grpc.health.v1.Health/Check"
# A new channel must not share a connection with an older one (grpcio pools
# subchannels by target), or "a new connection" would silently reuse one.
FRESH = [("grpc.use_local_subchannel_pool", 1)]
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def raise_nofile(need):
    """Raises this process's soft RLIMIT_NOFILE towards `need` (at most the
    hard limit); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


class Crowd:
    def __init__(self):
        self.socks = []          # in the order they connected: oldest first
        self.kinds = []          # "idle" or "preface", per socket
        self.connect_errors = 0

    def close(self):
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass
        self.socks = []


def hold(path, idle=1000, preface=200):
    """Opens the crowd (the idle ones first, then the preface ones).
    Connects that fail are counted, not retried."""
    raise_nofile(idle + preface + 256)
    c = Crowd()
    for kind in ["idle"] * idle + ["preface"] * preface:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect(path)
            if kind == "preface":
                s.sendall(PREFACE)
        except OSError:
            c.connect_errors += 1
            s.close()
            continue
        s.setblocking(False)
        c.socks.append(s)
        c.kinds.append(kind)
    return c


def closed(socks, wait=0.0):
    """Indexes of the sockets the peer has closed (EOF or reset), reading
    and dropping whatever the daemon sent them (its SETTINGS frame); waits
    up to `wait` seconds for the closes still on their way."""
    gone = set()
    end = time.monotonic() + wait
    while True:
        for i, s in enumerate(socks):
            if i in gone:
                continue
            while True:
                try:
                    d = s.recv(65536)
                except BlockingIOError:
                    break
                except OSError:
                    gone.add(i)
                    break
                if not d:
                    gone.add(i)
                    break
        if time.monotonic() >= end:
            return sorted(gone)
        time.sleep(0.05)


def wait_settled(pid, quiet=0.3, limit=15.0):
    """Waits until the daemon's descriptor count stops moving for `quiet`
    seconds (it has accepted, relayed or closed the whole crowd)."""
    last, since = None, time.monotonic()
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            n = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            return
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.05)


def fresh_health(path, timeout=5.0):
    """Seconds a Health call takes on a new connection (channel creation,
    connect and the call; the client waits for the connection), or None
    when it is not answered SERVING within `timeout`."""
    import grpc
    t = time.monotonic()
    ch = grpc.insecure_channel("unix:" + path, options=FRESH)
    try:
        r = ch.unary_unary(HEALTH)(b"", timeout=timeout, wait_for_ready=True)
        return time.monotonic() - t if r == b"\x08\x01" else None
    except grpc.RpcError:
        return None
    finally:
        ch.close()


def start_daemon(binary, sock, args=()):
    import grpc
    log = open(sock + ".log", "wb")
    p = subprocess.Popen([binary, f"--socket={sock}", "--log-level=info", *args],
                         stdout=log, stderr=subprocess.STDOUT)
    end = time.time() + 20
    while time.time() < end and p.poll() is None:
        if os.path.exists(sock):
            ch = grpc.insecure_channel("unix:" + sock, options=FRESH)
            try:
                ch.unary_unary(HEALTH)(b"", timeout=1.0, wait_for_ready=True)
                return p
            except grpc.RpcError:
                pass
            finally:
                ch.close()
        time.sleep(0.05)
    raise RuntimeError(f"amaxd did not start (rc={p.poll()}): see {sock}.log")


def stop_daemon(p, timeout=30):
    if p.poll() is None:
        p.terminate()
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "killed"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build/amaxd")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--preface", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("daemon_args", nargs="*")
    a = ap.parse_args()
    firsts = []
    for run in range(a.runs):
        tmp = tempfile.mkdtemp(prefix="crowd-")
        sock = os.path.join(tmp, "amaxd.sock")
        p = start_daemon(a.bin, sock, a.daemon_args)
        c = hold(sock, a.idle, a.preface)
        wait_settled(p.pid)
        lats = [fresh_health(sock, a.timeout) for _ in range(3)]
        gone = closed(c.socks, wait=1.0)
        held = len(c.socks) - len(gone)
        c.close()
        rc = stop_daemon(p)
        log = open(sock + ".log", errors="replace").read()
        evict = sum("evicting" in ln for ln in log.splitlines())
        firsts.append(lats[0] if lats[0] is not None else float("inf"))
        fmt = ["FAIL(>%.0fs)" % a.timeout if x is None else "%.1fms" % (x * 1000) for x in lats]
        print(f"run {run}: crowd={len(c.kinds)} (connect errors {c.connect_errors}) "
              f"still held={held} closed by the daemon={len(gone)} "
              f"fresh Health={' '.join(fmt)} evict log lines={evict} rc={rc}", flush=True)
    med = statistics.median(firsts)
    print(f"median fresh-connection Health over {a.runs} runs: "
          + ("no answer within %.0f s" % a.timeout if med == float("inf") else "%.1f ms" % (med * 1000)))
    return 0 if med < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
