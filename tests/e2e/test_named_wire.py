"""SendAmax and StreamAmax are read in place, without protobuf-c: the
daemon's reader must mean what protobuf means. Each request below is built
by hand on the wire (fields out of order, repeated scalars and strings,
unknown fields of every wire type at both levels, missing fields), decoded
by Python's protobuf for the expected meaning, sent as-is, and the daemon's
result compared with that meaning."""
import struct

import grpc
import numpy as np
import pytest

import amaxd
from amaxd import pb

SVC = "/amaxd.v1.Calibration/"


def varint(v):
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def fld(num, wt, payload):
    """One field: tag, then the payload (already encoded for its wire type)."""
    if wt == 2:
        payload = varint(len(payload)) + payload
    return varint(num << 3 | wt) + payload


def f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


UNKNOWN = (fld(15, 0, varint(300)) + fld(16, 1, b"\x01" * 8) + fld(17, 5, b"\x02" * 4) +
           fld(18, 2, b"ignored bytes"))


def update(*parts):
    return fld(4, 2, b"".join(parts))


# (id, request bytes): each accepted, with the meaning protobuf gives it.
CASES = [
    ("out-of-order",
     update(fld(2, 2, f32(1, 2, 3, 4)), fld(1, 2, b"w")) + fld(2, 0, varint(0)) + fld(1, 2, b"nw")),
    ("last-job-wins",
     fld(1, 2, b"ghost") + update(fld(1, 2, b"w"), fld(2, 2, f32(5, 1, 1, 1))) + fld(1, 2, b"nw")),
    ("last-name-and-values-win",
     fld(1, 2, b"nw") + update(fld(1, 2, b"nope"), fld(2, 2, f32(9, 9, 9)), fld(1, 2, b"w"),
                               fld(2, 2, f32(1, 6, 1, 1)))),
    ("unknown-fields-everywhere",
     UNKNOWN + fld(1, 2, b"nw") + update(UNKNOWN, fld(1, 2, b"w"), UNKNOWN,
                                         fld(2, 2, f32(1, 1, 7, 1)), UNKNOWN) + UNKNOWN),
    ("has-data-and-two-updates",
     fld(1, 2, b"nw") + update(fld(3, 2, b"\x00\x01\x00\x01"), fld(2, 2, f32(99, 1, 99, 8)),
                               fld(1, 2, b"w")) + update(fld(1, 2, b"s"), fld(2, 2, f32(3)))),
    ("epoch-zero-and-rank-zero-explicit",
     fld(3, 0, varint(0)) + fld(2, 0, varint(0)) + fld(1, 2, b"nw") +
     update(fld(1, 2, b"s"), fld(2, 2, f32(4)))),
]


def expected(blob, state):
    """Applies what protobuf says `blob` means to state {name: array}."""
    m = pb.SendAmaxRequest.FromString(blob)
    assert m.job == "nw" and m.rank == 0 and m.epoch == 0
    for u in m.updates:
        v = np.frombuffer(u.values, dtype=np.float32)
        if u.has_data:
            v = np.where(np.frombuffer(u.has_data, dtype=np.uint8) != 0, v, -np.inf)
        state[u.name] = np.maximum(state[u.name], v)
    return len(m.updates)


@pytest.mark.parametrize("method", ["SendAmax", "StreamAmax"])
def test_hand_built_requests_mean_what_protobuf_means(start_daemon, method):
    d = start_daemon()
    state = {"w": np.full(4, -np.inf, np.float32), "s": np.full(1, -np.inf, np.float32)}
    with d.client("nw", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [4], amaxd.Recipe.fp8_current()),
                    amaxd.Quantizer("s", [], amaxd.Recipe.fp8_current())])
        with d.channel() as ch:
            for case_id, blob in CASES:
                n = expected(blob, state)
                if method == "SendAmax":
                    resp = ch.unary_unary(SVC + method)(blob, timeout=10)
                else:
                    resp = ch.stream_unary(SVC + method)(iter([blob]), timeout=10)
                got = pb.SendAmaxResponse.FromString(resp)
                assert got.accepted == n, case_id
        assert c.status("nw").jobs[0].updates == sum(
            len(pb.SendAmaxRequest.FromString(b).updates) for _, b in CASES)
        res = c.reconcile()
    np.testing.assert_array_equal(res["w"].amax, state["w"])
    np.testing.assert_array_equal(res["s"].amax.reshape(-1), state["s"])


def test_update_without_a_name_is_not_found(start_daemon):
    d = start_daemon()
    with d.client("nw", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [4], amaxd.Recipe.fp8_current())])
        blob = fld(1, 2, b"nw") + update(fld(2, 2, f32(1, 1, 1, 1)))
        with d.channel() as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary(SVC + "SendAmax")(blob, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "quantizer '' is not registered" in e.value.details()
        assert c.status("nw").jobs[0].updates == 0
