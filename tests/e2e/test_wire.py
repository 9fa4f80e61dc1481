"""The hand-written protobuf codecs of amaxd/wire.py against protobuf's own
serialization and parsing, field by field (no daemon needed).

Encoders: byte for byte where protobuf's encoding is canonical, i.e. where
the hand encoder writes what protobuf writes (RegisterRequest and its
QuantizerSpecs with a non-empty job and name, HealthCheckRequest); by
parse equality otherwise (an empty job or name is written anyway;
SendPackedRequest puts its values last, after an align field). Decoders:
protobuf serializes random messages, the hand parser must read the same
values, also from messages protobuf would not write (fields repeated, out
of order, unknown fields of every wire type, a known number with the wrong
wire type). Each test first checks that it knows every field of the
message, so that a field added to the .proto fails here until the codec
and this test handle it."""
import dataclasses
import random
import struct

import numpy as np
import pytest

import amaxd
from amaxd import pb, wire
from amaxd import placement as P

SEED = 20
N = 400  # random messages per test

U32 = [0, 1, 127, 128, 255, 16383, 16384, 2**21, 2**28, 2**31, 2**32 - 1]
U64 = U32 + [2**32, 2**35, 2**56, 2**63 - 1, 2**63, 2**64 - 1]
F32 = [0.0, -0.0, 1.0, -1.0, -1.5, 0.1, -3.4e38, 3.4e38, 1e-45, -1e-45, float("inf"),
       float("-inf"), float("nan"), 448.0, 2.0**-126]
NAMES = ["", "a", "layers.0.mlp.experts.3.linear_fc1.weight_quantizer", "ü", "層.0.注意",
         "emoji.😀", "x" * 127, "y" * 128, "z" * 300, "tab\tnl\nnul\0"]


def fields(msg):
    return {f.name for f in msg.DESCRIPTOR.fields}


def keys(raw):
    """(field number, wire type) of each field of a serialized message, in
    order (a minimal reader, independent of wire.py)."""
    out, i = [], 0
    while i < len(raw):
        k, i = _varint_at(raw, i)
        num, wt = k >> 3, k & 7
        out.append((num, wt))
        if wt == 0:
            _, i = _varint_at(raw, i)
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        elif wt == 2:
            n, i = _varint_at(raw, i)
            i += n
        else:
            raise AssertionError(f"wire type {wt}")
    assert i == len(raw)
    return out


def _varint_at(b, i):
    v = s = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return v, i


def same_message(a, b):
    """Parse equality: every field equal, floats by their bits (NaN, -0.0),
    and nothing else (no unknown fields) in either."""
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True), \
        f"\n{a}\n!=\n{b}"


# -- varint --

def test_varint_matches_protobuf():
    rng = random.Random(SEED)
    values = U64 + [rng.getrandbits(rng.randint(1, 64)) for _ in range(2000)]
    for n in values:
        # SendAmaxResponse.accepted: uint64 field 1, key 0x08.
        want = pb.SendAmaxResponse(accepted=n).SerializeToString()[1:] if n else b"\x00"
        got = wire.varint(n)
        assert got == want, (n, got.hex(), want.hex())
        assert wire.read_varint(b"\xff" + got + b"\x01", 1) == (n, 1 + len(got))


# -- RegisterRequest / QuantizerSpec / Recipe --

RECIPE_FIELDS = {"format", "rule", "margin", "history_len", "history_reduce", "eps",
                 "power_of_2", "nvfp4_convention", "output_convention", "history_convention",
                 "mxfp8_convention"}
SPEC_FIELDS = {"name", "global_shape", "recipe", "accumulation", "peer_group", "scale_group",
               "offset", "local_shape", "peer_mode", "global_axes", "calibrator"}


def test_the_test_knows_every_field():
    assert fields(pb.Recipe) == RECIPE_FIELDS
    assert {f.name for f in dataclasses.fields(amaxd.Recipe)} == RECIPE_FIELDS
    assert fields(pb.QuantizerSpec) == SPEC_FIELDS
    assert fields(pb.RegisterRequest) == {"job", "rank", "quantizers"}
    assert fields(pb.SendPackedRequest) == SEND_PACKED_HAND | SEND_PACKED_PROTOBUF
    assert fields(pb.ReconcilePackedResponse) == set(RPR_ARRAYS) | set(RPR_NUMBERS) | {"align"}


def random_recipe(rng):
    enum = lambda: rng.choice([0, 0, 1, 2, 3, 4, 5, 99, 2**31 - 1])  # noqa: E731
    if rng.random() < 0.3:
        return rng.choice([amaxd.Recipe.fp8_current(), amaxd.Recipe.fp8_delayed(history_len=3),
                           amaxd.Recipe.nvfp4("modelopt", output="modelopt"),
                           amaxd.Recipe.mxfp8("te_2_18"), amaxd.Recipe(margin=-0.0),
                           amaxd.Recipe(eps=-0.0), amaxd.Recipe()])
    return amaxd.Recipe(format=enum(), rule=enum(), margin=rng.choice(F32),
                        history_len=rng.choice(U32), history_reduce=enum(), eps=rng.choice(F32),
                        power_of_2=rng.random() < 0.5, nvfp4_convention=enum(),
                        output_convention=enum(), history_convention=enum(),
                        mxfp8_convention=enum())


def random_calibrator(rng):
    """None, ModelOpt-like calibrators, or any field values (the daemon
    validates; the codec writes what it is given)."""
    r = rng.random()
    if r < 0.5:
        return None
    if r < 0.7:
        return rng.choice([amaxd.Calibrator.histogram("entropy", torch_cpu_build="avx512"),
                           amaxd.Calibrator.histogram("mse", 512, grid="e4m3",
                                                      torch_cpu_build="default"),
                           amaxd.Calibrator.mse(torch_cpu_build="avx2"), amaxd.Calibrator()])
    enum = lambda: rng.choice([0, 1, 2, 3, 99])  # noqa: E731
    f64 = lambda: rng.choice([0.0, -0.0, 99.99, 1e300, float("inf"), 0.1])  # noqa: E731
    return amaxd.Calibrator(kind=enum(), num_bins=rng.choice(U32), method=enum(),
                            percentile=f64(), start_bin=rng.choice(U32), stride=rng.choice(U32),
                            skip_zeros=rng.random() < 0.5, num_bits=rng.choice(U32),
                            is_unsigned=rng.random() < 0.5, grid=enum(), torch_cpu=enum(),
                            start_multiplier=f64(), stop_multiplier=f64(), step_size=f64())


def random_quantizer(rng):
    ndim = rng.randint(0, 4)
    shape = [rng.choice(U32[1:]) for _ in range(ndim)]
    if rng.random() < 0.3:  # numpy integers, as models give them
        shape = [np.int64(d) if d < 2**63 else d for d in shape]
    placement = rng.choice([None, None, P.Placement((), ()),
                            P.Placement(tuple(rng.choice(U32) for _ in range(ndim)),
                                        tuple(rng.choice(U32) for _ in range(ndim)))])
    return amaxd.Quantizer(rng.choice(NAMES), shape, random_recipe(rng), placement,
                           accumulation=rng.choice([0, amaxd.RUNNING_MAX, amaxd.PER_EPOCH, 7]),
                           peer_group=rng.choice(NAMES), scale_group=rng.choice(NAMES),
                           peer_mode=rng.choice([None, "fill", "share"]),
                           global_axes=rng.choice([0, 0, 1, 2, 3, 2**32 - 1]),
                           calibrator=random_calibrator(rng))


def test_quantizer_spec_matches_protobuf():
    """Each QuantizerSpec alone: byte for byte when its name is set (what
    protobuf writes), else equal once parsed."""
    rng = random.Random(SEED)
    for _ in range(N * 5):
        q = random_quantizer(rng)
        want = pb.RegisterRequest(quantizers=[q.to_pb()])
        got = wire.spec_bytes(q, {})
        if q.name:
            assert got == want.SerializeToString(), q
        same_message(pb.RegisterRequest.FromString(got), want)


def test_every_spec_field_is_written():
    """A quantizer that sets every field: each appears in the hand bytes,
    in field-number order, once."""
    q = amaxd.Quantizer("q", [4, 8], amaxd.Recipe.fp8_delayed(margin=-1.5, history_len=3),
                        P.shard([4, 8], 1, 1, 2), accumulation=amaxd.PER_EPOCH,
                        peer_group="g", scale_group="s", peer_mode="share", global_axes=1,
                        calibrator=amaxd.Calibrator.mse(torch_cpu_build="avx2"))
    spec = pb.RegisterRequest.FromString(wire.spec_bytes(q, {})).quantizers[0]
    assert {f.name for f, _ in spec.ListFields()} == SPEC_FIELDS
    assert {f.name for f, _ in spec.recipe.ListFields()} == {
        "format", "rule", "margin", "history_len", "history_reduce", "history_convention"}
    inner = wire.spec_bytes(q, {})
    inner = inner[1 + len(wire.varint(len(inner) - 2)):]  # the QuantizerSpec itself
    assert [n for n, _ in keys(inner)] == sorted(f.number for f in pb.QuantizerSpec.DESCRIPTOR.fields)


def test_register_request_matches_protobuf():
    """Whole requests as Client.register makes them (one recipe cache for
    all quantizers): byte for byte when job and every name are set."""
    rng = random.Random(SEED + 1)
    for _ in range(N):
        qs = [random_quantizer(rng) for _ in range(rng.randint(0, 12))]
        # The same recipe values with both signs of zero in one request.
        qs += [amaxd.Quantizer("m", [], amaxd.Recipe(margin=0.0)),
               amaxd.Quantizer("n", [], amaxd.Recipe(margin=-0.0)),
               amaxd.Quantizer("e", [], amaxd.Recipe(eps=-0.0))]
        rng.shuffle(qs)
        job, rank = rng.choice(NAMES), rng.choice(U32)
        cache = {}
        got = wire.register_head(job, rank) + b"".join(wire.spec_bytes(q, cache) for q in qs)
        want = pb.RegisterRequest(job=job, rank=rank, quantizers=[q.to_pb() for q in qs])
        if job and all(q.name for q in qs):
            assert got == want.SerializeToString()
        same_message(pb.RegisterRequest.FromString(got), want)


def test_client_register_bytes(monkeypatch):
    """Client.register sends head + specs per batch: what reaches the
    channel parses as the RegisterRequest protobuf would make."""
    sent = []

    def raw(self, method, data, parse=None, timeout=None):
        sent.append((method, data))
        return parse(pb.RegisterResponse(created=1).SerializeToString())

    monkeypatch.setattr(amaxd.transport.Channel, "raw", raw)
    rng = random.Random(SEED + 2)
    qs = [random_quantizer(rng) for _ in range(25)]
    with amaxd.Client("job.ü", 3, 4, socket="/nonexistent") as c:
        assert c.register(qs, batch=10).created == 3
    assert [m for m, _ in sent] == ["RegisterQuantizers"] * 3
    for i, (_, data) in enumerate(sent):
        want = pb.RegisterRequest(job="job.ü", rank=3,
                                  quantizers=[q.to_pb() for q in qs[10 * i:10 * i + 10]])
        same_message(pb.RegisterRequest.FromString(data), want)


# -- SendPackedRequest --

SEND_PACKED_HAND = {"job", "rank", "epoch", "layout_id", "values", "has_data", "align", "stats",
                    "stat_epochs"}
# With Client(shm=True) the request carries no array and protobuf makes it.
SEND_PACKED_PROTOBUF = {"shm_id", "shm_has_data", "shm_stats"}


def random_f32(rng, n):
    """float32 values of every kind: random bit patterns (NaN payloads,
    infinities, denormals, -0.0) and ordinary amax values."""
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    v = bits.view("<f4").copy()
    pick = rng.random(n) < 0.5
    v[pick] = rng.standard_normal(int(pick.sum())).astype("<f4") * 100
    return v


def test_send_packed_matches_protobuf():
    rng = np.random.default_rng(SEED)
    prng = random.Random(SEED)
    sizes = [0, 1, 3, 4, 5, 16, 31, 32, 33, 1000, 4097]
    for it in range(N):
        n = sizes[it % len(sizes)] if it < 2 * len(sizes) else int(rng.integers(0, 3000))
        v = random_f32(rng, n)
        m = None
        kind = it % 4
        if kind == 1:
            m = rng.integers(0, 2, size=n, dtype=np.uint8)
        elif kind == 2:
            m = rng.integers(0, 256, size=n, dtype=np.uint8)  # any byte goes as it is
        elif kind == 3:
            m = amaxd.packed.as_mask(rng.random(n) < 0.5)
        job, rank = prng.choice(NAMES), prng.choice(U32)
        epoch, layout_id = prng.choice(U64), prng.choice(U64 + [prng.getrandbits(64)])
        st = se = None
        if it % 3 == 1:  # statistics of calibrators beyond max
            st = rng.standard_normal(int(rng.integers(0, 50))).astype("<f8")
            se = rng.integers(0, 2**63, size=int(rng.integers(0, 6)), dtype=np.uint64)
        got = wire.encode_send_packed(job, rank, epoch, layout_id, v, m, st, se)

        msg = pb.SendPackedRequest.FromString(got)
        want = pb.SendPackedRequest(job=job, rank=rank, epoch=epoch, layout_id=layout_id,
                                    values=v.tobytes(), align=msg.align,
                                    has_data=b"" if m is None else m.tobytes(),
                                    stats=b"" if st is None else st.tobytes(),
                                    stat_epochs=b"" if se is None else se.tobytes())
        same_message(msg, want)
        assert set(msg.align) <= {0} and len(msg.align) < 16
        # The values come last, 16-byte aligned in the message.
        assert got[len(got) - v.nbytes:] == v.tobytes()
        assert (len(got) - v.nbytes) % 16 == 0
        # Each field once: job, rank, epoch (when not 0), layout_id,
        # has_data (when given), align, values.
        order = [1] + ([2] if rank else []) + ([3] if epoch else []) + [4] + \
            ([6] if m is not None else []) + ([9, 10] if st is not None else []) + [15, 5]
        assert [k for k, _ in keys(got)] == order


def test_client_packed_request_bytes():
    """Client._packed_req (inline and without shm): what the client sends,
    from numpy values and a bool mask."""
    c = amaxd.Client("j", 2, 4, socket="/nonexistent")
    c._layout = amaxd.Layout(7, 5, ["a"], np.array([0], np.uint64), np.array([5], np.uint64),
                             [(0,)], [(5,)], [(5,)], [1])
    c.epoch = 9
    v = np.array([1, -0.0, 3, np.inf, 5], np.float64)  # converted to float32
    mask = np.array([True, False, True, True, False])
    for has in (None, mask):
        msg = pb.SendPackedRequest.FromString(c._packed_req(v, has, None))
        same_message(msg, pb.SendPackedRequest(
            job="j", rank=2, epoch=9, layout_id=7, values=v.astype("<f4").tobytes(),
            has_data=b"" if has is None else has.astype(np.uint8).tobytes(), align=msg.align))
    c.close()


# -- ReconcilePackedResponse --

RPR_ARRAYS = {"amax": "<f4", "scale": "<f4", "scale_inv": "<f4", "block_scales": "u1",
              "global_amax": "<f4", "global_scale": "<f4", "global_scale_inv": "<f4",
              "missing": "<u4", "has_previous": "u1", "previous_global_amax": "<f4",
              "previous_global_scale": "<f4", "filled": "u1", "global_amaxes": "<f4",
              "global_scales": "<f4", "global_scale_invs": "<f4", "stat_state": "u1",
              "stat_epoch": "<u8", "stat_total": "<f8", "stat_overflow": "<f8",
              "stat_basis": "<f4"}
RPR_NUMBERS = {"epoch": U64, "next_epoch": U64, "layout_id": U64, "shm_bytes": U64,
               "peer_fill_known": [False, True]}


def random_rpr(rng, prng, present=0.7):
    kw = {}
    for name, dt in RPR_ARRAYS.items():
        if prng.random() < present:
            n = int(rng.integers(0, 40))
            if dt == "<f8":
                kw[name] = rng.standard_normal(n).tobytes()
                continue
            kw[name] = (random_f32(rng, n) if dt == "<f4" else
                        rng.integers(0, 2**63 if dt == "<u8" else 2**32 if dt == "<u4" else 256,
                                     size=n, dtype=np.uint64).astype(dt)).tobytes()
    for name, vals in RPR_NUMBERS.items():
        if prng.random() < present:
            kw[name] = prng.choice(vals + [prng.getrandbits(64)] if vals is U64 else vals)
    if prng.random() < 0.3:
        kw["align"] = bytes(prng.randint(0, 17))
    return pb.ReconcilePackedResponse(**kw)


def check_parsed(got, msg):
    """The hand parser's fields against protobuf's message."""
    for name in RPR_NUMBERS:
        assert got.get(name, type(getattr(msg, name))()) == getattr(msg, name), name
        if name in got:
            assert type(got[name]) is type(getattr(msg, name)), name
    for name, dt in RPR_ARRAYS.items():
        if name in got:
            assert got[name].dtype == np.dtype(dt), name
            assert got[name].tobytes() == getattr(msg, name), name
        else:
            assert getattr(msg, name) == b"", name
    assert set(got) <= set(RPR_NUMBERS) | set(RPR_ARRAYS)


def test_reconcile_packed_parser_matches_protobuf():
    rng = np.random.default_rng(SEED)
    prng = random.Random(SEED)
    for it in range(N):
        msg = random_rpr(rng, prng, present=[0.0, 1.0, 0.7][it % 3])
        raw = msg.SerializeToString()
        check_parsed(wire.parse_reconcile_packed(raw), msg)
        # As the shm path gives it: a read-only memoryview.
        check_parsed(wire.parse_reconcile_packed(memoryview(bytearray(raw)).toreadonly()), msg)


def unknown_fields(prng):
    """Fields this message does not have, of every wire type."""
    out = b""
    for num in prng.sample([26, 27, 30, 32, 100, 1000, 2**29 - 1], 3):
        wt = prng.choice([0, 1, 2, 5])
        out += wire.varint(num << 3 | wt)
        if wt == 0:
            out += wire.varint(prng.choice(U64))
        elif wt == 1:
            out += struct.pack("<Q", prng.getrandbits(64))
        elif wt == 5:
            out += struct.pack("<I", prng.getrandbits(32))
        else:
            body = bytes(prng.getrandbits(8) for _ in range(prng.randint(0, 20)))
            out += wire.varint(len(body)) + body
    return out


def test_reconcile_packed_parser_on_messages_protobuf_would_not_write():
    """Concatenated messages (protobuf merges them: the last occurrence of
    a number or an array wins), align fields anywhere, unknown fields, a
    known number with another wire type (protobuf keeps it as unknown)."""
    rng = np.random.default_rng(SEED + 1)
    prng = random.Random(SEED + 1)
    for _ in range(N):
        parts = [random_rpr(rng, prng, present=0.4).SerializeToString()
                 for _ in range(prng.randint(1, 4))]
        parts += [unknown_fields(prng) for _ in range(prng.randint(0, 3))]
        # amax (4, bytes) as a varint; epoch (1, varint) as bytes; layout_id (3, fixed64) as fixed32.
        parts += prng.sample([b"\x20\x05", b"\x0a\x02\x01\x02", b"\x1d\x01\x02\x03\x04",
                              b"\xfa\x01\x03\x00\x00\x00"], prng.randint(0, 4))
        prng.shuffle(parts)
        raw = b"".join(parts)
        msg = pb.ReconcilePackedResponse.FromString(raw)
        check_parsed(wire.parse_reconcile_packed(raw), msg)


def test_reconcile_packed_parser_refuses_truncated_messages():
    msg = pb.ReconcilePackedResponse(epoch=3, amax=np.ones(4, "<f4").tobytes(), layout_id=9)
    raw = msg.SerializeToString()
    for cut in range(1, len(raw)):
        try:
            got = wire.parse_reconcile_packed(raw[:cut])
        except (ValueError, IndexError, struct.error):
            continue
        # A cut at a field boundary is a shorter valid message.
        check_parsed(got, pb.ReconcilePackedResponse.FromString(raw[:cut]))


def test_packed_result_reads_what_protobuf_wrote():
    """PackedResult (packed.py, on wire.parse_reconcile_packed) for a
    layout of two quantizers, against the protobuf message."""
    rng = np.random.default_rng(SEED)
    L = amaxd.Layout(5, 6, ["a", "b"], np.array([0, 2], np.uint64), np.array([2, 4], np.uint64),
                     [(0,), (0, 0)], [(2,), (2, 2)], [(4,), (2, 2)], [1, 3], [0, 1],
                     np.array([0, 0], np.uint64), 2)
    f = lambda n: random_f32(rng, n).tobytes()  # noqa: E731
    msg = pb.ReconcilePackedResponse(
        epoch=2**64 - 1, next_epoch=1, layout_id=5, amax=f(6), scale=f(6), scale_inv=f(6),
        block_scales=bytes(range(6)), global_amax=f(2), global_scale=f(2), global_scale_inv=f(2),
        missing=np.array([0, 2**32 - 1], "<u4").tobytes(), has_previous=b"\x00\x01",
        previous_global_amax=np.array([0.0, -2.25], "<f4").tobytes(),
        previous_global_scale=f(2), peer_fill_known=True,
        filled=b"\x01\x00\x00\x01\x01\x00", global_amaxes=f(2), global_scales=f(2),
        global_scale_invs=f(2), shm_bytes=77, align=b"\x00" * 3)
    r = amaxd.PackedResult(msg.SerializeToString(), L)
    assert (r.epoch, r.next_epoch, r.layout_id, r.shm_bytes, r.peer_fill_known) == \
        (2**64 - 1, 1, 5, 77, True)
    for name in RPR_ARRAYS:
        assert getattr(r, name).tobytes() == getattr(msg, name), name
    b = r["b"]
    assert b.missing == 2**32 - 1 and b.peer_filled.tolist() == [[False, True], [True, False]]
    assert b.previous_global_amax == -2.25
    assert b.global_amaxes.tobytes() == msg.global_amaxes[:8]
    assert r["a"].previous_global_amax is None


# -- grpc.health.v1 --

def test_health_codec_matches_protobuf():
    health_pb2 = pytest.importorskip("grpc_health.v1.health_pb2")
    for s in NAMES + ["amaxd.v1.Calibration"]:
        assert wire.encode_health_check(s) == \
            health_pb2.HealthCheckRequest(service=s).SerializeToString(), s
    statuses = health_pb2.HealthCheckResponse.ServingStatus
    prng = random.Random(SEED)
    for status in [0, 1, 2, 3, 4, 99, 2**31 - 1]:
        raw = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        want = statuses.Name(status) if status <= 3 else "UNKNOWN"
        assert wire.parse_health_status(raw) == want, status
        noisy = unknown_fields(prng) + raw + unknown_fields(prng)
        assert wire.parse_health_status(noisy) == wire.parse_health_status(raw)
