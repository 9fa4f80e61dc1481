/*
 * registry_impl.h - the registry's internals, shared by the files that make
 * it up (registry.h is its interface):
 *
 *   registry.c   the registry object, waiters, expiry, Status/List, the
 *                peer service's entry points
 *   job.c        jobs and local ranks, Join, Reset and drop
 *   contrib.c    contributions: Register, SendAmax, SendPacked
 *   slab.c       a rank's slab layout (the packed form)
 *   results.c    answers: named results, packed answers, GetScales
 *   reconcile.c  Reconcile and the end of an epoch
 *   restore.c    jobs written to and restored from snapshots
 *
 * Everything here runs on the loop thread (or under the loop lock), as
 * everything in registry.h does.
 */
#ifndef AMX_REGISTRY_IMPL_H
#define AMX_REGISTRY_IMPL_H

#include <pthread.h>
#include <stdint.h>
#include <uv.h>

#include "engine.h"
#include "grow.h"
#include "job.h"
#include "metrics.h"
#include "peer.h"
#include "registry.h"
#include "swapq.h"

/* WAIT_RECONCILE_NEXT: a Reconcile of the epoch after the one in flight,
 * deferred until that one has ended (reconcile.c); WAIT_JOIN_NEXT: a Join
 * of a rank that is in the epoch in flight, the same (job.c). */
enum {
    WAIT_JOIN = 1,
    WAIT_RECONCILE = 2,
    WAIT_REGISTER = 3,
    WAIT_RESET = 4,
    WAIT_RECONCILE_NEXT = 5,
    WAIT_JOIN_NEXT = 6
};

struct amx_registry {
    uv_loop_t *loop;
    const amx_config_t *cfg;
    char backend[16];
    char collective[16];
    amx_peer_t *peer;
    amx_job_t *jobs;
    amx_job_t *zombies; /* dropped while in flight: freed when the engine returns */
    void (*on_drop)(void *ud, const char *job);
    void *on_drop_ud;
    void (*on_expect)(void *ud, uint64_t us);
    void *on_expect_ud;
    uint32_t njobs;
    uint32_t nwaiting;
    int shutting_down;
    /* Scratch for SendAmax and results: staged values and runs. */
    float *stage;
    size_t stage_cap;
    amx_run_t *runs;
    size_t runs_cap;
    uint32_t *lids; /* SendAmax: each update's lid, found once */
    size_t lids_cap;
    /* Statistics of calibrators beyond max (SendAmax, SendPacked): staged
     * float64 values and their runs in the stat buffers. */
    double *sstage;
    size_t sstage_cap, nsstage;
    amx_run_t *sruns;
    size_t sruns_cap, nsruns;
    /* Growths of pending buffers that ended (job.h growing). */
    uv_async_t grow_async;
    int open_asyncs; /* the registry is freed when both asyncs are closed */
    /* Epoch outcomes posted by engine threads. */
    uv_async_t done_async;
    amx_swapq_t done; /* amx_job_t * */
    amx_engine_env_t env;
    uint64_t budget;        /* memory_budget resolved: bytes of state all jobs may take */
    char fault[512];        /* a state backend fault (sticky CUDA error): Health says NOT_SERVING */
    char budget_src[64];    /* where it came from, for messages */
    amx_metrics_t *metrics; /* NULL: not recorded */
};

static inline amx_lrank_t *amx__local_rank(amx_job_t *j, uint32_t r)
{
    int32_t s = amx__job_slot(j, r);
    return s < 0 ? NULL : &j->lr[s];
}

static inline int amx__snapshots_on(const amx_registry_t *reg)
{
    return reg->cfg->state_dir != NULL && reg->cfg->state_dir[0] != '\0';
}

/* A quantizer registered here and not dropped by a conflict. */
static inline int amx__lq_live(const amx_lq_t *q)
{
    return q->status == LQ_AGREED || q->status == LQ_PROPOSED;
}

/* ---- registry.c ---- */

/* The job named `name`, or NULL. */
amx_job_t *amx__find_job(amx_registry_t *reg, const char *name);
/* Completes a waiting call (exactly once): its callback gets the status and the answer, or the
 * error sentence. */
void amx__finish_waiter(amx_registry_t *reg, amx_waiter_t *w, amx_status_t st, const char *msg,
                        const amx_reply_t *reply);
/* Records a state backend fault (a sticky device error: Health says NOT_SERVING); returns st. */
amx_status_t amx__note_fault(amx_registry_t *reg, amx_status_t st, const char *msg);

/* ---- job.c ---- */

/* The job of a request, which must exist and be ready; with need_rank, `rank` must be hosted here.
 * Marks the job active. */
amx_status_t amx__ready_job(amx_registry_t *reg, const char *name, uint32_t rank, int need_rank,
                            amx_job_t **out, amx_err_t *err);
/* Fails every call waiting in the job (Join, Reconcile, deferred Register/Reset) with `st`. */
void amx__fail_all_waiters(amx_registry_t *reg, amx_job_t *j, amx_status_t st, const char *why);
/* Frees a job that is unlinked and has nothing in flight (joins a growth thread at shutdown). */
void amx__job_free(amx_job_t *j);
/* Takes a job out of the registry's list (not freed). */
void amx__job_unlink(amx_registry_t *reg, amx_job_t *j);
/* A new, empty job of world size `world`, linked into the registry. */
amx_status_t amx__job_create(amx_registry_t *reg, const char *name, uint32_t world, amx_job_t **out,
                             amx_err_t *err);
/* Trainer rank r hosted here: its record, made on first use; NULL when out of memory. */
amx_lrank_t *amx__add_local_rank(amx_job_t *j, uint32_t r);
/* Forgets local rank r (its placements and slab go with it). */
void amx__remove_local_rank(amx_job_t *j, uint32_t r);
/* Drops a job here: its snapshot, its waiters (ABORTED), the drop hook; freed now or, in flight,
 * when its engine returns. */
void amx__drop_job(amx_registry_t *reg, amx_job_t *j, const char *why);
/* Runs the Register and Reset calls that waited for the epoch in flight (or a growth) to end. */
void amx__run_deferred(amx_registry_t *reg, amx_job_t *j);

/* ---- contrib.c ---- */

/* Room in rank r's placement tables for nlq local ids and npls placements. */
amx_status_t amx__rank_reserve(amx_lrank_t *r, uint32_t nlq, uint32_t npls);
/* Room for n local quantizers in the job's table. */
amx_status_t amx__job_reserve_lq(amx_job_t *j, uint32_t n);
/* Cells of the job's local view: agreed plus provisional. */
uint64_t amx__view_cells(const amx_job_t *j);
/* The memory_budget all jobs' state may take, in bytes. */
uint64_t amx__reg_budget(const amx_registry_t *reg);
/* Applies a Register to a job with nothing in flight (*deferred: it waits for a growth it started).
 */
amx_status_t amx__do_register(amx_registry_t *reg, amx_job_t *j, const amx_register_req_t *req,
                              amx_reply_t *rep, int *deferred, amx_err_t *err);
/* Queues waiter `w` (a Register, a Reset, or a Join or Reconcile of a
 * rank in the epoch in flight: `kind`) with its request until the job's
 * epoch in flight has ended; it waits (w->job, w->kind, reg->nwaiting).
 * amx__run_deferred takes it up. */
amx_status_t amx__defer(amx_registry_t *reg, amx_job_t *j, int kind, amx_waiter_t *w,
                        const void *req, amx_err_t *err);
/* Refuses an update or Reconcile for an epoch other than the open one (`what` names the call). */
amx_status_t amx__check_epoch(const amx_job_t *j, uint64_t open, uint64_t want, uint32_t rank,
                              const char *what, amx_err_t *err);
/* Room in the registry's scratch for nvals staged values and nruns runs. */
amx_status_t amx__stage_reserve(amx_registry_t *reg, uint64_t nvals, size_t nruns);

/* ---- slab.c ---- */

/* Frees a rank's slab layout (NULL is fine). */
void amx__slab_free(amx_slab_t *sl);
/* Rank r's slab layout, rebuilt when the job's layout_gen moved on. */
amx_status_t amx__slab_get(amx_job_t *j, amx_lrank_t *r, amx_slab_t **out, amx_err_t *err);
/* Refuses a packed call whose layout id is not the rank's current one (`what` names the call). */
amx_status_t amx__check_layout_id(const amx_job_t *j, const amx_lrank_t *r, const amx_slab_t *sl,
                                  uint64_t id, const char *what, amx_err_t *err);

/* ---- results.c ---- */

/* Rank r's packed answer, built in its reply buffer (the waiter's alloc_packed). */
amx_status_t amx__build_packed(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r, amx_waiter_t *w,
                               amx_packed_t *p, amx_err_t *err);
/* Results of the named quantizers (all of this rank's, or all whole ones with rank -1) from cell
 * `start`, at most `max` cells, in arena `a`. */
amx_status_t amx__build_results(amx_registry_t *reg, amx_job_t *j, int64_t rank, char **names,
                                size_t n, uint64_t start, uint64_t max, amx_result_t **out,
                                size_t *nout, uint64_t *total_cells, amx_arena_t *a,
                                amx_err_t *err);
/* The per-quantizer globals (ga/gs/gi, per slab quantizer) and global
 * slices (sa/ss/si, per slab slice) of the front outputs in layout order:
 * (0, 1, 1) for a quantizer not agreed yet or before an output has them.
 * The packed answer and the device answer both take them from here. */
void amx__slab_globals(const amx_job_t *j, const amx_slab_t *sl, float *ga, float *gs, float *gi,
                       float *sa, float *ss, float *si);
/* Refuses a Reconcile whose answer would not fit in max_message_bytes. */
amx_status_t amx__reconcile_answer_fits(amx_registry_t *reg, amx_job_t *j, uint32_t rank,
                                        char **names, size_t n, amx_err_t *err);

/* ---- device.c ---- */

/* FAILED_PRECONDITION, with what to do instead, on a daemon whose state backend has no device
 * buffers (`what` names the call). */
amx_status_t amx__dev_need_backend(const amx_registry_t *reg, const char *what, amx_err_t *err);
/* Frees rank r's device buffers, if any (`why`: logged when not NULL). */
void amx__dev_close_rank(amx_job_t *j, amx_lrank_t *r, const char *why);
/* Checks a ReconcileDevice of rank r before it enters the epoch. */
amx_status_t amx__dev_check_reconcile(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r,
                                      const amx_reconcile_req_t *req, amx_err_t *err);
/* Whether rank r's device slab goes into the epoch it enters (NULL-safe). */
void amx__dev_arm(amx_lrank_t *r, int send, int has_data, uint32_t seq, int armed);
/* Whether rank r's call of the epoch was armed by the doorbell. */
int amx__dev_armed(const amx_lrank_t *r);
/* Loop, the job in flight: rank r's armed epoch waits for its trainer's
 * ready flag, which will not come (`why`: its client or process went):
 * the epoch is aborted here (and so on every daemon of the job). */
void amx__dev_abort_armed(amx_job_t *j, amx_lrank_t *r, const char *why);
/* Just after the flip of an epoch: queues the device slabs of the ranks that sent one. */
void amx__dev_merge_epoch(amx_registry_t *reg, amx_job_t *j);
/* EINVAL naming the cell and quantizer when rank r's device slab of `epoch` failed its check
 * (the slab was not merged); else AMX_OK. Before amx__dev_epoch_end. */
amx_status_t amx__dev_bad_slab(amx_job_t *j, amx_lrank_t *r, uint64_t epoch, amx_err_t *err);
/* Rank r's answer of a reconciled epoch into its device buffers; an error (a slab that failed its
 * check, a layout changed during the epoch) to answer instead. */
amx_status_t amx__dev_answer(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r, uint64_t epoch,
                             amx_err_t *err);
/* The end of an epoch for rank r's device buffers (reconciled or not). */
void amx__dev_epoch_end(amx_lrank_t *r);
/* Frees the device buffers of trainers that exited (their pid). Not while in flight. */
void amx__dev_reap(amx_job_t *j);

/* ---- reconcile.c ---- */

/* "ranks 3, 5" of the job that have not entered Reconcile. */
void amx__missing_ranks(const amx_job_t *j, char *buf, size_t len);
/* The loop's side of a growth that ended: starts the epoch or the Register that waited. */
void amx__on_grow_async(uv_async_t *h);
/* Installs the engine's new agreed catalog: local ids, statuses, bases, previous globals, the
 * active buffer's layout. */
void amx__install_catalog(amx_registry_t *reg, amx_job_t *j, amx_epoch_result_t *res);
/* An epoch's outcome from the engine: publishes or rolls back, answers the waiting ranks, runs what
 * was deferred. */
void amx__epoch_done(amx_registry_t *reg, amx_job_t *j);

#endif
