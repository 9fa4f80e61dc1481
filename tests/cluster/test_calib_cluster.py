"""Calibrators beyond max across daemons (issue 23): the workload of
tests/e2e/calib_workload.py (histogram quantizers of every method, MSE
searches per channel and per tensor) over 4 daemons, its ranks spread
over them (rank r on daemon r % 4), gives the bytes of one daemon and one
rank: the statistics are summed by the SUM collective beside the MAX one
(Gloo here; NCCL on GPUs, tests/gpu/calib_nccl.sh)."""
import amaxd
import calib_workload as W
from conftest import max_daemons

DAEMONS = max_daemons(4)


def test_four_daemons_same_bytes_as_one(make_cluster):
    one = W.run_layout([make_cluster(1).socket(0)], "calib-one", "single")
    ref = W.whole_bytes(one[0])
    c = make_cluster(DAEMONS, "--log-level=info")
    socks = [c.socket(i) for i in range(DAEMONS)]
    for layout in ("tp2ep2dp2", "dp8", "tp4"):
        out = W.run_layout(socks, f"calib-{layout}", layout)
        for r, res in enumerate(out):
            assert W.whole_bytes(res) == ref, f"{layout}: rank {r} (daemon {r % DAEMONS})"
    out = W.run_layout(socks, "calib-row", "tp4", row_parallel=True)
    for r, res in enumerate(out):
        assert W.whole_bytes(res) == ref, f"row-parallel rank {r}"
    # Both collectives ran where statistics were reduced: the last epoch of
    # a job with an agreed basis took the MAX and the SUM.
    for d in range(DAEMONS):
        with amaxd.Client("calib-dp8", 0, 8, socket=c.socket(d)) as cl:
            st = cl.status("calib-dp8").jobs[0]
        assert st.participants == DAEMONS and st.last_collectives == 2, st
