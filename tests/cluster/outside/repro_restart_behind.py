"""Repro: kill -9 the coordinator (daemon A, cluster rank 0) right after an
epoch's collective, before A has written its snapshot / answered its ranks.
Counts the trials where A's trainers re-join at an older open epoch than
B's, and what the next epoch then contains."""
import os, sys, time, random, tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import busy_poll_check as C

def trial_series(root, busy, ntrials):
    W = 4
    (pa, pb), common = C.cluster_flags(root, busy, 4000)
    A = C.Daemon(root, "A", common + ["--cluster-rank=0", f"--peer-listen=127.0.0.1:{pa}",
                 f"--peer-advertise=127.0.0.1:{pa}", f"--state-dir={root}/A/state"]).start()
    B = C.Daemon(root, "B", common + ["--cluster-rank=1", f"--peer-listen=127.0.0.1:{pb}",
                 f"--peer-advertise=127.0.0.1:{pb}", f"--state-dir={root}/B/state"]).start()
    run = C.JobRun(root, "cl", W, [A.sock, A.sock, B.sock, B.sock])
    run.setup()
    C.run_steps_checked(run, 1, 3, "warm")
    step = 4
    hits = []
    for t in range(ntrials):
        for w in run.workers:
            w.start("step", step=step)
        d = random.uniform(0.003, 0.012)
        time.sleep(d)
        A.kill9()
        rr = [w.wait(15) for w in run.workers]
        A.start()
        for i, w in enumerate(run.workers):
            w.start("recover", sock=run.socks[i] if i < 2 else None, deadline=40.0,
                    join_timeout=13.0, rec_timeout=None)
        rec = [w.wait(55) for w in run.workers]
        if not all(r["ok"] for r in rec):
            print("recover failed", [C.brief(r) for r in rec]); break
        joins = [r["join"]["epoch"] for r in rec]
        answer_epochs = [r["epoch"] for r in rec]      # rank 0 (named) reports the request's epoch
        killed = ["ok" if r["ok"] else r["code"] for r in rr]
        if len(set(joins)) > 1:
            hits.append((t, d, killed, joins, answer_epochs))
            print(f"[{busy}] trial {t}: kill {d*1e3:.1f} ms into step {step}: step results {killed}; "
                  f"re-join open epochs {joins}; answers' epochs {answer_epochs}", flush=True)
        step = max(answer_epochs) + 1
        # resync: everyone to the same step via one normal epoch
        ss, r2 = run.run_step(step)
        if r2 is None or not all(x["ok"] for x in r2):
            print("follow-up step failed", [C.brief(x) for x in (r2 or ss)]); break
        step += 1
    run.close(); A.stop(); B.stop()
    return hits

try:
    for busy in ("off", "on"):
        root = tempfile.mkdtemp(dir=tempfile.gettempdir(), prefix=f"repro-{busy}-")
        hits = trial_series(root, busy, int(sys.argv[1]) if len(sys.argv) > 1 else 15)
        print(f"busy_poll={busy}: {len(hits)} trials where ranks re-joined at different open epochs; logs {root}", flush=True)
finally:
    C.cleanup()
