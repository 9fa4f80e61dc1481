#!/usr/bin/env python3
"""Independent check of amaxd's GPU-direct device buffers (docs/API.md
"Device buffers (GPU-direct)", "The doorbell", "Signals and the asynchronous
variant"). Needs 1 NVIDIA GPU, torch+CUDA, cupy, numpy, grpcio, amaxd, and
AMAXD_BIN. Prints PASS/FAIL lines; exit 1 on any FAIL, 3 on a HANG.

  python check.py                 # full GPU check (--backend=cuda)
  python check.py --backend host  # non-GPU smoke: doorbell + OpenDevice refused

Written by a separate reader from the documentation only (docs/API.md), not
from the daemon's code or tests: the "check from outside" of GPU-direct.
"""
import atexit
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import amaxd
from amaxd import errors as E

NQ = 500
EPOCHS = 20
FP8_MAX = np.float32(448.0)
MAGIC = 0x31424441
STEP_LIMIT = 60.0

FAILS = []
PROCS = []


def report(ok, name, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILS.append(name)


# ---------------------------------------------------------------- watchdog
class Watchdog:
    def __init__(self):
        self.name, self.t0, self.active = "start", time.monotonic(), True
        threading.Thread(target=self._run, daemon=True).start()

    def step(self, name):
        self.name, self.t0 = name, time.monotonic()

    def _run(self):
        while True:
            time.sleep(0.5)
            if self.active and time.monotonic() - self.t0 > STEP_LIMIT:
                print(f"HANG in step '{self.name}' (> {STEP_LIMIT:.0f} s)", flush=True)
                cleanup()
                os._exit(3)


WD = Watchdog()


# ---------------------------------------------------------------- daemon
def cleanup():
    for p in PROCS:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(timeout=5)
            except Exception:
                pass


atexit.register(cleanup)


def start_daemon(backend, tag):
    d = tempfile.mkdtemp(prefix=f"amaxd-chk-{tag}-")
    sock = os.path.join(d, "s.sock")
    log = open(os.path.join(d, "amaxd.log"), "w")
    binp = os.environ.get("AMAXD_BIN", "amaxd")
    p = subprocess.Popen([binp, f"--socket={sock}", f"--backend={backend}", "--log-level=info"],
                         stdout=log, stderr=subprocess.STDOUT)
    PROCS.append(p)
    WD.step(f"start daemon {tag}")
    while not (os.path.exists(sock) and os.path.exists(sock + ".door")):
        if p.poll() is not None:
            log.flush()
            print(open(os.path.join(d, "amaxd.log")).read()[-3000:])
            raise RuntimeError(f"amaxd exited with {p.returncode} at start")
        time.sleep(0.05)
    return p, sock, d


def quantizers(prefix="q"):
    return [amaxd.Quantizer(f"{prefix}.{i:04d}", [], amaxd.Recipe.fp8_current())
            for i in range(NQ)]


def u32(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def expect_scale(amax):
    """FP8 E4M3 current scaling: 448/amax in float32; amax 0 -> 1 (NUMERICS)."""
    amax = np.asarray(amax, dtype=np.float32)
    with np.errstate(divide="ignore"):
        s = np.where(amax > 0, FP8_MAX / np.where(amax > 0, amax, np.float32(1)),
                     np.float32(1)).astype(np.float32)
    return s, (np.float32(1) / s).astype(np.float32)


def compare(res, L, ref_amax, snap=None):
    """Bitwise: per cell amax/scale/scale_inv, per quantizer global_*.
    Returns '' if equal else a short reason."""
    ref_amax = np.asarray(ref_amax, dtype=np.float32)
    sc, si = expect_scale(ref_amax)
    offs = np.asarray(L.offsets, dtype=np.int64)
    got = {k: res.arrays()[k].cpu().numpy() for k in
           ("amax", "scale", "scale_inv", "global_amax", "global_scale", "global_scale_inv")}
    want = {"amax": ref_amax, "scale": sc, "scale_inv": si,
            "global_amax": ref_amax[offs], "global_scale": sc[offs], "global_scale_inv": si[offs]}
    for k, w in want.items():
        g = got[k][: len(w)]
        if g.shape != w.shape or not np.array_equal(u32(g), u32(w)):
            bad = np.nonzero(u32(g) != u32(w))[0] if g.shape == w.shape else []
            i = int(bad[0]) if len(bad) else -1
            return (f"{k} differs ({len(bad)} cells; first {i}: got "
                    f"{g[i] if i >= 0 else g.shape} want {w[i] if i >= 0 else w.shape})")
    if snap is not None:
        g = snap.cpu().numpy()
        if not np.array_equal(u32(g), u32(ref_amax)):
            return "amax read on the stream right after the async call (ordered by the done flag) != reference"
    return ""


# ---------------------------------------------------------------- doorbell by hand
def door_request(payload, timeout=10.0, conn=None, path=None):
    s = conn
    if s is None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(timeout)
        s.connect(path)
    s.settimeout(timeout)
    s.send(payload)
    ans = s.recv(65536)
    return s, ans


def req(flags, device_id, epoch, layout_id, rank, job, magic=MAGIC, seq=0, jlen=None):
    """The doorbell request as the daemon and the Python client build it: a
    48-byte header (the doc's 40-byte table plus u32 seq at 40, u32 0 at 44)."""
    jb = job.encode()
    return struct.pack("<IIQQQIIII", magic, flags, device_id, epoch, layout_id, rank,
                       len(jb) if jlen is None else jlen, seq, 0) + jb


def parse_answer(ans):
    if len(ans) < 40:
        return None
    magic, code, ep, nxt, lid, mlen, z = struct.unpack_from("<IIQQQII", ans, 0)
    return dict(magic=magic, code=code, msg=ans[40:40 + mlen].decode("utf-8", "replace"),
                mlen=mlen, total=len(ans))


def check_doorbell_garbage(sock, job, c):
    WD.step("doorbell garbage")
    path = sock + ".door"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path)
    jb = job.encode()
    cases = {
        "10 zero bytes (too short)": b"\x00" * 10,
        "wrong magic": req(1, 1, 0, 1, 0, job, magic=0xDEADBEEF),
        "job length mismatch": req(1, 1, 0, 1, 0, job, jlen=len(jb) + 5),
        "unknown flags": req(0x80, 1, 0, 1, 0, job),
        "no job": req(1, 1, 0, 1, 0, ""),
        "the doc table's 40-byte header": struct.pack("<IIQQQII", MAGIC, 1, 1, 0, 1, 0, len(jb)) + jb,
        "400 random bytes": os.urandom(400),
    }
    for name, payload in cases.items():
        try:
            _, ans = door_request(payload, conn=s)
            a = parse_answer(ans)
            ok = a is not None and a["code"] == 3 and a["magic"] == MAGIC and a["mlen"] > 0
            report(ok, f"d. doorbell garbage [{name}] -> INVALID_ARGUMENT on the same connection",
                   "no answer" if a is None else f"code {a['code']} magic {a['magic']:#x} '{a['msg'][:100]}'")
        except Exception as e:
            report(False, f"d. doorbell garbage [{name}]", f"{type(e).__name__}: {e}")
    s.close()
    WD.step("doorbell: daemon still serves")
    try:
        h = c.health()
        report(True, "d. daemon still serves gRPC after garbage", f"health={h}")
    except Exception as e:
        report(False, "d. daemon still serves gRPC after garbage", f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------- host smoke
def host_mode():
    p, sock, d = start_daemon("host", "host")
    c = amaxd.Client("chk-host", 0, 1, socket=sock, timeout=30)
    WD.step("host join/register")
    c.join(timeout=30)
    c.register(quantizers())
    L = c.layout()
    report(L.total_cells == NQ, "host: layout has one cell per quantizer", f"{L.total_cells}")
    WD.step("host OpenDevice")
    try:
        c._unary("OpenDevice", amaxd.pb.OpenDeviceRequest(job="chk-host", rank=0, layout_id=L.id,
                                                            device="", pid=os.getpid()),
                 amaxd.pb.OpenDeviceResponse)
        report(False, "host: OpenDevice refused", "accepted")
    except E.FailedPrecondition as e:
        report("CUDA backend" in e.message, "host: OpenDevice -> FAILED_PRECONDITION", e.message[:150])
    except Exception as e:
        report(False, "host: OpenDevice refused", f"{type(e).__name__}: {e}")
    try:
        c.open_device()
        report(False, "host: Client.open_device refused", "accepted")
    except (E.FailedPrecondition, amaxd.device.DeviceUnavailable) as e:
        report(True, "host: Client.open_device refused", f"{type(e).__name__}: {str(e)[:120]}")
    # A well-formed doorbell request: the host backend refuses it (FAILED_PRECONDITION, 9).
    jb = b"chk-host"
    _, ans = door_request(req(1, 1, 0, L.id, 0, "chk-host"),
                         path=sock + ".door")
    a = parse_answer(ans)
    report(a is not None and a["code"] == 9, "host: well-formed doorbell request -> FAILED_PRECONDITION",
           str(a and (a["code"], a["msg"][:120])))
    check_doorbell_garbage(sock, "chk-host", c)
    c.close()


# ---------------------------------------------------------------- GPU
def gpu_mode():
    import torch
    torch.cuda.init()
    dev = torch.cuda.current_device()
    stream = torch.cuda.Stream(device=dev)
    gen = torch.Generator(device="cuda").manual_seed(1234)

    def rand_vals(lo=-3.0, hi=3.0):
        # log-uniform positive values on the GPU, queued on the trainer's stream
        return torch.pow(10.0, torch.rand(NQ, device="cuda", generator=gen) * (hi - lo) + lo)

    p, sock, d = start_daemon("cuda", "main")
    job = "chk-main"
    c = amaxd.Client(job, 0, 1, socket=sock, timeout=60)
    with torch.cuda.stream(stream):
        WD.step("join/register/open")
        c.join(timeout=30)
        c.register(quantizers())
        L = c.layout()
        bufs = c.open_device()
        slab = c.device_slab()
        report(L.total_cells == NQ and slab.numel() == NQ and slab.is_cuda and slab.dtype == torch.float32,
               "open_device/device_slab: float32 CUDA view, one cell per quantizer",
               f"cells {L.total_cells} slab {tuple(slab.shape)} {slab.dtype} doorbell "
               f"'{bufs.doorbell}' signals {bufs.signals}")
        report(bufs.doorbell == sock + ".door", "OpenDevice names the doorbell <socket>.door", bufs.doorbell)

        # Epoch 1: send=False; the catalog is agreed; no data -> amax 0, scale 1.
        WD.step("warm-up send=False")
        ref = np.zeros(NQ, dtype=np.float32)
        try:
            res = c.reconcile_device(send=False)
            why = compare(res, L, ref)
            report(not why, "epoch send=False: no data reads amax 0 / scale 1", why)
        except Exception as e:
            report(False, "epoch send=False", f"{type(e).__name__}: {e}")

        # ---------------- 20 blocking epochs
        bad = []
        for ep in range(EPOCHS):
            WD.step(f"blocking epoch {ep}")
            v = rand_vals()
            slab.copy_(v)
            ref = np.maximum(ref, v.cpu().numpy())  # RUNNING_MAX (default accumulation)
            try:
                res = c.reconcile_device()
                why = compare(res, L, ref)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            if why:
                bad.append(f"epoch {ep}: {why}")
        report(not bad, f"reconcile_device x{EPOCHS}: amax/scale/scale_inv/globals bit-exact",
               "; ".join(bad[:3]))

        # ---------------- 20 async epochs
        bad = []
        amax_view = bufs.answer["amax"]
        for ep in range(EPOCHS):
            WD.step(f"async epoch {ep}")
            v = rand_vals()
            slab.copy_(v)
            ref = np.maximum(ref, v.cpu().numpy())
            try:
                t0 = time.perf_counter()
                pend = c.reconcile_device_async()
                dt = time.perf_counter() - t0
                # queued on the trainer's stream behind the done-flag wait:
                snap = amax_view.clone()
                res = pend.result(timeout=30)
                why = compare(res, L, ref, snap=snap)
                if not why and dt > 5:
                    why = f"async call took {dt:.3f} s to return"
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            if why:
                bad.append(f"epoch {ep}: {why}")
        report(not bad, f"reconcile_device_async x{EPOCHS}: result() bit-exact, stream ordered by done flag",
               "; ".join(bad[:3]))

        # ---------------- c. NaN in the slab (blocking, then async)
        for variant in ("blocking", "async"):
            WD.step(f"NaN {variant}")
            v = torch.full((NQ,), 1e6, device="cuda")   # larger than ref: a partial merge would show
            v[NQ // 2] = float("nan")
            slab.copy_(v)
            try:
                if variant == "blocking":
                    c.reconcile_device()
                else:
                    c.reconcile_device_async().result(timeout=30)
                report(False, f"c. NaN in slab ({variant}) -> InvalidArgument", "no error")
            except E.InvalidArgument as e:
                report(True, f"c. NaN in slab ({variant}) -> InvalidArgument", e.message[:120])
            except Exception as e:
                report(False, f"c. NaN in slab ({variant}) -> InvalidArgument", f"{type(e).__name__}: {e}")
            WD.step(f"NaN {variant}: stream free")
            ev = torch.cuda.Event()
            ev.record(stream)
            t0 = time.monotonic()
            while not ev.query() and time.monotonic() - t0 < 30:
                time.sleep(0.01)
            report(ev.query(), f"c. trainer stream completes after the NaN error ({variant})")
            WD.step(f"NaN {variant}: next epoch")
            v = rand_vals()
            slab.copy_(v)
            ref = np.maximum(ref, v.cpu().numpy())
            try:
                res = c.reconcile_device()
                why = compare(res, L, ref)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            report(not why, f"c. next epoch after NaN ({variant}) bit-exact, nothing of the NaN slab merged", why)

        # ---------------- d. garbage on the doorbell, then the daemon still serves
        check_doorbell_garbage(sock, job, c)
        WD.step("d. epoch after garbage")
        v = rand_vals()
        slab.copy_(v)
        ref = np.maximum(ref, v.cpu().numpy())
        try:
            res = c.reconcile_device()
            why = compare(res, L, ref)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        report(not why, "d. device epoch after doorbell garbage bit-exact", why)

        # ---------------- b. SIGSTOP during a blocking call with timeout=3
        WD.step("b. SIGSTOP")
        v1 = rand_vals()
        slab.copy_(v1)
        v1h = v1.cpu().numpy()
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        t0 = time.monotonic()
        try:
            c.reconcile_device(timeout=3)
            report(False, "b. SIGSTOP: reconcile_device(timeout=3) raises", "returned")
        except E.AmaxdError as e:
            dt = time.monotonic() - t0
            report(dt < 10, "b. SIGSTOP: reconcile_device(timeout=3) raises a typed error in time",
                   f"{type(e).__name__} after {dt:.1f} s ({isinstance(e, E.DeadlineExceeded) and 'DeadlineExceeded' or 'other'})")
        except Exception as e:
            report(False, "b. SIGSTOP: typed error", f"{type(e).__name__}: {e}")
        finally:
            os.kill(p.pid, signal.SIGCONT)
        WD.step("b. after SIGCONT")
        # Whether the timed-out slab got merged is not specified: make the next
        # slab dominate both it and the running max, so either way the answer is v2.
        v2 = np.maximum(ref, v1h) * np.float32(2)
        ref = np.maximum(ref, v2)
        why = "not tried"
        for attempt in range(3):
            slab.copy_(torch.from_numpy(v2).to("cuda"))
            try:
                res = c.reconcile_device(timeout=30)
                why = compare(res, L, ref)
                break
            except E.FailedPrecondition as e:  # the epoch moved on: client learned it; retry
                why = f"FailedPrecondition x{attempt + 1}: {e.message[:100]}"
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                break
        report(not why, "b. after SIGCONT: next epoch bit-exact", why)
        ev = torch.cuda.Event()
        ev.record(stream)
        t0 = time.monotonic()
        while not ev.query() and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        report(ev.query(), "b. trainer stream completes after SIGSTOP/SIGCONT")

        # ---------------- a. kill -9 while an async call's stream waits
        WD.step("a. 2-rank job join")
        job2 = "chk-kill"
        c0 = amaxd.Client(job2, 0, 2, socket=sock, timeout=60)
        c1 = amaxd.Client(job2, 1, 2, socket=sock, timeout=60)
        errs = []
        t1 = threading.Thread(target=lambda: (c1.join(timeout=30), c1.register(quantizers("k"))),
                              daemon=True)
        t1.start()
        c0.join(timeout=30)
        c0.register(quantizers("k"))
        t1.join(timeout=30)
        L0 = c0.layout()
        slab0 = c0.device_slab()
        slab0.copy_(rand_vals())
        WD.step("a. async call that waits for rank 1")
        try:
            pend = c0.reconcile_device_async()
        except Exception as e:
            report(False, "a. reconcile_device_async on the 2-rank job", f"{type(e).__name__}: {e}")
            pend = None
        marker = torch.zeros(1, device="cuda")
        marker.add_(1)  # queued behind the done-flag wait
        ev = torch.cuda.Event()
        ev.record(stream)
        time.sleep(1.5)
        report(not ev.query() and (pend is None or not pend.done()),
               "a. stream waits on the GPU for the daemon (rank 1 absent)",
               f"event done={ev.query()} pending done={pend is not None and pend.done()}")
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        WD.step("a. after kill -9: stream")
        t0 = time.monotonic()
        while not ev.query() and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        report(ev.query(), "a. after kill -9 the trainer's stream completes",
               f"{time.monotonic() - t0:.2f} s")
        WD.step("a. after kill -9: result()")
        if pend is not None:
            t0 = time.monotonic()
            try:
                pend.result(timeout=40)
                report(False, "a. result() raises after kill -9", "returned a result")
            except E.DeadlineExceeded as e:
                report("no answer from the daemon within" not in e.message,
                       "a. result() raises after kill -9 (not just result's own timeout)", e.message[:120])
            except E.AmaxdError as e:
                report(True, "a. result() raises a typed error after kill -9",
                       f"{type(e).__name__} after {time.monotonic() - t0:.2f} s: {e.message[:100]}")
            except Exception as e:
                report(False, "a. result() raises a typed error after kill -9", f"{type(e).__name__}: {e}")
        for cl in (c0, c1, c):
            try:
                cl.close()
            except Exception:
                pass

    # ---------------- restart cleanly: a fresh daemon serves correct bytes
    WD.step("restart")
    p2, sock2, _ = start_daemon("cuda", "restart")
    c2 = amaxd.Client("chk-restart", 0, 1, socket=sock2, timeout=60)
    with torch.cuda.stream(stream):
        c2.join(timeout=30)
        c2.register(quantizers())
        L2 = c2.layout()
        s2 = c2.device_slab()
        v = rand_vals()
        s2.copy_(v)
        r2 = np.maximum(np.zeros(NQ, np.float32), v.cpu().numpy())
        try:
            why = compare(c2.reconcile_device(), L2, r2)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        report(not why, "a. restarted daemon: first device epoch bit-exact", why)
        try:
            c2.close_device()
            c2.close()
        except Exception:
            pass


def main():
    backend = "cuda"
    if "--backend" in sys.argv:
        backend = sys.argv[sys.argv.index("--backend") + 1]
    try:
        host_mode() if backend == "host" else gpu_mode()
    except Exception as e:
        import traceback
        traceback.print_exc()
        report(False, "script ran to the end", f"{type(e).__name__}: {e}")
    WD.active = False
    cleanup()
    print(f"{'FAIL' if FAILS else 'PASS'} overall: {len(FAILS)} failed", flush=True)
    os._exit(1 if FAILS else 0)


if __name__ == "__main__":
    main()
