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
- Dynamic quantizers (per-token inputs, MX activations) have nothing to
  reconcile and are left alone; other formats raise ``ValueError``.

A quantizer no rank fed (a cold expert's input quantizer where ModelOpt
does not unify the experts) is left as ModelOpt leaves it, without
``_amax``, unless ``plan(cold_experts="fill")`` asks for the layer's max.
"""
import fnmatch
import math
import re
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import placement as P
from .client import Masked, Quantizer, Recipe, Result

__all__ = ["Layout", "Entry", "plan", "register", "send", "reconcile", "write_back", "sync",
           "supports_share", "DEFAULT_COLUMN", "DEFAULT_ROW"]

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

    def __post_init__(self):
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
    def from_megatron(parallel_state=None) -> "Layout":
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
    quantizer: object  # the TensorQuantizer
    module: object  # the module that owns it (a quantized linear)
    kind: str  # fp8_tensor, fp8_channel, nvfp4_blocks, nvfp4_static, nvfp4_tensor, mxfp8_blocks
    spec: Quantizer
    weight: object = None  # the module's weight, for block amax
    parallel: str = "replicated"  # column, row, replicated
    expert: Optional[int] = None
    peer_share: bool = False
    # The geometry of the quantizer's amax grid whether or not it is what
    # amaxd holds: (global shape, this rank's Placement) of the per-channel
    # or block amax (that of ModelOpt's exported weight scales); None for
    # per-tensor quantizers.
    grid: Optional[Tuple[tuple, P.Placement]] = None
    # Whether amaxd holds the blocks (False: the weight's per-tensor amax,
    # plan(weight_blocks=False)).
    blocks: bool = True


def _torch():
    import torch
    return torch


def _tensor_quantizer_cls():
    from modelopt.torch.quantization.nn import TensorQuantizer
    return TensorQuantizer


def _global_name(model, local_name: str, layout: Layout) -> Tuple[str, Optional[int], str]:
    """(global name, global expert index or None, the MoE block's name) for a
    local module name: experts.<i> becomes experts.<ep_rank * n_local + i>."""
    m = None
    for m in _EXPERTS.finditer(local_name):
        pass
    if m is None:
        return local_name, None, ""
    container = local_name[:m.start(3) - 1]  # "...experts"
    try:
        experts = model.get_submodule(container)
        n_local = len(experts)
    except (AttributeError, TypeError):
        return local_name, None, ""
    g = layout.ep_rank * n_local + int(m.group(3))
    owner = container.rsplit(".", 1)[0] if "." in container else ""
    return local_name[:m.start(3)] + str(g) + local_name[m.end(3):], g, owner


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


def _block_size(q) -> Optional[int]:
    bs = q.block_sizes
    if not bs:
        return None
    return bs.get(-1)


def _classify(q, is_weight: bool) -> Optional[str]:
    """The kind of amax a quantizer holds, or None when it has none to reconcile."""
    bs = q.block_sizes
    nb = q.num_bits
    if getattr(q, "_dynamic", False):
        return None
    if bs and bs.get("type") == "dynamic":
        if bs.get("scale_bits") == (8, 0):  # MX: no amax, scales from the data
            if is_weight and nb == (4, 3) and bs.get(-1) == 32:
                return "mxfp8_blocks"
            if not is_weight:
                return None
            raise ValueError(f"MX format {nb} of a weight is not supported by amaxd")
        if nb == (2, 1) and bs.get("scale_bits") == (4, 3):
            if bs.get(-1) != 16:
                raise ValueError(f"NVFP4 block size {bs.get(-1)} (amaxd's NVFP4 uses 16)")
            if bs.get("four_over_six"):
                raise ValueError("NVFP4 four_over_six is not supported by amaxd")
            return "nvfp4_blocks" if is_weight else "nvfp4_tensor"
        raise ValueError(f"dynamic block quantization {nb} {dict(bs)} is not supported by amaxd")
    if bs:
        if nb == (2, 1) and bs.get("scale_bits") == (4, 3) and bs.get(-1) == 16 and is_weight:
            if bs.get("four_over_six"):
                raise ValueError("NVFP4 four_over_six is not supported by amaxd")
            return "nvfp4_static"
        if all(v is None for k, v in bs.items() if isinstance(k, int)):
            pass  # per-channel written as block_sizes: handled through axis below
        else:
            raise ValueError(f"static block quantization {nb} {dict(bs)} is not supported by amaxd")
    if nb == (4, 3):
        axis = q.axis
        if axis is None:
            return "fp8_tensor"
        if is_weight and axis in (0, (0,), [0]):
            return "fp8_channel"
        raise ValueError(f"FP8 with axis {axis} is not supported by the adapter")
    raise ValueError(f"num_bits {nb} is not supported by amaxd (FP8 E4M3, NVFP4, MXFP8)")


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


def plan(model, layout: Layout = Layout(), *, column: Sequence[str] = DEFAULT_COLUMN,
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
    ``peer_mode="fill"``)."""
    if cold_experts not in ("leave", "fill"):
        raise ValueError(f"cold_experts={cold_experts!r}: use 'leave' or 'fill'")
    TensorQuantizer = _tensor_quantizer_cls()
    if shared_patterns is None:
        from modelopt.torch.quantization.utils import SHARED_PATTERNS
        shared_patterns = SHARED_PATTERNS
    shared = _shared_groups(model, shared_patterns)
    share_ok = supports_share()
    entries = []
    for qname, q in model.named_modules():
        if not isinstance(q, TensorQuantizer) or not q.is_enabled:
            continue
        if "." not in qname:
            continue
        mod_name, attr = qname.rsplit(".", 1)
        module = model.get_submodule(mod_name)
        is_weight = attr.endswith("weight_quantizer")
        kind = _classify(q, is_weight)
        if kind is None:
            continue
        weight = None
        if is_weight:
            wname = attr[:-len("weight_quantizer")].rstrip("_") or "weight"
            weight = getattr(module, wname, None)
            if weight is None or weight.dim() != 2:
                raise ValueError(f"{qname}: a 2-D weight {wname!r} is needed")
        gname, expert, owner = _global_name(model, qname, layout)
        par = _parallel_kind(module, mod_name, column, row)
        tp_rank, tp = layout.etp if expert is not None else (layout.tp_rank, layout.tp_size)
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
        if kind in ("fp8_tensor", "nvfp4_tensor"):
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
        if kind == "fp8_tensor" or kind == "fp8_channel":
            recipe = Recipe.fp8_current(output="modelopt")
        elif kind == "nvfp4_static":
            recipe = Recipe.nvfp4("modelopt_static", output="modelopt")
        elif kind.startswith("nvfp4"):
            recipe = Recipe.nvfp4("modelopt", output="modelopt")
        else:
            recipe = Recipe.mxfp8("modelopt")
        kw = {}
        if peer_mode is not None:
            kw["peer_mode"] = peer_mode
        spec = Quantizer(gname, gshape, recipe, pl, peer_group=peer_group,
                         scale_group=scale_group, **kw)
        entries.append(Entry(qname, gname, q, module, kind, spec, weight, par, expert, peer_share,
                             grid, weight_blocks))
    return entries


def _local_amax(e: Entry):
    """This rank's amax block of an entry (numpy float32), or a Masked one
    when the quantizer saw no data."""
    torch = _torch()
    if e.kind in ("nvfp4_blocks", "nvfp4_static", "mxfp8_blocks"):
        bsz = 32 if e.kind == "mxfp8_blocks" else 16
        with torch.no_grad():
            w = e.weight.detach().float()
            a = w.abs().reshape(w.shape[0], w.shape[1] // bsz, bsz).amax(dim=-1)
        amax = getattr(e.quantizer, "_amax", None)
        if amax is not None and e.kind != "mxfp8_blocks":
            # Max calibration gives the weight's block amax (static) or its
            # max (dynamic); an algorithm that refines them (MSE, AWQ, ...)
            # would be overwritten by the write-back: refuse rather than do that.
            cal = amax.detach().float()
            ok = (torch.equal(cal.reshape(a.shape), a) if e.kind == "nvfp4_static"
                  else cal.numel() == 1 and torch.equal(cal.reshape(()), a.amax()))
            if not ok:
                raise ValueError(f"{e.local_name}: _amax is not the weight's max calibration "
                                 "(another calibration algorithm?); amaxd.modelopt reconciles "
                                 "max-calibrated weights")
        if not e.blocks:
            return a.amax().cpu().numpy()
        return a.cpu().numpy()
    amax = getattr(e.quantizer, "_amax", None)
    if e.kind == "fp8_channel":
        if amax is None:
            rows = e.grid[1].local_shape[0]
            return Masked(torch.zeros(rows), torch.ones(rows, dtype=torch.bool))
        return amax.detach().float().reshape(-1).cpu().numpy()
    # Per-tensor: no amax (or NaN from load_calib_amax(strict=False)) = no data.
    if amax is None or amax.is_meta or bool(torch.isnan(amax).any()):
        return Masked(torch.zeros(()), torch.tensor(True))
    return amax.detach().float().reshape(()).cpu().numpy()


def register(client, entries: Sequence[Entry]):
    """Registers the entries (nothing when there are none: a rank without
    quantizers to reconcile still takes part in reconcile())."""
    if entries:
        return client.register([e.spec for e in entries])
    return None


def send(client, entries: Sequence[Entry]):
    """Sends this rank's local amax of every entry, in one request."""
    if entries:
        return client.send({e.name: _local_amax(e) for e in entries})
    return None


def reconcile(client, entries: Sequence[Entry]) -> Dict[str, Result]:
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


def write_back(entries: Sequence[Entry], results: Dict[str, Result]):
    """Writes the reconciled amax into the quantizers: ``_amax`` of
    per-tensor and per-channel quantizers and of dynamic NVFP4 weights (the
    global amax), ``_amax`` (blocks) and ``_global_amax`` of static NVFP4
    weights. MXFP8 weights keep no amax in ModelOpt. A quantizer that no
    rank fed (and no peer group filled) is left as it is, without
    ``_amax``, as a single-process calibration leaves it: never 0."""
    torch = _torch()
    for e in entries:
        r = results[e.name]
        if e.kind == "mxfp8_blocks":
            continue
        if not _whole_or_nothing(e.local_name, _no_data(r)):
            continue
        if e.kind in ("fp8_tensor", "nvfp4_tensor"):
            _set_amax(e.quantizer, torch.tensor(np.float32(r.amax.reshape(())), dtype=torch.float32))
        elif e.kind == "fp8_channel":
            _set_amax(e.quantizer, torch.from_numpy(r.amax.copy()).reshape(-1, 1))
        elif e.kind == "nvfp4_blocks":
            _set_amax(e.quantizer, torch.tensor(np.float32(r.global_amax), dtype=torch.float32))
        elif e.kind == "nvfp4_static":
            if e.blocks:  # the shard's own blocks, as reconciled
                _set_amax(e.quantizer, torch.from_numpy(r.amax.copy()).reshape(-1, 1))
            g = torch.tensor(np.float32(r.global_amax), dtype=torch.float32)
            old = getattr(e.quantizer, "_global_amax", None)
            if old is not None:
                with torch.no_grad():
                    old.data.copy_(g.to(old.device))  # tied across a shared group: in place
            else:
                e.quantizer.global_amax = g


def sync(client, model, layout: Layout = Layout(), **plan_kw) -> Dict[str, Result]:
    """Registers, sends, reconciles and writes back in one call (after
    this rank's calibration); returns {global name: Result}."""
    entries = plan(model, layout, **plan_kw)
    register(client, entries)
    send(client, entries)
    results = reconcile(client, entries)
    write_back(entries, results)
    return results
