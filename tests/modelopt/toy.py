"""A toy transformer block for the ModelOpt tier, and its shards.

One decoder block, float32, no biases:

    x -> RMSNorm -> self_attn (q_proj, k_proj, v_proj: column-parallel;
                               o_proj: row-parallel; 4 query heads, 2 KV heads)
      -> RMSNorm -> mlp (gate_proj, up_proj column, down_proj row; SiLU GLU)
      -> RMSNorm -> block_sparse_moe (router `gate`, top-2 of 8 experts, each
                               a GLU like mlp; experts 6 and 7 never get a token)

The MoE block has the structure ModelOpt's HF plugin recognizes as a sparse
sequential MoE (a `gate` with `top_k` and `num_experts`, an iterable
`experts`), so ModelOpt wraps it and, after calibration, gives every
expert's input quantizers the max over experts (`sync_moe_expert_amax`).
The router is not quantized (ModelOpt's default config disables
`*block_sparse_moe.gate*`). `full_model(router="router")` names the router
`router` instead: ModelOpt then neither wraps the block nor unifies its
experts, and the cold experts' input quantizers keep no `_amax` (and
`*router*` is disabled too).

Shards. The world is W = 4 ranks, TP x EP = 4 (Megatron order, TP fastest:
tp_rank = r % TP, ep_rank = r // TP). Dense layers have W / TP replicas
(replica r // TP) and each sees its share of the batch's sequences; EP rank e
holds experts [e*E/EP, (e+1)*E/EP) and, after the all-to-all, every token of
the batch routed to them (DP = 1); expert weights are split over TP like the
dense ones. A shard model has the same module names with sharded linears and
only its local experts (`experts.0..` are local indices).

A shard's calibration does not run the block: a real TP forward sums the
row-parallel partial products in another order than one process does, so its
activations would differ from the single process in the last bits, and the
point here is what amaxd does with what the ranks measure. Each linear of a
shard is instead fed its part of exactly what the same linear of the
single-process model saw (captured by forward pre-hooks during the
reference's calibration forward): all of it for a column-parallel linear, its
TP slice of the input features for a row-parallel one, the replica's
sequences for dense layers, the expert's tokens for an expert.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

H = 64  # hidden
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
FF = 128  # dense MLP
E, TOP_K, FF_E = 8, 2, 64  # experts
COLD = (6, 7)  # experts the router never picks
B, S = 8, 8  # calibration batch: sequences x tokens
W = 4
LAYOUTS = {"tp2ep2": (2, 2), "tp1ep4": (1, 4)}
SEED = 20261123


class RMSNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, q_out=HEADS * HEAD_DIM, kv_out=KV_HEADS * HEAD_DIM):
        super().__init__()
        self.q_proj = nn.Linear(H, q_out, bias=False)
        self.k_proj = nn.Linear(H, kv_out, bias=False)
        self.v_proj = nn.Linear(H, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, KV_HEADS, HEAD_DIM).transpose(1, 2)
        rep = HEADS // KV_HEADS
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, ff, ff_in=None):
        super().__init__()
        self.gate_proj = nn.Linear(H, ff, bias=False)
        self.up_proj = nn.Linear(H, ff, bias=False)
        self.down_proj = nn.Linear(ff_in or ff, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    def __init__(self, n_experts=E, ff=FF_E, router="gate"):
        super().__init__()
        # The router's name: ModelOpt's HF plugin recognizes (and unifies the
        # experts' input amax of) a sparse MoE by a `gate` with top_k and
        # num_experts; under another name the block stays as it is.
        self.router_name = router
        lin = nn.Linear(H, E, bias=False)
        lin.top_k = TOP_K
        lin.num_experts = E
        setattr(self, router, lin)
        self.experts = nn.ModuleList([MLP(ff) for _ in range(n_experts)])
        self.register_buffer("cold", torch.zeros(E))
        self.cold[list(COLD)] = float("-inf")

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        logits = getattr(self, self.router_name)(x) + self.cold
        weights, chosen = logits.softmax(-1).topk(TOP_K, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(chosen == e)
            if tok.numel():
                out.index_add_(0, tok, expert(x[tok]) * weights[tok, slot, None])
        return out.reshape(shape)


class RoutedMoe(SparseMoe):
    """SparseMoe with a router not named `gate`. A class of its own: ModelOpt
    registers a module class it detected as a sparse MoE for good (and every
    subclass that shares its forward), so SparseMoe wrapped once would be
    wrapped again here."""

    def forward(self, x):
        return super().forward(x)


class Block(nn.Module):
    def __init__(self, q_out=HEADS * HEAD_DIM, kv_out=KV_HEADS * HEAD_DIM, ff=FF, n_experts=E,
                 ff_e=FF_E, router="gate"):
        super().__init__()
        self.input_layernorm = RMSNorm(H)
        self.self_attn = Attention(q_out, kv_out)
        self.post_attention_layernorm = RMSNorm(H)
        self.mlp = MLP(ff)
        self.pre_moe_layernorm = RMSNorm(H)
        moe = SparseMoe if router == "gate" else RoutedMoe
        self.block_sparse_moe = moe(n_experts, ff_e, router)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x + self.block_sparse_moe(self.pre_moe_layernorm(x))


def _weight(g, shape, lo, hi, block=16):
    """Normal values with one power-of-two magnitude 2^[lo, hi) per 1 x block,
    so that block amaxes span a wide range."""
    out, inn = shape
    mag = torch.exp2(torch.randint(lo, hi, (out, inn // block), generator=g).float())
    return torch.randn(shape, generator=g) * mag.repeat_interleave(block, dim=1)


def full_model(router="gate"):
    """The single-process model, with fixed weights and a few edge cases
    (the same whatever the router's name)."""
    g = torch.Generator().manual_seed(SEED)
    m = Block(router=router)
    with torch.no_grad():
        for name, lin in m.named_modules():
            if isinstance(lin, nn.Linear):
                lin.weight.copy_(_weight(g, tuple(lin.weight.shape), -6, 3) * 0.1)
        m.self_attn.q_proj.weight[3, 32:48] = 0  # an all-zero NVFP4 block (ModelOpt: scale 1.0)
        m.self_attn.v_proj.weight[10, 5] = 30.0  # q/k/v's largest weight is in v_proj
        m.mlp.up_proj.weight[7] = 0  # a zero FP8 channel / MXFP8 blocks with amax 0
        m.mlp.up_proj.weight[7, 40] = 1e-30  # ... and a tiny block
        m.block_sparse_moe.experts[6].down_proj.weight[2, 50] = -25.0  # in a cold expert
        m.block_sparse_moe.experts[3].gate_proj.weight[9, 3] = 0
    return m


def batch():
    g = torch.Generator().manual_seed(SEED + 1)
    scale = torch.exp2(torch.randint(-3, 4, (B, S, 1), generator=g).float())
    return torch.randn((B, S, H), generator=g) * scale


# -- shards -------------------------------------------------------------------

def coords(layout, rank):
    """(tp, ep, tp_rank, ep_rank)."""
    tp, ep = LAYOUTS[layout]
    assert tp * ep == W
    return tp, ep, rank % tp, rank // tp


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _part(n, i, parts):
    assert n % parts == 0
    return slice(i * n // parts, (i + 1) * n // parts)


def shard_model(full, layout, rank):
    """The rank's shard of `full` (an unquantized Block with its weights)."""
    tp, ep, tpr, epr = coords(layout, rank)
    m = Block(q_out=HEADS * HEAD_DIM // tp, kv_out=KV_HEADS * HEAD_DIM // tp, ff=FF // tp,
              n_experts=E // ep, ff_e=FF_E // tp, router=full.block_sparse_moe.router_name)
    src = dict(full.named_modules())
    mine = range(E)[_part(E, epr, ep)]
    with torch.no_grad():
        for name, lin in m.named_modules():
            if not isinstance(lin, nn.Linear):
                continue
            sname = name
            if ".experts." in name:
                pre, rest = name.split(".experts.", 1)
                i, tail = rest.split(".", 1)
                sname = f"{pre}.experts.{mine[int(i)]}.{tail}"
            w = src[sname].weight
            last = name.rsplit(".", 1)[-1]
            if last in COLUMN:
                w = w[_part(w.shape[0], tpr, tp)]
            elif last in ROW:
                w = w[:, _part(w.shape[1], tpr, tp)]
            lin.weight.copy_(w)
    return m


def capture_hooks(model):
    """Forward pre-hooks that record every nn.Linear's input; returns
    (captured dict name -> list of inputs, remove())."""
    seen, handles = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_pre_hook(
                lambda mod, args, name=name: seen.setdefault(name, []).append(
                    args[0].detach().clone())))
    return seen, lambda: [h.remove() for h in handles]


def replay(model, captured, layout, rank):
    """Feeds each linear of a shard model its part of what the same linear
    of the single-process model saw (see the module docstring)."""
    tp, ep, tpr, epr = coords(layout, rank)
    replicas = W // tp
    seqs = _part(B, rank // tp, replicas)  # this dense replica's sequences
    mine = range(E)[_part(E, epr, ep)]
    router = "block_sparse_moe." + model.block_sparse_moe.router_name
    for name, lin in model.named_modules():
        if not isinstance(lin, nn.Linear) or name == router:
            continue
        sname = name
        if ".experts." in name:
            pre, rest = name.split(".experts.", 1)
            i, tail = rest.split(".", 1)
            sname = f"{pre}.experts.{mine[int(i)]}.{tail}"
        for x in captured.get(sname, []):
            if ".experts." not in name:
                x = x[seqs]
            if name.rsplit(".", 1)[-1] in ROW:
                x = x[..., _part(x.shape[-1], tpr, tp)]
            lin(x)


def calibrate_full(quantize, router="gate"):
    """(the single-process model calibrated by quantize(model, loop), where
    loop(model) runs one batch; what each of its linears saw)."""
    model, x = full_model(router), batch()
    captured = {}

    def loop(m):
        seen, remove = capture_hooks(m)
        m(x)
        remove()
        captured.update(seen)
    quantize(model, loop)
    return model, captured


def amaxd_layout(layout, rank):
    """amaxd.modelopt.Layout of `rank` under `layout` (TP x EP, DP over the
    rest of W)."""
    import amaxd.modelopt as amo
    tp, ep, tpr, epr = coords(layout, rank)
    return amo.Layout(tp_rank=tpr, tp_size=tp, ep_rank=epr, ep_size=ep, dp_rank=rank // tp,
                      dp_size=W // tp)
