"""Where one packed epoch of the 1e7-cell case goes, end to end.

    AMAXD_BIN=build/amaxd .venv/bin/python bench/epoch_breakdown.py
    SHM=1 ...   the same through the daemon's shared-memory buffers

W=8 ranks (one process each) of bench/datapath.py's "1e7 cells" catalog;
each rank times its encode, its SendPacked call, its ReconcilePacked call
and the decode of the answer; rank 0 reads the engine's finish time from
Status. Medians over the epochs after the first two.
"""
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np
import datapath as D

def rank(conn, sock, W, r, case, epochs):
    import amaxd
    from amaxd.packed import encode_send_packed, PackedResult
    shm = os.environ.get("SHM") == "1"
    with amaxd.Client("b", r, W, socket=sock, timeout=600, shm=shm) as c:
        c.join(); c.register(D.catalog(case, W, r)); L = c.layout()
        rng = np.random.default_rng(r); rows = []
        conn.send("ready")
        for e in range(epochs):
            slab = rng.random(L.total_cells, dtype=np.float32)
            conn.recv()
            t0 = time.perf_counter()
            data = c._packed_req(slab, None, None)
            t1 = time.perf_counter()
            c._raw("SendPacked", data, None)
            t2 = time.perf_counter()
            from amaxd import pb
            req = pb.ReconcilePackedRequest(job="b", rank=r, epoch=c.epoch, layout_id=L.id,
                                            shm_id=c._shm[1] if shm else 0).SerializeToString()
            raw = c._raw("ReconcilePacked", req, None)
            t3 = time.perf_counter()
            if shm:
                from amaxd.client import _pread_all
                raw = _pread_all(c._shm[3], pb.ReconcilePackedResponse.FromString(raw).shm_bytes,
                                 0)
            res = PackedResult(raw, L); c.epoch = res.next_epoch
            t4 = time.perf_counter()
            st = c.status("b").jobs[0] if r == 0 else None
            conn.send((t0, t1, t2, t3, t4, st.last_finish_us if st else 0, st.last_epoch_us if st else 0,
                       (st.last_epoch_ended_us - st.last_epoch_started_us) if st else 0))
        conn.recv()

if __name__ == "__main__":
    W, epochs = 8, 12
    case = {"kind": "channel", "nq": 1000, "qcells": 10_000}
    sock = os.path.join(tempfile.mkdtemp(prefix="amaxd-breakdown-"), "b.sock")
    if os.path.exists(sock): os.unlink(sock)
    d = D.start_daemon(sock, *os.environ.get("EXTRA", "").split())
    ctx = mp.get_context("spawn"); pipes = []; procs = []
    for r in range(W):
        a, b = ctx.Pipe(); p = ctx.Process(target=rank, args=(b, sock, W, r, case, epochs)); p.start(); pipes.append(a); procs.append(p)
    for a in pipes: assert a.recv() == "ready"
    res = []
    for e in range(epochs):
        time.sleep(0.3)
        for a in pipes: a.send("go")
        res.append([a.recv() for a in pipes])
    for a in pipes: a.send("stop")
    for p in procs: p.join()
    d.terminate(); d.wait()
    S = res[2:]
    med = lambda xs: statistics.median(xs) * 1000
    t0 = [min(x[0] for x in ep) for ep in S]
    print("epoch wall (first encode -> last decode) ms: %.1f" % med([max(x[4] for x in ep) - min(x[0] for x in ep) for ep in S]))
    print("client encode per rank ms: %.1f" % med([x[1]-x[0] for ep in S for x in ep]))
    print("SendPacked call per rank ms: %.1f" % med([x[2]-x[1] for ep in S for x in ep]))
    print("last send done after start ms: %.1f" % med([max(x[2] for x in ep) - min(x[0] for x in ep) for ep in S]))
    print("ReconcilePacked call (last rank's send done -> each answer) ms: %.1f" % med([x[3]-max(y[2] for y in ep) for ep in S for x in ep]))
    print("first answer / last answer after last send ms: %.1f / %.1f" % (med([min(x[3] for x in ep)-max(y[2] for y in ep) for ep in S]), med([max(x[3] for x in ep)-max(y[2] for y in ep) for ep in S])))
    print("client decode per rank ms: %.2f" % med([x[4]-x[3] for ep in S for x in ep]))
    print("daemon finish ms (Status last_finish_us): %.1f, engine epoch ms: %.1f" % (statistics.median([ep[0][5] for ep in S]) / 1000, statistics.median([ep[0][6] for ep in S]) / 1000))
