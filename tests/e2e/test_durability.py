"""Snapshots (docs/OPERATING.md, "Durability"): kill -9 after epoch k, restart
on the same state_dir, re-join, epoch k+1 equals an uninterrupted run's
byte for byte; damaged snapshots are refused and moved aside; intervals,
shutdown flush, drops and write failures."""
import glob
import os
import shutil
import signal
import threading

import numpy as np
import pytest

import amaxd
from amaxd import placement as P

W = 2
E = 4
JOB = "durable"


def quantizers(rank):
    """A mix of everything that carries state across epochs: a delayed-scaling
    history, running maxima, per-epoch accumulation, NVFP4 blocks with a
    global amax, MXFP8 blocks (TE's and ModelOpt's E8M0, and TE 2.13-2.18's
    byte-0 scales, the highest convention number a snapshot stores), a peer
    group with a cold expert, a share-mode peer group and per-expert NVFP4
    globals (global_axes)."""
    return [
        amaxd.Quantizer("l0.fc1.weight", [8], amaxd.Recipe.fp8_current(),
                        P.column_parallel([8], rank, W)),
        amaxd.Quantizer("l0.fc1.input", [], amaxd.Recipe.fp8_delayed(history_len=4),
                        accumulation=amaxd.PER_EPOCH),
        amaxd.Quantizer("l0.fc2.input", [4, 6], amaxd.Recipe.nvfp4(), P.shard([4, 6], 1, rank, W)),
        amaxd.Quantizer("l0.fc2.weight", [6], amaxd.Recipe.mxfp8(), P.row_parallel([6], rank, W)),
        amaxd.Quantizer("l0.experts.input", [E], amaxd.Recipe.fp8_current(amaxd.FP8_E5M2),
                        P.per_expert(E, rank, W), accumulation=amaxd.PER_EPOCH,
                        peer_group="l0.experts"),
        amaxd.Quantizer("l0.experts.fc1.weight", [E, 2, 3], amaxd.Recipe.nvfp4(),
                        P.shard([E, 2, 3], 0, rank, W), global_axes=1,
                        peer_group="l0.experts.fc1", peer_mode="share"),
        amaxd.Quantizer("l0.experts.fc1.input", [E], amaxd.Recipe.fp8_current(),
                        P.per_expert(E, rank, W), peer_group="l0.experts.fc1",
                        peer_mode="share"),
        amaxd.Quantizer("l0.fc3.weight", [6], amaxd.Recipe.mxfp8("modelopt"),
                        P.row_parallel([6], rank, W)),
        amaxd.Quantizer("l0.fc4.weight", [6], amaxd.Recipe.mxfp8("te_2_18"),
                        P.row_parallel([6], rank, W)),
    ]


def amax_of(epoch, rank):
    rng = np.random.default_rng(1000 * epoch + rank)
    experts = np.ma.masked_array(rng.uniform(0.5, 4, E // W).astype(np.float32),
                                 mask=[rank == 1 and epoch % 2 == 0, False])
    return {
        "l0.fc1.weight": rng.uniform(0.1, 3, 8 // W).astype(np.float32),
        "l0.fc1.input": np.float32(rng.uniform(0.5, 10)),
        "l0.fc2.input": rng.uniform(0, 5, (4, 3)).astype(np.float32),
        "l0.fc2.weight": rng.uniform(0, 2, 6).astype(np.float32),
        "l0.experts.input": experts,
        "l0.experts.fc1.weight": rng.uniform(0, 2 ** epoch, (E // W, 2, 3)).astype(np.float32),
        "l0.experts.fc1.input": np.ma.masked_array(rng.uniform(0, 3, E // W).astype(np.float32),
                                                   mask=[rank == 0, False]),
        # 448 * 2^k plus 1 ulp: ModelOpt's E8M0 is k where TE's is k + 1
        "l0.fc3.weight": (np.ldexp(np.float32(448), rng.integers(-20, 20, 6).astype(np.int32))
                          .astype(np.float32).view(np.uint32) + 1).view(np.float32),
        # some zero blocks: E8M0 byte 0 (scale 2^127, scale_inv 0.0 in TE 2.13-2.18)
        "l0.fc4.weight": (rng.uniform(0, 2, 6) * (rng.random(6) > 0.4)).astype(np.float32),
    }


def run_epochs(d, epochs, join=True, register=True):
    """Every rank (a thread each) runs `epochs`; returns {rank: [(rejoined, results)...]}."""
    out, errs = {}, []

    def rank_main(r):
        try:
            with d.client(JOB, r, W) as c:
                rejoined = c.join().rejoined if join else None
                if register:
                    c.register(quantizers(r))
                got = []
                for e in epochs:
                    c.send(amax_of(e, r))
                    got.append(c.reconcile())
                out[r] = (rejoined, got, c.get_scales())
        except Exception as e:  # noqa: BLE001 - reported below
            errs.append(e)

    ts = [threading.Thread(target=rank_main, args=(r,)) for r in range(W)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    return out


def same(a, b):
    """Results of two runs, byte for byte."""
    assert a.keys() == b.keys()
    for n in a:
        x, y = a[n], b[n]
        for f in ("amax", "scale", "scale_inv", "block_scales"):
            assert getattr(x, f).tobytes() == getattr(y, f).tobytes(), (n, f)
        for f in ("global_amax", "global_scale", "global_scale_inv", "missing"):
            assert np.float32(getattr(x, f)).tobytes() == np.float32(getattr(y, f)).tobytes(), (n, f)
        for f in ("global_amaxes", "global_scales", "global_scale_invs"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None) and (u is None or u.tobytes() == v.tobytes()), (n, f)
        # The epoch before (has_previous): in the snapshot too.
        for f in ("previous_global_amax", "previous_global_scale"):
            u, v = getattr(x, f), getattr(y, f)
            assert (u is None) == (v is None), (n, f, u, v)
            assert u is None or np.float32(u).tobytes() == np.float32(v).tobytes(), (n, f)


def snapshot_path(state):
    return os.path.join(state, JOB + ".amxs")


@pytest.mark.parametrize("register_again", [False, True])
def test_kill9_restart_continues_byte_identical(start_daemon, tmp_path, register_again):
    state = str(tmp_path / "state")
    k = 3
    ref = start_daemon()
    want = run_epochs(ref, range(1, k + 2))

    d = start_daemon(f"--state-dir={state}")
    first = run_epochs(d, range(1, k + 1))
    assert os.path.exists(snapshot_path(state))
    with d.client(JOB, 0, W) as c:
        st = c.status(JOB).jobs[0]
        assert st.durable_epoch == k and st.snapshot_error == "" and not st.restored
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    d._log.close()
    os.unlink(d.socket)  # what kill -9 leaves behind

    d2 = start_daemon(f"--state-dir={state}", socket=d.socket)
    assert f"job {JOB} restored from" in d2.log()
    with d2.client(JOB, 0, W) as c:
        st = c.status(JOB).jobs[0]
        assert st.restored and st.ready and st.durable_epoch == k and st.epoch == k + 1
        assert st.reconciled_epochs == k
    after = run_epochs(d2, [k + 1], register=register_again)
    for r in range(W):
        rejoined, got, _ = after[r]
        assert rejoined
        # Before the crash: the same results as the reference's first k epochs.
        for e in range(k):
            same(first[r][1][e], want[r][1][e])
        # After it: epoch k+1 as if nothing had happened.
        same(got[0], want[r][1][k])
        same(after[r][2], want[r][2])
    with d2.client(JOB, 0, W) as c:
        assert c.status(JOB).jobs[0].durable_epoch == k + 1


def test_results_of_the_last_epoch_survive(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}")
    before = run_epochs(d, [1, 2])
    d.check_clean_exit(d.stop())
    d2 = start_daemon(f"--state-dir={state}")
    for r in range(W):
        with d2.client(JOB, r, W) as c:
            assert c.join().rejoined
            got = c.get_scales()
            same(got, before[r][2])
            assert all(v.previous_global_amax is not None for v in got.values())


@pytest.mark.parametrize("damage", ["truncate", "flip_state", "flip_section", "version"])
def test_damaged_snapshot_is_moved_aside(start_daemon, tmp_path, damage):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}")
    run_epochs(d, [1])
    d.check_clean_exit(d.stop())
    path = snapshot_path(state)
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[:len(data) * 2 // 3]
    elif damage == "flip_state":
        data[-40] ^= 0x10  # inside the job state's arrays
    elif damage == "flip_section":
        data[30] ^= 0x01  # inside the job section
    else:
        data[4] = 99  # format version
    open(path, "wb").write(bytes(data))
    d2 = start_daemon(f"--state-dir={state}")
    log = d2.log()
    assert f"snapshot {path} cannot be used" in log, log[-3000:]
    expect = {"truncate": "truncated", "flip_state": "checksum", "flip_section": "checksum",
              "version": "snapshot format 99"}[damage]
    line = [x for x in log.splitlines() if "cannot be used" in x][0]
    assert expect in line, line
    assert not os.path.exists(path)
    assert open(path + ".corrupt", "rb").read() == bytes(data)  # set aside, unchanged
    with d2.client(JOB, 0, W) as c:
        assert list(c.status().jobs) == []
        # The job starts over.
    run_epochs(d2, [1])


def test_interrupted_write_is_removed_and_previous_kept(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}")
    run_epochs(d, [1])
    d.check_clean_exit(d.stop())
    with open(snapshot_path(state) + ".tmp", "wb") as f:
        f.write(b"AMXS half a snapshot")
    d2 = start_daemon(f"--state-dir={state}")
    assert "a snapshot write that did not finish" in d2.log()
    assert not os.path.exists(snapshot_path(state) + ".tmp")
    with d2.client(JOB, 0, W) as c:
        assert c.status(JOB).jobs[0].restored


def test_interval_defers_writes_and_shutdown_flushes(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}", "--snapshot-interval-ms=3600000")
    before = run_epochs(d, [1, 2, 3])
    with d.client(JOB, 0, W) as c:
        assert c.status(JOB).jobs[0].durable_epoch == 1  # the first; the next hour's wait
    d.check_clean_exit(d.stop())
    assert f"job {JOB}: epoch 3 written to its snapshot at shutdown" in d.log()
    d2 = start_daemon(f"--state-dir={state}")
    with d2.client(JOB, 0, W) as c:
        st = c.status(JOB).jobs[0]
        assert st.restored and st.durable_epoch == 3 and st.epoch == 4
        got = c.get_scales()
        same(got, before[0][2])
        assert all(v.previous_global_amax is not None for v in got.values())


def test_drop_removes_the_snapshot(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}")
    run_epochs(d, [1])
    assert os.path.exists(snapshot_path(state))
    with d.client(JOB, 0, W) as c:
        c.reset(drop_job=True)
    assert not os.path.exists(snapshot_path(state))
    d.check_clean_exit(d.stop())
    d2 = start_daemon(f"--state-dir={state}")
    with d2.client(JOB, 0, W) as c:
        assert list(c.status().jobs) == []


def test_mxfp8_te_in_a_snapshot_is_the_current_rule(start_daemon, tmp_path):
    """A snapshot stores the MXFP8 convention's number; value 1 (`te`) is
    read as TE main's rule after a restart (docs/NUMERICS.md, "MXFP8 byte
    0"): a zero block answers 2^127 / 2^-127. The old rule is a different
    recipe: registering `te_legacy` over the restored quantizer is refused,
    and accepted after the job is dropped."""
    state = str(tmp_path / "state")
    amax = np.array([0, 1, 448], np.float32)
    d = start_daemon(f"--state-dir={state}")
    with d.client("mx", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [3], amaxd.Recipe.mxfp8())])
        c.send({"w": amax})
        c.reconcile()
    d.check_clean_exit(d.stop())
    d2 = start_daemon(f"--state-dir={state}")
    with d2.client("mx", 0, 1) as c:
        assert c.join().rejoined
        got = c.get_scales()["w"]
        assert got.block_scales.tolist() == [0, 119, 127]  # 1/448 = 2^-8.8 rounds up to 2^-8
        assert got.scale.view(np.uint32).tolist()[0] == 0x7F000000
        assert got.scale_inv.view(np.uint32).tolist()[0] == 0x00400000
        with pytest.raises(amaxd.errors.FailedPrecondition):
            c.register([amaxd.Quantizer("w", [3], amaxd.Recipe.mxfp8("te_legacy"))])
        c.reset(drop_job=True)
    with d2.client("mx", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [3], amaxd.Recipe.mxfp8("te_legacy"))])
        c.send({"w": amax})
        c.reconcile()
        got = c.get_scales()["w"]
        assert got.scale.view(np.uint32).tolist()[0] == 0x3F800000
        assert got.scale_inv.view(np.uint32).tolist()[0] == 0


def test_block_rules_and_partial_cast_survive_a_restart(start_daemon, tmp_path):
    """The highest rule and NVFP4 convention numbers a snapshot stores
    (FP8 BLOCK_BF16 / BLOCK_FP16, NVFP4 TRANSFORMER_ENGINE_PARTIAL_CAST =
    5) are read back: the restarted daemon answers the same scales, and
    the next epoch goes on from them."""
    state = str(tmp_path / "state")
    qs = [amaxd.Quantizer("nv", [2, 3], amaxd.Recipe.nvfp4("te_partial_cast")),
          amaxd.Quantizer("b16", [4], amaxd.Recipe.fp8_block(power_of_2=False,
                                                             input_dtype="bfloat16")),
          amaxd.Quantizer("f16", [4], amaxd.Recipe.fp8_block(amaxd.FP8_E5M2,
                                                             input_dtype="float16"),
                          accumulation=amaxd.PER_EPOCH)]
    amax = {"nv": np.array([[0, 1, 6], [7, 1e-40, 448]], np.float32),
            "b16": np.array([0, 1e-37, 1, 3e38], np.float32),
            "f16": np.array([0, 1e-37, 1, 3e38], np.float32)}
    d = start_daemon(f"--state-dir={state}")
    with d.client("blk", 0, 1) as c:
        c.join()
        c.register(qs)
        c.send(amax)
        c.reconcile()
        before = c.get_scales()
    d.check_clean_exit(d.stop())
    d2 = start_daemon(f"--state-dir={state}")
    assert "job blk restored from" in d2.log()
    with d2.client("blk", 0, 1) as c:
        assert c.join().rejoined
        got = c.get_scales()
        for n in amax:
            for f in ("amax", "scale", "scale_inv", "block_scales"):
                assert getattr(got[n], f).tobytes() == getattr(before[n], f).tobytes(), (n, f)
        assert got["b16"].scale.view(np.uint32)[1] == 0x7F7F0000  # bf16 max, not FLT_MAX
        c.register(qs)
        c.send(amax)
        c.reconcile()
        again = c.get_scales()
        for n in amax:
            assert again[n].scale.tobytes() == before[n].scale.tobytes(), n


def test_idle_job_snapshot_is_kept_aside(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}", "--job-idle-timeout-ms=300")
    run_epochs(d, [1])
    for _ in range(100):
        if os.path.exists(snapshot_path(state) + ".expired"):
            break
        threading.Event().wait(0.05)
    assert os.path.exists(snapshot_path(state) + ".expired")
    assert not os.path.exists(snapshot_path(state))


def test_write_failure_is_reported_and_reconcile_still_answers(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}")
    run_epochs(d, [1])
    # The directory is replaced by a file: every later write fails.
    shutil.rmtree(state)
    open(state, "w").close()
    out = run_epochs(d, [2], join=False, register=False)
    assert out[0][1][0]  # results came back
    with d.client(JOB, 0, W) as c:
        st = c.status(JOB).jobs[0]
        assert st.durable_epoch == 1 and st.reconciled_epochs == 2
        assert "epoch 2 of job 'durable' was reconciled but not written" in st.snapshot_error
    assert "was reconciled but not written to its snapshot" in d.log()
    os.unlink(state)
    os.mkdir(state)
    run_epochs(d, [3], join=False, register=False)
    with d.client(JOB, 0, W) as c:
        st = c.status(JOB).jobs[0]
        assert st.durable_epoch == 3 and st.snapshot_error == ""


def test_unusable_state_dir_refuses_to_start(tmp_path):
    import subprocess

    from conftest import BIN
    bad = tmp_path / "file"
    bad.write_text("x")
    p = subprocess.run([BIN, f"--socket={tmp_path / 's.sock'}", f"--state-dir={bad}"],
                       capture_output=True, timeout=30)
    assert p.returncode != 0
    assert f"state_dir {bad}" in p.stderr.decode(), p.stderr.decode()[-2000:]
    assert not (tmp_path / "s.sock").exists()


def test_several_jobs_and_other_files_are_left_alone(start_daemon, tmp_path):
    state = str(tmp_path / "state")
    d = start_daemon(f"--state-dir={state}")
    run_epochs(d, [1])
    with d.client("solo", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("a", [3], amaxd.Recipe.fp8_current())])
        c.send({"a": np.array([1, 2, 3], np.float32)})
        c.reconcile()
    d.check_clean_exit(d.stop())
    open(os.path.join(state, "README"), "w").write("operator notes")
    d2 = start_daemon(f"--state-dir={state}")
    with d2.client("solo", 0, 1) as c:
        jobs = {j.name: j for j in c.status().jobs}
        assert set(jobs) == {JOB, "solo"} and all(j.restored for j in jobs.values())
        assert c.join().rejoined
        np.testing.assert_array_equal(c.get_scales()["a"].amax, [1, 2, 3])
    assert sorted(os.listdir(state)) == sorted(["README", JOB + ".amxs", "solo.amxs"])
    assert glob.glob(os.path.join(state, "*.corrupt*")) == []
