/*
 * comm.h - the collective backend: how the daemons of one job reduce their
 * flat buffers.
 *
 * A communicator connects the participants of one job (the daemons that host
 * at least one of its trainer ranks), numbered 0..size-1 in the order of
 * their cluster ranks. It is created once per "communicator generation"
 * (docs/CLUSTER.md) after a rendezvous through the coordinator's key-value
 * store, and kept across epochs until a failure.
 *
 * Backends:
 *   local  one participant: nothing to exchange (comm_local.c)
 *   gloo   CPU buffers, TCP transport, through a C++ shim (comm_gloo.cc)
 *   nccl   device buffers; every NCCL call runs on one thread (comm_nccl.c)
 *
 * Threads: create, allreduce_max, allreduce_sum_f64 and destroy are called on the job's engine
 * thread (engine.c) and block it, never the loop thread. abort may be called
 * from any thread; it makes an operation in flight (or the next one) fail
 * promptly where the backend can (NCCL: ncclCommAbort; Gloo: closes the
 * connections). After any failed operation or an abort the communicator is
 * unusable and must be destroyed.
 */
#ifndef AMX_COMM_H
#define AMX_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The rendezvous store: a key-value store served by the coordinator
 * (peer.c), or an in-process one in tests. Both calls block the calling
 * thread. Keys are printable ASCII; values are bytes.
 */
typedef struct amx_kv {
    void *ud;
    /* Stores `len` bytes under `key` (replacing any old value). */
    amx_status_t (*set)(void *ud, const char *key, const void *val, size_t len, amx_err_t *err);
    /* Waits until `key` exists or the CLOCK_MONOTONIC time `deadline_ms`
     * passes (ETIMEDOUT); ends early with EABORTED (the caller's abort) or,
     * where the store has a watch (peer.h amx_peer_kv), EUNAVAIL naming a
     * participant that is gone. On AMX_OK *val is malloc'd (the caller
     * frees it). */
    amx_status_t (*get)(void *ud, const char *key, uint64_t deadline_ms, void **val, size_t *len,
                        amx_err_t *err);
} amx_kv_t;

typedef struct amx_comm amx_comm_t;

typedef struct amx_comm_ops {
    const char *name;
    /*
     * Element-wise MAX of `n` floats over all participants: recv[i] = max
     * over participants of send[i]. send and recv do not overlap (a failed
     * operation leaves send untouched). Device memory for nccl, host memory
     * otherwise; `stream` is the caller's cudaStream_t for nccl (ignored
     * otherwise). Every participant must call it with the same n, in the
     * same order. Returns ETIMEDOUT when `deadline_ms` passes, EUNAVAIL
     * when a peer is gone, EABORTED after abort().
     */
    amx_status_t (*allreduce_max)(amx_comm_t *c, const float *send, float *recv, size_t n,
                                  void *stream, uint64_t deadline_ms, amx_err_t *err);
    /* Any thread; idempotent. */
    void (*abort)(amx_comm_t *c);
    void (*destroy)(amx_comm_t *c);
    /* Optional: an all-reduce follows shortly (the caller is about to
     * prepare one); a backend with a thread of its own may wake it now so
     * that its wake-up does not add to the collective. */
    void (*soon)(amx_comm_t *c);
    /*
     * Element-wise SUM of `n` float64 values (statistics of calibrators
     * beyond max), otherwise as allreduce_max. Each element is reduced
     * once and the result distributed, so every participant gets the same
     * bytes; the order of the additions depends on the number of
     * participants (exact for integers below 2^53, as bin counts are).
     */
    amx_status_t (*allreduce_sum_f64)(amx_comm_t *c, const double *send, double *recv, size_t n,
                                      void *stream, uint64_t deadline_ms, amx_err_t *err);
    /* Optional (device backends): the next allreduce_max also copies
     * `bytes` of device memory `src` (part of its recv) into pinned host
     * memory `dst`, queued behind the collective on its stream; the copy is
     * done when allreduce_max returns AMX_OK (the caller then needs no
     * copy and sync of its own). */
    void (*tail)(amx_comm_t *c, void *dst, const void *src, size_t bytes);
} amx_comm_ops_t;

struct amx_comm {
    const amx_comm_ops_t *ops;
    int rank; /* this participant, 0..size-1 */
    int size;
    int on_device; /* buffers must be device memory */
};

/* What creating a communicator needs. Strings are borrowed for the call. */
typedef struct amx_comm_params {
    int rank, size;
    const amx_kv_t *kv;   /* rendezvous store (gloo, nccl) */
    const char *prefix;   /* key prefix unique to this job and generation */
    const char *host;     /* gloo: the address to bind and advertise */
    int cuda_device;      /* nccl: the device of the job's state */
    uint64_t deadline_ms; /* CLOCK_MONOTONIC ms by which the rendezvous must end */
    /* Optional: polled while create waits for the peers (NCCL: its init);
     * non-zero ends create with EABORTED (the epoch was aborted, e.g. by a
     * peer that will never join). Called from another thread. */
    int (*aborted)(void *ud);
    void *abort_ud;
    /* Optional (nccl, which does not notice a dead peer: its collectives
     * wait for the deadline; the engine gives the same function to the
     * rendezvous store, whose gets both backends make): called on the
     * calling thread about every AMX_COMM_WATCH_MS while the create, or any
     * later all-reduce, has waited that long; it may block for a ping round and a TCP connect
     * (AMX_COMM_WATCH_MS / 2 each at most; no name lookup). Non-zero: a
     * participant is gone (`why`, a sentence naming it); the operation is
     * aborted and fails with EUNAVAIL and that sentence. Kept for the
     * communicator's life: `watch_ud` must outlive it. */
    int (*watch)(void *ud, char *why, size_t len);
    void *watch_ud;
} amx_comm_params_t;

#define AMX_COMM_WATCH_MS 400

/* Creates a communicator of backend `name` ("local", "gloo", "nccl").
 * EUNAVAIL when the backend is not compiled in. Blocks until every
 * participant has joined the rendezvous or the deadline passes. */
amx_status_t amx_comm_create(const char *name, const amx_comm_params_t *p, amx_comm_t **out,
                             amx_err_t *err);

/* Sets the process-wide defaults of the backends; main calls it once,
 * before any other thread starts (it may setenv). Returns a sentence for
 * the log, or NULL. NCCL: NCCL_RUNTIME_CONNECT=0 unless the environment
 * sets it, so that the all-reduces can run on a blocking communicator
 * (comm_nccl.c); AMAXD_NCCL_BLOCKING=0 keeps them on the non-blocking one. */
const char *amx_comm_process_init(void);

/* Whether backend `name` is compiled in. */
int amx_comm_available(const char *name);

/* Backend constructors (comm_local.c, comm_gloo.cc, comm_nccl.c). */
amx_status_t amx__comm_local_create(const amx_comm_params_t *p, amx_comm_t **out, amx_err_t *err);
amx_status_t amx__comm_gloo_create(const amx_comm_params_t *p, amx_comm_t **out, amx_err_t *err);
amx_status_t amx__comm_nccl_create(const amx_comm_params_t *p, amx_comm_t **out, amx_err_t *err);

#ifdef __cplusplus
}
#endif

#endif
