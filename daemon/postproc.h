/*
 * postproc.h - the per-cell and per-quantizer steps of finishing an epoch,
 * shared verbatim by the host backend (state_host.c) and the CUDA kernels
 * (cuda/state_cuda.cu). Only max, comparisons and the functions of
 * recipe.h: the result does not depend on evaluation order, so the
 * backends agree bit for bit.
 */
#ifndef AMX_POSTPROC_H
#define AMX_POSTPROC_H

#include "recipe.h"
#include "state.h"

#define AMX_NEG_INF (-INFINITY)

/*
 * Accumulation of cell `c` of quantizer `q` given this epoch's reduced value
 * (-inf = no data): RUNNING_MAX folds it into *accum. PER_EPOCH keeps the
 * quantizer's H x ncells history `ring` (slot-major) and returns the amax
 * the scale is computed from:
 *
 *   TE (default; TE common/recipe/delayed_scaling.cu kernel_bulk, the fused
 *   update after the amax reduction that TE's PyTorch recipe runs): an
 *   epoch whose amax is 0 (or without data) leaves the window as it is and
 *   its amax is 0, so the scale stays the previous one. Any other epoch
 *   shifts the window by one (slot 0 oldest, slot H-1 newest) and the amax
 *   is the window's max, or the epoch's own (MOST_RECENT).
 *
 *   TE_UNFUSED (TE's per-tensor `kernel`; amaxd's rule before conventions): every
 *   epoch writes slot hist_head, zero and "no data" included; the amax is
 *   the max over the window, or the epoch's own.
 *
 * Returns the cell's raw amax (-inf = no data).
 */
AMX_HD float amx_pp_accumulate(const amx_qdesc_t *q, float *accum, float *ring, uint64_t c,
                               float reduced)
{
    if (q->accumulation != AMX_ACC_PER_EPOCH) {
        float a = amx_fmaxf(*accum, reduced);
        *accum = a;
        return a;
    }
    if (q->recipe.history_convention == AMX_HISTCONV_TE_UNFUSED) {
        ring[(uint64_t)q->hist_head * q->ncells + c] = reduced;
        if (q->recipe.history_reduce == AMX_HIST_MOST_RECENT)
            return reduced;
        float a = AMX_NEG_INF;
        for (uint32_t s = 0; s < q->hist_len; s++)
            a = amx_fmaxf(a, ring[(uint64_t)s * q->ncells + c]);
        return a;
    }
    if (!(reduced > 0.0f))
        return reduced; /* 0 or no data: the window is left alone */
    float a = reduced;
    uint32_t h = q->hist_len;
    for (uint32_t s = 0; s + 1 < h; s++) {
        float v = ring[(uint64_t)(s + 1) * q->ncells + c];
        ring[(uint64_t)s * q->ncells + c] = v;
        a = amx_fmaxf(a, v);
    }
    ring[(uint64_t)(h - 1) * q->ncells + c] = reduced;
    return q->recipe.history_reduce == AMX_HIST_MOST_RECENT ? reduced : a;
}

/*
 * The peer group stage of one cell: `a` is its amax after accumulation
 * (-inf = no data), `m` its group's max over every cell of every member
 * that has data (-inf when none has). PEER_FILL: a cell without data takes
 * m, the others keep a. PEER_SHARE: every cell takes m (ModelOpt's MoE
 * rule). *raised is 1 when the group raised the cell's value: a cell
 * without data that got m, or (SHARE) a cell whose own amax was below m.
 * max is exact, so both backends agree bit for bit.
 */
AMX_HD float amx_pp_peer(int mode, float a, float m, uint8_t *raised)
{
    float v = (mode == AMX_PEER_SHARE || a == AMX_NEG_INF) ? amx_fmaxf(a, m) : a;
    *raised = (uint8_t)(v > a);
    return v;
}

/* The per-slice entry of cell `c` (of quantizer `q`, which has slices). */
AMX_HD uint64_t amx_pp_slice(const amx_qdesc_t *q, uint64_t c)
{
    return q->gbase + c / q->slice_cells;
}

/*
 * Scales of one cell with amax `a` (-inf = no data, read as 0), the
 * quantizer's (group) global amax `g` and global encode scale `s_enc`.
 * `prev` is the cell's previous delayed scale (updated). Only NVFP4 reads
 * g, s_enc and s_dec: the CUDA finish scales FP8 and MXFP8 cells in its
 * accumulation pass, before the globals exist (scales_in_accumulate in
 * cuda/state_cuda.cu); a format that reads them must not be listed there.
 */
AMX_HD void amx_pp_cell(const amx_recipe_t *r, float a, float g, float s_enc, float s_dec,
                        float *prev, float *scale, float *inv, uint8_t *byte)
{
    float v = a > 0.0f ? a : 0.0f;
    uint8_t b = 0;
    float s, i;
    if (r->format == AMX_FMT_NVFP4) {
        b = amx_nvfp4_block(r->nvfp4_convention, v, g, s_enc);
        /* scale_inv is the E4M3 block decode scale (TE's scale_inv bytes);
         * scale is the block encode scale a quantizer multiplies by, TE's
         * block_scale_inverse (cast/nvfp4/quantize_transpose_nvfp4.cuh):
         * min(1 / (S_dec_b * (1 / S_enc)), FLT_MAX). */
        i = amx_e4m3_to_float(b);
        s = r->nvfp4_convention == AMX_NVFP4_TE_PARTIAL_CAST
                ? amx_nvfp4_partial_cast_encode(i, s_enc)
                : amx_nvfp4_block_encode(i, s_dec);
    } else if (r->format == AMX_FMT_MXFP8) {
        b = amx_mxfp8_e8m0_conv(r->mxfp8_convention, v);
        s = amx_e8m0_encode_conv(r->mxfp8_convention, b);
        i = amx_e8m0_decode_conv(r->mxfp8_convention, b);
    } else {
        if (r->rule == AMX_RULE_DELAYED) {
            s = amx_fp8_delayed_scale(v, r->scaled_max, *prev);
            *prev = s;
        } else {
            s = amx_fp8_current_scale_rule(r->rule, v, amx_fp8_max(r->format), r->power_of_2,
                                           r->eps);
        }
        i = r->output_convention == AMX_OUT_MODELOPT
                ? amx_fp8_scale_inv_modelopt(v, amx_fp8_max(r->format))
                : amx_fp8_scale_inv(s);
    }
    *scale = s;
    *inv = i;
    *byte = b;
}

/* Global scale and its inverse (dequantization factor) from global amax `g` (>= 0). */
AMX_HD void amx_pp_global(const amx_recipe_t *r, float g, float *prev_g, float *gs, float *gsi)
{
    if (r->format == AMX_FMT_NVFP4) {
        *gs = amx_nvfp4_global_encode_conv(r->nvfp4_convention, g);
        *gsi = amx_nvfp4_global_decode(r->output_convention, g);
    } else if (r->format == AMX_FMT_MXFP8) {
        uint8_t e = amx_mxfp8_e8m0_conv(r->mxfp8_convention, g);
        *gs = amx_e8m0_encode_conv(r->mxfp8_convention, e);
        *gsi = amx_e8m0_decode_conv(r->mxfp8_convention, e);
    } else {
        float s;
        if (r->rule == AMX_RULE_DELAYED) {
            s = amx_fp8_delayed_scale(g, r->scaled_max, *prev_g);
            *prev_g = s;
        } else {
            s = amx_fp8_current_scale_rule(r->rule, g, amx_fp8_max(r->format), r->power_of_2,
                                           r->eps);
        }
        *gs = s;
        *gsi = r->output_convention == AMX_OUT_MODELOPT
                   ? amx_fp8_scale_inv_modelopt(g, amx_fp8_max(r->format))
                   : amx_fp8_scale_inv(s);
    }
}

#endif
