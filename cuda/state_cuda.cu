/*
 * state_cuda.cu - the CUDA state backend: a job's pending buffers, the
 * receive buffer, the replicated state and both result sets live in GPU
 * memory. Contributions are staged in pinned host memory and merged by one
 * kernel launch per batch; an epoch's finish runs as kernels that call the
 * same per-cell code as the host backend (daemon/postproc.h). Per-quantizer
 * results are copied to host memory at the end of each finish; per-cell
 * results stay on the device and are gathered for each answer
 * (read_results), so an epoch never copies the whole catalog back.
 *
 * Threads (state.h): the loop thread uses stream `sl`, the job's engine
 * thread stream `se`; every operation synchronizes its own stream before
 * it returns. Buffers are allocated and freed stream-ordered
 * (cudaMallocAsync/cudaFreeAsync): cudaMalloc/cudaFree may synchronize the
 * whole device, which would make one thread wait for another job's NCCL
 * kernel that is stuck on a dead peer.
 */
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib_cuda.h"
#include "clock.h"
#include "devbuf.h"
#include "kernels.h"
#include "log.h"
#include "postproc.h"
#include "state.h"

#define THREADS 256

/* What finish's launches after the uploads read (finish_launch): the key
 * of its CUDA graphs too, so zeroed before it is filled (padding). */
struct fin_args {
    uint32_t nq, nch, back, fl;
    uint64_t n, npeer, nsl, ngroups, pend_n;
    const float *red, *d_ovr;
    float *clear; /* the pending buffer's data, when accumulate clears it */
    float *pend;  /* else cleared by a fill */
    float *groups, *accum, *hist, *prev, *prev_g, *prev_gs;
    amx_qdesc_t *dq;
    uint8_t *empty;
    uint32_t *chunkq;
    float *gdec, *sdec;
    float *o_amax, *o_scale, *o_inv, *o_gamax, *o_gscale, *o_ginv, *o_samax, *o_sscale, *o_sinv;
    uint8_t *o_bytes, *o_filled;
    unsigned long long *d_counts, *h_counts;
    float *g_amax, *g_scale, *g_inv, *s_amax, *s_scale, *s_inv; /* pinned host results */
    int uva;  /* the pinned results are written by a kernel (k_copy_out), not copied */
    int fuse; /* scales of scales_in_accumulate quantizers written by k_accumulate */
};

struct fin_graph {
    struct fin_args key;
    cudaGraphExec_t exec;
    uint64_t used;
};

typedef struct cuda_state {
    int device;
    int uva; /* unified addressing: kernels write pinned host memory directly */
    cudaStream_t sl, se;
    float *pend[2]; /* AMX_HDR_CELLS + pend_n[k] */
    uint64_t pend_n[2];
    int active;
    float *recv; /* AMX_HDR_CELLS + recv_n */
    uint64_t recv_n;
    float *accum, *prev, *hist, *prev_g, *prev_gs;
    float *o_amax[2], *o_scale[2], *o_inv[2];
    uint8_t *o_bytes[2];
    /* Per output set: 1 where a cell without data took its peer group's
     * max; valid only when filled_ok (a remap or import leaves it unknown). */
    uint8_t *o_filled[2];
    uint64_t filled_cap[2];
    int filled_ok[2];
    /* Cells filled and cells left without data by the last finish: device
     * counters, and their pinned copy. */
    unsigned long long *d_counts, *h_counts;
    float *o_gamax[2], *o_gscale[2], *o_ginv[2];
    float *o_samax[2], *o_sscale[2], *o_sinv[2]; /* per global slice */
    /* Engine-thread device scratch (grow_dev: capacities in elements). */
    float *groups;
    uint64_t cap_groups;
    amx_qdesc_t *dq;
    uint64_t cap_dq;
    uint8_t *empty; /* per quantizer: some cell saw no data this epoch */
    uint64_t cap_empty;
    /* 1 / S_enc of each quantizer and each global slice (NVFP4 block
     * encode scales), made once by k_global / k_slices rather than a
     * division per cell in k_scales (bench/NOTES.md, kernels). */
    float *gdec, *sdec;
    uint64_t cap_gdec, cap_sdec;
    uint32_t *chunkq; /* per CHUNK of cells: the quantizer of its first cell */
    uint64_t cap_chunkq;
    uint32_t chunkq_n;
    /* Loop-thread staging: values and runs (pinned + device). */
    float *h_stage, *d_stage;
    uint64_t cap_stage;
    amx_run_t *h_runs, *d_runs;
    uint64_t cap_runs;
    /* Engine-thread runs, and pinned staging for descriptors and the
     * per-quantizer results (copies from pinned memory are asynchronous and
     * about twice as fast as from pageable memory). */
    amx_run_t *e_runs;
    size_t cap_e_runs;
    void *e_pin;
    size_t cap_e_pin;
    uint32_t dq_n; /* descriptors on the device, valid for this many quantizers */
    /* Statistics of calibrators beyond max (state.h): float64 pending[2]
     * (flipped with pend), receive and accumulated sums; the calibrated
     * amax of each stat cell for a finish (st->ovr uploaded); the loop's
     * float64 staging (pinned + device). The histogram methods run on
     * the device (stat_hist, calib_cuda.cu), the rest on the host
     * (engine_stat.c): the accumulated sums are copied back after each
     * accumulation. */
    double *spend[2], *srecv, *saccum;
    uint64_t spend_n[2], srecv_n, saccum_n;
    float *d_ovr;
    uint64_t cap_ovr;
    double *h_sstage, *d_sstage;
    uint64_t cap_sstage;
    /* Pinned buffers replaced by bigger ones, freed at destroy (freeing
     * pinned memory may synchronize the device). */
    pthread_mutex_t retired_mu; /* the loop and the engine thread both retire */
    void **retired;
    size_t nretired, cap_retired;
    /* Device buffers shared with trainers (devbuf.cu): their slabs are
     * merged on `sd` (behind each trainer's ready event) into the in-flight
     * buffer, and `in` recorded after; every engine operation on the
     * in-flight buffer, and unflip, waits for `in` on its own stream. Made
     * by the first dev_open (the loop, before any epoch uses them). */
    cudaStream_t sd;
    cudaEvent_t in;
    int dev_used;
    /* The buffers merged since the last flip (dev_wait's; the loop
     * appends at the flip, the engine reads during the epoch). */
    amx_devbuf_t **merging;
    size_t nmerging, cap_merging;
    /* The device answers the loop queued on sl (dev_answer) and did not
     * wait for: `answered` is recorded after each, and every engine
     * operation waits for it on its own stream (wait_in), so nothing of
     * the next epoch frees or moves what they read. */
    cudaEvent_t answered;
    int answered_used;
    /* The job's previous globals on the device (dev_answer): amax, scale
     * (float32), has-previous bytes, prev_n_up of each, uploaded on sl once
     * per key through pinned staging. */
    float *d_prev;
    void *h_prev;
    size_t cap_prev;
    uint32_t prev_n_up;
    uint64_t prev_key;
    /* prev_dev's has-previous bytes: cap_ones ones, on sl. */
    uint8_t *d_ones;
    size_t cap_ones;
    /* The reduced header's pinned host copy (header_copy). */
    float *e_hdr;
    /* CUDA graphs of finish's kernels and copies (finish_graph), keyed by
     * everything they were captured with. */
    struct fin_graph graphs[4];
    uint64_t graph_clock;
    int graphs_off; /* AMAXD_FINISH_GRAPH=0, or a capture failed */
    int fuse;       /* finish_launch's fin_args.fuse */
} cuda_state_t;

/* Stream s waits for the device slabs merged into the in-flight buffer. */
static amx_status_t wait_in(cuda_state_t *c, cudaStream_t s, amx_err_t *err)
{
    if (c->dev_used)
        CU(cudaStreamWaitEvent(s, c->in, 0), "cudaStreamWaitEvent (device slabs)");
    if (c->answered_used)
        CU(cudaStreamWaitEvent(s, c->answered, 0), "cudaStreamWaitEvent (device answers)");
    return AMX_OK;
}

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

/* The quantizer of this block's first cell: precomputed per chunk when
 * the descriptors were uploaded (a search per block, run by one thread
 * while the others wait, would cost more than the block's own work), or
 * searched when there is no table. */
__device__ __forceinline__ uint32_t chunk_q(const amx_qdesc_t *qs, uint32_t nq,
                                            const uint32_t *chunkq)
{
    if (chunkq != NULL)
        return chunkq[blockIdx.x];
    return chunk_first(qs, nq, &amx_qdesc_t::base);
}

/* One thread per chunk: the quantizer of its first cell. */
__global__ void k_chunk_table(const amx_qdesc_t *qs, uint32_t nq, uint32_t nchunks,
                              uint32_t *chunkq)
{
    for (uint32_t b = blockIdx.x * blockDim.x + threadIdx.x; b < nchunks;
         b += gridDim.x * blockDim.x)
        chunkq[b] = last_le(qs, nq, &amx_qdesc_t::base, (uint64_t)b * CHUNK);
}

/* The quantizer of `cell`, at or after qi (the quantizer of an earlier
 * cell). Within one quantizer this is one load; across small quantizers a
 * binary search, bounded because each quantizer has at least one cell:
 * the answer is at most cell - base(qi + 1) quantizers past qi + 1. */
__device__ __forceinline__ uint32_t seek_q(const amx_qdesc_t *qs, uint32_t nq, uint32_t qi,
                                           uint64_t cell)
{
    if (qi + 1 >= nq || qs[qi + 1].base > cell)
        return qi;
    uint32_t lo = qi + 1;
    uint64_t span = cell - qs[lo].base + 1;
    uint32_t hi = (uint64_t)(nq - lo) > span ? lo + (uint32_t)span : nq;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (qs[mid].base <= cell)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
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

/* Publishes one thread's running max `m` of quantizer `mq` (and whether
 * some of its cells saw no data). */
__device__ __forceinline__ void publish_q(const amx_qdesc_t *qs, uint32_t mq, float m, int e,
                                          float *gamax, float *peer_max, uint8_t *empty)
{
    if (m != AMX_NEG_INF) {
        atomic_max_nonneg(&gamax[mq], m);
        if (qs[mq].peer_group >= 0)
            atomic_max_nonneg(&peer_max[qs[mq].peer_group], m);
    }
    if (e)
        empty[mq] = 1;
}

/* A quantizer whose per-cell scales need nothing but the cell's own amax
 * (and its previous scale): no peer stage, and a format whose cell scale
 * does not read the quantizer's or a slice's global (FP8, MXFP8; NVFP4's
 * block scales do). With the fused finish, k_accumulate writes its scales
 * as it writes its amax, and k_scales skips it: one pass over its cells
 * instead of two. */
__device__ __forceinline__ int scales_in_accumulate(const amx_qdesc_t *q)
{
    /* The formats amx_pp_cell scales from the cell alone, named: a format
     * added later takes two passes until it is listed here. */
    int f = q->recipe.format;
    return q->peer_group < 0 &&
           (f == AMX_FMT_FP8_E4M3 || f == AMX_FMT_FP8_E5M2 || f == AMX_FMT_MXFP8);
}

/*
 * Accumulates the reduced values into the running state and writes each
 * cell's amax. Each thread keeps a running max of its cells of one
 * quantizer and publishes it into the quantizer's max `gamax` and its peer
 * group's max, and flags quantizers with cells that saw no data in
 * `empty`. Inside a large tensor every lane of a warp ends on the same
 * quantizer: the warp then publishes once (atomics on one address
 * serialize). `clear`, when set, is the next epoch's pending buffer, reset
 * here rather than by a pass of its own. `fuse`: the cells of quantizers
 * that scales_in_accumulate also get their scales here (amx_pp_cell, as in
 * k_scales), and their cells without data are counted into counts[1].
 */
__global__ void k_accumulate(const amx_qdesc_t *qs, uint32_t nq, uint64_t ncells,
                             const float *pending, float *accum, float *hist, float *out_amax,
                             float *peer_max, float *gamax, uint8_t *empty, float *clear,
                             const uint32_t *chunkq, const float *ovr, int fuse, float *prev,
                             float *out_scale, float *out_inv, uint8_t *out_bytes,
                             uint8_t *out_filled, unsigned long long *counts)
{
    uint32_t qi = chunk_q(qs, nq, chunkq);
    uint64_t base = (uint64_t)blockIdx.x * CHUNK + threadIdx.x;
    /* Every load is issued before the first result is computed: one
     * outstanding load per thread would leave the kernel latency-bound. */
    float red[ITEMS], acc[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i < ncells) {
            red[k] = pending[i];
            acc[k] = accum[i];
        }
    }
    if (clear != NULL) {
#pragma unroll
        for (int k = 0; k < ITEMS; k++) {
            uint64_t i = base + (uint64_t)k * THREADS;
            if (i < ncells)
                clear[i] = AMX_NEG_INF;
        }
    }
    float m = AMX_NEG_INF;
    uint32_t mq = qi;
    int e = 0;
    unsigned long long nmiss = 0;
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i >= ncells)
            break;
        qi = seek_q(qs, nq, qi, i);
        if (qi != mq) {
            publish_q(qs, mq, m, e, gamax, peer_max, empty);
            m = AMX_NEG_INF;
            e = 0;
            mq = qi;
        }
        const amx_qdesc_t *q = &qs[qi];
        float a = amx_pp_accumulate(q, &acc[k], hist + q->hist_base, i - q->base, red[k]);
        if (q->accumulation != AMX_ACC_PER_EPOCH)
            accum[i] = acc[k];
        if (q->stat != 0 && ovr != NULL) {
            /* A calibrator beyond max: its amax where it computed one (the
             * running max stays in accum, the basis's source). */
            float o = ovr[q->obase + (i - q->base)];
            if (o == o)
                a = o;
        }
        out_amax[i] = a;
        if (fuse && scales_in_accumulate(q)) {
            float sc, inv;
            uint8_t b;
            /* The global arguments are not read for these formats. */
            amx_pp_cell(&q->recipe, a, 0.0f, 0.0f, 0.0f, &prev[i], &sc, &inv, &b);
            out_scale[i] = sc;
            out_inv[i] = inv;
            out_bytes[i] = b;
            if (out_filled != NULL)
                out_filled[i] = 0;
            nmiss += a == AMX_NEG_INF;
        }
        if (a == AMX_NEG_INF)
            e = 1;
        else /* NVFP4 per-block search: the global stays the running max's */
            m = amx_fmaxf(m, q->global_of_max ? acc[k] : a);
    }
    /* Lanes past the end hold m = -inf, e = 0: publishing them is a no-op. */
    const unsigned full = 0xffffffffu;
    if (fuse && counts != NULL) {
        for (int off = 16; off > 0; off /= 2)
            nmiss += __shfl_xor_sync(full, nmiss, off);
        if ((threadIdx.x & 31) == 0 && nmiss != 0)
            atomicAdd(&counts[1], nmiss);
    }
    uint32_t q0 = __shfl_sync(full, mq, 0);
    if (__all_sync(full, mq == q0)) {
        for (int off = 16; off > 0; off /= 2)
            m = amx_fmaxf(m, __shfl_xor_sync(full, m, off));
        e = __any_sync(full, e);
        if ((threadIdx.x & 31) == 0)
            publish_q(qs, mq, m, e, gamax, peer_max, empty);
    } else {
        publish_q(qs, mq, m, e, gamax, peer_max, empty);
    }
}

/*
 * Per quantizer: cells without data take their peer group's max, or (peer
 * mode SHARE) every cell does, so the quantizer's max includes it; then
 * scale groups collect their members'.
 */
__global__ void k_quantizer_max(const amx_qdesc_t *qs, uint32_t nq, const float *peer_max,
                                const uint8_t *empty, float *gamax, float *scale_max)
{
    for (uint32_t qi = blockIdx.x * blockDim.x + threadIdx.x; qi < nq;
         qi += gridDim.x * blockDim.x) {
        float g = gamax[qi];
        if ((empty[qi] || qs[qi].peer_mode == AMX_PEER_SHARE) && qs[qi].peer_group >= 0) {
            g = amx_fmaxf(g, peer_max[qs[qi].peer_group]);
            gamax[qi] = g;
        }
        if (qs[qi].scale_group >= 0 && g != AMX_NEG_INF)
            atomic_max_nonneg(&scale_max[qs[qi].scale_group], g);
    }
}

struct hdr_args {
    float v[AMX_HDR_CELLS];
};

/* finish_launch under unified addressing: the per-quantizer and per-slice
 * globals (n[k] floats of src[k] into the pinned host dst[k]) and the two
 * cell counts, in one launch. */
struct out_args {
    const float *src[6];
    float *dst[6];
    uint64_t n[6];
    const unsigned long long *dc;
    unsigned long long *hc;
};

__global__ void k_copy_out(struct out_args a)
{
    uint64_t t = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
    uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    if (t == 0) {
        a.hc[0] = a.dc[0];
        a.hc[1] = a.dc[1];
    }
    for (int k = 0; k < 6; k++)
        for (uint64_t i = t; i < a.n[k]; i += stride)
            a.dst[k][i] = a.src[k][i];
}

/* cuda_prepare: the header into the in-flight buffer, the receive header
 * zeroed. */
__global__ void k_header(float *send, float *recv, struct hdr_args h)
{
    unsigned i = threadIdx.x;
    if (i < AMX_HDR_CELLS) {
        send[i] = h.v[i];
        recv[i] = 0.0f;
    }
}

__global__ void k_epoch_init(float *groups, size_t ngroups, float *gamax, uint8_t *empty,
                             uint32_t nq)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < ngroups || i < nq;
         i += (size_t)gridDim.x * blockDim.x) {
        if (i < ngroups)
            groups[i] = AMX_NEG_INF;
        if (i < nq) {
            gamax[i] = AMX_NEG_INF;
            empty[i] = 0;
        }
    }
}

__global__ void k_global(const amx_qdesc_t *qs, uint32_t nq, const float *scale_max, float *gamax,
                         float *prev_g, float *gscale, float *gscale_inv, float *gdec)
{
    for (uint32_t qi = blockIdx.x * blockDim.x + threadIdx.x; qi < nq;
         qi += gridDim.x * blockDim.x) {
        float g = qs[qi].scale_group >= 0 ? scale_max[qs[qi].scale_group] : gamax[qi];
        g = g > 0.0f ? g : 0.0f;
        gamax[qi] = g;
        amx_pp_global(&qs[qi].recipe, g, &prev_g[qi], &gscale[qi], &gscale_inv[qi]);
        gdec[qi] = 1.0f / gscale[qi];
    }
}

/*
 * Global slices (quantizers with global_axes > 0), one block per slice
 * (grid-stride): the max over the slice's cells after the peer stage
 * (amx_pp_peer, as k_scales applies it), then its global scales. The
 * slice's quantizer is the last one whose gbase is <= the slice (gbase
 * never decreases, and a quantizer without slices shares its gbase with
 * the next one). max is exact: the order of the reduction does not matter.
 */
__global__ void k_slices(const amx_qdesc_t *qs, uint32_t nq, uint64_t nslices,
                         const float *out_amax, const float *peer_max, float *prev_gs, float *samax,
                         float *sscale, float *sinv, float *sdec)
{
    __shared__ float warp_max[THREADS / 32];
    for (uint64_t sl = blockIdx.x; sl < nslices; sl += gridDim.x) {
        uint32_t qi = last_le(qs, nq, &amx_qdesc_t::gbase, sl);
        const amx_qdesc_t *q = &qs[qi];
        float pm = q->peer_group >= 0 ? peer_max[q->peer_group] : AMX_NEG_INF;
        const float *cells = out_amax + q->base + (sl - q->gbase) * q->slice_cells;
        float m = AMX_NEG_INF;
        for (uint64_t c = threadIdx.x; c < q->slice_cells; c += blockDim.x) {
            float a = cells[c];
            uint8_t raised;
            if (q->peer_group >= 0)
                a = amx_pp_peer(q->peer_mode, a, pm, &raised);
            m = amx_fmaxf(m, a);
        }
        for (int off = 16; off > 0; off /= 2)
            m = amx_fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        if ((threadIdx.x & 31) == 0)
            warp_max[threadIdx.x / 32] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < THREADS / 32; w++)
                m = amx_fmaxf(m, warp_max[w]);
            float g = m > 0.0f ? m : 0.0f;
            samax[sl] = g;
            amx_pp_global(&q->recipe, g, &prev_gs[sl], &sscale[sl], &sinv[sl]);
            sdec[sl] = 1.0f / sscale[sl];
        }
        __syncthreads();
    }
}

/* One cell of k_scales: the peer stage, then the cell's scales. `q` is
 * quantizer qi's descriptor (in global memory, or a block-uniform copy). */
__device__ __forceinline__ void scale_cell(const amx_qdesc_t *q, uint32_t qi, uint64_t i, float a,
                                           float pm, const float *gamax, const float *gscale,
                                           const float *gdec, const float *samax,
                                           const float *sscale, const float *sdec, float *out_amax,
                                           float *prev, float *out_scale, float *out_inv,
                                           uint8_t *out_bytes, uint8_t *out_filled,
                                           unsigned long long *nfill, unsigned long long *nmiss)
{
    uint8_t raised = 0;
    if (q->peer_group >= 0) {
        a = amx_pp_peer(q->peer_mode, a, pm, &raised);
        if (raised)
            out_amax[i] = a;
    }
    *nfill += raised;
    *nmiss += a == AMX_NEG_INF;
    if (out_filled != NULL)
        out_filled[i] = raised;
    float g = gamax[qi], s_enc = gscale[qi], s_dec = gdec[qi];
    if (q->nslices > 0) {
        uint64_t sl = amx_pp_slice(q, i - q->base);
        g = samax[sl];
        s_enc = sscale[sl];
        s_dec = sdec[sl];
    }
    float s, inv;
    uint8_t b;
    amx_pp_cell(&q->recipe, a, g, s_enc, s_dec, &prev[i], &s, &inv, &b);
    out_scale[i] = s;
    out_inv[i] = inv;
    out_bytes[i] = b;
}

/* Per-cell scales; the peer stage (fill or share) is applied here (written
 * back, it is the cell's reported amax), the cells it raised marked in
 * out_filled and counted in counts[0], cells still without data in
 * counts[1] (when those are given). A cell of a quantizer with global
 * slices uses its slice's global amax and scale. A block whose cells all
 * belong to one quantizer (every block of a large tensor) keeps that
 * quantizer's descriptor in registers instead of reading it per cell.
 * `fused`: the cells that k_accumulate scaled (scales_in_accumulate) are
 * skipped; a block of one such quantizer returns at once. */
__global__ void k_scales(const amx_qdesc_t *qs, uint32_t nq, uint64_t ncells, float *out_amax,
                         const float *peer_max, const float *gamax, const float *gscale,
                         const float *gdec, const float *samax, const float *sscale,
                         const float *sdec, float *prev, float *out_scale, float *out_inv,
                         uint8_t *out_bytes, const uint32_t *chunkq, uint8_t *out_filled,
                         unsigned long long *counts, int fused)
{
    unsigned long long nfill = 0, nmiss = 0;
    uint32_t qi = chunk_q(qs, nq, chunkq);
    uint64_t first = (uint64_t)blockIdx.x * CHUNK, base = first + threadIdx.x;
    uint64_t end = first + CHUNK < ncells ? first + CHUNK : ncells;
    if (fused && qs[qi].base + qs[qi].ncells >= end && scales_in_accumulate(&qs[qi]))
        return; /* block-uniform: no lane is left in the warp reductions below */
    float a[ITEMS];
#pragma unroll
    for (int k = 0; k < ITEMS; k++) {
        uint64_t i = base + (uint64_t)k * THREADS;
        if (i < ncells)
            a[k] = out_amax[i];
    }
    if (qs[qi].base + qs[qi].ncells >= end) {
        const amx_qdesc_t q = qs[qi];
        float pm = q.peer_group >= 0 ? peer_max[q.peer_group] : 0.0f;
#pragma unroll
        for (int k = 0; k < ITEMS; k++) {
            uint64_t i = base + (uint64_t)k * THREADS;
            if (i >= ncells)
                break;
            scale_cell(&q, qi, i, a[k], pm, gamax, gscale, gdec, samax, sscale, sdec, out_amax,
                       prev, out_scale, out_inv, out_bytes, out_filled, &nfill, &nmiss);
        }
    } else {
#pragma unroll
        for (int k = 0; k < ITEMS; k++) {
            uint64_t i = base + (uint64_t)k * THREADS;
            if (i >= ncells)
                break;
            qi = seek_q(qs, nq, qi, i);
            const amx_qdesc_t *q = &qs[qi];
            if (fused && scales_in_accumulate(q))
                continue;
            float pm = q->peer_group >= 0 ? peer_max[q->peer_group] : 0.0f;
            scale_cell(q, qi, i, a[k], pm, gamax, gscale, gdec, samax, sscale, sdec, out_amax, prev,
                       out_scale, out_inv, out_bytes, out_filled, &nfill, &nmiss);
        }
    }
    /* Every lane gets here (a block returns early only as a whole): one atomic
     * per warp. */
    if (counts != NULL) {
        for (int off = 16; off > 0; off /= 2) {
            nfill += __shfl_xor_sync(0xffffffffu, nfill, off);
            nmiss += __shfl_xor_sync(0xffffffffu, nmiss, off);
        }
        if ((threadIdx.x & 31) == 0 && (nfill | nmiss) != 0) {
            atomicAdd(&counts[0], nfill);
            atomicAdd(&counts[1], nmiss);
        }
    }
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
amx__cuda_scales_launch(const amx_qdesc_t *d_q, uint32_t nq, uint64_t ncells, float *out_amax,
                        const float *peer_max, const float *gamax, const float *gscale,
                        const float *gdec, const float *samax, const float *sscale,
                        const float *sdec, float *prev, float *out_scale, float *out_inv,
                        uint8_t *out_bytes, const uint32_t *chunkq, uint8_t *out_filled,
                        unsigned long long *counts, cudaStream_t stream, amx_err_t *err)
{
    if (ncells == 0)
        return AMX_OK;
    k_scales<<<chunks_for(ncells), THREADS, 0, stream>>>(
        d_q, nq, ncells, out_amax, peer_max, gamax, gscale, gdec, samax, sscale, sdec, prev,
        out_scale, out_inv, out_bytes, chunkq, out_filled, counts, 0);
    CU(cudaGetLastError(), "scale kernel launch");
    return AMX_OK;
}

/* One block per run (grid-stride over runs): dst[r.dst + i] = src[r.src + i]. */
template <typename T>
__global__ void k_copy_runs(T *dst, const T *src, const amx_run_t *runs, size_t nruns)
{
    for (size_t r = blockIdx.x; r < nruns; r += gridDim.x)
        for (uint64_t i = threadIdx.x; i < runs[r].len; i += blockDim.x)
            dst[runs[r].dst + i] = src[runs[r].src + i];
}

__global__ void k_max_into(float *a, const float *b, uint64_t n)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        a[i] = amx_fmaxf(a[i], b[i]);
}

/* One block per run (grid-stride over runs): dst[r.dst + i] += src[r.src
 * + i] (statistics; runs never overlap). */
__global__ void k_add_runs(double *dst, const double *src, const amx_run_t *runs, size_t nruns)
{
    for (size_t r = blockIdx.x; r < nruns; r += gridDim.x)
        for (uint64_t i = threadIdx.x; i < runs[r].len; i += blockDim.x)
            dst[runs[r].dst + i] += src[runs[r].src + i];
}

/* dst[r.dst + i] = 0 over the runs. */
__global__ void k_zero_runs(double *dst, const amx_run_t *runs, size_t nruns)
{
    for (size_t r = blockIdx.x; r < nruns; r += gridDim.x)
        for (uint64_t i = threadIdx.x; i < runs[r].len; i += blockDim.x)
            dst[runs[r].dst + i] = 0.0;
}

__global__ void k_add_into(double *a, const double *b, uint64_t n)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        a[i] += b[i];
}

/* Quantizers flagged `reset` lose their accumulated state (one block each). */
__global__ void k_reset_flagged(const amx_qdesc_t *qs, uint32_t nq, float *accum, float *prev,
                                float *hist, float *prev_g, float *prev_gs)
{
    for (uint32_t k = blockIdx.x; k < nq; k += gridDim.x) {
        const amx_qdesc_t *q = &qs[k];
        if (!q->reset)
            continue;
        for (uint64_t c = threadIdx.x; c < q->ncells; c += blockDim.x) {
            accum[q->base + c] = AMX_NEG_INF;
            prev[q->base + c] = 1.0f;
        }
        if (q->accumulation == AMX_ACC_PER_EPOCH)
            for (uint64_t c = threadIdx.x; c < (uint64_t)q->hist_len * q->ncells; c += blockDim.x)
                hist[q->hist_base + c] = AMX_NEG_INF;
        for (uint64_t c = threadIdx.x; c < q->nslices; c += blockDim.x)
            prev_gs[q->gbase + c] = 1.0f;
        if (threadIdx.x == 0)
            prev_g[k] = 1.0f;
    }
}

/* ---- buffers ---- */

static amx_status_t dalloc(void **p, size_t bytes, cudaStream_t s, amx_err_t *err)
{
    *p = NULL;
    CU(cudaMallocAsync(p, bytes ? bytes : 16, s), "cudaMallocAsync");
    return AMX_OK;
}

static void dfree(void *p, cudaStream_t s)
{
    if (p != NULL)
        cudaFreeAsync(p, s);
}

/* Device scratch `*p` of at least `need` elements of `elem` bytes
 * (contents not kept when it grows); `*cap` counts elements. */
static amx_status_t grow_dev(void **p, uint64_t *cap, uint64_t need, size_t elem, cudaStream_t s,
                             amx_err_t *err)
{
    if (need <= *cap)
        return AMX_OK;
    dfree(*p, s);
    *p = NULL;
    *cap = 0;
    AMX_CHECK(dalloc(p, need * elem, s, err));
    *cap = need;
    return AMX_OK;
}

static amx_status_t fill_f(float *p, uint64_t n, float v, cudaStream_t s, amx_err_t *err)
{
    if (n == 0)
        return AMX_OK;
    k_fill<<<blocks_for(n), THREADS, 0, s>>>(p, n, v);
    CU(cudaGetLastError(), "fill kernel launch");
    return AMX_OK;
}

/* Host runs into a device buffer of the calling thread (grown as needed). */
static amx_status_t upload_runs(amx_run_t **d, size_t *cap, const amx_run_t *runs, size_t n,
                                cudaStream_t s, amx_err_t *err)
{
    if (n > *cap) {
        size_t c = *cap ? *cap : 1024;
        while (c < n)
            c *= 2;
        dfree(*d, s);
        *d = NULL;
        *cap = 0;
        AMX_CHECK(dalloc((void **)d, c * sizeof(amx_run_t), s, err));
        *cap = c;
    }
    if (n > 0)
        CU(cudaMemcpyAsync(*d, runs, n * sizeof(amx_run_t), cudaMemcpyHostToDevice, s),
           "cudaMemcpyAsync (runs)");
    return AMX_OK;
}

template <typename T>
static amx_status_t copy_runs(T *dst, const T *src, const amx_run_t *d_runs, size_t n,
                              cudaStream_t s, amx_err_t *err)
{
    if (n == 0)
        return AMX_OK;
    unsigned grid = n < 65535u * 16u ? (unsigned)n : 65535u * 16u;
    k_copy_runs<T><<<grid, THREADS, 0, s>>>(dst, src, d_runs, n);
    CU(cudaGetLastError(), "copy kernel launch");
    return AMX_OK;
}

/* Replaces float array *p by a fresh one of n cells set to v, with the
 * runs of the old one copied (runs already on the device). */
static amx_status_t remap_f(float **p, uint64_t n, float v, const amx_run_t *d_runs, size_t nruns,
                            cudaStream_t s, amx_err_t *err)
{
    float *np;
    AMX_CHECK(dalloc((void **)&np, n * sizeof(float), s, err));
    AMX_CHECK(fill_f(np, n, v, s, err));
    if (*p != NULL)
        AMX_CHECK(copy_runs<float>(np, *p, d_runs, nruns, s, err));
    dfree(*p, s);
    *p = np;
    return AMX_OK;
}

/* ---- loop thread ---- */

static amx_status_t cuda_reserve_pending(amx_state_t *st, uint64_t ncells, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    for (int k = 0; k < 2; k++) {
        if (c->pend[k] != NULL && ncells <= c->pend_n[k])
            continue;
        uint64_t cap = c->pend[k] ? c->pend_n[k] : 0;
        uint64_t want = cap ? cap : 1024;
        while (want < ncells)
            want *= 2;
        float *np;
        AMX_CHECK(dalloc((void **)&np, (AMX_HDR_CELLS + want) * sizeof(float), c->sl, err));
        AMX_CHECK(fill_f(np, AMX_HDR_CELLS, 0.0f, c->sl, err));
        AMX_CHECK(fill_f(np + AMX_HDR_CELLS, want, -INFINITY, c->sl, err));
        if (c->pend[k] != NULL)
            CU(cudaMemcpyAsync(np, c->pend[k], (AMX_HDR_CELLS + cap) * sizeof(float),
                               cudaMemcpyDeviceToDevice, c->sl),
               "cudaMemcpyAsync (grow pending)");
        dfree(c->pend[k], c->sl);
        c->pend[k] = np;
        c->pend_n[k] = want;
    }
    CU(cudaStreamSynchronize(c->sl), "cudaStreamSynchronize (pending)");
    st->pend_cells = c->pend_n[c->active];
    return AMX_OK;
}

/* Keeps pinned memory that is no longer used until destroy: freeing it
 * may wait for the whole device, e.g. for another job's collective stuck on
 * a dead peer. Buffers grow by doubling, so little is kept this way. Any
 * thread. */
static void retire(cuda_state_t *c, void *p)
{
    if (p == NULL)
        return;
    pthread_mutex_lock(&c->retired_mu);
    if (c->nretired == c->cap_retired) {
        size_t n = c->cap_retired ? 2 * c->cap_retired : 16;
        void **g = (void **)realloc(c->retired, n * sizeof(void *));
        if (g == NULL) {
            pthread_mutex_unlock(&c->retired_mu);
            cudaFreeHost(p); /* out of host memory: free it now, even if that waits */
            return;
        }
        c->retired = g;
        c->cap_retired = n;
    }
    c->retired[c->nretired++] = p;
    pthread_mutex_unlock(&c->retired_mu);
}

static amx_status_t grow_pinned(cuda_state_t *c, void **h, void **d, uint64_t *cap, uint64_t need,
                                size_t elem, amx_err_t *err)
{
    if (need <= *cap)
        return AMX_OK;
    uint64_t n = *cap ? *cap : 65536;
    while (n < need)
        n *= 2;
    void *nh = NULL, *nd = NULL;
    CU(cudaHostAlloc(&nh, n * elem, cudaHostAllocDefault), "cudaHostAlloc (staging)");
    if (dalloc(&nd, n * elem, c->sl, err) != AMX_OK) {
        retire(c, nh);
        return err->code;
    }
    retire(c, *h);
    dfree(*d, c->sl);
    *h = nh;
    *d = nd;
    *cap = n;
    return AMX_OK;
}

/* Loop thread: `runs` to the device (d_runs, through the pinned h_runs),
 * queued on the loop's stream before whatever uses them. */
static amx_status_t loop_runs(cuda_state_t *c, const amx_run_t *runs, size_t nruns, amx_err_t *err)
{
    AMX_CHECK(grow_pinned(c, (void **)&c->h_runs, (void **)&c->d_runs, &c->cap_runs, nruns,
                          sizeof(amx_run_t), err));
    if (nruns == 0)
        return AMX_OK;
    memcpy(c->h_runs, runs, nruns * sizeof(amx_run_t));
    CU(cudaMemcpyAsync(c->d_runs, c->h_runs, nruns * sizeof(amx_run_t), cudaMemcpyHostToDevice,
                       c->sl),
       "cudaMemcpyAsync (runs)");
    return AMX_OK;
}

static amx_status_t cuda_merge(amx_state_t *st, const float *vals, uint64_t nvals,
                               const amx_run_t *runs, size_t nruns, int overlap, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    if (nvals == 0)
        return AMX_OK;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(grow_pinned(c, (void **)&c->h_stage, (void **)&c->d_stage, &c->cap_stage, nvals,
                          sizeof(float), err));
    memcpy(c->h_stage, vals, nvals * sizeof(float));
    CU(cudaMemcpyAsync(c->d_stage, c->h_stage, nvals * sizeof(float), cudaMemcpyHostToDevice,
                       c->sl),
       "cudaMemcpyAsync (values)");
    AMX_CHECK(loop_runs(c, runs, nruns, err));
    AMX_CHECK(amx__cuda_merge_launch(c->pend[c->active] + AMX_HDR_CELLS, c->d_stage, nvals,
                                     c->d_runs, (uint32_t)nruns, overlap, c->sl, err));
    /* The staging buffers are reused by the next batch: wait for this one. */
    CU(cudaStreamSynchronize(c->sl), "merge");
    return AMX_OK;
}

static void cuda_flip(amx_state_t *st)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    c->active ^= 1;
    c->nmerging = 0;
    st->pend_cells = c->pend_n[c->active];
}

static amx_status_t cuda_unflip(amx_state_t *st, int keep, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    int fl = c->active ^ 1;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(wait_in(c, c->sl, err));
    uint64_t n = c->pend_n[fl] < c->pend_n[c->active] ? c->pend_n[fl] : c->pend_n[c->active];
    if (keep && n > 0)
        k_max_into<<<blocks_for(n), THREADS, 0, c->sl>>>(c->pend[c->active] + AMX_HDR_CELLS,
                                                         c->pend[fl] + AMX_HDR_CELLS, n);
    CU(cudaGetLastError(), "unflip kernel launch");
    AMX_CHECK(fill_f(c->pend[fl] + AMX_HDR_CELLS, c->pend_n[fl], -INFINITY, c->sl, err));
    uint64_t ns = c->spend_n[fl] < c->spend_n[c->active] ? c->spend_n[fl] : c->spend_n[c->active];
    if (keep && ns > 0 && c->spend[fl] != NULL && c->spend[c->active] != NULL)
        k_add_into<<<blocks_for(ns), THREADS, 0, c->sl>>>(c->spend[c->active], c->spend[fl], ns);
    CU(cudaGetLastError(), "unflip kernel launch");
    if (c->spend[fl] != NULL && c->spend_n[fl] > 0)
        CU(cudaMemsetAsync(c->spend[fl], 0, c->spend_n[fl] * sizeof(double), c->sl),
           "cudaMemsetAsync (stat buffer)");
    CU(cudaStreamSynchronize(c->sl), "unflip");
    return AMX_OK;
}

/* Stat buffer k at `n` values at least on stream s (new values 0): both
 * pending buffers follow the replicated layout's size, whichever path
 * (remap, import, a restore) set it. */
static amx_status_t ensure_spend(cuda_state_t *c, int k, uint64_t n, cudaStream_t s, amx_err_t *err)
{
    if (c->spend[k] != NULL && c->spend_n[k] >= n)
        return AMX_OK;
    double *np;
    AMX_CHECK(dalloc((void **)&np, (n ? n : 1) * sizeof(double), s, err));
    CU(cudaMemsetAsync(np, 0, (n ? n : 1) * sizeof(double), s), "cudaMemsetAsync (stat buffer)");
    if (c->spend[k] != NULL && c->spend_n[k] > 0)
        CU(cudaMemcpyAsync(np, c->spend[k], c->spend_n[k] * sizeof(double),
                           cudaMemcpyDeviceToDevice, s),
           "cudaMemcpyAsync (stat buffer)");
    dfree(c->spend[k], s);
    c->spend[k] = np;
    c->spend_n[k] = n;
    return AMX_OK;
}

static amx_status_t cuda_stat_merge(amx_state_t *st, const double *vals, uint64_t nvals,
                                    const amx_run_t *runs, size_t nruns, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    if (nvals == 0 || nruns == 0)
        return AMX_OK;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(ensure_spend(c, c->active, st->nstat, c->sl, err));
    AMX_CHECK(grow_pinned(c, (void **)&c->h_sstage, (void **)&c->d_sstage, &c->cap_sstage, nvals,
                          sizeof(double), err));
    memcpy(c->h_sstage, vals, nvals * sizeof(double));
    CU(cudaMemcpyAsync(c->d_sstage, c->h_sstage, nvals * sizeof(double), cudaMemcpyHostToDevice,
                       c->sl),
       "cudaMemcpyAsync (statistics)");
    AMX_CHECK(loop_runs(c, runs, nruns, err));
    unsigned grid = nruns < 65535u * 16u ? (unsigned)nruns : 65535u * 16u;
    k_add_runs<<<grid, THREADS, 0, c->sl>>>(c->spend[c->active], c->d_sstage, c->d_runs, nruns);
    CU(cudaGetLastError(), "stat merge kernel launch");
    CU(cudaStreamSynchronize(c->sl), "stat merge");
    return AMX_OK;
}

/* Pending buffer k moved to the layout of lc (runs on the device). */
static amx_status_t remap_pend(cuda_state_t *c, int k, const amx_layout_change_t *lc,
                               const amx_run_t *d_runs, cudaStream_t s, amx_err_t *err)
{
    float *np;
    AMX_CHECK(dalloc((void **)&np, (AMX_HDR_CELLS + lc->ncells) * sizeof(float), s, err));
    AMX_CHECK(fill_f(np, AMX_HDR_CELLS, 0.0f, s, err));
    AMX_CHECK(fill_f(np + AMX_HDR_CELLS, lc->ncells, -INFINITY, s, err));
    if (c->pend[k] != NULL)
        AMX_CHECK(copy_runs<float>(np + AMX_HDR_CELLS, c->pend[k] + AMX_HDR_CELLS, d_runs,
                                   lc->npend_runs, s, err));
    dfree(c->pend[k], s);
    c->pend[k] = np;
    c->pend_n[k] = lc->ncells;
    return AMX_OK;
}

static amx_status_t cuda_remap_active(amx_state_t *st, const amx_layout_change_t *lc,
                                      amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(loop_runs(c, lc->pend, lc->npend_runs, err));
    AMX_CHECK(remap_pend(c, c->active, lc, c->d_runs, c->sl, err));
    /* The active stat buffer is empty (statistics are taken only while
     * nothing is in flight): it only takes the new size. */
    dfree(c->spend[c->active], c->sl);
    c->spend[c->active] = NULL;
    c->spend_n[c->active] = 0;
    AMX_CHECK(ensure_spend(c, c->active, lc->nstat, c->sl, err));
    CU(cudaStreamSynchronize(c->sl), "remap of the pending buffer");
    st->pend_cells = c->pend_n[c->active];
    return AMX_OK;
}

static void cuda_publish(amx_state_t *st)
{
    st->front ^= 1;
}

static amx_status_t cuda_read_results(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                      uint64_t total, float *amax, float *scale, float *inv,
                                      uint8_t *bytes, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    int f = st->front;
    if (total == 0 || nruns == 0)
        return AMX_OK;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    /* Gather into the staging buffer (13 bytes a cell), one copy back. */
    uint64_t need = (total * 13 + 3) / 4;
    AMX_CHECK(grow_pinned(c, (void **)&c->h_stage, (void **)&c->d_stage, &c->cap_stage, need,
                          sizeof(float), err));
    AMX_CHECK(loop_runs(c, runs, nruns, err));
    float *da = c->d_stage, *ds = da + total, *di = ds + total;
    uint8_t *db = (uint8_t *)(di + total);
    AMX_CHECK(copy_runs<float>(da, c->o_amax[f], c->d_runs, nruns, c->sl, err));
    AMX_CHECK(copy_runs<float>(ds, c->o_scale[f], c->d_runs, nruns, c->sl, err));
    AMX_CHECK(copy_runs<float>(di, c->o_inv[f], c->d_runs, nruns, c->sl, err));
    AMX_CHECK(copy_runs<uint8_t>(db, c->o_bytes[f], c->d_runs, nruns, c->sl, err));
    CU(cudaMemcpyAsync(c->h_stage, c->d_stage, total * 13, cudaMemcpyDeviceToHost, c->sl),
       "cudaMemcpyAsync (results)");
    CU(cudaStreamSynchronize(c->sl), "results");
    float *ha = c->h_stage, *hs = ha + total, *hi = hs + total;
    memcpy(amax, ha, total * 4);
    memcpy(scale, hs, total * 4);
    memcpy(inv, hi, total * 4);
    memcpy(bytes, hi + total, total);
    return AMX_OK;
}

/* Gathers the fill marks of the front outputs, like read_results. */
static amx_status_t cuda_read_filled(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                     uint8_t *filled, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    int f = st->front;
    if (!c->filled_ok[f] || c->o_filled[f] == NULL)
        return amx_err_set(err, AMX_EUNAVAIL, "which cells were filled is not known");
    uint64_t total = 0;
    for (size_t i = 0; i < nruns; i++)
        total += runs[i].len;
    if (total == 0)
        return AMX_OK;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(grow_pinned(c, (void **)&c->h_stage, (void **)&c->d_stage, &c->cap_stage,
                          (total + 3) / 4, sizeof(float), err));
    AMX_CHECK(loop_runs(c, runs, nruns, err));
    AMX_CHECK(
        copy_runs<uint8_t>((uint8_t *)c->d_stage, c->o_filled[f], c->d_runs, nruns, c->sl, err));
    CU(cudaMemcpyAsync(c->h_stage, c->d_stage, total, cudaMemcpyDeviceToHost, c->sl),
       "cudaMemcpyAsync (fill marks)");
    CU(cudaStreamSynchronize(c->sl), "fill marks");
    memcpy(filled, c->h_stage, total);
    return AMX_OK;
}

/* ---- engine thread ---- */

/* Output set k sized for n cells and nq quantizers (device), contents
 * undefined; host globals grown. */
static amx_status_t size_outputs(amx_state_t *st, int k, uint64_t n, uint32_t nq, uint64_t ns,
                                 amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaStream_t s = c->se;
    if (n != st->out_cells[k] || c->o_amax[k] == NULL) {
        dfree(c->o_amax[k], s), dfree(c->o_scale[k], s), dfree(c->o_inv[k], s),
            dfree(c->o_bytes[k], s);
        c->o_amax[k] = c->o_scale[k] = c->o_inv[k] = NULL;
        c->o_bytes[k] = NULL;
        st->out_cells[k] = 0;
        AMX_CHECK(dalloc((void **)&c->o_amax[k], n * 4, s, err));
        AMX_CHECK(dalloc((void **)&c->o_scale[k], n * 4, s, err));
        AMX_CHECK(dalloc((void **)&c->o_inv[k], n * 4, s, err));
        AMX_CHECK(dalloc((void **)&c->o_bytes[k], n, s, err));
        st->out_cells[k] = n;
    }
    if (nq != st->out_nq[k] || c->o_gamax[k] == NULL) {
        dfree(c->o_gamax[k], s), dfree(c->o_gscale[k], s), dfree(c->o_ginv[k], s);
        c->o_gamax[k] = c->o_gscale[k] = c->o_ginv[k] = NULL;
        AMX_CHECK(dalloc((void **)&c->o_gamax[k], (size_t)nq * 4, s, err));
        AMX_CHECK(dalloc((void **)&c->o_gscale[k], (size_t)nq * 4, s, err));
        AMX_CHECK(dalloc((void **)&c->o_ginv[k], (size_t)nq * 4, s, err));
    }
    AMX_CHECK(amx__state_grow_globals(st, k, nq, err));
    st->out_nq[k] = nq;
    if (ns != st->out_ns[k] || c->o_samax[k] == NULL) {
        dfree(c->o_samax[k], s), dfree(c->o_sscale[k], s), dfree(c->o_sinv[k], s);
        c->o_samax[k] = c->o_sscale[k] = c->o_sinv[k] = NULL;
        AMX_CHECK(dalloc((void **)&c->o_samax[k], ns * 4, s, err));
        AMX_CHECK(dalloc((void **)&c->o_sscale[k], ns * 4, s, err));
        AMX_CHECK(dalloc((void **)&c->o_sinv[k], ns * 4, s, err));
    }
    AMX_CHECK(amx__state_size_slices(st, k, ns, err));
    return AMX_OK;
}

/* Fill marks of output set k for n cells (contents undefined, marked not
 * known until a finish writes them) and the cell counters, zeroed. */
static amx_status_t size_filled(cuda_state_t *c, int k, uint64_t n, amx_err_t *err)
{
    cudaStream_t s = c->se;
    c->filled_ok[k] = 0;
    if (c->filled_cap[k] < n || c->o_filled[k] == NULL) {
        dfree(c->o_filled[k], s);
        c->o_filled[k] = NULL;
        c->filled_cap[k] = 0;
        AMX_CHECK(dalloc((void **)&c->o_filled[k], n, s, err));
        c->filled_cap[k] = n;
    }
    if (c->d_counts == NULL)
        AMX_CHECK(dalloc((void **)&c->d_counts, 2 * sizeof(unsigned long long), s, err));
    if (c->h_counts == NULL)
        CU(cudaHostAlloc((void **)&c->h_counts, 2 * sizeof(unsigned long long),
                         cudaHostAllocDefault),
           "cudaHostAlloc (cell counts)");
    CU(cudaMemsetAsync(c->d_counts, 0, 2 * sizeof(unsigned long long), s), "cudaMemsetAsync");
    return AMX_OK;
}

static amx_status_t cuda_remap(amx_state_t *st, const amx_layout_change_t *lc, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaStream_t s = c->se;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(wait_in(c, s, err));
    int fl = c->active ^ 1, back = st->front ^ 1;
    int src = lc->outputs_from_back ? back : st->front;
    /* All run lists in one upload: cells, hist, qs, pend, slices, stat, spend. */
    size_t n = lc->ncell_runs + lc->nhist_runs + lc->nq_runs + lc->npend_runs + lc->nslice_runs +
               lc->nstat_runs + lc->nspend_runs;
    amx_run_t *all = (amx_run_t *)malloc((n ? n : 1) * sizeof(amx_run_t));
    if (all == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory");
    size_t o_c = 0, o_h = lc->ncell_runs, o_q = o_h + lc->nhist_runs, o_p = o_q + lc->nq_runs,
           o_s = o_p + lc->npend_runs;
    memcpy(all + o_c, lc->cells, lc->ncell_runs * sizeof(amx_run_t));
    memcpy(all + o_h, lc->hist, lc->nhist_runs * sizeof(amx_run_t));
    memcpy(all + o_q, lc->qs, lc->nq_runs * sizeof(amx_run_t));
    memcpy(all + o_p, lc->pend, lc->npend_runs * sizeof(amx_run_t));
    if (lc->nslice_runs > 0)
        memcpy(all + o_s, lc->slices, lc->nslice_runs * sizeof(amx_run_t));
    size_t o_st = o_s + lc->nslice_runs, o_sp = o_st + lc->nstat_runs;
    if (lc->nstat_runs > 0)
        memcpy(all + o_st, lc->stat, lc->nstat_runs * sizeof(amx_run_t));
    if (lc->nspend_runs > 0)
        memcpy(all + o_sp, lc->spend, lc->nspend_runs * sizeof(amx_run_t));
    amx_status_t rc = upload_runs(&c->e_runs, &c->cap_e_runs, all, n, s, err);
    CU(cudaStreamSynchronize(s), "runs upload");
    free(all);
    AMX_CHECK(rc);
    const amx_run_t *rc_ = c->e_runs + o_c, *rh = c->e_runs + o_h, *rq = c->e_runs + o_q,
                    *rp = c->e_runs + o_p, *rs = c->e_runs + o_s;
    AMX_CHECK(remap_pend(c, fl, lc, rp, s, err));
    AMX_CHECK(remap_f(&c->accum, lc->ncells, -INFINITY, rc_, lc->ncell_runs, s, err));
    AMX_CHECK(remap_f(&c->prev, lc->ncells, 1.0f, rc_, lc->ncell_runs, s, err));
    AMX_CHECK(remap_f(&c->hist, lc->nhist, -INFINITY, rh, lc->nhist_runs, s, err));
    AMX_CHECK(remap_f(&c->prev_g, lc->nq, 1.0f, rq, lc->nq_runs, s, err));
    AMX_CHECK(remap_f(&c->prev_gs, lc->nslices, 1.0f, rs, lc->nslice_runs, s, err));
    /* Statistics: the accumulated sums and the in-flight values. */
    {
        double *np[2] = {NULL, NULL};
        double **old[2] = {&c->saccum, &c->spend[fl]};
        const amx_run_t *runs[2] = {c->e_runs + o_st, c->e_runs + o_sp};
        size_t nr[2] = {lc->nstat_runs, lc->nspend_runs};
        for (int k = 0; k < 2; k++) {
            AMX_CHECK(
                dalloc((void **)&np[k], (lc->nstat ? lc->nstat : 1) * sizeof(double), s, err));
            CU(cudaMemsetAsync(np[k], 0, (lc->nstat ? lc->nstat : 1) * sizeof(double), s),
               "cudaMemsetAsync (statistics)");
            if (*old[k] != NULL && nr[k] > 0)
                AMX_CHECK(copy_runs<double>(np[k], *old[k], runs[k], nr[k], s, err));
            dfree(*old[k], s);
            *old[k] = np[k];
        }
        c->saccum_n = c->spend_n[fl] = lc->nstat;
    }
    AMX_CHECK(amx__state_remap_stats(st, lc, src, back, err));
    st->ncells = lc->ncells;
    st->nhist = lc->nhist;
    st->nq = lc->nq;
    st->nslices = lc->nslices;
    /* Results in the new layout, from the published (or imported) ones. */
    float *na, *ns, *ni, *ga, *gs, *gi, *sa, *ss, *si;
    uint8_t *nb;
    AMX_CHECK(dalloc((void **)&na, lc->ncells * 4, s, err));
    AMX_CHECK(dalloc((void **)&ns, lc->ncells * 4, s, err));
    AMX_CHECK(dalloc((void **)&ni, lc->ncells * 4, s, err));
    AMX_CHECK(dalloc((void **)&nb, lc->ncells, s, err));
    AMX_CHECK(dalloc((void **)&ga, (size_t)lc->nq * 4, s, err));
    AMX_CHECK(dalloc((void **)&gs, (size_t)lc->nq * 4, s, err));
    AMX_CHECK(dalloc((void **)&gi, (size_t)lc->nq * 4, s, err));
    AMX_CHECK(dalloc((void **)&sa, lc->nslices * 4, s, err));
    AMX_CHECK(dalloc((void **)&ss, lc->nslices * 4, s, err));
    AMX_CHECK(dalloc((void **)&si, lc->nslices * 4, s, err));
    AMX_CHECK(fill_f(na, lc->ncells, -INFINITY, s, err));
    AMX_CHECK(fill_f(ns, lc->ncells, 1.0f, s, err));
    AMX_CHECK(fill_f(ni, lc->ncells, 1.0f, s, err));
    if (lc->ncells)
        CU(cudaMemsetAsync(nb, 0, lc->ncells, s), "cudaMemsetAsync");
    AMX_CHECK(fill_f(ga, lc->nq, 0.0f, s, err));
    AMX_CHECK(fill_f(gs, lc->nq, 1.0f, s, err));
    AMX_CHECK(fill_f(gi, lc->nq, 1.0f, s, err));
    AMX_CHECK(fill_f(sa, lc->nslices, 0.0f, s, err));
    AMX_CHECK(fill_f(ss, lc->nslices, 1.0f, s, err));
    AMX_CHECK(fill_f(si, lc->nslices, 1.0f, s, err));
    if (c->o_amax[src] != NULL) {
        AMX_CHECK(copy_runs<float>(na, c->o_amax[src], rc_, lc->ncell_runs, s, err));
        AMX_CHECK(copy_runs<float>(ns, c->o_scale[src], rc_, lc->ncell_runs, s, err));
        AMX_CHECK(copy_runs<float>(ni, c->o_inv[src], rc_, lc->ncell_runs, s, err));
        AMX_CHECK(copy_runs<uint8_t>(nb, c->o_bytes[src], rc_, lc->ncell_runs, s, err));
    }
    if (c->o_gamax[src] != NULL) {
        AMX_CHECK(copy_runs<float>(ga, c->o_gamax[src], rq, lc->nq_runs, s, err));
        AMX_CHECK(copy_runs<float>(gs, c->o_gscale[src], rq, lc->nq_runs, s, err));
        AMX_CHECK(copy_runs<float>(gi, c->o_ginv[src], rq, lc->nq_runs, s, err));
    }
    if (c->o_samax[src] != NULL) {
        AMX_CHECK(copy_runs<float>(sa, c->o_samax[src], rs, lc->nslice_runs, s, err));
        AMX_CHECK(copy_runs<float>(ss, c->o_sscale[src], rs, lc->nslice_runs, s, err));
        AMX_CHECK(copy_runs<float>(si, c->o_sinv[src], rs, lc->nslice_runs, s, err));
    }
    dfree(c->o_samax[back], s), dfree(c->o_sscale[back], s), dfree(c->o_sinv[back], s);
    c->o_samax[back] = sa, c->o_sscale[back] = ss, c->o_sinv[back] = si;
    dfree(c->o_amax[back], s), dfree(c->o_scale[back], s), dfree(c->o_inv[back], s);
    dfree(c->o_bytes[back], s), dfree(c->o_gamax[back], s), dfree(c->o_gscale[back], s);
    dfree(c->o_ginv[back], s);
    c->o_amax[back] = na, c->o_scale[back] = ns, c->o_inv[back] = ni, c->o_bytes[back] = nb;
    c->filled_ok[back] = 0; /* remapped results: which cells were filled is not known */
    c->o_gamax[back] = ga, c->o_gscale[back] = gs, c->o_ginv[back] = gi;
    st->out_cells[back] = lc->ncells;
    AMX_CHECK(amx__state_grow_globals(st, back, lc->nq, err));
    st->out_nq[back] = lc->nq;
    if (lc->nq > 0) {
        CU(cudaMemcpyAsync(st->g_amax[back], ga, (size_t)lc->nq * 4, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (globals)");
        CU(cudaMemcpyAsync(st->g_scale[back], gs, (size_t)lc->nq * 4, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (globals)");
        CU(cudaMemcpyAsync(st->g_inv[back], gi, (size_t)lc->nq * 4, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (globals)");
    }
    /* The host slice arrays are sized afresh (contents as copied below). */
    st->out_ns[back] = 0;
    AMX_CHECK(amx__state_size_slices(st, back, lc->nslices, err));
    if (lc->nslices > 0) {
        size_t sb = (size_t)lc->nslices * 4;
        CU(cudaMemcpyAsync(st->s_amax[back], sa, sb, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (slices)");
        CU(cudaMemcpyAsync(st->s_scale[back], ss, sb, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (slices)");
        CU(cudaMemcpyAsync(st->s_inv[back], si, sb, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (slices)");
    }
    CU(cudaStreamSynchronize(s), "remap");
    return AMX_OK;
}

static amx_status_t cuda_prepare(amx_state_t *st, const float *hdr, uint64_t ncells, float **send,
                                 float **recv, void **stream, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    int fl = c->active ^ 1;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(wait_in(c, c->se, err));
    if (c->pend[fl] == NULL || ncells > c->pend_n[fl])
        return amx_err_set(err, AMX_EINTERNAL, "in-flight buffer holds %llu cells, not %llu",
                           (unsigned long long)(c->pend[fl] ? c->pend_n[fl] : 0),
                           (unsigned long long)ncells);
    if (c->recv == NULL || ncells > c->recv_n) {
        dfree(c->recv, c->se);
        c->recv = NULL;
        AMX_CHECK(dalloc((void **)&c->recv, (AMX_HDR_CELLS + ncells) * sizeof(float), c->se, err));
        c->recv_n = ncells;
    }
    if (c->e_hdr == NULL) /* the reduced header's way out (header_copy) */
        CU(cudaHostAlloc((void **)&c->e_hdr, AMX_HDR_CELLS * sizeof(float), cudaHostAllocDefault),
           "cudaHostAlloc (header)");
    /* One launch writes the header, by value, into the in-flight buffer
     * and zeroes the receive header (one that nothing wrote fails the
     * engine's check); not waited for: the collective follows on se. */
    struct hdr_args h;
    memcpy(h.v, hdr, sizeof(h.v));
    k_header<<<1, AMX_HDR_CELLS, 0, c->se>>>(c->pend[fl], c->recv, h);
    CU(cudaGetLastError(), "header kernel launch");
    *send = c->pend[fl];
    *recv = c->recv;
    *stream = (void *)c->se;
    return AMX_OK;
}

static float *cuda_header_copy(amx_state_t *st, const float **dev)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    *dev = c->recv;
    return c->e_hdr;
}

static amx_status_t cuda_read_header(amx_state_t *st, float *hdr, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    CU(cudaMemcpyAsync(hdr, c->recv, AMX_HDR_CELLS * sizeof(float), cudaMemcpyDeviceToHost, c->se),
       "cudaMemcpyAsync (header)");
    CU(cudaStreamSynchronize(c->se), "header");
    return AMX_OK;
}

/* ---- statistics on the engine thread ---- */

static amx_status_t cuda_stat_prepare(amx_state_t *st, uint64_t n, double **send, double **recv,
                                      void **stream, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    int fl = c->active ^ 1;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(ensure_spend(c, fl, n, c->se, err));
    if (c->srecv == NULL || n > c->srecv_n) {
        dfree(c->srecv, c->se);
        c->srecv = NULL;
        AMX_CHECK(dalloc((void **)&c->srecv, (n ? n : 1) * sizeof(double), c->se, err));
        c->srecv_n = n;
    }
    CU(cudaStreamSynchronize(c->se), "stat buffers");
    *send = c->spend[fl];
    *recv = c->srecv;
    *stream = (void *)c->se;
    return AMX_OK;
}

static amx_status_t cuda_stat_accumulate(amx_state_t *st, uint64_t n, const amx_run_t *clear,
                                         size_t nclear, const amx_run_t *add, size_t nadd,
                                         int from_send, double *host, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaStream_t s = c->se;
    int fl = c->active ^ 1;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(ensure_spend(c, fl, n, s, err));
    if (n != st->nstat || (n > 0 && c->saccum == NULL))
        return amx_err_set(err, AMX_EINTERNAL, "statistics over %llu values, the state holds %llu",
                           (unsigned long long)n, (unsigned long long)st->nstat);
    size_t nr = nclear + nadd;
    amx_run_t *all = (amx_run_t *)malloc((nr ? nr : 1) * sizeof(amx_run_t));
    if (all == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory");
    if (nclear > 0)
        memcpy(all, clear, nclear * sizeof(amx_run_t));
    if (nadd > 0)
        memcpy(all + nclear, add, nadd * sizeof(amx_run_t));
    amx_status_t rc = upload_runs(&c->e_runs, &c->cap_e_runs, all, nr, s, err);
    CU(cudaStreamSynchronize(s), "runs upload");
    free(all);
    AMX_CHECK(rc);
    if (nclear > 0) {
        unsigned grid = nclear < 65535u * 16u ? (unsigned)nclear : 65535u * 16u;
        k_zero_runs<<<grid, THREADS, 0, s>>>(c->saccum, c->e_runs, nclear);
    }
    const double *red = from_send ? c->spend[fl] : c->srecv;
    if (nadd > 0) {
        unsigned grid = nadd < 65535u * 16u ? (unsigned)nadd : 65535u * 16u;
        k_add_runs<<<grid, THREADS, 0, s>>>(c->saccum, red, c->e_runs + nclear, nadd);
    }
    CU(cudaGetLastError(), "stat accumulate kernel launch");
    if (c->spend_n[fl] > 0)
        CU(cudaMemsetAsync(c->spend[fl], 0, c->spend_n[fl] * sizeof(double), s),
           "cudaMemsetAsync (stat buffer)");
    /* The engine reads the sums on the host (engine_stat.c): they come back. */
    if (n > 0)
        CU(cudaMemcpyAsync(host, c->saccum, n * sizeof(double), cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (statistics)");
    CU(cudaStreamSynchronize(s), "stat accumulate");
    return AMX_OK;
}

/* The histogram methods on the device, from the accumulated sums
 * (calib_cuda.cu). */
static amx_status_t cuda_stat_hist(amx_state_t *st, const struct amx_hist_job *jobs, size_t n,
                                   float *out, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    return amx__cuda_hist_amax(c->saccum, st->nstat, jobs, n, out, c->se, err);
}

static amx_status_t cuda_read_accum(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                    float *out, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaStream_t s = c->se;
    uint64_t n = 0;
    for (size_t i = 0; i < nruns; i++)
        n = runs[i].dst + runs[i].len > n ? runs[i].dst + runs[i].len : n;
    if (n == 0)
        return AMX_OK;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    AMX_CHECK(grow_dev((void **)&c->d_ovr, &c->cap_ovr, n, sizeof(float), s, err));
    AMX_CHECK(upload_runs(&c->e_runs, &c->cap_e_runs, runs, nruns, s, err));
    AMX_CHECK(copy_runs<float>(c->d_ovr, c->accum, c->e_runs, nruns, s, err));
    float *tmp = (float *)malloc(n * sizeof(float));
    if (tmp == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory");
    cudaError_t e = cudaMemcpyAsync(tmp, c->d_ovr, n * sizeof(float), cudaMemcpyDeviceToHost, s);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(s);
    if (e != cudaSuccess) {
        free(tmp);
        CU(e, "cudaMemcpyAsync (max)");
    }
    for (size_t i = 0; i < nruns; i++)
        memcpy(out + runs[i].dst, tmp + runs[i].dst, runs[i].len * sizeof(float));
    free(tmp);
    return AMX_OK;
}

enum { P_START, P_UPLOAD, P_RESET, P_ACCUM, P_FILL, P_GLOBAL, P_SCALES, P_D2H, P_CLEAR, P_N };

/* The engine's pinned staging buffer, at least `bytes` long. */
static amx_status_t engine_pin(cuda_state_t *c, size_t bytes, amx_err_t *err)
{
    if (bytes <= c->cap_e_pin)
        return AMX_OK;
    size_t n = c->cap_e_pin ? c->cap_e_pin : 65536;
    while (n < bytes)
        n *= 2;
    void *p = NULL;
    CU(cudaHostAlloc(&p, n, cudaHostAllocDefault), "cudaHostAlloc (engine staging)");
    retire(c, c->e_pin);
    c->e_pin = p;
    c->cap_e_pin = n;
    return AMX_OK;
}

/* Queues finish's kernels and copies after the uploads on s: the epoch's
 * accumulation, the per-quantizer and per-slice globals, the scales, the
 * per-quantizer results into the pinned host arrays and the clearing of
 * the pending buffer. With `ev` (AMAXD_PROFILE), records ev[P_RESET ..
 * P_D2H] between the stages. Nothing here allocates or waits: it is
 * captured as a CUDA graph (finish_graph). */
static amx_status_t finish_launch(const struct fin_args *a, cudaStream_t s, cudaEvent_t *ev,
                                  amx_err_t *err)
{
#define AT(i)                                                                                      \
    do {                                                                                           \
        if (ev != NULL)                                                                            \
            cudaEventRecord(ev[i], s);                                                             \
    } while (0)
    if (a->nq > 0) {
        uint32_t nq = a->nq;
        float *peer_max = a->groups, *scale_max = a->groups + a->npeer;
        size_t m = a->ngroups > nq ? a->ngroups : nq;
        k_epoch_init<<<blocks_for(m), THREADS, 0, s>>>(a->groups, a->ngroups, a->o_gamax, a->empty,
                                                       nq);
        AT(P_RESET);
        if (a->n > 0)
            k_accumulate<<<chunks_for(a->n), THREADS, 0, s>>>(
                a->dq, nq, a->n, a->red, a->accum, a->hist, a->o_amax, peer_max, a->o_gamax,
                a->empty, a->clear, a->chunkq, a->d_ovr, a->fuse, a->prev, a->o_scale, a->o_inv,
                a->o_bytes, a->o_filled, a->d_counts);
        AT(P_ACCUM);
        k_quantizer_max<<<blocks_for(nq), THREADS, 0, s>>>(a->dq, nq, peer_max, a->empty,
                                                           a->o_gamax, scale_max);
        AT(P_FILL);
        k_global<<<blocks_for(nq), THREADS, 0, s>>>(a->dq, nq, scale_max, a->o_gamax, a->prev_g,
                                                    a->o_gscale, a->o_ginv, a->gdec);
        if (a->nsl > 0) {
            unsigned sb = a->nsl < 65535u * 16u ? (unsigned)a->nsl : 65535u * 16u;
            k_slices<<<sb, THREADS, 0, s>>>(a->dq, nq, a->nsl, a->o_amax, peer_max, a->prev_gs,
                                            a->o_samax, a->o_sscale, a->o_sinv, a->sdec);
        }
        CU(cudaGetLastError(), "epoch kernels launch");
        AT(P_GLOBAL);
        if (a->n > 0)
            k_scales<<<chunks_for(a->n), THREADS, 0, s>>>(
                a->dq, nq, a->n, a->o_amax, peer_max, a->o_gamax, a->o_gscale, a->gdec, a->o_samax,
                a->o_sscale, a->sdec, a->prev, a->o_scale, a->o_inv, a->o_bytes, a->chunkq,
                a->o_filled, a->d_counts, a->fuse);
        CU(cudaGetLastError(), "scale kernel launch");
        AT(P_SCALES);
        size_t gbytes = (size_t)nq * 4;
        if (a->uva) {
            /* One kernel instead of up to seven copies (each a graph node
             * of a few microseconds): the pinned host results are mapped
             * under unified addressing. */
            struct out_args o;
            memset(&o, 0, sizeof(o));
            const float *src[6] = {a->o_gamax, a->o_gscale, a->o_ginv,
                                   a->o_samax, a->o_sscale, a->o_sinv};
            float *dst[6] = {a->g_amax, a->g_scale, a->g_inv, a->s_amax, a->s_scale, a->s_inv};
            for (int k = 0; k < 6; k++) {
                o.src[k] = src[k];
                o.dst[k] = dst[k];
                o.n[k] = k < 3 ? nq : a->nsl;
            }
            o.dc = a->d_counts;
            o.hc = a->h_counts;
            uint64_t m = nq > a->nsl ? nq : a->nsl;
            unsigned nb = blocks_for(m);
            if (nb > 1024)
                nb = 1024;
            k_copy_out<<<nb, THREADS, 0, s>>>(o);
            CU(cudaGetLastError(), "copy-out kernel launch");
            AT(P_D2H);
            if (a->clear == NULL)
                AMX_CHECK(fill_f(a->pend, a->pend_n, -INFINITY, s, err));
            return AMX_OK;
        }
        CU(cudaMemcpyAsync(a->h_counts, a->d_counts, 2 * sizeof(unsigned long long),
                           cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (cell counts)");
        /* Straight into the (pinned) host results. */
        CU(cudaMemcpyAsync(a->g_amax, a->o_gamax, gbytes, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (globals)");
        CU(cudaMemcpyAsync(a->g_scale, a->o_gscale, gbytes, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (globals)");
        CU(cudaMemcpyAsync(a->g_inv, a->o_ginv, gbytes, cudaMemcpyDeviceToHost, s),
           "cudaMemcpyAsync (globals)");
        if (a->nsl > 0) {
            size_t sb = (size_t)a->nsl * 4;
            CU(cudaMemcpyAsync(a->s_amax, a->o_samax, sb, cudaMemcpyDeviceToHost, s),
               "cudaMemcpyAsync (slices)");
            CU(cudaMemcpyAsync(a->s_scale, a->o_sscale, sb, cudaMemcpyDeviceToHost, s),
               "cudaMemcpyAsync (slices)");
            CU(cudaMemcpyAsync(a->s_inv, a->o_sinv, sb, cudaMemcpyDeviceToHost, s),
               "cudaMemcpyAsync (slices)");
        }
    }
    AT(P_D2H);
    if (a->clear == NULL)
        AMX_CHECK(fill_f(a->pend, a->pend_n, -INFINITY, s, err));
#undef AT
    return AMX_OK;
}

/* finish_launch through a CUDA graph: one launch instead of a dozen (at a
 * small catalog the host's launches, not the device, set finish's time:
 * bench/NOTES.md). A graph is captured once per distinct fin_args (the
 * output set and pending buffer alternate, so a steady job uses two) and
 * kept while its key holds; four are kept. AMAXD_FINISH_GRAPH=0, or a
 * capture that fails, launches directly instead. *graphed: a graph ran. */
static amx_status_t finish_graph(cuda_state_t *c, const struct fin_args *a, cudaStream_t s,
                                 cudaEvent_t *ev, int *graphed, amx_err_t *err)
{
    *graphed = 0;
    if (c->graphs_off == 0) {
        const char *v = getenv("AMAXD_FINISH_GRAPH");
        c->graphs_off = v != NULL && strcmp(v, "0") == 0 ? 1 : -1;
    }
    if (c->graphs_off > 0)
        return finish_launch(a, s, ev, err);
    struct fin_graph *g = NULL, *lru = &c->graphs[0];
    for (int i = 0; i < 4 && g == NULL; i++) {
        if (c->graphs[i].exec != NULL && memcmp(&c->graphs[i].key, a, sizeof(*a)) == 0)
            g = &c->graphs[i];
        else if (c->graphs[i].used < lru->used)
            lru = &c->graphs[i];
    }
    if (g == NULL) {
        if (lru->exec != NULL)
            cudaGraphExecDestroy(lru->exec);
        lru->exec = NULL;
        cudaGraph_t graph = NULL;
        cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
        amx_status_t r = AMX_OK;
        if (e == cudaSuccess) {
            r = finish_launch(a, s, NULL, err);
            cudaError_t e2 = cudaStreamEndCapture(s, &graph);
            if (r == AMX_OK)
                e = e2;
        }
        if (e == cudaSuccess && r == AMX_OK)
            e = cudaGraphInstantiate(&lru->exec, graph, 0);
        if (graph != NULL)
            cudaGraphDestroy(graph);
        if (e != cudaSuccess || r != AMX_OK) {
            lru->exec = NULL;
            cudaGetLastError();
            AMX_WARN("cuda",
                     "capturing finish as a CUDA graph failed (%s%s): launching its kernels one "
                     "by one from now on",
                     e != cudaSuccess ? cudaGetErrorString(e) : "", r != AMX_OK ? err->msg : "");
            c->graphs_off = 1;
            return finish_launch(a, s, ev, err);
        }
        lru->key = *a;
        g = lru;
    }
    g->used = ++c->graph_clock;
    CU(cudaGraphLaunch(g->exec, s), "cudaGraphLaunch (finish)");
    *graphed = 1;
    for (int i = P_RESET; ev != NULL && i <= P_D2H; i++)
        cudaEventRecord(ev[i], s); /* the profile shows the graph as its first stage */
    return AMX_OK;
}

static amx_status_t finish_epoch(amx_state_t *st, const amx_qdesc_t *qs, uint32_t nq,
                                 uint64_t ncells, uint32_t npeer, uint32_t nscale, int from_send,
                                 int desc_dirty, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaStream_t s = c->se;
    uint64_t t0 = amx_now_us();
    int fl = c->active ^ 1, back = st->front ^ 1;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    if (ncells != st->ncells)
        return amx_err_set(err, AMX_EINTERNAL, "finish over %llu cells, the state holds %llu",
                           (unsigned long long)ncells, (unsigned long long)st->ncells);
    int prof = amx_log_profiling();
    cudaEvent_t ev[P_N];
    if (prof)
        for (int i = 0; i < P_N; i++)
            cudaEventCreate(&ev[i]);
#define MARK(i)                                                                                    \
    do {                                                                                           \
        if (prof)                                                                                  \
            cudaEventRecord(ev[i], s);                                                             \
    } while (0)
    size_t ngroups = (size_t)npeer + nscale;
    uint32_t nch = chunks_for(ncells);
    if (nq > c->cap_dq)
        c->dq_n = 0; /* regrown: the descriptors go up again */
    if (nch > c->cap_chunkq)
        c->chunkq_n = 0;
    AMX_CHECK(grow_dev((void **)&c->groups, &c->cap_groups, ngroups, sizeof(float), s, err));
    AMX_CHECK(grow_dev((void **)&c->dq, &c->cap_dq, nq, sizeof(amx_qdesc_t), s, err));
    AMX_CHECK(grow_dev((void **)&c->chunkq, &c->cap_chunkq, nch, sizeof(uint32_t), s, err));
    AMX_CHECK(grow_dev((void **)&c->empty, &c->cap_empty, nq, 1, s, err));
    AMX_CHECK(grow_dev((void **)&c->gdec, &c->cap_gdec, nq, sizeof(float), s, err));
    size_t dbytes = (size_t)nq * sizeof(amx_qdesc_t);
    AMX_CHECK(engine_pin(c, dbytes, err));
    char *pin_d = (char *)c->e_pin;
    uint64_t nsl = amx_qdesc_slices(qs, nq);
    if (nsl != st->nslices)
        return amx_err_set(err, AMX_EINTERNAL,
                           "finish over %llu global slices, the state holds %llu",
                           (unsigned long long)nsl, (unsigned long long)st->nslices);
    AMX_CHECK(size_outputs(st, back, ncells, nq, nsl, err));
    AMX_CHECK(grow_dev((void **)&c->sdec, &c->cap_sdec, nsl, sizeof(float), s, err));
    AMX_CHECK(size_filled(c, back, ncells, err));
    uint64_t n = ncells;
    const float *red = (from_send ? c->pend[fl] : c->recv) + AMX_HDR_CELLS;
    const float *d_ovr = NULL;
    if (st->ovr != NULL && st->nscell > 0) {
        /* The calibrated amax of each stat cell (engine_stat.c, on the host). */
        AMX_CHECK(grow_dev((void **)&c->d_ovr, &c->cap_ovr, st->nscell, sizeof(float), s, err));
        CU(cudaMemcpyAsync(c->d_ovr, st->ovr, st->nscell * sizeof(float), cudaMemcpyHostToDevice,
                           s),
           "cudaMemcpyAsync (calibrated amax)");
        d_ovr = c->d_ovr;
    }
    uint64_t t_setup = amx_now_us();
    MARK(P_START);
    if (nq > 0) {
        int upload = desc_dirty || c->dq_n != nq;
        if (upload) {
            memcpy(pin_d, qs, dbytes);
            CU(cudaMemcpyAsync(c->dq, pin_d, dbytes, cudaMemcpyHostToDevice, s),
               "cudaMemcpyAsync (descriptors)");
            c->dq_n = nq;
        }
        if (upload || c->chunkq_n != nch) {
            k_chunk_table<<<blocks_for(nch), THREADS, 0, s>>>(c->dq, nq, nch, c->chunkq);
            c->chunkq_n = nch;
        }
        MARK(P_UPLOAD);
        /* Reset flags only ever come with new descriptors. */
        if (desc_dirty) {
            unsigned nb = nq < 4096 ? nq : 4096;
            k_reset_flagged<<<nb, THREADS, 0, s>>>(c->dq, nq, c->accum, c->prev, c->hist, c->prev_g,
                                                   c->prev_gs);
        }
    }
    struct fin_args a;
    memset(&a, 0, sizeof(a)); /* a graph key: no stray padding */
    a.nq = nq;
    a.nch = nch;
    a.back = (uint32_t)back;
    a.fl = (uint32_t)fl;
    a.n = n;
    a.npeer = npeer;
    a.nsl = nsl;
    a.ngroups = ngroups;
    a.pend_n = c->pend_n[fl];
    a.red = red;
    a.d_ovr = d_ovr;
    /* The next epoch's pending buffer is cleared by accumulate when it
     * covers the same cells, else by a fill. */
    a.clear = nq > 0 && c->pend_n[fl] == n ? c->pend[fl] + AMX_HDR_CELLS : NULL;
    a.pend = c->pend[fl] + AMX_HDR_CELLS;
    a.groups = c->groups;
    a.accum = c->accum;
    a.hist = c->hist;
    a.prev = c->prev;
    a.prev_g = c->prev_g;
    a.prev_gs = c->prev_gs;
    a.dq = c->dq;
    a.empty = c->empty;
    a.chunkq = c->chunkq;
    a.gdec = c->gdec;
    a.sdec = c->sdec;
    a.o_amax = c->o_amax[back];
    a.o_scale = c->o_scale[back];
    a.o_inv = c->o_inv[back];
    a.o_gamax = c->o_gamax[back];
    a.o_gscale = c->o_gscale[back];
    a.o_ginv = c->o_ginv[back];
    a.o_samax = c->o_samax[back];
    a.o_sscale = c->o_sscale[back];
    a.o_sinv = c->o_sinv[back];
    a.o_bytes = c->o_bytes[back];
    a.o_filled = c->o_filled[back];
    a.d_counts = c->d_counts;
    a.h_counts = c->h_counts;
    a.g_amax = st->g_amax[back];
    a.g_scale = st->g_scale[back];
    a.g_inv = st->g_inv[back];
    a.s_amax = st->s_amax[back];
    a.s_scale = st->s_scale[back];
    a.s_inv = st->s_inv[back];
    a.uva = c->uva;
    a.fuse = c->fuse;
    int graphed = 0;
    AMX_CHECK(finish_graph(c, &a, s, prof ? ev : NULL, &graphed, err));
    MARK(P_CLEAR);
    uint64_t t_launched = amx_now_us();
    CU(cudaStreamSynchronize(s), "epoch kernels");
    uint64_t t_synced = amx_now_us();
    st->cell_counts = 1;
    st->last_filled = nq > 0 ? c->h_counts[0] : 0;
    st->last_missing = nq > 0 ? c->h_counts[1] : 0;
    c->filled_ok[back] = 1;
    st->last_finish_us = amx_now_us() - t0;
    if (prof) {
        static const char *names[P_N] = {"",       "upload", "reset", "accumulate", "fill",
                                         "global", "scales", "d2h",   "clear"};
        char buf[512];
        size_t k = 0;
        for (int i = 1; i < P_N && k < sizeof(buf); i++) {
            float ms = 0.0f;
            cudaEventElapsedTime(&ms, ev[i - 1], ev[i]);
            k += (size_t)snprintf(buf + k, sizeof(buf) - k, " %s %.0f", names[i], ms * 1000.0f);
        }
        AMX_INFO("profile",
                 "finish of %llu cells / %u quantizers%s: host setup %llu us, launches "
                 "%llu us, wait %llu us, copy-out %llu us; device us:%s",
                 (unsigned long long)ncells, nq,
                 graphed ? " (one CUDA graph: its time is under reset)" : "",
                 (unsigned long long)(t_setup - t0), (unsigned long long)(t_launched - t_setup),
                 (unsigned long long)(t_synced - t_launched),
                 (unsigned long long)(amx_now_us() - t_synced), buf);
        for (int i = 0; i < P_N; i++)
            cudaEventDestroy(ev[i]);
    }
#undef MARK
    return AMX_OK;
}

/* finish_epoch; after a failure, waits for whatever it had queued (copies
 * into host results must not run on after the caller moves on) and
 * forgets what it had uploaded. */
static amx_status_t cuda_finish(amx_state_t *st, const amx_qdesc_t *qs, uint32_t nq,
                                uint64_t ncells, uint32_t npeer, uint32_t nscale, int from_send,
                                int desc_dirty, amx_err_t *err)
{
    cuda_state_t *ci = (cuda_state_t *)st->impl;
    CU(cudaSetDevice(ci->device), "cudaSetDevice");
    AMX_CHECK(wait_in(ci, ci->se, err));
    amx_status_t r = finish_epoch(st, qs, nq, ncells, npeer, nscale, from_send, desc_dirty, err);
    if (r != AMX_OK) {
        cuda_state_t *c = (cuda_state_t *)st->impl;
        cudaStreamSynchronize(c->se);
        c->dq_n = 0;
        c->chunkq_n = 0;
    }
    return r;
}

static amx_status_t cuda_export(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                uint64_t nslices, int back, const amx_state_arrays_t *d,
                                amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaStream_t s = c->se;
    int f = st->front ^ (back != 0);
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    if (ncells != st->ncells || nhist != st->nhist || nq != st->nq || ncells != st->out_cells[f] ||
        nq > st->out_nq[f] || nslices != st->nslices || nslices != st->out_ns[f])
        return amx_err_set(err, AMX_EINTERNAL,
                           "state export of %llu cells / %u quantizers, the state holds %llu / %u",
                           (unsigned long long)ncells, nq, (unsigned long long)st->ncells, st->nq);
    struct {
        void *dst;
        const void *src;
        size_t bytes;
    } cp[] = {{d->accum, c->accum, ncells * 4},        {d->prev, c->prev, ncells * 4},
              {d->hist, c->hist, nhist * 4},           {d->prev_g, c->prev_g, (size_t)nq * 4},
              {d->out_amax, c->o_amax[f], ncells * 4}, {d->out_scale, c->o_scale[f], ncells * 4},
              {d->out_inv, c->o_inv[f], ncells * 4},   {d->out_bytes, c->o_bytes[f], ncells},
              {d->prev_gs, c->prev_gs, nslices * 4}};
    for (size_t k = 0; k < sizeof(cp) / sizeof(cp[0]); k++)
        if (cp[k].bytes)
            CU(cudaMemcpyAsync(cp[k].dst, cp[k].src, cp[k].bytes, cudaMemcpyDeviceToHost, s),
               "cudaMemcpyAsync (export)");
    if (d->nstat != st->nstat || d->nscell != st->nscell)
        return amx_err_set(err, AMX_EINTERNAL,
                           "state export of %llu statistic values, the state holds %llu",
                           (unsigned long long)d->nstat, (unsigned long long)st->nstat);
    if (d->nstat > 0 && d->stat != NULL)
        CU(cudaMemcpyAsync(d->stat, c->saccum, d->nstat * sizeof(double), cudaMemcpyDeviceToHost,
                           s),
           "cudaMemcpyAsync (export)");
    CU(cudaStreamSynchronize(s), "export");
    amx__state_export_stats(st, nq, f, d);
    if (nq) {
        memcpy(d->g_amax, st->g_amax[f], nq * sizeof(float));
        memcpy(d->g_scale, st->g_scale[f], nq * sizeof(float));
        memcpy(d->g_inv, st->g_inv[f], nq * sizeof(float));
    }
    if (nslices) {
        memcpy(d->s_amax, st->s_amax[f], nslices * sizeof(float));
        memcpy(d->s_scale, st->s_scale[f], nslices * sizeof(float));
        memcpy(d->s_inv, st->s_inv[f], nslices * sizeof(float));
    }
    return AMX_OK;
}

static amx_status_t cuda_import(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                uint64_t nslices, const amx_state_arrays_t *src, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaStream_t s = c->se;
    int back = st->front ^ 1;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    /* The back outputs may be freed below: after any device answer still
     * reading them (they were front until a failed epoch published). */
    AMX_CHECK(wait_in(c, s, err));
    dfree(c->accum, s), dfree(c->prev, s), dfree(c->hist, s), dfree(c->prev_g, s);
    dfree(c->prev_gs, s);
    c->accum = c->prev = c->hist = c->prev_g = c->prev_gs = NULL;
    AMX_CHECK(dalloc((void **)&c->accum, ncells * 4, s, err));
    AMX_CHECK(dalloc((void **)&c->prev, ncells * 4, s, err));
    AMX_CHECK(dalloc((void **)&c->hist, nhist * 4, s, err));
    AMX_CHECK(dalloc((void **)&c->prev_g, (size_t)nq * 4, s, err));
    AMX_CHECK(dalloc((void **)&c->prev_gs, nslices * 4, s, err));
    st->ncells = ncells;
    st->nhist = nhist;
    st->nq = nq;
    st->nslices = nslices;
    AMX_CHECK(size_outputs(st, back, ncells, nq, nslices, err));
    c->filled_ok[back] = 0; /* imported results: which cells were filled is not known */
    struct {
        void *dst;
        const void *src;
        size_t bytes;
    } cp[] = {{c->accum, src->accum, ncells * 4},
              {c->prev, src->prev, ncells * 4},
              {c->hist, src->hist, nhist * 4},
              {c->prev_g, src->prev_g, (size_t)nq * 4},
              {c->o_amax[back], src->out_amax, ncells * 4},
              {c->o_scale[back], src->out_scale, ncells * 4},
              {c->o_inv[back], src->out_inv, ncells * 4},
              {c->o_bytes[back], src->out_bytes, ncells},
              {c->o_gamax[back], src->g_amax, (size_t)nq * 4},
              {c->o_gscale[back], src->g_scale, (size_t)nq * 4},
              {c->o_ginv[back], src->g_inv, (size_t)nq * 4},
              {c->prev_gs, src->prev_gs, nslices * 4},
              {c->o_samax[back], src->s_amax, nslices * 4},
              {c->o_sscale[back], src->s_scale, nslices * 4},
              {c->o_sinv[back], src->s_inv, nslices * 4}};
    for (size_t k = 0; k < sizeof(cp) / sizeof(cp[0]); k++)
        if (cp[k].bytes)
            CU(cudaMemcpyAsync(cp[k].dst, cp[k].src, cp[k].bytes, cudaMemcpyHostToDevice, s),
               "cudaMemcpyAsync (import)");
    /* Statistics: the accumulated sums. The stat buffers keep their layout
     * (the loop's) until the remap that follows every import. */
    dfree(c->saccum, s);
    c->saccum = NULL;
    AMX_CHECK(dalloc((void **)&c->saccum, (src->nstat ? src->nstat : 1) * sizeof(double), s, err));
    c->saccum_n = src->nstat;
    if (src->nstat > 0 && src->stat != NULL)
        CU(cudaMemcpyAsync(c->saccum, src->stat, src->nstat * sizeof(double),
                           cudaMemcpyHostToDevice, s),
           "cudaMemcpyAsync (import)");
    CU(cudaStreamSynchronize(s), "import");
    AMX_CHECK(amx__state_import_stats(st, src, nq, back, err));
    if (nq) {
        memcpy(st->g_amax[back], src->g_amax, nq * sizeof(float));
        memcpy(st->g_scale[back], src->g_scale, nq * sizeof(float));
        memcpy(st->g_inv[back], src->g_inv, nq * sizeof(float));
    }
    if (nslices) {
        memcpy(st->s_amax[back], src->s_amax, nslices * sizeof(float));
        memcpy(st->s_scale[back], src->s_scale, nslices * sizeof(float));
        memcpy(st->s_inv[back], src->s_inv, nslices * sizeof(float));
    }
    return AMX_OK;
}

static void cuda_destroy(amx_state_t *st)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    cudaSetDevice(c->device);
    if (c->dev_used)
        cudaStreamSynchronize(c->sd);
    cudaStreamSynchronize(c->sl);
    cudaStreamSynchronize(c->se);
    void *dev[] = {c->pend[0],     c->pend[1],     c->recv,        c->accum,       c->prev,
                   c->hist,        c->prev_g,      c->o_amax[0],   c->o_amax[1],   c->o_scale[0],
                   c->o_scale[1],  c->o_inv[0],    c->o_inv[1],    c->o_bytes[0],  c->o_bytes[1],
                   c->o_gamax[0],  c->o_gamax[1],  c->o_gscale[0], c->o_gscale[1], c->o_ginv[0],
                   c->o_ginv[1],   c->groups,      c->dq,          c->d_stage,     c->d_runs,
                   c->e_runs,      c->empty,       c->chunkq,      c->prev_gs,     c->o_samax[0],
                   c->o_samax[1],  c->o_sscale[0], c->o_sscale[1], c->o_sinv[0],   c->o_sinv[1],
                   c->o_filled[0], c->o_filled[1], c->d_counts,    c->gdec,        c->sdec,
                   c->spend[0],    c->spend[1],    c->srecv,       c->saccum,      c->d_ovr,
                   c->d_sstage,    c->d_prev,      c->d_ones};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
        if (dev[i] != NULL)
            cudaFreeAsync(dev[i], c->se);
    cudaStreamSynchronize(c->se);
    cudaFreeHost(c->h_stage);
    cudaFreeHost(c->h_runs);
    cudaFreeHost(c->e_pin);
    cudaFreeHost(c->e_hdr);
    for (int i = 0; i < 4; i++)
        if (c->graphs[i].exec != NULL)
            cudaGraphExecDestroy(c->graphs[i].exec);
    cudaFreeHost(c->h_counts);
    cudaFreeHost(c->h_sstage);
    cudaFreeHost(c->h_prev);
    for (size_t i = 0; i < c->nretired; i++)
        cudaFreeHost(c->retired[i]);
    free(c->retired);
    free(c->merging);
    pthread_mutex_destroy(&c->retired_mu);
    cudaStreamDestroy(c->sl);
    cudaStreamDestroy(c->se);
    if (c->dev_used) {
        cudaEventDestroy(c->in);
        cudaEventDestroy(c->answered);
        cudaStreamDestroy(c->sd);
    }
    free(c);
}

/* ---- device buffers shared with trainers (devbuf.cu) ---- */

static amx_status_t cuda_dev_open(amx_state_t *st, const char *device, uint64_t slab_bytes,
                                  uint64_t answer_bytes, amx_devbuf_t **out,
                                  amx_devbuf_info_t *info, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    if (!c->dev_used) {
        CU(cudaSetDevice(c->device), "cudaSetDevice");
        CU(cudaStreamCreateWithFlags(&c->sd, cudaStreamNonBlocking), "cudaStreamCreate");
        cudaError_t e = cudaEventCreateWithFlags(&c->in, cudaEventDisableTiming);
        if (e == cudaSuccess) {
            e = cudaEventCreateWithFlags(&c->answered, cudaEventDisableTiming);
            if (e != cudaSuccess)
                cudaEventDestroy(c->in);
        }
        if (e != cudaSuccess) {
            cudaStreamDestroy(c->sd);
            CU(e, "cudaEventCreate");
        }
        c->dev_used = 1;
    }
    return amx__cuda_dev_open(c->device, device, slab_bytes, answer_bytes, out, info, err);
}

static amx_status_t cuda_dev_merge(amx_state_t *st, amx_devbuf_t *d, const amx_run_t *runs,
                                   size_t nruns, uint64_t key, uint64_t ncells,
                                   uint64_t has_data_off, const amx_devsignal_t *ready,
                                   uint32_t rank, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    int fl = c->active ^ 1; /* just flipped: the in-flight buffer */
    if (c->pend[fl] == NULL)
        return amx_err_set(err, AMX_EINTERNAL, "no in-flight buffer to merge a device slab into");
    if (c->nmerging == c->cap_merging) {
        size_t cap = c->cap_merging ? 2 * c->cap_merging : 8;
        amx_devbuf_t **m = (amx_devbuf_t **)realloc(c->merging, cap * sizeof(*m));
        if (m == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        c->merging = m;
        c->cap_merging = cap;
    }
    AMX_CHECK(amx__cuda_dev_merge(d, c->pend[fl] + AMX_HDR_CELLS, runs, nruns, key, ncells,
                                  has_data_off, ready, rank, c->sd, c->in, err));
    c->merging[c->nmerging++] = d;
    return AMX_OK;
}

static amx_status_t cuda_dev_wait(amx_state_t *st, uint64_t deadline_ms, int spin,
                                  int (*aborted)(void *ud), void *ud, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    if (!c->dev_used || c->nmerging == 0)
        return AMX_OK;
    CU(cudaSetDevice(c->device), "cudaSetDevice");
    return amx__cuda_dev_wait(c->merging, c->nmerging, c->sd, c->in, c->device, deadline_ms, spin,
                              aborted, ud, err);
}

static int cuda_dev_waiting(amx_state_t *st, amx_devbuf_t *d)
{
    (void)st;
    return amx__cuda_dev_waiting(d);
}

static int64_t cuda_dev_bad(amx_state_t *st, amx_devbuf_t *d)
{
    (void)st;
    return amx__cuda_dev_bad(d);
}

/* The job's previous globals (lay->prev_*) on the device for the device
 * answers, copied once per lay->prev_key: every rank's answer of an epoch
 * reads the same copy. */
static amx_status_t prev_upload(const amx_state_t *st, cuda_state_t *c,
                                const amx_devans_layout_t *lay, amx_devans_src_t *src,
                                amx_err_t *err)
{
    size_t pn = lay->prev_n;
    if (pn == 0 || lay->nq == 0)
        return AMX_OK;
    int back = st->front ^ 1;
    if (lay->prev_dev && st->out_nq[back] >= pn && c->o_gamax[back] != NULL) {
        /* The set published before this epoch's, all of it (reconcile.c
         * previous_on_device): read in place, behind the engine's finish;
         * the next epoch's writes to it wait for the answers (wait_in). */
        if (pn > c->cap_ones) {
            CU(cudaSetDevice(c->device), "cudaSetDevice");
            dfree(c->d_ones, c->sl);
            c->d_ones = NULL;
            c->cap_ones = 0;
            size_t cap = pn + pn / 4;
            AMX_CHECK(dalloc((void **)&c->d_ones, cap, c->sl, err));
            CU(cudaMemsetAsync(c->d_ones, 1, cap, c->sl), "cudaMemsetAsync (has-previous)");
            c->cap_ones = cap;
        }
        src->pga = c->o_gamax[back];
        src->pgs = c->o_gscale[back];
        src->pok = c->d_ones;
        src->prev_n = (uint32_t)pn;
        return AMX_OK;
    }
    if (lay->prev_dev)
        return amx_err_set(err, AMX_EINTERNAL,
                           "the previous globals are not on the device (%llu of %zu there)",
                           (unsigned long long)st->out_nq[back], pn);
    if (lay->prev_key == 0 || lay->prev_key != c->prev_key || pn != c->prev_n_up) {
        CU(cudaSetDevice(c->device), "cudaSetDevice");
        /* The last copy out of the staging is behind the last answer. */
        if (c->answered_used)
            CU(cudaEventSynchronize(c->answered), "cudaEventSynchronize (device answers)");
        c->prev_key = 0;
        c->prev_n_up = 0;
        size_t bytes = 9 * pn;
        if (bytes > c->cap_prev) {
            cudaFreeHost(c->h_prev);
            dfree(c->d_prev, c->sl);
            c->h_prev = NULL;
            c->d_prev = NULL;
            c->cap_prev = 0;
            size_t cap = bytes + bytes / 4;
            CU(cudaHostAlloc(&c->h_prev, cap, cudaHostAllocDefault), "cudaHostAlloc");
            AMX_CHECK(dalloc((void **)&c->d_prev, cap, c->sl, err));
            c->cap_prev = cap;
        }
        uint8_t *h = (uint8_t *)c->h_prev;
        memcpy(h, lay->prev_ga, 4 * pn);
        memcpy(h + 4 * pn, lay->prev_gs, 4 * pn);
        memcpy(h + 8 * pn, lay->prev_ok, pn);
        CU(cudaMemcpyAsync(c->d_prev, h, 9 * pn, cudaMemcpyHostToDevice, c->sl),
           "cudaMemcpyAsync (previous globals)");
        c->prev_key = lay->prev_key;
        c->prev_n_up = (uint32_t)pn;
    }
    src->pga = c->d_prev;
    src->pgs = c->d_prev + pn;
    src->pok = (const uint8_t *)(c->d_prev + 2 * pn);
    src->prev_n = (uint32_t)pn;
    return AMX_OK;
}

static amx_status_t cuda_dev_answer(amx_state_t *st, amx_devbuf_t *d, const amx_run_t *gather,
                                    size_t ngather, uint64_t ncells, const amx_devans_layout_t *lay,
                                    const amx_devsignal_t *done, amx_err_t *err)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    int f = st->front;
    amx_devans_src_t src;
    memset(&src, 0, sizeof(src));
    src.amax = c->o_amax[f], src.scale = c->o_scale[f], src.inv = c->o_inv[f];
    src.bytes = c->o_bytes[f];
    src.gamax = c->o_gamax[f], src.gscale = c->o_gscale[f], src.ginv = c->o_ginv[f];
    src.samax = c->o_samax[f], src.sscale = c->o_sscale[f], src.sinv = c->o_sinv[f];
    src.out_nq = st->out_nq[f];
    src.out_ns = st->out_ns[f];
    AMX_CHECK(prev_upload(st, c, lay, &src, err));
    amx_status_t r = amx__cuda_dev_answer(d, &src, gather, ngather, ncells, lay, done, c->sl, err);
    /* Not waited for here: the engine's next operations wait for it
     * (wait_in), the loop's own are behind it on sl. Also after a failure,
     * which may have queued part of it. */
    cudaError_t e = cudaEventRecord(c->answered, c->sl);
    if (e == cudaSuccess)
        c->answered_used = 1;
    if (r != AMX_OK)
        return r;
    CU(e, "cudaEventRecord (device answers)");
    return AMX_OK;
}

static void cuda_dev_close(amx_state_t *st, amx_devbuf_t *d)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    for (size_t i = 0; i < c->nmerging; i++)
        if (c->merging[i] == d)
            c->merging[i--] = c->merging[--c->nmerging];
    amx__cuda_dev_close(d);
}

/* Per-quantizer host results are pinned: finish copies into them directly. */
static void *pinned_alloc(amx_state_t *st, size_t bytes)
{
    cuda_state_t *c = (cuda_state_t *)st->impl;
    void *p = NULL;
    cudaSetDevice(c->device);
    if (cudaHostAlloc(&p, bytes ? bytes : 4, cudaHostAllocDefault) != cudaSuccess)
        return NULL;
    return p;
}

static void pinned_free(amx_state_t *st, void *p)
{
    retire((cuda_state_t *)st->impl, p);
}

static const amx_state_ops_t cuda_ops = {
    "cuda",
    1,
    cuda_reserve_pending,
    cuda_merge,
    cuda_flip,
    cuda_unflip,
    cuda_remap_active,
    cuda_publish,
    cuda_read_results,
    cuda_remap,
    cuda_prepare,
    cuda_read_header,
    cuda_finish,
    cuda_export,
    cuda_import,
    cuda_destroy,
    NULL,
    NULL,
    cuda_read_filled,
    cuda_stat_merge,
    cuda_stat_prepare,
    cuda_stat_accumulate,
    cuda_read_accum,
    cuda_dev_open,
    cuda_dev_merge,
    cuda_dev_bad,
    cuda_dev_waiting,
    cuda_dev_answer,
    cuda_dev_close,
    cuda_stat_hist,
    cuda_dev_wait,
    cuda_header_copy,
};

extern "C" uint64_t amx__state_cuda_memory(int device)
{
    size_t free_b = 0, total = 0;
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
        return 0;
    cudaError_t e = cudaMemGetInfo(&free_b, &total);
    cudaSetDevice(prev);
    return e == cudaSuccess ? (uint64_t)total : 0;
}

extern "C" int amx__state_cuda_probe(void)
{
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

extern "C" amx_status_t amx__state_cuda_create(int device, amx_state_t **out, amx_err_t *err)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0)
        return amx_err_set(err, AMX_EUNAVAIL, "no usable CUDA device (%s); use --backend=host",
                           e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    if (device < 0 || device >= n)
        return amx_err_set(err, AMX_EINVAL, "cuda_device %d does not exist (%d visible devices)",
                           device, n);
    cuda_state_t *c = (cuda_state_t *)calloc(1, sizeof(*c));
    amx_state_t *st = (amx_state_t *)calloc(1, sizeof(*st));
    if (c == NULL || st == NULL) {
        free(c);
        free(st);
        return amx_err_set(err, AMX_ENOMEM, "out of host memory");
    }
    c->device = device;
    pthread_mutex_init(&c->retired_mu, NULL);
    e = cudaSetDevice(device);
    /* Under unified addressing cudaHostAlloc's memory is mapped at the
     * same address on the device (the CUDA programming guide, "Unified
     * Virtual Address Space"): finish writes the host results with a
     * kernel. AMAXD_FINISH_COPY_KERNEL=0: copies instead. */
    const char *ck = getenv("AMAXD_FINISH_COPY_KERNEL");
    if (e == cudaSuccess && (ck == NULL || strcmp(ck, "0") != 0) &&
        cudaDeviceGetAttribute(&c->uva, cudaDevAttrUnifiedAddressing, device) != cudaSuccess)
        c->uva = 0;
    /* The fused finish (scales_in_accumulate): on unless
     * AMAXD_FUSED_FINISH=0, kept for comparing the two in one run. */
    const char *fz = getenv("AMAXD_FUSED_FINISH");
    c->fuse = fz == NULL || strcmp(fz, "0") != 0;
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&c->sl, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&c->se, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(c);
        free(st);
        CU(e, "cudaStreamCreate");
    }
    st->ops = &cuda_ops;
    st->impl = c;
    st->host_alloc = pinned_alloc;
    st->host_free = pinned_free;
    *out = st;
    return AMX_OK;
}
