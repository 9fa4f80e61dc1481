"""One amax sync as the trainer sees it (issue 21): W trainer ranks on W
GPUs, one amaxd per GPU (CUDA backend; NCCL between the daemons when W > 1),
the amax of every quantizer already in one packed float32 CUDA tensor `x`
on the trainer's GPU, and the scales needed back on the GPU. Per sync,
timed from the trainer's seat until the results are usable on its GPU
(the stream synchronized at the end of every path, so all paths are timed
the same way):

  inproc  torch.distributed.all_reduce(x, MAX) among the trainers (NCCL) +
          448 / x on the GPU: what a trainer does without amaxd (baseline)
  grpc    x.cpu() -> SendPacked -> ReconcilePacked -> scale to the GPU
  shm     the same through the daemon's shared-memory buffers
  device  GPU-direct: x copied into the device slab, ReconcileDevice
          through the daemon's doorbell socket (the daemon merges the slab
          in place behind the trainer's ready event; the answer is written
          into the device answer buffer and ordered by the done event);
          results are CUDA tensors already
  devgrpc the same with ReconcileDevice over gRPC
  async   reconcile_device_async: the trainer's stream waits for the
          daemon's done flag on the GPU and the call returns at once; timed
          until the stream is done and result() has the daemon's answer, as
          the others ("host back": when the call gave the host back;
          "ready": when the stream was done, before result(), i.e. when
          kernels queued after the call could run: what a trainer that
          collects result() later waits for)
  armed   reconcile_device(arm=True): the daemon starts the next epoch as
          it answers this one (docs/API.md "Armed epochs"), so the next
          sync sends nothing: its ready flag alone starts the merge
  armasync the asynchronous variant of armed; "armready" its "ready"
  (--paths picks which run; the armed ones keep their epochs armed, and
  their daemons' engines polling, between their syncs)

Each sync starts after a barrier of the trainers (W > 1); the printed
number per path is the median over the syncs of the slowest rank's time;
ratios are to `inproc` of the same run. Raw per-sync times go to --out
(JSON lines).

  python3 bench/trainer_latency.py --amaxd .gpu-build/amaxd --gpus 1 \
      [--sizes 1000,20000,100000+pc] [--iters 50] [--out results.jsonl]

--one-daemon: one amaxd (on GPU 0) serves the W trainers of the node, its
state on GPU 0 and each trainer's device buffers on the trainer's GPU
(read and written by peer access), no NCCL between daemons.

Sizes: N (N per-tensor FP8 quantizers per rank), or N+pc (N per-tensor plus
1000 per-channel of 10000 channels, column-parallel over the ranks).
"""
import argparse
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "e2e"))


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_daemons(amaxd_bin, n, tmp, extra=None):
    """n daemons, one per GPU (NCCL between them when n > 1); extra(i):
    more flags for daemon i (they come last, so they win)."""
    os.environ["AMAXD_BIN"] = os.path.abspath(amaxd_bin)
    from amaxd_proc import Daemon
    ports = free_ports(n)
    secret = os.path.join(tmp, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(24).hex().encode())
    os.chmod(secret, 0o600)
    ds = []
    for i in range(n):
        d = os.path.join(tmp, f"d{i}")
        os.makedirs(d)
        flags = ["--backend=cuda", f"--cuda-device={i}", "--log-level=info",
                 "--max-message-bytes=536870912", "--reconcile-timeout-ms=600000"]
        if n > 1:
            flags += [f"--cluster-size={n}", f"--cluster-rank={i}",
                      f"--coordinator=127.0.0.1:{ports[0]}", f"--peer-listen=127.0.0.1:{ports[i]}",
                      f"--peer-advertise=127.0.0.1:{ports[i]}", f"--cluster-secret-file={secret}",
                      "--collective=nccl"]
        flags += list(extra(i)) if extra else []
        ds.append(Daemon(d, *flags, socket=os.path.join(d, "s.sock")))
    return ds


def catalog(size, rank, world):
    import amaxd
    from amaxd import placement as P
    per, _, pc = size.partition("+")
    specs = [amaxd.Quantizer(f"pt.{i:06d}", [], amaxd.Recipe.fp8_current())
             for i in range(int(per))]
    if pc:
        specs += [amaxd.Quantizer(f"pc.{i:05d}", [10000], amaxd.Recipe.fp8_current(),
                                  P.column_parallel([10000], rank, world)) for i in range(1000)]
    return specs


def worker(rank, world, socks, port, args, q):
    import numpy as np
    import torch
    import torch.distributed as dist
    import amaxd
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    gloo = dist.new_group(backend="gloo")
    out = []
    for size in args.sizes.split(","):
        specs = catalog(size, rank, world)
        clients = {}
        want = args.paths.split(",")
        for path in [p for p in ALL_PATHS if p != "inproc" and p in want]:
            c = amaxd.Client(f"lat-{size.replace('+', '_')}-{path}", rank, world,
                             socket=socks[rank % len(socks)], timeout=600,
                             max_message_bytes=512 << 20, shm=(path == "shm"))
            c.doorbell = path != "devgrpc"  # devgrpc: ReconcileDevice over gRPC
            c.join()
            for i in range(0, len(specs), 50000):
                c.register(specs[i:i + 50000])
            clients[path] = c
        L = next(iter(clients.values())).layout()
        n = L.total_cells
        gen = torch.Generator(device=dev)
        gen.manual_seed(rank)
        x = torch.rand(n, device=dev, generator=gen) * 100
        slabs = {p: c.device_slab() for p, c in clients.items()
                 if p in ("device", "devgrpc", "async", "armed", "armasync")}
        last = args.warmup + args.iters - 1
        it_now = [0]
        host_ret = []  # async: when the call gave the host back, after its start
        s = torch.cuda.current_stream(dev)

        def inproc():
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            return 448.0 / x

        def packed(c):
            def f():
                v = x.cpu().numpy()
                c.send_packed(v)
                r = c.reconcile_packed()
                return torch.from_numpy(np.asarray(r.scale)).to(dev)
            return f

        marks = []  # per timed device sync: the trainer's CLOCK_MONOTONIC us around the call

        def device():
            slabs["device"].copy_(x)
            t0 = time.monotonic_ns() // 1000
            r = clients["device"].reconcile_device(stream=s)
            marks.append((t0, time.monotonic_ns() // 1000))
            return r.scale

        def devgrpc():
            slabs["devgrpc"].copy_(x)
            return clients["devgrpc"].reconcile_device(stream=s).scale

        def armed():
            # Armed epochs (docs/API.md): the ready flag alone starts the
            # merge; the last sync disarms.
            slabs["armed"].copy_(x)
            return clients["armed"].reconcile_device(stream=s, arm=it_now[0] < last).scale

        ready = []  # async: when the stream got past the done flag, after the path began

        def asyncof(path, rec, arm):
            def f():
                t0 = time.perf_counter()
                slabs[path].copy_(x)
                t1 = time.perf_counter()
                p = clients[path].reconcile_device_async(stream=s, arm=arm and it_now[0] < last)
                if path == "async":
                    host_ret.append(time.perf_counter() - t1)
                s.synchronize()  # the results are in the answer buffer: the stream waited
                rec.append(time.perf_counter() - t0)
                return p.result().scale
            return f

        ready_armed = []
        fns = {"inproc": inproc, "device": device, "devgrpc": devgrpc, "armed": armed,
               "async": asyncof("async", ready, False),
               "armasync": asyncof("armasync", ready_armed, True)}
        for p in ("grpc", "shm"):
            if p in clients:
                fns[p] = packed(clients[p])
        paths = {p: fns[p] for p in ALL_PATHS if p in want}
        times = {p: [] for p in paths}
        phases = []
        check = {}
        for it in range(args.warmup + args.iters):
            it_now[0] = it
            for p, fn in paths.items():
                dist.barrier(group=gloo)
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                res = fn()
                s.synchronize()
                t1 = time.perf_counter()
                if it >= args.warmup:
                    times[p].append(t1 - t0)
                    if p == "async":
                        times.setdefault("ready", []).append(ready[-1])
                    if p == "armasync":
                        times.setdefault("armready", []).append(ready_armed[-1])
                if p == "device" and args.breakdown:
                    # Where the device sync's time went: the daemon's own
                    # marks of this epoch (Status, outside the timed part).
                    synced = time.monotonic_ns() // 1000
                    js = clients["device"].status(clients["device"].job).jobs[0]
                    c0, c1 = marks[-1]
                    if it >= args.warmup:
                        phases.append([js.last_epoch_entered_us - c0,
                                       js.last_epoch_started_us - js.last_epoch_entered_us,
                                       js.last_engine_begin_us - js.last_epoch_started_us,
                                       js.last_engine_end_us - js.last_engine_begin_us,
                                       js.last_epoch_ended_us - js.last_engine_end_us,
                                       js.last_published_us - js.last_epoch_ended_us,
                                       js.last_answered_us - js.last_published_us,
                                       c1 - js.last_answered_us, synced - c1])
                if it == args.warmup + args.iters - 1:
                    check[p] = res[:4].cpu().numpy().tolist() if res is not None else None
        # The device and packed paths answer the same scales.
        same = all(check[p] == check[paths_ref(check)] for p in check if p != "inproc")
        allt = [None] * world
        dist.all_gather_object(allt, times, group=gloo)
        if rank == 0:
            slow = {p: [max(allt[r][p][i] for r in range(world)) for i in range(args.iters)]
                    for p in times}
            out.append({"size": size, "cells_per_rank": n, "world": world, "same_scales": same,
                        "times_s": slow, "device_phases_us_rank0": phases,
                        "async_host_return_s_rank0": host_ret[args.warmup:] or [0.0]})
        for c in clients.values():
            c.close()
        dist.barrier(group=gloo)
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


ALL_PATHS = ("inproc", "grpc", "shm", "device", "devgrpc", "async", "armed", "armasync")


def paths_ref(check):
    """The path every other is compared with: the first of check after inproc."""
    return next(p for p in check if p != "inproc")


PROFILE_KINDS = (("engine", re.compile(r"profile: job (\S+), epoch \d+ \(reconciled\): (.*)")),
                 ("nccl", re.compile(r"profile: nccl all-reduce of \d+ floats: (.*)")),
                 ("finish", re.compile(r"profile: finish of \d+ cells / \d+ quantizers[^:]*: (.*)")),
                 ("slabs", re.compile(r"profile: device slabs of \d+ trainer\(s\): (.*)")),
                 ("merge", re.compile(r"profile: device merge of rank \d+, device us: (.*)")),
                 ("answer", re.compile(r"profile: job (\S+), epoch \d+ answered: (.*)")),
                 ("devans", re.compile(r"profile: device answer of rank \d+: (.*)")))


def print_profile(log, res, warmup, path="device"):
    """Medians of the AMAXD_PROFILE lines of a device path's epochs
    (job lat-SIZE-PATH) in one daemon's log: each engine line, and the
    NCCL and finish lines of the same engine thread just before it."""
    per_job, last, last_row = {}, {}, None
    for line in log.splitlines():
        for kind, rx in PROFILE_KINDS:
            m = rx.search(line)
            if not m:
                continue
            if kind == "answer":  # after its epoch's engine line, on the loop
                rows = per_job.get(m.group(1))
                if rows and "answer" not in rows[-1]:
                    rows[-1]["answer"] = m.group(2)
                continue
            if kind == "devans":  # the loop's answer of the last epoch (no job named)
                if last_row is not None and "devans" not in last_row:
                    last_row["devans"] = m.group(1)
                continue
            if kind != "engine":
                last[kind] = m.group(1)
                continue
            job, text = m.group(1), m.group(2)
            rows = per_job.setdefault(job, [])
            last_row = {"engine": text, **last}
            rows.append(last_row)
            last = {}
    print(f"daemon 0's profile of the {path} path (AMAXD_PROFILE=1), medians in us after the "
          "warm-up:")
    for r in res:
        rows = per_job.get(f"lat-{r['size'].replace('+', '_')}-{path}", [])[warmup:]
        if not rows:
            print(f"{r['size']:>16} | no profile lines")
            continue
        for kind in ("engine", "slabs", "merge", "nccl", "finish", "answer", "devans"):
            fields = {}
            for row in rows:
                for label, num in re.findall(r"([a-zA-Z][a-zA-Z0-9 -]*?)\s+(\d+)(?: us)?(?=[,;:(]|$| )",
                                             re.sub(r"^(\d+) us(?: in the engine:|,|:)", r"total \1,",
                                                    row.get(kind, ""))):
                    fields.setdefault(label.strip(), []).append(int(num))
            text = ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in fields.items())
            print(f"{r['size']:>16} | {kind:6} | {text}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--amaxd", required=True)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--sizes", default="1000,20000")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--paths", default="inproc,grpc,shm,device,devgrpc,async",
                    help="which paths, of " + ",".join(ALL_PATHS) + " (inproc always runs): "
                         "armed / armasync = reconcile_device(_async) with arm=True (docs/API.md "
                         "\"Armed epochs\"); their jobs stay armed between their syncs, so "
                         "they run alone with the baseline unless asked")
    ap.add_argument("--one-daemon", action="store_true",
                    help="one amaxd (GPU 0) for all the trainers, instead of one per GPU")
    ap.add_argument("--profile", action="store_true",
                    help="daemons run with AMAXD_PROFILE=1: print the medians of daemon 0's "
                         "profile lines (engine steps, NCCL all-reduce, finish) of the device "
                         "path's epochs")
    ap.add_argument("--profile-path", default="device",
                    help="whose epochs --profile prints (device, armed, async, armasync, devgrpc)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print where rank 0's device sync went (daemon's Status marks)")
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp
    W = args.gpus
    if torch.cuda.device_count() < W:
        sys.exit(f"{W} GPUs asked, {torch.cuda.device_count()} visible")
    tmp = tempfile.mkdtemp(prefix="amaxd-lat-")
    if args.profile:
        os.environ["AMAXD_PROFILE"] = "1"
    ds = start_daemons(args.amaxd, 1 if args.one_daemon else W, tmp)
    port = free_ports(1)[0]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, W, [d.socket for d in ds], port, args, q))
             for r in range(W)]
    for p in procs:
        p.start()
    res = q.get(timeout=3600)
    for p in procs:
        p.join(timeout=120)
    for d in ds:
        d.stop()
    name = torch.cuda.get_device_name(0)
    who = ("one amaxd for all GPUs (CUDA backend, its state on GPU 0, peer access)"
           if args.one_daemon else
           f"one amaxd per GPU (CUDA backend{', NCCL between daemons' if W > 1 else ''})")
    print(f"trainer_latency: {W} x {name}, {who}, {args.iters} syncs per path after "
          f"{args.warmup} warm-up, median of the slowest rank, stream synchronized at the end of "
          f"every path")
    bp = os.environ.get("AMAXD_BUSY_POLL", "auto")
    ncpu = os.cpu_count() or 1
    spin = os.environ.get("AMAXD_DOORBELL_SPIN_S")
    spin = float(spin) if spin is not None else 0.002 if ncpu >= 8 else 0.0
    print(f"daemon busy_poll={bp} ({'on' if bp == 'on' or (bp == 'auto' and ncpu >= 8) else 'off'}"
          f", {ncpu} CPUs), client doorbell spin {spin * 1e3:g} ms, AMAXD_PROFILE "
          f"{'on' if args.profile else 'off'}")
    cols = [p for p in ("grpc", "shm", "device", "devgrpc", "async", "ready", "armed",
                        "armasync", "armready") if p in res[0]["times_s"]]
    print(f"{'per rank':>16} {'cells':>9} | {'inproc ms':>9} | "
          + " | ".join(f"{p + ' ms':>13} {'x':>6}" for p in cols)
          + (f" | {'async host back':>15}" if "async" in cols else "") + " | same scales")
    for r in res:
        med = {p: statistics.median(t) * 1e3 for p, t in r["times_s"].items()}
        b = med["inproc"]
        print(f"{r['size']:>16} {r['cells_per_rank']:>9} | {b:9.3f} | "
              + " | ".join(f"{med[p]:13.3f} {med[p] / b:6.2f}" for p in cols)
              + (f" | {statistics.median(r['async_host_return_s_rank0']) * 1e3:15.3f}"
                 if "async" in cols else "") + f" | {r['same_scales']}")
        r["median_ms"] = med
    if args.breakdown:
        names = ["call>entered", "entered>started", "started>engine", "engine",
                 "engine>loop", "loop>published", "published>answered", "answered>returned",
                 "returned>synced"]
        print("device sync of rank 0, medians in us (CLOCK_MONOTONIC marks of the trainer and "
              "of its daemon's Status):")
        print(f"{'per rank':>16} | " + " ".join(f"{k:>17}" for k in names))
        for r in res:
            ph = r["device_phases_us_rank0"]
            if ph:
                meds = [statistics.median(v[k] for v in ph) for k in range(len(names))]
                print(f"{r['size']:>16} | " + " ".join(f"{m:17.0f}" for m in meds))
    if args.profile:
        print_profile(ds[0].log(), res, args.warmup, args.profile_path)
    if args.out:
        with open(args.out, "a") as f:
            for r in res:
                f.write(json.dumps({"gpu": name, **r}) + "\n")
    ok = all(r["same_scales"] for r in res)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
