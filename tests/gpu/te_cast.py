"""TE's master-weight cast through amaxd on GPUs (issue 22): N trainer ranks,
one per GPU, each with its own amaxd daemon (CUDA state backend, NCCL
between the daemons), master shards as torch CUDA tensors.

For NVFP4 2D, FP8 block scaling, MXFP8 and FP8 current scaling weights of
shapes that are not multiples of the tiles, with zero, subnormal, huge and
NaN values, sharded as Megatron's distributed optimizer shards them (one
flat buffer of all weights cut in N equal pieces: most weights fall on one
or two ranks, many ranks hold nothing of a weight) and by random cuts
(empty shards included), every rank's amaxd.te output, through both of
amaxd.te's paths, must equal, byte for byte:
  0. the other path's: the GPU-direct device path (Caster(path="device"):
     partial amaxes written into the device slab, ReconcileDevice over
     the doorbell, outputs derived from the device answer; every step
     under torch.cuda.set_sync_debug_mode("error"), so a host sync in it
     fails the run) and the packed path (path="packed": SendPacked +
     ReconcilePacked), each in a job of its own;
  1. the numpy transcription of TE's kernels (tests/e2e/te_reference.py);
  2. where TransformerEngine is installed, TE's own kernels run the way
     quantize_master_weights runs them (tex partial amax, NCCL
     all_reduce(MAX) over the ranks, TE's scale kernels), on the same GPUs;
  3. the same weights reconciled by jobs of 1, 2, ..., N ranks.
Several steps per job reuse one registration. Exit status 0 when all agree.

    AMAXD_BIN=.gpu-build/amaxd python3 tests/gpu/te_cast.py [--ranks 4] [--steps 3]
    python3 tests/gpu/te_cast.py --amaxd build-gpu/amaxd --paths device   # one path only
    python3 tests/gpu/te_cast.py --amaxd build/amaxd --device cpu   # CPU, Gloo: a smoke run

Needs torch (CUDA), CuPy or cuda-bindings for the device path, and the
amaxd client on the path (tests/gpu/README.md; tests/gpu/te_cast.sh runs
it with the staged build and the bundle's wheel); keep NCCL_NVLS_ENABLE=0.
"""
import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def start_daemons(args, tmp, extra=()):
    """One daemon per rank: a cluster over NCCL (CUDA backend) or Gloo."""
    os.environ["AMAXD_BIN"] = os.path.abspath(args.amaxd)
    from amaxd_proc import Daemon
    n = args.ranks
    ports = free_ports(n)
    secret = os.path.join(tmp, "secret")
    with open(secret, "wb") as f:
        f.write(os.urandom(24).hex().encode())
    os.chmod(secret, 0o600)
    gpu = args.device == "cuda"
    ds = []
    for i in range(n):
        d = os.path.join(tmp, f"d{i}")
        os.makedirs(d)
        flags = [f"--cluster-size={n}", f"--cluster-rank={i}",
                 f"--coordinator=127.0.0.1:{ports[0]}", f"--peer-listen=127.0.0.1:{ports[i]}",
                 f"--peer-advertise=127.0.0.1:{ports[i]}", f"--cluster-secret-file={secret}",
                 "--gloo-host=127.0.0.1", f"--collective={'nccl' if gpu else 'gloo'}",
                 f"--backend={'cuda' if gpu else 'host'}", "--log-level=info",
                 "--max-message-bytes=1073741824", "--reconcile-timeout-ms=600000", *extra]
        if gpu:
            flags.append(f"--cuda-device={i}")
        ds.append(Daemon(d, *flags, socket=os.path.join(d, "s.sock")))
    return ds


def make_weights(seed, scale):
    """(spec, float32 master values) for every kind, shapes not multiples
    of the tiles (MXFP8: multiples of 32, TE's requirement), model dtype
    bf16 (and float32 for two FP8 weights)."""
    import amaxd.te as ate
    rng = np.random.default_rng(seed)
    s = scale
    shapes = {"nvfp4": [(1000 * s + 7, 777 * s + 3), (64 * s + 1, 4096 * s + 9)],
              "fp8_block": [(1500 * s + 5, 1100 * s + 1), (300 * s + 77, 129)],
              "mxfp8": [(32 * (40 * s + 1), 32 * (30 * s + 3)), (32 * 5, 32 * (70 * s + 1))],
              "fp8_current": [(900 * s + 1, 333), (17, 3000 * s + 5)]}
    out = []
    for kind, shp in shapes.items():
        for k, (r, c) in enumerate(shp):
            dtype = "float32" if (kind.startswith("fp8") and k == 1) else "bfloat16"
            spec = ate.WeightSpec(f"layers.{k}.{kind}.weight", (int(r), int(c)), kind, dtype,
                                  "e5m2" if kind == "fp8_current" and k == 1 else "e4m3",
                                  eps=0.0, power_of_2=kind == "fp8_block" and k == 0)
            n = int(r) * int(c)
            x = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 20))).astype(np.float32)
            x[rng.random(n) < 0.05] = 0
            x[rng.random(n) < 0.01] = np.float32(3e-39)
            x[rng.random(n) < 0.001] = np.nan
            if k == 0:
                x[rng.integers(n)] = np.float32(3.0e38)
            out.append((spec, x))
    # A weight that is all zeros, and one so small its scales overflow.
    z = ate.WeightSpec("zeros.weight", (100, 300), "nvfp4")
    t = ate.WeightSpec("tiny.weight", (260, 300), "fp8_block", "float32")
    out += [(z, np.zeros(30000, np.float32)),
            (t, (rng.standard_normal(78000) * 1e-38).astype(np.float32))]
    return out


def layouts(weights, n, seed):
    """{layout: {name: [(start, numel) per rank]}}: Megatron's flat buffer
    cut in n equal pieces, and random cuts per weight (an empty shard in
    each when n > 2)."""
    sizes = [s.rows * s.cols for s, _ in weights]
    total = sum(sizes)
    per = -(-total // n)
    mega, off = {}, 0
    for (spec, _), sz in zip(weights, sizes):
        rr = []
        for r in range(n):
            a, b = max(off, r * per), min(off + sz, (r + 1) * per)
            rr.append((a - off, b - a) if b > a else (0, 0))
        mega[spec.name] = rr
        off += sz
    rng = np.random.default_rng(seed)
    rand = {}
    for (spec, _), sz in zip(weights, sizes):
        c = np.sort(rng.integers(0, sz + 1, n - 1))
        if n > 2:
            c[rng.integers(0, n - 1)] = c[0]
            c = np.sort(c)
        b = np.concatenate([[0], c, [sz]])
        rand[spec.name] = [(int(b[k]), int(b[k + 1] - b[k])) for k in range(n)]
    return {"megatron": mega, "random": rand}


def expected(spec, vals, ranges):
    import te_reference as ter
    import torch
    v = torch.from_numpy(vals).to(getattr(torch, spec.dtype)).float().numpy()
    shards = [v[s:s + n] if n else None for s, n in ranges]
    return ter.te_cast(spec.kind, shards, [s for s, _ in ranges], spec.rows, spec.cols,
                       fp8_max=57344.0 if spec.fp8_format == "e5m2" else 448.0,
                       pow2=spec.power_of_2, eps=spec.eps)


def te_kernels(spec, shard, start, group):
    """TE's own kernels as utils.py quantize_master_weights runs them (one
    weight at a time), with NCCL all_reduce(MAX) over `group`; `shard` is
    the master shard cast to the model dtype (None: this rank has none)."""
    import torch
    import torch.distributed as dist
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.optimizers.multi_tensor_apply import multi_tensor_applier
    from transformer_engine_torch import (multi_tensor_compute_scale_and_scale_inv,
                                          multi_tensor_compute_scale_inv_e8m0)
    import amaxd.te as ate
    dev = torch.device("cuda", torch.cuda.current_device())
    h, w = spec.rows, spec.cols
    MAX = dist.ReduceOp.MAX
    fmax = 57344.0 if spec.fp8_format == "e5m2" else 448.0
    flag = torch.zeros(1, dtype=torch.int, device=dev)
    has = shard is not None and shard.numel() > 0
    if spec.kind in ("fp8_block", "fp8_current"):
        shape = ate.scale_inv_shapes(spec).get("rowwise_scale_inv", (1,))
        amax = torch.zeros(shape, dtype=torch.float32, device=dev)
        if has and spec.kind == "fp8_block":
            tex.fp8_block_scaling_compute_partial_amax(shard, amax, h, w, start, 128)
        elif has:
            tex.compute_amax(shard, amax)
        dist.all_reduce(amax, op=MAX, group=group)
        scale, inv = torch.empty_like(amax), torch.empty_like(amax)
        multi_tensor_applier(multi_tensor_compute_scale_and_scale_inv, flag, [[amax], [scale], [inv]],
                             fmax, spec.power_of_2, spec.eps)
        if spec.kind == "fp8_block":
            return {"amax": amax, "scale": scale, "rowwise_scale_inv": inv}
        return {"amax": amax, "scale": scale, "scale_inv": inv}
    if spec.kind == "nvfp4":
        tr, tc = -(-h // 16), -(-w // 16)
        amax = torch.zeros((tr, tc), dtype=torch.float32, device=dev)
        g = torch.zeros(1, dtype=torch.float32, device=dev)
        if has:
            tex.nvfp4_multi_tensor_compute_partial_amax([shard], [amax], [g], [h], [w], [start], 16)
        dist.all_reduce(amax, op=MAX, group=group)
        dist.all_reduce(g, op=MAX, group=group)
        gs = torch.empty_like(g)
        tex.nvfp4_compute_global_scale(g, gs)
        pbs = torch.zeros_like(amax)
        target = torch.zeros(ate.scale_inv_shapes(spec)["rowwise_scale_inv"], dtype=torch.uint8,
                             device=dev)
        tamax = torch.zeros(1, dtype=torch.float32, device=dev)
        tex.nvfp4_multi_tensor_fused_scale([amax], [g], [pbs], [target], [tamax], [tr], [tc],
                                           [target.shape[0]], 16)
        return {"amax": amax, "global_amax": g, "global_scale": gs, "rowwise_scale_inv": target,
                "amax_rowwise": tamax}
    rs, cs = ate.scale_inv_shapes(spec).values()
    dt = shard.dtype if has else getattr(torch, spec.dtype)
    row = torch.zeros(rs, dtype=dt, device=dev)
    col = torch.zeros(cs, dtype=dt, device=dev)
    if has:
        tex.mxfp8_scaling_compute_partial_amax(shard, row, col, h, w, start)
    dist.all_reduce(row, op=MAX, group=group)
    dist.all_reduce(col, op=MAX, group=group)
    ri = torch.empty(rs, dtype=torch.uint8, device=dev)
    ci = torch.empty(cs, dtype=torch.uint8, device=dev)
    multi_tensor_applier(multi_tensor_compute_scale_inv_e8m0, None, [[row, col], [ri, ci]])
    return {"amax_rowwise_blocks": row.float(), "amax_columnwise_blocks": col.float(),
            "rowwise_scale_inv": ri, "columnwise_scale_inv": ci}


def compare(got, want, what, errors, limit=20):
    """Byte comparison of every field of `want` present in `got`."""
    n = 0
    for f, w in want.items():
        if f not in got:
            continue
        g = np.ascontiguousarray(got[f])
        w = np.ascontiguousarray(np.asarray(w))
        n += 1
        if g.shape != w.shape or g.dtype != w.dtype or g.tobytes() != w.tobytes():
            if g.shape == w.shape and g.dtype == w.dtype:
                bad = np.flatnonzero(g.reshape(-1).view(np.uint8 if g.dtype == np.uint8 else np.uint32)
                                     != w.reshape(-1).view(np.uint8 if w.dtype == np.uint8
                                                           else np.uint32))
                msg = (f"{what} {f}: {bad.size} of {w.size} differ, first at {bad[0]}: "
                       f"{g.reshape(-1)[bad[0]]!r} vs {w.reshape(-1)[bad[0]]!r}")
            else:
                msg = f"{what} {f}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
            if len(errors) < limit:
                errors.append(msg)
    return n


def trainer(rank, args, sockets, port, q):
    try:
        import torch
        import torch.distributed as dist
        import amaxd
        import amaxd.te as ate
        torch.set_num_threads(2)
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=args.ranks)
        try:
            import transformer_engine_torch  # noqa: F401
            have_te = cuda
        except ImportError:
            have_te = False
        weights = make_weights(args.seed, args.scale)
        lays = layouts(weights, args.ranks, args.seed + 1)
        errors, checked = [], 0
        jobs = [(name, args.ranks, lay) for name, lay in lays.items()]
        # The same weights over 1, 2, ..., N ranks (Megatron cuts).
        jobs += [(f"megatron-dp{k}", k, layouts(weights, k, args.seed + 1)["megatron"])
                 for k in range(1, args.ranks)]
        paths = args.paths.split(",")
        digests = {p: {} for p in paths}
        timings = {p: [] for p in paths}
        for job, world, lay in jobs:
            group = dist.new_group(list(range(world))) if have_te else None
            if rank >= world:
                continue
            specs = [s for s, _ in weights]
            starts = [lay[s.name][rank][0] for s in specs]
            numels = [lay[s.name][rank][1] for s in specs]
            clients, casters = {}, {}
            for p in paths:
                c = clients[p] = amaxd.Client(f"te-cast-{job}-{p}", rank, world,
                                              socket=sockets[rank], timeout=600,
                                              max_message_bytes=1 << 30)
                c.join()
                # The device path's no-host-sync check (below) runs without
                # the step guard, whose read of W + 2 floats is the one host
                # sync of a device step.
                casters[p] = ate.Caster(c, specs, starts, numels, device=dev, path=p,
                                        verify=p != "device")
                if casters[p].path != p:
                    errors.append(f"{job} rank {rank}: asked for the {p} path, got "
                                  f"{casters[p].path} ({casters[p].path_reason})")
            try:
                for step in range(args.steps):
                    k = np.float32(2.0 ** -step)
                    masters = [torch.from_numpy((v * k)[s:s + n]).to(dev) if n else None
                               for (_, v), s, n in zip(weights, starts, numels)]
                    got = {}
                    for p in paths:
                        if cuda:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        if cuda and p == "device":
                            # No host sync inside a device step: torch
                            # raises on one.
                            torch.cuda.set_sync_debug_mode("error")
                            try:
                                out = casters[p].step(masters)
                            finally:
                                torch.cuda.set_sync_debug_mode(0)
                        else:
                            out = casters[p].step(masters)
                        if cuda:
                            torch.cuda.synchronize()
                        timings[p].append(time.perf_counter() - t0)
                        got[p] = {nm: {f: t.cpu().numpy() for f, t in fs.items()}
                                  for nm, fs in out.items()}
                    # 0. the device path's bytes are the packed path's.
                    for p in paths[1:]:
                        for spec in specs:
                            checked += compare(got[p][spec.name], got[paths[0]][spec.name],
                                               f"{job} rank {rank} step {step} {spec.name} ({p} "
                                               f"path vs {paths[0]} path)", errors)
                    for (spec, v), s in zip(weights, starts):
                        want = expected(spec, v * k, [lay[spec.name][r] for r in range(world)])
                        tw = None
                        if have_te:
                            sh = masters[specs.index(spec)]
                            sh = None if sh is None else sh.to(getattr(torch, spec.dtype))
                            tw = {f: t.cpu().numpy()
                                  for f, t in te_kernels(spec, sh, s, group).items()}
                        for p in paths:
                            checked += compare(got[p][spec.name], want,
                                               f"{job} rank {rank} step {step} {spec.name} "
                                               f"({p} path vs numpy TE)", errors)
                            if tw is not None:
                                checked += compare(got[p][spec.name], tw,
                                                   f"{job} rank {rank} step {step} {spec.name} "
                                                   f"({p} path vs TE kernels)", errors)
                    if step == 0 and job.startswith("megatron"):
                        for p in paths:
                            digests[p][world] = {nm: {f: a.tobytes() for f, a in fs.items()}
                                                 for nm, fs in got[p].items()}
            finally:
                for c in clients.values():
                    c.close()
        # 3. the same bytes whatever the number of ranks.
        if rank == 0:
            for p in paths:
                for k, d in digests[p].items():
                    if d != digests[p][args.ranks]:
                        errors.append(f"{p} path: megatron cuts over {k} ranks give other bytes "
                                      f"than over {args.ranks}")
        dist.destroy_process_group()
        q.put((rank, errors, checked, have_te, timings))
    except Exception:  # noqa: BLE001
        q.put((rank, [traceback.format_exc()], 0, False, {}))


def check_args(ap, args):
    """--amaxd, --paths and --device of te_cast.py and bench/te_cast_bench.py."""
    if not args.amaxd:
        ap.error("--amaxd (or AMAXD_BIN) is required")
    if args.paths is None:
        args.paths = "packed,device" if args.device == "cuda" else "packed"
    if "device" in args.paths.split(",") and args.device != "cuda":
        ap.error("the device path needs --device cuda")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    return args


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--amaxd", default=os.environ.get("AMAXD_BIN"),
                    help="the amaxd binary (default: $AMAXD_BIN)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--scale", type=int, default=1, help="weight size multiplier")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--paths", default=None,
                    help="amaxd.te paths, comma-separated, the first the reference of the others "
                         "(default: packed,device on cuda, packed on cpu)")
    args = check_args(ap, ap.parse_args())
    with tempfile.TemporaryDirectory(prefix="amaxd-te-cast-") as tmp:
        ds = start_daemons(args, tmp)
        try:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            port = free_ports(1)[0]
            procs = [ctx.Process(target=trainer, args=(r, args, [d.socket for d in ds], port, q))
                     for r in range(args.ranks)]
            for p in procs:
                p.start()
            res = [q.get(timeout=3600) for _ in procs]
            for p in procs:
                p.join(60)
        finally:
            rcs = [d.stop() for d in ds]
            logs = [d.log() for d in ds]
    bad = False
    for rank, errors, checked, have_te, timings in sorted(res, key=lambda x: x[0]):
        med = ", ".join(f"{p} {1e3 * float(np.median(t)):.1f} ms" for p, t in timings.items() if t)
        print(f"rank {rank}: {checked} fields compared (paths {args.paths}; "
              f"{'numpy TE and TE kernels' if have_te else 'numpy TE'}), "
              f"{len(errors)} mismatches; amaxd.te step median {med or '-'}")
        for e in errors:
            print("  " + e)
        bad |= bool(errors) or checked == 0
    if any(rcs):
        print(f"daemon exit codes {rcs}")
        for i, lg in enumerate(logs):
            print(f"--- daemon {i} log (tail) ---\n" + lg[-3000:])
        bad = True
    print(f"te_cast: {'FAILED' if bad else 'amaxd.te equals TE byte for byte on every rank'} "
          f"(paths {args.paths})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
