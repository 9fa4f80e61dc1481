"""Peer mode share and per-slice globals across daemons: the same bytes on
every daemon and as one daemon; a peer group declared with two modes on two
daemons is a catalog conflict that every trainer sees."""
import numpy as np

import amaxd
from amaxd import placement as P
from test_basic import Q, run_threads

E, R, C = 4, 2, 8
W = 4


def model():
    rng = np.random.default_rng(11)
    tokens = rng.uniform(0, 1, E).astype(np.float32) * np.array([3, 9, 5, 0], np.float32)
    w = (rng.uniform(0, 1, (E, R, C)) * np.array([1, 100, 10, 1000])[:, None, None]).astype(
        np.float32)
    return tokens, w


def quantizers(r):
    ep, tp = r // 2, r % 2
    return [
        # Per-expert input amax, one expert per rank; expert 3 gets no tokens.
        amaxd.Quantizer("moe.fc2.input", [E], amaxd.Recipe.fp8_current(), P.per_expert(E, r, W),
                        peer_group="moe.inputs", peer_mode="share"),
        amaxd.Quantizer("moe.fc1.input", [], amaxd.Recipe.nvfp4(), peer_group="moe.inputs",
                        peer_mode="share"),
        # Per-expert NVFP4 weight globals: EP=2 on axis 0, TP=2 on axis 2.
        amaxd.Quantizer("moe.fc1.weight", [E, R, C], amaxd.Recipe.nvfp4(),
                        P.Placement((ep * E // 2, 0, tp * C // 2), (E // 2, R, C // 2)),
                        global_axes=1),
    ]


def amax_of(r):
    tokens, w = model()
    ep, tp = r // 2, r % 2
    return {"moe.fc2.input": np.ma.masked_array(tokens[r:r + 1], mask=[r == 3]),
            "moe.fc1.input": np.float32(0.25 * (r + 1)),
            "moe.fc1.weight": w[ep * 2:(ep + 1) * 2, :, tp * 4:(tp + 1) * 4]}


def run(sockets, job):
    def rank(r):
        with amaxd.Client(job, r, W, socket=sockets[r % len(sockets)], timeout=30) as cl:
            cl.join()
            cl.register(quantizers(r))
            cl.send(amax_of(r))
            mine = cl.reconcile()
            return mine, cl.get_scales(whole=True)

    out, errs = run_threads({r: (lambda r=r: rank(r)) for r in range(W)})
    assert not errs, errs
    return out


def dump(res):
    return {n: tuple(getattr(r, f).tobytes() if getattr(r, f) is not None else None
                     for f in ("amax", "scale", "scale_inv", "block_scales", "global_amaxes",
                               "global_scales", "global_scale_invs"))
            + (r.global_amax, r.global_scale, r.global_scale_inv, r.missing)
            for n, r in res.items()}


def test_share_and_slices_across_two_daemons(make_cluster):
    c = make_cluster(2)
    out = run([c.socket(0), c.socket(1)], "share2")
    tokens, w = model()
    group = np.float32(max(tokens[:3].max(), 0.25 * W))
    for r, (mine, whole) in out.items():
        # Share: every expert (the cold one included) and the per-tensor member read the group max.
        assert np.all(mine["moe.fc2.input"].amax == group), (r, mine["moe.fc2.input"].amax)
        assert mine["moe.fc1.input"].amax[()] == group
        assert whole["moe.fc2.input"].missing == 0
        # Per-expert globals: this rank's two experts.
        ep = r // 2
        want = w.reshape(E, -1).max(axis=1)
        assert mine["moe.fc1.weight"].global_amaxes.tobytes() == want[ep * 2:ep * 2 + 2].tobytes()
        assert whole["moe.fc1.weight"].global_amaxes.tobytes() == want.tobytes()
        assert np.float32(whole["moe.fc1.weight"].global_amax) == want.max()
    wholes = [dump(whole) for _, whole in out.values()]
    assert all(x == wholes[0] for x in wholes), "whole tensors differ between daemons"
    with amaxd.Client("share2", 0, W, socket=c.socket(0)) as cl:
        infos = {q.name: q for q in cl.list_quantizers().quantizers}
    assert infos["moe.fc2.input"].peer_mode == amaxd.pb.PEER_SHARE
    assert infos["moe.fc1.weight"].global_axes == 1


def test_same_bytes_as_one_daemon(make_cluster):
    c = make_cluster(2)
    two = run([c.socket(0), c.socket(1)], "layout")
    one = run([make_cluster(1).socket(0)], "layout")
    assert dump(two[0][1]) == dump(one[0][1])
    for r in range(W):
        assert dump(two[r][0]) == dump(one[r][0])


def test_group_with_two_modes_on_two_daemons_is_a_conflict(make_cluster):
    c = make_cluster(2)
    clients = [amaxd.Client("mix", r, 2, socket=c.socket(r), timeout=30) for r in range(2)]

    def prep(r):
        clients[r].join()
        # Each daemon alone sees one consistent group.
        clients[r].register([Q("ok"), Q("a" if r == 0 else "b", [2], peer="g",
                                        peer_mode="share" if r == 0 else "fill")])
        clients[r].send({"ok": 1.0 + r})
    out, errs = run_threads({r: (lambda r=r: prep(r)) for r in range(2)})
    assert not errs, errs
    out, errs = run_threads({r: (lambda r=r: clients[r].reconcile()) for r in range(2)})
    assert sorted(errs) == [0, 1], out
    assert isinstance(errs[0], amaxd.errors.FailedPrecondition), errs[0]
    assert errs[0].message == errs[1].message
    m = errs[0].message
    assert "peer group 'g'" in m and "PEER_SHARE" in m and "PEER_FILL" in m, m
    assert "'a'" in m and "'b'" in m and "daemon 0" in m and "daemon 1" in m, m
    # The later declaration was dropped; the group keeps the first one's mode.
    for r in range(2):
        names = {q.name: q.agreed for q in clients[r].list_quantizers().quantizers}
        assert names == {"ok": True, "a": True}, names
    # Registering b again with the group's mode on daemon 1 works.
    clients[1].register([Q("b", [2], peer="g", peer_mode="share")])
    clients[1].send({"b": np.array([4, 1], np.float32)})
    out, errs = run_threads({r: (lambda r=r: clients[r].reconcile()) for r in range(2)})
    assert not errs, f"{errs}\n{c.logs()}"
    assert out[0]["a"].amax.tolist() == [4.0, 4.0]
    for cl in clients:
        cl.close()
