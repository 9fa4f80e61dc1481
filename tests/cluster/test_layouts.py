"""The product's promise across daemons: 4 amaxd processes on loopback
(Gloo), 8 trainer processes, one synthetic MoE transformer block
(moe_block.py) calibrated for 3 epochs under three parallel layouts with the
same global data:

  (a) every rank gets bit-identical global quantities, and its own slices
      are the whole tensors cut at its placements;
  (b) the whole tensors are byte-identical across the three layouts;
  (c) they equal a single-process numpy reference (moe_block.expected).

Rank r talks to daemon r % 4: in tp1ep4dp2 daemon 3 hosts ranks 3 and 7,
whose experts never receive tokens. Every rank registers in its own
shuffled order, in one or two Register calls.
"""
import hashlib
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor

import amaxd
import moe_block as M
from conftest import COLLECTIVE, max_daemons

DAEMONS = max_daemons(4)


def daemon_of(rank):
    return rank % DAEMONS


def run_layout(cluster, layout, job, order_seed):
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=M.WORLD, mp_context=ctx) as ex:
        futs = [ex.submit(M.run_rank, cluster.socket(daemon_of(r)), job, layout, r, order_seed)
                for r in range(M.WORLD)]
        return [f.result(timeout=300) for f in futs]


def test_three_layouts_same_bytes_as_numpy(make_cluster):
    c = make_cluster(DAEMONS, "--log-level=info")
    assert M.ranks_without_expert_tokens("tp1ep4dp2") == [3, 7]
    per_layout = {}
    for i, layout in enumerate(M.LAYOUTS):
        out = run_layout(c, layout, f"moe-{layout}", order_seed=11 + i)
        for r in range(M.WORLD):
            M.check_rank_results(layout, r, out[r]["epochs"])            # (a), (c)
            M.check_whole(out[r]["whole"], f"{layout} rank {r} whole")   # (c)
        wholes = {M.whole_bytes(o) for o in out}
        assert len(wholes) == 1, f"{layout}: ranks disagree on the whole tensors"  # (a)
        per_layout[layout] = wholes.pop()
        # Steady state on every daemon: the last epoch took one collective,
        # and all four daemons took part.
        for d in range(DAEMONS):
            with amaxd.Client(f"moe-{layout}", 0, M.WORLD, socket=c.socket(d)) as cl:
                st = cl.status(f"moe-{layout}").jobs[0]
            assert st.participants == DAEMONS and st.local_ranks == M.WORLD // DAEMONS, st
            assert st.reconciled_epochs == M.epochs and st.last_collectives == 1, st
            assert st.collective == COLLECTIVE
    assert len(set(per_layout.values())) == 1, "the layouts gave different bytes"      # (b)
    # The digest of the whole tensors: the same on every backend and
    # collective (tests/gpu/cluster.sh prints it next to a CPU run's).
    digest = hashlib.sha256(per_layout["tp4ep1dp2"]).hexdigest()
    print(f"\nwhole-tensor digest ({COLLECTIVE}, {DAEMONS} daemons): {digest}")
    if os.environ.get("AMAXD_DIGEST_FILE"):
        with open(os.environ["AMAXD_DIGEST_FILE"], "a") as f:
            f.write(f"{COLLECTIVE} {DAEMONS} {digest}\n")
