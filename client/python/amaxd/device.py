"""GPU-direct: a rank's slab and answer in device buffers shared with the
daemon over CUDA IPC (docs/API.md, "Device buffers").

The daemon (CUDA backend, same node) allocates both buffers on this
trainer's GPU and hands out legacy CUDA IPC handles; they are mapped here
and shown as torch CUDA tensors (through ``__cuda_array_interface__``). The
trainer writes its amax into ``slab`` (``torch.amax(x, out=view)`` or
``view.copy_(...)``), and ``Client.reconcile_device()``:

1. records the daemon's *ready* event on the current stream (after the
   writes queued on it),
2. calls ReconcileDevice: the daemon's stream waits on that event on the
   GPU, checks and merges the slab in place, reconciles, and writes this
   rank's results into the answer buffer, then records its *done* event,
3. makes the current stream wait on the *done* event.

Nothing here synchronizes the stream from the host: kernels queued after
``reconcile_device()`` see the results; the host never waits for the GPU.
The views stay valid until ``close()`` (or the client's); the answer views
hold the last epoch's results until the next ``reconcile_device()``.

The IPC calls go through CuPy when it is installed, else through NVIDIA's
``cuda-bindings`` (``cuda.bindings.runtime``); torch with CUDA is needed
for the views. Without them ``DeviceUnavailable`` says what is missing.
With CuPy the views are made through DLPack, else through
``__cuda_array_interface__``: either way torch launches kernels on them
asynchronously. (The first launch of a kernel in a process loads its
module, CUDA's lazy loading, and that waits for the device: a trainer's
first sync may block once; tests/gpu/diag_ipc.py.)
"""
import array
import ctypes
import os
import queue
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import grpc

from .errors import AmaxdError


class DeviceUnavailable(RuntimeError):
    """GPU-direct cannot run in this process (no torch with CUDA, no CUDA IPC
    binding): use the packed form (send_packed / reconcile_packed)."""


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise DeviceUnavailable("GPU-direct needs torch with CUDA (import torch failed: "
                                f"{e}); use send_packed/reconcile_packed instead") from e
    if not torch.cuda.is_available():
        raise DeviceUnavailable("GPU-direct needs a CUDA GPU visible to torch "
                                "(torch.cuda.is_available() is False); use "
                                "send_packed/reconcile_packed instead")
    return torch


class _Cupy:
    """CUDA IPC through CuPy's runtime bindings."""

    def __init__(self) -> None:
        import cupy  # noqa: F401
        from cupy.cuda import runtime
        self.rt = runtime
        self.name = "cupy"

    def bus_id(self, dev: int) -> str:
        return str(self.rt.deviceGetPCIBusId(dev))

    def open_mem(self, handle: bytes, dev: int) -> int:
        import cupy
        with cupy.cuda.Device(dev):
            return int(self.rt.ipcOpenMemHandle(handle, self.rt.cudaIpcMemLazyEnablePeerAccess))

    def close_mem(self, ptr: int, dev: int) -> None:
        import cupy
        with cupy.cuda.Device(dev):
            self.rt.ipcCloseMemHandle(ptr)

    def open_event(self, handle: bytes, dev: int) -> int:
        import cupy
        with cupy.cuda.Device(dev):
            return int(self.rt.ipcOpenEventHandle(handle))

    def destroy_event(self, ev: int) -> None:
        self.rt.eventDestroy(ev)

    def view(self, ptr: int, n: int, typestr: str, dev: int, owner: Any) -> Any:
        """A torch tensor over device memory, through DLPack."""
        import cupy
        t = _torch()
        dt = {"<f4": cupy.float32, "|u1": cupy.uint8, "<i4": cupy.int32}[typestr]
        mem = cupy.cuda.UnownedMemory(ptr, max(n, 1) * cupy.dtype(dt).itemsize, owner, dev)
        a = cupy.ndarray((n,), dt, cupy.cuda.MemoryPointer(mem, 0))
        return t.from_dlpack(a)

    def record(self, ev: int, stream: int) -> None:
        self.rt.eventRecord(ev, stream)

    def wait(self, stream: int, ev: int) -> None:
        self.rt.streamWaitEvent(stream, ev, 0)


class _CudaBindings:
    """CUDA IPC through NVIDIA's cuda-bindings (cuda.bindings.runtime)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            from cuda import cudart as rt  # older cuda-python
        self.rt = rt
        self.name = "cuda-bindings"

    def _ok(self, r: Any, what: str) -> Any:
        err = r[0] if isinstance(r, tuple) else r
        if int(err) != 0:
            raise DeviceUnavailable(f"CUDA {what} failed: {err}")
        return r[1] if isinstance(r, tuple) and len(r) > 1 else None

    def bus_id(self, dev: int) -> str:
        b = self._ok(self.rt.cudaDeviceGetPCIBusId(32, dev), "cudaDeviceGetPCIBusId")
        return (b.decode() if isinstance(b, bytes) else str(b)).rstrip("\x00")

    def open_mem(self, handle: bytes, dev: int) -> int:
        h = self.rt.cudaIpcMemHandle_t()
        h.reserved = handle
        with _device(dev):
            return int(self._ok(self.rt.cudaIpcOpenMemHandle(
                h, self.rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))

    def close_mem(self, ptr: int, dev: int) -> None:
        with _device(dev):
            self._ok(self.rt.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    def open_event(self, handle: bytes, dev: int) -> Any:
        h = self.rt.cudaIpcEventHandle_t()
        h.reserved = handle
        with _device(dev):
            return self._ok(self.rt.cudaIpcOpenEventHandle(h), "cudaIpcOpenEventHandle")

    def destroy_event(self, ev: Any) -> None:
        self.rt.cudaEventDestroy(ev)

    def record(self, ev: Any, stream: int) -> None:
        self._ok(self.rt.cudaEventRecord(ev, stream), "cudaEventRecord")

    def wait(self, stream: int, ev: Any) -> None:
        self._ok(self.rt.cudaStreamWaitEvent(stream, ev, 0), "cudaStreamWaitEvent")


class _device:
    """cuda-bindings' current device set to `dev` for a block (each CUDA
    runtime copy in a process, torch's and the binding's, keeps its own)."""

    def __init__(self, dev: int) -> None:
        self.dev = dev

    def __enter__(self) -> None:
        rt = ipc().rt
        r = rt.cudaGetDevice()
        self.prev = r[1] if isinstance(r, tuple) else 0
        rt.cudaSetDevice(self.dev)

    def __exit__(self, *exc: object) -> None:
        ipc().rt.cudaSetDevice(self.prev)


_IPC: Optional[Any] = None


def ipc() -> Any:
    """The CUDA IPC binding of this process (CuPy, else cuda-bindings)."""
    global _IPC
    if _IPC is None:
        errs = []
        for cls in (_Cupy, _CudaBindings):
            try:
                _IPC = cls()
                break
            except Exception as e:  # noqa: BLE001 - any failure: try the next binding
                errs.append(f"{cls.__doc__.split(' through ')[1].rstrip('.')}: {e}")
        if _IPC is None:
            raise DeviceUnavailable("GPU-direct needs CuPy or NVIDIA's cuda-bindings for CUDA IPC "
                                    "(" + "; ".join(errs) + ")")
    return _IPC


class _CAI:
    """A device pointer as __cuda_array_interface__ (v3, no stream: the
    consumer must not synchronize)."""

    def __init__(self, ptr: int, n: int, typestr: str, owner: Any) -> None:
        self._owner = owner  # keeps the mapping's holder alive while a view exists
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": None}


def device_name(dev: int) -> str:
    """The PCI bus id of torch's CUDA device `dev` (what OpenDevice names)."""
    try:
        return ipc().bus_id(dev)
    except DeviceUnavailable:
        raise
    except Exception:  # noqa: BLE001 - fall back to torch's UUID
        u = _torch().cuda.get_device_properties(dev).uuid
        return "GPU-" + str(u)


class DeviceBuffers:
    """A rank's device slab and answer (OpenDeviceResponse), mapped as
    torch CUDA tensors on device `dev`."""

    def __init__(self, r: Any, dev: int) -> None:
        self._page: Any = None  # the armed epochs' flag page (flag_page())
        t = _torch()
        b = ipc()
        self.id = r.device_id
        self.layout_id = r.layout_id
        self.dev = dev
        self.total_cells, self.quantizers, self.total_slices = (r.total_cells, r.quantizers,
                                                                 r.total_slices)
        self.bus_id = r.device_bus_id
        self.doorbell = getattr(r, "doorbell", "")
        # Signals (docs/API.md "Signals"): uint32 flags instead of the events.
        self.signals = bool(getattr(r, "signals", False))
        self.seq = 0
        self._release: Any = None
        self._b = b
        self._ptrs: List[int] = []
        self._events: List[Any] = []
        try:
            slab = b.open_mem(bytes(r.slab_handle), dev)
            self._ptrs.append(slab)
            ans = b.open_mem(bytes(r.answer_handle), dev)
            self._ptrs.append(ans)
            self.ready = b.open_event(bytes(r.ready_event), dev)
            self._events.append(self.ready)
            self.done = b.open_event(bytes(r.done_event), dev)
            self._events.append(self.done)
        except Exception as e:
            self.close()
            if isinstance(e, DeviceUnavailable):
                raise
            raise DeviceUnavailable(f"mapping the daemon's device buffers failed ({e}): the "
                                    "trainer must run on the daemon's node, in its IPC and PID "
                                    "namespaces") from e
        n, q, s = self.total_cells, self.quantizers, self.total_slices
        cuda = t.device("cuda", dev)
        view_of = getattr(b, "view", None)

        def view(base: int, off: int, count: int, ts: str) -> Any:
            if view_of is not None:
                return view_of(base + off, count, ts, dev, self)
            return t.as_tensor(_CAI(base + off, count, ts, self), device=cuda)
        self.ready_flag = slab + r.ready_flag_offset
        self.done_flag = ans + r.done_flag_offset
        self.slab = view(slab, 0, n, "<f4")
        self.has_data = view(slab, r.has_data_offset, n, "|u1")
        self.answer: Dict[str, Any] = {
            "amax": view(ans, r.amax_offset, n, "<f4"),
            "scale": view(ans, r.scale_offset, n, "<f4"),
            "scale_inv": view(ans, r.scale_inv_offset, n, "<f4"),
            "block_scales": view(ans, r.block_scales_offset, n, "|u1"),
            "global_amax": view(ans, r.global_amax_offset, q, "<f4"),
            "global_scale": view(ans, r.global_scale_offset, q, "<f4"),
            "global_scale_inv": view(ans, r.global_scale_inv_offset, q, "<f4"),
            "global_amaxes": view(ans, r.global_amaxes_offset, s, "<f4"),
            "global_scales": view(ans, r.global_scales_offset, s, "<f4"),
            "global_scale_invs": view(ans, r.global_scale_invs_offset, s, "<f4"),
        }
        # Per quantizer, as ReconcilePacked answers them; a daemon before
        # them answers no offsets (0 is the amax array's). `missing` is the
        # uint32 count viewed as int32 (torch's uint32 support is thin; a
        # count never reaches 2^31: a slab of 8 GiB).
        if getattr(r, "missing_offset", 0):
            self.answer.update({
                "missing": view(ans, r.missing_offset, q, "<i4"),
                "has_previous": view(ans, r.has_previous_offset, q, "|u1"),
                "previous_global_amax": view(ans, r.previous_global_amax_offset, q, "<f4"),
                "previous_global_scale": view(ans, r.previous_global_scale_offset, q, "<f4"),
            })

    def record_ready(self, stream: int) -> None:
        self._b.record(self.ready, stream)

    def wait_done(self, stream: int) -> None:
        self._b.wait(stream, self.done)

    def release_stream(self) -> Any:
        """The torch stream on which the client writes the done flag
        itself when an asynchronous call fails (made once, on first use)."""
        if self._release is None:
            self._release = _torch().cuda.Stream(device=self.dev)
        return self._release

    def next_seq(self) -> int:
        """The next signal sequence number (1, 2, ..., never 0)."""
        self.seq = (self.seq + 1) & 0xFFFFFFFF or 1
        return self.seq

    def flag_page(self) -> Tuple[int, int]:
        """(fd, address) of the armed epochs' flag page (docs/API.md
        "Armed epochs"): a memfd of 4096 bytes sealed against shrinking and
        growing, mapped here and registered with CUDA (mapped, portable),
        so that a stream can write the ready seq into its first word
        (its address is the device's too: unified addressing). Made once."""
        if self._page is None:
            import fcntl
            import mmap
            fd = os.memfd_create("amaxd-flags", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, 4096)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
                mm = mmap.mmap(fd, 4096)
                word = ctypes.c_uint32.from_buffer(mm)
                addr = ctypes.addressof(word)
                rc = _torch().cuda.cudart().cudaHostRegister(addr, 4096, 3)  # portable, mapped
                if int(rc) != 0:
                    del word
                    mm.close()
                    raise DeviceUnavailable(f"cudaHostRegister of the flag page failed ({rc})")
            except BaseException:
                os.close(fd)
                raise
            self._page = (fd, addr, mm, word)
        return self._page[0], self._page[1]

    def close(self) -> None:
        """Unmaps the buffers (the views must not be used after)."""
        if self._page is not None:
            fd, addr, mm, word = self._page
            self._page = None
            try:
                _torch().cuda.cudart().cudaHostUnregister(addr)
            except Exception:  # noqa: BLE001 - best effort at close
                pass
            del word
            mm.close()
            os.close(fd)
        for ev in self._events:
            try:
                self._b.destroy_event(ev)
            except Exception:  # noqa: BLE001 - best effort at close
                pass
        self._events = []
        for p in self._ptrs:
            try:
                self._b.close_mem(p, self.dev)
            except Exception:  # noqa: BLE001
                pass
        self._ptrs = []


class _MemOps:
    """The driver's 32-bit stream memory operations (libcuda, through
    ctypes: neither CuPy nor torch exposes them). Each runs with the
    primary context of the buffers' device pushed on the calling thread
    (a thread that never used CUDA has none current) and popped after."""

    GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._write = lib.cuStreamWriteValue32_v2
        self._wait = lib.cuStreamWaitValue32_v2
        for f in (self._write, self._wait):
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            f.restype = ctypes.c_int
        self._get = lib.cuDeviceGet
        self._get.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self._retain = lib.cuDevicePrimaryCtxRetain
        self._retain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self._push = lib.cuCtxPushCurrent_v2
        self._push.argtypes = [ctypes.c_void_p]
        self._pop = lib.cuCtxPopCurrent_v2
        self._pop.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._ctx: Dict[int, ctypes.c_void_p] = {}

    def _context(self, dev: int) -> ctypes.c_void_p:
        ctx = self._ctx.get(dev)
        if ctx is None:
            d, c = ctypes.c_int(), ctypes.c_void_p()
            r = self._get(ctypes.byref(d), dev) or self._retain(ctypes.byref(c), d)
            if r != 0:
                raise DeviceUnavailable(f"the primary context of CUDA device {dev}: CUresult {r}")
            self._ctx[dev] = ctx = c
        return ctx

    def _run(self, fn: Any, what: str, dev: int, stream: int, ptr: int, value: int,
             flags: int) -> None:
        r = self._push(self._context(dev))
        if r == 0:
            try:
                r = fn(ctypes.c_void_p(stream), ptr, value, flags)
            finally:
                self._pop(ctypes.byref(ctypes.c_void_p()))
        if r != 0:
            raise DeviceUnavailable(f"{what} failed (CUresult {r})")

    def write(self, dev: int, stream: int, ptr: int, value: int) -> None:
        self._run(self._write, "cuStreamWriteValue32", dev, stream, ptr, value, 0)

    def wait(self, dev: int, stream: int, ptr: int, value: int) -> None:
        self._run(self._wait, "cuStreamWaitValue32", dev, stream, ptr, value, self.GEQ)


_MEMOPS: Optional[_MemOps] = None


def memops() -> Optional[_MemOps]:
    """The stream memory operations of this process, or None (no libcuda
    with them: the client uses the events)."""
    global _MEMOPS
    if _MEMOPS is None:
        try:
            _MEMOPS = _MemOps()
        except (OSError, AttributeError):
            return None
    return _MEMOPS


class Doorbell:
    """ReconcileDevice over the daemon's doorbell (docs/API.md "The
    doorbell"): one SOCK_SEQPACKET datagram each way, no gRPC. A call that
    times out closes the connection (which cancels the daemon's wait, as a
    gRPC deadline does); the next call connects again. One request at a
    time: send() then recv()."""

    # magic, flags, device_id, epoch, layout_id, rank, job_len, seq, 0
    REQ = struct.Struct("<IIQQQIIII")
    # magic, code, epoch, next_epoch, layout_id, msg_len, flags (1: armed)
    ANS = struct.Struct("<IIQQQII")
    MAGIC = 0x31424441  # "ADB1"
    SEND, HAS_DATA, ARM, DISARM = 1, 2, 4, 8

    def __init__(self, path: str) -> None:
        self.path = path
        self._s: Optional[socket.socket] = None
        # Whether the last answer said the next epoch is armed (docs/API.md
        # "Armed epochs").
        self.armed = False
        self.conn = 0  # counts the connections made: arming belongs to one

    def close(self) -> None:
        if self._s is not None:
            self._s.close()
            self._s = None

    def _fail(self, e: Exception, what: str) -> AmaxdError:
        from .errors import DeadlineExceeded, Unavailable
        self.close()
        if isinstance(e, socket.timeout):
            return DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"no answer on the doorbell {self.path} within {what} s")
        return Unavailable(grpc.StatusCode.UNAVAILABLE, f"the doorbell {self.path} failed: {e}")

    def send(self, req: Any, seq: int = 0, arm_fd: Optional[int] = None) -> None:
        """Sends ReconcileDeviceRequest `req` (seq != 0: signals; arm_fd:
        arm, the daemon arms the next epoch when it answers this one, with
        this flag page)."""
        job = req.job.encode()
        flags = ((self.SEND if req.send else 0) | (self.HAS_DATA if req.has_data else 0)
                 | (self.ARM if arm_fd is not None else 0))
        self._send(self.REQ.pack(self.MAGIC, flags, req.device_id, req.epoch, req.layout_id,
                                 req.rank, len(job), seq, 0) + job, arm_fd)

    def disarm(self, req: Any) -> None:
        """Asks the daemon not to arm again after the armed epoch: sent
        before the trainer writes that epoch's ready flag."""
        job = req.job.encode()
        self._send(self.REQ.pack(self.MAGIC, self.DISARM, req.device_id, 0, 0, req.rank,
                                 len(job), 0, 0) + job)

    def _send(self, msg: bytes, fd: Optional[int] = None) -> None:
        try:
            if self._s is None:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    s.connect(self.path)
                except OSError:
                    s.close()
                    raise
                self._s = s
                self.conn += 1
            self._s.settimeout(None)
            if fd is None:
                self._s.send(msg)
            else:
                self._s.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                         array.array("i", [fd]))])
        except OSError as e:
            raise self._fail(e, "") from e

    def _poll(self, s: socket.socket, spin: float) -> Optional[bytes]:
        """The answer if it comes within `spin` seconds, read without
        sleeping (no scheduler wake-up when it comes); None after."""
        end = time.perf_counter() + spin
        while True:
            try:
                return s.recv(self.ANS.size + 4096, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= end:
                    return None

    def recv(self, timeout: Optional[float], spin: float = 0.0) -> Any:
        """The answer to the request sent: a ReconcileDeviceResponse, or
        the AmaxdError of the daemon's status. spin: poll for it this many
        seconds (at most `timeout`) before sleeping."""
        from .errors import Unavailable, from_status
        from ._gen import amaxd_pb2 as pb
        s = self._s
        if s is None:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              f"the doorbell {self.path} is closed")
        try:
            t0 = time.perf_counter()
            if timeout is not None:
                spin = min(spin, timeout)
            data = self._poll(s, spin) if spin > 0 else None
            if data is None:
                if timeout is not None:
                    left = max(0.0, timeout - (time.perf_counter() - t0))
                    ready, _, _ = select.select([s], [], [], left)
                    if not ready:
                        raise socket.timeout()
                data = s.recv(self.ANS.size + 4096)
        except OSError as e:
            raise self._fail(e, str(timeout)) from e
        if len(data) < self.ANS.size:
            self.close()
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              f"the doorbell {self.path} closed or answered {len(data)} bytes")
        self.armed = False
        magic, code, epoch, next_epoch, layout_id, n, aflags = self.ANS.unpack_from(data)
        text = data[self.ANS.size:self.ANS.size + n].decode("utf-8", "replace")
        if magic != self.MAGIC:
            self.close()
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              f"the doorbell {self.path} answered magic 0x{magic:08x}")
        if code != 0:
            raise from_status(code, text)
        self.armed = bool(aflags & 1)
        return pb.ReconcileDeviceResponse(epoch=epoch, next_epoch=next_epoch,
                                          layout_id=layout_id)

    def call(self, req: Any, timeout: Optional[float], seq: int = 0, spin: float = 0.0,
             arm_fd: Optional[int] = None) -> Any:
        self.send(req, seq, arm_fd)
        return self.recv(timeout, spin)


class StreamNotReleased(AmaxdError):
    """An asynchronous device call failed (its `cause`: the daemon's error,
    a vanished daemon, a timeout) and the client could not write the done
    flag that frees the trainer's stream either (`release_error`): kernels
    queued on that stream after reconcile_device_async() may stay blocked
    on the flag. The code is the cause's. Write the flag yourself
    (amaxd.device.memops().write(bufs.dev, stream, bufs.done_flag, seq))
    or treat the stream (and its CUDA context) as lost."""

    cause: Optional[BaseException] = None
    release_error: Optional[BaseException] = None

    @classmethod
    def of(cls, cause: BaseException, release_error: BaseException) -> "StreamNotReleased":
        code = getattr(cause, "code", None)
        if not isinstance(code, grpc.StatusCode):
            code = grpc.StatusCode.UNKNOWN
        what = getattr(cause, "message", None) or f"{type(cause).__name__}: {cause}"
        e = cls(code, f"{what}; releasing the trainer's stream failed too "
                      f"({type(release_error).__name__}: {release_error}): the stream may stay "
                      "blocked on the done flag, and kernels queued on it after "
                      "reconcile_device_async() may never run")
        e.cause, e.release_error = cause, release_error
        return e


def release_after(release: Callable[[], None], error: BaseException) -> BaseException:
    """Runs release() (the write of the done flag that frees the trainer's
    stream) after `error` failed an asynchronous call, and gives the error
    result() must raise: `error` itself, or a StreamNotReleased when the
    release raised. Never raises."""
    try:
        release()
    except BaseException as e:  # noqa: BLE001 - a failed release is reported, never lost
        try:
            out: BaseException = StreamNotReleased.of(error, e)
        except BaseException:  # noqa: BLE001 - even building the message must not lose it
            out = StreamNotReleased(grpc.StatusCode.UNKNOWN,
                                    "the asynchronous call failed and releasing the trainer's "
                                    "stream failed too: the stream may stay blocked")
        try:
            out.__cause__ = e
            import logging
            logging.getLogger("amaxd").error("%s", out)
        except BaseException:  # noqa: BLE001
            pass
        return out
    return error


class PendingDevice:
    """An asynchronous reconcile_device (Client.reconcile_device_async):
    the trainer's stream already waits on the GPU for the daemon's done
    flag; result() waits on the host for the daemon's answer and gives
    the DeviceResult, or raises its error. When the answer is an error
    (or the daemon is gone) the client writes the done flag itself, on a
    stream of its own, as soon as the answer arrives (a thread reads it),
    so the trainer's stream never hangs; the results it read then are the
    previous epoch's or garbage, and result() raises: check it before
    trusting them. Should that write fail, result() raises
    StreamNotReleased: the stream may stay blocked."""

    def __init__(self, finish: Callable[[Any], Any],
                 failed: Callable[[BaseException], None]) -> None:
        self._finish = finish
        self._failed = failed
        self._done = threading.Event()
        self._answer: Any = None
        self._error: Optional[BaseException] = None
        self._value: Any = None
        self._taken = False

    def _set(self, answer: Any, error: Optional[BaseException]) -> None:
        self._answer, self._error = answer, error
        self._done.set()

    def done(self) -> bool:
        """Whether the daemon's answer arrived."""
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self._done.wait(timeout):
            from .errors import DeadlineExceeded
            raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"no answer from the daemon within {timeout} s")
        if not self._taken:
            self._taken = True
            if self._error is None:
                self._value = self._finish(self._answer)
            else:
                self._failed(self._error)
        if self._error is not None:
            raise self._error
        return self._value


class AsyncReader:
    """The thread that reads a doorbell's answers to asynchronous calls:
    resolves each PendingDevice in order, and on an error releases the
    trainer's stream (writes the done flag on a stream of its own). Every
    call it took is resolved and, unless answered OK, released, whatever
    raises (the thread's CUDA set-up, the doorbell, the mapping of the
    error, the release itself): the thread never dies with calls queued."""

    def __init__(self, door: Doorbell, dev: int,
                 setup: Optional[Callable[[], None]] = None) -> None:
        self.door = door
        self.dev = dev
        self._setup = setup if setup is not None else lambda: _torch().cuda.set_device(dev)
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._t = threading.Thread(target=self._run, name="amaxd-doorbell", daemon=True)
        self._t.start()

    def alive(self) -> bool:
        return self._t.is_alive()

    def submit(self, pending: PendingDevice, timeout: Optional[float],
               release: Callable[[], None]) -> None:
        self._q.put((pending, timeout, release))

    def stop(self) -> None:
        self._q.put(None)
        self._t.join(timeout=5)

    def _run(self) -> None:
        try:
            self._setup()  # the current device of this thread (the release needs none)
        except BaseException:  # noqa: BLE001 - the calls are still read and released
            pass
        while True:
            item = self._q.get()
            if item is None:
                return
            pending, timeout, release = item
            try:
                ans = self.door.recv(timeout)
            except BaseException as e:  # noqa: BLE001 - every failure releases the stream
                pending._set(None, release_after(release, e))
                continue
            pending._set(ans, None)


PER_QUANTIZER = ("global_amax", "global_scale", "global_scale_inv", "missing", "has_previous",
                 "previous_global_amax", "previous_global_scale")


class DeviceResult:
    """One epoch's answer in the device buffers: CUDA tensor views (amax,
    scale, scale_inv, block_scales per cell in slab order; global_amax,
    global_scale, global_scale_inv, missing (int32: cells of this rank's
    block without data anywhere), has_previous (uint8), previous_global_amax,
    previous_global_scale per quantizer; global_amaxes, ... per global
    slice), valid until the next reconcile_device(). The arrays are
    ReconcilePacked's, byte for byte."""

    def __init__(self, bufs: DeviceBuffers, layout: Any, epoch: int, next_epoch: int) -> None:
        self.epoch, self.next_epoch = epoch, next_epoch
        self.layout = layout
        self._keys = tuple(bufs.answer)
        for k, v in bufs.answer.items():
            setattr(self, k, v)

    def __getitem__(self, name: str) -> Dict[str, Any]:
        """Views of quantizer `name`: its block's amax/scale/scale_inv/
        block_scales, its globals, missing count and previous globals."""
        L = self.layout
        i = L.index[name]
        out = {k: L.view(getattr(self, k), name)
               for k in ("amax", "scale", "scale_inv", "block_scales")}
        for k in PER_QUANTIZER:
            if k in self._keys:
                out[k] = getattr(self, k)[i]
        return out

    def arrays(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self._keys}


def current_stream(dev: int) -> Tuple[Any, int]:
    """torch's current stream on device `dev` and its cudaStream_t."""
    t = _torch()
    s = t.cuda.current_stream(dev)
    return s, int(s.cuda_stream)


__all__ = ["DeviceBuffers", "DeviceResult", "DeviceUnavailable", "Doorbell", "PendingDevice",
           "StreamNotReleased", "device_name", "ipc", "memops", "release_after", "AmaxdError"]
