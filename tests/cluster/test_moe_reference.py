"""Consistency of moe_block itself (no daemon): the ranks' contributions,
merged at their placements, are the global tensors expected() is built from
in every layout; the block has every feature the cluster test relies on;
the checkers accept the expected bytes and refuse anything else."""
import os
import sys

import numpy as np
import pytest

import amaxd
from amaxd import pb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_block as mb  # noqa: E402

ORDER_SEED = 7


def merge(contributions, shape):
    """Max-merge (placement, local amax) pairs like the daemon: masked cells
    carry no data. Returns float32 with -inf where nobody had data."""
    out = np.full(shape, -np.inf, np.float32)
    for pl, v in contributions:
        data = np.asarray(np.ma.getdata(v), np.float32)
        assert data.shape == tuple(pl.local_shape), f"local block {data.shape} vs {pl.local_shape}"
        mask = np.ma.getmaskarray(v) if isinstance(v, np.ma.MaskedArray) else np.zeros(data.shape, bool)
        sl = tuple(slice(o, o + n) for o, n in zip(pl.offset, pl.local_shape))
        out[sl] = np.where(mask, out[sl], np.maximum(out[sl], data))
    return out


def as_merged(global_tensor):
    return np.where(np.isnan(global_tensor), -np.inf, global_tensor).astype(np.float32)


def test_rank_decomposition():
    for name, (tp, ep, dp) in mb.LAYOUTS.items():
        assert tp * ep * dp == mb.WORLD
        seen = {mb.coords(name, r)[3:] for r in range(mb.WORLD)}
        assert len(seen) == mb.WORLD, name
    # Megatron order, TP fastest: rank 5 of TP2 x EP2 x DP2 is tp 1, ep 0, dp 1.
    assert mb.coords("tp2ep2dp2", 5)[3:] == (1, 0, 1)
    assert mb.coords("tp1ep4dp2", 6)[3:] == (0, 2, 1)


@pytest.mark.parametrize("layout", sorted(mb.LAYOUTS))
def test_contributions_merge_to_the_global_tensors(layout):
    names = {s.name for s in mb.SPECS}
    for epoch in range(1, mb.epochs + 1):
        want = mb.global_amax(epoch)
        contrib = {n: [] for n in names}
        for rank in range(mb.WORLD):
            local = mb.local_amax(layout, rank, epoch)
            assert set(local) == names, f"rank {rank} does not send every quantizer"
            # The micro-batches max-merge to the epoch's amax, masks included.
            mbs = mb.microbatch_amax(layout, rank, epoch)
            for q in mb.quantizers(layout, rank):
                shape = q.placement.local_shape
                block = mb.P.replicated(shape)
                parts = merge([(block, m[q.name]) for m in mbs if q.name in m], shape)
                assert parts.tobytes() == merge([(block, local[q.name])], shape).tobytes(), \
                    f"{layout} rank {rank} epoch {epoch} {q.name}: micro-batches"
                contrib[q.name].append((q.placement, local[q.name]))
        for s in mb.SPECS:
            got = merge(contrib[s.name], s.shape)
            assert got.tobytes() == as_merged(want[s.name]).tobytes(), f"{layout} epoch {epoch} {s.name}"
    # Every SendAmax of a rank's epoch together carries exactly its micro-batches.
    sends = mb.send_batches(layout, 0, 1, ORDER_SEED)
    assert len(sends) == 4 and all(sends)
    mbs = mb.microbatch_amax(layout, 0, 1)
    assert {**sends[0], **sends[1]}.keys() == mbs[0].keys()
    assert {**sends[2], **sends[3]}.keys() == mbs[1].keys()


def test_expected_uses_the_global_tensors():
    # Weights are fixed and RUNNING_MAX: expected() amax is the global weight amax.
    for s in mb.SPECS:
        if s.name.endswith("weight_quantizer"):
            assert mb.expected(1)[s.name]["amax"].tobytes() == mb.global_amax(1)[s.name].tobytes()


def test_ep_rank_with_only_tokenless_experts():
    assert mb.ranks_without_expert_tokens("tp1ep4dp2") == [3, 7]
    assert mb.ranks_without_expert_tokens("tp2ep2dp2") == []
    assert mb.ranks_without_expert_tokens("tp4ep1dp2") == []
    for epoch in range(1, mb.epochs + 1):
        tokens = mb.expert_tokens(epoch)
        assert tokens[6] == tokens[7] == 0
        assert (tokens[0] > 0) == (epoch > 1) and (tokens[2] > 0) == (epoch == 1)
        assert all(tokens[e] > 0 for e in (1, 3, 4, 5))
        for rank in (3, 7):
            local = mb.local_amax("tp1ep4dp2", rank, epoch)
            for n in (mb.FC1_IN, mb.FC2_IN):
                assert np.ma.getmaskarray(local[n]).all(), (rank, n)
    # Expert 5's epoch-1 tokens all lie in DP replica 0's first micro-batch in
    # every layout: DP rank 1 sends it masked, DP rank 0 sends a masked
    # micro-batch 1 after a real micro-batch 0.
    for layout in mb.LAYOUTS:
        for rank in range(mb.WORLD):
            _, ep, _, _, ep_rank, dp_rank = mb.coords(layout, rank)
            first = ep_rank * mb.E // ep
            if not first <= 5 < first + mb.E // ep:
                continue
            mbs = mb.microbatch_amax(layout, rank, 1)
            for n in (mb.FC1_IN, mb.FC2_IN):
                masked = [bool(np.ma.getmaskarray(m[n])[5 - first]) for m in mbs]
                assert masked == ([False, True] if dp_rank == 0 else [True, True]), (layout, rank, n)


def test_registration_orders_differ():
    for layout in mb.LAYOUTS:
        orders, calls = [], []
        for rank in range(mb.WORLD):
            batches = mb.registration_batches(layout, rank, ORDER_SEED)
            order = tuple(q.name for b in batches for q in b)
            assert sorted(order) == sorted(s.name for s in mb.SPECS)
            assert all(batches)
            orders.append(order)
            calls.append(len(batches))
        assert len(set(orders)) == mb.WORLD, f"{layout}: two ranks register in the same order"
        assert 2 in calls, f"{layout}: no rank registers in 2 calls"
    assert mb.registration_batches("tp2ep2dp2", 0, 1) != mb.registration_batches("tp2ep2dp2", 0, 2)


def fmt(s):
    return {amaxd.FP8_E4M3: "e4m3", amaxd.FP8_E5M2: "e5m2", amaxd.NVFP4: "nvfp4",
            amaxd.MXFP8: "mxfp8"}[s.recipe.format]


def test_every_quantizer_kind_is_present():
    S = mb.SPEC
    # Per-channel FP8 current weights: column-parallel (sharded) and row-parallel (replicated).
    for name, kind in ((mb.GATE_W, "column"), (mb.DOWN_W, "row")):
        assert fmt(S[name]) == "e4m3" and S[name].recipe.rule == pb.CURRENT
        assert len(S[name].shape) == 1 and S[name].kind == kind
    assert mb.placement(S[mb.DOWN_W], "tp4ep1dp2", 1) == mb.P.replicated(S[mb.DOWN_W].shape)
    assert mb.placement(S[mb.GATE_W], "tp4ep1dp2", 1).local_shape == (mb.FS // 4,)
    # NVFP4 per-block weights: column-parallel on dim 0, row-parallel on dim 1.
    for name in (mb.Q_W, mb.K_W, mb.V_W):
        assert fmt(S[name]) == "nvfp4" and S[name].kind == "column" and S[name].scale_group == mb.QKV_GROUP
    assert mb.placement(S[mb.O_W], "tp4ep1dp2", 1) == mb.P.Placement((0, 2), (mb.H, 2))
    # The experts' NVFP4 weights: one quantizer covering all experts, split over EP and TP.
    assert S[mb.FC1_W].shape[0] == S[mb.FC2_W].shape[0] == mb.E
    assert mb.placement(S[mb.FC1_W], "tp2ep2dp2", 3) == mb.P.Placement((4, 32, 0), (4, 32, 8))
    assert mb.placement(S[mb.FC2_W], "tp2ep2dp2", 3) == mb.P.Placement((4, 0, 2), (4, mb.H, 2))
    # Per-expert fc2 input in a peer group, FP8 current.
    assert S[mb.FC2_IN].kind == "expert" and S[mb.FC2_IN].peer_group and fmt(S[mb.FC2_IN]) == "e5m2"
    # Per-tensor NVFP4 activations.
    assert all(S[n].shape == () and fmt(S[n]) == "nvfp4" for n in (mb.Q_IN, mb.O_IN))
    # MXFP8, column-parallel.
    assert fmt(S[mb.UP_W]) == "mxfp8" and S[mb.UP_W].kind == "column"
    # FP8 delayed, PER_EPOCH, history 3.
    r = S[mb.ROUTER_IN]
    assert r.recipe.rule == pb.DELAYED and r.accumulation == mb.PER_EPOCH and r.recipe.history_len == 3


def test_the_data_exercises_the_edge_cases():
    e1, e2, e3 = (mb.expected(k) for k in (1, 2, 3))
    raw = [mb.global_amax(k) for k in (1, 2, 3)]
    weights = np.concatenate([e3[s.name]["amax"].ravel() for s in mb.SPECS
                              if s.name.endswith("weight_quantizer")])
    assert (weights == 0).any() and (weights < 2.0 ** -7).sum() > 10 and weights.max() >= 1e4
    assert e3[mb.GATE_W]["scale"].max() == np.finfo(np.float32).max  # the subnormal channel
    assert (e3[mb.UP_W]["block_scales"] == 0).any()  # MXFP8 zero block
    assert (e3[mb.Q_W]["block_scales"] == 0).any() and (e3[mb.V_W]["block_scales"] == 0x7E).sum() == 1
    assert e3[mb.FC2_IN]["amax"].min() < 2.0 ** -7 and e3[mb.FC2_IN]["amax"].max() > 1e4
    # Scale group: q and k take v_proj's max.
    g = e1[mb.V_W]["global_amax"]
    assert e1[mb.Q_W]["global_amax"] == e1[mb.K_W]["global_amax"] == g
    assert e1[mb.Q_W]["amax"].max() < g and e1[mb.K_W]["amax"].max() < g
    # The experts' NVFP4 global amax lies in one expert (one EP rank under EP 4).
    assert np.argmax(e1[mb.FC1_W]["amax"].max(axis=(1, 2))) == 3
    assert np.argmax(e1[mb.FC2_W]["amax"].max(axis=(1, 2))) == 6
    # Peer fill: token-less experts 6, 7 take the group's max; expert 2 keeps its running max.
    for e in (e1, e2, e3):
        a = e[mb.FC2_IN]["amax"]
        assert a[6] == a[7] == a[:6].max() and not e[mb.FC2_IN]["missing"].any()
    assert e3[mb.FC2_IN]["amax"][2] == raw[0][mb.FC2_IN][2]
    # The fill is not accumulated: expert 0, filled in epoch 1, reads its own amax in epoch 2.
    assert e1[mb.FC2_IN]["amax"][0] == e1[mb.FC2_IN]["amax"].max()
    assert e2[mb.FC2_IN]["amax"][0] == raw[1][mb.FC2_IN][0] < 2.0 ** -7
    # Delayed, history 3: epoch 2's larger amax stays in epoch 3.
    r = [float(x[mb.ROUTER_IN]) for x in raw]
    assert r[1] > r[0] and r[2] < r[1]
    assert e3[mb.ROUTER_IN]["amax"] == np.float32(r[1])
    assert e3[mb.ROUTER_IN]["scale"] == e2[mb.ROUTER_IN]["scale"]
    assert e2[mb.ROUTER_IN]["scale"] != e1[mb.ROUTER_IN]["scale"]
    # Delayed, history 2, no peer group: experts 6, 7 missing with scale 1; expert 2
    # has data in epoch 1, comes from the window in epoch 2, is missing in epoch 3
    # and keeps its previous scale.
    f1, f2, f3 = (e[mb.FC1_IN] for e in (e1, e2, e3))
    assert [int(f["missing"].sum()) for f in (f1, f2, f3)] == [3, 2, 3]
    assert (f3["scale"][6:] == 1).all() and f3["missing"][2] and f3["amax"][2] == 0
    assert f3["scale"][2] == f2["scale"][2] == f1["scale"][2] != 1
    assert raw[0][mb.FC1_IN][2] > 0  # a running max would still hold it: the window dropped epoch 1
    for e in (e1, e2, e3):
        for v in e.values():
            assert np.isfinite(v["scale"]).all() and np.isfinite(v["scale_inv"]).all()


def fake_result(exp, offset, shape):
    """What a daemon that agrees with expected() would answer for one block."""
    sl = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    r = {f: np.ascontiguousarray(exp[f][sl]).tobytes()
         for f in ("amax", "scale", "scale_inv", "block_scales")}
    r.update({f: float(exp[f]) for f in ("global_amax", "global_scale", "global_scale_inv")})
    r.update(offset=tuple(offset), shape=tuple(shape), missing=int(exp["missing"][sl].sum()))
    return r


def fake_run(layout, rank):
    per_epoch = [{q.name: fake_result(mb.expected(k)[q.name], q.placement.offset, q.placement.local_shape)
                  for q in mb.quantizers(layout, rank)} for k in range(1, mb.epochs + 1)]
    whole = {s.name: fake_result(mb.expected(mb.epochs)[s.name], (0,) * len(s.shape), s.shape)
             for s in mb.SPECS}
    return {"epochs": per_epoch, "whole": whole}


def test_checkers_accept_expected_and_refuse_one_bit():
    runs = {layout: fake_run(layout, 3) for layout in mb.LAYOUTS}
    for layout, run in runs.items():
        mb.check_rank_results(layout, 3, run["epochs"])
        mb.check_whole(run["whole"])
    assert len({mb.whole_bytes(r) for r in runs.values()}) == 1
    run = runs["tp1ep4dp2"]
    cell = run["epochs"][1][mb.FC1_W]
    bad = bytearray(cell["scale"])
    bad[5] ^= 1
    cell["scale"] = bytes(bad)
    with pytest.raises(AssertionError, match="epoch 2 .*fc1.weight_quantizer scale"):
        mb.check_rank_results("tp1ep4dp2", 3, run["epochs"])
    router = run["whole"][mb.ROUTER_IN]
    router["global_scale"] = float(np.nextafter(np.float32(router["global_scale"]), np.float32(0)))
    with pytest.raises(AssertionError, match="global_scale"):
        mb.check_whole(run["whole"])
    assert mb.whole_bytes(run) != mb.whole_bytes(runs["tp4ep1dp2"])
    # A block of another rank is refused too.
    with pytest.raises(AssertionError, match="block"):
        mb.check_rank_results("tp1ep4dp2", 2, runs["tp4ep1dp2"]["epochs"])
