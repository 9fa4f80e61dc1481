"""Writes the seed corpus of tests/fuzz/fuzz_requests: valid requests of
every method (a byte naming the method, then the serialized request),
forming a job's life: Join, Register, SendAmax, Reconcile, GetScales in
windows, Reset, Status, ListQuantizers, Health, and the peer service's
messages.

    python tests/fuzz/make_seeds.py FUZZ_BINARY OUT_DIR
"""
import importlib
import importlib.util
import os
import struct
import subprocess
import sys
import tempfile

from amaxd import pb

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def peer_module():
    """amaxd/peer/v1/peer.proto compiled for Python (the client package
    carries only amaxd.v1)."""
    from grpc_tools import protoc
    out = tempfile.mkdtemp(prefix="amaxd-fuzz-pb-")
    inc = os.path.join(ROOT, "proto")
    rc = protoc.main(["protoc", f"-I{inc}", f"--python_out={out}",
                      os.path.join(inc, "amaxd/peer/v1/peer.proto"),
                      os.path.join(inc, "amaxd/v1/amaxd.proto")])
    if rc != 0:
        raise SystemExit("protoc failed")
    # Its import of amaxd/v1/amaxd.proto is the client package's module.
    path = os.path.join(out, "amaxd", "peer", "v1", "peer_pb2.py")
    src = open(path).read().replace("from amaxd.v1 import amaxd_pb2", "from amaxd._gen import amaxd_pb2")
    spec = importlib.util.spec_from_loader("amaxd_peer_pb2", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


def f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


def spec(name, shape, fmt=pb.FP8_E4M3, **kw):
    return pb.QuantizerSpec(name=name, global_shape=list(shape), recipe=pb.Recipe(format=fmt), **kw)


def main():
    binary, out = sys.argv[1], sys.argv[2]
    ppb = peer_module()
    table = subprocess.run([binary], env=dict(os.environ, AMAXD_FUZZ_LIST="1"),
                           capture_output=True, text=True, check=True).stdout.split("\n")
    index = {line.split()[1]: int(line.split()[0]) for line in table if line.strip()}
    C, P = "/amaxd.v1.Calibration/", "/amaxd.peer.v1.Peer/"
    reqs = [
        (C + "Join", pb.JoinRequest(job="j", rank=0, world_size=1)),
        (C + "Join", pb.JoinRequest(job="k", rank=1, world_size=2)),
        (C + "RegisterQuantizers", pb.RegisterRequest(job="j", quantizers=[
            spec("w", [4]), spec("x", [2, 3], fmt=pb.NVFP4, scale_group="qkv"),
            spec("e", [4], fmt=pb.MXFP8, peer_group="experts", offset=[2], local_shape=[2]),
            pb.QuantizerSpec(name="d", global_shape=[3], accumulation=pb.PER_EPOCH,
                             recipe=pb.Recipe(format=pb.FP8_E4M3, rule=pb.DELAYED,
                                              history_len=4, margin=1))])),
        (C + "SendAmax", pb.SendAmaxRequest(job="j", updates=[
            pb.AmaxUpdate(name="w", values=f32(1, 2, 3, 4)),
            pb.AmaxUpdate(name="e", values=f32(5, 6), has_data=b"\x01\x00")])),
        # Calibrators beyond max (issue 23): a histogram and an MSE search,
        # then a statistic against a basis.
        (C + "RegisterQuantizers", pb.RegisterRequest(job="j", quantizers=[
            pb.QuantizerSpec(name="h", global_shape=[], recipe=pb.Recipe(format=pb.FP8_E4M3),
                             calibrator=pb.Calibrator(
                                 kind=pb.CALIBRATOR_HISTOGRAM, num_bins=8,
                                 method=pb.PERCENTILE, percentile=99.9, start_bin=4,
                                 stride=1, num_bits=8, torch_cpu=pb.TORCH_CPU_AVX2)),
            pb.QuantizerSpec(name="m", global_shape=[2], recipe=pb.Recipe(format=pb.FP8_E4M3),
                             calibrator=pb.Calibrator(
                                 kind=pb.CALIBRATOR_MSE, start_multiplier=0.5,
                                 stop_multiplier=1.0, step_size=0.25,
                                 torch_cpu=pb.TORCH_CPU_AVX2))])),
        (C + "SendAmax", pb.SendAmaxRequest(job="j", epoch=2, updates=[
            pb.AmaxUpdate(name="h", values=f32(3), stat=struct.pack("<9d", *range(9)),
                          stat_epoch=1)])),
        (C + "StreamAmax", pb.SendAmaxRequest(job="j", epoch=1, updates=[
            pb.AmaxUpdate(name="x", values=f32(1, 2, 3, 4, 5, 6))])),
        (C + "Reconcile", pb.ReconcileRequest(job="j", names=["w"])),
        (C + "Reconcile", pb.ReconcileRequest(job="j", epoch=1)),
        (C + "GetScales", pb.GetScalesRequest(job="j", names=["x", "w"], start_cell=3, max_cells=5)),
        (C + "GetScales", pb.GetScalesRequest(job="j", **{"global": True})),
        (C + "Reset", pb.ResetRequest(job="j", names=["w"])),
        (C + "Reset", pb.ResetRequest(job="k", drop_job=True)),
        (C + "Status", pb.StatusRequest(job="j")),
        (C + "ListQuantizers", pb.ListQuantizersRequest(job="j")),
        ("/grpc.health.v1.Health/Check", b"\x0a\x15amaxd.v1.Calibration"),
        (P + "Join", ppb.JoinRequest(job="j", world_size=2, rank=1, daemon=1,
                                     address="127.0.0.1:7420")),
        (P + "Sync", ppb.SyncRequest(job="j", daemon=1, resets=["w"], ranks=[1], world_size=2)),
        (P + "KvSet", ppb.KvSetRequest(key="k", value=b"v")),
        (P + "KvGet", ppb.KvGetRequest(key="k")),
        (P + "FetchState", ppb.FetchStateRequest(job="j", max_bytes=4096)),
        (P + "Abort", ppb.AbortRequest(job="j", comm_generation=1, reason="test")),
        (P + "Progress", ppb.ProgressRequest(job="j", epoch=1)),
        (P + "Drop", ppb.DropRequest(job="j", **{"from": 1})),
    ]
    os.makedirs(out, exist_ok=True)
    # Inputs that once found a bug stay in the corpus.
    regress = os.path.join(ROOT, "tests", "fuzz", "regress")
    for name in sorted(os.listdir(regress)):
        with open(os.path.join(regress, name), "rb") as src, \
                open(os.path.join(out, "regress-" + name), "wb") as dst:
            dst.write(src.read())
    for i, (method, req) in enumerate(reqs):
        body = req if isinstance(req, bytes) else req.SerializeToString()
        with open(os.path.join(out, f"seed-{i:02d}"), "wb") as f:
            f.write(bytes([index[method]]) + body)
    print(f"{len(reqs)} seeds in {out}")


if __name__ == "__main__":
    main()
