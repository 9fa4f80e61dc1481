"""Every recipe through the API, over several epochs, against the numpy
reference: 2 ranks, 2-D per-block/per-tile amax split over TP, delayed
scaling with a history window, cells without data."""
import threading

import numpy as np
import pytest

import amaxd
import reference as ref
from amaxd import pb
from amaxd import placement as P

SHAPE = (4, 8)  # e.g. NVFP4 16x16 tiles of a 64 x 128 weight, or 1x16 blocks of a 4 x 128 one
# Every convention of docs/NUMERICS.md; the expected values come from
# reference.py, written from the peers' sources (TE main, ModelOpt 0.47).
RECIPES = {
    "fp8_current": (amaxd.Recipe.fp8_current(), amaxd.RUNNING_MAX),
    "fp8_current_modelopt_out": (amaxd.Recipe.fp8_current(output="modelopt"), amaxd.RUNNING_MAX),
    "fp8_delayed_h3_unfused": (amaxd.Recipe.fp8_delayed(history_len=3, history="te_unfused"),
                               amaxd.PER_EPOCH),
    "nvfp4_te_legacy": (amaxd.Recipe.nvfp4("te_legacy"), amaxd.RUNNING_MAX),
    "nvfp4_modelopt_static": (amaxd.Recipe.nvfp4("modelopt_static", output="modelopt"),
                              amaxd.RUNNING_MAX),
    "nvfp4_te_modelopt_out": (amaxd.Recipe.nvfp4(output="modelopt"), amaxd.PER_EPOCH),
    "mxfp8_ocp": (amaxd.Recipe.mxfp8("ocp"), amaxd.RUNNING_MAX),
    "mxfp8_modelopt": (amaxd.Recipe.mxfp8("modelopt"), amaxd.PER_EPOCH),
    "fp8_current_e5m2_pow2": (amaxd.Recipe.fp8_current(amaxd.FP8_E5M2, eps=1e-3, power_of_2=True),
                              amaxd.RUNNING_MAX),
    "fp8_delayed_h3": (amaxd.Recipe.fp8_delayed(margin=1, history_len=3), amaxd.PER_EPOCH),
    "fp8_delayed_recent": (amaxd.Recipe.fp8_delayed(history_len=2, reduce="most_recent"), amaxd.PER_EPOCH),
    "nvfp4_te": (amaxd.Recipe.nvfp4(), amaxd.RUNNING_MAX),
    "nvfp4_modelopt": (amaxd.Recipe.nvfp4("modelopt"), amaxd.PER_EPOCH),
    "mxfp8": (amaxd.Recipe.mxfp8(), amaxd.RUNNING_MAX),
    "mxfp8_te_legacy": (amaxd.Recipe.mxfp8("te_legacy"), amaxd.RUNNING_MAX),
    "mxfp8_te_2_18": (amaxd.Recipe.mxfp8("te_2_18"), amaxd.PER_EPOCH),
    "fp8_block": (amaxd.Recipe.fp8_block(), amaxd.RUNNING_MAX),
    "fp8_block_bf16_f32_scales": (amaxd.Recipe.fp8_block(power_of_2=False, input_dtype="bfloat16"),
                                  amaxd.RUNNING_MAX),
    "fp8_block_fp16_e5m2": (amaxd.Recipe.fp8_block(amaxd.FP8_E5M2, eps=1e-40, power_of_2=False,
                                                   input_dtype="float16"), amaxd.PER_EPOCH),
    "nvfp4_te_partial_cast": (amaxd.Recipe.nvfp4("te_partial_cast"), amaxd.RUNNING_MAX),
}
RULE = {pb.CURRENT: "current", pb.BLOCK_BF16: "block_bf16", pb.BLOCK_FP16: "block_fp16", 0: "current"}
EPOCHS = 4


def epoch_data(e):
    """Global amax tensor of epoch e per quantizer (nan = no data anywhere)."""
    rng = np.random.default_rng(e)
    out = {}
    for n in RECIPES:
        a = (np.exp(rng.uniform(-8, 8, SHAPE)) * (rng.random(SHAPE) > 0.1)).astype(np.float32)
        if n.startswith("fp8_block"):
            a[0, ::3] = np.float32(1e-37)  # 448/amax overflows: the rules' value_for_inf
        if e == 3:
            a[:, :4] = np.nan  # the left half sees nothing in epoch 3
        out[n] = a
    return out


def expected(name, history):
    """Reference amax and scales after the epochs in `history` (list of tensors)."""
    recipe, acc = RECIPES[name]
    stack = np.stack(history)
    if acc == amaxd.RUNNING_MAX:
        raw = np.nanmax(np.where(np.isnan(stack), -np.inf, stack), axis=0)
    else:
        conv = "te_unfused" if recipe.history_convention == pb.HISTORY_TRANSFORMER_ENGINE_UNFUSED else "te"
        reduce = "most_recent" if recipe.history_reduce == pb.MOST_RECENT else "max"
        raw = ref.delayed_history(list(stack), max(recipe.history_len, 1), reduce, conv)[-1]
    amax = np.where(np.isinf(raw), 0, raw).astype(np.float32)
    g = np.float32(amax.max())
    return raw, amax, g


def test_all_recipes_over_epochs(daemon):
    results = {0: [], 1: []}

    def rank(r):
        with daemon.client("rec", r, 2) as c:
            c.join()
            c.register([amaxd.Quantizer(n, SHAPE, rc, P.shard(SHAPE, 1, r, 2), accumulation=acc)
                        for n, (rc, acc) in RECIPES.items()])
            for e in range(EPOCHS):
                data = epoch_data(e)
                c.send({n: np.ma.masked_invalid(d[:, r * 4:(r + 1) * 4]) for n, d in data.items()})
                results[r].append(c.get_scales(whole=True) if c.reconcile() else None)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert len(results[0]) == len(results[1]) == EPOCHS
    prev = {n: np.ones(SHAPE, np.float32) for n in RECIPES}
    prev_g = {n: np.float32(1) for n in RECIPES}
    for e in range(EPOCHS):
        hist = [epoch_data(k) for k in range(e + 1)]
        for n, (recipe, acc) in RECIPES.items():
            raw, amax, g = expected(n, [h[n] for h in hist])
            got = results[0][e][n]
            assert got.amax.tobytes() == amax.tobytes(), f"epoch {e} {n} amax"
            assert got.missing == int(np.isinf(raw).sum())
            if recipe.rule == pb.DELAYED:
                m = 57344.0 if recipe.format == amaxd.FP8_E5M2 else 448.0
                s = ref.fp8_delayed(amax, prev[n], m, recipe.margin)
                gs = ref.fp8_delayed(g, prev_g[n], m, recipe.margin)
                prev[n], prev_g[n] = s, gs
                b = np.zeros(SHAPE, np.uint8)
                si, gsi = np.float32(1) / s, np.float32(1) / gs
            elif recipe.format in (amaxd.FP8_E4M3, amaxd.FP8_E5M2):
                m = 57344.0 if recipe.format == amaxd.FP8_E5M2 else 448.0
                inp = ref.RULE_INPUT[RULE[recipe.rule]]
                s = ref.fp8_current(amax, m, recipe.power_of_2, recipe.eps, inp)
                gs = ref.fp8_current(g, m, recipe.power_of_2, recipe.eps, inp)
                b, si, gsi = np.zeros(SHAPE, np.uint8), np.float32(1) / s, np.float32(1) / gs
                if recipe.output_convention == pb.OUTPUT_MODELOPT:
                    si, gsi = ref.fp8_inv_modelopt(amax, m), ref.fp8_inv_modelopt(g, m)
            elif recipe.format == amaxd.NVFP4:
                conv = {pb.MODELOPT: "modelopt", pb.TRANSFORMER_ENGINE_LEGACY: "te_legacy",
                        pb.MODELOPT_STATIC: "modelopt_static",
                        pb.TRANSFORMER_ENGINE_PARTIAL_CAST: "te_partial_cast"}.get(
                            recipe.nvfp4_convention, "te")
                out = "modelopt" if recipe.output_convention == pb.OUTPUT_MODELOPT else "te"
                s, si, b, gs, gsi = ref.scales("nvfp4", amax, g, nvfp4=conv, output=out)
            else:
                conv = {pb.MXFP8_OCP: "ocp", pb.MXFP8_MODELOPT: "modelopt",
                        pb.MXFP8_TRANSFORMER_ENGINE_LEGACY: "te_legacy",
                        pb.MXFP8_TRANSFORMER_ENGINE_2_18: "te_2_18"}.get(recipe.mxfp8_convention, "te")
                s, si, b, gs, gsi = ref.scales("mxfp8", amax, g, mxfp8_conv=conv)
            assert got.block_scales.tobytes() == np.asarray(b, np.uint8).tobytes(), f"epoch {e} {n} bytes"
            assert got.scale.tobytes() == np.asarray(s, np.float32).tobytes(), f"epoch {e} {n} scale"
            assert got.scale_inv.tobytes() == np.asarray(si, np.float32).tobytes(), f"epoch {e} {n} scale_inv"
            assert np.float32(got.global_amax) == g and np.float32(got.global_scale) == np.float32(gs), n
            assert np.float32(got.global_scale_inv) == np.float32(gsi), n
            assert np.isfinite(got.scale).all() and np.isfinite(got.scale_inv).all()
    # Both ranks saw the same bytes.
    for e in range(EPOCHS):
        for n in RECIPES:
            assert results[0][e][n].scale.tobytes() == results[1][e][n].scale.tobytes()


def test_mxfp8_modelopt_at_powers_of_two(daemon):
    """MXFP8 "modelopt" over every amax from 448 * 2^k to 64 ulps above it
    (k = -140..119, a subnormal quotient included) and random amaxes, one
    quantizer on one rank: E8M0 bytes, scales and global scales are the
    reference's (ModelOpt's ceil(log2(amax / 448)) in float32, scales
    2^(127-e) / 2^(e-127)); TE's rule (one more) differs exactly where the
    float32 log2 of a quotient above 2^k rounds to k."""
    base = np.ldexp(np.float32(448), np.arange(-140, 120)).astype(np.float32).view(np.uint32)
    a = (base[:, None] + np.arange(64, dtype=np.uint32)[None, :]).view(np.float32).ravel()
    a = np.concatenate([a, np.exp(np.random.default_rng(9).uniform(-80, 80, 4000)).astype(np.float32),
                        np.array([0, 1e-45, 3.4028235e38], np.float32)])
    with daemon.client("mxmo", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("q", [a.size], amaxd.Recipe.mxfp8("modelopt"))])
        c.send({"q": a})
        got = c.reconcile()["q"]
    s, si, b, gs, gsi = ref.scales("mxfp8", a, a.max(), mxfp8_conv="modelopt")
    assert got.block_scales.tobytes() == b.tobytes()
    assert got.scale.tobytes() == s.tobytes() and got.scale_inv.tobytes() == si.tobytes()
    assert np.float32(got.global_scale) == gs and np.float32(got.global_scale_inv) == gsi
    te = ref.mxfp8(a)
    down = te.astype(int) - b.astype(int)
    assert set(down.tolist()) == {0, 1}
    # up to 22 quotient ulps above 2^k (39 amax ulps) by |k|: 6289 of the 16640
    assert 6000 < np.count_nonzero(down) < 6600
    assert b[a == np.float32(0.027343752)].tolist() == [113]


def test_placement_helpers():
    assert P.column_parallel([8], 1, 2) == P.Placement((4,), (4,))
    assert P.row_parallel([6], 1, 2) == P.Placement((0,), (6,))
    assert P.row_parallel([6, 8], 1, 2) == P.Placement((0, 4), (6, 4))
    assert P.per_expert(8, 3, 4) == P.Placement((6,), (2,))
    assert P.replicated([]) == P.Placement((), ())
    with pytest.raises(ValueError):
        P.shard([6], 0, 0, 4)  # not divisible
    with pytest.raises(ValueError):
        P.shard([6], 0, 2, 2)  # rank out of range


def test_torch_tensors_accepted(daemon):
    torch = pytest.importorskip("torch")
    with daemon.client("torch", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [3], amaxd.Recipe.fp8_current())])
        c.send({"w": torch.tensor([1.0, 2.0, 4.0], dtype=torch.bfloat16)})
        r = c.reconcile()["w"]
    np.testing.assert_array_equal(r.scale, np.array([448, 224, 112], np.float32))
