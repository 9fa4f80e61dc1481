/*
 * calib.c - the histogram and MSE-search methods (calib.h).
 *
 * Every function reproduces what ModelOpt 0.47 computes on the CPU with
 * torch 2.9, numpy 2.4 and scipy 1.17, rounding for rounding: the
 * docs/NUMERICS.md section "Calibration beyond max" writes each formula
 * out, and tests/modelopt/test_calib_methods.py compares these functions
 * with ModelOpt's own on thousands of histograms. Compiled without FMA
 * contraction (CMakeLists.txt): a multiply-add is fused only where torch's
 * kernel fuses it, with fmaf().
 */
#include "calib.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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
    if (steps == 0)
        return;
    if (steps == 1) {
        out[0] = start; /* linspace_out fills a single step with start */
        return;
    }
    float step = (end - start) / (float)(steps - 1);
    uint32_t halfway = steps / 2;
    for (uint32_t i = 0; i < steps; i++) {
        if (i < halfway) {
            float k = (float)i;
            out[i] = fma ? fmaf(step, k, start) : start + step * k;
        } else {
            float k = (float)(steps - i - 1);
            out[i] = fma ? fmaf(-step, k, end) : end - step * k;
        }
    }
}

/* utils::CeilLog2 of ATen (aten/src/ATen/native/cpu/utils.h). */
static int64_t ceil_log2(int64_t x)
{
    if (x <= 2)
        return 1;
    uint64_t v = (uint64_t)x - 1;
    int64_t bits = 0;
    while (v != 0) {
        bits++;
        v >>= 1;
    }
    return bits;
}

#define MAX_LANES 16

/* multi_row_sum<Vectorized<float>, 4>: rows of 4 vectors of `lanes`
 * floats, row i at x + i * 4 * lanes. */
static void multi_row_sum(const float *x, int64_t size, int lanes, float ret[4][MAX_LANES])
{
    const int64_t num_levels = 4;
    int64_t lp = ceil_log2(size) / num_levels;
    const int64_t level_power = lp > 4 ? lp : 4;
    const int64_t level_step = (int64_t)1 << level_power;
    const int64_t level_mask = level_step - 1;
    float acc[4][4][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    for (; i + level_step <= size;) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++)
                    acc[0][k][l] += x[(i * 4 + k) * lanes + l];
        for (int64_t j = 1; j < num_levels; ++j) {
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            const int64_t mask = level_mask << (j * level_power);
            if ((i & mask) != 0)
                break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++)
                acc[0][k][l] += x[(i * 4 + k) * lanes + l];
    for (int64_t j = 1; j < num_levels; ++j)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++)
                acc[0][k][l] += acc[j][k][l];
    memcpy(ret, acc[0], sizeof(acc[0]));
}

float amx_torch_sum_f32(const float *x, uint64_t n, int lanes)
{
    if (lanes < 1 || lanes > MAX_LANES)
        lanes = 8;
    float out = 0.0f; /* the output tensor, filled with 0 */
    if (n < (uint64_t)lanes) {
        /* Not a vectorized inner sum: scalar_inner_sum's row_sum with
         * ilp 4 over single floats. */
        float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t size_ilp = (int64_t)n / 4;
        for (int64_t i = 0; i < size_ilp; i++) /* short rows: one level */
            for (int k = 0; k < 4; k++)
                p[k] += x[i * 4 + k];
        for (uint64_t i = (uint64_t)size_ilp * 4; i < n; i++)
            p[0] += x[i];
        for (int k = 1; k < 4; k++)
            p[0] += p[k];
        return out + p[0];
    }
    int64_t vec_size = (int64_t)(n / (uint64_t)lanes);
    int64_t size_ilp = vec_size / 4;
    float part[4][MAX_LANES];
    multi_row_sum(x, size_ilp, lanes, part);
    for (int64_t i = size_ilp * 4; i < vec_size; i++)
        for (int l = 0; l < lanes; l++)
            part[0][l] += x[i * lanes + l];
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < lanes; l++)
            part[0][l] += part[k][l];
    float fin = 0.0f;
    for (uint64_t k = (uint64_t)vec_size * (uint64_t)lanes; k < n; k++)
        fin += x[k];
    for (int l = 0; l < lanes; l++)
        fin += part[0][l];
    return out + fin;
}

#define PW_BLOCKSIZE 128

double amx_numpy_sum_f64(const double *a, uint64_t n)
{
    if (n < 8) {
        double res = 0.;
        for (uint64_t i = 0; i < n; i++)
            res += a[i];
        return res;
    }
    if (n <= PW_BLOCKSIZE) {
        double r[8], res;
        for (int j = 0; j < 8; j++)
            r[j] = a[j];
        uint64_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++)
                r[j] += a[i + j];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++)
            res += a[i];
        return res;
    }
    uint64_t n2 = n / 2;
    n2 -= n2 % 8;
    return amx_numpy_sum_f64(a, n2) + amx_numpy_sum_f64(a + n2, n - n2);
}

static int lanes_of(int torch_cpu)
{
    (void)torch_cpu; /* AVX-512 builds run the AVX2 sum kernel (no AVX-512 dispatch) */
    return 8;
}

static int fma_of(int torch_cpu)
{
    return torch_cpu != AMX_TORCH_DEFAULT;
}

/* ---- histograms ---- */

void amx_hist_edges(float g, uint32_t num_bins, int torch_cpu, float *out)
{
    amx_torch_linspace_f32(0.0f, g, num_bins + 1, fma_of(torch_cpu), out);
}

float amx_hist_percentile(const double *counts, uint32_t num_bins, const float *edges,
                          double percentile)
{
    /* total = calib_hist.sum(); cdf = np.cumsum(calib_hist / total) (a
     * running sum, left to right); idx = np.searchsorted(cdf, percentile /
     * 100): the first index whose cdf is not below it, a NaN (total 0)
     * counting as not below. */
    double total = 0.0;
    for (uint32_t i = 0; i < num_bins; i++)
        total += counts[i]; /* integers below 2^53: exact in any order */
    double v = percentile / 100.0, cdf = 0.0;
    uint32_t idx = 0;
    for (; idx < num_bins; idx++) {
        double q = counts[idx] / total;
        cdf = idx == 0 ? q : cdf + q;
        if (!(cdf < v))
            break;
    }
    return edges[idx];
}

size_t amx_hist_scratch(const amx_calib_t *c)
{
    size_t n = (size_t)c->num_bins + 1;
    size_t nb = c->num_bits >= 1 && c->num_bits <= 24
                    ? ((size_t)1 << (c->num_bits - 1 + (c->is_unsigned != 0))) + 1
                    : 1;
    /* entropy: bins (8 n), digitized (4 n), density counts and group sizes
     * (16 nb), new density and reference (16 n), divergences (8 n);
     * mse: counts, centers, quantized, terms (16 n). */
    size_t ent = 8 * n + 4 * n + 16 * nb + 16 * n + 8 * n + 64;
    size_t mse = 16 * n + 64;
    return ent > mse ? ent : mse;
}

/* scipy.special.rel_entr. */
static double rel_entr(double x, double y)
{
    if (isnan(x) || isnan(y))
        return NAN;
    if (x > 0 && y > 0)
        return x * log(x / y);
    if (x == 0 && y >= 0)
        return 0.0;
    return INFINITY;
}

float amx_hist_entropy(const double *counts, uint32_t num_bins, const float *edges,
                       uint32_t num_bits, int is_unsigned, uint32_t stride, uint32_t start_bin,
                       void *scratch)
{
    const uint64_t n = num_bins;
    char *p = scratch;
    double *bins = (double *)(void *)p;
    p += 8 * n;
    int32_t *dig = (int32_t *)(void *)p;
    p += 4 * n;
    const uint64_t nbins = (uint64_t)1 << (num_bits - 1 + (is_unsigned != 0));
    double *ndc = (double *)(void *)p;
    p += 8 * nbins;
    double *cnt = (double *)(void *)p;
    p += 8 * nbins;
    double *nd = (double *)(void *)p;
    p += 8 * n;
    double *ref = (double *)(void *)p;
    p += 8 * n;
    double *vec = ref; /* rel_entr overwrites the normalized reference in place */
    (void)vec;
    for (uint64_t i = 0; i < n; i++)
        bins[i] = counts[i];
    if (n > 1)
        bins[0] = bins[1]; /* bins[0] = bins[1] */
    /* The divergence of each candidate i; the last smallest wins
     * (len - 1 - argmin(divergences[::-1])), and when some divergence is
     * NaN, the last NaN (np.argmin returns the first NaN it meets). */
    double best = 0.0;
    int64_t best_k = -1, last_nan = -1, k = 0;
    double tail = 0.0; /* np.sum(bins[i:]), integers: exact */
    for (uint64_t i = start_bin; i < n; i++)
        tail += bins[i];
    uint64_t i_prev = start_bin;
    for (uint64_t i = start_bin; i <= n; i += stride, k++) {
        for (uint64_t t = i_prev; t < i; t++)
            tail -= bins[t];
        i_prev = i;
        /* space = np.linspace(0, i, nbins + 1) is exact (nbins is a power
         * of two), so np.digitize(j, space) - 1 = floor(j * nbins / i);
         * bins holding 0 are left out (-1). */
        for (uint64_t b = 0; b < nbins; b++)
            ndc[b] = 0.0, cnt[b] = 0.0;
        for (uint64_t j = 0; j < i; j++) {
            if (bins[j] == 0.0) {
                dig[j] = -1;
                continue;
            }
            dig[j] = (int32_t)((j * nbins) / i);
            ndc[dig[j]] += bins[j];
            cnt[dig[j]] += 1.0;
        }
        for (uint64_t b = 0; b < nbins; b++)
            if (cnt[b] != 0.0)
                ndc[b] = ndc[b] / cnt[b];
        for (uint64_t j = 0; j < i; j++)
            nd[j] = dig[j] < 0 ? 0.0 : ndc[dig[j]];
        /* reference_density = bins[:i], the rest of the histogram added to
         * its last bin; scipy.stats.entropy(reference, new): each
         * normalized by its np.sum, rel_entr, np.sum. */
        for (uint64_t j = 0; j < i; j++)
            ref[j] = bins[j];
        ref[i - 1] += tail;
        double psum = amx_numpy_sum_f64(ref, i);
        double qsum = amx_numpy_sum_f64(nd, i);
        for (uint64_t j = 0; j < i; j++)
            ref[j] = rel_entr(ref[j] / psum, nd[j] / qsum);
        double d = amx_numpy_sum_f64(ref, i);
        if (isnan(d))
            last_nan = k;
        else if (best_k < 0 || d <= best)
            best = d, best_k = k;
    }
    if (last_nan >= 0)
        best_k = last_nan;
    return edges[(uint64_t)best_k * stride + start_bin];
}

/* ModelOpt's _tensor_quant(x, amax, num_bits, unsigned, narrow_range=True)
 * on CPU float32 tensors, for one element: scale = max_bound / amax (0
 * when amax <= 2^-24, then 1 for the division back), round half to even,
 * clamp, divide. */
static float fake_quant_int(float x, float amax, float max_bound, float min_bound, int tiny)
{
    float scale = tiny ? 0.0f : max_bound / amax;
    float q = rintf(x * scale);
    q = q < min_bound ? min_bound : q;
    q = q > max_bound ? max_bound : q;
    return q / (tiny ? 1.0f : scale);
}

/* ModelOpt's fp8_eager (tensor_quant.py; what scaled_e4m3 runs on CPU
 * tensors): x * scale clamped to [-448, 448], cast to float8_e4m3fn
 * (round to nearest even), times scale_inv (the caller makes both). */
static float fake_quant_e4m3(float x, float scale, float scale_inv)
{
    float v = x * scale;
    v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
    return amx_e4m3_to_float(amx_e4m3_from_float(v)) * scale_inv;
}

float amx_hist_mse(const double *counts, uint32_t num_bins, const float *edges, int grid,
                   uint32_t num_bits, int is_unsigned, uint32_t stride, uint32_t start_bin,
                   int torch_cpu, void *scratch)
{
    const uint64_t n = num_bins;
    float *cnt = (float *)scratch, *centers = cnt + n, *term = centers + n;
    /* counts = torch.from_numpy(calib_hist).float(); centers = (edges[1:]
     * + edges[:-1]) / 2, all float32. */
    for (uint64_t j = 0; j < n; j++) {
        cnt[j] = (float)counts[j];
        centers[j] = (edges[j + 1] + edges[j]) / 2.0f;
    }
    float max_bound = (float)(ldexp(1.0, (int)num_bits - 1 + (is_unsigned != 0)) - 1.0);
    float min_bound = is_unsigned ? 0.0f : -max_bound;
    const float eps = 1.0f / (float)(1 << 24);
    int lanes = lanes_of(torch_cpu);
    float best = 0.0f;
    int64_t best_i = -1;
    int best_nan = 0;
    for (uint64_t i = start_bin; i < n; i += stride) {
        float amax = centers[i];
        int tiny = amax <= eps;
        /* fp8_eager's `448.0 / safe_amax` and `1 / scale` are a Python
         * number divided by a tensor: torch's Tensor.__rdiv__,
         * reciprocal() * number (two roundings for the first). */
        float scale = (1.0f / (amax <= eps ? 1.0f : amax)) * 448.0f, scale_inv = 1.0f / scale;
        for (uint64_t j = 0; j < n; j++) {
            float qc = grid == AMX_GRID_E4M3
                           ? fake_quant_e4m3(centers[j], scale, scale_inv)
                           : fake_quant_int(centers[j], amax, max_bound, min_bound, tiny);
            float d = qc - centers[j];
            term[j] = (d * d) * cnt[j];
        }
        /* ((quant_centers - centers) ** 2 * counts).mean(): torch's CPU
         * mean is sum(...).div_(numel). */
        float mse = amx_torch_sum_f32(term, n, lanes) / (float)n;
        /* np.argmin over the losses: the first smallest, or the first NaN. */
        if (best_nan)
            continue;
        if (isnan(mse)) {
            best_nan = 1;
            best_i = (int64_t)i;
        } else if (best_i < 0 || mse < best) {
            best = mse;
            best_i = (int64_t)i;
        }
    }
    return centers[best_i];
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
                           fma_of(c->torch_cpu), out);
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
