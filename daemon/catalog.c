/*
 * catalog.c - spec validation and the canonical, sorted catalog.
 */
#include "catalog.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- names ---- */

int amx_valid_job_name(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > AMX_MAX_JOB_NAME)
        return 0;
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && *s != '.' && *s != '_' && *s != '-')
            return 0;
    return 1;
}

int amx_valid_name(const char *s)
{
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n > AMX_MAX_NAME)
        return 0;
    for (; *s; s++)
        if ((unsigned char)*s < 0x21 || (unsigned char)*s > 0x7e)
            return 0;
    return 1;
}

void amx_fmt_shape(char *buf, size_t len, const uint32_t *d, size_t n)
{
    size_t k = (size_t)snprintf(buf, len, "[");
    for (size_t i = 0; i < n && k < len; i++)
        k += (size_t)snprintf(buf + k, len - k, i ? ", %u" : "%u", d[i]);
    if (k < len)
        snprintf(buf + k, len - k, "]");
}

/* ---- recipes ---- */

static amx_status_t normalize_recipe(const char *qname, const amx_recipe_in_t *in, uint8_t acc,
                                     amx_recipe_t *out, amx_err_t *err)
{
    memset(out, 0, sizeof(*out));
    if (!in->present)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe is missing", qname);
    if (in->format < 1 || in->format > 4)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.format %d is not FP8_E4M3, FP8_E5M2, NVFP4 or "
                           "MXFP8",
                           qname, in->format);
    int fp8 = in->format == AMX_FMT_FP8_E4M3 || in->format == AMX_FMT_FP8_E5M2;
    out->format = (uint8_t)in->format;
    int rule = in->rule == 0 ? AMX_RULE_CURRENT : in->rule;
    if (rule < AMX_RULE_CURRENT || rule > AMX_RULE_BLOCK_FP16)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.rule %d is unknown (use CURRENT, DELAYED, "
                           "BLOCK_BF16 or BLOCK_FP16)",
                           qname, in->rule);
    /* CURRENT and the BLOCK_* rules are one formula (TE's
     * compute_scale_from_amax) that differs only in what an overflowing
     * scale becomes; eps and power_of_2 apply to all three. */
    int current = rule != AMX_RULE_DELAYED;
    if (!fp8 && in->rule != 0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.rule applies to FP8 formats only", qname);
    out->rule = (uint8_t)(fp8 ? rule : 0);
    if (!isfinite(in->margin) || in->margin < -100.0f || in->margin > 100.0f)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.margin must be in [-100, 100]",
                           qname);
    if (in->margin != 0.0f && out->rule != AMX_RULE_DELAYED)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.margin applies to FP8 DELAYED scaling only",
                           qname);
    /* -0 is 0: equal recipes must hash alike (amx_catalog_hash reads bytes). */
    out->margin = in->margin + 0.0f;
    out->history_len = in->history_len == 0 ? 1 : in->history_len;
    if (out->history_len > AMX_HISTORY_MAX)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.history_len %u exceeds %u",
                           qname, in->history_len, AMX_HISTORY_MAX);
    if (out->history_len > 1 && (out->rule != AMX_RULE_DELAYED || acc != AMX_ACC_PER_EPOCH))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.history_len > 1 needs rule DELAYED and "
                           "accumulation PER_EPOCH",
                           qname);
    if (in->history_reduce < 0 || in->history_reduce > 2)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.history_reduce %d is unknown",
                           qname, in->history_reduce);
    out->history_reduce = (uint8_t)(in->history_reduce == 0 ? AMX_HIST_MAX : in->history_reduce);
    if (!isfinite(in->eps) || in->eps < 0.0f)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.eps must be finite and >= 0",
                           qname);
    if ((in->eps != 0.0f || in->power_of_2) && !(fp8 && current))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.eps and power_of_2 apply to FP8 CURRENT "
                           "(and BLOCK_BF16, BLOCK_FP16) scaling only",
                           qname);
    out->eps = in->eps + 0.0f;
    out->power_of_2 = (uint8_t)(in->power_of_2 != 0);
    if (in->nvfp4_convention < 0 || in->nvfp4_convention > AMX_NVFP4_TE_PARTIAL_CAST)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.nvfp4_convention %d is unknown (use "
                           "TRANSFORMER_ENGINE, MODELOPT, TRANSFORMER_ENGINE_LEGACY, "
                           "MODELOPT_STATIC or TRANSFORMER_ENGINE_PARTIAL_CAST)",
                           qname, in->nvfp4_convention);
    if (in->nvfp4_convention != 0 && in->format != AMX_FMT_NVFP4)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.nvfp4_convention applies to NVFP4 only", qname);
    out->nvfp4_convention =
        (uint8_t)(in->format == AMX_FMT_NVFP4
                      ? (in->nvfp4_convention == 0 ? AMX_NVFP4_TE : in->nvfp4_convention)
                      : 0);
    if (in->output_convention < 0 || in->output_convention > 2)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.output_convention %d is unknown (use "
                           "OUTPUT_TRANSFORMER_ENGINE or OUTPUT_MODELOPT)",
                           qname, in->output_convention);
    out->output_convention =
        (uint8_t)(in->output_convention == 0 ? AMX_OUT_TE : in->output_convention);
    if (out->output_convention == AMX_OUT_MODELOPT &&
        !(in->format == AMX_FMT_NVFP4 || (fp8 && out->rule == AMX_RULE_CURRENT)))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.output_convention OUTPUT_MODELOPT applies to "
                           "NVFP4 and FP8 CURRENT scaling only (ModelOpt has no %s)",
                           qname,
                           !fp8                            ? "MXFP8 export factors"
                           : out->rule == AMX_RULE_DELAYED ? "delayed scaling"
                                                           : "FP8 block-scaling rules");
    if (in->history_convention < 0 || in->history_convention > 2)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.history_convention %d is unknown (use "
                           "HISTORY_TRANSFORMER_ENGINE or HISTORY_TRANSFORMER_ENGINE_UNFUSED)",
                           qname, in->history_convention);
    if (in->history_convention != 0 && out->rule != AMX_RULE_DELAYED)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.history_convention applies to FP8 DELAYED "
                           "scaling only",
                           qname);
    out->history_convention =
        (uint8_t)(out->rule == AMX_RULE_DELAYED
                      ? (in->history_convention == 0 ? AMX_HISTCONV_TE : in->history_convention)
                      : 0);
    if (in->mxfp8_convention < 0 || in->mxfp8_convention > AMX_MX_TE_2_18)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.mxfp8_convention %d is unknown (use "
                           "MXFP8_TRANSFORMER_ENGINE, MXFP8_OCP, MXFP8_MODELOPT, "
                           "MXFP8_TRANSFORMER_ENGINE_LEGACY or MXFP8_TRANSFORMER_ENGINE_2_18)",
                           qname, in->mxfp8_convention);
    if (in->mxfp8_convention != 0 && in->format != AMX_FMT_MXFP8)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.mxfp8_convention applies to MXFP8 only", qname);
    out->mxfp8_convention =
        (uint8_t)(in->format == AMX_FMT_MXFP8
                      ? (in->mxfp8_convention == 0 ? AMX_MX_TE : in->mxfp8_convention)
                      : 0);
    out->scaled_max = fp8 ? amx_fp8_max(out->format) * powf(2.0f, -out->margin) : 0.0f;
    return AMX_OK;
}

static int recipe_equal(const amx_recipe_t *a, const amx_recipe_t *b)
{
    return a->format == b->format && a->rule == b->rule && a->history_reduce == b->history_reduce &&
           a->nvfp4_convention == b->nvfp4_convention && a->power_of_2 == b->power_of_2 &&
           a->history_len == b->history_len && a->margin == b->margin && a->eps == b->eps &&
           a->output_convention == b->output_convention &&
           a->history_convention == b->history_convention &&
           a->mxfp8_convention == b->mxfp8_convention;
}

/* ---- calibrators ---- */

/* The NVFP4 per-block search (calib.h AMX_CAL_NVFP4_MSE): static NVFP4
 * blocks whose global amax phase 1 fixes; its candidates are fixed, so it
 * takes no option. */
static amx_status_t normalize_nvfp4_mse(const amx_calib_in_t *in, const amx_qspec_t *s,
                                        amx_calib_t *out, amx_err_t *err)
{
    const char *q = s->name;
    if (in->method || in->grid || in->torch_cpu || in->num_bins || in->num_bits || in->start_bin ||
        in->stride || in->is_unsigned || in->skip_zeros || in->percentile != 0.0 ||
        in->start_mult != 0.0 || in->stop_mult != 0.0 || in->step_size != 0.0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator NVFP4_MSE takes no other field (its 126 "
                           "candidates are the FP8 E4M3 scales); leave them at 0",
                           q);
    if (s->recipe.format != AMX_FMT_NVFP4 || s->ndim == 0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator NVFP4_MSE needs format NVFP4 and a "
                           "global_shape of blocks (1 to 4 dimensions, e.g. [R, C/16]), got "
                           "format %d with %u dimensions",
                           q, (int)s->recipe.format, s->ndim);
    if (s->accumulation != AMX_ACC_RUNNING_MAX)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator NVFP4_MSE needs accumulation RUNNING_MAX "
                           "(phase 1's max fixes the global amax)",
                           q);
    if (s->peer_group[0] != '\0' || s->global_axes != 0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator NVFP4_MSE cannot be combined with a "
                           "peer_group or global_axes (a scale_group is allowed)",
                           q);
    out->kind = AMX_CAL_NVFP4_MSE;
    out->nsteps = AMX_NVFP4_MSE_STEPS;
    return AMX_OK;
}

/* Validates a calibrator (calib.h) against the rest of spec `s` (shape,
 * accumulation, groups, global axes already parsed). */
static amx_status_t normalize_calib(const amx_calib_in_t *in, const amx_qspec_t *s,
                                    amx_calib_t *out, amx_err_t *err)
{
    const char *q = s->name;
    memset(out, 0, sizeof(*out));
    int kind = in->present ? in->kind : AMX_CAL_MAX;
    if (kind < AMX_CAL_MAX || kind > AMX_CAL_NVFP4_MSE)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.kind %d is unknown (use CALIBRATOR_MAX, "
                           "CALIBRATOR_HISTOGRAM, CALIBRATOR_MSE or CALIBRATOR_NVFP4_MSE)",
                           q, in->kind);
    int hist = kind == AMX_CAL_HISTOGRAM, mse = kind == AMX_CAL_MSE;
    if (kind == AMX_CAL_MAX) {
        if (in->present && (in->method || in->grid || in->torch_cpu || in->num_bins ||
                            in->num_bits || in->start_bin || in->stride || in->is_unsigned ||
                            in->skip_zeros || in->percentile != 0.0 || in->start_mult != 0.0 ||
                            in->stop_mult != 0.0 || in->step_size != 0.0))
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator fields are set but calibrator.kind is "
                               "CALIBRATOR_MAX; set kind to CALIBRATOR_HISTOGRAM or "
                               "CALIBRATOR_MSE, or leave the other fields at 0",
                               q);
        return AMX_OK;
    }
    if (kind == AMX_CAL_NVFP4_MSE)
        return normalize_nvfp4_mse(in, s, out, err);
    const char *kn = hist ? "HISTOGRAM" : "MSE";
    if (s->accumulation != AMX_ACC_RUNNING_MAX)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator %s needs accumulation RUNNING_MAX (its "
                           "statistic accumulates until Reset)",
                           q, kn);
    if (s->peer_group[0] != '\0' || s->scale_group[0] != '\0' || s->global_axes != 0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator %s cannot be combined with a peer_group, "
                           "a scale_group or global_axes",
                           q, kn);
    if (hist && s->ndim != 0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator HISTOGRAM needs global_shape [] (one "
                           "histogram per tensor, as ModelOpt's HistogramCalibrator)",
                           q);
    if (in->torch_cpu < 0 || in->torch_cpu > AMX_TORCH_DEFAULT)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.torch_cpu %d is unknown (use "
                           "TORCH_CPU_AVX2, TORCH_CPU_AVX512 or TORCH_CPU_DEFAULT)",
                           q, in->torch_cpu);
    out->kind = (uint8_t)kind;
    out->torch_cpu = (uint8_t)(in->torch_cpu == 0 ? AMX_TORCH_AVX2 : in->torch_cpu);
    if (mse) {
        if (in->method || in->grid || in->num_bins || in->num_bits || in->start_bin || in->stride ||
            in->is_unsigned || in->skip_zeros || in->percentile != 0.0)
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator MSE takes start_multiplier, "
                               "stop_multiplier, step_size and torch_cpu only",
                               q);
        uint64_t k = amx_mse_nsteps(in->start_mult, in->stop_mult, in->step_size);
        if (k == 0 || !(in->start_mult >= 0.0))
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator MSE needs 0 <= start_multiplier <= "
                               "stop_multiplier and step_size > 0, all finite, with at most %u "
                               "candidates (got %g, %g, %g)",
                               q, AMX_MSE_MAX_STEPS, in->start_mult, in->stop_mult, in->step_size);
        if ((k + 1) * s->ncells > ((uint64_t)1 << 40))
            return amx_err_set(err, AMX_ENOMEM,
                               "quantizer '%s': %llu MSE candidates of %llu cells are too many "
                               "statistic values",
                               q, (unsigned long long)k, (unsigned long long)s->ncells);
        out->nsteps = (uint32_t)k;
        out->start_mult = in->start_mult + 0.0;
        out->stop_mult = in->stop_mult + 0.0;
        out->step_size = in->step_size + 0.0;
        return AMX_OK;
    }
    if (in->start_mult != 0.0 || in->stop_mult != 0.0 || in->step_size != 0.0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': start_multiplier, stop_multiplier and step_size "
                           "apply to calibrator MSE only",
                           q);
    if (in->num_bins < 1 || in->num_bins > AMX_HIST_MAX_BINS)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.num_bins %u must be in [1, %u] (ModelOpt's "
                           "default is 2048)",
                           q, in->num_bins, AMX_HIST_MAX_BINS);
    out->num_bins = in->num_bins;
    out->skip_zeros = (uint8_t)(in->skip_zeros != 0);
    if (in->method < AMX_HM_ENTROPY || in->method > AMX_HM_MSE)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.method %d is unknown (use ENTROPY, "
                           "PERCENTILE or HISTOGRAM_MSE)",
                           q, in->method);
    out->method = (uint8_t)in->method;
    if (in->method == AMX_HM_PERCENTILE) {
        if (in->grid || in->num_bits || in->start_bin || in->stride || in->is_unsigned)
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator method PERCENTILE takes percentile "
                               "only (not grid, num_bits, start_bin, stride or unsigned)",
                               q);
        if (!(in->percentile >= 0.0 && in->percentile <= 100.0))
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator.percentile %g must be in [0, 100]", q,
                               in->percentile);
        out->percentile = in->percentile + 0.0;
        return AMX_OK;
    }
    if (in->percentile != 0.0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.percentile applies to method PERCENTILE "
                           "only",
                           q);
    if (in->stride < 1 || in->stride > in->num_bins)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.stride %u must be in [1, num_bins]", q,
                           in->stride);
    out->stride = in->stride;
    out->is_unsigned = (uint8_t)(in->is_unsigned != 0);
    if (in->method == AMX_HM_ENTROPY) {
        if (in->grid)
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator.grid applies to method HISTOGRAM_MSE "
                               "only (ENTROPY uses num_bits)",
                               q);
        if (in->num_bits < 1 || in->num_bits + (in->is_unsigned != 0) > 17)
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator.num_bits %u must be in [1, 16] for "
                               "ENTROPY (2^(num_bits - 1 + unsigned) quantization levels)",
                               q, in->num_bits);
        /* ModelOpt fails on an empty candidate range, and start_bin 0 on
         * its first candidate (bins[:0]). */
        if (in->start_bin < 1 || in->start_bin > in->num_bins)
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': calibrator.start_bin %u must be in [1, num_bins "
                               "%u] for ENTROPY (ModelOpt's default is 128)",
                               q, in->start_bin, in->num_bins);
        out->num_bits = in->num_bits;
        out->start_bin = in->start_bin;
        return AMX_OK;
    }
    /* HISTOGRAM_MSE */
    int grid = in->grid == 0 ? AMX_GRID_INT : in->grid;
    if (grid != AMX_GRID_INT && grid != AMX_GRID_E4M3)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.grid %d is unknown (use GRID_INT or "
                           "GRID_E4M3)",
                           q, in->grid);
    out->grid = (uint8_t)grid;
    if (grid == AMX_GRID_E4M3 && (in->num_bits != 0 || in->is_unsigned))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator grid GRID_E4M3 takes no num_bits or "
                           "unsigned",
                           q);
    if (grid == AMX_GRID_INT && (in->num_bits < 2 || in->num_bits > 16))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.num_bits %u must be in [2, 16] for the "
                           "integer grid of HISTOGRAM_MSE",
                           q, in->num_bits);
    if (in->start_bin >= in->num_bins)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': calibrator.start_bin %u must be below num_bins %u for "
                           "HISTOGRAM_MSE (its candidates are the bin centers from start_bin on)",
                           q, in->start_bin, in->num_bins);
    out->num_bits = in->num_bits;
    out->start_bin = in->start_bin;
    return AMX_OK;
}

/* ---- specs ---- */

amx_status_t amx_qspec_parse(const amx_qspec_in_t *in, uint64_t max_cells, amx_qspec_t *out,
                             amx_err_t *err)
{
    const char *name = in->name ? in->name : "";
    memset(out, 0, sizeof(*out));
    if (!amx_valid_name(name))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer name '%.64s' is invalid: use 1-%d printable ASCII characters "
                           "without spaces",
                           name, AMX_MAX_NAME);
    if (in->ndim > AMX_MAX_DIMS)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': global_shape has %zu dimensions, at most %d are "
                           "supported",
                           name, in->ndim, AMX_MAX_DIMS);
    out->name = (char *)name;
    out->ndim = (uint32_t)in->ndim;
    out->ncells = 1;
    for (uint32_t d = 0; d < out->ndim; d++) {
        if (in->global_shape[d] == 0)
            return amx_err_set(err, AMX_EINVAL, "quantizer '%s': global_shape[%u] is 0", name, d);
        out->shape[d] = in->global_shape[d];
        out->ncells *= in->global_shape[d];
        if (out->ncells > max_cells)
            return amx_err_set(err, AMX_ENOMEM,
                               "quantizer '%s': global shape has more than max_cells=%llu cells",
                               name, (unsigned long long)max_cells);
    }
    if (in->accumulation < 0 || in->accumulation > 2)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': accumulation %d is unknown", name,
                           in->accumulation);
    out->accumulation = (uint8_t)(in->accumulation == 0 ? AMX_ACC_RUNNING_MAX : in->accumulation);
    AMX_CHECK(normalize_recipe(name, &in->recipe, out->accumulation, &out->recipe, err));
    const char *pg = in->peer_group ? in->peer_group : "";
    const char *sg = in->scale_group ? in->scale_group : "";
    if (pg[0] != '\0' && !amx_valid_name(pg))
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': peer_group name is invalid", name);
    if (sg[0] != '\0' && !amx_valid_name(sg))
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': scale_group name is invalid", name);
    out->peer_group = (char *)pg;
    out->scale_group = (char *)sg;
    if (in->peer_mode < 0 || in->peer_mode > 2)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': peer_mode %d is unknown (use PEER_FILL or PEER_SHARE)",
                           name, in->peer_mode);
    if (in->peer_mode != 0 && pg[0] == '\0')
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': peer_mode %s needs a peer_group (the mode is the "
                           "group's)",
                           name, amx_peer_mode_name(in->peer_mode));
    out->peer_mode = (uint8_t)(pg[0] == '\0'        ? 0
                               : in->peer_mode == 0 ? AMX_PEER_FILL
                                                    : in->peer_mode);
    if (in->global_axes != 0 && in->global_axes >= out->ndim)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': global_axes %u must be less than the %u dimensions "
                           "of global_shape (0: one global amax; k: one per index of the first "
                           "k axes)",
                           name, in->global_axes, out->ndim);
    if (in->global_axes != 0 && sg[0] != '\0')
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': global_axes %u cannot be combined with scale_group "
                           "'%s' (a scale group shares one global amax); use one or the other",
                           name, in->global_axes, sg);
    out->global_axes = (uint8_t)in->global_axes;
    return normalize_calib(&in->calib, out, &out->calib, err);
}

amx_status_t amx_qspec_check_calib(const amx_qspec_t *s)
{
    const amx_calib_t *c = &s->calib;
    amx_calib_in_t in = {
        .present = 1,
        .kind = c->kind,
        .method = c->method,
        .grid = c->kind == AMX_CAL_HISTOGRAM && c->method == AMX_HM_MSE ? c->grid : 0,
        .torch_cpu = c->torch_cpu,
        .num_bins = c->num_bins,
        .num_bits = c->num_bits,
        .start_bin = c->start_bin,
        .stride = c->stride,
        .is_unsigned = c->is_unsigned,
        .skip_zeros = c->skip_zeros,
        .percentile = c->percentile,
        .start_mult = c->start_mult,
        .stop_mult = c->stop_mult,
        .step_size = c->step_size,
    };
    amx_calib_t out;
    if (c->kind == AMX_CAL_MAX) {
        amx_calib_t zero;
        memset(&zero, 0, sizeof(zero));
        return amx_calib_equal(c, &zero) ? AMX_OK : AMX_EINVAL;
    }
    if (normalize_calib(&in, s, &out, NULL) != AMX_OK || !amx_calib_equal(&out, c))
        return AMX_EINVAL;
    return AMX_OK;
}

uint64_t amx_qspec_stat_values(const amx_qspec_t *s)
{
    if (s->calib.kind == AMX_CAL_HISTOGRAM)
        return (uint64_t)s->calib.num_bins + 1;
    if (s->calib.kind == AMX_CAL_MSE)
        return ((uint64_t)s->calib.nsteps + 1) * s->ncells;
    if (s->calib.kind == AMX_CAL_NVFP4_MSE)
        return 3 * s->ncells; /* per cell: sum of amaxes, of their squares, count */
    return 0;
}

uint64_t amx_qspec_stat_cells(const amx_qspec_t *s)
{
    if (s->calib.kind == AMX_CAL_HISTOGRAM)
        return 1;
    if (s->calib.kind == AMX_CAL_MSE || s->calib.kind == AMX_CAL_NVFP4_MSE)
        return s->ncells;
    return 0;
}

const char *amx_peer_mode_name(int mode)
{
    return mode == AMX_PEER_SHARE ? "PEER_SHARE" : mode == AMX_PEER_FILL ? "PEER_FILL" : "none";
}

uint64_t amx_qspec_slices(const amx_qspec_t *s)
{
    if (s->global_axes == 0)
        return 0;
    uint64_t n = 1;
    for (uint32_t d = 0; d < s->global_axes && d < s->ndim; d++)
        n *= s->shape[d];
    return n;
}

int amx_qspec_equal(const amx_qspec_t *a, const amx_qspec_t *b)
{
    return strcmp(a->name, b->name) == 0 && a->ndim == b->ndim &&
           memcmp(a->shape, b->shape, a->ndim * sizeof(uint32_t)) == 0 &&
           recipe_equal(&a->recipe, &b->recipe) && a->accumulation == b->accumulation &&
           strcmp(a->peer_group, b->peer_group) == 0 &&
           strcmp(a->scale_group, b->scale_group) == 0 && a->peer_mode == b->peer_mode &&
           a->global_axes == b->global_axes && amx_calib_equal(&a->calib, &b->calib);
}

amx_qspec_t *amx_qspec_dup(const amx_qspec_t *s)
{
    /* One allocation: the struct, then the three strings. */
    size_t ln = strlen(s->name) + 1, lp = strlen(s->peer_group) + 1,
           ls = strlen(s->scale_group) + 1;
    amx_qspec_t *d = malloc(sizeof(*d) + ln + lp + ls);
    if (d == NULL)
        return NULL;
    *d = *s;
    d->name = (char *)(d + 1);
    d->peer_group = d->name + ln;
    d->scale_group = d->peer_group + lp;
    memcpy(d->name, s->name, ln);
    memcpy(d->peer_group, s->peer_group, lp);
    memcpy(d->scale_group, s->scale_group, ls);
    return d;
}

void amx_qspec_free(amx_qspec_t *s)
{
    free(s);
}

uint64_t amx_qspec_hist_cells(const amx_qspec_t *s)
{
    return s->accumulation == AMX_ACC_PER_EPOCH ? s->ncells * s->recipe.history_len : 0;
}

static const char *fmt_name(int f)
{
    static const char *const names[] = {"?", "FP8_E4M3", "FP8_E5M2", "NVFP4", "MXFP8"};
    return f >= 1 && f <= 4 ? names[f] : "?";
}

void amx_qspec_diff(const amx_qspec_t *a, const amx_qspec_t *b, char *buf, size_t len)
{
    char s1[96], s2[96];
    if (a->ndim != b->ndim || memcmp(a->shape, b->shape, a->ndim * sizeof(uint32_t)) != 0) {
        amx_fmt_shape(s1, sizeof(s1), a->shape, a->ndim);
        amx_fmt_shape(s2, sizeof(s2), b->shape, b->ndim);
        snprintf(buf, len, "global shape %s vs %s", s1, s2);
    } else if (a->recipe.format != b->recipe.format) {
        snprintf(buf, len, "format %s vs %s", fmt_name(a->recipe.format),
                 fmt_name(b->recipe.format));
    } else if (!recipe_equal(&a->recipe, &b->recipe)) {
        snprintf(buf, len,
                 "recipe (rule %d, margin %g, history %u/%d/%d, eps %g, pow2 %d, nvfp4 %d, "
                 "output %d, mxfp8 %d) vs (rule %d, margin %g, history %u/%d/%d, eps %g, pow2 "
                 "%d, nvfp4 %d, output %d, mxfp8 %d)",
                 a->recipe.rule, (double)a->recipe.margin, a->recipe.history_len,
                 a->recipe.history_reduce, a->recipe.history_convention, (double)a->recipe.eps,
                 a->recipe.power_of_2, a->recipe.nvfp4_convention, a->recipe.output_convention,
                 a->recipe.mxfp8_convention, b->recipe.rule, (double)b->recipe.margin,
                 b->recipe.history_len, b->recipe.history_reduce, b->recipe.history_convention,
                 (double)b->recipe.eps, b->recipe.power_of_2, b->recipe.nvfp4_convention,
                 b->recipe.output_convention, b->recipe.mxfp8_convention);
    } else if (a->accumulation != b->accumulation) {
        snprintf(buf, len, "accumulation %s vs %s",
                 a->accumulation == AMX_ACC_PER_EPOCH ? "PER_EPOCH" : "RUNNING_MAX",
                 b->accumulation == AMX_ACC_PER_EPOCH ? "PER_EPOCH" : "RUNNING_MAX");
    } else if (strcmp(a->peer_group, b->peer_group) != 0) {
        snprintf(buf, len, "peer_group '%s' vs '%s'", a->peer_group, b->peer_group);
    } else if (strcmp(a->scale_group, b->scale_group) != 0) {
        snprintf(buf, len, "scale_group '%s' vs '%s'", a->scale_group, b->scale_group);
    } else if (a->peer_mode != b->peer_mode) {
        snprintf(buf, len, "peer_mode %s vs %s", amx_peer_mode_name(a->peer_mode),
                 amx_peer_mode_name(b->peer_mode));
    } else if (a->global_axes != b->global_axes) {
        snprintf(buf, len, "global_axes %u vs %u", a->global_axes, b->global_axes);
    } else if (!amx_calib_equal(&a->calib, &b->calib)) {
        const amx_calib_t *x = &a->calib, *y = &b->calib;
        snprintf(buf, len,
                 "calibrator (%s, bins %u, method %d, percentile %g, start_bin %u, stride %u, "
                 "bits %u, unsigned %d, grid %d, skip_zeros %d, torch_cpu %d, multipliers "
                 "%g..%g step %g) vs (%s, bins %u, method %d, percentile %g, start_bin %u, "
                 "stride %u, bits %u, unsigned %d, grid %d, skip_zeros %d, torch_cpu %d, "
                 "multipliers %g..%g step %g)",
                 amx_calib_kind_name(x->kind), x->num_bins, x->method, x->percentile, x->start_bin,
                 x->stride, x->num_bits, x->is_unsigned, x->grid, x->skip_zeros, x->torch_cpu,
                 x->start_mult, x->stop_mult, x->step_size, amx_calib_kind_name(y->kind),
                 y->num_bins, y->method, y->percentile, y->start_bin, y->stride, y->num_bits,
                 y->is_unsigned, y->grid, y->skip_zeros, y->torch_cpu, y->start_mult, y->stop_mult,
                 y->step_size);
    } else {
        snprintf(buf, len, "no difference");
    }
}

/* ---- catalogs ---- */

int amx_qspec_name_cmp(const void *x, const void *y)
{
    const amx_qspec_t *a = *(amx_qspec_t *const *)x, *b = *(amx_qspec_t *const *)y;
    return strcmp(a->name, b->name);
}

#define cmp_spec amx_qspec_name_cmp

static int cmp_str(const void *x, const void *y)
{
    return strcmp(*(char *const *)x, *(char *const *)y);
}

/* Sorted unique non-empty group names of one kind (0 peer, 1 scale). */
static char **collect_groups(amx_qspec_t **q, uint32_t n, int scale, uint32_t *count)
{
    char **g = malloc((n ? n : 1) * sizeof(char *));
    if (g == NULL)
        return NULL;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        char *s = scale ? q[i]->scale_group : q[i]->peer_group;
        if (s[0] != '\0')
            g[k++] = s;
    }
    qsort(g, k, sizeof(char *), cmp_str);
    uint32_t u = 0;
    for (uint32_t i = 0; i < k; i++)
        if (u == 0 || strcmp(g[u - 1], g[i]) != 0)
            g[u++] = g[i];
    *count = u;
    return g;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

uint64_t amx_catalog_hash(amx_qspec_t *const *q, uint32_t n)
{
    uint64_t h = 1469598103934665603ull;
    h = fnv(h, &n, sizeof(n));
    for (uint32_t i = 0; i < n; i++) {
        const amx_qspec_t *s = q[i];
        const amx_recipe_t *r = &s->recipe;
        h = fnv(h, s->name, strlen(s->name) + 1);
        h = fnv(h, &s->ndim, sizeof(s->ndim));
        h = fnv(h, s->shape, s->ndim * sizeof(uint32_t));
        uint8_t b[9] = {
            r->format,          r->rule,         r->history_reduce,    r->nvfp4_convention,
            r->power_of_2,      s->accumulation, r->output_convention, r->history_convention,
            r->mxfp8_convention};
        h = fnv(h, b, sizeof(b));
        h = fnv(h, &r->history_len, sizeof(r->history_len));
        h = fnv(h, &r->margin, sizeof(r->margin));
        h = fnv(h, &r->eps, sizeof(r->eps));
        h = fnv(h, s->peer_group, strlen(s->peer_group) + 1);
        h = fnv(h, s->scale_group, strlen(s->scale_group) + 1);
        uint8_t g[2] = {s->peer_mode, s->global_axes};
        h = fnv(h, g, sizeof(g));
        if (s->calib.kind != AMX_CAL_MAX) {
            /* Max quantizers hash as before calibrators existed. */
            const amx_calib_t *c = &s->calib;
            uint8_t cb[6] = {c->kind,        c->method,     c->grid,
                             c->is_unsigned, c->skip_zeros, c->torch_cpu};
            uint32_t cu[5] = {c->num_bins, c->num_bits, c->start_bin, c->stride, c->nsteps};
            double cd[4] = {c->percentile, c->start_mult, c->stop_mult, c->step_size};
            h = fnv(h, cb, sizeof(cb));
            h = fnv(h, cu, sizeof(cu));
            h = fnv(h, cd, sizeof(cd));
        }
    }
    return h;
}

amx_catalog_t *amx_catalog_empty(void)
{
    amx_catalog_t *c = calloc(1, sizeof(*c));
    if (c != NULL)
        c->hash = amx_catalog_hash(NULL, 0);
    return c;
}

amx_status_t amx_catalog_build(amx_qspec_t **specs, uint32_t n, amx_catalog_t **out, amx_err_t *err)
{
    amx_catalog_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        goto nomem;
    c->q = malloc((n ? n : 1) * sizeof(amx_qspec_t *));
    if (c->q == NULL || amx_strmap_reserve(&c->map, n) != 0)
        goto nomem;
    if (n > 0)
        memcpy(c->q, specs, n * sizeof(amx_qspec_t *));
    /* Often in order already (the coordinator merges its additions into
     * the sorted master): a pass of n - 1 comparisons instead of a sort. */
    uint32_t k = 1;
    while (k < n && cmp_spec(&c->q[k - 1], &c->q[k]) < 0)
        k++;
    if (k < n)
        qsort(c->q, n, sizeof(amx_qspec_t *), cmp_spec);
    c->peer = collect_groups(c->q, n, 0, &c->npeer);
    c->scale = collect_groups(c->q, n, 1, &c->nscale);
    if (c->peer == NULL || c->scale == NULL)
        goto nomem;
    for (uint32_t i = 0; i < n; i++) {
        amx_strmap_put(&c->map, c->q[i]->name, i); /* reserved: cannot fail */
        c->ncells += c->q[i]->ncells;
        c->nhist += amx_qspec_hist_cells(c->q[i]);
        c->nslices += amx_qspec_slices(c->q[i]);
        c->nstat += amx_qspec_stat_values(c->q[i]);
        c->nscell += amx_qspec_stat_cells(c->q[i]);
    }
    c->n = n;
    c->hash = amx_catalog_hash(c->q, n);
    *out = c;
    return AMX_OK;
nomem:
    if (c != NULL) {
        free(c->q);
        free(c->peer);
        free(c->scale);
        amx_strmap_free(&c->map);
        free(c);
    }
    return amx_err_set(err, AMX_ENOMEM, "out of memory building a catalog of %u quantizers", n);
}

void amx_catalog_free(amx_catalog_t *c)
{
    if (c == NULL)
        return;
    for (uint32_t i = 0; i < c->n; i++)
        amx_qspec_free(c->q[i]);
    free(c->q);
    free(c->peer);
    free(c->scale);
    amx_strmap_free(&c->map);
    free(c);
}

amx_qspec_t **amx_catalog_take_specs(amx_catalog_t *c, uint32_t *n)
{
    amx_qspec_t **q = c->q;
    *n = c->n;
    c->q = NULL;
    c->n = 0;
    amx_catalog_free(c);
    return q;
}

int64_t amx_catalog_find(const amx_catalog_t *c, const char *name)
{
    uint32_t i;
    return amx_strmap_get(&c->map, name, &i) ? (int64_t)i : -1;
}

static int32_t group_index(char **g, uint32_t n, const char *name)
{
    if (name[0] == '\0')
        return -1;
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        int c = strcmp(g[mid], name);
        if (c == 0)
            return (int32_t)mid;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1; /* cannot happen: every group name of the catalog is in g */
}

void amx_catalog_layout(const amx_catalog_t *c, amx_qdesc_t *desc)
{
    uint64_t base = 0, hist = 0, slices = 0, sbase = 0, obase = 0;
    for (uint32_t i = 0; i < c->n; i++) {
        const amx_qspec_t *s = c->q[i];
        amx_qdesc_t *d = &desc[i];
        memset(d, 0, sizeof(*d));
        d->base = base;
        d->ncells = s->ncells;
        d->hist_base = hist;
        d->hist_len = s->accumulation == AMX_ACC_PER_EPOCH ? s->recipe.history_len : 1;
        d->hist_head = 0;
        d->peer_group = group_index(c->peer, c->npeer, s->peer_group);
        d->scale_group = group_index(c->scale, c->nscale, s->scale_group);
        d->peer_mode = s->peer_mode;
        d->gbase = slices;
        d->nslices = amx_qspec_slices(s);
        d->slice_cells = d->nslices ? s->ncells / d->nslices : 0;
        d->accumulation = s->accumulation;
        d->recipe = s->recipe;
        d->stat = s->calib.kind;
        d->global_of_max = s->calib.kind == AMX_CAL_NVFP4_MSE;
        d->sbase = sbase;
        d->svals = amx_qspec_stat_values(s);
        d->obase = obase;
        base += s->ncells;
        hist += amx_qspec_hist_cells(s);
        slices += d->nslices;
        sbase += d->svals;
        obase += amx_qspec_stat_cells(s);
    }
}
