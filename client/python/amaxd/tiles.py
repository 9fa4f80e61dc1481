"""Tile amax of a 2-D weight whose flattened elements are split over ranks
by contiguous ranges (ZeRO / distributed-optimizer sharding of master
weights, as TransformerEngine's quantize_master_weights takes them).

A weight [R, C] is cut into tiles of `tile` = (th, tw) elements (128x128
FP8 blocks, 16x16 NVFP4 2D tiles, 1x32 / 32x1 MXFP8 blocks, ...): its tile
grid is [ceil(R/th), ceil(C/tw)], one amax per tile. Rank k holds the flat
elements [start, start + n) of the row-major weight; the ranges do not
follow tile boundaries, so a tile may be cut between two ranks (or more,
when a range is shorter than a tile).

What a rank contributes (flat_range_block): the tiles its range touches,
as one rectangular block of the tile grid (the bounding box of those tiles:
a Placement the daemon accepts as it is) and a mask over that block, True
where the rank touched the tile. Each touched tile's value is the max of
|x| over the rank's elements in it; the other cells of the block are sent
as "no data" (has_data = 0, amaxd.Masked). The daemon max-merges
contributions, so every tile reconciles to the max over the ranks that
touched it = the max over all its elements, for any number of ranks and
any offsets; a tile nobody touched reads 0, as TE's zero-initialised
partial-amax buffer does. A rank whose range is empty touches nothing
(flat_range_block returns None): it contributes nothing and still enters
every epoch.

The touched tiles of a range form at most three bands: a partial first
tile row, full tile rows, a partial last tile row. Only the first and last
tile rows of the block can hold untouched cells; a block that spans more
than one tile row is as wide as the grid.
"""
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from .placement import Placement

__all__ = ["TileBlock", "tile_grid", "flat_range_block", "whole_mask", "partial_tile_amax"]


@dataclass(frozen=True)
class TileBlock:
    """A rank's block of the tile grid: where it lies and which of its cells
    the rank touched (mask, bool, shaped like the block)."""

    placement: Placement
    mask: np.ndarray

    @property
    def offset(self) -> Tuple[int, int]:
        return self.placement.offset

    @property
    def shape(self) -> Tuple[int, int]:
        return self.placement.local_shape


def tile_grid(rows: int, cols: int, tile: Tuple[int, int]) -> Tuple[int, int]:
    """The tile grid [ceil(rows/th), ceil(cols/tw)] of a [rows, cols] weight."""
    th, tw = (int(t) for t in tile)
    rows, cols = int(rows), int(cols)
    if rows <= 0 or cols <= 0 or th <= 0 or tw <= 0:
        raise ValueError(f"weight [{rows}, {cols}] and tile {tuple(tile)} must be positive")
    return -(-rows // th), -(-cols // tw)


def _check(rows, cols, start, n):
    start, n = int(start), int(n)
    if start < 0 or n < 0 or start + n > rows * cols:
        raise ValueError(f"flat range [{start}, {start + n}) does not lie in a [{rows}, {cols}] "
                         f"weight of {rows * cols} elements")
    return start, n


def _row_spans(r, r0, c0, r1, c1, cols):
    """Columns [lo, hi] of element row r that the range [r0:c0 .. r1:c1] covers."""
    return (c0 if r == r0 else 0), (c1 if r == r1 else cols - 1)


def _tile_row_cols(tr, th, tw, r0, c0, r1, c1, cols):
    """The tile columns that tile row `tr` has touched, as intervals."""
    a, b = max(r0, tr * th), min(r1, tr * th + th - 1)
    if a == b:
        lo, hi = _row_spans(a, r0, c0, r1, c1, cols)
        return [(lo // tw, hi // tw)]
    if b - a >= 2:
        return [(0, (cols - 1) // tw)]
    # Two element rows: [lo(a), C-1] and [0, hi(b)].
    lo, _ = _row_spans(a, r0, c0, r1, c1, cols)
    _, hi = _row_spans(b, r0, c0, r1, c1, cols)
    if hi + 1 >= lo:
        return [(0, (cols - 1) // tw)]
    return [(0, hi // tw), (lo // tw, (cols - 1) // tw)]


def flat_range_block(rows: int, cols: int, tile: Tuple[int, int], start: int,
                     n: int) -> Optional[TileBlock]:
    """The block of the tile grid that the flat range [start, start + n) of a
    row-major [rows, cols] weight touches, with its mask; None when n is 0."""
    rows, cols = int(rows), int(cols)
    tr_all, tc_all = tile_grid(rows, cols, tile)
    th, tw = int(tile[0]), int(tile[1])
    start, n = _check(rows, cols, start, n)
    if n == 0:
        return None
    r0, c0 = divmod(start, cols)
    r1, c1 = divmod(start + n - 1, cols)
    tr0, tr1 = r0 // th, r1 // th
    first = _tile_row_cols(tr0, th, tw, r0, c0, r1, c1, cols)
    last = first if tr1 == tr0 else _tile_row_cols(tr1, th, tw, r0, c0, r1, c1, cols)
    if tr1 == tr0:
        j0, j1 = min(i[0] for i in first), max(i[1] for i in first)
    else:
        j0, j1 = 0, tc_all - 1
    mask = np.zeros((tr1 - tr0 + 1, j1 - j0 + 1), dtype=np.bool_)
    mask[1:-1, :] = True
    for row, spans in ((0, first), (mask.shape[0] - 1, last)):
        for a, b in spans:
            mask[row, a - j0:b - j0 + 1] = True
    return TileBlock(Placement((tr0, j0), (tr1 - tr0 + 1, j1 - j0 + 1)), mask)


def whole_mask(block: Optional[TileBlock], shape: Tuple[int, int]) -> np.ndarray:
    """The block's mask embedded in a tensor of `shape` (the tile grid, or a
    padded one that contains it): True only at the cells the rank touched."""
    m = np.zeros(tuple(int(d) for d in shape), dtype=np.bool_)
    if block is not None:
        (i, j), (h, w) = block.offset, block.shape
        m[i:i + h, j:j + w] = block.mask
    return m


def partial_tile_amax(shard: Any, rows: int, cols: int, tile: Tuple[int, int],
                      start: int) -> Optional[Tuple[TileBlock, np.ndarray]]:
    """numpy: this rank's (block, values) for the flat elements `shard`
    starting at `start`: values[i, j] = max |x| over the shard's elements
    in that tile, 0 where the mask is False. NaN elements are skipped, as
    TE's partial-amax kernels (fmaxf) skip them. None for an empty shard."""
    x = np.asarray(shard).reshape(-1)
    block = flat_range_block(rows, cols, tile, start, x.size)
    if block is None:
        return None
    th, tw = int(tile[0]), int(tile[1])
    (i0, j0), (h, w) = block.offset, block.shape
    r0 = i0 * th
    # The shard in its element rows, padded to whole tiles of the block.
    buf = np.zeros((h * th, max(cols, (j0 + w) * tw)), dtype=np.float32)
    flat = buf[:, :cols].copy().reshape(-1)
    a = start - r0 * cols
    flat[a:a + x.size] = np.abs(x.astype(np.float32))
    buf[:, :cols] = flat.reshape(h * th, cols)
    buf = np.nan_to_num(buf, nan=0.0, posinf=np.inf)
    vals = buf[:, j0 * tw:(j0 + w) * tw].reshape(h, th, w, tw).max(axis=(1, 3))
    return block, np.where(block.mask, vals, np.float32(0)).astype(np.float32)
