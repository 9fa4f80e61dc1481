/*
 * job.c - jobs and their local ranks as this daemon holds them (job.h):
 * creation and teardown, Join (through the coordinator), Reset and
 * drop, and the calls deferred while an epoch is in flight.
 */
#include "registry_impl.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bytebuf.h"
#include "clock.h"
#include "coord.h"
#include "log.h"
#include "snapshot.h"
#include "state.h"

typedef struct join_ctx {
    amx_registry_t *reg;
    amx_job_t *job;
    uint32_t rank;
} join_ctx_t;

/* The node a rank lives on, for messages: "daemon 1 (host:port)". */
static void fmt_rank_home(const amx_job_t *j, uint32_t r, char *buf, size_t len)
{
    for (uint32_t p = 0; p < j->mship.npart; p++)
        for (uint32_t k = 0; k < j->mship.part[p].nranks; k++)
            if (j->mship.part[p].ranks[k] == r) {
                snprintf(buf, len, "daemon %u (%s)", j->mship.part[p].daemon,
                         j->mship.part[p].addr);
                return;
            }
    snprintf(buf, len, "another daemon");
}

/* The job named in a request, which must exist and be ready; with
 * need_rank, the rank must be one of this daemon's. */
amx_status_t amx__ready_job(amx_registry_t *reg, const char *name, uint32_t rank, int need_rank,
                            amx_job_t **out, amx_err_t *err)
{
    if (name == NULL || !amx_valid_job_name(name))
        return amx_err_set(err, AMX_EINVAL,
                           "job name '%s' is invalid: use 1-%d characters of [A-Za-z0-9._-]",
                           name ? name : "", AMX_MAX_JOB_NAME);
    amx_job_t *j = amx__find_job(reg, name);
    if (j == NULL)
        return amx_err_set(err, AMX_ENOTFOUND,
                           "job '%s' is not known to this daemon: call Join first", name);
    if (need_rank && rank >= j->world)
        return amx_err_set(err, AMX_EINVAL, "rank %u is out of range for job '%s' of world size %u",
                           rank, name, j->world);
    if (!j->ready) {
        uint32_t joined = 0;
        for (uint32_t i = 0; i < j->nlocal; i++)
            joined += j->lr[i].joined;
        return amx_err_set(err, AMX_EPRECOND,
                           "job '%s' is not ready: %u of %u ranks have joined this daemon and "
                           "the job waits for all of them to join some daemon; wait for Join to "
                           "return",
                           name, joined, j->world);
    }
    if (need_rank && amx__local_rank(j, rank) == NULL) {
        char home[320];
        fmt_rank_home(j, rank, home, sizeof(home));
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' joined %s, not this daemon: a rank talks to the "
                           "daemon it joined",
                           rank, name, home);
    }
    j->last_active_ms = amx_now_ms();
    *out = j;
    return AMX_OK;
}

static void lrank_free(amx_job_t *j, amx_lrank_t *r)
{
    amx__dev_close_rank(j, r, "its rank or its job is gone");
    amx__slab_free(r->slab);
    r->slab = NULL;
    amx_replybuf_unref(r->answer);
    r->answer = NULL;
    free(r->pl_of);
    free(r->pls);
    free(r->pl_lid);
}

static void fail_deferred(amx_registry_t *reg, amx_job_t *j, amx_status_t st, const char *why)
{
    while (j->defer_head != NULL) {
        amx_deferred_t *d = j->defer_head;
        j->defer_head = d->next;
        amx__finish_waiter(reg, d->w, st, why, NULL);
        if (d->kind == WAIT_RECONCILE_NEXT)
            free((void *)d->req);
        free(d);
    }
    j->defer_tail = &j->defer_head;
}

/* Fails every waiter of the job with `st` (drop, shutdown). */
void amx__fail_all_waiters(amx_registry_t *reg, amx_job_t *j, amx_status_t st, const char *why)
{
    char msg[1024];
    for (uint32_t i = 0; i < j->nlocal; i++) {
        amx_lrank_t *r = &j->lr[i];
        if (r->join_w != NULL) {
            amx_waiter_t *w = r->join_w;
            r->join_w = NULL;
            if (r->cjoin != NULL) {
                amx_peer_join_cancel(reg->peer, r->cjoin);
                r->cjoin = NULL;
                free(r->jctx);
                r->jctx = NULL;
            }
            snprintf(msg, sizeof(msg), "Join of rank %u to job '%s' ended: %s", r->rank, j->name,
                     why);
            amx__finish_waiter(reg, w, st, msg, NULL);
        }
        if (r->rec_w != NULL) {
            amx_waiter_t *w = r->rec_w;
            r->rec_w = NULL;
            snprintf(msg, sizeof(msg), "Reconcile of rank %u, job '%s', epoch %llu ended: %s",
                     r->rank, j->name, (unsigned long long)j->epoch, why);
            amx__finish_waiter(reg, w, st, msg, NULL);
        }
        if (!j->in_flight && r->in_reconcile) {
            r->in_reconcile = 0;
            j->nin_reconcile--;
        }
    }
    fail_deferred(reg, j, st, why);
}

void amx__job_free(amx_job_t *j)
{
    if (j->growing)
        pthread_join(j->grow_th, NULL); /* only at shutdown: drops wait for it */
    if (j->eng != NULL)
        amx_engine_destroy(j->eng);
    for (uint32_t i = 0; i < j->nlocal; i++)
        lrank_free(j, &j->lr[i]);
    free(j->lr);
    free(j->slot);
    for (uint32_t i = 0; i < j->nlq; i++)
        if (j->lq[i].status != LQ_AGREED)
            amx_qspec_free(j->lq[i].spec);
    free(j->lq);
    amx_strmap_free(&j->lqmap);
    amx_catalog_free(j->cat);
    free(j->desc);
    amx_membership_free(&j->mship);
    amx_state_destroy(j->state);
    free(j->snap_err);
    free(j->prev_ga);
    free(j->prev_gs);
    free(j->prev_ok);
    free(j->pub_ok);
    free(j->name);
    free(j);
}

void amx__job_unlink(amx_registry_t *reg, amx_job_t *j)
{
    for (amx_job_t **p = &reg->jobs; *p != NULL; p = &(*p)->next) {
        if (*p == j) {
            *p = j->next;
            reg->njobs--;
            break;
        }
    }
    j->next = NULL;
}

/* Removes a job: freed now, or when its epoch in flight returns. */
static void job_remove(amx_registry_t *reg, amx_job_t *j)
{
    amx__job_unlink(reg, j);
    amx_metrics_job_drop(reg->metrics, j->name);
    if (j->in_flight || j->growing) {
        j->dropped = 1;
        j->next = reg->zombies;
        reg->zombies = j;
        if (j->in_flight && j->eng != NULL)
            amx_engine_abort(j->eng, 0, 0, 0, 0, AMX_ENGINE_LOCAL, AMX_EABORTED,
                             "the job was dropped");
        return;
    }
    amx__job_free(j);
}

amx_status_t amx__job_create(amx_registry_t *reg, const char *name, uint32_t world, amx_job_t **out,
                             amx_err_t *err)
{
    if (reg->njobs >= (uint64_t)reg->cfg->max_jobs)
        return amx_err_set(err, AMX_ENOMEM,
                           "this daemon already serves %u jobs (max_jobs); drop a finished job "
                           "with Reset(amx__drop_job) or raise max_jobs",
                           reg->njobs);
    amx_job_t *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory creating job '%s'", name);
    j->name = strdup(name);
    j->slot = malloc((size_t)world * sizeof(int32_t));
    j->cat = amx_catalog_empty();
    j->world = world;
    j->epoch = 1;
    j->me = -1;
    j->defer_tail = &j->defer_head;
    amx_status_t st = AMX_ENOMEM;
    if (j->name == NULL || j->slot == NULL || j->cat == NULL) {
        amx_err_set(err, st, "out of memory creating job '%s' of world size %u", name, world);
        goto fail;
    }
    for (uint32_t r = 0; r < world; r++)
        j->slot[r] = -1;
    st = amx_state_create(reg->backend, reg->cfg->cuda_device, &j->state, err);
    if (st != AMX_OK)
        goto fail;
    st = j->state->ops->reserve_pending(j->state, 0, err);
    if (st != AMX_OK)
        goto fail;
    j->next = reg->jobs;
    reg->jobs = j;
    reg->njobs++;
    *out = j;
    return AMX_OK;
fail:
    amx_state_destroy(j->state);
    amx_catalog_free(j->cat);
    free(j->slot);
    free(j->name);
    free(j);
    return st;
}

/* A slot for local rank r (created when missing). */
amx_lrank_t *amx__add_local_rank(amx_job_t *j, uint32_t r)
{
    amx_lrank_t *lr = amx__local_rank(j, r);
    if (lr != NULL)
        return lr;
    if (amx_grow(&j->lr, &j->cap_local, j->nlocal + 1, sizeof(*j->lr), 8, 0) != 0)
        return NULL;
    lr = &j->lr[j->nlocal];
    memset(lr, 0, sizeof(*lr));
    lr->rank = r;
    j->slot[r] = (int32_t)j->nlocal++;
    return lr;
}

/* Removes local rank r (a join that gave up before the job was ready). */
void amx__remove_local_rank(amx_job_t *j, uint32_t r)
{
    int32_t s = amx__job_slot(j, r);
    if (s < 0)
        return;
    lrank_free(j, &j->lr[s]);
    uint32_t last = j->nlocal - 1;
    if ((uint32_t)s != last) {
        j->lr[s] = j->lr[last];
        j->slot[j->lr[s].rank] = s;
    }
    j->slot[r] = -1;
    j->nlocal--;
}

/* ---- Join ---- */

static void complete_join(amx_registry_t *reg, amx_job_t *j, amx_waiter_t *w, int rejoined)
{
    amx_reply_t rep;
    memset(&rep, 0, sizeof(rep));
    rep.world = j->world;
    /* The epoch SendAmax adds to (a Join of a rank in the epoch in flight
     * waits until it has ended: amx_registry_join). */
    rep.epoch = j->in_flight ? j->epoch + 1 : j->epoch;
    rep.rejoined = rejoined;
    amx__finish_waiter(reg, w, AMX_OK, NULL, &rep);
}

/* The coordinator's membership for a job becomes this daemon's. */
static amx_status_t install_membership(amx_registry_t *reg, amx_job_t *j, const amx_membership_t *m)
{
    uint32_t me = amx_peer_id(reg->peer)->rank;
    int32_t idx = -1;
    for (uint32_t p = 0; p < m->npart; p++)
        if (m->part[p].daemon == me)
            idx = (int32_t)p;
    if (idx < 0)
        return AMX_EINTERNAL;
    amx_membership_t copy;
    if (amx_membership_copy(m, &copy) != AMX_OK)
        return AMX_ENOMEM;
    for (uint32_t k = 0; k < copy.part[idx].nranks; k++)
        if (amx__add_local_rank(j, copy.part[idx].ranks[k]) == NULL) {
            amx_membership_free(&copy);
            return AMX_ENOMEM;
        }
    amx_membership_free(&j->mship);
    j->mship = copy;
    j->me = idx;
    return AMX_OK;
}

/* A job restored from a cluster snapshot, now that its membership is
 * known: a rank the membership puts on another daemon (its trainer moved)
 * goes, with its placements. */
static void forget_moved_ranks(amx_job_t *j)
{
    const amx_part_t *mine = j->me >= 0 ? &j->mship.part[j->me] : NULL;
    for (uint32_t i = j->nlocal; i-- > 0;) {
        amx_lrank_t *r = &j->lr[i];
        int here = 0;
        for (uint32_t k = 0; mine != NULL && k < mine->nranks; k++)
            here |= mine->ranks[k] == r->rank;
        if (here)
            continue;
        AMX_WARN("registry",
                 "job %s: rank %u, restored from the snapshot, re-joined another daemon; its "
                 "placements here are forgotten",
                 j->name, r->rank);
        for (uint32_t k = 0; k < r->npls; k++) {
            uint32_t lid = r->pl_lid[k];
            if (lid < r->cap_of && r->pl_of[lid] == k + 1 && j->lq[lid].nplacements > 0)
                j->lq[lid].nplacements--;
        }
        amx__remove_local_rank(j, r->rank);
    }
}

static void on_join_answer(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    join_ctx_t *ctx = ud;
    amx_registry_t *reg = ctx->reg;
    amx_job_t *j = ctx->job;
    uint32_t rank = ctx->rank;
    free(ctx);
    amx_lrank_t *r = amx__local_rank(j, rank);
    if (r == NULL || r->join_w == NULL)
        return; /* cannot happen: a join is cancelled before its rank goes */
    amx_waiter_t *w = r->join_w;
    r->join_w = NULL;
    r->cjoin = NULL;
    r->jctx = NULL;
    if (st == AMX_OK) {
        amx_status_t ist = install_membership(reg, j, m);
        if (ist != AMX_OK) {
            st = ist;
            msg = ist == AMX_ENOMEM ? "out of memory installing the job's membership"
                                    : "the coordinator's membership does not list this daemon";
        }
    }
    if (st != AMX_OK) {
        AMX_WARN("registry", "job %s: Join of rank %u failed: %s", j->name, rank, msg);
        r = amx__local_rank(j, rank);
        if (!j->ready && !r->restored) {
            amx__remove_local_rank(j, rank);
        } else {
            r->joined = 0;
        }
        amx__finish_waiter(reg, w, st, msg, NULL);
        if (!j->ready && j->nlocal == 0 && !j->in_flight) {
            amx__job_unlink(reg, j);
            amx__job_free(j);
        }
        return;
    }
    r = amx__local_rank(j, rank);
    int was_restored = r->restored;
    if (!j->ready) {
        j->ready = 1;
        if (j->restored)
            forget_moved_ranks(j);
        AMX_INFO("registry",
                 "job %s: all %u ranks joined; this daemon hosts %u of them, %u "
                 "daemon(s) take part",
                 j->name, j->world, j->nlocal, j->mship.npart);
    }
    r = amx__local_rank(j, rank);
    r->joined = 1;
    r->restored = 0;
    /* rejoined: this daemon kept the rank (restored it from its snapshot;
     * a rank it kept live was answered at once by amx_registry_join). The
     * coordinator knowing the rank is not enough: a daemon that restarted
     * without the job has nothing of it. */
    complete_join(reg, j, w, was_restored);
}

amx_status_t amx_registry_join(amx_registry_t *reg, const amx_join_req_t *req, amx_waiter_t *w,
                               uint64_t now_ms, amx_err_t *err)
{
    if (!amx_valid_job_name(req->job))
        return amx_err_set(err, AMX_EINVAL,
                           "job name '%s' is invalid: use 1-%d characters of [A-Za-z0-9._-]",
                           req->job ? req->job : "", AMX_MAX_JOB_NAME);
    if (req->world == 0 || req->world > (uint64_t)reg->cfg->max_world_size)
        return amx_err_set(err, AMX_EINVAL, "world_size %u of job '%s' must be in [1, %lld]",
                           req->world, req->job, (long long)reg->cfg->max_world_size);
    if (req->rank >= req->world)
        return amx_err_set(err, AMX_EINVAL, "rank %u is out of range for world size %u (job '%s')",
                           req->rank, req->world, req->job);
    if (reg->shutting_down)
        return amx_err_set(err, AMX_EUNAVAIL, "amaxd is shutting down");
    amx_job_t *j = amx__find_job(reg, req->job);
    if (j != NULL && j->world != req->world)
        return amx_err_set(err, AMX_EPRECOND,
                           "job '%s' exists with world size %u, not %u: every rank must declare "
                           "the same world size (or drop the old job with Reset(amx__drop_job))",
                           req->job, j->world, req->world);
    amx_lrank_t *r = j ? amx__local_rank(j, req->rank) : NULL;
    if (j != NULL && j->ready && r == NULL) {
        char home[320];
        fmt_rank_home(j, req->rank, home, sizeof(home));
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is served by %s: a rank stays with the daemon it "
                           "joined for the life of the job (drop the job to start over)",
                           req->rank, req->job, home);
    }
    if (j != NULL && j->ready && r != NULL && r->join_w == NULL) {
        j->last_active_ms = now_ms;
        r->joined = 1;
        if (j->in_flight && r->in_reconcile) {
            /* Its earlier call is in the epoch in flight (a trainer that
             * restarted while its daemon waits for others): answered when
             * that epoch has ended, with the epoch then open (the next one,
             * or the same after a failure). Answered now, the trainer would
             * send for the next epoch, and a failure of this one would
             * carry those values into its retry. */
            w->rank = req->rank;
            AMX_CHECK(amx__defer(reg, j, WAIT_JOIN_NEXT, w, NULL, err));
            AMX_INFO("registry",
                     "job %s: rank %u re-joined while epoch %llu, which its earlier call entered, "
                     "is in flight: answered when it has ended",
                     j->name, req->rank, (unsigned long long)j->epoch);
            return AMX_OK;
        }
        AMX_INFO("registry", "job %s: rank %u re-joined; state kept", j->name, req->rank);
        w->job = NULL;
        complete_join(reg, j, w, 1);
        return AMX_OK;
    }
    if (r != NULL && r->join_w != NULL)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is already waiting in Join on another call",
                           req->rank, req->job);
    int created = 0;
    if (j == NULL) {
        AMX_CHECK(amx__job_create(reg, req->job, req->world, &j, err));
        created = 1;
    }
    j->last_active_ms = now_ms;
    r = amx__add_local_rank(j, req->rank);
    join_ctx_t *ctx = malloc(sizeof(*ctx));
    if (r == NULL || ctx == NULL) {
        free(ctx);
        if (r != NULL && !j->ready && !r->restored)
            amx__remove_local_rank(j, req->rank);
        if (created) {
            amx__job_unlink(reg, j);
            amx__job_free(j);
        }
        return amx_err_set(err, AMX_ENOMEM, "out of memory joining job '%s'", req->job);
    }
    *ctx = (join_ctx_t){reg, j, req->rank};
    w->job = j;
    w->rank = req->rank;
    w->kind = WAIT_JOIN;
    w->deadline_ms = now_ms + (uint64_t)reg->cfg->join_timeout_ms;
    r->join_w = w;
    r->joined = 1;
    reg->nwaiting++;
    void *h = NULL;
    amx_status_t st = amx_peer_join(reg->peer, req->job, req->world, req->rank, w->deadline_ms,
                                    on_join_answer, ctx, &h, err);
    if (st != AMX_OK) {
        /* The callback is never called: undo. */
        free(ctx);
        r = amx__local_rank(j, req->rank);
        r->join_w = NULL;
        w->job = NULL;
        reg->nwaiting--;
        if (!j->ready && !r->restored)
            amx__remove_local_rank(j, req->rank);
        if (created && j->nlocal == 0) {
            amx__job_unlink(reg, j);
            amx__job_free(j);
        }
        return st;
    }
    r = amx__local_rank(j, req->rank);
    if (r != NULL && r->join_w == w) {
        r->cjoin = h; /* still waiting (the answer may already have come) */
        r->jctx = ctx;
    }
    AMX_DEBUG("registry", "job %s: rank %u joining", j->name, req->rank);
    return AMX_OK;
}

/* ---- Reset ---- */

static amx_status_t do_reset(amx_registry_t *reg, amx_job_t *j, const amx_reset_req_t *req,
                             amx_reply_t *rep, amx_err_t *err)
{
    (void)reg;
    for (size_t i = 0; i < req->n_names; i++) {
        uint32_t lid;
        if (!amx_strmap_get(&j->lqmap, req->names[i], &lid) || !amx__lq_live(&j->lq[lid]))
            return amx_err_set(err, AMX_ENOTFOUND,
                               "quantizer '%.255s' is not registered in job '%s' (nothing was "
                               "reset)",
                               req->names[i], j->name);
    }
    uint32_t n = 0;
    for (uint32_t lid = 0; lid < j->nlq; lid++) {
        amx_lq_t *q = &j->lq[lid];
        if (!amx__lq_live(q))
            continue;
        int hit = req->n_names == 0;
        for (size_t i = 0; i < req->n_names && !hit; i++)
            hit = strcmp(req->names[i], q->spec->name) == 0;
        if (!hit)
            continue;
        n++;
        if (!q->reset) {
            q->reset = 1;
            j->nreset++;
        }
    }
    j->reset_seq++;
    rep->reset = n;
    AMX_INFO("registry", "job %s: %u quantizers will be reset at the start of epoch %llu", j->name,
             n, (unsigned long long)j->epoch);
    return AMX_OK;
}

void amx__drop_job(amx_registry_t *reg, amx_job_t *j, const char *why)
{
    AMX_INFO("registry", "job %s dropped (%u quantizers): %s", j->name, j->cat->n + j->nprop, why);
    if (amx__snapshots_on(reg)) {
        int rc = amx_snapshot_remove(reg->cfg->state_dir, j->name);
        if (rc != 0)
            AMX_ERROR("registry", "job %s: cannot remove its snapshot from %s: %s", j->name,
                      reg->cfg->state_dir, strerror(-rc));
    }
    amx__fail_all_waiters(reg, j, AMX_EABORTED, why);
    if (reg->on_drop != NULL)
        reg->on_drop(reg->on_drop_ud, j->name);
    job_remove(reg, j);
}

amx_status_t amx_registry_reset(amx_registry_t *reg, const amx_reset_req_t *req, amx_waiter_t *w,
                                amx_err_t *err)
{
    if (!amx_valid_job_name(req->job))
        return amx_err_set(err, AMX_EINVAL, "job name '%s' is invalid", req->job ? req->job : "");
    amx_job_t *j = amx__find_job(reg, req->job);
    if (j == NULL)
        return amx_err_set(err, AMX_ENOTFOUND, "job '%s' is not known to this daemon", req->job);
    j->last_active_ms = amx_now_ms();
    amx_reply_t rep;
    memset(&rep, 0, sizeof(rep));
    if (req->drop_job) {
        if (req->n_names != 0)
            return amx_err_set(err, AMX_EINVAL,
                               "Reset with amx__drop_job takes no quantizer names");
        rep.reset = j->cat->n + j->nprop;
        char name[AMX_MAX_JOB_NAME + 1];
        snprintf(name, sizeof(name), "%s", j->name);
        amx__drop_job(reg, j, "the job was dropped by Reset");
        /* Then the coordinator forgets it too (and fails Joins of it
         * waiting on other daemons), also before all ranks joined:
         * otherwise those Joins would wait on, and their ranks could not
         * join again. After the local drop, which withdrew this daemon's
         * own waiting Joins. */
        amx_peer_drop(reg->peer, name);
        w->job = NULL;
        w->done(w, AMX_OK, NULL, &rep);
        return AMX_OK;
    }
    if (j->in_flight) {
        /* Validate now, apply when the epoch in flight has ended. */
        for (size_t i = 0; i < req->n_names; i++) {
            uint32_t lid;
            if (!amx_strmap_get(&j->lqmap, req->names[i], &lid) || !amx__lq_live(&j->lq[lid]))
                return amx_err_set(err, AMX_ENOTFOUND,
                                   "quantizer '%.255s' is not registered in job '%s' (nothing "
                                   "was reset)",
                                   req->names[i], j->name);
        }
        return amx__defer(reg, j, WAIT_RESET, w, req, err);
    }
    AMX_CHECK(do_reset(reg, j, req, &rep, err));
    w->job = NULL;
    w->done(w, AMX_OK, NULL, &rep);
    return AMX_OK;
}

/* Unlinks and frees the first deferred request (not its req). */
static void pop_deferred(amx_job_t *j)
{
    amx_deferred_t *d = j->defer_head;
    j->defer_head = d->next;
    if (j->defer_head == NULL)
        j->defer_tail = &j->defer_head;
    free(d);
}

void amx__run_deferred(amx_registry_t *reg, amx_job_t *j)
{
    while (j->defer_head != NULL && !j->in_flight && !j->growing) {
        amx_deferred_t *d = j->defer_head;
        amx_waiter_t *w = d->w;
        int kind = d->kind;
        const void *req = d->req;
        amx_reply_t rep;
        memset(&rep, 0, sizeof(rep));
        amx_err_t err = {0};
        int deferred = 0;
        if (kind == WAIT_JOIN_NEXT || kind == WAIT_RECONCILE_NEXT) {
            /* The epoch it waited for has ended. */
            pop_deferred(j);
            if (kind == WAIT_JOIN_NEXT) {
                AMX_INFO("registry", "job %s: rank %u re-joined; state kept (epoch %llu open)",
                         j->name, w->rank, (unsigned long long)j->epoch);
                complete_join(reg, j, w, 1);
                continue;
            }
            /* It enters the open epoch as any Reconcile (which may start
             * it, ending this loop). */
            w->job = NULL;
            reg->nwaiting--;
            amx_status_t st = amx_registry_reconcile(reg, req, w, amx_now_ms(), &err);
            free((void *)req);
            if (st != AMX_OK)
                amx__finish_waiter(reg, w, st, err.msg, NULL);
            continue;
        }
        amx_status_t st = kind == WAIT_REGISTER
                              ? amx__do_register(reg, j, req, &rep, &deferred, &err)
                              : do_reset(reg, j, req, &rep, &err);
        if (st == AMX_OK && deferred)
            return; /* it waits, first in line, for the growth it started */
        pop_deferred(j);
        if (st != AMX_OK)
            AMX_WARN("rpc", "%s rejected (%s): %s", kind == WAIT_REGISTER ? "Register" : "Reset",
                     amx_strerror(st), err.msg);
        amx__finish_waiter(reg, w, st, st == AMX_OK ? NULL : err.msg, st == AMX_OK ? &rep : NULL);
    }
}
