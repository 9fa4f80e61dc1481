"""The amaxd client: one trainer rank talking to the daemon on its node.

Client holds the job, rank and epoch this rank is in and turns its calls
into requests; what it sends and gets is defined in types.py (Recipe,
Quantizer, Masked, Result) and packed.py (Layout, PackedResult), encoded in
wire.py where not by protobuf, and carried by transport.py.
"""
import os
import time
from typing import Any, Callable, Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple

import grpc

from ._gen import amaxd_pb2 as pb
from .errors import AmaxdError, FailedPrecondition, InvalidArgument, ResourceExhausted
from .packed import Layout, PackedResult
from .placement import Placement
from .transport import (DEFAULT_SOCKET, Channel, ShmBuffers, open_shm, pread_all,  # noqa: F401
                        pwrite_all, target)
from .types import (FP8_E4M3, FP8_E5M2, MXFP8, NVFP4, PER_EPOCH, RUNNING_MAX, Masked, Quantizer,
                    Recipe, Result, amax_update, as_f32, as_mask)
from . import device as dv, wire

# Names this module had before types.py, wire.py and transport.py took them
# (issue 20), for code that imports them from here.
from .packed import encode_send_packed  # noqa: F401
from .transport import SERVICE as _SVC, target as _target  # noqa: F401
from .transport import pread_all as _pread_all, pwrite_all as _pwrite_all  # noqa: F401
from .types import (_conv, amax_update as _update, peer_mode_value as _peer_mode,  # noqa: F401
                    to_bool_array as _to_bool_array, to_f32_bytes as _to_f32_bytes)
from .wire import spec_bytes as _spec_bytes, varint as _varint  # noqa: F401


def _doorbell_spin(text: Optional[str]) -> float:
    """Seconds the blocking device call polls the doorbell: AMAXD_DOORBELL_SPIN_S,
    else 2 ms with 8 or more CPUs (0 with fewer)."""
    if text is None:
        return 0.002 if (os.cpu_count() or 1) >= 8 else 0.0
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (0.0 <= v <= 10.0):
        raise ValueError(f"AMAXD_DOORBELL_SPIN_S={text!r}: give seconds from 0 to 10 "
                         "(how long reconcile_device polls the doorbell before it sleeps)")
    return v


class Client:
    """A connection of one rank of one job to its node's daemon.

    Use as a context manager. Every method raises an amaxd.errors.AmaxdError
    subclass on a gRPC error status.
    """

    def __init__(self, job: str, rank: int, world_size: int, *, socket: Optional[str] = None,
                 address: Optional[str] = None, timeout: float = 600.0,
                 max_message_bytes: int = 64 << 20, shm: bool = False) -> None:
        """shm=True: the packed form passes slabs and answers through a
        shared-memory buffer the daemon makes in its shm_dir (the trainer
        must run on the daemon's host and see that directory); the named
        form is unchanged."""
        self.job, self.rank, self.world_size = job, int(rank), int(world_size)
        self.shm = bool(shm)
        self._shm: Optional[ShmBuffers] = None
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self._rpc = Channel(target(socket, address), timeout, max_message_bytes)
        self._layout: Optional[Layout] = None
        self._dev: Any = None  # amaxd.device.DeviceBuffers, after open_device()
        # ReconcileDevice through the daemon's doorbell socket when it has
        # one (docs/API.md "The doorbell"); AMAXD_DOORBELL=0 or False: gRPC.
        self.doorbell = os.environ.get("AMAXD_DOORBELL", "1") != "0"
        # The blocking reconcile_device polls the doorbell for its answer
        # this many seconds before it sleeps (no wake-up when the answer
        # comes, as CUDA's own spin-waits): AMAXD_DOORBELL_SPIN_S, default
        # 2 ms with 8 or more CPUs, else 0 (docs/API.md "The doorbell").
        self.doorbell_spin = _doorbell_spin(os.environ.get("AMAXD_DOORBELL_SPIN_S"))
        self._door: Any = None
        self._reader: Any = None  # amaxd.device.AsyncReader of the async variant
        self._pending: Any = None  # its last PendingDevice
        # The epoch the daemon armed for this rank (docs/API.md "Armed
        # epochs"): (doorbell, its connection, buffers id, epoch, has_data).
        self._armed: Any = None
        self.epoch = 0

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._close_shm()
        self._collect_async()
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
        if self._door is not None:
            self._door.close()
            self._door = None
        try:
            self.close_device()
        except AmaxdError:
            pass  # the daemon frees them with the rank, the job or this process anyway
        self._rpc.close()

    def _close_shm(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    def _unary(self, method: str, req: Any, resp_cls: Any, timeout: Optional[float] = None) -> Any:
        return self._rpc.unary(method, req, resp_cls, timeout)

    def _raw(self, method: str, data: bytes, parse: Optional[Callable[[bytes], Any]],
             timeout: Optional[float] = None) -> Any:
        """A unary call with a request serialized already; parse(bytes) or
        the raw answer when parse is None."""
        return self._rpc.raw(method, data, parse, timeout)

    # -- the API --

    def join(self, timeout: Optional[float] = None) -> pb.JoinResponse:
        """Blocks until all world_size ranks have joined; returns the
        JoinResponse (its epoch is the open one)."""
        r = self._unary("Join", pb.JoinRequest(job=self.job, rank=self.rank,
                                               world_size=self.world_size), pb.JoinResponse, timeout)
        self.epoch = r.epoch
        return r

    def register(self, quantizers: Iterable[Quantizer], batch: int = 20000) -> pb.RegisterResponse:
        """Registers quantizers, `batch` per request (a request is decoded
        whole by the daemon, within its max_request_memory). Each request
        is atomic; the answer sums created and existing over all of them,
        with the catalog size after the last."""
        self._not_armed("register")
        # Encoded by hand (wire.spec_bytes): building protobuf objects for
        # 100k quantizers costs seconds; this costs ~1 us each.
        cache: Dict[Any, bytes] = {}
        qs = [wire.spec_bytes(q, cache) for q in quantizers]
        head = wire.register_head(self.job, self.rank)
        total = pb.RegisterResponse()
        for i in range(0, max(len(qs), 1), batch):
            req = head + b"".join(qs[i:i + batch])
            r = self._raw("RegisterQuantizers", req, pb.RegisterResponse.FromString)
            total.created += r.created
            total.existing += r.existing
            total.catalog_size = r.catalog_size
        return total

    def _send_req(self, amax: Mapping[str, object], epoch: int) -> pb.SendAmaxRequest:
        return pb.SendAmaxRequest(job=self.job, rank=self.rank, epoch=epoch,
                                  updates=[amax_update(n, v) for n, v in amax.items()])

    def _epoch(self, epoch: Optional[int]) -> int:
        # Updates are for the epoch this client saw open (Join, Reconcile):
        # one that arrives after that epoch was reconciled is refused
        # (FAILED_PRECONDITION) instead of landing in the next one. 0 means
        # "whatever epoch is open now".
        return self.epoch if epoch is None else epoch

    def _tracked(self, epoch: Optional[int], fn: Callable[[], Any]) -> Any:
        """Runs fn(); when it was refused because the epoch this client
        tracked is closed, learns the open epoch (so that the next call
        goes to it) and re-raises."""
        try:
            return fn()
        except FailedPrecondition:
            if epoch is None and self.epoch:
                self._learn_epoch()
            raise

    def _learn_epoch(self) -> None:
        """The epoch to send for, from Status (after a refusal): the open
        one, or while it is being reconciled the next (as Join says)."""
        try:
            jobs = self.status(self.job).jobs
            if jobs:
                self.epoch = jobs[0].epoch + (1 if jobs[0].in_flight else 0)
        except AmaxdError:
            pass

    def send(self, amax: Mapping[str, object],
             epoch: Optional[int] = None) -> pb.SendAmaxResponse:
        """Merges {name: local amax block} into the epoch this client saw
        open (atomic); `epoch` overrides it (0: whatever is open). A block
        is a numpy array, torch tensor or number; cells without data are
        given as Masked(values, no_data_mask) (numpy or torch bool mask) or
        as a numpy masked array."""
        return self._tracked(epoch, lambda: self._unary(
            "SendAmax", self._send_req(amax, self._epoch(epoch)), pb.SendAmaxResponse))

    def stream(self, batches: Iterable[Mapping[str, object]],
               epoch: Optional[int] = None) -> pb.SendAmaxResponse:
        """Sends many batches on one client-streaming call; returns the total accepted."""
        e = self._epoch(epoch)
        return self._rpc.stream("StreamAmax", (self._send_req(b, e) for b in batches),
                                pb.SendAmaxResponse.FromString, pb.SendAmaxRequest.SerializeToString)

    def reconcile(self, names: Sequence[str] = (), epoch: Optional[int] = None,
                  timeout: Optional[float] = None) -> Dict[str, Result]:
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
                # Opened now: the daemon unlinks the files at their first use.
                shm = open_shm(r.shm_path, r.shm_answer_path, r.shm_id, r.shm_has_data_offset,
                               r.shm_stats_offset, r.shm_stat_epochs_offset)
                self._close_shm()
                self._shm = shm
            self._layout = Layout.from_pb(r)
        return self._layout

    def _packed_req(self, values: object, has_data: object, epoch: Optional[int],
                    inline: bool = False, stats: Optional[Mapping[str, Any]] = None) -> bytes:
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
        sv = se = None
        if stats:
            sv, se = L.pack_stats(stats)
        shm = self._shm
        if shm is not None and not inline:
            pwrite_all(shm.slab_fd, v, 0)
            if m is not None:
                pwrite_all(shm.slab_fd, m, shm.has_data_offset)
            if sv is not None:  # the statistics after the slab (GetLayout's offsets)
                pwrite_all(shm.slab_fd, sv, shm.stats_offset)
                pwrite_all(shm.slab_fd, se, shm.stat_epochs_offset)
            return pb.SendPackedRequest(job=self.job, rank=self.rank, epoch=self._epoch(epoch),
                                        layout_id=L.id, shm_id=shm.id, shm_has_data=m is not None,
                                        shm_stats=sv is not None).SerializeToString()
        return wire.encode_send_packed(self.job, self.rank, self._epoch(epoch), L.id, v, m, sv, se)

    def send_packed(self, values: object, has_data: object = None,
                    epoch: Optional[int] = None,
                    stats: Optional[Mapping[str, Any]] = None) -> pb.SendAmaxResponse:
        """Merges one slab (float32 per cell of layout(), numpy or torch, CPU
        or CUDA; copied once) into the epoch; has_data: optional per-cell
        mask (bool/uint8; 0 = no data); stats: {name: amaxd.Stat} of
        quantizers with calibrators beyond max (packed by
        Layout.pack_stats; a histogram's with its overflow count). A stale
        layout raises FailedPrecondition: call layout(refresh=True) and
        repack."""
        data = self._packed_req(values, has_data, epoch, stats=stats)
        return self._tracked(epoch, lambda: self._raw("SendPacked", data,
                                                      pb.SendAmaxResponse.FromString))

    def stream_packed(self, slabs: Iterable[object],
                      epoch: Optional[int] = None) -> pb.SendAmaxResponse:
        """Sends slabs (values, or (values, has_data)) on one stream."""
        def gen() -> Iterator[bytes]:
            for s in slabs:
                v, m = s if isinstance(s, tuple) else (s, None)
                # In the messages: gRPC may still hold one when the next is made.
                yield self._packed_req(v, m, epoch, inline=True)
        return self._rpc.stream("StreamPacked", gen(), pb.SendAmaxResponse.FromString)

    def reconcile_packed(self, epoch: Optional[int] = None,
                         timeout: Optional[float] = None) -> PackedResult:
        """Reconcile with the answer packed in layout order (PackedResult:
        numpy views of the answer, no per-quantizer copies). When the
        daemon answers in a newer layout (a quantizer of this rank was
        refused by agreement during the epoch), the layout is re-fetched."""
        L = self.layout()
        shm = self._shm
        req = pb.ReconcilePackedRequest(job=self.job, rank=self.rank, epoch=self._epoch(epoch),
                                        layout_id=L.id,
                                        shm_id=shm.id if shm else 0).SerializeToString()
        raw = self._tracked(epoch, lambda: self._raw("ReconcilePacked", req, None, timeout))
        if shm is not None:
            n = pb.ReconcilePackedResponse.FromString(raw).shm_bytes
            if n:  # else the daemon could not use the buffer: the answer is in the message
                raw = pread_all(shm.answer_fd, n, 0)
        res = PackedResult(raw, L)
        if res.layout_id != L.id:
            res = PackedResult(raw, self.layout(refresh=True))
        self.epoch = res.next_epoch
        return res

    # -- GPU-direct (amaxd/device.py, docs/API.md "Device buffers") --

    def open_device(self, device: Optional[int] = None) -> Any:
        """Device buffers for this rank's layout on torch CUDA device
        `device` (default: the current one), allocated by the daemon (CUDA
        backend, this node) and mapped here: a DeviceBuffers whose `slab`
        (float32 per cell, layout order) and `has_data` (uint8) are torch
        CUDA tensor views. Replaces this client's earlier buffers. Raises
        amaxd.device.DeviceUnavailable without torch/CUDA/an IPC binding,
        FailedPrecondition from a host-backend daemon."""
        t = dv._torch()
        dev = t.cuda.current_device() if device is None else int(device)
        name = dv.device_name(dev)
        L = self.layout()
        r = self._unary("OpenDevice", pb.OpenDeviceRequest(job=self.job, rank=self.rank,
                                                           layout_id=L.id, device=name,
                                                           pid=os.getpid()),
                        pb.OpenDeviceResponse)
        try:
            bufs = dv.DeviceBuffers(r, dev)
        except Exception:
            try:
                self._unary("CloseDevice", pb.CloseDeviceRequest(job=self.job, rank=self.rank,
                                                                 device_id=r.device_id),
                            pb.CloseDeviceResponse)
            except AmaxdError:
                pass
            raise
        old, self._dev = self._dev, bufs
        if old is not None:
            old.close()  # the daemon freed them when it made the new ones
        return bufs

    @property
    def device_buffers(self) -> Any:
        """The open device buffers (amaxd.device.DeviceBuffers: slab,
        has_data, the answer's views, layout_id), or None before
        open_device() and after close_device()."""
        return self._dev

    def device_slab(self, device: Optional[int] = None) -> Any:
        """The device slab (torch CUDA float32 view, one cell per layout
        cell): write this rank's amax into it on the current stream, e.g.
        torch.amax(x.abs(), out=client.layout().view(slab, name)), then
        reconcile_device(). Opens the buffers on first use."""
        if self._dev is None:
            self.open_device(device)
        return self._dev.slab

    def reconcile_device(self, send: bool = True, has_data: bool = False,
                         epoch: Optional[int] = None, stream: Any = None,
                         timeout: Optional[float] = None, arm: bool = False) -> Any:
        """Reconcile through the device buffers: marks the slab written on
        `stream` (default: torch's current stream), the daemon merges the
        slab after it on the GPU (send=False: this rank sends nothing this
        epoch; has_data: also read the has_data bytes) and writes the
        answer into the device answer buffer; then `stream` waits for it
        on the GPU. Returns a DeviceResult of CUDA tensor views, valid
        until the next call. Never synchronizes the stream from the host.
        Through the daemon's doorbell when it has one, with the buffers'
        flags (signals) when both sides can, else the interprocess events
        (docs/API.md "Device buffers").

        arm=True (doorbell and signals only): when the daemon answers, it
        starts the next epoch for this rank at once (docs/API.md "Armed
        epochs"); the next call then sends nothing: its ready flag alone
        starts the merge. Every armed call must send the slab with the
        same has_data; pass arm=False on the last one (it disarms), or the
        close of this client aborts the armed epoch on every daemon."""
        self._collect_async()
        bufs, L, sp, req = self._device_request(send, has_data, epoch, stream)
        door = self._door if self.doorbell else None
        tmo = self.timeout if timeout is None else timeout
        if self._take_armed(door, bufs, send, has_data, epoch):
            seq = bufs.next_seq()
            if not arm:
                door.disarm(req)
            dv.memops().write(bufs.dev, sp, bufs.flag_page()[1], seq)
            r = self._device_answer(epoch, lambda: door.recv(tmo, self.doorbell_spin))
            return self._device_done(bufs, L, sp, seq, r, door, has_data)
        self._check_arm(arm, door, bufs, send)
        seq = bufs.next_seq() if door is not None and self._signals(bufs) else 0
        if send:
            if seq:
                dv.memops().write(bufs.dev, sp, bufs.ready_flag, seq)
            else:
                bufs.record_ready(sp)

        def call() -> Any:
            if door is not None:
                return door.call(req, tmo, seq, self.doorbell_spin,
                                 bufs.flag_page()[0] if arm else None)
            return self._unary("ReconcileDevice", req, pb.ReconcileDeviceResponse, timeout)
        r = self._device_answer(epoch, call)
        return self._device_done(bufs, L, sp, seq, r, door, has_data)

    def _take_armed(self, door: Any, bufs: Any, send: bool, has_data: bool,
                    epoch: Optional[int]) -> bool:
        """Whether the daemon armed this call's epoch (the last answer on
        this doorbell connection said so); the arming is used up here."""
        a, self._armed = self._armed, None
        if a is None:
            return False
        if door is None or door is not a[0] or door.conn != a[1] or bufs.id != a[2]:
            return False  # another connection or buffers: the daemon dropped that arming
        if not send or bool(has_data) != a[4] or (epoch is not None and epoch != a[3]):
            self._armed = a
            raise ValueError(
                f"epoch {a[3]} is armed for this rank (reconcile_device(arm=True)): the next "
                f"call must send the slab with has_data={a[4]} for that epoch; got send={send}, "
                f"has_data={has_data}, epoch={epoch}")
        return True

    def _not_armed(self, what: str) -> None:
        """A Register or Reset of this rank waits for the epoch in flight,
        which, armed, waits for this rank's next sync: refused here
        instead of waiting for its own deadline."""
        if self._armed is not None:
            raise ValueError(
                f"{what}: epoch {self._armed[3]} is armed for this rank and waits for its next "
                "sync; the daemon would hold this call until that epoch ends. Sync first "
                "(the last with reconcile_device(arm=False)), then " + what)

    def _check_arm(self, arm: bool, door: Any, bufs: Any, send: bool) -> None:
        if arm and (door is None or not self._signals(bufs) or not send):
            raise dv.DeviceUnavailable(
                "arm=True needs send=True, the daemon's doorbell and signals (stream memory "
                f"operations on both sides): doorbell {bufs.doorbell or 'none'}, signals "
                f"{bufs.signals} at the daemon, {dv.memops() is not None} here")

    def _device_done(self, bufs: Any, L: Any, sp: int, seq: int, r: Any, door: Any,
                     has_data: bool) -> Any:
        """After an OK answer: the stream waits for the done flag (or
        event); an arming the answer announced is kept for the next call."""
        if seq:
            dv.memops().wait(bufs.dev, sp, bufs.done_flag, seq)
        else:
            bufs.wait_done(sp)
        self.epoch = r.next_epoch
        self._keep_armed(door, bufs, r, has_data)
        return dv.DeviceResult(bufs, L, r.epoch, r.next_epoch)

    def _keep_armed(self, door: Any, bufs: Any, r: Any, has_data: bool) -> None:
        if door is not None and door.armed:
            self._armed = (door, door.conn, bufs.id, r.next_epoch, bool(has_data))

    def reconcile_device_async(self, send: bool = True, has_data: bool = False,
                               epoch: Optional[int] = None, stream: Any = None,
                               timeout: Optional[float] = None, arm: bool = False) -> Any:
        """The asynchronous variant: marks the slab written and makes
        `stream` wait for the daemon's done flag on the GPU, sends the
        request on the doorbell and returns at once, without waiting for
        the daemon: the host goes on queuing work behind the wait. Gives a
        PendingDevice; its result() (or the next call of this client)
        waits for the daemon's answer and gives the DeviceResult, or raises
        its error: the results the stream read are trustworthy only then.
        Needs the doorbell and signals (DeviceUnavailable otherwise).
        arm: as in reconcile_device."""
        self._collect_async()
        bufs, L, sp, req = self._device_request(send, has_data, epoch, stream)
        door = self._door if self.doorbell else None
        armed = self._take_armed(door, bufs, send, has_data, epoch)
        if door is None or not self._signals(bufs):
            raise dv.DeviceUnavailable(
                "reconcile_device_async needs the daemon's doorbell and signals (stream memory "
                f"operations on both sides): doorbell {bufs.doorbell or 'none'}, signals "
                f"{bufs.signals} at the daemon, {dv.memops() is not None} here")
        seq = bufs.next_seq()
        mo = dv.memops()
        # The release stream is made here, on the caller's thread, so that
        # the release (in the reader thread) is one driver call and a sync.
        side = bufs.release_stream()

        def release() -> None:
            # The daemon will not write the done flag: free the stream.
            mo.write(bufs.dev, int(side.cuda_stream), bufs.done_flag, seq)
            side.synchronize()

        def finish(r: Any) -> Any:
            self.epoch = r.next_epoch
            self._keep_armed(door, bufs, r, has_data)
            return dv.DeviceResult(bufs, L, r.epoch, r.next_epoch)

        def failed(e: BaseException) -> None:
            # As the blocking call: a refused or failed epoch moves the open one.
            if epoch is None and isinstance(e, (InvalidArgument, FailedPrecondition)):
                self._learn_epoch()
        pending = dv.PendingDevice(finish, failed)
        if not armed:
            self._check_arm(arm, door, bufs, send)
        elif not arm:
            door.disarm(req)  # before the flag: the daemon sees it when it answers
        if armed:
            mo.write(bufs.dev, sp, bufs.flag_page()[1], seq)
        elif send:
            mo.write(bufs.dev, sp, bufs.ready_flag, seq)
        mo.wait(bufs.dev, sp, bufs.done_flag, seq)
        # From here the stream waits for the done flag: every way out that
        # does not hand the call to the reader releases it.
        try:
            if (self._reader is None or self._reader.door is not door
                    or not self._reader.alive()):
                self._reader = dv.AsyncReader(door, bufs.dev)
            if not armed:
                door.send(req, seq, bufs.flag_page()[0] if arm else None)
        except AmaxdError as e:
            pending._set(None, dv.release_after(release, e))
            return pending
        except BaseException as e:
            err = dv.release_after(release, e)
            if err is not e:
                raise err from e
            raise
        self._reader.submit(pending, self.timeout if timeout is None else timeout, release)
        self._pending = pending
        return pending

    def _collect_async(self) -> None:
        """Waits for the answer of this client's last asynchronous call (one
        request at a time on the doorbell); its error, if any, is raised
        by its own result(), not here."""
        p, self._pending = self._pending, None
        if p is not None:
            try:
                p.result()
            except AmaxdError:
                pass

    def _signals(self, bufs: Any) -> bool:
        return bufs.signals and dv.memops() is not None

    def _device_request(self, send: bool, has_data: bool, epoch: Optional[int],
                        stream: Any) -> Any:
        """(buffers, layout, stream handle, ReconcileDeviceRequest) of a
        device call; opens the buffers and the doorbell on first use."""
        if self._dev is None:
            self.open_device()
        bufs = self._dev
        L = self.layout()
        if stream is None:
            _, sp = dv.current_stream(bufs.dev)
        else:
            sp = int(getattr(stream, "cuda_stream", stream))
        req = pb.ReconcileDeviceRequest(job=self.job, rank=self.rank, epoch=self._epoch(epoch),
                                        layout_id=L.id, device_id=bufs.id, send=bool(send),
                                        has_data=bool(has_data))
        if self.doorbell and bufs.doorbell and (self._door is None
                                                or self._door.path != bufs.doorbell):
            self._door = dv.Doorbell(bufs.doorbell)
        return bufs, L, sp, req

    def _device_answer(self, epoch: Optional[int], call: Callable[[], Any]) -> Any:
        try:
            return self._tracked(epoch, call)
        except InvalidArgument:
            # A slab that failed the daemon's check fails the epoch on every
            # rank; learn the open epoch again all the same (an argument
            # refused before the epoch began leaves it as it was).
            if epoch is None:
                self._learn_epoch()
            raise

    def close_device(self) -> None:
        """Unmaps and frees this client's device buffers (no-op without)."""
        bufs, self._dev = self._dev, None
        if bufs is None:
            return
        bufs.close()
        req = pb.CloseDeviceRequest(job=self.job, rank=self.rank, device_id=bufs.id)
        if self._armed is None:
            self._unary("CloseDevice", req, pb.CloseDeviceResponse)
            return
        # An armed epoch waits for this rank: closing the doorbell aborts
        # it (on every daemon of the job); the rank is out of it shortly.
        self._armed = None
        if self._door is not None:
            self._door.close()
        end = time.monotonic() + 5.0
        while True:
            try:
                self._unary("CloseDevice", req, pb.CloseDeviceResponse)
                return
            except FailedPrecondition as e:
                if "waiting in Reconcile" not in str(e) or time.monotonic() > end:
                    raise
                time.sleep(0.01)

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

    def _windows(self, names: Sequence[str], whole: bool, window: int
                 ) -> Tuple[Optional[Dict[str, list]], Optional[int]]:
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
            last = jobs[0].reconciled_epochs if jobs else 0
            ex.write(path, {}, ex.metadata(self.job, last, []))
            return last
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

    def reset(self, names: Sequence[str] = (), drop_job: bool = False) -> pb.ResetResponse:
        if not drop_job:
            self._not_armed("reset")
        return self._unary("Reset", pb.ResetRequest(job=self.job, names=list(names),
                                                    drop_job=drop_job), pb.ResetResponse)

    def status(self, job: str = "") -> pb.StatusResponse:
        return self._unary("Status", pb.StatusRequest(job=job), pb.StatusResponse)

    def list_quantizers(self) -> pb.ListQuantizersResponse:
        return self._unary("ListQuantizers", pb.ListQuantizersRequest(job=self.job),
                           pb.ListQuantizersResponse)

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check; returns "SERVING", "NOT_SERVING"...

        Encoded by hand (one string field in, one enum field out) so that this
        package never registers grpc/health/v1/health.proto and cannot clash
        with grpcio-health-checking in the same process."""
        return self._rpc.raw("/grpc.health.v1.Health/Check", wire.encode_health_check(service),
                             wire.parse_health_status)


__all__ = ["Client", "Quantizer", "Recipe", "Result", "Masked", "Layout", "PackedResult", "AmaxdError",
           "Placement", "pb",
           "FP8_E4M3", "FP8_E5M2", "NVFP4", "MXFP8", "RUNNING_MAX", "PER_EPOCH"]
