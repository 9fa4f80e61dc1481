"""The bad-input table: each case gets a precise gRPC status, a log line in
the daemon, and changes no state (checked by a reconcile at the end whose
result must reflect only the good contributions)."""
import struct
import threading
import time

import grpc
import numpy as np
import pytest

import amaxd
from amaxd import pb

SVC = "/amaxd.v1.Calibration/"
C = grpc.StatusCode


def raw(d, method, payload, timeout=10):
    """Sends `payload` bytes as-is; returns (code, details)."""
    with d.channel() as ch:
        try:
            ch.unary_unary(method)(payload, timeout=timeout)
            return C.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


def call(d, method, msg, timeout=10):
    return raw(d, SVC + method, msg.SerializeToString(), timeout)


def f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


def spec(name, shape, fmt=pb.FP8_E4M3, offset=(), local=(), recipe=True):
    s = pb.QuantizerSpec(name=name, global_shape=list(shape), offset=list(offset), local_shape=list(local))
    if recipe:
        s.recipe.CopyFrom(pb.Recipe(format=fmt))
    return s


def send(name, values, epoch=0, rank=0, job="bad", has_data=b""):
    return pb.SendAmaxRequest(job=job, rank=rank, epoch=epoch,
                              updates=[pb.AmaxUpdate(name=name, values=values, has_data=has_data)])


@pytest.fixture
def bad(start_daemon):
    d = start_daemon("--max-message-bytes=65536", "--max-cells=4096")
    with d.client("bad", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [4], amaxd.Recipe.fp8_current())])
        c.send({"w": [1, 2, 3, 4]})
        c.reconcile()          # epoch 1 closed: GetScales works
        c.send({"w": [5, 1, 1, 1]})  # pending in epoch 2
    return d


CASES = [
    # (id, method, request or raw bytes, expected code, text the message must contain)
    ("garbage-send", "SendAmax", b"\xff\xff\xff\xff", C.INVALID_ARGUMENT, "not a valid amaxd.v1.SendAmaxRequest"),
    ("garbage-join", "Join", b"\x0a\xff", C.INVALID_ARGUMENT, "not a valid amaxd.v1.JoinRequest"),
    ("garbage-register", "RegisterQuantizers", b"\x1a\x05\x0a", C.INVALID_ARGUMENT, "not a valid"),
    ("garbage-reconcile", "Reconcile", b"\x08", C.INVALID_ARGUMENT, "not a valid"),
    ("nan", "SendAmax", send("w", f32(1, float("nan"), 1, 1)), C.INVALID_ARGUMENT, "value[1] = nan"),
    ("negative", "SendAmax", send("w", f32(1, 1, -2, 1)), C.INVALID_ARGUMENT, "value[2] = -2"),
    ("inf", "SendAmax", send("w", f32(float("inf"), 1, 1, 1)), C.INVALID_ARGUMENT, "value[0] = inf"),
    ("-inf", "SendAmax", send("w", f32(float("-inf"), 1, 1, 1)), C.INVALID_ARGUMENT, "value[0] = -inf"),
    ("wrong-length", "SendAmax", send("w", f32(1, 2, 3)), C.INVALID_ARGUMENT, "has 12 bytes"),
    ("odd-bytes", "SendAmax", send("w", b"\x00" * 15), C.INVALID_ARGUMENT, "has 15 bytes"),
    ("has-data-length", "SendAmax", send("w", f32(1, 1, 1, 1), has_data=b"\x01"), C.INVALID_ARGUMENT, "has_data has 1 bytes"),
    ("unknown-quantizer", "SendAmax", send("nope", f32(1)), C.NOT_FOUND, "'nope' is not registered"),
    ("unknown-job", "SendAmax", send("w", f32(1, 1, 1, 1), job="ghost"), C.NOT_FOUND, "job 'ghost'"),
    ("bad-job-name", "SendAmax", send("w", f32(1, 1, 1, 1), job="a b"), C.INVALID_ARGUMENT, "job name"),
    ("rank-range", "SendAmax", send("w", f32(1, 1, 1, 1), rank=3), C.INVALID_ARGUMENT, "rank 3 is out of range"),
    ("closed-epoch", "SendAmax", send("w", f32(9, 9, 9, 9), epoch=1), C.FAILED_PRECONDITION, "already reconciled"),
    ("future-epoch", "SendAmax", send("w", f32(9, 9, 9, 9), epoch=7), C.FAILED_PRECONDITION, "not open yet"),
    ("oversized", "SendAmax", send("w", b"\x00" * 70000), C.RESOURCE_EXHAUSTED, "exceeds max_message_bytes=65536"),
    ("placement-outside", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("p", [8], offset=[6], local=[4])]), C.INVALID_ARGUMENT, "does not lie inside"),
    ("placement-arity", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("p", [8, 2], offset=[0], local=[4])]), C.INVALID_ARGUMENT, "offset has 1"),
    ("shape-conflict", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("w", [5])]), C.FAILED_PRECONDITION, "registered with global shape [4]"),
    ("recipe-conflict", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("w", [4], fmt=pb.NVFP4)]), C.FAILED_PRECONDITION, "another recipe"),
    ("too-many-dims", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("p", [1, 1, 1, 1, 1])]), C.INVALID_ARGUMENT, "at most 4"),
    ("zero-dim", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("p", [3, 0])]), C.INVALID_ARGUMENT, "global_shape[1] is 0"),
    ("bad-name", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("has space", [1])]), C.INVALID_ARGUMENT, "name"),
    ("no-recipe", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("p", [1], recipe=False)]), C.INVALID_ARGUMENT, "recipe is missing"),
    ("duplicate-in-request", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("p", [1]), spec("p", [1])]), C.INVALID_ARGUMENT, "appears twice"),
    ("catalog-too-big", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[spec("big", [4096])]), C.RESOURCE_EXHAUSTED, "max_cells=4096"),
    ("recipe-field-mismatch", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(format=pb.MXFP8, margin=1))]),
     C.INVALID_ARGUMENT, "margin applies"),
    ("nvfp4-convention-unknown", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(format=pb.NVFP4, nvfp4_convention=9))]),
     C.INVALID_ARGUMENT, "quantizer 'p': recipe.nvfp4_convention 9 is unknown (use TRANSFORMER_ENGINE, MODELOPT, "
                         "TRANSFORMER_ENGINE_LEGACY, MODELOPT_STATIC or TRANSFORMER_ENGINE_PARTIAL_CAST)"),
    ("rule-unknown", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(format=pb.FP8_E4M3, rule=5))]),
     C.INVALID_ARGUMENT, "quantizer 'p': recipe.rule 5 is unknown (use CURRENT, DELAYED, BLOCK_BF16 or BLOCK_FP16)"),
    ("rule-block-on-nvfp4", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(format=pb.NVFP4, rule=pb.BLOCK_BF16))]),
     C.INVALID_ARGUMENT, "recipe.rule applies to FP8 formats only"),
    ("eps-on-delayed", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(
         format=pb.FP8_E4M3, rule=pb.DELAYED, power_of_2=True))]),
     C.INVALID_ARGUMENT, "recipe.eps and power_of_2 apply to FP8 CURRENT (and BLOCK_BF16, BLOCK_FP16) scaling only"),
    ("output-modelopt-block", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(
         format=pb.FP8_E4M3, rule=pb.BLOCK_FP16, output_convention=pb.OUTPUT_MODELOPT))]),
     C.INVALID_ARGUMENT, "(ModelOpt has no FP8 block-scaling rules)"),
    ("output-convention-unknown", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(format=pb.NVFP4, output_convention=3))]),
     C.INVALID_ARGUMENT, "quantizer 'p': recipe.output_convention 3 is unknown"),
    ("output-modelopt-delayed", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(
         format=pb.FP8_E4M3, rule=pb.DELAYED, output_convention=pb.OUTPUT_MODELOPT))]),
     C.INVALID_ARGUMENT, "OUTPUT_MODELOPT applies to NVFP4 and FP8 CURRENT scaling only (ModelOpt has no delayed scaling)"),
    ("output-modelopt-mxfp8", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(
         format=pb.MXFP8, output_convention=pb.OUTPUT_MODELOPT))]),
     C.INVALID_ARGUMENT, "(ModelOpt has no MXFP8 export factors)"),
    ("history-convention-unknown", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(
         format=pb.FP8_E4M3, rule=pb.DELAYED, history_convention=7))]),
     C.INVALID_ARGUMENT, "recipe.history_convention 7 is unknown"),
    ("history-convention-current", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(
         format=pb.FP8_E4M3, history_convention=pb.HISTORY_TRANSFORMER_ENGINE_UNFUSED))]),
     C.INVALID_ARGUMENT, "recipe.history_convention applies to FP8 DELAYED scaling only"),
    ("mxfp8-convention-unknown", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(format=pb.MXFP8, mxfp8_convention=6))]),
     C.INVALID_ARGUMENT, "recipe.mxfp8_convention 6 is unknown (use MXFP8_TRANSFORMER_ENGINE, MXFP8_OCP, "
     "MXFP8_MODELOPT, MXFP8_TRANSFORMER_ENGINE_LEGACY or MXFP8_TRANSFORMER_ENGINE_2_18)"),
    ("mxfp8-convention-on-nvfp4", "RegisterQuantizers",
     pb.RegisterRequest(job="bad", quantizers=[pb.QuantizerSpec(name="p", recipe=pb.Recipe(format=pb.NVFP4, mxfp8_convention=pb.MXFP8_OCP))]),
     C.INVALID_ARGUMENT, "recipe.mxfp8_convention applies to MXFP8 only"),
    ("join-world-zero", "Join", pb.JoinRequest(job="x", rank=0, world_size=0), C.INVALID_ARGUMENT, "world_size 0"),
    ("join-world-conflict", "Join", pb.JoinRequest(job="bad", rank=0, world_size=3), C.FAILED_PRECONDITION, "world size 1, not 3"),
    ("join-rank-range", "Join", pb.JoinRequest(job="x", rank=2, world_size=2), C.INVALID_ARGUMENT, "rank 2 is out of range"),
    ("reconcile-closed-epoch", "Reconcile", pb.ReconcileRequest(job="bad", epoch=1), C.FAILED_PRECONDITION, "already reconciled"),
    ("reconcile-unknown-name", "Reconcile", pb.ReconcileRequest(job="bad", names=["zz"]), C.NOT_FOUND, "'zz'"),
    ("getscales-unknown", "GetScales", pb.GetScalesRequest(job="bad", names=["zz"]), C.NOT_FOUND, "'zz'"),
    ("reset-unknown", "Reset", pb.ResetRequest(job="bad", names=["w", "zz"]), C.NOT_FOUND, "nothing was reset"),
    ("reset-drop-with-names", "Reset", pb.ResetRequest(job="bad", names=["w"], drop_job=True), C.INVALID_ARGUMENT, "drop_job"),
    ("list-unknown-job", "ListQuantizers", pb.ListQuantizersRequest(job="ghost"), C.NOT_FOUND, "ghost"),
    ("status-unknown-job", "Status", pb.StatusRequest(job="ghost"), C.NOT_FOUND, "ghost"),
]


def snapshot(d):
    with d.client("bad", 0, 1) as c:
        st = c.status("bad").jobs[0]
        lst = [q.SerializeToString() for q in c.list_quantizers().quantizers]
        sc = c.get_scales(whole=True)["w"]
    return (st.epoch, st.quantizers, st.cells, st.updates, lst, sc.amax.tobytes(), sc.scale.tobytes())


def test_bad_input_table(bad):
    before = snapshot(bad)
    for case_id, method, req, code, text in CASES:
        payload = req if isinstance(req, bytes) else req.SerializeToString()
        got, details = raw(bad, SVC + method, payload)
        assert got == code, f"{case_id}: got {got} ({details}), expected {code}"
        assert text in details, f"{case_id}: message {details!r} lacks {text!r}"
        assert details in bad.log(), f"{case_id}: no log line for {details!r}"
        assert snapshot(bad) == before, f"{case_id} changed the state"
    # Only the good contributions are in the open epoch.
    with bad.client("bad", 0, 1) as c:
        r = c.reconcile()["w"]
    np.testing.assert_array_equal(r.amax, np.array([5, 2, 3, 4], np.float32))


def test_unknown_method_is_unimplemented(bad):
    code, details = raw(bad, "/amaxd.v1.Calibration/NoSuchThing", b"")
    assert code == C.UNIMPLEMENTED and "NoSuchThing" in details
    code, _ = raw(bad, "/grpc.health.v1.Health/Watch", b"")
    assert code == C.UNIMPLEMENTED
    assert "NoSuchThing is not served" in bad.log()


def test_stream_stops_at_first_bad_message(bad):
    msgs = [send("w", f32(1, 1, 1, 7)), send("w", f32(1, float("nan"), 1, 1)), send("w", f32(9, 9, 9, 9))]
    with bad.channel() as ch:
        fn = ch.stream_unary(SVC + "StreamAmax", request_serializer=lambda m: m.SerializeToString())
        with pytest.raises(grpc.RpcError) as e:
            fn(iter(msgs), timeout=10)
    assert e.value.code() == C.INVALID_ARGUMENT and "value[1] = nan" in e.value.details()
    assert "StreamAmax message rejected after 1 accepted" in bad.log()
    with bad.client("bad", 0, 1) as c:
        r = c.reconcile()["w"]
    np.testing.assert_array_equal(r.amax, np.array([5, 2, 3, 7], np.float32))  # 9s never applied


def test_garbage_in_stream(bad):
    with bad.channel() as ch:
        fn = ch.stream_unary(SVC + "StreamAmax")
        with pytest.raises(grpc.RpcError) as e:
            fn(iter([b"\xff\xfe\xfd"]), timeout=10)
    assert e.value.code() == C.INVALID_ARGUMENT


def test_oversized_stream_message(bad):
    with bad.channel() as ch:
        fn = ch.stream_unary(SVC + "StreamAmax", request_serializer=lambda m: m.SerializeToString())
        with pytest.raises(grpc.RpcError) as e:
            fn(iter([send("w", b"\x00" * 70000)]), timeout=10)
    assert e.value.code() == C.RESOURCE_EXHAUSTED


def test_send_before_job_ready(start_daemon):
    d = start_daemon()
    errs = []

    def join():
        try:
            with d.client("half", 0, 2, timeout=3) as c:
                c.join()
        except amaxd.AmaxdError as e:
            errs.append(e)

    t = threading.Thread(target=join)
    t.start()
    time.sleep(0.5)
    code, details = call(d, "SendAmax", send("w", f32(1), job="half"))
    assert code == C.FAILED_PRECONDITION and "1 of 2 ranks have joined" in details
    t.join()
    assert isinstance(errs[0], amaxd.errors.DeadlineExceeded)
    # The rank that gave up no longer counts: the job is gone.
    code, _ = call(d, "Status", pb.StatusRequest(job="half"))
    assert code == C.NOT_FOUND


def test_unknown_convention_names_in_the_client():
    """The Python client refuses a convention name it does not know, naming the choices."""
    with pytest.raises(ValueError, match="unknown NVFP4 convention 'trt': use one of"):
        amaxd.Recipe.nvfp4("trt")
    with pytest.raises(ValueError, match=r"\['modelopt', 'ocp', 'te', 'te_2_18', 'te_legacy'\]"):
        amaxd.Recipe.mxfp8("ieee")
    with pytest.raises(ValueError, match="unknown history convention"):
        amaxd.Recipe.fp8_delayed(history="legacy")
