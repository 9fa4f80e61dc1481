"""Two and three daemons: membership, catalog agreement regardless of
registration order, one packed collective, identical answers."""
import os
import threading
import time

import numpy as np
import pytest

import amaxd
from amaxd_proc import open_files_under
from conftest import COLLECTIVE


def run_threads(fns, timeout=60):
    out, errs = {}, {}

    def wrap(k, fn):
        try:
            out[k] = fn()
        except Exception as e:  # noqa: BLE001 - reported below
            errs[k] = e

    ts = [threading.Thread(target=wrap, args=(k, fn)) for k, fn in fns.items()]
    [t.start() for t in ts]
    [t.join(timeout) for t in ts]
    assert not any(t.is_alive() for t in ts), "a trainer thread hangs"
    return out, errs


def reconcile_as_trainer(cl, resend=None, tries=8):
    """Reconcile as a trainer does after a fault (docs/API.md "Decisions on
    edge cases"): ABORTED, UNAVAILABLE (another daemon's attempt failed;
    contributions kept): call Reconcile again; FAILED_PRECONDITION (this
    rank's epoch was closed: its daemon restarted behind its peers; the
    client learned the open epoch): send again (`resend`, a {name: amax}
    dict) and Reconcile. Returns (results, the errors it went through)."""
    seen = []
    for _ in range(tries):
        try:
            return cl.reconcile(), seen
        except (amaxd.errors.Aborted, amaxd.errors.Unavailable) as e:
            seen.append(e)
        except amaxd.errors.FailedPrecondition as e:
            seen.append(e)
            if resend is None:
                raise
            cl.send(resend)
    raise AssertionError(f"no answer after {tries} attempts: {seen}")


def Q(name, shape=(), peer="", **kw):
    return amaxd.Quantizer(name, list(shape), amaxd.Recipe.fp8_current(), peer_group=peer, **kw)


def test_two_daemons_reduce_and_agree(make_cluster):
    c = make_cluster(2)
    names = ["b.w", "a.w", "c.in"]
    vals = {0: {"a.w": [1, 5], "b.w": 2.0, "c.in": 0.5}, 1: {"a.w": [3, 4], "b.w": 7.0}}

    def rank(r):
        d = r  # rank r on daemon r
        with amaxd.Client("j", r, 2, socket=c.socket(d), timeout=30) as cl:
            cl.join()
            qs = {"a.w": Q("a.w", [2]), "b.w": Q("b.w"), "c.in": Q("c.in")}
            order = names if r == 0 else list(reversed(names))
            cl.register([qs[n] for n in order if n in vals[r] or r == 0])
            out = []
            for epoch in range(3):
                cl.send({k: np.asarray(v, np.float32) * (epoch + 1) for k, v in vals[r].items()})
                res = cl.reconcile()
                out.append({k: (v.amax.tobytes(), v.scale.tobytes()) for k, v in res.items()})
            whole = cl.get_scales(whole=True)
            st = cl.status("j").jobs[0]
            return out, {k: v.amax.tobytes() for k, v in whole.items()}, st

    out, errs = run_threads({0: lambda: rank(0), 1: lambda: rank(1)})
    assert not errs, f"{errs}\n{c.logs()}"
    for epoch in range(3):
        m = epoch + 1
        assert out[0][0][epoch]["a.w"][0] == (np.array([3, 5], np.float32) * m).tobytes()
        assert out[0][0][epoch]["b.w"][0] == np.float32(7 * m).tobytes()
    assert out[0][1] == out[1][1], "whole tensors differ between daemons"
    s0, s1 = out[0][2], out[1][2]
    assert s0.participants == s1.participants == 2
    assert s0.catalog_hash == s1.catalog_hash and s0.catalog_hash != 0
    assert s0.collective == COLLECTIVE and s0.local_ranks == 1
    # Steady state: one collective per epoch.
    assert s0.last_collectives == 1 and s1.last_collectives == 1


def test_job_on_one_daemon_of_a_cluster_is_local(make_cluster):
    c = make_cluster(2)
    with amaxd.Client("solo", 0, 1, socket=c.socket(1), timeout=30) as cl:
        cl.join()
        cl.register([Q("x")])
        cl.send({"x": 2.0})
        assert cl.reconcile()["x"].amax[()] == 2.0
        st = cl.status("solo").jobs[0]
    assert st.participants == 1 and st.collective == "local"
    # The other daemon knows nothing of it.
    with amaxd.Client("solo", 0, 1, socket=c.socket(0), timeout=30) as cl:
        with pytest.raises(amaxd.errors.NotFound):
            cl.status("solo")


def test_packed_over_shared_memory_in_a_cluster(make_cluster):
    """Rank 0 passes its slab and answer through its daemon's shared-memory
    buffer, rank 1 through gRPC on the other daemon (both daemons share the
    host's shm_dir): the same reduction, the same bytes."""
    c = make_cluster(2)

    def rank(r):
        with amaxd.Client("shmj", r, 2, socket=c.socket(r), timeout=30, shm=r == 0) as cl:
            cl.join()
            mine = [Q("a.w", [4], placement=amaxd.placement.column_parallel([4], r, 2)),
                    Q("b.w"), Q("c.in", [3])]
            cl.register(mine if r == 0 else list(reversed(mine)))
            L = cl.layout()
            out = []
            for epoch in range(1, 4):
                slab = np.arange(L.total_cells, dtype=np.float32) * (r + 1) * epoch
                cl.send_packed(slab)
                res = cl.reconcile_packed()
                out.append({n: (res[n].amax.tobytes(), res[n].scale.tobytes(),
                                np.float32(res[n].global_amax).tobytes()) for n in L.names})
            return L.names, out, cl._shm is not None

    out, errs = run_threads({0: lambda: rank(0), 1: lambda: rank(1)})
    assert not errs, f"{errs}\n{c.logs()}"
    names0, res0, shm0 = out[0]
    names1, res1, shm1 = out[1]
    assert shm0 and not shm1 and names0 == names1 == ["a.w", "b.w", "c.in"]
    for epoch in range(3):
        for n in ("b.w", "c.in"):  # replicated: identical answers on both daemons
            assert res0[epoch][n] == res1[epoch][n], (epoch, n)
        assert res0[epoch]["a.w"][2] == res1[epoch]["a.w"][2]  # global amax of the sharded one
        # b.w is slab cell 2 on both ranks: max(2*1, 2*2) * epoch
        assert res0[epoch]["b.w"][0] == np.float32(4 * (epoch + 1)).tobytes()


def test_peer_drop_closes_shared_buffers(make_cluster, tmp_path):
    """A job dropped on another daemon (Reset(drop_job) there, fanned out by
    the coordinator) closes this daemon's shared-memory buffers of the job,
    as a local drop does."""
    shm = str(tmp_path)
    c = make_cluster(2, f"--shm-dir={shm}")

    def buffers(i):
        return open_files_under(c[i].proc.pid, os.path.join(shm, "amaxd-"))

    clients = {r: amaxd.Client("pd", r, 2, socket=c.socket(r), timeout=30, shm=r == 0)
               for r in (0, 1)}
    try:
        def epoch(r):
            cl = clients[r]
            cl.join()
            cl.register([Q("a"), Q("b", [3])])
            L = cl.layout()
            cl.send_packed(np.full(L.total_cells, r + 1, dtype=np.float32))
            return cl.reconcile_packed()["b"].amax.tolist()

        out, errs = run_threads({0: lambda: epoch(0), 1: lambda: epoch(1)})
        assert not errs, f"{errs}\n{c.logs()}"
        assert out[0] == out[1] == [2, 2, 2]
        assert clients[0]._shm is not None
        assert len(buffers(0)) == 2  # slab and answer file of rank 0
        clients[1].reset(drop_job=True)  # on daemon 1
        deadline = time.monotonic() + 10
        # The drop is logged just before the buffers are closed: wait for both.
        while ("job pd dropped" not in c[0].log() or buffers(0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "job pd dropped" in c[0].log(), c.logs()
        assert buffers(0) == []
    finally:
        for cl in clients.values():
            cl.close()
