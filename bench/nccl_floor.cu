/*
 * nccl_floor - the floors of the cluster benchmark (bench/cluster_bench.py),
 * run as NRANKS processes, one per GPU:
 *
 *   (a) one packed ncclAllReduce(MAX) of CELLS float32 cells: what amaxd's
 *       epoch does at its core; measured on a blocking communicator (the
 *       floor) and on a non-blocking one polled with ncclCommGetAsyncError,
 *       the kind amaxd uses so that a dead peer can be aborted (NCCL then
 *       enqueues from a thread of its own, which costs time);
 *   (b) one ncclAllReduce(MAX) per quantizer: NQ1 quantizers of one cell,
 *       then NQ2 quantizers of C2 cells, enqueued back to back on one stream
 *       (what a per-quantizer loop of torch.distributed.all_reduce does).
 *
 *   (a'') with IDLE_MS > 0: (a) after the GPUs sat idle for IDLE_MS, the
 *       ranks lined up first by a one-cell all-reduce: what an epoch that
 *       follows a pause meets, where (a) runs back to back. Each rank
 *       prints its start and end times (CLOCK_MONOTONIC, us) per run, so
 *       that the caller, on the same host, can time each run from the last
 *       rank's start to the last rank's end, as cluster_bench times the
 *       daemons' epochs; "packed_idle_us" is this rank's own median, which
 *       includes waiting for ranks that woke later.
 *
 * Each figure is the wall time from the first enqueue to the end of the
 * stream, median of REPS (REPS_B for b) runs after 3 warm-up runs of (a) and
 * one of (b). Rendezvous: rank 0 writes the NCCL unique id to ID_FILE.
 *
 *   nccl_floor RANK NRANKS ID_FILE CELLS NQ1 NQ2 C2 REPS REPS_B [IDLE_MS]
 *
 * Prints one JSON line: {"rank":..,"packed_us":..,"packed_nonblocking_us":..,
 * "per_quantizer_us":..,"packed_idle_us":..,"idle_t0":[..],"idle_end":[..]}
 * (packed_idle_us 0 and the lists empty without IDLE_MS).
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                               \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)
#define NK(x)                                                                                      \
    do {                                                                                           \
        ncclResult_t r_ = (x);                                                                     \
        if (r_ != ncclSuccess) {                                                                   \
            fprintf(stderr, "%s: %s\n", #x, ncclGetErrorString(r_));                               \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static double median(std::vector<double> v)
{
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

int main(int argc, char **argv)
{
    if (argc != 10 && argc != 11) {
        fprintf(stderr, "usage: %s RANK NRANKS ID_FILE CELLS NQ1 NQ2 C2 REPS REPS_B [IDLE_MS]\n",
                argv[0]);
        return 2;
    }
    int rank = atoi(argv[1]), n = atoi(argv[2]);
    const char *idf = argv[3];
    size_t cells = strtoull(argv[4], NULL, 10), nq1 = strtoull(argv[5], NULL, 10),
           nq2 = strtoull(argv[6], NULL, 10), c2 = strtoull(argv[7], NULL, 10);
    int reps = atoi(argv[8]), reps_b = atoi(argv[9]), idle_ms = argc > 10 ? atoi(argv[10]) : 0;
    CK(cudaSetDevice(rank));
    ncclUniqueId id[2];
    if (rank == 0) {
        NK(ncclGetUniqueId(&id[0]));
        NK(ncclGetUniqueId(&id[1]));
        char tmp[512];
        snprintf(tmp, sizeof(tmp), "%s.tmp", idf);
        FILE *f = fopen(tmp, "wb");
        fwrite(id, sizeof(id), 1, f);
        fclose(f);
        rename(tmp, idf);
    } else {
        FILE *f;
        while ((f = fopen(idf, "rb")) == NULL)
            usleep(1000);
        if (fread(id, sizeof(id), 1, f) != 1)
            return 2;
        fclose(f);
    }
    ncclComm_t comm, nb;
    NK(ncclCommInitRank(&comm, n, id[0], rank));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t ar = ncclCommInitRankConfig(&nb, n, id[1], rank, &cfg);
    while (ar == ncclInProgress)
        ncclCommGetAsyncError(nb, &ar);
    NK(ar);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    size_t need = std::max(cells, nq1 + nq2 * c2);
    float *send, *recv;
    CK(cudaMalloc(&send, need * sizeof(float)));
    CK(cudaMalloc(&recv, need * sizeof(float)));
    CK(cudaMemset(send, 0, need * sizeof(float)));
    std::vector<double> a, a_nb, b, a_idle;
    for (int i = 0; i < 3 + reps; i++) {
        CK(cudaStreamSynchronize(s));
        double t0 = now_us();
        NK(ncclAllReduce(send, recv, cells, ncclFloat32, ncclMax, comm, s));
        CK(cudaStreamSynchronize(s));
        if (i >= 3)
            a.push_back(now_us() - t0);
    }
    for (int i = 0; i < 3 + reps; i++) {
        CK(cudaStreamSynchronize(s));
        double t0 = now_us();
        ncclResult_t r = ncclAllReduce(send, recv, cells, ncclFloat32, ncclMax, nb, s);
        while (r == ncclInProgress)
            ncclCommGetAsyncError(nb, &r);
        NK(r);
        CK(cudaStreamSynchronize(s));
        if (i >= 3)
            a_nb.push_back(now_us() - t0);
    }
    for (int i = 0; i < 1 + reps_b; i++) {
        CK(cudaStreamSynchronize(s));
        double t0 = now_us();
        for (size_t q = 0; q < nq1; q++)
            NK(ncclAllReduce(send + q, recv + q, 1, ncclFloat32, ncclMax, comm, s));
        for (size_t q = 0; q < nq2; q++)
            NK(ncclAllReduce(send + nq1 + q * c2, recv + nq1 + q * c2, c2, ncclFloat32, ncclMax,
                             comm, s));
        CK(cudaStreamSynchronize(s));
        if (i >= 1)
            b.push_back(now_us() - t0);
    }
    std::vector<double> i_t0, i_end;
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* the default 50 us would skew the ranks' wake */
    for (int i = 0; idle_ms > 0 && i < reps; i++) {
        NK(ncclAllReduce(send, recv, 1, ncclFloat32, ncclMax, comm, s)); /* lines the ranks up */
        CK(cudaStreamSynchronize(s));
        struct timespec ts = {idle_ms / 1000, (long)(idle_ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
        double t0 = now_us();
        NK(ncclAllReduce(send, recv, cells, ncclFloat32, ncclMax, comm, s));
        CK(cudaStreamSynchronize(s));
        double t1 = now_us();
        a_idle.push_back(t1 - t0);
        i_t0.push_back(t0);
        i_end.push_back(t1);
    }
    printf("{\"rank\": %d, \"cells\": %zu, \"packed_us\": %.1f, \"packed_nonblocking_us\": %.1f, "
           "\"per_quantizer_us\": %.1f, \"per_quantizer_calls\": %zu, \"packed_idle_us\": %.1f",
           rank, cells, median(a), median(a_nb), median(b), nq1 + nq2,
           a_idle.empty() ? 0.0 : median(a_idle));
    const char *sep = "";
    printf(", \"idle_t0\": [");
    for (double v : i_t0)
        printf("%s%.1f", sep, v), sep = ", ";
    sep = "";
    printf("], \"idle_end\": [");
    for (double v : i_end)
        printf("%s%.1f", sep, v), sep = ", ";
    printf("]}\n");
    ncclCommDestroy(comm);
    ncclCommAbort(nb);
    return 0;
}
