"""GPU-direct on a daemon without device state (CI: the host backend):
OpenDevice, ReconcileDevice and CloseDevice are refused with
FAILED_PRECONDITION and a sentence that says what to use instead, before
and after the job exists; unparsable requests are INVALID_ARGUMENT; the
refusals change nothing (the packed form still works after them). The
Python client refuses the device API with a clear error when torch, CUDA
or the daemon's backend does not allow it. On a GPU, tests/gpu/test_device.py
covers the device path itself."""
import os

import grpc
import numpy as np
import pytest

import amaxd
from amaxd import errors, pb

SVC = "/amaxd.v1.Calibration/"

pytestmark = pytest.mark.skipif(os.environ.get("AMAXD_BACKEND", "host") != "host",
                                reason="the refusal of a host-backend daemon")


def call(daemon, method, req, resp_cls):
    with daemon.channel() as ch:
        fn = ch.unary_unary(SVC + method, request_serializer=lambda m: m.SerializeToString(),
                            response_deserializer=resp_cls.FromString)
        return fn(req, timeout=10)


def test_host_backend_refuses_device_rpcs(daemon):
    reqs = [("OpenDevice", pb.OpenDeviceRequest(job="j", rank=0, layout_id=1, device="",
                                                pid=os.getpid()), pb.OpenDeviceResponse),
            ("ReconcileDevice", pb.ReconcileDeviceRequest(job="j", rank=0, layout_id=1,
                                                          device_id=2, send=True),
             pb.ReconcileDeviceResponse),
            ("CloseDevice", pb.CloseDeviceRequest(job="j", rank=0, device_id=2),
             pb.CloseDeviceResponse)]
    # Before the job exists and after: the backend is what is wrong.
    for phase in ("no job", "job"):
        if phase == "job":
            c = daemon.client("j", 0, 1)
            c.join()
            c.register([amaxd.Quantizer("q", [4], amaxd.Recipe.fp8_current())])
            lay = c.layout()
            reqs[0][1].layout_id = reqs[1][1].layout_id = lay.id
        for method, req, resp in reqs:
            with pytest.raises(grpc.RpcError) as ei:
                call(daemon, method, req, resp)
            e = ei.value
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, (method, phase, e.details())
            d = e.details()
            assert f"{method}: this daemon keeps its state on the host (backend 'host')" in d, d
            assert "CUDA backend" in d and "packed form" in d, d
    # Nothing changed: the packed form works, epoch 1 is still open.
    c.send_packed(np.array([1, 2, 3, 4], dtype=np.float32))
    res = c.reconcile_packed()
    assert res.epoch == 1 and res.amax.tolist() == [1, 2, 3, 4]
    c.close()
    assert "OpenDevice rejected (failed precondition)" in daemon.log()


def test_garbage_device_requests(daemon):
    with daemon.channel() as ch:
        for method in ("OpenDevice", "ReconcileDevice", "CloseDevice"):
            fn = ch.unary_unary(SVC + method)
            with pytest.raises(grpc.RpcError) as ei:
                fn(b"\xff\xff\xff\xff\x0f", timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method


def test_client_device_api_refused(daemon):
    c = daemon.client("k", 0, 1)
    c.join()
    c.register([amaxd.Quantizer("q", [4], amaxd.Recipe.fp8_current())])
    from amaxd import device
    try:
        import torch
        have_cuda = torch.cuda.is_available()
    except ImportError:
        have_cuda = False
    if not have_cuda:
        # No torch or no GPU here: a clear local error, nothing sent.
        with pytest.raises(device.DeviceUnavailable, match="GPU-direct needs"):
            c.open_device()
        with pytest.raises(device.DeviceUnavailable, match="GPU-direct needs"):
            c.reconcile_device()
    else:
        with pytest.raises(errors.FailedPrecondition, match="backend 'host'"):
            c.open_device()
    # The client still works.
    c.send_packed(np.ones(4, dtype=np.float32))
    assert c.reconcile_packed().epoch == 1
    c.close()
