"""The packed form over the daemon's shared-memory buffers (GetLayout with
shm, SendPacked and ReconcilePacked naming the buffer): the same bytes as
the packed form over gRPC for every result array; the buffer's file, its
permission bits, its unlinking at first use and at a job's drop, the sweep
of dead daemons' files; and every way a client can misuse a buffer
(another id, a replaced buffer, a truncated file, bad values in it, values
both inline and in the buffer, buffers off) refused with a precise status,
changing nothing."""
import contextlib
import os
import stat
import threading
import time

import numpy as np
import pytest

import amaxd
from amaxd import errors, pb
from amaxd_proc import open_files_under
from test_packed import W, assert_same, catalog, contributions, run_ranks


def shm_files(d):
    return sorted(f for f in os.listdir(d) if f.startswith("amaxd-"))


def open_buffers(pid, d):
    """The daemon's descriptors on buffer files of d (linked or not)."""
    return open_files_under(pid, os.path.join(d, "amaxd-"))


@contextlib.contextmanager
def scalar_rank(daemon, job):
    """Rank 0 of a one-rank job with one scalar quantizer and its buffer."""
    with daemon.client(job, 0, 1, shm=True) as c:
        c.join()
        c.register([amaxd.Quantizer("a", [], amaxd.Recipe.fp8_current())])
        c.layout()
        yield c


@pytest.fixture
def shmdir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def test_shm_matches_grpc(start_daemon, shmdir):
    daemon = start_daemon(f"--shm-dir={shmdir}")

    def rank_fn(r):
        got = []
        with daemon.client("grpc", r, W) as cg, daemon.client("shm", r, W, shm=True) as cs:
            cg.join(), cs.join()
            cg.register(catalog(r))
            cs.register(catalog(r))
            Lg, Ls = cg.layout(), cs.layout()
            assert Lg.names == Ls.names and Lg.total_cells == Ls.total_cells
            for epoch in (1, 2, 3):
                contrib = contributions(r, epoch, np.random.default_rng(100 * r + epoch))
                slab, has = Ls.pack(contrib)
                cg.send_packed(slab, has_data=has)
                cs.send_packed(slab, has_data=has)
                rg = cg.reconcile_packed()
                rs = cs.reconcile_packed()
                assert rs.epoch == rg.epoch and rs.next_epoch == rg.next_epoch
                assert rs.layout_id == Ls.id
                for name in rg.keys():
                    assert_same(rg[name], rs[name], name)
                for f in ("missing", "has_previous", "global_amaxes", "global_scales"):
                    assert getattr(rg, f).tobytes() == getattr(rs, f).tobytes(), f
                got.append(rs)
            # stream_packed keeps the values in the messages, with or without a buffer.
            contrib = contributions(r, 4, np.random.default_rng(100 * r + 4))
            slab, has = Ls.pack(contrib)
            cg.stream_packed([(slab, has)])
            cs.stream_packed([(slab, has)])
            rg, rs = cg.reconcile_packed(), cs.reconcile_packed()
            for name in rg.keys():
                assert_same(rg[name], rs[name], name)
        return got

    outs = run_ranks(rank_fn)
    assert any(int(rp.missing.sum()) > 0 for o in outs for rp in o)
    # The answer's arrays are read-only views of the client's own copy.
    v = outs[0][-1]["a.fc1.weight"].amax
    assert not v.flags.owndata and not v.flags.writeable
    # Every buffer was unlinked at its first use; the daemon holds W of them.
    assert shm_files(shmdir) == []
    assert len(open_buffers(daemon.proc.pid, shmdir)) == 2 * W  # a slab and an answer file each


def test_file_mode_unlink_and_drop(start_daemon, shmdir):
    daemon = start_daemon(f"--shm-dir={shmdir}", "--socket-mode=0640")
    R = amaxd.Recipe
    with daemon.client("f", 0, 1, shm=True) as c:
        c.join()
        c.register([amaxd.Quantizer("a", [3], R.fp8_current())])
        c.layout()
        files = shm_files(shmdir)
        assert len(files) == 2 and all(f.startswith(f"amaxd-{daemon.proc.pid}-") for f in files)
        # The socket's permission bits, without execute bits; the answer
        # file is the daemon's alone to write.
        modes = {f[-1]: stat.S_IMODE(os.stat(os.path.join(shmdir, f)).st_mode) for f in files}
        assert modes == {"s": 0o640, "a": 0o640}
        c.send_packed(np.array([1, 2, 3], dtype=np.float32))
        assert shm_files(shmdir) == []  # unlinked at first use
        res = c.reconcile_packed()
        np.testing.assert_array_equal(res.amax, [1, 2, 3])
        # A new layout with shm replaces the rank's buffer (the daemon closes the old one).
        c.layout(refresh=True)
        assert len(shm_files(shmdir)) == 2
        assert len(open_buffers(daemon.proc.pid, shmdir)) == 2
        c.reset(drop_job=True)
        # Dropping the job closes and removes its buffers.
        assert shm_files(shmdir) == []
        assert open_buffers(daemon.proc.pid, shmdir) == []


def test_never_world_readable(start_daemon, shmdir):
    daemon = start_daemon(f"--shm-dir={shmdir}", "--socket-mode=0666")
    with scalar_rank(daemon, "w") as c:
        files = shm_files(shmdir)
        modes = {f[-1]: stat.S_IMODE(os.stat(os.path.join(shmdir, f)).st_mode) for f in files}
        assert modes == {"s": 0o660, "a": 0o640}
        # The files' names do not tell the buffer's id.
        assert all(f"{c._shm[1]:016x}" not in f for f in files)


def test_misuse_is_refused(start_daemon, shmdir):
    daemon = start_daemon(f"--shm-dir={shmdir}")
    R = amaxd.Recipe
    with daemon.client("m", 0, 1, shm=True) as c:
        c.join()
        c.register([amaxd.Quantizer("a", [], R.fp8_current()),
                    amaxd.Quantizer("b", [4], R.fp8_current())])
        L = c.layout()
        fd, sid = c._shm[0], c._shm[1]
        c.send_packed(np.arange(1, 6, dtype=np.float32))
        n0 = c.status("m").jobs[0].updates

        def raw(**kw):
            req = pb.SendPackedRequest(job="m", rank=0, layout_id=L.id, **kw)
            return c._raw("SendPacked", req.SerializeToString(), pb.SendAmaxResponse.FromString)

        with pytest.raises(errors.FailedPrecondition, match="has no shared buffer"):
            raw(shm_id=sid ^ 1)
        with pytest.raises(errors.FailedPrecondition, match="has no shared buffer"):
            c._raw("SendPacked", pb.SendPackedRequest(job="m", rank=3, layout_id=L.id,
                                                      shm_id=sid).SerializeToString(), None)
        with pytest.raises(errors.InvalidArgument, match="either in the request or in the shared"):
            raw(shm_id=sid, values=np.ones(5, dtype=np.float32).tobytes())
        with pytest.raises(errors.InvalidArgument, match="shm_has_data without shm_id"):
            raw(values=np.ones(5, dtype=np.float32).tobytes(), shm_has_data=True)
        # Bad values in the buffer: refused naming the quantizer, nothing applied.
        for bad in (np.nan, -2.0, np.inf):
            v = np.ones(5, dtype=np.float32)
            v[2] = bad
            with pytest.raises(errors.InvalidArgument, match="quantizer 'b'"):
                c.send_packed(v)
        # A file truncated under the daemon: a short read, not a crash.
        os.ftruncate(fd, 7)
        with pytest.raises(errors.FailedPrecondition, match="truncated"):
            raw(shm_id=sid)
        os.pwrite(fd, np.ones(5, dtype=np.float32).tobytes(), 0)
        with pytest.raises(errors.FailedPrecondition, match="ends 0 bytes into the has-data"):
            raw(shm_id=sid, shm_has_data=True)
        assert c.status("m").jobs[0].updates == n0
        # The same file grown and rewritten works again.
        c.send_packed(np.full(5, 0.5, dtype=np.float32), has_data=[1, 1, 0, 1, 1])
        assert c.status("m").jobs[0].updates == n0 + 2
        res = c.reconcile_packed()
        np.testing.assert_array_equal(res.amax, np.array([1, 2, 3, 4, 5], dtype=np.float32))
        # A reconcile naming another buffer is refused before it waits.
        req = pb.ReconcilePackedRequest(job="m", rank=0, epoch=c.epoch, layout_id=L.id,
                                        shm_id=sid + 1)
        with pytest.raises(errors.FailedPrecondition, match="has no shared buffer"):
            c._raw("ReconcilePacked", req.SerializeToString(), None)
        # A replaced buffer: the old id is refused, naming why.
        old = sid
        c.layout(refresh=True)
        assert c._shm[1] != old
        with pytest.raises(errors.FailedPrecondition, match="replaced by a newer one"):
            raw(shm_id=old)
        # A buffer of an older layout of the rank.
        c.register([amaxd.Quantizer("c", [2], R.fp8_current())])
        stale_id = c._shm[1]
        L2 = c.layout(refresh=True)
        req = pb.SendPackedRequest(job="m", rank=0, layout_id=L.id, shm_id=c._shm[1])
        with pytest.raises(errors.FailedPrecondition, match="was made for layout"):
            c._raw("SendPacked", req.SerializeToString(), None)
        assert stale_id != c._shm[1] and L2.total_cells == 7
        c.send_packed(np.full(7, 9, dtype=np.float32))
        res = c.reconcile_packed()
        np.testing.assert_array_equal(res["c"].amax, [9, 9])
    assert daemon.proc.poll() is None
    assert "truncated" in daemon.log() and "has no shared buffer" in daemon.log()


def test_off_and_bad_dir(start_daemon, tmp_path):
    daemon = start_daemon("--shm-dir=")
    with daemon.client("o", 0, 1, shm=True) as c:
        c.join()
        c.register([amaxd.Quantizer("a", [], amaxd.Recipe.fp8_current())])
        with pytest.raises(errors.FailedPrecondition, match="shared-memory buffers are off"):
            c.layout()
    with daemon.client("o", 0, 1) as c:
        L = c.layout()
        req = pb.ReconcilePackedRequest(job="o", rank=0, layout_id=L.id, shm_id=5)
        with pytest.raises(errors.FailedPrecondition, match="shared-memory buffers are off"):
            c._raw("ReconcilePacked", req.SerializeToString(), None)
        req = pb.SendPackedRequest(job="o", rank=0, layout_id=L.id, shm_id=5)
        with pytest.raises(errors.FailedPrecondition, match="shared-memory buffers are off"):
            c._raw("SendPacked", req.SerializeToString(), None)
    # An explicit shm_dir that is not a directory: the daemon refuses to start.
    bad = tmp_path / "not-a-dir"
    bad.write_text("x")
    with pytest.raises(RuntimeError, match=r"(?s)exited with 1.*shm_dir=.*Not a directory"):
        start_daemon(f"--shm-dir={bad}", socket=str(tmp_path / "b.sock"))


def test_sweep_of_dead_daemons_files(start_daemon, shmdir):
    import fcntl
    # Files no daemon holds a lock on are removed (whatever their pid says:
    # a daemon in another PID namespace, a reused pid); one a running
    # daemon holds (here: this process, as another daemon would) is kept,
    # and so are names that are not a daemon's buffers.
    # A file under a maker's temporary name (a daemon killed between making
    # and renaming it) goes once a minute old; a fresh one may be a live
    # daemon's, before its lock: kept.
    for name in (f"amaxd-{os.getpid()}-00000000000000aa", "amaxd-1-00000000000000cc",
                 "amaxd-7-00000000000000bb", "amaxd-notapid", "other-file",
                 ".new-amaxd-00000000000000dd-s", ".new-amaxd-00000000000000ee-a"):
        with open(os.path.join(shmdir, name), "w") as f:
            f.write("x")
    old = time.time() - 120
    os.utime(os.path.join(shmdir, ".new-amaxd-00000000000000dd-s"), (old, old))
    held = open(os.path.join(shmdir, "amaxd-7-00000000000000bb"))
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        daemon = start_daemon(f"--shm-dir={shmdir}")
        assert sorted(os.listdir(shmdir)) == [".new-amaxd-00000000000000ee-a",
                                              "amaxd-7-00000000000000bb", "amaxd-notapid",
                                              "other-file"]
        assert "removed 3 shared buffers" in daemon.log()
        os.unlink(os.path.join(shmdir, ".new-amaxd-00000000000000ee-a"))
        # A second daemon sharing the directory leaves the first one's buffers alone.
        with daemon.client("sw", 0, 1, shm=True) as c:
            c.join()
            c.register([amaxd.Quantizer("a", [], amaxd.Recipe.fp8_current())])
            c.layout()
            mine = [f for f in shm_files(shmdir) if f.startswith(f"amaxd-{daemon.proc.pid}-")]
            assert len(mine) == 2
            other = start_daemon(f"--shm-dir={shmdir}", socket=os.path.join(shmdir, "o.sock"))
            assert set(mine) <= set(os.listdir(shmdir))
            assert "removed" not in other.log()
            c.send_packed(np.ones(1, dtype=np.float32))
            np.testing.assert_array_equal(c.reconcile_packed().amax, [1])
    finally:
        held.close()


def test_answer_survives_a_replaced_buffer(start_daemon, shmdir):
    """A buffer replaced while its ReconcilePacked waits: the epoch's answer
    comes in the message instead, not as an error after the epoch."""
    daemon = start_daemon(f"--shm-dir={shmdir}")
    R = amaxd.Recipe
    with daemon.client("rp", 0, 2, shm=True) as c0, daemon.client("rp", 1, 2, shm=True) as c1, \
            daemon.client("rp", 0, 2, shm=True) as thief:
        t = threading.Thread(target=c1.join)
        t.start()
        c0.join()
        t.join()
        for r, c in ((0, c0), (1, c1)):
            c.register([amaxd.Quantizer("a", [4], R.fp8_current(), amaxd.placement.column_parallel(
                [4], r, 2))])
        for c in (c0, c1):
            c.layout()
            c.send_packed(np.full(2, 3.0 + c.rank, dtype=np.float32))
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(0, c0.reconcile_packed()))
        t.start()
        # Wait until rank 0 waits in its epoch, then take its buffer away.
        for _ in range(500):
            if c1.status("rp").jobs[0].ranks_in_reconcile == 1:
                break
            time.sleep(0.01)
        assert c1.status("rp").jobs[0].ranks_in_reconcile == 1
        thief.layout()  # a new buffer for rank 0: c0's is closed
        r1 = c1.reconcile_packed()
        t.join(30)
        r0 = out[0]
        assert r0.epoch == r1.epoch == 1
        np.testing.assert_array_equal(r0.amax, [3, 3])
        np.testing.assert_array_equal(r1.amax, [4, 4])
        assert r0.global_amax.tobytes() == r1.global_amax.tobytes()
    assert "answered in the message instead" in daemon.log()


def test_idle_expiry_closes_buffers(start_daemon, shmdir):
    daemon = start_daemon(f"--shm-dir={shmdir}", "--job-idle-timeout-ms=300")
    with scalar_rank(daemon, "idlejob"):
        assert len(open_buffers(daemon.proc.pid, shmdir)) == 2
        for _ in range(100):
            time.sleep(0.05)
            if "job idlejob dropped" in daemon.log():
                break
        assert "job idlejob dropped" in daemon.log()
        assert open_buffers(daemon.proc.pid, shmdir) == []
        assert shm_files(shmdir) == []


def test_buffers_within_the_descriptor_limit(start_daemon, shmdir):
    """At a hard limit of 512 descriptors a daemon keeps at most 512/16 = 32
    buffers (two descriptors each, kept out of the socket guard's budget):
    the next one is RESOURCE_EXHAUSTED, the others keep working, and a new
    trainer connection is still served."""
    import resource

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    daemon = start_daemon(f"--shm-dir={shmdir}", preexec_fn=low_limit)
    with contextlib.ExitStack() as stack:
        ranks = [stack.enter_context(scalar_rank(daemon, f"fd{i}")) for i in range(32)]
        with daemon.client("fd32", 0, 1, shm=True) as c:
            c.join()
            c.register([amaxd.Quantizer("a", [], amaxd.Recipe.fp8_current())])
            with pytest.raises(errors.ResourceExhausted, match="32 shared buffers are open"):
                c.layout()
        assert len(open_buffers(daemon.proc.pid, shmdir)) == 64
        for i, c in enumerate(ranks):
            c.send_packed(np.array([i], dtype=np.float32))
            assert c.reconcile_packed().amax[0] == i
        with daemon.client("late", 0, 1) as c:
            assert c.health() == "SERVING"
