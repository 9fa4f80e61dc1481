"""TransformerEngine's cast of data-parallel-sharded master weights, in
numpy: the partial amaxes each rank computes, the all-reduce(MAX) over the
data-parallel group, and the scales and scale_inv buffers TE then stores on
the model weights. Transcribed from TE main d0067d0da6cb (2026-08-22,
build_tools/VERSION.txt 2.20.0.dev0), file and function named at each
function; independent of amaxd (the scale formulas come from reference.py).

Each rank holds the flat elements [start, start + len(shard)) of a
row-major [h, w] model weight; `shard` is its master weight already cast to
the model weight's dtype (quantize_master_weights: `master_weight =
master_weight.to(model_weight.dtype)`), given here as float32 values.
"""
import numpy as np

import reference as ref

F32 = np.float32
FLT_MAX = np.finfo(np.float32).max


def round_up(x, m):
    return -(-int(x) // m) * m


def _abs_at(shard, start, w):
    """Element rows, columns and |x| of the shard (fabs(static_cast<float>(x)))."""
    x = np.abs(np.asarray(shard, dtype=np.float32).reshape(-1))
    idx = np.arange(start, start + x.size, dtype=np.int64)
    return idx // w, idx % w, x


def _fmax_into(amax, cells, vals):
    """amax[cell] = fmaxf(amax[cell], v) for every element: fmaxf keeps the
    non-NaN operand, so NaN elements leave the amax alone (and an amax
    starts at 0.0f)."""
    np.fmax.at(amax.reshape(-1), cells, vals)


def fp8_block_scale_shape(h, w, block_len=128):
    """pytorch/tensor/float8_blockwise_tensor.py Float8BlockQuantizer
    .get_scale_shape(shape, columnwise=False), block_scaling_dim 2:
    (ceil(h/128), round_up(ceil(w/128), 4))."""
    return -(-h // block_len), round_up(-(-w // block_len), 4)


def fp8_block_partial_amax(shard, h, w, start, block_len=128):
    """utils.py _cast_master_weights_to_fp8_blockwise_scaling: a zero
    buffer of get_scale_shape, then common/recipe/fp8_block_scaling.cu
    fp8_block_scaling_compute_partial_amax_kernel (tile (r/128, c/128) over
    the shard's elements, fmaxf from 0.0f). None shard: zeros."""
    amax = np.zeros(fp8_block_scale_shape(h, w, block_len), dtype=np.float32)
    if shard is not None and np.size(shard):
        r, c, x = _abs_at(shard, start, w)
        _fmax_into(amax, (r // block_len) * amax.shape[1] + c // block_len, x)
    return amax


def nvfp4_tile_shape(h, w):
    return -(-h // 16), -(-w // 16)


def nvfp4_partial_amax(shard, h, w, start):
    """utils.py _cast_master_weights_to_nvfp4_2d: zero buffers, then for a
    non-empty shard csrc/extensions/nvfp4_2d_partial_cast.cpp
    nvfp4_multi_tensor_compute_partial_amax: recipe/nvfp4.cu
    nvfp4_2d_compute_partial_amax_kernel (16x16 tiles) and nvte_compute_amax
    (recipe/current_scaling.cu amax_kernel: fmaxf / __hmax from 0, NaN
    skipped) for the global amax."""
    amax = np.zeros(nvfp4_tile_shape(h, w), dtype=np.float32)
    g = F32(0)
    if shard is not None and np.size(shard):
        r, c, x = _abs_at(shard, start, w)
        _fmax_into(amax, (r // 16) * amax.shape[1] + c // 16, x)
        g = F32(np.fmax.reduce(x, initial=F32(0)))
    return amax, g


def mxfp8_scale_shapes(h, w):
    """pytorch/tensor/mxfp8_tensor.py MXFP8Quantizer.get_scale_shape: rowwise
    (round_up(h, 128), round_up(w/32, 4)), columnwise (round_up(h/32, 4),
    round_up(w, 128))."""
    return (round_up(h, 128), round_up(w // 32, 4)), (round_up(h // 32, 4), round_up(w, 128))


def mxfp8_partial_amax(shard, h, w, start):
    """utils.py _cast_master_weights_to_fp8_mxfp8_scaling (zero buffers of
    the scale_inv shapes) and recipe/mxfp8_scaling.cu
    mxfp8_scaling_compute_partial_amax_kernel: rowwise cell (r, c/32),
    columnwise cell (r/32, c), fmaxf from 0; h and w multiples of 32. The
    buffers have the shard's dtype; an amax of bf16 values is one of them,
    exact in float32."""
    if h % 32 or w % 32:
        raise ValueError("TE's MXFP8 partial cast needs rows and cols divisible by 32")
    rs, cs = mxfp8_scale_shapes(h, w)
    row, col = np.zeros(rs, np.float32), np.zeros(cs, np.float32)
    if shard is not None and np.size(shard):
        r, c, x = _abs_at(shard, start, w)
        _fmax_into(row, r * rs[1] + c // 32, x)
        _fmax_into(col, (r // 32) * cs[1] + c, x)
    return row, col


def current_amax(shard):
    """utils.py _cast_master_weights_to_fp8_current_scaling: tex.compute_amax
    (current_scaling.cu amax_kernel) of a non-empty shard, else 0."""
    if shard is None or not np.size(shard):
        return F32(0)
    return F32(np.fmax.reduce(np.abs(np.asarray(shard, np.float32).reshape(-1)), initial=F32(0)))


def all_reduce_max(parts):
    """torch.distributed.all_reduce(op=MAX) of the ranks' buffers."""
    out = np.asarray(parts[0], dtype=np.float32).copy()
    for p in parts[1:]:
        out = np.fmax(out, np.asarray(p, dtype=np.float32))
    return out


def fp8_scale_and_inv(amax, fp8_max=448.0, pow2=False, eps=0.0):
    """multi_tensor/compute_scale.cu ComputeScaleAndScaleInvFunctor:
    compute_scale_from_amax(amax, max_fp8, pow2, eps, FLT_MAX) and
    reciprocal<float> (__frcp_rn, the correctly rounded 1/scale)."""
    s = ref.fp8_current(amax, fp8_max, pow2, eps, "float32")
    return s, (F32(1.0) / s).astype(np.float32)


def nvfp4_fused_scale(amax, g, h, target=None):
    """recipe/nvfp4.cu nvfp4_compute_global_scale_kernel and
    nvfp4_fused_scale_kernel with rows_padded = round_up(h, 128) (the
    model weight's _rowwise_scale_inv, get_scale_shape: (round_up(h, 128),
    round_up(ceil(w/16), 4))): per_block_scale = fminf(amax * (S_enc *
    (1/6)), FLT_MAX) [tile_rows, tile_cols]; target_scale[out_row *
    tile_cols + out_col] = e4m3(per_block_scale[out_row / 16, out_col]),
    0 for out_row / 16 >= tile_rows, over out_row < rows_padded; the
    kernel indexes the buffer with row stride tile_cols (not its padded
    width), so bytes past rows_padded * tile_cols keep what `target` held;
    target_amax = g. Returns (global_scale, per_block_scale, target bytes
    [rows_padded, round_up(tile_cols, 4)], target_amax)."""
    tr, tc = amax.shape
    rp = round_up(h, 128)
    s_enc = ref.nvfp4_global_partial_cast(g)
    with np.errstate(over="ignore", invalid="ignore"):
        pbs = np.fmin(amax * (s_enc * ref.RCP_6), FLT_MAX).astype(np.float32)
    out = np.zeros((rp, round_up(tc, 4)), np.uint8) if target is None else target.copy()
    rows = np.arange(rp) // 16
    vals = np.zeros((rp, tc), np.float32)
    ok = rows < tr
    vals[ok] = pbs[rows[ok]]
    flat = out.reshape(-1)
    flat[:rp * tc] = ref.e4m3_bits(vals).reshape(-1)
    return F32(s_enc), pbs, out, F32(g)


def nvfp4_cast_encode(pbs, s_enc):
    """recipe/nvfp4.cu nvfp4_2d_partial_cast_kernel: the encode scale a tile's
    values are multiplied by, from the float per_block_scale."""
    return ref.nvfp4_partial_cast_encode(ref.e4m3_bits(pbs), s_enc)


def mxfp8_scale_inv(amax):
    """multi_tensor/compute_scale.cu ComputeScaleInvE8M0Functor:
    float_to_e8m0(amax * max_norm_rcp) over the whole padded buffer."""
    return ref.mxfp8(amax)


def te_cast(kind, shards, starts, h, w, *, fp8_max=448.0, pow2=False, eps=0.0):
    """What every rank of TE's quantize_master_weights stores for one weight
    whose master shards (None = empty) start at `starts`: a dict of numpy
    arrays named as amaxd.te names them."""
    if kind == "fp8_current":
        g = all_reduce_max([current_amax(s) for s in shards])
        s, si = fp8_scale_and_inv(np.array([g], np.float32), fp8_max, pow2, eps)
        return {"amax": np.array([g], np.float32), "scale": s, "scale_inv": si}
    if kind == "fp8_block":
        a = all_reduce_max([fp8_block_partial_amax(s, h, w, o) for s, o in zip(shards, starts)])
        s, si = fp8_scale_and_inv(a, fp8_max, pow2, eps)
        return {"amax": a, "scale": s, "rowwise_scale_inv": si}
    if kind == "nvfp4":
        parts = [nvfp4_partial_amax(s, h, w, o) for s, o in zip(shards, starts)]
        a = all_reduce_max([p[0] for p in parts])
        g = all_reduce_max([np.array([p[1]], np.float32) for p in parts])[0]
        s_enc, pbs, tgt, tamax = nvfp4_fused_scale(a, g, h)
        return {"amax": a, "global_amax": np.array([tamax], np.float32),
                "global_scale": np.array([s_enc], np.float32),
                "tile_encode_scale": nvfp4_cast_encode(pbs, s_enc),
                "tile_scale_inv": ref.e4m3_value(ref.e4m3_bits(pbs)), "rowwise_scale_inv": tgt,
                "amax_rowwise": np.array([tamax], np.float32)}
    if kind == "mxfp8":
        parts = [mxfp8_partial_amax(s, h, w, o) for s, o in zip(shards, starts)]
        row = all_reduce_max([p[0] for p in parts])
        col = all_reduce_max([p[1] for p in parts])
        return {"amax_rowwise_blocks": row, "amax_columnwise_blocks": col,
                "rowwise_scale_inv": mxfp8_scale_inv(row),
                "columnwise_scale_inv": mxfp8_scale_inv(col)}
    raise ValueError(kind)
