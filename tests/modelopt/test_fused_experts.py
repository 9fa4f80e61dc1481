"""amaxd.modelopt on transformers' fused 3-D MoE experts (issue 19, item 1).

transformers 5.x builds MoE experts as one module with 3-D weights
(``MixtralExperts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
ModelOpt 0.47 wraps it as ``_QuantFusedExperts`` with one weight quantizer
per expert (``gate_up_proj_weight_quantizers.<i>``) and one shared input
quantizer per projection. fused_toy.py builds the block from transformers'
own classes (CPU, random weights), calibrates it in one process with
ModelOpt (the reference) and shards it over EP and expert-TP:
TP=1 x EP=2, TP=2 x EP=2 and TP=1 x EP=4 (each rank a thread with its own
shard model and its own amaxd.Client, all through one real daemon). After
amaxd.modelopt's sync, on every rank:

- every quantizer's ``_amax`` and ``_global_amax`` is the reference's (its
  part of it), bit for bit; a quantizer without ``_amax`` in the reference
  has none;
- what ModelOpt's export computes from them
  (``modelopt.torch.export.moe_utils._export_fused_experts``: per expert
  ``gate_proj`` / ``up_proj`` / ``down_proj`` ``weight_scale`` (NVFP4 E4M3
  and MXFP8 E8M0 block scales, FP8 scales), ``weight_scale_2``,
  ``input_scale``) is the reference's export, restricted to the shard;
- the daemon's own scales (``scale_inv``, block scales, per-expert
  ``global_scale_invs``) equal those exported ones.

Before the fix the per-expert quantizers were registered under their local
names as per-tensor activations, so expert i of one EP rank was max-merged
with expert i of the others, and fused FP8 per-channel / static NVFP4
weights were refused.
"""
import copy
import functools
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")
mtq = pytest.importorskip("modelopt.torch.quantization")
pytest.importorskip("transformers")
moe_utils = pytest.importorskip("modelopt.torch.export.moe_utils")

import amaxd.modelopt as amo  # noqa: E402
from amaxd.placement import Placement  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
import fused_toy as ft  # noqa: E402
from amaxd_proc import Daemon  # noqa: E402
from common import CONFIGS, block, quantize, quantizers, same  # noqa: E402

torch.set_num_threads(1)
FUSED = "mlp.experts"
PROJS = ("gate_up_proj", "down_proj")


@functools.lru_cache(maxsize=None)
def reference(cfg_name):
    """(the single-process calibrated model, what each expert's input
    quantizers were fed)."""
    return ft.calibrate_full(lambda m, loop: quantize(m, cfg_name, loop))


@functools.lru_cache(maxsize=None)
def reference_export(cfg_name):
    return _export(reference(cfg_name)[0])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("amaxd")))
    yield d
    d.check_clean_exit(d.stop())


def calibrate_shards(cfg_name, layout):
    _, captured = reference(cfg_name)
    *_, world = ft.coords(layout, 0)
    models = []
    for r in range(world):
        m = ft.shard_model(ft.full_model(), layout, r)
        quantize(m, cfg_name, lambda mm, r=r: ft.replay(mm, captured, layout, r))
        models.append(m)
    return models


def amo_layout(layout, rank):
    etp, ep, er, epr, _ = ft.coords(layout, rank)
    return amo.Layout(tp_rank=er, tp_size=etp, ep_rank=epr, ep_size=ep)


def run_layout(daemon, cfg_name, layout, weight_blocks=True, models=None):
    """Calibrates the shards of `layout` and syncs them through amaxd;
    returns [(shard model, entries, results)]."""
    models = models or calibrate_shards(cfg_name, layout)
    world = len(models)
    job = f"fused-{cfg_name}-{layout}-{int(weight_blocks)}".replace("_", "-")

    def rank(r):
        with daemon.client(job, r, world) as c:
            c.join()
            entries = amo.plan(models[r], amo_layout(layout, r), weight_blocks=weight_blocks)
            amo.register(c, entries)
            amo.send(c, entries)
            results = amo.reconcile(c, entries)
            amo.write_back(entries, results)
        return entries, results

    with ThreadPoolExecutor(world) as ex:
        outs = list(ex.map(rank, range(world)))
    with daemon.client(job, 0, world) as c:
        c.reset(drop_job=True)
    return [(models[r], *outs[r]) for r in range(world)]


def _export(model):
    """{(expert, proj): {weight_scale, weight_scale_2, input_scale}} of
    ModelOpt's fused-experts export, on a copy of the experts module."""
    ex = copy.deepcopy(model.get_submodule(FUSED))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        moe_utils._export_fused_experts(ex, torch.float32)
    out = {}
    for i in range(ex.num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            m = ex.get_submodule(f"{i}.{proj}")
            out[i, proj] = {k: getattr(m, k, None)
                            for k in ("weight_scale", "weight_scale_2", "input_scale")}
    return out


def _shard_part(t, proj, layout, rank):
    """The part of a reference export tensor that a shard's export holds:
    gate/up rows and down columns are split over expert-TP."""
    etp, _, er, _, _ = ft.coords(layout, rank)
    if t is None or t.numel() == 1 or etp == 1:
        return t
    if proj in ("gate_proj", "up_proj"):
        return t.chunk(etp, 0)[er]
    if t.dim() == 2 and t.shape[1] > 1:  # down_proj blocks: input features split
        return t.chunk(etp, 1)[er]
    return t  # down_proj per-channel: every rank has all output channels


def _ref_grid_amax(ref_model, e):
    """The reference's per-expert _amax of a fused entry's projection, as a
    whole tensor of the entry's amax grid (expert axis first)."""
    ref_list = ref_model.get_submodule(e.name)
    gshape = e.grid[0]
    return np.stack([ref_list[g]._amax.detach().float().numpy().reshape(gshape[1:])
                     for g in range(gshape[0])])


def global_quantizer_name(name, layout, rank):
    """The reference's name of a shard's quantizer (the test's own mapping:
    local expert j of EP rank e is expert e * E/ep + j)."""
    _, ep, _, epr, _ = ft.coords(layout, rank)
    lst, _, idx = name.rpartition(".")
    if lst.endswith("_weight_quantizers") and idx.isdigit():
        return f"{lst}.{epr * ft.E // ep + int(idx)}"
    return name


def check_rank(cfg_name, layout, rank, model, entries, results):
    ref_model, _ = reference(cfg_name)
    ref_q = quantizers(ref_model)
    lay = amo_layout(layout, rank)
    by_list = {e.local_name: e for e in entries}
    bad, checked = [], 0

    def cmp(got, want, where):
        nonlocal checked
        try:
            same(got, want, where)
            checked += 1
        except AssertionError as err:
            bad.append(str(err))

    # 1. _amax and _global_amax of every quantizer.
    for name, q in quantizers(model).items():
        gname = global_quantizer_name(name, layout, rank)
        rq = ref_q[gname]
        where = f"{cfg_name} {layout} rank {rank} {gname}"
        a, ra = getattr(q, "_amax", None), getattr(rq, "_amax", None)
        if (a is None) != (ra is None):
            bad.append(f"{where}: _amax {a} vs reference {ra}")
            continue
        if a is not None:
            lst, _, idx = name.rpartition(".")
            e = by_list.get(lst)
            if e is not None and e.grid is not None and ra.numel() > 1:
                want = block(_ref_grid_amax(ref_model, e), e.grid)[int(idx)]
                cmp(a.reshape(want.shape), want, where + " _amax")
            else:
                cmp(a, ra, where + " _amax")
        g, rg = getattr(q, "_global_amax", None), getattr(rq, "_global_amax", None)
        if (g is None) != (rg is None):
            bad.append(f"{where}: _global_amax {g} vs reference {rg}")
        elif g is not None:
            cmp(g, rg, where + " _global_amax")
    # 2. ModelOpt's export of the fused experts.
    got, want = _export(model), reference_export(cfg_name)
    n = model.get_submodule(FUSED).num_experts
    for (j, proj), scales in got.items():
        g = lay.ep_rank * n + j
        for key, t in scales.items():
            where = f"{cfg_name} {layout} rank {rank} expert {g} {proj} {key}"
            w = _shard_part(want[g, proj][key], proj, layout, rank)
            if (t is None) != (w is None):
                bad.append(f"{where}: {t} vs reference {w}")
            elif t is not None:
                cmp(t, w, where)
    return checked, bad, got


def check_daemon_numerics(cfg_name, layout, rank, model, entries, results, exported):
    """amaxd's scales in the modelopt conventions = ModelOpt's exported ones."""
    bad = []
    halves = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    for e in entries:
        r = results[e.name]
        where = f"{cfg_name} {layout} rank {rank} {e.name}"
        try:
            if not e.kind.startswith("fused_"):  # the shared input quantizers
                proj = "gate_proj" if e.name.endswith("gate_up_proj_input_quantizer") else \
                    "down_proj"
                key = "input_scale"
                want = exported[0, proj][key]
                if e.kind == "fp8_tensor":
                    same(np.asarray(r.scale_inv, np.float32).reshape(1), want.reshape(1), where)
                else:
                    same(np.float32(r.global_scale_inv), want, where + " global_scale_inv")
                continue
            proj = e.local_name.rsplit(".", 1)[-1][:-len("_weight_quantizers")]
            for j in range(len(e.quantizer)):
                for h, hp in enumerate(halves[proj]):
                    exp = exported[j, hp]
                    sel = (j, h) if e.parallel == "packed_column" else (j,)
                    w = f"{where} expert {j} {hp}"
                    if e.base_kind == "fp8_tensor":
                        same(np.float32(r.scale_inv[j]), exp["weight_scale"], w + " scale_inv")
                    elif e.base_kind == "fp8_channel":
                        same(r.scale_inv[sel], exp["weight_scale"], w + " scale_inv")
                    elif e.base_kind.startswith("nvfp4") and e.blocks:
                        # ([E] per-tensor amax, weight_blocks=False: one global for
                        # the quantizer; the per-expert ones are checked in check_rank.)
                        same(r.block_scales[sel], exp["weight_scale"], w + " block scales")
                        same(np.float32(r.global_scale_invs[j]), exp["weight_scale_2"],
                             w + " global_scale_inv")
                    elif e.base_kind == "mxfp8_blocks":
                        same(r.block_scales[sel], exp["weight_scale"], w + " E8M0 block scales")
        except AssertionError as err:
            bad.append(str(err))
    return bad


def test_reference():
    """The reference is what the tests claim: ModelOpt wrapped transformers'
    MixtralExperts as fused experts with per-expert weight quantizers, the
    router never picked experts 6 and 7, and the per-expert amax differ."""
    model, captured = reference("fp8")
    ex = model.get_submodule(FUSED)
    assert type(ex).__name__ == "QuantMixtralExperts" and hasattr(ex, "_first_proj_attr")
    assert len(ex.gate_up_proj_weight_quantizers) == ft.E
    assert {g for _, g in captured}.isdisjoint(ft.COLD)
    amax = [float(q._amax) for q in ex.gate_up_proj_weight_quantizers]
    assert len(set(amax)) == ft.E and min(amax) < 1e-4 < max(amax)


@pytest.mark.parametrize("layout", sorted(ft.LAYOUTS))
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_fused_sharded_equals_single_process(daemon, cfg_name, layout):
    ranks = run_layout(daemon, cfg_name, layout)
    checked, bad = 0, []
    for r, (model, entries, results) in enumerate(ranks):
        c, b, exported = check_rank(cfg_name, layout, r, model, entries, results)
        checked += c
        bad += b
        bad += check_daemon_numerics(cfg_name, layout, r, model, entries, results, exported)
    assert checked > 0
    assert not bad, f"{len(bad)} differences from the single process:\n" + "\n".join(bad[:20])
    for r, (model, entries, _) in enumerate(ranks):  # one entry per fused projection
        assert sum(e.kind.startswith("fused_") for e in entries) == 2, f"rank {r}"


@pytest.mark.parametrize("cfg_name", ["nvfp4", "nvfp4_static", "mxfp8"])
def test_fused_per_tensor_weights_only(daemon, cfg_name):
    """plan(weight_blocks=False): fused NVFP4 weights as their per-expert
    amax [E], MXFP8 weights left out; the same checkpoint."""
    ranks = run_layout(daemon, cfg_name, "etp2ep2", weight_blocks=False)
    for r, (model, entries, results) in enumerate(ranks):
        for e in entries:
            assert e.spec.global_shape == ((ft.E,) if e.fused else ())
        checked, bad, exported = check_rank(cfg_name, "etp2ep2", r, model, entries, results)
        assert checked > 0 and not bad, "\n".join(bad[:20])
        bad = check_daemon_numerics(cfg_name, "etp2ep2", r, model, entries, results, exported)
        assert not bad, "\n".join(bad[:20])


def test_fused_plan():
    """Names, shapes and placements of a TP=2 x EP=2 shard (rank 3: EP rank
    1, expert-TP rank 1): experts on the first axis at ep_rank * E_local,
    gate_up_proj's gate and up halves apart and split over expert-TP,
    down_proj's blocks split on their input features, per-expert NVFP4
    globals (global_axes=1)."""
    model = calibrate_shards("nvfp4_static", "etp2ep2")[3]
    ents = {e.name: e for e in amo.plan(model, amo_layout("etp2ep2", 3))}
    gu = ents[f"{FUSED}.gate_up_proj_weight_quantizers"]
    assert gu.kind == "fused_nvfp4_static" and gu.parallel == "packed_column"
    assert tuple(gu.spec.global_shape) == (8, 2, 64, 4) and gu.spec.global_axes == 1
    assert gu.spec.placement == Placement((4, 0, 32, 0), (4, 2, 32, 4))
    dn = ents[f"{FUSED}.down_proj_weight_quantizers"]
    assert tuple(dn.spec.global_shape) == (8, 64, 4) and dn.spec.global_axes == 1
    assert dn.spec.placement == Placement((4, 0, 2), (4, 64, 2))
    inp = ents[f"{FUSED}.gate_up_proj_input_quantizer"]
    assert inp.kind == "nvfp4_tensor" and tuple(inp.spec.global_shape) == ()
    assert len(ents) == 4
    assert amo.global_name(model, f"{FUSED}.down_proj_weight_quantizers.1",
                           amo_layout("etp2ep2", 3)) == f"{FUSED}.down_proj_weight_quantizers.5"


@pytest.mark.parametrize("cfg_name", ["fp8_channel", "nvfp4_static"])
def test_non_gated_fused_experts(daemon, cfg_name):
    """transformers' NemotronHExperts (``up_proj`` / ``down_proj``, no gate),
    which ModelOpt wraps as _QuantNonGatedFusedExperts, TP=2 x EP=2,
    calibrated on the weights only (no forward): every per-expert _amax /
    _global_amax is the single process's part (``up_proj`` rows and
    ``down_proj`` columns split over expert-TP), and the input quantizers,
    which no rank fed, keep no _amax, as in the single process."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    e, h, inter, etp, ep = 8, 32, 64, 2, 2
    cfg = NemotronHConfig(hidden_size=h, moe_intermediate_size=inter, n_routed_experts=e,
                          num_hidden_layers=1, vocab_size=32)

    def model(n, i):
        m = torch.nn.Module()
        cfg.n_routed_experts, cfg.moe_intermediate_size = n, i
        m.experts = NemotronHExperts(cfg)
        return m

    g = torch.Generator().manual_seed(ft.SEED + 2)
    ref = model(e, inter)
    with torch.no_grad():
        ref.experts.up_proj.copy_(ft._blocks(g, (e, inter, h), -6, 3))
        ref.experts.down_proj.copy_(ft._blocks(g, (e, h, inter), -6, 3))
        ref.experts.down_proj[5] *= 2.0 ** -12
    quantize(ref, cfg_name, None)
    shards = []
    for r in range(etp * ep):
        er, epr = r % etp, r // etp
        m = model(e // ep, inter // etp)
        mine, part = slice(epr * e // ep, (epr + 1) * e // ep), ft._part(inter, er, etp)
        with torch.no_grad():
            m.experts.up_proj.copy_(ref.experts.up_proj[mine][:, part])
            m.experts.down_proj.copy_(ref.experts.down_proj[mine][:, :, part])
        quantize(m, cfg_name, None)
        shards.append(m)
    job = f"nongated-{cfg_name}".replace("_", "-")

    def rank(r):
        lay = amo.Layout(tp_rank=r % etp, tp_size=etp, ep_rank=r // etp, ep_size=ep)
        with daemon.client(job, r, etp * ep) as c:
            c.join()
            return amo.sync(c, shards[r], lay), amo.plan(shards[r], lay)

    with ThreadPoolExecutor(etp * ep) as ex:
        outs = list(ex.map(rank, range(etp * ep)))
    ref_q = quantizers(ref)
    for r, (m, (_, entries)) in enumerate(zip(shards, outs)):
        lay = amo.Layout(tp_rank=r % etp, tp_size=etp, ep_rank=r // etp, ep_size=ep)
        by_list = {en.local_name: en for en in entries}
        assert by_list["experts.up_proj_weight_quantizers"].parallel == "column"
        assert by_list["experts.down_proj_weight_quantizers"].parallel == "row"
        for name, q in quantizers(m).items():
            gname = amo.global_name(m, name, lay)
            rq = ref_q[gname]
            where = f"{cfg_name} rank {r} {gname}"
            if "input_quantizer" in name:
                assert getattr(q, "_amax", None) is None and getattr(rq, "_amax", None) is None
                continue
            en = by_list[name.rsplit(".", 1)[0]]
            want = block(np.stack([ref_q[f"{en.name}.{x}"]._amax.float().numpy().reshape(
                en.grid[0][1:]) for x in range(e)]), en.grid)[int(name.rsplit(".", 1)[1])]
            same(q._amax.reshape(want.shape), want, where + " _amax")
            if cfg_name == "nvfp4_static":
                same(q._global_amax, rq._global_amax, where + " _global_amax")
