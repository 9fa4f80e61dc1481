/*
 * registry.h - the jobs this daemon serves: their local ranks, catalogs,
 * placements, contributions and epochs.
 *
 * The registry is owned by the loop thread and every function here must be
 * called on it. It knows nothing of gRPC or protobuf: requests and answers
 * are the C structs below (service.c maps them to amaxd.v1 messages). Calls
 * that may wait (Join, Reconcile, and Register/Reset while an epoch of the
 * job is in flight) complete through an amx_waiter_t whose callback the
 * registry calls exactly once, or return an error and never call it.
 *
 * Every request is validated completely before any state changes, so a
 * rejected request leaves the job exactly as it was.
 */
#ifndef AMX_REGISTRY_H
#define AMX_REGISTRY_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "arena.h"
#include "catalog.h"
#include "config.h"
#include "status.h"

typedef struct amx_registry amx_registry_t;
typedef struct amx_waiter amx_waiter_t;
typedef struct amx_peer amx_peer_t;

/* ---- requests ---- */

typedef struct amx_join_req {
    const char *job;
    uint32_t rank, world;
} amx_join_req_t;

typedef struct amx_register_req {
    const char *job;
    uint32_t rank;
    const amx_qspec_in_t *q;
    size_t n;
} amx_register_req_t;

typedef struct amx_update_in {
    const char *name;
    const uint8_t *values; /* float32 LE */
    size_t values_len;
    const uint8_t *has_data; /* one byte per cell, or NULL */
    size_t has_data_len;
} amx_update_in_t;

typedef struct amx_send_req {
    const char *job;
    uint32_t rank;
    uint64_t epoch;
    const amx_update_in_t *u;
    size_t n;
} amx_send_req_t;

typedef struct amx_reconcile_req {
    const char *job;
    uint32_t rank;
    uint64_t epoch;
    char **names;
    size_t n_names;
    /* The packed form: the answer is the rank's slab (the waiter's
     * alloc_packed), which must still have this layout id. */
    int packed;
    uint64_t layout_id;
} amx_reconcile_req_t;

/* SendPacked: one slab of values. `values` is writable and 4-byte aligned:
 * the registry normalizes it in place (no-data cells -> -inf, -0 -> +0). */
typedef struct amx_send_packed_req {
    const char *job;
    uint32_t rank;
    uint64_t epoch;
    uint64_t layout_id;
    float *values;
    size_t values_len;       /* bytes */
    const uint8_t *has_data; /* one byte per cell, or NULL */
    size_t has_data_len;
} amx_send_packed_req_t;

/* A rank's slab layout (GetLayout), arrays in the arena. */
typedef struct amx_layout {
    uint64_t id, total_cells;
    uint32_t n;
    const char **names;
    uint64_t *slab_offset, *ncells;
    uint32_t *ndim;
    uint32_t *block_offset, *block_shape, *global_shape; /* ndim[i] entries each, in order */
    size_t ndims;                                        /* entries of those three */
    int *format;
    uint32_t *global_axes;  /* n */
    uint64_t *slice_offset; /* n: first global slice of each in the answer */
    uint64_t total_slices;
} amx_layout_t;

/* The packed answer of a ReconcilePacked: the registry sets layout_id,
 * ncells and nq, asks the waiter's owner for the arrays (alloc_packed),
 * fills them, then calls done with reply->packed pointing here. */
typedef struct amx_packed {
    uint64_t layout_id, ncells;
    uint32_t nq;
    float *amax, *scale, *scale_inv; /* ncells each */
    uint8_t *block_scales;           /* ncells */
    float *g_amax, *g_scale, *g_inv; /* nq each */
    uint32_t *missing;               /* nq */
    uint8_t *has_previous;           /* nq */
    float *prev_amax, *prev_scale;   /* nq */
    uint8_t *filled;                 /* ncells; NULL: not wanted */
    uint64_t nslices;                /* global slices of the layout */
    /* The rank's reply buffer slot (an amx_replybuf_t *, bytebuf.h) that the
     * owner may reuse from one epoch to the next; the registry frees what
     * it holds with the rank. */
    struct amx_replybuf **cache;
    float *s_amax, *s_scale, *s_inv; /* nslices each (NULL when 0) */
    int peer_fill_known;             /* set by the registry */
    uint64_t nfilled;                /* cells marked in `filled` */
} amx_packed_t;

typedef struct amx_scales_req {
    const char *job;
    uint32_t rank;
    char **names;
    size_t n_names;
    int whole; /* whole global tensors instead of the rank's blocks */
    /* A window of the answer's cells (results in order, each block's cells
     * in row-major order): skip `start_cell`, return at most `max_cells`
     * (0: all). */
    uint64_t start_cell, max_cells;
} amx_scales_req_t;

typedef struct amx_reset_req {
    const char *job;
    char **names;
    size_t n_names;
    int drop_job;
} amx_reset_req_t;

/* ---- answers ---- */

/* One quantizer's results restricted to a block (arrays in the arena), or
 * to cells [first_cell, first_cell + ncells) of it (row-major) when a
 * window cut it. */
typedef struct amx_result {
    const char *name;
    uint32_t ndim;
    uint32_t off[AMX_MAX_DIMS], shape[AMX_MAX_DIMS];
    uint64_t first_cell, ncells;
    float *amax, *scale, *scale_inv;
    uint8_t *bytes;
    float global_amax, global_scale, global_scale_inv;
    /* Quantizers with global_axes > 0: the global slices the result's cells
     * lie in, in order (arena). */
    uint32_t global_axes;
    uint64_t nslices;
    float *s_amax, *s_scale, *s_inv;
    uint32_t missing;
    /* One byte per cell, 1 = took its peer group's max in the last epoch;
     * NULL when the state backend does not report it. */
    uint8_t *filled;
    uint32_t nfilled;
    /* The epoch before the last one's global amax and scale. */
    int has_previous;
    float previous_global_amax, previous_global_scale;
} amx_result_t;

typedef struct amx_reply {
    /* Join */
    uint32_t world;
    uint64_t epoch;
    int rejoined;
    /* Reconcile (epoch = the reconciled one), GetScales (epoch = last). */
    uint64_t next_epoch;
    amx_result_t *results;
    size_t nresults;
    uint64_t total_cells; /* GetScales: cells of the whole answer, all windows */
    /* Register */
    uint32_t created, existing, catalog_size;
    /* Reset */
    uint32_t reset;
    /* ReconcilePacked */
    const amx_packed_t *packed;
} amx_reply_t;

/*
 * A waiting call. The owner (the RPC layer, or a test) embeds it and sets
 * `done`; the registry fills the rest. `done` runs once on the loop thread:
 * with st == AMX_OK and the reply (valid only during the callback), or an
 * error and a message. The waiter may be freed inside `done`.
 */
struct amx_waiter {
    void (*done)(amx_waiter_t *w, amx_status_t st, const char *msg, const amx_reply_t *reply);
    /* Registry-private. */
    void *job;
    uint32_t rank;
    int kind;
    uint64_t deadline_ms;
    char **names; /* Reconcile: the names the answer is restricted to (borrowed) */
    size_t n_names;
    int gone; /* the client went away while the epoch was in flight */
    /* Set by other owners of waiting calls (the peer service): called
     * instead of amx_registry_cancel when the client goes away. */
    void (*on_cancel)(amx_waiter_t *w);
    void *ext;
    uint64_t aux;
    /* ReconcilePacked (set by the owner): gives the arrays of a packed
     * answer of p->ncells cells and p->nq quantizers; AMX_ENOMEM when it
     * cannot. Called once, on the loop thread, just before `done`. */
    amx_status_t (*alloc_packed)(amx_waiter_t *w, amx_packed_t *p);
    uint64_t layout_id;
};

/* Daemon-wide status for Status. */
typedef struct amx_job_info {
    const char *name;
    uint32_t world, joined, local_ranks, participants, quantizers, proposals, ranks_in_reconcile;
    int ready, in_flight;
    uint64_t epoch, reconciled, cells, updates, epochs_failed, catalog_hash, comm_generation;
    uint64_t last_epoch_us, last_collective_us, last_finish_us;
    uint64_t last_started_us, last_ended_us;
    uint64_t last_engine_begin_us, last_engine_end_us, last_answered_us;
    uint32_t last_collectives;
    const char *collective;
    uint64_t durable_epoch;
    const char *snapshot_error; /* NULL: none */
    int restored;
} amx_job_info_t;

typedef struct amx_qinfo {
    const amx_qspec_t *spec;
    uint32_t placements;
    int agreed;
} amx_qinfo_t;

/*
 * Creates an empty registry whose jobs use state backend `backend` ("host"
 * or "cuda") and the limits of `cfg` (borrowed; must outlive the registry).
 * Epoch outcomes are delivered on `loop`. `peer` (may be NULL for a single
 * daemon) is the cluster's membership and peer service.
 */
amx_status_t amx_registry_create(uv_loop_t *loop, const amx_config_t *cfg, const char *backend,
                                 amx_peer_t *peer, amx_registry_t **out, amx_err_t *err);

/* Restores every job snapshotted under state_dir (creating the directory
 * when missing); snapshots that cannot be used are moved aside with a log
 * line. EUNAVAIL when state_dir is unusable. Before serving. */
amx_status_t amx_registry_restore(amx_registry_t *reg, amx_err_t *err);

/* Writes the epochs that snapshot_interval_ms left unwritten (shutdown,
 * after the engines stopped: amx_registry_destroy calls it). */
void amx_registry_flush_snapshots(amx_registry_t *reg);
typedef struct amx_metrics amx_metrics_t;

/* Records into `m` (may be NULL) from now on: updates and bytes merged,
 * epochs, latencies, missing and filled cells, dropped jobs. `m` must
 * outlive the registry. Loop thread. */
void amx_registry_set_metrics(amx_registry_t *reg, amx_metrics_t *m);

/* Completes every waiter with EUNAVAIL, stops every engine, frees everything. */
void amx_registry_destroy(amx_registry_t *reg);

/* Aborts epochs in flight and fails waiting calls (shutdown); `why` is
 * their message. The registry stays usable for amx_registry_destroy. */
void amx_registry_shutdown(amx_registry_t *reg, const char *why);

/* The state backend's name ("host" or "cuda"). */
const char *amx_registry_backend(const amx_registry_t *reg);

/* The collective backend jobs of several daemons use ("gloo", "nccl"),
 * or "local" for a single daemon. */
const char *amx_registry_collective(const amx_registry_t *reg);

amx_status_t amx_registry_join(amx_registry_t *reg, const amx_join_req_t *req, amx_waiter_t *w,
                               uint64_t now_ms, amx_err_t *err);
amx_status_t amx_registry_register(amx_registry_t *reg, const amx_register_req_t *req,
                                   amx_waiter_t *w, amx_err_t *err);
amx_status_t amx_registry_send(amx_registry_t *reg, const amx_send_req_t *req, uint64_t *accepted,
                               uint64_t *epoch, amx_err_t *err);
/* The slab layout of a rank (the packed form); arrays in the arena. */
amx_status_t amx_registry_layout(amx_registry_t *reg, const char *job, uint32_t rank,
                                 amx_layout_t *out, amx_arena_t *arena, amx_err_t *err);
/* Merges a slab into the open epoch; atomic. A layout id that is not the
 * rank's current one is FAILED_PRECONDITION. */
/* fn(ud, job) is called whenever a job is dropped (Reset, idle timeout,
 * a peer's drop), before it is gone. */
void amx_registry_on_drop(amx_registry_t *reg, void (*fn)(void *ud, const char *job), void *ud);
amx_status_t amx_registry_send_packed(amx_registry_t *reg, const amx_send_packed_req_t *req,
                                      uint64_t *accepted, uint64_t *epoch, amx_err_t *err);
amx_status_t amx_registry_reconcile(amx_registry_t *reg, const amx_reconcile_req_t *req,
                                    amx_waiter_t *w, uint64_t now_ms, amx_err_t *err);
amx_status_t amx_registry_get_scales(amx_registry_t *reg, const amx_scales_req_t *req,
                                     amx_reply_t *reply, amx_arena_t *arena, amx_err_t *err);
amx_status_t amx_registry_reset(amx_registry_t *reg, const amx_reset_req_t *req, amx_waiter_t *w,
                                amx_err_t *err);

/* Removes a waiter whose client went away; its callback is not called. */
void amx_registry_cancel(amx_registry_t *reg, amx_waiter_t *w);

/* The state backend's device fault (a sticky CUDA error), or NULL. */
const char *amx_registry_fault(const amx_registry_t *reg);

/* Fails waiters whose deadline is before `now_ms` with ETIMEDOUT. */
void amx_registry_expire(amx_registry_t *reg, uint64_t now_ms);

/* Number of calls waiting in Join or Reconcile. */
uint32_t amx_registry_waiting(const amx_registry_t *reg);

/* Status: `job` empty = all jobs. NOT_FOUND for an unknown job. The infos
 * are allocated in the arena. */
amx_status_t amx_registry_status(amx_registry_t *reg, const char *job, amx_job_info_t **jobs,
                                 size_t *njobs, amx_arena_t *arena, amx_err_t *err);

/* The local view of a job's catalog (agreed, then proposals). */
amx_status_t amx_registry_list(amx_registry_t *reg, const char *job, amx_qinfo_t **q, size_t *n,
                               amx_arena_t *arena, amx_err_t *err);

/* ---- for the peer service (peer.c) ---- */

/* Ranks of `job` hosted here that have not entered Reconcile for `epoch`
 * (written into `missing`, at most `cap`); NOT_FOUND when unknown. */
amx_status_t amx_registry_progress(amx_registry_t *reg, const char *job, uint64_t epoch,
                                   uint32_t *missing, uint32_t cap, uint32_t *nmissing,
                                   uint64_t *open_epoch, uint64_t *last, int *in_flight,
                                   amx_err_t *err);

/* A peer says the job's communicator `gen` failed with `code` (or the job
 * changed membership: AMX_EABORTED): abort what is in flight, failing it
 * with that status and the peer's sentence, and agree again at the next
 * epoch. */
void amx_registry_peer_abort(amx_registry_t *reg, const char *job, uint64_t gen, uint32_t from,
                             amx_status_t code, const char *reason);

/* The coordinator dropped the job (Reset(drop_job) on some daemon). */
void amx_registry_peer_drop(amx_registry_t *reg, const char *job, uint32_t from);

/* A donor's published state for sync `seq`: copies up to `max` bytes at
 * `offset` (allocated with malloc into *data). EUNAVAIL when not (yet)
 * published. Any thread is fine for this one (it locks). */
amx_status_t amx_registry_fetch_state(amx_registry_t *reg, const char *job, uint64_t seq,
                                      uint64_t offset, uint32_t max, void **data, size_t *len,
                                      uint64_t *total, amx_err_t *err);

#endif
