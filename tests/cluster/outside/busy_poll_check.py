#!/usr/bin/env python3
"""Outside check of amaxd's busy_poll setting (docs only: README.md,
docs/OPERATING.md "Busy polling", docs/API.md, docs/CLUSTER.md, amaxd --help).

Prints PASS/FAIL lines and a final "overall: N failed".  Every daemon and
trainer process it starts lives in a temp dir under this folder and is
killed at the end.  The same file is also the trainer worker
(`check.py worker JSON`), driven over stdin/stdout one JSON line per op.
"""
import json
import os
import queue
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
AMAXD = os.environ.get("AMAXD_BIN", os.path.join(ROOT, "build", "amaxd"))
PY = sys.executable
HERE = os.path.dirname(os.path.abspath(__file__))
F32 = np.float32
FLT_MAX = np.finfo(np.float32).max

# --------------------------------------------------------------------------
# The job: quantizers and the amax values every rank sends at each step.
# --------------------------------------------------------------------------
NAMES = ["q.delayed", "q.experts", "q.fp8_chan", "q.fp8_chan_rm", "q.fp8_tensor", "q.mxfp8",
         "q.nvfp4_blocks", "q.nvfp4_tensor"]


def quantizers(rank, W):
    import amaxd
    from amaxd import placement as P
    R = amaxd.Recipe
    PE, RM = amaxd.PER_EPOCH, amaxd.RUNNING_MAX
    return [
        amaxd.Quantizer("q.delayed", [], R.fp8_delayed(history_len=4), accumulation=PE),
        amaxd.Quantizer("q.experts", [12], R.fp8_current(), P.per_expert(12, rank, W),
                        accumulation=PE, peer_group="experts"),
        amaxd.Quantizer("q.fp8_chan", [12], R.fp8_current(), P.column_parallel([12], rank, W),
                        accumulation=PE),
        amaxd.Quantizer("q.fp8_chan_rm", [12], R.fp8_current(), P.replicated([12]),
                        accumulation=RM),
        amaxd.Quantizer("q.fp8_tensor", [], R.fp8_current(), accumulation=PE),
        amaxd.Quantizer("q.mxfp8", [12], R.mxfp8(), P.replicated([12]), accumulation=PE),
        amaxd.Quantizer("q.nvfp4_blocks", [12, 4], R.nvfp4(), P.shard([12, 4], 0, rank, W),
                        accumulation=PE),
        amaxd.Quantizer("q.nvfp4_tensor", [], R.nvfp4(), accumulation=PE),
    ]


def values(rank, W, step):
    """Deterministic float32 amax values of `rank` at logical step `step`."""
    rng = np.random.default_rng(1000003 * step + 7919 * rank + 17 * W)

    def v(shape):
        return np.exp(rng.uniform(-3.0, 4.0, size=shape)).astype(F32)
    n = 12 // W
    out = {"q.delayed": v(()), "q.fp8_tensor": v(()), "q.nvfp4_tensor": v(()),
           "q.fp8_chan": v((n,)), "q.fp8_chan_rm": v((12,)), "q.mxfp8": v((12,)),
           "q.nvfp4_blocks": v((n, 4))}
    ev = v((n,))
    nodata = rng.random(n) < 0.35
    if step % 5 == 0 and rank == 0:
        nodata[:] = True          # a whole EP rank without tokens
    if rank == W - 1:
        nodata[0] = False         # at least one expert has data every step
    out["q.experts"] = (ev, nodata)
    return out


# --------------------------------------------------------------------------
# Worker (one trainer rank in its own process)
# --------------------------------------------------------------------------
def canon(results, include_filled=True):
    """Every byte of every answer field, in name order."""
    parts = []
    for n in sorted(results):
        r = results[n]
        parts.append(n.encode() + b"\0")
        parts.append(struct.pack("<8I", *(list(r.offset) + [0] * 4)[:4], *(list(r.shape) + [0] * 4)[:4]))
        for a in (r.amax, r.scale, r.scale_inv):
            parts.append(np.ascontiguousarray(a, dtype="<f4").tobytes())
        parts.append(np.ascontiguousarray(r.block_scales, dtype=np.uint8).tobytes())
        parts.append(struct.pack("<fffI", r.global_amax, r.global_scale, r.global_scale_inv,
                                 r.missing))
        if include_filled:
            parts.append(b"F" + (np.asarray(r.peer_filled, dtype=np.uint8).tobytes()
                                 if r.peer_filled is not None else b"-"))
        if r.previous_global_amax is None:
            parts.append(b"P-")
        else:
            parts.append(b"P" + struct.pack("<ff", r.previous_global_amax,
                                            r.previous_global_scale))
    return b"".join(parts)


def res_json(results):
    out = {}
    for n, r in results.items():
        out[n] = {"amax": np.ascontiguousarray(r.amax, dtype="<f4").tobytes().hex(),
                  "scale": np.ascontiguousarray(r.scale, dtype="<f4").tobytes().hex(),
                  "scale_inv": np.ascontiguousarray(r.scale_inv, dtype="<f4").tobytes().hex(),
                  "bs": np.ascontiguousarray(r.block_scales, dtype=np.uint8).tobytes().hex(),
                  "g": struct.pack("<fff", r.global_amax, r.global_scale,
                                   r.global_scale_inv).hex(),
                  "shape": list(r.shape), "offset": list(r.offset)}
    return out


def worker_main(cfg):
    import amaxd
    from amaxd import errors as E
    rank, W, job = cfg["rank"], cfg["world"], cfg["job"]
    packed = bool(rank % 2)          # odd ranks use the packed form
    state = {"c": None}

    def connect(sock):
        if state["c"] is not None:
            try:
                state["c"].close()
            except Exception:
                pass
        state["c"] = amaxd.Client(job, rank, W, socket=sock, timeout=cfg.get("timeout", 8.0))

    def op_send(a):
        c = state["c"]
        vals = values(rank, W, a["step"])
        ev, nd = vals.pop("q.experts")
        ep = a.get("epoch")
        if packed:
            L = c.layout()
            d = {n: v for n, v in vals.items()}
            d["q.experts"] = amaxd.Masked(ev, nd)
            slab, has = L.pack(d)
            c.send_packed(slab, has, epoch=ep)
        else:
            d = {n: (float(v) if v.shape == () else v) for n, v in vals.items()}
            d["q.experts"] = amaxd.Masked(ev, nd)
            c.send(d, epoch=ep)
        return {"epoch": c.epoch}

    def op_reconcile(a):
        c = state["c"]
        before = c.epoch
        if packed:
            pr = c.reconcile_packed(timeout=a.get("timeout"), epoch=a.get("epoch"))
            results = {n: pr.result(n) for n in pr.keys()}
            ep, nxt = pr.epoch, pr.next_epoch
            raw = bytes(pr.raw).hex()     # the ReconcilePackedResponse as it came
        else:
            results = c.reconcile(timeout=a.get("timeout"), epoch=a.get("epoch"))
            ep, nxt = before, c.epoch
            raw = None
        return {"epoch": ep, "next_epoch": nxt, "canon": canon(results).hex(),
                "res": res_json(results), "raw": raw}

    def op_join(a):
        r = state["c"].join(timeout=a.get("timeout"))
        return {"rejoined": bool(r.rejoined), "epoch": int(r.epoch)}

    def op_register(a):
        r = state["c"].register(quantizers(rank, W))
        return {"created": r.created, "existing": r.existing}

    def op_getscales(a):
        res = state["c"].get_scales()
        return {"canon_nofill": canon(res, include_filled=False).hex()}

    def op_step(a):
        op_send(a)
        return op_reconcile(a)

    def op_recover(a):
        """What a trainer does after an error: (reconnect,) Join again,
        Register again, send the step of the open epoch (step k is epoch k
        in these runs) and Reconcile; on an error, start over, until the
        deadline. Every failed call is reported with its time."""
        if a.get("sock"):
            connect(a["sock"])
        t_end = time.monotonic() + a["deadline"]
        errors = []
        while time.monotonic() < t_end:
            for what, fn in (("join", lambda: op_join({"timeout": a["join_timeout"]})),
                             ("register", lambda: op_register({})),
                             ("send", lambda: op_send({"step": state["c"].epoch})),
                             ("reconcile", lambda: op_reconcile({"timeout": a.get("rec_timeout")}))):
                t0 = time.monotonic()
                try:
                    out = fn()
                except E.AmaxdError as e:
                    errors.append({"call": what, "code": e.code.name, "msg": e.message,
                                   "elapsed": time.monotonic() - t0})
                    time.sleep(0.1)
                    break
                if what == "join":
                    joined = out
            else:
                out["join"] = joined
                out["errors"] = errors
                return out
        return {"ok": False, "code": "GAVE_UP", "msg": f"no epoch in {a['deadline']}s",
                "errors": errors}

    ops = {"connect": lambda a: connect(a["sock"]) or {}, "join": op_join,
           "register": op_register, "send": op_send, "reconcile": op_reconcile,
           "getscales": op_getscales, "step": op_step, "recover": op_recover,
           "drop": lambda a: (state["c"].reset(drop_job=True), {})[1]}
    for line in sys.stdin:
        a = json.loads(line)
        t0 = time.monotonic()
        try:
            out = ops[a["op"]](a)
            out.setdefault("ok", True)
        except E.AmaxdError as e:
            out = {"ok": False, "code": e.code.name, "msg": e.message}
        except Exception as e:  # noqa: BLE001
            out = {"ok": False, "code": "EXC", "msg": repr(e) + "\n" + traceback.format_exc()}
        out["elapsed"] = time.monotonic() - t0
        out["id"] = a["id"]
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------
# Harness: results, processes
# --------------------------------------------------------------------------
FAILS = []
PASSES = 0
PROCS = []          # every Popen we started
INFO = []
NOTES = []


def report(ok, name, detail=""):
    global PASSES
    line = f"{'PASS' if ok else 'FAIL'}: {name}" + (f" -- {detail}" if detail else "")
    print(line, flush=True)
    if ok:
        PASSES += 1
    else:
        FAILS.append(line)
    return ok


def info(msg):
    print(f"INFO: {msg}", flush=True)
    INFO.append(msg)


def cpu_seconds(pid):
    """utime + stime of the whole process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    rest = s[s.rfind(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid):
    """Run time of the process's live threads (ns), from /proc/<pid>/task/*/schedstat:
    finer than /proc/<pid>/stat's clock ticks, for the per-epoch figure."""
    t = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                t += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return t


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def cluster_flags(root, busy, reconcile_ms):
    """(ports, flags every daemon of a two-daemon Gloo cluster on loopback
    shares): a fresh secret file, the coordinator's port first."""
    secret = os.path.join(root, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(24).hex().encode())
    os.chmod(secret, 0o600)
    pa, pb = free_port(), free_port()
    common = [f"--busy-poll={busy}", "--cluster-size=2", f"--coordinator=127.0.0.1:{pa}",
              f"--cluster-secret-file={secret}", "--gloo-host=127.0.0.1", "--collective=gloo",
              f"--reconcile-timeout-ms={reconcile_ms}", "--join-timeout-ms=10000"]
    return (pa, pb), common


class Daemon:
    def __init__(self, root, name, args, env=None):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir, exist_ok=True)
        self.name = name
        self.sock = os.path.join(self.dir, "s.sock")
        self.args = list(args)
        self.env = env
        self.p = None
        self.starts = 0

    @property
    def log(self):
        return os.path.join(self.dir, "daemon.log")

    def start(self, wait=True, timeout=20.0):
        self.starts += 1
        lf = open(self.log, "a")
        lf.write(f"==== start #{self.starts} at {time.time():.3f}\n")
        lf.flush()
        self.p = subprocess.Popen([AMAXD, f"--socket={self.sock}", "--backend=host"] + self.args,
                                  stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=self.env, start_new_session=True)
        PROCS.append(self.p)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout=20.0):
        import amaxd
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.p.poll() is not None:
                raise RuntimeError(f"daemon {self.name} exited {self.p.returncode}: "
                                   + open(self.log).read()[-2000:])
            if os.path.exists(self.sock):
                try:
                    with amaxd.Client("probe", 0, 1, socket=self.sock, timeout=1.0) as c:
                        if c.health() == "SERVING":
                            return
                except Exception:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"daemon {self.name} not ready after {timeout}s")

    @property
    def pid(self):
        return self.p.pid

    def cpu(self):
        return cpu_seconds(self.p.pid)

    def kill9(self):
        if self.p and self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)

    def stop(self):
        if self.p and self.p.poll() is None:
            try:
                os.kill(self.p.pid, signal.SIGCONT)
            except OSError:
                pass
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)

    def status(self, job):
        import amaxd
        with amaxd.Client("probe", 0, 1, socket=self.sock, timeout=3.0) as c:
            st = c.status(job)
        return st


class Worker:
    _n = 0

    def __init__(self, root, job, rank, W, sock, timeout=8.0):
        Worker._n += 1
        self.rank, self.job, self.W = rank, job, W
        self.errlog = open(os.path.join(root, f"worker-{job}-{rank}-{Worker._n}.log"), "w")
        cfg = {"job": job, "rank": rank, "world": W, "timeout": timeout}
        self.p = subprocess.Popen([PY, os.path.abspath(__file__), "worker", json.dumps(cfg)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.errlog, text=True, bufsize=1,
                                  start_new_session=True)
        PROCS.append(self.p)
        self.q = queue.Queue()
        self.id = 0
        self.pending = None
        threading.Thread(target=self._read, daemon=True).start()
        self.call("connect", 10, sock=sock)

    def _read(self):
        for line in self.p.stdout:
            try:
                self.q.put(json.loads(line))
            except ValueError:
                pass
        self.q.put({"eof": True})

    def start(self, op, **kw):
        self.id += 1
        kw.update(op=op, id=self.id)
        self.pending = (self.id, op, time.monotonic())
        try:
            self.p.stdin.write(json.dumps(kw) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def wait(self, wait_s):
        timeout = wait_s
        pid, op, t0 = self.pending
        t_end = t0 + timeout
        while True:
            left = t_end - time.monotonic()
            try:
                r = self.q.get(timeout=max(0.01, left))
            except queue.Empty:
                return {"ok": False, "code": "HANG", "msg": f"{op}: no answer in {timeout:.1f}s",
                        "elapsed": time.monotonic() - t0}
            if r.get("eof"):
                return {"ok": False, "code": "DEAD", "msg": f"{op}: worker exited",
                        "elapsed": time.monotonic() - t0}
            if r.get("id") == pid:
                r["wall"] = time.monotonic() - t0
                return r

    def call(self, op, wait_s, **kw):
        self.start(op, **kw)
        return self.wait(wait_s)

    def kill9(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.kill9()


def all_call(workers, op, wait_s, **kw):
    for w in workers:
        w.start(op, **kw)
    return [w.wait(wait_s) for w in workers]


def brief(r):
    if r.get("ok"):
        return "ok"
    return f"{r.get('code')}: {r.get('msg', '')[:300]} ({r.get('elapsed', 0):.2f}s)"


# --------------------------------------------------------------------------
# Reference numerics, from docs/NUMERICS.md
# --------------------------------------------------------------------------
def _e4m3_table():
    vals = []
    for code in range(0x7f):   # 0x00..0x7e, positive finite
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3 = _e4m3_table()


def e4m3_encode(x):
    x = float(x)
    if x >= 448.0:
        return 0x7e
    i = int(np.searchsorted(E4M3, x))
    if i < len(E4M3) and E4M3[i] == x:
        return i
    lo, hi = i - 1, i
    dl, dh = x - E4M3[lo], E4M3[hi] - x
    if dl < dh:
        return lo
    if dh < dl:
        return hi
    return lo if lo % 2 == 0 else hi


def e8m0(x):
    b = int(np.array(x, dtype=F32).view(np.uint32))
    exp, mant = (b >> 23) & 0xff, b & 0x7fffff
    if x == 0:
        return 0
    if exp == 0xff:
        return 0xfe if mant == 0 else 0xff
    if exp == 0xfe or exp == 0:
        return exp
    return exp + (1 if mant else 0)


def fp8_current(a):
    a = F32(a)
    if a == 0 or not np.isfinite(a):
        s = F32(1.0)
    else:
        s = F32(448.0) / a
        if not np.isfinite(s):
            s = FLT_MAX
    return s, F32(1.0) / s


def nvfp4_global(g):
    g = F32(g)
    if g == 0:
        senc = F32(1.0)
    else:
        senc = F32(2688.0) / g
        if senc == 0:
            senc = F32(1.0)
        senc = min(senc, FLT_MAX)
    return F32(senc), F32(g * F32(1.0 / 2688.0))


def nvfp4_cell(a, senc):
    x = F32(a) * F32(senc * F32(1.0 / 6.0))
    x = min(x, FLT_MAX)
    byte = e4m3_encode(x)
    sinv = F32(E4M3[byte])
    prod = F32(sinv * F32(F32(1.0) / senc))
    with np.errstate(divide="ignore"):
        sc = F32(F32(1.0) / prod)
    if not np.isfinite(sc) or sc > FLT_MAX:
        sc = FLT_MAX
    return byte, sinv, sc


def f32hex(h):
    return np.frombuffer(bytes.fromhex(h), dtype="<f4")


def expected_globals(W, step):
    """Global amax arrays per quantizer for step `step` (uninterrupted run)."""
    vs = [values(r, W, step) for r in range(W)]
    n = 12 // W
    g = {}
    g["q.fp8_tensor"] = np.array(max(v["q.fp8_tensor"] for v in vs), dtype=F32)
    g["q.nvfp4_tensor"] = np.array(max(v["q.nvfp4_tensor"] for v in vs), dtype=F32)
    g["q.fp8_chan"] = np.concatenate([v["q.fp8_chan"] for v in vs]).astype(F32)
    g["q.nvfp4_blocks"] = np.concatenate([v["q.nvfp4_blocks"] for v in vs]).astype(F32)
    g["q.mxfp8"] = np.max([v["q.mxfp8"] for v in vs], axis=0).astype(F32)
    rm = np.zeros(12, dtype=F32)
    for s in range(1, step + 1):
        rm = np.maximum(rm, np.max([values(r, W, s)["q.fp8_chan_rm"] for r in range(W)], axis=0))
    g["q.fp8_chan_rm"] = rm
    ex = np.zeros(12, dtype=F32)
    has = np.zeros(12, dtype=bool)
    for r, v in enumerate(vs):
        ev, nd = v["q.experts"]
        ex[r * n:(r + 1) * n] = np.where(nd, 0, ev)
        has[r * n:(r + 1) * n] = ~nd
    M = ex[has].max()
    g["q.experts"] = np.where(has, ex, M).astype(F32)
    return g


def block_of(name, rank, W, arr):
    n = 12 // W
    if name in ("q.fp8_chan", "q.nvfp4_blocks", "q.experts"):
        return arr[rank * n:(rank + 1) * n]
    return arr


def check_reference(W, step, rank, res):
    """Mismatches of one rank's answer against the docs' formulas."""
    bad = []
    G = expected_globals(W, step)
    for name, garr in G.items():
        r = res.get(name)
        if r is None:
            bad.append(f"{name}: missing from the answer")
            continue
        blk = np.asarray(block_of(name, rank, W, garr), dtype=F32).reshape(-1)
        amax = f32hex(r["amax"])
        scale = f32hex(r["scale"])
        sinv = f32hex(r["scale_inv"])
        bs = np.frombuffer(bytes.fromhex(r["bs"]), dtype=np.uint8)
        ga, gs, gsi = f32hex(r["g"])
        gmax = F32(np.max(garr))
        if not np.array_equal(amax.view(np.uint32), blk.view(np.uint32)):
            bad.append(f"{name}: amax {amax.tolist()} != max over ranks {blk.tolist()}")
            continue
        if ga.view(np.uint32) != gmax.view(np.uint32):
            bad.append(f"{name}: global_amax {ga} != {gmax}")
        if name in ("q.fp8_tensor", "q.fp8_chan", "q.fp8_chan_rm", "q.experts"):
            for i, a in enumerate(blk):
                s, si = fp8_current(a)
                if scale[i] != s or sinv[i] != si:
                    bad.append(f"{name}[{i}]: scale/scale_inv {scale[i]!r}/{sinv[i]!r}, "
                               f"expected 448/amax={s!r}/{si!r}")
            s, si = fp8_current(gmax)
            if gs != s or gsi != si:
                bad.append(f"{name}: global scale {gs!r}/{gsi!r} expected {s!r}/{si!r}")
        elif name in ("q.nvfp4_tensor", "q.nvfp4_blocks"):
            senc, ginv = nvfp4_global(gmax)
            if gs != senc or gsi != ginv:
                bad.append(f"{name}: global_scale/inv {gs!r}/{gsi!r} expected {senc!r}/{ginv!r}")
            for i, a in enumerate(blk):
                byte, si, sc = nvfp4_cell(a, senc)
                if bs[i] != byte or sinv[i] != si or scale[i] != sc:
                    bad.append(f"{name}[{i}]: block byte/scale_inv/scale {bs[i]}/{sinv[i]!r}/"
                               f"{scale[i]!r} expected {byte}/{si!r}/{sc!r}")
        elif name == "q.mxfp8":
            for i, a in enumerate(blk):
                e = e8m0(F32(a) * F32(1.0 / 448.0))
                s, si = F32(2.0 ** (127 - e)), F32(2.0 ** (e - 127))
                if bs[i] != e or scale[i] != s or sinv[i] != si:
                    bad.append(f"{name}[{i}]: e/scale/scale_inv {bs[i]}/{scale[i]!r}/{sinv[i]!r}"
                               f" expected {e}/{s!r}/{si!r}")
    return bad


# --------------------------------------------------------------------------
# Running steps
# --------------------------------------------------------------------------
class JobRun:
    """One job on one or more daemons, steps orchestrated from here."""

    def __init__(self, root, job, W, socks, timeout=8.0):
        self.root, self.job, self.W = root, job, W
        self.socks = socks        # rank -> socket
        self.workers = [Worker(root, job, r, W, socks[r], timeout) for r in range(W)]
        self.answers = {}         # step -> [per-rank reconcile result]
        self.step = 0             # last completed step

    def setup(self, join_timeout=15.0):
        js = all_call(self.workers, "join", join_timeout + 3, timeout=join_timeout)
        rs = all_call(self.workers, "register", 10)
        return js, rs

    def run_step(self, step, rec_timeout=None, wait=20.0):
        ss = all_call(self.workers, "send", wait, step=step)
        # A rank that re-joined while its epoch was being reconciled is told
        # that epoch by Join, but SendAmax for it is refused ("already
        # reconciled or being reconciled"); its values are in already, and a
        # Reconcile of that epoch answers it. Go on with the Reconcile.
        inflight = [i for i, x in enumerate(ss) if not x["ok"] and x.get("code") ==
                    "FAILED_PRECONDITION" and "being reconciled" in x.get("msg", "")]
        if inflight:
            NOTES.append(f"job {self.job} step {step}: SendAmax for the epoch Join had just named "
                         f"was refused: {ss[inflight[0]]['msg'][:160]}")
        if not all(x["ok"] for x in ss):
            return ss, None
        rr = all_call(self.workers, "reconcile", wait, timeout=rec_timeout)
        if all(r["ok"] for r in rr):
            self.answers[step] = rr
            self.step = step
        return ss, rr

    def close(self):
        for w in self.workers:
            w.close()


class _Answers:
    def __init__(self, W, answers):
        self.W, self.answers = W, answers


def run_with(run, k, rr):
    return _Answers(run.W, {k: rr})


def control_diffs(run, control, steps, check_epochs=True):
    diffs = []
    for s in steps:
        a, c = run.answers.get(s), control.answers.get(s)
        if a is None or c is None:
            diffs.append(f"step {s}: no answer ({'run' if a is None else 'control'})")
            continue
        for r in range(run.W):
            if a[r]["canon"] != c[r]["canon"]:
                names = [n for n in a[r]["res"] if a[r]["res"][n] != c[r]["res"].get(n)]
                diffs.append(f"step {s} rank {r}: bytes differ (quantizers {names or 'prev/filled'})")
            elif check_epochs and a[r].get("raw") != c[r].get("raw"):
                diffs.append(f"step {s} rank {r}: raw ReconcilePackedResponse bytes differ")
            if check_epochs and (a[r]["epoch"], a[r]["next_epoch"]) != (c[r]["epoch"],
                                                                      c[r]["next_epoch"]):
                diffs.append(f"step {s} rank {r}: epoch {a[r]['epoch']}->{a[r]['next_epoch']} vs "
                             f"control {c[r]['epoch']}->{c[r]['next_epoch']}")
    return diffs


def compare_to_control(tag, run, control, steps, check_epochs=True, quiet=False):
    """Every rank's answer of each step byte-for-byte against the control run
    (packed ranks: also the raw ReconcilePackedResponse bytes)."""
    diffs = control_diffs(run, control, steps, check_epochs)
    if quiet and not diffs:
        return True
    return report(not diffs, f"{tag}: answers of steps {steps[0]}..{steps[-1]} equal the "
                  f"busy_poll=off control byte for byte", "; ".join(diffs[:6]))


def check_refs(tag, run, steps, quiet=False):
    bad = []
    for s in steps:
        if s not in run.answers:
            bad.append(f"step {s}: no answer")
            continue
        for r in range(run.W):
            for b in check_reference(run.W, s, r, run.answers[s][r]["res"]):
                bad.append(f"step {s} rank {r}: {b}")
    if quiet and not bad:
        return True
    return report(not bad, f"{tag}: steps {steps[0]}..{steps[-1]} match the docs' formulas "
                  "(amax = max over ranks/epochs/peer fill, FP8 448/amax, NVFP4, MXFP8)",
                  "; ".join(bad[:5]))


def recover(run, restarted_ranks, tag, deadline_s=25.0):
    """After a fault: reconnect the ranks of a restarted daemon, re-join all
    ranks (concurrently), re-register, and find the step to run next."""
    for r in restarted_ranks:
        run.workers[r].call("connect", 10, sock=run.socks[r])
    t_end = time.monotonic() + deadline_s
    js = None
    tries = 0
    while time.monotonic() < t_end:
        tries += 1
        js = all_call(run.workers, "join", 18, timeout=12.0)
        if all(j["ok"] for j in js):
            break
        info(f"{tag}: re-join try {tries}: " + "; ".join(brief(j) for j in js if not j["ok"]))
        for r, j in enumerate(js):
            if j.get("code") in ("HANG", "DEAD"):
                return None, js
        time.sleep(0.5)
    if not js or not all(j["ok"] for j in js):
        return None, js
    rs = all_call(run.workers, "register", 10)
    if not all(r["ok"] for r in rs):
        info(f"{tag}: register after re-join: " + "; ".join(brief(r) for r in rs))
    epochs = sorted({j["epoch"] for j in js})
    info(f"{tag}: re-joined: rejoined={[j['rejoined'] for j in js]} open epochs={[j['epoch'] for j in js]}")
    return epochs, js


def ensure_step_after_fault(run, step_tried, tag, rec_timeout, epochs):
    """The job's open epoch decides whether `step_tried` was reconciled
    (uninterrupted run: step k is epoch k)."""
    open_epoch = max(epochs)
    if len(epochs) > 1:
        report(False, f"{tag}: every rank re-joins at the same open epoch", f"open epochs {epochs}")
    if open_epoch == step_tried + 1:
        info(f"{tag}: step {step_tried} was reconciled before the fault (open epoch {open_epoch})")
        run.step = step_tried
        return step_tried + 1
    if open_epoch != step_tried:
        report(False, f"{tag}: open epoch after the fault is the step tried or the next",
               f"open epoch {open_epoch}, step tried {step_tried}")
    return step_tried


def run_steps_checked(run, first, last, tag, rec_timeout=None):
    for s in range(first, last + 1):
        ss, rr = run.run_step(s, rec_timeout=rec_timeout)
        if rr is None or not all(r["ok"] for r in rr):
            report(False, f"{tag}: step {s} completes",
                   "; ".join(brief(x) for x in (rr or ss) if not x["ok"]))
            return False
    return True


def controlled(results, limit, tag, allowed=("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED")):
    """Each call ended with an answer or a daemon error within `limit` seconds."""
    bad = []
    for i, r in enumerate(results):
        if r["ok"]:
            continue
        if r["code"] not in allowed:
            bad.append(f"rank {i}: {brief(r)}")
        elif r["code"] == "DEADLINE_EXCEEDED" and r.get("msg", "").strip() == "Deadline Exceeded" \
                and "client" not in tag:
            bad.append(f"rank {i}: only the client's own deadline fired ({r['elapsed']:.2f}s): "
                       "the daemon did not answer")
        if r.get("elapsed", 1e9) > limit:
            bad.append(f"rank {i}: took {r['elapsed']:.2f}s > {limit:.1f}s")
    return bad


# --------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------
def part5_bad_value(root):
    cases = [("flag", ["--busy-poll=sometimes"], None, None),
             ("config file", [], "busy_poll = sometimes\n", None),
             ("environment", [], None, {"AMAXD_BUSY_POLL": "sometimes"})]
    for tag, args, conf, env in cases:
        d = tempfile.mkdtemp(dir=root, prefix="bad-")
        sock = os.path.join(d, "s.sock")
        argv = [AMAXD, f"--socket={sock}", "--backend=host"] + args
        if conf:
            with open(os.path.join(d, "c.conf"), "w") as f:
                f.write(conf)
            argv.append(f"--config={os.path.join(d, 'c.conf')}")
        e = dict(os.environ)
        if env:
            e.update(env)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=10, env=e)
            out = (p.stdout + p.stderr).strip()
            ok = p.returncode != 0 and "busy_poll" in out and "sometimes" in out \
                and not os.path.exists(sock)
            report(ok, f"5. bad value busy_poll=sometimes ({tag}) stops the start naming the setting",
                   f"rc={p.returncode}, output: {out[-300:]!r}")
        except subprocess.TimeoutExpired:
            report(False, f"5. bad value ({tag}) stops the start", "amaxd still running after 10 s")


def part1_and_2(root, on, off):
    W, N = 3, 25
    res = {}
    # The setting is visible and in force
    st = on.status("")
    cfg = {c.name: c.value for c in st.config}
    log = open(on.log).read()
    report(cfg.get("busy_poll") == "on" and "busy polling around epochs" in log,
           "1. --busy-poll=on is taken (Status config busy_poll=on, log line)",
           f"config {cfg.get('busy_poll')!r}")
    cfg_off = {c.name: c.value for c in off.status("").config}
    report(cfg_off.get("busy_poll") == "off" and "busy polling" not in open(off.log).read(),
           "1. --busy-poll=off is taken", f"config {cfg_off.get('busy_poll')!r}")

    runs = {}
    cpu = {}
    for tag, d in (("on", on), ("off", off)):
        run = JobRun(root, f"p1-{tag}", W, [d.sock] * W)
        js, rs = run.setup()
        if not all(j["ok"] for j in js) or not all(r["ok"] for r in rs):
            report(False, f"1. job on busy_poll={tag} daemon joins and registers",
                   "; ".join(brief(x) for x in js + rs if not x["ok"]))
            return None
        # one warm-up step outside the measurement
        run.run_step(1)
        c0, n0, t0 = d.cpu(), cpu_ns(d.pid), time.monotonic()
        ok = run_steps_checked(run, 2, N, f"1. busy_poll={tag}")
        cpu[tag] = ((d.cpu() - c0) / (N - 1), (time.monotonic() - t0) / (N - 1),
                    (cpu_ns(d.pid) - n0) / 1e9 / (N - 1))
        runs[tag] = run
        if not ok:
            return None
    info(f"2. daemon CPU per epoch (W=3, 8 quantizers, {N-1} epochs): busy_poll=on "
         f"{cpu['on'][2]*1e3:.2f} ms by schedstat / {cpu['on'][0]*1e3:.2f} ms by /proc/stat ticks "
         f"(wall {cpu['on'][1]*1e3:.1f} ms/epoch); busy_poll=off {cpu['off'][2]*1e3:.2f} / "
         f"{cpu['off'][0]*1e3:.2f} ms (wall {cpu['off'][1]*1e3:.1f} ms/epoch)")
    compare_to_control("1. single daemon on vs off (W=3, 25 epochs)", runs["on"], runs["off"],
                       list(range(1, N + 1)))
    check_refs("1. busy_poll=on answers vs reference", runs["on"], list(range(1, N + 1)))
    check_refs("1. busy_poll=off answers vs reference", runs["off"], list(range(1, N + 1)))
    # 2. idle CPU after the epochs
    time.sleep(0.3)
    c0 = on.cpu()
    time.sleep(2.0)
    idle = on.cpu() - c0
    report(idle < 0.10, "2. idle busy_poll=on daemon takes no CPU after the epochs",
           f"{idle:.3f} CPU-s over 2 s")
    # 2b. a rank waiting in Reconcile for a late rank: nothing should spin
    waits = {}
    for tag, d in (("on", on), ("off", off)):
        run = runs[tag]
        s = N + 1
        all_call(run.workers, "send", 10, step=s)
        for w in run.workers[:2]:
            w.start("reconcile")
        time.sleep(0.3)
        c0 = d.cpu()
        time.sleep(2.0)
        waits[tag] = d.cpu() - c0
        w2 = run.workers[2]
        w2.start("reconcile")
        rr = [w.wait(15) for w in run.workers]
        if all(r["ok"] for r in rr):
            run.answers[s] = rr
        else:
            report(False, f"2. step {s} with a late rank completes ({tag})",
                   "; ".join(brief(r) for r in rr))
    info(f"2. CPU over 2 s while 2 of 3 ranks wait in Reconcile for the third: "
         f"on {waits['on']:.3f} s, off {waits['off']:.3f} s")
    report(waits["on"] < 0.15, "2. busy_poll=on: no spinning while ranks wait in Reconcile for a "
           "late rank", f"{waits['on']:.3f} CPU-s over 2 s")
    compare_to_control("1. step with a late rank, on vs off", runs["on"], runs["off"], [N + 1])
    check_refs("1. step with a late rank vs reference", runs["on"], [N + 1])
    time.sleep(0.3)
    c0 = on.cpu()
    time.sleep(2.0)
    idle = on.cpu() - c0
    report(idle < 0.10, "2. idle busy_poll=on daemon takes no CPU (second look)",
           f"{idle:.3f} CPU-s over 2 s")
    for r in runs.values():
        r.close()
    return cpu


def part1_multi(root, on, off):
    """Several jobs reconciling at once on one daemon: the loop polls for one
    job's end while others hand off theirs. Answers on vs off, stalls."""
    import hashlib
    import amaxd
    from amaxd import placement as P

    def run(d, tag, njobs, ncells, nsteps):
        W = 2
        lat, digests, errs = [], {}, []

        def rank(j, r):
            try:
                with amaxd.Client(f"mj{j}-{tag}", r, W, socket=d.sock, timeout=20) as c:
                    c.join()
                    c.register([
                        amaxd.Quantizer("big", [ncells], amaxd.Recipe.fp8_current(),
                                        P.shard([ncells], 0, r, W), accumulation=amaxd.PER_EPOCH),
                        amaxd.Quantizer("nv", [64], amaxd.Recipe.nvfp4()),
                        amaxd.Quantizer("d", [], amaxd.Recipe.fp8_delayed(history_len=3),
                                        accumulation=amaxd.PER_EPOCH)])
                    L = c.layout()
                    h = hashlib.sha256()
                    for s in range(nsteps):
                        rng = np.random.default_rng(s * 1000 + r * 10 + j)
                        c.send_packed((rng.random(L.total_cells, dtype=np.float32) * 10)
                                      .astype(np.float32))
                        if (s + j) % 3 == 0:
                            time.sleep(0.0005 * r)
                        t0 = time.monotonic()
                        res = c.reconcile_packed(timeout=20)
                        lat.append(time.monotonic() - t0)
                        h.update(bytes(res.raw))
                    digests[(j, r)] = h.hexdigest()
            except Exception as e:  # noqa: BLE001
                errs.append(f"job {j} rank {r}: {e!r}")
        ts = [threading.Thread(target=rank, args=(j, r), daemon=True)
              for j in range(njobs) for r in range(W)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        if any(t.is_alive() for t in ts):
            errs.append("a rank thread hangs after 120 s")
        return digests, np.array(lat) * 1e3, errs

    for njobs, ncells, nsteps in ((3, 2000, 120), (4, 200000, 25)):
        out, cpu = {}, {}
        for tag, d in (("on", on), ("off", off)):
            n0 = cpu_ns(d.pid)
            out[tag] = run(d, f"{tag}{ncells}", njobs, ncells, nsteps)
            cpu[tag] = (cpu_ns(d.pid) - n0) / 1e6 / (njobs * nsteps)
        (don, lon, eon), (doff, loff, eoff) = out["on"], out["off"]
        info(f"1. {njobs} concurrent jobs x 2 ranks x {ncells} cells, {nsteps} epochs: Reconcile "
             f"latency on p50 {np.median(lon):.2f} / max {lon.max():.1f} ms, off p50 "
             f"{np.median(loff):.2f} / max {loff.max():.1f} ms; daemon CPU per job-epoch on "
             f"{cpu['on']:.2f} ms, off {cpu['off']:.2f} ms")
        report(not eon and not eoff and don == doff and len(don) == 2 * njobs,
               f"1. {njobs} jobs reconciling at once ({ncells} cells): busy_poll=on answers equal "
               "busy_poll=off byte for byte", "; ".join((eon + eoff)[:3]))
        report(lon.max() < max(250.0, 5 * loff.max()),
               f"1. {njobs} concurrent jobs ({ncells} cells): no stalled epoch with busy_poll=on",
               f"max {lon.max():.1f} ms vs off {loff.max():.1f} ms")


def make_control(root, off, job, W, N):
    run = JobRun(root, job, W, [off.sock] * W)
    js, rs = run.setup()
    ok = all(j["ok"] for j in js) and all(r["ok"] for r in rs) and \
        run_steps_checked(run, 1, N, f"control {job}")
    run.close()
    if not ok:
        report(False, f"control run {job} completes")
    return run


def part3_faults(root, off):
    RT = 3.0     # reconcile_timeout_ms = 3000
    fdir = os.path.join(root, "fault")
    os.makedirs(fdir, exist_ok=True)
    state = os.path.join(fdir, "state")
    F = Daemon(root, "fault", ["--busy-poll=on", f"--state-dir={state}",
                               "--reconcile-timeout-ms=3000", "--join-timeout-ms=10000"])
    F.start()
    ctl = make_control(root, off, "ctl2", 2, 10)

    # ---- (a) a trainer killed while it waits in Reconcile
    run = JobRun(root, "fa", 2, [F.sock] * 2)
    run.setup()
    run_steps_checked(run, 1, 3, "3a")
    all_call(run.workers, "send", 10, step=4)
    run.workers[1].start("reconcile")
    time.sleep(0.5)
    try:
        waiting = F.status("fa").jobs[0].ranks_in_reconcile
    except Exception as e:  # noqa: BLE001
        waiting = f"status failed: {e}"
    run.workers[1].kill9()
    time.sleep(0.3)
    r0 = run.workers[0].call("reconcile", RT + 8)
    ok = (not r0["ok"] and r0["code"] in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "ABORTED")
          and r0["elapsed"] <= RT + 1.5 and r0["msg"].strip() != "Deadline Exceeded")
    report(ok, "3a. rank 1 killed -9 while waiting in Reconcile: rank 0 gets a daemon error "
           "within reconcile_timeout (3 s)",
           f"ranks waiting before the kill: {waiting}; rank 0: {brief(r0)}")
    # a fresh trainer for rank 1 continues the job
    run.workers[1] = Worker(root, "fa", 1, 2, F.sock)
    eps, js = recover(run, [], "3a")
    if eps is None:
        report(False, "3a. a fresh rank-1 trainer re-joins", "; ".join(brief(j) for j in js or []))
    else:
        report(js[1]["rejoined"], "3a. the fresh trainer's Join says rejoined=true",
               f"{js[1]}")
        nxt = ensure_step_after_fault(run, 4, "3a", RT, eps)
        if run_steps_checked(run, nxt, 6, "3a after the fresh trainer"):
            compare_to_control("3a. fresh trainer continues the job", run, ctl, list(range(1, 7)))
            check_refs("3a. after the kill", run, list(range(4, 7)))
    run.close()
    run2 = JobRun(root, "fa2", 2, [F.sock] * 2)
    js, rs = run2.setup()
    if all(j["ok"] for j in js) and run_steps_checked(run2, 1, 3, "3a new job"):
        compare_to_control("3a. a new job after the kill works", run2, ctl, [1, 2, 3])
    run2.close()

    # ---- (b) SIGSTOP of the daemon during an epoch
    for variant in ("waiting", "racing1", "racing2", "racing3"):
        job = f"fb-{variant}"
        run = JobRun(root, job, 2, [F.sock] * 2)
        run.setup()
        run_steps_checked(run, 1, 2, f"3b {variant}")
        s = 3
        if variant == "waiting":
            all_call(run.workers, "send", 10, step=s)
            run.workers[0].start("reconcile", timeout=10.0)
            time.sleep(0.3)
            os.kill(F.pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            run.workers[1].start("reconcile", timeout=2.0)
        else:
            for w in run.workers:
                w.start("step", step=s, timeout=2.0)
            delay = random.uniform(0.0, 0.004)
            time.sleep(delay)
            os.kill(F.pid, signal.SIGSTOP)
            info(f"3b {variant}: SIGSTOP {delay*1e3:.1f} ms after the step started")
            t_stop = time.monotonic()
        time.sleep(3.5)
        os.kill(F.pid, signal.SIGCONT)
        rr = [w.wait(15) for w in run.workers]
        bad = []
        for i, r in enumerate(rr):
            if r["ok"]:
                continue
            if r["code"] not in ("DEADLINE_EXCEEDED", "UNAVAILABLE", "ABORTED", "CANCELLED"):
                bad.append(f"rank {i}: {brief(r)}")
            # waiting: rank 0's Reconcile has a 10 s client deadline, rank 1's 2 s; racing: the
            # send may wait out the stop (3.5 s), then the Reconcile has 2 s
            lim = 10.0 if (variant == "waiting" and i == 0) else \
                (2.0 if variant == "waiting" else 3.5 + 2.0)
            if r["elapsed"] > lim + 1.5:
                bad.append(f"rank {i}: {r['elapsed']:.2f}s past its {lim}s timeout")
        report(not bad, f"3b. SIGSTOP {variant} for 3.5 s: each client completes or times out "
               "cleanly", "; ".join(bad) + " | " + "; ".join(f"rank {i}: {brief(r)}"
                                                          for i, r in enumerate(rr)))
        ok_run = True
        if all(r["ok"] for r in rr):
            run.answers[s] = rr
            nxt = s + 1
        else:
            # a trainer's loop: re-join, run the step of the open epoch; a SendAmax
            # refused because that epoch is being reconciled right now: re-join again
            for attempt in range(6):
                eps, js = recover(run, [], f"3b {variant}")
                if eps is None:
                    report(False, f"3b {variant}: ranks re-join after SIGCONT",
                           "; ".join(brief(j) for j in js or []))
                    ok_run = False
                    break
                nxt = ensure_step_after_fault(run, s, f"3b {variant}", RT, eps)
                ss, r2 = run.run_step(nxt)
                if r2 is not None and all(x["ok"] for x in r2):
                    nxt += 1
                    break
                info(f"3b {variant}: step {nxt} after re-join: " +
                     "; ".join(brief(x) for x in (r2 or ss) if not x["ok"]))
                time.sleep(0.2)
            else:
                ok_run = False
                report(False, f"3b {variant}: an epoch completes after SIGCONT", "6 tries")
        if not ok_run:
            run.close()
            continue
        if run_steps_checked(run, nxt, 5, f"3b {variant} after SIGCONT"):
            steps = [x for x in range(1, 6) if x in run.answers]
            compare_to_control(f"3b {variant}. epochs after SIGCONT", run, ctl, steps)
            check_refs(f"3b {variant}. after SIGCONT", run, [x for x in steps if x >= 3])
        run.close()
        time.sleep(0.3)
        c0 = F.cpu()
        time.sleep(2.0)
        idle = F.cpu() - c0
        report(idle < 0.10, f"3b {variant}. idle busy_poll daemon after SIGSTOP/SIGCONT takes no CPU",
               f"{idle:.3f} CPU-s over 2 s")

    # ---- (c) kill -9 of the daemon, restart with its state_dir
    run = JobRun(root, "fc", 2, [F.sock] * 2)
    run.setup()
    run_steps_checked(run, 1, 3, "3c")
    all_call(run.workers, "send", 10, step=4)
    run.workers[0].start("reconcile", timeout=10.0)
    time.sleep(0.3)
    F.kill9()
    r0 = run.workers[0].wait(15)
    report((not r0["ok"]) and r0["code"] in ("UNAVAILABLE", "ABORTED") and r0["elapsed"] < 3.0,
           "3c. daemon killed -9: the rank waiting in Reconcile gets UNAVAILABLE at once",
           brief(r0))
    F.start()
    eps, js = recover(run, [0, 1], "3c")
    if eps is None:
        report(False, "3c. ranks re-join the restarted daemon", "; ".join(brief(j) for j in js or []))
    else:
        report(all(j["rejoined"] for j in js) and eps == [4],
               "3c. restarted daemon restores the job from state_dir (rejoined, open epoch 4)",
               f"{js}")
        gs = all_call(run.workers, "getscales", 10)
        same = []
        for r in range(2):
            if not gs[r]["ok"]:
                same.append(f"rank {r}: {brief(gs[r])}")
                continue
            # the step-3 answer without the peer_filled field (not known after a restore)
            import amaxd  # noqa: F401
            ref = run.answers[3][r]["canon"]
            if gs[r]["canon_nofill"] != strip_filled(ref):
                same.append(f"rank {r}: GetScales after restart differs from the step-3 answer")
        report(not same, "3c. GetScales after the restart answers the last reconciled epoch as "
               "before the kill", "; ".join(same))
        nxt = ensure_step_after_fault(run, 4, "3c", RT, eps)
        if run_steps_checked(run, nxt, 6, "3c after restart"):
            compare_to_control("3c. epochs after kill -9 and restart", run, ctl, list(range(1, 7)))
            check_refs("3c. after restart", run, [4, 5, 6])
    run.close()
    c0 = F.cpu()
    time.sleep(2.0)
    idle = F.cpu() - c0
    report(idle < 0.10, "3c. idle restarted busy_poll daemon takes no CPU", f"{idle:.3f} CPU-s over 2 s")
    F.stop()


def strip_filled(canon_hex):
    """canon() bytes without the F... peer_filled fields (recomputed by parsing)."""
    b = bytes.fromhex(canon_hex)
    out = bytearray()
    i = 0
    while i < len(b):
        j = b.index(b"\0", i)
        name = b[i:j].decode()
        out += b[i:j + 1]
        i = j + 1
        dims = struct.unpack_from("<8I", b, i)
        out += b[i:i + 32]
        i += 32
        shape = [d for d in dims[4:] if d]
        n = int(np.prod(shape)) if shape else 1
        out += b[i:i + 13 * n + 16]
        i += 13 * n + 16
        assert b[i:i + 1] == b"F", name
        i += 1
        if b[i:i + 1] == b"-":
            i += 1
        else:
            i += n
        if b[i:i + 2] == b"P-":
            out += b[i:i + 2]
            i += 2
        else:
            out += b[i:i + 9]
            i += 9
    return bytes(out).hex()


def part4_cluster(root, off):
    W = 4
    RT = 4.0
    ctl = make_control(root, off, "ctl4", W, 10)
    secret = os.path.join(root, "cluster.secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(24).hex().encode())
    os.chmod(secret, 0o600)
    pa, pb = free_port(), free_port()
    common = ["--busy-poll=on", "--cluster-size=2", f"--coordinator=127.0.0.1:{pa}",
              f"--cluster-secret-file={secret}", "--gloo-host=127.0.0.1", "--collective=gloo",
              "--reconcile-timeout-ms=4000", "--join-timeout-ms=10000"]
    A = Daemon(root, "clA", common + ["--cluster-rank=0", f"--peer-listen=127.0.0.1:{pa}",
                                      f"--peer-advertise=127.0.0.1:{pa}",
                                      f"--state-dir={os.path.join(root, 'clA', 'state')}"])
    B = Daemon(root, "clB", common + ["--cluster-rank=1", f"--peer-listen=127.0.0.1:{pb}",
                                      f"--peer-advertise=127.0.0.1:{pb}",
                                      f"--state-dir={os.path.join(root, 'clB', 'state')}"])
    A.start()
    B.start()
    socks = [A.sock, A.sock, B.sock, B.sock]
    run = JobRun(root, "cl", W, socks)
    js, rs = run.setup()
    if not all(j["ok"] for j in js + rs):
        report(False, "4. cluster job joins and registers", "; ".join(brief(x) for x in js + rs))
        return
    st = A.status("cl").jobs
    info(f"4. cluster job on daemon A: participants={st[0].participants if st else '?'} "
         f"collective={st[0].collective if st else '?'} local_ranks={st[0].local_ranks if st else '?'}")
    run.run_step(1)
    ca, cb, t0 = A.cpu(), B.cpu(), time.monotonic()
    if not run_steps_checked(run, 2, 6, "4. cluster"):
        return
    info(f"4. cluster CPU per epoch (busy_poll=on, Gloo): A {(A.cpu()-ca)/5*1e3:.1f} ms, "
         f"B {(B.cpu()-cb)/5*1e3:.1f} ms, wall {(time.monotonic()-t0)/5*1e3:.1f} ms/epoch")
    compare_to_control("4. cluster of 2 busy_poll=on daemons vs single busy_poll=off daemon",
                       run, ctl, list(range(1, 7)))
    check_refs("4. cluster answers vs reference", run, list(range(1, 7)))

    # ranks of A waiting for a late rank of B: A's epoch is under way; does anything spin?
    s = 7
    all_call(run.workers, "send", 10, step=s)
    for w in run.workers[:3]:
        w.start("reconcile")
    time.sleep(0.3)
    ca, cb = A.cpu(), B.cpu()
    time.sleep(2.0)
    da, db = A.cpu() - ca, B.cpu() - cb
    run.workers[3].start("reconcile")
    rr = [w.wait(15) for w in run.workers]
    if all(r["ok"] for r in rr):
        run.answers[s] = rr
    report(all(r["ok"] for r in rr), "4. step with B's rank 3 late by 2.3 s completes",
           "; ".join(brief(r) for r in rr if not r["ok"]))
    report(da < 0.3 and db < 0.3, "4. no spinning while daemon A's epoch waits 2 s for daemon B",
           f"A {da:.3f} CPU-s, B {db:.3f} CPU-s over 2 s")
    time.sleep(0.3)
    ca, cb = A.cpu(), B.cpu()
    time.sleep(2.0)
    da, db = A.cpu() - ca, B.cpu() - cb
    report(da < 0.15 and db < 0.15, "4. idle cluster daemons take no CPU",
           f"A {da:.3f}, B {db:.3f} CPU-s over 2 s")

    drop_job(run)
    scenarios = [("B (non-coordinator)", B, [2, 3], "waiting"),
                 ("B (non-coordinator)", B, [2, 3], "racing1"),
                 ("B (non-coordinator)", B, [2, 3], "racing2"),
                 ("A (coordinator)", A, [0, 1], "waiting"),
                 ("A (coordinator)", A, [0, 1], "racing1"),
                 ("A (coordinator)", A, [0, 1], "racing2"),
                 ("B (non-coordinator)", B, [2, 3], "sigstop")]
    # the coordinator killed right after a collective, repeated: the window
    # in which B has answered epoch k but A has not written its snapshot
    NTRIALS = 24
    scenarios += [("A (coordinator)", A, [0, 1], f"after-collective{i}") for i in range(NTRIALS)]
    n_mixed = 0
    mixed_details = []
    for n, (label, D, dranks, variant) in enumerate(scenarios):
        tag = f"4. kill -9 {label} {variant}"
        quiet = variant.startswith("after-collective")
        run = JobRun(root, f"cl-s{n}", W, socks)
        js, rs = run.setup()
        if not all(j["ok"] for j in js + rs) or not run_steps_checked(run, 1, 2, tag + " warm-up"):
            report(False, f"{tag}: a fresh job on the cluster runs",
                   "; ".join(brief(x) for x in js + rs if not x["ok"]))
            run.close()
            break
        step = 3
        if variant == "waiting":
            all_call(run.workers, "send", 10, step=step)
            late = 3 if D is A else 1      # the late rank lives on the surviving daemon
            for i, w in enumerate(run.workers):
                if i != late:
                    w.start("reconcile")
            time.sleep(0.4)
            D.kill9()
            run.workers[late].start("reconcile")
        elif variant == "sigstop":
            tag = f"4. SIGSTOP {label} for 5 s (> reconcile_timeout) during an epoch"
            all_call(run.workers, "send", 10, step=step)
            for i, w in enumerate(run.workers):
                if i != 3:
                    w.start("reconcile")
            time.sleep(0.3)
            os.kill(D.pid, signal.SIGSTOP)
            run.workers[3].start("reconcile")
            time.sleep(5.0)
            os.kill(D.pid, signal.SIGCONT)
        else:
            for w in run.workers:
                w.start("step", step=step)
            delay = random.uniform(0.0035, 0.008) if quiet else random.uniform(0.0, 0.012)
            time.sleep(delay)
            D.kill9()
            if not quiet:
                info(f"{tag}: kill {delay*1e3:.1f} ms after the step started")
        rr = [w.wait(RT + 8) for w in run.workers]
        if variant == "sigstop":
            bad = controlled([r for i, r in enumerate(rr) if i not in dranks], RT + 2.0, tag) + \
                controlled([r for i, r in enumerate(rr) if i in dranks], 5.3 + 8.0 + 1.0,
                           tag + " client")
        else:
            bad = controlled(rr, RT + 2.0, tag)
        names = []
        for i, r in enumerate(rr):
            if not r["ok"] and i not in dranks and "daemon" not in r.get("msg", ""):
                names.append(f"rank {i}: error does not name the dead daemon: {r.get('msg', '')[:160]}")
        if not quiet or bad:
            report(not bad, f"{tag}: every trainer call ends with an answer or a daemon error "
                   "within reconcile_timeout", "; ".join(bad) + " | " +
                   "; ".join(f"r{i}: {brief(r)}" for i, r in enumerate(rr)))
        if names:
            report(False, f"{tag}: errors of surviving ranks name the dead daemon", "; ".join(names))
        if all(r["ok"] for r in rr):
            run.answers[step] = rr
        if variant != "sigstop":
            D.start()
        t_up = time.monotonic()
        for i, w in enumerate(run.workers):
            w.start("recover", sock=run.socks[i] if (i in dranks and variant != "sigstop")
                    else None, deadline=40.0, join_timeout=13.0, rec_timeout=None)
        rr = [w.wait(55) for w in run.workers]
        t_done = time.monotonic() - t_up
        bad, seen = [], []
        for i, r in enumerate(rr):
            for e in r.get("errors", []):
                lim = {"join": 10.0, "reconcile": RT}.get(e["call"], 8.0) + 2.0
                seen.append(f"r{i} {e['call']}: {e['code']} {e['msg'][:140]} ({e['elapsed']:.2f}s)")
                if e["code"] not in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED",
                                     "FAILED_PRECONDITION") or e["elapsed"] > lim \
                        or e["msg"].strip() == "Deadline Exceeded":
                    bad.append(f"r{i} {e['call']}: {e['code']} {e['msg'][:200]} "
                               f"({e['elapsed']:.2f}s, bound {lim:.0f}s)")
            if not r["ok"]:
                bad.append(f"r{i}: {brief(r)}")
        if seen and not quiet:
            info(f"{tag}: errors during recovery: " + " | ".join(seen[:6]))
        if not quiet or bad:
            report(not bad, f"{tag}: after the restart every rank's retry loop (Join, Register, "
                   "send, Reconcile) reaches a good epoch; each failed call ends with a daemon "
                   "error in time", "; ".join(bad[:6]))
        if not all(r["ok"] for r in rr):
            drop_job(run)
            run.close()
            continue
        joins = [r["join"]["epoch"] for r in rr]
        ans = [r["epoch"] for r in rr]
        k = max(ans)
        mixed = len(set(joins)) > 1
        if mixed:
            n_mixed += 1
            dr = dranks[0]
            got = f32hex(rr[dr]["res"]["q.fp8_chan"]["amax"]).tolist()
            diffs = control_diffs(run_with(run, k, rr), ctl, [k])
            (mixed_details.append if quiet else (lambda d: report(False, f"{tag}: every rank "
             "re-joins at the job's open epoch and the next epoch holds only that epoch's data",
                                                                  d)))(
                   f"killed during epoch {step}; re-join open epochs {joins} (the restarted "
                   f"daemon's ranks {dranks} one behind: its snapshot had not reached epoch "
                   f"{step}); answers for epochs {ans} (a named rank shows the epoch it asked "
                   f"for); in epoch {k} rank {dr}'s q.fp8_chan cells read {got}: its step-{step} "
                   f"values {values(dr, W, step)['q.fp8_chan'].tolist()} sent again for the epoch "
                   f"Join named, not its step-{step + 1} values "
                   f"{values(dr, W, step + 1)['q.fp8_chan'].tolist()}; vs the uninterrupted "
                   f"control: {'; '.join(diffs[:3])}")
        elif not quiet or k not in (step, step + 1):
            report(k in (step, step + 1), f"{tag}: the first epoch after the restart is the same "
                   "epoch on every rank (the step killed, or the next if it had completed)",
                   f"answers' epochs {ans}, re-join open epochs {joins}, killed step {step}")
        if not quiet:
            info(f"{tag}: first good epoch (epoch {k}) {t_done:.2f}s after the restart began")
        run.answers[k] = rr
        run.step = k
        ok_next = run_steps_checked(run, k + 1, k + 1, tag + " next epoch")
        if ok_next and not mixed:
            steps = sorted(x for x in run.answers if x >= step - 1)
            compare_to_control(f"{tag}: epochs after restart", run, ctl, steps, quiet=quiet)
            check_refs(f"{tag}: after restart", run, steps, quiet=quiet)
        drop_job(run)
        run.close()
    report(not mixed_details, f"4. coordinator killed 3.5-8 ms into an epoch, {NTRIALS} trials: "
           "every rank re-joins at the job's open epoch and the next epoch holds only that "
           "epoch's data (the bytes of an uninterrupted run)",
           f"{len(mixed_details)} of {NTRIALS} trials hit the window; first: "
           f"{mixed_details[0] if mixed_details else ''}")
    time.sleep(0.3)
    ca, cb = A.cpu(), B.cpu()
    time.sleep(2.0)
    report(A.cpu() - ca < 0.15 and B.cpu() - cb < 0.15,
           "4. idle cluster daemons take no CPU after the restarts",
           f"A {A.cpu() - ca:.3f}, B {B.cpu() - cb:.3f} CPU-s over 2 s")
    A.stop()
    B.stop()


def drop_job(run):
    r = run.workers[0].call("drop", 10)
    if not r["ok"]:
        info(f"drop of job {run.job}: {brief(r)}")


def cleanup():
    for p in PROCS:
        try:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except OSError:
                    pass
                p.kill()
                p.wait(5)
        except Exception:
            pass


def main():
    t_start = time.monotonic()
    root = tempfile.mkdtemp(prefix="amaxd-busy-poll-check-")
    print(f"INFO: work dir {root}", flush=True)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("overall 12 min")))
    signal.alarm(12 * 60)
    try:
        part5_bad_value(root)
        on = Daemon(root, "on", ["--busy-poll=on"]).start()
        off = Daemon(root, "off", ["--busy-poll=off"]).start()
        part1_and_2(root, on, off)
        part1_multi(root, on, off)
        time.sleep(0.3)
        c0 = on.cpu()
        time.sleep(2.0)
        report(on.cpu() - c0 < 0.10, "2. idle busy_poll=on daemon takes no CPU after concurrent jobs",
               f"{on.cpu() - c0:.3f} CPU-s over 2 s")
        auto = Daemon(root, "auto", ["--busy-poll=auto"]).start()
        time.sleep(0.2)
        report("busy polling around epochs" not in open(auto.log).read()
               and (os.cpu_count() or 1) < 8,
               f"auto on a {os.cpu_count()}-CPU host leaves busy polling off (no log line)")
        auto.stop()
        on.stop()
        part3_faults(root, off)
        part4_cluster(root, off)
        off.stop()
        for d, name in ((on, "on"), (off, "off")):
            report(d.p.returncode == 0, f"daemon '{name}' exits 0 on SIGTERM", f"rc={d.p.returncode}")
    except BaseException as e:  # noqa: BLE001
        report(False, "check script ran to the end", f"{type(e).__name__}: {e}\n"
               + traceback.format_exc())
    finally:
        signal.alarm(0)
        cleanup()
    for n in sorted(set(NOTES)):
        print(f"NOTE: {n}")
    print(f"INFO: {PASSES} passed, {len(FAILS)} failed, {time.monotonic() - t_start:.0f}s; "
          f"logs under {root}")
    print(f"overall: {len(FAILS)} failed")
    return 1 if FAILS else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
