/*
 * devbuf.cu - device buffers shared with a trainer (GPU-direct, docs/API.md
 * "Device buffers"): legacy CUDA IPC memory and events.
 *
 * The daemon allocates both buffers (cudaMalloc: memory from a stream
 * pool cannot be exported by cudaIpcGetMemHandle) on the trainer's GPU and
 * creates two interprocess events there: `ready`, which the trainer
 * records on its stream after writing its slab, and `done`, which the
 * daemon records after writing the answer and the trainer's stream waits
 * on. The daemon's streams wait on `ready` on the device
 * (cudaStreamWaitEvent): no thread of the daemon blocks for the trainer's
 * kernels, and the trainer never synchronizes from the host.
 *
 * Interprocess events are only waited on and recorded on a stream of
 * their own GPU: the trainer's `ready` by `ds` (one per buffers, so that
 * `seen` tells each trainer's lateness apart), `done` by ds when the GPUs
 * differ, else by the state's answer stream itself; plain events carry
 * the order between ds and the state's streams (a stream of GPU 0
 * waiting on an interprocess event of GPU 1 crashed the daemon on 2 x
 * H100).
 *
 * A slab on another GPU than the state's is read, and the answer written,
 * through peer access (one daemon for all GPUs of a node).
 *
 * Signals (the doorbell's requests with a sequence number): a uint32 flag
 * in each buffer replaces the events. The trainer writes the slab's flag
 * on its stream (cuStreamWriteValue32), ds waits for it
 * (cuStreamWaitValue32, cyclic >=); the stream that records `done` writes
 * the answer's flag instead, the trainer's stream waits for it. The driver's functions are found
 * through the runtime (cudaGetDriverEntryPointByVersion), so the daemon does not link libcuda.
 */
#include <cuda.h> /* types of the stream memory operations (found at run time) */
#include <cuda_runtime.h>
#include <ctype.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "devbuf.h"
#include "log.h"

#define THREADS 256
#define NO_BAD 0xffffffffffffffffull

/* A host array kept on the device through pinned staging (upload()). */
struct upl {
    void *h, *d;
    size_t cap, bytes; /* bytes: on the device now */
    uint64_t key;      /* what they are (0: nothing known; upload again) */
};

static void upl_free(struct upl *u)
{
    cudaFreeHost(u->h);
    cudaFree(u->d);
    u->h = u->d = NULL;
}

struct amx_devbuf {
    int dev, state_dev;
    void *slab, *answer; /* on dev */
    uint64_t slab_bytes, answer_bytes;
    cudaStream_t ds;      /* on dev: waits on `ready`, records `done` */
    cudaEvent_t ready;    /* on dev, interprocess, recorded by the trainer */
    cudaEvent_t done;     /* on dev, interprocess, recorded by the daemon (ds, or its answer
                             stream on the same GPU) */
    cudaEvent_t seen;     /* on dev: ds got past `ready` */
    cudaEvent_t answered; /* on state_dev: the answer is written */
    cudaEvent_t merged;   /* on state_dev: the last merge's check copied back */
    int merged_used;
    int answered_used; /* `answered` was recorded (the last answer may still run) */
    /* The first bad cell of a merge: d_bad[token & 1] (the other word is
     * reset for the next merge by the merge kernel), copied by the merge
     * kernel into h_bad (mapped pinned memory, hd_bad on the device). */
    unsigned long long *d_bad, *h_bad, *hd_bad;
    int bad_dirty;                /* a merge was set up and not launched: reset d_bad first */
    amx_run_t *d_runs, *h_runs;   /* merge runs (state_dev, pinned) */
    size_t cap_runs, n_runs;      /* n_runs: the runs on the device now */
    amx_run_t *d_gruns, *h_gruns; /* answer runs */
    size_t cap_gruns, n_gruns;
    uint64_t *d_qoff, *h_qoff; /* the slab's quantizer offsets (answer's missing counts) */
    size_t cap_qoff, n_qoff;
    uint32_t *d_miss;  /* state_dev, cap_qoff: the counts, copied into the answer (atomics
                          stay local: peer atomics need NVLink) and zeroed by k_dev_tail */
    int miss_dirty;    /* d_miss may hold counts: zero it before the next gather */
    int answer_failed; /* the last answer failed part-way: its copies may still run */
    /* The deadline on the trainer's ready flag (amx__cuda_dev_wait): each
     * merge has a token; the merge kernel skips the slab when *d_abort
     * holds its token, which a release writes before it writes the flag. */
    uint32_t *d_abort;    /* state_dev */
    uint32_t token;       /* the last merge's */
    amx_devsignal_t pend; /* the last merge's ready flag (pend_signal: by a flag) */
    int pend_signal, released;
    /* The last merge waits for a host flag (pend.host): set up, launched
     * by dev_wait (launch_deferred) when the flag passed. */
    int deferred, launched;
    float *m_pending;
    const uint8_t *m_has;
    uint64_t m_ncells;
    size_t m_nruns;
    uint32_t rank;                          /* the last merge's trainer rank */
    uint64_t key_runs, key_gruns, key_qoff; /* the slab serials of the runs and offsets there */
    /* The answer's globals (k_dev_tail): the maps, uploaded when the slab
     * changes. */
    struct upl cidx, ssrc, send;
    /* AMAXD_PROFILE: timed events of the last merge, read by dev_wait:
     * the state's stream at the merge, the waiting stream before and
     * after the ready flag, the state's stream after it, after the
     * kernels (twice: the check's copy is the merge kernel's now). */
    cudaEvent_t pt[6];
    int pt_rec;
};

typedef CUresult (*memop32_fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
static memop32_fn p_wait32, p_write32;

/* The driver's cuStreamWaitValue32 and cuStreamWriteValue32 (v2, CUDA 12
 * ABI); 0 when the driver has none. Loop thread. */
static int memops_found(void)
{
    static int state; /* 0: not looked, 1: found, -1: missing */
    if (state == 0) {
        cudaDriverEntryPointQueryResult q1 = cudaDriverEntryPointSymbolNotFound, q2 = q1;
        cudaError_t e1 = cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", (void **)&p_wait32,
                                                          12000, cudaEnableDefault, &q1);
        cudaError_t e2 = cudaGetDriverEntryPointByVersion(
            "cuStreamWriteValue32", (void **)&p_write32, 12000, cudaEnableDefault, &q2);
        int ok = e1 == cudaSuccess && e2 == cudaSuccess && q1 == cudaDriverEntryPointSuccess &&
                 q2 == cudaDriverEntryPointSuccess && p_wait32 != NULL && p_write32 != NULL;
        cudaGetLastError();
        state = ok ? 1 : -1;
        if (!ok)
            AMX_WARN("devbuf", "the CUDA driver has no cuStreamWaitValue32/cuStreamWriteValue32: "
                               "device buffers use interprocess events only");
    }
    return state > 0;
}

/* Converts a driver error of a stream memory operation. */
#define CUD(call, what)                                                                            \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS)                                                                    \
            return amx_err_set(err, AMX_EDEVICE, "CUDA %s failed: driver error %d", what,          \
                               (int)r_);                                                           \
    } while (0)

/* The run of `runs` (sorted by key, non-overlapping) holding `x`, or -1. */
__device__ __forceinline__ int64_t find_run(const amx_run_t *runs, uint32_t n, uint64_t x,
                                            int by_src)
{
    int64_t lo = 0, hi = (int64_t)n - 1;
    while (lo <= hi) {
        int64_t mid = (lo + hi) / 2;
        uint64_t k = by_src ? runs[mid].src : runs[mid].dst;
        if (x < k)
            hi = mid - 1;
        else if (x >= k + runs[mid].len)
            lo = mid + 1;
        else
            return mid;
    }
    return -1;
}

/* The smallest cell with data whose value is not finite and >= 0. */
__global__ void k_dev_check(const float *v, const uint8_t *has, uint64_t n, unsigned long long *bad)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        float x = v[i];
        if ((has == NULL || has[i] != 0) && !(x >= 0.0f && x <= 3.402823466e38f))
            atomicMin(bad, (unsigned long long)i);
    }
}

/* Max-merge of the slab along its runs (slab cells, sorted by src) when the
 * check found nothing. The merges of one epoch run one after another on
 * one stream, and a rank's runs never overlap: plain stores. */
__global__ void k_dev_merge(float *pending, const float *v, const uint8_t *has, uint64_t n,
                            const amx_run_t *runs, uint32_t nruns, unsigned long long *bad,
                            const volatile uint32_t *abort, uint32_t token,
                            volatile unsigned long long *h_bad)
{
    unsigned long long b = bad[token & 1]; /* final: k_dev_check ran before */
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *h_bad = b;                    /* the host reads it after the merge's event */
        bad[(token + 1) & 1] = NO_BAD; /* the next merge's word */
    }
    if (b != NO_BAD || *abort == token) /* a bad value, or released at the deadline */
        return;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        if (has != NULL && has[i] == 0)
            continue;
        int64_t r = find_run(runs, nruns, i, 1);
        if (r < 0)
            continue;
        float x = v[i] + 0.0f; /* -0 -> +0 */
        float *p = &pending[runs[r].dst + (i - runs[r].src)];
        *p = fmaxf(*p, x);
    }
}

/* The quantizer of slab cell i: qoff[q] <= i < qoff[q + 1]. */
__device__ __forceinline__ uint32_t find_quantizer(const uint64_t *qoff, uint32_t nq, uint64_t i)
{
    uint32_t lo = 0, hi = nq;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (qoff[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The answer's per-cell arrays in slab order (runs sorted by dst), and
 * per quantizer the count of its cells without data (`missing`, zeroed
 * before): as the packed answer counts them (results.c). Most epochs
 * have no such cell: the search and the atomic run for those only. */
__global__ void k_dev_gather(uint8_t *ans, uint64_t o_a, uint64_t o_s, uint64_t o_i, uint64_t o_b,
                             uint64_t n, const float *amax, const float *scale, const float *inv,
                             const uint8_t *bytes, const amx_run_t *runs, uint32_t nruns,
                             uint32_t *missing, const uint64_t *qoff, uint32_t nq)
{
    float *da = (float *)(ans + o_a), *ds = (float *)(ans + o_s), *di = (float *)(ans + o_i);
    uint8_t *db = ans + o_b;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        int64_t r = find_run(runs, nruns, i, 0);
        if (r < 0) { /* a quantizer not agreed yet: no data */
            da[i] = 0.0f;
            ds[i] = di[i] = 1.0f;
            db[i] = 0;
            if (nq > 0)
                atomicAdd(&missing[find_quantizer(qoff, nq, i)], 1u);
            continue;
        }
        uint64_t c = runs[r].src + (i - runs[r].dst);
        float a = amax[c];
        if (a == -INFINITY && nq > 0)
            atomicAdd(&missing[find_quantizer(qoff, nq, i)], 1u);
        da[i] = a == -INFINITY ? 0.0f : a;
        ds[i] = scale[c];
        di[i] = inv[c];
        db[i] = bytes[c];
    }
}

/* The answer's globals (state.h amx_devans_layout_t): per quantizer i of
 * the slab, the front set's global amax, scale, scale_inv of its catalog
 * index and the previous globals; per global slice s, the front set's.
 * What results.c amx__slab_globals and amx__build_packed write on the
 * host for the packed answer. */
struct tail_args {
    uint64_t g[9];
    uint32_t nq, out_nq, prev_n;
    uint64_t ns, out_ns;
    const uint32_t *cidx;
    const uint64_t *ssrc, *send;
    const float *gamax, *gscale, *ginv, *samax, *sscale, *sinv;
    const float *pga, *pgs;
    const uint8_t *pok;
    uint64_t missing; /* the answer's uint32 counts, from miss (then zeroed) */
    uint32_t *miss;
};

__global__ void k_dev_tail(uint8_t *ans, struct tail_args a)
{
    uint64_t m = a.nq > a.ns ? a.nq : a.ns;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < m;
         i += (uint64_t)gridDim.x * blockDim.x) {
        if (i < a.nq) {
            uint32_t ci = a.cidx[i];
            int have = ci != 0xffffffffu && ci < a.out_nq;
            ((float *)(ans + a.g[0]))[i] = have ? a.gamax[ci] : 0.0f;
            ((float *)(ans + a.g[1]))[i] = have ? a.gscale[ci] : 1.0f;
            ((float *)(ans + a.g[2]))[i] = have ? a.ginv[ci] : 1.0f;
            int prev = ci < a.prev_n && a.pok[ci] != 0;
            ((float *)(ans + a.g[6]))[i] = prev ? a.pga[ci] : 0.0f;
            ((float *)(ans + a.g[7]))[i] = prev ? a.pgs[ci] : 0.0f;
            ans[a.g[8] + i] = (uint8_t)prev;
            ((uint32_t *)(ans + a.missing))[i] = a.miss[i];
            a.miss[i] = 0;
        }
        if (i < a.ns) {
            uint64_t g = a.ssrc[i];
            int have = g != 0xffffffffffffffffull && a.send[i] <= a.out_ns;
            ((float *)(ans + a.g[3]))[i] = have ? a.samax[g] : 0.0f;
            ((float *)(ans + a.g[4]))[i] = have ? a.sscale[g] : 1.0f;
            ((float *)(ans + a.g[5]))[i] = have ? a.sinv[g] : 1.0f;
        }
    }
}

static unsigned grid_for(uint64_t n)
{
    uint64_t b = (n + THREADS - 1) / THREADS;
    if (b > 65535u * 8u)
        b = 65535u * 8u;
    return (unsigned)(b ? b : 1);
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" of a device, as nvidia-smi and
 * torch print it. */
static void uuid_str(const cudaUUID_t *u, char *out)
{
    const unsigned char *b = (const unsigned char *)u->bytes;
    int k = sprintf(out, "GPU-");
    for (int i = 0; i < 16; i++) {
        k += sprintf(out + k, "%02x", b[i]);
        if (i == 3 || i == 5 || i == 7 || i == 9)
            out[k++] = '-';
    }
    out[k] = '\0';
}

/* The CUDA ordinal of the device named by a PCI bus id or a UUID. */
static amx_status_t find_device(const char *name, int state_dev, int *out, amx_err_t *err)
{
    if (name == NULL || name[0] == '\0') {
        *out = state_dev;
        return AMX_OK;
    }
    if (strlen(name) > 64)
        return amx_err_set(err, AMX_EINVAL,
                           "device name of %zu characters; give a PCI bus id "
                           "(0000:65:00.0) or a GPU UUID (GPU-...)",
                           strlen(name));
    int n = 0;
    CU(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    if (strncasecmp(name, "GPU-", 4) == 0) {
        for (int i = 0; i < n; i++) {
            cudaDeviceProp p;
            char u[64];
            CU(cudaGetDeviceProperties(&p, i), "cudaGetDeviceProperties");
            uuid_str(&p.uuid, u);
            if (strcasecmp(u, name) == 0) {
                *out = i;
                return AMX_OK;
            }
        }
        return amx_err_set(err, AMX_ENOTFOUND,
                           "no GPU with UUID %s is visible to the daemon (%d visible): run the "
                           "trainer on a GPU of the daemon's node, or give the daemon that GPU "
                           "(CUDA_VISIBLE_DEVICES)",
                           name, n);
    }
    for (const char *c = name; *c; c++)
        if (!isxdigit((unsigned char)*c) && *c != ':' && *c != '.')
            return amx_err_set(err, AMX_EINVAL,
                               "device '%s' is neither a PCI bus id (0000:65:00.0) nor a GPU UUID "
                               "(GPU-...)",
                               name);
    int d = -1;
    cudaError_t e = cudaDeviceGetByPCIBusId(&d, name);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return amx_err_set(err, AMX_ENOTFOUND,
                           "no GPU with PCI bus id %s is visible to the daemon (%d visible; %s): "
                           "run the trainer on a GPU of the daemon's node, or give the daemon "
                           "that GPU (CUDA_VISIBLE_DEVICES)",
                           name, n, cudaGetErrorName(e));
    }
    *out = d;
    return AMX_OK;
}

extern "C" void amx__cuda_dev_close(amx_devbuf_t *d)
{
    if (d == NULL)
        return;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(d->state_dev);
    if (d->merged_used)
        cudaEventSynchronize(d->merged);
    if (d->answered_used)
        cudaEventSynchronize(d->answered);
    if (d->merged != NULL)
        cudaEventDestroy(d->merged);
    if (d->answered != NULL)
        cudaEventDestroy(d->answered);
    for (int i = 0; i < 6; i++)
        if (d->pt[i] != NULL)
            cudaEventDestroy(d->pt[i]);
    cudaFree(d->d_bad);
    cudaFreeHost(d->h_bad);
    cudaFree(d->d_runs);
    cudaFreeHost(d->h_runs);
    cudaFree(d->d_gruns);
    cudaFreeHost(d->h_gruns);
    cudaFree(d->d_qoff);
    cudaFreeHost(d->h_qoff);
    cudaFree(d->d_miss);
    cudaFree(d->d_abort);
    upl_free(&d->cidx);
    upl_free(&d->ssrc);
    upl_free(&d->send);
    cudaSetDevice(d->dev);
    if (d->ds != NULL) {
        cudaStreamSynchronize(d->ds);
        cudaStreamDestroy(d->ds);
    }
    if (d->ready != NULL)
        cudaEventDestroy(d->ready);
    if (d->done != NULL)
        cudaEventDestroy(d->done);
    if (d->seen != NULL)
        cudaEventDestroy(d->seen);
    cudaFree(d->slab);
    cudaFree(d->answer);
    cudaGetLastError();
    cudaSetDevice(prev);
    free(d);
}

static amx_status_t open_buffers(amx_devbuf_t *d, amx_devbuf_info_t *info, amx_err_t *err)
{
    unsigned ev = cudaEventInterprocess | cudaEventDisableTiming;
    CU(cudaSetDevice(d->dev), "cudaSetDevice (trainer's device)");
    CU(cudaMalloc(&d->slab, d->slab_bytes ? d->slab_bytes : 16), "cudaMalloc (device slab)");
    CU(cudaMalloc(&d->answer, d->answer_bytes ? d->answer_bytes : 16),
       "cudaMalloc (device answer)");
    CU(cudaMemset(d->slab, 0, d->slab_bytes ? d->slab_bytes : 16), "cudaMemset (slab)");
    CU(cudaMemset(d->answer, 0, d->answer_bytes ? d->answer_bytes : 16), "cudaMemset (answer)");
    CU(cudaStreamSynchronize(0), "cudaStreamSynchronize (buffers' first values)");
    CU(cudaEventCreateWithFlags(&d->ready, ev), "cudaEventCreate (ready)");
    CU(cudaEventCreateWithFlags(&d->done, ev), "cudaEventCreate (done)");
    CU(cudaEventCreateWithFlags(&d->seen, cudaEventDisableTiming), "cudaEventCreate");
    CU(cudaStreamCreateWithFlags(&d->ds, cudaStreamNonBlocking), "cudaStreamCreate");
    CU(cudaIpcGetEventHandle((cudaIpcEventHandle_t *)info->done, d->done), "cudaIpcGetEventHandle");
    CU(cudaIpcGetMemHandle((cudaIpcMemHandle_t *)info->slab, d->slab), "cudaIpcGetMemHandle");
    CU(cudaIpcGetMemHandle((cudaIpcMemHandle_t *)info->answer, d->answer), "cudaIpcGetMemHandle");
    CU(cudaIpcGetEventHandle((cudaIpcEventHandle_t *)info->ready, d->ready),
       "cudaIpcGetEventHandle");
    CU(cudaSetDevice(d->state_dev), "cudaSetDevice");
    if (d->dev != d->state_dev) {
        int ok = 0;
        CU(cudaDeviceCanAccessPeer(&ok, d->state_dev, d->dev), "cudaDeviceCanAccessPeer");
        if (!ok)
            return amx_err_set(err, AMX_EPRECOND,
                               "the daemon's GPU %d cannot reach GPU %d (%s) by peer access: run "
                               "a daemon on that GPU, or the trainer on the daemon's",
                               d->state_dev, d->dev, info->bus_id);
        cudaError_t e = cudaDeviceEnablePeerAccess(d->dev, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
            CU(e, "cudaDeviceEnablePeerAccess");
        cudaGetLastError();
    }
    CU(cudaEventCreateWithFlags(&d->answered, cudaEventDisableTiming), "cudaEventCreate");
    CU(cudaEventCreateWithFlags(&d->merged, cudaEventDisableTiming), "cudaEventCreate");
    CU(cudaMalloc(&d->d_bad, 2 * sizeof(unsigned long long)), "cudaMalloc");
    CU(cudaMemset(d->d_bad, 0xff, 2 * sizeof(unsigned long long)), "cudaMemset");
    CU(cudaMalloc(&d->d_abort, sizeof(uint32_t)), "cudaMalloc");
    CU(cudaMemset(d->d_abort, 0, sizeof(uint32_t)), "cudaMemset");
    /* cudaMemset runs on the legacy stream, which the non-blocking sd is
     * not ordered after: done before the first merge. */
    CU(cudaStreamSynchronize(0), "cudaStreamSynchronize (buffers' first values)");
    CU(cudaHostAlloc(&d->h_bad, sizeof(unsigned long long), cudaHostAllocMapped), "cudaHostAlloc");
    *d->h_bad = NO_BAD;
    CU(cudaHostGetDevicePointer((void **)&d->hd_bad, d->h_bad, 0), "cudaHostGetDevicePointer");
    info->signals = memops_found();
    return AMX_OK;
}

extern "C" amx_status_t amx__cuda_dev_open(int state_dev, const char *device, uint64_t slab_bytes,
                                           uint64_t answer_bytes, amx_devbuf_t **out,
                                           amx_devbuf_info_t *info, amx_err_t *err)
{
    *out = NULL;
    memset(info, 0, sizeof(*info));
    int dev = -1;
    AMX_CHECK(find_device(device, state_dev, &dev, err));
    amx_devbuf_t *d = (amx_devbuf_t *)calloc(1, sizeof(*d));
    if (d == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    d->dev = dev;
    d->state_dev = state_dev;
    d->slab_bytes = slab_bytes;
    d->answer_bytes = answer_bytes;
    info->device = dev;
    info->state_dev = state_dev;
    cudaDeviceGetPCIBusId(info->bus_id, sizeof(info->bus_id), dev);
    int prev = 0;
    cudaGetDevice(&prev);
    amx_status_t st = open_buffers(d, info, err);
    cudaSetDevice(prev);
    if (st != AMX_OK) {
        if (st == AMX_EDEVICE && strstr(err->msg, "cudaMalloc") != NULL &&
            strstr(err->msg, "cudaErrorMemoryAllocation") != NULL)
            err->code = st = AMX_ENOMEM;
        amx__cuda_dev_close(d);
        return st;
    }
    *out = d;
    return AMX_OK;
}

/* Pinned staging `*h` and a device copy `*d` (state_dev) of at least n runs. */
static amx_status_t grow_runs(amx_run_t **h, amx_run_t **d, size_t *cap, size_t n, amx_err_t *err)
{
    if (n <= *cap)
        return AMX_OK;
    size_t c = *cap ? *cap : 64;
    while (c < n)
        c *= 2;
    cudaFreeHost(*h);
    cudaFree(*d);
    *h = NULL;
    *d = NULL;
    *cap = 0;
    CU(cudaHostAlloc((void **)h, c * sizeof(amx_run_t), cudaHostAllocDefault), "cudaHostAlloc");
    CU(cudaMalloc((void **)d, c * sizeof(amx_run_t)), "cudaMalloc (runs)");
    *cap = c;
    return AMX_OK;
}

/* The runs `runs[0, n)` on the device (*d), copied through the pinned
 * staging *h only when they are not the ones there: `key` (the slab's
 * serial) is not *key_up, the key of the *n_up runs there. A layout's runs
 * stay the same from epoch to epoch. The last copy is done (its epoch
 * ended) before the staging is written again. */
static amx_status_t upload_runs(amx_run_t **h, amx_run_t **d, size_t *cap, size_t *n_up,
                                uint64_t *key_up, const amx_run_t *runs, size_t n, uint64_t key,
                                cudaStream_t s, amx_err_t *err)
{
    if (n > *cap)
        *n_up = 0;
    AMX_CHECK(grow_runs(h, d, cap, n, err));
    if (n == 0 || (n == *n_up && key != 0 && key == *key_up))
        return AMX_OK;
    *n_up = 0;
    memcpy(*h, runs, n * sizeof(amx_run_t));
    CU(cudaMemcpyAsync(*d, *h, n * sizeof(amx_run_t), cudaMemcpyHostToDevice, s),
       "cudaMemcpyAsync (runs)");
    *n_up = n;
    *key_up = key;
    return AMX_OK;
}

/* The slab's quantizer offsets (n values) on the device (d->d_qoff),
 * copied through pinned staging only when the slab changed (as
 * upload_runs). */
static amx_status_t upload_qoff(amx_devbuf_t *d, const uint64_t *qoff, size_t n, uint64_t key,
                                cudaStream_t s, amx_err_t *err)
{
    if (n > d->cap_qoff) {
        cudaFreeHost(d->h_qoff);
        cudaFree(d->d_qoff);
        cudaFree(d->d_miss);
        d->h_qoff = NULL;
        d->d_qoff = NULL;
        d->d_miss = NULL;
        d->cap_qoff = d->n_qoff = 0;
        CU(cudaHostAlloc((void **)&d->h_qoff, n * sizeof(uint64_t), cudaHostAllocDefault),
           "cudaHostAlloc");
        CU(cudaMalloc((void **)&d->d_qoff, n * sizeof(uint64_t)), "cudaMalloc (offsets)");
        CU(cudaMalloc((void **)&d->d_miss, n * sizeof(uint32_t)), "cudaMalloc (counts)");
        d->cap_qoff = n;
        d->miss_dirty = 1;
    }
    if (n == 0 || (n == d->n_qoff && key != 0 && key == d->key_qoff))
        return AMX_OK;
    d->n_qoff = 0;
    memcpy(d->h_qoff, qoff, n * sizeof(uint64_t));
    CU(cudaMemcpyAsync(d->d_qoff, d->h_qoff, n * sizeof(uint64_t), cudaMemcpyHostToDevice, s),
       "cudaMemcpyAsync (offsets)");
    d->n_qoff = n;
    d->key_qoff = key;
    return AMX_OK;
}

/* `bytes` of host memory `src` on the device (u->d), through u's pinned
 * staging, unless the same key's are there already (key 0: always). The
 * last copy out of the staging is done before it is written again (the
 * caller waited for its answer). */
static amx_status_t upload(struct upl *u, const void *src, size_t bytes, uint64_t key,
                           cudaStream_t s, amx_err_t *err)
{
    if (bytes == 0)
        return AMX_OK;
    if (key != 0 && key == u->key && bytes == u->bytes)
        return AMX_OK;
    u->key = 0;
    u->bytes = 0;
    if (bytes > u->cap) {
        cudaFreeHost(u->h);
        cudaFree(u->d);
        u->h = u->d = NULL;
        u->cap = 0;
        size_t c = bytes < 4096 ? 4096 : bytes + bytes / 4;
        CU(cudaHostAlloc(&u->h, c, cudaHostAllocDefault), "cudaHostAlloc");
        CU(cudaMalloc(&u->d, c), "cudaMalloc (answer maps)");
        u->cap = c;
    }
    memcpy(u->h, src, bytes);
    CU(cudaMemcpyAsync(u->d, u->h, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync (maps)");
    u->bytes = bytes;
    u->key = key;
    return AMX_OK;
}

/* The profile's timed events of d (pt), made on first use: 0 when there. */
static int prof_events(amx_devbuf_t *d)
{
    if (d->pt[0] != NULL)
        return 0;
    for (int i = 0; i < 6; i++) {
        cudaSetDevice(i == 1 || i == 2 ? d->dev : d->state_dev);
        if (cudaEventCreate(&d->pt[i]) != cudaSuccess) {
            cudaGetLastError();
            for (int k = 0; k < i; k++)
                cudaEventDestroy(d->pt[k]);
            memset(d->pt, 0, sizeof(d->pt));
            cudaSetDevice(d->state_dev);
            return -1;
        }
    }
    cudaSetDevice(d->state_dev);
    return 0;
}

#define PT(i, stream)                                                                              \
    do {                                                                                           \
        if (d->pt_rec)                                                                             \
            cudaEventRecord(d->pt[i], stream);                                                     \
    } while (0)

/* Queues the check and merge of d's slab on sd (state_dev current). */
static amx_status_t launch_merge(amx_devbuf_t *d, float *pending, const uint8_t *has,
                                 uint64_t ncells, size_t nruns, cudaStream_t sd, amx_err_t *err)
{
    const float *v = (const float *)d->slab;
    if (ncells > 0) {
        k_dev_check<<<grid_for(ncells), THREADS, 0, sd>>>(v, has, ncells,
                                                          d->d_bad + (d->token & 1));
        k_dev_merge<<<grid_for(ncells), THREADS, 0, sd>>>(pending, v, has, ncells, d->d_runs,
                                                          (uint32_t)nruns, d->d_bad, d->d_abort,
                                                          d->token, d->hd_bad);
        CU(cudaGetLastError(), "device slab merge launch");
    }
    d->bad_dirty = 0;
    CU(cudaEventRecord(d->merged, sd), "cudaEventRecord");
    d->merged_used = 1;
    return AMX_OK;
}

extern "C" amx_status_t amx__cuda_dev_merge(amx_devbuf_t *d, float *pending, const amx_run_t *runs,
                                            size_t nruns, uint64_t key, uint64_t ncells,
                                            uint64_t has_data_off, const amx_devsignal_t *ready,
                                            uint32_t rank, cudaStream_t sd, cudaEvent_t in,
                                            amx_err_t *err)
{
    CU(cudaSetDevice(d->state_dev), "cudaSetDevice");
    d->pt_rec = amx_log_profiling() && prof_events(d) == 0;
    /* The last merge's staging is free once its check came back (the
     * engine waited for it before the epoch could end). */
    if (d->merged_used)
        CU(cudaEventSynchronize(d->merged), "cudaEventSynchronize");
    AMX_CHECK(upload_runs(&d->h_runs, &d->d_runs, &d->cap_runs, &d->n_runs, &d->key_runs, runs,
                          nruns, key, sd, err));
    /* A merge set up but never launched left the word of this one
     * unreset (k_dev_merge resets the next one): reset both. */
    if (d->bad_dirty)
        CU(cudaMemsetAsync(d->d_bad, 0xff, 2 * sizeof(unsigned long long), sd), "cudaMemsetAsync");
    d->bad_dirty = 1;
    /* Never 0 (what d_abort starts with); odd and even in turn (d_bad). */
    d->token = d->token + 1 ? d->token + 1 : 2;
    *d->h_bad = NO_BAD; /* what an empty slab (no kernel) leaves */
    d->released = 0;
    d->rank = rank;
    d->pend_signal = ready != NULL && (ready->host != NULL || memops_found());
    d->deferred = ready != NULL && ready->host != NULL;
    d->launched = 0;
    if (ready != NULL)
        d->pend = *ready;
    const uint8_t *has =
        has_data_off == UINT64_MAX ? NULL : (const uint8_t *)d->slab + has_data_off;
    if (d->deferred) {
        /* Armed: nothing waits on the GPU for the trainer's step (a stream
         * blocked for a step would block every implicit synchronization of
         * this process: cudaFree, cudaHostAlloc, ...). dev_wait launches
         * it once the trainer's host flag passed. */
        d->pt_rec = 0;
        d->m_pending = pending;
        d->m_has = has;
        d->m_ncells = ncells;
        d->m_nruns = nruns;
        return AMX_OK;
    }
    PT(0, sd);
    /* Behind the trainer's writes of the slab: its last record of `ready`
     * (before it called ReconcileDevice), waited on by ds on its GPU (its
     * own stream, also on the state's GPU: `seen` must tell this
     * trainer's flag from the merges queued before it on sd, dev_wait's
     * stuck()). */
    CU(cudaSetDevice(d->dev), "cudaSetDevice");
    PT(1, d->ds);
    if (ready != NULL && memops_found())
        CUD(p_wait32((CUstream)d->ds, (CUdeviceptr)((char *)d->slab + ready->flag_off), ready->seq,
                     CU_STREAM_WAIT_VALUE_GEQ),
            "cuStreamWaitValue32 (trainer's ready flag)");
    else
        CU(cudaStreamWaitEvent(d->ds, d->ready, 0), "cudaStreamWaitEvent (trainer's ready event)");
    PT(2, d->ds);
    CU(cudaEventRecord(d->seen, d->ds), "cudaEventRecord");
    CU(cudaSetDevice(d->state_dev), "cudaSetDevice");
    CU(cudaStreamWaitEvent(sd, d->seen, 0), "cudaStreamWaitEvent");
    PT(3, sd);
    AMX_CHECK(launch_merge(d, pending, has, ncells, nruns, sd, err));
    PT(4, sd);
    PT(5, sd);
    d->launched = 1;
    CU(cudaEventRecord(in, sd), "cudaEventRecord");
    return AMX_OK;
}

extern "C" int64_t amx__cuda_dev_bad(amx_devbuf_t *d)
{
    if (!d->merged_used || d->released || (d->deferred && !d->launched))
        return -1;
    cudaSetDevice(d->state_dev);
    if (cudaEventSynchronize(d->merged) != cudaSuccess)
        return -1;
    return *d->h_bad == NO_BAD ? -1 : (int64_t)*d->h_bad;
}

/* Releases the last merge of d, whose trainer never wrote its ready flag:
 * cancels the merge (its token into d_abort, on the state's device), then
 * writes the flag (pend.seq) into the slab from a stream of the buffers'
 * device, each synchronized, in that order: when the daemon's stream gets
 * past the flag, the merge kernel reads the token and skips the slab. */
static amx_status_t release(amx_devbuf_t *d, amx_err_t *err)
{
    if (d->deferred) {
        /* never launched: nothing on the GPU waits for it */
        __atomic_store_n(&d->released, 1, __ATOMIC_RELEASE);
        return AMX_OK;
    }
    cudaStream_t s = NULL;
    CU(cudaSetDevice(d->state_dev), "cudaSetDevice");
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    CUresult r = p_write32((CUstream)s, (CUdeviceptr)d->d_abort, d->token, 0);
    cudaError_t e = r == CUDA_SUCCESS ? cudaStreamSynchronize(s) : cudaSuccess;
    cudaStreamDestroy(s);
    if (r != CUDA_SUCCESS)
        return amx_err_set(err, AMX_EDEVICE,
                           "cuStreamWriteValue32 (cancel a merge): driver error %d", (int)r);
    CU(e, "cudaStreamSynchronize (cancel a merge)");
    CU(cudaSetDevice(d->dev), "cudaSetDevice");
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    r = p_write32((CUstream)s, (CUdeviceptr)((char *)d->slab + d->pend.flag_off), d->pend.seq, 0);
    e = r == CUDA_SUCCESS ? cudaStreamSynchronize(s) : cudaSuccess;
    cudaStreamDestroy(s);
    if (r != CUDA_SUCCESS)
        return amx_err_set(err, AMX_EDEVICE,
                           "cuStreamWriteValue32 (a trainer's ready flag): driver error %d",
                           (int)r);
    CU(e, "cudaStreamSynchronize (a trainer's ready flag)");
    d->released = 1;
    return AMX_OK;
}

/* Whether d's last merge still waits for its trainer (its stream did not
 * get past the ready flag or event). */
static int stuck(amx_devbuf_t *d)
{
    if (d->deferred)
        return !d->launched && !d->released;
    int s = cudaEventQuery(d->seen) == cudaErrorNotReady;
    cudaGetLastError();
    return s;
}

/* After every merge of `ds` ended: EINVAL when a slab failed its check
 * (it was not merged), naming the first such rank and cell and counting
 * the others; the epoch fails on every rank instead of going on without
 * the slab (state.h dev_wait). */
static amx_status_t check_merged(amx_devbuf_t *const *ds, size_t n, amx_err_t *err)
{
    size_t nbad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        if (ds[i]->released || *ds[i]->h_bad == NO_BAD)
            continue;
        if (nbad++ == 0)
            first = i;
    }
    if (nbad == 0)
        return AMX_OK;
    char more[64] = "";
    if (nbad > 1)
        snprintf(more, sizeof(more), " (and %zu more trainer slab%s)", nbad - 1,
                 nbad > 2 ? "s" : "");
    return amx_err_set(err, AMX_EINVAL,
                       "the device slab of trainer rank %u holds a NaN, infinite or negative "
                       "amax (slab cell %llu)%s; amax values must be finite and >= 0. That slab "
                       "was not merged, so nothing of this epoch was reconciled (on every rank); "
                       "the other contributions are kept for the next epoch",
                       ds[first]->rank, (unsigned long long)*ds[first]->h_bad, more);
}

/* AMAXD_PROFILE: the device's times of d's last merge (pt), in us; -1
 * where the driver cannot tell (events of two devices). */
static void log_merge_times(amx_devbuf_t *d)
{
    if (!d->pt_rec)
        return;
    static const int from[] = {0, 1, 2, 3, 4}, to[] = {5, 2, 3, 4, 5};
    long us[5];
    for (int i = 0; i < 5; i++) {
        float ms = -0.001f;
        cudaSetDevice(from[i] == 1 || from[i] == 2 ? d->dev : d->state_dev);
        if (cudaEventElapsedTime(&ms, d->pt[from[i]], d->pt[to[i]]) != cudaSuccess) {
            cudaGetLastError();
            ms = -0.001f;
        }
        us[i] = (long)(ms * 1000.0f + (ms >= 0 ? 0.5f : -0.5f));
    }
    AMX_INFO("profile",
             "device merge of rank %u, device us: total %ld, the ready flag's wait %ld, to the "
             "state's stream %ld, check and merge %ld, the rest %ld",
             d->rank, us[0], us[1], us[2], us[3], us[4]);
}

extern "C" int amx__cuda_dev_waiting(amx_devbuf_t *d)
{
    /* The loop asks while the engine launches or releases. */
    if (d->deferred)
        return !__atomic_load_n(&d->launched, __ATOMIC_ACQUIRE) &&
               !__atomic_load_n(&d->released, __ATOMIC_ACQUIRE);
    return d->merged_used && !d->released && stuck(d);
}

/* Whether the trainer's host flag of deferred merge d reached its seq
 * (cyclically, as cuStreamWaitValue32's >=). */
static int host_flag_passed(const amx_devbuf_t *d)
{
    uint32_t v = *d->pend.host;
    return (int32_t)(v - d->pend.seq) >= 0;
}

/* dev_wait's part for the deferred merges (armed epochs): launches those
 * whose host flag passed; when none is left, records `in` behind them.
 * Returns 1 while some still wait. */
static int launch_deferred(amx_devbuf_t *const *ds, size_t n, cudaStream_t sd, cudaEvent_t in,
                           int *any, amx_err_t *err, amx_status_t *st)
{
    int waiting = 0;
    *st = AMX_OK;
    for (size_t i = 0; i < n; i++) {
        amx_devbuf_t *d = ds[i];
        if (!d->deferred || d->launched || d->released)
            continue;
        if (!host_flag_passed(d)) {
            waiting = 1;
            continue;
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if ((*st = launch_merge(d, d->m_pending, d->m_has, d->m_ncells, d->m_nruns, sd, err)) !=
            AMX_OK) {
            /* `in` behind what was launched, for the unflip. */
            if (*any)
                cudaEventRecord(in, sd);
            return 0;
        }
        __atomic_store_n(&d->launched, 1, __ATOMIC_RELEASE);
        *any = 1;
    }
    if (!waiting && *any) {
        cudaError_t e = cudaEventRecord(in, sd);
        if (e != cudaSuccess)
            *st = amx_err_set(err, AMX_EDEVICE, "CUDA cudaEventRecord failed: %s",
                              cudaGetErrorString(e));
        *any = 0;
    }
    return waiting;
}

extern "C" amx_status_t amx__cuda_dev_wait(amx_devbuf_t *const *ds, size_t n, cudaStream_t sd,
                                           cudaEvent_t in, int state_dev, uint64_t deadline_ms,
                                           int spin, int (*aborted)(void *ud), void *ud,
                                           amx_err_t *err)
{
    int deferred = 0, launched_any = 0;
    for (size_t i = 0; i < n; i++)
        deferred |= ds[i]->deferred;
    int warned = 0, warned_abort = 0;
    int prof = amx_log_profiling(); /* when the flags passed, when the merges ended */
    uint64_t t0 = prof ? amx_now_us() : 0, t_seen = 0;
    int seen = !prof;
    for (uint64_t spins = 0;; spins++) {
        if (!seen) {
            seen = 1;
            for (size_t i = 0; i < n && seen; i++)
                seen = !stuck(ds[i]);
            if (seen)
                t_seen = amx_now_us() - t0;
        }
        int held = 0;
        if (deferred) {
            amx_status_t lst;
            held = launch_deferred(ds, n, sd, in, &launched_any, err, &lst);
            if (lst != AMX_OK)
                return lst;
        }
        cudaError_t e = held ? cudaErrorNotReady : cudaEventQuery(in);
        if (e == cudaSuccess) {
            if (prof) {
                AMX_INFO("profile",
                         "device slabs of %zu trainer(s): their flags passed %llu us into the "
                         "engine's wait, the merges ended at %llu us",
                         n, (unsigned long long)t_seen, (unsigned long long)(amx_now_us() - t0));
                for (size_t i = 0; i < n; i++)
                    log_merge_times(ds[i]);
                cudaSetDevice(state_dev);
            }
            return check_merged(ds, n, err);
        }
        if (e != cudaErrorNotReady)
            CU(e, "cudaEventQuery (device slabs merged)");
        int abort_now = !warned_abort && aborted != NULL && (spins & 63) == 0 && aborted(ud);
        int late = deadline_ms != UINT64_MAX && !warned && amx_now_ms() >= deadline_ms;
        if (abort_now || late) {
            char ranks[256] = "";
            size_t nr = 0, nev = 0;
            for (size_t i = 0; i < n; i++) {
                if (!stuck(ds[i]))
                    continue;
                if (!ds[i]->pend_signal) {
                    nev++;
                    continue;
                }
                if (nr < sizeof(ranks))
                    nr += (size_t)snprintf(ranks + nr, sizeof(ranks) - nr, "%s%u (signal %u)",
                                           nr ? ", " : "", ds[i]->pend.rank, ds[i]->pend.seq);
            }
            if (late)
                warned = 1;
            if (abort_now)
                warned_abort = 1;
            if (nev > 0) {
                /* A stream wait on an interprocess event cannot be
                 * cancelled: releasing the others would not free the
                 * daemon's stream. Wait on, as without a deadline. */
                AMX_ERROR("devbuf",
                          "%s while the daemon's stream waits for %zu trainer slab(s) ordered by "
                          "the ready event: a stream wait on an interprocess event cannot be "
                          "released, so this epoch waits on for the trainer (signals, the "
                          "doorbell's flags, can be released)",
                          late ? "the deadline passed" : "the epoch was aborted", nev);
                continue;
            }
            if (nr == 0)
                continue; /* every trainer got past its flag: merging now */
            for (size_t i = 0; i < n; i++) {
                if (!stuck(ds[i]))
                    continue;
                amx_status_t st = release(ds[i], err);
                cudaSetDevice(state_dev);
                if (st != AMX_OK)
                    return st;
            }
            if (deferred) {
                /* `in` behind the deferred merges launched before. */
                amx_status_t lst;
                (void)launch_deferred(ds, n, sd, in, &launched_any, err, &lst);
                if (lst != AMX_OK)
                    return lst;
            }
            /* The released merges skip their slabs; `in` follows shortly
             * (the loop's unflip waits for it). A trainer whose flag lands
             * between stuck() and release() has its (real) slab merged in
             * part or in whole: the sentences say so. */
            if (!late)
                return amx_err_set(
                    err, AMX_EABORTED,
                    "the epoch was aborted while the daemon waited for the ready flag of "
                    "trainer rank %s; the daemon released that merge (writing the flag itself "
                    "where its stream waited on it), and that slab was not merged (unless its "
                    "flag arrived at that very moment)",
                    ranks);
            return amx_err_set(
                err, AMX_ETIMEDOUT,
                "the device slab of trainer rank %s was not ready within the epoch's deadline "
                "(reconcile_timeout_ms): its stream never wrote the ready flag after the slab (a "
                "stream stuck behind other work, or a trainer that died). The daemon wrote the "
                "flag itself so that its own stream goes on; the slab was not merged (unless its "
                "flag arrived at that very moment), nothing of this epoch was reconciled, and "
                "the other contributions are kept for the next epoch",
                ranks);
        }
        if (spin || spins < 1000) {
            sched_yield();
        } else {
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
        }
    }
}

extern "C" amx_status_t amx__cuda_dev_answer(amx_devbuf_t *d, const amx_devans_src_t *src,
                                             const amx_run_t *gather, size_t ngather,
                                             uint64_t ncells, const amx_devans_layout_t *lay,
                                             const amx_devsignal_t *done, cudaStream_t s,
                                             amx_err_t *err)
{
    uint64_t end = lay->g[8] + lay->nq;
    if (lay->g[5] + 4 * lay->ns > end)
        end = lay->g[5] + 4 * lay->ns;
    if (end > d->answer_bytes || lay->block_scales + ncells > d->answer_bytes ||
        lay->missing + 4 * (uint64_t)lay->nq > d->answer_bytes)
        return amx_err_set(err, AMX_EINTERNAL, "device answer of %llu bytes too small",
                           (unsigned long long)d->answer_bytes);
    int prof = amx_log_profiling();
    uint64_t t0 = prof ? amx_now_us() : 0, t1 = 0, t2 = 0, t3 = 0;
    CU(cudaSetDevice(d->state_dev), "cudaSetDevice");
    /* The last answer's copies out of our pinned staging (runs, offsets,
     * maps) are done before the host writes them again; long done by now. */
    if (d->answered_used)
        CU(cudaEventSynchronize(d->answered), "cudaEventSynchronize (last answer)");
    /* One that failed after queuing copies out of the staging recorded no
     * `answered`: wait for its stream instead. */
    if (d->answer_failed)
        CU(cudaStreamSynchronize(s), "cudaStreamSynchronize (failed answer)");
    d->answer_failed = 1;
    if (prof)
        t1 = amx_now_us();
    AMX_CHECK(upload_runs(&d->h_gruns, &d->d_gruns, &d->cap_gruns, &d->n_gruns, &d->key_gruns,
                          gather, ngather, lay->key, s, err));
    if (lay->nq > 0) {
        AMX_CHECK(upload_qoff(d, lay->qoff, (size_t)lay->nq + 1, lay->key, s, err));
        /* Zeroed by the last answer's k_dev_tail, unless it never ran. */
        if (d->miss_dirty)
            CU(cudaMemsetAsync(d->d_miss, 0, d->cap_qoff * sizeof(uint32_t), s), "cudaMemsetAsync");
        d->miss_dirty = 1;
    }
    if (prof)
        t2 = amx_now_us();
    if (ncells > 0) {
        k_dev_gather<<<grid_for(ncells), THREADS, 0, s>>>(
            (uint8_t *)d->answer, lay->amax, lay->scale, lay->scale_inv, lay->block_scales, ncells,
            src->amax, src->scale, src->inv, src->bytes, d->d_gruns, (uint32_t)ngather, d->d_miss,
            d->d_qoff, lay->nq);
        CU(cudaGetLastError(), "device answer launch");
    }
    if (lay->nq > 0 || lay->ns > 0) {
        struct tail_args a;
        memset(&a, 0, sizeof(a));
        memcpy(a.g, lay->g, sizeof(a.g));
        a.nq = lay->nq;
        a.ns = lay->ns;
        a.out_nq = src->out_nq;
        a.out_ns = src->samax != NULL ? src->out_ns : 0;
        a.gamax = src->gamax, a.gscale = src->gscale, a.ginv = src->ginv;
        a.samax = src->samax, a.sscale = src->sscale, a.sinv = src->sinv;
        if (a.out_nq == 0 || a.gamax == NULL)
            a.out_nq = 0;
        AMX_CHECK(upload(&d->cidx, lay->cidx, lay->nq * sizeof(uint32_t), lay->key, s, err));
        AMX_CHECK(upload(&d->ssrc, lay->ssrc, lay->ns * sizeof(uint64_t), lay->key, s, err));
        AMX_CHECK(upload(&d->send, lay->send, lay->ns * sizeof(uint64_t), lay->key, s, err));
        a.cidx = (const uint32_t *)d->cidx.d;
        a.ssrc = (const uint64_t *)d->ssrc.d;
        a.send = (const uint64_t *)d->send.d;
        a.pga = src->pga;
        a.pgs = src->pgs;
        a.pok = src->pok;
        a.prev_n = src->pga != NULL ? src->prev_n : 0;
        a.missing = lay->missing;
        a.miss = d->d_miss;
        uint64_t m = lay->nq > lay->ns ? lay->nq : lay->ns;
        k_dev_tail<<<grid_for(m), THREADS, 0, s>>>((uint8_t *)d->answer, a);
        CU(cudaGetLastError(), "device answer launch (globals)");
        d->miss_dirty = 0;
    }
    if (prof)
        t3 = amx_now_us();
    /* The done flag or event behind the answer: written by s itself when
     * the buffers are on the state's GPU (`answered` after it, so that
     * dev_close waits for the write), else by ds after `answered`. */
    int same = d->dev == d->state_dev;
    cudaStream_t ss = same ? s : d->ds;
    if (!same) {
        CU(cudaEventRecord(d->answered, s), "cudaEventRecord");
        d->answered_used = 1;
        CU(cudaSetDevice(d->dev), "cudaSetDevice");
        CU(cudaStreamWaitEvent(d->ds, d->answered, 0), "cudaStreamWaitEvent");
    }
    if (done != NULL && memops_found())
        CUD(p_write32((CUstream)ss, (CUdeviceptr)((char *)d->answer + done->flag_off), done->seq,
                      0),
            "cuStreamWriteValue32 (done flag)");
    else
        CU(cudaEventRecord(d->done, ss), "cudaEventRecord (done event)");
    if (same) {
        CU(cudaEventRecord(d->answered, s), "cudaEventRecord");
        d->answered_used = 1;
    } else {
        CU(cudaSetDevice(d->state_dev), "cudaSetDevice");
    }
    /* Not waited for: the trainer's stream waits for the done flag or
     * event, the state's engine for its `answered` (state_cuda.cu), and
     * the staging for d->answered above. */
    d->answer_failed = 0;
    if (prof)
        AMX_INFO("profile",
                 "device answer of rank %u: %llu us: sync with the last %llu, uploads %llu, "
                 "launches %llu, signal %llu",
                 done != NULL ? done->rank : 0, (unsigned long long)(amx_now_us() - t0),
                 (unsigned long long)(t1 - t0), (unsigned long long)(t2 - t1),
                 (unsigned long long)(t3 - t2), (unsigned long long)(amx_now_us() - t3));
    return AMX_OK;
}
