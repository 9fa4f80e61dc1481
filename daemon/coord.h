/*
 * coord.h - the coordinator: what cluster rank 0 serves to every daemon
 * (docs/CLUSTER.md).
 *
 *   membership  which daemon hosts which trainer rank of a job; a job is
 *               ready when all W ranks joined some daemon
 *   agreement   a barrier of a job's participants that merges catalog
 *               proposals into the master catalog, collects resets, picks
 *               the daemons that are behind and a donor, and decides on a
 *               new communicator generation
 *   kv          a key-value store with waiting gets (Gloo's rendezvous
 *               store, the NCCL unique id)
 *
 * Cluster rank 0 creates the one coordinator (a single daemon is a cluster
 * of one). Loop lock only (the loop thread, or a completion-queue thread
 * that holds the lock: rpc.h). Requests come from the peer service
 * (service_peer.c) for remote daemons and through peer.c's local path for
 * rank 0 itself. Callbacks are called exactly once (unless the request is
 * cancelled), under the same lock.
 */
#ifndef AMX_COORD_H
#define AMX_COORD_H

#include <stddef.h>
#include <stdint.h>

#include "catalog.h"
#include "status.h"

/* A daemon of the cluster taking part in a job. */
typedef struct amx_part {
    uint32_t daemon; /* cluster rank */
    uint64_t incarnation;
    char addr[256];  /* its peer service, host:port */
    uint32_t *ranks; /* trainer ranks it hosts, sorted */
    uint32_t nranks;
} amx_part_t;

/* A job's membership: participants sorted by cluster rank. */
typedef struct amx_membership {
    uint32_t world;
    uint32_t npart;
    amx_part_t *part;
    int rejoined; /* the coordinator knew the rank before (a trainer's Join answer
                   * says instead whether its own daemon kept it: job.c) */
    uint64_t coord_inc;
} amx_membership_t;

/* Deep copy / free of a membership's participant array. */
amx_status_t amx_membership_copy(const amx_membership_t *src, amx_membership_t *dst);
void amx_membership_free(amx_membership_t *m);

/* "ranks 0-3, 8" for a sorted rank list. */
void amx_fmt_ranks(char *buf, size_t len, const uint32_t *r, uint32_t n);

typedef struct amx_coord amx_coord_t;
typedef struct amx_creq amx_creq_t; /* a waiting request */

/* What the coordinator did, for Status and the tests: agreement requests
 * recorded, rounds completed, specs received in offers (each distinct
 * offer once), offers and whole catalogs it had to ask for, offers sent
 * although it held them, and the specs, participant lists and bytes of
 * the answers delivered (counted by the peer service, per answer). */
typedef struct amx_coord_stats {
    uint64_t syncs, rounds, specs_received, offers_asked, catalogs_asked, offers_known;
    uint64_t specs_sent, members_sent, answers_built, answer_bytes;
} amx_coord_stats_t;

/* A hash of a membership (participants, their incarnations, addresses and
 * ranks); equal memberships hash alike on every daemon. */
uint64_t amx_membership_hash(const amx_membership_t *m);

/* A coordinator that serves from the start (active). */
amx_coord_t *amx_coord_create(uint64_t incarnation, uint64_t join_timeout_ms);

/* The role of a coordinator candidate (docs/CLUSTER.md, "Coordinator
 * failover"). Stepping down fails every waiting request with UNAVAILABLE
 * and `why` and forgets every job and key; taking the role back starts
 * empty, with a new incarnation (the members rebuild it, as for a
 * restart). Whether it serves now. */
void amx_coord_step_down(amx_coord_t *co, const char *why);
void amx_coord_take_over(amx_coord_t *co, uint64_t incarnation);
int amx_coord_active(const amx_coord_t *co);
/* Frees it, failing every waiting request with UNAVAILABLE first. */
void amx_coord_destroy(amx_coord_t *co);
uint64_t amx_coord_incarnation(const amx_coord_t *co);

/* ---- membership ---- */

typedef void (*amx_coord_join_cb)(void *ud, amx_status_t st, const char *msg,
                                  const amx_membership_t *m);

typedef struct amx_coord_join_req {
    const char *job;
    uint32_t world, rank;
    uint32_t daemon;
    uint64_t incarnation;
    const char *addr;
    int announce;         /* record only (a daemon re-announcing a rank it serves) */
    uint64_t deadline_ms; /* CLOCK_MONOTONIC */
} amx_coord_join_req_t;

/* Joins a trainer rank. AMX_OK: cb will be (or was) called; *h is a handle
 * for amx_coord_cancel while it waits (NULL when already answered). */
amx_status_t amx_coord_join(amx_coord_t *co, const amx_coord_join_req_t *req, amx_coord_join_cb cb,
                            void *ud, amx_creq_t **h, amx_err_t *err);

/* ---- agreement ---- */

typedef struct amx_coord_sync_req {
    const char *job;
    uint32_t daemon;
    uint64_t incarnation;
    uint64_t last_reconciled;
    uint64_t catalog_hash;
    /* The daemon's offer: its proposals, with full_catalog its whole agreed
     * catalog too, by catalog hash (of the specs in name order) and count;
     * the specs themselves (borrowed for the call) only with
     * offer_included. */
    amx_qspec_t **proposals;
    size_t nprop;
    int full_catalog;
    uint64_t offer_hash;
    uint32_t offer_count;
    int offer_included;
    /* For the answer (the peer service): the membership the caller holds,
     * and whether it wants the whole catalog rather than a delta. */
    uint64_t membership_hash;
    int want_catalog;
    /* The catalog hash of its agreed catalog and proposals together: when
     * the round adopts exactly that, the master's new hash (the
     * coordinator need not hash the whole master again). */
    uint64_t union_hash;
    char **resets;
    size_t nresets;
    int need_comm;
    /* Enough to rebuild the membership after the coordinator restarted. */
    uint32_t world;
    const uint32_t *ranks;
    uint32_t nranks;
    const char *addr;
    uint64_t deadline_ms;
} amx_coord_sync_req_t;

/* A job's master catalog as an answer reads it: the agreed specs in name
 * order (q) and in the order they were agreed (agreed: a version of the
 * master holds the first nadded of them), n of each, and its hash (the
 * catalog hash of q). Owned by the coordinator; valid during the answer. */
typedef struct amx_coord_catalog {
    amx_qspec_t **q;
    amx_qspec_t **agreed;
    uint32_t n;
    uint64_t hash;
} amx_coord_catalog_t;

typedef struct amx_coord_sync_ans {
    uint64_t seq;
    uint64_t catalog_hash;
    const amx_coord_catalog_t *catalog; /* the master: always here (the caller decides what to
                                           send) */
    char **rejected;
    size_t nrejected;
    const char *conflict; /* NULL, or the FAILED_PRECONDITION sentence */
    char **resets;
    size_t nresets;
    uint64_t target_epoch;
    uint32_t donor;
    const uint32_t *behind;
    size_t nbehind;
    uint64_t comm_gen;
    int new_comm;
    const amx_membership_t *members;
    uint64_t members_hash;
    uint64_t coord_inc;
    /* The master's last versions (hash, and how many of catalog->agreed it
     * held), for answers that carry only the specs agreed since the
     * caller's catalog. */
    const struct cver *versions;
    size_t nversions;
    amx_coord_stats_t *stats; /* the answerer counts what it sends */
    uint64_t round;           /* unique per completed round of this coordinator */
    /* Set alone (nothing above is meaningful): the caller's agreed catalog
     * is not the master and it did not send it whole; it must call again
     * with full_catalog. A coordinator that restarted without its state
     * learns the catalog this way instead of losing what only other
     * daemons' ranks registered. */
    int send_catalog;
    int send_offer; /* alone, as send_catalog: call again with the offer's specs */
} amx_coord_sync_ans_t;

/* Called with the answer (valid during the call) or an error. */
typedef void (*amx_coord_sync_cb)(void *ud, amx_status_t st, const char *msg,
                                  const amx_coord_sync_ans_t *ans);

amx_status_t amx_coord_sync(amx_coord_t *co, const amx_coord_sync_req_t *req, amx_coord_sync_cb cb,
                            void *ud, amx_creq_t **h, amx_err_t *err);

/* ---- key-value store ---- */

typedef void (*amx_coord_kv_cb)(void *ud, amx_status_t st, const char *msg, const void *val,
                                size_t len);

/* Sets `key` (a copy of val) and answers the gets waiting for it; out of
 * memory, the key stays unset (its gets time out). */
void amx_coord_kv_set(amx_coord_t *co, const char *key, const void *val, size_t len);

/* Answers at once when the key exists, else when it is set or at the
 * deadline (ETIMEDOUT). */
amx_status_t amx_coord_kv_get(amx_coord_t *co, const char *key, uint64_t deadline_ms,
                              amx_coord_kv_cb cb, void *ud, amx_creq_t **h, amx_err_t *err);

/* ---- notifications ---- */

/* Called when a daemon of a ready job re-joins with a new incarnation (it
 * restarted): the other participants must drop their communicator of
 * generation `gen`, which includes the dead incarnation. */
typedef void (*amx_coord_notify_fn)(void *ud, const char *job, const amx_membership_t *m,
                                    uint32_t restarted_daemon, uint64_t gen);
void amx_coord_set_notify(amx_coord_t *co, amx_coord_notify_fn fn, void *ud);

/* ---- common ---- */

/* Fails every waiting request with UNAVAILABLE and `why` (the daemon is
 * stopping); the coordinator stays usable. */
void amx_coord_fail_all(amx_coord_t *co, const char *why);

/* Withdraws a waiting request; its callback is not called. */
void amx_coord_cancel(amx_coord_t *co, amx_creq_t *h);

/* Fails waiting requests whose deadline is before now_ms. */
void amx_coord_expire(amx_coord_t *co, uint64_t now_ms);

/* Forgets a job (membership, catalog, keys); its waiting requests fail with
 * ABORTED. Returns the participants to tell (copied into *m; free it), or
 * NOT_FOUND. */
amx_status_t amx_coord_drop(amx_coord_t *co, const char *job, amx_membership_t *m);

/* Participants of a ready job (copied; free it), or NOT_FOUND. */
amx_status_t amx_coord_members(amx_coord_t *co, const char *job, amx_membership_t *m);

/* Counts for Status. */
void amx_coord_counts(const amx_coord_t *co, uint32_t *jobs, uint32_t *waiting, uint32_t *keys);

/* What it did since it started. */
const amx_coord_stats_t *amx_coord_stats(const amx_coord_t *co);

/* A version of a master: see amx_coord_sync_ans_t. */
typedef struct cver {
    uint64_t hash;
    size_t nadded;
} amx_coord_version_t;

#endif
