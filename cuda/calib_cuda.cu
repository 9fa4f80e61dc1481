/*
 * calib_cuda.cu - the histogram methods (entropy, percentile, MSE) on the
 * device, where the CUDA backend keeps the summed counts (calib_cuda.h).
 *
 * The arithmetic is calib_core.h, the host's own source, compiled with
 * --fmad=false (CMakeLists.txt): the same IEEE operations in the same
 * order give the same bits. Four launches per call, each quantizer a
 * block: its bin edges (torch.linspace, one thread per edge); its
 * candidates' divergences (entropy) or losses (MSE), one thread per
 * candidate, each summing over the histogram as the host does; then one
 * thread per quantizer picks the candidate by ModelOpt's rule, in
 * candidate order.
 * Percentile runs in that last thread (one pass over the bins).
 *
 * Entropy is the exception (docs/NUMERICS.md, "The methods on the GPU"):
 * its log is CUDA's here (at most 1 ulp from the exact value) and the C
 * library's on the host (glibc: at most 0.52 ulp), so a divergence may
 * differ from the host's in its last bits. Everything else in it is
 * exact-order arithmetic, which bounds that difference: each term p log x
 * differs by at most about 2.6 ulp of itself, and numpy's pairwise sum
 * passes each term through at most 34 roundings (16 in a lane, 3 joining
 * the lanes, 7 for the leftovers, 8 levels of halves for 32,767 bins), so
 * |D_host - D_device| < 37 * 2^-52 * S with S the sum of the terms'
 * magnitudes. The device keeps its choice only when the chosen
 * candidate's margin over every other exceeds (S_w + S_k) * 2^-45 (3.4
 * times that bound, which also covers the rounding of the check itself);
 * otherwise it answers NaN and the engine computes the quantizer on the
 * host. NaN and infinite divergences involve no log (an empty density, a
 * reference bin against an empty quantized bin) and are the same on both.
 * All-zero terms (p = q everywhere) are exact on both: log(1) = 0.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "calib_cuda.h"
#include "devbuf.h" /* CU */

#include "calib_core.h"

#define THREADS 128

/* What the device needs of a job beyond amx_hist_job_t: where its edges
 * and candidate values start. */
typedef struct hjob {
    amx_hist_job_t j;
    uint64_t eoff, coff;
    uint32_t ncand;
} hjob_t;

__global__ void k_edges(const hjob_t *jobs, float *edges)
{
    const hjob_t *h = &jobs[blockIdx.x];
    const amx_calib_t *c = &h->j.c;
    for (uint32_t e = threadIdx.x; e <= c->num_bins; e += blockDim.x)
        edges[h->eoff + e] =
            amx__linspace_at(0.0f, h->j.g, c->num_bins + 1, amx__torch_fma(c->torch_cpu), e);
}

/* Each job's candidates, one thread each: entropy's divergence and its
 * terms' magnitudes, MSE's loss. (Two kernels, not one with two branches:
 * each thread's local arrays are those of one method.) */
__global__ void k_entropy(const hjob_t *jobs, const double *sums, double *val, double *mag)
{
    const hjob_t *h = &jobs[blockIdx.x];
    if (h->j.c.method != AMX_HM_ENTROPY || !(h->j.g > 0.0f))
        return;
    for (uint32_t k = threadIdx.x; k < h->ncand; k += blockDim.x)
        val[h->coff + k] = amx__hist_cand_entropy(&h->j.c, sums + h->j.sbase, k, &mag[h->coff + k]);
}

__global__ void k_mse(const hjob_t *jobs, const double *sums, const float *edges, double *val)
{
    const hjob_t *h = &jobs[blockIdx.x];
    if (h->j.c.method != AMX_HM_MSE || !(h->j.g > 0.0f))
        return;
    for (uint32_t k = threadIdx.x; k < h->ncand; k += blockDim.x)
        val[h->coff + k] = amx__hist_cand_mse(&h->j.c, sums + h->j.sbase, edges + h->eoff, k);
}

/* One thread per job: ModelOpt's pick over its candidates, in order. */
__global__ void k_pick(const hjob_t *jobs, uint32_t n, const double *sums, const float *edges,
                       const double *val, const double *mag, float *out)
{
    uint32_t q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= n)
        return;
    const hjob_t *h = &jobs[q];
    out[q] = amx__hist_pick(&h->j.c, h->j.g, sums + h->j.sbase, edges + h->eoff, val + h->coff,
                            mag + h->coff, 1);
}

extern "C" amx_status_t amx__cuda_hist_amax(const double *d_sums, uint64_t nsums,
                                            const amx_hist_job_t *jobs, size_t n, float *out,
                                            cudaStream_t s, amx_err_t *err)
{
    if (n == 0)
        return AMX_OK;
    if (n > 0x7fffffffu)
        return amx_err_set(err, AMX_EINVAL, "%zu histogram quantizers in one call", n);
    hjob_t *h = (hjob_t *)malloc(n * sizeof(*h));
    if (h == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory");
    uint64_t ne = 0, nc = 0;
    for (size_t q = 0; q < n; q++) {
        const amx_calib_t *c = &jobs[q].c;
        /* PERCENTILE has no stride (0): it walks the bins, no candidates. */
        if (c->method < AMX_HM_ENTROPY || c->method > AMX_HM_MSE || c->num_bins == 0 ||
            (c->method != AMX_HM_PERCENTILE && c->stride == 0) ||
            jobs[q].sbase + c->num_bins + 1 > nsums) {
            free(h);
            return amx_err_set(err, AMX_EINTERNAL,
                               "histogram quantizer %zu: method %u, %u bins at %llu of %llu "
                               "statistic values",
                               q, c->method, c->num_bins, (unsigned long long)jobs[q].sbase,
                               (unsigned long long)nsums);
        }
        h[q].j = jobs[q];
        h[q].eoff = ne;
        h[q].coff = nc;
        h[q].ncand = amx__hist_ncand(c);
        ne += (uint64_t)c->num_bins + 1;
        nc += h[q].ncand;
    }
    /* One allocation: jobs, edges, values and magnitudes, out. */
    size_t o_jobs = 0, o_val = (n * sizeof(hjob_t) + 255) & ~(size_t)255;
    size_t o_mag = o_val + (size_t)nc * 8, o_edges = o_mag + (size_t)nc * 8;
    size_t o_out = (o_edges + (size_t)ne * 4 + 7) & ~(size_t)7, total = o_out + n * 4;
    char *d = NULL;
    cudaError_t ce = cudaMallocAsync((void **)&d, total, s);
    if (ce != cudaSuccess) {
        free(h);
        CU(ce, "cudaMallocAsync (histogram methods)");
    }
    hjob_t *dj = (hjob_t *)(d + o_jobs);
    double *val = (double *)(d + o_val), *mag = (double *)(d + o_mag);
    float *edges = (float *)(d + o_edges), *dout = (float *)(d + o_out);
    ce = cudaMemcpyAsync(dj, h, n * sizeof(hjob_t), cudaMemcpyHostToDevice, s);
    if (ce == cudaSuccess) {
        k_edges<<<(unsigned)n, THREADS, 0, s>>>(dj, edges);
        k_entropy<<<(unsigned)n, THREADS, 0, s>>>(dj, d_sums, val, mag);
        k_mse<<<(unsigned)n, THREADS, 0, s>>>(dj, d_sums, edges, val);
        k_pick<<<(unsigned)((n + THREADS - 1) / THREADS), THREADS, 0, s>>>(dj, (uint32_t)n, d_sums,
                                                                           edges, val, mag, dout);
        ce = cudaGetLastError();
    }
    if (ce == cudaSuccess)
        ce = cudaMemcpyAsync(out, dout, n * sizeof(float), cudaMemcpyDeviceToHost, s);
    cudaFreeAsync(d, s);
    cudaError_t se = cudaStreamSynchronize(s);
    free(h);
    CU(ce != cudaSuccess ? ce : se, "histogram methods");
    return AMX_OK;
}
