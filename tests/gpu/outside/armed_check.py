#!/usr/bin/env python3
"""Independent outside check of amaxd's *armed epochs* (docs/API.md "Device
buffers (GPU-direct)", "The doorbell", "Signals and the asynchronous
variant", "Armed epochs"), written from those sections and the public
Python client's call signatures only: not from the daemon's code or the
project's tests. Its own model: a catalog of 300 per-tensor FP8 quantizers
and 4 per-channel ones (no placement), RUNNING_MAX over epochs, elementwise
max over ranks, FP8 E4M3 current scaling s = 448/amax (amax 0 -> 1),
scale_inv = 1/s (docs/NUMERICS.md table); and a reference: the packed path
(send_packed + reconcile_packed) of a second job fed the same values,
whose answer bytes the device answer must equal.

Needs: 2 NVIDIA GPUs (1 for everything but check 4d), torch with CUDA,
numpy, grpcio, the amaxd client (with CuPy or cuda-bindings), AMAXD_BIN =
the CUDA build of amaxd. Prints PASS/FAIL lines; exit 0 all passed, 1 on
any FAIL, 3 on a HANG (a step over STEP_LIMIT s, or the whole run over
TOTAL_LIMIT s).

  python3 armed_check.py                  # the GPU check (--backend cuda)
  python3 armed_check.py --only 1,2,4d    # a subset: 1 2 3 4a 4b 4c 4d 5 5d
  python3 armed_check.py --backend host   # CPU smoke of the model and the raw doorbell
"""
import array
import atexit
import fcntl
import mmap
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib

import numpy as np

import amaxd
from amaxd import device as dv
from amaxd import errors as E

NPT = 300                                # per-tensor FP8 quantizers
PC_SHAPES = ([64], [128], [256], [8, 16])  # per-channel (whole tensor on every rank)
FP8_MAX = np.float32(448.0)
MAGIC = 0x31424441
D0_RECONCILE_MS = 6000                   # the single daemon's reconcile_timeout_ms
ARMED_PAUSE_S = 7.0                      # > D0_RECONCILE_MS: an armed epoch has no deadline before its flag
STEP_LIMIT = 60.0
TOTAL_LIMIT = 178.0
SLEEP_CYCLES = 40_000_000                # ~20 ms GPU sleep before some slab writes (ordering)
CALL_TMO = 20.0

# Every array of the device answer, compared byte for byte with ReconcilePacked's.
KEYS = ("amax", "scale", "scale_inv", "block_scales", "global_amax", "global_scale",
        "global_scale_inv", "global_amaxes", "global_scales", "global_scale_invs", "missing",
        "has_previous", "previous_global_amax", "previous_global_scale")
MODEL_KEYS = ("amax", "scale", "scale_inv", "global_amax", "global_scale", "global_scale_inv")

FAILS = []
PROCS = []
T = None          # torch, once loaded
BIN = os.environ.get("AMAXD_BIN", "amaxd")


def report(ok, name, detail=""):
    detail = str(detail)
    if len(detail) > 900:
        detail = detail[:900] + " ..."
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILS.append(name)


def info(text):
    print(f"INFO {text}", flush=True)


def exc_text(e):
    if isinstance(e, E.AmaxdError):
        return f"{type(e).__name__}: {e.message[:300]}"
    return f"{type(e).__name__}: {str(e)[:300]}"


# ---------------------------------------------------------------- watchdog
class Watchdog:
    def __init__(self):
        self.name, self.t0, self.start, self.active = "start", time.monotonic(), time.monotonic(), True
        threading.Thread(target=self._run, daemon=True).start()

    def step(self, name):
        self.name, self.t0 = name, time.monotonic()

    def _run(self):
        while True:
            time.sleep(0.25)
            if not self.active:
                continue
            now = time.monotonic()
            why = None
            if now - self.t0 > STEP_LIMIT:
                why = f"step '{self.name}' over {STEP_LIMIT:.0f} s"
            elif now - self.start > TOTAL_LIMIT:
                why = f"whole run over {TOTAL_LIMIT:.0f} s (in step '{self.name}')"
            if why:
                print(f"HANG {why}", flush=True)
                print(f"{'FAIL' if FAILS else 'PASS'} so far: {len(FAILS)} failed {FAILS}", flush=True)
                cleanup()
                os._exit(3)


WD = None


def step(name):
    if WD is not None:
        WD.step(name)


# ---------------------------------------------------------------- processes
def own_children():
    """pids of this process's live children (daemons started by helpers whose
    handle was lost, e.g. a start_daemons() that failed half way)."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            if int(st[st.rindex(")") + 2:].split()[1]) == me:
                out.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out


def cleanup():
    for pid in own_children():
        if not any(p.pid == pid for p in PROCS):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for p in list(PROCS):
        try:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        except Exception:
            pass


atexit.register(cleanup)


def start_d0(backend):
    """The single daemon of checks 1-5 (and of every packed reference)."""
    d = tempfile.mkdtemp(prefix="amaxd-armchk-")
    sock = os.path.join(d, "s.sock")
    logp = os.path.join(d, "amaxd.log")
    log = open(logp, "w")
    args = [BIN, f"--socket={sock}", f"--backend={backend}", "--log-level=info",
            f"--reconcile-timeout-ms={D0_RECONCILE_MS}"]
    if backend == "cuda":
        args.append("--cuda-device=0")
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    PROCS.append(p)
    end = time.monotonic() + 30
    while not (os.path.exists(sock) and os.path.exists(sock + ".door")):
        if p.poll() is not None or time.monotonic() > end:
            log.flush()
            print(open(logp).read()[-3000:], flush=True)
            raise RuntimeError(f"amaxd did not start (rc {p.poll()})")
        time.sleep(0.05)
    return p, sock, logp


def read_log(path, start=0):
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def log_size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def wait_log(path, start, rx, limit):
    """The first line of the log (from byte `start`) matching rx, waiting up to limit s."""
    end = time.monotonic() + limit
    while True:
        for line in read_log(path, start).splitlines():
            if rx.search(line):
                return line.strip()
        if time.monotonic() > end:
            return None
        time.sleep(0.1)


def repo_root():
    cands = [os.environ.get("AMAXD_REPO")]
    try:
        cands.append(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.dirname(os.path.abspath(amaxd.__file__))))))
    except Exception:
        pass
    b = os.path.abspath(BIN) if os.path.sep in BIN else None
    while b and os.path.dirname(b) != b:
        b = os.path.dirname(b)
        cands.append(b)
    for c in cands:
        if c and os.path.exists(os.path.join(c, "bench", "trainer_latency.py")):
            return c
    return None


class _Own:
    """A cluster daemon started here (used when bench/trainer_latency.py is not importable)."""

    def __init__(self, args, d):
        self.dir = d
        self.socket = os.path.join(d, "s.sock")
        self.log_path = os.path.join(d, "amaxd.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([BIN, f"--socket={self.socket}", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        PROCS.append(self.proc)
        end = time.monotonic() + 30
        while not os.path.exists(self.socket + ".door"):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"cluster daemon did not start: {self.log()[-2000:]}")
            time.sleep(0.05)

    def log(self):
        self._log.flush()
        return read_log(self.log_path)


def start_cluster(n):
    """n daemons on GPUs 0..n-1, NCCL between them: bench/trainer_latency.py's
    start_daemons() when importable, else the same flags here."""
    tmp = tempfile.mkdtemp(prefix="amaxd-armchk-cl-")
    root = repo_root()
    if root is not None:
        try:
            sys.path.insert(0, os.path.join(root, "bench"))
            import trainer_latency as TL
            ds = TL.start_daemons(BIN, n, tmp)
            for d in ds:
                PROCS.append(d.proc)
            return ds, "bench/trainer_latency.start_daemons"
        except Exception as e:
            info(f"start_daemons from {root}/bench not usable ({exc_text(e)}): starting the cluster here")
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    secret = os.path.join(tmp, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(24).hex().encode())
    os.chmod(secret, 0o600)
    ds = []
    for i in range(n):
        d = os.path.join(tmp, f"d{i}")
        os.makedirs(d)
        ds.append(_Own(["--backend=cuda", f"--cuda-device={i}", "--log-level=info",
                        "--reconcile-timeout-ms=600000", f"--cluster-size={n}",
                        f"--cluster-rank={i}", f"--coordinator=127.0.0.1:{ports[0]}",
                        f"--peer-listen=127.0.0.1:{ports[i]}",
                        f"--peer-advertise=127.0.0.1:{ports[i]}",
                        f"--cluster-secret-file={secret}", "--collective=nccl"], d))
    return ds, "started here"


# ---------------------------------------------------------------- model
def catalog():
    qs = [amaxd.Quantizer(f"pt.{i:04d}", [], amaxd.Recipe.fp8_current()) for i in range(NPT)]
    qs += [amaxd.Quantizer(f"pc.{j}", list(s), amaxd.Recipe.fp8_current())
           for j, s in enumerate(PC_SHAPES)]
    return qs


def vals(tag, epoch, rank, n, scale=None):
    """Deterministic positive float32 values: log-uniform 1e-2..1e2, times
    1.5**epoch (so most cells raise the running max every epoch: a stale
    answer cannot pass), or times `scale` (values that dominate)."""
    rng = np.random.default_rng([zlib.crc32(tag.encode()), epoch, rank])
    v = np.power(10.0, rng.uniform(-2.0, 2.0, n))
    if scale is None:
        v = v * (1.5 ** epoch)
    else:
        v = scale * (1.0 + rng.uniform(0.0, 1.0, n))
    return v.astype(np.float32)


def fp8_scale(a):
    a = np.asarray(a, dtype=np.float32)
    pos = a > 0
    with np.errstate(divide="ignore", over="ignore"):
        s = np.where(pos, FP8_MAX / np.where(pos, a, np.float32(1)), np.float32(1)).astype(np.float32)
    return s, (np.float32(1) / s).astype(np.float32)


def model(L, amax):
    """amax per cell (running max over epochs, max over ranks; 0 = no data)
    -> the arrays the docs promise for FP8 current scaling."""
    amax = np.asarray(amax, dtype=np.float32)
    sc, si = fp8_scale(amax)
    offs = np.asarray(L.offsets, dtype=np.int64)
    nc = np.asarray(L.ncells, dtype=np.int64)
    g = np.array([amax[o:o + k].max() if k else 0.0 for o, k in zip(offs, nc)], dtype=np.float32)
    gs, gsi = fp8_scale(g)
    return {"amax": amax, "scale": sc, "scale_inv": si, "global_amax": g, "global_scale": gs,
            "global_scale_inv": gsi}


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def diff(got, want, keys, label):
    """'' when every array of keys has the same bytes, else the first difference."""
    for k in keys:
        if k not in want:
            continue
        if got is None or k not in got:
            return f"{label}: the answer has no '{k}'"
        g = np.ascontiguousarray(got[k]).reshape(-1)
        w = np.ascontiguousarray(want[k]).reshape(-1)
        if g.dtype.itemsize != w.dtype.itemsize or g.shape != w.shape:
            return f"{label} {k}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        gu, wu = g.view(_UINT[g.dtype.itemsize]), w.view(_UINT[w.dtype.itemsize])
        if not np.array_equal(gu, wu):
            bad = np.nonzero(gu != wu)[0]
            i = int(bad[0])
            return (f"{label} {k}: {len(bad)} of {g.size} differ, first [{i}] got {g[i]!r} "
                    f"want {w[i]!r}")
    return ""


# ---------------------------------------------------------------- threads
def run_threads(fns, limit):
    """Runs each fn in a thread; [(result, exception)] ; a thread still
    running after `limit` s gives a RuntimeError (it is left behind, daemonic)."""
    out = [(None, RuntimeError(f"thread did not finish within {limit:.0f} s"))] * len(fns)
    out = list(out)

    def wrap(i, fn):
        try:
            out[i] = (fn(), None)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            out[i] = (None, e)
    ts = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in ts:
        t.start()
    end = time.monotonic() + limit
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    return out


# ---------------------------------------------------------------- the packed reference
def run_reference(sock, job, world, epochs, limit=50.0):
    """epochs: [[values of rank r or None (sends nothing)] per epoch]. The
    answers of the packed path: [epoch][rank] {key: numpy array}."""
    out = [[None] * world for _ in epochs]

    def rank_fn(r):
        c = amaxd.Client(job, r, world, socket=sock, timeout=30)
        try:
            c.join(timeout=30)
            c.register(catalog())
            for i, ep in enumerate(epochs):
                if ep[r] is not None:
                    c.send_packed(ep[r])
                pr = c.reconcile_packed(timeout=30)
                out[i][r] = {k: np.array(getattr(pr, k)) for k in KEYS}
                out[i][r]["_epoch"] = pr.epoch
        finally:
            c.close()
    res = run_threads([lambda r=r: rank_fn(r) for r in range(world)], limit)
    for _, e in res:
        if e is not None:
            raise e
    return out


def verify(tag, sock, world, L, seq, answers, groups):
    """seq: the epochs the device job reconciled, [[values or None] per rank];
    answers: [epoch][rank] the device answer as numpy (None: not read).
    Compares every device answer with the packed reference's bytes (all 14
    arrays) and with the numpy model (6 arrays), and the packed path with
    the model; one report line per group (name, [epoch indexes])."""
    step(f"{tag}: packed reference")
    try:
        ref = run_reference(sock, "ref-" + tag, world, seq)
    except Exception as e:
        for name, _ in groups:
            report(False, name, f"the packed reference job failed: {exc_text(e)}")
        return
    n = L.total_cells
    run = np.zeros(n, dtype=np.float32)
    errs = {}
    counted = {}
    for i, ep in enumerate(seq):
        sent = [v for v in ep if v is not None]
        if sent:
            run = np.maximum(run, np.maximum.reduce(sent))
        want = model(L, run)
        errs[i], counted[i] = [], 0
        for r in range(world):
            d = diff(ref[i][r], want, MODEL_KEYS, f"epoch #{i} rank {r}: packed path vs numpy")
            if d:
                errs[i].append(d)
            a = answers[i][r] if i < len(answers) else None
            if a is None:
                continue
            counted[i] += 1
            d = (diff(a, ref[i][r], KEYS, f"epoch #{i} rank {r}: device vs packed")
                 or diff(a, want, MODEL_KEYS, f"epoch #{i} rank {r}: device vs numpy"))
            if d:
                errs[i].append(d)
    for name, idxs in groups:
        e = [x for i in idxs for x in errs.get(i, [])]
        k = sum(counted.get(i, 0) for i in idxs)
        if k == 0 and not e:
            report(False, name, "no device answer to compare")
            continue
        report(not e, name, "; ".join(e[:3]) if e else
               f"{k} device answer(s) bit-exact vs the packed path (14 arrays) and the numpy "
               f"model (amax/scale/scale_inv/globals); last amax max {float(run.max()):.6g}")


# ---------------------------------------------------------------- device helpers
def load_torch():
    global T
    import torch
    T = torch
    return torch


def wait_stream(S, limit):
    """Whether stream S finishes its queued work within `limit` s (polling, never blocking)."""
    with T.cuda.device(S.device):
        ev = T.cuda.Event()
        ev.record(S)
    end = time.monotonic() + limit
    while not ev.query():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def sync(c, S, dev, v, arm=False, mode="block", timeout=CALL_TMO, sleep=False, stats=None):
    """One device sync of client c on stream S (GPU dev): v (numpy float32 per
    cell, or None = send nothing) into the device slab, then reconcile_device
    (mode "block") or reconcile_device_async (mode "async": the answer is
    read on S right after the call returns, i.e. ordered only by the done
    flag, and compared after result()). Returns (epoch, next_epoch, armed
    after, {key: numpy}); raises the call's error."""
    with T.cuda.device(dev), T.cuda.stream(S):
        if v is not None:
            vg = T.from_numpy(np.ascontiguousarray(v)).to(T.device("cuda", dev))
            if sleep and hasattr(T.cuda, "_sleep"):
                T.cuda._sleep(SLEEP_CYCLES)  # the slab is written well after the call returns
            c.device_slab().copy_(vg)
        if mode == "block":
            res = c.reconcile_device(send=v is not None, stream=S, timeout=timeout, arm=arm)
            snap = {k: t.clone() for k, t in res.arrays().items()}
        else:
            t0 = time.perf_counter()
            p = c.reconcile_device_async(send=v is not None, stream=S, timeout=timeout, arm=arm)
            dt = time.perf_counter() - t0
            if stats is not None:
                stats.append(dt)
            snap = {k: t.clone() for k, t in c.device_buffers.answer.items()}
            res = p.result(timeout=timeout + 5)
        if not wait_stream(S, 15):
            raise RuntimeError("the trainer's stream did not finish within 15 s after the call")
        host = {k: t.cpu().numpy().copy() for k, t in snap.items()}
    return res.epoch, res.next_epoch, c._armed is not None, host


def open_retry(c, dev, limit=6.0):
    """open_device, retried while the rank is still in the aborted epoch."""
    end = time.monotonic() + limit
    while True:
        try:
            return c.open_device(device=dev)
        except E.FailedPrecondition:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def new_client(job, rank, world, sock, dev, timeout=30):
    """A fresh client of an existing rank: layout and device buffers (Join
    again only when the daemon asks for it)."""
    c = amaxd.Client(job, rank, world, socket=sock, timeout=timeout)
    try:
        c.layout()
    except (E.FailedPrecondition, E.NotFound):
        c.join(timeout=15)
        c.layout()
    open_retry(c, dev)
    return c


def consecutive(eps):
    """'' when each (epoch, next) follows the one before, else why."""
    for i in range(len(eps)):
        e, n = eps[i]
        if n != e + 1:
            return f"sync #{i}: epoch {e} next {n}"
        if i and e != eps[i - 1][1]:
            return f"sync #{i}: epoch {e} after next_epoch {eps[i - 1][1]}"
    return ""


def setup_job(job, world, sock, devs, streams=None):
    """Clients of every rank (threads for the Joins), registered, buffers open."""
    cs = [amaxd.Client(job, r, world, socket=sock, timeout=30) for r in range(world)]

    def one(r):
        T.cuda.set_device(devs[r])
        cs[r].join(timeout=40)
        cs[r].register(catalog())
        cs[r].layout()
        cs[r].open_device(device=devs[r])
    res = run_threads([lambda r=r: one(r) for r in range(world)], 55)
    for _, e in res:
        if e is not None:
            raise e
    return cs


def close_all(cs):
    for c in cs:
        try:
            c.close()
        except Exception:
            pass


# ---------------------------------------------------------------- check 1
def check1(sock):
    step("1: setup")
    job = "arm1"
    (c,) = setup_job(job, 1, sock, [0])
    S = T.cuda.Stream(device=0)
    L = c.layout()
    n = L.total_cells
    seq, ans, eps, armed_state = [], [], [], []
    try:
        step("1: warm-up")
        e, nx, a, h = sync(c, S, 0, None)
        seq.append([None]); ans.append([h]); eps.append((e, nx)); armed_state.append(a)
        bad = []
        for k in range(1, 11):
            step(f"1: armed sync {k}")
            v = vals(job, k, 0, n)
            try:
                e, nx, a, h = sync(c, S, 0, v, arm=True, sleep=k in (3, 7))
            except Exception as ex:
                bad.append(f"armed sync {k}: {exc_text(ex)}")
                break
            seq.append([v]); ans.append([h]); eps.append((e, nx)); armed_state.append(a)
            if not a:
                bad.append(f"armed sync {k}: client._armed is None after arm=True")
        n_armed = len(seq) - 1
        final = plain = None
        if not bad:
            step("1: final arm=False")
            v = vals(job, 11, 0, n)
            try:
                e, nx, a, h = sync(c, S, 0, v, arm=False)
                seq.append([v]); ans.append([h]); eps.append((e, nx)); final = a
                step("1: plain after disarm")
                v = vals(job, 12, 0, n)
                e, nx, a, h = sync(c, S, 0, v)
                seq.append([v]); ans.append([h]); eps.append((e, nx)); plain = a
            except Exception as ex:
                bad.append(f"final/plain sync: {exc_text(ex)}")
        report(not bad and n_armed == 10 and final is False and plain is False,
               "1. 10 armed blocking syncs, then arm=False, then a plain one: no error, "
               "client._armed set while armed and None after",
               "; ".join(bad) or f"{n_armed} armed, _armed after them {armed_state[1:]}, "
               f"after arm=False {final}, after the plain one {plain}")
        main_idx = list(range(len(seq)))

        # ---- 1b: guards while armed, and no deadline before the flag
        g_idx = []
        gd = []
        try:
            step("1b: arm")
            v = vals(job, 13, 0, n)
            e, nx, a, h = sync(c, S, 0, v, arm=True)
            seq.append([v]); ans.append([h]); eps.append((e, nx)); g_idx.append(len(seq) - 1)
            step("1b: guards")
            for what, kw in (("send=False", {"send": False}), ("has_data=True", {"has_data": True})):
                try:
                    with T.cuda.device(0), T.cuda.stream(S):
                        c.reconcile_device(stream=S, timeout=5, **kw)
                    gd.append(f"{what} while armed: accepted")
                except ValueError as ex:
                    if c._armed is None:
                        gd.append(f"{what}: ValueError but the arming was dropped")
                    else:
                        info(f"1b. {what} while armed -> ValueError: {str(ex)[:120]}")
                except Exception as ex:
                    gd.append(f"{what} while armed: {exc_text(ex)} (want ValueError)")
            old_id = c.device_buffers.id
            try:
                c.open_device(device=0)
                gd.append("OpenDevice while armed: accepted (want FAILED_PRECONDITION)")
            except E.FailedPrecondition as ex:
                info(f"1b. OpenDevice while armed -> FailedPrecondition: {ex.message[:120]}")
            except Exception as ex:
                gd.append(f"OpenDevice while armed: {exc_text(ex)}")
            try:
                c._unary("CloseDevice", amaxd.pb.CloseDeviceRequest(job=job, rank=0, device_id=old_id),
                         amaxd.pb.CloseDeviceResponse)
                gd.append("CloseDevice while armed: accepted (want FAILED_PRECONDITION)")
            except E.FailedPrecondition as ex:
                info(f"1b. CloseDevice while armed -> FailedPrecondition: {ex.message[:120]}")
            except Exception as ex:
                gd.append(f"CloseDevice while armed: {exc_text(ex)}")
            report(not gd, "1b. while armed: send=False / has_data mismatch -> ValueError (arming kept); "
                   "OpenDevice and CloseDevice -> FAILED_PRECONDITION", "; ".join(gd))
            step("1b: pause")
            time.sleep(ARMED_PAUSE_S)
            step("1b: armed sync after the pause")
            v = vals(job, 14, 0, n)
            t0 = time.monotonic()
            try:
                e, nx, a, h = sync(c, S, 0, v, arm=True)
                seq.append([v]); ans.append([h]); eps.append((e, nx)); g_idx.append(len(seq) - 1)
                report(a, f"1b. an armed epoch waits {ARMED_PAUSE_S:.0f} s (> reconcile_timeout "
                       f"{D0_RECONCILE_MS} ms) for the next step, then answers",
                       f"answered in {time.monotonic() - t0:.3f} s, armed again {a}")
            except Exception as ex:
                report(False, f"1b. an armed epoch waits {ARMED_PAUSE_S:.0f} s for the next step "
                       "(no deadline before the flag)", exc_text(ex))
                raise
            step("1b: disarm")
            v = vals(job, 15, 0, n)
            e, nx, a, h = sync(c, S, 0, v, arm=False)
            seq.append([v]); ans.append([h]); eps.append((e, nx)); g_idx.append(len(seq) - 1)
            if a:
                report(False, "1b. arm=False ends the arming", "client._armed still set")
        except Exception as ex:
            report(False, "1b. guards / pause sequence ran", exc_text(ex))
        why = consecutive(eps)
        report(not why, "1. epochs numbered consecutively (each armed answer is the epoch announced)",
               why or f"epochs {eps[0][0]}..{eps[-1][0]}")
    finally:
        close_all([c])
    verify(job, sock, 1, L, seq, ans,
           [("1. each epoch (warm-up, 10 armed, arm=False, plain) bit-exact vs packed and numpy",
             main_idx),
            ("1b. armed epochs around the guards and the pause bit-exact", g_idx)])


# ---------------------------------------------------------------- check 2
def check2(sock):
    step("2: setup")
    job = "arm2"
    (c,) = setup_job(job, 1, sock, [0])
    S = T.cuda.Stream(device=0)
    L = c.layout()
    n = L.total_cells
    seq, ans, eps, bad, rt = [], [], [], [], []
    try:
        e, nx, a, h = sync(c, S, 0, None)
        seq.append([None]); ans.append([h]); eps.append((e, nx))
        plan = [(k, True, "async") for k in range(1, 9)] + [(9, False, "async"), (10, False, "async"),
                                                          (11, False, "block")]
        for k, arm, mode in plan:
            step(f"2: sync {k} ({mode}, arm={arm})")
            v = vals(job, k, 0, n)
            try:
                e, nx, a, h = sync(c, S, 0, v, arm=arm, mode=mode, sleep=k % 2 == 0, stats=rt)
            except Exception as ex:
                bad.append(f"sync {k}: {exc_text(ex)}")
                break
            seq.append([v]); ans.append([h]); eps.append((e, nx))
            if a != arm:
                bad.append(f"sync {k} (arm={arm}): client._armed {'set' if a else 'None'} after it")
        report(not bad, "2. 8 async armed syncs, an async arm=False, an async and a blocking plain: "
               "no error, _armed as asked", "; ".join(bad) or
               (f"host back after the async call: max {max(rt) * 1e3:.2f} ms" if rt else ""))
        why = consecutive(eps)
        report(not why, "2. async: epochs numbered consecutively", why or f"{eps[0][0]}..{eps[-1][0]}")
    finally:
        close_all([c])
    verify(job, sock, 1, L, seq, ans,
           [("2. async armed: the answer read on the stream right after the call (ordered by the "
             "done flag only) is bit-exact vs packed and numpy, every epoch", list(range(len(seq))))])


# ---------------------------------------------------------------- check 3
def check3(sock):
    step("3: setup")
    job = "arm3"
    cs = setup_job(job, 2, sock, [0, 0])
    Ss = [T.cuda.Stream(device=0), T.cuda.Stream(device=0)]
    L = cs[0].layout()
    n = L.total_cells
    if cs[1].layout().id != L.id:
        report(False, "3. both ranks have the same layout", "differ")
    # phases: (name, [(arm, mode) for rank 0], [(arm, mode) for rank 1])
    phases = [
        ("3a. two ranks, blocking armed", [(True, "block")] * 5 + [(False, "block")],
         [(True, "block")] * 5 + [(False, "block")]),
        ("3b. two ranks, async armed (own streams)", [(True, "async")] * 5 + [(False, "async")],
         [(True, "async")] * 5 + [(False, "async")]),
        ("3c. rank 0 armed (blocking and async alternating), rank 1 plain blocking",
         [(True, "block"), (True, "async"), (True, "block"), (True, "async"), (False, "block")],
         [(False, "block")] * 5),
    ]
    seq, ans, groups = [[None, None]], [], []
    ep_no = [0]
    try:
        step("3: warm-up")
        r = run_threads([lambda r=r: sync(cs[r], Ss[r], 0, None) for r in range(2)], 30)
        for _, e in r:
            if e is not None:
                raise e
        ans.append([r[0][0][3], r[1][0][3]])
        for name, p0, p1 in phases:
            step(name)
            plans = [p0, p1]
            base = ep_no[0]
            vs = [[vals(job, base + i + 1, rk, n) for i in range(len(plans[rk]))] for rk in range(2)]
            outs = [[], []]

            def worker(rk):
                T.cuda.set_device(0)
                for i, (arm, mode) in enumerate(plans[rk]):
                    outs[rk].append(sync(cs[rk], Ss[rk], 0, vs[rk][i], arm=arm, mode=mode,
                                         sleep=(i + rk) % 3 == 1))
            res = run_threads([lambda rk=rk: worker(rk) for rk in range(2)], 50)
            errs = [f"rank {rk}: {exc_text(res[rk][1])}" for rk in range(2) if res[rk][1] is not None]
            k = min(len(outs[0]), len(outs[1]))
            idx = []
            for i in range(k):
                seq.append([vs[0][i], vs[1][i]])
                ans.append([outs[0][i][3], outs[1][i][3]])
                idx.append(len(seq) - 1)
                if outs[0][i][0] != outs[1][i][0]:
                    errs.append(f"sync {i}: ranks answered epochs {outs[0][i][0]} and {outs[1][i][0]}")
                for rk in range(2):
                    if outs[rk][i][2] != plans[rk][i][0]:
                        errs.append(f"rank {rk} sync {i}: _armed {outs[rk][i][2]} after arm={plans[rk][i][0]}")
            ep_no[0] = base + len(plans[0])
            report(not errs and k == len(p0), f"{name}: every sync answered, _armed as asked",
                   "; ".join(errs[:3]) or f"{k} epochs, epochs {outs[0][0][0]}..{outs[0][k - 1][0]}")
            groups.append((f"{name}: each rank's answer = elementwise max of both ranks' values, "
                           "bit-exact vs packed and numpy", idx))
            if errs:
                break
    finally:
        close_all(cs)
    if groups:
        verify(job, sock, 2, L, seq, ans, groups)


# ---------------------------------------------------------------- check 4a
def check4a(sock):
    step("4a: setup")
    job = "arm4a"
    (c,) = setup_job(job, 1, sock, [0])
    S = T.cuda.Stream(device=0)
    L = c.layout()
    n = L.total_cells
    nan_q = f"pt.{150:04d}"
    nan_cell = L.span(nan_q)[0]
    seq, ans, idx_b, idx_a = [], [], [], []
    try:
        e, nx, a, h = sync(c, S, 0, None)
        seq.append([None]); ans.append([h])
        for variant, mode in (("blocking", "block"), ("async", "async")):
            step(f"4a: {variant} armed")
            base = 10 if mode == "async" else 0
            for k in (1, 2):
                v = vals(job, base + k, 0, n)
                e, nx, a, h = sync(c, S, 0, v, arm=True, mode=mode)
                seq.append([v]); ans.append([h])
            step(f"4a: {variant} NaN")
            bad = np.full(n, 1e7, dtype=np.float32)   # above everything: a partial merge would show
            bad[nan_cell] = np.nan
            err = None
            try:
                with T.cuda.device(0), T.cuda.stream(S):
                    c.device_slab().copy_(T.from_numpy(bad).to("cuda:0"))
                    if mode == "block":
                        c.reconcile_device(stream=S, timeout=CALL_TMO, arm=True)
                    else:
                        c.reconcile_device_async(stream=S, timeout=CALL_TMO, arm=True).result(CALL_TMO + 5)
            except Exception as ex:
                err = ex
            freed = wait_stream(S, 15)
            ok = isinstance(err, E.InvalidArgument)
            report(ok and freed and c._armed is None,
                   f"4a. NaN in the slab of an armed epoch ({variant}) -> INVALID_ARGUMENT, arming "
                   "ended, the trainer's stream runs on",
                   f"{exc_text(err) if err else 'no error: a result'}; stream done {freed}; "
                   f"_armed {'None' if c._armed is None else 'still set'}")
            if ok:
                report(nan_q in err.message, f"4a. the NaN error names the quantizer ({variant})",
                       f"'{nan_q}' in '{err.message[:200]}'")
            step(f"4a: {variant} next plain epoch")
            v = vals(job, base + 3, 0, n)
            e, nx, a, h = sync(c, S, 0, v)
            seq.append([v]); ans.append([h])
            (idx_b if mode == "block" else idx_a).append(len(seq) - 1)
    finally:
        close_all([c])
    verify(job, sock, 1, L, seq, ans,
           [("4a. plain epoch after the blocking NaN epoch bit-exact (nothing of the 1e7/NaN slab "
             "merged)", idx_b),
            ("4a. plain epoch after the async NaN epoch bit-exact (nothing merged)", idx_a)])


# ---------------------------------------------------------------- check 4b
def child_4b(sock, job, nsync):
    """The trainer that arms and is then killed (run as a subprocess)."""
    signal.alarm(120)
    load_torch()
    T.cuda.set_device(0)
    S = T.cuda.Stream(device=0)
    c = amaxd.Client(job, 0, 1, socket=sock, timeout=30)
    c.join(timeout=30)
    c.register(catalog())
    L = c.layout()
    c.open_device(device=0)
    e, nx, a, _ = sync(c, S, 0, None)
    print(f"EPOCH {e} {nx} {int(a)}", flush=True)
    for k in range(1, nsync + 1):
        e, nx, a, _ = sync(c, S, 0, vals(job, k, 0, L.total_cells), arm=True)
        print(f"EPOCH {e} {nx} {int(a)}", flush=True)
    print(f"ARMED {c.epoch} {int(c._armed is not None)}", flush=True)
    time.sleep(110)


def check4b(sock, logp):
    step("4b: child trainer")
    job = "arm4b"
    nsync = 2
    errf = tempfile.NamedTemporaryFile(prefix="armchk-child-", suffix=".err", delete=False)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child-4b", sock, job,
                              str(nsync)], stdout=subprocess.PIPE, stderr=errf, text=True)
    PROCS.append(child)
    q = queue.Queue()
    threading.Thread(target=lambda: [q.put(line) for line in child.stdout], daemon=True).start()
    lines, armed_epoch = [], None
    end = time.monotonic() + 50
    while time.monotonic() < end and armed_epoch is None:
        try:
            line = q.get(timeout=0.2).strip()
        except queue.Empty:
            if child.poll() is not None:
                break
            continue
        lines.append(line)
        if line.startswith("ARMED "):
            f = line.split()
            armed_epoch = int(f[1]) if f[2] == "1" else None
            if f[2] != "1":
                break
    if armed_epoch is None:
        report(False, "4b. child trainer armed an epoch", f"lines {lines}; stderr: "
               f"{read_log(errf.name)[-1500:]}")
        child.kill()
        return
    info(f"4b. child: {lines}")
    at = log_size(logp)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    step("4b: the daemon's abort")
    rx = re.compile(r"armed epoch\s+(\d+).*(went away|abort)|abort.*armed epoch", re.I)
    line = wait_log(logp, at, rx, 10)
    report(line is not None, "4b. SIGKILL of an armed trainer: the daemon logs the abort of the armed epoch",
           line[:300] if line else f"no line like 'armed epoch N ... went away' in 10 s; log tail: "
           f"{read_log(logp, at)[-600:]}")
    if line is not None:
        m = re.search(r"armed epoch\s+(\d+)", line)
        if m and int(m.group(1)) != armed_epoch:
            report(False, "4b. the aborted epoch is the one armed", f"log {m.group(1)}, child {armed_epoch}")
    step("4b: a new client of the rank")
    n = None
    c = None
    try:
        c = new_client(job, 0, 1, sock, 0)
        L = c.layout()
        n = L.total_cells
        S = T.cuda.Stream(device=0)
        v3 = vals(job, nsync + 1, 0, n)
        e, nx, a, h = sync(c, S, 0, v3)
        report(e == armed_epoch, "4b. the job's next epoch has the aborted epoch's number",
               f"new client's epoch {e}, aborted {armed_epoch}")
        seq = [[None]] + [[vals(job, k, 0, n)] for k in range(1, nsync + 1)] + [[v3]]
        ans = [[None]] * (nsync + 1) + [[h]]
        verify(job, sock, 1, L, seq, ans,
               [("4b. a new client of the killed trainer's rank reconciles the next epoch "
                 "bit-exact (the child's epochs kept, nothing of the aborted one)", [nsync + 1])])
    except Exception as ex:
        report(False, "4b. a new client of the killed trainer's rank reconciles the next epoch",
               exc_text(ex))
    finally:
        if c is not None:
            close_all([c])


# ---------------------------------------------------------------- check 4c
def check4c(sock, logp):
    step("4c: setup")
    job = "arm4c"
    cs = setup_job(job, 2, sock, [0, 0])
    Ss = [T.cuda.Stream(device=0), T.cuda.Stream(device=0)]
    L = cs[0].layout()
    n = L.total_cells
    seq, ans = [[None, None]], []
    K = 3
    newc = None
    try:
        r = run_threads([lambda r=r: sync(cs[r], Ss[r], 0, None) for r in range(2)], 30)
        for _, e in r:
            if e is not None:
                raise e
        ans.append([r[0][0][3], r[1][0][3]])
        step("4c: rank 0 armed, rank 1 plain")
        for k in range(1, K + 1):
            v0, v1 = vals(job, k, 0, n), vals(job, k, 1, n)
            r = run_threads([lambda: sync(cs[0], Ss[0], 0, v0, arm=True),
                             lambda: sync(cs[1], Ss[1], 0, v1)], 30)
            for _, e in r:
                if e is not None:
                    raise e
            seq.append([v0, v1])
            ans.append([r[0][0][3], r[1][0][3]])
        if cs[0]._armed is None:
            raise RuntimeError("rank 0 is not armed after its arm=True syncs")
        step("4c: rank 1 waits, rank 0 closes while armed")
        w1 = vals(job, K + 1, 1, n)
        box = {}

        def waiter():
            T.cuda.set_device(0)
            t0 = time.monotonic()
            try:
                box["res"] = sync(cs[1], Ss[1], 0, w1, timeout=25)
            except Exception as ex:
                box["err"] = ex
            box["dt"] = time.monotonic() - t0
        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        time.sleep(1.0)   # rank 1 is in the epoch by now
        at = log_size(logp)
        t0 = time.monotonic()
        try:
            cs[0].close()
            cerr = None
        except Exception as ex:
            cerr = ex
        dt = time.monotonic() - t0
        report(cerr is None and dt < 8.0, "4c. Client.close() of an armed client returns within a few seconds",
               f"{dt:.2f} s{', ' + exc_text(cerr) if cerr else ''}")
        th.join(30)
        err = box.get("err")
        report(isinstance(err, E.Aborted),
               "4c. the other local rank waiting in that epoch gets ABORTED (not a result, not a hang)",
               ("still waiting after 30 s" if th.is_alive() else
                f"{exc_text(err)} after {box.get('dt', 0):.2f} s" if err else "it got a result"))
        line = wait_log(logp, at, re.compile(r"armed epoch", re.I), 3)
        info(f"4c. daemon log: {line[:250] if line else '(no armed-epoch line)'}")
        step("4c: new client of rank 0")
        newc = new_client(job, 0, 2, sock, 0)
        x0 = vals(job, K + 2, 0, n)
        x1 = w1 * np.float32(2)   # >= rank 1's aborted slab, whether or not that one was kept

        def again(c, S, v):
            try:
                return sync(c, S, 0, v, timeout=25)
            except E.FailedPrecondition as ex:  # the client tracked another epoch: learn it, once
                info(f"4c. retry after {exc_text(ex)}")
                return sync(c, S, 0, v, timeout=25)
        r = run_threads([lambda: again(newc, Ss[0], x0), lambda: again(cs[1], Ss[1], x1)], 40)
        errs = [f"rank {i}: {exc_text(e)}" for i, (_, e) in enumerate(r) if e is not None]
        if errs:
            report(False, "4c. a new client of rank 0 and rank 1 reconcile the next epoch", "; ".join(errs))
        else:
            seq.append([x0, x1])
            ans.append([r[0][0][3], r[1][0][3]])
            verify(job, sock, 2, L, seq, ans,
                   [("4c. armed rank 0 + plain rank 1 epochs, then (after the close and the abort) "
                     "the new rank-0 client's epoch: bit-exact", list(range(len(seq))))])
    finally:
        close_all(cs[1:] + ([newc] if newc is not None else []))


# ---------------------------------------------------------------- check 4d
def check4d(sock0):
    if T.cuda.device_count() < 2:
        report(False, "4d. two daemons on two GPUs", f"{T.cuda.device_count()} GPU(s) visible")
        return
    step("4d: start 2 daemons (NCCL)")
    ds, how = start_cluster(2)
    socks = [d.socket for d in ds]
    info(f"4d. cluster of 2 daemons ({how})")
    job = "arm4d"
    K = 4
    cs, newc = [], None
    try:
        step("4d: join/register/open")
        cs = [amaxd.Client(job, r, 2, socket=socks[r], timeout=50) for r in range(2)]

        def setup(r):
            T.cuda.set_device(r)
            cs[r].join(timeout=40)
            cs[r].register(catalog())
            cs[r].layout()
            cs[r].open_device(device=r)
        res = run_threads([lambda r=r: setup(r) for r in range(2)], 55)
        for _, e in res:
            if e is not None:
                raise e
        Ss = [T.cuda.Stream(device=r) for r in range(2)]
        L = cs[0].layout()
        n = L.total_cells
        step("4d: warm-up (first NCCL epoch)")
        res = run_threads([lambda r=r: sync(cs[r], Ss[r], r, None, timeout=50) for r in range(2)], 55)
        for _, e in res:
            if e is not None:
                raise e
        seq, ans = [[None, None]], [[res[0][0][3], res[1][0][3]]]
        step("4d: armed syncs")
        vs = [[vals(job, k, r, n) for k in range(1, K + 1)] for r in range(2)]
        outs = [[], []]

        def worker(r):
            T.cuda.set_device(r)
            for k in range(K):
                outs[r].append(sync(cs[r], Ss[r], r, vs[r][k], arm=True, sleep=k == 1,
                                    mode="async" if k == 2 else "block", timeout=30))
        res = run_threads([lambda r=r: worker(r) for r in range(2)], 55)
        errs = [f"rank {r}: {exc_text(res[r][1])}" for r in range(2) if res[r][1] is not None]
        k = min(len(outs[0]), len(outs[1]))
        for i in range(k):
            seq.append([vs[0][i], vs[1][i]])
            ans.append([outs[0][i][3], outs[1][i][3]])
            if not (outs[0][i][2] and outs[1][i][2]):
                errs.append(f"sync {i}: not armed after arm=True")
        report(not errs and k == K, f"4d. {K} armed syncs, one rank per daemon on GPUs 0 and 1: answered, armed",
               "; ".join(errs[:3]) or f"epochs {outs[0][0][0]}..{outs[0][k - 1][0]}")
        verify(job, sock0, 2, L, seq, ans,
               [("4d. armed epochs over NCCL: each rank's answer = numpy max of both ranks, bit-exact "
                 "(and vs the packed path of a 2-rank job on the single daemon)", list(range(len(seq))))])
        if errs:
            return
        step("4d: rank 1 goes away while armed")
        at1 = len(ds[1].log())
        t0 = time.monotonic()
        try:
            cs[1].close()
            info(f"4d. rank 1's close() took {time.monotonic() - t0:.2f} s")
        except Exception as ex:
            info(f"4d. rank 1's close() raised {exc_text(ex)} after {time.monotonic() - t0:.2f} s")
        step("4d: rank 0's next armed sync")
        va0 = vals(job, K + 1, 0, n)
        t0 = time.monotonic()
        err, got = None, None
        try:
            got = sync(cs[0], Ss[0], 0, va0, arm=True, timeout=30)
        except Exception as ex:
            err = ex
        dt = time.monotonic() - t0
        client_timeout = isinstance(err, E.DeadlineExceeded) and "no answer on the doorbell" in err.message
        report(isinstance(err, E.AmaxdError) and not client_timeout and dt < 30,
               "4d. the other rank's next armed sync raises an AmaxdError within 30 s",
               f"{exc_text(err)} after {dt:.2f} s" if err else f"it got a result: epoch {got[0]}")
        report(wait_stream(Ss[0], 10), "4d. rank 0's stream runs on after the error")
        tail = ds[1].log()[at1:]
        m = [x for x in tail.splitlines() if re.search(r"armed epoch", x, re.I)]
        info(f"4d. daemon 1 log: {m[0].strip()[:250] if m else '(no armed-epoch line)'}")
        step("4d: recovery with a new rank-1 client")
        x0 = va0 * np.float32(2)
        x1 = vals(job, K + 2, 1, n)
        box = {}

        def rank1():
            T.cuda.set_device(1)
            box["c"] = new_client(job, 1, 2, socks[1], 1, timeout=50)
            return sync(box["c"], Ss[1], 1, x1, timeout=45)

        def rank0():
            try:
                return sync(cs[0], Ss[0], 0, x0, timeout=45)
            except E.FailedPrecondition as ex:
                info(f"4d. rank 0 retry after {exc_text(ex)}")
                return sync(cs[0], Ss[0], 0, x0, timeout=45)
        res = run_threads([rank0, rank1], 55)
        newc = box.get("c")
        errs = [f"rank {r}: {exc_text(e)}" for r, (_, e) in enumerate(res) if e is not None]
        if errs:
            report(False, "4d. (extra) after the abort, rank 0 and a new rank-1 client reconcile the "
                   "next epoch", "; ".join(errs))
        else:
            seq.append([x0, x1])
            last = [res[0][0][3], res[1][0][3]]
            # a second reference job (the first one, ref-arm4d, is past these epochs)
            verify(job + "-2", sock0, 2, L, seq, [[None, None]] * (len(seq) - 1) + [last],
                   [("4d. (extra) after the abort, rank 0 and a new rank-1 client reconcile the next "
                     "epoch bit-exact", [len(seq) - 1])])
    finally:
        close_all(cs[:1] + ([newc] if newc is not None else []))
        for d in ds:
            try:
                d.proc.kill()
                d.proc.wait(timeout=10)
            except Exception:
                pass


# ---------------------------------------------------------------- check 5
REQ = struct.Struct("<IIQQQIIII")
ANS = struct.Struct("<IIQQQII")


def hdr(flags, dev_id, layout_id, job, seq, rank=0, epoch=0):
    jb = job.encode()
    return REQ.pack(MAGIC, flags, dev_id, epoch, layout_id, rank, len(jb), seq, 0) + jb


def door_send(s, msg, fd=None):
    if fd is None:
        s.send(msg)
    else:
        s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def door_recv(s, timeout):
    """A parsed answer, or None when none came within timeout."""
    s.settimeout(timeout)
    try:
        data = s.recv(65536)
    except socket.timeout:
        return None
    if len(data) < ANS.size:
        return {"code": -1, "msg": f"{len(data)} bytes", "magic": 0, "epoch": 0, "next": 0, "aflags": 0}
    magic, code, ep, nx, lid, mlen, aflags = ANS.unpack_from(data)
    return {"magic": magic, "code": code, "epoch": ep, "next": nx, "aflags": aflags,
            "msg": data[ANS.size:ANS.size + mlen].decode("utf-8", "replace")}


def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    return s


def flag_page(seal=True, size=4096):
    fd = os.memfd_create("armchk-flags", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seal else 0))
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    mm = mmap.mmap(fd, size)
    return fd, mm


def show(a):
    if a is None:
        return "no answer"
    return f"code {a['code']} epoch {a['epoch']} next {a['next']} armed {a['aflags'] & 1} '{a['msg'][:150]}'"


class Proto:
    """A rank whose device buffers the raw requests name (its client opened
    them); slab writes and ready flags by hand."""

    def __init__(self, sock, job):
        self.job = job
        (self.c,) = setup_job(job, 1, sock, [0])
        self.S = T.cuda.Stream(device=0)
        self.L = self.c.layout()
        self.n = self.L.total_cells
        sync(self.c, self.S, 0, None)  # warm-up: the catalog agreed
        self.b = self.c.device_buffers
        self.door = self.b.doorbell
        if not (self.door and self.b.signals and dv.memops() is not None):
            raise RuntimeError(f"no doorbell/signals: doorbell '{self.door}', signals {self.b.signals}")

    def prep(self, v, flag=True):
        """v into the slab and (flag) the next seq into the ready flag, done
        on the GPU before this returns; gives the seq."""
        seq = self.b.next_seq()
        with T.cuda.device(0), T.cuda.stream(self.S):
            self.b.slab.copy_(T.from_numpy(v).to("cuda:0"))
            if flag:
                dv.memops().write(0, int(self.S.cuda_stream), self.b.ready_flag, seq)
        if not wait_stream(self.S, 10):
            raise RuntimeError("slab write did not finish")
        return seq

    def answer_amax(self, seq):
        """The device answer's amax/scale after the done flag reached seq
        (the stream waits for it on the GPU, bounded by wait_stream)."""
        with T.cuda.device(0), T.cuda.stream(self.S):
            dv.memops().wait(0, int(self.S.cuda_stream), self.b.done_flag, seq)
            snap = {k: self.b.answer[k].clone() for k in ("amax", "scale", "scale_inv")}
        if not wait_stream(self.S, 10):
            # free our own stream: write the done flag ourselves
            with T.cuda.device(0):
                side = T.cuda.Stream(device=0)
                dv.memops().write(0, int(side.cuda_stream), self.b.done_flag, seq)
                side.synchronize()
            wait_stream(self.S, 5)
            return None
        return {k: t.cpu().numpy() for k, t in snap.items()}

    def hdr(self, flags, seq):
        return hdr(flags, self.b.id, self.L.id, self.job, seq)

    def expect(self, got, v):
        if got is None:
            return "the done flag never reached the seq (no answer written)"
        return diff(got, model(self.L, v), ("amax", "scale", "scale_inv"), "device answer vs numpy")


def check5(sock):
    step("5: setup")
    P = Proto(sock, "arm5")
    n = P.n
    fd, mm = flag_page()
    try:
        # ---- 5a: bad arm requests on one connection, which stays usable
        step("5a: arm without a flag page")
        s = connect(P.door)
        v = vals("arm5", 1, 0, n)
        seq = P.prep(v)
        door_send(s, P.hdr(1 | 4, seq))          # send + arm + signal, no SCM_RIGHTS
        a = door_recv(s, 10)
        report(a is not None and a["code"] == 3 and "flag page" in a["msg"].lower(),
               "5a. raw arm request without a flag page -> INVALID_ARGUMENT naming the flag page", show(a))
        if a is not None and a["code"] == 0 and a["aflags"] & 1:
            s.close()
            s = connect(P.door)
        step("5a: arm without send / without a signal")
        for what, flags, sq in (("arm without send", 4, P.b.next_seq()), ("arm without a signal (seq 0)", 1 | 4, 0)):
            door_send(s, P.hdr(flags, sq), fd)
            a = door_recv(s, 10)
            report(a is not None and a["code"] == 3, f"5a. raw {what} (flag page given) -> INVALID_ARGUMENT",
                   show(a))
            if a is not None and a["code"] == 0 and a["aflags"] & 1:
                s.close()
                s = connect(P.door)
        step("5a: the connection still answers")
        vb = vals("arm5", 2, 0, n, scale=1e4)
        seq = P.prep(vb)
        door_send(s, P.hdr(1, seq))
        a = door_recv(s, 10)
        why = "" if (a is not None and a["code"] == 0 and not a["aflags"] & 1) else show(a)
        if not why:
            why = P.expect(P.answer_amax(seq), vb)
        report(not why, "5a. after those, a plain request on the same connection answers OK (not armed), "
               "answer bit-exact", why or show(a))
        s.close()

        # ---- 5b: disarm on a connection that is not armed
        step("5b: disarm, not armed")
        s = connect(P.door)
        door_send(s, hdr(8, P.b.id, 0, P.job, 0))
        a = door_recv(s, 1.5)
        report(a is None, "5b. a disarm datagram on a connection that is not armed gets no answer", show(a))
        vc = vals("arm5", 3, 0, n, scale=1e5)
        seq = P.prep(vc)
        door_send(s, P.hdr(1, seq))
        a = door_recv(s, 10)
        why = "" if (a is not None and a["code"] == 0 and not a["aflags"] & 1) else show(a)
        if not why:
            why = P.expect(P.answer_amax(seq), vc)
        report(not why, "5b. ... and the connection answers the next request (OK, bit-exact)", why or show(a))
        s.close()

        # ---- 5c: by hand: arm with our own flag page, another datagram while armed, host-written flag
        step("5c: raw arm")
        s = connect(P.door)
        vd = vals("arm5", 4, 0, n, scale=1e6)
        seq1 = P.prep(vd)
        door_send(s, P.hdr(1 | 4, seq1), fd)
        a = door_recv(s, 10)
        ok = a is not None and a["code"] == 0 and bool(a["aflags"] & 1)
        why = "" if ok else show(a)
        if ok:
            why = P.expect(P.answer_amax(seq1), vd)
        report(not why, "5c. raw arm request with a sealed 4 KiB memfd flag page -> OK, armed bit set, "
               "answer bit-exact", why or show(a))
        if ok:
            armed_ep = a["next"]
            seq2 = P.b.next_seq()
            step("5c: another datagram on the armed connection")
            door_send(s, P.hdr(0, 0))              # a valid send=False request: not allowed while armed
            early = door_recv(s, 1.0)
            ve = vals("arm5", 5, 0, n, scale=1e7)
            P.prep(ve, flag=False)
            struct.pack_into("<I", mm, 0, seq2)     # the armed epoch's ready word, written by the host
            a1 = early if early is not None else door_recv(s, 10)
            a2 = door_recv(s, 10)
            good = (a1 is not None and a1["code"] == 0 and a1["epoch"] == armed_ep and not a1["aflags"] & 1
                    and a2 is not None and a2["code"] == 3 and early is None)
            report(good, "5c. another datagram while armed: the armed epoch (started by the host-written "
                   "flag word) answers OK and not armed again, then INVALID_ARGUMENT",
                   f"before the flag: {show(early)}; then: {show(a1)}; then: {show(a2)}; armed epoch {armed_ep}")
            why = P.expect(P.answer_amax(seq2), ve) if a1 is not None and a1["code"] == 0 else "no OK answer"
            report(not why, "5c. the armed epoch's device answer (flag page written from the host) bit-exact",
                   why)
            step("5c: connection after")
            vf = vals("arm5", 6, 0, n, scale=1e8)
            seq3 = P.prep(vf)
            door_send(s, P.hdr(1, seq3))
            a = door_recv(s, 10)
            why = "" if (a is not None and a["code"] == 0 and not a["aflags"] & 1) else show(a)
            if not why:
                why = P.expect(P.answer_amax(seq3), vf)
            report(not why, "5c. the connection then serves a plain request (OK, bit-exact)", why or show(a))
        s.close()
    finally:
        close_all([P.c])
        mm.close()
        os.close(fd)


def check5d(sock, p0):
    """Extra: a flag page NOT sealed against shrinking, truncated after the
    arm: the docs say the seal is what keeps the daemon's reads from
    faulting. Refused, or accepted with the daemon surviving, passes."""
    step("5d: unsealed flag page")
    P = Proto(sock, "arm5d")
    fd, mm = flag_page(seal=False)
    s = None
    try:
        s = connect(P.door)
        v = vals("arm5d", 1, 0, P.n)
        seq = P.prep(v)
        door_send(s, P.hdr(1 | 4, seq), fd)
        a = door_recv(s, 10)
        if a is not None and a["code"] == 3:
            report(True, "5d. (extra) arm with a flag page not sealed against shrinking -> refused", show(a))
            return
        if a is None or a["code"] != 0 or not a["aflags"] & 1:
            report(False, "5d. (extra) arm with an unsealed flag page: refused or armed", show(a))
            return
        mm.close()
        os.ftruncate(fd, 0)          # the daemon's mapping now lies past the end of the file
        time.sleep(1.5)
        alive = p0.poll() is None
        h = None
        if alive:
            try:
                h = P.c.health()
            except Exception as ex:
                h = exc_text(ex)
        report(alive and h == "SERVING", "5d. (extra) an unsealed flag page was accepted; truncated while "
               "armed, the daemon survives", f"daemon alive {alive} (rc {p0.poll()}), health {h}")
    finally:
        if s is not None:
            s.close()
        try:
            mm.close()
        except Exception:
            pass
        os.close(fd)
        close_all([P.c])


# ---------------------------------------------------------------- host smoke (no GPU)
def host_mode():
    """On a CPU host: the packed reference and the numpy model agree, and
    the doorbell's flag checks (the host backend refuses device calls)."""
    p0, sock, logp = start_d0("host")
    c = amaxd.Client("host-probe", 0, 1, socket=sock, timeout=20)
    c.join(timeout=20)
    c.register(catalog())
    L = c.layout()
    n = L.total_cells
    report(n == NPT + sum(int(np.prod(s)) for s in PC_SHAPES) and len(L) == NPT + len(PC_SHAPES),
           "host: layout cells", f"{n} cells, {len(L)} quantizers")
    for world in (1, 2):
        seq = [[None] * world] + [[vals("host", k, r, n) for r in range(world)] for k in range(1, 5)]
        ref = run_reference(sock, f"host-ref-{world}", world, seq)
        run = np.zeros(n, np.float32)
        errs = []
        for i, ep in enumerate(seq):
            sent = [v for v in ep if v is not None]
            if sent:
                run = np.maximum(run, np.maximum.reduce(sent))
            for r in range(world):
                d = diff(ref[i][r], model(L, run), MODEL_KEYS, f"epoch {i} rank {r}")
                if d:
                    errs.append(d)
        report(not errs, f"host: packed path of a {world}-rank job = numpy model", "; ".join(errs[:2]))
    fd, mm = flag_page()
    s = connect(sock + ".door")
    for what, flags, sq, f in (("arm, no flag page", 5, 7, None), ("arm without send", 4, 7, fd),
                               ("arm without a signal", 5, 0, fd), ("plain", 1, 7, None)):
        door_send(s, hdr(flags, 1, L.id, "host-probe", sq), f)
        info(f"host doorbell [{what}]: {show(door_recv(s, 5))}")
    door_send(s, hdr(8, 1, 0, "host-probe", 0))
    info(f"host doorbell [disarm, not armed]: {show(door_recv(s, 1.0))}")
    s.close()
    c.close()


# ---------------------------------------------------------------- main
CHECKS = ("1", "2", "3", "4a", "4b", "4c", "5", "4d", "5d")


def gpu_mode(only):
    load_torch()
    if not T.cuda.is_available():
        report(False, "prerequisites: torch sees a CUDA GPU", "torch.cuda.is_available() is False")
        return
    T.cuda.init()
    T.cuda.set_device(0)
    try:
        dv.ipc()
        mo = dv.memops()
    except Exception as e:
        report(False, "prerequisites: CUDA IPC binding (CuPy or cuda-bindings)", exc_text(e))
        return
    info(f"{T.cuda.device_count()} x {T.cuda.get_device_name(0)}, torch {T.__version__}, IPC "
         f"{dv.ipc().name}, stream memory operations {'yes' if mo is not None else 'NO'}, "
         f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}, AMAXD_BIN={BIN}")
    if mo is None:
        report(False, "prerequisites: libcuda stream memory operations (arming needs signals)")
    step("start daemon")
    p0, sock, logp = start_d0("cuda")
    info(f"single daemon: {sock}, log {logp}")
    fns = {"1": lambda: check1(sock), "2": lambda: check2(sock), "3": lambda: check3(sock),
           "4a": lambda: check4a(sock), "4b": lambda: check4b(sock, logp),
           "4c": lambda: check4c(sock, logp), "5": lambda: check5(sock),
           "4d": lambda: check4d(sock), "5d": lambda: check5d(sock, p0)}
    for k in CHECKS:
        if only and k not in only:
            continue
        if p0.poll() is not None:
            report(False, f"check {k}: the single daemon is alive", f"exited with {p0.returncode}; log tail "
                   f"{read_log(logp)[-800:]}")
            break
        t0 = time.monotonic()
        try:
            fns[k]()
        except Exception as e:
            traceback.print_exc()
            report(False, f"check {k} ran to its end", exc_text(e))
        info(f"check {k}: {time.monotonic() - t0:.1f} s")
    bad = [ln.strip() for ln in read_log(logp).splitlines()
           if re.search(r"Sanitizer|runtime error:|Assertion.*failed", ln)]
    report(not bad, "single daemon log has no sanitizer/assertion lines", "; ".join(bad[:3]))
    report(p0.poll() is None, "single daemon still alive at the end", f"rc {p0.poll()}")


def main():
    global WD
    if len(sys.argv) > 1 and sys.argv[1] == "--child-4b":
        child_4b(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    backend = "cuda"
    if "--backend" in sys.argv:
        backend = sys.argv[sys.argv.index("--backend") + 1]
    only = None
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    WD = Watchdog()
    t0 = time.monotonic()
    try:
        host_mode() if backend == "host" else gpu_mode(only)
    except Exception as e:
        traceback.print_exc()
        report(False, "script ran to the end", exc_text(e))
    WD.active = False
    cleanup()
    print(f"{'FAIL' if FAILS else 'PASS'} overall: {len(FAILS)} failed in "
          f"{time.monotonic() - t0:.1f} s{': ' + '; '.join(FAILS) if FAILS else ''}", flush=True)
    os._exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
