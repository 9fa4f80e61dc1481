/*
 * comm_nccl.c - the NCCL collective backend (comm.h).
 *
 * NCCL is never called from two threads: one NCCL thread per daemon issues
 * every NCCL call (unique id, communicator init, all-reduce, abort,
 * destroy) on behalf of the jobs' engine threads, which wait for their
 * request to complete. The thread polls every operation in flight
 * (ncclCommGetAsyncError, cudaEventQuery), so one job's collective that
 * waits on a dead peer does not hold up another job's, and an operation is
 * aborted (ncclCommAbort) when its deadline passes or abort() is called.
 *
 * Two communicators per job. The first is non-blocking
 * (ncclConfig_t.blocking = 0): its init, which waits for every peer, runs
 * on a thread of NCCL's and is polled with the deadline. Once it is up, it
 * is split (same ranks, splitShare = 1, so the child uses the parent's
 * connections) into a *blocking* child, again polled, because a split of
 * a non-blocking parent runs asynchronously. The all-reduces go to the
 * child: a blocking communicator enqueues on the calling thread, where a
 * non-blocking one starts a thread of NCCL's per call (200-340 us per
 * epoch on H200). A blocking enqueue never waits for a peer once the
 * connections exist, so the daemon sets NCCL_RUNTIME_CONNECT=0 (unless the
 * operator set it): every connection is made during the (polled) init.
 * The kernel of a collective whose peer is gone still spins on the GPU
 * and is ended by ncclCommAbort, as before. With NCCL_RUNTIME_CONNECT=1
 * set by the operator, or AMAXD_NCCL_BLOCKING=0, the all-reduces stay on
 * the non-blocking communicator.
 *
 * The rendezvous (the unique id through the coordinator's key-value store)
 * happens on the engine thread before the init request.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "clock.h"
#include "comm.h"
#include "log.h"

enum { R_GETID, R_INIT, R_ALLREDUCE, R_DESTROY };

typedef struct nccl_comm {
    amx_comm_t base;
    ncclComm_t comm;  /* the non-blocking communicator (init, split) */
    ncclComm_t fast;  /* its blocking child, for the all-reduces (NULL: use comm) */
    ncclComm_t split; /* written by NCCL when the split ends */
    int device;
    atomic_int abort_req;     /* abort() was called */
    int (*aborted)(void *ud); /* during create: the caller's abort (params) */
    void *abort_ud;
    int dead; /* aborted or failed: every later request fails */
    char why[256];
    /* params.watch: asked while an init or all-reduce waits (submit) */
    int (*watch)(void *ud, char *why, size_t len);
    void *watch_ud;
    char gone[512]; /* what the watch said (engine thread) */
    /* nccl_tail: the next all-reduce's copy out (engine thread) */
    void *tail_dst;
    const void *tail_src;
    size_t tail_bytes;
} nccl_comm_t;

typedef struct nreq {
    int kind;
    nccl_comm_t *c;
    /* R_INIT */
    ncclUniqueId id;
    int nranks, rank;
    /* R_ALLREDUCE: MAX of float32, or (sum_f64) SUM of float64 */
    const void *send;
    void *recv;
    size_t n;
    int sum_f64;
    cudaStream_t stream;
    void *tail_dst; /* nccl_tail's copy, queued before ev */
    const void *tail_src;
    size_t tail_bytes;
    cudaEvent_t ev;
    int launched;
    int phase; /* R_INIT: 0 init, 1 split */
    uint64_t deadline;
    uint64_t t_submit, t_issue, t_enqueued, t_done; /* AMAXD_PROFILE */
    /* completion */
    int done;
    amx_status_t st;
    char msg[600];
    struct nreq *next;
} nreq_t;

/* For this long after an all-reduce is announced (nccl_soon) or issued,
 * the NCCL thread and the waiting engine poll every 2 us instead of waiting
 * on a condition variable, whose wake-up (tens of microseconds, more from
 * an idle CPU) would add to every epoch. A collective that waits for a late
 * peer is polled every 5 us after that. */
#define SPIN_US 3000

static struct {
    pthread_once_t once;
    pthread_mutex_t mu;
    pthread_cond_t cv, done_cv;
    pthread_t th;
    int started;
    nreq_t *queue;       /* submitted, not yet issued */
    nreq_t *flight;      /* issued, polled */
    uint64_t spin_until; /* µs: poll closely until then (atomic) */
} G = {.once = PTHREAD_ONCE_INIT,
       .mu = PTHREAD_MUTEX_INITIALIZER,
       .cv = PTHREAD_COND_INITIALIZER,
       .done_cv = PTHREAD_COND_INITIALIZER};

static void finish(nreq_t *r, amx_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void finish(nreq_t *r, amx_status_t st, const char *fmt, ...)
{
    r->t_done = amx_now_us();
    if (st != AMX_OK && fmt != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->msg, sizeof(r->msg), fmt, ap);
        va_end(ap);
    }
    r->st = st;
    pthread_mutex_lock(&G.mu);
    __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&G.done_cv);
    pthread_mutex_unlock(&G.mu);
}

/* Aborts the child (if any) and then the parent, which share their
 * connections and abort flag. A split still running is ended by the
 * parent's abort (NCCL joins it); its child, written when it ends, is then
 * aborted too. */
static void abort_both(nccl_comm_t *c)
{
    if (c->fast != NULL)
        ncclCommAbort(c->fast);
    c->fast = NULL;
    if (c->comm != NULL)
        ncclCommAbort(c->comm);
    c->comm = NULL;
    ncclComm_t late = __atomic_exchange_n(&c->split, NULL, __ATOMIC_ACQ_REL);
    if (late != NULL)
        ncclCommAbort(late);
}

/* Whether the all-reduces go to a blocking child (see the top). */
static int use_blocking(void)
{
    static int v = -1;
    if (v < 0) {
        const char *b = getenv("AMAXD_NCCL_BLOCKING");
        const char *rc = getenv("NCCL_RUNTIME_CONNECT");
        /* main sets NCCL_RUNTIME_CONNECT=0 (amx_comm_process_init); a
         * program that did not keeps the non-blocking communicator. */
        v = !(b != NULL && strcmp(b, "0") == 0) && rc != NULL && strcmp(rc, "0") == 0;
    }
    return v;
}

static void kill_comm(nccl_comm_t *c, const char *why)
{
    if (c->comm != NULL && !c->dead) {
        AMX_WARN("nccl", "aborting a communicator (rank %d of %d): %s", c->base.rank, c->base.size,
                 why);
        uint64_t t0 = amx_now_us();
        abort_both(c);
        AMX_INFO("nccl", "communicator (rank %d of %d) aborted in %llu us", c->base.rank,
                 c->base.size, (unsigned long long)(amx_now_us() - t0));
    }
    if (!c->dead)
        snprintf(c->why, sizeof(c->why), "%s", why);
    c->dead = 1;
}

/* Issues a new request; 1 when it is done already, 0 when it is in flight. */
static int issue(nreq_t *r)
{
    nccl_comm_t *c = r->c;
    if (r->kind == R_GETID) {
        ncclResult_t e = ncclGetUniqueId(&r->id);
        if (e != ncclSuccess)
            finish(r, AMX_EUNAVAIL, "ncclGetUniqueId: %s", ncclGetErrorString(e));
        else
            finish(r, AMX_OK, NULL);
        return 1;
    }
    if (c->dead && r->kind != R_DESTROY) {
        finish(r, AMX_EABORTED, "the communicator was aborted before: %s", c->why);
        return 1;
    }
    cudaSetDevice(c->device);
    if (r->kind == R_INIT) {
        ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
        cfg.blocking = 0;
        ncclResult_t e = ncclCommInitRankConfig(&c->comm, r->nranks, r->id, r->rank, &cfg);
        if (e != ncclSuccess && e != ncclInProgress) {
            c->comm = NULL;
            c->dead = 1;
            finish(r, AMX_EUNAVAIL, "ncclCommInitRankConfig: %s", ncclGetErrorString(e));
            return 1;
        }
        return 0;
    }
    if (r->kind == R_ALLREDUCE) {
        r->t_issue = amx_now_us();
        ncclResult_t e =
            ncclAllReduce(r->send, r->recv, r->n, r->sum_f64 ? ncclFloat64 : ncclFloat32,
                          r->sum_f64 ? ncclSum : ncclMax, c->fast ? c->fast : c->comm, r->stream);
        if (e == ncclSuccess)
            r->t_enqueued = amx_now_us();
        if (e != ncclSuccess && e != ncclInProgress) {
            kill_comm(c, ncclGetErrorString(e));
            finish(r, AMX_EUNAVAIL, "ncclAllReduce: %s", ncclGetErrorString(e));
            return 1;
        }
        r->launched = e == ncclSuccess;
        if (cudaEventCreateWithFlags(&r->ev, cudaEventDisableTiming) != cudaSuccess) {
            kill_comm(c, "cudaEventCreate failed");
            finish(r, AMX_EDEVICE, "cudaEventCreate failed");
            return 1;
        }
        return 0;
    }
    /* R_DESTROY */
    /* ncclCommFinalize may wait for peers that are gone; a communicator
     * being destroyed has no work left, so abort frees it as well and
     * never waits. */
    uint64_t t0 = amx_now_us();
    int had = c->comm != NULL;
    abort_both(c);
    if (had)
        AMX_DEBUG("nccl", "communicator (rank %d of %d) freed in %llu us", c->base.rank,
                  c->base.size, (unsigned long long)(amx_now_us() - t0));
    finish(r, AMX_OK, NULL);
    return 1;
}

/* Polls one request in flight; 1 when it is done. */
static int poll_one(nreq_t *r)
{
    nccl_comm_t *c = r->c;
    cudaSetDevice(c->device);
    uint64_t now = amx_now_ms();
    if (atomic_load(&c->abort_req) ||
        (r->kind == R_INIT && c->aborted != NULL && c->aborted(c->abort_ud))) {
        kill_comm(c, "aborted by the daemon");
        finish(r, AMX_EABORTED, "aborted");
        return 1;
    }
    ncclResult_t async = ncclSuccess;
    if (c->comm != NULL)
        ncclCommGetAsyncError(c->comm, &async);
    if (async == ncclSuccess && c->fast != NULL)
        ncclCommGetAsyncError(c->fast, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
        const char *m = ncclGetErrorString(async);
        const char *last = c->comm ? ncclGetLastError(c->comm) : "";
        kill_comm(c, m);
        finish(r, AMX_EUNAVAIL, "NCCL: %s (%s)", m, last ? last : "");
        return 1;
    }
    if (r->kind == R_INIT) {
        if (async == ncclSuccess && r->phase == 0 && use_blocking()) {
            /* The parent is up: split it into the blocking child. The
             * split runs on a thread of NCCL's (the parent is
             * non-blocking); the parent reads ncclInProgress until it
             * ends, and NCCL writes c->split before that. */
            ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
            cfg.blocking = 1;
            cfg.splitShare = 1;
            r->phase = 1;
            ncclResult_t e = ncclCommSplit(c->comm, 0, c->base.rank, &c->split, &cfg);
            if (e != ncclSuccess && e != ncclInProgress) {
                kill_comm(c, ncclGetErrorString(e));
                finish(r, AMX_EUNAVAIL, "ncclCommSplit: %s", ncclGetErrorString(e));
                return 1;
            }
            return 0;
        }
        if (async == ncclSuccess) {
            if (r->phase == 1) {
                c->fast = __atomic_exchange_n(&c->split, NULL, __ATOMIC_ACQ_REL);
                if (c->fast == NULL) {
                    kill_comm(c, "the split gave no communicator");
                    finish(r, AMX_EUNAVAIL, "ncclCommSplit gave no communicator");
                    return 1;
                }
            }
            finish(r, AMX_OK, NULL);
            return 1;
        }
    } else if (r->kind == R_ALLREDUCE) {
        /* launched: 0 enqueueing, 1 enqueued (event not recorded), 2 recorded. */
        if (!r->launched && async == ncclSuccess) {
            r->launched = 1;
            r->t_enqueued = amx_now_us();
        }
        if (r->launched) {
            if (r->launched == 1) {
                if (r->tail_bytes > 0 &&
                    cudaMemcpyAsync(r->tail_dst, r->tail_src, r->tail_bytes, cudaMemcpyDeviceToHost,
                                    r->stream) != cudaSuccess) {
                    const char *m = cudaGetErrorString(cudaGetLastError());
                    kill_comm(c, m);
                    finish(r, AMX_EDEVICE, "CUDA: copying the all-reduce's header out: %s", m);
                    return 1;
                }
                cudaError_t er = cudaEventRecord(r->ev, r->stream);
                if (er != cudaSuccess) {
                    /* A query of an event never recorded says done: the
                     * collective and the header's copy would be taken for
                     * complete. */
                    const char *m = cudaGetErrorString(er);
                    cudaGetLastError();
                    kill_comm(c, m);
                    finish(r, AMX_EDEVICE, "CUDA: recording the all-reduce's end: %s", m);
                    return 1;
                }
                r->launched = 2;
            }
            cudaError_t q = cudaEventQuery(r->ev);
            if (q == cudaSuccess) {
                /* Kernels that NCCL stopped (a peer's failure) end too:
                 * done only if the communicators are still sound, the
                 * parent's too (the child shares its connections, so a
                 * peer's failure may show on either). */
                ncclResult_t after = ncclSuccess;
                ncclCommGetAsyncError(c->fast ? c->fast : c->comm, &after);
                if ((after == ncclSuccess || after == ncclInProgress) && c->fast != NULL &&
                    c->comm != NULL) {
                    ncclResult_t parent = ncclSuccess;
                    ncclCommGetAsyncError(c->comm, &parent);
                    if (parent != ncclSuccess && parent != ncclInProgress)
                        after = parent;
                }
                if (after != ncclSuccess && after != ncclInProgress) {
                    const char *m = ncclGetErrorString(after);
                    kill_comm(c, m);
                    finish(r, AMX_EUNAVAIL, "NCCL: %s after the all-reduce's kernels ended", m);
                    return 1;
                }
                finish(r, AMX_OK, NULL);
                return 1;
            }
            if (q != cudaErrorNotReady) {
                kill_comm(c, cudaGetErrorString(q));
                finish(r, AMX_EDEVICE, "CUDA: %s", cudaGetErrorString(q));
                return 1;
            }
        }
    }
    if (now >= r->deadline) {
        kill_comm(c, "deadline passed");
        finish(r, AMX_ETIMEDOUT, "%s did not complete in time",
               r->kind == R_INIT ? "communicator init" : "all-reduce");
        return 1;
    }
    return 0;
}

/* The pause between two polls of something about to happen: a short
 * sleep rather than sched_yield, which could keep a thread NCCL wakes on
 * this CPU waiting for the rest of our time slice. */
static void poll_pause(void)
{
    struct timespec ts = {0, 2000};
    nanosleep(&ts, NULL);
}

static void *nccl_main(void *arg)
{
    (void)arg;
    /* The thread sleeps a few microseconds between polls while something
     * is in flight: the default 50 us timer slack would add that much to
     * every collective. */
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
    pthread_mutex_lock(&G.mu);
    for (;;) {
        while (G.queue == NULL && G.flight == NULL) {
            if (amx_now_us() < __atomic_load_n(&G.spin_until, __ATOMIC_RELAXED)) {
                /* Work announced (nccl_soon): watch for it closely. */
                pthread_mutex_unlock(&G.mu);
                poll_pause();
                pthread_mutex_lock(&G.mu);
            } else {
                pthread_cond_wait(&G.cv, &G.mu);
            }
        }
        nreq_t *q = G.queue;
        G.queue = NULL;
        pthread_mutex_unlock(&G.mu);
        /* Issue new requests in submission order. */
        nreq_t *rev = NULL;
        while (q) {
            nreq_t *n = q->next;
            q->next = rev;
            rev = q;
            q = n;
        }
        while (rev) {
            nreq_t *n = rev->next;
            rev->next = NULL;
            if (rev->kind == R_ALLREDUCE)
                __atomic_store_n(&G.spin_until, amx_now_us() + SPIN_US, __ATOMIC_RELAXED);
            if (!issue(rev)) {
                pthread_mutex_lock(&G.mu);
                rev->next = G.flight;
                G.flight = rev;
                pthread_mutex_unlock(&G.mu);
            }
            rev = n;
        }
        /* Poll everything in flight. */
        pthread_mutex_lock(&G.mu);
        nreq_t **pp = &G.flight;
        while (*pp) {
            nreq_t *r = *pp;
            /* Read before polling: once a request is finished its owner may
             * return and reuse the memory (only this thread changes the
             * flight list). */
            nreq_t *next = r->next;
            pthread_mutex_unlock(&G.mu);
            int done = poll_one(r);
            pthread_mutex_lock(&G.mu);
            if (done)
                *pp = next;
            else
                pp = &r->next;
        }
        if (G.flight != NULL && G.queue == NULL) {
            /* Something in flight: poll again at once during the first
             * SPIN_US of an all-reduce (its usual length), less often after. */
            pthread_mutex_unlock(&G.mu);
            if (amx_now_us() < __atomic_load_n(&G.spin_until, __ATOMIC_RELAXED)) {
                poll_pause();
            } else {
                struct timespec ts = {0, 5000};
                nanosleep(&ts, NULL);
            }
            pthread_mutex_lock(&G.mu);
        }
    }
    return NULL;
}

static void start_thread(void)
{
    if (pthread_create(&G.th, NULL, nccl_main, NULL) == 0) {
        pthread_detach(G.th);
        G.started = 1;
    }
}

/* Submits a request and waits until it is done. */
static amx_status_t submit(nreq_t *r, amx_err_t *err)
{
    pthread_once(&G.once, start_thread);
    if (!G.started)
        return amx_err_set(err, AMX_EINTERNAL, "cannot start the NCCL thread");
    pthread_mutex_lock(&G.mu);
    r->next = G.queue;
    G.queue = r;
    pthread_cond_signal(&G.cv);
    if (r->kind == R_ALLREDUCE) {
        /* Watch for the end without sleeping for as long as an all-reduce
         * usually takes: a condition variable's wake-up costs tens of
         * microseconds per epoch. */
        pthread_mutex_unlock(&G.mu);
        static __thread int slack_set;
        if (!slack_set) {
            prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0); /* this (engine) thread's 2 us naps */
            slack_set = 1;
        }
        uint64_t until = amx_now_us() + SPIN_US;
        while (!__atomic_load_n(&r->done, __ATOMIC_ACQUIRE) && amx_now_us() < until)
            poll_pause();
        pthread_mutex_lock(&G.mu);
    }
    /* A watch (params.watch) is asked every AMX_COMM_WATCH_MS while the
     * request waits: a peer that died never ends NCCL's collective, which
     * would otherwise wait for the deadline. */
    nccl_comm_t *wc = (r->kind == R_INIT || r->kind == R_ALLREDUCE) ? r->c : NULL;
    uint64_t next_watch = amx_now_ms() + AMX_COMM_WATCH_MS;
    while (!r->done) {
        if (wc == NULL || wc->watch == NULL || wc->gone[0] != '\0') {
            pthread_cond_wait(&G.done_cv, &G.mu);
            continue;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100L * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&G.done_cv, &G.mu, &ts);
        if (r->done || amx_now_ms() < next_watch)
            continue;
        pthread_mutex_unlock(&G.mu);
        char why[512] = "";
        int gone = wc->watch(wc->watch_ud, why, sizeof(why));
        next_watch = amx_now_ms() + AMX_COMM_WATCH_MS;
        pthread_mutex_lock(&G.mu);
        if (gone && !r->done) {
            snprintf(wc->gone, sizeof(wc->gone), "%s", why[0] ? why : "a participant is gone");
            AMX_WARN("nccl", "%s: aborting the communicator (rank %d of %d)", wc->gone,
                     wc->base.rank, wc->base.size);
            atomic_store(&wc->abort_req, 1);
            pthread_cond_signal(&G.cv);
        }
    }
    pthread_mutex_unlock(&G.mu);
    if (r->ev != NULL)
        cudaEventDestroy(r->ev);
    if (wc != NULL && wc->gone[0] != '\0' && r->st != AMX_OK)
        return amx_err_set(err, AMX_EUNAVAIL, "%s", wc->gone);
    if (r->st != AMX_OK)
        return amx_err_set(err, r->st, "%s", r->msg);
    return AMX_OK;
}

/* ---- amx_comm_t ---- */

static amx_status_t nccl_allreduce(amx_comm_t *base, const void *send, void *recv, size_t n,
                                   int sum_f64, void *stream, uint64_t deadline_ms, amx_err_t *err)
{
    nccl_comm_t *c = (nccl_comm_t *)base;
    nreq_t r;
    memset(&r, 0, sizeof(r));
    r.kind = R_ALLREDUCE;
    r.c = c;
    r.send = send;
    r.recv = recv;
    r.n = n;
    r.sum_f64 = sum_f64;
    r.stream = (cudaStream_t)stream;
    r.deadline = deadline_ms;
    if (!sum_f64) { /* nccl_tail's copy goes with the next MAX */
        r.tail_dst = c->tail_dst;
        r.tail_src = c->tail_src;
        r.tail_bytes = c->tail_bytes;
        c->tail_bytes = 0;
    }
    r.t_submit = amx_now_us();
    amx_status_t st = submit(&r, err);
    if (amx_log_profiling())
        AMX_INFO("profile",
                 "nccl all-reduce of %zu %s: to the NCCL thread %llu us, enqueue %llu us, "
                 "run %llu us, back to the engine %llu us",
                 n, sum_f64 ? "float64 sums" : "floats",
                 (unsigned long long)(r.t_issue - r.t_submit),
                 (unsigned long long)(r.t_enqueued - r.t_issue),
                 (unsigned long long)(r.t_done - r.t_enqueued),
                 (unsigned long long)(amx_now_us() - r.t_done));
    return st;
}

static amx_status_t nccl_allreduce_max(amx_comm_t *base, const float *send, float *recv, size_t n,
                                       void *stream, uint64_t deadline_ms, amx_err_t *err)
{
    return nccl_allreduce(base, send, recv, n, 0, stream, deadline_ms, err);
}

/* SUM of float64 statistics (calibrators beyond max), on the same thread
 * and with the same deadline and abort as the MAX. */
static amx_status_t nccl_allreduce_sum_f64(amx_comm_t *base, const double *send, double *recv,
                                           size_t n, void *stream, uint64_t deadline_ms,
                                           amx_err_t *err)
{
    return nccl_allreduce(base, send, recv, n, 1, stream, deadline_ms, err);
}

static void nccl_abort(amx_comm_t *base)
{
    nccl_comm_t *c = (nccl_comm_t *)base;
    atomic_store(&c->abort_req, 1);
    pthread_mutex_lock(&G.mu);
    pthread_cond_signal(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

static void nccl_destroy(amx_comm_t *base)
{
    nccl_comm_t *c = (nccl_comm_t *)base;
    nreq_t r;
    memset(&r, 0, sizeof(r));
    r.kind = R_DESTROY;
    r.c = c;
    amx_err_t err = {0};
    submit(&r, &err);
    free(c);
}

static void nccl_soon(amx_comm_t *base)
{
    (void)base;
    pthread_once(&G.once, start_thread);
    pthread_mutex_lock(&G.mu);
    __atomic_store_n(&G.spin_until, amx_now_us() + SPIN_US, __ATOMIC_RELAXED);
    pthread_cond_signal(&G.cv);
    pthread_mutex_unlock(&G.mu);
}

static void nccl_tail(amx_comm_t *base, void *dst, const void *src, size_t bytes)
{
    nccl_comm_t *c = (nccl_comm_t *)base;
    c->tail_dst = dst;
    c->tail_src = src;
    c->tail_bytes = bytes;
}

static const amx_comm_ops_t nccl_ops = {"nccl",    nccl_allreduce_max,     nccl_abort, nccl_destroy,
                                        nccl_soon, nccl_allreduce_sum_f64, nccl_tail};

amx_status_t amx__comm_nccl_create(const amx_comm_params_t *p, amx_comm_t **out, amx_err_t *err)
{
    nccl_comm_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    c->base.ops = &nccl_ops;
    c->base.rank = p->rank;
    c->base.size = p->size;
    c->base.on_device = 1;
    c->device = p->cuda_device;
    c->aborted = p->aborted;
    c->abort_ud = p->abort_ud;
    c->watch = p->watch;
    c->watch_ud = p->watch_ud;
    atomic_init(&c->abort_req, 0);
    nreq_t r;
    memset(&r, 0, sizeof(r));
    char key[300];
    snprintf(key, sizeof(key), "%snccl-unique-id", p->prefix);
    if (p->rank == 0) {
        r.kind = R_GETID;
        r.c = c;
        if (submit(&r, err) != AMX_OK ||
            p->kv->set(p->kv->ud, key, &r.id, sizeof(r.id), err) != AMX_OK) {
            free(c);
            return err->code;
        }
    } else {
        void *v = NULL;
        size_t len = 0;
        if (p->kv->get(p->kv->ud, key, p->deadline_ms, &v, &len, err) != AMX_OK) {
            free(c);
            return err->code;
        }
        if (len != sizeof(r.id)) {
            free(v);
            free(c);
            return amx_err_set(err, AMX_EINTERNAL, "the NCCL unique id has %zu bytes, not %zu", len,
                               sizeof(r.id));
        }
        memcpy(&r.id, v, sizeof(r.id));
        free(v);
    }
    nreq_t init;
    memset(&init, 0, sizeof(init));
    init.kind = R_INIT;
    init.c = c;
    init.id = r.id;
    init.nranks = p->size;
    init.rank = p->rank;
    init.deadline = p->deadline_ms;
    amx_status_t st = submit(&init, err);
    c->aborted = NULL; /* the caller's flag is not ours to read after create */
    if (st != AMX_OK) {
        nccl_destroy(&c->base);
        return err->code;
    }
    *out = &c->base;
    return AMX_OK;
}
