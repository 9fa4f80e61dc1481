"""Per optimizer step, TE's master-weight cast (issue 22): TransformerEngine's
pattern written in torch (partial amax of each rank's master shards, one
all_reduce(MAX) of the packed tile amaxes, a second one of the NVFP4 global
amaxes, the scale computations) against amaxd.te's two paths (the same
partial amaxes, one amaxd epoch, the scales from the daemon), in the same
run, on the same GPUs, for the weights of an 8B-parameter model
(Llama-3-8B shapes: 32 layers of q/k/v/o and gate/up/down, hidden 4096,
intermediate 14336, 8 KV heads), data parallel over --ranks GPUs,
Megatron's flat-buffer sharding:

- "packed": Caster(path="packed"), SendPacked + ReconcilePacked over
  shared memory (--no-shm: in the gRPC messages), the answer copied to
  the GPU;
- "device": Caster(path="device"), GPU-direct: the partial amaxes written
  into the device slab, ReconcileDevice over the doorbell (signals), the
  outputs derived from the device answer on the GPU, no host sync.

Each recipe (NVFP4 2D, FP8 block 128x128, MXFP8, FP8 current scaling) and
each path is a phase of its own (its own amaxd job, dropped after it, so
that the daemons hold one 8B catalog at a time): in a phase every step
times TE's pattern and then the path, each CUDA-synchronized behind a
barrier, the slowest rank of each step; medians over --steps steps after
--warmup. A path's ratio is its median over the median of TE's pattern in
the same phase. Before timing, one step of each side is compared byte for
byte with TE's pattern (scale_inv layouts, scales, global amax); a
mismatch fails the run.

    AMAXD_BIN=.gpu-build/amaxd python3 bench/te_cast_bench.py [--ranks 4] [--layers 32]
    python3 bench/te_cast_bench.py --amaxd build/amaxd --device cpu --ranks 2 --layers 1 --shrink 16

Needs torch with CUDA (and NCCL), CuPy or cuda-bindings for the device
path, and the amaxd client; one amaxd per GPU (CUDA backend, NCCL between
daemons) is started here. tests/gpu/te_cast.sh runs it with the staged
build.
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "e2e"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "gpu"))

FLT_MAX = 3.4028234663852886e38
FLT_MIN = 1.1754943508222875e-38


def llama8b_shapes(layers, shrink=1):
    h, i, kv = 4096 // shrink, 14336 // shrink, 1024 // shrink
    out = []
    for layer in range(layers):
        p = f"decoder.layers.{layer:02d}."
        out += [(p + "self_attention.q.weight", (h, h)), (p + "self_attention.k.weight", (kv, h)),
                (p + "self_attention.v.weight", (kv, h)), (p + "self_attention.o.weight", (h, h)),
                (p + "mlp.gate.weight", (i, h)), (p + "mlp.up.weight", (i, h)),
                (p + "mlp.down.weight", (h, i))]
    return out


def megatron_ranges(sizes, ranks):
    """Each weight's (start, numel) on each rank: one flat buffer of all
    weights cut in `ranks` equal pieces."""
    total = sum(sizes)
    per = -(-total // ranks)
    out, off = [], 0
    for sz in sizes:
        rr = []
        for r in range(ranks):
            a, b = max(off, r * per), min(off + sz, (r + 1) * per)
            rr.append((a - off, b - a) if b > a else (0, 0))
        out.append(rr)
        off += sz
    return out


class TEPattern:
    """TE's quantize_master_weights for one recipe, written in torch: zero
    buffers, partial amaxes, all_reduce(MAX) (two for NVFP4), the scales."""

    def __init__(self, specs, ranges, rank, device, group):
        import torch
        import amaxd.te as ate
        self.torch, self.ate = torch, ate
        self.specs, self.device, self.group = specs, device, group
        self.ranges = [rr[rank] for rr in ranges]
        self.kind = specs[0].kind
        self.shapes = []  # per weight: the amax buffer shape(s)
        for s in specs:
            if self.kind == "nvfp4":
                self.shapes.append([(-(-s.rows // 16), -(-s.cols // 16))])
            elif self.kind == "fp8_block":
                self.shapes.append([ate.scale_inv_shapes(s)["rowwise_scale_inv"]])
            elif self.kind == "mxfp8":
                self.shapes.append(list(ate.scale_inv_shapes(s).values()))
            else:
                self.shapes.append([(1,)])
        self.tiles = {"nvfp4": [(16, 16)], "fp8_block": [(128, 128)],
                      "mxfp8": [(1, 32), (32, 1)], "fp8_current": [None]}[self.kind]
        need = 0
        from amaxd import tiles as T
        self.blocks = []
        for s, (st, n) in zip(specs, self.ranges):
            bl = []
            for t in self.tiles:
                b = T.flat_range_block(s.rows, s.cols, t, st, n) if (t and n) else None
                bl.append(b)
                if b is not None:
                    need = max(need, b.shape[0] * t[0] * s.cols)
            self.blocks.append(bl)
        self.scratch = torch.zeros(max(need, 1), dtype=torch.bfloat16, device=device)

    def partial(self, x, spec, tile, blk, start, out):
        """max |x| per tile of the touched block into out (a zero buffer)."""
        th, tw = tile
        C = spec.cols
        (i0, j0), (h, w) = blk.offset, blk.shape
        flat = self.scratch[:h * th * C]
        a, n = start - i0 * th * C, x.numel()
        flat[:a].zero_()
        flat[a + n:].zero_()
        flat[a:a + n].copy_(x)
        flat.abs_()
        m = flat.view(h * th, C)
        o = out[i0:i0 + h, j0:j0 + w]
        full = min(j0 + w, C // tw)
        if full > j0:
            k = full - j0
            o[:, :k].copy_(m[:, j0 * tw:full * tw].reshape(h, th, k, tw).amax(dim=(1, 3)))
        if j0 + w > full:
            o[:, w - 1].copy_(m[:, full * tw:C].reshape(h, th, C - full * tw).amax(dim=(1, 2)))

    def step(self, masters):
        torch = self.torch
        import torch.distributed as dist
        sizes = [int(torch.Size(sh).numel()) for shs in self.shapes for sh in shs]
        dt = torch.bfloat16 if self.kind == "mxfp8" else torch.float32
        packed = torch.zeros(sum(sizes), dtype=dt, device=self.device)
        views, off = [], 0
        for shs in self.shapes:
            vv = []
            for sh in shs:
                k = int(torch.Size(sh).numel())
                vv.append(packed[off:off + k].view(sh))
                off += k
            views.append(vv)
        g = torch.zeros(len(self.specs), dtype=torch.float32, device=self.device)
        for i, (spec, m, (st, n)) in enumerate(zip(self.specs, masters, self.ranges)):
            if m is None or n == 0:
                continue
            x = m.to(torch.bfloat16)  # master_weight.to(model_weight.dtype)
            if self.kind == "fp8_current":
                views[i][0].copy_(x.abs().amax().float().reshape(1))
                continue
            for t, blk, v in zip(self.tiles, self.blocks[i], views[i]):
                self.partial(x, spec, t, blk, st, v)
            if self.kind == "nvfp4":
                g[i] = x.abs().amax().float()
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group)
        if self.kind == "nvfp4":
            dist.all_reduce(g, op=dist.ReduceOp.MAX, group=self.group)
        return self.scales(views, g)

    def fp8_scale(self, amax, spec):
        """compute_scale_from_amax (value_for_inf FLT_MAX) and 1/scale."""
        torch = self.torch
        fmax = 57344.0 if spec.fp8_format == "e5m2" else 448.0
        a = torch.where(amax < spec.eps, torch.full_like(amax, spec.eps), amax)
        s = torch.full_like(a, fmax).div_(a)
        s = torch.where(torch.isinf(s), torch.full_like(s, FLT_MAX), s)
        s = torch.where((a == 0) | ~torch.isfinite(a), torch.ones_like(s), s)
        if spec.power_of_2:
            s = (s.view(torch.int32) & -8388608).view(torch.float32)  # 0xff800000
        return s, torch.ones_like(s).div_(s)

    def e8m0(self, amax):
        """float_to_e8m0(amax * float(1/448)) on finite amax >= 0."""
        torch = self.torch
        v = amax.float() * torch.tensor(1.0 / 448.0, dtype=torch.float32, device=amax.device)
        b = v.view(torch.int32)
        e, m = (b >> 23) & 0xFF, b & 0x7FFFFF
        up = (m > 0) & (e != 0xFE) & ~((e == 0) & (m <= 0x400000))
        e = torch.where(v == 0, torch.zeros_like(e), e + up.to(torch.int32))
        return e.to(torch.uint8)

    def scales(self, views, g):
        torch = self.torch
        out = {}
        for i, spec in enumerate(self.specs):
            if self.kind in ("fp8_current", "fp8_block"):
                s, inv = self.fp8_scale(views[i][0], spec)
                out[spec.name] = ({"scale": s, "scale_inv": inv} if self.kind == "fp8_current"
                                  else {"scale": s, "rowwise_scale_inv": inv})
            elif self.kind == "mxfp8":
                out[spec.name] = {"rowwise_scale_inv": self.e8m0(views[i][0]),
                                  "columnwise_scale_inv": self.e8m0(views[i][1])}
            else:
                a, gi = views[i][0], g[i:i + 1]
                senc = torch.where(gi > 0, torch.clamp(torch.full_like(gi, 2688.0).div_(
                    torch.clamp(gi, min=FLT_MIN)), max=FLT_MAX), torch.ones_like(gi))
                k = senc * torch.tensor(1.0 / 6.0, dtype=torch.float32, device=gi.device)
                pbs = torch.clamp(a * k, max=FLT_MAX)
                byts = torch.clamp(pbs, max=448.0).to(torch.float8_e4m3fn).view(torch.uint8)
                tr, tc = a.shape
                tgt = torch.zeros(self.ate.scale_inv_shapes(spec)["rowwise_scale_inv"],
                                  dtype=torch.uint8, device=a.device)
                rp = tgt.shape[0]
                tgt.view(-1)[:rp * tc].view(rp, tc)[:tr * 16].copy_(
                    byts.repeat_interleave(16, dim=0))
                out[spec.name] = {"rowwise_scale_inv": tgt, "amax_rowwise": gi.clone(),
                                  "global_scale": senc}
        return out


def sync(torch, cuda):
    if cuda:
        torch.cuda.synchronize()


def trainer(rank, args, sockets, port, q):
    try:
        import torch
        import torch.distributed as dist
        import amaxd
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=args.ranks)
        shapes = llama8b_shapes(args.layers, args.shrink)
        sizes = [r * c for _, (r, c) in shapes]
        ranges = megatron_ranges(sizes, args.ranks)
        gen = torch.Generator(device=dev).manual_seed(1234 + rank)
        masters = [torch.randn(rr[rank][1], generator=gen, device=dev) * 0.02 if rr[rank][1] else None
                   for rr in ranges]
        rows = []
        for kind in args.recipes.split(","):
            for path in args.paths.split(","):
                try:
                    rows.append(run_phase(kind, path, rank, args, sockets, shapes, ranges, masters,
                                          dev, cuda))
                except amaxd.AmaxdError as e:  # e.g. a catalog over the daemon's limits
                    rows.append((kind, path, 0, 0.0, -1, str(e)))
        dist.destroy_process_group()
        q.put((rank, rows, None))
    except Exception:  # noqa: BLE001
        q.put((rank, None, traceback.format_exc()))


def run_phase(kind, path, rank, args, sockets, shapes, ranges, masters, dev, cuda):
    """One recipe through one amaxd.te path: register, check the bytes of
    one step against TE's pattern, time both, drop the job."""
    import torch
    import torch.distributed as dist
    import amaxd
    import amaxd.te as ate
    specs = [ate.WeightSpec(n, s, kind, "bfloat16", power_of_2=kind == "fp8_block")
             for n, s in shapes]
    te = TEPattern(specs, ranges, rank, dev, None)
    with amaxd.Client(f"te-bench-{kind}-{path}", rank, args.ranks, socket=sockets[rank],
                      timeout=1200, max_message_bytes=1 << 30,
                      shm=path == "packed" and not args.no_shm) as c:
        c.join()
        try:
            return _phase_body(c, kind, path, rank, args, specs, ranges, masters, te, dev, cuda)
        except amaxd.AmaxdError:
            # Drop the job on every daemon even when the phase failed (a
            # catalog or an answer over a limit), or the next phase would
            # find its cells still held.
            sync(torch, cuda)
            try:
                c.close_device()
            except Exception:  # noqa: BLE001
                pass
            dist.barrier()
            if rank == 0:
                c.reset(drop_job=True)
            dist.barrier()
            raise
        finally:
            if cuda:
                torch.cuda.empty_cache()


def _phase_body(c, kind, path, rank, args, specs, ranges, masters, te, dev, cuda):
    """run_phase's work once the client has joined."""
    import torch
    import torch.distributed as dist
    import amaxd.te as ate
    t0 = time.perf_counter()
    cast = ate.Caster(c, specs, [rr[rank][0] for rr in ranges],
                      [rr[rank][1] for rr in ranges], device=dev, path=path)
    t_reg = time.perf_counter() - t0  # registration and buffers (device: OpenDevice)
    if cast.path != path:
        raise RuntimeError(f"{kind}: asked for the {path} path, got {cast.path} "
                           f"({cast.path_reason})")
    # Byte check of one step of each side.
    mine = cast.step(masters)
    theirs = te.step(masters)
    bad = 0
    for s in specs:
        for f, t in theirs[s.name].items():
            a, b = mine[s.name][f], t
            if kind == "fp8_current" and f in ("scale", "scale_inv"):
                b = b.reshape(1)
            if a.shape != b.shape or not torch.equal(a.contiguous().view(torch.uint8),
                                                      b.contiguous().view(torch.uint8)):
                bad += 1
    del mine, theirs
    times = {"te": [], "amaxd": [], "partial": []}
    for it in range(args.warmup + args.steps):
        for side, fn in (("te", lambda: te.step(masters)),
                         ("amaxd", lambda: cast.step(masters))):
            dist.barrier()
            sync(torch, cuda)
            t0 = time.perf_counter()
            fn()
            sync(torch, cuda)
            if it >= args.warmup:
                times[side].append(time.perf_counter() - t0)
        if it >= args.warmup:  # the partial amaxes alone (the same code both paths)
            sync(torch, cuda)
            t0 = time.perf_counter()
            for i, (s, m) in enumerate(zip(specs, masters)):
                if m is not None:
                    cast._partial(s, cast.parts[i], cast.blocks[i], cast.ranges[i], m)
            sync(torch, cuda)
            times["partial"].append(time.perf_counter() - t0)
    cells = cast.layout.total_cells
    # Every rank done with the job's buffers before they are freed.
    sync(torch, cuda)
    del cast
    c.close_device()
    dist.barrier()
    if rank == 0:
        c.reset(drop_job=True)
    dist.barrier()
    return (kind, path, cells, t_reg, bad, times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--amaxd", default=os.environ.get("AMAXD_BIN"),
                    help="the amaxd binary (default: $AMAXD_BIN)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--shrink", type=int, default=1, help="divide hidden/intermediate sizes")
    ap.add_argument("--recipes", default="nvfp4,fp8_block,mxfp8,fp8_current")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--no-shm", action="store_true", help="the packed path in the gRPC messages")
    ap.add_argument("--paths", default=None,
                    help="amaxd.te paths, comma-separated (default: packed,device on cuda, "
                         "packed on cpu)")
    from te_cast import check_args, free_ports, start_daemons
    args = check_args(ap, ap.parse_args())
    with tempfile.TemporaryDirectory(prefix="amaxd-te-bench-") as tmp:
        # An 8B model's MXFP8 blocks are 2 x 218 M cells: above the default
        # max_cells (2^28) and max_request_memory (256 MiB).
        ds = start_daemons(args, tmp, ["--max-cells=4294967295",
                                       "--max-request-memory=34359738368"])
        try:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            port = free_ports(1)[0]
            procs = [ctx.Process(target=trainer, args=(r, args, [d.socket for d in ds], port, q))
                     for r in range(args.ranks)]
            for p in procs:
                p.start()
            res = sorted([q.get(timeout=7200) for _ in procs], key=lambda x: x[0])
            for p in procs:
                p.join(60)
        finally:
            for d in ds:
                d.stop()
    errs = [e for _, _, e in res if e]
    if errs:
        print("\n".join(errs))
        return 1
    shapes = llama8b_shapes(args.layers, args.shrink)
    params = sum(r * c for _, (r, c) in shapes)
    paths = args.paths.split(",")
    print(f"\nTE master-weight cast per optimizer step: {len(shapes)} weights, {params / 1e9:.2f} B "
          f"parameters, DP = {args.ranks} ({args.device}), one amaxd per rank "
          f"({'NCCL' if args.device == 'cuda' else 'Gloo'}); packed path "
          f"{'in the messages' if args.no_shm else 'over shared memory'}, device path GPU-direct "
          f"(doorbell); median of {args.steps} steps, slowest rank; ratio = path / TE's pattern "
          f"in the same phase")
    head = f"{'recipe':12s} {'amax cells':>11s} {'partial amax':>13s} {'TE pattern':>11s}"
    for p in paths:
        head += f" {p:>9s} {p[:6] + '/TE':>9s}"
    print(head + "  register  bytes")
    bad = False
    med = statistics.median
    rows = [r[1] for r in res]  # per rank: (kind, path, ...) per phase
    by_kind = {}
    for k, row in enumerate(rows[0]):
        by_kind.setdefault(row[0], []).append(k)
    for kind, ks in by_kind.items():
        line, cells, te_all, pa_all, regs, notes = "", 0, [], [], [], []
        mism = 0
        for k in ks:
            path = rows[0][k][1]
            if any(r[k][4] < 0 for r in rows):
                msg = next(r[k][5] for r in rows if r[k][4] < 0)
                notes.append(f"{path} not run: {msg[:300]}")
                line += f" {'-':>9s} {'-':>9s}"
                continue
            cells = rows[0][k][2]
            mism += sum(r[k][4] for r in rows)

            def slowest(side):
                return med([max(r[k][5][side][i] for r in rows) for i in range(args.steps)]) * 1e3

            te_ms, am_ms = slowest("te"), slowest("amaxd")
            te_all.append(te_ms)
            pa_all.append(slowest("partial"))
            regs.append(f"{path} {max(r[k][3] for r in rows):.1f}s")
            line += f" {am_ms:7.2f}ms {am_ms / te_ms:8.2f}x"
        te_ms = med(te_all) if te_all else float("nan")
        pa_ms = med(pa_all) if pa_all else float("nan")
        print(f"{kind:12s} {cells:11d} {pa_ms:11.2f}ms {te_ms:9.2f}ms{line}  {', '.join(regs)}  "
              f"{'equal' if mism == 0 else f'{mism} DIFFER'}")
        for n in notes:
            print(f"  {n}")
        bad |= mism != 0 or bool(notes)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
