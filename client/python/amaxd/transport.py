"""How a client reaches its daemon: the gRPC channel and its calls (unary
with protobuf messages, unary with bytes serialized already,
client-streaming), every grpc.RpcError turned into an amaxd.errors
exception here and nowhere else, and the shared-memory buffers through
which the packed form passes slabs and answers (Client(shm=True)).

A Channel is used by one Client; its calls may run on several threads at
once (gRPC's channel is thread-safe; the method cache is filled with
idempotent entries).
"""
import os
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional

import grpc
import numpy as np

from .errors import from_rpc_error

__all__ = ["DEFAULT_SOCKET", "SERVICE", "target", "Channel", "ShmBuffers", "open_shm",
           "pwrite_all", "pread_all"]

DEFAULT_SOCKET = "/run/amaxd/amaxd.sock"
SERVICE = "/amaxd.v1.Calibration/"


def target(socket: Optional[str], address: Optional[str]) -> str:
    """The gRPC target: `address` as given, else the Unix socket `socket`,
    $AMAXD_SOCKET or DEFAULT_SOCKET."""
    if address:
        return address
    path = socket or os.environ.get("AMAXD_SOCKET") or DEFAULT_SOCKET
    return path if path.startswith("unix:") else "unix:" + path


def _path(method: str) -> str:
    """A Calibration method name, or a whole "/package.Service/Method" path."""
    return method if method.startswith("/") else SERVICE + method


def _serialize(m: Any) -> bytes:
    return m.SerializeToString()


class Channel:
    """One gRPC channel to the daemon, with the client's default deadline."""

    def __init__(self, target: str, timeout: float, max_message_bytes: int) -> None:
        opts = [("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", -1)]
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=opts)
        self._calls: Dict[Any, Any] = {}

    def close(self) -> None:
        self._channel.close()

    def unary(self, method: str, req: Any, resp_cls: Any, timeout: Optional[float] = None) -> Any:
        """Calls `method` with the protobuf message `req`; the answer parsed
        as `resp_cls`."""
        fn = self._calls.get(method)
        if fn is None:
            fn = self._channel.unary_unary(_path(method), request_serializer=_serialize,
                                           response_deserializer=resp_cls.FromString)
            self._calls[method] = fn
        try:
            return fn(req, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def raw(self, method: str, data: bytes, parse: Optional[Callable[[bytes], Any]] = None,
            timeout: Optional[float] = None) -> Any:
        """A unary call with a request serialized already; parse(bytes) or
        the raw answer when parse is None."""
        key = (method, "raw")
        fn = self._calls.get(key)
        if fn is None:
            fn = self._channel.unary_unary(_path(method))
            self._calls[key] = fn
        try:
            out = fn(data, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return parse(out) if parse is not None else out

    def stream(self, method: str, requests: Iterator[Any], parse: Callable[[bytes], Any],
               serialize: Optional[Callable[[Any], bytes]] = None) -> Any:
        """A client-streaming call: `requests` are protobuf messages, or
        bytes serialized already when `serialize` is None."""
        fn = self._channel.stream_unary(_path(method), request_serializer=serialize,
                                        response_deserializer=parse)
        try:
            return fn(requests, timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


class ShmBuffers(NamedTuple):
    """The two files of a rank's shared buffer, open (GetLayout with shm):
    the daemon reads slabs from the first (values at 0, has-data bytes at
    has_data_offset, the statistics of calibrators beyond max at
    stats_offset and their stat epochs at stat_epochs_offset) and writes
    answers into the second."""

    slab_fd: int
    id: int
    has_data_offset: int
    answer_fd: int
    stats_offset: int = 0
    stat_epochs_offset: int = 0

    def close(self) -> None:
        os.close(self.slab_fd)
        os.close(self.answer_fd)


def open_shm(slab_path: str, answer_path: str, shm_id: int, has_data_offset: int,
             stats_offset: int = 0, stat_epochs_offset: int = 0) -> ShmBuffers:
    """Opens a shared buffer's files (as soon as GetLayout named them: the
    daemon unlinks them at their first use). An OSError says what to do
    when they cannot be opened."""
    fds = []
    try:
        for path, mode in ((slab_path, os.O_RDWR), (answer_path, os.O_RDONLY)):
            fds.append(os.open(path, mode | os.O_CLOEXEC | os.O_NOFOLLOW))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        raise OSError(e.errno, f"amaxd: cannot open the daemon's shared buffer "
                               f"{e.filename} ({e.strerror}); is this process on the "
                               f"daemon's host and does it see its shm_dir? "
                               f"Use Client(shm=False) otherwise") from None
    return ShmBuffers(fds[0], shm_id, has_data_offset, fds[1], stats_offset, stat_epochs_offset)


def pwrite_all(fd: int, arr: np.ndarray, offset: int) -> None:
    """Writes the bytes of a contiguous array at `offset` of file `fd`."""
    mv = memoryview(arr).cast("B")
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], offset + done)


def pread_all(fd: int, n: int, offset: int) -> memoryview:
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
