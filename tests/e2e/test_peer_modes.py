"""Peer-group modes (fill and share) and global amax over leading axes
(global_axes), against values computed here in numpy from the rules of
docs/NUMERICS.md ("Peer groups", "Global slices")."""
import threading

import grpc
import numpy as np
import pytest

import amaxd
import reference as ref
from amaxd import errors
from amaxd import placement as P

F32 = np.float32


def run_ranks(d, job, world, body):
    """body(client, rank) in one thread per rank; returns {rank: its value}."""
    out, errs = {}, []

    def main(r):
        try:
            with d.client(job, r, world) as c:
                c.join()
                out[r] = body(c, r)
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    return out


def peer_stage(cells, mode):
    """The documented rule: cells is {name: float32 array, nan = no data}.
    fill: a cell without data takes the group max; share: every cell does.
    Returns ({name: amax, 0 where still without data}, {name: raised marks})."""
    m = max((np.nanmax(v) for v in cells.values() if not np.all(np.isnan(v))), default=np.nan)
    amax, marks = {}, {}
    for n, v in cells.items():
        if mode == "share":
            out = np.where(np.isnan(m), v, np.fmax(v, m))
        else:
            out = np.where(np.isnan(v), m, v)
        own = np.where(np.isnan(v), -np.inf, v)
        got = np.where(np.isnan(out), -np.inf, out)
        marks[n] = got > own
        amax[n] = np.nan_to_num(out, nan=0.0).astype(F32)
    return amax, marks


def masked(v):
    v = np.asarray(v, F32)
    return np.ma.masked_array(np.nan_to_num(v), mask=np.isnan(v))


# Two groups with the same data, one in each mode: a member with some cold
# cells, a member with no data at all, and a member of another recipe.
GROUP_DATA = [
    # epoch 1
    {"e0": [1.0, np.nan, 3.0, np.nan], "e1": [np.nan, np.nan], "e2": [0.5]},
    # epoch 2 (RUNNING_MAX: the rule applies to the accumulated amax)
    {"e0": [np.nan, np.nan, np.nan, np.nan], "e1": [np.nan, 2.0], "e2": [7.0]},
]
SHAPES = {"e0": [4], "e1": [2], "e2": [1]}


def group_quantizers(mode):
    g = "layer.experts." + mode
    rec = {"e0": amaxd.Recipe.fp8_current(), "e1": amaxd.Recipe.fp8_current(amaxd.FP8_E5M2),
           "e2": amaxd.Recipe.nvfp4()}
    return [amaxd.Quantizer(f"{mode}.{n}", SHAPES[n], rec[n], peer_group=g, peer_mode=mode)
            for n in SHAPES]


FMT = {"e0": ("fp8_e4m3", "current"), "e1": ("fp8_e5m2", "current"), "e2": ("nvfp4", None)}


@pytest.mark.parametrize("mode", ["share", "fill"])
def test_share_and_fill_with_cold_members(daemon, mode):
    with daemon.client("groups-" + mode, 0, 1) as c:
        c.join()
        c.register(group_quantizers(mode))
        acc = {n: np.full(SHAPES[n], np.nan, F32) for n in SHAPES}
        for epoch in GROUP_DATA:
            c.send({f"{mode}.{n}": masked(v) for n, v in epoch.items()})
            res = c.reconcile()
            for n, v in epoch.items():
                acc[n] = np.fmax(acc[n], np.asarray(v, F32))
            amax, marks = peer_stage(acc, mode)
            for n in SHAPES:
                r = res[f"{mode}.{n}"]
                fmt, rule = FMT[n]
                g = F32(amax[n].max())
                s, si, b, gs, gsi = ref.scales(fmt, amax[n], g)
                assert r.amax.tobytes() == amax[n].tobytes(), (n, r.amax, amax[n])
                assert r.scale.tobytes() == np.asarray(s, F32).tobytes(), n
                assert r.scale_inv.tobytes() == np.asarray(si, F32).tobytes(), n
                assert r.block_scales.tobytes() == np.asarray(b, np.uint8).tobytes(), n
                assert F32(r.global_amax) == g and F32(r.global_scale) == F32(gs), n
                assert r.missing == 0
                np.testing.assert_array_equal(r.peer_filled, marks[n], err_msg=n)
                assert r.global_amaxes is None
        # The two modes differ exactly where a member's own amax is below the max.
        if mode == "share":
            assert np.all(res["share.e0"].amax == F32(7.0))
            assert res["share.e0"].peer_filled.all()


def test_share_group_without_any_data_stays_missing(daemon):
    with daemon.client("cold", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("a", [2], amaxd.Recipe.fp8_current(), peer_group="g",
                                    peer_mode="share"),
                    amaxd.Quantizer("b", [3], amaxd.Recipe.fp8_current(), peer_group="g",
                                    peer_mode="share")])
        c.send({"a": np.ma.masked_array([0.0, 0.0], mask=[True, True])})
        res = c.reconcile()
        for n, k in (("a", 2), ("b", 3)):
            assert res[n].missing == k and not res[n].peer_filled.any()
            assert np.all(res[n].amax == 0) and np.all(res[n].scale == 1)


def test_share_with_per_epoch_history(daemon):
    # PER_EPOCH: a cell without data this epoch is "no data" before the
    # group stage; the shared value does not enter the history.
    q = [amaxd.Quantizer(n, [2], amaxd.Recipe.fp8_delayed(history_len=2),
                         accumulation=amaxd.PER_EPOCH, peer_group="g", peer_mode="share")
         for n in ("a", "b")]
    with daemon.client("hist", 0, 1) as c:
        c.join()
        c.register(q)
        c.send({"a": np.array([1, 2], F32), "b": np.array([4, 1], F32)})
        r1 = c.reconcile()
        c.send({"a": np.array([1, 1], F32)})
        r2 = c.reconcile()
    assert np.all(r1["a"].amax == 4) and np.all(r1["b"].amax == 4)
    # Epoch 2: a's window holds max(1,1)=1 / max(2,1)=2; b's window still 4, 1
    # (b had no data: the fused TE history leaves it alone, amax 0 -> "no data").
    # b's cells read no data this epoch, a's history max is 2: the group max is 2.
    assert r2["a"].amax.tolist() == [2.0, 2.0]
    assert r2["b"].amax.tolist() == [2.0, 2.0]
    assert r2["b"].peer_filled.all()


def test_mode_is_the_groups_and_mismatches_are_refused(daemon):
    with daemon.client("modes", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("x", [2], amaxd.Recipe.fp8_current(), peer_group="g",
                                    peer_mode="share")])
        # Another member of g with another mode: INVALID_ARGUMENT, nothing registered.
        with pytest.raises(errors.InvalidArgument) as ei:
            c.register([amaxd.Quantizer("ok", [1], amaxd.Recipe.fp8_current()),
                        amaxd.Quantizer("y", [2], amaxd.Recipe.fp8_current(), peer_group="g")])
        msg = str(ei.value)
        assert "peer group 'g'" in msg and "PEER_SHARE" in msg and "PEER_FILL" in msg
        assert "'x'" in msg and "'y'" in msg
        # Two members of a new group disagreeing within one request.
        with pytest.raises(errors.InvalidArgument) as ei:
            c.register([amaxd.Quantizer("p", [1], amaxd.Recipe.fp8_current(), peer_group="h",
                                        peer_mode="fill"),
                        amaxd.Quantizer("q", [1], amaxd.Recipe.fp8_current(), peer_group="h",
                                        peer_mode="share")])
        assert "same request" in str(ei.value) and "'p'" in str(ei.value)
        # A mode without a group.
        with pytest.raises(errors.InvalidArgument) as ei:
            c.register([amaxd.Quantizer("z", [1], amaxd.Recipe.fp8_current(), peer_mode="share")])
        assert "needs a peer_group" in str(ei.value)
        # An unknown mode on the wire.
        raw = amaxd.Quantizer("w", [1], amaxd.Recipe.fp8_current(), peer_group="g").to_pb()
        raw.peer_mode = 7
        with pytest.raises(errors.InvalidArgument) as ei:
            c._unary("RegisterQuantizers", amaxd.pb.RegisterRequest(
                job="modes", rank=0, quantizers=[raw]), amaxd.pb.RegisterResponse)
        assert "peer_mode 7 is unknown" in str(ei.value)
        # The same quantizer again with another mode: a spec conflict.
        with pytest.raises(errors.FailedPrecondition) as ei:
            c.register([amaxd.Quantizer("x", [2], amaxd.Recipe.fp8_current(), peer_group="g",
                                        peer_mode="fill")])
        assert "peer_mode PEER_SHARE" in str(ei.value)
        # Fill and unspecified are the same mode; a matching member is accepted.
        c.register([amaxd.Quantizer("v", [2], amaxd.Recipe.fp8_current(), peer_group="g",
                                    peer_mode="share")])
        c.send({"x": np.array([1, 2], F32)})
        c.reconcile()
        infos = {q.name: q for q in c.list_quantizers().quantizers}
        assert sorted(infos) == ["v", "x"]
        assert infos["x"].peer_mode == amaxd.pb.PEER_SHARE and infos["x"].global_axes == 0
        # A group already agreed keeps its mode.
        with pytest.raises(errors.InvalidArgument) as ei:
            c.register([amaxd.Quantizer("u", [2], amaxd.Recipe.fp8_current(), peer_group="g",
                                        peer_mode="fill")])
        assert "agreed" in str(ei.value)
        c.register([amaxd.Quantizer("f1", [1], amaxd.Recipe.fp8_current(), peer_group="k",
                                    peer_mode="fill"),
                    amaxd.Quantizer("f2", [1], amaxd.Recipe.fp8_current(), peer_group="k")])
        infos = {q.name: q for q in c.list_quantizers().quantizers}
        assert infos["f2"].peer_mode == amaxd.pb.PEER_FILL
        assert infos["f1"].peer_mode == amaxd.pb.PEER_FILL
    with pytest.raises(ValueError, match="unknown peer_mode"):
        amaxd.Quantizer("bad", [1], peer_group="g", peer_mode="max")


# ---- global amax over leading axes ----

E, R, C = 4, 3, 8


def expert_blocks(seed=7):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0, 1, (E, R, C)).astype(F32) * (F32(10.0) ** np.arange(E, dtype=F32))[:, None, None]
    a[2, 1, 3] = 0.0
    return a


def nvfp4_ref(amax, k):
    """Per-slice globals and per-cell NVFP4 (te) from the documented rule."""
    lead = amax.shape[:k]
    g = amax.reshape(int(np.prod(lead)), -1).max(axis=1).reshape(lead).astype(F32)
    s_enc = ref.nvfp4_global(g)
    ginv = ref.nvfp4_global_inv(g)
    ge = np.broadcast_to(g.reshape(lead + (1,) * (amax.ndim - k)), amax.shape)
    se = np.broadcast_to(np.asarray(s_enc, F32).reshape(lead + (1,) * (amax.ndim - k)), amax.shape)
    b = ref.NVFP4_BLOCK["te"](amax, ge, se)
    dec = ref.e4m3_value(b)
    return g, np.asarray(s_enc, F32), np.asarray(ginv, F32), ref.nvfp4_block_encode(dec, se), dec, b


def sliced_quantizer(name, place, k=1):
    return amaxd.Quantizer(name, [E, R, C], amaxd.Recipe.nvfp4(), place, global_axes=k)


@pytest.mark.parametrize("k", [1, 2])
def test_global_axes_nvfp4_sharded_ep2_tp2(daemon, k):
    full = expert_blocks()
    g, s_enc, ginv, scale, dec, b = nvfp4_ref(full, k)
    EP, TP = 2, 2

    def body(c, r):
        ep, tp = r // TP, r % TP
        pl = P.Placement((ep * E // EP, 0, tp * C // TP), (E // EP, R, C // TP))
        c.register([sliced_quantizer("w", pl, k)])
        sl = tuple(slice(o, o + n) for o, n in zip(pl.offset, pl.local_shape))
        c.send({"w": full[sl]})
        return pl, sl, c.reconcile()["w"], c.get_scales(whole=True)["w"]

    out = run_ranks(daemon, f"ga{k}", EP * TP, body)
    for r, (pl, sl, mine, whole) in out.items():
        assert mine.amax.tobytes() == full[sl].tobytes()
        assert mine.block_scales.tobytes() == np.ascontiguousarray(b[sl]).tobytes(), r
        assert mine.scale_inv.tobytes() == np.ascontiguousarray(dec[sl]).tobytes(), r
        assert mine.scale.tobytes() == np.ascontiguousarray(scale[sl]).tobytes(), r
        # The slices this block overlaps, shaped like its first k axes.
        lead = sl[:k]
        assert mine.global_amaxes.shape == tuple(pl.local_shape[:k])
        assert mine.global_amaxes.tobytes() == np.ascontiguousarray(g[lead]).tobytes(), r
        assert mine.global_scales.tobytes() == np.ascontiguousarray(s_enc[lead]).tobytes()
        assert mine.global_scale_invs.tobytes() == np.ascontiguousarray(ginv[lead]).tobytes()
        # The scalar: the max over all slices and its recipe scales.
        gmax = F32(full.max())
        assert F32(mine.global_amax) == gmax
        assert F32(mine.global_scale) == F32(ref.nvfp4_global(gmax))
        assert F32(mine.global_scale_inv) == F32(ref.nvfp4_global_inv(gmax))
        assert whole.global_amaxes.tobytes() == g.tobytes()
        assert whole.block_scales.tobytes() == b.tobytes()
    wholes = [w for *_, w in out.values()]
    assert all(w.global_amaxes.tobytes() == wholes[0].global_amaxes.tobytes() for w in wholes)
    # One global per slice differs from one global for all: experts of small
    # values keep their resolution.
    one = ref.NVFP4_BLOCK["te"](full, F32(full.max()), ref.nvfp4_global(F32(full.max())))
    assert not np.array_equal(one, b)

    # Layout independence: the same data from one rank gives the same bytes.
    def single(c, r):
        c.register([sliced_quantizer("w", None, k)])
        c.send({"w": full})
        c.reconcile()
        return c.get_scales(whole=True)["w"]

    one_rank = run_ranks(daemon, f"ga{k}-tp1", 1, single)[0]
    for f in ("amax", "scale", "scale_inv", "block_scales", "global_amaxes", "global_scales",
              "global_scale_invs"):
        assert getattr(one_rank, f).tobytes() == getattr(wholes[0], f).tobytes(), f


def test_global_axes_windows(start_daemon):
    full = expert_blocks(3)
    g, *_ = nvfp4_ref(full, 1)
    d = start_daemon()
    with d.client("win", 0, 1) as c:
        c.join()
        c.register([sliced_quantizer("w", None, 1)])
        c.send({"w": full})
        c.reconcile()
        # Windows of 10 cells: a slice has 24 cells, so windows start inside slices.
        for start in (0, 10, 20, 40, 90):
            r = c._unary("GetScales", amaxd.pb.GetScalesRequest(
                job="win", rank=0, names=["w"], start_cell=start, max_cells=10,
                **{"global": True}), amaxd.pb.GetScalesResponse).results[0]
            assert r.first_cell == start and r.global_axes == 1
            j0, j1 = start // (R * C), (start + len(r.amax) // 4 - 1) // (R * C)
            got = np.frombuffer(r.global_amaxes, F32)
            assert got.tobytes() == g[j0:j1 + 1].tobytes(), start
        whole = c.get_scales(whole=True, window_cells=10)["w"]
        assert whole.global_amaxes.tobytes() == g.tobytes()
        assert whole.amax.tobytes() == full.tobytes()


def test_global_axes_with_share_group(daemon):
    # Share applies first, then the slices: every expert of every member reads the group max.
    a = expert_blocks(5)
    with daemon.client("gashare", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("m0", [E, R, C], amaxd.Recipe.nvfp4(), global_axes=1,
                                    peer_group="pg", peer_mode="share"),
                    amaxd.Quantizer("m1", [2], amaxd.Recipe.fp8_current(), peer_group="pg",
                                    peer_mode="share")])
        c.send({"m0": a, "m1": np.array([1e6, 0], F32)})
        res = c.reconcile()
    assert np.all(res["m0"].amax == F32(1e6)) and np.all(res["m0"].global_amaxes == F32(1e6))


@pytest.mark.parametrize("spec,what", [
    (dict(global_shape=[E, R, C], global_axes=3), "global_axes 3 must be less than the 3"),
    (dict(global_shape=[E], global_axes=1), "global_axes 1 must be less than the 1"),
    (dict(global_shape=[], global_axes=1), "global_axes 1 must be less than the 0"),
    (dict(global_shape=[E, R], global_axes=1, scale_group="qkv"), "cannot be combined"),
])
def test_bad_global_axes_change_nothing(daemon, spec, what):
    with daemon.client("bad", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("keep", [2], amaxd.Recipe.fp8_current())])
        c.reconcile()
        before = c.status("bad").jobs[0]
        with pytest.raises(errors.InvalidArgument) as ei:
            c.register([amaxd.Quantizer("new", [1], amaxd.Recipe.fp8_current()),
                        amaxd.Quantizer("bad", recipe=amaxd.Recipe.nvfp4(), **spec)])
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert what in str(ei.value) and "'bad'" in str(ei.value)
        after = c.status("bad").jobs[0]
        assert (after.quantizers, after.cells, after.proposals) == \
            (before.quantizers, before.cells, before.proposals)
        assert [q.name for q in c.list_quantizers().quantizers] == ["keep"]


def test_slices_survive_a_catalog_change(daemon):
    # Delayed FP8 with per-expert globals: each slice keeps its own previous
    # scale. In epoch 2 a quantizer that sorts first is added (the layout
    # moves every slice) and expert 1 sends nothing: its slice's global
    # scale must stay epoch 1's.
    import json
    import os
    import subprocess
    q = amaxd.Quantizer("w", [3, 2], amaxd.Recipe.fp8_delayed(history_len=2),
                        accumulation=amaxd.PER_EPOCH, global_axes=1)
    with daemon.client("move", 0, 1) as c:
        c.join()
        c.register([q])
        c.send({"w": np.array([[1, 2], [4, 8], [3, 0]], F32)})
        r1 = c.reconcile()["w"]
        assert r1.global_amaxes.tolist() == [2, 8, 3]
        assert r1.global_scales.tolist() == [224, 56, np.float32(448 / 3)]
        # Sliced too: w's slices move behind a.first's 5.
        c.register([amaxd.Quantizer("a.first", [5, 2], amaxd.Recipe.fp8_current(),
                                    global_axes=1)])
        c.send({"w": np.ma.masked_array(np.array([[16, 1], [0, 0], [1, 1]], F32),
                                        mask=[[0, 0], [1, 1], [0, 0]])})
        r2 = c.reconcile()["w"]
        # History window of 2: expert 0 max(2, 16) = 16, expert 2 max(3, 1) = 3.
        assert r2.global_amaxes.tolist() == [16, 0, 3]
        assert r2.global_scales.tolist() == [28, 56, np.float32(448 / 3)]
        assert F32(r2.global_amax) == 16
    ctl = os.environ.get("AMAXCTL_BIN", os.path.join(os.path.dirname(__file__), "..", "..",
                                                     "build", "amaxctl"))
    p = subprocess.run([ctl, "--socket", daemon.socket, "--json", "list", "move"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    got = {q["name"]: q for q in json.loads(p.stdout)}
    assert got["w"]["global_axes"] == 1 and got["w"]["peer_mode"] == ""
