"""The protobuf wire format, written by hand where protobuf's Python objects
cost too much or would get in the way; every other message goes through
protobuf's generated classes (amaxd._gen.amaxd_pb2).

- RegisterRequest: building QuantizerSpec objects for 100k quantizers costs
  seconds, encoding them here ~1 us each.
- SendPackedRequest: the slab is copied once, into the message, after an
  `align` padding field chosen so that the values start 16-byte aligned in
  it (the daemon then reads them in place).
- ReconcilePackedResponse: read field by field, each array a numpy view of
  the answer's bytes at its offset.
- grpc.health.v1 HealthCheckRequest / HealthCheckResponse: one field each,
  so that this package never registers health.proto and cannot clash with
  grpcio-health-checking in the same process.

Field numbers and wire types come from the generated descriptors (a field
renamed or removed in the .proto fails at import), never from literal tag
bytes, except for the two health messages, whose .proto this package does
not load. tests/e2e/test_wire.py compares every field written or read here
with protobuf's own serialization and parsing.
"""
import math
import struct
from typing import Any, Dict, Iterable, MutableMapping, Optional, Tuple

import numpy as np
from google.protobuf.descriptor import FieldDescriptor

from ._gen import amaxd_pb2 as pb
from .types import Quantizer, peer_mode_value

__all__ = ["varint", "read_varint", "spec_bytes", "register_head", "encode_send_packed",
           "parse_reconcile_packed", "encode_health_check", "parse_health_status"]


def varint(n: int) -> bytes:
    """n >= 0 as a protobuf base-128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(b: Any, i: int) -> Tuple[int, int]:
    """The varint at b[i:] and the index after it."""
    v = shift = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            return v, i
        shift += 7


# -- keys (tags) from the generated descriptors --

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_WIRE_TYPE = {
    FieldDescriptor.TYPE_DOUBLE: _I64, FieldDescriptor.TYPE_FIXED64: _I64,
    FieldDescriptor.TYPE_SFIXED64: _I64, FieldDescriptor.TYPE_FLOAT: _I32,
    FieldDescriptor.TYPE_FIXED32: _I32, FieldDescriptor.TYPE_SFIXED32: _I32,
    FieldDescriptor.TYPE_STRING: _LEN, FieldDescriptor.TYPE_BYTES: _LEN,
    FieldDescriptor.TYPE_MESSAGE: _LEN,
}


def _is_repeated(f: FieldDescriptor) -> bool:
    rep = getattr(f, "is_repeated", None)  # protobuf >= 6; `label` before
    if rep is None:
        rep = getattr(f, "label") == FieldDescriptor.LABEL_REPEATED
    return bool(rep)


def _key(msg: Any, name: str) -> bytes:
    """The key of field `name` of message class `msg` as protobuf writes it
    (a repeated number is packed: proto3's default)."""
    f = msg.DESCRIPTOR.fields_by_name[name]
    wt = _WIRE_TYPE.get(f.type, _VARINT)
    if _is_repeated(f) and wt != _LEN:
        wt = _LEN
    return varint(f.number << 3 | wt)


_REG_JOB = _key(pb.RegisterRequest, "job")
_REG_RANK = _key(pb.RegisterRequest, "rank")
_REG_QUANTIZER = _key(pb.RegisterRequest, "quantizers")

_QS = pb.QuantizerSpec
_QS_NAME, _QS_GLOBAL_SHAPE, _QS_RECIPE = (_key(_QS, "name"), _key(_QS, "global_shape"),
                                          _key(_QS, "recipe"))
_QS_ACCUMULATION, _QS_PEER_GROUP, _QS_SCALE_GROUP = (
    _key(_QS, "accumulation"), _key(_QS, "peer_group"), _key(_QS, "scale_group"))
_QS_OFFSET, _QS_LOCAL_SHAPE = _key(_QS, "offset"), _key(_QS, "local_shape")
_QS_PEER_MODE, _QS_GLOBAL_AXES = _key(_QS, "peer_mode"), _key(_QS, "global_axes")
_QS_CALIBRATOR = _key(_QS, "calibrator")

_SP = pb.SendPackedRequest
_SP_JOB, _SP_RANK, _SP_EPOCH = _key(_SP, "job"), _key(_SP, "rank"), _key(_SP, "epoch")
_SP_LAYOUT_ID, _SP_VALUES = _key(_SP, "layout_id"), _key(_SP, "values")
_SP_HAS_DATA, _SP_ALIGN = _key(_SP, "has_data"), _key(_SP, "align")
_SP_STATS, _SP_STAT_EPOCHS = _key(_SP, "stats"), _key(_SP, "stat_epochs")
assert len(_SP_ALIGN) == 1, "encode_send_packed counts on a one-byte key for align"


def _len_field(key: bytes, body: bytes) -> bytes:
    return key + varint(len(body)) + body


def _str_field(key: bytes, v: str) -> bytes:
    return _len_field(key, v.encode())


def _packed_uints(key: bytes, vals: Iterable[int]) -> bytes:
    return _len_field(key, b"".join(varint(int(x)) for x in vals))


# -- RegisterRequest --

def register_head(job: str, rank: int) -> bytes:
    """RegisterRequest's job and rank fields; append spec_bytes() of each
    quantizer to make a whole request."""
    return _str_field(_REG_JOB, job) + (_REG_RANK + varint(rank) if rank else b"")


def spec_bytes(q: Quantizer, cache: MutableMapping[Any, bytes]) -> bytes:
    """RegisterRequest.quantizers field holding q's QuantizerSpec, as
    protobuf serializes it (defaults left out, fields in number order; the
    name is written even when empty). `cache` maps recipes to their
    encoded field: pass the same dict for all quantizers of one request."""
    r = q.recipe
    # Recipe(margin=-0.0) == Recipe(margin=0.0), but protobuf writes -0.0
    # and leaves 0.0 out: the signs keep the two apart in the cache.
    ck = (r, math.copysign(1.0, r.margin), math.copysign(1.0, r.eps))
    rb = cache.get(ck)
    if rb is None:
        rb = _len_field(_QS_RECIPE, r.to_pb().SerializeToString())
        cache[ck] = rb
    parts = [_str_field(_QS_NAME, q.name)]
    if len(q.global_shape):
        parts.append(_packed_uints(_QS_GLOBAL_SHAPE, q.global_shape))
    parts.append(rb)
    if q.accumulation:
        parts.append(_QS_ACCUMULATION + varint(int(q.accumulation)))
    if q.peer_group:
        parts.append(_str_field(_QS_PEER_GROUP, q.peer_group))
    if q.scale_group:
        parts.append(_str_field(_QS_SCALE_GROUP, q.scale_group))
    if q.placement is not None:
        if len(q.placement.offset):
            parts.append(_packed_uints(_QS_OFFSET, q.placement.offset))
        if len(q.placement.local_shape):
            parts.append(_packed_uints(_QS_LOCAL_SHAPE, q.placement.local_shape))
    if q.peer_mode is not None and peer_mode_value(q.peer_mode):
        parts.append(_QS_PEER_MODE + varint(peer_mode_value(q.peer_mode)))
    if q.global_axes:
        parts.append(_QS_GLOBAL_AXES + varint(int(q.global_axes)))
    c = q.calibrator
    if c is not None and c.kind:
        cb = cache.get(("calibrator", c))
        if cb is None:
            cb = _len_field(_QS_CALIBRATOR, c.to_pb().SerializeToString())
            cache[("calibrator", c)] = cb
        parts.append(cb)
    return _len_field(_REG_QUANTIZER, b"".join(parts))


# -- SendPackedRequest --

def encode_send_packed(job: str, rank: int, epoch: int, layout_id: int, values: np.ndarray,
                       has_data: Optional[np.ndarray] = None,
                       stats: Optional[np.ndarray] = None,
                       stat_epochs: Optional[np.ndarray] = None) -> bytes:
    """A serialized SendPackedRequest; `values` (float32, contiguous) is
    copied once, into the message, 16-byte aligned in it. The values come
    last, after has_data, the statistics (float64 `stats` and uint64
    `stat_epochs`, calibrators beyond max) and the align field (not
    protobuf's field order; any order parses the same); job and layout_id
    are written even when empty or 0."""
    head = [_str_field(_SP_JOB, job)]
    if rank:
        head += [_SP_RANK, varint(rank)]
    if epoch:
        head += [_SP_EPOCH, varint(epoch)]
    head += [_SP_LAYOUT_ID, struct.pack("<Q", layout_id)]
    parts: list = [b"".join(head)]
    pos = len(parts[0])
    if has_data is not None:
        h = _SP_HAS_DATA + varint(has_data.nbytes)
        parts += [h, memoryview(has_data).cast("B")]
        pos += len(h) + has_data.nbytes
    for key, arr in ((_SP_STATS, stats), (_SP_STAT_EPOCHS, stat_epochs)):
        if arr is not None:
            h = key + varint(arr.nbytes)
            parts += [h, memoryview(np.ascontiguousarray(arr)).cast("B")]
            pos += len(h) + arr.nbytes
    nbytes = values.nbytes
    vh = _SP_VALUES + varint(nbytes)
    # The align field: its key, a 1-byte length and 0..15 zero bytes.
    need = (-(pos + 2 + len(vh))) % 16
    parts += [_SP_ALIGN + bytes([need]) + bytes(need), vh, memoryview(values).cast("B")]
    return b"".join(parts)


# -- ReconcilePackedResponse --

# The dtype of each bytes field (the .proto's comments); align is skipped.
_RPR_ARRAYS = {"amax": "<f4", "scale": "<f4", "scale_inv": "<f4", "block_scales": "u1",
               "global_amax": "<f4", "global_scale": "<f4", "global_scale_inv": "<f4",
               "missing": "<u4", "has_previous": "u1", "previous_global_amax": "<f4",
               "previous_global_scale": "<f4", "filled": "u1", "global_amaxes": "<f4",
               "global_scales": "<f4", "global_scale_invs": "<f4", "stat_state": "u1",
               "stat_epoch": "<u8", "stat_total": "<f8", "stat_overflow": "<f8",
               "stat_basis": "<f4"}
_RPR_FIELDS = {f.number: (f.name, _WIRE_TYPE.get(f.type, _VARINT), f.type)
               for f in pb.ReconcilePackedResponse.DESCRIPTOR.fields}
assert {n for n, wt, _ in _RPR_FIELDS.values() if wt == _LEN} == set(_RPR_ARRAYS) | {"align"}, \
    "a bytes field of ReconcilePackedResponse has no dtype in wire._RPR_ARRAYS"
_RPR_DTYPES = {k: np.dtype(v) for k, v in _RPR_ARRAYS.items()}


def parse_reconcile_packed(raw: Any) -> Dict[str, Any]:
    """The fields present in a serialized ReconcilePackedResponse (bytes or
    a memoryview): numbers as int (bool fields as bool), arrays as
    numpy views of `raw` (read-only when it is). As protobuf does, the last
    occurrence of a field wins and unknown fields are skipped."""
    out: Dict[str, Any] = {}
    b, i, end = raw, 0, len(raw)
    while i < end:
        key, i = read_varint(b, i)
        num, wt = key >> 3, key & 7
        f = _RPR_FIELDS.get(num)
        if f is not None and f[1] != wt:
            f = None  # a known number with another wire type: unknown, as for protobuf
        if wt == _VARINT:
            v, i = read_varint(b, i)
            if f is not None:
                out[f[0]] = bool(v) if f[2] == FieldDescriptor.TYPE_BOOL else v
        elif wt == _I64:
            if f is not None:
                out[f[0]] = struct.unpack_from("<Q", b, i)[0]
            i += 8
        elif wt == _I32:
            i += 4
        elif wt == _LEN:
            ln, i = read_varint(b, i)
            if f is not None and f[0] in _RPR_DTYPES:
                dt = _RPR_DTYPES[f[0]]
                out[f[0]] = np.frombuffer(b, dtype=dt, count=ln // dt.itemsize, offset=i)
            i += ln
        else:
            raise ValueError(f"ReconcilePackedResponse: wire type {wt} at byte {i}")
        if i > end:
            raise ValueError(f"ReconcilePackedResponse: a field ends at byte {i} of {end}")
    return out


# -- grpc.health.v1 (health.proto: HealthCheckRequest.service = 1, a
#    string; HealthCheckResponse.status = 1, an enum) --

_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def encode_health_check(service: str) -> bytes:
    """A serialized HealthCheckRequest."""
    return _str_field(b"\x0a", service) if service else b""


def parse_health_status(raw: bytes) -> str:
    """HealthCheckResponse.status by name ("SERVING", "NOT_SERVING", ...;
    "UNKNOWN" for a value this client does not know)."""
    status, i, end = 0, 0, len(raw)
    while i < end:
        key, i = read_varint(raw, i)
        wt = key & 7
        if wt == _VARINT:
            v, i = read_varint(raw, i)
            if key >> 3 == 1:
                status = v
        elif wt == _I64:
            i += 8
        elif wt == _I32:
            i += 4
        elif wt == _LEN:
            ln, i = read_varint(raw, i)
            i += ln
        else:
            break
    return _HEALTH_STATUS.get(status, "UNKNOWN")
