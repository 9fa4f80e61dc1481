"""The first epoch of a job over N real daemons on loopback, for one or more
amaxd binaries in the same run (issue 24; docs/CLUSTER.md, "What agreement
costs").

N daemons (host backend, Gloo; daemon 0 is the coordinator), one trainer
rank per daemon, every rank registering the same Q per-tensor quantizers
(the data-parallel common case). Measured per binary and N: the first epoch
(every rank registered and sent, then Reconcile: agreement, rendezvous, the
collective), the coordinator's CPU time, the resident memory of the
coordinator and of the largest member afterwards, the CPU time of all
daemons together (on a host with fewer cores than daemons, the first epoch's
wall time follows it), and the bytes through the loopback interface (every
peer call and collective of all daemons). Then one rank adds one
quantizer: the epoch that agrees it.

    python bench/scale_real.py --amaxd before=/tmp/orig/build/amaxd --amaxd after=build/amaxd \
        --daemons 8,64 --quantizers 20000
"""
import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
sys.path.insert(0, os.path.join(ROOT, "tests", "cluster"))
import amaxd  # noqa: E402
import amaxd_proc  # noqa: E402
from conftest import Cluster  # noqa: E402


def lo_bytes():
    """Bytes through the loopback interface: every peer call and collective
    of the run (the trainers' Unix sockets are not on it)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, v = line.partition(":")
            if name.strip() == "lo":
                return int(v.split()[0])
    return 0


def proc_stat(pid):
    m = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                m[k] = int(v.split()[0]) * 1024
    m["lo"] = lo_bytes()
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    m["cpu"] = (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")
    return m


def run(binary, n, q, tmp):
    amaxd_proc.BIN = binary
    root = tempfile.mkdtemp(dir=tmp)
    c = Cluster(root, n, "--log-level=info", "--join-timeout-ms=600000",
                "--reconcile-timeout-ms=600000")
    qs = [amaxd.Quantizer(f"model.layers.{i // 8:05d}.q{i % 8}.input_quantizer", [],
                          amaxd.Recipe.fp8_current()) for i in range(q)]
    vals = {x.name: 1.0 for x in qs[:64]}
    cls = [amaxd.Client("scale", r, n, socket=c.socket(r), timeout=900) for r in range(n)]
    bar = threading.Barrier(n + 1)
    done = threading.Barrier(n + 1)
    errs = []

    def rank(r):
        try:
            cls[r].join()
            cls[r].register(qs)
            cls[r].send(vals)
            bar.wait()
            cls[r].reconcile(names=[qs[0].name])
            done.wait()
            bar.wait()
            if r == 0:
                cls[r].register([amaxd.Quantizer("zz.added", [], amaxd.Recipe.fp8_current())])
            cls[r].send(vals)
            cls[r].reconcile(names=[qs[0].name])
            done.wait()
        except Exception as e:  # noqa: BLE001
            errs.append((r, e))
            bar.abort()
            done.abort()
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in ts:
        t.start()
    out = {}
    try:
        bar.wait()
        s0 = proc_stat(c[0].proc.pid)
        a0 = sum(proc_stat(c[i].proc.pid)["cpu"] for i in range(n))
        t0 = time.monotonic()
        done.wait()
        out["first"] = time.monotonic() - t0
        s1 = proc_stat(c[0].proc.pid)
        out["all_cpu"] = sum(proc_stat(c[i].proc.pid)["cpu"] for i in range(n)) - a0
        out["coord_rss"] = s1["VmRSS"]
        out["coord_hwm"] = s1["VmHWM"]
        out["member_rss"] = max(proc_stat(c[i].proc.pid)["VmRSS"] for i in range(1, n))
        out["lo"] = s1["lo"] - s0["lo"]
        out["cpu"] = s1["cpu"] - s0["cpu"]
        bar.wait()
        t0 = time.monotonic()
        done.wait()
        out["change"] = time.monotonic() - t0
        s2 = proc_stat(c[0].proc.pid)
        out["change_cpu"] = s2["cpu"] - s1["cpu"]
        out["change_lo"] = s2["lo"] - s1["lo"]
    except threading.BrokenBarrierError:
        pass
    for t in ts:
        t.join(900)
    for x in cls:
        x.close()
    c.stop_all()
    if errs:
        raise RuntimeError(f"{binary} N={n}: {errs[:3]}\n{c.logs()[-4000:]}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--amaxd", action="append", required=True, help="label=path, repeatable")
    ap.add_argument("--daemons", default="8,64")
    ap.add_argument("--quantizers", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=1, help="runs per cell (the median is printed)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="amaxd-scale-")
    bins = [a.split("=", 1) for a in args.amaxd]
    print(f"# scale_real: Q = {args.quantizers} per-tensor quantizers on every rank, one rank "
          f"per daemon, Gloo on loopback, {os.cpu_count()} CPUs; median of {args.reps}")
    print("| amaxd | N | first epoch | all daemons' CPU | coordinator CPU | coordinator RSS (peak) | "
          "member RSS | "
          "loopback bytes | one quantizer added | its coordinator CPU | its loopback bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in [int(x) for x in args.daemons.split(",")]:
        for label, path in bins:
            rs = [run(os.path.abspath(path), n, args.quantizers, tmp) for _ in range(args.reps)]

            def med(k):
                return statistics.median(r[k] for r in rs)
            print(f"| {label} | {n} | {med('first') * 1e3:.0f} ms | {med('all_cpu') * 1e3:.0f} ms | "
                  f"{med('cpu') * 1e3:.0f} ms | "
                  f"{med('coord_rss') / 1e6:.0f} MB ({med('coord_hwm') / 1e6:.0f} MB) | "
                  f"{med('member_rss') / 1e6:.0f} MB | {med('lo') / 1e6:.1f} MB | "
                  f"{med('change') * 1e3:.0f} ms | {med('change_cpu') * 1e3:.0f} ms | "
                  f"{med('change_lo') / 1e6:.2f} MB |",
                  flush=True)


if __name__ == "__main__":
    main()
