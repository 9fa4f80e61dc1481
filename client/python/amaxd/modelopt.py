"""amaxd for a ModelOpt-quantized torch model (nvidia-modelopt).

ModelOpt calibrates every ``TensorQuantizer`` of a model on this rank's
shard, then, in a distributed job, all-reduces each quantizer's amax over
its data-, expert- and tensor-parallel groups (``max_calibrate`` in
``modelopt/torch/quantization/model_calib.py``: one collective per
quantizer, with process groups held by the modules). This adapter replaces
that step: calibrate each rank with ``distributed_sync=False`` (or without
``torch.distributed``), then

    import amaxd, amaxd.modelopt
    layout = amaxd.modelopt.Layout(tp_rank=..., tp_size=..., ep_rank=..., ep_size=...)
    with amaxd.Client("my-ptq", rank, world_size) as c:
        c.join()
        results = amaxd.modelopt.sync(c, model, layout)

``sync`` registers every enabled quantizer that has an amax to reconcile
with its placement (global shape, this rank's block) and recipe, sends the
rank's local amax, reconciles, and writes the reconciled ``_amax`` (and
``_global_amax`` of static NVFP4 weights) back, so that ModelOpt's export
(``modelopt.torch.export``) writes what a single-process calibration of the
whole model writes. The quantizers hold no process group.

What is registered, per quantizer (docs/MODELOPT.md has the table):

- FP8 per-tensor (``axis=None``): ``[]``, FP8 current with ModelOpt's
  output convention (``scale_inv`` = amax/448, as ``get_scaling_factor``).
- FP8 per-channel weights (``axis=0``): ``[C_out]``, split over TP for a
  column-parallel linear, max-merged for a row-parallel one.
- NVFP4 weights: the ``[R, C/16]`` block amax, split on dim 0
  (column-parallel) or dim 1 (row-parallel); dynamic blocks use the
  ``modelopt`` convention and get ``_amax`` = the global amax back, static
  blocks ``modelopt_static`` and get ``_amax`` (their blocks) and
  ``_global_amax``; ModelOpt's fusible siblings (q/k/v, gate/up, w1/w3,
  ``SHARED_PATTERNS``) share one global amax through a scale group, as
  ``SharedWeightGlobalAmaxState`` does.
- NVFP4 activations: ``[]`` with the ``modelopt`` convention.
- MXFP8 weights: the ``[R, C/32]`` block amax with the ``modelopt``
  convention (ModelOpt's E8M0 exponent, ``ceil(log2(amax/448))`` in
  float32); ModelOpt computes MXFP8 scales from the weight at export and
  keeps no amax: nothing is written back; the daemon's E8M0 block scales
  are in the results.
- Routed experts (``experts.<i>`` / ``local_experts.<i>`` in a
  ``ModuleList``) get their global index ``ep_rank * n_local + i`` in the
  name and are placed on their EP rank; their weights are split over the
  expert-TP group. The input quantizers of the experts of an MoE block that
  ModelOpt unifies (a block with ``layer_sync_moe_local_experts_amax``:
  every expert takes the max over experts, ``sync_moe_expert_amax``) form a
  peer group in ``share`` mode, so experts without tokens, on any EP rank,
  take the layer's max too.
- Fused 3-D experts (transformers 5.x ``MixtralExperts`` & co., which
  ModelOpt wraps as ``_QuantFusedExperts``: ``gate_up_proj`` /
  ``down_proj`` of shape ``[E_local, out, in]`` with one weight quantizer
  per expert in ``gate_up_proj_weight_quantizers.<i>``): one amaxd
  quantizer per projection whose first axis is the global expert index
  (``[E]``, ``[E, C_out]``, ``[E, R, C/16]``...; a gated ``gate_up_proj``
  keeps its gate and up halves apart, ``[E, 2, I, ...]``), placed at
  ``ep_rank * E_local`` and split over the expert-TP group; NVFP4 blocks
  get one global amax per expert (``global_axes=1``). The two input
  quantizers, shared by all experts, are ``[]``.
- Dynamic quantizers (per-token inputs, MX activations) have nothing to
  reconcile and are left alone; other formats raise ``ValueError``.

A quantizer no rank fed (a cold expert's input quantizer where ModelOpt
does not unify the experts) is left as ModelOpt leaves it, without
``_amax``, unless ``plan(cold_experts="fill")`` asks for the layer's max.
Any quantizer whose module the adapter does not know (its placement would
be a guess) makes ``plan`` raise :class:`Unsupported`.
"""
import fnmatch
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import placement as P
from ._gen import amaxd_pb2 as pb
from .packed import PackedResult
from .types import Calibrator, Masked, Quantizer, Recipe, Result, Stat

if TYPE_CHECKING:  # torch is imported when first needed
    import torch

    from .client import Client

__all__ = ["Layout", "Entry", "Unsupported", "plan", "register", "send", "reconcile",
           "write_back", "sync", "SyncResults", "PATHS", "supports_share", "global_name", "DEFAULT_COLUMN",
           "DEFAULT_ROW", "HistEntry", "plan_histograms", "sync_histograms", "MseEntry",
           "plan_mse", "sync_mse", "plan_nvfp4_mse"]

# Last name component of a linear whose output features are split over TP
# (column-parallel) or whose input features are (row-parallel): the usual
# HF / Megatron names. A module that ModelOpt marks _is_column_parallel /
# _is_row_parallel (its Megatron and HF tensor-parallel plugins) is taken
# as such whatever its name.
DEFAULT_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "fc1",
                  "linear_fc1", "linear_qkv", "query_key_value", "c_fc", "dense_h_to_4h")
DEFAULT_ROW = ("o_proj", "down_proj", "w2", "fc2", "linear_fc2", "linear_proj",
               "dense_4h_to_h")
_EXPERTS = re.compile(r"(^|\.)(experts|local_experts)\.(\d+)(?=\.|$)")
# Quantizers of a linear-like module (ModelOpt's QuantLinear and its
# Megatron / HF / TE wrappers: quantizer_attr_names("weight")).
_LINEAR_ATTRS = ("weight_quantizer", "input_quantizer", "output_quantizer")
# Activation quantizers of ModelOpt's attention wrappers (plugins/attention.py,
# huggingface.py _QuantAttention, megatron.py): per-tensor amax of the
# query/key/value/probabilities, whose heads TP splits.
_ATTENTION_ATTR = re.compile(r"([a-z_]+_bmm_quantizer|softmax_quantizer)$")
_PER_TENSOR = ("fp8_tensor", "nvfp4_tensor")


class Unsupported(ValueError):
    """plan() met a quantizer it cannot place without guessing: the message
    names the quantizer, its module (type) and what was not understood."""


@dataclass(frozen=True)
class Layout:
    """This rank's place in the job's parallel layout. Expert tensor
    parallelism (etp) defaults to the dense TP."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    etp_rank: Optional[int] = None
    etp_size: Optional[int] = None

    def __post_init__(self) -> None:
        for r, n, what in ((self.tp_rank, self.tp_size, "tp"), (self.ep_rank, self.ep_size, "ep"),
                           (self.dp_rank, self.dp_size, "dp"),
                           (self.etp[0], self.etp[1], "etp")):
            if n < 1 or not 0 <= r < n:
                raise ValueError(f"{what} rank {r} is not in [0, {n})")

    @property
    def etp(self) -> Tuple[int, int]:
        if self.etp_size is None:
            return self.tp_rank, self.tp_size
        return (self.etp_rank or 0), self.etp_size

    @staticmethod
    def from_megatron(parallel_state: Any = None) -> "Layout":
        """The layout from Megatron-core's ``parallel_state`` (initialized
        model parallel); `parallel_state` may be given (a module with the
        same functions)."""
        if parallel_state is None:
            from megatron.core import parallel_state  # noqa: F811
        ps = parallel_state

        def get(name, default):
            fn = getattr(ps, name, None)
            return default if fn is None else int(fn())

        tp = get("get_tensor_model_parallel_world_size", 1)
        tpr = get("get_tensor_model_parallel_rank", 0)
        return Layout(tp_rank=tpr, tp_size=tp,
                      ep_rank=get("get_expert_model_parallel_rank", 0),
                      ep_size=get("get_expert_model_parallel_world_size", 1),
                      dp_rank=get("get_data_parallel_rank", 0),
                      dp_size=get("get_data_parallel_world_size", 1),
                      etp_rank=get("get_expert_tensor_parallel_rank", tpr),
                      etp_size=get("get_expert_tensor_parallel_world_size", tp))


def supports_share() -> bool:
    """Whether this amaxd client has peer groups in ``share`` mode."""
    return "peer_mode" in {f.name for f in fields(Quantizer)}


@dataclass
class Entry:
    """One quantizer of the model as registered with amaxd."""

    local_name: str  # the quantizer's module name in this rank's model
    name: str  # the logical (global) name: expert indices made global
    # The TensorQuantizer; for fused experts (kind "fused_..."), the
    # nn.ModuleList of this rank's per-expert quantizers.
    quantizer: object
    module: object  # the module that owns it (a quantized linear, the fused experts)
    # fp8_tensor, fp8_channel, nvfp4_blocks, nvfp4_static, nvfp4_tensor,
    # mxfp8_blocks; fused experts' weights: the same prefixed by "fused_".
    kind: str
    spec: Quantizer
    weight: object = None  # the module's weight (3-D for fused experts), for block amax
    parallel: str = "replicated"  # column, row, replicated; packed_column (gate|up halves)
    expert: Optional[int] = None
    peer_share: bool = False
    # The geometry of the quantizer's amax grid whether or not it is what
    # amaxd holds: (global shape, this rank's Placement) of the per-channel
    # or block amax (that of ModelOpt's exported weight scales); None for
    # per-tensor quantizers. Fused experts: with the expert axis first.
    grid: Optional[Tuple[tuple, P.Placement]] = None
    # Whether amaxd holds the blocks (False: the weight's per-tensor amax,
    # plan(weight_blocks=False)).
    blocks: bool = True

    @property
    def fused(self) -> bool:
        return self.kind.startswith("fused_")

    @property
    def base_kind(self) -> str:
        return self.kind[len("fused_"):] if self.fused else self.kind


def _torch():
    import torch
    return torch


def _tensor_quantizer_cls():
    from modelopt.torch.quantization.nn import TensorQuantizer
    return TensorQuantizer


def _quantizer_containers():
    """ModelOpt's quantizer containers (a child quantizer of one is part of
    a chain or a group, not a quantizer of its own)."""
    from modelopt.torch.quantization import nn as qnn
    return tuple(c for c in (getattr(qnn, "SequentialQuantizer", None),
                             getattr(qnn, "GroupedQuantizer", None)) if c is not None)


def _fused_attrs(module) -> Optional[Tuple[str, bool]]:
    """(first projection, gated) of a ModelOpt fused-experts wrapper
    (``_QuantFusedExperts`` / ``_QuantNonGatedFusedExperts`` in
    modelopt/torch/quantization/plugins/huggingface.py, which hold
    ``<first>_weight_quantizers`` and ``down_proj_weight_quantizers`` as
    nn.ModuleLists and one ``<first>_input_quantizer`` /
    ``down_proj_input_quantizer``), or None."""
    first = getattr(module, "_first_proj_attr", None)
    if not isinstance(first, str):
        return None
    import torch.nn as nn
    if not (isinstance(getattr(module, f"{first}_weight_quantizers", None), nn.ModuleList)
            and isinstance(getattr(module, "down_proj_weight_quantizers", None), nn.ModuleList)):
        return None
    return first, bool(getattr(module, "_is_gated", True))


def _n_local_experts(model, container: str, local_name: str, layout: Layout) -> Optional[int]:
    try:
        experts = model.get_submodule(container)
        return len(experts)
    except (AttributeError, TypeError):
        if layout.ep_size > 1:
            raise Unsupported(
                f"{local_name}: {container!r} is not a ModuleList of experts (it has no length), "
                "so amaxd.modelopt cannot tell which global expert the index is; "
                "it refuses rather than guess the EP placement") from None
        return None


def _global_name(model, local_name: str, layout: Layout) -> Tuple[str, Optional[int], str]:
    """(global name, global expert index or None, the MoE block's name) for a
    local module name: experts.<i> becomes experts.<ep_rank * n_local + i>,
    and a fused-experts per-expert quantizer <experts>.<proj>_weight_quantizers.<i>
    becomes ...<proj>_weight_quantizers.<ep_rank * n_local + i>."""
    m = None
    for m in _EXPERTS.finditer(local_name):
        pass
    if m is not None:
        container = local_name[:m.start(3) - 1]  # "...experts"
        n_local = _n_local_experts(model, container, local_name, layout)
        if n_local is None:
            return local_name, None, ""
        g = layout.ep_rank * n_local + int(m.group(3))
        owner = container.rsplit(".", 1)[0] if "." in container else ""
        return local_name[:m.start(3)] + str(g) + local_name[m.end(3):], g, owner
    parts = local_name.rsplit(".", 2)
    if len(parts) >= 2 and parts[-1].isdigit() and parts[-2].endswith("_weight_quantizers"):
        owner = parts[0] if len(parts) == 3 else ""
        try:
            fmod = model.get_submodule(owner) if owner else model
        except AttributeError:
            fmod = None
        if fmod is not None and _fused_attrs(fmod) is not None:
            g = layout.ep_rank * int(fmod.num_experts) + int(parts[-1])
            return local_name[:-len(parts[-1])] + str(g), g, owner
    return local_name, None, ""


def global_name(model: "torch.nn.Module", local_name: str, layout: Layout = Layout()) -> str:
    """The name a quantizer (or module) of this rank's shard has in the
    whole model: routed experts' local indices made global."""
    return _global_name(model, local_name, layout)[0]


def _parallel_kind(module, module_name: str, column, row) -> str:
    if getattr(module, "_is_column_parallel", False):
        return "column"
    if getattr(module, "_is_row_parallel", False):
        return "row"
    last = module_name.rsplit(".", 1)[-1]
    for kind, pats in (("column", column), ("row", row)):
        for p in pats:
            if fnmatch.fnmatchcase(module_name, p) or fnmatch.fnmatchcase(last, p):
                return kind
    return "replicated"


def _classify(q, is_weight: bool, where: str = "") -> Optional[str]:
    """The kind of amax a quantizer holds, or None when it has none to reconcile."""
    bs = q.block_sizes
    nb = q.num_bits
    pre = f"{where}: " if where else ""
    if getattr(q, "_dynamic", False):
        return None
    if bs and bs.get("type") == "dynamic":
        if bs.get("scale_bits") == (8, 0):  # MX: no amax, scales from the data
            if is_weight and nb == (4, 3) and bs.get(-1) == 32:
                return "mxfp8_blocks"
            if not is_weight:
                return None
            raise ValueError(f"{pre}MX format {nb} of a weight is not supported by amaxd")
        if nb == (2, 1) and bs.get("scale_bits") == (4, 3):
            if bs.get(-1) != 16:
                raise ValueError(f"{pre}NVFP4 block size {bs.get(-1)} (amaxd's NVFP4 uses 16)")
            if bs.get("four_over_six"):
                raise ValueError(f"{pre}NVFP4 four_over_six is not supported by amaxd")
            return "nvfp4_blocks" if is_weight else "nvfp4_tensor"
        raise ValueError(f"{pre}dynamic block quantization {nb} {dict(bs)} is not supported "
                         "by amaxd")
    if bs:
        if nb == (2, 1) and bs.get("scale_bits") == (4, 3) and bs.get(-1) == 16:
            if not is_weight:
                raise ValueError(f"{pre}static NVFP4 blocks of an activation are not supported "
                                 "by amaxd (only of weights)")
            if bs.get("four_over_six"):
                raise ValueError(f"{pre}NVFP4 four_over_six is not supported by amaxd")
            return "nvfp4_static"
        if all(v is None for k, v in bs.items() if isinstance(k, int)):
            pass  # per-channel written as block_sizes: handled through axis below
        else:
            raise ValueError(f"{pre}static block quantization {nb} {dict(bs)} is not supported "
                             "by amaxd")
    if nb == (4, 3):
        axis = q.axis
        if axis is None:
            return "fp8_tensor"
        if is_weight and axis in (0, (0,), [0]):
            return "fp8_channel"
        raise ValueError(f"{pre}FP8 with axis {axis} is not supported by the adapter")
    raise ValueError(f"{pre}num_bits {nb} is not supported by amaxd (FP8 E4M3, NVFP4, MXFP8)")


def _shared_groups(model, patterns) -> Dict[str, Tuple[int, str]]:
    """{linear module name: (pattern index, group parent)} of ModelOpt's
    fusible sibling groups (SHARED_PATTERNS) that have at least 2 members
    with an enabled weight quantizer, as find_shared_input_groups forms them."""
    compiled = [re.compile(p) for p in patterns]
    buckets: Dict[tuple, List[str]] = {}
    for name, module in model.named_modules():
        wq = getattr(module, "weight_quantizer", None)
        if wq is None or getattr(wq, "_disabled", True):
            continue
        for i, rx in enumerate(compiled):
            m = rx.fullmatch(name)
            if m is not None:
                buckets.setdefault((i, m.groups()), []).append(name)
                break
    out = {}
    for (i, groups), names in buckets.items():
        if len(names) >= 2:
            parent = groups[0] if groups and groups[0] else ""
            for n in names:
                out[n] = (i, parent)
    return out


def _recipe(kind: str) -> Recipe:
    if kind in ("fp8_tensor", "fp8_channel"):
        return Recipe.fp8_current(output="modelopt")
    if kind == "nvfp4_static":
        return Recipe.nvfp4("modelopt_static", output="modelopt")
    if kind.startswith("nvfp4"):
        return Recipe.nvfp4("modelopt", output="modelopt")
    return Recipe.mxfp8("modelopt")


def _check_expert_indices(qname: str, mod_name: str, model, layout: Layout):
    """With EP > 1, a linear indexed inside an experts container other than
    by experts.<i> / local_experts.<i> (e.g. ModelOpt's unrolled DBRX
    ``experts.mlp.w1_linear.<i>`` or Qwen3-VL ``experts.gate_proj.<i>``)
    has an index amaxd.modelopt cannot map to a global expert: refuse."""
    if layout.ep_size <= 1:
        return
    comps = mod_name.split(".")
    for k, c in enumerate(comps):
        if not c.isdigit() or k == 0:
            continue
        if comps[k - 1] in ("experts", "local_experts"):
            continue
        if any("expert" in a.lower() for a in comps[:k - 1]):
            container = ".".join(comps[:k])
            typ = type(model.get_submodule(".".join(comps[:k - 1]))).__name__
            raise Unsupported(
                f"{qname}: the linear {mod_name!r} is indexed {comps[k - 1]}.{c} inside the experts "
                f"container {'.'.join(comps[:k - 1])!r} ({typ}); amaxd.modelopt knows experts as "
                "experts.<i> / local_experts.<i> ModuleLists or ModelOpt's fused experts "
                f"(_QuantFusedExperts) and cannot tell which global expert {container!r} is "
                f"with ep_size={layout.ep_size}; it refuses rather than guess")


def _resolve(model, qname: str, q, layout: Layout):
    """What a quantizer is: ("linear", owner, owner name, attr),
    ("fused_input", owner, owner name, attr) or ("attention", owner, owner
    name, attr); raises Unsupported for anything else."""
    import torch.nn as nn
    if "." not in qname:
        raise Unsupported(f"{qname}: a quantizer at the top of the model has no module "
                          "amaxd.modelopt could place it by")
    mod_name, attr = qname.rsplit(".", 1)
    owner = model.get_submodule(mod_name)
    typ = type(owner).__name__
    containers = _quantizer_containers()
    if containers and isinstance(owner, containers):
        raise Unsupported(
            f"{qname}: part of a {typ} ({mod_name}); amaxd.modelopt reconciles single "
            "TensorQuantizers, not ModelOpt's quantizer chains or groups (W4A8, "
            "TEGroupedLinear)")
    fused = _fused_attrs(owner)
    if fused is not None:
        first, _ = fused
        if attr in (f"{first}_input_quantizer", "down_proj_input_quantizer"):
            return "fused_input", owner, mod_name, attr
        raise Unsupported(f"{qname}: {typ} {mod_name!r} (fused experts) has no quantizer "
                          f"{attr!r} that amaxd.modelopt knows (it knows {first}_input_quantizer, "
                          f"down_proj_input_quantizer and the per-expert {first}_weight_quantizers"
                          " / down_proj_weight_quantizers)")
    if isinstance(owner, nn.ModuleList):
        parent_name = mod_name.rsplit(".", 1)[0] if "." in mod_name else ""
        parent = model.get_submodule(parent_name) if parent_name else model
        raise Unsupported(
            f"{qname}: quantizer {attr} of the ModuleList {mod_name!r} in {type(parent).__name__}; "
            "amaxd.modelopt does not know this layout of per-item quantizers (it knows "
            "ModelOpt's fused experts, _QuantFusedExperts)")
    if attr in _LINEAR_ATTRS:
        w = getattr(owner, "weight", None)
        if isinstance(owner, nn.Embedding):
            raise Unsupported(f"{qname}: {typ} {mod_name!r} is an embedding; amaxd.modelopt "
                              "knows linear layers (a vocabulary-parallel table would be "
                              "placed wrongly)")
        if w is None or not hasattr(w, "dim") or w.dim() != 2:
            shape = None if w is None or not hasattr(w, "shape") else tuple(w.shape)
            raise Unsupported(
                f"{qname}: {typ} {mod_name!r} has no 2-D weight (weight shape {shape}); "
                "amaxd.modelopt knows linear layers ([out, in] weights) and ModelOpt's fused "
                "experts")
        _check_expert_indices(qname, mod_name, model, layout)
        return "linear", owner, mod_name, attr
    if _ATTENTION_ATTR.fullmatch(attr):
        return "attention", owner, mod_name, attr
    raise Unsupported(f"{qname}: {typ} {mod_name!r} has a quantizer {attr!r} that "
                      "amaxd.modelopt does not know (it knows weight_quantizer, input_quantizer, "
                      "output_quantizer of linear layers, *_bmm_quantizer / softmax_quantizer "
                      "of attention, and ModelOpt's fused experts); it refuses rather than "
                      "guess its placement")


def _plan_fused(model, fname: str, fmod, layout: Layout, weight_blocks: bool,
                handled: set) -> List[Entry]:
    """The entries of the per-expert weight quantizers of one fused-experts
    module: one amaxd quantizer per projection, experts on the first axis."""
    import torch.nn as nn
    TensorQuantizer = _tensor_quantizer_cls()
    first, gated = _fused_attrs(fmod)
    typ = type(fmod).__name__
    n = int(getattr(fmod, "num_experts", -1))
    etp_rank, etp = layout.etp
    e_glob = n * layout.ep_size
    out = []
    for proj in (first, "down_proj"):
        lname = f"{fname}.{proj}_weight_quantizers".lstrip(".")
        qs = getattr(fmod, f"{proj}_weight_quantizers")
        w = getattr(fmod, proj, None)
        for q in qs.modules():
            handled.add(id(q))
        if not isinstance(w, (nn.Parameter, _torch().Tensor)) or w.dim() != 3:
            raise Unsupported(f"{lname}: {typ} {fname!r} has no 3-D {proj} "
                              f"(got {None if w is None else tuple(w.shape)})")
        if not (len(qs) == n == w.shape[0]):
            raise Unsupported(f"{lname}: {typ} {fname!r} has num_experts={n}, {len(qs)} "
                              f"quantizers and {proj} of shape {tuple(w.shape)}; they must agree")
        if not all(isinstance(q, TensorQuantizer) for q in qs):
            kinds = sorted({type(q).__name__ for q in qs})
            raise Unsupported(f"{lname}: per-expert quantizers of {typ} {fname!r} are {kinds}; "
                              "amaxd.modelopt knows single TensorQuantizers")
        enabled = [bool(q.is_enabled) for q in qs]
        if not any(enabled):
            continue
        if not all(enabled):
            off = [i for i, on in enumerate(enabled) if not on]
            raise Unsupported(f"{lname}: experts {off} of {typ} {fname!r} have their weight "
                              "quantizer disabled and the others not; amaxd.modelopt registers "
                              "a projection's experts as one tensor and needs them alike")
        kinds = {_classify(q, True, f"{lname}.{i}") for i, q in enumerate(qs)}
        if len(kinds) != 1:
            raise Unsupported(f"{lname}: the experts of {typ} {fname!r} are quantized "
                              f"differently ({sorted(map(str, kinds))})")
        kind = kinds.pop()
        if kind is None or (kind == "mxfp8_blocks" and not weight_blocks):
            continue
        rows, cols = int(w.shape[1]), int(w.shape[2])
        par = "packed_column" if (proj == first and gated) else "column" if proj == first \
            else "row"
        if par == "packed_column" and rows % 2:
            raise Unsupported(f"{lname}: gated {proj} of {typ} {fname!r} has an odd number of "
                              f"rows ({rows}); its gate and up halves cannot be told apart")
        lead_g, lead_o, lead_l = (e_glob,), (layout.ep_rank * n,), (n,)
        if par == "packed_column":
            half = rows // 2
            rows_g, rows_o, rows_l = (2, half * etp), (0, etp_rank * half), (2, half)
        elif par == "column":
            rows_g, rows_o, rows_l = (rows * etp,), (etp_rank * rows,), (rows,)
        else:  # row-parallel: every expert-TP rank sees all rows, part of the columns
            rows_g, rows_o, rows_l = (rows,), (0,), (rows,)
        grid = None
        global_axes = 0
        if kind == "fp8_tensor":
            gshape, pl = lead_g, P.Placement(lead_o, lead_l)
        elif kind == "fp8_channel":
            gshape = lead_g + rows_g
            pl = P.Placement(lead_o + rows_o, lead_l + rows_l)
            grid = (gshape, pl)
        else:
            bsz = 32 if kind == "mxfp8_blocks" else 16
            if cols % bsz:
                raise ValueError(f"{lname}: {cols} input features are not a multiple of {bsz}")
            nb = cols // bsz
            if par == "row":
                cols_g, cols_o = nb * etp, etp_rank * nb
            else:
                cols_g, cols_o = nb, 0
            gshape = lead_g + rows_g + (cols_g,)
            pl = P.Placement(lead_o + rows_o + (cols_o,), lead_l + rows_l + (nb,))
            grid = (gshape, pl)
            if kind.startswith("nvfp4"):
                global_axes = 1  # one global amax (S_enc) per expert
            if not weight_blocks:
                gshape, pl, global_axes = lead_g, P.Placement(lead_o, lead_l), 0
        spec = Quantizer(global_name(model, lname, layout), gshape, _recipe(kind), pl,
                         global_axes=global_axes)
        out.append(Entry(lname, spec.name, qs, fmod, "fused_" + kind, spec, w, par, None, False,
                         grid, weight_blocks))
    return out


def plan(model: "torch.nn.Module", layout: Layout = Layout(), *, column: Sequence[str] = DEFAULT_COLUMN,
         row: Sequence[str] = DEFAULT_ROW, moe_share: bool = True, weight_blocks: bool = True,
         shared_patterns: Optional[Sequence[str]] = None,
         cold_experts: str = "leave") -> List[Entry]:
    """The quantizers of `model` (this rank's shard) that amaxd reconciles,
    with their specs and placements. `column` / `row`: name patterns
    (fnmatch, on the full module name or its last component) of column- and
    row-parallel linears. `moe_share`: register the experts' input
    quantizers of an MoE block that ModelOpt unifies as a ``share`` peer
    group (needs a client with peer_mode); False leaves them out.
    `weight_blocks=False` registers NVFP4 weights as their per-tensor amax
    only (what ModelOpt's export needs reconciled: the blocks of a shard are
    its own) and leaves MXFP8 weights out: a catalog of one cell per weight
    instead of one per 16 weights. `cold_experts`: what an input quantizer
    of a routed expert that no rank fed gets when ModelOpt does not unify
    the block's experts: "leave" (the default) leaves it without ``_amax``,
    as a single-process ModelOpt calibration does; "fill" gives it the max
    over the layer's experts that got tokens (a peer group per projection,
    ``peer_mode="fill"``). Raises :class:`Unsupported` for a quantizer whose
    module it does not know."""
    if cold_experts not in ("leave", "fill"):
        raise ValueError(f"cold_experts={cold_experts!r}: use 'leave' or 'fill'")
    TensorQuantizer = _tensor_quantizer_cls()
    if shared_patterns is None:
        from modelopt.torch.quantization.utils import SHARED_PATTERNS
        shared_patterns = SHARED_PATTERNS
    shared = _shared_groups(model, shared_patterns)
    share_ok = supports_share()
    entries = []
    handled = set()  # quantizers of fused experts' per-expert lists
    for fname, fmod in model.named_modules():
        if _fused_attrs(fmod) is not None:
            entries.extend(_plan_fused(model, fname, fmod, layout, weight_blocks, handled))
    for qname, q in model.named_modules():
        if not isinstance(q, TensorQuantizer) or id(q) in handled or not q.is_enabled:
            continue
        if _is_histogram(q):
            continue  # sync_histograms(): two passes over the data
        role, module, mod_name, attr = _resolve(model, qname, q, layout)
        is_weight = role == "linear" and attr == "weight_quantizer"
        kind = _classify(q, is_weight, qname)
        if kind is None:
            continue
        if not is_weight and kind not in _PER_TENSOR:
            raise Unsupported(f"{qname}: an activation quantizer with a {kind} amax; "
                              "amaxd.modelopt knows per-tensor activation amax")
        par = _parallel_kind(module, mod_name, column, row) if role == "linear" else "replicated"
        weight = module.weight if is_weight else None
        gname, expert, owner = _global_name(model, qname, layout)
        tp_rank, tp = layout.etp if expert is not None else (layout.tp_rank, layout.tp_size)
        if attr == "output_quantizer" and par == "row" and tp > 1:
            raise Unsupported(f"{qname}: the output of row-parallel {mod_name!r} is a partial "
                              "sum on each TP rank; its amax cannot be reconciled by a max")
        peer_share = False
        peer_group = ""
        peer_mode = None
        scale_group = ""
        if expert is not None and not is_weight:
            owner_mod = model.get_submodule(owner) if owner else model
            rel = gname[len(owner) + 1:] if owner else gname
            rel = _EXPERTS.sub(r"\1\2.*", rel, count=1)
            if (hasattr(owner_mod, "layer_sync_moe_local_experts_amax")
                    and getattr(owner_mod, "_moe_calib_experts_ratio", None) is None):
                if not moe_share:
                    continue
                if not share_ok:
                    raise ValueError(
                        f"{qname}: ModelOpt gives every expert of {owner or 'the model'} the "
                        "max over experts; that needs a peer group in share mode, which this "
                        "amaxd client lacks (pass moe_share=False to leave these quantizers out)")
                peer_group = (owner + "." if owner else "") + rel
                peer_share = True
                peer_mode = "share"
            elif cold_experts == "fill":
                peer_group = (owner + "." if owner else "") + rel
        if kind == "mxfp8_blocks" and not weight_blocks:
            continue
        if kind == "nvfp4_static" and mod_name in shared:
            i, parent = shared[mod_name]
            gparent = _global_name(model, parent, layout)[0] if parent else ""
            scale_group = f"{gparent}.shared_weight_global_amax.{i}".lstrip(".")

        grid = None
        if kind in _PER_TENSOR:
            gshape, pl = (), None
        elif kind == "fp8_channel":
            rows = weight.shape[0]
            if par == "column":
                gshape = (rows * tp,)
                pl = P.column_parallel(gshape, tp_rank, tp)
            else:
                gshape, pl = (rows,), P.replicated((rows,))
            grid = (gshape, pl)
        else:
            bsz = 16 if kind.startswith("nvfp4") else 32
            rows, cols = weight.shape
            if cols % bsz:
                raise ValueError(f"{qname}: {cols} input features are not a multiple of {bsz}")
            local = (rows, cols // bsz)
            if par == "column":
                gshape = (rows * tp, cols // bsz)
                pl = P.column_parallel(gshape, tp_rank, tp)
            elif par == "row":
                gshape = (rows, cols // bsz * tp)
                pl = P.row_parallel(gshape, tp_rank, tp)
            else:
                gshape, pl = local, P.replicated(local)
            grid = (gshape, pl)
            if not weight_blocks:
                gshape, pl = (), None
        kw = {}
        if peer_mode is not None:
            kw["peer_mode"] = peer_mode
        spec = Quantizer(gname, gshape, _recipe(kind), pl, peer_group=peer_group,
                         scale_group=scale_group, **kw)
        entries.append(Entry(qname, gname, q, module, kind, spec, weight, par, expert, peer_share,
                             grid, weight_blocks))
    return entries


def _block_amax(w, bsz: int):
    """|w| max over blocks of `bsz` along the last axis (float32)."""
    a = w.detach().float().abs()
    return a.reshape(*a.shape[:-1], a.shape[-1] // bsz, bsz).amax(dim=-1)


def _check_max_calibrated(name: str, amax, blocks, static: bool):
    """Max calibration gives the weight's block amax (static) or its max
    (dynamic); an algorithm that refines them (MSE, AWQ, ...) would be
    overwritten by the write-back: refuse rather than do that."""
    torch = _torch()
    cal = amax.detach().float()
    if bool(torch.isnan(cal).any()):
        raise ValueError(f"{name}: _amax has NaN in {int(torch.isnan(cal).sum())} of its "
                         f"{cal.numel()} values (a broken calibration?); amaxd.modelopt "
                         "recomputes a weight's blocks from the weight and checks them "
                         "against a max-calibrated _amax")
    ok = (torch.equal(cal.reshape(blocks.shape), blocks) if static
          else cal.numel() == 1 and torch.equal(cal.reshape(()), blocks.amax()))
    if not ok:
        raise ValueError(f"{name}: _amax is not the weight's max calibration "
                         "(another calibration algorithm?); amaxd.modelopt reconciles "
                         "max-calibrated weights")


def _usable(amax, name: str = "") -> bool:
    """Whether a quantizer's _amax is data: not absent, meta or all NaN
    (load_calib_amax(strict=False) leaves NaN where nothing was seen). A
    NaN in some of its values only is not that convention but a broken
    amax: ValueError naming the quantizer (treating the whole quantizer
    as no data would silently drop its valid channels)."""
    torch = _torch()
    if amax is None or amax.is_meta:
        return False
    nan = torch.isnan(amax.detach())
    if not bool(nan.any()):
        return True
    if bool(nan.all()):
        return False
    bad = int(nan.sum())
    first = int(torch.nonzero(nan.reshape(-1))[0])
    raise ValueError(f"{name or 'a quantizer'}: _amax has NaN in {bad} of its {nan.numel()} "
                     f"values (the first at flat index {first}) and valid values in the "
                     "others; amaxd.modelopt takes an all-NaN _amax as no data, a partly "
                     "NaN one is refused (a broken calibration?)")


def _fused_local_amax(e: Entry):
    torch = _torch()
    kind = e.base_kind
    qs = list(e.quantizer)
    n = len(qs)
    if kind in ("fp8_tensor", "fp8_channel"):
        local = e.spec.placement.local_shape
        vals = torch.zeros(local)
        nodata = torch.zeros(local, dtype=torch.bool)
        for i, q in enumerate(qs):
            a = getattr(q, "_amax", None)
            if _usable(a, f"{e.local_name}.{i}"):
                vals[i] = a.detach().float().reshape(local[1:])
            else:
                nodata[i] = True
        return Masked(vals, nodata) if bool(nodata.any()) else vals.numpy()
    bsz = 32 if kind == "mxfp8_blocks" else 16
    with torch.no_grad():
        blocks = _block_amax(e.weight, bsz)  # [n, R, C/bsz]
    if kind != "mxfp8_blocks":
        for i, q in enumerate(qs):
            a = getattr(q, "_amax", None)
            if a is not None:
                _check_max_calibrated(f"{e.local_name}.{i}", a, blocks[i],
                                      kind == "nvfp4_static")
    if not e.blocks:
        return blocks.reshape(n, -1).amax(dim=1).cpu().numpy()
    return blocks.reshape(e.grid[1].local_shape).cpu().numpy()


def _local_amax(e: Entry):
    """This rank's amax block of an entry (numpy float32), or a Masked one
    when the quantizer saw no data."""
    torch = _torch()
    if e.fused:
        return _fused_local_amax(e)
    if e.kind in ("nvfp4_blocks", "nvfp4_static", "mxfp8_blocks"):
        bsz = 32 if e.kind == "mxfp8_blocks" else 16
        with torch.no_grad():
            a = _block_amax(e.weight, bsz)
        amax = getattr(e.quantizer, "_amax", None)
        if amax is not None and e.kind != "mxfp8_blocks":
            _check_max_calibrated(e.local_name, amax, a, e.kind == "nvfp4_static")
        if not e.blocks:
            return a.amax().cpu().numpy()
        return a.cpu().numpy()
    amax = getattr(e.quantizer, "_amax", None)
    if e.kind == "fp8_channel":
        if not _usable(amax, e.local_name):
            rows = e.grid[1].local_shape[0]
            return Masked(torch.zeros(rows), torch.ones(rows, dtype=torch.bool))
        return amax.detach().float().reshape(-1).cpu().numpy()
    # Per-tensor: no amax (or NaN from load_calib_amax(strict=False)) = no data.
    if not _usable(amax, e.local_name):
        return Masked(torch.zeros(()), torch.tensor(True))
    return amax.detach().float().reshape(()).cpu().numpy()


def register(client: "Client", entries: Sequence[Entry]) -> Optional[pb.RegisterResponse]:
    """Registers the entries (nothing when there are none: a rank without
    quantizers to reconcile still takes part in reconcile())."""
    if entries:
        return client.register([e.spec for e in entries])
    return None


def send(client: "Client", entries: Sequence[Entry],
         local: Optional[Dict[str, Any]] = None) -> Optional[pb.SendAmaxResponse]:
    """Sends this rank's local amax of every entry (`local`: computed
    already, {name: amax}), in one request."""
    if entries:
        return client.send(local if local is not None else
                           {e.name: _local_amax(e) for e in entries})
    return None


def reconcile(client: "Client", entries: Sequence[Entry]) -> Dict[str, Result]:
    return client.reconcile([e.name for e in entries])


def _set_amax(q, values):
    """Writes `values` into q._amax in place (its shape and dtype), or
    registers it as ModelOpt would."""
    torch = _torch()
    old = getattr(q, "_amax", None)
    if old is not None and not old.is_meta:
        with torch.no_grad():
            old.data.copy_(values.reshape(old.shape).to(old.dtype).to(old.device))
    else:
        q.amax = values


def _set_global_amax(q, value):
    torch = _torch()
    g = torch.tensor(np.float32(value), dtype=torch.float32)
    old = getattr(q, "_global_amax", None)
    if old is not None:
        with torch.no_grad():
            old.data.copy_(g.to(old.device))  # tied across a shared group: in place
    else:
        q.global_amax = g


def _no_data(r: Result) -> np.ndarray:
    """The cells of a result that no rank fed (and no peer group filled),
    as a bool array shaped like r.amax. The daemon reports how many there
    are (``missing``) and gives them amax 0; when the zero cells are exactly
    that many they are those cells, otherwise which ones they are is not
    known and this raises rather than guess."""
    amax = np.asarray(r.amax)
    if not r.missing:
        return np.zeros(amax.shape, dtype=bool)
    zero = amax == 0
    if int(zero.sum()) != int(r.missing):
        raise RuntimeError(f"{r.name}: {r.missing} cells got no data from any rank but "
                           f"{int(zero.sum())} cells read 0; amaxd.modelopt cannot tell which "
                           "ones had no data and will not write 0 into them")
    return zero


def _whole_or_nothing(name: str, nodata: np.ndarray) -> bool:
    """True when a quantizer's cells all had data, False when none had
    (leave it as it is); raises for a partly fed per-channel/block amax,
    which ModelOpt cannot hold."""
    if not nodata.any():
        return True
    if nodata.all():
        return False
    raise RuntimeError(f"{name}: {int(nodata.sum())} of {nodata.size} cells got no data from "
                       "any rank; ModelOpt's _amax cannot be partly absent and amaxd.modelopt "
                       "will not write 0 into it")


def _write_back_fused(e: Entry, r: Result):
    torch = _torch()
    kind = e.base_kind
    if kind == "mxfp8_blocks":
        return
    nodata = _no_data(r)
    for i, q in enumerate(e.quantizer):
        qn = f"{e.local_name}.{i}"
        if not _whole_or_nothing(qn, nodata[i]):
            continue
        if kind == "fp8_tensor":
            _set_amax(q, torch.tensor(np.float32(r.amax[i]), dtype=torch.float32))
        elif kind == "fp8_channel":
            _set_amax(q, torch.from_numpy(np.array(r.amax[i], np.float32)).reshape(-1, 1))
        elif not e.blocks:  # NVFP4 as the per-expert amax [E]
            g = np.float32(r.amax[i])
            if kind == "nvfp4_blocks":
                _set_amax(q, torch.tensor(g, dtype=torch.float32))
            else:
                _set_global_amax(q, g)
        else:
            g = np.float32(r.global_amaxes[i])
            if kind == "nvfp4_blocks":
                _set_amax(q, torch.tensor(g, dtype=torch.float32))
            else:  # static: the expert's blocks, as reconciled, and its own global
                _set_amax(q, torch.from_numpy(np.array(r.amax[i], np.float32)).reshape(-1, 1))
                _set_global_amax(q, g)


def write_back(entries: Sequence[Entry], results: Dict[str, Result]) -> None:
    """Writes the reconciled amax into the quantizers: ``_amax`` of
    per-tensor and per-channel quantizers and of dynamic NVFP4 weights (the
    global amax), ``_amax`` (blocks) and ``_global_amax`` of static NVFP4
    weights; fused experts' per-expert quantizers each get their expert's.
    MXFP8 weights keep no amax in ModelOpt. A quantizer that no rank fed
    (and no peer group filled) is left as it is, without ``_amax``, as a
    single-process calibration leaves it: never 0."""
    torch = _torch()
    for e in entries:
        r = results[e.name]
        if e.fused:
            _write_back_fused(e, r)
            continue
        if e.kind == "mxfp8_blocks":
            continue
        if not _whole_or_nothing(e.local_name, _no_data(r)):
            continue
        if e.kind in _PER_TENSOR:
            _set_amax(e.quantizer, torch.tensor(np.float32(r.amax.reshape(())), dtype=torch.float32))
        elif e.kind == "fp8_channel":
            _set_amax(e.quantizer, torch.from_numpy(r.amax.copy()).reshape(-1, 1))
        elif e.kind == "nvfp4_blocks":
            _set_amax(e.quantizer, torch.tensor(np.float32(r.global_amax), dtype=torch.float32))
        elif e.kind == "nvfp4_static":
            if e.blocks:  # the shard's own blocks, as reconciled
                _set_amax(e.quantizer, torch.from_numpy(r.amax.copy()).reshape(-1, 1))
            _set_global_amax(e.quantizer, r.global_amax)


class SyncResults(dict):
    """{global name: Result} of sync(), with `path`: how this rank's amax
    went to the daemon and its results came back ("device", "packed" or
    "named"; docs/MODELOPT.md "Paths")."""

    path: str = "named"


PATHS = ("auto", "device", "packed", "named")


def _model_device(model) -> Optional[int]:
    """The CUDA device of the model's first CUDA parameter or buffer, or None."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_cuda:
            return t.device.index if t.device.index is not None else _torch().cuda.current_device()
    return None


def _open_device(client: "Client", dev: int, strict: bool = False) -> bool:
    """Device buffers of this rank's current layout on GPU `dev`, opened
    when needed; False when GPU-direct cannot run here or the daemon does
    not offer it (no torch CUDA / IPC binding, a host-backend daemon, a GPU
    the daemon does not see, a GPU it cannot reach)."""
    from . import device as dv
    from .errors import AmaxdError
    b = client.device_buffers
    if b is not None and b.dev == dev and b.layout_id == client.layout().id:
        return "missing" in b.answer
    try:
        b = client.open_device(dev)
    except (dv.DeviceUnavailable, AmaxdError):
        # Any refusal (a host backend, a GPU the daemon does not see, a
        # daemon without OpenDevice, a device error): "auto" goes packed,
        # "device" (strict) raises it.
        if strict:
            raise
        return False
    # A daemon whose answer has no missing counts cannot say which
    # quantizers had no data: write_back needs them.
    return "missing" in b.answer


def _reconcile_packed(client: "Client", entries: Sequence[Entry], device: Optional[int],
                      local: Dict[str, Any]):
    """Sends this rank's amax as one slab and reconciles: through the
    device buffers when `device` is given, else ReconcilePacked. A
    PackedResult (host arrays) either way."""
    L = client.layout()
    vals, has = L.pack(local)
    if device is None:
        client.send_packed(vals, has)
        return client.reconcile_packed()
    torch = _torch()
    bufs = client.device_buffers
    with torch.cuda.device(device):
        bufs.slab.copy_(torch.from_numpy(vals).to(bufs.slab.device))
        if has is not None:
            bufs.has_data.copy_(torch.from_numpy(has).to(bufs.slab.device))
        res = client.reconcile_device(has_data=has is not None)
        return PackedResult.from_device(res)


def sync(client: "Client", model: "torch.nn.Module", layout: Layout = Layout(),
         path: str = "auto", **plan_kw: Any) -> Dict[str, Result]:
    """Registers, sends, reconciles and writes back in one call (after
    this rank's calibration); returns {global name: Result} (a SyncResults:
    `.path` says which path ran).

    `path`: "device" sends the rank's amax slab through the daemon's device
    buffers (GPU-direct, docs/API.md "Device buffers") on the model's GPU;
    "packed" as one slab over gRPC (SendPacked, ReconcilePacked); "named"
    per quantizer name (SendAmax, Reconcile). "auto" (the default) takes
    the device path when the model is on a CUDA GPU and the daemon offers
    it (CUDA backend, a GPU it sees), else the packed one. All three give
    the same bytes; ranks of one job may take different paths."""
    if path not in PATHS:
        raise ValueError(f"path {path!r}: one of {', '.join(PATHS)}")
    entries = plan(model, layout, **plan_kw)
    dev = _model_device(model) if entries and path in ("auto", "device") else None
    if dev is None and path == "device" and entries:
        raise ValueError("path='device': the model has no parameter on a CUDA GPU")
    # This rank's amax first: one it refuses (a partly NaN _amax, a weight
    # not max-calibrated) raises before anything is registered or sent.
    local = {e.name: _local_amax(e) for e in entries}
    reg = register(client, entries)
    if reg is not None and reg.created and path != "named":
        # A layout fetched before (an earlier sync, a Caster) lacks the new
        # quantizers: the packed and device paths need this one.
        client.layout(refresh=True)
    used = "named" if path == "named" else "packed"
    if dev is not None:
        if not _open_device(client, dev, strict=path == "device"):
            if path == "device":
                from .device import DeviceUnavailable
                raise DeviceUnavailable("path='device': the daemon's device answer has no "
                                        "missing counts (a daemon before them); use 'packed'")
            dev = None
        if dev is not None:
            used = "device"
    if used == "named" or not entries:
        send(client, entries, local)
        results = reconcile(client, entries)
        used = "named"
    else:
        res = _reconcile_packed(client, entries, dev, local)
        results = {e.name: res[e.name] for e in entries}
    write_back(entries, results)
    out = SyncResults(results)
    out.path = used
    import logging
    logging.getLogger("amaxd").info("amaxd.modelopt.sync: %d quantizers through the %s path",
                                    len(entries), used)
    return out


# -- calibrators beyond max (docs/MODELOPT.md "Histogram and MSE calibration") --

def _is_histogram(q) -> bool:
    from modelopt.torch.quantization.calib import HistogramCalibrator
    return isinstance(getattr(q, "_calibrator", None), HistogramCalibrator)


def _counts_here(role: str, attr: str, par: str, tp_rank: int, layout: Layout,
                 expert: Optional[int] = None) -> bool:
    """Whether this rank's data of a quantizer is its own (summed with the
    other ranks') rather than a copy another rank counts too: TP ranks
    see the same input of a column-parallel (or TP-replicated) linear, and
    DP ranks hold the same weights (a routed expert's weights: its
    expert-data-parallel replicas, EP being carved out of DP as Megatron
    does, edp_rank = dp_rank // ep_size); one of the copies counts."""
    if attr == "weight_quantizer":
        if expert is not None and layout.dp_size % layout.ep_size == 0:
            return layout.dp_rank // layout.ep_size == 0
        return layout.dp_rank == 0
    if role == "linear" and attr == "input_quantizer" and par != "row":
        return tp_rank == 0
    return True


@dataclass
class HistEntry:
    """One histogram-calibrated quantizer of the model, as registered."""

    local_name: str
    name: str
    quantizer: object
    spec: Quantizer
    counts: bool  # this rank's values are its own (see _counts_here)


def plan_histograms(model: "torch.nn.Module", layout: Layout = Layout(), method: str = "percentile",
                    *, percentile: float = 99.99, start_bin: int = 128, stride: int = 1,
                    column: Sequence[str] = DEFAULT_COLUMN, row: Sequence[str] = DEFAULT_ROW,
                    torch_cpu_build: Optional[str] = None) -> List[HistEntry]:
    """The enabled quantizers of `model` whose calibrator is ModelOpt's
    HistogramCalibrator (config ``"calibrator": "histogram"``), each an
    amaxd histogram quantizer with the calibrator's num_bins, skip_zeros,
    num_bits and unsigned and the method and options ModelOpt's
    ``load_calib_amax(method, ...)`` would be given. Per-tensor only (as
    HistogramCalibrator); an FP8 quantizer ((4, 3)) registers FP8 current
    scaling with ModelOpt's output convention, an integer one (INT8) the
    same recipe as a carrier: only ``_amax`` is written back, from which
    ModelOpt derives its own scales. Entropy needs an integer num_bits (as
    ModelOpt's _compute_amax_entropy)."""
    TensorQuantizer = _tensor_quantizer_cls()
    out = []
    for qname, q in model.named_modules():
        if not isinstance(q, TensorQuantizer) or not q.is_enabled or not _is_histogram(q):
            continue
        if getattr(q, "_dynamic", False):
            continue
        if q.axis is not None or q.block_sizes:
            raise Unsupported(f"{qname}: a histogram calibrator with axis {q.axis} / block sizes "
                              f"{q.block_sizes}; ModelOpt's HistogramCalibrator and amaxd's "
                              "histograms are per tensor")
        role, module, mod_name, attr = _resolve(model, qname, q, layout)
        if role == "fused_input":
            raise Unsupported(f"{qname}: histograms of fused experts' inputs are not supported")
        par = _parallel_kind(module, mod_name, column, row) if role == "linear" else "replicated"
        gname, expert, _ = _global_name(model, qname, layout)
        tp_rank, tp = layout.etp if expert is not None else (layout.tp_rank, layout.tp_size)
        if attr == "output_quantizer" and par == "row" and tp > 1:
            raise Unsupported(f"{qname}: the output of row-parallel {mod_name!r} is a partial "
                              "sum on each TP rank; its histogram is not the output's")
        cal = q._calibrator
        nb, uns = cal._num_bits, bool(cal._unsigned)
        kw: Dict[str, Any] = {}
        if method == "entropy":
            if not isinstance(nb, int):
                raise ValueError(f"{qname}: entropy calibration needs an integer num_bits "
                                 f"(ModelOpt's _compute_amax_entropy), not {nb}")
            kw = dict(num_bits=nb, unsigned=uns, start_bin=start_bin, stride=stride)
        elif method == "mse":
            if isinstance(nb, int):
                kw = dict(grid="int", num_bits=nb, unsigned=uns, start_bin=start_bin,
                          stride=stride)
            elif tuple(nb) == (4, 3):
                kw = dict(grid="e4m3", start_bin=start_bin, stride=stride)
            else:
                raise ValueError(f"{qname}: histogram MSE on num_bits {nb} (integers or (4, 3))")
        elif method == "percentile":
            kw = dict(percentile=percentile)
        else:
            raise ValueError(f"method {method!r}: use entropy, percentile or mse")
        calib = Calibrator.histogram(method, int(cal._num_bins), skip_zeros=bool(cal._skip_zeros),
                                     torch_cpu_build=torch_cpu_build, **kw)
        spec = Quantizer(gname, (), Recipe.fp8_current(output="modelopt"), calibrator=calib)
        out.append(HistEntry(qname, gname, q, spec,
                             _counts_here(role, attr, par, tp_rank, layout, expert)))
    return out


class _MaxRecorder:
    """Stands in for a HistogramCalibrator during the first pass: the max of
    |x| over what the quantizer sees."""

    def __init__(self):
        self.amax = None

    def collect(self, x):
        m = float(x.detach().abs().max().float().item()) if x.numel() else None
        if m is not None and (self.amax is None or m > self.amax):
            self.amax = np.float32(m)

    def reset(self):
        self.amax = None


class _HistRecorder:
    """The second pass: the histogram of |x| against the agreed edges
    (amaxd.calib.histogram, torch.histc's bins), summed over batches."""

    def __init__(self, basis, calib):
        self.basis, self.calib = basis, calib
        self.counts = np.zeros(calib.num_bins + 1)

    def collect(self, x):
        from . import calib as C
        self.counts += C.histogram(x, self.basis, self.calib)

    def reset(self):
        self.counts[:] = 0


def _calibrating(entries, recorders):
    """Puts each entry's quantizer in calibration mode with recorder r; the
    caller restores (the returned list of (quantizer, calibrator, flags))."""
    saved = []
    for e, r in zip(entries, recorders):
        q = e.quantizer
        saved.append((q, q._calibrator, q._if_quant, q._if_calib))
        q._calibrator = r
        q.disable_quant()
        q.enable_calib()
    return saved


def _restore(saved):
    for q, cal, if_quant, if_calib in saved:
        q._calibrator = cal
        q._if_quant, q._if_calib = if_quant, if_calib


def sync_histograms(client: "Client", model: "torch.nn.Module", layout: Layout = Layout(),
                    forward_loop: Any = None, method: str = "percentile",
                    **plan_kw: Any) -> Dict[str, Result]:
    """Histogram calibration of the model's HistogramCalibrator quantizers
    across every rank (docs/MODELOPT.md): two passes of `forward_loop`
    (`forward_loop(model)` runs this rank's calibration data), the first for
    the max (reconciled: the bin edges [0, global max] every rank agrees
    on), the second counting |x| against those edges; the daemons sum the
    counts and compute the amax by `method` (ModelOpt's
    ``load_calib_amax(method, ...)``; options: plan_histograms). Writes
    ``_amax`` back (a quantizer no rank fed keeps none) and leaves each
    quantizer quantizing, as ModelOpt's calibration ends. Returns {global
    name: Result}. Every rank calls it, with or without such quantizers."""
    torch = _torch()
    entries = plan_histograms(model, layout, method, **plan_kw)
    if entries:
        client.register([e.spec for e in entries])
    maxes = [_MaxRecorder() for _ in entries]
    saved = _calibrating(entries, maxes)
    try:
        if entries and forward_loop is not None:
            forward_loop(model)
    finally:
        _restore(saved)
    if entries:
        client.send({e.name: (Masked(0.0, True) if m.amax is None else m.amax)
                     for e, m in zip(entries, maxes)})
    r1 = client.reconcile([e.name for e in entries])
    hists = [_HistRecorder(r1[e.name].stat_basis, e.spec.calibrator)
             if r1[e.name].stat_epoch else None for e in entries]
    live = [(e, h) for e, h in zip(entries, hists) if h is not None]
    saved = _calibrating([e for e, _ in live], [h for _, h in live])
    try:
        if live and forward_loop is not None:
            forward_loop(model)
    finally:
        _restore(saved)
    stats = {e.name: Stat(h.counts, r1[e.name].stat_epoch) for e, h in live if e.counts}
    if stats:
        client.send(stats)
    results = client.reconcile([e.name for e in entries])
    for e in entries:
        r = results[e.name]
        if r.stat_state == pb.STAT_WAITING:
            continue  # no rank saw data: no _amax, as ModelOpt leaves it
        _set_amax(e.quantizer, torch.tensor(np.float32(r.amax.reshape(())), dtype=torch.float32))
        e.quantizer.enable_quant()
        e.quantizer.disable_calib()
    return results


@dataclass
class MseEntry:
    """One weight quantizer whose amax an MSE search refines, as registered
    (its amaxd name is the quantizer's global name + ".mse")."""

    local_name: str
    name: str
    quantizer: object
    weight: object
    spec: Quantizer
    axis: Optional[int]
    owner: bool  # this rank's copy of the weight block sends its losses (or block amaxes)
    kind: str = "mse"  # "mse" (multiplier search) or "nvfp4" (per-block FP8 scale sweep)


def plan_mse(model: "torch.nn.Module", layout: Layout = Layout(), *, step_size: float = 0.1,
             start_multiplier: float = 0.25, stop_multiplier: float = 4.0,
             column: Sequence[str] = DEFAULT_COLUMN, row: Sequence[str] = DEFAULT_ROW,
             torch_cpu_build: Optional[str] = None) -> List[MseEntry]:
    """The weight quantizers ModelOpt's ``mse_calibrate`` refines with an
    MseCalibrator (multiplier search, ``fp8_scale_sweep=False``): static
    FP8 weights per tensor (``[]``) or per output channel (``[C_out]``,
    split over TP for a column-parallel linear). Other formats are left
    out: NVFP4's per-block FP8-scale sweep (``fp8_scale_sweep``) is
    plan_nvfp4_mse's."""
    TensorQuantizer = _tensor_quantizer_cls()
    out = []
    for qname, q in model.named_modules():
        if (not isinstance(q, TensorQuantizer) or not q.is_enabled or _is_histogram(q)
                or getattr(q, "_dynamic", False) or not qname.endswith("weight_quantizer")):
            continue
        role, module, mod_name, attr = _resolve(model, qname, q, layout)
        if role != "linear" or attr != "weight_quantizer":
            continue
        kind = _classify(q, True, qname)
        if kind not in ("fp8_tensor", "fp8_channel"):
            continue
        par = _parallel_kind(module, mod_name, column, row)
        gname, expert, _ = _global_name(model, qname, layout)
        tp_rank, tp = layout.etp if expert is not None else (layout.tp_rank, layout.tp_size)
        w = module.weight
        if kind == "fp8_tensor":
            gshape, pl, axis = (), None, None
        else:
            rows = w.shape[0]
            axis = 0
            if par == "column":
                gshape = (rows * tp,)
                pl = P.column_parallel(gshape, tp_rank, tp)
            else:
                gshape, pl = (rows,), None
        cal = Calibrator.mse(start_multiplier, stop_multiplier, step_size,
                             torch_cpu_build=torch_cpu_build)
        spec = Quantizer(gname + ".mse", gshape, Recipe.fp8_current(output="modelopt"), pl,
                         calibrator=cal)
        out.append(MseEntry(qname, gname + ".mse", q, w, spec, axis,
                            _counts_here(role, attr, par, tp_rank, layout, expert)))
    return out


def plan_nvfp4_mse(model: "torch.nn.Module", layout: Layout = Layout(), *,
                   column: Sequence[str] = DEFAULT_COLUMN, row: Sequence[str] = DEFAULT_ROW,
                   shared_patterns: Optional[Sequence[str]] = None) -> List[MseEntry]:
    """The weight quantizers ModelOpt's ``mse_calibrate(fp8_scale_sweep=True)``
    refines with an NVFP4MSECalibrator: static NVFP4 weights (``[R, C/16]``
    blocks placed as ``plan`` places them), each an amaxd quantizer
    ``<global name>.mse`` with ``Calibrator.nvfp4_mse()``; fusible siblings
    (q/k/v, gate/up) share their global amax through a scale group as in
    ``plan``. Fused 3-D experts: one quantizer per expert and projection
    (``_plan_fused_nvfp4_mse``)."""
    out = []
    for e in plan(model, layout, column=column, row=row, shared_patterns=shared_patterns,
                  moe_share=False):
        if e.base_kind != "nvfp4_static":
            continue
        if e.fused:
            out.extend(_plan_fused_nvfp4_mse(model, e, layout))
            continue
        tp_rank = layout.etp[0] if e.expert is not None else layout.tp_rank
        sg = e.spec.scale_group + ".mse" if e.spec.scale_group else ""
        spec = Quantizer(e.name + ".mse", e.spec.global_shape, e.spec.recipe, e.spec.placement,
                         scale_group=sg, calibrator=Calibrator.nvfp4_mse())
        out.append(MseEntry(e.local_name, e.name + ".mse", e.quantizer, e.weight, spec, None,
                            _counts_here("linear", "weight_quantizer", e.parallel, tp_rank,
                                         layout, e.expert), "nvfp4"))
    return out


def _plan_fused_nvfp4_mse(model, e: Entry, layout: Layout) -> List[MseEntry]:
    """The per-block search of a fused-experts projection, as ModelOpt 0.47
    runs it: ``_QuantFusedExperts.iter_weights_for_calibration``
    (plugins/huggingface.py) gives ``mse_calibrate`` each expert's 2-D slice
    ``weight[i]`` with its own TensorQuantizer, whose global amax
    ``promote_static_block_weight_quantizers`` (utils/core_utils.py) made
    the max of that expert's blocks. So each expert is an amaxd quantizer
    of its own, ``<...>_weight_quantizers.<global expert>.mse``: the
    projection's block grid without the expert axis, this rank's part of it
    (its expert-TP rows or columns), one global amax (its basis). EP ranks
    hold disjoint experts; the first expert-data-parallel replica searches."""
    gshape, pl = e.spec.global_shape, e.spec.placement
    if len(pl.local_shape) < 3:  # plan(weight_blocks=False) never reaches here
        raise Unsupported(f"{e.local_name}: fused experts registered without their blocks")
    out = []
    for i, q in enumerate(e.quantizer):
        gname = global_name(model, f"{e.local_name}.{i}", layout)
        spec = Quantizer(gname + ".mse", tuple(gshape[1:]), e.spec.recipe,
                         P.Placement(tuple(pl.offset[1:]), tuple(pl.local_shape[1:])),
                         calibrator=Calibrator.nvfp4_mse())
        out.append(MseEntry(f"{e.local_name}.{i}", gname + ".mse", q, e.weight[i], spec, None,
                            _counts_here("linear", "weight_quantizer", e.parallel,
                                         layout.etp[0], layout, pl.offset[0] + i), "nvfp4"))
    return out


def _nvfp4_quant(q):
    """The fake quantization the per-block search runs: ModelOpt's own
    (``_mse_quant_func``: its Triton kernel) where ModelOpt has it, else
    amaxd.calib's transcription of it (ModelOpt 0.47 has no CPU kernel for
    static NVFP4 blocks)."""
    from modelopt.torch.quantization import tensor_quant as TQ
    if getattr(TQ.triton_kernel, "IS_AVAILABLE", False):
        from functools import partial

        from modelopt.torch.quantization.model_calib import _mse_quant_func
        return partial(_mse_quant_func, quantizer=q)
    return None


def _sync_nvfp4_mse(client: "Client", model: "torch.nn.Module", layout: Layout,
                    **plan_kw: Any) -> Dict[str, Result]:
    from . import calib as C
    torch = _torch()
    entries = plan_nvfp4_mse(model, layout, **plan_kw)
    if entries:
        client.register([e.spec for e in entries])
        client.send({e.name: _block_amax(e.weight, 16).reshape(
            e.spec.placement.local_shape if e.spec.placement else e.spec.global_shape)
            .cpu().numpy() for e in entries})
    # Phase 1: the daemons fix each weight's global amax (the basis).
    r1 = client.reconcile([e.name for e in entries])
    stats = {}
    for e in entries:
        if not e.owner or not r1[e.name].stat_epoch:
            continue
        with torch.no_grad():
            amax = C.nvfp4_mse_amax(e.weight.detach(), r1[e.name].stat_basis,
                                    _nvfp4_quant(e.quantizer))
        stats[e.name] = Stat(amax, r1[e.name].stat_epoch)
    # Phase 2: each block's owner sends the amax its search chose.
    if stats:
        client.send(stats)
    results = client.reconcile([e.name for e in entries])
    for e in entries:
        r = results[e.name]
        if r.stat_state != pb.STAT_COMPUTED:
            raise RuntimeError(f"{e.local_name}: the NVFP4 per-block search did not reach every "
                               f"block (stat_state {r.stat_state}, {r.stat_total:.0f} blocks "
                               f"searched, {r.stat_overflow:.0f} with disagreeing amaxes)")
        _set_amax(e.quantizer, torch.from_numpy(np.array(r.amax, np.float32)).reshape(-1, 1))
        _set_global_amax(e.quantizer, r.global_amax)
    return results


def sync_mse(client: "Client", model: "torch.nn.Module", layout: Layout = Layout(),
             fp8_scale_sweep: bool = False, **plan_kw: Any) -> Dict[str, Result]:
    """ModelOpt's MSE weight calibration (``mse_calibrate``'s multiplier
    search) with the losses summed over every rank's shard: the weights'
    max reconciled (the search's initial amax, MseCalibrator's
    ``initial_amax``), each rank's squared errors of ModelOpt's own fake
    quantization of its block for every candidate (``_mse_quant_func``),
    summed by the daemons (float64), the smallest candidate taken. Writes
    ``_amax`` back. Every rank calls it.

    ``fp8_scale_sweep=True`` (``mse_calibrate``'s argument): only static
    NVFP4 weights, by NVFP4MSECalibrator's per-block FP8 scale sweep in two
    phases: the blocks' max reconciled, which fixes the global amax (the
    scale group's for fusible siblings); then each rank that owns blocks
    (its TP shard; one DP replica) searches them against that global amax
    and sends the chosen amaxes; every rank writes back ``_amax`` (its
    shard's blocks) and ``_global_amax``."""
    if fp8_scale_sweep:
        return _sync_nvfp4_mse(client, model, layout, **plan_kw)
    from functools import partial

    from modelopt.torch.quantization.model_calib import _mse_quant_func
    from . import calib as C
    torch = _torch()
    entries = plan_mse(model, layout, **plan_kw)
    if entries:
        client.register([e.spec for e in entries])
        m = {}
        for e in entries:
            a = e.weight.detach().float().abs()
            m[e.name] = a.amax(dim=1).cpu().numpy() if e.axis == 0 else float(a.max())
        client.send(m)
    r1 = client.reconcile([e.name for e in entries])
    stats = {}
    for e in entries:
        if not e.owner:
            continue
        quant = partial(_mse_quant_func, quantizer=e.quantizer)
        losses = C.mse_losses(e.weight.detach(), r1[e.name].stat_basis, e.spec.calibrator, quant,
                              axis=e.axis)
        stats[e.name] = Stat(losses, r1[e.name].stat_epoch)
    if stats:
        client.send(stats)
    results = client.reconcile([e.name for e in entries])
    for e in entries:
        r = results[e.name]
        a = torch.from_numpy(np.array(r.amax, np.float32))
        _set_amax(e.quantizer, a.reshape(-1, 1) if e.axis == 0 else a.reshape(()))
    return results
