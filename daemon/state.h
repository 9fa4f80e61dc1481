/*
 * state.h - where a job's amax state lives and how an epoch is finished.
 *
 * A job's catalog is laid out in one flat float32 buffer ("cells"); every
 * quantizer owns the range [base, base + ncells). A state backend holds:
 *   pending   contributions of the open epoch (-inf = nobody wrote)
 *   accum     running max over epochs (RUNNING_MAX quantizers)
 *   history   H slots per cell (PER_EPOCH quantizers)
 *   prev      the last FP8 delayed scale per cell and per quantizer
 * and after each reconcile publishes the results in host memory (the
 * `out_*` arrays below), identical whatever the backend, so that answering a
 * trainer never touches the device.
 *
 * Backends: "host" (state_host.c, plain C) and "cuda" (cuda/state_cuda.cu).
 * All functions are called on the loop thread only.
 */
#ifndef AMX_STATE_H
#define AMX_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "recipe.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a backend needs to know of one quantizer to post-process it. */
typedef struct amx_qdesc {
    uint64_t base;      /* first cell in the flat buffers */
    uint64_t ncells;    /* cells of the global amax tensor */
    uint64_t hist_base; /* first cell of its history ring (PER_EPOCH) */
    uint32_t hist_len;  /* H slots (1 when RUNNING_MAX) */
    uint32_t hist_head; /* the slot this epoch writes */
    int32_t peer_group; /* index, or -1 */
    int32_t scale_group;
    uint8_t accumulation;
    uint8_t pad[7];
    amx_recipe_t recipe;
} amx_qdesc_t;

/* A run of contiguous cells to max-merge: cells [dst, dst+len) take
 * max(cell, vals[src + i]). */
typedef struct amx_run {
    uint64_t dst;
    uint64_t src;
    uint64_t len;
} amx_run_t;

typedef struct amx_state amx_state_t;

typedef struct amx_state_ops {
    const char *name;
    /* Grows the buffers to `ncells` cells, `nhist` history cells and `nq`
     * quantizers; existing contents are kept, new cells are -inf (amax) or 1
     * (previous scales). Never shrinks. */
    amx_status_t (*reserve)(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                            amx_err_t *err);
    /* Max-merges `nruns` runs of `vals` into pending. The values were
     * validated by the caller (finite and >= 0, or -inf for "no data").
     * `overlap` is set when two runs of the batch may hit the same cell. */
    amx_status_t (*merge)(amx_state_t *st, const float *vals, uint64_t nvals, const amx_run_t *runs,
                          size_t nruns, int overlap, amx_err_t *err);
    /* Finishes an epoch: all-reduce MAX of pending through `comm`, then
     * accumulation, peer fill, global amax, scale groups and scales for all
     * `nq` quantizers; publishes the out_* arrays and clears pending. On
     * error nothing of the job's state has changed (pending is kept). */
    amx_status_t (*reconcile)(amx_state_t *st, const amx_qdesc_t *q, uint32_t nq, uint32_t npeer,
                              uint32_t nscale, amx_comm_t *comm, amx_err_t *err);
    /* Clears pending, accumulated amax, history and previous scales of the
     * quantizers `ids`. */
    amx_status_t (*reset)(amx_state_t *st, const amx_qdesc_t *q, const uint32_t *ids, uint32_t n,
                          amx_err_t *err);
    void (*destroy)(amx_state_t *st);
} amx_state_ops_t;

struct amx_state {
    const amx_state_ops_t *ops;
    void *impl;
    uint64_t ncells, nhist;
    uint32_t nq;
    /* Results of the last reconcile, host memory, ncells entries: amax
     * after peer fill (-inf = no data anywhere), scale, scale_inv, and one
     * byte (E4M3 block scale or E8M0 exponent). */
    float *out_amax, *out_scale, *out_scale_inv;
    uint8_t *out_bytes;
    /* Per quantizer (nq entries): global amax (0 when no data), global
     * scale and its inverse. */
    float *out_gamax, *out_gscale, *out_gscale_inv;
};

/* Creates an empty state of the named backend ("host" or "cuda"). Returns
 * EUNAVAIL when the backend is not compiled in or no GPU is usable. The
 * caller owns *out and frees it with amx_state_destroy. */
amx_status_t amx_state_create(const char *backend, amx_state_t **out, amx_err_t *err);

void amx_state_destroy(amx_state_t *st);

/* True when a CUDA device is present and the cuda backend is compiled in. */
int amx_state_cuda_available(void);

/* Host backend constructor (state_host.c). */
amx_status_t amx__state_host_create(amx_state_t **out, amx_err_t *err);
/* CUDA backend constructor (cuda/state_cuda.cu), when built. */
amx_status_t amx__state_cuda_create(amx_state_t **out, amx_err_t *err);
int amx__state_cuda_probe(void);

/*
 * For backends, at the end of reserve: grows the published out_* arrays
 * (host memory) and records the new sizes in st. ENOMEM on failure, with the
 * sizes unchanged.
 */
amx_status_t amx__state_grow_outputs(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                     amx_err_t *err);

#ifdef __cplusplus
}
#endif

#endif
