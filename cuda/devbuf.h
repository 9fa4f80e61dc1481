/*
 * devbuf.h - device buffers shared with a trainer over CUDA IPC (the CUDA
 * state backend's dev_* operations, state.h): allocation and handles, the
 * in-place check and merge of a trainer's slab, and the answer written
 * into the trainer's answer buffer. state_cuda.cu owns the streams and
 * the state's buffers and passes them in; this file owns amx_devbuf_t.
 */
#ifndef AMAXD_CUDA_DEVBUF_H
#define AMAXD_CUDA_DEVBUF_H

#include <cuda_runtime.h>

#include "state.h"

/* Converts a CUDA error once, where it happens, keeping the original text
 * (in a function with an amx_err_t *err, returning amx_status_t). Both
 * CUDA files use it. */
#define CU(call, what)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return amx_err_set(err, AMX_EDEVICE, "CUDA %s failed: %s (%s)", what,                  \
                               cudaGetErrorString(e_), cudaGetErrorName(e_));                      \
    } while (0)

/* Loop thread. dev_open of state.h for a state on CUDA device `state_dev`. */
extern "C" amx_status_t amx__cuda_dev_open(int state_dev, const char *device, uint64_t slab_bytes,
                                           uint64_t answer_bytes, amx_devbuf_t **out,
                                           amx_devbuf_info_t *info, amx_err_t *err);

/* Loop thread. dev_merge of state.h into `pending` (the in-flight buffer's
 * first data cell) on stream `sd`; `in` (on the state's device) is
 * recorded on sd after the merge. */
extern "C" amx_status_t amx__cuda_dev_merge(amx_devbuf_t *d, float *pending, const amx_run_t *runs,
                                            size_t nruns, uint64_t key, uint64_t ncells,
                                            uint64_t has_data_off, const amx_devsignal_t *ready,
                                            uint32_t rank, cudaStream_t sd, cudaEvent_t in,
                                            amx_err_t *err);

/* Engine thread. dev_wait of state.h over the `n` buffers `ds` merged at
 * the last flip, whose merges record `in` (state_dev's) on sd; deferred
 * merges (a host flag, armed epochs) are launched here on sd. */
extern "C" amx_status_t amx__cuda_dev_wait(amx_devbuf_t *const *ds, size_t n, cudaStream_t sd,
                                           cudaEvent_t in, int state_dev, uint64_t deadline_ms,
                                           int spin, int (*aborted)(void *ud), void *ud,
                                           amx_err_t *err);

/* Any thread. dev_waiting of state.h. */
extern "C" int amx__cuda_dev_waiting(amx_devbuf_t *d);

/* Loop thread. dev_bad of state.h. */
extern "C" int64_t amx__cuda_dev_bad(amx_devbuf_t *d);

/* Loop thread. dev_answer of state.h from the front outputs, on stream s,
 * not waited for (the caller orders its own later work after it). */
/* The front output set a device answer reads (state_cuda.cu): per cell,
 * per quantizer (out_nq, catalog order) and per global slice (out_ns). */
typedef struct amx_devans_src {
    const float *amax, *scale, *inv;
    const uint8_t *bytes;
    const float *gamax, *gscale, *ginv;
    const float *samax, *sscale, *sinv;
    uint32_t out_nq;
    uint64_t out_ns;
    /* The previous globals on the device (catalog order, prev_n each). */
    const float *pga, *pgs;
    const uint8_t *pok;
    uint32_t prev_n;
} amx_devans_src_t;

extern "C" amx_status_t amx__cuda_dev_answer(amx_devbuf_t *d, const amx_devans_src_t *src,
                                             const amx_run_t *gather, size_t ngather,
                                             uint64_t ncells, const amx_devans_layout_t *lay,
                                             const amx_devsignal_t *done, cudaStream_t s,
                                             amx_err_t *err);

/* Loop thread. dev_close of state.h. */
extern "C" void amx__cuda_dev_close(amx_devbuf_t *d);

#endif
