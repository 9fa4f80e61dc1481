"""TransformerEngine's cast of data-parallel-sharded master weights, with the
amax reconciled by amaxd instead of all_reduce(MAX) over a process group.

TE's `quantize_master_weights(model_weights, master_weights, start_offsets,
group)` (transformer_engine/pytorch/tensor/utils.py, TE main d0067d0da6cb)
runs every optimizer step: each data-parallel rank holds the flat elements
[start, start + n) of each weight's FP32 master copy (n may be 0), computes
partial amaxes of the tiles its range touches, all-reduces them (MAX) over
`group`, and derives the scales that every rank stores on its full copy of
the model weight. This module does the same with torch (CPU or CUDA
tensors; TE is not needed) and one amaxd epoch per step:

    import amaxd, amaxd.te as ate
    with amaxd.Client("llama-8b-train", dp_rank, dp_size) as c:
        c.join()
        cast = ate.Caster(c, specs, start_offsets, numels)    # registers once
        for step in ...:
            optimizer.step()
            out = cast.step(master_weights)                 # {name: {field: tensor}}

or, where TE is installed, `ate.quantize_master_weights(model_weights,
master_weights, start_offsets, client=c)`, which writes TE's
`_rowwise_scale_inv` / `_columnwise_scale_inv` / `_amax_rowwise` /
`_scale_inv` in place (and, with cast=True, casts each rank's fragment
with TE's own partial-cast kernels).

The epoch goes one of two ways, chosen once per Caster when its buffers
are built (`Caster.path`, logged once on the "amaxd.te" logger):

- "device" (GPU-direct, docs/API.md "Device buffers"): the outputs live on
  a CUDA device and the daemon, on the CUDA backend on this node, maps a
  device slab and answer for the client (Client.open_device). The partial
  amaxes are written by torch straight into the device slab, the has-data
  mask once; Client.reconcile_device() marks the slab written on the
  current stream (the doorbell's signal, else an interprocess event),
  the daemon merges it on the GPU, reconciles, writes this rank's answer
  into the device answer buffer, and the current stream waits for it on
  the GPU. The outputs are views of that answer buffer (no copy); the
  NVFP4 scale layout is one copy on the stream. No .cpu(), no stream
  synchronize: the host waits only for the daemon's answer.
- "packed": the slab goes through SendPacked (a .cpu() copy of it for a
  CUDA slab) and ReconcilePacked, and the answer is copied to the output
  buffers. Taken for CPU outputs, a host-backend daemon, a trainer without
  torch CUDA or a CUDA IPC binding (path="auto" falls back, saying why),
  or path="packed".

Four recipes, as TE stores them (docs/NUMERICS.md, "TE master-weight cast"):

- "nvfp4" (NVFP4 2D, 16x16 tiles; _cast_master_weights_to_nvfp4_2d): a
  [ceil(R/16), ceil(C/16)] tile amax under NVFP4 convention
  te_partial_cast; fields amax, global_amax, global_scale (S_enc),
  tile_scale_inv (the tile's E4M3 decode scale as float),
  tile_encode_scale (what the cast multiplies a tile by), rowwise_scale_inv
  (uint8, TE's layout: see Caster._nvfp4_layout) and amax_rowwise
  (= global_amax).
- "fp8_block" (128x128 blocks; _cast_master_weights_to_fp8_blockwise_scaling):
  the amax buffer of get_scale_shape, [ceil(R/128), round_up(ceil(C/128),
  4)], registered with that padded shape so that the padding reads amax 0
  as in TE; FP8 current-scaling rule with TE's eps and power-of-2; fields
  amax, scale, rowwise_scale_inv (float32, that shape).
- "mxfp8" (1x32 and 32x1 blocks; _cast_master_weights_to_fp8_mxfp8_scaling):
  two quantizers with the padded scale_inv shapes of
  MXFP8Quantizer.get_scale_shape; fields amax_rowwise_blocks,
  amax_columnwise_blocks, rowwise_scale_inv, columnwise_scale_inv (uint8).
- "fp8_current" (_cast_master_weights_to_fp8_current_scaling): one amax per
  weight; fields amax, scale, scale_inv ([1] each).

Every rank places every quantizer whole (every rank needs every scale: it
holds the full model weight) and marks as data only the tiles its range
touches (amaxd.tiles): the reconciled tile amax is the max over the ranks
that touched the tile, TE's all-reduce; a rank with an empty range sends
nothing but "no data" and still takes part in every epoch. Registration
happens once, in Caster(); the buffers (and on the device path the
client's device buffers) once, at the first step or in Caster() when its
device is given; each step reuses the layout, the mask, the slab and the
output buffers: no registration, no allocation of amaxd buffers.
"""
import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import tiles as T
from .types import FP8_E4M3, FP8_E5M2, PER_EPOCH, Quantizer, Recipe

__all__ = ["WeightSpec", "Caster", "StepMismatch", "quantize_master_weights", "scale_inv_shapes",
           "KINDS"]

KINDS = ("nvfp4", "fp8_block", "mxfp8", "fp8_current")
PATHS = ("auto", "device", "packed")  # Caster(path=...): see the module's docstring

# The step guard (Caster, "Every rank in every step"): three quantizers of
# the job beside the weights' (the prefix is reserved): one cell per rank
# that the rank marks 1.0 in each step it contributes, and the step's id
# and GUARD_C minus it (two MAXes give the max and the min of the ids of
# everything the epoch merged). Ids stay below 2^23, exact in float32.
GUARD = "amaxd.te:guard/"
GUARD_C = float(1 << 23)


class StepMismatch(RuntimeError):
    """A step whose epoch was not one clean step of every rank: a rank
    contributed nothing to it (its step failed: a refused slab, an error
    before it sent), or the epoch also merged contributions a failed step
    left in the daemon (a timed-out epoch keeps them). The step's outputs
    are not that step's; the Caster's next step is clean again (every rank
    raises this for the same step, and the step ids are realigned)."""
NVFP4_TILE = 16  # TE constants.NVFP4_BLOCK_SCALING_SIZE
FP8_BLOCK_LEN = 128  # Float8BlockQuantizer.block_len (the partial-amax kernel's kTileDim)
MXFP8_BLOCK = 32  # MXFP8_BLOCK_SCALING_SIZE

_LOG = logging.getLogger("amaxd.te")
# The torch device types the device path serves (a test widens it to run
# the path's code on CPU through an emulated client).
_DEVICE_TYPES = ("cuda",)


def _round_up(x: int, m: int) -> int:
    return -(-int(x) // m) * m


def _cdiv(x: int, m: int) -> int:
    return -(-int(x) // m)


@dataclass(frozen=True)
class WeightSpec:
    """One model weight: a stable name (the same on every rank), its [rows,
    cols] shape, the recipe kind, the model weight's dtype (the master shard
    is cast to it before its amax is taken, as TE does), and for FP8 kinds
    the format ("e4m3" / "e5m2"), TE's amax_epsilon and force_pow_2_scales
    (default as TE's quantizers: True for "fp8_block", Float8BlockQuantizer
    in tensor/float8_blockwise_tensor.py; False for "fp8_current",
    Float8CurrentScalingQuantizer in tensor/float8_tensor.py; TE main
    d0067d0)."""

    name: str
    shape: Tuple[int, int]
    kind: str
    dtype: str = "bfloat16"
    fp8_format: str = "e4m3"
    eps: float = 0.0
    power_of_2: Optional[bool] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.power_of_2 is None:
            object.__setattr__(self, "power_of_2", self.kind == "fp8_block")
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise ValueError(f"{self.name}: shape {tuple(self.shape)} is not a 2-D weight")
        if self.fp8_format not in ("e4m3", "e5m2"):
            raise ValueError(f"{self.name}: fp8_format {self.fp8_format!r}: use e4m3 or e5m2")
        if self.kind == "mxfp8" and (self.shape[0] % MXFP8_BLOCK or self.shape[1] % MXFP8_BLOCK):
            raise ValueError(f"{self.name}: TE's MXFP8 partial cast needs rows and cols divisible "
                             f"by 32 (mxfp8_scaling_compute_partial_amax), not {tuple(self.shape)}")

    @property
    def rows(self) -> int:
        return int(self.shape[0])

    @property
    def cols(self) -> int:
        return int(self.shape[1])

    @staticmethod
    def from_te(name: str, model_weight: Any) -> "WeightSpec":
        """The spec of a TE quantized model weight (duck-typed: its
        _get_quantizer() class name and the fields TE's cast reads)."""
        q = model_weight._get_quantizer()
        kind = {"NVFP4Quantizer": "nvfp4", "Float8BlockQuantizer": "fp8_block",
                "MXFP8Quantizer": "mxfp8",
                "Float8CurrentScalingQuantizer": "fp8_current"}.get(type(q).__name__)
        if kind is None:
            raise ValueError(f"{name}: amaxd.te handles NVFP4 2D, FP8 block, MXFP8 and FP8 current "
                             f"scaling weights, not {type(q).__name__}")
        if kind == "nvfp4" and not getattr(q, "with_2d_quantization", False):
            raise ValueError(f"{name}: NVFP4 2D quantization must be enabled (as TE requires)")
        if kind == "fp8_block" and getattr(q, "block_scaling_dim", 2) != 2:
            raise ValueError(f"{name}: TE's master-weight cast computes 128x128 partial amaxes; "
                             f"a weight with block_scaling_dim 1 is not supported")
        shape = tuple(int(d) for d in model_weight.shape)
        if len(shape) != 2:
            if kind != "fp8_current":
                raise ValueError(f"{name}: expected a 2-D model weight, got {shape}")
            shape = (int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1,
                     shape[-1] if shape else 1)
        fmt = "e5m2" if "E5M2" in str(getattr(q, "dtype", "")).upper() else "e4m3"
        return WeightSpec(name, shape, kind, str(model_weight.dtype).replace("torch.", ""), fmt,
                          float(getattr(q, "amax_epsilon", 0.0) or 0.0),
                          bool(getattr(q, "force_pow_2_scales", False)))


def scale_inv_shapes(spec: WeightSpec) -> Dict[str, Tuple[int, ...]]:
    """The shapes of what TE stores for a weight (get_scale_shape of its
    quantizer, rowwise; MXFP8 also columnwise)."""
    R, C = spec.rows, spec.cols
    if spec.kind == "nvfp4":
        return {"rowwise_scale_inv": (_round_up(R, 128), _round_up(_cdiv(C, NVFP4_TILE), 4))}
    if spec.kind == "fp8_block":
        return {"rowwise_scale_inv": (_cdiv(R, FP8_BLOCK_LEN),
                                      _round_up(_cdiv(C, FP8_BLOCK_LEN), 4))}
    if spec.kind == "mxfp8":
        return {"rowwise_scale_inv": (_round_up(R, 128), _round_up(C // MXFP8_BLOCK, 4)),
                "columnwise_scale_inv": (_round_up(R // MXFP8_BLOCK, 4), _round_up(C, 128))}
    return {"scale_inv": (1,)}


@dataclass
class _Part:
    """One quantizer of a weight: its name, global shape, the tile of the
    weight each cell covers ((R, C) for the per-weight amax) and its recipe."""

    qname: str
    shape: Tuple[int, ...]
    tile: Optional[Tuple[int, int]]
    recipe: Recipe


def _parts(spec: WeightSpec) -> List[_Part]:
    R, C = spec.rows, spec.cols
    fmt = FP8_E5M2 if spec.fp8_format == "e5m2" else FP8_E4M3
    if spec.kind == "nvfp4":
        return [_Part(spec.name + ".nvfp4_2d", (_cdiv(R, 16), _cdiv(C, 16)), (16, 16),
                      Recipe.nvfp4("te_partial_cast"))]
    if spec.kind == "fp8_block":
        return [_Part(spec.name + ".fp8_block", scale_inv_shapes(spec)["rowwise_scale_inv"],
                      (FP8_BLOCK_LEN, FP8_BLOCK_LEN),
                      Recipe.fp8_block(fmt, spec.eps, spec.power_of_2, "float32"))]
    if spec.kind == "mxfp8":
        s = scale_inv_shapes(spec)
        return [_Part(spec.name + ".mxfp8_rowwise", s["rowwise_scale_inv"], (1, MXFP8_BLOCK),
                      Recipe.mxfp8("te")),
                _Part(spec.name + ".mxfp8_columnwise", s["columnwise_scale_inv"], (MXFP8_BLOCK, 1),
                      Recipe.mxfp8("te"))]
    return [_Part(spec.name + ".fp8_current", (), None,
                  Recipe.fp8_current(fmt, spec.eps, spec.power_of_2))]


def _torch():
    import torch
    return torch


def _dtype(name):
    torch = _torch()
    d = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return d


class Caster:
    """The amaxd side of TE's master-weight cast for one rank: registers the
    weights' quantizers once (client joined already; the same specs, in any
    order, on every rank), then step() per optimizer step.

    specs: WeightSpec per weight; start_offsets / numels: where this rank's
    master shard of each weight starts in the flattened weight and how many
    elements it has (0: none). device: where the outputs live (default:
    the first master weight's device at the first step, else CPU); when
    given, the buffers are built here, else at the first step.

    path: "auto" (the device path when the outputs are on a CUDA device
    and the client can open device buffers with the daemon, else the
    packed path), "device" (the device path or an error: DeviceUnavailable
    or the daemon's status) or "packed". After the buffers are built,
    self.path is the path taken ("device" or "packed") and
    self.path_reason why the packed one was, if it was; both are logged
    once (logger "amaxd.te", INFO).

    The device path uses the client's device buffers (Client.open_device;
    reused when the client has them for this layout and device): the
    outputs are views of them, valid while the client is open. One Caster
    per client and layout is the intended use (two share the buffers
    correctly, but each step's outputs are then the last caller's)."""

    def __init__(self, client: Any, specs: Sequence[WeightSpec], start_offsets: Sequence[int],
                 numels: Sequence[int], device: Any = None, path: str = "auto",
                 verify: bool = True) -> None:
        torch = _torch()
        if path not in PATHS:
            raise ValueError(f"path {path!r} is not one of {PATHS}")
        if not (len(specs) == len(start_offsets) == len(numels)):
            raise ValueError("specs, start_offsets and numels must have one entry per weight")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("weight names must be unique")
        self.client = client
        self.specs = list(specs)
        self.ranges = [(int(s), int(n)) for s, n in zip(start_offsets, numels)]
        for sp, (s, n) in zip(self.specs, self.ranges):
            if s < 0 or n < 0 or s + n > sp.rows * sp.cols:
                raise ValueError(f"{sp.name}: range [{s}, {s + n}) is not inside its "
                                 f"{sp.rows * sp.cols} elements")
        self.parts = [_parts(sp) for sp in self.specs]
        # PER_EPOCH (history 1): each step's amax is that step's, as TE's
        # all-reduce of freshly zeroed buffers; whole placements: every rank
        # answers every cell.
        for sp in self.specs:
            if sp.name.startswith(GUARD):
                raise ValueError(f"{sp.name}: names starting with {GUARD!r} are amaxd.te's own")
        self.world, self.rank = int(client.world_size), int(client.rank)
        self.verify = bool(verify)
        guard = [Quantizer(GUARD + "present", (self.world,), Recipe.fp8_current(),
                           accumulation=PER_EPOCH),
                 Quantizer(GUARD + "step_max", (), Recipe.fp8_current(), accumulation=PER_EPOCH),
                 Quantizer(GUARD + "step_min", (), Recipe.fp8_current(), accumulation=PER_EPOCH)]
        reg = client.register([Quantizer(p.qname, p.shape, p.recipe, accumulation=PER_EPOCH)
                               for ps in self.parts for p in ps] + guard)
        # A layout the client fetched before (another Caster, a sync) lacks
        # quantizers registered now.
        self.layout = client.layout(refresh=bool(reg.created))
        L = self.layout
        pa, _ = L.span(GUARD + "present")
        self._g_present = pa + self.rank
        self._g_max = L.span(GUARD + "step_max")[0]
        self._g_min = L.span(GUARD + "step_min")[0]
        # The cells read back after each epoch: every rank's present cell,
        # then the two ids.
        self._g_cells = np.array(list(range(pa, pa + self.world)) + [self._g_max, self._g_min],
                                 dtype=np.int64)
        self._step_id = 0
        self.requested_path = path
        self.path: Optional[str] = None  # "device" or "packed", once the buffers are built
        self.path_reason = ""
        self._bufs: Any = None  # the client's DeviceBuffers on the device path
        self.device = None if device is None else torch.device(device)
        self._built_for = None
        self._mask = self._build_mask()
        # Cells without data: the daemon reads the has-data bytes.
        self._gaps = not bool(self._mask.all())
        if self.device is not None:
            self._build_buffers(self.device)

    # -- built once --

    def _block(self, spec, part, rng):
        s, n = rng
        if part.tile is None or n == 0:
            return None
        return T.flat_range_block(spec.rows, spec.cols, part.tile, s, n)

    def _build_mask(self) -> np.ndarray:
        """has_data of the slab: the cells of the tiles this rank touches."""
        L = self.layout
        mask = np.zeros(L.total_cells, dtype=np.uint8)
        self.blocks = []
        for spec, parts, rng in zip(self.specs, self.parts, self.ranges):
            bl = []
            for p in parts:
                a, b = L.span(p.qname)
                if p.tile is None:
                    mask[a:b] = rng[1] > 0
                    bl.append(None)
                    continue
                blk = self._block(spec, p, rng)
                mask[a:b] = T.whole_mask(blk, p.shape).reshape(-1)
                bl.append(blk)
            self.blocks.append(bl)
        mask[[self._g_present, self._g_max, self._g_min]] = 1
        return mask

    def _open_device(self, device) -> Tuple[Any, str]:
        """(the client's device buffers for this layout on `device`, "") for
        the device path, or (None, why not) for the packed one; raises
        instead when path="device"."""
        if self.requested_path == "packed":
            return None, "path='packed' was asked for"
        from . import device as dv
        from .errors import AmaxdError
        try:
            if device.type not in _DEVICE_TYPES:
                raise dv.DeviceUnavailable(f"the outputs live on {device}, not on a CUDA device "
                                           f"(the device path keeps them in the daemon's device "
                                           f"answer buffer on the trainer's GPU)")
            bufs = self.client.device_buffers
            if (bufs is None or bufs.layout_id != self.layout.id
                    or (device.index is not None and bufs.dev != device.index)):
                bufs = self.client.open_device(device.index)
            if bufs.slab.device != device and device.index is not None:
                raise dv.DeviceUnavailable(f"the device buffers are on {bufs.slab.device}, the "
                                           f"outputs on {device}")
        except (dv.DeviceUnavailable, AmaxdError) as e:
            if self.requested_path == "device":
                raise
            return None, f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
        return bufs, ""

    def _build_buffers(self, device):
        """The slab, the scratch and the output tensors, on `device`: the
        client's device buffers (the device path) or buffers of this
        Caster (the packed path)."""
        torch = _torch()
        L = self.layout
        n = L.total_cells
        bufs, why = self._open_device(device)
        if bufs is not None:
            device = bufs.slab.device
        self.device = device
        if bufs is not None:
            # The partial amaxes go straight into the device slab; the
            # outputs are views of the device answer.
            self.path, self.path_reason, self._bufs = "device", "", bufs
            self.slab = bufs.slab
            self.slab.zero_()
            self._mask_dev = torch.from_numpy(self._mask).to(device)
            self._claim()
            a = bufs.answer
            self.a_amax, self.a_scale, self.a_inv = a["amax"], a["scale"], a["scale_inv"]
            self.a_bytes = a["block_scales"]
            self.a_gamax, self.a_gscale = a["global_amax"], a["global_scale"]
        else:
            self.path, self.path_reason = "packed", why
            self.slab = torch.zeros(n, dtype=torch.float32, device=device)
            # Per-cell answers on the device; outputs are views of them.
            self.a_amax = torch.zeros(n, dtype=torch.float32, device=device)
            self.a_scale = torch.zeros(n, dtype=torch.float32, device=device)
            self.a_inv = torch.zeros(n, dtype=torch.float32, device=device)
            self.a_bytes = torch.zeros(n, dtype=torch.uint8, device=device)
            self.a_gamax = torch.zeros(len(L), dtype=torch.float32, device=device)
            self.a_gscale = torch.zeros(len(L), dtype=torch.float32, device=device)
        # One scratch per model dtype, as large as the largest need: the
        # element rows of the touched tiles of one weight.
        need: Dict[str, int] = {}
        for spec, parts, blocks in zip(self.specs, self.parts, self.blocks):
            for p, blk in zip(parts, blocks):
                if blk is None:
                    continue
                rows = blk.shape[0] * p.tile[0]  # the element rows of its tile rows
                need[spec.dtype] = max(need.get(spec.dtype, 0), rows * spec.cols)
        self.scratch = {d: torch.zeros(k, dtype=_dtype(d), device=device) for d, k in need.items()}
        self._g_idx = torch.from_numpy(self._g_cells).to(device)
        self.outputs: Dict[str, Dict[str, object]] = {}
        for spec, parts in zip(self.specs, self.parts):
            o: Dict[str, object] = {}
            views = [self._views(p) for p in parts]
            if spec.kind == "nvfp4":
                amax, scale, inv, byts, qi = views[0]
                o.update(amax=amax, tile_encode_scale=scale, tile_scale_inv=inv,
                         global_amax=self.a_gamax[qi:qi + 1], amax_rowwise=self.a_gamax[qi:qi + 1],
                         global_scale=self.a_gscale[qi:qi + 1],
                         rowwise_scale_inv=torch.zeros(scale_inv_shapes(spec)["rowwise_scale_inv"],
                                                       dtype=torch.uint8, device=device))
                o["_tile_bytes"] = byts
            elif spec.kind == "fp8_block":
                amax, scale, inv, _, _ = views[0]
                o.update(amax=amax, scale=scale, rowwise_scale_inv=inv)
            elif spec.kind == "mxfp8":
                o.update(amax_rowwise_blocks=views[0][0], amax_columnwise_blocks=views[1][0],
                         rowwise_scale_inv=views[0][3], columnwise_scale_inv=views[1][3])
            else:
                amax, scale, inv, _, _ = views[0]
                o.update(amax=amax.reshape(1), scale=scale.reshape(1), scale_inv=inv.reshape(1))
            self.outputs[spec.name] = o
        self._public = {k: {f: t for f, t in v.items() if not f.startswith("_")}
                        for k, v in self.outputs.items()}
        self._built_for = device
        if self.path == "device":
            b = self._bufs
            _LOG.info("amaxd.te: job %s rank %d: %d weights, %d cells on %s: the device path "
                      "(GPU-direct: slab and answer in device buffers %d, ReconcileDevice over %s)",
                      self.client.job, self.client.rank, len(self.specs), n, device, b.id,
                      "the doorbell" if getattr(b, "doorbell", "") and
                      getattr(self.client, "doorbell", False) else "gRPC")
        else:
            _LOG.info("amaxd.te: job %s rank %d: %d weights, %d cells on %s: the packed path "
                      "(%s)", self.client.job, self.client.rank, len(self.specs), n, device,
                      self.path_reason)

    def _claim(self):
        """Makes the device buffers' has-data bytes this Caster's mask (once,
        unless another Caster of the client wrote its own since)."""
        b = self._bufs
        owner = getattr(b, "_amaxd_te_owner", None)
        if owner is None or owner() is not self:
            b.has_data.copy_(self._mask_dev)
            b._amaxd_te_owner = weakref.ref(self)  # the buffers do not keep this Caster alive

    def _views(self, p: _Part):
        L = self.layout
        a, b = L.span(p.qname)
        shape = p.shape if p.shape else (1,)
        return (self.a_amax[a:b].view(shape), self.a_scale[a:b].view(shape),
                self.a_inv[a:b].view(shape), self.a_bytes[a:b].view(shape), L.index[p.qname])

    # -- every step --

    def _tile_amax(self, x, spec: WeightSpec, part: _Part, blk: T.TileBlock, start: int):
        """Writes this rank's partial amax of the tiles in `blk` into the
        slab: max |x| over its elements of each tile (NaN skipped as TE's
        fmaxf skips it), in the model dtype, exact in float32."""
        th, tw = part.tile
        C = spec.cols
        (i0, j0), (h, w) = blk.offset, blk.shape
        buf = self.scratch[spec.dtype]
        nrows = h * th
        base = i0 * th * C
        a, n = start - base, x.numel()
        flat = buf[:nrows * C]
        flat[:a].zero_()
        flat[a + n:].zero_()
        flat[a:a + n].copy_(x.reshape(-1))
        flat.abs_()
        flat.nan_to_num_(nan=0.0, posinf=float("inf"))
        m = flat.view(nrows, C)
        qa, qb = self.layout.span(part.qname)
        out = self.slab[qa:qb].view(part.shape)[i0:i0 + h, j0:j0 + w]
        full = min(j0 + w, C // tw)  # tile columns that lie wholly inside the weight
        if full > j0:
            k = full - j0
            out[:, :k].copy_(m[:, j0 * tw:full * tw].reshape(h, th, k, tw).amax(dim=(1, 3)))
        if j0 + w > full:  # the last tile column, cut by the weight's edge
            out[:, w - 1].copy_(m[:, full * tw:C].reshape(h, th, C - full * tw).amax(dim=(1, 2)))

    def _partial(self, spec, parts, blocks, rng, master):
        torch = _torch()
        s, n = rng
        if n == 0 or master is None:
            return
        if master.numel() != n:
            raise ValueError(f"{spec.name}: the master shard has {master.numel()} elements, "
                             f"this Caster was built for {n}")
        x = master.detach().reshape(-1)
        # TE: master_weight = master_weight.to(model_weight.dtype)
        x = x.to(device=self.device, dtype=_dtype(spec.dtype))
        for p, blk in zip(parts, blocks):
            if p.tile is None:
                a, b = self.layout.span(p.qname)
                v = x.abs().nan_to_num(nan=0.0, posinf=float("inf")).amax()
                self.slab[a:b].copy_(v.reshape(1).to(torch.float32))
            else:
                self._tile_amax(x, spec, p, blk, s)

    def step(self, master_weights: Sequence[Any]) -> Dict[str, Dict[str, Any]]:
        """One optimizer step: partial amaxes of this rank's master shards
        (torch tensors, or None where the rank holds nothing), one amaxd
        epoch (self.path), and the scales of every weight as TE stores
        them: {name: {field: tensor}} on self.device, the same dict and
        tensors every step, overwritten by the next one. On the device
        path they are views of the client's device answer, written on the
        GPU and ordered on the current stream: read them on it (or order
        another stream after it) before the next step."""
        torch = _torch()
        if len(master_weights) != len(self.specs):
            raise ValueError(f"{len(master_weights)} master weights for {len(self.specs)} specs")
        if self._built_for is None:
            dev = self.device
            if dev is None:
                dev = next((m.device for m in master_weights if m is not None), torch.device("cpu"))
            self._build_buffers(torch.device(dev))
        if self.path == "device":
            if self.client.device_buffers is not self._bufs:
                raise RuntimeError("amaxd.te: the client's device buffers were closed or replaced "
                                   "(close_device, open_device, or a new layout) after this "
                                   "Caster mapped them: its outputs are views of them; build a "
                                   "new Caster")
            self._claim()
        # The guard: this rank's present cell and the step's id (small
        # fills on the stream; no host sync).
        self._step_id = self._step_id % (int(GUARD_C) - 1) + 1
        sid = float(self._step_id)
        self.slab[self._g_present:self._g_present + 1].fill_(1.0)
        self.slab[self._g_max:self._g_max + 1].fill_(sid)
        self.slab[self._g_min:self._g_min + 1].fill_(GUARD_C - sid)
        try:
            for spec, parts, blocks, rng, m in zip(self.specs, self.parts, self.blocks,
                                                   self.ranges, master_weights):
                self._partial(spec, parts, blocks, rng, m)
        except Exception:
            # A master shard this rank cannot use: the rank still takes
            # part in the step's epoch, contributing nothing (see below).
            self._enter_empty()
            raise
        if self.path == "device":
            # Ordered on the current stream: after the slab writes above,
            # before whatever the caller queues next.
            self.client.reconcile_device(has_data=self._gaps)
            if self.verify:
                # The one host sync of a device step: W + 2 floats.
                self._check(self.a_amax.index_select(0, self._g_idx).cpu().numpy())
        else:
            from .errors import AmaxdError
            try:
                self.client.send_packed(self.slab, has_data=self._mask)
            except AmaxdError:
                # Refused (an infinite weight, a stale layout, ...): this
                # rank still enters the step's epoch, with only its step id
                # and without its present mark, so that the other ranks'
                # step fails with StepMismatch rather than silently without
                # this rank's shard, and no rank's next step pairs with
                # this one.
                self._enter_empty()
                raise
            res = self.client.reconcile_packed()
            if res.layout_id != self.layout.id:
                raise RuntimeError("the job's layout changed under amaxd.te (a quantizer was "
                                   "refused by agreement); register the same specs on every rank")
            if self.verify:
                self._check(np.asarray(res.amax)[self._g_cells])
            self._read(res)
        self._nvfp4_layout()
        return self._public

    def _enter_empty(self) -> None:
        """Takes part in the step's epoch without this rank's present mark
        (its step failed here), so that the other ranks' step raises
        StepMismatch instead of giving scales without this rank's shard,
        and no rank's next step pairs with this one. Errors are left to the
        caller's exception."""
        from .errors import AmaxdError
        try:
            if self.path == "device":
                self.client.reconcile_device(send=False)
            else:
                mask = np.zeros_like(self._mask)
                mask[[self._g_max, self._g_min]] = 1
                self.client.send_packed(self.slab, has_data=mask)
                self.client.reconcile_packed()
        except AmaxdError:
            pass

    def _check(self, g) -> None:
        """The step guard, from the reconciled cells of every rank's present
        mark and the two ids (the same on every rank): StepMismatch unless
        every rank contributed and every contribution was this step's."""
        W = self.world
        g = np.asarray(g, dtype=np.float32)
        absent = [r for r in range(W) if g[r] != np.float32(1.0)]
        hi, lo = int(g[W]), int(GUARD_C - float(g[W + 1])) if g[W + 1] > 0 else 0
        mine = self._step_id
        if not absent and hi == lo == mine:
            return
        # Realign: every rank read the same ids, so every rank's next step
        # carries the same id.
        self._step_id = max(mine, hi)
        why = []
        if absent:
            why.append(f"rank(s) {', '.join(map(str, absent))} contributed nothing to it (their "
                       f"step failed: a refused slab or send, an error before it was sent)")
        if hi != lo or (not absent and hi != mine):
            why.append(f"its epoch merged contributions of step ids {lo}..{hi} while this rank's "
                       f"step is {mine} (a step that failed before it was reconciled left its "
                       f"contributions in the daemon, which keeps them)")
        raise StepMismatch(
            f"amaxd.te, job {self.client.job} rank {self.rank}: this step is not one clean step of "
            f"every rank: {'; and '.join(why)}. Its outputs are not this step's: do not use "
            f"them. The next step is clean (every rank raised this for the same step)")

    def _read(self, res):
        """Copies the packed answer to the output buffers (the packed path)."""
        torch = _torch()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only answer bytes, only read
            for dst, src in ((self.a_amax, res.amax), (self.a_scale, res.scale),
                             (self.a_inv, res.scale_inv), (self.a_bytes, res.block_scales),
                             (self.a_gamax, res.global_amax), (self.a_gscale, res.global_scale)):
                if src.size:
                    dst.copy_(torch.from_numpy(src))

    def _nvfp4_layout(self):
        """TE's NVFP4 scale layout (nvfp4_fused_scale_kernel) from the tile
        bytes of the answer: each tile row's bytes repeated over its 16
        rows, written with row stride tile_cols over the first rows_padded
        rows; rows past the tiles stay 0. One copy on the current stream
        (an expanded view, nothing allocated)."""
        for spec in self.specs:
            if spec.kind != "nvfp4":
                continue
            o = self.outputs[spec.name]
            tb = o["_tile_bytes"]
            tr, tc = tb.shape
            rp = o["rowwise_scale_inv"].shape[0]
            flat = o["rowwise_scale_inv"].view(-1)[:rp * tc].view(rp, tc)
            flat[:tr * NVFP4_TILE].view(tr, NVFP4_TILE, tc).copy_(
                tb.unsqueeze(1).expand(tr, NVFP4_TILE, tc))

    # -- TransformerEngine's model weights --

    def write_te(self, model_weights: Sequence[Any], outputs: Optional[Dict[str, Any]] = None,
                 manual_post_all_gather_processing: bool = False) -> None:
        """Stores the last step's scales on TE quantized model weights as
        TE's cast does: _scale_inv (FP8 current), _rowwise_scale_inv (FP8
        block, MXFP8, NVFP4: its first rows_padded * tile_cols bytes, TE's
        writes), _columnwise_scale_inv (MXFP8), _amax_rowwise (NVFP4); and,
        unless manual_post_all_gather_processing, what TE does to every
        weight of the bucket besides: _reset_caches() (FP8 current),
        update_usage(rowwise_usage=True, columnwise_usage=False) (FP8 block,
        NVFP4)."""
        outputs = outputs or self.outputs
        for spec, mw in zip(self.specs, model_weights):
            o = outputs[spec.name]
            if not manual_post_all_gather_processing:
                if spec.kind == "fp8_current" and hasattr(mw, "_reset_caches"):
                    mw._reset_caches()
                elif spec.kind in ("fp8_block", "nvfp4") and hasattr(mw, "update_usage"):
                    mw.update_usage(rowwise_usage=True, columnwise_usage=False)
            if spec.kind == "fp8_current":
                mw._scale_inv.view(1).copy_(o["scale_inv"])
            elif spec.kind == "fp8_block":
                mw._rowwise_scale_inv.copy_(o["rowwise_scale_inv"])
            elif spec.kind == "mxfp8":
                mw._rowwise_scale_inv.copy_(o["rowwise_scale_inv"])
                mw._columnwise_scale_inv.copy_(o["columnwise_scale_inv"])
            else:
                tc = _cdiv(spec.cols, NVFP4_TILE)
                rp = mw._rowwise_scale_inv.shape[0]
                k = rp * tc
                mw._rowwise_scale_inv.view(-1)[:k].copy_(o["rowwise_scale_inv"].view(-1)[:k])
                if getattr(mw, "_amax_rowwise", None) is not None:
                    mw._amax_rowwise.copy_(o["amax_rowwise"])

    def cast_te(self, model_weights: Sequence[Any], master_weights: Sequence[Any],
                outputs: Optional[Dict[str, Any]] = None) -> None:
        """Casts each rank's master fragment into TE model weights with TE's
        own partial-cast kernels and the reconciled scales, as utils.py does
        after its all-reduce (needs transformer_engine; not for FSDP-sharded
        model weights)."""
        import transformer_engine_torch as tex  # noqa: F401 (TE's extension)
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
        outputs = outputs or self.outputs
        for spec, mw, master, (s, n) in zip(self.specs, model_weights, master_weights,
                                            self.ranges):
            if master is None or n == 0:
                continue
            master = master.to(mw.dtype)
            o, h, w = outputs[spec.name], spec.rows, spec.cols
            q = mw._get_quantizer()
            if spec.kind == "fp8_current":
                fq = Float8Quantizer(scale=o["scale"], amax=_torch().Tensor(), fp8_dtype=mw._fp8_dtype)
                fq.update_quantized(master, mw.reshape(-1)[s:s + n])
            elif spec.kind == "fp8_block":
                tex.fp8_block_scaling_partial_cast(master, mw._rowwise_data.reshape(-1)[s:s + n],
                                                   o["scale"], h, w, s, q.block_len, q.dtype)
            elif spec.kind == "mxfp8":
                tex.mxfp8_scaling_partial_cast(master, mw._rowwise_data.reshape(-1)[s:s + n],
                                               mw._columnwise_data.reshape(-1)[s:s + n],
                                               o["rowwise_scale_inv"], o["columnwise_scale_inv"],
                                               h, w, s)
            else:
                # The tile decode scale as float: the E4M3 byte's value, which
                # nvfp4_2d_partial_cast_kernel rounds to E4M3 again (the same
                # value) where TE passes the unrounded per_block_scale.
                frag = mw._rowwise_data.view(-1)[s // 2:(s + n + 1) // 2]
                tex.nvfp4_2d_partial_cast(master, frag, o["tile_scale_inv"], o["global_scale"],
                                          h, w, s, NVFP4_TILE)


_CASTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def quantize_master_weights(model_weights: Sequence[Any], master_weights: Sequence[Any],
                            start_offsets: Sequence[Optional[int]], group: Any = None, *,
                            client: Any, names: Optional[Sequence[str]] = None,
                            cast: bool = False,
                            manual_post_all_gather_processing: bool = False,
                            path: str = "auto") -> Dict[str, Dict[str, Any]]:
    """TE's quantize_master_weights through amaxd. model_weights: TE
    quantized tensors (their scales are written in place) or WeightSpecs;
    master_weights: this rank's shards (None or empty where it holds none);
    start_offsets: where each shard starts. group is not used (amaxd
    reconciles over the job's ranks); client: a joined amaxd.Client of the
    data-parallel job. The first call registers the weights (names: one per
    weight, the same on every rank; default "w0", "w1", ...); later calls
    with the same weights and ranges reuse that registration. Returns
    {name: {field: tensor}}; cast=True also casts the fragments with TE's
    kernels (TE model weights only; not FSDP-sharded model weights, nor
    Float8 weights that keep only a transpose). The per-step tensors of
    the first call's Caster are reused: copy what must outlive a step.
    path: the Caster's ("auto": GPU-direct for CUDA master weights when the
    daemon offers it, else packed; "device"; "packed"); the Caster of a
    call is _CASTERS[client][key], its .path the one taken.
    fsdp_shard_model_weights is not supported."""
    del group
    names = list(names) if names is not None else [f"w{i}" for i in range(len(model_weights))]
    specs = [mw if isinstance(mw, WeightSpec) else WeightSpec.from_te(nm, mw)
             for nm, mw in zip(names, model_weights)]
    numels = [0 if m is None else int(m.numel()) for m in master_weights]
    starts = [0 if s is None else int(s) for s in start_offsets]
    key = (tuple(specs), tuple(starts), tuple(numels), path)
    per_client = _CASTERS.setdefault(client, {})
    c = per_client.get(key)
    if c is None:
        c = per_client[key] = Caster(client, specs, starts, numels, path=path)
    out = c.step(master_weights)
    te_weights = [mw for mw in model_weights if not isinstance(mw, WeightSpec)]
    if te_weights and len(te_weights) == len(model_weights):
        for mw in model_weights:  # as TE does first, for every model weight
            if hasattr(mw, "clear_high_precision_init_val"):
                mw.clear_high_precision_init_val()
        c.write_te(model_weights, manual_post_all_gather_processing=manual_post_all_gather_processing)
        if cast:
            c.cast_te(model_weights, master_weights)
    return out
