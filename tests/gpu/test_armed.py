"""Armed epochs on a GPU (docs/API.md "Armed epochs", issue 21): the
daemon starts a rank's next epoch as it answers the last
(reconcile_device(arm=True)), and the trainer's ready flag alone starts
the merge.

- the armed path gives the packed path's bytes, epoch after epoch (3 ranks
  of the packed tests' catalog: FP8 current/delayed, NVFP4 with global
  slices, MXFP8, peer groups, cells without data), blocking and
  asynchronous; arm=False disarms, and a plain call works after;
- the asynchronous armed call returns while a ~1 s kernel queued before it
  still runs, and the stream reads the right answer after it;
- a NaN in an armed slab: INVALID_ARGUMENT naming the cell, the arming
  ends, the state is unchanged (the next plain epoch gives the reference's
  bytes);
- kill -9 of a trainer whose epoch is armed (between its syncs): the
  daemon aborts the armed epoch (a log line naming the pid), frees the
  buffers, and the job goes on with a new trainer;
- a client closed while armed: close() returns, the epoch is aborted and
  the buffers freed (CloseDevice);
- an armed job blocks nothing else: another job's first epochs (its state
  allocated meanwhile) and SIGTERM;
- one daemon for every GPU (up to 4; peer access), armed: the same bytes;
- one daemon per GPU over NCCL (every GPU, up to 4): the same bytes armed;
  a rank that leaves while armed fails the other ranks' armed syncs with
  ABORTED or UNAVAILABLE, not a hang.

Run by tests/gpu/device.sh with test_device.py.
"""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "e2e"))
sys.path.insert(0, HERE)

import amaxd  # noqa: E402
from amaxd import errors  # noqa: E402
from conftest import start_daemon  # noqa: E402,F401  (the fixture)
import test_packed as TP  # noqa: E402

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

from test_device import (ARRAYS, ENV, NGPU, async_behind_kernel, daemons_per_gpu,  # noqa: E402,F401
                         host, long_kernel_setup, packed_and_device, run_ranks)


def wait_log(d, text, timeout=20.0):
    end = time.time() + timeout
    while time.time() < end and text not in d.log():
        time.sleep(0.05)
    return text in d.log()


def armed_epochs(cp, cd, r, rng, epochs, use_async):
    """Epochs of the packed tests' contributions through the packed client
    cp and the armed device client cd; every device answer is compared
    with the packed one. The last epoch disarms. Returns the epochs."""
    L = cd.layout()
    slab = cd.device_slab()
    got = []
    # Each rank thread its own stream: ranks of one process sharing a
    # stream would queue one rank's ready flag behind another's wait for
    # the done flag (the asynchronous variant).
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for e in range(epochs):
            got.append(_armed_epoch(cp, cd, r, rng, e, epochs, use_async, slab, s))
    assert len(L.names) > 0
    return got


def _armed_epoch(cp, cd, r, rng, e, epochs, use_async, slab, s):
    vals, has = cp.layout().pack(TP.contributions(r, e, rng))
    cp.send_packed(vals, has)
    rp = cp.reconcile_packed()
    slab.copy_(torch.from_numpy(vals).cuda())
    # Armed calls keep has_data: every epoch sends the has-data bytes.
    if has is not None:
        cd._dev.has_data.copy_(torch.from_numpy(has).cuda())
    else:
        cd._dev.has_data.fill_(1)
    arm = e < epochs - 1
    was_armed = cd._armed is not None
    if use_async:
        res = cd.reconcile_device_async(has_data=True, arm=arm).result(60)
    else:
        res = cd.reconcile_device(has_data=True, arm=arm)
    s.synchronize()
    # Epoch 1 is a plain request that arms; the others were armed.
    assert was_armed == (e > 0), (r, e, was_armed)
    assert (cd._armed is not None) == arm, (r, e)
    assert res.epoch == rp.epoch == e + 1
    for k in ARRAYS:
        assert np.asarray(getattr(rp, k)).tobytes() == host(getattr(res, k)), (r, e, k)
    return res.epoch


@pytest.mark.parametrize("use_async", [False, True])
def test_armed_same_bytes_as_packed(start_daemon, use_async):
    d = start_daemon(env=ENV)
    W, epochs = TP.W, 5

    def rank(r):
        rng = np.random.default_rng(3000 + r)
        cp, cd = d.client("pk", r, W), d.client("arm", r, W)
        for c in (cp, cd):
            c.join()
            c.register(TP.catalog(r))
        got = armed_epochs(cp, cd, r, rng, epochs, use_async)
        # Disarmed: a plain call is a request again, and answers epoch 6.
        vals, has = cp.layout().pack(TP.contributions(r, epochs, rng))
        cp.send_packed(vals, has)
        rp = cp.reconcile_packed()
        cd.device_slab().copy_(torch.from_numpy(vals).cuda())
        if has is not None:
            cd._dev.has_data.copy_(torch.from_numpy(has).cuda())
        res = cd.reconcile_device(has_data=has is not None)
        torch.cuda.current_stream().synchronize()
        assert res.epoch == epochs + 1 and cd._armed is None
        assert host(res.scale) == np.asarray(rp.scale).tobytes()
        for c in (cp, cd):
            c.close()
        return got
    print(f"armed ({'async' if use_async else 'blocking'}), same bytes as packed, epochs per "
          f"rank:", run_ranks(rank, W))
    assert "aborted" not in d.log()


def test_armed_async_returns_while_the_kernel_runs(start_daemon):
    d = start_daemon(env=ENV)
    ref, c, s, slab, stacked, b, b_d, cycles, out, want = long_kernel_setup(d)
    # long_kernel_setup ran epoch 1 (plain, values a) and the reference's
    # epochs 1 (a) and 2 (b): epoch 2 here (b) arms epoch 3.
    with torch.cuda.stream(s):
        slab.copy_(b_d)
        r2 = c.reconcile_device(stream=s, arm=True)  # epoch 2 (b), arms epoch 3
    s.synchronize()
    assert r2.epoch == 2 and c._armed is not None
    assert host(r2.amax) == np.asarray(want.amax).tobytes()
    # Epoch 3 of the reference: the same values again (max stays b).
    ref.send_packed(b)
    want3 = ref.reconcile_packed()
    # The armed epoch 3, behind the kernel; arm=False disarms.
    p, t0, t1, answered_at_return, kernel_running = async_behind_kernel(c, s, slab, stacked,
                                                                        cycles, out, arm=False)
    res = p.result(timeout=60)
    t2 = time.perf_counter()
    s.synchronize()
    print(f"armed async: returned {1e3 * (t1 - t0):.2f} ms after the call began (kernel still "
          f"running: {kernel_running}, answered already: {answered_at_return}); result() "
          f"{1e3 * (t2 - t0):.0f} ms after")
    assert t1 - t0 < 0.2 and kernel_running and not answered_at_return
    assert res.epoch == 3 and c._armed is None
    for k in ARRAYS:
        assert host(out[k]) == np.asarray(getattr(want3, k)).tobytes(), k
    ref.close()
    c.close()


def test_armed_blocks_nothing_else(start_daemon):
    """While a job is armed (its trainer between steps), the daemon's
    other work goes on: a new job allocates its state and reconciles, and
    SIGTERM stops the daemon at once (the armed epoch is aborted). Nothing
    of the daemon waits on the GPU for the armed trainer: a stream blocked
    for a step would block every implicit synchronization of the daemon
    (cudaFree, cudaHostAlloc): the first design did, and this hung."""
    d = start_daemon(env=ENV)
    c = d.client("armed", 0, 1)
    c.join()
    c.register([amaxd.Quantizer("w", [1024], amaxd.Recipe.fp8_current())])
    c.device_slab().fill_(1.0)
    assert c.reconcile_device(arm=True).epoch == 1 and c._armed is not None
    t0 = time.perf_counter()
    o = d.client("other", 0, 1, timeout=30)
    o.join()
    o.register([amaxd.Quantizer(f"q{i}", [4096], amaxd.Recipe.fp8_current()) for i in range(64)])
    for e in range(3):
        o.send_packed(np.full(64 * 4096, e + 1, dtype=np.float32))
        assert o.reconcile_packed().epoch == e + 1
    dt = time.perf_counter() - t0
    o.close()
    t1 = time.perf_counter()
    d.stop()
    dt_stop = time.perf_counter() - t1
    print(f"armed job waiting: another job's first three epochs {1e3 * dt:.0f} ms; SIGTERM "
          f"stopped the daemon in {1e3 * dt_stop:.0f} ms")
    assert dt < 20 and dt_stop < 20


def test_armed_nan_fails_and_disarms(start_daemon):
    d = start_daemon(env=ENV)
    n = 64
    qs = [amaxd.Quantizer(f"q{i:02d}", [], amaxd.Recipe.fp8_current()) for i in range(n)]
    ref, c = d.client("ref", 0, 1), d.client("nan", 0, 1)
    for x in (ref, c):
        x.join()
        x.register(qs)
    slab = c.device_slab()
    a = np.arange(1, n + 1, dtype=np.float32)
    slab.copy_(torch.from_numpy(a).cuda())
    assert c.reconcile_device(arm=True).epoch == 1 and c._armed is not None
    ref.send_packed(a)
    ref.reconcile_packed()
    bad = a * 100
    bad[7] = float("nan")
    slab.copy_(torch.from_numpy(bad).cuda())
    with pytest.raises(errors.InvalidArgument, match="cell 7"):
        c.reconcile_device(arm=True)
    assert c._armed is None
    # Nothing of the bad slab was merged: epoch 2 again, plain, gives the
    # reference's bytes.
    b = a * 2
    slab.copy_(torch.from_numpy(b).cuda())
    res = c.reconcile_device()
    torch.cuda.current_stream().synchronize()
    ref.send_packed(b)
    want = ref.reconcile_packed()
    assert res.epoch == 2 == want.epoch
    for k in ARRAYS:
        assert host(getattr(res, k)) == np.asarray(getattr(want, k)).tobytes(), k
    ref.close()
    c.close()


TRAINER = textwrap.dedent("""
    import sys, torch, amaxd
    c = amaxd.Client("k9a", 0, 1, socket=sys.argv[1], timeout=60)
    c.join()
    c.register([amaxd.Quantizer("w", [1 << 20], amaxd.Recipe.fp8_current())])
    slab = c.device_slab()
    slab.fill_(2.5)
    r = c.reconcile_device(arm=True)
    torch.cuda.synchronize()
    print("armed", r.epoch, c._armed is not None, flush=True)
    sys.stdin.readline()
""")


def test_armed_trainer_killed(start_daemon):
    d = start_daemon(env=ENV)
    p = subprocess.Popen([sys.executable, "-c", TRAINER, d.socket], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().split()
        assert line == ["armed", "1", "True"], line
        pid = p.pid
        p.kill()
        p.wait()
        # The doorbell's hang-up or the reaper, whichever comes first.
        assert wait_log(d, "the armed epoch 2 waited for the ready flag of trainer rank 0"), \
            "the armed epoch was not aborted when its trainer died"
        assert wait_log(d, f"freed: its trainer (pid {pid}) exited"), "buffers not freed"
    finally:
        if p.poll() is None:
            p.kill()
    # The job goes on: a new trainer of rank 0 reconciles epoch 2 (the
    # aborted armed attempt did not count).
    c = d.client("k9a", 0, 1)
    c.join()
    c.register([amaxd.Quantizer("w", [1 << 20], amaxd.Recipe.fp8_current())])
    slab = c.device_slab()
    slab.fill_(3.0)
    r = c.reconcile_device()
    torch.cuda.current_stream().synchronize()
    assert r.epoch == 2 and float(r.amax[0].item()) == 3.0
    print("kill -9 while armed:", [ln for ln in d.log().splitlines() if "armed epoch" in ln][0])
    c.close()


def test_armed_client_closed(start_daemon):
    d = start_daemon(env=ENV)
    c = d.client("cl", 0, 1)
    c.join()
    c.register([amaxd.Quantizer("w", [16], amaxd.Recipe.fp8_current())])
    c.device_slab().fill_(1.0)
    assert c.reconcile_device(arm=True).epoch == 1
    t0 = time.perf_counter()
    c.close()
    dt = time.perf_counter() - t0
    assert wait_log(d, "its client went away (the doorbell connection closed)")
    assert wait_log(d, "freed: CloseDevice"), "the buffers were not freed"
    print(f"client closed while armed: close() took {1e3 * dt:.0f} ms")
    assert dt < 10
    c2 = d.client("cl", 0, 1)
    c2.join()
    c2.device_slab().fill_(4.0)
    r = c2.reconcile_device()
    torch.cuda.current_stream().synchronize()
    assert r.epoch == 2 and float(r.amax[0].item()) == 4.0
    c2.close()


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_armed_daemons_per_gpu_nccl(daemons_per_gpu):
    """One daemon per GPU (every GPU, up to 4) over NCCL, armed: the
    packed path's bytes on every rank; then rank 1 leaves while armed and
    every other rank's armed sync fails instead of hanging."""
    W = NGPU
    ds = daemons_per_gpu(W)

    def rank(r):
        rng = np.random.default_rng(4000 + r)
        cp, cd, _ = packed_and_device(ds[r].socket, r, W, "pka", "arm2")
        got = armed_epochs(cp, cd, r % TP.W, rng, 4, False)
        cp.close()
        cd.close()
        return got
    print(f"{W} daemons over NCCL, armed, same bytes:", run_ranks(rank, W))

    # Rank 1 leaves while armed; rank 0's armed sync fails, not hangs.
    def leave(r):
        torch.cuda.set_device(r)
        c = amaxd.Client("lv", r, W, socket=ds[r].socket, timeout=60)
        c.join()
        c.register([amaxd.Quantizer("w", [16], amaxd.Recipe.fp8_current())])
        c.open_device(r).slab.fill_(float(r + 1))
        c.reconcile_device(arm=True)
        torch.cuda.current_stream(r).synchronize()
        if r == 1:
            time.sleep(0.5)
            c.close()
            return None
        t0 = time.perf_counter()
        try:
            c.reconcile_device(arm=True)
            err = None
        except errors.AmaxdError as e:
            err = e
        dt = time.perf_counter() - t0
        c.close()
        return err, dt
    out = run_ranks(leave, W)
    for r in range(W):
        if r == 1:
            continue
        err, dt = out[r]
        print(f"rank 1 left while armed: rank {r}'s armed sync answered after {dt:.2f} s: {err}")
        # ABORTED (the abort reached this daemon first) or UNAVAILABLE (its
        # collective ended without daemon 1's part): never INTERNAL, as the
        # first 4-GPU run gave ("a daemon of another amaxd version").
        assert isinstance(err, (errors.Aborted, errors.Unavailable)) and dt < 30, (r, err, dt)


@pytest.mark.skipif(NGPU < 2, reason="needs 2 GPUs")
def test_armed_one_daemon_all_gpus(start_daemon):
    """One daemon (state on GPU 0) for a trainer on every GPU (up to 4),
    armed: the other ranks' slabs are merged by peer access after their
    flag pages passed; the same bytes as the packed path, blocking (even
    ranks) and asynchronous (odd ranks)."""
    d = start_daemon("--cuda-device=0", env=ENV)
    W = NGPU

    def rank(r):
        rng = np.random.default_rng(5000 + r)
        cp, cd, bufs = packed_and_device(d.socket, r, W, "pk1a", "arm1")
        assert bufs.slab.device.index == r
        got = armed_epochs(cp, cd, r % TP.W, rng, 4, r % 2 == 1)  # odd ranks async
        cp.close()
        cd.close()
        return got
    print(f"one daemon, {W} GPUs, armed, same bytes:", run_ranks(rank, W))
    assert "state on GPU 0" in d.log()
