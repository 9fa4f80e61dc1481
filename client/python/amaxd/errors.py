"""Typed exceptions, one per gRPC status the daemon returns."""
from typing import Any, Tuple

import grpc


class AmaxdError(Exception):
    """Base class: `code` is the grpc.StatusCode, `message` the daemon's sentence."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    def __reduce__(self) -> Tuple[Any, ...]:
        # Picklable, so that an error raised in a worker process (e.g. a
        # ProcessPoolExecutor of trainer ranks) arrives as itself.
        return (type(self), (self.code, self.message))


class InvalidArgument(AmaxdError):
    """The request was malformed: bad name, shape, NaN/negative amax..."""


class NotFound(AmaxdError):
    """Unknown job or quantizer."""


class FailedPrecondition(AmaxdError):
    """Valid request at the wrong time: job not ready, epoch closed, conflict."""


class ResourceExhausted(AmaxdError):
    """Message or catalog too large, too many jobs."""


class DeadlineExceeded(AmaxdError):
    """Other ranks did not arrive in time (Join/Reconcile), or the client deadline passed."""


class Unavailable(AmaxdError):
    """The daemon cannot be reached or is shutting down."""


class Aborted(AmaxdError):
    """The job was dropped while this call waited."""


class Unimplemented(AmaxdError):
    """The daemon does not serve this method."""


class Internal(AmaxdError):
    """A bug or a device error in the daemon."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.INTERNAL: Internal,
}


_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def from_status(code: int, message: str) -> AmaxdError:
    """The AmaxdError of a numeric gRPC status code (the doorbell's answers)."""
    sc = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(sc, AmaxdError)(sc, message)


def from_rpc_error(err: grpc.RpcError) -> AmaxdError:
    """Turns a grpc.RpcError into the matching AmaxdError subclass."""
    code = err.code()  # type: ignore[attr-defined]  # a call's error is a grpc.Call too
    return _BY_CODE.get(code, AmaxdError)(code, err.details() or "")  # type: ignore[attr-defined]
