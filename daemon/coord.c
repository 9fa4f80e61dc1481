/*
 * coord.c - the coordinator: membership, agreement barrier, key-value store
 * (coord.h). Loop thread only; no I/O of its own.
 */
#include "coord.h"

#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "grow.h"
#include "log.h"
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
    amx_membership_t mship; /* valid when ready */
    int mship_dirty;
    amx_catalog_t *master;
    /* The master's history, for answers that carry only what changed:
     * names in the order they were agreed, and for each of the last
     * versions its hash and how many of those names it held. */
    char **added;
    size_t nadded, cap_added;
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

/* ---- helpers ---- */

void amx_fmt_ranks(char *buf, size_t len, const uint32_t *r, uint32_t n)
{
    size_t k = 0;
    buf[0] = '\0';
    for (uint32_t i = 0; i < n && k < len;) {
        uint32_t j = i;
        while (j + 1 < n && r[j + 1] == r[j] + 1)
            j++;
        if (j == i)
            k += (size_t)snprintf(buf + k, len - k, "%s%u", i ? ", " : "", r[i]);
        else
            k += (size_t)snprintf(buf + k, len - k, "%s%u-%u", i ? ", " : "", r[i], r[j]);
        i = j + 1;
    }
}

amx_status_t amx_membership_copy(const amx_membership_t *src, amx_membership_t *dst)
{
    *dst = *src;
    dst->part = calloc(src->npart ? src->npart : 1, sizeof(amx_part_t));
    if (dst->part == NULL)
        return AMX_ENOMEM;
    for (uint32_t p = 0; p < src->npart; p++) {
        dst->part[p] = src->part[p];
        dst->part[p].ranks = malloc((src->part[p].nranks ? src->part[p].nranks : 1) * 4);
        if (dst->part[p].ranks == NULL) {
            dst->npart = p;
            amx_membership_free(dst);
            return AMX_ENOMEM;
        }
        if (src->part[p].nranks > 0)
            memcpy(dst->part[p].ranks, src->part[p].ranks, src->part[p].nranks * 4);
    }
    return AMX_OK;
}

void amx_membership_free(amx_membership_t *m)
{
    if (m->part != NULL)
        for (uint32_t p = 0; p < m->npart; p++)
            free(m->part[p].ranks);
    free(m->part);
    memset(m, 0, sizeof(*m));
}

static cjob_t *find(amx_coord_t *co, const char *name)
{
    for (cjob_t *j = co->jobs; j != NULL; j = j->next)
        if (strcmp(j->name, name) == 0)
            return j;
    return NULL;
}

static cjob_t *job_new(amx_coord_t *co, const char *name, uint32_t world)
{
    cjob_t *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return NULL;
    j->name = strdup(name);
    j->host = calloc(world, sizeof(uint32_t));
    if (j->name == NULL || j->host == NULL) {
        free(j->name);
        free(j->host);
        free(j);
        return NULL;
    }
    j->world = world;
    j->mship_dirty = 1;
    /* Version 0: the empty catalog (a daemon that has none gets it all). */
    if (amx_grow(&j->ver, &j->cap_ver, 1, sizeof(cver_t), 8, 0) == 0)
        j->ver[j->nver++] = (cver_t){amx_catalog_hash(NULL, 0), 0};
    j->next = co->jobs;
    co->jobs = j;
    co->njobs++;
    return j;
}

/* Offers this large give their memory back to the system when freed: the
 * first agreement of a big catalog would otherwise leave the coordinator's
 * resident size at its peak (the request, its parse and the offer). */
#define TRIM_SPECS 16384

static void offers_clear(cjob_t *j)
{
    size_t freed = 0;
    for (size_t i = 0; i < j->noffers; i++) {
        for (uint32_t k = 0; k < j->offers[i].n; k++)
            amx_qspec_free(j->offers[i].specs[k]);
        free(j->offers[i].specs);
        freed += j->offers[i].n;
    }
    j->noffers = 0;
    j->nasked = 0;
    if (freed >= TRIM_SPECS)
        malloc_trim(0);
}

static void job_free(cjob_t *j)
{
    free(j->sync_of);
    free(j->asked);
    free(j->name);
    free(j->host);
    free(j->dm);
    amx_membership_free(&j->mship);
    amx_catalog_free(j->master);
    for (size_t i = 0; i < j->nadded; i++)
        free(j->added[i]);
    free(j->added);
    free(j->ver);
    offers_clear(j);
    free(j->offers);
    free(j);
}

static int offer_asked(const cjob_t *j, uint64_t hash)
{
    for (size_t i = 0; i < j->nasked; i++)
        if (j->asked[i] == hash)
            return 1;
    return 0;
}

static coffer_t *offer_find(cjob_t *j, uint64_t hash)
{
    for (size_t i = 0; i < j->noffers; i++)
        if (j->offers[i].hash == hash)
            return &j->offers[i];
    return NULL;
}

/* Records an offer (copies of its specs), after checking that they are
 * what its hash says. */
static amx_status_t offer_add(amx_coord_t *co, cjob_t *j, const amx_coord_sync_req_t *req,
                              amx_err_t *err)
{
    size_t n = req->nprop;
    if (n != req->offer_count)
        return amx_err_set(err, AMX_EINVAL, "an offer of %u specs carries %zu", req->offer_count,
                           n);
    amx_qspec_t **specs = calloc(n ? n : 1, sizeof(*specs));
    if (specs == NULL ||
        amx_grow(&j->offers, &j->cap_offers, j->noffers + 1, sizeof(coffer_t), 4, 0) != 0) {
        free(specs);
        return amx_err_set(err, AMX_ENOMEM, "out of memory recording an offer");
    }
    for (size_t i = 0; i < n; i++)
        if ((specs[i] = amx_qspec_dup(req->proposals[i])) == NULL) {
            for (size_t k = 0; k < i; k++)
                amx_qspec_free(specs[k]);
            free(specs);
            return amx_err_set(err, AMX_ENOMEM, "out of memory recording an offer");
        }
    qsort(specs, n, sizeof(*specs), amx_qspec_name_cmp);
    if (amx_catalog_hash(specs, (uint32_t)n) != req->offer_hash) {
        for (size_t k = 0; k < n; k++)
            amx_qspec_free(specs[k]);
        free(specs);
        return amx_err_set(err, AMX_EINVAL,
                           "daemon %u's offer of %zu specs does not have the hash it names",
                           req->daemon, n);
    }
    j->offers[j->noffers++] = (coffer_t){req->offer_hash, specs, (uint32_t)n, req->daemon, 0};
    co->stats.specs_received += n;
    return AMX_OK;
}

/* The master changed: the names just agreed join the history, and a
 * version. */
static void note_version(cjob_t *j, const add_t *adds, size_t nadd)
{
    for (size_t a = 0; a < nadd; a++) {
        char *name = strdup(adds[a].spec->name);
        if (name == NULL ||
            amx_grow(&j->added, &j->cap_added, j->nadded + 1, sizeof(char *), 64, 0) != 0) {
            free(name);
            j->nver = 0; /* no deltas until the next version: whole catalogs */
            return;
        }
        j->added[j->nadded++] = name;
    }
    if (j->nver == KEEP_VERSIONS) {
        memmove(j->ver, j->ver + 1, (KEEP_VERSIONS - 1) * sizeof(cver_t));
        j->nver--;
    }
    if (amx_grow(&j->ver, &j->cap_ver, j->nver + 1, sizeof(cver_t), 8, 0) == 0)
        j->ver[j->nver++] = (cver_t){j->master->hash, j->nadded};
}

static cdaemon_t *daemon_of(cjob_t *j, uint32_t d)
{
    for (uint32_t i = 0; i < j->ndm; i++)
        if (j->dm[i].daemon == d)
            return &j->dm[i];
    return NULL;
}

/* Records daemon d; returns 1 when it is known with another incarnation. */
static int note_daemon(cjob_t *j, uint32_t d, uint64_t inc, const char *addr)
{
    cdaemon_t *x = daemon_of(j, d);
    if (x == NULL) {
        if (amx_grow(&j->dm, &j->cap_dm, j->ndm + 1, sizeof(*j->dm), 8, 0) != 0)
            return 0;
        x = &j->dm[j->ndm++];
        memset(x, 0, sizeof(*x));
        x->daemon = d;
        x->incarnation = inc;
        snprintf(x->addr, sizeof(x->addr), "%s", addr ? addr : "");
        j->mship_dirty = 1;
        return 0;
    }
    int restarted = x->incarnation != inc;
    if (restarted) {
        x->incarnation = inc;
        j->mship_dirty = 1;
    }
    if (addr != NULL && addr[0] != '\0' && strcmp(x->addr, addr) != 0) {
        snprintf(x->addr, sizeof(x->addr), "%s", addr);
        j->mship_dirty = 1;
    }
    return restarted;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* (Re)builds the membership of a ready job. */
static amx_status_t build_mship(amx_coord_t *co, cjob_t *j)
{
    if (!j->mship_dirty && j->mship.part != NULL)
        return AMX_OK;
    uint32_t *ds = malloc((j->world ? j->world : 1) * 4);
    if (ds == NULL)
        return AMX_ENOMEM;
    uint32_t nd = 0;
    for (uint32_t r = 0; r < j->world; r++)
        ds[nd++] = j->host[r] - 1;
    qsort(ds, nd, 4, cmp_u32);
    uint32_t u = 0;
    for (uint32_t i = 0; i < nd; i++)
        if (u == 0 || ds[u - 1] != ds[i])
            ds[u++] = ds[i];
    amx_membership_t m = {.world = j->world, .npart = u, .coord_inc = co->incarnation};
    m.part = calloc(u ? u : 1, sizeof(amx_part_t));
    if (m.part == NULL) {
        free(ds);
        return AMX_ENOMEM;
    }
    for (uint32_t p = 0; p < u; p++) {
        amx_part_t *x = &m.part[p];
        x->daemon = ds[p];
        cdaemon_t *d = daemon_of(j, ds[p]);
        if (d != NULL) {
            x->incarnation = d->incarnation;
            snprintf(x->addr, sizeof(x->addr), "%s", d->addr);
        }
    }
    /* Each participant's ranks, in rank order: O(world log participants). */
    uint32_t *cnt = calloc(u ? u : 1, sizeof(*cnt));
    int ok = cnt != NULL;
    for (uint32_t r = 0; ok && r < j->world; r++) {
        uint32_t d = j->host[r] - 1;
        uint32_t *at = bsearch(&d, ds, u, 4, cmp_u32);
        cnt[at - ds]++;
    }
    for (uint32_t p = 0; ok && p < u; p++)
        ok = (m.part[p].ranks = malloc((cnt[p] ? cnt[p] : 1) * 4)) != NULL;
    for (uint32_t r = 0; ok && r < j->world; r++) {
        uint32_t d = j->host[r] - 1;
        amx_part_t *x = &m.part[(uint32_t *)bsearch(&d, ds, u, 4, cmp_u32) - ds];
        x->ranks[x->nranks++] = r;
    }
    free(cnt);
    free(ds);
    if (!ok) {
        amx_membership_free(&m);
        return AMX_ENOMEM;
    }
    amx_membership_free(&j->mship);
    j->mship = m;
    j->mship_dirty = 0;
    return AMX_OK;
}

static void req_link(amx_coord_t *co, amx_creq_t *r)
{
    if (r->kind == REQ_SYNC) {
        r->job->sync_of[r->daemon] = r; /* room made by amx_coord_sync */
        r->job->nsync++;
    }
    r->prev = NULL;
    r->next = co->reqs;
    if (co->reqs)
        co->reqs->prev = r;
    co->reqs = r;
    co->nreqs++;
}

static void req_unlink(amx_coord_t *co, amx_creq_t *r)
{
    if (r->kind == REQ_SYNC && r->job->sync_of[r->daemon] == r) {
        r->job->sync_of[r->daemon] = NULL;
        r->job->nsync--;
    }
    if (r->prev)
        r->prev->next = r->next;
    else
        co->reqs = r->next;
    if (r->next)
        r->next->prev = r->prev;
    co->nreqs--;
}

static void req_free(amx_creq_t *r)
{
    for (size_t i = 0; i < r->nresets; i++)
        free(r->resets[i]);
    free(r->resets);
    free(r->key);
    free(r);
}

/* Answers a waiting request with an error and frees it. */
static void req_fail(amx_coord_t *co, amx_creq_t *r, amx_status_t st, const char *msg)
{
    req_unlink(co, r);
    if (r->kind == REQ_JOIN)
        r->cb.join(r->ud, st, msg, NULL);
    else if (r->kind == REQ_SYNC)
        r->cb.sync(r->ud, st, msg, NULL);
    else
        r->cb.kv(r->ud, st, msg, NULL, 0);
    req_free(r);
}

amx_coord_t *amx_coord_create(uint64_t incarnation, uint64_t join_timeout_ms)
{
    amx_coord_t *co = calloc(1, sizeof(*co));
    if (co != NULL) {
        co->incarnation = incarnation;
        co->started_ms = amx_now_ms();
        co->join_timeout_ms = join_timeout_ms;
    }
    return co;
}

static void kv_drop_prefix(amx_coord_t *co, const char *prefix)
{
    size_t n = strlen(prefix), k = 0;
    for (size_t i = 0; i < co->nkv; i++) {
        if (strncmp(co->kv[i].key, prefix, n) == 0) {
            free(co->kv[i].key);
            free(co->kv[i].val);
        } else {
            co->kv[k++] = co->kv[i];
        }
    }
    co->nkv = k;
    /* Indices moved: the map is made again (once per new communicator). */
    amx_strmap_free(&co->kvmap);
    memset(&co->kvmap, 0, sizeof(co->kvmap));
    for (size_t i = 0; i < co->nkv; i++)
        if (amx_strmap_put(&co->kvmap, co->kv[i].key, (uint32_t)i) != 0)
            AMX_ERROR("coord",
                      "out of memory indexing the key-value store; lookups of key '%s' fail",
                      co->kv[i].key);
}

void amx_coord_fail_all(amx_coord_t *co, const char *why)
{
    while (co->reqs != NULL)
        req_fail(co, co->reqs, AMX_EUNAVAIL, why);
}

void amx_coord_destroy(amx_coord_t *co)
{
    if (co == NULL)
        return;
    amx_coord_fail_all(co, "the coordinator is shutting down");
    while (co->jobs != NULL) {
        cjob_t *j = co->jobs;
        co->jobs = j->next;
        job_free(j);
    }
    kv_drop_prefix(co, "");
    amx_strmap_free(&co->kvmap);
    free(co->kv);
    free(co);
}

uint64_t amx_coord_incarnation(const amx_coord_t *co)
{
    return co->incarnation;
}

void amx_coord_set_notify(amx_coord_t *co, amx_coord_notify_fn fn, void *ud)
{
    co->notify = fn;
    co->notify_ud = ud;
}

/* ---- membership ---- */

static void missing_list(const cjob_t *j, char *buf, size_t len)
{
    size_t k = 0;
    int shown = 0, total = 0;
    buf[0] = '\0';
    for (uint32_t r = 0; r < j->world; r++) {
        if (j->host[r] != 0)
            continue;
        total++;
        if (shown < 16 && k < len) {
            k += (size_t)snprintf(buf + k, len - k, shown ? ", %u" : "%u", r);
            shown++;
        }
    }
    if (total > shown && k < len)
        snprintf(buf + k, len - k, " and %d more", total - shown);
}

static void complete_joins(amx_coord_t *co, cjob_t *j)
{
    if (build_mship(co, j) != AMX_OK) {
        for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
            next = r->next;
            if (r->kind == REQ_JOIN && r->job == j)
                req_fail(co, r, AMX_ENOMEM, "out of memory building the job's membership");
        }
        return;
    }
    for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
        next = r->next;
        if (r->kind != REQ_JOIN || r->job != j)
            continue;
        req_unlink(co, r);
        amx_membership_t m = j->mship;
        m.rejoined = 0;
        r->cb.join(r->ud, AMX_OK, NULL, &m);
        req_free(r);
    }
}

static void unjoin(amx_coord_t *co, cjob_t *j, uint32_t rank)
{
    if (j->ready || j->host[rank] == 0)
        return;
    j->host[rank] = 0;
    j->njoined--;
    if (j->njoined == 0) {
        for (cjob_t **p = &co->jobs; *p != NULL; p = &(*p)->next)
            if (*p == j) {
                *p = j->next;
                co->njobs--;
                break;
            }
        job_free(j);
    }
}

amx_status_t amx_coord_join(amx_coord_t *co, const amx_coord_join_req_t *req, amx_coord_join_cb cb,
                            void *ud, amx_creq_t **h, amx_err_t *err)
{
    *h = NULL;
    if (req->world == 0 || req->rank >= req->world)
        return amx_err_set(err, AMX_EINVAL, "rank %u is out of range for world size %u (job '%s')",
                           req->rank, req->world, req->job);
    cjob_t *j = find(co, req->job);
    if (j != NULL && j->world != req->world)
        return amx_err_set(err, AMX_EPRECOND,
                           "job '%s' exists with world size %u, not %u: every rank must declare "
                           "the same world size (or drop the old job with Reset(drop_job))",
                           req->job, j->world, req->world);
    if (j == NULL && (j = job_new(co, req->job, req->world)) == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory creating job '%s'", req->job);
    uint32_t prev = j->host[req->rank];
    if (prev != 0 && prev - 1 != req->daemon) {
        cdaemon_t *d = daemon_of(j, prev - 1);
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is served by daemon %u (%s): a rank stays with "
                           "the daemon it joined for the life of the job (drop the job to start "
                           "over)",
                           req->rank, req->job, prev - 1, d ? d->addr : "?");
    }
    int restarted = note_daemon(j, req->daemon, req->incarnation, req->addr);
    if (prev == 0) {
        j->host[req->rank] = req->daemon + 1;
        j->njoined++;
        j->mship_dirty = 1;
    }
    if (restarted && j->ready) {
        AMX_INFO("coord",
                 "job %s: daemon %u restarted (rank %u re-joined); its peers must agree "
                 "again",
                 j->name, req->daemon, req->rank);
        j->comm_dirty = 1;
        if (j->comm_gen != 0 && build_mship(co, j) == AMX_OK && co->notify != NULL)
            co->notify(co->notify_ud, j->name, &j->mship, req->daemon, j->comm_gen);
    }
    if (!j->ready && j->njoined == j->world) {
        j->ready = 1;
        AMX_INFO("coord", "job %s: all %u ranks joined", j->name, j->world);
    }
    if (j->ready || req->announce) {
        if (j->ready && build_mship(co, j) != AMX_OK)
            return amx_err_set(err, AMX_ENOMEM, "out of memory building the job's membership");
        amx_membership_t m = {0};
        if (j->ready) {
            m = j->mship;
            m.rejoined = prev != 0;
        }
        m.coord_inc = co->incarnation;
        cb(ud, AMX_OK, NULL, &m);
        if (j->ready)
            complete_joins(co, j);
        return AMX_OK;
    }
    amx_creq_t *r = calloc(1, sizeof(*r));
    if (r == NULL) {
        unjoin(co, j, req->rank);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    r->kind = REQ_JOIN;
    r->job = j;
    r->rank = req->rank;
    r->daemon = req->daemon;
    r->deadline = req->deadline_ms;
    r->cb.join = cb;
    r->ud = ud;
    req_link(co, r);
    *h = r;
    return AMX_OK;
}

/* ---- agreement ---- */

static int sync_waiting(amx_coord_t *co, cjob_t *j, uint32_t daemon, amx_creq_t **out)
{
    (void)co;
    amx_creq_t *r = daemon < j->cap_sync_of ? j->sync_of[daemon] : NULL;
    if (r != NULL && out != NULL)
        *out = r;
    return r != NULL;
}

static const char *daemon_ranks(cjob_t *j, uint32_t d, char *buf, size_t len)
{
    for (uint32_t p = 0; p < j->mship.npart; p++)
        if (j->mship.part[p].daemon == d) {
            char r[160];
            amx_fmt_ranks(r, sizeof(r), j->mship.part[p].ranks, j->mship.part[p].nranks);
            snprintf(buf, len, "daemon %u (ranks %s)", d, r);
            return buf;
        }
    snprintf(buf, len, "daemon %u", d);
    return buf;
}

/* Every participant is waiting: compute the one answer and give it to all. */
static void complete_sync(amx_coord_t *co, cjob_t *j)
{
    amx_creq_t **w = calloc(j->mship.npart, sizeof(*w));
    size_t nadd = 0, cap_add = 0, nrej = 0, nconf = 0, nres = 0;
    add_t *adds = NULL;
    amx_strmap_t add_idx = {0}, rej_idx = {0}, res_idx = {0}; /* name -> index */
    char **rej = NULL, **res = NULL;
    char conflict[1024] = "";
    amx_catalog_t *newcat = NULL;
    uint32_t *behind = NULL;
    amx_err_t err = {0};
    const char *oom = NULL;
    if (w == NULL) {
        oom = "out of memory";
        goto fail;
    }
    for (uint32_t p = 0; p < j->mship.npart; p++)
        sync_waiting(co, j, j->mship.part[p].daemon, &w[p]);
    const amx_catalog_t *master = j->master;
    /* 1. The offers of this round against the master and against each
     * other: each distinct one once, in the participants' order (so that
     * a conflict names the same daemons whatever the order of arrival).
     * An offer no waiting request names (superseded) is left out. */
    for (size_t o = 0; o < j->noffers; o++)
        j->offers[o].done = 0;
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        coffer_t *of = w[p]->offer_hash != 0 ? offer_find(j, w[p]->offer_hash) : NULL;
        if (of == NULL || of->done)
            continue;
        of->done = 1;
        uint32_t origin = w[p]->daemon; /* the first participant that offers it */
        for (size_t i = 0; i < of->n; i++) {
            amx_qspec_t *s = of->specs[i];
            int64_t k = master ? amx_catalog_find(master, s->name) : -1;
            const amx_qspec_t *other = NULL;
            uint32_t other_d = UINT32_MAX;
            if (k >= 0) {
                if (amx_qspec_equal(master->q[k], s))
                    continue;
                other = master->q[k];
            } else {
                uint32_t a;
                int known = amx_strmap_get(&add_idx, s->name, &a);
                if (known && amx_qspec_equal(adds[a].spec, s))
                    continue;
                if (known) {
                    other = adds[a].spec;
                    other_d = adds[a].origin;
                } else {
                    if (amx_grow(&adds, &cap_add, nadd + 1, sizeof(*adds), 64, 0) != 0) {
                        oom = "out of memory merging proposals";
                        goto fail;
                    }
                    if (amx_strmap_put(&add_idx, s->name, (uint32_t)nadd) != 0) {
                        oom = "out of memory merging proposals";
                        goto fail;
                    }
                    adds[nadd++] = (add_t){s, origin, &of->specs[i]};
                    continue;
                }
            }
            /* A conflict. */
            uint32_t seen;
            if (!amx_strmap_get(&rej_idx, s->name, &seen)) {
                char **q = realloc(rej, (nrej + 1) * sizeof(char *));
                if (q == NULL || (q[nrej] = strdup(s->name)) == NULL ||
                    amx_strmap_put(&rej_idx, q[nrej], (uint32_t)nrej) != 0) {
                    if (q != NULL && q[nrej] != NULL)
                        free(q[nrej]);
                    rej = q ? q : rej;
                    oom = "out of memory";
                    goto fail;
                }
                rej = q;
                nrej++;
            }
            if (nconf++ == 0) {
                char diff[512], d1[200], d2[200];
                amx_qspec_diff(other, s, diff, sizeof(diff));
                if (other_d == UINT32_MAX)
                    snprintf(d1, sizeof(d1), "the agreed catalog");
                else
                    daemon_ranks(j, other_d, d1, sizeof(d1));
                daemon_ranks(j, origin, d2, sizeof(d2));
                snprintf(conflict, sizeof(conflict),
                         "the catalog of job '%s' cannot be agreed: quantizer '%s' is declared "
                         "with %s by %s and by %s",
                         j->name, s->name, diff, d1, d2);
            }
        }
    }
    /* 1b. A peer group's mode is the group's: a proposal whose group
     * already has another mode (in the master, or in an earlier proposal)
     * is a conflict too. */
    {
        amx_strmap_t gm = {0}; /* group -> index: < n0 master, else n0 + add */
        uint32_t n0 = master ? master->n : 0;
        if (amx_strmap_reserve(&gm, n0 + nadd) != 0) {
            oom = "out of memory checking peer groups";
            goto fail;
        }
        for (uint32_t i = 0; i < n0; i++)
            if (master->q[i]->peer_group[0] != '\0')
                amx_strmap_put(&gm, master->q[i]->peer_group, i);
        for (size_t a = 0; a < nadd; a++) {
            const amx_qspec_t *s = adds[a].spec;
            uint32_t k, dummy;
            if (s->peer_group[0] == '\0' || amx_strmap_get(&rej_idx, s->name, &dummy))
                continue;
            if (!amx_strmap_get(&gm, s->peer_group, &k)) {
                amx_strmap_put(&gm, s->peer_group, n0 + (uint32_t)a);
                continue;
            }
            const amx_qspec_t *o = k < n0 ? master->q[k] : adds[k - n0].spec;
            if (o->peer_mode == s->peer_mode)
                continue;
            char **q = realloc(rej, (nrej + 1) * sizeof(char *));
            if (q == NULL || (q[nrej] = strdup(s->name)) == NULL ||
                amx_strmap_put(&rej_idx, q[nrej], (uint32_t)nrej) != 0) {
                if (q != NULL && q[nrej] != NULL)
                    free(q[nrej]);
                rej = q ? q : rej;
                amx_strmap_free(&gm);
                oom = "out of memory";
                goto fail;
            }
            rej = q;
            nrej++;
            if (nconf++ == 0) {
                char d1[200], d2[200];
                if (k < n0)
                    snprintf(d1, sizeof(d1), "the agreed catalog");
                else
                    daemon_ranks(j, adds[k - n0].origin, d1, sizeof(d1));
                daemon_ranks(j, adds[a].origin, d2, sizeof(d2));
                snprintf(conflict, sizeof(conflict),
                         "the catalog of job '%s' cannot be agreed: peer group '%s' has peer_mode "
                         "%s (quantizer '%s', %s) and %s (quantizer '%s', %s); every member of a "
                         "peer group must declare the same peer_mode",
                         j->name, s->peer_group, amx_peer_mode_name(o->peer_mode), o->name, d1,
                         amx_peer_mode_name(s->peer_mode), s->name, d2);
            }
        }
        amx_strmap_free(&gm);
    }
    if (nconf > 0) {
        size_t n = strlen(conflict);
        if (nrej > 1)
            n += (size_t)snprintf(conflict + n, sizeof(conflict) - n,
                                  " (and %zu more quantizer(s) in conflict)", nrej - 1);
        snprintf(conflict + n, sizeof(conflict) - n,
                 "; every rank must declare the same spec: the conflicting registrations were "
                 "dropped, register them again consistently");
    }
    /* 2. The new master: the old one plus the proposals not in conflict. */
    size_t keep = 0;
    uint32_t dummy;
    for (size_t a = 0; a < nadd; a++)
        if (!amx_strmap_get(&rej_idx, adds[a].spec->name, &dummy))
            adds[keep++] = adds[a];
    nadd = keep;
    if (nadd > 0 || master == NULL) {
        /* The new specs move from the offers (which go at the end of the
         * round) and the master's own move over: nothing is copied, so
         * the coordinator holds one copy of each spec. */
        amx_qspec_t **fresh = calloc(nadd + 1, sizeof(*fresh));
        int ok = fresh != NULL;
        for (size_t a = 0; ok && a < nadd; a++) {
            fresh[a] = *adds[a].slot;
            *adds[a].slot = NULL;
        }
        uint32_t n0 = master ? master->n : 0;
        amx_qspec_t **specs = ok ? malloc((n0 + nadd + 1) * sizeof(*specs)) : NULL;
        if (specs == NULL) {
            for (size_t a = 0; fresh != NULL && a < nadd; a++)
                amx_qspec_free(fresh[a]);
            free(fresh);
            oom = "out of memory building the master catalog";
            goto fail;
        }
        /* Both in name order, merged: the catalog is built without a sort. */
        qsort(fresh, nadd, sizeof(*fresh), amx_qspec_name_cmp);
        amx_qspec_t **old = NULL;
        if (master != NULL) {
            uint32_t got;
            old = amx_catalog_take_specs(j->master, &got);
            j->master = NULL;
            master = NULL;
        }
        size_t a = 0, b = 0, k = 0;
        while (a < n0 || b < nadd)
            specs[k++] = b == nadd || (a < n0 && amx_qspec_name_cmp(&old[a], &fresh[b]) < 0)
                             ? old[a++]
                             : fresh[b++];
        free(old);
        free(fresh);
        if (amx_catalog_build(specs, (uint32_t)(n0 + nadd), &newcat, &err) != AMX_OK) {
            /* Nothing sane remains of the job's agreement. */
            for (size_t i = 0; i < n0 + nadd; i++)
                amx_qspec_free(specs[i]);
            free(specs);
            oom = "out of memory building the master catalog";
            goto fail;
        }
        free(specs);
        j->master = newcat;
        newcat = NULL;
        note_version(j, adds, nadd);
    }
    /* 3. Resets of every daemon, names of the master only. */
    for (uint32_t p = 0; p < j->mship.npart; p++)
        for (size_t i = 0; i < w[p]->nresets; i++) {
            const char *s = w[p]->resets[i];
            if (amx_catalog_find(j->master, s) < 0 || amx_strmap_get(&res_idx, s, &dummy))
                continue;
            char **q = realloc(res, (nres + 1) * sizeof(char *));
            if (q == NULL || amx_strmap_put(&res_idx, s, (uint32_t)nres) != 0) {
                res = q ? q : res;
                oom = "out of memory";
                goto fail;
            }
            res = q;
            res[nres++] = w[p]->resets[i]; /* borrowed until the answers are given */
        }
    /* 4. Who is behind, and who gives them the state. */
    uint64_t target = 0;
    for (uint32_t p = 0; p < j->mship.npart; p++)
        if (w[p]->last_reconciled > target)
            target = w[p]->last_reconciled;
    uint32_t donor = UINT32_MAX;
    size_t nbehind = 0;
    behind = calloc(j->mship.npart, sizeof(uint32_t));
    if (behind == NULL) {
        oom = "out of memory";
        goto fail;
    }
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        if (w[p]->last_reconciled < target)
            behind[nbehind++] = w[p]->daemon;
        else if (donor == UINT32_MAX)
            donor = w[p]->daemon;
    }
    /* 5. The communicator. */
    int new_comm = j->comm_dirty || j->comm_gen == 0;
    for (uint32_t p = 0; p < j->mship.npart; p++)
        new_comm |= w[p]->need_comm;
    if (new_comm) {
        char prefix[200];
        snprintf(prefix, sizeof(prefix), "comm/%s/", j->name);
        kv_drop_prefix(co, prefix);
        j->comm_gen++;
        j->comm_dirty = 0;
    }
    j->seq++;
    AMX_INFO("coord",
             "job %s: agreement %llu: %u quantizers (%zu new%s), epoch %llu, %zu "
             "behind, communicator generation %llu%s",
             j->name, (unsigned long long)j->seq, j->master->n, nadd, nconf ? ", conflicts" : "",
             (unsigned long long)target, nbehind, (unsigned long long)j->comm_gen,
             new_comm ? " (new)" : "");
    amx_coord_sync_ans_t ans = {
        .seq = j->seq,
        .catalog_hash = j->master->hash,
        .catalog = j->master,
        .rejected = rej,
        .nrejected = nrej,
        .conflict = nconf ? conflict : NULL,
        .resets = res,
        .nresets = nres,
        .target_epoch = target,
        .donor = donor,
        .behind = behind,
        .nbehind = nbehind,
        .comm_gen = j->comm_gen,
        .new_comm = new_comm,
        .members = &j->mship,
        .members_hash = amx_membership_hash(&j->mship),
        .coord_inc = co->incarnation,
        .versions = j->ver,
        .nversions = j->nver,
        .added = (const char *const *)j->added,
        .nadded = j->nadded,
        .stats = &co->stats,
        .round = ++co->stats.rounds,
    };
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        req_unlink(co, w[p]);
        w[p]->cb.sync(w[p]->ud, AMX_OK, NULL, &ans);
    }
    for (uint32_t p = 0; p < j->mship.npart; p++)
        req_free(w[p]);
    offers_clear(j); /* the round is over */
    goto out;
fail:
    AMX_ERROR("coord", "job %s: agreement failed: %s", j->name, oom);
    for (uint32_t p = 0; w != NULL && p < j->mship.npart; p++)
        req_fail(co, w[p], AMX_ENOMEM, oom);
out:
    amx_strmap_free(&add_idx);
    amx_strmap_free(&rej_idx);
    amx_strmap_free(&res_idx);
    free(w);
    free(adds);
    for (size_t i = 0; i < nrej; i++)
        free(rej[i]);
    free(rej);
    free(res);
    free(behind);
    amx_catalog_free(newcat);
}

static void try_sync(amx_coord_t *co, cjob_t *j)
{
    if (!j->ready || build_mship(co, j) != AMX_OK || j->nsync < j->mship.npart)
        return;
    for (uint32_t p = 0; p < j->mship.npart; p++)
        if (!sync_waiting(co, j, j->mship.part[p].daemon, NULL))
            return;
    /* Everyone is here: an offer that another daemon was asked for but
     * never sent (it went away, or was superseded) is asked of each
     * participant that waits on it; the round completes when they resend. */
    int missing = 0;
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        amx_creq_t *r = NULL;
        sync_waiting(co, j, j->mship.part[p].daemon, &r);
        if (r == NULL || r->offer_hash == 0 || offer_find(j, r->offer_hash) != NULL)
            continue;
        missing = 1;
        co->stats.offers_asked++;
        req_unlink(co, r);
        amx_coord_sync_ans_t ans = {.send_offer = 1, .coord_inc = co->incarnation};
        r->cb.sync(r->ud, AMX_OK, NULL, &ans);
        req_free(r);
    }
    if (!missing)
        complete_sync(co, j);
}

amx_status_t amx_coord_sync(amx_coord_t *co, const amx_coord_sync_req_t *req, amx_coord_sync_cb cb,
                            void *ud, amx_creq_t **h, amx_err_t *err)
{
    *h = NULL;
    cjob_t *j = find(co, req->job);
    if (j == NULL) {
        /* Unknown here: the coordinator restarted (or the job was dropped
         * meanwhile). Rebuild the membership from what the daemons say. */
        if (req->world == 0 || req->nranks == 0)
            return amx_err_set(err, AMX_ENOTFOUND, "job '%s' is not known to the coordinator",
                               req->job);
        if ((j = job_new(co, req->job, req->world)) == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        AMX_INFO("coord", "job %s: rebuilding its membership from daemon %u's agreement request",
                 req->job, req->daemon);
    }
    if (req->world != 0 && req->world != j->world)
        return amx_err_set(err, AMX_EPRECOND, "job '%s' has world size %u here, not %u", req->job,
                           j->world, req->world);
    for (uint32_t k = 0; k < req->nranks; k++) {
        uint32_t r = req->ranks[k];
        if (r >= j->world)
            return amx_err_set(err, AMX_EINVAL, "rank %u is out of range for job '%s'", r,
                               req->job);
        if (j->host[r] != 0 && j->host[r] - 1 != req->daemon)
            return amx_err_set(err, AMX_EPRECOND,
                               "daemon %u claims rank %u of job '%s', which daemon %u serves",
                               req->daemon, r, req->job, j->host[r] - 1);
    }
    for (uint32_t k = 0; k < req->nranks; k++)
        if (j->host[req->ranks[k]] == 0) {
            j->host[req->ranks[k]] = req->daemon + 1;
            j->njoined++;
            j->mship_dirty = 1;
        }
    if (note_daemon(j, req->daemon, req->incarnation, req->addr))
        j->comm_dirty = 1;
    if (!j->ready && j->njoined == j->world) {
        j->ready = 1;
        AMX_INFO("coord", "job %s: all %u ranks known again (from daemon %u's agreement request)",
                 j->name, j->world, req->daemon);
        /* Trainers of a daemon that restarted with the coordinator wait in
         * Join for ranks the other daemons' agreement requests named. */
        complete_joins(co, j);
    }
    if (j->ready && daemon_of(j, req->daemon) != NULL) {
        int member = 0;
        for (uint32_t r = 0; r < j->world; r++)
            member |= j->host[r] - 1 == req->daemon;
        if (!member)
            return amx_err_set(err, AMX_EPRECOND,
                               "daemon %u hosts no rank of job '%s' and takes no part in it",
                               req->daemon, req->job);
    }
    /* A daemon whose agreed catalog this coordinator does not hold must
     * send it whole first: otherwise what only its ranks registered would
     * be missing from the master, and every daemon would drop it. */
    uint64_t master_hash = j->master != NULL ? j->master->hash : amx_catalog_hash(NULL, 0);
    if (!req->full_catalog && req->catalog_hash != master_hash) {
        AMX_INFO("coord",
                 "job %s: daemon %u holds catalog %016llx, not the master %016llx: asking for it "
                 "whole",
                 j->name, req->daemon, (unsigned long long)req->catalog_hash,
                 (unsigned long long)master_hash);
        co->stats.catalogs_asked++;
        amx_coord_sync_ans_t ans = {.send_catalog = 1, .coord_inc = co->incarnation};
        cb(ud, AMX_OK, NULL, &ans);
        return AMX_OK;
    }
    /* Its offer, by hash: the coordinator keeps one copy per distinct
     * offer of the round, and asks for the specs only when it has none
     * and has not asked another daemon for the same offer already (then
     * this request waits; should that offer still be missing when every
     * participant has arrived, try_sync asks this daemon). */
    if (req->offer_count > 0 && offer_find(j, req->offer_hash) == NULL) {
        if (!req->offer_included && !offer_asked(j, req->offer_hash)) {
            if (amx_grow(&j->asked, &j->cap_asked, j->nasked + 1, sizeof(*j->asked), 8, 0) != 0)
                return amx_err_set(err, AMX_ENOMEM, "out of memory");
            j->asked[j->nasked++] = req->offer_hash;
            co->stats.offers_asked++;
            amx_coord_sync_ans_t ans = {.send_offer = 1, .coord_inc = co->incarnation};
            cb(ud, AMX_OK, NULL, &ans);
            return AMX_OK;
        }
        if (req->offer_included)
            AMX_CHECK(offer_add(co, j, req, err));
    } else if (req->offer_included) {
        co->stats.offers_known++; /* sent anyway (small), already held */
    }
    if (amx_grow(&j->sync_of, &j->cap_sync_of, (size_t)req->daemon + 1, sizeof(*j->sync_of), 16,
                 1) != 0)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    co->stats.syncs++;
    amx_creq_t *old;
    if (sync_waiting(co, j, req->daemon, &old))
        req_fail(co, old, AMX_EABORTED, "superseded by a newer agreement request");
    amx_creq_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    r->kind = REQ_SYNC;
    r->job = j;
    r->daemon = req->daemon;
    r->incarnation = req->incarnation;
    r->last_reconciled = req->last_reconciled;
    r->catalog_hash = req->catalog_hash;
    r->offer_hash = req->offer_count > 0 ? req->offer_hash : 0;
    r->need_comm = req->need_comm;
    r->full = req->full_catalog;
    r->deadline = req->deadline_ms;
    r->cb.sync = cb;
    r->ud = ud;
    r->resets = calloc(req->nresets ? req->nresets : 1, sizeof(char *));
    int ok = r->resets != NULL;
    for (size_t i = 0; ok && i < req->nresets; i++)
        ok = (r->resets[r->nresets++] = strdup(req->resets[i])) != NULL;
    if (!ok) {
        req_free(r);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    req_link(co, r);
    *h = r;
    try_sync(co, j);
    if (!sync_waiting(co, j, req->daemon, NULL))
        *h = NULL; /* answered already */
    return AMX_OK;
}

/* ---- key-value store ---- */

static kv_entry_t *kv_find(amx_coord_t *co, const char *key)
{
    uint32_t i;
    return amx_strmap_get(&co->kvmap, key, &i) ? &co->kv[i] : NULL;
}

void amx_coord_kv_set(amx_coord_t *co, const char *key, const void *val, size_t len)
{
    kv_entry_t *e = kv_find(co, key);
    void *copy = malloc(len ? len : 1);
    if (copy == NULL)
        return;
    if (len > 0)
        memcpy(copy, val, len);
    if (e == NULL) {
        if (amx_grow(&co->kv, &co->cap_kv, co->nkv + 1, sizeof(*co->kv), 64, 0) != 0) {
            free(copy);
            return;
        }
        e = &co->kv[co->nkv];
        if ((e->key = strdup(key)) == NULL ||
            amx_strmap_put(&co->kvmap, e->key, (uint32_t)co->nkv) != 0) {
            free(e->key);
            free(copy);
            return;
        }
        co->nkv++;
    } else {
        free(e->val);
    }
    e->val = copy;
    e->len = len;
    for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
        next = r->next;
        if (r->kind != REQ_KVGET || strcmp(r->key, key) != 0)
            continue;
        req_unlink(co, r);
        r->cb.kv(r->ud, AMX_OK, NULL, e->val, e->len);
        req_free(r);
    }
}

amx_status_t amx_coord_kv_get(amx_coord_t *co, const char *key, uint64_t deadline_ms,
                              amx_coord_kv_cb cb, void *ud, amx_creq_t **h, amx_err_t *err)
{
    *h = NULL;
    kv_entry_t *e = kv_find(co, key);
    if (e != NULL) {
        cb(ud, AMX_OK, NULL, e->val, e->len);
        return AMX_OK;
    }
    amx_creq_t *r = calloc(1, sizeof(*r));
    if (r == NULL || (r->key = strdup(key)) == NULL) {
        free(r);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    r->kind = REQ_KVGET;
    r->deadline = deadline_ms;
    r->cb.kv = cb;
    r->ud = ud;
    req_link(co, r);
    *h = r;
    return AMX_OK;
}

/* ---- common ---- */

void amx_coord_cancel(amx_coord_t *co, amx_creq_t *r)
{
    req_unlink(co, r);
    if (r->kind == REQ_JOIN)
        unjoin(co, r->job, r->rank);
    req_free(r);
}

void amx_coord_expire(amx_coord_t *co, uint64_t now_ms)
{
    char msg[1024], missing[256], who[512];
    for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
        next = r->next;
        if (r->deadline > now_ms)
            continue;
        if (r->kind == REQ_JOIN) {
            cjob_t *j = r->job;
            missing_list(j, missing, sizeof(missing));
            uint64_t up = now_ms > co->started_ms ? now_ms - co->started_ms : 0;
            if (missing[0] != '\0') {
                int k =
                    snprintf(msg, sizeof(msg),
                             "Join of rank %u to job '%s' timed out after %llu ms: ranks %s "
                             "never joined (check that every trainer of the job started and "
                             "uses the same world size)",
                             r->rank, j->name, (unsigned long long)co->join_timeout_ms, missing);
                if (up < 2 * co->join_timeout_ms + 1000 && k > 0 && (size_t)k < sizeof(msg))
                    snprintf(msg + k, sizeof(msg) - (size_t)k,
                             "; this coordinator started %llu ms ago: if it restarted, ranks "
                             "that had joined before are known again when their daemons next "
                             "reach it, at their trainers' next Reconcile",
                             (unsigned long long)up);
            } else
                snprintf(msg, sizeof(msg),
                         "Join of rank %u to job '%s' timed out after %llu ms although every "
                         "rank is known to the coordinator (this is a bug: please report it "
                         "with the daemons' logs)",
                         r->rank, j->name, (unsigned long long)co->join_timeout_ms);
            uint32_t rank = r->rank;
            next = r->next;
            req_fail(co, r, AMX_ETIMEDOUT, msg);
            unjoin(co, j, rank);
            next = co->reqs; /* the list may have changed */
            continue;
        }
        if (r->kind == REQ_SYNC) {
            cjob_t *j = r->job;
            size_t k = 0;
            who[0] = '\0';
            if (build_mship(co, j) == AMX_OK)
                for (uint32_t p = 0; p < j->mship.npart && k < sizeof(who); p++) {
                    if (sync_waiting(co, j, j->mship.part[p].daemon, NULL))
                        continue;
                    char rk[160];
                    amx_fmt_ranks(rk, sizeof(rk), j->mship.part[p].ranks, j->mship.part[p].nranks);
                    k += (size_t)snprintf(who + k, sizeof(who) - k, "%sdaemon %u (%s, ranks %s)",
                                          k ? ", " : "", j->mship.part[p].daemon,
                                          j->mship.part[p].addr, rk);
                }
            if (!j->ready) {
                missing_list(j, missing, sizeof(missing));
                snprintf(msg, sizeof(msg),
                         "the agreement of job '%s' timed out: the coordinator does not know "
                         "where ranks %s are (it restarted, and their daemons have not come back)",
                         j->name, missing);
            } else {
                snprintf(msg, sizeof(msg), "the agreement of job '%s' timed out waiting for %s",
                         j->name, who[0] ? who : "other daemons");
            }
            req_fail(co, r, AMX_ETIMEDOUT, msg);
            next = co->reqs;
            continue;
        }
        snprintf(msg, sizeof(msg), "key '%s' was not set in time", r->key);
        req_fail(co, r, AMX_ETIMEDOUT, msg);
        next = co->reqs;
    }
}

amx_status_t amx_coord_drop(amx_coord_t *co, const char *job, amx_membership_t *m)
{
    cjob_t *j = find(co, job);
    memset(m, 0, sizeof(*m));
    if (j == NULL)
        return AMX_ENOTFOUND;
    if (j->ready && build_mship(co, j) == AMX_OK)
        amx_membership_copy(&j->mship, m);
    for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
        next = r->next;
        if ((r->kind == REQ_JOIN || r->kind == REQ_SYNC) && r->job == j) {
            req_fail(co, r, AMX_EABORTED,
                     "the job was dropped (Reset(drop_job) on a daemon of the cluster); join "
                     "again to start it over");
            next = co->reqs;
        }
    }
    char prefix[200];
    snprintf(prefix, sizeof(prefix), "comm/%s/", job);
    kv_drop_prefix(co, prefix);
    for (cjob_t **p = &co->jobs; *p != NULL; p = &(*p)->next)
        if (*p == j) {
            *p = j->next;
            co->njobs--;
            break;
        }
    job_free(j);
    return AMX_OK;
}

amx_status_t amx_coord_members(amx_coord_t *co, const char *job, amx_membership_t *m)
{
    cjob_t *j = find(co, job);
    memset(m, 0, sizeof(*m));
    if (j == NULL || !j->ready || build_mship(co, j) != AMX_OK)
        return AMX_ENOTFOUND;
    return amx_membership_copy(&j->mship, m);
}

void amx_coord_counts(const amx_coord_t *co, uint32_t *jobs, uint32_t *waiting, uint32_t *keys)
{
    *jobs = co->njobs;
    *waiting = co->nreqs;
    *keys = (uint32_t)co->nkv;
}

const amx_coord_stats_t *amx_coord_stats(const amx_coord_t *co)
{
    return &co->stats;
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

uint64_t amx_membership_hash(const amx_membership_t *m)
{
    uint64_t h = 0xcbf29ce484222325ull;
    h = fnv(h, &m->world, sizeof(m->world));
    h = fnv(h, &m->npart, sizeof(m->npart));
    for (uint32_t p = 0; p < m->npart; p++) {
        const amx_part_t *x = &m->part[p];
        h = fnv(h, &x->daemon, sizeof(x->daemon));
        h = fnv(h, &x->incarnation, sizeof(x->incarnation));
        h = fnv(h, x->addr, strlen(x->addr) + 1);
        h = fnv(h, &x->nranks, sizeof(x->nranks));
        h = fnv(h, x->ranks, x->nranks * sizeof(uint32_t));
    }
    return h;
}
