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
 * Accumulation of cell `c` of quantizer `q` given this epoch's reduced value:
 * RUNNING_MAX folds it into *accum; PER_EPOCH writes it into history slot
 * hist_head of `ring` (the quantizer's H x ncells history) and reduces the
 * window (max, or the most recent). Returns the cell's raw amax (-inf = no
 * data).
 */
AMX_HD float amx_pp_accumulate(const amx_qdesc_t *q, float *accum, float *ring, uint64_t c,
                               float reduced)
{
    if (q->accumulation != AMX_ACC_PER_EPOCH) {
        float a = amx_fmaxf(*accum, reduced);
        *accum = a;
        return a;
    }
    ring[(uint64_t)q->hist_head * q->ncells + c] = reduced;
    if (q->recipe.history_reduce == AMX_HIST_MOST_RECENT)
        return reduced;
    float a = AMX_NEG_INF;
    for (uint32_t s = 0; s < q->hist_len; s++)
        a = amx_fmaxf(a, ring[(uint64_t)s * q->ncells + c]);
    return a;
}

/*
 * Scales of one cell with amax `a` (-inf = no data, read as 0), the
 * quantizer's (group) global amax `g`, global scale `s_enc` and its inverse
 * `s_dec` (the quantizer's global_scale_inv). `prev` is the cell's previous
 * delayed scale (updated).
 */
AMX_HD void amx_pp_cell(const amx_recipe_t *r, float a, float g, float s_enc, float s_dec,
                        float *prev, float *scale, float *inv, uint8_t *byte)
{
    float v = a > 0.0f ? a : 0.0f;
    uint8_t b = 0;
    float s, i;
    if (r->format == AMX_FMT_NVFP4) {
        b = r->nvfp4_convention == AMX_NVFP4_MODELOPT ? amx_nvfp4_block_modelopt(v, g)
                                                      : amx_nvfp4_block_te(v, s_enc);
        /* scale_inv is the E4M3 block decode scale (TE's scale_inv bytes);
         * scale is the block encode scale a quantizer multiplies by. */
        i = amx_e4m3_to_float(b);
        s = amx_nvfp4_block_encode(i, s_dec);
    } else if (r->format == AMX_FMT_MXFP8) {
        b = amx_mxfp8_e8m0(v);
        s = amx_e8m0_encode(b);
        i = amx_e8m0_decode(b);
    } else {
        if (r->rule == AMX_RULE_DELAYED) {
            s = amx_fp8_delayed_scale(v, r->scaled_max, *prev);
            *prev = s;
        } else {
            s = amx_fp8_current_scale(v, amx_fp8_max(r->format), r->power_of_2, r->eps);
        }
        i = amx_fp8_scale_inv(s);
    }
    *scale = s;
    *inv = i;
    *byte = b;
}

/* Global scale and its inverse from global amax `g` (>= 0). */
AMX_HD void amx_pp_global(const amx_recipe_t *r, float g, float *prev_g, float *gs, float *gsi)
{
    if (r->format == AMX_FMT_NVFP4) {
        float s = amx_nvfp4_global_encode(g);
        *gs = s;
        *gsi = 1.0f / s;
    } else if (r->format == AMX_FMT_MXFP8) {
        uint8_t e = amx_mxfp8_e8m0(g);
        *gs = amx_e8m0_encode(e);
        *gsi = amx_e8m0_decode(e);
    } else {
        float s;
        if (r->rule == AMX_RULE_DELAYED) {
            s = amx_fp8_delayed_scale(g, r->scaled_max, *prev_g);
            *prev_g = s;
        } else {
            s = amx_fp8_current_scale(g, amx_fp8_max(r->format), r->power_of_2, r->eps);
        }
        *gs = s;
        *gsi = amx_fp8_scale_inv(s);
    }
}

#endif
