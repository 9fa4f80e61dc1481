/*
 * kernels.h - launchers of the CUDA state backend's kernels that the
 * kernel benchmark (bench/bench_kernels.cu) calls too: one declaration for
 * both, since C linkage would not catch a signature that drifted apart.
 */
#ifndef AMAXD_CUDA_KERNELS_H
#define AMAXD_CUDA_KERNELS_H

#include <cuda_runtime.h>

#include "state.h"

/* Max-merges device-resident staged values into pending along `runs`
 * (`overlap`: a cell may be hit twice, atomics needed). */
extern "C" amx_status_t amx__cuda_merge_launch(float *pending, const float *d_vals, uint64_t nvals,
                                               const amx_run_t *d_runs, uint32_t nruns, int overlap,
                                               cudaStream_t stream, amx_err_t *err);

/* Per-cell scales (k_scales): gdec / sdec are 1 / S_enc per quantizer and
 * per global slice; out_filled and counts may be NULL. */
extern "C" amx_status_t
amx__cuda_scales_launch(const amx_qdesc_t *d_q, uint32_t nq, uint64_t ncells, float *out_amax,
                        const float *peer_max, const float *gamax, const float *gscale,
                        const float *gdec, const float *samax, const float *sscale,
                        const float *sdec, float *prev, float *out_scale, float *out_inv,
                        uint8_t *out_bytes, const uint32_t *chunkq, uint8_t *out_filled,
                        unsigned long long *counts, cudaStream_t stream, amx_err_t *err);

#endif
