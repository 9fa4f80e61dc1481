"""100k small updates streamed on one call: none may be lost.

Each update goes to its own scalar quantizer with a distinct value, so a lost
(or duplicated into the wrong place) update shows as a wrong or missing cell.
"""
import numpy as np

import amaxd
from amaxd import pb

N = 100_000


def test_stream_100k_updates_none_lost(daemon):
    names = [f"q{i:06d}" for i in range(N)]
    vals = (np.arange(N, dtype=np.float32) + 1) * np.float32(0.5)
    with daemon.client("stream", 0, 1, timeout=300) as c:
        c.join()
        r = c.register(amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current()) for n in names)
        assert r.created == N and r.catalog_size == N
        resp = c.stream({n: v} for n, v in zip(names, vals))
        assert resp.accepted == N
        assert c.status("stream").jobs[0].updates == N
        res = c.reconcile()
    assert len(res) == N
    got = np.array([res[n].amax[()] for n in names], dtype=np.float32)
    np.testing.assert_array_equal(got, vals)
    assert sum(r.missing for r in res.values()) == 0
