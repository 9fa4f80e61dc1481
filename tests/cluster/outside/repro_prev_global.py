#!/usr/bin/env python3
"""Reproducer: after a daemon restarted from a snapshot older than its
peers' epoch catches up from a donor, GetScales on it (which the docs tell
its ranks to use: "read epoch E's results with GetScales (the bytes every
other rank got)") answers epoch E's amax/scales but the
previous_global_amax / previous_global_scale of an older epoch.

2 daemons (Gloo, loopback), both with state_dir; the restarted daemon has
snapshot_interval_ms=600000 (or --coord: the coordinator is the one
restarted) so that its snapshot is behind (docs/OPERATING.md: "After a crash
the job restarts from its last snapshot ... behind"; CLUSTER.md "Failures":
"restarts from a snapshot older than its peers' epoch ... catches up from a
donor").  One per-tensor FP8 current quantizer, PER_EPOCH; rank r sends
amax = 2**epoch + r each epoch, so epoch k's global amax is 2**k + 1.

Run: .venv/bin/python tests/cluster/outside/repro_prev_global.py [--coord]  (from the repository)
"""
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import amaxd
from amaxd import errors as E
from amaxd import pb

AMAXD = os.environ.get("AMAXD_BIN", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "..", "..", "build", "amaxd"))
VICTIM = 0 if "--coord" in sys.argv else 1


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


root = tempfile.mkdtemp(prefix="amx-repro-prev-")
secret = os.path.join(root, "secret")
open(secret, "w").write("0123456789abcdef0123456789abcdef\n")
os.chmod(secret, 0o600)
ports = [free_port(), free_port()]
procs = [None, None]


def start(i):
    args = [AMAXD, f"--socket={root}/d{i}.sock", "--cluster_size=2", f"--cluster_rank={i}",
            f"--coordinator=127.0.0.1:{ports[0]}", f"--peer_listen=127.0.0.1:{ports[i]}",
            f"--peer_advertise=127.0.0.1:{ports[i]}", f"--cluster_secret_file={secret}",
            "--gloo_host=127.0.0.1", "--backend=host", "--shm_dir=",
            f"--state_dir={root}/state{i}", "--reconcile_timeout_ms=3000"]
    if i == VICTIM:
        args.append("--snapshot_interval_ms=600000")
    log = open(f"{root}/d{i}.log", "a")
    off = log.tell()
    procs[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(500):
        if "main: ready" in open(f"{root}/d{i}.log").read()[off:]:
            return
        time.sleep(0.01)
    raise RuntimeError("not ready")


Q = [amaxd.Quantizer("q", [], amaxd.Recipe.fp8_current(), accumulation=amaxd.PER_EPOCH)]
JOB = "repro"


def client(r):
    return amaxd.Client(JOB, r, 2, socket=f"{root}/d{r}.sock", timeout=20)


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def epoch(cs, k):
    def one(r):
        cs[r].send({"q": float(2 ** k + r)}, epoch=k)
        resp = cs[r]._unary("Reconcile", pb.ReconcileRequest(job=JOB, rank=r, epoch=k),
                            pb.ReconcileResponse)
        return resp
    with ThreadPoolExecutor(2) as ex:
        return list(ex.map(one, range(2)))


try:
    start(0)
    start(1)
    cs = [client(0), client(1)]
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda r: (cs[r].join(), cs[r].register(Q)), range(2)))
    want = {}
    for k in (1, 2, 3):
        rs = epoch(cs, k)
        q = rs[0].results[0]
        want[k] = (q.global_amax, q.global_scale, q.has_previous, q.previous_global_amax,
                   q.previous_global_scale)
        print(f"epoch {k}: global_amax {q.global_amax} previous_global_amax "
              f"{q.previous_global_amax if q.has_previous else None}")
    print(f"kill -9 daemon {VICTIM} between epochs 3 and 4, restart it")
    procs[VICTIM].send_signal(signal.SIGKILL)
    procs[VICTIM].wait()
    start(VICTIM)
    cs[VICTIM].close()
    cs[VICTIM] = client(VICTIM)
    other = 1 - VICTIM
    jr = {}

    def victim():
        t_end = time.time() + 20
        j = None
        while time.time() < t_end:
            try:
                if j is None:
                    j = cs[VICTIM].join(timeout=10)
                    print(f"rank {VICTIM} re-Join: epoch {j.epoch} rejoined {j.rejoined}")
                cs[VICTIM].send({"q": float(2 ** j.epoch + VICTIM)}, epoch=j.epoch)
                r = cs[VICTIM]._unary("Reconcile", pb.ReconcileRequest(job=JOB, rank=VICTIM,
                                                                     epoch=j.epoch), pb.ReconcileResponse)
                return ("answer", r.epoch)
            except E.FailedPrecondition as err:
                print(f"rank {VICTIM}: FAILED_PRECONDITION {err.message[:200]}")
                return ("error", err.code.name)
            except E.AmaxdError as err:
                print(f"rank {VICTIM}: {err.code.name} {err.message[:120]} (retrying)")
                time.sleep(0.1)
        return ("gave up",)

    def survivor():
        t_end = time.time() + 20
        while time.time() < t_end:
            try:
                cs[other].send({"q": float(2 ** 4 + other)}, epoch=4)
                r = cs[other]._unary("Reconcile", pb.ReconcileRequest(job=JOB, rank=other, epoch=4),
                                     pb.ReconcileResponse, timeout=5)
                return ("answer", r.epoch)
            except E.AmaxdError as err:
                print(f"rank {other}: {err.code.name} {err.message[:120]} (retrying)")
                time.sleep(0.1)
        return ("gave up",)
    with ThreadPoolExecutor(2) as ex:
        fv, fs = ex.submit(victim), ex.submit(survivor)
        print(f"rank {VICTIM} Reconcile(epoch=<Join's>):", fv.result())
        # the docs: the behind daemon's ranks read epoch E's results with GetScales
        g = cs[VICTIM]._unary("GetScales", pb.GetScalesRequest(job=JOB, rank=VICTIM),
                              pb.GetScalesResponse)
        q = g.results[0]
        got = (q.global_amax, q.global_scale, q.has_previous, q.previous_global_amax,
               q.previous_global_scale)
        print(f"GetScales on daemon {VICTIM} (restarted): epoch {g.epoch} global_amax {q.global_amax} "
              f"has_previous {q.has_previous} previous_global_amax {q.previous_global_amax} "
              f"previous_global_scale {q.previous_global_scale}")
        print(f"epoch {g.epoch} as every rank got it in Reconcile: global_amax {want[g.epoch][0]} "
              f"previous_global_amax {want[g.epoch][3]} previous_global_scale {want[g.epoch][4]}")
        ok = got == want[g.epoch]
        # ... and send for the open epoch, so the survivor's epoch 4 completes
        st = cs[VICTIM].status(JOB).jobs[0].epoch
        cs[VICTIM].send({"q": float(2 ** st + VICTIM)}, epoch=st)
        r = cs[VICTIM]._unary("Reconcile", pb.ReconcileRequest(job=JOB, rank=VICTIM, epoch=st),
                              pb.ReconcileResponse)
        print(f"rank {VICTIM} Reconcile(epoch={st}) -> epoch {r.epoch}; rank {other}:", fs.result())
    print("PASS" if ok else "FAIL", "GetScales on the caught-up daemon == the epoch's Reconcile answer")
    print("overall:", 0 if ok else 1, "failed")
finally:
    for p in procs:
        if p and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
    print("logs:", root)
