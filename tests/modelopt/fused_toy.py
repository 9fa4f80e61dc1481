"""transformers' own fused MoE for the ModelOpt tier, and its shards.

The model is one ``MixtralSparseMoeBlock`` of transformers 5.x
(``transformers/models/mixtral/modeling_mixtral.py``): a
``MixtralTopKRouter`` (``gate``) and ``MixtralExperts`` (``experts``), whose
weights are two 3-D parameters, ``gate_up_proj [E, 2*I, H]`` (the gate half
then the up half) and ``down_proj [E, H, I]``, run per expert with two
``F.linear`` calls (``experts_implementation="eager"``). ModelOpt 0.47
wraps the experts as ``_QuantFusedExperts``
(``modelopt/torch/quantization/plugins/huggingface.py``): one
``TensorQuantizer`` per expert and projection in
``gate_up_proj_weight_quantizers`` / ``down_proj_weight_quantizers``
(nn.ModuleLists) and one input quantizer per projection shared by every
expert. The router is not a linear and is not quantized, and ModelOpt does
not unify the input amax of fused experts (``_is_sparse_sequaential_moe_block``
needs iterable experts).

E = 8 experts, top-2; the router never picks experts 6 and 7 (their router
rows are negative and every calibration token is positive), so an EP rank
may hold only cold experts. Expert weights have a power-of-two magnitude per
16 x 1 block over a wide range, one expert is far smaller than the others
(per-expert NVFP4 globals differ a lot), and there are an all-zero block and
a lone large weight in a cold expert.

Shards. Layout (etp, ep), W = etp * ep ranks, rank r = ep_rank * etp +
etp_rank. EP rank e holds experts [e*E/ep, (e+1)*E/ep) as its local experts
0..E/ep-1 (transformers' ``GroupedGemmParallel``, Megatron's contiguous
assignment); expert-TP splits ``gate_up_proj`` as transformers'
``packed_colwise`` does (each of the gate and up halves split in etp parts:
local rows [gate part, up part]) and ``down_proj`` row-wise (its input
features). A shard is a ``MixtralSparseMoeBlock`` of a config with E/ep
experts and intermediate size I/etp.

Calibration of a shard: with etp = 1 the shard's real experts forward runs
on exactly the tokens the single process routed to each of its experts
(one call per expert, so each F.linear sees the same rows in the same
order as in the single process); with etp > 1 a shard's matmul has other
shapes, whose results may differ from the single process in the last bits
before amaxd sees anything (toy.py says the same of TP), so the shard's two
input quantizers are fed what the single process's got, the down
projection's its part of the intermediate features.
"""
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

H, I, E, TOP_K = 64, 64, 8, 2
COLD = (6, 7)
TOKENS = 48
LAYOUTS = {"ep2": (1, 2), "etp2ep2": (2, 2), "ep4": (1, 4)}  # (etp, ep)
SEED = 20261126


def config(n_experts=E, inter=I):
    c = MixtralConfig(hidden_size=H, intermediate_size=inter, num_local_experts=n_experts,
                      num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=32)
    c._experts_implementation = "eager"
    return c


class Model(torch.nn.Module):
    """One transformers Mixtral MoE block under `mlp` (names as in a decoder layer)."""

    def __init__(self, n_experts=E, inter=I):
        super().__init__()
        self.mlp = MixtralSparseMoeBlock(config(n_experts, inter))

    def forward(self, x):
        return self.mlp(x)


def _blocks(g, shape, lo, hi):
    """Normal values with one power-of-two magnitude 2^[lo, hi) per 1 x 16."""
    *lead, inn = shape
    mag = torch.exp2(torch.randint(lo, hi, (*lead, inn // 16), generator=g).float())
    return torch.randn(shape, generator=g) * mag.repeat_interleave(16, dim=-1)


def full_model():
    g = torch.Generator().manual_seed(SEED)
    m = Model()
    ex = m.mlp.experts
    with torch.no_grad():
        ex.gate_up_proj.copy_(_blocks(g, tuple(ex.gate_up_proj.shape), -6, 3) * 0.1)
        ex.down_proj.copy_(_blocks(g, tuple(ex.down_proj.shape), -6, 3) * 0.1)
        ex.gate_up_proj[3] *= 2.0 ** -20  # an expert far below the others
        ex.down_proj[3] *= 2.0 ** -20
        ex.gate_up_proj[1, 70, 16:32] = 0  # an all-zero block (up half)
        ex.down_proj[6, 5, 40] = -30.0  # the largest down weight, in a cold expert
        r = torch.randn(E, H, generator=g)
        r[list(COLD)] = -1.0  # tokens are positive: never among the top 2
        m.mlp.gate.weight.copy_(r)
    return m


def tokens():
    g = torch.Generator().manual_seed(SEED + 1)
    scale = torch.exp2(torch.randint(-3, 4, (1, TOKENS, 1), generator=g).float())
    return torch.rand((1, TOKENS, H), generator=g) * scale + 1e-3


def capture(model):
    """Forward pre-hooks on the fused experts' two input quantizers that
    record what each expert fed them; returns ({(proj, expert): input}, remove)."""
    ex = model.mlp.experts
    seen, handles = {}, []
    for proj in ("gate_up_proj", "down_proj"):
        q = getattr(ex, f"{proj}_input_quantizer")
        handles.append(q.register_forward_pre_hook(
            lambda mod, args, proj=proj: seen.__setitem__(
                (proj, int(ex._current_expert_idx)), args[0].detach().clone())))
    return seen, lambda: [h.remove() for h in handles]


def calibrate_full(quantize):
    """The whole block calibrated on the tokens by `quantize(model, loop)`,
    and what each expert's input quantizers were fed: (model, {(proj,
    expert): input})."""
    model, x = full_model(), tokens()
    captured = {}

    def loop(m):
        seen, remove = capture(m)
        m(x)
        remove()
        captured.update(seen)

    quantize(model, loop)
    return model, captured


def coords(layout, rank):
    """(etp, ep, etp_rank, ep_rank, world)."""
    etp, ep = LAYOUTS[layout]
    return etp, ep, rank % etp, rank // etp, etp * ep


def _part(n, i, parts):
    assert n % parts == 0
    return slice(i * n // parts, (i + 1) * n // parts)


def shard_model(full, layout, rank):
    etp, ep, er, epr, _ = coords(layout, rank)
    m = Model(n_experts=E // ep, inter=I // etp)
    mine = list(range(E))[_part(E, epr, ep)]
    src = full.mlp.experts
    with torch.no_grad():
        gu = src.gate_up_proj[mine]  # [n, 2I, H]
        gate, up = gu[:, :I], gu[:, I:]
        m.mlp.experts.gate_up_proj.copy_(
            torch.cat([gate[:, _part(I, er, etp)], up[:, _part(I, er, etp)]], dim=1))
        m.mlp.experts.down_proj.copy_(src.down_proj[mine][:, :, _part(I, er, etp)])
        m.mlp.gate.weight.copy_(full.mlp.gate.weight[mine])
    return m


def replay(model, captured, layout, rank):
    """Calibration forward of a shard (see the module docstring)."""
    etp, ep, er, epr, _ = coords(layout, rank)
    mine = list(range(E))[_part(E, epr, ep)]
    ex = model.mlp.experts
    for j, g in enumerate(mine):
        x = captured.get(("gate_up_proj", g))
        if x is None:
            continue  # a cold expert: nothing routed to it
        if etp == 1:
            idx = torch.full((x.shape[0], 1), j, dtype=torch.long)
            ex(x, idx, torch.ones(x.shape[0], 1))
        else:
            ex.gate_up_proj_input_quantizer(x)
            d = captured[("down_proj", g)]
            ex.down_proj_input_quantizer(d[..., _part(d.shape[-1], er, etp)])
