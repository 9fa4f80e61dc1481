"""The amaxd client: one trainer rank talking to the daemon on its node."""
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, Mapping, Optional, Sequence

import grpc
import numpy as np

from ._gen import amaxd_pb2 as pb
from .errors import AmaxdError, FailedPrecondition, ResourceExhausted, from_rpc_error
from .packed import Layout, PackedResult, as_f32, as_mask, encode_send_packed, varint as _varint
from .placement import Placement

DEFAULT_SOCKET = "/run/amaxd/amaxd.sock"
_SVC = "/amaxd.v1.Calibration/"

FP8_E4M3 = pb.FP8_E4M3
FP8_E5M2 = pb.FP8_E5M2
NVFP4 = pb.NVFP4
MXFP8 = pb.MXFP8
RUNNING_MAX = pb.RUNNING_MAX
PER_EPOCH = pb.PER_EPOCH


_NVFP4_CONV = {"te": pb.TRANSFORMER_ENGINE, "modelopt": pb.MODELOPT,
               "te_legacy": pb.TRANSFORMER_ENGINE_LEGACY, "modelopt_static": pb.MODELOPT_STATIC}
_OUTPUT_CONV = {"te": pb.OUTPUT_TRANSFORMER_ENGINE, "modelopt": pb.OUTPUT_MODELOPT}
_HISTORY_CONV = {"te": pb.HISTORY_TRANSFORMER_ENGINE,
                 "te_unfused": pb.HISTORY_TRANSFORMER_ENGINE_UNFUSED}
_MXFP8_CONV = {"te": pb.MXFP8_TRANSFORMER_ENGINE, "ocp": pb.MXFP8_OCP,
               "modelopt": pb.MXFP8_MODELOPT, "te_legacy": pb.MXFP8_TRANSFORMER_ENGINE_LEGACY,
               "te_2_18": pb.MXFP8_TRANSFORMER_ENGINE_2_18}
_PEER_MODE = {"fill": pb.PEER_FILL, "share": pb.PEER_SHARE}


_F4 = np.dtype("<f4")


def _conv(table, what, name):
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} convention {name!r}: use one of {sorted(table)}") from None


def _peer_mode(name):
    try:
        return _PEER_MODE[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown peer_mode {name!r}: use one of {sorted(_PEER_MODE)}") from None


@dataclass(frozen=True)
class Recipe:
    """A scale recipe (see docs/NUMERICS.md for every convention and its source)."""

    format: int = FP8_E4M3
    rule: int = 0  # pb.CURRENT / pb.DELAYED for FP8
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
    def fp8_current(fmt=FP8_E4M3, eps=0.0, power_of_2=False, output="te"):
        """output: "te" (scale_inv = 1/scale) or "modelopt" (amax / fp8_max, ModelOpt's export)."""
        return Recipe(format=fmt, rule=pb.CURRENT, eps=eps, power_of_2=power_of_2,
                      output_convention=_conv(_OUTPUT_CONV, "output", output))

    @staticmethod
    def fp8_delayed(fmt=FP8_E4M3, margin=0.0, history_len=1, reduce="max", history="te"):
        """history: "te" (TE's fused update: a zero epoch leaves the history alone) or
        "te_unfused" (every epoch rolls the window)."""
        r = pb.MOST_RECENT if reduce == "most_recent" else pb.HISTORY_MAX
        return Recipe(format=fmt, rule=pb.DELAYED, margin=margin, history_len=history_len,
                      history_reduce=r,
                      history_convention=_conv(_HISTORY_CONV, "history", history))

    @staticmethod
    def nvfp4(convention="te", output="te"):
        """convention: "te" (current TE), "te_legacy" (TE <= 2.13), "modelopt" (dynamic),
        "modelopt_static" (static export); output: "te" or "modelopt" (global_scale_inv)."""
        return Recipe(format=NVFP4, nvfp4_convention=_conv(_NVFP4_CONV, "NVFP4", convention),
                      output_convention=_conv(_OUTPUT_CONV, "output", output))

    @staticmethod
    def mxfp8(convention="te"):
        """convention: "te" (TE main, 2.19 on: TE's E8M0, rounded up; scales 2^(127-e) /
        2^(e-127) for every byte, byte 0: 2^127 / 2^-127), "ocp" (the same), "modelopt"
        (ModelOpt's ceil(log2(amax/448)) in float32; scales as "ocp"), "te_legacy" (TE <= 2.12:
        byte 0 encodes 1 and decodes 0, byte 254 encodes 0) or "te_2_18" (TE 2.13 to 2.18:
        byte 0 encodes 2^127 but decodes 0)."""
        return Recipe(format=MXFP8, mxfp8_convention=_conv(_MXFP8_CONV, "MXFP8", convention))

    def to_pb(self):
        return pb.Recipe(format=self.format, rule=self.rule, margin=self.margin,
                         history_len=self.history_len, history_reduce=self.history_reduce,
                         eps=self.eps, power_of_2=self.power_of_2,
                         nvfp4_convention=self.nvfp4_convention,
                         output_convention=self.output_convention,
                         history_convention=self.history_convention,
                         mxfp8_convention=self.mxfp8_convention)


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

    def __post_init__(self):
        if self.peer_mode is not None:
            _peer_mode(self.peer_mode)

    def to_pb(self):
        mode = 0 if self.peer_mode is None else _peer_mode(self.peer_mode)
        q = pb.QuantizerSpec(name=self.name, global_shape=[int(d) for d in self.global_shape],
                             recipe=self.recipe.to_pb(), accumulation=self.accumulation,
                             peer_group=self.peer_group, scale_group=self.scale_group,
                             peer_mode=mode, global_axes=int(self.global_axes))
        if self.placement is not None:
            q.offset.extend(int(o) for o in self.placement.offset)
            q.local_shape.extend(int(d) for d in self.placement.local_shape)
        return q


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

    @staticmethod
    def from_pb(r):
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
                      r.previous_global_scale if prev else None)

    @staticmethod
    def from_parts(parts):
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
        def cat(field, dtype):
            if len(parts) == 1:
                return np.frombuffer(getattr(r, field), dtype=dtype).reshape(shape)
            b = b"".join(getattr(p, field) for p in parts)
            return np.frombuffer(b, dtype=dtype).reshape(shape)

        slices = [None, None, None]
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
                      r.previous_global_scale if r.has_previous else None, *slices)


def _str_field(num: int, v: str) -> bytes:
    b = v.encode()
    return bytes([(num << 3) | 2]) + _varint(len(b)) + b


def _packed_u32(num: int, vals) -> bytes:
    body = b"".join(_varint(int(x)) for x in vals)
    return bytes([(num << 3) | 2]) + _varint(len(body)) + body


def _spec_bytes(q: "Quantizer", cache) -> bytes:
    """RegisterRequest.quantizers field (3) holding q's QuantizerSpec, as
    protobuf would serialize it (defaults left out)."""
    rb = cache.get(q.recipe)
    if rb is None:
        rb = q.recipe.to_pb().SerializeToString()
        rb = b"\x1a" + _varint(len(rb)) + rb
        cache[q.recipe] = rb
    parts = [_str_field(1, q.name)]
    if len(q.global_shape):
        parts.append(_packed_u32(2, q.global_shape))
    parts.append(rb)
    if q.accumulation:
        parts.append(b"\x20" + _varint(int(q.accumulation)))
    if q.peer_group:
        parts.append(_str_field(5, q.peer_group))
    if q.scale_group:
        parts.append(_str_field(6, q.scale_group))
    if q.placement is not None:
        if len(q.placement.offset):
            parts.append(_packed_u32(7, q.placement.offset))
        if len(q.placement.local_shape):
            parts.append(_packed_u32(8, q.placement.local_shape))
    if q.peer_mode is not None and _peer_mode(q.peer_mode):
        parts.append(b"\x48" + _varint(_peer_mode(q.peer_mode)))
    if q.global_axes:
        parts.append(b"\x50" + _varint(int(q.global_axes)))
    body = b"".join(parts)
    return b"\x1a" + _varint(len(body)) + body


def _to_f32_bytes(values) -> bytes:
    """numpy arrays, Python scalars/lists and torch tensors -> float32 LE bytes."""
    if hasattr(values, "detach") and hasattr(values, "cpu"):  # a torch tensor
        values = values.detach().float().cpu().numpy()
    return np.ascontiguousarray(np.asarray(values, dtype="<f4")).tobytes()


@dataclass(frozen=True)
class Masked:
    """Amax values with the cells this rank had no data for (an expert that
    received no tokens): `no_data` is a bool array or torch bool tensor of
    the same shape (or one bool for a scalar), True where there is no data.
    The values of those cells are not sent. `values` may be numpy, torch or
    Python numbers. Same meaning as a numpy masked array (masked = no data)."""

    values: object
    no_data: object


def _to_bool_array(mask):
    if hasattr(mask, "detach") and hasattr(mask, "cpu"):  # a torch tensor
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.dtype != np.bool_:
        raise TypeError(f"a no-data mask must be bool, not {mask.dtype}")
    return mask


def _update(name, values):
    """An AmaxUpdate from an array, or from a Masked / numpy masked array
    whose masked cells had no data on this rank (e.g. experts that received
    no tokens)."""
    if isinstance(values, Masked):
        mask = _to_bool_array(values.no_data)
        data = values.values
        if hasattr(data, "detach") and hasattr(data, "cpu"):
            data = data.detach().float().cpu().numpy()
        data = np.asarray(data, dtype="<f4")
        if mask.shape != data.shape:
            raise ValueError(f"{name}: no-data mask of shape {mask.shape} for values of shape "
                             f"{data.shape}")
        values = np.ma.masked_array(data, mask=mask)
    if isinstance(values, np.ma.MaskedArray):
        mask = np.ma.getmaskarray(values)
        data = np.ma.getdata(values)
        return pb.AmaxUpdate(name=name, values=_to_f32_bytes(np.where(mask, 0, data)),
                             has_data=(~mask).astype(np.uint8).tobytes())
    return pb.AmaxUpdate(name=name, values=_to_f32_bytes(values))


def _pwrite_all(fd, arr, offset):
    mv = memoryview(arr).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)


def _pread_all(fd, n, offset):
    """n bytes at offset, as a read-only memoryview of fresh memory (the
    answer's arrays are views of it; the next answer overwrites the file,
    not them)."""
    buf = np.empty(n, dtype=np.uint8)
    mv = memoryview(buf)
    done = 0
    while done < n:
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got == 0:
            raise OSError(f"amaxd: the shared buffer ends {done} bytes into an answer of {n}")
        done += got
    return mv.toreadonly()


def _target(socket, address):
    if address:
        return address
    path = socket or os.environ.get("AMAXD_SOCKET") or DEFAULT_SOCKET
    return path if path.startswith("unix:") else "unix:" + path


class Client:
    """A connection of one rank of one job to its node's daemon.

    Use as a context manager. Every method raises an amaxd.errors.AmaxdError
    subclass on a gRPC error status.
    """

    def __init__(self, job: str, rank: int, world_size: int, *, socket: Optional[str] = None,
                 address: Optional[str] = None, timeout: float = 600.0,
                 max_message_bytes: int = 64 << 20, shm: bool = False):
        """shm=True: the packed form passes slabs and answers through a
        shared-memory buffer the daemon makes in its shm_dir (the trainer
        must run on the daemon's host and see that directory); the named
        form is unchanged."""
        self.job, self.rank, self.world_size = job, int(rank), int(world_size)
        self.shm = bool(shm)
        self._shm = None  # (slab fd, id, has_data offset, answer fd)
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        opts = [("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", -1)]
        self._channel = grpc.insecure_channel(_target(socket, address), options=opts)
        self._calls = {}
        self._layout: Optional[Layout] = None
        self.epoch = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._close_shm()
        self._channel.close()

    def _close_shm(self):
        if self._shm is not None:
            os.close(self._shm[0])
            os.close(self._shm[3])
            self._shm = None

    def _unary(self, method, req, resp_cls, timeout=None):
        fn = self._calls.get(method)
        if fn is None:
            fn = self._channel.unary_unary(_SVC + method, request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=resp_cls.FromString)
            self._calls[method] = fn
        try:
            return fn(req, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _raw(self, method, data: bytes, parse, timeout=None):
        """A unary call with a request serialized already; parse(bytes) or
        the raw answer when parse is None."""
        key = (method, "raw")
        fn = self._calls.get(key)
        if fn is None:
            fn = self._channel.unary_unary(_SVC + method)
            self._calls[key] = fn
        try:
            out = fn(data, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return parse(out) if parse is not None else out

    # -- the API --

    def join(self, timeout=None):
        """Blocks until all world_size ranks have joined; returns the open epoch."""
        r = self._unary("Join", pb.JoinRequest(job=self.job, rank=self.rank,
                                               world_size=self.world_size), pb.JoinResponse, timeout)
        self.epoch = r.epoch
        return r

    def register(self, quantizers: Iterable[Quantizer], batch: int = 20000):
        """Registers quantizers, `batch` per request (a request is decoded
        whole by the daemon, within its max_request_memory). Each request
        is atomic; the answer sums created and existing over all of them,
        with the catalog size after the last."""
        # Encoded by hand (_spec_bytes): building protobuf objects for
        # 100k quantizers costs seconds; this costs ~1 us each.
        cache: Dict[Recipe, bytes] = {}
        qs = [_spec_bytes(q, cache) for q in quantizers]
        head = _str_field(1, self.job) + (b"\x10" + _varint(self.rank) if self.rank else b"")
        total = pb.RegisterResponse()
        for i in range(0, max(len(qs), 1), batch):
            req = head + b"".join(qs[i:i + batch])
            r = self._raw("RegisterQuantizers", req, pb.RegisterResponse.FromString)
            total.created += r.created
            total.existing += r.existing
            total.catalog_size = r.catalog_size
        return total

    def _send_req(self, amax: Mapping[str, object], epoch: int):
        return pb.SendAmaxRequest(job=self.job, rank=self.rank, epoch=epoch,
                                  updates=[_update(n, v) for n, v in amax.items()])

    def _epoch(self, epoch):
        # Updates are for the epoch this client saw open (Join, Reconcile):
        # one that arrives after that epoch was reconciled is refused
        # (FAILED_PRECONDITION) instead of landing in the next one. 0 means
        # "whatever epoch is open now".
        return self.epoch if epoch is None else epoch

    def _tracked(self, epoch, fn):
        """Runs fn(); when it was refused because the epoch this client
        tracked is closed, learns the open epoch (so that the next call
        goes to it) and re-raises."""
        try:
            return fn()
        except FailedPrecondition:
            if epoch is None and self.epoch:
                try:
                    jobs = self.status(self.job).jobs
                    if jobs:
                        self.epoch = jobs[0].epoch
                except AmaxdError:
                    pass
            raise

    def send(self, amax: Mapping[str, object], epoch: Optional[int] = None):
        """Merges {name: local amax block} into the epoch this client saw
        open (atomic); `epoch` overrides it (0: whatever is open). A block
        is a numpy array, torch tensor or number; cells without data are
        given as Masked(values, no_data_mask) (numpy or torch bool mask) or
        as a numpy masked array."""
        return self._tracked(epoch, lambda: self._unary(
            "SendAmax", self._send_req(amax, self._epoch(epoch)), pb.SendAmaxResponse))

    def stream(self, batches: Iterable[Mapping[str, object]], epoch: Optional[int] = None):
        """Sends many batches on one client-streaming call; returns the total accepted."""
        epoch = self._epoch(epoch)
        fn = self._channel.stream_unary(_SVC + "StreamAmax",
                                        request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=pb.SendAmaxResponse.FromString)
        try:
            return fn((self._send_req(b, epoch) for b in batches), timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def reconcile(self, names: Sequence[str] = (), epoch: Optional[int] = None,
                  timeout=None) -> Dict[str, Result]:
        """Ends this rank's epoch (the one this client saw open; `epoch`
        overrides it, 0: whatever is open); blocks until every rank did;
        returns {name: Result}."""
        req = pb.ReconcileRequest(job=self.job, rank=self.rank, epoch=self._epoch(epoch),
                                  names=list(names))
        r = self._tracked(epoch, lambda: self._unary("Reconcile", req, pb.ReconcileResponse,
                                                     timeout))
        self.epoch = r.next_epoch
        return {q.name: Result.from_pb(q) for q in r.results}

    # -- the packed form (amaxd/packed.py) --

    def layout(self, refresh: bool = False) -> Layout:
        """This rank's slab layout (fetched once after register(); again
        with refresh=True, or when the daemon says it changed)."""
        if self._layout is None or refresh:
            r = self._unary("GetLayout", pb.GetLayoutRequest(job=self.job, rank=self.rank,
                                                             shm=self.shm),
                            pb.GetLayoutResponse)
            if self.shm:
                # Opened now: the daemon unlinks the file at its first use.
                fds = []
                try:
                    for path, mode in ((r.shm_path, os.O_RDWR), (r.shm_answer_path, os.O_RDONLY)):
                        fds.append(os.open(path, mode | os.O_CLOEXEC | os.O_NOFOLLOW))
                except OSError as e:
                    for fd in fds:
                        os.close(fd)
                    raise OSError(e.errno, f"amaxd: cannot open the daemon's shared buffer "
                                           f"{e.filename} ({e.strerror}); is this process on the "
                                           f"daemon's host and does it see its shm_dir? "
                                           f"Use Client(shm=False) otherwise") from None
                self._close_shm()
                self._shm = (fds[0], r.shm_id, r.shm_has_data_offset, fds[1])
            self._layout = Layout.from_pb(r)
        return self._layout

    def _packed_req(self, values, has_data, epoch, inline=False):
        L = self.layout()
        v = as_f32(values)
        if v.size != L.total_cells:
            raise ValueError(f"send_packed: {v.size} values, the layout has {L.total_cells} cells")
        m = None
        if has_data is not None:
            m = as_mask(has_data)
            if m.size != L.total_cells:
                raise ValueError(f"send_packed: has_data has {m.size} entries, the layout has "
                                 f"{L.total_cells} cells")
        if self._shm is not None and not inline:
            fd, sid, hd_off, _ = self._shm
            _pwrite_all(fd, v, 0)
            if m is not None:
                _pwrite_all(fd, m, hd_off)
            return pb.SendPackedRequest(job=self.job, rank=self.rank, epoch=self._epoch(epoch),
                                        layout_id=L.id, shm_id=sid,
                                        shm_has_data=m is not None).SerializeToString()
        return encode_send_packed(self.job, self.rank, self._epoch(epoch), L.id, v, m)

    def send_packed(self, values, has_data=None, epoch: Optional[int] = None):
        """Merges one slab (float32 per cell of layout(), numpy or torch, CPU
        or CUDA; copied once) into the epoch; has_data: optional per-cell
        mask (bool/uint8; 0 = no data). A stale layout raises
        FailedPrecondition: call layout(refresh=True) and repack."""
        data = self._packed_req(values, has_data, epoch)
        return self._tracked(epoch, lambda: self._raw("SendPacked", data,
                                                      pb.SendAmaxResponse.FromString))

    def stream_packed(self, slabs: Iterable, epoch: Optional[int] = None):
        """Sends slabs (values, or (values, has_data)) on one stream."""
        def gen():
            for s in slabs:
                v, m = s if isinstance(s, tuple) else (s, None)
                # In the messages: gRPC may still hold one when the next is made.
                yield self._packed_req(v, m, epoch, inline=True)
        fn = self._channel.stream_unary(_SVC + "StreamPacked",
                                        response_deserializer=pb.SendAmaxResponse.FromString)
        try:
            return fn(gen(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def reconcile_packed(self, epoch: Optional[int] = None, timeout=None) -> PackedResult:
        """Reconcile with the answer packed in layout order (PackedResult:
        numpy views of the answer, no per-quantizer copies). When the
        daemon answers in a newer layout (a quantizer of this rank was
        refused by agreement during the epoch), the layout is re-fetched."""
        L = self.layout()
        shm = self._shm
        req = pb.ReconcilePackedRequest(job=self.job, rank=self.rank, epoch=self._epoch(epoch),
                                        layout_id=L.id,
                                        shm_id=shm[1] if shm else 0).SerializeToString()
        raw = self._tracked(epoch, lambda: self._raw("ReconcilePacked", req, None, timeout))
        if shm is not None:
            n = pb.ReconcilePackedResponse.FromString(raw).shm_bytes
            if n:  # else the daemon could not use the buffer: the answer is in the message
                raw = _pread_all(shm[3], n, 0)
        res = PackedResult(raw, L)
        if res.layout_id != L.id:
            res = PackedResult(raw, self.layout(refresh=True))
        self.epoch = res.next_epoch
        return res

    def get_scales(self, names: Sequence[str] = (), whole: bool = False,
                   window_cells: Optional[int] = None) -> Dict[str, Result]:
        """The last reconciled results. Fetched in windows of `window_cells`
        cells (default: what fits in max_message_bytes); a window the daemon
        refuses as too large is halved."""
        mmb = self.max_message_bytes
        window = window_cells or max(1, (mmb - min(mmb // 8, 1 << 20)) // 14)
        for _ in range(8):
            parts, epoch = self._windows(names, whole, window)
            if parts is not None:
                return {n: Result.from_parts(p) for n, p in parts.items()}
        raise AmaxdError(grpc.StatusCode.ABORTED,
                         f"epochs kept being reconciled while the results were read (last {epoch})")

    def _windows(self, names, whole, window):
        """All windows of one answer; (None, epoch) when an epoch was
        reconciled between two of them (the windows would mix epochs)."""
        parts: Dict[str, list] = {}
        start, epoch = 0, None
        while True:
            req = pb.GetScalesRequest(job=self.job, rank=self.rank, names=list(names),
                                      start_cell=start, max_cells=window, **{"global": whole})
            try:
                r = self._unary("GetScales", req, pb.GetScalesResponse)
            except ResourceExhausted:
                if window <= 1:
                    raise
                window //= 2
                continue
            if epoch is None:
                epoch = r.epoch
            elif r.epoch != epoch:
                return None, r.epoch
            got = 0
            for q in r.results:
                parts.setdefault(q.name, []).append(q)
                got += len(q.amax) // 4
            start += got
            if got == 0 or start >= r.total_cells:
                return parts, epoch

    def export(self, path: str, names: Sequence[str] = ()) -> int:
        """Writes the job's last reconciled scales (whole tensors; `names`:
        only those) to a safetensors file (amaxd/export.py describes it);
        returns the epoch written."""
        from . import export as ex
        infos = [q for q in self.list_quantizers().quantizers if q.agreed]
        if names:
            want = set(names)
            infos = [q for q in infos if q.name in want]
        if not infos:
            jobs = self.status(self.job).jobs
            epoch = jobs[0].reconciled_epochs if jobs else 0
            ex.write(path, {}, ex.metadata(self.job, epoch, []))
            return epoch
        mmb = self.max_message_bytes
        window = max(1, (mmb - min(mmb // 8, 1 << 20)) // 14)
        for _ in range(8):
            parts, epoch = self._windows([q.name for q in infos], True, window)
            if parts is not None:
                break
        else:
            raise AmaxdError(grpc.StatusCode.ABORTED,
                             "epochs kept being reconciled while the results were read")
        results = {n: Result.from_parts(p) for n, p in parts.items()}
        ex.write(path, ex.tensors(results, {q.name: q.recipe.format for q in infos}),
                 ex.metadata(self.job, epoch or 0, infos))
        return epoch or 0

    def reset(self, names: Sequence[str] = (), drop_job: bool = False):
        return self._unary("Reset", pb.ResetRequest(job=self.job, names=list(names),
                                                    drop_job=drop_job), pb.ResetResponse)

    def status(self, job: str = ""):
        return self._unary("Status", pb.StatusRequest(job=job), pb.StatusResponse)

    def list_quantizers(self):
        return self._unary("ListQuantizers", pb.ListQuantizersRequest(job=self.job),
                           pb.ListQuantizersResponse)

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check; returns "SERVING", "NOT_SERVING"...

        Encoded by hand (one string field in, one enum field out) so that this
        package never registers grpc/health/v1/health.proto and cannot clash
        with grpcio-health-checking in the same process."""
        name = service.encode()
        n, varint = len(name), b""
        while True:  # the length as a protobuf varint
            varint += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
            n >>= 7
            if not n:
                break
        req = b"\x0a" + varint + name if name else b""
        fn = self._channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            raw = fn(req, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        status = raw[1] if len(raw) >= 2 and raw[0] == 0x08 else 0
        return {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}.get(status,
                                                                                       "UNKNOWN")


__all__ = ["Client", "Quantizer", "Recipe", "Result", "Masked", "Layout", "PackedResult", "AmaxdError",
           "Placement", "pb",
           "FP8_E4M3", "FP8_E5M2", "NVFP4", "MXFP8", "RUNNING_MAX", "PER_EPOCH"]
