/*
 * request.h - what the services hand the registry and get back: requests,
 * answers and the waiting call, as C structs (registry.h has the
 * functions). Below the registry and the RPC layer, which embeds a waiter
 * in every call it may keep waiting; no functions here.
 */
#ifndef AMX_REQUEST_H
#define AMX_REQUEST_H

#include <stddef.h>
#include <stdint.h>

#include "catalog.h"
#include "status.h"

typedef struct amx_waiter amx_waiter_t;

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
    const uint8_t *stat; /* calibrators beyond max: float64 LE statistic, or NULL */
    size_t stat_len;
    uint64_t stat_epoch;
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
    /* GPU-direct (ReconcileDevice): the answer goes into the rank's device
     * buffers `device_id`; with `send` their slab is merged into the
     * epoch first (`has_data`: with its has-data bytes). */
    int device;
    uint64_t device_id;
    int send, has_data;
    /* Signals instead of the events (the doorbell): the slab's ready flag
     * reaches `seq` (cyclically) when the slab is written; the daemon
     * writes `seq` into the answer's done flag. 0: the events. */
    uint32_t seq;
    /* Armed (the doorbell started this epoch for the rank when it answered
     * the last, docs/API.md "Armed epochs"): no deadline until the rank's
     * ready flag passed; the epoch's own deadline runs from then. */
    int armed;
} amx_reconcile_req_t;

/* OpenDevice: device buffers for rank `rank`'s layout `layout_id` on the
 * GPU named `device` (PCI bus id or UUID; "" the daemon's), freed when
 * process `pid` (0: none) ends. */
typedef struct amx_dev_open_req {
    const char *job;
    uint32_t rank;
    uint64_t layout_id;
    const char *device;
    uint32_t pid;
} amx_dev_open_req_t;

/* What OpenDevice answers: sizes, byte offsets and the IPC handles. */
typedef struct amx_dev_opened {
    uint64_t id, layout_id, total_cells, total_slices;
    uint32_t nq;
    uint64_t slab_bytes, has_data_off, answer_bytes;
    uint64_t amax, scale, scale_inv, block_scales;           /* answer offsets, per cell */
    uint64_t g_amax, g_scale, g_inv, s_amax, s_scale, s_inv; /* per quantizer, per slice */
    uint64_t missing, has_prev, prev_amax, prev_scale;       /* per quantizer */
    uint8_t slab_handle[64], answer_handle[64], ready_event[64], done_event[64];
    char bus_id[32];
    int signals;                            /* flags may replace the events (seq != 0) */
    uint64_t ready_flag_off, done_flag_off; /* uint32 flags: in the slab, in the answer */
} amx_dev_opened_t;

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
    const uint8_t *stats; /* float64 LE statistics of the stat slab, or NULL */
    size_t stats_len;
    const uint8_t *stat_epochs; /* uint64 LE per quantizer of the layout */
    size_t stat_epochs_len;
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
    /* Calibrators beyond max (NULL / 0 when no quantizer has one): kind
     * and first statistic value in the stat slab, per quantizer. */
    int *calibrator;
    uint64_t *stat_offset;
    uint64_t total_stats;
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
    /* Calibrators beyond max: `stats` set by the registry when a quantizer
     * of the layout has one; then the arrays: per quantizer state, epoch,
     * total, overflow; per cell the basis. */
    int stats;
    uint8_t *st_state;
    uint64_t *st_epoch;
    double *st_total, *st_over;
    float *st_basis;
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
    /* Calibrators beyond max (stat_state != AMX_STAT_NONE): the published
     * statistic's state, basis epoch, counts, and the basis of each cell
     * of the result (arena; NULL without a basis). */
    int stat_state;
    uint64_t stat_epoch;
    double stat_total, stat_overflow;
    float *stat_basis;
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
    void *ext2; /* the owner's own (the peer service: what a Sync's caller holds) */
    uint64_t aux;
    /* ReconcilePacked (set by the owner): gives the arrays of a packed
     * answer of p->ncells cells and p->nq quantizers; AMX_ENOMEM when it
     * cannot. Called once, on the loop thread, just before `done`. */
    amx_status_t (*alloc_packed)(amx_waiter_t *w, amx_packed_t *p);
    uint64_t layout_id;
    /* ReconcileDevice (set by the registry): answered into the rank's
     * device buffers; `done` gets a reply without results. */
    int device_answer;
};

/* Daemon-wide status for Status. */
typedef struct amx_job_info {
    const char *name;
    uint32_t world, joined, local_ranks, participants, quantizers, proposals, ranks_in_reconcile;
    int ready, in_flight;
    uint64_t epoch, reconciled, cells, updates, epochs_failed, catalog_hash, comm_generation;
    uint64_t last_epoch_us, last_collective_us, last_finish_us;
    uint64_t last_started_us, last_ended_us;
    uint64_t last_engine_begin_us, last_engine_end_us, last_answered_us, last_entered_us;
    uint64_t last_published_us;
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

#endif
