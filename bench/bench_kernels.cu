/*
 * bench_kernels - the CUDA backend's merge and per-cell scale kernels over
 * N amax values (default 2^28 = 256M), against a device-to-device copy of
 * the same size measured in the same run.
 *
 * Bytes counted (each input read once, each output written once):
 *   copy            4 B read + 4 B written per value
 *   merge           value 4 B + pending 4 B read, pending 4 B written = 12 B
 *   nvfp4 scales    amax 4 B read; scale 4 B, scale_inv 4 B, E4M3 1 B written = 13 B
 * Each kernel is timed with CUDA events, median of REPS runs after warm-up.
 * With IDLE_MS > 0 each run follows IDLE_MS of an idle GPU (what a kernel
 * of an epoch after a pause meets) instead of the run before it; the run
 * (start event, kernel, end event) is queued behind a one-thread gate
 * kernel that the host opens once all of it is queued, so the interval
 * holds the GPU's time only, not the host's launch after its sleep.
 *
 *   bench_kernels [N] [REPS] [IDLE_MS]
 */
#include <algorithm>
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <vector>

#include "../cuda/kernels.h"
#include "state.h"

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));                            \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

__global__ void k_init(float *p, uint64_t n, uint32_t seed)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 13, x *= 0x5bd1e995u, x ^= x >> 15;
        p[i] = (float)(x & 0xffffff) * (1.0f / 65536.0f); /* 0 .. 256, never zero-only */
    }
}

static int idle_ms;
static volatile unsigned *gate;   /* mapped host memory: the host opens the gate */
static volatile unsigned *d_gate; /* the same, as the device sees it */

__global__ void k_gate(volatile unsigned *g, unsigned v)
{
    while (*g < v) {
    }
}

template <typename F> static float median_ms(F fn, int reps)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    fn(); /* warm-up */
    fn();
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    static unsigned ticket;
    for (int r = 0; r < reps; r++) {
        if (idle_ms > 0) {
            CK(cudaDeviceSynchronize());
            usleep((useconds_t)idle_ms * 1000);
            k_gate<<<1, 1>>>(d_gate, ++ticket);
        }
        CK(cudaEventRecord(a));
        fn();
        CK(cudaEventRecord(b));
        if (idle_ms > 0)
            *gate = ticket;
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t.empty() ? 0.0f : t[t.size() / 2];
}

int main(int argc, char **argv)
{
    uint64_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : (1ull << 28);
    int reps = argc > 2 ? atoi(argv[2]) : 20;
    idle_ms = argc > 3 ? atoi(argv[3]) : 0;
    CK(cudaHostAlloc((void **)&gate, sizeof(unsigned), cudaHostAllocMapped));
    *gate = 0;
    CK(cudaHostGetDevicePointer((void **)&d_gate, (void *)gate, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    float *src, *dst, *pending, *vals, *amax, *scale, *inv, *prev, *gamax, *gscale, *gscale_inv;
    uint8_t *bytes;
    CK(cudaMalloc(&src, n * 4));
    CK(cudaMalloc(&dst, n * 4));
    CK(cudaMalloc(&pending, n * 4));
    CK(cudaMalloc(&vals, n * 4));
    CK(cudaMalloc(&amax, n * 4));
    CK(cudaMalloc(&scale, n * 4));
    CK(cudaMalloc(&inv, n * 4));
    CK(cudaMalloc(&prev, 4));
    CK(cudaMalloc(&bytes, n));
    CK(cudaMalloc(&gamax, 4));
    CK(cudaMalloc(&gscale, 4));
    CK(cudaMalloc(&gscale_inv, 4));
    k_init<<<4096, 256>>>(src, n, 1);
    k_init<<<4096, 256>>>(pending, n, 2);
    k_init<<<4096, 256>>>(vals, n, 3);
    k_init<<<4096, 256>>>(amax, n, 4);
    CK(cudaGetLastError());
    float g = 256.0f, s_enc = 2688.0f / 256.0f, s_dec = 1.0f / s_enc;
    CK(cudaMemcpy(gamax, &g, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(gscale, &s_enc, 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(gscale_inv, &s_dec, 4, cudaMemcpyHostToDevice));

    /* Runs: one per quantizer of a batch; 1 and 4096 quantizers. */
    auto make_runs = [&](uint32_t nruns) {
        std::vector<amx_run_t> r(nruns);
        uint64_t per = n / nruns;
        for (uint32_t i = 0; i < nruns; i++)
            r[i] = amx_run_t{i * per, i * per, i + 1 == nruns ? n - i * per : per};
        amx_run_t *d;
        CK(cudaMalloc(&d, nruns * sizeof(amx_run_t)));
        CK(cudaMemcpy(d, r.data(), nruns * sizeof(amx_run_t), cudaMemcpyHostToDevice));
        return d;
    };
    amx_run_t *runs1 = make_runs(1), *runs4k = make_runs(4096);
    amx_qdesc_t qd;
    memset(&qd, 0, sizeof(qd));
    qd.ncells = n;
    qd.hist_len = 1;
    qd.peer_group = qd.scale_group = -1;
    qd.accumulation = AMX_ACC_RUNNING_MAX;
    qd.recipe.format = AMX_FMT_NVFP4;
    qd.recipe.nvfp4_convention = AMX_NVFP4_TE;
    amx_qdesc_t *dq;
    CK(cudaMalloc(&dq, sizeof(qd)));
    CK(cudaMemcpy(dq, &qd, sizeof(qd), cudaMemcpyHostToDevice));
    amx_err_t err = {AMX_OK, ""};

    float t_copy =
        median_ms([&] { CK(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice)); }, reps);
    float t_m1 =
        median_ms([&] { amx__cuda_merge_launch(pending, vals, n, runs1, 1, 0, 0, &err); }, reps);
    float t_m4k = median_ms(
        [&] { amx__cuda_merge_launch(pending, vals, n, runs4k, 4096, 0, 0, &err); }, reps);
    float t_ma = median_ms(
        [&] { amx__cuda_merge_launch(pending, vals, n, runs4k, 4096, 1, 0, &err); }, reps);
    float t_nv = median_ms(
        [&] {
            amx__cuda_scales_launch(dq, 1, n, amax, NULL, gamax, gscale, gscale_inv, NULL, NULL,
                                    NULL, prev, scale, inv, bytes, NULL, NULL, NULL, 0, &err);
        },
        reps);
    CK(cudaGetLastError());
    if (err.code != AMX_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 2;
    }
    double gb_copy = 8.0 * n / (t_copy * 1e6);
    struct row {
        const char *name;
        double bytes_per;
        float ms;
    } rows[] = {{"device-to-device copy (floor)", 8, t_copy},
                {"merge, 1 run, plain max", 12, t_m1},
                {"merge, 4096 runs, plain max", 12, t_m4k},
                {"merge, 4096 runs, atomic max", 12, t_ma},
                {"NVFP4 per-block scales (TE)", 13, t_nv}};
    printf("%s, %d SMs; N = %llu amax values (%.2f GiB of float32); median of %d runs, each after "
           "%d ms idle\n",
           prop.name, prop.multiProcessorCount, (unsigned long long)n, n * 4.0 / (1 << 30), reps,
           idle_ms);
    printf("%-32s %10s %10s %10s\n", "kernel", "ms", "GB/s", "of copy");
    for (auto &r : rows) {
        double gbs = r.bytes_per * n / (r.ms * 1e6);
        printf("%-32s %10.3f %10.1f %9.1f%%\n", r.name, r.ms, gbs, 100.0 * gbs / gb_copy);
    }
    return 0;
}
