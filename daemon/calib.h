/*
 * calib.h - calibrators beyond max: the options of a histogram or an
 * MSE-search quantizer, and the arithmetic that turns a reduced statistic
 * (summed bin counts, summed per-candidate losses) into an amax.
 *
 * The arithmetic transcribes ModelOpt 0.47 (nvidia-modelopt, the PyPI
 * wheel), modelopt/torch/quantization/calib/histogram.py
 * (_compute_amax_entropy, _compute_amax_mse, _compute_amax_percentile,
 * HistogramCalibrator) and calib/mse.py (MseCalibrator), together with the
 * torch 2.9 / numpy 2.4 / scipy 1.17 operations those functions run on the
 * CPU, operation for operation (docs/NUMERICS.md, "Calibration beyond
 * max"). Where torch's CPU result depends on the build (x86-64 AVX2 or
 * AVX-512 kernels, or the baseline "default" kernels), the caller names the
 * build: amx_calib_t.torch_cpu.
 *
 * Pure functions on host memory, no state: any thread. The daemon runs
 * them on the engine thread after the SUM collective; the CUDA backend
 * runs the histogram methods on the device (cuda/calib_cuda.cu, the same
 * arithmetic: calib_core.h) and the host computes what it leaves (an
 * entropy near-tie) and the MSE searches.
 */
#ifndef AMX_CALIB_H
#define AMX_CALIB_H

#include <stddef.h>
#include <stdint.h>

/* Values of the wire enums (proto/amaxd/v1/amaxd.proto, Calibrator). */
enum { AMX_CAL_MAX = 0, AMX_CAL_HISTOGRAM = 1, AMX_CAL_MSE = 2, AMX_CAL_NVFP4_MSE = 3 };
enum { AMX_HM_ENTROPY = 1, AMX_HM_PERCENTILE = 2, AMX_HM_MSE = 3 };
/* The grid a histogram MSE search quantizes bin centers to: ModelOpt's
 * integer fake quantization (num_bits, unsigned) or FP8 E4M3. */
enum { AMX_GRID_INT = 1, AMX_GRID_E4M3 = 2 };
/* The torch CPU build whose results are reproduced: x86-64 AVX2 kernels
 * (float32 FMA contracted, 8-lane vectors), AVX-512 (FMA, 16 lanes), the
 * baseline "default" kernels (no FMA, 8 lanes). */
enum { AMX_TORCH_AVX2 = 1, AMX_TORCH_AVX512 = 2, AMX_TORCH_DEFAULT = 3 };

/* The largest histogram: torch computes linspace and sums of fewer than
 * 32768 elements on one thread, so that their results do not depend on
 * the number of threads. */
#define AMX_HIST_MAX_BINS 32767u
/* The most candidates of an MSE search. */
#define AMX_MSE_MAX_STEPS 4096u
/* The candidates of an NVFP4 per-block search: the finite positive FP8
 * E4M3 values. */
#define AMX_NVFP4_MSE_STEPS 126u

/* A quantizer's calibrator, normalized (every field zero for MAX). */
typedef struct amx_calib {
    uint8_t kind;        /* AMX_CAL_* */
    uint8_t method;      /* HISTOGRAM: AMX_HM_* */
    uint8_t grid;        /* HISTOGRAM + MSE method: AMX_GRID_* */
    uint8_t is_unsigned; /* HISTOGRAM: ModelOpt's `unsigned` */
    uint8_t skip_zeros;  /* HISTOGRAM: ranks leave |x| == 0 out (the daemon only records it) */
    uint8_t torch_cpu;   /* AMX_TORCH_* (HISTOGRAM, MSE) */
    uint16_t pad;
    uint32_t num_bins;                       /* HISTOGRAM: 1..AMX_HIST_MAX_BINS */
    uint32_t num_bits;                       /* HISTOGRAM entropy / integer grid */
    uint32_t start_bin;                      /* HISTOGRAM entropy / mse */
    uint32_t stride;                         /* HISTOGRAM entropy / mse, >= 1 */
    uint32_t nsteps;                         /* MSE: candidates, derived */
    double percentile;                       /* HISTOGRAM percentile: [0, 100] */
    double start_mult, stop_mult, step_size; /* MSE */
} amx_calib_t;

/* Statistic values a quantizer of `ncells` cells holds (0 for MAX): a
 * histogram's num_bins counts and one overflow count, or an MSE search's
 * nsteps losses per cell (cell-major). */
uint64_t amx_calib_stat_values(const amx_calib_t *c, uint64_t ncells);

/* "max", "histogram", "mse", "nvfp4_mse". */
const char *amx_calib_kind_name(int kind);

/* Equal options? */
int amx_calib_equal(const amx_calib_t *a, const amx_calib_t *b);

/*
 * torch.linspace(start, end, steps) in float32 as torch 2.9's CPU kernel
 * computes it (aten/src/ATen/native/cpu/RangeFactoriesKernel.cpp,
 * linspace_kernel; CUDA's LinspaceOp is the same expression): step =
 * (end - start) / (steps - 1); index i below steps / 2 is start + step * i,
 * the others end - step * (steps - i - 1); `fma`: the AVX2 and AVX-512
 * builds contract each into one fused multiply-add.
 */
void amx_torch_linspace_f32(float start, float end, uint32_t steps, int fma, float *out);

/*
 * torch.sum of n float32 values on the CPU (aten/src/ATen/native/cpu/
 * SumKernel.cpp, cascade_sum: 4 x `lanes`-wide partial sums in up to four
 * cascade levels, then the tail and the lanes in order), n < 32768;
 * lanes 1..8 (other values: 8, what every build sums with).
 */
float amx_torch_sum_f32(const float *x, uint64_t n, int lanes);

/* numpy's float64 add.reduce of a contiguous array (pairwise summation,
 * numpy/_core/src/umath/loops_utils.h.src pairwise_sum). */
double amx_numpy_sum_f64(const double *x, uint64_t n);

/* The bin edges [0, g] in num_bins bins: torch.linspace(0, g, num_bins + 1)
 * on the CPU build `torch_cpu` (what HistogramCalibrator.collect makes from
 * its first batch's max). `out` has num_bins + 1 entries. */
void amx_hist_edges(float g, uint32_t num_bins, int torch_cpu, float *out);

/*
 * The histogram methods on `counts` (num_bins counts, integers held as
 * doubles, the overflow count not included) and `edges` (amx_hist_edges).
 * Each returns the amax ModelOpt's function returns (docs/NUMERICS.md
 * gives every step). `scratch` needs amx_hist_scratch(c) bytes, 8-aligned.
 */
size_t amx_hist_scratch(const amx_calib_t *c);
float amx_hist_percentile(const double *counts, uint32_t num_bins, const float *edges,
                          double percentile);
float amx_hist_entropy(const double *counts, uint32_t num_bins, const float *edges,
                       uint32_t num_bits, int is_unsigned, uint32_t stride, uint32_t start_bin,
                       void *scratch);
float amx_hist_mse(const double *counts, uint32_t num_bins, const float *edges, int grid,
                   uint32_t num_bits, int is_unsigned, uint32_t stride, uint32_t start_bin,
                   int torch_cpu, void *scratch);

/* The amax of a histogram quantizer from its summed counts (num_bins + 1
 * values: the bins, then the overflow count) and its agreed range top `g`,
 * by c->method. A range of 0 gives 0 (every edge is 0). */
float amx_hist_amax(const amx_calib_t *c, const double *counts, float g, void *scratch);

/* A histogram quantizer whose amax a state backend computes where its
 * statistics are (state.h stat_hist): its num_bins + 1 summed counts at
 * `sbase` of the accumulated statistics, its range top g, its options. */
typedef struct amx_hist_job {
    uint64_t sbase;
    float g;
    uint32_t pad;
    amx_calib_t c;
} amx_hist_job_t;

/* The candidate multipliers of an MSE search: torch.linspace(start_mult,
 * stop_mult, nsteps) in float32 (MseCalibrator._generate_candidates).
 * `out` has c->nsteps entries. */
void amx_mse_candidates(const amx_calib_t *c, float *out);

/* The search's steps, ModelOpt's ceil((stop - start) / step_size) + 1 in
 * double; 0 when the options make no finite count. */
uint64_t amx_mse_nsteps(double start, double stop, double step);

/* The index of the smallest of n losses, the first one on a tie
 * (torch.argmin); the values are finite. */
uint32_t amx_mse_argmin(const double *loss, uint32_t n);

/*
 * The candidate multipliers of an NVFP4 per-block search (ModelOpt 0.47,
 * kernels/quantization/gemm/_fp8_scale_candidates.py fp8_scale_candidates,
 * used by calib/mse.py NVFP4MSECalibrator): the bytes 0..127 read as FP8
 * E4M3, the finite positive ones (bytes 1..126) divided by 448 in float32,
 * in byte order (increasing). `out` has AMX_NVFP4_MSE_STEPS entries.
 */
void amx_nvfp4_mse_candidates(float *out);

/*
 * Which candidate amax `v` is for global amax g >= 0 and the candidates
 * `cand` (amx_nvfp4_mse_candidates): the index k with v == float32(g *
 * c_k) (NVFP4MSECalibrator._compute_candidate_amax), the first one when
 * several products are equal (g 0 or tiny); -1 when v is none of them.
 */
int amx_nvfp4_mse_index(const float *cand, float g, double v);

#endif
