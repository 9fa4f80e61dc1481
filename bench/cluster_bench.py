"""Reconcile latency of a job spread over several daemons, against its floors,
in one run (docs/CLUSTER.md; bench/NOTES.md says how to run it).

N daemons (one per GPU, CUDA backend, NCCL; or on CPU, host backend and
Gloo) serve a job of N trainer ranks, one per daemon, whose catalog holds
PER_TENSOR per-tensor quantizers plus CHANNEL_Q per-channel quantizers of
CHANNELS cells each (sharded over the ranks). Every epoch each rank sends
new amax for every quantizer and reconciles; each daemon reports what its
epoch cost (Status: from the hand-off to its engine thread to published
results; the collective part; the finish). The first epoch, which agrees on
the catalog and creates the communicator, is reported apart.

Floors, measured in the same run on the same devices by bench/nccl_floor
(GPU only):
  (a) one packed all-reduce of the same number of cells (header included),
      and (a') the same on a non-blocking communicator, the kind amaxd's
      all-reduces use with AMAXD_NCCL_BLOCKING=0 (by default a blocking child);
  (b) one all-reduce per quantizer, what a per-quantizer loop does;
  (a'') (a) after the GPUs sat idle for IDLE_MS (--idle-ms, 0: not run),
      each run timed from the last rank's start to the last rank's end:
      the daemons' epochs here come ~1 s apart (the trainers send named
      amax), where (a) runs back to back.

After a pause the same all-reduce takes about twice as long (bench/NOTES.md,
seventh session): compare the epoch with (a'') as well.

    python bench/cluster_bench.py --amaxd build-gpu/amaxd --floor build-gpu/nccl_floor \
        --daemons 2 [--per-tensor 100000 --channel-q 1000 --channels 10000 --epochs 10]
"""
import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "e2e"))

HDR = 32  # header cells of every collective (daemon/state.h)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def trainer(sock, rank, world, args, q):
    """One rank: register everything, then `epochs` epochs of send + reconcile."""
    import amaxd
    from amaxd import placement as P
    rng = np.random.default_rng(rank)
    per = [f"pt.{i:06d}" for i in range(args.per_tensor)]
    chans = [f"pc.{i:05d}" for i in range(args.channel_q)]
    specs = [amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current()) for n in per]
    specs += [amaxd.Quantizer(n, [args.channels], amaxd.Recipe.fp8_current(),
                              P.column_parallel([args.channels], rank, world)) for n in chans]
    local = args.channels // world
    with amaxd.Client("bench", rank, world, socket=sock, timeout=600,
                      max_message_bytes=512 << 20) as c:
        c.join()
        for i in range(0, len(specs), 50000):
            c.register(specs[i:i + 50000])
        q.put(("ready", rank))
        for e in range(args.epochs):
            vals = rng.random(args.per_tensor, dtype=np.float32)
            c.send({n: float(v) for n, v in zip(per, vals)})
            block = rng.random((args.channel_q, local), dtype=np.float32)
            c.send({n: block[i] for i, n in enumerate(chans)})
            c.reconcile(names=[chans[0]])
            q.put(("epoch", rank, e))
    return rank


def run_daemons(args, tmp):
    os.environ["AMAXD_BIN"] = os.path.abspath(args.amaxd)
    from amaxd_proc import Daemon
    n = args.daemons
    ports = free_ports(n)
    secret = os.path.join(tmp, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(24).hex().encode())
    os.chmod(secret, 0o600)
    gpu = args.collective == "nccl"
    ds = []
    for i in range(n):
        d = os.path.join(tmp, f"d{i}")
        os.makedirs(d)
        flags = [f"--cluster-size={n}", f"--cluster-rank={i}",
                 f"--coordinator=127.0.0.1:{ports[0]}", f"--peer-listen=127.0.0.1:{ports[i]}",
                 f"--peer-advertise=127.0.0.1:{ports[i]}", f"--cluster-secret-file={secret}",
                 "--gloo-host=127.0.0.1", f"--collective={args.collective}",
                 f"--backend={'cuda' if gpu else 'host'}", "--log-level=info",
                 "--max-message-bytes=536870912", "--reconcile-timeout-ms=600000"]
        if gpu:
            flags.append(f"--cuda-device={i}")
        ds.append(Daemon(d, *flags, socket=os.path.join(d, "s.sock")))
    return ds


def status(sock):
    import amaxd
    with amaxd.Client("bench", 0, 1, socket=sock, timeout=30) as c:
        return c.status("bench").jobs[0]


def floors(args, tmp, cells):
    idf = os.path.join(tmp, "nccl.id")
    idle = [str(args.idle_ms)] if args.idle_ms > 0 else []
    procs = [subprocess.Popen([args.floor, str(r), str(args.daemons), idf, str(cells),
                               str(args.per_tensor), str(args.channel_q),
                               str(args.channels), str(args.reps), str(args.reps_b)] + idle,
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
             for r in range(args.daemons)]
    out = []
    for p in procs:
        text = p.communicate(timeout=600)[0].strip()
        if p.returncode != 0 or not text:
            raise SystemExit(f"{args.floor} failed (exit {p.returncode}); an nccl_floor older "
                             f"than --idle-ms takes no IDLE_MS: pass --idle-ms 0")
        out.append(json.loads(text.splitlines()[-1]))
    # (a''): each run from the last rank's start to the last rank's end (the
    # ranks share one clock), as the epochs are timed from the last hand-off.
    a_idle = 0.0
    if idle and all(o.get("idle_t0") for o in out):
        runs = zip(zip(*[o["idle_t0"] for o in out]), zip(*[o["idle_end"] for o in out]))
        a_idle = statistics.median(max(e) - max(t) for t, e in runs)
    return (max(o["packed_us"] for o in out), max(o["per_quantizer_us"] for o in out),
            out[0]["per_quantizer_calls"], max(o["packed_nonblocking_us"] for o in out), a_idle,
            max(o.get("packed_idle_us", 0) for o in out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--amaxd", required=True)
    ap.add_argument("--floor", help="bench/nccl_floor binary (GPU runs)")
    ap.add_argument("--daemons", type=int, default=2)
    ap.add_argument("--collective", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--per-tensor", type=int, default=100000)
    ap.add_argument("--channel-q", type=int, default=1000)
    ap.add_argument("--channels", type=int, default=10000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--reps-b", type=int, default=3)
    ap.add_argument("--logs", help="copy the daemons' logs into this folder")
    ap.add_argument("--idle-ms", type=int, default=200,
                    help="the idle gap before each run of floor (a''); 0 skips it")
    args = ap.parse_args()
    cells = args.per_tensor + args.channel_q * args.channels
    with tempfile.TemporaryDirectory(prefix="amaxd-bench-") as tmp:
        fl = floors(args, tmp, HDR + cells) if args.floor else None
        ds = run_daemons(args, tmp)
        try:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            procs = [ctx.Process(target=trainer, args=(ds[r].socket, r, args.daemons, args, q))
                     for r in range(args.daemons)]
            for p in procs:
                p.start()
            per_epoch = []
            done = {}
            t0 = time.time()
            while len(per_epoch) < args.epochs:
                msg = q.get(timeout=900)
                if msg[0] != "epoch":
                    continue
                done.setdefault(msg[2], set()).add(msg[1])
                if len(done[msg[2]]) == args.daemons:
                    per_epoch.append([status(d.socket) for d in ds])
            for p in procs:
                p.join(60)
            wall = time.time() - t0
        finally:
            for i, d in enumerate(ds):
                d.stop()
                if args.logs:
                    os.makedirs(args.logs, exist_ok=True)
                    with open(os.path.join(args.logs, f"amaxd{i}.log"), "w") as f:
                        f.write(d.log())
    first = per_epoch[0]
    steady = per_epoch[1:]
    # The reconcile latency of an epoch: from the moment the last daemon
    # handed it to its engine (its last rank entered Reconcile) to the moment
    # the last daemon published the results. The daemons run on one host,
    # so their CLOCK_MONOTONIC timestamps compare. The breakdown is the last
    # arriving daemon's: its collective waits for nobody.
    lat, en, co, fi = [], [], [], []
    for e in steady:
        last = max(e, key=lambda s: s.last_epoch_started_us)
        lat.append(max(s.last_epoch_ended_us for s in e) - last.last_epoch_started_us)
        en.append(last.last_epoch_us)
        co.append(last.last_collective_us)
        fi.append(last.last_finish_us)
    ncoll = {s.last_collectives for e in steady for s in e}
    med = statistics.median
    print(f"\ncluster reconcile: {args.daemons} daemons, {args.collective}, {args.per_tensor} "
          f"per-tensor + {args.channel_q} x {args.channels} per-channel = {cells} cells "
          f"({(cells + HDR) * 4 / 1e6:.1f} MB per collective), {len(steady)} steady epochs "
          f"(collectives per epoch: {sorted(ncoll)}), {wall:.0f} s wall")
    print(f"first epoch (agreement of the catalog, communicator): "
          f"{max(s.last_epoch_ended_us for s in first) - max(s.last_epoch_started_us for s in first)}"
          f" us")
    print(f"{'measure (median of the steady epochs)':62s} {'us':>9s} {'vs (a)':>8s}")
    rows = [("amaxd reconcile: last hand-off -> all results published", med(lat)),
            ("  the last daemon's engine thread, start to end", med(en)),
            ("    its all-reduce (header + cells)", med(co)),
            ("    its finish (accumulate, fill, scales)", med(fi))]
    if fl:
        rows.append(("(a) one packed NCCL all-reduce of the same cells", fl[0]))
        rows.append(("(a') the same on a non-blocking communicator (AMAXD_NCCL_BLOCKING=0)", fl[3]))
        if fl[4] > 0:
            rows.append((f"(a'') (a) after {args.idle_ms} ms idle, last start -> last end", fl[4]))
            rows.append(("      the same, the slowest rank's own median (first to start)", fl[5]))
        rows.append((f"(b) one NCCL all-reduce per quantizer ({fl[2]} calls)", fl[1]))
    for name, v in rows:
        ratio = f"{v / fl[0]:.2f}x" if fl else ""
        print(f"{name:62s} {v:9.0f} {ratio:>8s}")
    if fl:
        idle = f" = {med(lat) / fl[4]:.2f} x (a'')" if fl[4] > 0 else ""
        print(f"amaxd reconcile = {med(lat) / fl[0]:.2f} x (a){idle};  (b) = "
              f"{fl[1] / med(lat):.0f} x amaxd reconcile")
    print("per-epoch latency (us): " + ", ".join(str(v) for v in lat))
    # Where the time between the hand-off and the answers goes, per daemon
    # (medians of the steady epochs): the engine thread waking up, the
    # engine, the loop taking the result back and publishing it, and the
    # answer to the waiting rank.
    if steady and getattr(steady[0][0], "last_engine_begin_us", 0):
        print(f"{'per daemon (median us)':24s} {'wake':>7s} {'engine':>7s} {'back':>7s} "
              f"{'answer':>7s} {'to answer':>10s}")
        for d in range(args.daemons):
            ss = [e[d] for e in steady]
            wake = med([s.last_engine_begin_us - s.last_epoch_started_us for s in ss])
            eng = med([s.last_engine_end_us - s.last_engine_begin_us for s in ss])
            back = med([s.last_epoch_ended_us - s.last_engine_end_us for s in ss])
            ans = med([s.last_answered_us - s.last_epoch_ended_us for s in ss])
            tot = med([e[d].last_answered_us - max(x.last_epoch_started_us for x in e)
                       for e in steady])
            print(f"{'daemon ' + str(d):24s} {wake:7.0f} {eng:7.0f} {back:7.0f} {ans:7.0f} "
                  f"{tot:10.0f}")


if __name__ == "__main__":
    main()
