"""The packed per-rank form: a rank's slab layout (Layout) and its answers
in layout order (PackedResult: numpy views of the bytes that came off the
wire, no per-quantizer work, no copies beyond the one into the request and
gRPC's own). The requests and the answer are encoded and parsed by hand in
wire.py (proto/amaxd/v1/amaxd.proto: SendPackedRequest,
ReconcilePackedResponse).
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ._gen import amaxd_pb2 as pb
from .types import Masked, Result, Stat, as_f32, as_f64, as_mask, to_bool_array
from .wire import encode_send_packed, parse_reconcile_packed, read_varint, varint

# Layout and PackedResult live here; the rest is importable from here too,
# as it was before wire.py and types.py.
__all__ = ["Layout", "PackedResult", "encode_send_packed", "parse_reconcile_packed",
           "varint", "as_f32", "as_mask"]
_read_varint = read_varint


@dataclass
class Layout:
    """Where each of this rank's quantizers lies in its slab (layout order =
    the catalog's canonical order: names in byte order)."""

    id: int
    total_cells: int
    names: List[str]
    offsets: np.ndarray  # uint64, first slab cell of each quantizer
    ncells: np.ndarray  # uint64, cells of its block
    block_offsets: List[Tuple[int, ...]]
    block_shapes: List[Tuple[int, ...]]
    global_shapes: List[Tuple[int, ...]]
    formats: List[int]
    # Per quantizer: its global_axes k and its first global slice in the
    # answer's per-slice arrays (prod(block_shape[:k]) slices when k > 0).
    global_axes: List[int] = None  # type: ignore[assignment]  # None: all 0
    slice_offsets: np.ndarray = None  # type: ignore[assignment]  # uint64; None: all 0
    total_slices: int = 0
    # Calibrators beyond max: per quantizer its pb.CalibratorKind and first
    # value in the stat slab (float64); None / 0 when no quantizer has one.
    calibrators: Optional[List[int]] = None
    stat_offsets: Optional[np.ndarray] = None
    total_stats: int = 0

    def __post_init__(self) -> None:
        if self.global_axes is None:
            self.global_axes = [0] * len(self.names)
        if self.slice_offsets is None:
            self.slice_offsets = np.zeros(len(self.names), dtype=np.uint64)
        self.index: Dict[str, int] = {n: i for i, n in enumerate(self.names)}

    @staticmethod
    def from_pb(r: pb.GetLayoutResponse) -> "Layout":
        ndim = list(r.ndim)
        bo, bs, gs = list(r.block_offset), list(r.block_shape), list(r.global_shape)
        offs, shapes, gshapes = [], [], []
        k = 0
        for d in ndim:
            offs.append(tuple(bo[k:k + d]))
            shapes.append(tuple(bs[k:k + d]))
            gshapes.append(tuple(gs[k:k + d]))
            k += d
        n = len(r.names)
        return Layout(r.layout_id, r.total_cells, list(r.names),
                      np.array(r.slab_offset, dtype=np.uint64),
                      np.array(r.ncells, dtype=np.uint64), offs, shapes, gshapes,
                      list(r.format), list(r.global_axes) or [0] * n,
                      np.array(r.slice_offset or [0] * n, dtype=np.uint64),
                      r.total_slices, list(r.calibrator) or None,
                      np.array(r.stat_offset, dtype=np.uint64) if len(r.stat_offset) else None,
                      r.total_stats)

    def __len__(self) -> int:
        return len(self.names)

    def span(self, name: str) -> Tuple[int, int]:
        i = self.index[name]
        o = int(self.offsets[i])
        return o, o + int(self.ncells[i])

    def view(self, slab: np.ndarray, name: str) -> np.ndarray:
        """The block of quantizer `name` in a per-cell array of the slab (a view)."""
        a, b = self.span(name)
        return slab[a:b].reshape(self.block_shapes[self.index[name]])

    def stat_span(self, name: str) -> Tuple[int, int]:
        """Where quantizer `name`'s statistic lies in the stat slab."""
        if self.stat_offsets is None:
            raise ValueError(f"{name}: no quantizer of this layout has a calibrator beyond max")
        i = self.index[name]
        a = int(self.stat_offsets[i])
        b = int(self.stat_offsets[i + 1]) if i + 1 < len(self.names) else self.total_stats
        return a, b

    def pack_stats(self, stats: Mapping[str, Stat]) -> Tuple[np.ndarray, np.ndarray]:
        """{name: Stat} -> (stat slab float64, stat_epochs uint64 per
        quantizer); quantizers not named send no statistic (epoch 0, zeros).
        A histogram's statistic here has the overflow count (num_bins + 1
        values, as amaxd.calib.histogram returns)."""
        slab = np.zeros(self.total_stats, dtype="<f8")
        epochs = np.zeros(len(self.names), dtype="<u8")
        for name, st in stats.items():
            a, b = self.stat_span(name)
            v = as_f64(st.values)
            if v.size != b - a:
                raise ValueError(f"{name}: a statistic of {v.size} values, the layout has {b - a}")
            slab[a:b] = v
            epochs[self.index[name]] = int(st.epoch)
        return slab, epochs

    def empty(self, fill: float = 0.0) -> np.ndarray:
        """A slab to fill in place (float32, total_cells)."""
        return np.full(self.total_cells, fill, dtype=np.float32)

    def pack(self, amax: Mapping[str, object]) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """{name: block} -> (slab, has_data); quantizers not named, and masked
        cells (amaxd.Masked or numpy masked arrays), have no data."""
        slab = np.zeros(self.total_cells, dtype=np.float32)
        has = np.zeros(self.total_cells, dtype=np.uint8) if len(amax) < len(self.names) else None
        for name, v in amax.items():
            a, b = self.span(name)
            if isinstance(v, Masked):
                data = as_f32(v.values).reshape(-1)
                mask = to_bool_array(v.no_data)
                if mask.size != data.size:
                    raise ValueError(f"{name}: no-data mask of {mask.size} cells for "
                                     f"{data.size} values")
                v = np.ma.masked_array(data, mask=mask.reshape(-1))
            if isinstance(v, np.ma.MaskedArray):
                if has is None:
                    has = np.ones(self.total_cells, dtype=np.uint8)
                slab[a:b] = np.ma.getdata(v).reshape(-1)
                has[a:b] = ~np.ma.getmaskarray(v).reshape(-1)
            else:
                slab[a:b] = as_f32(v).reshape(-1)
                if has is not None:
                    has[a:b] = 1
        if has is not None:
            slab[has == 0] = 0.0
        return slab, has


_F32_ARRAYS = ("amax", "scale", "scale_inv", "global_amax", "global_scale", "global_scale_inv",
               "previous_global_amax", "previous_global_scale", "global_amaxes", "global_scales",
               "global_scale_invs")


class PackedResult:
    """One rank's results in layout order: per-cell arrays (amax, scale,
    scale_inv, block_scales, filled) and per-quantizer arrays (global_amax,
    global_scale, global_scale_inv, missing, has_previous,
    previous_global_amax, previous_global_scale), per-slice arrays
    (global_amaxes, global_scales, global_scale_invs: the global slices of
    quantizers with global_axes > 0, at Layout.slice_offsets), all
    read-only numpy views of the answer's bytes. result(name) gives one
    quantizer's views."""

    epoch: int
    next_epoch: int
    layout_id: int
    shm_bytes: int
    peer_fill_known: bool
    amax: np.ndarray
    scale: np.ndarray
    scale_inv: np.ndarray
    block_scales: np.ndarray
    global_amax: np.ndarray
    global_scale: np.ndarray
    global_scale_inv: np.ndarray
    missing: np.ndarray
    has_previous: np.ndarray
    previous_global_amax: np.ndarray
    previous_global_scale: np.ndarray
    filled: Optional[np.ndarray]  # None unless peer_fill_known
    global_amaxes: np.ndarray
    global_scales: np.ndarray
    global_scale_invs: np.ndarray

    def __init__(self, raw: Any, layout: Layout) -> None:
        """raw: a serialized ReconcilePackedResponse (bytes or memoryview),
        kept alive by the arrays that view it."""
        self.raw = raw
        self.layout = layout
        n, q = layout.total_cells, len(layout)
        f32, u8 = np.dtype("<f4"), np.dtype(np.uint8)
        # Fields the answer leaves out keep protobuf's defaults (0, empty).
        self.epoch = self.next_epoch = self.layout_id = self.shm_bytes = 0
        self.peer_fill_known = False
        empty_f = np.zeros(0, dtype=f32)
        for a in _F32_ARRAYS:
            setattr(self, a, empty_f)
        self.block_scales = np.zeros(0, dtype=u8)
        self.missing = np.zeros(0, dtype="<u4")
        self.has_previous = np.zeros(0, dtype=u8)
        self.filled = None
        self.stat_state = np.zeros(0, dtype=u8)
        self.stat_epoch = np.zeros(0, dtype="<u8")
        self.stat_total = self.stat_overflow = np.zeros(0, dtype="<f8")
        self.stat_basis = empty_f
        for name, v in parse_reconcile_packed(raw).items():
            setattr(self, name, v)
        if self.layout_id == layout.id and (len(self.amax) != n or len(self.global_amax) != q or
                                            len(self.global_amaxes) != layout.total_slices):
            raise ValueError(f"ReconcilePackedResponse: {len(self.amax)} cells, "
                             f"{len(self.global_amax)} quantizers and {len(self.global_amaxes)} "
                             f"global slices, the layout has {n}, {q} and {layout.total_slices}")
        if self.peer_fill_known and self.filled is None:
            self.filled = np.zeros(n, dtype=u8)

    @classmethod
    def from_device(cls, res: Any) -> "PackedResult":
        """A device answer (amaxd.device.DeviceResult) copied to host
        memory, as ReconcilePacked would give it, without `filled` and the
        calibrators' statistics. Synchronizes with the current stream of
        the buffers' device (the stream that waited for the answer)."""
        from .device import _torch
        keys = res.arrays()
        if "missing" not in keys:
            raise ValueError("this daemon's device answer has no missing counts (a daemon "
                             "before them): use reconcile_packed for host results")
        _torch().cuda.current_stream(res.amax.device).synchronize()
        r = cls.__new__(cls)
        r.raw, r.layout = None, res.layout
        r.epoch, r.next_epoch, r.layout_id = res.epoch, res.next_epoch, res.layout.id
        r.shm_bytes, r.peer_fill_known, r.filled = 0, False, None
        for k, v in keys.items():
            a = v.cpu().numpy()
            setattr(r, k, a.view("<u4") if k == "missing" else a)
        r.stat_state = np.zeros(0, np.uint8)
        r.stat_epoch = np.zeros(0, "<u8")
        r.stat_total = r.stat_overflow = np.zeros(0, "<f8")
        r.stat_basis = np.zeros(0, "<f4")
        return r

    def result(self, name: str) -> Result:
        """Quantizer `name`'s Result, its arrays views into this answer."""
        L = self.layout
        i = L.index[name]
        a, b = L.span(name)
        shape = L.block_shapes[i]
        has_prev = bool(self.has_previous[i])
        filled = None
        if self.filled is not None and self.peer_fill_known:
            filled = self.filled[a:b].reshape(shape).view(np.bool_)
        slices: List[Optional[np.ndarray]] = [None, None, None]
        k = L.global_axes[i]
        if k > 0 and b == a:  # an empty block overlaps no slice
            slices = [np.zeros(shape[:k], dtype=np.float32)] * 3
        elif k > 0:
            s0 = int(L.slice_offsets[i])
            s1 = s0 + int(np.prod(shape[:k], dtype=np.int64))
            slices = [self.global_amaxes[s0:s1].reshape(shape[:k]),
                      self.global_scales[s0:s1].reshape(shape[:k]),
                      self.global_scale_invs[s0:s1].reshape(shape[:k])]
        res = Result(name, L.block_offsets[i], shape, self.amax[a:b].reshape(shape),
                     self.scale[a:b].reshape(shape), self.scale_inv[a:b].reshape(shape),
                     self.block_scales[a:b].reshape(shape), float(self.global_amax[i]),
                     float(self.global_scale[i]), float(self.global_scale_inv[i]),
                     int(self.missing[i]), filled,
                     float(self.previous_global_amax[i]) if has_prev else None,
                     float(self.previous_global_scale[i]) if has_prev else None, *slices)
        if len(self.stat_state) and self.stat_state[i]:
            res.stat_state, res.stat_epoch = int(self.stat_state[i]), int(self.stat_epoch[i])
            res.stat_total, res.stat_overflow = float(self.stat_total[i]), float(
                self.stat_overflow[i])
            if res.stat_epoch:
                res.stat_basis = self.stat_basis[a:b].reshape(shape)
        return res

    def __getitem__(self, name: str) -> Result:
        return self.result(name)

    def __len__(self) -> int:
        return len(self.layout)

    def keys(self) -> Sequence[str]:
        return self.layout.names
