"""amaxd.modelopt against ModelOpt itself (nvidia-modelopt from PyPI, on CPU).

For each ModelOpt config (FP8 per-tensor, FP8 per-channel weights, NVFP4
dynamic, NVFP4 with static weight blocks, MXFP8), the toy block (toy.py) is
calibrated in one process by ModelOpt (the reference), then sharded over 4
ranks as TP=2 x EP=2 and TP=1 x EP=4; each rank (a thread with its own
shard model and its own amaxd.Client) calibrates its shard with ModelOpt,
then amaxd.modelopt registers, sends, reconciles through one amaxd daemon
and writes the amax back. Every rank's `_amax`, `_global_amax` and the
scales ModelOpt's export functions compute from them
(modelopt.torch.export.quant_utils: get_weight_scaling_factor,
get_weight_scaling_factor_2, get_activation_scaling_factor) must be the
reference's, restricted to the rank's shard, bit for bit. The daemon's own
scales (scale_inv, block scales, global_scale_inv in the modelopt
conventions) must equal ModelOpt's exported ones too.
"""
import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mtq = pytest.importorskip("modelopt.torch.quantization")
quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")

import amaxd  # noqa: E402
import amaxd.modelopt as amo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import toy  # noqa: E402
from common import CONFIGS, block as _block, quantize, quantizers as _quantizers, same  # noqa: E402
from amaxd_proc import Daemon  # noqa: E402

torch.set_num_threads(1)


SHARE = amo.supports_share()


@functools.lru_cache(maxsize=None)
def reference(cfg_name, router="gate"):
    """(the single-process calibrated model, what each of its linears saw)."""
    model, captured = toy.calibrate_full(
        lambda mm, loop: quantize(mm, cfg_name, loop), router)
    return model, captured


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("amaxd")))
    yield d
    d.check_clean_exit(d.stop())


def _is_expert_input(name):
    return ".experts." in name and "input_quantizer" in name


def run_layout(daemon, cfg_name, layout, weight_blocks=True, router="gate", **plan_kw):
    """Calibrates the 4 shards of `layout` and syncs them through amaxd;
    returns [(shard model, entries, results, amax present before sync)]."""
    _, captured = reference(cfg_name, router)
    models = []
    for r in range(toy.W):
        m = toy.shard_model(toy.full_model(router), layout, r)
        quantize(m, cfg_name, lambda mm, r=r: toy.replay(mm, captured, layout, r))
        models.append(m)
    had_amax = [{n: getattr(q, "_amax", None) is not None for n, q in _quantizers(m).items()}
                for m in models]
    job = f"{cfg_name}-{layout}-{int(weight_blocks)}-{router}-{len(plan_kw)}".replace("_", "-")

    def rank(r):
        lay = toy.amaxd_layout(layout, r)
        with daemon.client(job, r, toy.W) as c:
            c.join()
            entries = amo.plan(models[r], lay, column=toy.COLUMN, row=toy.ROW, moe_share=SHARE,
                               weight_blocks=weight_blocks, **plan_kw)
            amo.register(c, entries)
            amo.send(c, entries)
            results = amo.reconcile(c, entries)
            amo.write_back(entries, results)
        return entries, results

    with ThreadPoolExecutor(toy.W) as ex:
        outs = list(ex.map(rank, range(toy.W)))
    with daemon.client(job, 0, toy.W) as c:
        c.reset(drop_job=True)
    return [(models[r], *outs[r], had_amax[r]) for r in range(toy.W)]


def _export(module):
    return {"weight_scale": quant_utils.get_weight_scaling_factor(module),
            "weight_scale_2": quant_utils.get_weight_scaling_factor_2(module),
            "input_scale": quant_utils.get_activation_scaling_factor(module)}


def check_rank(cfg_name, layout, rank, model, entries, results, had_amax, router="gate"):
    ref_model, _ = reference(cfg_name, router)
    ref_q = _quantizers(ref_model)
    ref_mods = dict(ref_model.named_modules())
    by_local = {e.local_name: e for e in entries}
    tp, ep, tpr, epr = toy.coords(layout, rank)
    lay = amo.Layout(tp_rank=tpr, tp_size=tp, ep_rank=epr, ep_size=ep)
    checked = 0
    # 1. amax and _global_amax of every quantizer.
    for name, q in _quantizers(model).items():
        gname = amo._global_name(model, name, lay)[0]
        rq = ref_q[gname]
        where = f"{cfg_name} {layout} rank {rank} {gname}"
        if _is_expert_input(name) and not SHARE:
            continue  # ModelOpt's per-rank MoE rule only; see test_expert_inputs_share
        e = by_local.get(name)
        a, ra = getattr(q, "_amax", None), getattr(rq, "_amax", None)
        assert (a is None) == (ra is None), f"{where}: _amax {a} vs reference {ra}"
        if a is not None:
            if e is not None and e.kind in ("fp8_channel", "nvfp4_static"):
                same(a.reshape(e.grid[1].local_shape), _block(ra, e.grid), where + " _amax")
            else:
                same(a, ra, where + " _amax")
            checked += 1
        g, rg = getattr(q, "_global_amax", None), getattr(rq, "_global_amax", None)
        assert (g is None) == (rg is None), f"{where}: _global_amax {g} vs reference {rg}"
        if g is not None:
            same(g, rg, where + " _global_amax")
    # 2. What ModelOpt's export computes from them, per linear.
    for name, mod in model.named_modules():
        wq = getattr(mod, "weight_quantizer", None)
        if not isinstance(mod, torch.nn.Linear) or wq is None or not wq.is_enabled:
            continue
        gname = amo._global_name(model, name, lay)[0]
        got, want = _export(mod), _export(ref_mods[gname])
        e = by_local.get(name + ".weight_quantizer")
        for key in got:
            where = f"{cfg_name} {layout} rank {rank} {gname} {key}"
            if key == "input_scale" and ".experts." in name and not SHARE:
                continue
            assert (got[key] is None) == (want[key] is None), f"{where}: {got[key]} vs {want[key]}"
            if got[key] is None:
                continue
            w = want[key]
            if key == "weight_scale" and e is not None and w.numel() > 1:
                w = _block(w, e.grid)
            elif key == "weight_scale" and e is None and w.numel() > 1:  # MXFP8, not registered
                tp, _, tpr, _ = toy.coords(layout, rank)
                last = name.rsplit(".", 1)[-1]
                w = (w.chunk(tp, 0)[tpr] if last in toy.COLUMN
                     else w.chunk(tp, 1)[tpr] if last in toy.ROW else w)
            same(got[key], w, where)
            checked += 1
    return checked


def check_daemon_numerics(cfg_name, layout, rank, model, entries, results):
    """amaxd's scales in the modelopt conventions = ModelOpt's exported ones."""
    bad = []
    for e in entries:
        r = results[e.name]
        where = f"{cfg_name} {layout} rank {rank} {e.name}"
        exp = _export(e.module)
        is_weight = e.local_name.endswith("weight_quantizer")
        if not is_weight and r.missing:  # no rank fed it: nothing to export either
            if exp["input_scale"] is not None:
                bad.append(f"{where}: no data, but ModelOpt exports {exp['input_scale']}")
            continue
        try:
            if e.kind == "fp8_tensor":
                want = exp["weight_scale" if is_weight else "input_scale"]
                same(np.asarray(r.scale_inv, np.float32).reshape(1), want.reshape(1), where + " scale_inv")
            elif e.kind == "fp8_channel":
                same(r.scale_inv, exp["weight_scale"], where + " scale_inv")
            elif e.kind in ("nvfp4_blocks", "nvfp4_static"):
                if e.blocks:
                    same(r.block_scales, exp["weight_scale"], where + " block scales")
                same(np.float32(r.global_scale_inv), exp["weight_scale_2"], where + " global_scale_inv")
            elif e.kind == "nvfp4_tensor":
                same(np.float32(r.global_scale_inv), exp["input_scale"], where + " global_scale_inv")
            elif e.kind == "mxfp8_blocks":
                same(r.block_scales, exp["weight_scale"], where + " E8M0 block scales")
        except AssertionError as err:
            bad.append(str(err))
    return bad


@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_reference_moe(cfg_name):
    """The reference is what the test claims: experts 6 and 7 got no tokens,
    and ModelOpt gave every expert's input quantizer the max over experts."""
    model, captured = reference(cfg_name)
    assert "block_sparse_moe.experts.0.gate_proj" in captured or cfg_name == "mxfp8"
    for e in toy.COLD:
        assert f"block_sparse_moe.experts.{e}.gate_proj" not in captured
    assert type(model.block_sparse_moe).__name__.startswith("Quant"), "ModelOpt did not wrap the MoE"
    qs = _quantizers(model)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        amaxes = [getattr(qs[f"block_sparse_moe.experts.{e}.{proj}.input_quantizer"], "_amax", None)
                  for e in range(toy.E)]
        if amaxes[0] is None:
            assert cfg_name in ("fp8_channel", "mxfp8")  # dynamic inputs
            continue
        assert len({float(a) for a in amaxes}) == 1, (proj, amaxes)


@pytest.mark.parametrize("layout", sorted(toy.LAYOUTS))
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_sharded_equals_single_process(daemon, cfg_name, layout):
    ranks = run_layout(daemon, cfg_name, layout)
    checked, bad = 0, []
    for r, (model, entries, results, _) in enumerate(ranks):
        checked += check_rank(cfg_name, layout, r, model, entries, results, None)
        bad += check_daemon_numerics(cfg_name, layout, r, model, entries, results)
    assert checked > 0
    assert not bad, "amaxd's scales differ from ModelOpt's export:\n" + "\n".join(bad[:20])


@pytest.mark.parametrize("cfg_name", ["nvfp4", "nvfp4_static", "mxfp8"])
def test_per_tensor_weights_only(daemon, cfg_name):
    """plan(weight_blocks=False): NVFP4 weights registered as their
    per-tensor amax, MXFP8 weights left out; the same checkpoint."""
    ranks = run_layout(daemon, cfg_name, "tp2ep2", weight_blocks=False)
    for r, (model, entries, results, _) in enumerate(ranks):
        assert all(e.spec.global_shape == () for e in entries)
        assert check_rank(cfg_name, "tp2ep2", r, model, entries, results, None) > 0
        assert not check_daemon_numerics(cfg_name, "tp2ep2", r, model, entries, results)


@pytest.mark.skipif(not SHARE, reason="this amaxd client has no peer_mode='share' yet")
@pytest.mark.parametrize("cfg_name", ["fp8", "nvfp4"])
def test_expert_inputs_share(daemon, cfg_name):
    """TP=1 x EP=4: rank 3 holds only the cold experts 6 and 7, whose input
    quantizers have no amax after its calibration (sent as no data); after
    the sync every expert on every rank has the layer-wide max, as in the
    single process."""
    ranks = run_layout(daemon, cfg_name, "tp1ep4")
    model, entries, results, had = ranks[3]
    names = [n for n in had if _is_expert_input(n)]
    assert names and not any(had[n] for n in names)
    ref_q = _quantizers(reference(cfg_name)[0])
    want = ref_q["block_sparse_moe.experts.0.down_proj.input_quantizer"]._amax
    for r, (m, *_rest) in enumerate(ranks):
        for n, q in _quantizers(m).items():
            if _is_expert_input(n) and "down_proj" in n:
                same(q._amax, want, f"rank {r} {n}")


def _expert_inputs(qs, experts, proj):
    return [qs[f"block_sparse_moe.experts.{e}.{proj}.input_quantizer"] for e in experts]


@pytest.mark.parametrize("layout", sorted(toy.LAYOUTS))
@pytest.mark.parametrize("cfg_name", ["fp8", "nvfp4"])
def test_cold_experts_keep_no_amax(daemon, cfg_name, layout):
    """Issue 19, item 2. With the router named `router` ModelOpt does not
    unify the block's experts, so in one process the cold experts' input
    quantizers keep no `_amax` (and ModelOpt's export gives them no
    input_scale). After the sync they have none either — not 0, which the
    export would turn into input_scale 1.0 (FP8) / 6/2688 (NVFP4) — and every
    quantizer and exported scale of every rank is the single process's
    (TP=1 x EP=4: rank 3 holds only the cold experts)."""
    ref_model, _ = reference(cfg_name, "router")
    assert type(ref_model.block_sparse_moe) is toy.RoutedMoe  # not wrapped by ModelOpt
    ref_q = _quantizers(ref_model)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert all(getattr(q, "_amax", None) is None for q in _expert_inputs(ref_q, toy.COLD, proj))
    ranks = run_layout(daemon, cfg_name, layout, router="router")
    cold_seen = 0
    for r, (model, entries, results, _) in enumerate(ranks):
        assert not any(e.spec.peer_group for e in entries)
        assert check_rank(cfg_name, layout, r, model, entries, results, None, router="router") > 0
        bad = check_daemon_numerics(cfg_name, layout, r, model, entries, results)
        assert not bad, "\n".join(bad[:20])
        for e in entries:
            if _is_expert_input(e.local_name) and e.expert in toy.COLD:
                assert results[e.name].missing == 1
                assert getattr(e.quantizer, "_amax", None) is None, f"rank {r} {e.name}"
                assert quant_utils.get_activation_scaling_factor(e.module) is None
                cold_seen += 1
    assert cold_seen == len(toy.COLD) * 3 * toy.LAYOUTS[layout][0]  # 3 projections x TP


def test_cold_experts_fill(daemon):
    """plan(cold_experts="fill"): the peer rule asked for — a cold expert's
    input quantizer takes the max over the layer's experts that got tokens
    (one peer group per projection); the others keep their own."""
    ref_q = _quantizers(reference("fp8", "router")[0])
    hot = [e for e in range(toy.E) if e not in toy.COLD]
    ranks = run_layout(daemon, "fp8", "tp1ep4", router="router", cold_experts="fill")
    for r, (model, entries, results, _) in enumerate(ranks):
        for e in entries:
            if not _is_expert_input(e.local_name):
                continue
            proj = e.name.split(".")[-2]
            assert e.spec.peer_group == f"block_sparse_moe.experts.*.{proj}.input_quantizer"
            if e.expert in toy.COLD:
                want = max(float(q._amax) for q in _expert_inputs(ref_q, hot, proj))
                assert results[e.name].missing == 0 and bool(results[e.name].peer_filled)
            else:
                want = float(ref_q[e.name]._amax)
            same(e.quantizer._amax, np.float32(want), f"rank {r} {e.name}")
    with pytest.raises(ValueError, match="cold_experts"):
        amo.plan(ranks[0][0], cold_experts="zero")


def test_masked_torch_bool(daemon):
    """Client.send takes amaxd.Masked with torch (or numpy) bool masks: masked
    cells are no data (missing, or filled from the peer group)."""
    name = "m.experts.input_quantizer"
    with daemon.client("masked-torch", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer(name, [4], amaxd.Recipe.fp8_current()),
                    amaxd.Quantizer("m.scalar", [], amaxd.Recipe.fp8_current())])
        c.send({name: amaxd.Masked(torch.tensor([1.0, 7.0, 2.0, 9.0]),
                                   torch.tensor([False, True, False, True])),
                "m.scalar": amaxd.Masked(torch.tensor(3.0), torch.tensor(True))})
        res = c.reconcile()
        assert res[name].amax.tolist() == [1.0, 0.0, 2.0, 0.0] and res[name].missing == 2
        assert res["m.scalar"].missing == 1
        c.send({name: amaxd.Masked(np.array([5.0, 6.0, 0.0, 0.0], np.float32),
                                   np.array([False, False, True, True]))})
        assert c.reconcile()[name].amax.tolist() == [5.0, 6.0, 2.0, 0.0]
        with pytest.raises(TypeError):
            c.send({name: amaxd.Masked(torch.ones(4), torch.ones(4))})
        with pytest.raises(ValueError):
            c.send({name: amaxd.Masked(torch.ones(4), torch.ones(3, dtype=torch.bool))})


def test_layout_from_megatron():
    class PS:
        get_tensor_model_parallel_world_size = staticmethod(lambda: 2)
        get_tensor_model_parallel_rank = staticmethod(lambda: 1)
        get_expert_model_parallel_world_size = staticmethod(lambda: 4)
        get_expert_model_parallel_rank = staticmethod(lambda: 3)
        get_data_parallel_world_size = staticmethod(lambda: 2)
        get_data_parallel_rank = staticmethod(lambda: 0)
        get_expert_tensor_parallel_world_size = staticmethod(lambda: 1)
        get_expert_tensor_parallel_rank = staticmethod(lambda: 0)

    lay = amo.Layout.from_megatron(PS)
    assert (lay.tp_rank, lay.tp_size, lay.ep_rank, lay.ep_size, lay.dp_rank, lay.dp_size) == \
        (1, 2, 3, 4, 0, 2)
    assert lay.etp == (0, 1)
    assert amo.Layout(tp_rank=1, tp_size=2).etp == (1, 2)
    with pytest.raises(ValueError):
        amo.Layout(tp_rank=2, tp_size=2)


def test_plan_names_and_placements():
    """Global names and placements of a TP=2 x EP=2 shard (rank 3)."""
    model = toy.shard_model(toy.full_model(), "tp2ep2", 3)
    quantize(model, "nvfp4", None)
    ents = {e.name: e for e in amo.plan(model, amo.Layout(tp_rank=1, tp_size=2, ep_rank=1, ep_size=2),
                                       column=toy.COLUMN, row=toy.ROW, moe_share=SHARE)}
    q = ents["self_attn.q_proj.weight_quantizer"]
    assert q.kind == "nvfp4_blocks" and tuple(q.spec.global_shape) == (64, 4)
    assert q.spec.placement.offset == (32, 0) and q.spec.placement.local_shape == (32, 4)
    o = ents["self_attn.o_proj.weight_quantizer"]
    assert tuple(o.spec.global_shape) == (64, 4) and o.spec.placement.offset == (0, 2)
    d = ents["block_sparse_moe.experts.5.down_proj.weight_quantizer"]
    assert d.local_name == "block_sparse_moe.experts.1.down_proj.weight_quantizer" and d.expert == 5
    assert tuple(d.spec.global_shape) == (64, 4) and d.spec.placement.offset == (0, 2)
    assert ents["self_attn.q_proj.input_quantizer"].spec.global_shape == ()
    assert not any("block_sparse_moe.gate." in n for n in ents)  # the router is not quantized
    if SHARE:
        i = ents["block_sparse_moe.experts.5.down_proj.input_quantizer"]
        assert i.peer_share and i.spec.peer_group == "block_sparse_moe.experts.*.down_proj.input_quantizer"


def test_refuses_other_calibrations():
    """A weight _amax that is not the max calibration (e.g. MSE-refined) is
    refused before anything is sent, instead of being overwritten."""
    class NoClient:
        def send(self, amax):
            raise AssertionError("nothing should be sent")

    for cfg_name in ("nvfp4", "nvfp4_static"):
        model = toy.shard_model(toy.full_model(), "tp2ep2", 0)
        quantize(model, cfg_name, None)
        entries = amo.plan(model, amo.Layout(tp_size=2, ep_size=2), column=toy.COLUMN,
                           row=toy.ROW, moe_share=SHARE)
        q = model.mlp.up_proj.weight_quantizer
        with torch.no_grad():
            q._amax.view(-1)[0] *= 0.5
        with pytest.raises(ValueError, match="mlp.up_proj.weight_quantizer: _amax is not"):
            amo.send(NoClient(), entries)


def test_refuses_unknown_modules():
    """A quantizer whose module amaxd.modelopt does not know is refused
    (amo.Unsupported, a ValueError) with a message naming the quantizer,
    its module and type and what was not understood, instead of being
    registered as a guess (a replicated per-tensor amax under its local name,
    as fused experts' per-expert quantizers were before issue 19)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import SequentialQuantizer, TensorQuantizer

    def refused(model, match, **kw):
        with pytest.raises(amo.Unsupported, match=match):
            amo.plan(model, **kw)

    # transformers' Llama4TextExperts: ModelOpt's _QuantLlama4TextExperts
    # quantizes the 3-D weights of all experts with one quantizer each.
    cfg = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=32, num_local_experts=4,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, vocab_size=32)
    m = torch.nn.Module()
    m.experts = Llama4TextExperts(cfg)
    torch.nn.init.normal_(m.experts.gate_up_proj)
    torch.nn.init.normal_(m.experts.down_proj)
    quantize(m, "fp8", lambda mm: mm.experts(torch.randn(8, 32)))
    refused(m, r"experts\.gate_up_proj_input_quantizer: QuantLlama4TextExperts 'experts' has a "
               r"quantizer 'gate_up_proj_input_quantizer' that amaxd\.modelopt does not know")
    # A convolution: its 4-D weight is no [out, in] matrix.
    m = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3))
    quantize(m, "fp8", lambda mm: mm(torch.randn(1, 4, 8, 8)))
    refused(m, r"0\.input_quantizer: QuantConv2d '0' has no 2-D weight \(weight shape \(4, 4, 3, 3\)\)")
    # Per-item quantizers in a ModuleList that is not ModelOpt's fused experts.
    m = toy.shard_model(toy.full_model(), "tp2ep2", 0)
    quantize(m, "fp8", None)
    fp8 = QuantizerAttributeConfig(num_bits=(4, 3), axis=None)
    m.mlp.extra_quantizers = torch.nn.ModuleList([TensorQuantizer(fp8) for _ in range(2)])
    refused(m, r"mlp\.extra_quantizers\.0: quantizer 0 of the ModuleList 'mlp\.extra_quantizers' "
               r"in MLP")
    del m.mlp.extra_quantizers
    # A quantizer chain (W4A8's SequentialQuantizer).
    m.mlp.up_proj.weight_quantizer = SequentialQuantizer(TensorQuantizer(fp8), TensorQuantizer(fp8))
    refused(m, r"mlp\.up_proj\.weight_quantizer\.0: part of a SequentialQuantizer")
    # A linear indexed inside an experts container other than experts.<i>
    # (ModelOpt's unrolled DBRX experts.mlp.w1_linear.<i>): with EP > 1 the
    # index cannot be mapped to a global expert.
    m = torch.nn.Module()
    m.experts = torch.nn.Module()
    m.experts.mlp = torch.nn.Module()
    m.experts.mlp.w1_linear = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
    quantize(m, "fp8", lambda mm: [lin(torch.randn(2, 32)) for lin in mm.experts.mlp.w1_linear])
    refused(m, r"experts\.mlp\.w1_linear\.0\.input_quantizer: the linear 'experts\.mlp\.w1_linear\.0' "
               r"is indexed w1_linear\.0 inside the experts container 'experts\.mlp'",
            layout=amo.Layout(ep_size=2))
    assert len(amo.plan(m)) == 4  # EP = 1: local indices are the global ones
    assert issubclass(amo.Unsupported, ValueError)


@pytest.mark.parametrize("cfg_name", ["fp8", "nvfp4_static"])
def test_sync_paths_write_the_same(daemon, cfg_name):
    """sync(path=...): a CPU model takes the packed path under "auto"
    (SyncResults.path says so), and the packed and named paths write the
    same bytes into every quantizer (_amax, _global_amax); "device" on a
    CPU model is refused. On a GPU, tests/gpu/test_device.py checks the
    device path against the packed one."""
    import copy
    layout = sorted(toy.LAYOUTS)[0]
    _, captured = reference(cfg_name)
    base = []
    for r in range(toy.W):
        m = toy.shard_model(toy.full_model(), layout, r)
        quantize(m, cfg_name, lambda mm, r=r: toy.replay(mm, captured, layout, r))
        base.append(m)
    got = {}
    for path in ("auto", "named"):
        models = [copy.deepcopy(m) for m in base]
        job = f"paths-{cfg_name}-{path}".replace("_", "-")

        def rank(r):
            lay = toy.amaxd_layout(layout, r)
            with daemon.client(job, r, toy.W) as c:
                c.join()
                res = amo.sync(c, models[r], lay, path=path, column=toy.COLUMN, row=toy.ROW,
                               moe_share=SHARE)
            return res.path
        with ThreadPoolExecutor(toy.W) as ex:
            used = list(ex.map(rank, range(toy.W)))
        assert used == ["packed" if path == "auto" else "named"] * toy.W, used
        got[path] = [{n: tuple(getattr(q, a).detach().numpy().tobytes()
                               for a in ("_amax", "_global_amax") if getattr(q, a, None) is not None)
                      for n, q in _quantizers(m).items()} for m in models]
    assert got["auto"] == got["named"]
    assert any(v for d in got["auto"] for v in d.values()), "nothing was written back"
    with daemon.client(f"paths-device-{cfg_name}".replace("_", "-"), 0, 1) as c:
        c.join()
        with pytest.raises(ValueError, match="no parameter on a CUDA GPU"):
            amo.sync(c, base[0], amo.Layout(), path="device", column=toy.COLUMN, row=toy.ROW)
        with pytest.raises(ValueError, match="one of auto"):
            amo.sync(c, base[0], amo.Layout(), path="gpu")


def test_a_second_sync_with_more_quantizers(daemon):
    """One client syncs a model, then a larger one that holds the first
    one's layers and more (a model grown between calibrations): the second
    sync registers the new quantizers and must read the layout again (it
    used to reuse the first layout: KeyError or a stale layout on the
    default path). Both write what the named path writes."""
    import copy
    torch.manual_seed(7)
    small = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    big = torch.nn.Sequential(*[copy.deepcopy(m) for m in small], torch.nn.ReLU(),
                              torch.nn.Linear(8, 4))
    x = torch.randn(64, 16)
    models = {}
    for name, m in (("small", small), ("big", big)):
        for path in ("auto", "named"):
            mm = copy.deepcopy(m)
            quantize(mm, "fp8", lambda q: q(x))
            models[name, path] = mm
    got = {}
    for path in ("auto", "named"):
        with daemon.client(f"grow-{path}", 0, 1) as c:
            c.join()
            r1 = amo.sync(c, models["small", path], amo.Layout(), path=path)
            r2 = amo.sync(c, models["big", path], amo.Layout(), path=path)
            assert r1.path == r2.path == ("packed" if path == "auto" else "named")
            assert len(r2) > len(r1), (len(r1), len(r2))
        got[path] = {n: q._amax.detach().numpy().tobytes()
                     for n, q in _quantizers(models["big", path]).items()
                     if getattr(q, "_amax", None) is not None}
    assert got["auto"] == got["named"] and len(got["auto"]) >= 6, got


def test_a_partly_nan_per_channel_amax_is_refused(daemon):
    """A NaN in one channel of an FP8 per-channel weight amax (found from
    outside: the whole rank's amax of that quantizer was dropped as no
    data, valid channels included, with no error): ValueError naming the
    quantizer, nothing sent; an all-NaN amax is still no data."""
    import copy
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(32, 16)
    quantize(m, "fp8_channel", lambda q: q(x))
    q = _quantizers(m)["0.weight_quantizer"]
    assert q._amax.numel() > 1
    bad = copy.deepcopy(m)
    _quantizers(bad)["0.weight_quantizer"]._amax.view(-1)[1] = float("nan")
    with daemon.client("nan-channel", 0, 1) as c:
        c.join()
        with pytest.raises(ValueError, match=r"0\.weight_quantizer: _amax has NaN in 1 of"):
            amo.sync(c, bad, amo.Layout())
        # Refused before anything reached the daemon.
        assert c.status("nan-channel").jobs[0].reconciled_epochs == 0
        assert len(c.list_quantizers().quantizers) == 0
    allnan = copy.deepcopy(m)
    _quantizers(allnan)["0.weight_quantizer"]._amax.fill_(float("nan"))
    with daemon.client("nan-channel-all", 0, 1) as c:
        c.join()
        res = amo.sync(c, allnan, amo.Layout())
        assert int(np.asarray(res["0.weight_quantizer"].missing).sum()) > 0
