"""Partial tiles of flat-sharded weights (issue 22, item 2): amaxd.tiles
computes the block of the tile grid a rank's flat range touches and its
mask; through the daemon the reconciled tile amax is the max over the
ranks that touched the tile, for any data-parallel degree and offsets,
empty ranges included, and equals what TE's partial-amax kernels plus
all_reduce(MAX) give (te_reference.py)."""
import threading

import numpy as np
import pytest

import amaxd
import reference as ref
import te_reference as ter
from amaxd import tiles

TILES = [(16, 16), (128, 128), (1, 32), (32, 1), (1, 128), (7, 5), (3, 1000)]


def touched(rows, cols, tile, start, n):
    """Brute force: the set of tiles the flat range touches."""
    idx = np.arange(start, start + n)
    return set(zip((idx // cols // tile[0]).tolist(), (idx % cols // tile[1]).tolist()))


def cuts(rng, numel, dp):
    """Random sorted cut points: ranges of any length, empty ones included."""
    c = np.sort(rng.integers(0, numel + 1, dp - 1))
    if dp > 2 and rng.random() < 0.5:
        c[rng.integers(0, dp - 1)] = c[0]  # repeated cut: an empty range
        c = np.sort(c)
    b = np.concatenate([[0], c, [numel]])
    out = [(int(b[k]), int(b[k + 1] - b[k])) for k in range(dp)]
    assert all(n >= 0 for _, n in out) and sum(n for _, n in out) == numel
    return out


def test_block_is_the_bounding_box_of_touched_tiles():
    rng = np.random.default_rng(1)
    for _ in range(3000):
        tile = TILES[rng.integers(len(TILES))]
        rows, cols = int(rng.integers(1, 300)), int(rng.integers(1, 300))
        n = int(rng.integers(0, rows * cols + 1)) if rng.random() < 0.5 else int(rng.integers(0, 3 * cols))
        n = min(n, rows * cols)
        start = int(rng.integers(0, rows * cols - n + 1))
        b = tiles.flat_range_block(rows, cols, tile, start, n)
        want = touched(rows, cols, tile, start, n)
        if n == 0:
            assert b is None
            continue
        (i, j), (h, w) = b.offset, b.shape
        tr, tc = tiles.tile_grid(rows, cols, tile)
        assert 0 <= i and i + h <= tr and 0 <= j and j + w <= tc
        got = {(i + a, j + c) for a, c in zip(*np.nonzero(b.mask))}
        assert got == want, (rows, cols, tile, start, n)
        # A bounding box: its first and last rows and columns hold touched tiles.
        assert b.mask[0].any() and b.mask[-1].any() and b.mask[:, 0].any() and b.mask[:, -1].any()
        # Only the first and last block rows can hold untouched tiles.
        assert b.mask[1:-1].all()


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError):
        tiles.flat_range_block(4, 4, (2, 2), 10, 7)
    with pytest.raises(ValueError):
        tiles.flat_range_block(4, 4, (2, 2), -1, 1)
    with pytest.raises(ValueError):
        tiles.tile_grid(0, 4, (2, 2))


def test_partial_amax_is_te_partial_amax():
    """A rank's block values, embedded in the tile grid, are TE's per-rank
    partial-amax buffer (fp8_block_scaling / nvfp4_2d / mxfp8 kernels),
    zero, subnormal, huge and NaN elements included."""
    rng = np.random.default_rng(2)
    for it in range(60):
        rows, cols = int(rng.integers(1, 260)), int(rng.integers(1, 300))
        x = (rng.standard_normal(rows * cols) * np.exp(rng.uniform(-30, 30))).astype(np.float32)
        x[rng.random(x.size) < 0.05] = 0
        x[rng.random(x.size) < 0.01] = 1e-45
        x[rng.random(x.size) < 0.01] = -3e38
        x[rng.random(x.size) < 0.01] = np.nan
        for start, n in cuts(rng, rows * cols, int(rng.integers(1, 9))):
            shard = x[start:start + n]
            part = tiles.partial_tile_amax(shard, rows, cols, (16, 16), start)
            te = ter.nvfp4_partial_amax(shard, rows, cols, start)[0]
            got = np.zeros_like(te)
            if part is not None:
                (i, j), (h, w) = part[0].offset, part[0].shape
                got[i:i + h, j:j + w] = part[1]
            assert got.tobytes() == te.tobytes(), (it, rows, cols, start, n)
            part = tiles.partial_tile_amax(shard, rows, cols, (128, 128), start)
            te = ter.fp8_block_partial_amax(shard, rows, cols, start)
            got = np.zeros_like(te)
            if part is not None:
                (i, j), (h, w) = part[0].offset, part[0].shape
                got[i:i + h, j:j + w] = part[1]
            assert got.tobytes() == te.tobytes(), (it, rows, cols, start, n)


def _rank_threads(world, fn):
    errors, out = [], [None] * world

    def run(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    assert not errors, errors
    return out


@pytest.mark.parametrize("dp", range(1, 9))
def test_reconciled_tiles_are_te_all_reduce(daemon, dp):
    """DP ranks (threads), each its own client: random weights (shapes not
    multiples of the tile), random flat ranges (empty ones included), zero,
    subnormal and huge values. Each weight twice: placed as the rank's
    touched block (empty rank: not placed), and placed whole with the block
    embedded in a whole-tensor mask (empty rank: all cells without data).
    Every rank reads the whole tile grid: byte for byte TE's all-reduced
    buffer, and scales = TE's compute_scale_from_amax on it; nobody waits
    for an empty rank."""
    rng = np.random.default_rng(100 + dp)
    weights = []
    for q in range(6):
        tile = TILES[(q + dp) % len(TILES)]
        rows, cols = int(rng.integers(1, 400)), int(rng.integers(1, 400))
        x = (rng.standard_normal(rows * cols) * np.exp(rng.uniform(-20, 20))).astype(np.float32)
        x[rng.random(x.size) < 0.1] = 0
        x[rng.random(x.size) < 0.01] = 1e-45
        if q == 0:
            x[:] = 0  # an all-zero weight
        if q == 1:
            x[rng.integers(x.size)] = 3.4e38
        ranges = cuts(rng, rows * cols, dp)
        if q == 2 and dp > 1:
            ranges = [(0, rows * cols)] + [(rows * cols, 0)] * (dp - 1)  # one rank holds it all
        grid = tiles.tile_grid(rows, cols, tile)
        parts = [tiles.partial_tile_amax(x[s:s + n], rows, cols, tile, s) for s, n in ranges]
        full = np.zeros(grid, np.float32)
        for p in parts:  # TE: zero buffer per rank, all_reduce(MAX)
            if p is not None:
                buf = np.zeros(grid, np.float32)
                (i, j), (h, w) = p[0].offset, p[0].shape
                buf[i:i + h, j:j + w] = p[1]
                full = np.fmax(full, buf)
        # The single-process answer: each tile's max |x| over all its elements.
        padded = np.zeros((grid[0] * tile[0], grid[1] * tile[1]), np.float32)
        padded[:rows, :cols] = np.abs(x).reshape(rows, cols)
        one = padded.reshape(grid[0], tile[0], grid[1], tile[1]).max(axis=(1, 3))
        assert full.tobytes() == one.tobytes()
        weights.append((f"w{q}", grid, parts, one))
    recipe = amaxd.Recipe.fp8_block(power_of_2=False)

    def rank(r):
        with daemon.client(f"tiles{dp}", r, dp) as c:
            c.join()
            qs, send = [], {}
            for name, grid, parts, _ in weights:
                p = parts[r]
                if p is not None:
                    qs.append(amaxd.Quantizer(name + ".block", grid, recipe, p[0].placement))
                    send[name + ".block"] = amaxd.Masked(p[1], ~p[0].mask)
                qs.append(amaxd.Quantizer(name + ".whole", grid, recipe))
                vals = np.zeros(grid, np.float32)
                if p is not None:
                    (i, j), (h, w) = p[0].offset, p[0].shape
                    vals[i:i + h, j:j + w] = p[1]
                send[name + ".whole"] = amaxd.Masked(
                    vals, ~tiles.whole_mask(None if p is None else p[0], grid))
            c.register(qs)
            for _ in range(2):  # the same contributions twice: running max, same bytes
                c.send(send)
                c.reconcile()
            return c.get_scales(whole=True)

    got = _rank_threads(dp, rank)
    for name, grid, parts, one in weights:
        s, si = ter.fp8_scale_and_inv(one, 448.0, False, 0.0)
        for r in range(dp):
            for mode in (".block", ".whole"):
                res = got[r][name + mode]
                assert res.amax.tobytes() == one.tobytes(), (name, mode, r)
                assert res.missing == 0
                assert res.scale.tobytes() == s.tobytes() and res.scale_inv.tobytes() == si.tobytes()
                assert np.float32(res.global_amax) == one.max()


def test_rank_without_any_placement_blocks_nobody(daemon):
    """A tiny weight over 8 ranks: ranks 3..7 hold nothing, place nothing,
    send nothing and only enter every epoch; packed and named answers."""
    rows, cols, tile = 3, 5, (2, 2)
    x = np.arange(1, 16, dtype=np.float32) * np.float32(1e-40)
    ranges = [(0, 4), (4, 9), (13, 2)] + [(15, 0)] * 5
    grid = tiles.tile_grid(rows, cols, tile)
    want = np.zeros(grid, np.float32)
    for s, n in ranges:
        p = tiles.partial_tile_amax(x[s:s + n], rows, cols, tile, s)
        if p is not None:
            (i, j), (h, w) = p[0].offset, p[0].shape
            want[i:i + h, j:j + w] = np.fmax(want[i:i + h, j:j + w], p[1])

    def rank(r):
        s, n = ranges[r]
        p = tiles.partial_tile_amax(x[s:s + n], rows, cols, tile, s)
        with daemon.client("tiny", r, 8) as c:
            c.join()
            if p is not None:
                c.register([amaxd.Quantizer("w", grid, amaxd.Recipe.nvfp4("te_partial_cast"),
                                            p[0].placement)])
            for _ in range(3):
                L = c.layout(refresh=True)
                if p is not None:
                    c.send_packed(*L.pack({"w": amaxd.Masked(p[1], ~p[0].mask)}))
                c.reconcile_packed()
            return c.get_scales(["w"], whole=True)["w"]

    got = _rank_threads(8, rank)
    s, si, b, gs, gsi = ref.scales("nvfp4", want, want.max(), nvfp4="te_partial_cast")
    for r in range(8):
        assert got[r].amax.tobytes() == want.tobytes()
        assert got[r].block_scales.tobytes() == b.tobytes()
        assert got[r].scale.tobytes() == s.tobytes()
        assert np.float32(got[r].global_scale) == gs
