"""The epoch cost of histogram quantizers over several daemons (issue 23),
against one all-reduce(SUM) of the same bytes, in one run (bench/NOTES.md,
"Calibrators beyond max").

DAEMONS daemons on loopback (host backend, Gloo; on GPUs the CUDA backend
and NCCL: --collective nccl --backend cuda) serve a job of one trainer rank
per daemon whose catalog holds QUANTIZERS per-tensor histogram quantizers
of BINS bins (method percentile: the cheapest method, so that the epoch is
the protocol's cost; --method entropy|mse times those too). Epoch 1 sends
the max and fixes the bin edges; every later epoch each rank sends its
counts (SendPacked with its stat slab: QUANTIZERS x (BINS + 1) float64) and
reconciles. Each daemon reports its epoch (Status: from the hand-off to
its engine to published results, the collectives in it: the MAX of the
cells and the SUM of the counts, and the finish, which accumulates the
counts and runs the methods), read by each trainer from its daemon after
each epoch; per epoch the slowest daemon counts, and the median over the
epochs after the first stat epoch is reported; the trainers' wall time of
send + reconcile too (the slowest rank's).

The floor, in the same run: bench/gloo_floor (the same Gloo shim the
daemons use, as DAEMONS processes): one all-reduce(SUM) of the same
QUANTIZERS x (BINS + 1) float64 values, and one all-reduce(MAX) of the
epoch's header and cells; over NCCL, bench/nccl_floor (--nccl-floor): a
non-blocking ncclAllReduce of the same bytes. Medians over EPOCHS epochs /
repetitions.

    python bench/calib_bench.py --amaxd build/amaxd --floor build/gloo_floor \\
        [--daemons 4 --quantizers 1000 --bins 2048 --epochs 7 --runs 3]
"""
import argparse
import ctypes
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

HDR = 32  # header cells of the MAX collective (daemon/state.h)


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def trainer(sock, rank, world, args, job, q):
    import amaxd
    names = [f"hist.{i:05d}" for i in range(args.quantizers)]
    kw = {"percentile": dict(percentile=99.99), "entropy": dict(start_bin=128),
          "mse": dict(start_bin=128)}[args.method]
    cal = amaxd.Calibrator.histogram(args.method, args.bins, torch_cpu_build="avx2", **kw)
    rng = np.random.default_rng(rank)
    with amaxd.Client(job, rank, world, socket=sock, timeout=600) as c:
        c.join()
        c.register([amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current(), calibrator=cal)
                    for n in names])
        L = c.layout()
        c.send_packed(rng.uniform(1, 10, L.total_cells).astype(np.float32))
        res = c.reconcile_packed()
        ep = res.stat_epoch
        assert len(set(ep.tolist())) == 1 and ep[0] > 0, ep
        # Every epoch the same counts (what they are does not matter to the
        # cost): up to 1000 per bin, the overflow count 0.
        stats = rng.integers(0, 1000, size=L.total_stats).astype(np.float64)
        stats[L.stat_offsets.astype(np.int64) + args.bins] = 0
        epochs = np.asarray(ep, dtype="<u8")
        zeros = np.zeros(L.total_cells, np.float32)
        none = np.zeros(L.total_cells, np.uint8)
        from amaxd import wire
        walls, daemon = [], []
        for e in range(args.epochs):
            t0 = time.perf_counter()
            raw = wire.encode_send_packed(job, rank, 0, L.id, zeros, none, stats, epochs)
            c._raw("SendPacked", raw, amaxd.pb.SendAmaxResponse.FromString)
            res = c.reconcile_packed()
            walls.append(time.perf_counter() - t0)
            assert res.stat_state[0] == amaxd.pb.STAT_COMPUTED
            st = c.status(job).jobs[0]  # this rank's daemon's view of the epoch
            daemon.append((st.last_epoch_us, st.last_collective_us, st.last_finish_us,
                           st.last_collectives))
        q.put((rank, (walls, daemon)))


def status(sock, job):
    import amaxd
    with amaxd.Client(job, 0, 1, socket=sock) as c:
        return c.status(job).jobs[0]


def run_cluster(args, run):
    from amaxd_proc import Daemon
    n = args.daemons
    tmp = tempfile.mkdtemp(prefix="amaxd-calib-bench-")
    secret = os.path.join(tmp, "secret")
    with open(secret, "wb") as f:
        f.write(b"0123456789abcdef-bench-secret")
    os.chmod(secret, 0o600)
    ports = free_ports(n)
    ds = []
    os.environ["AMAXD_BIN"] = args.amaxd
    for i in range(n):
        d = os.path.join(tmp, f"d{i}")
        os.makedirs(d)
        flags = []
        if n > 1:
            flags = [f"--cluster-size={n}", f"--cluster-rank={i}",
                     f"--coordinator=127.0.0.1:{ports[0]}", f"--peer-listen=127.0.0.1:{ports[i]}",
                     f"--peer-advertise=127.0.0.1:{ports[i]}", f"--cluster-secret-file={secret}",
                     "--gloo-host=127.0.0.1", f"--collective={args.collective}"]
        ds.append(Daemon(d, *flags, f"--backend={args.backend}", "--log-level=info",
                         "--reconcile-timeout-ms=600000",
                         *([f"--cuda-device={i}"] if args.backend == "cuda" else []),
                         socket=os.path.join(d, "amaxd.sock")))
    job = f"calib-bench-{run}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=trainer, args=(ds[r].socket, r, n, args, job, q)) for r in range(n)]
    per_epoch = []
    try:
        for p in ps:
            p.start()
        got = dict(q.get(timeout=3600) for _ in ps)
        for p in ps:
            p.join()
        walls = {r: g[0] for r, g in got.items()}
        # Per epoch (the first stat epoch left out: warm-up), the slowest
        # daemon's figures.
        for e in range(1, args.epochs):
            per_epoch.append({k: max(got[r][1][e][i] for r in got)
                              for i, k in enumerate(("epoch_us", "collective_us", "finish_us",
                                                     "collectives"))})
    finally:
        for d in ds:
            d.stop()
    return walls, per_epoch


def method_costs(lib, bins, reps=5):
    """Single-threaded cost of each method on one BINS-bin histogram (the
    daemon's own code, libamaxd_calib.so), median of reps."""
    L = ctypes.CDLL(lib)
    f64p, f32p = ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_float)
    for fn in ("amx_hist_percentile", "amx_hist_entropy", "amx_hist_mse"):
        getattr(L, fn).restype = ctypes.c_float
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_normal(1 << 20)).astype(np.float32)
    h = np.histogram(x, bins=bins, range=(0, float(x.max())))[0].astype(np.float64)
    e = np.linspace(0, float(x.max()), bins + 1).astype(np.float32)
    scratch = np.zeros(64 * (bins + 2) + (1 << 16), np.uint8)
    calls = {
        "percentile": lambda: L.amx_hist_percentile(h.ctypes.data_as(f64p), bins,
                                                    e.ctypes.data_as(f32p), ctypes.c_double(99.9)),
        "entropy": lambda: L.amx_hist_entropy(h.ctypes.data_as(f64p), bins, e.ctypes.data_as(f32p),
                                              8, 0, 1, 128, scratch.ctypes.data_as(ctypes.c_void_p)),
        "mse": lambda: L.amx_hist_mse(h.ctypes.data_as(f64p), bins, e.ctypes.data_as(f32p), 1, 8,
                                      0, 1, 128, 1, scratch.ctypes.data_as(ctypes.c_void_p)),
    }
    out = {}
    for name, fn in calls.items():
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name + "_ms"] = round(statistics.median(ts) * 1e3, 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--amaxd", default=os.path.join(HERE, "..", "build", "amaxd"))
    ap.add_argument("--floor", default=os.path.join(HERE, "..", "build", "gloo_floor"))
    ap.add_argument("--nccl-floor", help="bench/nccl_floor binary (NCCL runs)")
    ap.add_argument("--daemons", type=int, default=4)
    ap.add_argument("--quantizers", type=int, default=1000)
    ap.add_argument("--bins", type=int, default=2048)
    ap.add_argument("--epochs", type=int, default=7)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--method", default="percentile", choices=["percentile", "entropy", "mse"])
    ap.add_argument("--collective", default="gloo")
    ap.add_argument("--backend", default="host")
    args = ap.parse_args()
    args.amaxd = os.path.abspath(args.amaxd)
    nsum = args.quantizers * (args.bins + 1)
    rows = []
    for run in range(args.runs):
        walls, daemons = run_cluster(args, run)
        floor = {}
        if args.collective == "gloo" and args.daemons > 1:
            out = subprocess.run([args.floor, str(args.daemons), str(nsum),
                                  str(HDR + args.quantizers), str(max(args.epochs, 5))],
                                 capture_output=True, text=True, check=True)
            floor = json.loads(out.stdout)
        elif args.collective == "nccl" and args.nccl_floor:
            # bench/nccl_floor reduces float32 by MAX: 2 x the values is the
            # same bytes as the float64 SUM (the same ring, the same
            # traffic), and HDR + quantizers cells the MAX.
            idf = os.path.join(tempfile.mkdtemp(), "nccl.id")

            def nf(cells):
                procs = [subprocess.Popen([args.nccl_floor, str(r), str(args.daemons), idf,
                                           str(cells), "0", "0", "0", "20", "1"],
                                          stdout=subprocess.PIPE, text=True,
                                          env=dict(os.environ, NCCL_NVLS_ENABLE="0"))
                         for r in range(args.daemons)]
                outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1])
                        for p in procs]
                if os.path.exists(idf):
                    os.remove(idf)
                return max(o["packed_nonblocking_us"] for o in outs)
            floor = {"sum_median_us": nf(2 * nsum), "max_median_us": nf(HDR + args.quantizers)}
        wall = statistics.median(max(ws[e] for ws in walls.values())
                                 for e in range(1, args.epochs))
        md = lambda k: round(statistics.median(d[k] for d in daemons) / 1e3, 2)  # noqa: E731
        row = {"run": run, "trainer_epoch_ms": round(wall * 1e3, 2),
               "daemon_epoch_ms": md("epoch_us"), "daemon_collectives_ms": md("collective_us"),
               "daemon_finish_ms": md("finish_us"),
               "collectives": sorted({d["collectives"] for d in daemons}),
               "floor_sum_ms": round(floor.get("sum_median_us", 0) / 1e3, 2),
               "floor_max_ms": round(floor.get("max_median_us", 0) / 1e3, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    summary = {
        "daemons": args.daemons, "quantizers": args.quantizers, "bins": args.bins,
        "method": args.method, "stat_bytes": nsum * 8, "runs": args.runs,
        "trainer_epoch_ms": med("trainer_epoch_ms"),
        "daemon_epoch_ms": med("daemon_epoch_ms"),
        "daemon_collectives_ms": med("daemon_collectives_ms"),
        "daemon_finish_ms": med("daemon_finish_ms"),
        "floor_sum_ms": med("floor_sum_ms"), "floor_max_ms": med("floor_max_ms"),
    }
    lib = os.path.join(os.path.dirname(args.amaxd), "libamaxd_calib.so")
    if os.path.exists(lib):
        summary["method_per_quantizer"] = method_costs(lib, args.bins)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
