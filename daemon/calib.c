/*
 * calib.c - the histogram and MSE-search methods (calib.h).
 *
 * Every function reproduces what ModelOpt 0.47 computes on the CPU with
 * torch 2.9, numpy 2.4 and scipy 1.17, rounding for rounding: the
 * docs/NUMERICS.md section "Calibration beyond max" writes each formula
 * out, and tests/modelopt/test_calib_methods.py compares these functions
 * with ModelOpt's own on thousands of histograms. The histogram methods'
 * arithmetic is calib_core.h, which the CUDA backend runs too. Compiled
 * without FMA contraction (CMakeLists.txt): a multiply-add is fused only
 * where torch's kernel fuses it, with fmaf().
 */
#include "calib.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "calib_core.h"
#include "recipe.h"

uint64_t amx_calib_stat_values(const amx_calib_t *c, uint64_t ncells)
{
    if (c->kind == AMX_CAL_HISTOGRAM)
        return (uint64_t)c->num_bins + 1;
    if (c->kind == AMX_CAL_MSE)
        return (uint64_t)c->nsteps * ncells;
    if (c->kind == AMX_CAL_NVFP4_MSE)
        return ncells;
    return 0;
}

const char *amx_calib_kind_name(int kind)
{
    return kind == AMX_CAL_HISTOGRAM   ? "histogram"
           : kind == AMX_CAL_MSE       ? "mse"
           : kind == AMX_CAL_NVFP4_MSE ? "nvfp4_mse"
                                       : "max";
}

int amx_calib_equal(const amx_calib_t *a, const amx_calib_t *b)
{
    return a->kind == b->kind && a->method == b->method && a->grid == b->grid &&
           a->is_unsigned == b->is_unsigned && a->skip_zeros == b->skip_zeros &&
           a->torch_cpu == b->torch_cpu && a->num_bins == b->num_bins &&
           a->num_bits == b->num_bits && a->start_bin == b->start_bin && a->stride == b->stride &&
           a->nsteps == b->nsteps && a->percentile == b->percentile &&
           a->start_mult == b->start_mult && a->stop_mult == b->stop_mult &&
           a->step_size == b->step_size;
}

/* ---- torch and numpy primitives ---- */

void amx_torch_linspace_f32(float start, float end, uint32_t steps, int fma, float *out)
{
    for (uint32_t i = 0; i < steps; i++)
        out[i] = amx__linspace_at(start, end, steps, fma, i);
}

float amx_torch_sum_f32(const float *x, uint64_t n, int lanes)
{
    amx__f32src_t s = {x, NULL};
    return amx__torch_sum_f32(&s, n, lanes);
}

double amx_numpy_sum_f64(const double *a, uint64_t n)
{
    if (n >> 38 != 0) /* beyond calib_core.h's stack: halves first, as numpy */
    {
        uint64_t n2 = n / 2;
        n2 -= n2 % 8;
        return amx_numpy_sum_f64(a, n2) + amx_numpy_sum_f64(a + n2, n - n2);
    }
    amx__ent_t e;
    memset(&e, 0, sizeof(e));
    e.x = a;
    return amx__pairwise(&e, AMX__ARR, 0, n);
}

/* ---- histograms ---- */

void amx_hist_edges(float g, uint32_t num_bins, int torch_cpu, float *out)
{
    amx_torch_linspace_f32(0.0f, g, num_bins + 1, amx__torch_fma(torch_cpu), out);
}

float amx_hist_percentile(const double *counts, uint32_t num_bins, const float *edges,
                          double percentile)
{
    return edges[amx__percentile_idx(counts, num_bins, percentile)];
}

size_t amx_hist_scratch(const amx_calib_t *c)
{
    /* The methods read their terms from the histogram as they add them
     * (calib_core.h): no per-candidate arrays. */
    (void)c;
    return 64;
}

float amx_hist_entropy(const double *counts, uint32_t num_bins, const float *edges,
                       uint32_t num_bits, int is_unsigned, uint32_t stride, uint32_t start_bin,
                       void *scratch)
{
    (void)scratch;
    const uint64_t nbins = (uint64_t)1 << (num_bits - 1 + (is_unsigned != 0));
    /* The divergence of each candidate i; the last smallest wins, or the
     * last NaN. */
    amx__pick_t p;
    amx__pick_init(&p, 1);
    int64_t k = 0;
    double tail = amx__ent_tail(counts, num_bins, start_bin, start_bin);
    for (uint64_t i = start_bin; i <= num_bins; i += stride, k++) {
        amx__pick_add(&p, k, amx__ent_divergence(counts, num_bins, i, nbins, tail, NULL));
        tail = amx__ent_tail_step(counts, num_bins, i, i + stride, tail);
    }
    return edges[(uint64_t)amx__pick_result(&p) * stride + start_bin];
}

float amx_hist_mse(const double *counts, uint32_t num_bins, const float *edges, int grid,
                   uint32_t num_bits, int is_unsigned, uint32_t stride, uint32_t start_bin,
                   int torch_cpu, void *scratch)
{
    (void)scratch;
    /* The loss of each candidate centers[i]; the first smallest wins, or
     * the first NaN (np.argmin). */
    amx__pick_t p;
    amx__pick_init(&p, 0);
    for (uint64_t i = start_bin; i < num_bins; i += stride)
        amx__pick_add(&p, (int64_t)i,
                      amx__hmse_loss(counts, num_bins, edges, i, grid, num_bits, is_unsigned,
                                     amx__torch_lanes(torch_cpu)));
    int64_t best = amx__pick_result(&p);
    return best < 0 ? NAN : amx__center(edges, (uint64_t)best);
}

float amx_hist_amax(const amx_calib_t *c, const double *counts, float g, void *scratch)
{
    if (!(g > 0.0f))
        return 0.0f;
    float *edges = malloc(((size_t)c->num_bins + 1) * sizeof(float));
    if (edges == NULL)
        return NAN;
    amx_hist_edges(g, c->num_bins, c->torch_cpu, edges);
    float a;
    switch (c->method) {
    case AMX_HM_PERCENTILE:
        a = amx_hist_percentile(counts, c->num_bins, edges, c->percentile);
        break;
    case AMX_HM_ENTROPY:
        a = amx_hist_entropy(counts, c->num_bins, edges, c->num_bits, c->is_unsigned, c->stride,
                             c->start_bin, scratch);
        break;
    default:
        a = amx_hist_mse(counts, c->num_bins, edges, c->grid, c->num_bits, c->is_unsigned,
                         c->stride, c->start_bin, c->torch_cpu, scratch);
        break;
    }
    free(edges);
    return a;
}

/* ---- MSE search ---- */

uint64_t amx_mse_nsteps(double start, double stop, double step)
{
    if (!isfinite(start) || !isfinite(stop) || !isfinite(step) || !(step > 0.0) || stop < start)
        return 0;
    double q = ceil((stop - start) / step);
    if (!(q >= 0.0) || q > (double)AMX_MSE_MAX_STEPS)
        return 0;
    return (uint64_t)q + 1;
}

void amx_mse_candidates(const amx_calib_t *c, float *out)
{
    amx_torch_linspace_f32((float)c->start_mult, (float)c->stop_mult, c->nsteps,
                           amx__torch_fma(c->torch_cpu), out);
}

uint32_t amx_mse_argmin(const double *loss, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t k = 1; k < n; k++)
        if (loss[k] < loss[best])
            best = k;
    return best;
}

/* ---- NVFP4 per-block search ---- */

/* FP8 E4M3 (fn) byte b in 1..126 as float: exponent field e = b >> 3,
 * mantissa m = b & 7; subnormal (e 0) m * 2^-9, else (8 + m) * 2^(e - 10).
 * Byte 127 is NaN. */
static float e4m3_value(unsigned b)
{
    unsigned e = b >> 3, m = b & 7u;
    return e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8u + m), (int)e - 10);
}

void amx_nvfp4_mse_candidates(float *out)
{
    for (unsigned b = 1; b <= AMX_NVFP4_MSE_STEPS; b++) {
        out[b - 1] = e4m3_value(b) / 448.0f; /* float32, as torch divides */
    }
}

int amx_nvfp4_mse_index(const float *c, float g, double v)
{
    if (!(v >= 0.0) || (double)(float)v != v)
        return -1;
    /* g * c_k is non-decreasing in k (c increases, g >= 0, rounding is
     * monotone): the first k whose product is >= v. */
    uint32_t lo = 0, hi = AMX_NVFP4_MSE_STEPS;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if ((double)(g * c[mid]) < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == AMX_NVFP4_MSE_STEPS)
        return -1;
    return (double)(g * c[lo]) == v ? (int)lo : -1;
}
