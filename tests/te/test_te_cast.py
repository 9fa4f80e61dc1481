"""amaxd.te against TransformerEngine's master-weight cast (issue 22, item 3),
on CPU: torch tensors in, one amaxd daemon, data-parallel ranks as threads.

The reference is tests/e2e/te_reference.py: TE main's partial-amax kernels,
all_reduce(MAX) and scale kernels transcribed in numpy (file, function and
commit at each function), independent of amaxd. For NVFP4 2D, FP8 block
scaling (128x128), MXFP8 and FP8 current scaling, with weight shapes that
are not multiples of the tile, data-parallel degrees 1..8, random shard
offsets (empty shards included) and zero, subnormal, huge and NaN weights,
every field amaxd.te returns is the reference's, byte for byte, on every
rank; the same weights sharded over 1, 2, 4 and 8 ranks give the same
bytes; the catalog is registered once for many steps.
"""
import os
import sys
import threading
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import amaxd  # noqa: E402
import amaxd.te as ate  # noqa: E402
import te_reference as ter  # noqa: E402
from amaxd_proc import Daemon  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("amaxd")))
    yield d
    d.check_clean_exit(d.stop())


def weight_values(rng, numel, kind_of_values):
    """float32 master values: normal * a random magnitude, with zeros,
    bf16/fp32 subnormals, huge values (below bf16's max) and NaN."""
    x = (rng.standard_normal(numel) * np.exp(rng.uniform(-25, 25))).astype(np.float32)
    if kind_of_values == "zero":
        return np.zeros(numel, np.float32)
    x[rng.random(numel) < 0.05] = 0
    x[rng.random(numel) < 0.01] = np.float32(-0.0)
    x[rng.random(numel) < 0.01] = np.float32(3e-39)  # a bf16 and fp32 subnormal
    x[rng.random(numel) < 0.01] = np.float32(1e-45)  # fp32 subnormal; bf16 rounds it to 0
    if kind_of_values == "huge":
        x[rng.integers(numel)] = np.float32(-3.0e38)
    if kind_of_values == "tiny":
        x = (x * np.float32(1e-30)).astype(np.float32)  # scales near FLT_MAX
    x[rng.random(numel) < 0.002] = np.nan  # TE's fmaxf skips NaN
    return x


def random_specs(rng, tag):
    """Weights of every kind, shapes not multiples of their tiles (MXFP8:
    multiples of 32, as TE requires, not of 128)."""
    out = []
    for k, kind in enumerate(ate.KINDS * 2):
        if kind == "mxfp8":
            shape = (32 * int(rng.integers(1, 9)), 32 * int(rng.integers(1, 9)))
        elif kind == "fp8_block":
            shape = (int(rng.integers(1, 300)), int(rng.integers(1, 400)))
        else:
            shape = (int(rng.integers(1, 90)), int(rng.integers(1, 130)))
        dtype = "float32" if (kind in ("fp8_block", "fp8_current") and k >= 4) else "bfloat16"
        spec = ate.WeightSpec(f"{tag}.{kind}{k}", shape, kind, dtype,
                              "e5m2" if k == 3 else "e4m3",
                              eps=float(rng.choice([0.0, 0.0, 1e-30])) if kind != "nvfp4" else 0.0,
                              power_of_2=bool(k % 2) if kind.startswith("fp8") else False)
        vals = weight_values(rng, shape[0] * shape[1], ["normal", "zero", "huge", "tiny"][k % 4])
        out.append((spec, vals))
    return out


def random_ranges(rng, numel, dp):
    c = np.sort(rng.integers(0, numel + 1, dp - 1))
    if dp > 2:
        c[rng.integers(0, dp - 1)] = c[0]  # an empty shard
        c = np.sort(c)
    b = np.concatenate([[0], c, [numel]])
    out = [(int(b[k]), int(b[k + 1] - b[k])) for k in range(dp)]
    assert all(n >= 0 for _, n in out) and sum(n for _, n in out) == numel
    return out


def even_ranges(numel, dp):
    """Megatron's distributed optimizer: a contiguous buffer cut in equal
    pieces (the last ranks may get less, or nothing)."""
    per = -(-numel // dp)
    return [(min(k * per, numel), max(0, min(per, numel - k * per))) for k in range(dp)]


def model_dtype_view(spec, vals):
    """What TE's kernels read: the master values cast to the model dtype."""
    return torch.from_numpy(vals).to(getattr(torch, spec.dtype)).float().numpy()


def expected(spec, vals, ranges):
    v = model_dtype_view(spec, vals)
    shards = [v[s:s + n] if n else None for s, n in ranges]
    return ter.te_cast(spec.kind, shards, [s for s, _ in ranges], spec.rows, spec.cols,
                       fp8_max=57344.0 if spec.fp8_format == "e5m2" else 448.0,
                       pow2=spec.power_of_2, eps=spec.eps)


def in_threads(fn, n, timeout):
    """fn(r) for r in 0..n-1, one thread each; raises the first rank's
    exception (with its rank) if any failed or hung."""
    errors = []

    def body(r):
        try:
            fn(r)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append((r, e))
    ts = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    [t.start() for t in ts]
    [t.join(timeout) for t in ts]
    assert not any(t.is_alive() for t in ts), f"a rank hangs after {timeout} s"
    assert not errors, errors


def run_ranks(daemon, job, weights, ranges_of, dp, steps=1, device="cpu"):
    """Each rank: a client, a Caster built once, `steps` steps (step k's
    master values are vals * 2^-k, exactly); returns per rank per step
    {name: {field: numpy}}."""
    out = [None] * dp

    def rank(r):
        with daemon.client(job, r, dp) as c:
            c.join()
            specs = [w[0] for w in weights]
            starts = [ranges_of[w[0].name][r][0] for w in weights]
            numels = [ranges_of[w[0].name][r][1] for w in weights]
            cast = ate.Caster(c, specs, starts, numels)
            res = []
            for k in range(steps):
                masters = []
                for (spec, vals), s, n in zip(weights, starts, numels):
                    v = (vals * np.float32(2.0 ** -k)).astype(np.float32)
                    masters.append(torch.from_numpy(v[s:s + n]).to(device) if n else None)
                o = cast.step(masters)
                res.append({nm: {f: t.cpu().numpy().copy() for f, t in fields.items()}
                            for nm, fields in o.items()})
            out[r] = res

    in_threads(rank, dp, 300)
    return out


def assert_same(got, want, what):
    for f, w in want.items():
        g = got[f]
        w = np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, f, g.dtype, g.shape, w.dtype, w.shape)
        if g.tobytes() != w.tobytes():
            bad = np.flatnonzero(g.reshape(-1).view(np.uint8 if g.dtype == np.uint8 else np.uint32)
                                 != w.reshape(-1).view(np.uint8 if w.dtype == np.uint8 else np.uint32))
            raise AssertionError(f"{what} {f}: {bad.size} of {w.size} differ, first at {bad[0]}: "
                                 f"{g.reshape(-1)[bad[0]]!r} vs TE {w.reshape(-1)[bad[0]]!r}")


@pytest.mark.parametrize("dp", range(1, 9))
def test_parity_with_te(daemon, dp):
    rng = np.random.default_rng(1000 + dp)
    weights = random_specs(rng, f"dp{dp}")
    ranges_of = {s.name: random_ranges(rng, s.rows * s.cols, dp) for s, _ in weights}
    got = run_ranks(daemon, f"te-parity-{dp}", weights, ranges_of, dp, steps=2)
    for spec, vals in weights:
        for k in range(2):
            want = expected(spec, (vals * np.float32(2.0 ** -k)).astype(np.float32),
                            ranges_of[spec.name])
            for r in range(dp):
                assert_same(got[r][k][spec.name], want, f"dp {dp} rank {r} step {k} {spec.name}")


def test_same_bytes_over_1_2_4_8_ranks(daemon):
    rng = np.random.default_rng(7)
    weights = random_specs(rng, "layout")
    results = {}
    for dp in (1, 2, 4, 8):
        ranges_of = {s.name: even_ranges(s.rows * s.cols, dp) for s, _ in weights}
        results[dp] = run_ranks(daemon, f"te-layout-{dp}", weights, ranges_of, dp)
    for spec, _ in weights:
        ref0 = results[1][0][0][spec.name]
        for dp in (2, 4, 8):
            for r in range(dp):
                assert_same(results[dp][r][0][spec.name], ref0, f"dp {dp} rank {r} {spec.name}")


def test_registered_once_for_many_steps(daemon):
    """One catalog for the job: the Caster registers in its constructor
    only; 20 steps reuse the layout; results follow the data."""
    rng = np.random.default_rng(11)
    weights = random_specs(rng, "steps")[:4]
    dp = 2
    ranges_of = {s.name: random_ranges(rng, s.rows * s.cols, dp) for s, _ in weights}
    calls = {"register": 0, "layout": 0}
    orig_reg, orig_layout = amaxd.Client.register, amaxd.Client.layout

    def reg(self, *a, **k):
        calls["register"] += 1
        return orig_reg(self, *a, **k)

    def lay(self, refresh=False):
        calls["layout"] += refresh or self._layout is None
        return orig_layout(self, refresh)

    amaxd.Client.register, amaxd.Client.layout = reg, lay
    try:
        got = run_ranks(daemon, "te-steps", weights, ranges_of, dp, steps=20)
    finally:
        amaxd.Client.register, amaxd.Client.layout = orig_reg, orig_layout
    assert calls == {"register": dp, "layout": dp}
    with daemon.client("te-steps", 0, dp) as c:
        # The weights' quantizers and the step guard's three.
        want = sum(len(ate._parts(s)) for s, _ in weights) + 3
        assert len(c.list_quantizers().quantizers) == want
    for spec, vals in weights:
        want = expected(spec, (vals * np.float32(2.0 ** -19)).astype(np.float32),
                        ranges_of[spec.name])
        assert_same(got[0][19][spec.name], want, spec.name)


def _rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_thousands_of_steps(daemon):
    """Issue 22, item 4: one job, 3000 optimizer steps on 3 ranks (one
    with an empty shard), all four recipes: registered once, every 500th
    step byte for byte against the TE transcription (its values change
    every step), one epoch per step, and the
    daemon's memory flat once warm (no per-step allocation that stays)."""
    rng = np.random.default_rng(3000)
    weights = [(s, v) for s, v in random_specs(rng, "long")[:4]]
    dp, steps = 3, 3000
    ranges_of = {s.name: [(0, s.rows * s.cols), (s.rows * s.cols, 0), (s.rows * s.cols, 0)]
                 if k == 0 else random_ranges(rng, s.rows * s.cols, dp)
                 for k, (s, _) in enumerate(weights)}
    checked, rss = [0] * dp, {}
    factors = [np.float32(2.0 ** -(k % 23)) for k in range(steps)]

    def rank(r):
        with daemon.client("te-long", r, dp) as c:
            c.join()
            specs = [w[0] for w in weights]
            starts = [ranges_of[s.name][r][0] for s in specs]
            numels = [ranges_of[s.name][r][1] for s in specs]
            cast = ate.Caster(c, specs, starts, numels)
            srcs = [torch.from_numpy(v[st:st + n].copy()) if n else None
                    for (_, v), st, n in zip(weights, starts, numels)]
            for k in range(steps):
                masters = [x * float(factors[k]) if x is not None else None for x in srcs]
                out = cast.step(masters)
                if r == 0 and k in (200, steps - 1):
                    rss[k] = _rss_kib(daemon.proc.pid)
                if k % 500 == 0 or k == steps - 1:
                    for spec, vals in weights:
                        want = expected(spec, (vals * factors[k]).astype(np.float32),
                                        ranges_of[spec.name])
                        assert_same({f: t.cpu().numpy() for f, t in out[spec.name].items()},
                                    want, f"rank {r} step {k} {spec.name}")
                    checked[r] += 1

    in_threads(rank, dp, 900)
    assert checked == [7] * dp, checked
    with daemon.client("te-long", 0, dp) as c:
        job = c.status("te-long").jobs[0]
        # One epoch per step (the Caster's constructor reconciles none).
        assert job.reconciled_epochs == steps and job.epochs_failed == 0, job
        # The weights' quantizers and the step guard's three.
        want = sum(len(ate._parts(s)) for s, _ in weights) + 3
        assert len(c.list_quantizers().quantizers) == want
    # Flat once warm: 2800 more steps may not keep more than 4 MiB.
    assert rss[steps - 1] - rss[200] < 4096, rss


# -- TE model weights (stand-ins with TE's attribute names) --

class NVFP4Quantizer:
    with_2d_quantization = True


class Float8BlockQuantizer:
    block_scaling_dim, block_len, dtype = 2, 128, "DType.kFloat8E4M3"
    force_pow_2_scales, amax_epsilon = True, 0.0


class MXFP8Quantizer:
    dtype = "DType.kFloat8E4M3"


class Float8CurrentScalingQuantizer:
    dtype, force_pow_2_scales, amax_epsilon = "DType.kFloat8E5M2", False, 0.0


def fake_te_weight(q, shape):
    """A TE quantized weight as quantize_master_weights sees it: shape,
    dtype, _get_quantizer() and the scale buffers TE allocates (filled with
    0xab so that bytes TE does not write stay visible)."""
    w = types.SimpleNamespace(shape=torch.Size(shape), dtype=torch.bfloat16,
                              _get_quantizer=lambda: q, calls=[])
    w.update_usage = lambda **kw: w.calls.append(("update_usage", kw))
    w._reset_caches = lambda: w.calls.append(("_reset_caches",))
    w.clear_high_precision_init_val = lambda: w.calls.append(("clear",))
    spec = ate.WeightSpec.from_te("x", w)
    for f, s in ate.scale_inv_shapes(spec).items():
        dt = torch.uint8 if spec.kind in ("nvfp4", "mxfp8") else torch.float32
        t = torch.full(s, 0xab, dtype=torch.uint8).view(dt) if dt == torch.uint8 else \
            torch.full(s, 7.0)
        setattr(w, "_" + f, t)
    if spec.kind == "nvfp4":
        w._amax_rowwise = torch.zeros(1)
    return w


def test_drop_in_writes_te_weights(daemon):
    """amaxd.te.quantize_master_weights on TE-like weights: specs read from
    their quantizers, scales written where TE writes them. NVFP4 with
    ceil(C/16) not a multiple of 4: TE's nvfp4_fused_scale_kernel writes
    rows_padded * tile_cols bytes with row stride tile_cols, the rest of
    the buffer keeps its bytes; amaxd.te writes exactly those bytes."""
    rng = np.random.default_rng(5)
    shapes = [(40, 72), (200, 130), (64, 96), (30, 50)]  # 72/16 -> 5 tile columns
    quants = [NVFP4Quantizer(), Float8BlockQuantizer(), MXFP8Quantizer(),
              Float8CurrentScalingQuantizer()]
    dp = 3
    vals = [weight_values(rng, a * b, "normal") for a, b in shapes]
    ranges = [random_ranges(rng, a * b, dp) for a, b in shapes]
    ws = [None] * dp

    def rank(r):
        with daemon.client("te-dropin", r, dp) as c:
            c.join()
            mws = [fake_te_weight(q, s) for q, s in zip(quants, shapes)]
            for _ in range(2):  # the second call reuses the first's registration
                masters = [torch.from_numpy(v[s:s + n]) if n else None
                           for v, (s, n) in zip(vals, (rg[r] for rg in ranges))]
                ate.quantize_master_weights(mws, masters, [rg[r][0] for rg in ranges],
                                            client=c, names=["a", "b", "c", "d"])
            ws[r] = mws

    in_threads(rank, dp, 120)
    for i, (q, shape) in enumerate(zip(quants, shapes)):
        spec = ate.WeightSpec.from_te("x", fake_te_weight(q, shape))
        want = expected(spec, vals[i], ranges[i])
        for r in range(dp):
            mw = ws[r][i]
            # TE's side effects on every model weight, every call.
            side = {"nvfp4": ("update_usage", {"rowwise_usage": True, "columnwise_usage": False}),
                    "fp8_block": ("update_usage", {"rowwise_usage": True,
                                                   "columnwise_usage": False}),
                    "fp8_current": ("_reset_caches",)}.get(spec.kind)
            assert mw.calls == [("clear",)] + ([side] if side else []) + [("clear",)] + \
                ([side] if side else [])
            if spec.kind == "nvfp4":
                tc = -(-shape[1] // 16)
                tgt = np.full(ate.scale_inv_shapes(spec)["rowwise_scale_inv"], 0xab, np.uint8)
                _, _, te_bytes, _ = ter.nvfp4_fused_scale(want["amax"], want["global_amax"][0],
                                                          shape[0], tgt)
                assert mw._rowwise_scale_inv.numpy().tobytes() == te_bytes.tobytes()
                assert te_bytes.reshape(-1)[-1] == 0xab and tc % 4 != 0  # TE's stride quirk
                assert mw._amax_rowwise.numpy().tobytes() == want["amax_rowwise"].tobytes()
            elif spec.kind == "mxfp8":
                assert mw._rowwise_scale_inv.numpy().tobytes() == want["rowwise_scale_inv"].tobytes()
                assert mw._columnwise_scale_inv.numpy().tobytes() == \
                    want["columnwise_scale_inv"].tobytes()
            elif spec.kind == "fp8_block":
                assert spec.power_of_2
                assert mw._rowwise_scale_inv.numpy().tobytes() == want["rowwise_scale_inv"].tobytes()
            else:
                assert spec.fp8_format == "e5m2"
                assert mw._scale_inv.numpy().tobytes() == want["scale_inv"].tobytes()


def test_infinite_weight_is_refused(daemon):
    """TE would read an inf tile amax as scale 1; amaxd refuses an infinite
    amax with INVALID_ARGUMENT naming the quantizer, and the epoch stays
    open for the next try."""
    spec = ate.WeightSpec("inf", (20, 20), "fp8_block")
    v = np.ones(400, np.float32)
    v[17] = np.inf
    with daemon.client("te-inf", 0, 1) as c:
        c.join()
        cast = ate.Caster(c, [spec], [0], [400])
        with pytest.raises(amaxd.errors.InvalidArgument, match="inf.fp8_block"):
            cast.step([torch.from_numpy(v)])
        v[17] = 2
        out = cast.step([torch.from_numpy(v)])
        assert out["inf"]["amax"][0, 0].item() == 2


def _join_all(clients):
    ts = [threading.Thread(target=c.join) for c in clients]
    [t.start() for t in ts]
    [t.join(60) for t in ts]


def _step_all(casts, masters_of, k):
    """Step k on every rank at once (threads); per rank the outputs as numpy
    or the exception."""
    out = [None] * len(casts)

    def one(r):
        try:
            o = casts[r].step(masters_of(r, k))
            out[r] = {n: {f: t.cpu().numpy().copy() for f, t in fs.items()} for n, fs in o.items()}
        except Exception as e:  # noqa: BLE001 (returned)
            out[r] = e
    ts = [threading.Thread(target=one, args=(r,)) for r in range(len(casts))]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    return out


def test_a_failed_step_is_an_error_on_every_rank(daemon):
    """Found from outside: +inf in one rank's master weights made that
    rank's step raise while the other rank's step returned scales without
    its shard, and from then on each rank's step paired with the other's
    previous one (scales of mixed steps, silently). With the step guard,
    the bad rank raises the daemon's INVALID_ARGUMENT, the other raises
    StepMismatch naming it, and the next step is clean on both, for every
    recipe."""
    rng = np.random.default_rng(5)
    weights = random_specs(rng, "guard")[:4]
    dp = 2
    ranges_of = {s.name: even_ranges(s.rows * s.cols, dp) for s, _ in weights}
    clients = [daemon.client("te-guard", r, dp) for r in range(dp)]
    _join_all(clients)
    casts = [ate.Caster(c, [w[0] for w in weights], [ranges_of[w[0].name][r][0] for w in weights],
                        [ranges_of[w[0].name][r][1] for w in weights])
             for r, c in enumerate(clients)]
    vals = [np.nan_to_num(v, nan=1.0) for _, v in weights]

    def masters(r, k):
        out = []
        for (spec, _), v in zip(weights, vals):
            st, n = ranges_of[spec.name][r]
            x = (v * np.float32(2.0 ** -k)).astype(np.float32)[st:st + n].copy()
            if k == 1 and r == 0 and n:
                x[0] = np.inf
            out.append(torch.from_numpy(x) if n else None)
        return out
    got = _step_all(casts, masters, 0)
    assert not any(isinstance(o, Exception) for o in got), got
    got = _step_all(casts, masters, 1)
    assert isinstance(got[0], amaxd.errors.InvalidArgument), got[0]
    assert isinstance(got[1], ate.StepMismatch), got[1]
    assert "rank(s) 0 contributed nothing" in str(got[1]), got[1]
    for k in (2, 3):
        got = _step_all(casts, masters, k)
        for r in range(dp):
            assert not isinstance(got[r], Exception), (k, r, got[r])
            for (spec, _), v in zip(weights, vals):
                want = expected(spec, (v * np.float32(2.0 ** -k)).astype(np.float32),
                                ranges_of[spec.name])
                assert_same(got[r][spec.name], want, f"step {k} rank {r} {spec.name}")
    for c in clients:
        c.close()


def test_a_step_after_a_timed_out_one_is_not_mixed(tmp_path):
    """Found from outside: a step whose epoch timed out (a rank never came)
    leaves its contributions in the daemon (kept, as for every epoch), and
    the next step's scales silently took them in (the max of both steps).
    With the step guard that step raises StepMismatch on every rank (the
    ids of two steps met in one epoch), and the one after is clean."""
    d = Daemon(str(tmp_path), "--reconcile-timeout-ms=1500")
    try:
        spec = ate.WeightSpec("w", (8, 40), "fp8_current")
        dp = 3
        ranges = even_ranges(320, dp)
        clients = [d.client("te-retry", r, dp) for r in range(dp)]
        _join_all(clients)
        casts = [ate.Caster(c, [spec], [ranges[r][0]], [ranges[r][1]])
                 for r, c in enumerate(clients)]
        scale = {0: 100.0, 1: 0.5, 2: 0.25, 3: 0.125}

        def masters(r, k):
            st, n = ranges[r]
            return [torch.full((n,), scale[k] * (1 + r), dtype=torch.float32)]
        # Step 0 on ranks 0 and 1 only: it times out there.
        got = _step_all(casts[:2], masters, 0)
        assert all(isinstance(o, amaxd.errors.DeadlineExceeded) for o in got), got
        got = _step_all(casts, masters, 1)
        assert all(isinstance(o, ate.StepMismatch) for o in got), got
        assert "merged contributions of step ids" in str(got[0]), got[0]
        for k in (2, 3):
            got = _step_all(casts, masters, k)
            for r in range(dp):
                assert not isinstance(got[r], Exception), (k, r, got[r])
                assert got[r]["w"]["amax"][0] == np.float32(scale[k] * dp), (k, r, got[r]["w"])
        for c in clients:
            c.close()
    finally:
        d.check_clean_exit(d.stop())


def test_power_of_2_defaults_as_te():
    """force_pow_2_scales defaults as TE's quantizers (TE main d0067d0):
    Float8BlockQuantizer True, Float8CurrentScalingQuantizer False (found
    from outside: a hand-built fp8_block spec used False)."""
    assert ate.WeightSpec("d", (8, 8), "fp8_block").power_of_2 is True
    assert ate.WeightSpec("d", (8, 8), "fp8_current").power_of_2 is False
    assert ate.WeightSpec("d", (8, 8), "fp8_block", power_of_2=False).power_of_2 is False


def test_bad_specs():
    with pytest.raises(ValueError, match="divisible by 32"):
        ate.WeightSpec("m", (33, 64), "mxfp8")
    with pytest.raises(ValueError, match="kind"):
        ate.WeightSpec("m", (33, 64), "int8")
    q = Float8BlockQuantizer()
    q.block_scaling_dim = 1
    with pytest.raises(ValueError, match="128x128"):
        ate.WeightSpec.from_te("b", types.SimpleNamespace(shape=(8, 8), dtype=torch.bfloat16,
                                                          _get_quantizer=lambda: q))


# -- the device path's code, on CPU --

class EmulatedDeviceClient(amaxd.Client):
    """A client whose device buffers are CPU tensors and whose
    reconcile_device runs the epoch through the packed form of the same
    connection (the slab and has-data bytes as amaxd.te left them in the
    "device" slab; the answer's arrays copied into the "device" answer).
    What a CUDA daemon does with the buffers is tests/gpu/te_cast.py's;
    this runs amaxd.te's side of the device path where there is no GPU:
    the slab writes, the has-data mask, the outputs as views of the
    answer, the NVFP4 layout. The slab starts as NaN and the has-data
    bytes as 0xab, as fresh device memory might."""

    ARRAYS = ("amax", "scale", "scale_inv", "block_scales", "global_amax", "global_scale",
              "global_scale_inv")

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.opened = self.device_calls = 0

    def open_device(self, device=None):
        L = self.layout()
        n, q = L.total_cells, len(L)
        f32 = torch.float32
        ans = {"amax": torch.full((n,), 3.0, dtype=f32), "scale": torch.full((n,), 3.0, dtype=f32),
               "scale_inv": torch.full((n,), 3.0, dtype=f32),
               "block_scales": torch.full((n,), 0xcd, dtype=torch.uint8),
               "global_amax": torch.full((q,), 3.0, dtype=f32),
               "global_scale": torch.full((q,), 3.0, dtype=f32),
               "global_scale_inv": torch.full((q,), 3.0, dtype=f32)}
        self._dev = types.SimpleNamespace(
            id=77, layout_id=L.id, dev=device, doorbell="", slab=torch.full((n,), float("nan")),
            has_data=torch.full((n,), 0xab, dtype=torch.uint8), answer=ans)
        self.opened += 1
        return self._dev

    def close_device(self):
        self._dev = None

    @property
    def device_buffers(self):
        return self._dev

    def reconcile_device(self, send=True, has_data=False, epoch=None, stream=None, timeout=None):
        b = self._dev
        self.device_calls += 1
        assert send
        self.send_packed(b.slab.numpy().copy(), b.has_data.numpy().copy() if has_data else None)
        r = self.reconcile_packed()
        for k in self.ARRAYS:
            a = np.asarray(getattr(r, k))
            if a.size:
                b.answer[k].copy_(torch.from_numpy(a.copy()))
        return types.SimpleNamespace(epoch=r.epoch, next_epoch=r.next_epoch, **b.answer)


def test_device_path_code_on_cpu(daemon, monkeypatch):
    """amaxd.te's device path with an emulated client on CPU: the same
    bytes as the packed path and the TE reference on every rank (an empty
    shard included), over several steps; one open_device, no copy of the
    answer (the outputs are views of the device answer), path visible."""
    monkeypatch.setattr(ate, "_DEVICE_TYPES", ("cuda", "cpu"))
    rng = np.random.default_rng(31)
    weights = random_specs(rng, "devpath")
    dp, steps = 3, 3
    ranges_of = {s.name: random_ranges(rng, s.rows * s.cols, dp) for s, _ in weights}
    # Rank 2 holds nothing of the first weight, rank 1 nothing at all of the second.
    s0, s1 = weights[0][0], weights[1][0]
    n0, n1 = s0.rows * s0.cols, s1.rows * s1.cols
    ranges_of[s0.name] = [(0, n0 // 2), (n0 // 2, n0 - n0 // 2), (0, 0)]
    ranges_of[s1.name] = [(0, n1), (0, 0), (0, 0)]
    got = [None] * dp

    def rank(r):
        dc = EmulatedDeviceClient("te-devpath", r, dp, socket=daemon.socket, timeout=60)
        pc = daemon.client("te-devpath-packed", r, dp)
        with dc, pc:
            dc.join()
            pc.join()
            specs = [w[0] for w in weights]
            starts = [ranges_of[s.name][r][0] for s in specs]
            numels = [ranges_of[s.name][r][1] for s in specs]
            cd = ate.Caster(dc, specs, starts, numels, device="cpu", path="device")
            cp = ate.Caster(pc, specs, starts, numels, path="auto")
            assert cd.path == "device" and cd.path_reason == ""
            assert cp.path is None  # built at its first step
            res = []
            for k in range(steps):
                masters = [torch.from_numpy((v * np.float32(2.0 ** -k))[s:s + n]) if n else None
                           for (_, v), s, n in zip(weights, starts, numels)]
                od, op = cd.step(masters), cp.step(masters)
                # The real client on CPU: auto falls back, saying why.
                assert cp.path == "packed" and "DeviceUnavailable" in cp.path_reason, \
                    cp.path_reason
                res.append(({nm: {f: t.numpy().copy() for f, t in fs.items()}
                             for nm, fs in od.items()},
                            {nm: {f: t.numpy().copy() for f, t in fs.items()}
                             for nm, fs in op.items()}))
            # The outputs are the device answer's memory, not copies.
            ans = dc._dev.answer
            lo = {k: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                  for k, t in ans.items()}
            for nm, fs in od.items():
                for f, t in fs.items():
                    if f != "rowwise_scale_inv" or cd.specs[[s.name for s in specs].index(
                            nm)].kind != "nvfp4":
                        assert any(a <= t.data_ptr() < b for a, b in lo.values()), (nm, f)
            assert dc.opened == 1 and dc.device_calls == steps
            got[r] = res

    in_threads(rank, dp, 300)
    for spec, vals in weights:
        for k in range(steps):
            want = expected(spec, (vals * np.float32(2.0 ** -k)).astype(np.float32),
                            ranges_of[spec.name])
            for r in range(dp):
                dev, packed = got[r][k][0][spec.name], got[r][k][1][spec.name]
                assert dev.keys() == packed.keys()
                for f in dev:
                    assert dev[f].dtype == packed[f].dtype and dev[f].shape == packed[f].shape
                    assert dev[f].tobytes() == packed[f].tobytes(), (spec.name, r, k, f)
                assert_same(dev, want, f"device path, rank {r} step {k} {spec.name}")


def test_path_choice(daemon, monkeypatch):
    """path="packed" and CPU outputs take the packed path; path="device"
    where the device path cannot run raises DeviceUnavailable; a bad path
    is refused. The choice is logged once."""
    import logging
    from amaxd.device import DeviceUnavailable
    spec = ate.WeightSpec("p", (20, 20), "fp8_block")
    with daemon.client("te-path", 0, 1) as c:
        c.join()
        with pytest.raises(ValueError, match="path"):
            ate.Caster(c, [spec], [0], [400], path="gpu")
        with pytest.raises(DeviceUnavailable, match="not on a CUDA device"):
            ate.Caster(c, [spec], [0], [400], device="cpu", path="device")
        logs = []

        class H(logging.Handler):
            def emit(self, rec):
                logs.append(rec.getMessage())
        h = H(level=logging.INFO)
        lg = logging.getLogger("amaxd.te")
        lg.addHandler(h)
        old = lg.level
        lg.setLevel(logging.INFO)
        try:
            cast = ate.Caster(c, [spec], [0], [400], path="packed")
            for _ in range(3):
                cast.step([torch.ones(400)])
        finally:
            lg.removeHandler(h)
            lg.setLevel(old)
        assert cast.path == "packed" and cast.path_reason == "path='packed' was asked for"
        assert len(logs) == 1 and "the packed path (path='packed' was asked for)" in logs[0], logs
