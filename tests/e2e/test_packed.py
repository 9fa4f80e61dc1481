"""The packed per-rank form (GetLayout, SendPacked, StreamPacked,
ReconcilePacked) against the named form: the same contributions sent both
ways to two jobs of one daemon give the same bytes in every result array,
for several ranks, FP8 (current, delayed), NVFP4 and MXFP8 recipes and
cells without data; stale layout ids, wrong lengths, bad values and
garbage bytes are refused with a precise status and change nothing."""
import random
import threading

import grpc
import numpy as np
import pytest

import amaxd
from amaxd import errors, pb
from amaxd import placement as P
from amaxd.packed import encode_send_packed

SVC = "/amaxd.v1.Calibration/"
W = 3


def catalog(rank):
    """Quantizers of one rank, deliberately not in name order."""
    R = amaxd.Recipe
    qs = [
        amaxd.Quantizer("z.fc2.input", [], R.fp8_current()),
        amaxd.Quantizer("a.fc1.weight", [24], R.fp8_delayed(history_len=3),
                        P.column_parallel([24], rank, W), accumulation=amaxd.PER_EPOCH),
        amaxd.Quantizer("m.nvfp4.w", [6, 9], R.nvfp4(), P.row_parallel([6, 9], rank, W),
                        scale_group="qkv"),
        amaxd.Quantizer("m.nvfp4.v", [6], R.nvfp4("modelopt", output="modelopt"),
                        P.column_parallel([6], rank, W), scale_group="qkv"),
        amaxd.Quantizer("k.mxfp8", [3, 4], R.mxfp8("ocp"), P.shard([3, 4], 0, rank, W)),
        amaxd.Quantizer("e.experts", [6], R.fp8_current(), P.per_expert(6, rank, W),
                        peer_group="moe0"),
        amaxd.Quantizer("e.experts2", [3], R.fp8_current(), P.replicated([3]), peer_group="moe0"),
    ]
    if rank == 0:
        qs.append(amaxd.Quantizer("only.rank0", [5], R.fp8_current()))
    if rank < 2:
        # Per-expert global amaxes (global_axes=1) of [E, R, C/16] NVFP4
        # blocks, the experts sharded over ranks 0 and 1 on axis 0.
        qs.append(amaxd.Quantizer("g.nvfp4.experts", [4, 3, 8], R.nvfp4(),
                                  P.shard([4, 3, 8], 0, rank, 2), global_axes=1))
    # A peer group in share mode (ModelOpt's MoE rule): every cell reads the
    # group's max, the raised ones marked.
    qs.append(amaxd.Quantizer("s.share.a", [6], R.fp8_current(), P.per_expert(6, rank, W),
                              peer_group="share0", peer_mode="share"))
    qs.append(amaxd.Quantizer("s.share.b", [2], R.fp8_current(), P.replicated([2]),
                              peer_group="share0", peer_mode="share"))
    return qs


def contributions(rank, epoch, rng):
    """{name: block or masked block} for one rank and epoch."""
    out = {}
    for q in catalog(rank):
        shape = q.placement.local_shape if q.placement else tuple(q.global_shape)
        v = (rng.random(shape, dtype=np.float32) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
        if q.name.startswith(("e.experts", "s.share.a", "g.nvfp4")):
            mask = rng.random(shape) < 0.5  # experts without tokens
            # Both ways of saying it: a numpy masked array, amaxd.Masked.
            v = np.ma.MaskedArray(v, mask=mask) if rank % 2 else amaxd.Masked(v, mask)
        if q.name == "z.fc2.input" and epoch == 2 and rank == 1:
            continue  # this rank saw nothing for it this epoch
        if q.name == "k.mxfp8" and epoch == 1:
            v = v * 0  # zero amax: E8M0 byte 0 edge
        out[q.name] = v
    return out


def run_ranks(fn):
    errs, outs = [], [None] * W

    def wrap(r):
        try:
            outs[r] = fn(r)
        except BaseException as e:  # noqa: BLE001
            errs.append(e)

    th = [threading.Thread(target=wrap, args=(r,)) for r in range(W)]
    for t in th:
        t.start()
    for t in th:
        t.join(120)
    if errs:
        raise errs[0]
    return outs


def assert_same(named, packed, name):
    for f in ("amax", "scale", "scale_inv", "block_scales"):
        a, b = getattr(named, f), getattr(packed, f)
        assert a.shape == b.shape, (name, f)
        assert a.tobytes() == b.tobytes(), (name, f, a, b)
    for f in ("global_amax", "global_scale", "global_scale_inv"):
        assert np.float32(getattr(named, f)).tobytes() == np.float32(getattr(packed, f)).tobytes(), \
            (name, f)
    assert named.missing == packed.missing, name
    assert named.offset == packed.offset and named.shape == packed.shape, name
    assert named.previous_global_amax == packed.previous_global_amax, name
    assert named.previous_global_scale == packed.previous_global_scale, name
    assert (named.peer_filled is None) == (packed.peer_filled is None), name
    if named.peer_filled is not None:
        np.testing.assert_array_equal(named.peer_filled, packed.peer_filled)
    for f in ("global_amaxes", "global_scales", "global_scale_invs"):
        a, b = getattr(named, f), getattr(packed, f)
        assert (a is None) == (b is None), (name, f)
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, (name, f, a.shape, b.shape)
            assert a.tobytes() == b.tobytes(), (name, f, a, b)


def test_packed_matches_named(daemon):
    def rank_fn(r):
        got = []
        with daemon.client("named", r, W) as cn, daemon.client("packed", r, W) as cp:
            cn.join(), cp.join()
            cn.register(catalog(r))
            cp.register(catalog(r))
            L = cp.layout()
            assert L.names == sorted(L.names)  # the catalog's canonical order
            assert L.total_cells == sum(int(x) for x in L.ncells)
            for epoch in (1, 2, 3):
                contrib = contributions(r, epoch, np.random.default_rng(100 * r + epoch))
                cn.send(contrib)
                slab, has = L.pack(contrib)
                if epoch == 3:
                    cp.stream_packed([(slab, has)])
                else:
                    cp.send_packed(slab, has_data=has)
                rn = cn.reconcile()
                rp = cp.reconcile_packed()
                assert set(rn) == set(rp.keys())
                for name in rn:
                    assert_same(rn[name], rp[name], name)
                if r < 2:
                    g = rp["g.nvfp4.experts"]
                    assert g.global_amaxes.shape == (2,)  # the 2 experts of this rank
                    if epoch > 1:
                        assert (g.global_amaxes > 0).all()
                got.append(rp)
        return got

    outs = run_ranks(rank_fn)
    # Cells without data anywhere and peer fill happened somewhere.
    assert any(int(rp.missing.sum()) > 0 or (rp.filled is not None and rp.filled.any())
               for o in outs for rp in o)
    # The share group raised cells below its max, and said so.
    assert any(rp["s.share.a"].peer_filled.any() for o in outs for rp in o)
    L = outs[0][0].layout
    i = L.index["g.nvfp4.experts"]
    assert L.global_axes[i] == 1 and L.total_slices == 2
    # Views, not copies.
    rp = outs[0][-1]
    v = rp["a.fc1.weight"].amax
    assert not v.flags.owndata and not v.flags.writeable


def test_stale_layout_and_lengths(daemon):
    R = amaxd.Recipe
    with daemon.client("stale", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("b", [4], R.fp8_current()),
                    amaxd.Quantizer("a", [], R.fp8_current())])
        L = c.layout()
        assert L.names == ["a", "b"] and L.total_cells == 5
        c.send_packed(np.array([1, 2, 3, 4, 5], dtype=np.float32))
        old = L.id
        # Registering from this rank changes the layout: the old id is stale.
        c.register([amaxd.Quantizer("c", [2], R.fp8_current())])
        with pytest.raises(errors.FailedPrecondition, match="fetch the layout again"):
            c.send_packed(np.zeros(5, dtype=np.float32))
        with pytest.raises(errors.FailedPrecondition, match="stale"):
            c.reconcile_packed()
        L = c.layout(refresh=True)
        assert L.id != old and L.names == ["a", "b", "c"]
        n0 = c.status("stale").jobs[0].updates
        raw = lambda data: c._raw("SendPacked", data, None)  # noqa: E731
        # Wrong lengths (past the client's own checks).
        with pytest.raises(errors.InvalidArgument, match="bytes of values"):
            raw(encode_send_packed("stale", 0, 0, L.id, np.zeros(6, dtype=np.float32)))
        with pytest.raises(errors.InvalidArgument, match="has_data has 3 bytes"):
            raw(encode_send_packed("stale", 0, 0, L.id, np.zeros(7, dtype=np.float32),
                                   np.ones(3, dtype=np.uint8)))
        # Bad values name the quantizer; nothing of the request is applied.
        for bad in (np.nan, -1.0, np.inf):
            v = np.ones(7, dtype=np.float32)
            v[3] = bad
            with pytest.raises(errors.InvalidArgument, match="quantizer 'b'"):
                c.send_packed(v)
        # A bad value in a cell without data is ignored.
        v = np.full(7, 0.5, dtype=np.float32)
        v[6] = np.nan
        has = np.ones(7, dtype=bool)
        has[6] = False
        c.send_packed(v, has_data=has)
        assert c.status("stale").jobs[0].updates == n0 + 3
        res = c.reconcile_packed()
        np.testing.assert_array_equal(res["a"].amax, np.float32(1))
        np.testing.assert_array_equal(res["b"].amax, np.array([2, 3, 4, 5], dtype=np.float32))
        # "c" was a proposal until this epoch: its epoch-1 value is kept... as no data
        np.testing.assert_array_equal(res["c"].amax, np.array([0.5, 0], dtype=np.float32))
        assert res["c"].missing == 1


def test_unaligned_and_torch(daemon):
    with daemon.client("ua", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer(f"q{i}", [3], amaxd.Recipe.fp8_current()) for i in range(4)])
        L = c.layout()
        vals = np.arange(12, dtype=np.float32)
        for pad in range(4):  # a client that does not align the values
            data = pb.SendPackedRequest(job="ua" + "", rank=0, layout_id=L.id,
                                        values=vals.tobytes(), align=b"x" * pad)
            r = c._raw("SendPacked", data.SerializeToString(), pb.SendAmaxResponse.FromString)
            assert r.accepted == 4
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None:
            c.send_packed(torch.arange(12, dtype=torch.float64) * 2)
        res = c.reconcile_packed()
        want = vals * (2 if torch is not None else 1)
        np.testing.assert_array_equal(res.amax, want)


GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\xff", b"\x2a\x05\x00", b"\x21\x01", b"\x08",
           b"\x0a\x02j\x00", b"\x7a\xff\xff\xff\xff\x0f"]


@pytest.mark.parametrize("method", ["SendPacked", "ReconcilePacked", "GetLayout"])
def test_garbage_bytes(daemon, method):
    with daemon.client("g", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("q", [2], amaxd.Recipe.fp8_current())])
        rnd = random.Random(7)
        cases = GARBAGE + [bytes(rnd.getrandbits(8) for _ in range(rnd.randint(1, 64)))
                           for _ in range(50)]
        with daemon.channel() as ch:
            fn = ch.unary_unary(SVC + method)
            for payload in cases:
                try:
                    fn(payload, timeout=10)
                except grpc.RpcError as e:
                    assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                        grpc.StatusCode.NOT_FOUND,
                                        grpc.StatusCode.FAILED_PRECONDITION,
                                        grpc.StatusCode.RESOURCE_EXHAUSTED), (payload, e)
            # A stream of garbage ends with INVALID_ARGUMENT.
            st = ch.stream_unary(SVC + "StreamPacked")
            with pytest.raises(grpc.RpcError) as ei:
                st(iter([b"\xff\xff"]), timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert c.status("g").jobs[0].updates == 0
        assert c.health() == "SERVING"

