/*
 * registry.c - the registry: the object that holds this daemon's jobs, the calls
 * waiting in them, their expiry, Status and ListQuantizers, and the peer
 * service's entry points (registry.h; its parts are listed in
 * registry_impl.h).
 */
#include "registry_impl.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bytebuf.h"
#include "clock.h"
#include "log.h"
#include "snapshot.h"
#include "state.h"

/* An idle job's snapshot is kept, renamed <job>.amxs.expired: dropping
 * the job must not resurrect it at the next start, nor lose it silently. */
static void set_aside_expired(amx_registry_t *reg, amx_job_t *j)
{
    if (!amx__snapshots_on(reg))
        return;
    char from[4096], to[4200];
    snprintf(from, sizeof(from), "%s/%s%s", reg->cfg->state_dir, j->name, AMX_SNAPSHOT_SUFFIX);
    snprintf(to, sizeof(to), "%s.expired", from);
    if (rename(from, to) == 0)
        AMX_WARN("registry", "job %s: idle, its snapshot was moved to %s", j->name, to);
}

amx_job_t *amx__find_job(amx_registry_t *reg, const char *name)
{
    for (amx_job_t *j = reg->jobs; j != NULL; j = j->next)
        if (strcmp(j->name, name) == 0)
            return j;
    return NULL;
}

void amx_registry_on_drop(amx_registry_t *reg, void (*fn)(void *ud, const char *job), void *ud)
{
    reg->on_drop = fn;
    reg->on_drop_ud = ud;
}

void amx_registry_on_expect(amx_registry_t *reg, void (*fn)(void *ud, uint64_t us), void *ud)
{
    reg->on_expect = fn;
    reg->on_expect_ud = ud;
}

/* ---- waiters ---- */

void amx__finish_waiter(amx_registry_t *reg, amx_waiter_t *w, amx_status_t st, const char *msg,
                        const amx_reply_t *reply)
{
    if (w->job != NULL) {
        w->job = NULL;
        reg->nwaiting--;
    }
    w->done(w, st, msg, reply);
}

/* ---- engine plumbing ---- */

static void post_done(void *ud, amx_job_t *job)
{
    amx_registry_t *reg = ud;
    if (amx_swapq_push(&reg->done, &job) != 0) {
        /* An epoch whose end is never seen would hang its trainers. */
        AMX_ERROR("registry", "out of memory posting the end of an epoch; aborting");
        abort();
    }
    uv_async_send(&reg->done_async);
}

/* Engine thread: its epoch ends within `us`: the loop polls from now on
 * (on_expect) and is woken to start (the done queue is empty yet: the
 * wake-up drains nothing). Its end, in epoch_done_item, says it came. */
static void expect_done(void *ud, uint64_t us)
{
    amx_registry_t *reg = ud;
    if (reg->on_expect == NULL)
        return;
    reg->on_expect(reg->on_expect_ud, us);
    uv_async_send(&reg->done_async);
}

static void epoch_done_item(void *ud, void *item)
{
    amx_registry_t *reg = ud;
    amx_job_t *j = *(amx_job_t **)item;
    if (reg->on_expect != NULL && amx_engine_result(j->eng)->expected_end)
        reg->on_expect(reg->on_expect_ud, 0); /* it came: one end fewer to poll for */
    amx__epoch_done(reg, j);
}

static void on_done_async(uv_async_t *h)
{
    amx_registry_t *reg = h->data;
    amx_swapq_drain(&reg->done, epoch_done_item, reg);
}

amx_status_t amx_registry_create(uv_loop_t *loop, const amx_config_t *cfg, const char *backend,
                                 amx_peer_t *peer, amx_registry_t **out, amx_err_t *err)
{
    amx_state_t *probe = NULL;
    /* Fail at start-up, not at the first Join, if the backend cannot work. */
    AMX_CHECK(amx_state_create(backend, cfg->cuda_device, &probe, err));
    amx_state_destroy(probe);
    const char *coll = cfg->collective;
    if (strcmp(coll, "auto") == 0)
        coll = strcmp(backend, "cuda") == 0 ? "nccl" : "gloo";
    if (peer != NULL && amx_peer_id(peer)->size > 1) {
        if (!amx_comm_available(coll))
            return amx_err_set(err, AMX_EUNAVAIL,
                               "collective backend %s is not compiled into this amaxd (see "
                               "amaxd --version); choose another with --collective",
                               coll);
        if (strcmp(coll, "nccl") == 0 && strcmp(backend, "cuda") != 0)
            return amx_err_set(err, AMX_EINVAL,
                               "collective=nccl reduces GPU buffers and needs backend=cuda; use "
                               "collective=gloo with the host backend");
        if (strcmp(coll, "gloo") == 0 && strcmp(backend, "host") != 0)
            return amx_err_set(err, AMX_EINVAL,
                               "collective=gloo reduces host buffers and needs backend=host; use "
                               "collective=nccl with the CUDA backend");
    }
    amx_registry_t *reg = calloc(1, sizeof(*reg));
    if (reg == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    reg->loop = loop;
    reg->cfg = cfg;
    reg->peer = peer;
    snprintf(reg->backend, sizeof(reg->backend), "%s", backend);
    snprintf(reg->collective, sizeof(reg->collective), "%s",
             peer != NULL && amx_peer_id(peer)->size > 1 ? coll : "local");
    amx_swapq_init(&reg->done, sizeof(amx_job_t *));
    uv_async_init(loop, &reg->done_async, on_done_async);
    reg->done_async.data = reg;
    uv_async_init(loop, &reg->grow_async, amx__on_grow_async);
    reg->grow_async.data = reg;
    reg->open_asyncs = 2;
    /* Epoch outcomes are delivered while the loop runs; they never keep it
     * running on their own. */
    uv_unref((uv_handle_t *)&reg->done_async);
    uv_unref((uv_handle_t *)&reg->grow_async);
    reg->env.cfg = cfg;
    reg->env.peer = peer;
    reg->env.collective = reg->collective;
    reg->env.gloo_host = cfg->gloo_host;
    reg->env.cuda_device = (int)cfg->cuda_device;
    reg->env.post = post_done;
    reg->env.expect = expect_done;
    reg->env.ud = reg;
    /* The default memory budget: half of the memory the state lives in. */
    uint64_t mem = amx_state_memory(backend, (int)cfg->cuda_device);
    reg->budget = mem > 0 ? mem / 2 : UINT64_MAX / 2;
    snprintf(reg->budget_src, sizeof(reg->budget_src), "%s",
             mem == 0                       ? "unlimited: the memory size is unknown"
             : strcmp(backend, "cuda") == 0 ? "half of the GPU's memory"
                                            : "half of the host's memory");
    if (cfg->memory_budget == 0)
        AMX_INFO("registry", "memory budget for job state: %llu MiB (%s)",
                 (unsigned long long)(reg->budget >> 20), reg->budget_src);
    *out = reg;
    return AMX_OK;
}

void amx_registry_shutdown(amx_registry_t *reg, const char *why)
{
    reg->shutting_down = 1;
    /* What the other daemons of a job in flight hear (the daemon's own
     * trainers get `why`). */
    char stop[320];
    const amx_cluster_id_t *id = amx_peer_id(reg->peer);
    snprintf(stop, sizeof(stop), "daemon %u (%s) is shutting down", id->rank,
             id->advertise[0] ? id->advertise : "this host");
    for (amx_job_t *j = reg->jobs; j != NULL; j = j->next) {
        if (j->in_flight && j->eng != NULL)
            amx_engine_abort(j->eng, 0, 0, 0, 0, AMX_ENGINE_LOCAL, AMX_EABORTED, stop);
        amx__fail_all_waiters(reg, j, AMX_EUNAVAIL, why);
    }
}

/* Waits (on this thread) for every epoch in flight to come back; only at
 * destruction, after every engine was aborted. */
static void drain_engines(amx_registry_t *reg)
{
    for (;;) {
        int busy = 0;
        for (amx_job_t *j = reg->jobs; j != NULL; j = j->next)
            busy |= j->in_flight;
        for (amx_job_t *j = reg->zombies; j != NULL; j = j->next)
            busy |= j->in_flight;
        if (!busy)
            return;
        on_done_async(&reg->done_async);
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

static void on_async_closed(uv_handle_t *h)
{
    amx_registry_t *reg = h->data;
    if (--reg->open_asyncs > 0)
        return;
    amx_swapq_destroy(&reg->done);
    free(reg->stage);
    free(reg->sstage);
    free(reg->sruns);
    free(reg->runs);
    free(reg->lids);
    free(reg);
}

void amx_registry_destroy(amx_registry_t *reg)
{
    if (reg == NULL)
        return;
    amx_registry_shutdown(reg, "the daemon is shutting down; retry after restart");
    drain_engines(reg);
    amx_registry_flush_snapshots(reg);
    while (reg->jobs != NULL) {
        amx_job_t *j = reg->jobs;
        amx__fail_all_waiters(reg, j, AMX_EUNAVAIL,
                              "the daemon is shutting down; retry after restart");
        amx__job_unlink(reg, j);
        amx__job_free(j);
    }
    while (reg->zombies != NULL) {
        amx_job_t *j = reg->zombies;
        reg->zombies = j->next;
        amx__job_free(j);
    }
    uv_close((uv_handle_t *)&reg->done_async, on_async_closed);
    uv_close((uv_handle_t *)&reg->grow_async, on_async_closed);
}

void amx_registry_set_metrics(amx_registry_t *reg, amx_metrics_t *m)
{
    reg->metrics = m;
}

const char *amx_registry_backend(const amx_registry_t *reg)
{
    return reg->backend;
}

const char *amx_registry_collective(const amx_registry_t *reg)
{
    return reg->collective;
}

uint32_t amx_registry_waiting(const amx_registry_t *reg)
{
    return reg->nwaiting;
}

/* Records a device fault of the state backend: CUDA errors are sticky, so
 * every later epoch would fail too; Health reports it. Returns st. */
amx_status_t amx__note_fault(amx_registry_t *reg, amx_status_t st, const char *msg)
{
    if (st == AMX_EDEVICE && reg->fault[0] == '\0') {
        snprintf(reg->fault, sizeof(reg->fault), "%.500s", msg);
        AMX_ERROR("registry",
                  "state backend fault: %s; Health answers NOT_SERVING from now on: restart "
                  "the daemon",
                  msg);
    }
    return st;
}

const char *amx_registry_fault(const amx_registry_t *reg)
{
    return reg->fault[0] != '\0' ? reg->fault : NULL;
}

void amx_registry_cancel(amx_registry_t *reg, amx_waiter_t *w)
{
    amx_job_t *j = w->job;
    if (j == NULL)
        return;
    w->job = NULL;
    reg->nwaiting--;
    if (w->kind == WAIT_REGISTER || w->kind == WAIT_RESET || w->kind == WAIT_RECONCILE_NEXT ||
        w->kind == WAIT_JOIN_NEXT) {
        for (amx_deferred_t **p = &j->defer_head; *p != NULL; p = &(*p)->next) {
            if ((*p)->w == w) {
                amx_deferred_t *d = *p;
                *p = d->next;
                if (j->defer_tail == &d->next)
                    j->defer_tail = p;
                if (d->kind == WAIT_RECONCILE_NEXT)
                    free((void *)d->req);
                free(d);
                break;
            }
        }
        return;
    }
    amx_lrank_t *r = amx__local_rank(j, w->rank);
    if (r == NULL)
        return;
    if (w->kind == WAIT_JOIN) {
        r->join_w = NULL;
        if (r->cjoin != NULL) {
            amx_peer_join_cancel(reg->peer, r->cjoin);
            r->cjoin = NULL;
            free(r->jctx);
            r->jctx = NULL;
        }
        AMX_INFO("registry", "job %s: rank %u left Join (client went away)", j->name, w->rank);
        if (!j->ready) {
            amx__remove_local_rank(j, w->rank);
            if (j->nlocal == 0 && !j->in_flight) {
                amx__job_unlink(reg, j);
                amx__job_free(j);
            }
        } else {
            r->joined = 0;
        }
        return;
    }
    r->rec_w = NULL;
    if (j->in_flight) {
        /* The epoch goes on without it; its answer is dropped. An armed
         * one still waiting for this rank's flag would wait for ever. */
        AMX_INFO("registry",
                 "job %s: rank %u left Reconcile of epoch %llu while it was being "
                 "reconciled (client went away)",
                 j->name, w->rank, (unsigned long long)j->epoch);
        amx__dev_abort_armed(j, r, "its client went away (the doorbell connection closed)");
        return;
    }
    r->in_reconcile = 0;
    j->nin_reconcile--;
    AMX_INFO("registry", "job %s: rank %u left Reconcile of epoch %llu (client went away)", j->name,
             w->rank, (unsigned long long)j->epoch);
}

/* A job none of whose ranks called for job_idle_timeout_ms (none waits,
 * no epoch in flight): its slot and memory go back. */
static int job_idle(const amx_registry_t *reg, const amx_job_t *j, uint64_t now_ms)
{
    int64_t t = reg->cfg->job_idle_timeout_ms;
    if (t <= 0 || j->in_flight || now_ms < j->last_active_ms + (uint64_t)t)
        return 0;
    for (uint32_t i = 0; i < j->nlocal; i++)
        if (j->lr[i].join_w != NULL || j->lr[i].rec_w != NULL)
            return 0;
    return 1;
}

void amx_registry_expire(amx_registry_t *reg, uint64_t now_ms)
{
    char msg[1024], missing[256];
    for (amx_job_t *j = reg->jobs, *next; j != NULL; j = next) {
        next = j->next;
        if (job_idle(reg, j, now_ms)) {
            snprintf(msg, sizeof(msg),
                     "no rank of it called this daemon for %lld ms (job_idle_timeout_ms); its "
                     "state is gone, its ranks must join again",
                     (long long)(now_ms - j->last_active_ms));
            set_aside_expired(reg, j);
            amx__drop_job(reg, j, msg);
            continue;
        }
        amx__dev_reap(j);
        if (j->in_flight) {
            /* The engine answers by the deadline; this only reports a bug. */
            if (j->flight_deadline != UINT64_MAX && now_ms > j->flight_deadline + 30000 &&
                now_ms < j->flight_deadline + 30050)
                AMX_ERROR("registry",
                          "job %s: epoch %llu is still in flight 30 s after its "
                          "deadline",
                          j->name, (unsigned long long)j->epoch);
            continue;
        }
        for (uint32_t i = 0; i < j->nlocal; i++) {
            amx_lrank_t *r = &j->lr[i];
            if (r->rec_w == NULL || r->rec_w->deadline_ms > now_ms)
                continue;
            amx__missing_ranks(j, missing, sizeof(missing));
            snprintf(msg, sizeof(msg),
                     "Reconcile of rank %u, job '%s', epoch %llu timed out after %lld ms: ranks "
                     "%s did not enter it; this rank's contributions are kept, call Reconcile "
                     "again",
                     r->rank, j->name, (unsigned long long)j->epoch,
                     (long long)reg->cfg->reconcile_timeout_ms, missing);
            AMX_WARN("registry", "%s", msg);
            amx_waiter_t *w = r->rec_w;
            r->rec_w = NULL;
            r->in_reconcile = 0;
            j->nin_reconcile--;
            amx__finish_waiter(reg, w, AMX_ETIMEDOUT, msg, NULL);
        }
    }
}

/* ---- Status, List ---- */

amx_status_t amx_registry_status(amx_registry_t *reg, const char *job, amx_job_info_t **jobs,
                                 size_t *njobs, amx_arena_t *arena, amx_err_t *err)
{
    if (job != NULL && job[0] != '\0' && amx__find_job(reg, job) == NULL)
        return amx_err_set(err, AMX_ENOTFOUND, "job '%.128s' is not known to this daemon", job);
    amx_job_info_t *out = amx_arena_alloc(arena, (reg->njobs + 1) * sizeof(*out));
    if (out == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    size_t n = 0;
    for (amx_job_t *j = reg->jobs; j != NULL; j = j->next) {
        if (job != NULL && job[0] != '\0' && strcmp(job, j->name) != 0)
            continue;
        amx_job_info_t *x = &out[n++];
        memset(x, 0, sizeof(*x));
        x->name = j->name;
        x->world = j->world;
        for (uint32_t i = 0; i < j->nlocal; i++)
            x->joined += j->lr[i].joined;
        x->local_ranks = j->nlocal;
        x->participants = j->mship.npart;
        x->ready = j->ready;
        x->in_flight = j->in_flight;
        x->epoch = j->epoch;
        x->reconciled = j->last_reconciled;
        x->quantizers = j->cat->n;
        x->proposals = j->nprop;
        x->cells = j->cat->ncells;
        x->ranks_in_reconcile = j->nin_reconcile;
        x->updates = j->updates;
        x->epochs_failed = j->epochs_failed;
        x->catalog_hash = j->cat->hash;
        x->comm_generation = j->eng ? amx_engine_comm_gen(j->eng) : 0;
        x->last_epoch_us = j->last_epoch_us;
        x->last_collective_us = j->last_collective_us;
        x->last_finish_us = j->last_finish_us;
        x->last_collectives = j->last_collectives;
        x->last_started_us = j->last_started_us;
        x->last_ended_us = j->last_ended_us;
        x->last_engine_begin_us = j->last_engine_begin_us;
        x->last_engine_end_us = j->last_engine_end_us;
        x->last_answered_us = j->last_answered_us;
        x->last_entered_us = j->last_entered_us;
        x->last_published_us = j->last_published_us;
        x->collective = j->mship.npart > 1 ? reg->collective : "local";
        x->durable_epoch = j->durable_epoch;
        x->snapshot_error = j->snap_err ? amx_arena_strdup(arena, j->snap_err) : NULL;
        x->restored = j->restored;
    }
    *jobs = out;
    *njobs = n;
    return AMX_OK;
}

amx_status_t amx_registry_list(amx_registry_t *reg, const char *job, amx_qinfo_t **q, size_t *n,
                               amx_arena_t *arena, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, job, 0, 0, &j, err));
    amx_qinfo_t *out = amx_arena_alloc(arena, ((size_t)j->cat->n + j->nprop + 1) * sizeof(*out));
    if (out == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    size_t k = 0;
    for (uint32_t i = 0; i < j->cat->n; i++) {
        uint32_t lid;
        amx_strmap_get(&j->lqmap, j->cat->q[i]->name, &lid);
        out[k++] = (amx_qinfo_t){j->cat->q[i], j->lq[lid].nplacements, 1};
    }
    for (uint32_t lid = 0; lid < j->nlq; lid++)
        if (j->lq[lid].status == LQ_PROPOSED)
            out[k++] = (amx_qinfo_t){j->lq[lid].spec, j->lq[lid].nplacements, 0};
    *q = out;
    *n = k;
    return AMX_OK;
}

/* ---- peer service ---- */

amx_status_t amx_registry_progress(amx_registry_t *reg, const char *job, uint64_t epoch,
                                   uint32_t *missing, uint32_t cap, uint32_t *nmissing,
                                   uint64_t *open_epoch, uint64_t *last, int *in_flight,
                                   amx_err_t *err)
{
    amx_job_t *j = amx__find_job(reg, job);
    if (j == NULL)
        return amx_err_set(err, AMX_ENOTFOUND, "job '%s' is not known to this daemon", job);
    uint32_t k = 0;
    if (epoch == 0 || epoch == j->epoch)
        for (uint32_t i = 0; i < j->nlocal; i++)
            if (!j->lr[i].in_reconcile && k < cap)
                missing[k++] = j->lr[i].rank;
    *nmissing = k;
    *open_epoch = j->epoch;
    *last = j->last_reconciled;
    *in_flight = j->in_flight;
    return AMX_OK;
}

void amx_registry_peer_abort(amx_registry_t *reg, const char *job, uint64_t gen, uint64_t epoch,
                             uint64_t agreement, uint64_t coord_inc, uint32_t from,
                             amx_status_t code, const char *reason)
{
    amx_job_t *j = amx__find_job(reg, job);
    amx_err_t err = {0};
    /* An epoch abort may come before this daemon ran any epoch of the
     * job: its engine keeps it for the epoch's start. */
    if (j != NULL && j->eng == NULL && epoch != 0 &&
        amx_engine_create(j, &reg->env, &j->eng, &err) != AMX_OK)
        AMX_WARN("registry", "job %s: %s", job, err.msg);
    if (j == NULL || j->eng == NULL)
        return;
    if (epoch != 0)
        AMX_INFO("registry",
                 "job %s: daemon %u reports that epoch %llu (agreement %llu) failed (%s)", job,
                 from, (unsigned long long)epoch, (unsigned long long)agreement, reason);
    else
        AMX_INFO("registry",
                 "job %s: daemon %u reports that communicator generation %llu failed "
                 "(%s)",
                 job, from, (unsigned long long)gen, reason);
    amx_engine_abort(j->eng, gen, epoch, agreement, coord_inc, from, code, reason);
}

void amx_registry_peer_drop(amx_registry_t *reg, const char *job, uint32_t from)
{
    amx_job_t *j = amx__find_job(reg, job);
    if (j == NULL)
        return;
    char why[160];
    snprintf(why, sizeof(why), "the job was dropped by Reset on daemon %u", from);
    amx__drop_job(reg, j, why);
}

amx_status_t amx_registry_fetch_state(amx_registry_t *reg, const char *job, uint64_t seq,
                                      uint64_t offset, uint32_t max, void **data, size_t *len,
                                      uint64_t *total, amx_err_t *err)
{
    amx_job_t *j = amx__find_job(reg, job);
    if (j == NULL || j->eng == NULL)
        return amx_err_set(err, AMX_EUNAVAIL, "job '%s' has no state to give on this daemon", job);
    return amx_engine_fetch(j->eng, seq, offset, max, data, len, total, err);
}
