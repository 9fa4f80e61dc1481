"""Where a rank's block of a quantizer's global amax tensor lies, for the
usual Megatron layouts. Every helper returns a Placement(offset, local_shape)."""
from dataclasses import dataclass
from typing import Sequence, Tuple


@dataclass(frozen=True)
class Placement:
    offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]


def _shape(global_shape):
    shape = tuple(int(d) for d in global_shape)
    if any(d <= 0 for d in shape):
        raise ValueError(f"global shape {shape} has a non-positive dimension")
    return shape


def replicated(global_shape: Sequence[int]) -> Placement:
    """Every rank contributes the whole tensor; contributions are max-merged
    (per-tensor amax, or a per-channel amax that TP does not split)."""
    shape = _shape(global_shape)
    return Placement((0,) * len(shape), shape)


def shard(global_shape: Sequence[int], dim: int, rank: int, size: int) -> Placement:
    """Rank `rank` of `size` holds an equal slice of dimension `dim`."""
    shape = _shape(global_shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"dimension {dim} does not exist in shape {shape}")
    if size <= 0 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in [0, {size})")
    if shape[dim] % size:
        raise ValueError(f"dimension {dim} of {shape} ({shape[dim]}) is not divisible by {size}")
    local = shape[dim] // size
    offset = [0] * len(shape)
    offset[dim] = rank * local
    lshape = list(shape)
    lshape[dim] = local
    return Placement(tuple(offset), tuple(lshape))


def column_parallel(global_shape: Sequence[int], tp_rank: int, tp_size: int) -> Placement:
    """Weight amax of a column-parallel linear ([C_out] per-channel or
    [C_out, C_in/16] per-block): output channels (dim 0) are split over TP."""
    return shard(global_shape, 0, tp_rank, tp_size)


def row_parallel(global_shape: Sequence[int], tp_rank: int, tp_size: int) -> Placement:
    """Weight amax of a row-parallel linear: the input dimension is split over
    TP. A per-channel [C_out] amax is then seen partially by every rank
    (replicated, max-merged); a per-block [C_out, C_in/16] amax is split
    along its block columns (dim 1)."""
    shape = _shape(global_shape)
    if len(shape) <= 1:
        return replicated(shape)
    return shard(shape, 1, tp_rank, tp_size)


def per_expert(num_experts: int, ep_rank: int, ep_size: int) -> Placement:
    """A per-expert [E] amax: EP rank r holds experts [r*E/ep, (r+1)*E/ep)."""
    return shard((num_experts,), 0, ep_rank, ep_size)
