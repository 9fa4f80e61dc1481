"""Repro: a trainer re-joins while its daemon's epoch is in flight (every
local rank entered Reconcile; the daemon waits for another daemon's late
rank). Join answers epoch E (the one in flight) but SendAmax(E) is refused:
'already reconciled or being reconciled; the open epoch is E+1'."""
import os, sys, time, tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import busy_poll_check as C
busy = sys.argv[1] if len(sys.argv) > 1 else "on"
root = tempfile.mkdtemp(dir=tempfile.gettempdir(), prefix=f"joininflight-{busy}-")
try:
    (pa, pb), common = C.cluster_flags(root, busy, 6000)
    A = C.Daemon(root, "A", common + ["--cluster-rank=0", f"--peer-listen=127.0.0.1:{pa}", f"--peer-advertise=127.0.0.1:{pa}"]).start()
    B = C.Daemon(root, "B", common + ["--cluster-rank=1", f"--peer-listen=127.0.0.1:{pb}", f"--peer-advertise=127.0.0.1:{pb}"]).start()
    run = C.JobRun(root, "j", 4, [A.sock, A.sock, B.sock, B.sock])
    run.setup()
    C.run_steps_checked(run, 1, 2, "warm")
    C.all_call(run.workers, "send", 10, step=3)
    for w in run.workers[:3]:
        w.start("reconcile")                 # A's ranks 0,1 in: A's epoch 3 in flight, waiting for B's rank 3
    time.sleep(0.5)
    st = A.status("j").jobs[0]
    print(f"A: epoch {st.epoch} in_flight {st.in_flight} ranks_in_reconcile {st.ranks_in_reconcile}")
    run.workers[1].kill9()                   # rank 1's trainer dies while waiting
    time.sleep(0.3)
    w1 = C.Worker(root, "j", 1, 4, A.sock)   # a fresh trainer for rank 1
    j = w1.call("join", 15, timeout=10.0)
    print("fresh rank 1 Join:", j)
    s = w1.call("send", 10, step=3)
    print("its SendAmax for the epoch Join named:", C.brief(s))
    st = A.status("j").jobs[0]
    print(f"A now: epoch {st.epoch} in_flight {st.in_flight}")
    w1.start("reconcile", timeout=10.0)      # Reconcile of the epoch Join named, without a send
    time.sleep(0.3)
    run.workers[3].start("reconcile")
    r1 = w1.wait(15)
    print("fresh rank 1 Reconcile(epoch Join named):", C.brief(r1), "epoch", r1.get("epoch"), "->", r1.get("next_epoch"))
    for i in (0, 2, 3):
        print(f"rank {i} reconcile:", C.brief(run.workers[i].wait(15)))
    run.close(); w1.close(); A.stop(); B.stop()
finally:
    C.cleanup()
