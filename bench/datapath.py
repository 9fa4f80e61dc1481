#!/usr/bin/env python3
"""The data path against its floor (issue 7), every row in one run.

    AMAXD_BIN=build/amaxd .venv/bin/python bench/datapath.py [--repeat 3]

Starts amaxd (host backend) on a temporary Unix socket for each case and
prints one table, each value the median of --repeat runs, each floor
measured in the same run:

  epoch rows   W trainer ranks (one process each), one epoch = every rank
               sends its amax and reconciles, and has its results as numpy
               arrays; wall time from the first send to the last rank's
               results, median over the steady epochs (the first epoch,
               which agrees the catalog, is left out). Named form:
               Client.send({name: value}) + Client.reconcile(); packed form:
               send_packed(slab) + reconcile_packed(); shm: the packed form
               through the daemon's shared-memory buffer (Client(shm=True)).
               Floor: the same bytes (every rank's request and answer of
               the packed form) written through a pipe to `cat >/dev/null`,
               plus a numpy max over the W slabs.
  StreamAmax   8 MiB messages (one quantizer / one slab of 2M cells),
               serialized beforehand, MB/s of float32 payload. Floor: the
               same bytes through a pipe to cat.
  unary        bench/unary_client (gRPC C core, 32 calls in flight, one
               channel) sending SendAmax (one scalar update) / SendPacked
               (a one-cell slab), calls/s. Floor: the same client against
               bench/min_server (a C-core server answering every call with
               an empty message from its completion-queue thread).
  RSS          the daemon's VmHWM (peak) and VmRSS after the last epoch
               (steady state), /proc/PID/status.
"""
import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("AMAXD_BIN", os.path.join(ROOT, "build", "amaxd"))
BUILD = os.environ.get("AMAXD_BUILD_DIR", os.path.dirname(os.path.abspath(BIN)))


def start_daemon(sock, *extra):
    # AMAXD_DAEMON_ARGS: more flags for every daemon (e.g. --socket_guard=false).
    more = os.environ.get("AMAXD_DAEMON_ARGS", "").split()
    p = subprocess.Popen([BIN, f"--socket={sock}", "--log-level=warn", *more, *extra])
    for _ in range(400):
        if os.path.exists(sock):
            return p
        time.sleep(0.025)
    raise RuntimeError("amaxd did not start")


def rss(pid):
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


# ---- the ranks (one process each) ----

def catalog(case, W, rank):
    import amaxd
    from amaxd import placement as P
    R = amaxd.Recipe
    if case["kind"] == "tensor":
        qs = [amaxd.Quantizer(f"t{i:06d}", [], R.fp8_current()) for i in range(case["nq"])]
        qs.append(amaxd.Quantizer("blk", [W, case["cells"]], R.nvfp4(),
                                  P.shard([W, case["cells"]], 0, rank, W)))
    else:
        qs = [amaxd.Quantizer(f"c{i:04d}", [case["qcells"]], R.fp8_current(),
                              P.column_parallel([case["qcells"]], rank, W))
              for i in range(case["nq"])]
    return qs


def rank_main(conn, sock, job, W, rank, case, form):
    import amaxd
    with amaxd.Client(job, rank, W, socket=sock, timeout=600, shm=form == "shm") as c:
        c.join()
        qs = catalog(case, W, rank)
        c.register(qs)
        rng = np.random.default_rng(rank)
        packed = form in ("packed", "shm")
        if packed:
            L = c.layout()
            n = L.total_cells
        else:
            shapes = {q.name: (q.placement.local_shape if q.placement else ()) for q in qs}
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            # Values for this epoch, made before the clock starts.
            if packed:
                slab = rng.random(n, dtype=np.float32)
            else:
                vals = {k: rng.random(s, dtype=np.float32) if s else np.float32(rng.random())
                        for k, s in shapes.items()}
            conn.send("set")
            conn.recv()  # go
            if packed:
                c.send_packed(slab)
                res = c.reconcile_packed()
                ok = res.amax.size == n
                if ok:
                    c.layout()  # the layout of the next epoch (cached)
            else:
                c.send(vals)
                res = c.reconcile()
                ok = len(res) == len(vals)
            conn.send(("done", time.perf_counter(), ok))


def run_epochs(sock, job, W, case, form, epochs):
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(W):
        a, b = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(b, sock, job, W, r, case, form))
        p.start()
        pipes.append(a)
        procs.append(p)
    for a in pipes:
        assert a.recv() == "ready"
    times = []
    for _ in range(epochs):
        for a in pipes:
            a.send("epoch")
        for a in pipes:
            a.recv()
        t0 = time.perf_counter()
        for a in pipes:
            a.send("go")
        ends = [a.recv() for a in pipes]
        assert all(e[2] for e in ends), "a rank got an incomplete answer"
        times.append(max(e[1] for e in ends) - t0)
    for a in pipes:
        a.send("stop")
    for p in procs:
        p.join(60)
    return times


def floor_epoch(W, cells_per_rank, nq_per_rank):
    """The same bytes through a pipe, plus a numpy max over the W slabs."""
    req = cells_per_rank * 4 + 64
    ans = cells_per_rank * 13 + nq_per_rank * 26 + 64
    buf = np.ones(max(req, ans), dtype=np.uint8)
    slabs = np.random.default_rng(0).random((W, cells_per_rank), dtype=np.float32)
    cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    t0 = time.perf_counter()
    for _ in range(W):
        cat.stdin.write(memoryview(buf)[:req])
        cat.stdin.write(memoryview(buf)[:ans])
    np.maximum.reduce(slabs, axis=0)
    cat.stdin.close()
    cat.wait()
    return time.perf_counter() - t0


def epoch_case(tmp, label, W, case, form, epochs):
    sock = os.path.join(tmp, f"e-{form}-{W}-{case['kind']}.sock")
    d = start_daemon(sock)
    try:
        times = run_epochs(sock, "bench", W, case, form, epochs)
        mem = rss(d.pid)
    finally:
        d.terminate()
        d.wait(60)
    return statistics.median(times[1:]), mem


# ---- StreamAmax ----

def stream_case(tmp, nmsg, cells, form):
    import amaxd
    from amaxd import pb
    from amaxd.packed import encode_send_packed
    import grpc
    sock = os.path.join(tmp, f"s-{form}.sock")
    d = start_daemon(sock)
    try:
        with amaxd.Client("s", 0, 1, socket=sock, timeout=600) as c:
            c.join()
            c.register([amaxd.Quantizer("big", [cells], amaxd.Recipe.fp8_current())])
            vals = np.random.default_rng(0).random(cells, dtype=np.float32)
            if form == "packed":
                blob = encode_send_packed("s", 0, 0, c.layout().id, vals)
                method = "/amaxd.v1.Calibration/StreamPacked"
            else:
                blob = pb.SendAmaxRequest(job="s", rank=0, updates=[
                    pb.AmaxUpdate(name="big", values=vals.tobytes())]).SerializeToString()
                method = "/amaxd.v1.Calibration/StreamAmax"
            opts = [("grpc.max_send_message_length", -1)]
            with grpc.insecure_channel("unix:" + sock, options=opts) as ch:
                st = ch.stream_unary(method)
                st(iter([blob] * 2), timeout=600)  # warm-up
                t0 = time.perf_counter()
                st(iter([blob] * nmsg), timeout=600)
                dt = time.perf_counter() - t0
            # The floor, same bytes, same run.
            cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
            t0 = time.perf_counter()
            for _ in range(nmsg):
                cat.stdin.write(blob)
            cat.stdin.close()
            cat.wait()
            fl = time.perf_counter() - t0
    finally:
        d.terminate()
        d.wait(60)
    mb = nmsg * cells * 4 / 1e6
    return mb / dt, mb / fl


# ---- unary from the C client ----

def unary_case(tmp, form, seconds, inflight):
    import amaxd
    from amaxd import pb
    from amaxd.packed import encode_send_packed
    sock = os.path.join(tmp, f"u-{form}.sock")
    d = start_daemon(sock)
    req = os.path.join(tmp, f"u-{form}.bin")
    try:
        with amaxd.Client("u", 0, 1, socket=sock) as c:
            c.join()
            c.register([amaxd.Quantizer("s", [], amaxd.Recipe.fp8_current())])
            if form == "packed":
                data = encode_send_packed("u", 0, 0, c.layout().id, np.ones(1, np.float32))
                method = "/amaxd.v1.Calibration/SendPacked"
            else:
                data = pb.SendAmaxRequest(job="u", rank=0, updates=[pb.AmaxUpdate(
                    name="s", values=np.float32(1.5).tobytes())]).SerializeToString()
                method = "/amaxd.v1.Calibration/SendAmax"
            with open(req, "wb") as f:
                f.write(data)
            out = subprocess.run([os.path.join(BUILD, "unary_client"), "unix:" + sock, method,
                                  req, str(inflight), str(seconds)], capture_output=True,
                                 text=True, check=True).stdout.split()
            rate, errs = float(out[5]), int(out[7])
            assert errs == 0, "unary calls failed"
    finally:
        d.terminate()
        d.wait(60)
    msock = os.path.join(tmp, f"m-{form}.sock")
    m = subprocess.Popen([os.path.join(BUILD, "min_server"), "unix:" + msock])
    try:
        for _ in range(200):
            if os.path.exists(msock):
                break
            time.sleep(0.025)
        out = subprocess.run([os.path.join(BUILD, "unary_client"), "unix:" + msock,
                              "/amaxd.v1.Calibration/SendAmax", req, str(inflight),
                              str(seconds)], capture_output=True, text=True,
                             check=True).stdout.split()
        floor = float(out[5])
    finally:
        m.terminate()
        m.wait(30)
    return rate, floor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4, help="per run; the first is left out")
    ap.add_argument("--stream-msgs", type=int, default=32)
    ap.add_argument("--unary-seconds", type=float, default=2.0)
    ap.add_argument("--only", default="", help="comma list of: w8,w2,big,stream,unary")
    ap.add_argument("--forms", default="named,packed,shm",
                    help="epoch rows: named,packed,shm; streams and unary: named,packed")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else {"w8", "w2", "big", "stream", "unary"}
    forms = args.forms.split(",")
    tmp = tempfile.mkdtemp(prefix="amaxd-datapath-")
    rows = []

    tensor = {"kind": "tensor", "nq": 100_000, "cells": 100_000}
    big = {"kind": "channel", "nq": 1000, "qcells": 10_000}
    epoch_cases = [("w8", "W=8, 100k per-tensor + 1e5 block cells/rank", 8, tensor),
                   ("w2", "W=2, 100k per-tensor + 1e5 block cells/rank", 2, tensor),
                   ("big", "W=8, 1k quantizers, 1e7 cells (1.25e6/rank)", 8, big)]
    for key, label, W, case in epoch_cases:
        if key not in only:
            continue
        if case["kind"] == "tensor":
            cells, nq = case["nq"] + case["cells"], case["nq"] + 1
        else:
            cells, nq = case["nq"] * case["qcells"] // W, case["nq"]
        for form in forms:
            vals, floors, peaks, steadies = [], [], [], []
            for _ in range(args.repeat):
                t, mem = epoch_case(tmp, label, W, case, form, args.epochs)
                vals.append(t)
                floors.append(statistics.median(floor_epoch(W, cells, nq) for _ in range(3)))
                peaks.append(mem["VmHWM"])
                steadies.append(mem["VmRSS"])
            v, f = statistics.median(vals), statistics.median(floors)
            pk, sd = statistics.median(peaks), statistics.median(steadies)
            rows.append((f"{label}, {form}", f"{v:.3f} s", f"{f:.3f} s", f"{v / f:.1f}x",
                         f"{pk / 2**20:.0f}/{sd / 2**20:.0f} MiB = {pk / sd:.2f}x"))
            print(*rows[-1], sep=" | ", flush=True)
    if "stream" in only:
        for form in (f for f in forms if f != "shm"):
            r = [stream_case(tmp, args.stream_msgs, 2 << 20, form) for _ in range(args.repeat)]
            v = statistics.median(x[0] for x in r)
            f = statistics.median(x[1] for x in r)
            name = "StreamAmax" if form == "named" else "StreamPacked"
            rows.append((f"{name}, 8 MiB messages", f"{v:.0f} MB/s", f"{f:.0f} MB/s (pipe)",
                         f"{v / f:.2f}x", ""))
            print(*rows[-1], sep=" | ", flush=True)
    if "unary" in only:
        for form in (f for f in forms if f != "shm"):
            r = [unary_case(tmp, form, args.unary_seconds, 32) for _ in range(args.repeat)]
            v = statistics.median(x[0] for x in r)
            f = statistics.median(x[1] for x in r)
            name = "SendAmax (1 scalar)" if form == "named" else "SendPacked (1 cell)"
            rows.append((f"unary {name}, C client, 32 in flight", f"{v:.0f}/s",
                         f"{f:.0f}/s (min C-core server)", f"{v / f:.2f}x", ""))
            print(*rows[-1], sep=" | ", flush=True)
    print()
    print(f"amaxd data path, host backend, Unix socket, {os.cpu_count()} CPUs, median of "
          f"{args.repeat} runs")
    print("| case | value | floor | ratio | daemon peak/steady RSS |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
