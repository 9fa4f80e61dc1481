#!/usr/bin/env python3
"""What a snapshot costs an epoch (docs/OPERATING.md, "Durability").

For catalogs of N float32 cells (one rank, per-channel FP8 quantizers of
65536 cells), times a whole epoch (SendAmax of every cell + Reconcile of one
small quantizer) against a daemon without state_dir (the floor) and one
writing a snapshot of every epoch into --dir (fsync included), in the same
run. The daemon's own figure (Status.last_epoch_us) and the snapshot size
are printed too. Median of --repeat epochs; nothing is asserted.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

import amaxd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q = 65536


def start(bin_path, sock, extra=()):
    p = subprocess.Popen([bin_path, f"--socket={sock}", "--log-level=warn", *extra])
    for _ in range(200):
        if os.path.exists(sock):
            return p
        time.sleep(0.05)
    raise RuntimeError("daemon did not start")


def run(bin_path, cells, repeat, state_dir):
    tmp = tempfile.mkdtemp(prefix="amaxd-snapbench-")
    sock = os.path.join(tmp, "s.sock")
    extra = [f"--state-dir={state_dir}"] if state_dir else []
    p = start(bin_path, sock, extra)
    try:
        nq = max(1, cells // Q)
        names = [f"layer{i:05d}.weight" for i in range(nq)]
        with amaxd.Client("bench", 0, 1, socket=sock, timeout=600) as c:
            c.join()
            c.register([amaxd.Quantizer(n, [Q], amaxd.Recipe.fp8_current()) for n in names] +
                       [amaxd.Quantizer("tiny", [], amaxd.Recipe.fp8_current())])
            rng = np.random.default_rng(0)
            vals = rng.uniform(0, 4, Q).astype(np.float32)
            times, eng = [], []
            for _ in range(repeat + 1):
                for k in range(0, nq, 16):
                    c.send({n: vals for n in names[k:k + 16]})
                c.send({"tiny": 1.0})
                t0 = time.perf_counter()
                c.reconcile(names=["tiny"])
                times.append(time.perf_counter() - t0)
                eng.append(c.status("bench").jobs[0].last_epoch_us)
        size = os.path.getsize(os.path.join(state_dir, "bench.amxs")) if state_dir else 0
        return statistics.median(times[1:]), statistics.median(eng[1:]), size
    finally:
        p.terminate()
        p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("AMAXD_BIN", os.path.join(ROOT, "build", "amaxd")))
    ap.add_argument("--cells", default="1048576,16777216")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where snapshots go (default: a directory under /var/tmp)")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="amaxd-snapdir-", dir="/var/tmp")
    print(f"{'cells':>10} {'snapshot MB':>12} {'Reconcile, none':>16} {'with snapshot':>14} "
          f"{'ratio':>6} {'engine us none':>15} {'engine us snap':>15}")
    for cells in (int(x) for x in a.cells.split(",")):
        sd = os.path.join(base, f"s{cells}")
        os.makedirs(sd, exist_ok=True)
        t0, e0, _ = run(a.bin, cells, a.repeat, None)
        t1, e1, size = run(a.bin, cells, a.repeat, sd)
        print(f"{cells:>10} {size / 1e6:>12.1f} {t0 * 1e3:>14.2f}ms {t1 * 1e3:>12.2f}ms "
              f"{t1 / t0:>6.2f} {e0:>15.0f} {e1:>15.0f}")
    if not a.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
