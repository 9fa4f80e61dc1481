"""A synthetic MoE transformer block for multi-daemon layout tests.

One decoder layer ("layers.0"): attention with fused q/k/v, a router, E = 8
routed experts and a dense shared expert. Weights and data are drawn from a
fixed seed and are the same global tensors in every layout; each rank
computes the amax of what it holds and sends it with its placement, so the
reconciled whole tensors must be the same bytes in every layout, and equal
to expected(), which this module derives from the global tensors alone.

Layouts and ranks
-----------------
The world is always 8 ranks, TP * EP * DP == 8 (LAYOUTS), in the Megatron
order with TP fastest:

    tp_rank = r % TP,  ep_rank = (r // TP) % EP,  dp_rank = r // (TP * EP)

- Tensor parallel: column-parallel linears (q/k/v, shared gate/up, expert
  fc1) split their output rows over TP; row-parallel ones (o_proj, shared
  down, expert fc2) split their input columns. Their inputs follow: the
  input of a column-parallel linear is the same on every TP rank (each sends
  the same value, max-merged); the input of a row-parallel one is the TP
  rank's slice of the features (each sends a partial amax, max-merged).
- Expert parallel: EP rank e owns experts [e*E/EP, (e+1)*E/EP). Attention,
  router and shared expert are replicated over EP, so the dense layers have
  8/TP data-parallel replicas, dense replica d = r // TP = dp_rank*EP +
  ep_rank, and replica d sees tokens [d*T/n, (d+1)*T/n) of the global batch
  (n = 8/TP). The dense-activation global amax is the max over all of them.
- Experts see, after the all-to-all, the tokens of their DP replica (the
  union of the dense slices of the EP group: [dp*T/DP, (dp+1)*T/DP)) that
  the router sent to them. Per-expert amax therefore depends only on the
  token and its route, never on the layout.
- Each rank's dense slice is split into 2 micro-batches, each sent on its
  own (weights with the first); an expert may get tokens in one micro-batch
  and none in the other, so a masked update follows a real one.

Activations are drawn, not computed (no matmul): BLAS may sum in another
order in another process, and every value here must be bit-identical
wherever it is computed. All magnitudes are powers of two times uniform
draws, which is exact arithmetic.

Routing (ROUTED, PINNED): top-1; experts 6 and 7 never get a token, so in
tp1ep4dp2 EP rank 3 (ranks 3 and 7) holds only token-less experts; in epoch
1 expert 5 gets 4 tokens, all in DP replica 0's first micro-batch; expert 0
gets tokens from epoch 2 on; expert 2 in epoch 1 only.

Quantizers and what each exercises
----------------------------------
  self_attn.{q,k,v}_proj.weight  NVFP4 TE [R, H/16] column-parallel, one
      scale group: S_enc from the group's max (held by v_proj); zero block.
  self_attn.o_proj.weight        NVFP4 ModelOpt [H, QO/16] row-parallel
      (block columns split over TP); zero block (ModelOpt reads it as 1.0).
  self_attn.q_proj.input, o_proj.input   NVFP4 per-tensor activations over
      all DP x EP replicas; o_proj's is TP-partial.
  mlp.router.input               FP8 E4M3 delayed, margin 1, PER_EPOCH,
      history 3 (max): the window keeps epoch 2's amax in epoch 3.
  mlp.experts.fc1.weight         NVFP4 [E, F, H/16]: one quantizer for all
      experts, blocks split over EP (dim 0) and TP (dim 1), so its global
      amax (held by expert 3) must be reduced over TP and EP.
  mlp.experts.fc2.weight         NVFP4 [E, H, F/16], EP dim 0, TP dim 2;
      global amax held by token-less expert 6.
  mlp.experts.fc1.input          FP8 E4M3 delayed, PER_EPOCH, history 2 (TE unfused rule)
      (max), [E] per expert, no peer group: experts 6/7 stay missing with
      scale 1 (expert 0 too in epoch 1), expert 2 falls out of the window in
      epoch 3 and keeps its previous scale; the 2-slot ring wraps.
  mlp.experts.fc2.input          FP8 E5M2 current, [E] per expert, peer
      group: token-less experts get the group's max; the fill is not
      accumulated (expert 0, filled in epoch 1, reads its own small amax in
      epoch 2); expert 2 keeps its running max. TP-partial (fc2's input
      features are split over TP).
  mlp.shared_expert.gate_proj.weight  FP8 E4M3 current per-channel [FS],
      column-parallel; a zero channel and a subnormal one (scale FLT_MAX).
  mlp.shared_expert.up_proj.weight    MXFP8 [FS, H/32] (1x32 blocks),
      column-parallel; a zero block (E8M0 0) and a subnormal one.
  mlp.shared_expert.down_proj.weight  FP8 E4M3 current per-channel [H],
      row-parallel: replicated, every TP rank sends a partial max; one
      channel is zero in the first half of its inputs (TP rank 0, and 1
      with TP 4, send 0 for it), one is zero everywhere.

Epochs are numbered from 1 as in the API; epoch k draws a new batch, the
weights stay fixed.

Use
---
  quantizers(layout, rank)            the rank's specs with placements
  registration_batches(layout, rank, order_seed)  the same, shuffled, in 1-2 calls
  local_amax(layout, rank, epoch)     the rank's amax of an epoch
  send_batches(layout, rank, epoch, order_seed)   ... as the SendAmax requests
  expected(epoch)                     whole-tensor results after epochs 1..epoch
  run_rank(socket, job, layout, rank, order_seed) one trainer process
  check_rank_results(layout, rank, run_rank(...)["epochs"]), check_whole(...),
  whole_bytes(run_rank(...))          the comparisons
  ranks_without_expert_tokens(layout) ranks whose experts never get a token
"""
import functools
import os
import sys
from dataclasses import dataclass

import numpy as np

import amaxd
from amaxd import pb
from amaxd import placement as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
import reference as ref  # noqa: E402

WORLD = 8
LAYOUTS = {"tp4ep1dp2": (4, 1, 2), "tp2ep2dp2": (2, 2, 2), "tp1ep4dp2": (1, 4, 2)}
epochs = 3

SEED = 20241122
E = 8  # routed experts
H = 128  # hidden size
QO = 128  # q_proj output (= o_proj input)
KV = 64  # k_proj/v_proj output (grouped-query attention)
F = 64  # routed expert FFN size
FS = 128  # shared expert FFN size
T = 64  # tokens of the global batch per epoch

# ROUTED[epoch][dp_rank]: the experts that DP replica's tokens go to, in
# equal shares, except for PINNED[epoch] = (expert, tokens): tokens 0-3 are
# in micro-batch 0 of DP replica 0 in every layout, so in epoch 1 expert 5
# is masked on DP rank 1 and in micro-batch 1 after real data in 0.
ROUTED = {
    1: ((1, 2, 3, 4), (1, 2, 3, 4)),
    2: ((0, 1, 3, 4, 5), (0, 1, 3, 4, 5)),
    3: ((0, 1, 3, 4, 5), (0, 1, 3, 4, 5)),
}
PINNED = {1: (5, slice(0, 4))}
# Magnitude of expert e's fc2 input: 2^-12 (amax below 2^-7) to 2^13 (~1e4).
EXPERT_GAIN_EXP = (-12, -6, -1, 3, 8, 13, 0, 0)
# Epoch gain of the router/expert input: epoch 2 is the largest, so the
# history window keeps it in epoch 3.
EPOCH_GAIN = {1: 1.0, 2: 4.0, 3: 0.5}

L = "layers.0."
QKV_GROUP = L + "self_attn.qkv.weight"
FC2_INPUT_PEERS = L + "mlp.experts.fc2.input"

NVFP4_TE = amaxd.Recipe.nvfp4()
NVFP4_MODELOPT = amaxd.Recipe.nvfp4("modelopt")
RUNNING_MAX, PER_EPOCH = amaxd.RUNNING_MAX, amaxd.PER_EPOCH


@dataclass(frozen=True)
class Spec:
    """A quantizer of the block; `kind` says how a rank's placement is made."""

    name: str
    shape: tuple
    recipe: amaxd.Recipe
    kind: str  # column, row, replicated, expert, expert_column, expert_row
    accumulation: int = RUNNING_MAX
    peer_group: str = ""
    scale_group: str = ""


SPECS = [
    Spec(L + "self_attn.q_proj.weight_quantizer", (QO, H // 16), NVFP4_TE, "column",
         scale_group=QKV_GROUP),
    Spec(L + "self_attn.k_proj.weight_quantizer", (KV, H // 16), NVFP4_TE, "column",
         scale_group=QKV_GROUP),
    Spec(L + "self_attn.v_proj.weight_quantizer", (KV, H // 16), NVFP4_TE, "column",
         scale_group=QKV_GROUP),
    Spec(L + "self_attn.o_proj.weight_quantizer", (H, QO // 16), NVFP4_MODELOPT, "row"),
    Spec(L + "self_attn.q_proj.input_quantizer", (), NVFP4_TE, "replicated"),
    Spec(L + "self_attn.o_proj.input_quantizer", (), NVFP4_TE, "replicated"),
    Spec(L + "mlp.router.input_quantizer", (), amaxd.Recipe.fp8_delayed(margin=1, history_len=3),
         "replicated", PER_EPOCH),
    Spec(L + "mlp.experts.fc1.weight_quantizer", (E, F, H // 16), NVFP4_TE, "expert_column"),
    Spec(L + "mlp.experts.fc2.weight_quantizer", (E, H, F // 16), NVFP4_TE, "expert_row"),
    Spec(L + "mlp.experts.fc1.input_quantizer", (E,), amaxd.Recipe.fp8_delayed(history_len=2, history="te_unfused"),
         "expert", PER_EPOCH),
    Spec(L + "mlp.experts.fc2.input_quantizer", (E,), amaxd.Recipe.fp8_current(amaxd.FP8_E5M2),
         "expert", peer_group=FC2_INPUT_PEERS),
    Spec(L + "mlp.shared_expert.gate_proj.weight_quantizer", (FS,), amaxd.Recipe.fp8_current(),
         "column"),
    Spec(L + "mlp.shared_expert.up_proj.weight_quantizer", (FS, H // 32), amaxd.Recipe.mxfp8(),
         "column"),
    Spec(L + "mlp.shared_expert.down_proj.weight_quantizer", (H,), amaxd.Recipe.fp8_current(),
         "row"),
]
SPEC = {s.name: s for s in SPECS}
# Short names used below.
Q_W, K_W, V_W, O_W, Q_IN, O_IN, ROUTER_IN, FC1_W, FC2_W, FC1_IN, FC2_IN, GATE_W, UP_W, DOWN_W = (
    s.name for s in SPECS)

# -- layout ------------------------------------------------------------------

def coords(layout_name, rank):
    """(tp, ep, dp, tp_rank, ep_rank, dp_rank) of a rank (Megatron order, TP fastest)."""
    tp, ep, dp = LAYOUTS[layout_name]
    assert tp * ep * dp == WORLD and 0 <= rank < WORLD
    return tp, ep, dp, rank % tp, (rank // tp) % ep, rank // (tp * ep)


def _part(n, i, parts):
    """Part i of `parts` equal parts of range(n), as a slice."""
    assert n % parts == 0
    return slice(i * n // parts, (i + 1) * n // parts)


def placement(spec, layout_name, rank):
    tp, ep, _, tp_rank, ep_rank, _ = coords(layout_name, rank)
    if spec.kind == "column":
        return P.column_parallel(spec.shape, tp_rank, tp)
    if spec.kind == "row":
        return P.row_parallel(spec.shape, tp_rank, tp)
    if spec.kind == "replicated":
        return P.replicated(spec.shape)
    if spec.kind == "expert":
        return P.per_expert(E, ep_rank, ep)
    # A block of all experts' weights: experts (dim 0) over EP, then the TP
    # split of each expert's weight (fc1 rows: dim 1, fc2 block columns:
    # dim 2). placement.py has no helper that combines the two.
    experts = P.per_expert(E, ep_rank, ep)
    block = P.shard(spec.shape, 1 if spec.kind == "expert_column" else 2, tp_rank, tp)
    return P.Placement(experts.offset + block.offset[1:], experts.local_shape + block.local_shape[1:])


def quantizers(layout_name, rank):
    """This rank's quantizer specs with placements, in SPECS order."""
    return [amaxd.Quantizer(s.name, s.shape, s.recipe, placement(s, layout_name, rank),
                            s.accumulation, s.peer_group, s.scale_group) for s in SPECS]


def registration_batches(layout_name, rank, order_seed):
    """quantizers() shuffled by (order_seed, rank), cut into 1 or 2 Register calls."""
    rng = np.random.default_rng([order_seed, rank])
    qs = quantizers(layout_name, rank)
    qs = [qs[i] for i in rng.permutation(len(qs))]
    cut = int(rng.integers(0, len(qs)))
    return [qs[:cut], qs[cut:]] if cut else [qs]


# -- the model -----------------------------------------------------------------

def _pow2(rng, lo, hi, shape):
    """Powers of two 2^[lo, hi): exact, so magnitudes span a wide range bit-reproducibly."""
    return np.ldexp(1.0, rng.integers(lo, hi, shape))


def _weight(rng, shape, lo, hi, block):
    """Uniform(-1, 1) values with one power-of-two magnitude 2^[lo, hi) per
    1 x `block` block (the quantizer's block, or a whole row for per-channel
    amax), so that the amax cells themselves span the range."""
    blocks = shape[:-1] + (shape[-1] // block,)
    mag = np.repeat(_pow2(rng, lo, hi, blocks), block, axis=-1)
    return (rng.uniform(-1, 1, shape) * mag).astype(np.float32)


def _frozen(d):
    for a in d.values():
        a.setflags(write=False)
    return d


@functools.lru_cache(maxsize=None)
def weights():
    """The global weights, [out, in] like torch.nn.Linear; experts stacked on dim 0."""
    rng = np.random.default_rng([SEED, 0])
    w = {
        "q": _weight(rng, (QO, H), -10, 12, 16),
        "k": _weight(rng, (KV, H), -10, 12, 16),
        "v": _weight(rng, (KV, H), -10, 12, 16),
        "o": _weight(rng, (H, QO), -10, 14, 16),
        "fc1": _weight(rng, (E, F, H), -10, 12, 16),
        "fc2": _weight(rng, (E, H, F), -10, 12, 16),
        "gate": _weight(rng, (FS, H), -14, 14, H),
        "up": _weight(rng, (FS, H), -14, 14, 32),
        "down": _weight(rng, (H, FS), -14, 14, FS),
    }
    w["q"][3, 32:48] = 0  # an all-zero NVFP4 block
    w["v"][10, 5] = 3.0e4  # the q/k/v scale group's max lies in v_proj only
    w["o"][0, :16] = 0  # ModelOpt reads a zero block as scale 1.0
    w["fc1"][3, 7, 100] = 2.0e4  # the experts' fc1 global amax, in expert 3 only
    w["fc1"][7, 0, :16] = 0
    w["fc2"][6, 2, 50] = -1.5e4  # the experts' fc2 global amax, in token-less expert 6
    w["gate"][5] = 0  # a zero channel: FP8 scale 1
    w["gate"][6] = 0
    w["gate"][6, 77] = 1e-40  # a subnormal channel: FP8 scale FLT_MAX
    w["up"][2, 32:64] = 0  # a zero MXFP8 block: E8M0 0, scale_inv 0
    w["up"][7, :32] = 0
    w["up"][7, 3] = -1e-40
    w["down"][9, :FS // 2] = 0  # channel 9: TP rank 0 (and 1 with TP 4) sends a partial 0
    w["down"][10] = 0
    return _frozen(w)


@functools.lru_cache(maxsize=None)
def batch(epoch):
    """Epoch `epoch`'s global batch: activations [T, features] and each token's expert."""
    assert 1 <= epoch <= epochs
    rng = np.random.default_rng([SEED, 1, epoch])
    half = T // 2  # DP = 2 in every layout: tokens [dp*T/2, (dp+1)*T/2) are DP replica dp's
    route = np.concatenate([rng.permutation(np.resize(np.array(ROUTED[epoch][dp]), half))
                            for dp in range(2)])
    if epoch in PINNED:
        expert, tokens = PINNED[epoch]
        route[tokens] = expert

    def act(features, lo, hi):
        return rng.uniform(-1, 1, (T, features)) * _pow2(rng, lo, hi, (T, 1))

    gain = np.ldexp(1.0, np.array(EXPERT_GAIN_EXP))[route][:, None]
    b = {
        "route": route,
        "ln1": act(H, -8, 8).astype(np.float32),  # q/k/v input
        "attn": act(QO, -12, 6).astype(np.float32),  # o_proj input
        "ln2": (act(H, -10, 10) * EPOCH_GAIN[epoch]).astype(np.float32),  # router/experts input
        "act": (act(F, -2, 2) * gain).astype(np.float32),  # each token's expert fc2 input
    }
    return _frozen(b)


def expert_tokens(epoch):
    """{expert: number of tokens routed to it in the epoch}."""
    route = batch(epoch)["route"]
    return {e: int((route == e).sum()) for e in range(E)}


def ranks_without_expert_tokens(layout_name):
    """Ranks all of whose experts get no token in any epoch."""
    fed = {e for k in range(1, epochs + 1) for e, n in expert_tokens(k).items() if n}
    out = []
    for r in range(WORLD):
        _, ep, _, _, ep_rank, _ = coords(layout_name, r)
        if not fed & set(range(E)[_part(E, ep_rank, ep)]):
            out.append(r)
    return out


def _block_amax(w, block):
    """Amax of each 1 x `block` block along the last dimension."""
    return np.abs(w).reshape(w.shape[:-1] + (w.shape[-1] // block, block)).max(axis=-1)


# -- what the whole job measures (no layout) --------------------------------------

def global_amax(epoch):
    """Each quantizer's global amax tensor of one epoch, before accumulation:
    float32, NaN where no rank has data."""
    w, b = weights(), batch(epoch)

    def per_expert(x):
        return np.array([np.abs(x[b["route"] == e]).max() if (b["route"] == e).any() else np.nan
                         for e in range(E)], np.float32)

    return {
        Q_W: _block_amax(w["q"], 16), K_W: _block_amax(w["k"], 16), V_W: _block_amax(w["v"], 16),
        O_W: _block_amax(w["o"], 16),
        Q_IN: np.abs(b["ln1"]).max(), O_IN: np.abs(b["attn"]).max(),
        ROUTER_IN: np.abs(b["ln2"]).max(),
        FC1_W: _block_amax(w["fc1"], 16), FC2_W: _block_amax(w["fc2"], 16),
        FC1_IN: per_expert(b["ln2"]), FC2_IN: per_expert(b["act"]),
        GATE_W: np.abs(w["gate"]).max(axis=1), UP_W: _block_amax(w["up"], 32),
        DOWN_W: np.abs(w["down"]).max(axis=1),
    }


# -- what one rank measures ------------------------------------------------------

def _dense_tokens(layout_name, rank, mb):
    """Token indices of the rank's dense replica in micro-batch mb (0 or 1)."""
    tp = LAYOUTS[layout_name][0]
    replica = _part(T, rank // tp, WORLD // tp)
    return np.arange(T)[replica][_part(replica.stop - replica.start, mb, 2)]


def _local(layout_name, rank, epoch, mbs):
    """The rank's amax over micro-batches `mbs`; weights come with micro-batch 0."""
    tp, ep, _, tp_rank, ep_rank, dp_rank = coords(layout_name, rank)
    b = batch(epoch)
    out = {}
    if 0 in mbs:
        w = weights()
        # Column-parallel: this TP rank's output rows; row-parallel: its input
        # columns; experts: this EP rank's.
        tpp = lambda n: _part(n, tp_rank, tp)  # noqa: E731
        mine = _part(E, ep_rank, ep)
        out.update({
            Q_W: _block_amax(w["q"][tpp(QO)], 16),
            K_W: _block_amax(w["k"][tpp(KV)], 16),
            V_W: _block_amax(w["v"][tpp(KV)], 16),
            O_W: _block_amax(w["o"][:, tpp(QO)], 16),
            FC1_W: _block_amax(w["fc1"][mine, tpp(F)], 16),
            FC2_W: _block_amax(w["fc2"][mine, :, tpp(F)], 16),
            GATE_W: np.abs(w["gate"][tpp(FS)]).max(axis=1),
            UP_W: _block_amax(w["up"][tpp(FS)], 32),
            DOWN_W: np.abs(w["down"][:, tpp(FS)]).max(axis=1),
        })
    dense = np.concatenate([_dense_tokens(layout_name, rank, m) for m in mbs])
    heads = _part(QO, tp_rank, tp)
    out[Q_IN] = np.abs(b["ln1"][dense]).max()
    out[O_IN] = np.abs(b["attn"][dense][:, heads]).max()
    out[ROUTER_IN] = np.abs(b["ln2"][dense]).max()
    # The all-to-all: the expert ranks get the micro-batches of every dense
    # replica of their EP group (same dp_rank and tp_rank).
    group = [dp_rank * tp * ep + e * tp + tp_rank for e in range(ep)]
    tokens = np.concatenate([_dense_tokens(layout_name, r, m) for r in group for m in mbs])
    experts = range(E)[_part(E, ep_rank, ep)]
    features = _part(F, tp_rank, tp)
    for name, x in ((FC1_IN, b["ln2"]), (FC2_IN, b["act"][:, features])):
        routed = [x[tokens[b["route"][tokens] == e]] for e in experts]
        vals = np.array([np.abs(t).max() if len(t) else 0 for t in routed], np.float32)
        out[name] = np.ma.masked_array(vals, mask=[not len(t) for t in routed])
    return out


def local_amax(layout_name, rank, epoch):
    """{name: this rank's local amax block} for the epoch: an array of the
    placement's local shape, a float32 scalar for per-tensor quantizers, a
    masked array where experts got no tokens."""
    return _local(layout_name, rank, epoch, (0, 1))


def microbatch_amax(layout_name, rank, epoch):
    """local_amax() as the 2 micro-batches that are sent; their max is local_amax()."""
    return [_local(layout_name, rank, epoch, (m,)) for m in (0, 1)]


def send_batches(layout_name, rank, epoch, order_seed):
    """The SendAmax requests of a rank's epoch: each micro-batch's updates in a
    shuffled order, cut into 2 requests."""
    rng = np.random.default_rng([order_seed, rank, epoch])
    out = []
    for mb in microbatch_amax(layout_name, rank, epoch):
        names = list(mb)
        rng.shuffle(names)
        cut = int(rng.integers(1, len(names)))
        out += [{n: mb[n] for n in names[:cut]}, {n: mb[n] for n in names[cut:]}]
    return out


# -- the reconciled result, independently ----------------------------------------

def _fp8_max(recipe):
    return 57344.0 if recipe.format == amaxd.FP8_E5M2 else 448.0


def _scales(spec, amax, g, prev, prev_g):
    """(scale, scale_inv, block_scales, global_scale, global_scale_inv, prev,
    prev_g) per docs/NUMERICS.md. reference.scales() covers NVFP4 TE, MXFP8 and
    FP8 current with a (group) global `g`; FP8 delayed with a previous scale
    per cell and per quantizer, and the ModelOpt NVFP4 convention, are built
    here from reference.py's pieces, following the NUMERICS.md table."""
    r = spec.recipe
    if r.format == amaxd.NVFP4 and r.nvfp4_convention == pb.MODELOPT:
        return (*ref.scales("nvfp4", amax, g, nvfp4="modelopt"), prev, prev_g)
    if r.format == amaxd.NVFP4:
        return (*ref.scales("nvfp4", amax, g), prev, prev_g)
    if r.format == amaxd.MXFP8:
        return (*ref.scales("mxfp8", amax, g), prev, prev_g)
    m = _fp8_max(r)
    if r.rule == pb.DELAYED:
        # The cell and the quantizer's global scale each fall back to their
        # own previous scale (1 before the first epoch) when the amax is 0.
        s, gs = ref.fp8_delayed(amax, prev, m, r.margin), ref.fp8_delayed(g, prev_g, m, r.margin)
        prev, prev_g = s, gs
    else:
        s, gs = ref.fp8_current(amax, m, r.power_of_2, r.eps), ref.fp8_current(g, m, r.power_of_2, r.eps)
    return s, np.float32(1) / s, np.zeros(np.shape(amax), np.uint8), gs, np.float32(1) / gs, prev, prev_g


@functools.lru_cache(maxsize=None)
def _history():
    """Reconciled whole tensors after each epoch 1..epochs, in order (docs/API.md):
    accumulation, peer fill, global amax (scale groups), scales."""
    running = {s.name: np.full(s.shape, -np.inf, np.float32) for s in SPECS}
    window = {s.name: [] for s in SPECS}
    prev = {s.name: np.ones(s.shape, np.float32) for s in SPECS}
    prev_g = {s.name: np.float32(1) for s in SPECS}
    out = []
    for epoch in range(1, epochs + 1):
        raw = {n: np.where(np.isnan(a), -np.inf, a).astype(np.float32)
               for n, a in global_amax(epoch).items()}
        acc = {}
        for s in SPECS:
            if s.accumulation == PER_EPOCH:
                # The spec's history convention (reference.delayed_history).
                window[s.name].append(np.where(np.isinf(raw[s.name]), np.nan, raw[s.name]))
                reduce = "most_recent" if s.recipe.history_reduce == pb.MOST_RECENT else "max"
                conv = ("te_unfused" if s.recipe.history_convention == pb.HISTORY_TRANSFORMER_ENGINE_UNFUSED
                        else "te")
                acc[s.name] = ref.delayed_history(window[s.name], max(s.recipe.history_len, 1),
                                                  reduce, conv)[-1]
            else:
                running[s.name] = np.maximum(running[s.name], raw[s.name])
                acc[s.name] = running[s.name]
        # Peer fill uses the group's max before any fill.
        peer = {}
        for s in SPECS:
            if s.peer_group:
                peer[s.peer_group] = max(peer.get(s.peer_group, -np.inf), acc[s.name].max())
        filled = {s.name: np.where(acc[s.name] == -np.inf, peer.get(s.peer_group, -np.inf),
                                   acc[s.name]).astype(np.float32) for s in SPECS}
        group = {}
        for s in SPECS:
            if s.scale_group:
                group[s.scale_group] = max(group.get(s.scale_group, -np.inf), filled[s.name].max())
        res = {}
        for s in SPECS:
            a = filled[s.name]
            missing = a == -np.inf
            amax = np.where(missing, 0, a).astype(np.float32)
            g = np.float32(max(group[s.scale_group] if s.scale_group else a.max(), 0))
            sc, si, bs, gs, gsi, prev[s.name], prev_g[s.name] = _scales(s, amax, g, prev[s.name],
                                                                         prev_g[s.name])
            res[s.name] = {
                "amax": amax,
                "scale": np.asarray(sc, np.float32).reshape(s.shape),
                "scale_inv": np.asarray(si, np.float32).reshape(s.shape),
                "block_scales": np.asarray(bs, np.uint8).reshape(s.shape),
                "global_amax": g,
                "global_scale": np.float32(gs),
                "global_scale_inv": np.float32(gsi),
                "missing": missing,
            }
            for v in res[s.name].values():
                if isinstance(v, np.ndarray):
                    v.setflags(write=False)
        out.append(res)
    return out


def expected(epoch):
    """{name: whole-tensor result after epochs 1..epoch}: float32 arrays
    "amax", "scale", "scale_inv"; uint8 "block_scales"; float32 scalars
    "global_amax", "global_scale", "global_scale_inv"; bool array "missing"
    (cells no rank wrote and no peer group filled)."""
    assert 1 <= epoch <= epochs
    return _history()[epoch - 1]


# -- a trainer rank and the checks --------------------------------------------------

def pack(results):
    """{name: amaxd.Result} -> plain picklable values (tensors as their bytes)."""
    return {n: {"offset": tuple(r.offset), "shape": tuple(r.shape), "amax": r.amax.tobytes(),
                "scale": r.scale.tobytes(), "scale_inv": r.scale_inv.tobytes(),
                "block_scales": r.block_scales.tobytes(), "global_amax": r.global_amax,
                "global_scale": r.global_scale, "global_scale_inv": r.global_scale_inv,
                "missing": r.missing} for n, r in results.items()}


def run_rank(socket, job, layout_name, rank, order_seed):
    """One trainer process: join, register (shuffled, maybe in 2 calls), then
    each epoch send its micro-batches (SendAmax; StreamAmax in epoch 2) and
    reconcile; finally read the whole tensors.
    Returns {"epochs": [pack(reconcile) per epoch], "whole": pack(get_scales(whole))}."""
    step = "join"
    try:
        with amaxd.Client(job, rank, WORLD, socket=socket, timeout=60) as c:
            c.join()
            step = "register"
            for qs in registration_batches(layout_name, rank, order_seed):
                c.register(qs)
            per_epoch = []
            for epoch in range(1, epochs + 1):
                step = f"epoch {epoch}"
                sends = send_batches(layout_name, rank, epoch, order_seed)
                if epoch == 2:
                    c.stream(sends)
                else:
                    for s in sends:
                        c.send(s)
                per_epoch.append(pack(c.reconcile()))
            step = "get_scales"
            whole = pack(c.get_scales(whole=True))
    except amaxd.AmaxdError as e:
        # An AmaxdError cannot be unpickled (its __init__ takes code and
        # message), so from a spawned worker it would surface only as
        # BrokenProcessPool: pass it on as text.
        raise RuntimeError(f"{layout_name} rank {rank} {step}: {e}") from None
    return {"epochs": per_epoch, "whole": whole}


def _first_diff(got, want):
    g = np.frombuffer(got, dtype=want.dtype)
    w = want.reshape(-1)
    if g.size != w.size:
        return f"{g.size} cells, expected {w.size}"
    i = int(np.flatnonzero(g.view(np.uint8 if g.itemsize == 1 else np.uint32)
                           != w.view(np.uint8 if w.itemsize == 1 else np.uint32))[0])
    return f"flat cell {i}: got {g[i]!r}, expected {w[i]!r}"


def _check(got, exp, offset, shape, where):
    assert tuple(got["offset"]) == tuple(offset) and tuple(got["shape"]) == tuple(shape), \
        f"{where}: block {got['offset']}+{got['shape']}, expected {offset}+{shape}"
    sl = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    for field in ("amax", "scale", "scale_inv", "block_scales"):
        want = np.ascontiguousarray(exp[field][sl])
        assert got[field] == want.tobytes(), f"{where} {field}: {_first_diff(got[field], want)}"
    for field in ("global_amax", "global_scale", "global_scale_inv"):
        assert np.float32(got[field]).tobytes() == exp[field].tobytes(), \
            f"{where} {field}: got {got[field]!r}, expected {exp[field]!r}"
    assert got["missing"] == int(exp["missing"][sl].sum()), \
        f"{where} missing: got {got['missing']}, expected {int(exp['missing'][sl].sum())}"


def check_rank_results(layout_name, rank, per_epoch_results):
    """Asserts that a rank's reconcile results of every epoch are the expected
    whole tensors sliced by its placements, bit for bit."""
    assert len(per_epoch_results) == epochs, f"{len(per_epoch_results)} epochs, expected {epochs}"
    qs = quantizers(layout_name, rank)
    for epoch, got in enumerate(per_epoch_results, start=1):
        exp = expected(epoch)
        assert set(got) == {q.name for q in qs}, f"{layout_name} rank {rank} epoch {epoch}: names"
        for q in qs:
            _check(got[q.name], exp[q.name], q.placement.offset, q.placement.local_shape,
                   f"{layout_name} rank {rank} epoch {epoch} {q.name}")


def check_whole(whole, where="whole"):
    """Asserts that whole-tensor results (GetScales global) are expected(epochs)."""
    exp = expected(epochs)
    assert set(whole) == set(SPEC), f"{where}: names"
    for s in SPECS:
        _check(whole[s.name], exp[s.name], (0,) * len(s.shape), s.shape, f"{where} {s.name}")


def whole_bytes(results):
    """run_rank()'s final whole tensors as one bytes string, to compare layouts."""
    whole = results["whole"]
    out = []
    for n in sorted(whole):
        r = whole[n]
        out += [n.encode(), np.asarray(r["shape"], np.uint32).tobytes(), r["amax"], r["scale"],
                r["scale_inv"], r["block_scales"],
                np.array([r["global_amax"], r["global_scale"], r["global_scale_inv"]], np.float32).tobytes(),
                np.uint32(r["missing"]).tobytes()]
    return b"".join(out)
