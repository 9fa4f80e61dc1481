/*
 * state_cuda.cu - the CUDA state backend: a job's flat amax buffer, history
 * ring, previous scales and results live in GPU memory (cudaMalloc).
 * Contributions are staged in pinned host memory and merged by one kernel
 * launch per batch; an epoch's post-processing runs as kernels that call the
 * same per-cell code as the host backend (daemon/postproc.h), and the
 * results are copied back to host memory once per epoch so that answering a
 * trainer never touches the device.
 *
 * All calls come from the loop thread; the backend uses one stream.
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "postproc.h"
#include "state.h"

#define THREADS 256

typedef struct cuda_state {
    int device;
    cudaStream_t stream;
    float *pending, *accum, *prev, *hist, *prev_g;
    float *out_amax, *out_scale, *out_inv;
    uint8_t *out_bytes;
    float *gamax, *gscale, *gscale_inv;
    float *groups;
    size_t cap_groups;
    amx_qdesc_t *q;
    uint32_t cap_qdesc;
    float *h_stage, *d_stage;
    uint64_t cap_stage;
    amx_run_t *h_runs, *d_runs;
    size_t cap_runs;
    uint64_t cap_cells, cap_hist;
    uint32_t cap_q;
} cuda_state_t;

/* Converts a CUDA error once, where it happens, keeping the original text. */
#define CU(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return amx_err_set(err, AMX_EDEVICE, "CUDA %s failed: %s (%s)", what,                  \
                               cudaGetErrorString(e_), cudaGetErrorName(e_));                      \
    } while (0)

static unsigned blocks_for(uint64_t n)
{
    uint64_t b = (n + THREADS - 1) / THREADS;
    if (b > 65535u * 16u)
        b = 65535u * 16u; /* grid-stride loops cover the rest */
    return (unsigned)(b ? b : 1);
}

/* Max of non-negative floats and -inf via integer atomics: for these values
 * the int order of the bit patterns is the float order. */
__device__ __forceinline__ void atomic_max_nonneg(float *addr, float v)
{
    atomicMax((int *)addr, __float_as_int(v));
}

__global__ void k_fill(float *p, uint64_t n, float v)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        p[i] = v;
}

/*
 * Per-cell kernels work on chunks: block b owns cells [b*CHUNK, (b+1)*CHUNK)
 * and each thread ITEMS of them, strided by THREADS so that warps stay
 * coalesced. The run (merge) or quantizer (post-processing) of the chunk's
 * first cell is found once per block by binary search; each thread then
 * walks forward, which costs one cached load per cell instead of a search.
 * Loads are issued for all ITEMS before any result is computed.
 */
#define ITEMS 8
#define CHUNK (THREADS * ITEMS)

static unsigned chunks_for(uint64_t n)
{
    return (unsigned)((n + CHUNK - 1) / CHUNK);
}

/* The last index k < n with a[k].*key <= x, for a sorted by key (runs by
 * src, quantizer descriptors by base); 0 when there is none. */
template <typename T>
__device__ __forceinline__ uint32_t last_le(const T *a, uint32_t n, uint64_t T::*key, uint64_t x)
{
    uint32_t lo = 0, hi = n;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (a[mid].*key <= x)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* last_le for the first cell of this block's chunk, searched by thread 0. */
template <typename T>
__device__ __forceinline__ uint32_t chunk_first(const T *a, uint32_t n, uint64_t T::*key)
{
    __shared__ uint32_t first;
    if (threadIdx.x == 0)
        first = last_le(a, n, key, (uint64_t)blockIdx.x * CHUNK);
    __syncthreads();
    return first;
}

__device__ __forceinline__ uint32_t advance_q(const amx_qdesc_t *qs, uint32_t nq, uint32_t qi,
                                              uint64_t cell)
{
    while (qi + 1 < nq && qs[qi + 1].base <= cell)
        qi++;
    return qi;
}

/* Max-merges staged values into pending. `overlap`: some cells may be hit
 * twice in this batch, so atomics are needed. */
__global__ void k_merge(float *pending, const float *vals, uint64_t nvals, const amx_run_t *runs,
                        uint32_t nruns, int overlap)
{
    uint32_t r = chunk_first(runs, nruns, &amx_run_t::src);
    uint64_t base = (uint64_t)blockIdx.x * CHUNK + threadIdx.x;
    uint64_t dst[ITEMS];
    float v[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i < nvals) {
            while (r + 1 < nruns && runs[r + 1].src <= i)
                r++;
            dst[k] = runs[r].dst + (i - runs[r].src);
            v[k] = vals[i];
        }
    }
    if (overlap) {
#pragma unroll
        for (int k = 0; k < ITEMS; k++)
            if (base + (uint64_t)k * THREADS < nvals)
                atomic_max_nonneg(&pending[dst[k]], v[k]);
        return;
    }
    float old[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++)
        if (base + (uint64_t)k * THREADS < nvals)
            old[k] = pending[dst[k]];
#pragma unroll
    for (int k = 0; k < ITEMS; k++)
        if (base + (uint64_t)k * THREADS < nvals)
            pending[dst[k]] = amx_fmaxf(old[k], v[k]);
}

__global__ void k_accumulate(const amx_qdesc_t *qs, uint32_t nq, uint64_t ncells,
                             const float *pending, float *accum, float *hist, float *out_amax,
                             float *peer_max)
{
    uint32_t qi = chunk_first(qs, nq, &amx_qdesc_t::base);
    uint64_t base = (uint64_t)blockIdx.x * CHUNK + threadIdx.x;
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i >= ncells)
            break;
        qi = advance_q(qs, nq, qi, i);
        const amx_qdesc_t *q = &qs[qi];
        float a = amx_pp_accumulate(q, &accum[i], hist + q->hist_base, i - q->base, pending[i]);
        out_amax[i] = a;
        if (q->peer_group >= 0 && a != AMX_NEG_INF)
            atomic_max_nonneg(&peer_max[q->peer_group], a);
    }
}

__global__ void k_peer_fill(const amx_qdesc_t *qs, uint32_t nq, uint64_t ncells,
                            const float *peer_max, float *out_amax, float *gamax)
{
    uint32_t qi = chunk_first(qs, nq, &amx_qdesc_t::base);
    uint64_t base = (uint64_t)blockIdx.x * CHUNK + threadIdx.x;
    /* Each thread keeps a running max of its cells of one quantizer and
     * publishes it once per quantizer: few atomics even for huge tensors. */
    float m = AMX_NEG_INF;
    uint32_t mq = qi;
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i >= ncells)
            break;
        qi = advance_q(qs, nq, qi, i);
        if (qi != mq) {
            if (m != AMX_NEG_INF)
                atomic_max_nonneg(&gamax[mq], m);
            m = AMX_NEG_INF;
            mq = qi;
        }
        float a = out_amax[i];
        if (a == AMX_NEG_INF && qs[qi].peer_group >= 0) {
            a = peer_max[qs[qi].peer_group];
            out_amax[i] = a;
        }
        m = amx_fmaxf(m, a);
    }
    if (m != AMX_NEG_INF)
        atomic_max_nonneg(&gamax[mq], m);
}

__global__ void k_scale_groups(const amx_qdesc_t *qs, uint32_t nq, const float *gamax,
                               float *scale_max)
{
    for (uint32_t qi = blockIdx.x * blockDim.x + threadIdx.x; qi < nq; qi += gridDim.x * blockDim.x)
        if (qs[qi].scale_group >= 0 && gamax[qi] != AMX_NEG_INF)
            atomic_max_nonneg(&scale_max[qs[qi].scale_group], gamax[qi]);
}

__global__ void k_global(const amx_qdesc_t *qs, uint32_t nq, const float *scale_max, float *gamax,
                         float *prev_g, float *gscale, float *gscale_inv)
{
    for (uint32_t qi = blockIdx.x * blockDim.x + threadIdx.x; qi < nq;
         qi += gridDim.x * blockDim.x) {
        float g = qs[qi].scale_group >= 0 ? scale_max[qs[qi].scale_group] : gamax[qi];
        g = g > 0.0f ? g : 0.0f;
        gamax[qi] = g;
        amx_pp_global(&qs[qi].recipe, g, &prev_g[qi], &gscale[qi], &gscale_inv[qi]);
    }
}

__global__ void k_scales(const amx_qdesc_t *qs, uint32_t nq, uint64_t ncells, const float *out_amax,
                         const float *gamax, const float *gscale, const float *gscale_inv,
                         float *prev, float *out_scale, float *out_inv, uint8_t *out_bytes)
{
    uint32_t qi = chunk_first(qs, nq, &amx_qdesc_t::base);
    uint64_t base = (uint64_t)blockIdx.x * CHUNK + threadIdx.x;
    float a[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i < ncells)
            a[k] = out_amax[i];
    }
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i >= ncells)
            break;
        qi = advance_q(qs, nq, qi, i);
        float s, inv;
        uint8_t b;
        amx_pp_cell(&qs[qi].recipe, a[k], gamax[qi], gscale[qi], gscale_inv[qi], &prev[i], &s, &inv,
                    &b);
        out_scale[i] = s;
        out_inv[i] = inv;
        out_bytes[i] = b;
    }
}

__global__ void k_reset(const amx_qdesc_t *qs, const uint32_t *ids, uint32_t n, float *pending,
                        float *accum, float *prev, float *hist, float *prev_g)
{
    /* One block per quantizer to reset. */
    for (uint32_t k = blockIdx.x; k < n; k += gridDim.x) {
        const amx_qdesc_t *q = &qs[ids[k]];
        for (uint64_t c = threadIdx.x; c < q->ncells; c += blockDim.x) {
            pending[q->base + c] = AMX_NEG_INF;
            accum[q->base + c] = AMX_NEG_INF;
            prev[q->base + c] = 1.0f;
        }
        if (q->accumulation == AMX_ACC_PER_EPOCH)
            for (uint64_t c = threadIdx.x; c < (uint64_t)q->hist_len * q->ncells; c += blockDim.x)
                hist[q->hist_base + c] = AMX_NEG_INF;
        if (threadIdx.x == 0)
            prev_g[ids[k]] = 1.0f;
    }
}

/* ---- buffer management ---- */

/* Grows device array *p from `old` to `n` elements of `size` bytes, keeping
 * contents, filling new float cells with `fill` (when fill_float). */
static amx_status_t grow(cuda_state_t *c, void **p, uint64_t old, uint64_t n, size_t size,
                         int fill_float, float fill, amx_err_t *err)
{
    void *np = NULL;
    CU(cudaMalloc(&np, (size_t)(n ? n : 1) * size), "cudaMalloc");
    if (old > 0) {
        cudaError_t e =
            cudaMemcpyAsync(np, *p, (size_t)old * size, cudaMemcpyDeviceToDevice, c->stream);
        if (e != cudaSuccess) {
            cudaFree(np);
            CU(e, "cudaMemcpyAsync (grow)");
        }
    }
    if (n > old) {
        if (fill_float)
            k_fill<<<blocks_for(n - old), THREADS, 0, c->stream>>>((float *)np + old, n - old,
                                                                   fill);
        else
            CU(cudaMemsetAsync((char *)np + old * size, 0, (size_t)(n - old) * size, c->stream),
               "cudaMemsetAsync");
        CU(cudaGetLastError(), "fill kernel launch");
    }
    CU(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize (grow)");
    cudaFree(*p);
    *p = np;
    return AMX_OK;
}

static amx_status_t cuda_reserve(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                 amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    const float ninf = -INFINITY;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    if (ncells > c->cap_cells) {
        uint64_t cap = c->cap_cells ? c->cap_cells : 1024;
        while (cap < ncells)
            cap *= 2;
        AMX_CHECK(grow(c, (void **)&c->pending, c->cap_cells, cap, 4, 1, ninf, err));
        AMX_CHECK(grow(c, (void **)&c->accum, c->cap_cells, cap, 4, 1, ninf, err));
        AMX_CHECK(grow(c, (void **)&c->prev, c->cap_cells, cap, 4, 1, 1.0f, err));
        AMX_CHECK(grow(c, (void **)&c->out_amax, c->cap_cells, cap, 4, 1, ninf, err));
        AMX_CHECK(grow(c, (void **)&c->out_scale, c->cap_cells, cap, 4, 1, 1.0f, err));
        AMX_CHECK(grow(c, (void **)&c->out_inv, c->cap_cells, cap, 4, 1, 1.0f, err));
        AMX_CHECK(grow(c, (void **)&c->out_bytes, c->cap_cells, cap, 1, 0, 0.0f, err));
        c->cap_cells = cap;
    }
    if (nhist > c->cap_hist) {
        uint64_t cap = c->cap_hist ? c->cap_hist : 1024;
        while (cap < nhist)
            cap *= 2;
        AMX_CHECK(grow(c, (void **)&c->hist, c->cap_hist, cap, 4, 1, ninf, err));
        c->cap_hist = cap;
    }
    if (nq > c->cap_q) {
        uint32_t cap = c->cap_q ? c->cap_q : 256;
        while (cap < nq)
            cap *= 2;
        AMX_CHECK(grow(c, (void **)&c->prev_g, c->cap_q, cap, 4, 1, 1.0f, err));
        AMX_CHECK(grow(c, (void **)&c->gamax, c->cap_q, cap, 4, 1, 0.0f, err));
        AMX_CHECK(grow(c, (void **)&c->gscale, c->cap_q, cap, 4, 1, 1.0f, err));
        AMX_CHECK(grow(c, (void **)&c->gscale_inv, c->cap_q, cap, 4, 1, 1.0f, err));
        AMX_CHECK(grow(c, (void **)&c->q, 0, cap, sizeof(amx_qdesc_t), 0, 0.0f, err));
        c->cap_q = cap;
    }
    return amx__state_grow_outputs(st, ncells, nhist, nq, err);
}

static amx_status_t stage_reserve(cuda_state_t *c, uint64_t nvals, size_t nruns, amx_err_t *err)
{
    if (nvals > c->cap_stage) {
        uint64_t cap = c->cap_stage ? c->cap_stage : 65536;
        while (cap < nvals)
            cap *= 2;
        cudaFreeHost(c->h_stage);
        cudaFree(c->d_stage);
        c->h_stage = NULL, c->d_stage = NULL, c->cap_stage = 0;
        CU(cudaMallocHost(&c->h_stage, cap * sizeof(float)), "cudaMallocHost (staging)");
        CU(cudaMalloc(&c->d_stage, cap * sizeof(float)), "cudaMalloc (staging)");
        c->cap_stage = cap;
    }
    if (nruns > c->cap_runs) {
        size_t cap = c->cap_runs ? c->cap_runs : 4096;
        while (cap < nruns)
            cap *= 2;
        cudaFreeHost(c->h_runs);
        cudaFree(c->d_runs);
        c->h_runs = NULL, c->d_runs = NULL, c->cap_runs = 0;
        CU(cudaMallocHost(&c->h_runs, cap * sizeof(amx_run_t)), "cudaMallocHost (runs)");
        CU(cudaMalloc(&c->d_runs, cap * sizeof(amx_run_t)), "cudaMalloc (runs)");
        c->cap_runs = cap;
    }
    return AMX_OK;
}

/* Launches the merge kernel on device-resident values and runs (also used
 * by bench/bench_kernels.cu). */
extern "C" amx_status_t amx__cuda_merge_launch(float *pending, const float *d_vals, uint64_t nvals,
                                               const amx_run_t *d_runs, uint32_t nruns, int overlap,
                                               cudaStream_t stream, amx_err_t *err)
{
    if (nvals == 0)
        return AMX_OK;
    k_merge<<<chunks_for(nvals), THREADS, 0, stream>>>(pending, d_vals, nvals, d_runs, nruns,
                                                       overlap);
    CU(cudaGetLastError(), "merge kernel launch");
    return AMX_OK;
}

/* Launches the per-cell scale kernel (also used by the benchmark). */
extern "C" amx_status_t
amx__cuda_scales_launch(const amx_qdesc_t *d_q, uint32_t nq, uint64_t ncells, const float *out_amax,
                        const float *gamax, const float *gscale, const float *gscale_inv,
                        float *prev, float *out_scale, float *out_inv, uint8_t *out_bytes,
                        cudaStream_t stream, amx_err_t *err)
{
    if (ncells == 0)
        return AMX_OK;
    k_scales<<<chunks_for(ncells), THREADS, 0, stream>>>(
        d_q, nq, ncells, out_amax, gamax, gscale, gscale_inv, prev, out_scale, out_inv, out_bytes);
    CU(cudaGetLastError(), "scale kernel launch");
    return AMX_OK;
}

static amx_status_t cuda_merge(amx_state_t *st, const float *vals, uint64_t nvals,
                               const amx_run_t *runs, size_t nruns, int overlap, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    if (nvals == 0)
        return AMX_OK;
    AMX_CHECK(stage_reserve(c, nvals, nruns, err));
    memcpy(c->h_stage, vals, nvals * sizeof(float));
    memcpy(c->h_runs, runs, nruns * sizeof(amx_run_t));
    CU(cudaMemcpyAsync(c->d_stage, c->h_stage, nvals * sizeof(float), cudaMemcpyHostToDevice,
                       c->stream),
       "cudaMemcpyAsync (values)");
    CU(cudaMemcpyAsync(c->d_runs, c->h_runs, nruns * sizeof(amx_run_t), cudaMemcpyHostToDevice,
                       c->stream),
       "cudaMemcpyAsync (runs)");
    AMX_CHECK(amx__cuda_merge_launch(c->pending, c->d_stage, nvals, c->d_runs, (uint32_t)nruns,
                                     overlap, c->stream, err));
    /* The staging buffers are reused by the next batch: wait for this one. */
    CU(cudaStreamSynchronize(c->stream), "merge");
    return AMX_OK;
}

static amx_status_t cuda_reconcile(amx_state_t *st, const amx_qdesc_t *qs, uint32_t nq,
                                   uint32_t npeer, uint32_t nscale, amx_comm_t *comm,
                                   amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    uint64_t n = st->ncells;
    size_t ngroups = (size_t)npeer + nscale;
    if (ngroups > c->cap_groups) {
        cudaFree(c->groups);
        c->groups = NULL, c->cap_groups = 0;
        CU(cudaMalloc(&c->groups, ngroups * sizeof(float)), "cudaMalloc (groups)");
        c->cap_groups = ngroups;
    }
    CU(cudaStreamSynchronize(c->stream), "sync before all-reduce");
    AMX_CHECK(comm->allreduce_max(comm, c->pending, (size_t)n, 1, err));
    if (nq == 0)
        return AMX_OK;
    CU(cudaMemcpyAsync(c->q, qs, nq * sizeof(amx_qdesc_t), cudaMemcpyHostToDevice, c->stream),
       "cudaMemcpyAsync (descriptors)");
    float *peer_max = c->groups, *scale_max = c->groups + npeer;
    if (ngroups)
        k_fill<<<blocks_for(ngroups), THREADS, 0, c->stream>>>(c->groups, ngroups, -INFINITY);
    k_fill<<<blocks_for(nq), THREADS, 0, c->stream>>>(c->gamax, nq, -INFINITY);
    k_accumulate<<<chunks_for(n), THREADS, 0, c->stream>>>(c->q, nq, n, c->pending, c->accum,
                                                           c->hist, c->out_amax, peer_max);
    k_peer_fill<<<chunks_for(n), THREADS, 0, c->stream>>>(c->q, nq, n, peer_max, c->out_amax,
                                                          c->gamax);
    k_scale_groups<<<blocks_for(nq), THREADS, 0, c->stream>>>(c->q, nq, c->gamax, scale_max);
    k_global<<<blocks_for(nq), THREADS, 0, c->stream>>>(c->q, nq, scale_max, c->gamax, c->prev_g,
                                                        c->gscale, c->gscale_inv);
    CU(cudaGetLastError(), "epoch kernels launch");
    AMX_CHECK(amx__cuda_scales_launch(c->q, nq, n, c->out_amax, c->gamax, c->gscale, c->gscale_inv,
                                      c->prev, c->out_scale, c->out_inv, c->out_bytes, c->stream,
                                      err));
    k_fill<<<blocks_for(n), THREADS, 0, c->stream>>>(c->pending, n, -INFINITY);
    CU(cudaGetLastError(), "fill kernel launch");
    /* Publish the results in host memory. */
    struct {
        void *dst;
        const void *src;
        size_t bytes;
    } d2h[] = {{st->out_amax, c->out_amax, n * 4},         {st->out_scale, c->out_scale, n * 4},
               {st->out_scale_inv, c->out_inv, n * 4},     {st->out_bytes, c->out_bytes, n},
               {st->out_gamax, c->gamax, nq * 4},          {st->out_gscale, c->gscale, nq * 4},
               {st->out_gscale_inv, c->gscale_inv, nq * 4}};
    for (size_t k = 0; k < sizeof(d2h) / sizeof(d2h[0]); k++)
        CU(cudaMemcpyAsync(d2h[k].dst, d2h[k].src, d2h[k].bytes, cudaMemcpyDeviceToHost, c->stream),
           "cudaMemcpyAsync (results)");
    CU(cudaStreamSynchronize(c->stream), "epoch kernels");
    return AMX_OK;
}

static amx_status_t cuda_reset(amx_state_t *st, const amx_qdesc_t *qs, const uint32_t *ids,
                               uint32_t n, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    if (n == 0)
        return AMX_OK;
    uint32_t *d_ids = NULL;
    CU(cudaMemcpyAsync(c->q, qs, st->nq * sizeof(amx_qdesc_t), cudaMemcpyHostToDevice, c->stream),
       "cudaMemcpyAsync (descriptors)");
    CU(cudaMalloc(&d_ids, n * sizeof(uint32_t)), "cudaMalloc (reset ids)");
    cudaError_t e =
        cudaMemcpyAsync(d_ids, ids, n * sizeof(uint32_t), cudaMemcpyHostToDevice, c->stream);
    if (e == cudaSuccess) {
        unsigned nb = n < 4096 ? n : 4096;
        k_reset<<<nb, THREADS, 0, c->stream>>>(c->q, d_ids, n, c->pending, c->accum, c->prev,
                                               c->hist, c->prev_g);
        e = cudaGetLastError();
    }
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(c->stream);
    cudaFree(d_ids);
    CU(e, "reset");
    return AMX_OK;
}

static void cuda_destroy(amx_state_t *st)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaSetDevice(c->device);
    void *dev[] = {c->pending,   c->accum,   c->prev,      c->hist,  c->prev_g, c->out_amax,
                   c->out_scale, c->out_inv, c->out_bytes, c->gamax, c->gscale, c->gscale_inv,
                   c->groups,    c->q,       c->d_stage,   c->d_runs};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
        cudaFree(dev[i]);
    cudaFreeHost(c->h_stage);
    cudaFreeHost(c->h_runs);
    cudaStreamDestroy(c->stream);
    free(c);
}

static const amx_state_ops_t cuda_ops = {
    "cuda", cuda_reserve, cuda_merge, cuda_reconcile, cuda_reset, cuda_destroy,
};

extern "C" int amx__state_cuda_probe(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

extern "C" amx_status_t amx__state_cuda_create(amx_state_t **out, amx_err_t *err)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return amx_err_set(err, AMX_EUNAVAIL, "no usable CUDA device (%s); use --backend=host",
                           e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    cuda_state_t *c = (cuda_state_t *)calloc(1, sizeof(*c));
    amx_state_t *st = (amx_state_t *)calloc(1, sizeof(*st));
    if (c == NULL || st == NULL) {
        free(c);
        free(st);
        return amx_err_set(err, AMX_ENOMEM, "out of host memory");
    }
    cudaGetDevice(&c->device);
    e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(c);
        free(st);
        CU(e, "cudaStreamCreate");
    }
    st->ops = &cuda_ops;
    st->impl = c;
    *out = st;
    return AMX_OK;
}
