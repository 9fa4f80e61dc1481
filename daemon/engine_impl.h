/*
 * engine_impl.h - the epoch engine's internals, shared by engine.c (the
 * thread, the collective, finish, snapshots) and engine_agree.c
 * (agreement, catch-up, communicators). Engine thread, unless a field says
 * otherwise.
 */
#ifndef AMX_ENGINE_IMPL_H
#define AMX_ENGINE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "engine.h"

/* Header cells (AMX_HDR_CELLS = 32): each field as 16-bit pieces and their
 * complements, so that after an element-wise MAX max(piece) == 65535 -
 * max(complement) holds exactly when every daemon sent the same value. */
enum {
    H_EPOCH = 0,    /* 4 pieces + 4 complements */
    H_HASH = 8,     /* 4 + 4 */
    H_GEN = 16,     /* 4 + 4 */
    H_CELLS = 24,   /* 3 + 3 */
    H_FLAG = 30,    /* max: some daemon needs an agreement round */
    H_VERSION = 31, /* -HDR_VERSION from every daemon: also its presence */
};
/* Written negated, so that after the MAX the cell holds -HDR_VERSION only
 * when every daemon contributed to it: a contribution that is missing
 * (reads 0, like the receive header poisoned before the collective) or
 * from an older version (1.0, written positive) shows. */
#define HDR_VERSION 2.0f

/* What a reduced header says, against this daemon's epoch, catalog hash,
 * communicator generation and cell count (check_header). */
typedef enum {
    AMX_HDR_OK,
    AMX_HDR_OLD_VERSION, /* a daemon of the older header (+1.0) took part */
    AMX_HDR_INCOMPLETE,  /* a contribution missing, of another epoch, or garbage */
    AMX_HDR_CATALOG,     /* every daemon there, with different catalogs */
    AMX_HDR_COMM,        /* every daemon there, on different communicators */
} amx_hdr_verdict_t;

void amx__engine_make_header(float *h, uint64_t epoch, uint64_t hash, uint64_t gen, uint64_t cells,
                             int flag);
amx_hdr_verdict_t amx__engine_header_verdict(const float *h, uint64_t epoch, uint64_t hash,
                                             uint64_t gen, uint64_t cells);

struct amx_engine {
    amx_job_t *job;
    amx_engine_env_t env;
    pthread_t th;
    int started;
    pthread_mutex_t mu; /* work hand-off, comm pointer, abort */
    pthread_cond_t cv;
    int have_work, quit;
    /* amx_engine_expect: an epoch is about to be handed over; the thread
     * wakes now and spins (EXPECT_SPIN_US at most) on `work` instead of
     * sleeping, so that the hand-off costs no wake-up. */
    atomic_int expect, work;
    int busy_poll; /* config busy_poll: expect and expect_end spin */
    uint64_t epoch, deadline;
    uint64_t armed_ms;    /* amx_engine_start's */
    uint64_t start_epoch; /* the epoch handed to amx_engine_start (under mu) */
    /* The epoch this attempt became when it caught up (the peers' number
     * for it; 0: none; under mu), and whether it then failed for it. */
    uint64_t relabeled;
    int stale_here;
    /* The agreement this attempt took part in (0: none yet) and the last
     * one an attempt that failed here took part in, with their coordinator
     * incarnations: what tells a late Abort (under mu). An attempt that
     * succeeded here is not counted: a peer that failed after the same
     * collective (its finish) dropped that round's communicator, and its
     * Abort must reach this daemon. */
    uint64_t agreed_seq, agreed_inc, failed_seq, failed_inc;
    /* With pend_epoch: the agreement of the peer's attempt (0: none). */
    uint64_t pend_seq, pend_inc;
    /* The communicator's watch found a participant gone (engine thread). */
    int watch_gone;
    atomic_int abort_flag;
    amx_status_t abort_code; /* with abort_flag: the status to fail with (under mu) */
    uint32_t abort_from;     /* the daemon that aborted it (AMX_ENGINE_LOCAL: this one) */
    int passed_on;           /* this attempt failed with another daemon's status and sentence */
    int aborted_here;        /* ... or because this daemon aborted it (peer_why says why) */
    char peer_why[768];
    char abort_why[768];
    /* An abort of an epoch this daemon has not started yet (a peer failed
     * it first): the epoch fails as it starts, if it starts within
     * PEND_ABORT_MS (under mu). */
    uint64_t pend_epoch, pend_at_ms;
    amx_status_t pend_code;
    uint32_t pend_from;
    char pend_why[768];
    amx_comm_t *comm;
    /* What the communicator's watch pings: this daemon's ring neighbours
     * among the participants it was made with (engine thread). */
    amx_peer_watch_t watch;
    _Atomic uint64_t comm_gen;
    uint64_t last_gen;  /* the generation of the last communicator held (engine thread) */
    int need_sync;      /* agree before the next collective */
    uint64_t coord_inc; /* the coordinator incarnation of our last agreement */
    amx_epoch_result_t res;
    /* A donor's state, published for FetchState. */
    pthread_mutex_t blob_mu;
    void *blob;
    size_t blob_len;
    uint64_t blob_seq;
    /* Working layout of this attempt. */
    amx_catalog_t *w_cat; /* the agreed catalog as this attempt knows it */
    amx_qdesc_t *w_desc;
    int w_owned;            /* w_cat/w_desc were made here (res.cat/res.desc) */
    int pend_original;      /* the in-flight buffer still has the loop's layout */
    amx_catalog_t *imp_cat; /* an imported catalog (the state's layout), owned */
    amx_qdesc_t *imp_desc;
    uint64_t last_reconciled; /* of the state, as this attempt knows it */
    int synced;               /* an agreement round happened in this attempt */
    /* Descriptor generations: bumped by every layout change; the backend
     * may keep a copy of the descriptors the last finish saw. */
    uint64_t desc_gen, fin_gen;
    int fin_had_reset;
    int marked;       /* some w_desc[].reset may be set: clean epochs skip the O(n) scans */
    int fin_ok;       /* the last finish succeeded (its descriptors may be reused) */
    uint64_t snap_ms; /* when this engine last wrote the job's snapshot (0: never) */
    /* Statistics (engine_stat.c): the accumulated sums on the host, their
     * copy and the calibrated amaxes of the last finish (reused while a
     * quantizer's sums did not change, under descriptor generation
     * scache_gen), this finish's amaxes and results, method scratch. */
    double *shost, *sprev;
    uint64_t shost_cap, sprev_n;
    float *ovr, *ocache, *otmp;
    uint64_t ovr_cap;
    amx_stat_result_t *sres;
    uint32_t sres_cap;
    uint64_t scache_gen;
    int scache_ok;
    void *sscratch;
    size_t sscratch_cap;
};

/* Records the epoch's first error (printf-style sentence); returns st. */
amx_status_t amx__engine_fail(amx_engine_t *e, amx_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The epoch was aborted while `during` ran: fails it with the aborting
 * daemon's status and sentence, or ABORTED. */
amx_status_t amx__engine_fail_aborted(amx_engine_t *e, const char *during);

/* Moves the in-flight buffer, the replicated state and the results to
 * catalog `to` (the engine's on success). */
amx_status_t amx__engine_change_layout(amx_engine_t *e, amx_catalog_t *to);

/* Aborts and frees the communicator (takes the engine mutex). */
void amx__engine_drop_comm(amx_engine_t *e);

/* Marks the named quantizers of the working catalog for reset. */
void amx__engine_mark_resets(amx_engine_t *e, char **names, size_t n);

/* One agreement round at the coordinator and what follows from it
 * (engine_agree.c). */
amx_status_t amx__engine_agree(amx_engine_t *e);

/* Statistics of calibrators beyond max (engine_stat.c). The SUM
 * collective of the stat buffer, run after the MAX one when some
 * quantizer of the working catalog has an agreed basis (the same decision
 * on every daemon: the basis is replicated state). */
amx_status_t amx__engine_stat_collective(amx_engine_t *e);

/* Before finish: resets, accumulation of the reduced statistic (the
 * in-flight buffer itself when `from_send`) and each calibrator's amax,
 * handed to finish in state->ovr. */
amx_status_t amx__engine_stat_begin(amx_engine_t *e, int from_send);

/* After a successful finish: bases fixed from this epoch's max where none
 * was, and the stat results published with the back outputs. */
amx_status_t amx__engine_stat_end(amx_engine_t *e);

/* Frees what the statistics keep (engine destroy). */
void amx__engine_stat_free(amx_engine_t *e);

#endif
