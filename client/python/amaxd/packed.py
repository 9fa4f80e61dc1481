"""The packed per-rank form: a rank's slab layout, requests encoded by hand
around one float32 buffer, and answers read as numpy views of the bytes
that came off the wire (no per-quantizer work, no copies beyond the one
into the request and gRPC's own).

Wire format notes (proto/amaxd/v1/amaxd.proto): SendPackedRequest puts the
values last, after an `align` padding field chosen so that they start
16-byte aligned in the message (the daemon then reads them in place);
ReconcilePackedResponse is parsed field by field here, each array becoming
a numpy view at its offset.
"""
import struct
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Layout", "PackedResult", "encode_send_packed", "parse_reconcile_packed",
           "varint", "as_f32", "as_mask"]


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(b, i):
    v = shift = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            return v, i
        shift += 7


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
    global_axes: List[int] = None
    slice_offsets: np.ndarray = None  # uint64
    total_slices: int = 0

    def __post_init__(self):
        if self.global_axes is None:
            self.global_axes = [0] * len(self.names)
        if self.slice_offsets is None:
            self.slice_offsets = np.zeros(len(self.names), dtype=np.uint64)
        self.index: Dict[str, int] = {n: i for i, n in enumerate(self.names)}

    @staticmethod
    def from_pb(r) -> "Layout":
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
                      r.total_slices)

    def __len__(self):
        return len(self.names)

    def span(self, name: str) -> Tuple[int, int]:
        i = self.index[name]
        o = int(self.offsets[i])
        return o, o + int(self.ncells[i])

    def view(self, slab: np.ndarray, name: str) -> np.ndarray:
        """The block of quantizer `name` in a per-cell array of the slab (a view)."""
        a, b = self.span(name)
        return slab[a:b].reshape(self.block_shapes[self.index[name]])

    def empty(self, fill: float = 0.0) -> np.ndarray:
        """A slab to fill in place (float32, total_cells)."""
        return np.full(self.total_cells, fill, dtype=np.float32)

    def pack(self, amax: Dict[str, object]) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """{name: block} -> (slab, has_data); quantizers not named, and masked
        cells (amaxd.Masked or numpy masked arrays), have no data."""
        from .client import Masked, _to_bool_array
        slab = np.zeros(self.total_cells, dtype=np.float32)
        has = np.zeros(self.total_cells, dtype=np.uint8) if len(amax) < len(self.names) else None
        for name, v in amax.items():
            a, b = self.span(name)
            if isinstance(v, Masked):
                data = as_f32(v.values).reshape(-1)
                mask = _to_bool_array(v.no_data)
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


def as_f32(values) -> np.ndarray:
    """A contiguous little-endian float32 numpy array of `values`: a numpy
    array as it is when it already is one; a torch tensor (CPU or CUDA)
    copied once to host memory as float32."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        import torch  # only when one was given
        t = values.detach()
        if t.dtype != torch.float32 or t.device.type != "cpu":
            t = t.to(device="cpu", dtype=torch.float32)
        values = t.contiguous().numpy()
    return np.ascontiguousarray(values, dtype="<f4").reshape(-1)


def as_mask(has_data) -> np.ndarray:
    if hasattr(has_data, "detach") and hasattr(has_data, "cpu"):
        has_data = has_data.detach().cpu().numpy()
    a = np.ascontiguousarray(has_data).reshape(-1)
    if a.dtype != np.uint8:
        a = a.astype(np.uint8) if a.dtype == np.bool_ else (a != 0).astype(np.uint8)
    return a


def encode_send_packed(job: str, rank: int, epoch: int, layout_id: int, values: np.ndarray,
                       has_data: Optional[np.ndarray] = None) -> bytes:
    """A serialized SendPackedRequest; `values` (float32, contiguous) is
    copied once, into the message, 16-byte aligned in it."""
    jb = job.encode()
    head = [b"\x0a", varint(len(jb)), jb]
    if rank:
        head += [b"\x10", varint(rank)]
    if epoch:
        head += [b"\x18", varint(epoch)]
    head += [b"\x21", struct.pack("<Q", layout_id)]
    parts = [b"".join(head)]
    pos = len(parts[0])
    if has_data is not None:
        h = b"\x32" + varint(has_data.nbytes)
        parts += [h, memoryview(has_data).cast("B")]
        pos += len(h) + has_data.nbytes
    nbytes = values.nbytes
    vh = b"\x2a" + varint(nbytes)
    # align field (15): tag 0x7a, a 1-byte length, padding: 2..17 bytes.
    need = (-(pos + 2 + len(vh))) % 16
    parts += [b"\x7a" + bytes([need]) + bytes(need), vh, memoryview(values).cast("B")]
    return b"".join(parts)


# ReconcilePackedResponse fields (amaxd.proto).
_F32_CELL = {4: "amax", 5: "scale", 6: "scale_inv"}
_F32_Q = {8: "global_amax", 9: "global_scale", 10: "global_scale_inv",
          13: "previous_global_amax", 14: "previous_global_scale"}
_F32_SLICE = {17: "global_amaxes", 18: "global_scales", 19: "global_scale_invs"}


class PackedResult:
    """One rank's results in layout order: per-cell arrays (amax, scale,
    scale_inv, block_scales, filled) and per-quantizer arrays (global_amax,
    global_scale, global_scale_inv, missing, has_previous,
    previous_global_amax, previous_global_scale), per-slice arrays
    (global_amaxes, global_scales, global_scale_invs: the global slices of
    quantizers with global_axes > 0, at Layout.slice_offsets), all
    read-only numpy views of the answer's bytes. result(name) gives one
    quantizer's views."""

    def __init__(self, raw: bytes, layout: Layout):
        self.raw = raw
        self.layout = layout
        self.epoch = self.next_epoch = self.layout_id = 0
        self.peer_fill_known = False
        n, q = layout.total_cells, len(layout)
        f32, u8 = np.dtype("<f4"), np.dtype(np.uint8)
        empty_f = np.zeros(0, dtype=f32)
        for a in list(_F32_CELL.values()) + list(_F32_Q.values()) + list(_F32_SLICE.values()):
            setattr(self, a, empty_f)
        self.block_scales = np.zeros(0, dtype=u8)
        self.missing = np.zeros(0, dtype="<u4")
        self.has_previous = np.zeros(0, dtype=u8)
        self.filled = None
        b, i, end = raw, 0, len(raw)
        while i < end:
            tag, i = _read_varint(b, i)
            f, wt = tag >> 3, tag & 7
            if wt == 0:
                v, i = _read_varint(b, i)
                if f == 1:
                    self.epoch = v
                elif f == 2:
                    self.next_epoch = v
                elif f == 15:
                    self.peer_fill_known = bool(v)
            elif wt == 1:
                if f == 3:
                    self.layout_id = struct.unpack_from("<Q", b, i)[0]
                i += 8
            elif wt == 5:
                i += 4
            elif wt == 2:
                ln, i = _read_varint(b, i)
                if f in _F32_CELL or f in _F32_Q or f in _F32_SLICE:
                    setattr(self, (_F32_CELL.get(f) or _F32_Q.get(f) or _F32_SLICE[f]),
                            np.frombuffer(b, dtype=f32, count=ln // 4, offset=i))
                elif f == 7:
                    self.block_scales = np.frombuffer(b, dtype=u8, count=ln, offset=i)
                elif f == 11:
                    self.missing = np.frombuffer(b, dtype="<u4", count=ln // 4, offset=i)
                elif f == 12:
                    self.has_previous = np.frombuffer(b, dtype=u8, count=ln, offset=i)
                elif f == 16:
                    self.filled = np.frombuffer(b, dtype=u8, count=ln, offset=i)
                i += ln
            else:
                raise ValueError(f"ReconcilePackedResponse: wire type {wt} at byte {i}")
        if self.layout_id == layout.id and (len(self.amax) != n or len(self.global_amax) != q or
                                            len(self.global_amaxes) != layout.total_slices):
            raise ValueError(f"ReconcilePackedResponse: {len(self.amax)} cells, "
                             f"{len(self.global_amax)} quantizers and {len(self.global_amaxes)} "
                             f"global slices, the layout has {n}, {q} and {layout.total_slices}")
        if self.peer_fill_known and self.filled is None:
            self.filled = np.zeros(n, dtype=u8)

    def result(self, name: str):
        """Quantizer `name`'s Result, its arrays views into this answer."""
        from .client import Result
        L = self.layout
        i = L.index[name]
        a, b = L.span(name)
        shape = L.block_shapes[i]
        has_prev = bool(self.has_previous[i])
        filled = None
        if self.peer_fill_known:
            filled = self.filled[a:b].reshape(shape).view(np.bool_)
        slices = [None, None, None]
        k = L.global_axes[i]
        if k > 0 and b == a:  # an empty block overlaps no slice
            slices = [np.zeros(shape[:k], dtype=np.float32)] * 3
        elif k > 0:
            s0 = int(L.slice_offsets[i])
            s1 = s0 + int(np.prod(shape[:k], dtype=np.int64))
            slices = [self.global_amaxes[s0:s1].reshape(shape[:k]),
                      self.global_scales[s0:s1].reshape(shape[:k]),
                      self.global_scale_invs[s0:s1].reshape(shape[:k])]
        return Result(name, L.block_offsets[i], shape, self.amax[a:b].reshape(shape),
                      self.scale[a:b].reshape(shape), self.scale_inv[a:b].reshape(shape),
                      self.block_scales[a:b].reshape(shape), float(self.global_amax[i]),
                      float(self.global_scale[i]), float(self.global_scale_inv[i]),
                      int(self.missing[i]), filled,
                      float(self.previous_global_amax[i]) if has_prev else None,
                      float(self.previous_global_scale[i]) if has_prev else None, *slices)

    def __getitem__(self, name: str):
        return self.result(name)

    def __len__(self):
        return len(self.layout)

    def keys(self) -> Sequence[str]:
        return self.layout.names
