/*
 * coord_impl.h - the coordinator's insides, shared by coord.c (jobs,
 * membership, key-value store) and coord_agree.c (the agreement barrier).
 * Not for other modules: they use coord.h. Everything here runs under the
 * loop lock, like the rest of the coordinator.
 */
#ifndef AMX_COORD_IMPL_H
#define AMX_COORD_IMPL_H

#include "coord.h"
#include "strmap.h"

enum { REQ_JOIN = 1, REQ_SYNC = 2, REQ_KVGET = 3 };

typedef struct cdaemon {
    uint32_t daemon;
    uint64_t incarnation;
    char addr[256];
} cdaemon_t;

typedef struct cjob cjob_t;

typedef amx_coord_version_t cver_t;

/* A distinct offer of an agreement round: specs (owned, sorted by name),
 * by their catalog hash, with the first daemon that made it. */
typedef struct coffer {
    uint64_t hash;
    amx_qspec_t **specs;
    uint32_t n;
    uint32_t origin;
    int done; /* merged in the round being completed */
} coffer_t;

typedef struct add {
    amx_qspec_t *spec; /* borrowed from an offer of the round */
    uint32_t origin;
    amx_qspec_t **slot; /* where that offer holds it: the master takes it */
} add_t;

/* A job's master catalog, kept so that agreeing k more specs costs O(k)
 * map and hash work (and a move of the pointers after them in q): only
 * ever added to. view.agreed owns the specs; names and groups index it
 * (a position there never moves); view.q borrows them in name order. */
typedef struct cmaster {
    amx_coord_catalog_t view;
    size_t cap_q, cap_agreed;
    amx_strmap_t names;  /* name -> index in view.agreed */
    amx_strmap_t groups; /* peer group -> index in view.agreed of its first quantizer */
} cmaster_t;

/* Versions of a master kept for delta answers. */
#define KEEP_VERSIONS 64

struct amx_creq {
    int kind;
    cjob_t *job;
    uint64_t deadline;
    void *ud;
    union {
        amx_coord_join_cb join;
        amx_coord_sync_cb sync;
        amx_coord_kv_cb kv;
    } cb;
    uint32_t rank, daemon; /* join; sync: daemon */
    /* sync */
    uint64_t incarnation, last_reconciled, catalog_hash;
    uint64_t offer_hash; /* its offer (coffer_t of the job), 0: none */
    uint64_t union_hash; /* its catalog and offer together (amx_coord_sync_req_t) */
    char **resets;
    size_t nresets;
    int need_comm, full;
    /* kv */
    char *key;
    struct amx_creq *prev, *next;
};

struct cjob {
    char *name;
    uint32_t world;
    uint32_t *host; /* per rank: daemon + 1, 0 = not joined */
    uint32_t njoined;
    int ready;
    cdaemon_t *dm;
    uint32_t ndm;
    size_t cap_dm;
    uint32_t *dm_at; /* by cluster rank: 1 + its index in dm, 0 = none */
    size_t cap_dm_at;
    amx_membership_t mship; /* valid when ready */
    int mship_dirty;
    cmaster_t master;
    /* The master's history, for answers that carry only what changed: for
     * each of the last versions its hash and how many specs it held (the
     * first of master.view.agreed). */
    cver_t *ver;
    size_t nver, cap_ver;
    /* The offers of the round in progress, one per distinct hash, and the
     * hashes already asked of some daemon (the others that make the same
     * offer wait for it instead of sending it too). */
    coffer_t *offers;
    size_t noffers, cap_offers;
    uint64_t *asked;
    size_t nasked, cap_asked;
    /* The waiting agreement request of each daemon (by cluster rank; at
     * most one each) and how many there are: the barrier's test is O(1)
     * per arrival, its completion O(participants). */
    amx_creq_t **sync_of;
    size_t cap_sync_of;
    uint32_t nsync;
    uint64_t seq, comm_gen;
    int comm_dirty;
    cjob_t *next;
};

typedef struct kv_entry {
    char *key;
    void *val;
    size_t len;
} kv_entry_t;

struct amx_coord {
    int active; /* serves the coordinator's calls (amx_coord_take_over) */
    amx_coord_stats_t stats;
    uint64_t incarnation;
    uint64_t started_ms; /* CLOCK_MONOTONIC */
    uint64_t join_timeout_ms;
    cjob_t *jobs;
    uint32_t njobs;
    amx_creq_t *reqs; /* every waiting request */
    uint32_t nreqs;
    kv_entry_t *kv;
    size_t nkv, cap_kv;
    amx_strmap_t kvmap; /* key -> index into kv */
    amx_coord_notify_fn notify;
    void *notify_ud;
};

/* (Re)builds the membership of a ready job when it changed. */
amx_status_t amx__coord_build_mship(amx_coord_t *co, cjob_t *j);
/* Answers the waiting Joins of j once every rank is known. */
void amx__coord_complete_joins(amx_coord_t *co, cjob_t *j);
/* Daemon d's record in job j, or NULL. */
cdaemon_t *amx__coord_daemon_of(cjob_t *j, uint32_t d);
/* The job named `name`, or NULL. */
cjob_t *amx__coord_find(amx_coord_t *co, const char *name);
/* A new job of `world` ranks, linked into co; NULL when out of memory. */
cjob_t *amx__coord_job_new(amx_coord_t *co, const char *name, uint32_t world);
/* Drops every key-value entry whose key starts with prefix. */
void amx__coord_kv_drop_prefix(amx_coord_t *co, const char *prefix);
/* Records daemon d with its incarnation and address; 1 when it was known
 * with another incarnation (it restarted). */
int amx__coord_note_daemon(cjob_t *j, uint32_t d, uint64_t inc, const char *addr);
/* Frees a master and its specs; it is empty again. */
void amx__coord_master_free(cmaster_t *m);
/* Frees the offers of j's round (and the hashes asked for). */
void amx__coord_offers_clear(cjob_t *j);
/* Unlinks r, answers it with st and msg, frees it. */
void amx__coord_req_fail(amx_coord_t *co, amx_creq_t *r, amx_status_t st, const char *msg);
/* Frees an unlinked request. */
void amx__coord_req_free(amx_creq_t *r);
/* Links a waiting request (and indexes an agreement request by daemon). */
void amx__coord_req_link(amx_coord_t *co, amx_creq_t *r);
/* Unlinks a waiting request (and its index entry). */
void amx__coord_req_unlink(amx_coord_t *co, amx_creq_t *r);
/* Whether daemon `daemon` has an agreement request waiting in j (and
 * which, in *out when out is not NULL). */
int amx__coord_sync_waiting(amx_coord_t *co, cjob_t *j, uint32_t daemon, amx_creq_t **out);
/* Completes the agreement of j when every participant is waiting (asking
 * again for an offer that never came). */
void amx__coord_try_sync(amx_coord_t *co, cjob_t *j);

#endif
