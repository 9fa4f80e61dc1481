/*
 * job.h - a job as one daemon holds it: what the registry's files (job.c
 * owns its life) and the job's engine (engine.c) share.
 *
 * Ownership and threads. The loop lock's holder (rpc.h) owns the job. While an epoch is in
 * flight (job->in_flight), the job's engine thread reads the catalog, the
 * quantizer table and the membership, and alone writes job->desc, the
 * state backend's in-flight and replicated buffers and the engine fields;
 * the loop thread writes none of those and defers every request that
 * would (Register, Reset, drop). When the engine posts the epoch's outcome,
 * the loop thread installs what changed (registry.c, epoch_done).
 */
#ifndef AMX_JOB_H
#define AMX_JOB_H

#include <pthread.h>
#include <stdint.h>

#include "catalog.h"
#include "coord.h"
#include "placement.h"
#include "request.h"
#include "state.h"
#include "strmap.h"

enum { LQ_AGREED = 1, LQ_PROPOSED = 2, LQ_DEAD = 3 };

/* A quantizer as this daemon knows it; its index is its local id (lid),
 * stable for the life of the job. */
typedef struct amx_lq {
    amx_qspec_t *spec; /* AGREED: borrowed from job->cat; PROPOSED/DEAD: owned */
    int32_t cidx;      /* index in job->cat (AGREED), else -1 */
    uint8_t status;
    uint8_t reset;  /* a Reset of it waits for the next epoch */
    uint64_t base;  /* first cell in pending: agreed layout, or provisional */
    uint64_t gbase; /* AGREED with global slices: its first entry of the per-slice results */
    uint32_t stamp; /* the last SendAmax batch that named it */
    uint32_t nplacements;
} amx_lq_t;

/* A rank's slab layout (the packed form): its live placements in catalog
 * order (names in byte order), where each lies in the rank's flat buffer,
 * and the runs that move cells between that buffer and the job's. Built
 * on demand, rebuilt when job->layout_gen moved on. */
typedef struct amx_slab {
    uint64_t gen;     /* job->layout_gen it was built for */
    uint64_t id;      /* layout id: a hash of the content */
    uint64_t serial;  /* unique to this build in the process (never 0): a key for caches of its
                         runs and maps (the device buffers' uploads) */
    uint32_t n;       /* quantizers */
    uint32_t *lid;    /* n, layout order */
    uint64_t *off;    /* n + 1: first slab cell of each; off[n] = total */
    amx_run_t *merge; /* pending cell (dst) <- slab cell (src), coalesced */
    size_t nmerge;
    amx_run_t *gather; /* output cell (src) -> slab cell (dst), agreed only, coalesced */
    size_t ngather;
    uint64_t gather_cells;
    /* Global slices (quantizers with global_axes > 0), in layout order:
     * quantizer i's are [soff[i], soff[i + 1]) of the packed answer's
     * per-slice arrays; sg[s] is slice s's index in the state's slice
     * arrays (UINT64_MAX while its quantizer is not agreed). */
    uint64_t *soff; /* n + 1 */
    uint64_t *sg;   /* soff[n] */
    /* For the packed answer, so that it does not chase each quantizer's
     * spec: catalog index of quantizer i (UINT32_MAX while not agreed),
     * and the layout indices of the quantizers not agreed yet and of
     * those in a peer group (the only ones whose cells can be marked). */
    uint32_t *cidx;
    uint32_t *pendq, npendq;
    uint32_t *peerq, npeerq;
    /* Calibrators beyond max: quantizer i's statistic is values
     * [stoff[i], stoff[i + 1]) of the rank's stat slab (none for max
     * quantizers); nstatq of them have one. */
    uint64_t *stoff; /* n + 1 */
    uint32_t nstatq;
} amx_slab_t;

/* A trainer rank hosted by this daemon. */
typedef struct amx_lrank {
    uint32_t rank;
    uint8_t joined;       /* Join returned (or is waiting) */
    uint8_t in_reconcile; /* waiting in Reconcile for the open epoch */
    uint8_t restored;     /* from a snapshot of a cluster job, not re-joined yet */
    amx_waiter_t *join_w, *rec_w;
    void *cjoin;     /* the coordinator join in progress (peer.c handle) */
    void *jctx;      /* its callback context, freed when it is cancelled */
    uint32_t *pl_of; /* per lid: index + 1 into pls, 0 = none */
    size_t cap_of;
    amx_placement_t *pls;
    uint32_t *pl_lid; /* lid of pls[i] */
    uint32_t npls;
    size_t cap_pls;
    amx_slab_t *slab; /* NULL until the packed form is used */
    /* ReconcilePacked answers of this rank: one buffer reused from epoch
     * to epoch while gRPC does not hold it any more (bytebuf.h). */
    struct amx_replybuf *answer;
    /* GPU-direct: the rank's device buffers (device.c), or NULL. */
    struct amx_devrank *dev;
} amx_lrank_t;

/* A request that waits until the epoch in flight has ended. */
typedef struct amx_deferred {
    int kind; /* WAIT_REGISTER, WAIT_RESET, WAIT_RECONCILE_NEXT, WAIT_JOIN_NEXT */
    amx_waiter_t *w;
    const void *req; /* WAIT_RECONCILE_NEXT: a copy, freed with this */
    struct amx_deferred *next;
} amx_deferred_t;

typedef struct amx_engine amx_engine_t;

typedef struct amx_job {
    char *name;
    uint32_t world;
    int ready;   /* membership known: every rank joined some daemon */
    int dropped; /* drop requested while in flight (or growing) */
    /* A large growth of the pending buffers whose new cells a thread of
     * its own is filling (state.h grow_pending): Register waits, no epoch
     * starts. */
    int growing;
    int grow_done; /* set by that thread (atomic), read by the loop */
    pthread_t grow_th;
    void *grow_wake; /* the registry's uv_async_t the thread signals */
    /* Membership. */
    amx_lrank_t *lr; /* local ranks, nlocal of them (grown as ranks join) */
    uint32_t nlocal;
    size_t cap_local;
    int32_t *slot;          /* per trainer rank: index into lr, or -1 */
    amx_membership_t mship; /* participants (mship.part, mship.npart) */
    int32_t me;             /* my index in mship.part, -1 before ready */
    /* Catalog. */
    amx_lq_t *lq;
    uint32_t nlq;
    size_t cap_lq;
    amx_strmap_t lqmap;  /* name -> lid */
    amx_catalog_t *cat;  /* agreed; never NULL */
    uint32_t *lid_of;    /* per catalog index: lid, or UINT32_MAX (known only to peers) */
    amx_qdesc_t *desc;   /* layout of cat (engine-owned while in flight) */
    uint64_t prov_cells; /* provisional cells after cat->ncells */
    uint64_t prov_hist;  /* history cells the proposals will need */
    uint32_t nprop;      /* proposals (LQ_PROPOSED) */
    uint32_t nreset;     /* quantizers with lq.reset set */
    uint64_t reset_seq;  /* Reset calls made here (cluster jobs: sent with proposals) */
    uint32_t batch;      /* SendAmax batch counter for lq.stamp */
    uint64_t layout_gen; /* moves on whenever a placement, a base or a status changes */
    amx_state_t *state;
    /* Epochs. */
    uint64_t epoch;           /* open epoch, from 1 */
    uint64_t last_reconciled; /* 0: none */
    uint32_t nin_reconcile;
    int in_flight;
    uint64_t flight_deadline;
    amx_engine_t *eng;
    amx_deferred_t *defer_head, **defer_tail;
    /* Statistics. */
    uint64_t updates, epochs_ok, epochs_failed;
    uint64_t last_epoch_us, last_collective_us, last_finish_us;
    uint64_t flight_started_us, last_started_us, last_ended_us; /* CLOCK_MONOTONIC */
    uint64_t last_engine_begin_us, last_engine_end_us, last_answered_us;
    uint64_t flight_entered_us, last_entered_us; /* the last local rank entered */
    uint64_t last_published_us;                  /* before the answers were built */
    uint64_t last_active_ms; /* the last call of one of its ranks (job_idle_timeout_ms) */
    /* Durability (snapshot.h). */
    uint64_t durable_epoch; /* the last epoch in the job's snapshot (0: none) */
    char *snap_err;         /* why the last snapshot failed, or NULL */
    int restored;           /* the job came from a snapshot at start */
    uint32_t last_collectives;
    /* The epoch before the last one: each quantizer's global amax and
     * global scale by catalog index (< prev_n), for previous_* fields. */
    float *prev_ga, *prev_gs;
    uint8_t *prev_ok;
    uint32_t prev_n;
    size_t prev_cap;
    /* Moves on whenever the prev_* arrays may have changed (every end of
     * an epoch, a restore): the key of their copy on the device (the
     * device answers'). */
    uint64_t prev_serial;
    /* Whether the front output set is what the finish of the last
     * reconciled epoch wrote (no import, restore, layout change or failed
     * epoch since): then, once published over, it is the previous
     * globals, on the device too (prev_dev). */
    int front_finished;
    /* The device answers of the epoch being answered read the previous
     * globals from the device's output set behind the front (all
     * published, catalog order): j->prev_* may lag until the answers are
     * queued. */
    int prev_dev;
    /* The host answers of the epoch being answered read the previous
     * globals in place, from the output set behind the front (all
     * published, catalog order, cat->n of them; amx_job_previous):
     * j->prev_* lag until the answers are out. NULL otherwise. */
    const float *prev_front_ga, *prev_front_gs;
    /* Per quantizer of cat (< pub_n): whether the front outputs hold a
     * global that an epoch published for it, rather than the placeholder
     * (0, 1) a layout change gives a quantizer new to it. NULL: all do. */
    uint8_t *pub_ok;
    uint32_t pub_n;
    struct amx_job *next;
} amx_job_t;

/* Whether the front outputs hold a published global of quantizer `ci` of
 * the installed catalog (amx_job_t.pub_ok). */
static inline int amx_job_published(const amx_job_t *j, uint32_t ci)
{
    return j->pub_ok == NULL || (ci < j->pub_n && j->pub_ok[ci]);
}

/* The previous-epoch global amax and scale of quantizer `ci` of the
 * installed catalog: 0 when there are none (a quantizer new to the
 * catalog, the first epoch, a restore). */
static inline int amx_job_previous(const amx_job_t *j, uint32_t ci, float *ga, float *gs)
{
    if (j->prev_front_ga != NULL) {
        if (j->cat == NULL || ci >= j->cat->n)
            return 0;
        *ga = j->prev_front_ga[ci];
        *gs = j->prev_front_gs[ci];
        return 1;
    }
    if (ci >= j->prev_n || !j->prev_ok[ci])
        return 0;
    *ga = j->prev_ga[ci];
    *gs = j->prev_gs[ci];
    return 1;
}

/* The registry's own state (registry.c). */
struct amx_registry;

/* Index of trainer rank r among the job's local ranks, or -1. */
static inline int32_t amx__job_slot(const amx_job_t *j, uint32_t r)
{
    return r < j->world ? j->slot[r] : -1;
}

#endif
