/*
 * coord.c - the coordinator: its jobs, membership and Join, the key-value
 * store, expiry and drops (coord.h; the agreement barrier is coord_agree.c).
 * Loop thread only; no I/O of its own.
 */
#include "coord_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "grow.h"
#include "log.h"
#include "strmap.h"

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

cjob_t *amx__coord_find(amx_coord_t *co, const char *name)
{
    for (cjob_t *j = co->jobs; j != NULL; j = j->next)
        if (strcmp(j->name, name) == 0)
            return j;
    return NULL;
}

cjob_t *amx__coord_job_new(amx_coord_t *co, const char *name, uint32_t world)
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
    /* Agreement numbers never repeat within this coordinator process, also
     * for a job dropped and made again: a late Abort names one (engine.c). */
    j->seq = co->stats.rounds;
    /* Version 0: the empty catalog (a daemon that has none gets it all). */
    j->master.view.hash = amx_catalog_hash(NULL, 0);
    if (amx_grow(&j->ver, &j->cap_ver, 1, sizeof(cver_t), 8, 0) == 0)
        j->ver[j->nver++] = (cver_t){j->master.view.hash, 0};
    j->next = co->jobs;
    co->jobs = j;
    co->njobs++;
    return j;
}

static void job_free(cjob_t *j)
{
    free(j->sync_of);
    free(j->asked);
    free(j->name);
    free(j->host);
    free(j->dm);
    free(j->dm_at);
    amx_membership_free(&j->mship);
    amx__coord_master_free(&j->master);
    free(j->ver);
    amx__coord_offers_clear(j);
    free(j->offers);
    free(j);
}

cdaemon_t *amx__coord_daemon_of(cjob_t *j, uint32_t d)
{
    return d < j->cap_dm_at && j->dm_at[d] != 0 ? &j->dm[j->dm_at[d] - 1] : NULL;
}

/* Records daemon d; returns 1 when it is known with another incarnation. */
int amx__coord_note_daemon(cjob_t *j, uint32_t d, uint64_t inc, const char *addr)
{
    cdaemon_t *x = amx__coord_daemon_of(j, d);
    if (x == NULL) {
        if (amx_grow(&j->dm, &j->cap_dm, j->ndm + 1, sizeof(*j->dm), 8, 0) != 0 ||
            amx_grow(&j->dm_at, &j->cap_dm_at, (size_t)d + 1, sizeof(*j->dm_at), 16, 1) != 0)
            return 0;
        j->dm_at[d] = j->ndm + 1;
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
amx_status_t amx__coord_build_mship(amx_coord_t *co, cjob_t *j)
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
        cdaemon_t *d = amx__coord_daemon_of(j, ds[p]);
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

void amx__coord_req_link(amx_coord_t *co, amx_creq_t *r)
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

void amx__coord_req_unlink(amx_coord_t *co, amx_creq_t *r)
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

void amx__coord_req_free(amx_creq_t *r)
{
    for (size_t i = 0; i < r->nresets; i++)
        free(r->resets[i]);
    free(r->resets);
    free(r->key);
    free(r);
}

/* Answers a waiting request with an error and frees it. */
void amx__coord_req_fail(amx_coord_t *co, amx_creq_t *r, amx_status_t st, const char *msg)
{
    amx__coord_req_unlink(co, r);
    if (r->kind == REQ_JOIN)
        r->cb.join(r->ud, st, msg, NULL);
    else if (r->kind == REQ_SYNC)
        r->cb.sync(r->ud, st, msg, NULL);
    else
        r->cb.kv(r->ud, st, msg, NULL, 0);
    amx__coord_req_free(r);
}

amx_coord_t *amx_coord_create(uint64_t incarnation, uint64_t join_timeout_ms)
{
    amx_coord_t *co = calloc(1, sizeof(*co));
    if (co != NULL) {
        co->active = 1;
        co->incarnation = incarnation;
        co->started_ms = amx_now_ms();
        co->join_timeout_ms = join_timeout_ms;
    }
    return co;
}

void amx__coord_kv_drop_prefix(amx_coord_t *co, const char *prefix)
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
        amx__coord_req_fail(co, co->reqs, AMX_EUNAVAIL, why);
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
    amx__coord_kv_drop_prefix(co, "");
    amx_strmap_free(&co->kvmap);
    free(co->kv);
    free(co);
}

void amx_coord_step_down(amx_coord_t *co, const char *why)
{
    amx_coord_fail_all(co, why);
    while (co->jobs != NULL) {
        cjob_t *j = co->jobs;
        co->jobs = j->next;
        job_free(j);
    }
    co->njobs = 0;
    amx__coord_kv_drop_prefix(co, "");
    co->active = 0;
}

void amx_coord_take_over(amx_coord_t *co, uint64_t incarnation)
{
    if (co->active)
        return;
    /* The counters go on (the round number keys shared answers: it never
     * repeats in this process). */
    co->incarnation = incarnation;
    co->started_ms = amx_now_ms();
    co->active = 1;
}

int amx_coord_active(const amx_coord_t *co)
{
    return co != NULL && co->active;
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

void amx__coord_complete_joins(amx_coord_t *co, cjob_t *j)
{
    if (amx__coord_build_mship(co, j) != AMX_OK) {
        for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
            next = r->next;
            if (r->kind == REQ_JOIN && r->job == j)
                amx__coord_req_fail(co, r, AMX_ENOMEM,
                                    "out of memory building the job's membership");
        }
        return;
    }
    for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
        next = r->next;
        if (r->kind != REQ_JOIN || r->job != j)
            continue;
        amx__coord_req_unlink(co, r);
        amx_membership_t m = j->mship;
        m.rejoined = 0;
        r->cb.join(r->ud, AMX_OK, NULL, &m);
        amx__coord_req_free(r);
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
    cjob_t *j = amx__coord_find(co, req->job);
    if (j != NULL && j->world != req->world)
        return amx_err_set(err, AMX_EPRECOND,
                           "job '%s' exists with world size %u, not %u: every rank must declare "
                           "the same world size (or drop the old job with Reset(drop_job))",
                           req->job, j->world, req->world);
    if (j == NULL && (j = amx__coord_job_new(co, req->job, req->world)) == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory creating job '%s'", req->job);
    uint32_t prev = j->host[req->rank];
    if (prev != 0 && prev - 1 != req->daemon) {
        cdaemon_t *d = amx__coord_daemon_of(j, prev - 1);
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is served by daemon %u (%s): a rank stays with "
                           "the daemon it joined for the life of the job (drop the job to start "
                           "over)",
                           req->rank, req->job, prev - 1, d ? d->addr : "?");
    }
    int restarted = amx__coord_note_daemon(j, req->daemon, req->incarnation, req->addr);
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
        if (j->comm_gen != 0 && amx__coord_build_mship(co, j) == AMX_OK && co->notify != NULL)
            co->notify(co->notify_ud, j->name, &j->mship, req->daemon, j->comm_gen);
    }
    if (!j->ready && j->njoined == j->world) {
        j->ready = 1;
        AMX_INFO("coord", "job %s: all %u ranks joined", j->name, j->world);
    }
    if (j->ready || req->announce) {
        if (j->ready && amx__coord_build_mship(co, j) != AMX_OK)
            return amx_err_set(err, AMX_ENOMEM, "out of memory building the job's membership");
        amx_membership_t m = {0};
        if (j->ready) {
            m = j->mship;
            m.rejoined = prev != 0;
        }
        m.coord_inc = co->incarnation;
        cb(ud, AMX_OK, NULL, &m);
        if (j->ready)
            amx__coord_complete_joins(co, j);
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
    amx__coord_req_link(co, r);
    *h = r;
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
        amx__coord_req_unlink(co, r);
        r->cb.kv(r->ud, AMX_OK, NULL, e->val, e->len);
        amx__coord_req_free(r);
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
    amx__coord_req_link(co, r);
    *h = r;
    return AMX_OK;
}

/* ---- common ---- */

void amx_coord_cancel(amx_coord_t *co, amx_creq_t *r)
{
    amx__coord_req_unlink(co, r);
    if (r->kind == REQ_JOIN)
        unjoin(co, r->job, r->rank);
    amx__coord_req_free(r);
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
            amx__coord_req_fail(co, r, AMX_ETIMEDOUT, msg);
            unjoin(co, j, rank);
            next = co->reqs; /* the list may have changed */
            continue;
        }
        if (r->kind == REQ_SYNC) {
            cjob_t *j = r->job;
            size_t k = 0;
            who[0] = '\0';
            if (amx__coord_build_mship(co, j) == AMX_OK)
                for (uint32_t p = 0; p < j->mship.npart && k < sizeof(who); p++) {
                    if (amx__coord_sync_waiting(co, j, j->mship.part[p].daemon, NULL))
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
                         "the agreement of job '%s' timed out: no daemon hosting ranks %s sent "
                         "this coordinator an agreement request (it restarted or took the role "
                         "over, and it learns where ranks are from those requests: their "
                         "daemons are down, or their trainers did not enter Reconcile)",
                         j->name, missing);
            } else {
                snprintf(msg, sizeof(msg), "the agreement of job '%s' timed out waiting for %s",
                         j->name, who[0] ? who : "other daemons");
            }
            amx__coord_req_fail(co, r, AMX_ETIMEDOUT, msg);
            next = co->reqs;
            continue;
        }
        snprintf(msg, sizeof(msg), "key '%s' was not set in time", r->key);
        amx__coord_req_fail(co, r, AMX_ETIMEDOUT, msg);
        next = co->reqs;
    }
}

amx_status_t amx_coord_drop(amx_coord_t *co, const char *job, amx_membership_t *m)
{
    cjob_t *j = amx__coord_find(co, job);
    memset(m, 0, sizeof(*m));
    if (j == NULL)
        return AMX_ENOTFOUND;
    if (j->ready && amx__coord_build_mship(co, j) == AMX_OK)
        amx_membership_copy(&j->mship, m);
    for (amx_creq_t *r = co->reqs, *next; r != NULL; r = next) {
        next = r->next;
        if ((r->kind == REQ_JOIN || r->kind == REQ_SYNC) && r->job == j) {
            amx__coord_req_fail(
                co, r, AMX_EABORTED,
                "the job was dropped (Reset(drop_job) on a daemon of the cluster); join "
                "again to start it over");
            next = co->reqs;
        }
    }
    char prefix[200];
    snprintf(prefix, sizeof(prefix), "comm/%s/", job);
    amx__coord_kv_drop_prefix(co, prefix);
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
    cjob_t *j = amx__coord_find(co, job);
    memset(m, 0, sizeof(*m));
    if (j == NULL || !j->ready || amx__coord_build_mship(co, j) != AMX_OK)
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
