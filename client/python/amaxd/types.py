"""What a trainer tells amaxd and what it gets back: the format and
convention constants, Recipe, Quantizer, Masked (a block with cells that
had no data), Result, and the conversions of numpy arrays, torch tensors
and Python numbers into the little-endian arrays that go on the wire.

The mapping of these types to protobuf messages (`to_pb`, `from_pb`) goes
through protobuf's own classes; the hand-written encoders are in wire.py.
"""
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import grpc
import numpy as np

from ._gen import amaxd_pb2 as pb
from .errors import AmaxdError
from .placement import Placement

__all__ = ["FP8_E4M3", "FP8_E5M2", "NVFP4", "MXFP8", "RUNNING_MAX", "PER_EPOCH", "Recipe",
           "Calibrator", "Quantizer", "Masked", "Stat", "Result", "peer_mode_value",
           "amax_update", "as_f32", "as_f64", "as_mask", "to_bool_array", "to_f32_bytes",
           "torch_cpu"]

FP8_E4M3 = pb.FP8_E4M3
FP8_E5M2 = pb.FP8_E5M2
NVFP4 = pb.NVFP4
MXFP8 = pb.MXFP8
RUNNING_MAX = pb.RUNNING_MAX
PER_EPOCH = pb.PER_EPOCH

_NVFP4_CONV = {"te": pb.TRANSFORMER_ENGINE, "modelopt": pb.MODELOPT,
               "te_legacy": pb.TRANSFORMER_ENGINE_LEGACY, "modelopt_static": pb.MODELOPT_STATIC,
               "te_partial_cast": pb.TRANSFORMER_ENGINE_PARTIAL_CAST}
# FP8 block scaling: the rule by the quantizer's input dtype (docs/NUMERICS.md).
_BLOCK_RULE = {"float32": pb.CURRENT, "bfloat16": pb.BLOCK_BF16, "float16": pb.BLOCK_FP16}
_OUTPUT_CONV = {"te": pb.OUTPUT_TRANSFORMER_ENGINE, "modelopt": pb.OUTPUT_MODELOPT}
_HISTORY_CONV = {"te": pb.HISTORY_TRANSFORMER_ENGINE,
                 "te_unfused": pb.HISTORY_TRANSFORMER_ENGINE_UNFUSED}
_MXFP8_CONV = {"te": pb.MXFP8_TRANSFORMER_ENGINE, "ocp": pb.MXFP8_OCP,
               "modelopt": pb.MXFP8_MODELOPT, "te_legacy": pb.MXFP8_TRANSFORMER_ENGINE_LEGACY,
               "te_2_18": pb.MXFP8_TRANSFORMER_ENGINE_2_18}
_PEER_MODE = {"fill": pb.PEER_FILL, "share": pb.PEER_SHARE}

_F4 = np.dtype("<f4")
# protobuf takes ints for enum fields; its generated stubs name only the
# enum types: the messages Recipe and Quantizer build are made through this.
_pb: Any = pb


def _conv(table: Mapping[str, int], what: str, name: str) -> int:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} convention {name!r}: use one of {sorted(table)}") from None


def peer_mode_value(name: str) -> int:
    """The pb.PeerMode of a Quantizer.peer_mode name ("fill" or "share")."""
    try:
        return _PEER_MODE[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown peer_mode {name!r}: use one of {sorted(_PEER_MODE)}") from None


@dataclass(frozen=True)
class Recipe:
    """A scale recipe (see docs/NUMERICS.md for every convention and its source)."""

    format: int = FP8_E4M3
    rule: int = 0  # pb.CURRENT / pb.DELAYED / pb.BLOCK_BF16 / pb.BLOCK_FP16 for FP8
    margin: float = 0.0
    history_len: int = 0
    history_reduce: int = 0  # pb.HISTORY_MAX / pb.MOST_RECENT
    eps: float = 0.0
    power_of_2: bool = False
    nvfp4_convention: int = 0  # pb.Nvfp4Convention
    output_convention: int = 0  # pb.OutputConvention
    history_convention: int = 0  # pb.HistoryConvention
    mxfp8_convention: int = 0  # pb.Mxfp8Convention

    @staticmethod
    def fp8_current(fmt: int = FP8_E4M3, eps: float = 0.0, power_of_2: bool = False,
                    output: str = "te") -> "Recipe":
        """output: "te" (scale_inv = 1/scale) or "modelopt" (amax / fp8_max, ModelOpt's export)."""
        return Recipe(format=fmt, rule=pb.CURRENT, eps=eps, power_of_2=power_of_2,
                      output_convention=_conv(_OUTPUT_CONV, "output", output))

    @staticmethod
    def fp8_block(fmt: int = FP8_E4M3, eps: float = 0.0, power_of_2: bool = True,
                  input_dtype: str = "float32") -> "Recipe":
        """TE's FP8 block scaling (1x128 or 128x128 blocks: the quantizer's
        shape and placements say which): current scaling per block, TE's
        amax_epsilon and force_pow_2_scales (its default True). input_dtype:
        "float32" (also TE's master-weight cast, whatever the dtype),
        "bfloat16" or "float16" (TE's block quantizer kernels on that input:
        an overflowing scale becomes its largest value, not FLT_MAX)."""
        return Recipe(format=fmt, rule=_conv(_BLOCK_RULE, "FP8 block input_dtype", input_dtype),
                      eps=eps, power_of_2=power_of_2)

    @staticmethod
    def fp8_delayed(fmt: int = FP8_E4M3, margin: float = 0.0, history_len: int = 1,
                    reduce: str = "max", history: str = "te") -> "Recipe":
        """history: "te" (TE's fused update: a zero epoch leaves the history alone) or
        "te_unfused" (every epoch rolls the window)."""
        r = pb.MOST_RECENT if reduce == "most_recent" else pb.HISTORY_MAX
        return Recipe(format=fmt, rule=pb.DELAYED, margin=margin, history_len=history_len,
                      history_reduce=r,
                      history_convention=_conv(_HISTORY_CONV, "history", history))

    @staticmethod
    def nvfp4(convention: str = "te", output: str = "te") -> "Recipe":
        """convention: "te" (current TE), "te_legacy" (TE <= 2.13), "modelopt" (dynamic),
        "modelopt_static" (static export), "te_partial_cast" (TE's cast of sharded master
        weights to NVFP4 2D); output: "te" or "modelopt" (global_scale_inv)."""
        return Recipe(format=NVFP4, nvfp4_convention=_conv(_NVFP4_CONV, "NVFP4", convention),
                      output_convention=_conv(_OUTPUT_CONV, "output", output))

    @staticmethod
    def mxfp8(convention: str = "te") -> "Recipe":
        """convention: "te" (TE main, 2.19 on: TE's E8M0, rounded up; scales 2^(127-e) /
        2^(e-127) for every byte, byte 0: 2^127 / 2^-127), "ocp" (the same), "modelopt"
        (ModelOpt's ceil(log2(amax/448)) in float32; scales as "ocp"), "te_legacy" (TE <= 2.12:
        byte 0 encodes 1 and decodes 0, byte 254 encodes 0) or "te_2_18" (TE 2.13 to 2.18:
        byte 0 encodes 2^127 but decodes 0)."""
        return Recipe(format=MXFP8, mxfp8_convention=_conv(_MXFP8_CONV, "MXFP8", convention))

    def to_pb(self) -> pb.Recipe:
        return _pb.Recipe(format=self.format, rule=self.rule, margin=self.margin,
                         history_len=self.history_len, history_reduce=self.history_reduce,
                         eps=self.eps, power_of_2=self.power_of_2,
                         nvfp4_convention=self.nvfp4_convention,
                         output_convention=self.output_convention,
                         history_convention=self.history_convention,
                         mxfp8_convention=self.mxfp8_convention)


_METHOD = {"entropy": pb.ENTROPY, "percentile": pb.PERCENTILE, "mse": pb.HISTOGRAM_MSE}
_GRID = {"int": pb.GRID_INT, "e4m3": pb.GRID_E4M3}
_TORCH_CPU = {"avx2": pb.TORCH_CPU_AVX2, "avx512": pb.TORCH_CPU_AVX512,
              "default": pb.TORCH_CPU_DEFAULT}


def torch_cpu(name: Optional[str] = None) -> int:
    """The pb.TorchCpu of a torch CPU build: `name` ("avx2", "avx512",
    "default"), or this process's torch (torch.backends.cpu.
    get_cpu_capability(); AVX2 when torch is not installed or says
    something else). It names whose float32 linspace and sum a calibrator
    reproduces (docs/NUMERICS.md); every rank must declare the same."""
    if name is None:
        try:
            import torch  # only to ask which kernels it runs
            name = str(torch.backends.cpu.get_cpu_capability()).lower()
        except Exception:  # no torch: the common x86-64 build
            name = "avx2"
        if name not in _TORCH_CPU:
            name = "avx2"
    return _conv(_TORCH_CPU, "torch_cpu", name)


@dataclass(frozen=True)
class Calibrator:
    """How a quantizer's data becomes its amax (docs/API.md, "Calibration
    beyond max"). The default is the max. Build the others with
    Calibrator.histogram(), Calibrator.mse() and Calibrator.nvfp4_mse();
    their defaults are ModelOpt 0.47's."""

    kind: int = 0  # pb.CalibratorKind
    num_bins: int = 0
    method: int = 0  # pb.HistogramMethod
    percentile: float = 0.0
    start_bin: int = 0
    stride: int = 0
    skip_zeros: bool = False
    num_bits: int = 0
    is_unsigned: bool = False
    grid: int = 0  # pb.SearchGrid
    torch_cpu: int = 0  # pb.TorchCpu
    start_multiplier: float = 0.0
    stop_multiplier: float = 0.0
    step_size: float = 0.0

    @staticmethod
    def histogram(method: str = "percentile", num_bins: int = 2048, *,
                  percentile: float = 99.99, start_bin: int = 128, stride: int = 1,
                  num_bits: int = 8, unsigned: bool = False, grid: str = "int",
                  skip_zeros: bool = False, torch_cpu_build: Optional[str] = None
                  ) -> "Calibrator":
        """ModelOpt's HistogramCalibrator with compute_amax(method): "entropy"
        (num_bits, unsigned, start_bin, stride), "percentile" (percentile) or
        "mse" (grid "int" with num_bits and unsigned, or "e4m3"; start_bin,
        stride). torch_cpu_build: whose CPU arithmetic to reproduce (None:
        this process's torch)."""
        m = _conv(_METHOD, "histogram method", method)
        c = dict(kind=pb.CALIBRATOR_HISTOGRAM, num_bins=int(num_bins), method=m,
                 skip_zeros=bool(skip_zeros), torch_cpu=torch_cpu(torch_cpu_build))
        if m == pb.PERCENTILE:
            c.update(percentile=float(percentile))
        elif m == pb.ENTROPY:
            c.update(num_bits=int(num_bits), is_unsigned=bool(unsigned), start_bin=int(start_bin),
                     stride=int(stride))
        else:
            g = _conv(_GRID, "grid", grid)
            c.update(grid=g, start_bin=int(start_bin), stride=int(stride))
            if g == pb.GRID_INT:
                c.update(num_bits=int(num_bits), is_unsigned=bool(unsigned))
        return Calibrator(**c)

    @staticmethod
    def mse(start_multiplier: float = 0.25, stop_multiplier: float = 4.0, step_size: float = 0.1,
            torch_cpu_build: Optional[str] = None) -> "Calibrator":
        """ModelOpt's MseCalibrator: candidates torch.linspace(start, stop,
        ceil((stop - start) / step) + 1) times the agreed max."""
        return Calibrator(kind=pb.CALIBRATOR_MSE, torch_cpu=torch_cpu(torch_cpu_build),
                          start_multiplier=float(start_multiplier),
                          stop_multiplier=float(stop_multiplier), step_size=float(step_size))

    @staticmethod
    def nvfp4_mse() -> "Calibrator":
        """ModelOpt's NVFP4MSECalibrator (``mse_calibrate(fp8_scale_sweep=True)``)
        on static NVFP4 weight blocks: phase 1 reconciles the max and fixes
        the global amax, phase 2 each block's owner searches its 126 FP8
        E4M3 scale candidates against it (amaxd.calib.nvfp4_mse_amax) and
        sends the chosen amax. No options."""
        return Calibrator(kind=pb.CALIBRATOR_NVFP4_MSE)

    @property
    def nsteps(self) -> int:
        """MSE: the number of candidates (ModelOpt's ceil((stop - start) / step) + 1);
        NVFP4_MSE: 126."""
        import math
        if self.kind == pb.CALIBRATOR_NVFP4_MSE:
            return 126
        return math.ceil((self.stop_multiplier - self.start_multiplier) / self.step_size) + 1

    def to_pb(self) -> pb.Calibrator:
        return _pb.Calibrator(kind=self.kind, num_bins=self.num_bins, method=self.method,
                              percentile=self.percentile, start_bin=self.start_bin,
                              stride=self.stride, skip_zeros=self.skip_zeros,
                              num_bits=self.num_bits, is_unsigned=self.is_unsigned,
                              grid=self.grid, torch_cpu=self.torch_cpu,
                              start_multiplier=self.start_multiplier,
                              stop_multiplier=self.stop_multiplier, step_size=self.step_size)


@dataclass(frozen=True)
class Quantizer:
    """A quantizer as this rank sees it. `placement` None means the whole tensor."""

    name: str
    global_shape: Sequence[int]
    recipe: Recipe = Recipe()
    placement: Optional[Placement] = None
    accumulation: int = 0
    peer_group: str = ""
    scale_group: str = ""
    # How the peer group combines its members: "fill" (cells without data take
    # the group's max; the default) or "share" (every cell takes the group's
    # max, ModelOpt's MoE rule). None: the default. Needs peer_group.
    peer_mode: Optional[str] = None
    # 0: one global amax; k > 0: one per index of the first k axes of
    # global_shape (e.g. 1 on [E, R, C/16] NVFP4 blocks: per-expert globals).
    global_axes: int = 0
    # None: the max. Calibrator.histogram() or Calibrator.mse(): a statistic
    # summed over the ranks decides the amax (docs/API.md).
    calibrator: Optional[Calibrator] = None

    def __post_init__(self) -> None:
        if self.peer_mode is not None:
            peer_mode_value(self.peer_mode)

    def to_pb(self) -> pb.QuantizerSpec:
        mode = 0 if self.peer_mode is None else peer_mode_value(self.peer_mode)
        q: pb.QuantizerSpec = _pb.QuantizerSpec(name=self.name, global_shape=[int(d) for d in self.global_shape],
                             recipe=self.recipe.to_pb(), accumulation=self.accumulation,
                             peer_group=self.peer_group, scale_group=self.scale_group,
                             peer_mode=mode, global_axes=int(self.global_axes))
        if self.calibrator is not None and self.calibrator.kind != 0:
            q.calibrator.CopyFrom(self.calibrator.to_pb())
        if self.placement is not None:
            q.offset.extend(int(o) for o in self.placement.offset)
            q.local_shape.extend(int(d) for d in self.placement.local_shape)
        return q


@dataclass(frozen=True)
class Masked:
    """Amax values with the cells this rank had no data for (an expert that
    received no tokens): `no_data` is a bool array or torch bool tensor of
    the same shape (or one bool for a scalar), True where there is no data.
    The values of those cells are not sent. `values` may be numpy, torch or
    Python numbers. Same meaning as a numpy masked array (masked = no data)."""

    values: object
    no_data: object


@dataclass(frozen=True)
class Stat:
    """A statistic for a quantizer with a calibrator beyond max (send it as
    the quantizer's value in Client.send): `values` float64 (histogram:
    num_bins counts, optionally then the overflow count; MSE: nsteps losses
    per cell of the rank's block, shape [cells, nsteps] or flat; NVFP4_MSE:
    the chosen amax of each block of the rank's block); `epoch`
    the stat_epoch of the Result whose basis it was computed against;
    `amax` optionally this rank's max in the same message (None: none)."""

    values: object
    epoch: int
    amax: object = None


@dataclass
class Result:
    """One quantizer's reconciled state, restricted to this rank's block."""

    name: str
    offset: tuple
    shape: tuple
    amax: np.ndarray
    scale: np.ndarray
    scale_inv: np.ndarray
    block_scales: np.ndarray  # uint8: NVFP4 E4M3 block scale or MXFP8 E8M0
    global_amax: float
    global_scale: float
    global_scale_inv: float
    missing: int
    # Cells their peer group raised in the last epoch, as a bool array: cells
    # without data that took the group's max (cold experts), and with
    # peer_mode "share" also cells whose own amax was below it; None when the
    # daemon's state backend does not report it.
    peer_filled: Optional[np.ndarray] = None
    # The epoch before the last one's global amax and scale (None after the
    # quantizer's first epoch).
    previous_global_amax: Optional[float] = None
    previous_global_scale: Optional[float] = None
    # Quantizers with global_axes = k > 0: the global amax, scale and inverse
    # of each slice this block overlaps, shaped like the block's first k axes
    # (shape[:k]; the slice of block index i is global index offset[:k] + i).
    # None when global_axes is 0.
    global_amaxes: Optional[np.ndarray] = None
    global_scales: Optional[np.ndarray] = None
    global_scale_invs: Optional[np.ndarray] = None
    # Calibrators beyond max (0 / None for max quantizers): pb.StatState,
    # the epoch that fixed the basis (echo it in Stat.epoch), the basis per
    # cell (histogram: the range top g; MSE: each cell's agreed max),
    # histogram counts summed so far and values counted above the range.
    stat_state: int = 0
    stat_epoch: int = 0
    stat_basis: Optional[np.ndarray] = None
    stat_total: float = 0.0
    stat_overflow: float = 0.0

    def _stat_from(self, parts: Sequence[pb.QuantizerResult]) -> "Result":
        r = parts[0]
        if r.stat_state:
            self.stat_state, self.stat_epoch = r.stat_state, r.stat_epoch
            self.stat_total, self.stat_overflow = r.stat_total, r.stat_overflow
            if all(len(p.stat_basis) for p in parts):
                b = b"".join(p.stat_basis for p in parts)
                self.stat_basis = np.frombuffer(b, dtype="<f4").reshape(self.shape)
        return self

    @staticmethod
    def from_pb(r: pb.QuantizerResult) -> "Result":
        """One whole result: read-only numpy views of the message's bytes."""
        if r.first_cell or r.global_axes:
            return Result.from_parts([r])  # windows, or global slices to reshape
        shape = tuple(r.shape)
        fb = np.frombuffer
        amax = fb(r.amax, _F4)
        n = amax.size
        if (shape and n != int(np.prod(shape))) or (not shape and n != 1):
            return Result.from_parts([r])  # says what is wrong
        filled = None
        if r.peer_fill_known:
            filled = (fb(r.filled, np.bool_) if r.peer_filled
                      else np.zeros(n, dtype=np.bool_)).reshape(shape)
        prev = r.has_previous
        return Result(r.name, tuple(r.offset), shape, amax.reshape(shape),
                      fb(r.scale, _F4).reshape(shape), fb(r.scale_inv, _F4).reshape(shape),
                      fb(r.block_scales, np.uint8).reshape(shape), r.global_amax,
                      r.global_scale, r.global_scale_inv, r.missing, filled,
                      r.previous_global_amax if prev else None,
                      r.previous_global_scale if prev else None)._stat_from([r])

    @staticmethod
    def from_parts(parts: Sequence[pb.QuantizerResult]) -> "Result":
        """One result from the windows of it that GetScales returned (in order)."""
        r = parts[0]
        shape = tuple(r.shape)
        ncells = int(np.prod(shape, dtype=np.int64)) if shape else 1
        pos = 0
        for p in parts:
            if p.first_cell != pos:
                raise AmaxdError(grpc.StatusCode.INTERNAL,
                                 f"{r.name}: a window starts at cell {p.first_cell}, "
                                 f"expected {pos}")
            pos += len(p.amax) // 4
        if pos != ncells:
            raise AmaxdError(grpc.StatusCode.INTERNAL, f"{r.name}: {pos} of {ncells} cells returned")

        # One window (the usual case): read-only views of the message's
        # bytes, no copy; several: one concatenation each.
        def cat(field: str, dtype: Any) -> np.ndarray:
            if len(parts) == 1:
                return np.frombuffer(getattr(r, field), dtype=dtype).reshape(shape)
            b = b"".join(getattr(p, field) for p in parts)
            return np.frombuffer(b, dtype=dtype).reshape(shape)

        slices: list = [None, None, None]
        k = r.global_axes
        if k > 0:
            bs = int(np.prod(shape[k:], dtype=np.int64))
            nsl = int(np.prod(shape[:k], dtype=np.int64))
            for i, fld in enumerate(("global_amaxes", "global_scales", "global_scale_invs")):
                out = np.zeros(nsl, dtype="<f4")
                for p in parts:  # windows: slices [first_cell // bs, ...) of the block
                    v = np.frombuffer(getattr(p, fld), dtype="<f4")
                    j0 = p.first_cell // bs
                    out[j0:j0 + len(v)] = v
                slices[i] = out.reshape(shape[:k])
        filled = None
        if all(p.peer_fill_known for p in parts):
            if len(parts) == 1 and not r.peer_filled:
                filled = np.zeros(shape, dtype=np.bool_)
            elif len(parts) == 1:
                filled = np.frombuffer(r.filled, dtype=np.bool_).reshape(shape)
            else:
                filled = np.concatenate([
                    np.frombuffer(p.filled, dtype=np.uint8) if p.peer_filled
                    else np.zeros(len(p.amax) // 4, dtype=np.uint8)
                    for p in parts]).reshape(shape) != 0
        return Result(r.name, tuple(r.offset), shape, cat("amax", "<f4"), cat("scale", "<f4"),
                      cat("scale_inv", "<f4"), cat("block_scales", np.uint8),
                      r.global_amax, r.global_scale, r.global_scale_inv,
                      sum(p.missing for p in parts), filled,
                      r.previous_global_amax if r.has_previous else None,
                      r.previous_global_scale if r.has_previous else None,
                      *slices)._stat_from(parts)


# -- numpy arrays, torch tensors and numbers as the arrays sent --

def _is_torch(x: object) -> bool:
    return hasattr(x, "detach") and hasattr(x, "cpu")


def to_f32_bytes(values: object) -> bytes:
    """numpy arrays, Python scalars/lists and torch tensors -> float32 LE bytes."""
    if _is_torch(values):
        values = values.detach().float().cpu().numpy()  # type: ignore[attr-defined]
    return np.ascontiguousarray(np.asarray(values, dtype="<f4")).tobytes()


def to_bool_array(mask: object) -> np.ndarray:
    """A no-data mask (numpy or torch, bool only) as a numpy bool array."""
    if _is_torch(mask):
        mask = mask.detach().cpu().numpy()  # type: ignore[attr-defined]
    a = np.asarray(mask)
    if a.dtype != np.bool_:
        raise TypeError(f"a no-data mask must be bool, not {a.dtype}")
    return a


def as_f32(values: object) -> np.ndarray:
    """A contiguous little-endian float32 numpy array of `values`: a numpy
    array as it is when it already is one; a torch tensor (CPU or CUDA)
    copied once to host memory as float32."""
    if _is_torch(values):
        import torch  # only when one was given
        t = values.detach()  # type: ignore[attr-defined]
        if t.dtype != torch.float32 or t.device.type != "cpu":
            t = t.to(device="cpu", dtype=torch.float32)
        values = t.contiguous().numpy()
    return np.ascontiguousarray(values, dtype="<f4").reshape(-1)


def as_mask(has_data: object) -> np.ndarray:
    """A has-data mask (numpy or torch, bool or numbers; 0 = no data) as
    contiguous uint8, one byte per cell."""
    if _is_torch(has_data):
        has_data = has_data.detach().cpu().numpy()  # type: ignore[attr-defined]
    a = np.ascontiguousarray(has_data).reshape(-1)
    if a.dtype != np.uint8:
        a = a.astype(np.uint8) if a.dtype == np.bool_ else (a != 0).astype(np.uint8)
    return a


def as_f64(values: object) -> np.ndarray:
    """A contiguous little-endian float64 numpy array of `values` (numpy,
    torch on any device, numbers), flattened."""
    if _is_torch(values):
        import torch  # only when one was given
        values = values.detach().to(device="cpu", dtype=torch.float64).contiguous().numpy()  # type: ignore[attr-defined]
    return np.ascontiguousarray(values, dtype="<f8").reshape(-1)


def amax_update(name: str, values: object) -> pb.AmaxUpdate:
    """An AmaxUpdate from an array, or from a Masked / numpy masked array
    whose masked cells had no data on this rank (e.g. experts that received
    no tokens), or from a Stat (a calibrator's statistic, with or without
    a max)."""
    if isinstance(values, Stat):
        u = amax_update(name, values.amax) if values.amax is not None else pb.AmaxUpdate(name=name)
        u.stat = as_f64(values.values).tobytes()
        u.stat_epoch = int(values.epoch)
        return u
    if isinstance(values, Masked):
        mask = to_bool_array(values.no_data)
        data = values.values
        if _is_torch(data):
            data = data.detach().float().cpu().numpy()  # type: ignore[attr-defined]
        data = np.asarray(data, dtype="<f4")
        if mask.shape != data.shape:
            raise ValueError(f"{name}: no-data mask of shape {mask.shape} for values of shape "
                             f"{data.shape}")
        values = np.ma.masked_array(data, mask=mask)
    if isinstance(values, np.ma.MaskedArray):
        mask = np.ma.getmaskarray(values)
        data = np.ma.getdata(values)
        return pb.AmaxUpdate(name=name, values=to_f32_bytes(np.where(mask, 0, data)),
                             has_data=(~mask).astype(np.uint8).tobytes())
    return pb.AmaxUpdate(name=name, values=to_f32_bytes(values))
