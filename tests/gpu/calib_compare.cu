/*
 * calib_compare - the histogram methods on the device (cuda/calib_cuda.cu)
 * against the host's (daemon/calib.c), bit for bit, on many random and
 * adversarial histograms (issue 23, item 4).
 *
 * Every method (entropy, percentile, MSE on the integer and E4M3 grids),
 * every torch CPU build, odd and large bin counts, strides, start bins,
 * percentiles 0/50/100, range tops from subnormal to huge; histograms
 * empty, all mass in one bin (first, last, any), two equal spikes, sparse,
 * heavy-tailed, counts near 2^52, only the overflow count, alternating
 * zeros. All jobs of a batch go through one call, their counts at
 * scattered offsets of one device buffer, as the backend's accumulated
 * sums are.
 *
 * A device answer must equal the host's amax bit for bit. NaN means the
 * device left the quantizer to the host (an entropy near-tie: its
 * divergences use CUDA's log, calib_cuda.cu says why); only entropy may
 * do that, and the program reports how often. Exit 0 when every answer
 * matches.
 *
 *   calib_compare [JOBS [SEED]]     (default 4000 jobs, seed 1)
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calib_cuda.h"

static uint64_t rng_state;

static uint64_t rnd(void)
{
    /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t below(uint32_t n)
{
    return n ? (uint32_t)(rnd() % n) : 0;
}

static double unif(void)
{
    return (double)(rnd() >> 11) * 0x1p-53;
}

static const char *kind_names[] = {"random",      "empty",    "one bin",  "two spikes",
                                   "sparse",      "pareto",   "huge",     "overflow only",
                                   "alternating", "last bin", "first bin"};
enum { NKINDS = 11 };

/* num_bins + 1 counts of kind k (the last one the overflow count). */
static void make_hist(double *h, uint32_t nb, int k)
{
    memset(h, 0, ((size_t)nb + 1) * sizeof(double));
    switch (k) {
    case 0:
        for (uint32_t j = 0; j <= nb; j++)
            h[j] = (double)below(6);
        break;
    case 1:
        break;
    case 2:
        h[below(nb)] = (double)(1 + below(1000));
        break;
    case 3: {
        double c = (double)(1 + below(50));
        h[below(nb)] = c;
        h[below(nb)] = c;
        break;
    }
    case 4:
        for (uint32_t j = 0; j < nb; j++)
            if (below(20) == 0)
                h[j] = (double)(1 + below(1000000));
        break;
    case 5:
        for (uint32_t j = 0; j < nb; j++)
            h[j] = floor(100.0 / (1.0 - unif() * 0.999)) - 100.0 + (double)below(3);
        break;
    case 6:
        for (uint32_t j = 0; j < nb; j++)
            h[j] = (double)(rnd() >> 14); /* below 2^50 */
        break;
    case 7:
        h[nb] = (double)(1 + below(100));
        h[below(nb)] = 1.0;
        break;
    case 8:
        for (uint32_t j = 0; j < nb; j += 2)
            h[j] = (double)(1 + below(9));
        break;
    case 9:
        h[nb - 1] = (double)(1 + below(7));
        break;
    default:
        h[0] = (double)(1 + below(7));
        if (nb > 1)
            h[1] = (double)below(3);
        break;
    }
}

static uint32_t pick_bins(void)
{
    static const uint32_t b[] = {1,   2,   3,   7,   8,   9,   16,   64,
                                 127, 128, 129, 200, 256, 512, 1000, 2048};
    return b[below(sizeof(b) / sizeof(b[0]))];
}

static float pick_g(void)
{
    switch (below(8)) {
    case 0:
        return 1.0f;
    case 1:
        return 1e-40f; /* subnormal */
    case 2:
        return 3.0e38f;
    case 3:
        return 448.0f;
    case 4:
        return 0.0f;
    default:
        return (float)ldexp(1.0 + unif(), (int)below(40) - 20);
    }
}

/* A random valid calibrator for a histogram of nb bins. */
static amx_calib_t make_calib(uint32_t nb)
{
    amx_calib_t c;
    memset(&c, 0, sizeof(c));
    c.kind = AMX_CAL_HISTOGRAM;
    c.method = (uint8_t)(1 + below(3));
    c.torch_cpu = (uint8_t)(1 + below(3));
    c.num_bins = nb;
    c.stride = 1;
    if (c.method == AMX_HM_PERCENTILE) {
        static const double p[] = {0.0, 50.0, 99.9, 99.99, 100.0};
        c.percentile = below(3) ? p[below(5)] : unif() * 100.0;
    } else if (c.method == AMX_HM_ENTROPY) {
        c.is_unsigned = (uint8_t)below(2);
        c.num_bits = 1 + below(16 - c.is_unsigned);
        c.start_bin = 1 + below(nb);
        c.stride = 1 + below(4);
    } else {
        if (nb < 2) {
            c.method = AMX_HM_PERCENTILE;
            c.percentile = 50.0;
            return c;
        }
        c.grid = (uint8_t)(1 + below(2));
        if (c.grid == AMX_GRID_INT) {
            c.is_unsigned = (uint8_t)below(2);
            c.num_bits = 2 + below(15);
        }
        c.start_bin = below(nb);
        c.stride = 1 + below(4);
    }
    return c;
}

int main(int argc, char **argv)
{
    size_t njobs = argc > 1 ? strtoull(argv[1], NULL, 10) : 4000;
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
    const size_t batch = 500;
    size_t checked[4] = {0}, fallback[4] = {0}, bad = 0;
    size_t kind_fb[NKINDS] = {0}, kind_n[NKINDS] = {0};
    cudaStream_t s;
    if (cudaStreamCreate(&s) != cudaSuccess) {
        fprintf(stderr, "calib_compare: no usable CUDA device\n");
        return 2;
    }
    for (size_t done = 0; done < njobs; done += batch) {
        size_t n = njobs - done < batch ? njobs - done : batch;
        amx_hist_job_t *jobs = (amx_hist_job_t *)calloc(n, sizeof(*jobs));
        int *kinds = (int *)calloc(n, sizeof(int));
        uint64_t total = 0;
        for (size_t q = 0; q < n; q++) {
            uint32_t nb = pick_bins();
            jobs[q].c = make_calib(nb);
            jobs[q].g = pick_g();
            total += below(5); /* a gap: scattered offsets */
            jobs[q].sbase = total;
            total += (uint64_t)nb + 1;
        }
        double *sums = (double *)calloc(total ? total : 1, sizeof(double));
        for (size_t q = 0; q < n; q++) {
            kinds[q] = (int)below(NKINDS);
            make_hist(sums + jobs[q].sbase, jobs[q].c.num_bins, kinds[q]);
        }
        double *d_sums = NULL;
        float *out = (float *)calloc(n, sizeof(float));
        amx_err_t err = {AMX_OK, ""};
        if (cudaMalloc((void **)&d_sums, total * sizeof(double)) != cudaSuccess ||
            cudaMemcpy(d_sums, sums, total * sizeof(double), cudaMemcpyHostToDevice) !=
                cudaSuccess ||
            amx__cuda_hist_amax(d_sums, total, jobs, n, out, s, &err) != AMX_OK) {
            fprintf(stderr, "calib_compare: %s\n", err.msg[0] ? err.msg : "CUDA setup failed");
            return 2;
        }
        void *scratch = malloc(1 << 20);
        for (size_t q = 0; q < n; q++) {
            const amx_calib_t *c = &jobs[q].c;
            float want = amx_hist_amax(c, sums + jobs[q].sbase, jobs[q].g, scratch);
            checked[c->method]++;
            kind_n[kinds[q]]++;
            if (isnan(out[q])) {
                fallback[c->method]++;
                kind_fb[kinds[q]]++;
                if (c->method != AMX_HM_ENTROPY) {
                    bad++;
                    printf("MISMATCH job %zu: method %u left to the host (only entropy may)\n",
                           done + q, c->method);
                }
                continue;
            }
            uint32_t a, b;
            memcpy(&a, &out[q], 4);
            memcpy(&b, &want, 4);
            if (a != b) {
                bad++;
                if (bad <= 20)
                    printf("MISMATCH job %zu: method %u bins %u start %u stride %u bits %u%s g "
                           "%a, %s histogram: device %a (0x%08x), host %a (0x%08x)\n",
                           done + q, c->method, c->num_bins, c->start_bin, c->stride, c->num_bits,
                           c->is_unsigned ? " unsigned" : "", (double)jobs[q].g,
                           kind_names[kinds[q]], (double)out[q], a, (double)want, b);
            }
        }
        free(scratch);
        cudaFree(d_sums);
        free(out), free(sums), free(jobs), free(kinds);
    }
    static const char *mname[] = {"", "entropy", "percentile", "mse"};
    for (int m = 1; m <= 3; m++)
        printf("%-10s %6zu jobs, %zu left to the host\n", mname[m], checked[m], fallback[m]);
    for (int k = 0; k < NKINDS; k++)
        if (kind_fb[k])
            printf("  entropy near-ties on %s histograms: %zu of %zu jobs of that kind\n",
                   kind_names[k], kind_fb[k], kind_n[k]);
    printf("%s: %zu mismatches\n", bad ? "FAIL" : "OK", bad);
    cudaStreamDestroy(s);
    return bad ? 1 : 0;
}
