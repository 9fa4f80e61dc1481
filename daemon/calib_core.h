/*
 * calib_core.h - the arithmetic of the histogram methods (calib.h), one
 * source for the host (calib.c) and the CUDA backend (cuda/calib_cuda.cu):
 * the same IEEE operations in the same order on both, so that they give
 * the same bits. The host compiles it without FMA contraction
 * (-ffp-contract=off), nvcc with --fmad=false; a multiply-add is fused
 * only where torch fuses it, with an explicit fmaf(), which both round
 * once. docs/NUMERICS.md ("Calibration beyond max") writes every formula
 * out; calib.c names the ModelOpt, torch, numpy and scipy sources.
 *
 * The methods are split per candidate (a bin edge the method may choose),
 * so that the device can give each candidate a thread: the divergence or
 * loss of candidate i depends on the histogram and i alone, and a picker
 * applies ModelOpt's rule (numpy's argmin) over them in candidate order.
 * Sums over a histogram read their terms from a source (an array, or the
 * terms of one candidate computed on the fly) in the order the reference
 * adds them, so that no per-candidate scratch array is needed.
 *
 * One exception to "the same bits": the entropy's log is the C library's
 * on the host (as scipy's rel_entr calls it) and CUDA's on the device,
 * which differ by up to about 1.5 ulp; amx__ent_divergence returns a bound
 * for the device to decide only where that cannot change the choice
 * (cuda/calib_cuda.cu, docs/NUMERICS.md "The methods on the GPU").
 *
 * Pure functions, no state: any thread.
 */
#ifndef AMX_CALIB_CORE_H
#define AMX_CALIB_CORE_H

#include <math.h>
#include <stdint.h>

#include "calib.h"
#include "recipe.h" /* AMX_HD, E4M3 */

/* ---- the torch CPU build ---- */

/* The lanes of torch's float32 sum: 8 on every x86-64 build (AVX-512
 * builds run the AVX2 sum kernel: no AVX-512 dispatch). */
AMX_HD int amx__torch_lanes(int torch_cpu)
{
    (void)torch_cpu;
    return 8;
}

/* Whether the build contracts linspace's multiply-adds (AVX2, AVX-512). */
AMX_HD int amx__torch_fma(int torch_cpu)
{
    return torch_cpu != AMX_TORCH_DEFAULT;
}

/* ---- torch.linspace, element by element ---- */

/* Element i of torch.linspace(start, end, steps) in float32 (calib.h
 * amx_torch_linspace_f32); steps >= 1, i < steps. */
AMX_HD float amx__linspace_at(float start, float end, uint32_t steps, int fma, uint32_t i)
{
    if (steps == 1)
        return start; /* linspace_out fills a single step with start */
    float step = (end - start) / (float)(steps - 1);
    if (i < steps / 2) {
        float k = (float)i;
        return fma ? fmaf(step, k, start) : start + step * k;
    }
    float k = (float)(steps - i - 1);
    return fma ? fmaf(-step, k, end) : end - step * k;
}

/* ---- the terms of a histogram MSE candidate (_compute_amax_mse) ---- */

typedef struct amx__hmse {
    const double *counts; /* num_bins counts */
    const float *edges;   /* num_bins + 1 edges */
    float amax, scale, scale_inv, max_bound, min_bound;
    int tiny, grid;
} amx__hmse_t;

/* centers = (edges[1:] + edges[:-1]) / 2, float32. */
AMX_HD float amx__center(const float *edges, uint64_t j)
{
    return (edges[j + 1] + edges[j]) / 2.0f;
}

/* Candidate i: amax = centers[i], the grid's scale (calib.c names each
 * step's source). */
AMX_HD void amx__hmse_init(amx__hmse_t *m, const double *counts, const float *edges, uint64_t i,
                           int grid, uint32_t num_bits, int is_unsigned)
{
    const float eps = 1.0f / (float)(1 << 24);
    m->counts = counts;
    m->edges = edges;
    m->grid = grid;
    m->amax = amx__center(edges, i);
    m->tiny = m->amax <= eps;
    /* fp8_eager's `448.0 / safe_amax` and `1 / scale` are a Python number
     * divided by a tensor: torch's Tensor.__rdiv__, reciprocal() * number
     * (two roundings for the first). */
    m->scale = (1.0f / (m->tiny ? 1.0f : m->amax)) * 448.0f;
    m->scale_inv = 1.0f / m->scale;
    m->max_bound = (float)(ldexp(1.0, (int)num_bits - 1 + (is_unsigned != 0)) - 1.0);
    m->min_bound = is_unsigned ? 0.0f : -m->max_bound;
}

/* ((quant(centers) - centers) ** 2 * counts)[j]. The integer grid is
 * ModelOpt's _tensor_quant(narrow_range) on CPU float32 tensors (scale 0
 * when amax <= 2^-24, then 1 for the division back; round half to even);
 * the E4M3 grid its fp8_eager (clamp to +-448, float8_e4m3fn, times
 * scale_inv). */
AMX_HD float amx__hmse_term(const amx__hmse_t *m, uint64_t j)
{
    float c = amx__center(m->edges, j), qc;
    if (m->grid == AMX_GRID_E4M3) {
        float v = c * m->scale;
        v = v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
        qc = amx_e4m3_to_float(amx_e4m3_from_float(v)) * m->scale_inv;
    } else {
        float scale = m->tiny ? 0.0f : m->max_bound / m->amax;
        float q = rintf(c * scale);
        q = q < m->min_bound ? m->min_bound : q;
        q = q > m->max_bound ? m->max_bound : q;
        qc = q / (m->tiny ? 1.0f : scale);
    }
    float d = qc - c;
    return (d * d) * (float)m->counts[j];
}

/* ---- torch's CPU float32 sum (cascade_sum) over a source ---- */

/* The floats a sum adds: x[k], or (m != NULL) the MSE terms of m. */
typedef struct amx__f32src {
    const float *x;
    const amx__hmse_t *m;
} amx__f32src_t;

AMX_HD float amx__f32_at(const amx__f32src_t *s, uint64_t k)
{
    return s->m != 0 ? amx__hmse_term(s->m, k) : s->x[k];
}

/* Every torch build sums 8 lanes (amx__torch_lanes); 8 at most keeps a
 * thread's accumulators at 512 bytes. */
#define AMX__MAX_LANES 8

/* utils::CeilLog2 of ATen (aten/src/ATen/native/cpu/utils.h). */
AMX_HD int64_t amx__ceil_log2(int64_t x)
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

/* multi_row_sum<Vectorized<float>, 4>: rows of 4 vectors of `lanes`
 * floats, row i at i * 4 * lanes. */
AMX_HD void amx__multi_row_sum(const amx__f32src_t *s, int64_t size, int lanes,
                               float ret[4][AMX__MAX_LANES])
{
    const int64_t num_levels = 4;
    int64_t lp = amx__ceil_log2(size) / num_levels;
    const int64_t level_power = lp > 4 ? lp : 4;
    const int64_t level_step = (int64_t)1 << level_power;
    const int64_t level_mask = level_step - 1;
    float acc[4][4][AMX__MAX_LANES];
    for (int a = 0; a < 4; a++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < AMX__MAX_LANES; l++)
                acc[a][k][l] = 0.0f;
    int64_t i = 0;
    for (; i + level_step <= size;) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < lanes; l++)
                    acc[0][k][l] += amx__f32_at(s, (uint64_t)((i * 4 + k) * lanes + l));
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
                acc[0][k][l] += amx__f32_at(s, (uint64_t)((i * 4 + k) * lanes + l));
    for (int64_t j = 1; j < num_levels; ++j)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < lanes; l++)
                acc[0][k][l] += acc[j][k][l];
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < AMX__MAX_LANES; l++)
            ret[k][l] = acc[0][k][l];
}

/* calib.h amx_torch_sum_f32, over a source. */
AMX_HD float amx__torch_sum_f32(const amx__f32src_t *s, uint64_t n, int lanes)
{
    if (lanes < 1 || lanes > AMX__MAX_LANES)
        lanes = 8;
    float out = 0.0f; /* the output tensor, filled with 0 */
    if (n < (uint64_t)lanes) {
        /* Not a vectorized inner sum: scalar_inner_sum's row_sum with
         * ilp 4 over single floats. */
        float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t size_ilp = (int64_t)n / 4;
        for (int64_t i = 0; i < size_ilp; i++) /* short rows: one level */
            for (int k = 0; k < 4; k++)
                p[k] += amx__f32_at(s, (uint64_t)(i * 4 + k));
        for (uint64_t i = (uint64_t)size_ilp * 4; i < n; i++)
            p[0] += amx__f32_at(s, i);
        for (int k = 1; k < 4; k++)
            p[0] += p[k];
        return out + p[0];
    }
    int64_t vec_size = (int64_t)(n / (uint64_t)lanes);
    int64_t size_ilp = vec_size / 4;
    float part[4][AMX__MAX_LANES];
    amx__multi_row_sum(s, size_ilp, lanes, part);
    for (int64_t i = size_ilp * 4; i < vec_size; i++)
        for (int l = 0; l < lanes; l++)
            part[0][l] += amx__f32_at(s, (uint64_t)(i * lanes + l));
    for (int k = 1; k < 4; k++)
        for (int l = 0; l < lanes; l++)
            part[0][l] += part[k][l];
    float fin = 0.0f;
    for (uint64_t k = (uint64_t)vec_size * (uint64_t)lanes; k < n; k++)
        fin += amx__f32_at(s, k);
    for (int l = 0; l < lanes; l++)
        fin += part[0][l];
    return out + fin;
}

/* The loss of histogram MSE candidate i: ((...) ** 2 * counts).mean(),
 * torch's CPU mean being sum(...).div_(numel). */
AMX_HD float amx__hmse_loss(const double *counts, uint32_t num_bins, const float *edges, uint64_t i,
                            int grid, uint32_t num_bits, int is_unsigned, int lanes)
{
    amx__hmse_t m;
    amx__hmse_init(&m, counts, edges, i, grid, num_bits, is_unsigned);
    amx__f32src_t s = {0, &m};
    return amx__torch_sum_f32(&s, num_bins, lanes) / (float)num_bins;
}

/* ---- numpy's pairwise float64 sum over a source ---- */

/* What a pairwise sum adds: an array, or one of the three sequences of an
 * entropy candidate (its reference density, its quantized density, their
 * rel_entr terms). */
enum { AMX__ARR = 0, AMX__REF = 1, AMX__ND = 2, AMX__REL = 3 };

typedef struct amx__ent {
    const double *x;      /* AMX__ARR */
    const double *counts; /* the histogram (bins[0] reads counts[1]) */
    uint64_t n, i, nbins; /* bins, the candidate, quantized bins */
    double tail;          /* np.sum(bins[i:]) as calib.c adds it */
    double psum, qsum;    /* the sums of ref and nd (for AMX__REL) */
    double abs_sum;       /* AMX__REL: the sum of |term| (a bound, any order) */
    uint64_t g_lo, g_hi;  /* the bins of the quantized bin whose mean gv holds, */
    double gv;            /* valid when g_ok */
    int g_ok;
} amx__ent_t;

/* bins = counts with bins[0] = bins[1] (_compute_amax_entropy). */
AMX_HD double amx__ent_bin(const amx__ent_t *e, uint64_t j)
{
    return j == 0 && e->n > 1 ? e->counts[1] : e->counts[j];
}

/* new_density[j] of candidate i: np.linspace(0, i, nbins + 1) is exact
 * (nbins a power of two), so np.digitize(j, space) - 1 = floor(j * nbins /
 * i) = d: the bins j < i of d are [ceil(d i / nbins), ceil((d + 1) i /
 * nbins)); a nonzero bin takes the mean of its group's nonzero bins (added
 * in bin order), a zero bin 0. */
AMX_HD double amx__ent_nd(amx__ent_t *e, uint64_t j)
{
    if (amx__ent_bin(e, j) == 0.0)
        return 0.0;
    if (!e->g_ok || j < e->g_lo || j >= e->g_hi) {
        uint64_t d = (j * e->nbins) / e->i;
        uint64_t lo = (d * e->i + e->nbins - 1) / e->nbins;
        uint64_t hi = ((d + 1) * e->i + e->nbins - 1) / e->nbins;
        hi = hi < e->i ? hi : e->i;
        double sum = 0.0, cnt = 0.0;
        for (uint64_t u = lo; u < hi; u++) {
            double b = amx__ent_bin(e, u);
            if (b != 0.0) {
                sum += b;
                cnt += 1.0;
            }
        }
        e->g_lo = lo;
        e->g_hi = hi;
        e->gv = sum / cnt; /* cnt >= 1: bin j is in the group */
        e->g_ok = 1;
    }
    return e->gv;
}

/* scipy.special.rel_entr. `log` is the C library's on the host, CUDA's on
 * the device (see the top of this file). */
AMX_HD double amx__rel_entr(double x, double y)
{
    if (isnan(x) || isnan(y))
        return NAN;
    if (x > 0 && y > 0)
        return x * log(x / y);
    if (x == 0 && y >= 0)
        return 0.0;
    return INFINITY;
}

AMX_HD double amx__ent_at(amx__ent_t *e, int which, uint64_t j)
{
    if (which == AMX__ARR)
        return e->x[j];
    /* reference_density = bins[:i], the rest of the histogram added to its
     * last bin. */
    double ref = j + 1 == e->i ? amx__ent_bin(e, j) + e->tail : amx__ent_bin(e, j);
    if (which == AMX__REF)
        return ref;
    if (which == AMX__ND)
        return amx__ent_nd(e, j);
    double t = amx__rel_entr(ref / e->psum, amx__ent_nd(e, j) / e->qsum);
    e->abs_sum += fabs(t);
    return t;
}

#define AMX__PW_BLOCKSIZE 128

/* numpy/_core/src/umath/loops_utils.h.src pairwise_sum on a range of at
 * most PW_BLOCKSIZE values. */
AMX_HD double amx__pairwise_leaf(amx__ent_t *e, int which, uint64_t lo, uint64_t n)
{
    if (n < 8) {
        double res = 0.;
        for (uint64_t i = 0; i < n; i++)
            res += amx__ent_at(e, which, lo + i);
        return res;
    }
    double r[8], res;
    for (int j = 0; j < 8; j++)
        r[j] = amx__ent_at(e, which, lo + (uint64_t)j);
    uint64_t i;
    for (i = 8; i < n - (n % 8); i += 8)
        for (int j = 0; j < 8; j++)
            r[j] += amx__ent_at(e, which, lo + i + (uint64_t)j);
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++)
        res += amx__ent_at(e, which, lo + i);
    return res;
}

/* pairwise_sum: above PW_BLOCKSIZE, the sum of the first n2 = n / 2 less
 * n2 % 8 values plus the sum of the rest, recursively; evaluated here
 * with an explicit stack (device code), left before right, as the
 * recursion adds. AMX__PW_DEPTH levels: n up to 2^38 values (the stack
 * stays below CUDA's default 1 KiB per thread). */
#define AMX__PW_DEPTH 32
AMX_HD double amx__pairwise(amx__ent_t *e, int which, uint64_t lo, uint64_t n)
{
    uint64_t flo[AMX__PW_DEPTH], fn[AMX__PW_DEPTH];
    double fleft[AMX__PW_DEPTH];
    int fstate[AMX__PW_DEPTH]; /* 0: new, 1: waits for its left half, 2: for its right half */
    int sp = 0;
    flo[0] = lo, fn[0] = n, fstate[0] = 0;
    for (;;) {
        if (fn[sp] > AMX__PW_BLOCKSIZE) { /* split: the left half first */
            uint64_t n2 = fn[sp] / 2;
            n2 -= n2 % 8;
            fstate[sp] = 1;
            flo[sp + 1] = flo[sp], fn[sp + 1] = n2, fstate[sp + 1] = 0;
            sp++;
            continue;
        }
        double ret = amx__pairwise_leaf(e, which, flo[sp], fn[sp]);
        for (;;) { /* hand the sum to the frames waiting for it */
            if (sp == 0)
                return ret;
            sp--;
            if (fstate[sp] == 1) {
                uint64_t n2 = fn[sp] / 2;
                n2 -= n2 % 8;
                fleft[sp] = ret;
                fstate[sp] = 2;
                flo[sp + 1] = flo[sp] + n2, fn[sp + 1] = fn[sp] - n2, fstate[sp + 1] = 0;
                sp++;
                break;
            }
            ret = fleft[sp] + ret;
        }
    }
}

/* ---- the entropy method, one candidate (_compute_amax_entropy) ---- */

/* np.sum(bins[i:]) of candidate i as calib.c adds it: the integers of
 * bins[start_bin:] added in order, then those below i subtracted in order
 * (exact below 2^53). The host steps it from candidate to candidate
 * (amx__ent_tail_step), which is the same operations in the same order. */
AMX_HD double amx__ent_tail_step(const double *counts, uint64_t n, uint64_t from, uint64_t to,
                                 double tail)
{
    amx__ent_t e;
    e.counts = counts;
    e.n = n;
    for (uint64_t u = from; u < to && u < n; u++)
        tail -= amx__ent_bin(&e, u);
    return tail;
}

AMX_HD double amx__ent_tail(const double *counts, uint64_t n, uint32_t start_bin, uint64_t i)
{
    amx__ent_t e;
    e.counts = counts;
    e.n = n;
    double tail = 0.0;
    for (uint64_t u = start_bin; u < n; u++)
        tail += amx__ent_bin(&e, u);
    return amx__ent_tail_step(counts, n, start_bin, i, tail);
}

/*
 * The KL divergence scipy.stats.entropy(reference, new) of candidate i
 * (1 <= i <= n) of the histogram `counts` (n bins) with nbins =
 * 2^(num_bits - 1 + unsigned) quantized bins and `tail` =
 * amx__ent_tail(..., i): each density normalized by its np.sum,
 * rel_entr, np.sum. *abs_sum (when not NULL) gets the sum of the terms'
 * magnitudes (the device's bound).
 */
AMX_HD double amx__ent_divergence(const double *counts, uint64_t n, uint64_t i, uint64_t nbins,
                                  double tail, double *abs_sum)
{
    amx__ent_t e;
    e.x = 0;
    e.counts = counts;
    e.n = n;
    e.i = i;
    e.nbins = nbins;
    e.g_ok = 0;
    e.g_lo = e.g_hi = 0;
    e.gv = 0.0;
    e.abs_sum = 0.0;
    e.tail = tail;
    e.psum = amx__pairwise(&e, AMX__REF, 0, i);
    e.qsum = amx__pairwise(&e, AMX__ND, 0, i);
    double d = amx__pairwise(&e, AMX__REL, 0, i);
    if (abs_sum != 0)
        *abs_sum = e.abs_sum;
    return d;
}

/* ---- percentile (_compute_amax_percentile) ---- */

/* total = calib_hist.sum(); cdf = np.cumsum(calib_hist / total) (a running
 * sum, left to right); idx = np.searchsorted(cdf, percentile / 100): the
 * first index whose cdf is not below it, a NaN (total 0) counting as not
 * below; num_bins when none. */
AMX_HD uint32_t amx__percentile_idx(const double *counts, uint32_t num_bins, double percentile)
{
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
    return idx;
}

/* ---- picking a candidate ---- */

/* numpy's argmin over candidates fed in order: the first smallest, or the
 * first NaN (`last` = 0, _compute_amax_mse); or the last smallest, or the
 * last NaN (`last` = 1: len - 1 - argmin of the reversed divergences,
 * _compute_amax_entropy). */
typedef struct amx__pick {
    int64_t k, nan_k;
    double best;
    int last;
} amx__pick_t;

AMX_HD void amx__pick_init(amx__pick_t *p, int last)
{
    p->k = -1;
    p->nan_k = -1;
    p->best = 0.0;
    p->last = last;
}

AMX_HD void amx__pick_add(amx__pick_t *p, int64_t k, double v)
{
    if (isnan(v)) {
        if (p->last || p->nan_k < 0)
            p->nan_k = k;
    } else if (p->k < 0 || (p->last ? v <= p->best : v < p->best)) {
        p->best = v;
        p->k = k;
    }
}

/* The picked candidate (-1 when none was added). */
AMX_HD int64_t amx__pick_result(const amx__pick_t *p)
{
    return p->nan_k >= 0 ? p->nan_k : p->k;
}

/* ---- one quantizer's method, split as a device runs it ---- */

/* The candidates the method tries: entropy start_bin..num_bins, MSE
 * start_bin..num_bins - 1, by stride; percentile none. */
AMX_HD uint32_t amx__hist_ncand(const amx_calib_t *c)
{
    if (c->method == AMX_HM_ENTROPY)
        return c->start_bin <= c->num_bins ? (c->num_bins - c->start_bin) / c->stride + 1 : 0;
    if (c->method == AMX_HM_MSE)
        return c->start_bin < c->num_bins ? (c->num_bins - 1 - c->start_bin) / c->stride + 1 : 0;
    return 0;
}

/* Candidate k (< amx__hist_ncand) of an entropy quantizer: its
 * divergence, *mag the sum of its terms' magnitudes. */
AMX_HD double amx__hist_cand_entropy(const amx_calib_t *c, const double *counts, uint32_t k,
                                     double *mag)
{
    uint64_t i = (uint64_t)c->start_bin + (uint64_t)k * c->stride;
    uint64_t nbins = (uint64_t)1 << (c->num_bits - 1 + (c->is_unsigned != 0));
    double tail = amx__ent_tail(counts, c->num_bins, c->start_bin, i);
    return amx__ent_divergence(counts, c->num_bins, i, nbins, tail, mag);
}

/* Candidate k of a histogram MSE quantizer: its loss. */
AMX_HD double amx__hist_cand_mse(const amx_calib_t *c, const double *counts, const float *edges,
                                 uint32_t k)
{
    uint64_t i = (uint64_t)c->start_bin + (uint64_t)k * c->stride;
    return (double)amx__hmse_loss(counts, c->num_bins, edges, i, c->grid, c->num_bits,
                                  c->is_unsigned, amx__torch_lanes(c->torch_cpu));
}

/*
 * Whether entropy candidate w, picked from divergences `val` whose log may
 * differ from the host's (CUDA's against the C library's), is the host's
 * pick too: its margin over every other candidate k beyond (mag_k +
 * mag_w) * 2^-45, more than 3 times the most the two logs can move a
 * divergence (cuda/calib_cuda.cu derives the bound). NaN and +inf picks
 * involve no log.
 */
AMX_HD int amx__entropy_sure(const double *val, const double *mag, uint32_t n, int64_t w)
{
    if (isnan(val[w]) || isinf(val[w]))
        return 1;
    for (uint32_t k = 0; k < n; k++) {
        if ((int64_t)k == w || isinf(val[k]))
            continue;
        double diff = val[k] - val[w], m = (mag[k] + mag[w]) * 0x1p-45;
        /* The host keeps w over an earlier candidate it ties with, and
         * over a later one only when strictly below it. */
        if ((int64_t)k < w ? !(diff >= m) : !(diff > m))
            return 0;
    }
    return 1;
}

/* The amax of a histogram quantizer with range top g from its candidates'
 * values (amx__hist_cand, n = amx__hist_ncand) and its edges: ModelOpt's
 * pick; percentile from the counts. NaN when an entropy pick is not sure
 * (`sure_check`: the values came from another log than the host's). */
AMX_HD float amx__hist_pick(const amx_calib_t *c, float g, const double *counts, const float *edges,
                            const double *val, const double *mag, int sure_check)
{
    if (!(g > 0.0f))
        return 0.0f; /* amx_hist_amax: every edge is 0 */
    if (c->method == AMX_HM_PERCENTILE)
        return edges[amx__percentile_idx(counts, c->num_bins, c->percentile)];
    uint32_t n = amx__hist_ncand(c);
    amx__pick_t p;
    amx__pick_init(&p, c->method == AMX_HM_ENTROPY);
    for (uint32_t k = 0; k < n; k++)
        amx__pick_add(&p, k, val[k]);
    int64_t w = amx__pick_result(&p);
    if (w < 0)
        return NAN;
    uint64_t i = (uint64_t)c->start_bin + (uint64_t)w * c->stride;
    if (c->method == AMX_HM_ENTROPY)
        return !sure_check || amx__entropy_sure(val, mag, n, w) ? edges[i] : NAN;
    return amx__center(edges, i);
}

#endif
