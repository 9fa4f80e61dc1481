/*
 * calib_cuda.h - the histogram methods of calibrators beyond max on the
 * device (issue 23, item 4): the CUDA state backend's stat_hist (state.h),
 * and tests/gpu/calib_compare.cu, which compares it with the host.
 */
#ifndef AMAXD_CUDA_CALIB_CUDA_H
#define AMAXD_CUDA_CALIB_CUDA_H

#include <cuda_runtime.h>

#include "state.h"

extern "C" {
#include "calib.h"
}

/*
 * The amax of `n` histogram quantizers `jobs` (host memory) from the
 * summed counts in device memory `d_sums` (job.sbase + num_bins + 1 <=
 * nsums), by the host's arithmetic (calib_core.h), into out[i] (host):
 * bit for bit amx_hist_amax's, or NaN where an entropy candidate's margin
 * over another is within the bound of CUDA's log against the C library's
 * (then the caller computes it on the host). Runs on stream s, synchronized
 * before it returns; the device must be current. Any thread that owns s.
 */
extern "C" amx_status_t amx__cuda_hist_amax(const double *d_sums, uint64_t nsums,
                                            const amx_hist_job_t *jobs, size_t n, float *out,
                                            cudaStream_t s, amx_err_t *err);

#endif
