/*
 * engine.h - the epoch engine of one job: a thread that runs the blocking
 * part of each epoch (agreement, state transfer, rendezvous, the packed
 * collective, finish) while the loop thread goes on serving
 * (docs/CLUSTER.md, "An epoch").
 *
 * The loop thread creates the engine, hands it an epoch with
 * amx_engine_start (the job is then in flight) and is told of the outcome
 * through env.post, called on the engine thread; the loop then reads
 * amx_engine_result and installs what changed (registry.c). The engine
 * owns the job's communicator; it keeps it across epochs and drops it after
 * any failure.
 */
#ifndef AMX_ENGINE_H
#define AMX_ENGINE_H

#include <stdint.h>

#include "catalog.h"
#include "config.h"
#include "job.h"
#include "peer.h"
#include "status.h"

typedef struct amx_engine amx_engine_t;

/* What the engine needs from its surroundings; borrowed, must outlive it. */
typedef struct amx_engine_env {
    const amx_config_t *cfg;
    amx_peer_t *peer;       /* blocking peer calls (several daemons) */
    const char *collective; /* "gloo" or "nccl" for jobs of several daemons */
    const char *gloo_host;
    int cuda_device;
    /* Engine thread: the epoch of `job` has ended; wake the loop. */
    void (*post)(void *ud, amx_job_t *job);
    /* Engine thread: post comes within `us` microseconds (finish begins);
     * may be NULL. */
    void (*expect)(void *ud, uint64_t us);
    void *ud;
} amx_engine_env_t;

/* The outcome of an epoch, read under the loop lock after env.post. */
typedef struct amx_epoch_result {
    amx_status_t st;
    char msg[1536];
    int reconciled; /* the epoch completed: publish and answer the waiting ranks */
    uint64_t epoch; /* the epoch reconciled (or attempted) */
    /* A new agreed catalog and its layout (NULL: unchanged). The loop takes
     * ownership; pend/npend move the active pending buffer to it. */
    amx_catalog_t *cat;
    amx_qdesc_t *desc;
    amx_layout_change_t pend_change;
    amx_run_t *pend_runs;
    char **rejected; /* proposals dropped for a conflict (owned) */
    size_t nrejected;
    /* The state was imported from a donor: the job's counters become these. */
    int imported;
    /* With imported: this daemon was behind after epochs of its own (a
     * restored snapshot, an epoch its peers completed), so its ranks'
     * contributions were for an epoch the cluster had reconciled: the
     * attempt failed, the loop drops them (unflip without keep) and answers
     * those ranks FAILED_PRECONDITION. */
    int stale;
    char stale_why[768]; /* with stale: the sentence those ranks hear */
    uint64_t last_reconciled;
    /* With imported: the donor's published global amax and scale (its
     * epoch last_reconciled), per quantizer of prev_cat (owned), which the
     * loop keeps as the previous epoch's once this one is published. */
    amx_catalog_t *prev_cat;
    float *prev_ga, *prev_gs;
    /* ... and the donor's previous globals (of epoch last_reconciled - 1,
     * NaN: none; NULL from a donor of an older format), per quantizer of
     * prev_cat: what its answers of last_reconciled carried as previous,
     * and what GetScales here answers while no epoch after it completed. */
    float *pprev_ga, *pprev_gs;
    /* The coordinator's membership, when it is not the one the job holds
     * (a daemon restarted): the loop installs it. */
    amx_membership_t members;
    int members_changed;
    int publish;      /* the back outputs hold results to publish even on failure */
    int expected_end; /* env.expect was called for this epoch's end */
    int resets_applied;
    uint32_t collectives;
    uint64_t total_us, collective_us, finish_us, prepare_us, header_us;
    uint64_t wait_us;                /* waiting for the trainers' device slabs to be merged */
    uint64_t begin_at_us, end_at_us; /* CLOCK_MONOTONIC: the engine thread took it, gave it back */
    /* Durability (snapshot.h): the epoch was written to the job's snapshot
     * (snapshot_ok), or writing it failed (snapshot_err); neither when
     * snapshots are off or this epoch was not due. */
    int snapshot_ok;
    char snapshot_err[512];
    uint64_t snapshot_us, snapshot_bytes;
} amx_epoch_result_t;

/* Loop lock: the engine of `job` and its thread (idle until started). */
amx_status_t amx_engine_create(amx_job_t *job, const amx_engine_env_t *env, amx_engine_t **out,
                               amx_err_t *err);

/* Loop lock: runs one epoch of the job (job->in_flight must be set and
 * the pending buffers flipped) with a deadline (CLOCK_MONOTONIC ms).
 * armed_ms != 0 (an armed epoch, deadline_ms UINT64_MAX): the device
 * slabs are waited for without a deadline, and the epoch's deadline is
 * armed_ms after they were merged. */
void amx_engine_start(amx_engine_t *e, uint64_t epoch, uint64_t deadline_ms, uint64_t armed_ms);

/* Loop lock: amx_engine_start is about to be called (the loop flips the
 * epoch first): the idle engine thread wakes now and spins for it instead
 * of waking at the start (a wake-up is tens of microseconds). */
void amx_engine_expect(amx_engine_t *e);

/* Loop lock: the outcome, valid from env.post until the next start.
 * The loop may take the pointers it owns (cat, desc, pend_runs, rejected)
 * and set them to NULL. */
amx_epoch_result_t *amx_engine_result(amx_engine_t *e);

/* Any thread: abort the epoch in flight (when it uses communicator `gen`,
 * or, when gen is 0, when it is `epoch` as started, or any when epoch is 0
 * too; with an `agreement` of coordinator `coord_inc`, not when an attempt
 * of that agreement has already ended here or this attempt agreed a later
 * one: a late Abort) and drop the communicator; the next epoch agrees again. `from` is the cluster
 * rank of the daemon that asked (AMX_ENGINE_LOCAL: this one). The epoch fails with ABORTED and
 * `why`, or, when another daemon passes on its failure, with that `code` and its sentence `why`
 * ("failed on daemon N: ..."). */
#define AMX_ENGINE_LOCAL UINT32_MAX /* an abort of this daemon's own */
void amx_engine_abort(amx_engine_t *e, uint64_t gen, uint64_t epoch, uint64_t agreement,
                      uint64_t coord_inc, uint32_t from, amx_status_t code, const char *why);

/* Loop lock, nothing in flight: stops the thread, frees everything. */
void amx_engine_destroy(amx_engine_t *e);

/* The communicator generation in use (0: none). Any thread. */
uint64_t amx_engine_comm_gen(const amx_engine_t *e);

/* A donor's published state for sync `seq` (see registry.h,
 * amx_registry_fetch_state). Any thread. */
amx_status_t amx_engine_fetch(amx_engine_t *e, uint64_t seq, uint64_t offset, uint32_t max,
                              void **data, size_t *len, uint64_t *total, amx_err_t *err);

#endif
