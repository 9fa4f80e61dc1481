/*
 * registry.c - jobs, local ranks, the local view of the catalog, placements,
 * contributions and epochs, on the loop thread.
 *
 * A quantizer registered here is a proposal (with provisional cells after
 * the agreed ones) until an epoch's agreement adopts it into the agreed
 * catalog, whose layout is canonical (catalog.h). Contributions are merged
 * into the active pending buffer at the quantizer's current cells. When
 * every local rank of a job has entered Reconcile, the epoch is handed to
 * the job's engine (epoch.c); its outcome comes back through epoch_done.
 */
#include "registry.h"
#include "metrics.h"

#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "bytebuf.h"
#include "clock.h"
#include "epoch.h"
#include "job.h"
#include "log.h"
#include "peer.h"
#include "snapshot.h"
#include "state.h"

enum { WAIT_JOIN = 1, WAIT_RECONCILE = 2, WAIT_REGISTER = 3, WAIT_RESET = 4 };

struct amx_registry {
    uv_loop_t *loop;
    const amx_config_t *cfg;
    char backend[16];
    char collective[16];
    amx_peer_t *peer;
    amx_job_t *jobs;
    amx_job_t *zombies; /* dropped while in flight: freed when the engine returns */
    void (*on_drop)(void *ud, const char *job);
    void *on_drop_ud;
    uint32_t njobs;
    uint32_t nwaiting;
    int shutting_down;
    /* Scratch for SendAmax and results: staged values and runs. */
    float *stage;
    uint64_t stage_cap;
    amx_run_t *runs;
    size_t runs_cap;
    uint32_t *lids; /* SendAmax: each update's lid, found once */
    size_t lids_cap;
    /* Growths of pending buffers that ended (job.h growing). */
    uv_async_t grow_async;
    int open_asyncs; /* the registry is freed when both asyncs are closed */
    /* Epoch outcomes posted by engine threads. */
    uv_async_t done_async;
    pthread_mutex_t done_mu;
    amx_job_t **done_q, **done_spare;
    size_t ndone, cap_done, cap_spare;
    amx_engine_env_t env;
    uint64_t budget;        /* memory_budget resolved: bytes of state all jobs may take */
    char fault[512];        /* a state backend fault (sticky CUDA error): Health says NOT_SERVING */
    char budget_src[64];    /* where it came from, for messages */
    amx_metrics_t *metrics; /* NULL: not recorded */
};

typedef struct join_ctx {
    amx_registry_t *reg;
    amx_job_t *job;
    uint32_t rank;
} join_ctx_t;

static void epoch_done(amx_registry_t *reg, amx_job_t *j);
static void run_deferred(amx_registry_t *reg, amx_job_t *j);
static void drop_job(amx_registry_t *reg, amx_job_t *j, const char *why);
static void on_grow_async(uv_async_t *h);

/* ---- small helpers ---- */

static int snapshots_on(const amx_registry_t *reg)
{
    return reg->cfg->state_dir != NULL && reg->cfg->state_dir[0] != '\0';
}

/* The engine's word on the epoch's snapshot. */
static void note_snapshot(amx_job_t *j, const amx_epoch_result_t *res)
{
    if (res->snapshot_ok) {
        j->durable_epoch = res->epoch;
        if (j->snap_err != NULL)
            AMX_INFO("registry", "job %s: snapshots are written again (epoch %llu)", j->name,
                     (unsigned long long)res->epoch);
        free(j->snap_err);
        j->snap_err = NULL;
        AMX_DEBUG("registry", "job %s: epoch %llu written to its snapshot (%llu bytes, %llu us)",
                  j->name, (unsigned long long)res->epoch, (unsigned long long)res->snapshot_bytes,
                  (unsigned long long)res->snapshot_us);
    } else if (res->snapshot_err[0] != '\0') {
        AMX_ERROR("registry", "job %s: %s", j->name, res->snapshot_err);
        free(j->snap_err);
        j->snap_err = strdup(res->snapshot_err);
    }
}

/* An idle job's snapshot is kept, renamed <job>.amxs.expired: dropping
 * the job must not resurrect it at the next start, nor lose it silently. */
static void set_aside_expired(amx_registry_t *reg, amx_job_t *j)
{
    if (!snapshots_on(reg))
        return;
    char from[4096], to[4200];
    snprintf(from, sizeof(from), "%s/%s%s", reg->cfg->state_dir, j->name, AMX_SNAPSHOT_SUFFIX);
    snprintf(to, sizeof(to), "%s.expired", from);
    if (rename(from, to) == 0)
        AMX_WARN("registry", "job %s: idle, its snapshot was moved to %s", j->name, to);
}

static amx_job_t *find_job(amx_registry_t *reg, const char *name)
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

static amx_lrank_t *local_rank(amx_job_t *j, uint32_t r)
{
    int32_t s = amx__job_slot(j, r);
    return s < 0 ? NULL : &j->lr[s];
}

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
static amx_status_t ready_job(amx_registry_t *reg, const char *name, uint32_t rank, int need_rank,
                              amx_job_t **out, amx_err_t *err)
{
    if (name == NULL || !amx_valid_job_name(name))
        return amx_err_set(err, AMX_EINVAL,
                           "job name '%s' is invalid: use 1-%d characters of [A-Za-z0-9._-]",
                           name ? name : "", AMX_MAX_JOB_NAME);
    amx_job_t *j = find_job(reg, name);
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
    if (need_rank && local_rank(j, rank) == NULL) {
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

/* ---- jobs ---- */

static void finish_waiter(amx_registry_t *reg, amx_waiter_t *w, amx_status_t st, const char *msg,
                          const amx_reply_t *reply)
{
    if (w->job != NULL) {
        w->job = NULL;
        reg->nwaiting--;
    }
    w->done(w, st, msg, reply);
}

/* The previous-epoch globals of quantizer `lid` (0: none). */
static int previous_of(const amx_job_t *j, uint32_t lid, float *ga, float *gs)
{
    const amx_lq_t *q = &j->lq[lid];
    if (q->status != LQ_AGREED || q->cidx < 0 || (uint32_t)q->cidx >= j->prev_n ||
        !j->prev_ok[q->cidx])
        return 0;
    *ga = j->prev_ga[q->cidx];
    *gs = j->prev_gs[q->cidx];
    return 1;
}

static void slab_free(amx_slab_t *sl)
{
    if (sl == NULL)
        return;
    free(sl->lid);
    free(sl->off);
    free(sl->merge);
    free(sl->gather);
    free(sl->soff);
    free(sl->sg);
    free(sl->cidx);
    free(sl->pendq);
    free(sl->peerq);
    free(sl);
}

static void lrank_free(amx_lrank_t *r)
{
    slab_free(r->slab);
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
        finish_waiter(reg, d->w, st, why, NULL);
        free(d);
    }
    j->defer_tail = &j->defer_head;
}

/* Fails every waiter of the job with `st` (drop, shutdown). */
static void fail_all_waiters(amx_registry_t *reg, amx_job_t *j, amx_status_t st, const char *why)
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
            finish_waiter(reg, w, st, msg, NULL);
        }
        if (r->rec_w != NULL) {
            amx_waiter_t *w = r->rec_w;
            r->rec_w = NULL;
            snprintf(msg, sizeof(msg), "Reconcile of rank %u, job '%s', epoch %llu ended: %s",
                     r->rank, j->name, (unsigned long long)j->epoch, why);
            finish_waiter(reg, w, st, msg, NULL);
        }
        if (!j->in_flight && r->in_reconcile) {
            r->in_reconcile = 0;
            j->nin_reconcile--;
        }
    }
    fail_deferred(reg, j, st, why);
}

static void job_free(amx_job_t *j)
{
    if (j->growing)
        pthread_join(j->grow_th, NULL); /* only at shutdown: drops wait for it */
    if (j->eng != NULL)
        amx_engine_destroy(j->eng);
    for (uint32_t i = 0; i < j->nlocal; i++)
        lrank_free(&j->lr[i]);
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
    free(j->name);
    free(j);
}

static void job_unlink(amx_registry_t *reg, amx_job_t *j)
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
    job_unlink(reg, j);
    amx_metrics_job_drop(reg->metrics, j->name);
    if (j->in_flight || j->growing) {
        j->dropped = 1;
        j->next = reg->zombies;
        reg->zombies = j;
        if (j->in_flight && j->eng != NULL)
            amx_engine_abort(j->eng, 0, AMX_EABORTED, "the job was dropped");
        return;
    }
    job_free(j);
}

static amx_status_t job_create(amx_registry_t *reg, const char *name, uint32_t world,
                               amx_job_t **out, amx_err_t *err)
{
    if (reg->njobs >= (uint64_t)reg->cfg->max_jobs)
        return amx_err_set(err, AMX_ENOMEM,
                           "this daemon already serves %u jobs (max_jobs); drop a finished job "
                           "with Reset(drop_job) or raise max_jobs",
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
static amx_lrank_t *add_local_rank(amx_job_t *j, uint32_t r)
{
    amx_lrank_t *lr = local_rank(j, r);
    if (lr != NULL)
        return lr;
    if (j->nlocal == j->cap_local) {
        uint32_t cap = j->cap_local ? j->cap_local * 2 : 8;
        amx_lrank_t *p = realloc(j->lr, cap * sizeof(*p));
        if (p == NULL)
            return NULL;
        j->lr = p;
        j->cap_local = cap;
    }
    lr = &j->lr[j->nlocal];
    memset(lr, 0, sizeof(*lr));
    lr->rank = r;
    j->slot[r] = (int32_t)j->nlocal++;
    return lr;
}

/* Removes local rank r (a join that gave up before the job was ready). */
static void remove_local_rank(amx_job_t *j, uint32_t r)
{
    int32_t s = amx__job_slot(j, r);
    if (s < 0)
        return;
    lrank_free(&j->lr[s]);
    uint32_t last = j->nlocal - 1;
    if ((uint32_t)s != last) {
        j->lr[s] = j->lr[last];
        j->slot[j->lr[s].rank] = s;
    }
    j->slot[r] = -1;
    j->nlocal--;
}

/* ---- engine plumbing ---- */

static void post_done(void *ud, amx_job_t *job)
{
    amx_registry_t *reg = ud;
    pthread_mutex_lock(&reg->done_mu);
    if (reg->ndone == reg->cap_done) {
        size_t cap = reg->cap_done ? reg->cap_done * 2 : 16;
        amx_job_t **q = realloc(reg->done_q, cap * sizeof(*q));
        if (q == NULL) {
            /* An epoch whose end is never seen would hang its trainers. */
            AMX_ERROR("registry", "out of memory posting the end of an epoch; aborting");
            abort();
        }
        reg->done_q = q;
        reg->cap_done = cap;
    }
    reg->done_q[reg->ndone++] = job;
    pthread_mutex_unlock(&reg->done_mu);
    uv_async_send(&reg->done_async);
}

static void on_done_async(uv_async_t *h)
{
    amx_registry_t *reg = h->data;
    for (;;) {
        pthread_mutex_lock(&reg->done_mu);
        amx_job_t **batch = reg->done_q;
        size_t n = reg->ndone, cap = reg->cap_done;
        reg->done_q = reg->done_spare;
        reg->cap_done = reg->cap_spare;
        reg->ndone = 0;
        pthread_mutex_unlock(&reg->done_mu);
        for (size_t i = 0; i < n; i++)
            epoch_done(reg, batch[i]);
        reg->done_spare = batch;
        reg->cap_spare = cap;
        if (n == 0)
            return;
    }
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
    pthread_mutex_init(&reg->done_mu, NULL);
    uv_async_init(loop, &reg->done_async, on_done_async);
    reg->done_async.data = reg;
    uv_async_init(loop, &reg->grow_async, on_grow_async);
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
    for (amx_job_t *j = reg->jobs; j != NULL; j = j->next) {
        if (j->in_flight && j->eng != NULL)
            amx_engine_abort(j->eng, 0, AMX_EABORTED, why);
        fail_all_waiters(reg, j, AMX_EUNAVAIL, why);
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
    free(reg->done_q);
    free(reg->done_spare);
    pthread_mutex_destroy(&reg->done_mu);
    free(reg->stage);
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
        fail_all_waiters(reg, j, AMX_EUNAVAIL, "the daemon is shutting down; retry after restart");
        job_unlink(reg, j);
        job_free(j);
    }
    while (reg->zombies != NULL) {
        amx_job_t *j = reg->zombies;
        reg->zombies = j->next;
        job_free(j);
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

/* ---- Join ---- */

static void complete_join(amx_registry_t *reg, amx_job_t *j, amx_waiter_t *w, int rejoined)
{
    amx_reply_t rep;
    memset(&rep, 0, sizeof(rep));
    rep.world = j->world;
    rep.epoch = j->epoch;
    rep.rejoined = rejoined;
    finish_waiter(reg, w, AMX_OK, NULL, &rep);
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
        if (add_local_rank(j, copy.part[idx].ranks[k]) == NULL) {
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
        remove_local_rank(j, r->rank);
    }
}

static void on_join_answer(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    join_ctx_t *ctx = ud;
    amx_registry_t *reg = ctx->reg;
    amx_job_t *j = ctx->job;
    uint32_t rank = ctx->rank;
    free(ctx);
    amx_lrank_t *r = local_rank(j, rank);
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
        r = local_rank(j, rank);
        if (!j->ready && !r->restored) {
            remove_local_rank(j, rank);
        } else {
            r->joined = 0;
        }
        finish_waiter(reg, w, st, msg, NULL);
        if (!j->ready && j->nlocal == 0 && !j->in_flight) {
            job_unlink(reg, j);
            job_free(j);
        }
        return;
    }
    r = local_rank(j, rank);
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
    r = local_rank(j, rank);
    r->joined = 1;
    r->restored = 0;
    complete_join(reg, j, w, m->rejoined || was_restored);
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
    amx_job_t *j = find_job(reg, req->job);
    if (j != NULL && j->world != req->world)
        return amx_err_set(err, AMX_EPRECOND,
                           "job '%s' exists with world size %u, not %u: every rank must declare "
                           "the same world size (or drop the old job with Reset(drop_job))",
                           req->job, j->world, req->world);
    amx_lrank_t *r = j ? local_rank(j, req->rank) : NULL;
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
        AMX_INFO("registry", "job %s: rank %u re-joined; state kept", j->name, req->rank);
        r->joined = 1;
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
        AMX_CHECK(job_create(reg, req->job, req->world, &j, err));
        created = 1;
    }
    j->last_active_ms = now_ms;
    r = add_local_rank(j, req->rank);
    join_ctx_t *ctx = malloc(sizeof(*ctx));
    if (r == NULL || ctx == NULL) {
        free(ctx);
        if (r != NULL && !j->ready && !r->restored)
            remove_local_rank(j, req->rank);
        if (created) {
            job_unlink(reg, j);
            job_free(j);
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
        r = local_rank(j, req->rank);
        r->join_w = NULL;
        w->job = NULL;
        reg->nwaiting--;
        if (!j->ready && !r->restored)
            remove_local_rank(j, req->rank);
        if (created && j->nlocal == 0) {
            job_unlink(reg, j);
            job_free(j);
        }
        return st;
    }
    r = local_rank(j, req->rank);
    if (r != NULL && r->join_w == w) {
        r->cjoin = h; /* still waiting (the answer may already have come) */
        r->jctx = ctx;
    }
    AMX_DEBUG("registry", "job %s: rank %u joining", j->name, req->rank);
    return AMX_OK;
}

/* ---- Register ---- */

/* One spec after validation, before it is applied. */
typedef struct reg_item {
    amx_qspec_t spec; /* borrowed strings */
    amx_placement_t pl;
    int64_t lid; /* an existing live local quantizer, or -1 */
    int same_placement;
} reg_item_t;

static int lq_live(const amx_lq_t *q)
{
    return q->status == LQ_AGREED || q->status == LQ_PROPOSED;
}

static amx_status_t validate_item(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r,
                                  const amx_qspec_in_t *in, reg_item_t *it, amx_err_t *err)
{
    AMX_CHECK(amx_qspec_parse(in, (uint64_t)reg->cfg->max_cells, &it->spec, err));
    AMX_CHECK(amx_placement_parse(&it->spec, in->offset, in->n_offset, in->local_shape,
                                  in->n_local_shape, &it->pl, err));
    it->lid = -1;
    it->same_placement = 0;
    uint32_t lid;
    if (!amx_strmap_get(&j->lqmap, it->spec.name, &lid) || !lq_live(&j->lq[lid]))
        return AMX_OK;
    const amx_qspec_t *q = j->lq[lid].spec;
    char b1[96], b2[96];
    if (q->ndim != it->spec.ndim ||
        memcmp(q->shape, it->spec.shape, q->ndim * sizeof(uint32_t)) != 0) {
        amx_fmt_shape(b1, sizeof(b1), q->shape, q->ndim);
        amx_fmt_shape(b2, sizeof(b2), it->spec.shape, it->spec.ndim);
        return amx_err_set(err, AMX_EPRECOND,
                           "quantizer '%s' of job '%s' is registered with global shape %s, "
                           "rank %u declares %s: all ranks must declare the same global shape",
                           q->name, j->name, b1, r->rank, b2);
    }
    if (!amx_qspec_equal(q, &it->spec)) {
        if (strcmp(q->peer_group, it->spec.peer_group) != 0 ||
            strcmp(q->scale_group, it->spec.scale_group) != 0)
            return amx_err_set(err, AMX_EPRECOND,
                               "quantizer '%s' of job '%s' is registered with peer_group '%s' and "
                               "scale_group '%s', rank %u declares '%s' and '%s'",
                               q->name, j->name, q->peer_group, q->scale_group, r->rank,
                               it->spec.peer_group, it->spec.scale_group);
        if (q->peer_mode != it->spec.peer_mode || q->global_axes != it->spec.global_axes)
            return amx_err_set(err, AMX_EPRECOND,
                               "quantizer '%s' of job '%s' is registered with peer_mode %s and "
                               "global_axes %u, rank %u declares %s and %u",
                               q->name, j->name, amx_peer_mode_name(q->peer_mode), q->global_axes,
                               r->rank, amx_peer_mode_name(it->spec.peer_mode),
                               it->spec.global_axes);
        return amx_err_set(err, AMX_EPRECOND,
                           "quantizer '%s' of job '%s' is registered with another recipe or "
                           "accumulation than rank %u declares; reset the job or use a new name",
                           q->name, j->name, r->rank);
    }
    it->lid = lid;
    if (lid < r->cap_of && r->pl_of[lid] != 0) {
        const amx_placement_t *old = &r->pls[r->pl_of[lid] - 1];
        if (!amx_placement_equal(old, &it->pl)) {
            amx_fmt_shape(b1, sizeof(b1), old->off, old->ndim);
            amx_fmt_shape(b2, sizeof(b2), old->shape, old->ndim);
            return amx_err_set(err, AMX_EPRECOND,
                               "rank %u already placed quantizer '%s' at offset %s with shape "
                               "%s; a placement cannot change within a job",
                               r->rank, q->name, b1, b2);
        }
        it->same_placement = 1;
    }
    return AMX_OK;
}

static amx_status_t rank_reserve(amx_lrank_t *r, uint32_t nlq, uint32_t npls)
{
    if (nlq > r->cap_of) {
        uint32_t cap = r->cap_of ? r->cap_of : 64;
        while (cap < nlq)
            cap *= 2;
        uint32_t *p = realloc(r->pl_of, cap * sizeof(uint32_t));
        if (p == NULL)
            return AMX_ENOMEM;
        memset(p + r->cap_of, 0, (cap - r->cap_of) * sizeof(uint32_t));
        r->pl_of = p;
        r->cap_of = cap;
    }
    if (npls > r->cap_pls) {
        uint32_t cap = r->cap_pls ? r->cap_pls : 64;
        while (cap < npls)
            cap *= 2;
        amx_placement_t *p = realloc(r->pls, cap * sizeof(amx_placement_t));
        if (p == NULL)
            return AMX_ENOMEM;
        r->pls = p;
        uint32_t *l = realloc(r->pl_lid, cap * sizeof(uint32_t));
        if (l == NULL)
            return AMX_ENOMEM;
        r->pl_lid = l;
        r->cap_pls = cap;
    }
    return AMX_OK;
}

static amx_status_t job_reserve_lq(amx_job_t *j, uint32_t n)
{
    if (n > j->cap_lq) {
        uint32_t cap = j->cap_lq ? j->cap_lq : 64;
        while (cap < n)
            cap *= 2;
        amx_lq_t *q = realloc(j->lq, cap * sizeof(amx_lq_t));
        if (q == NULL)
            return AMX_ENOMEM;
        j->lq = q;
        j->cap_lq = cap;
    }
    return amx_strmap_reserve(&j->lqmap, n) == 0 ? AMX_OK : AMX_ENOMEM;
}

/* Cells a local view holds: agreed, history, provisional. */
static uint64_t view_cells(const amx_job_t *j)
{
    return j->cat->ncells + j->cat->nhist + j->prov_cells + j->prov_hist;
}

/* The memory budget (configuration may be reloaded: an explicit value is
 * read every time; 0 means the default found at start). */
static uint64_t reg_budget(const amx_registry_t *reg)
{
    return reg->cfg->memory_budget > 0 ? (uint64_t)reg->cfg->memory_budget : reg->budget;
}

/* Records a device fault of the state backend: CUDA errors are sticky, so
 * every later epoch would fail too; Health reports it. Returns st. */
static amx_status_t note_fault(amx_registry_t *reg, amx_status_t st, const char *msg)
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

/* The growth above which pending buffers are grown by a thread of their
 * own (about 10 ms of filling on the loop). */
#define GROW_ASYNC_CELLS (4u << 20)

static void *grow_main(void *arg)
{
    amx_job_t *j = arg;
    j->state->ops->fill_pending(j->state);
    __atomic_store_n(&j->grow_done, 1, __ATOMIC_RELEASE);
    uv_async_send((uv_async_t *)j->grow_wake);
    return NULL;
}

/* Starts growing the pending buffers to `cells` off the loop; AMX_OK and
 * *started when it did (the Register waits for it), AMX_OK and !*started
 * when the growth is small or the backend has no such path (do it now). */
static amx_status_t grow_async(amx_registry_t *reg, amx_job_t *j, uint64_t cells, int *started,
                               amx_err_t *err)
{
    *started = 0;
    amx_state_t *st = j->state;
    if (st->ops->grow_pending == NULL || cells <= st->pend_cells ||
        cells - st->pend_cells < GROW_ASYNC_CELLS)
        return AMX_OK;
    AMX_CHECK(st->ops->grow_pending(st, cells, err));
    j->grow_done = 0;
    j->grow_wake = &reg->grow_async;
    if (pthread_create(&j->grow_th, NULL, grow_main, j) != 0) {
        st->ops->fill_pending(st); /* no thread: fill here */
        return AMX_OK;
    }
    j->growing = 1;
    *started = 1;
    AMX_DEBUG("registry", "job %s: growing pending buffers to %llu cells off the loop", j->name,
              (unsigned long long)cells);
    return AMX_OK;
}

/*
 * The peer mode belongs to the group: every member of a peer group (in this
 * request, and among the job's agreed and proposed quantizers) must declare
 * the same one. INVALID_ARGUMENT naming the group, two members and their
 * modes otherwise. One pass over the request and one over the job.
 */
static amx_status_t check_peer_modes(amx_job_t *j, const reg_item_t *items, size_t n,
                                     amx_err_t *err)
{
    amx_strmap_t groups = {0}; /* group -> index of its first item in the request */
    amx_status_t st = AMX_OK;
    if (amx_strmap_reserve(&groups, n) != 0)
        return amx_err_set(err, AMX_ENOMEM, "out of memory checking peer groups");
    for (size_t i = 0; i < n; i++) {
        const amx_qspec_t *s = &items[i].spec;
        uint32_t k;
        if (s->peer_group[0] == '\0')
            continue;
        if (!amx_strmap_get(&groups, s->peer_group, &k)) {
            amx_strmap_put(&groups, s->peer_group, (uint32_t)i); /* reserved: cannot fail */
            continue;
        }
        const amx_qspec_t *o = &items[k].spec;
        if (o->peer_mode != s->peer_mode) {
            st = amx_err_set(err, AMX_EINVAL,
                             "peer group '%s' of job '%s': quantizer '%s' declares peer_mode %s "
                             "and quantizer '%s' %s in the same request; every member of a peer "
                             "group must declare the same peer_mode",
                             s->peer_group, j->name, o->name, amx_peer_mode_name(o->peer_mode),
                             s->name, amx_peer_mode_name(s->peer_mode));
            goto out;
        }
    }
    for (uint32_t lid = 0; groups.len > 0 && lid < j->nlq; lid++) {
        const amx_lq_t *q = &j->lq[lid];
        uint32_t k;
        if (!lq_live(q) || q->spec->peer_group[0] == '\0' ||
            !amx_strmap_get(&groups, q->spec->peer_group, &k))
            continue;
        const amx_qspec_t *s = &items[k].spec;
        if (q->spec->peer_mode != s->peer_mode) {
            st = amx_err_set(err, AMX_EINVAL,
                             "peer group '%s' of job '%s' has peer_mode %s (quantizer '%s' is "
                             "%s), quantizer '%s' declares %s; every member of a peer group must "
                             "declare the same peer_mode",
                             s->peer_group, j->name, amx_peer_mode_name(q->spec->peer_mode),
                             q->spec->name, q->status == LQ_AGREED ? "agreed" : "registered",
                             s->name, amx_peer_mode_name(s->peer_mode));
            goto out;
        }
    }
out:
    amx_strmap_free(&groups);
    return st;
}

static amx_status_t do_register(amx_registry_t *reg, amx_job_t *j, const amx_register_req_t *req,
                                amx_reply_t *rep, int *deferred, amx_err_t *err)
{
    *deferred = 0;
    amx_lrank_t *r = local_rank(j, req->rank);
    size_t n = req->n;
    if (n == 0)
        return amx_err_set(err, AMX_EINVAL, "Register of rank %u, job '%s' names no quantizer",
                           req->rank, j->name);
    reg_item_t *items = calloc(n, sizeof(*items));
    amx_qspec_t **owned = calloc(n, sizeof(*owned));
    amx_strmap_t seen = {0};
    amx_status_t st = AMX_OK;
    if (items == NULL || owned == NULL || amx_strmap_reserve(&seen, n) != 0) {
        st = amx_err_set(err, AMX_ENOMEM, "out of memory registering %zu quantizers", n);
        goto out;
    }
    /* Phase 1: validate everything; nothing changes. */
    uint64_t new_cells = 0, new_hist = 0;
    uint32_t new_q = 0, new_pls = 0;
    for (size_t i = 0; i < n; i++) {
        reg_item_t *it = &items[i];
        AMX_CHECK_GOTO(validate_item(reg, j, r, &req->q[i], it, err), st, out);
        uint32_t prev;
        if (amx_strmap_get(&seen, it->spec.name, &prev)) {
            st = amx_err_set(err, AMX_EINVAL,
                             "quantizer '%s' appears twice in one Register request of rank %u",
                             it->spec.name, req->rank);
            goto out;
        }
        amx_strmap_put(&seen, it->spec.name, (uint32_t)i);
        if (it->lid < 0) {
            new_q++;
            new_cells += it->spec.ncells;
            new_hist += amx_qspec_hist_cells(&it->spec);
        }
        if (!it->same_placement)
            new_pls++;
    }
    AMX_CHECK_GOTO(check_peer_modes(j, items, n, err), st, out);
    uint64_t have = view_cells(j);
    if (have + new_cells + new_hist > (uint64_t)reg->cfg->max_cells) {
        st = amx_err_set(err, AMX_ENOMEM,
                         "job '%s' would hold %llu amax cells (history included), more than "
                         "max_cells=%lld; register fewer or smaller quantizers or raise max_cells",
                         j->name, (unsigned long long)(have + new_cells + new_hist),
                         (long long)reg->cfg->max_cells);
        goto out;
    }
    /* What the jobs hold: their catalogs, or their pending buffers where
     * those are larger (a growth for a Register that was then cancelled);
     * jobs dropped while busy too. */
    uint64_t used = 0;
    for (int list = 0; list < 2; list++)
        for (const amx_job_t *o = list ? reg->zombies : reg->jobs; o != NULL; o = o->next) {
            uint64_t v = view_cells(o), p = o->state ? o->state->pend_cells : 0;
            used += v > p ? v : p;
        }
    if (j->state != NULL && j->state->pend_cells > view_cells(j))
        used -= j->state->pend_cells - view_cells(j); /* this job's growth is counted as new */
    if ((used + new_cells + new_hist) * AMX_STATE_BYTES_PER_CELL > reg_budget(reg)) {
        st = amx_err_set(
            err, AMX_ENOMEM,
            "the jobs of this daemon would hold %llu amax cells, about %llu MiB of "
            "state (%d bytes a cell), more than memory_budget=%llu MiB (%s); "
            "register fewer or smaller quantizers, drop unused jobs, or raise "
            "memory_budget",
            (unsigned long long)(used + new_cells + new_hist),
            (unsigned long long)((used + new_cells + new_hist) * AMX_STATE_BYTES_PER_CELL >> 20),
            AMX_STATE_BYTES_PER_CELL, (unsigned long long)(reg_budget(reg) >> 20),
            reg->cfg->memory_budget > 0 ? "configured" : reg->budget_src);
        goto out;
    }
    if ((uint64_t)j->cat->n + j->nprop + new_q > (uint64_t)reg->cfg->max_quantizers) {
        st = amx_err_set(err, AMX_ENOMEM,
                         "job '%s' would hold %llu quantizers, more than max_quantizers=%lld",
                         j->name, (unsigned long long)j->cat->n + j->nprop + new_q,
                         (long long)reg->cfg->max_quantizers);
        goto out;
    }
    /* Phase 2: make room (may fail, changes nothing visible). */
    for (size_t i = 0; i < n; i++)
        if (items[i].lid < 0 && (owned[i] = amx_qspec_dup(&items[i].spec)) == NULL) {
            st = amx_err_set(err, AMX_ENOMEM, "out of memory registering %zu quantizers", n);
            goto out;
        }
    if (job_reserve_lq(j, j->nlq + new_q) != AMX_OK ||
        rank_reserve(r, j->nlq + new_q, r->npls + new_pls) != AMX_OK) {
        st = amx_err_set(err, AMX_ENOMEM, "out of memory registering %zu quantizers", n);
        goto out;
    }
    uint64_t need = j->cat->ncells + j->prov_cells + new_cells;
    st = grow_async(reg, j, need, deferred, err);
    if (st == AMX_OK && *deferred)
        goto out; /* nothing applied: the Register runs again once the buffers are ready */
    if (st == AMX_OK)
        st = j->state->ops->reserve_pending(j->state, need, err);
    if (st != AMX_OK) {
        note_fault(reg, st, err->msg);
        goto out;
    }
    /* Phase 3: apply; nothing below can fail. */
    uint32_t created = 0, existing = 0;
    for (size_t i = 0; i < n; i++) {
        reg_item_t *it = &items[i];
        uint32_t lid;
        if (it->lid >= 0) {
            lid = (uint32_t)it->lid;
            existing++;
        } else {
            uint32_t dead;
            amx_qspec_t *old = NULL; /* freed once the map key moved to the new spec */
            if (amx_strmap_get(&j->lqmap, it->spec.name, &dead)) {
                lid = dead; /* a quantizer dropped for a conflict, registered again */
                old = j->lq[lid].spec;
            } else {
                lid = j->nlq++;
            }
            amx_lq_t *q = &j->lq[lid];
            memset(q, 0, sizeof(*q));
            q->spec = owned[i];
            owned[i] = NULL;
            q->cidx = -1;
            q->status = LQ_PROPOSED;
            q->base = j->cat->ncells + j->prov_cells;
            j->prov_cells += q->spec->ncells;
            j->prov_hist += amx_qspec_hist_cells(q->spec);
            j->nprop++;
            amx_strmap_put(&j->lqmap, q->spec->name, lid); /* reserved: cannot fail */
            amx_qspec_free(old);
            created++;
        }
        if (!it->same_placement) {
            r->pls[r->npls] = it->pl;
            r->pl_lid[r->npls] = lid;
            r->pl_of[lid] = ++r->npls;
            j->lq[lid].nplacements++;
        }
    }
    if (created > 0 || new_pls > 0)
        j->layout_gen++;
    rep->created = created;
    rep->existing = existing;
    rep->catalog_size = j->cat->n + j->nprop;
    AMX_DEBUG("registry",
              "job %s: rank %u registered %u new, %u known quantizers (catalog %u "
              "agreed + %u proposed)",
              j->name, req->rank, created, existing, j->cat->n, j->nprop);
out:
    if (owned != NULL)
        for (size_t i = 0; i < n; i++)
            amx_qspec_free(owned[i]);
    free(owned);
    free(items);
    amx_strmap_free(&seen);
    return st;
}

static amx_status_t defer(amx_job_t *j, int kind, amx_waiter_t *w, const void *req, amx_err_t *err)
{
    amx_deferred_t *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    d->kind = kind;
    d->w = w;
    d->req = req;
    *j->defer_tail = d;
    j->defer_tail = &d->next;
    return AMX_OK;
}

amx_status_t amx_registry_register(amx_registry_t *reg, const amx_register_req_t *req,
                                   amx_waiter_t *w, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, 1, &j, err));
    int deferred = 0;
    amx_reply_t rep;
    memset(&rep, 0, sizeof(rep));
    /* The catalog and the buffers belong to the engine until it returns,
     * and new cells wait for a growth to end. */
    if (!j->in_flight && !j->growing)
        AMX_CHECK(do_register(reg, j, req, &rep, &deferred, err));
    if (j->in_flight || j->growing) {
        AMX_CHECK(defer(j, WAIT_REGISTER, w, req, err));
        w->job = j;
        w->kind = WAIT_REGISTER;
        reg->nwaiting++;
        return AMX_OK;
    }
    w->job = NULL;
    w->done(w, AMX_OK, NULL, &rep);
    return AMX_OK;
}

/* ---- SendAmax ---- */

/* The epoch SendAmax adds to: the next one while an epoch is in flight. */
static uint64_t send_epoch(const amx_job_t *j)
{
    return j->in_flight ? j->epoch + 1 : j->epoch;
}

static amx_status_t check_epoch(const amx_job_t *j, uint64_t open, uint64_t want, uint32_t rank,
                                const char *what, amx_err_t *err)
{
    if (want == 0 || want == open)
        return AMX_OK;
    if (want < open)
        return amx_err_set(err, AMX_EPRECOND,
                           "%s of rank %u names epoch %llu of job '%s', which is already "
                           "reconciled or being reconciled; the open epoch is %llu (or pass "
                           "epoch 0)",
                           what, rank, (unsigned long long)want, j->name, (unsigned long long)open);
    return amx_err_set(err, AMX_EPRECOND,
                       "%s of rank %u names epoch %llu of job '%s', which is not open yet; the "
                       "open epoch is %llu",
                       what, rank, (unsigned long long)want, j->name, (unsigned long long)open);
}

typedef struct stage_ctx {
    amx_registry_t *reg;
    size_t nruns;
    uint64_t src_base;
} stage_ctx_t;

static void stage_row(void *ud, uint64_t dst, uint64_t src, uint64_t len)
{
    stage_ctx_t *c = ud;
    amx_run_t *run = &c->reg->runs[c->nruns++];
    run->dst = dst;
    run->src = c->src_base + src;
    run->len = len;
}

static amx_status_t stage_reserve(amx_registry_t *reg, uint64_t nvals, size_t nruns)
{
    if (nvals > reg->stage_cap) {
        uint64_t cap = reg->stage_cap ? reg->stage_cap : 4096;
        while (cap < nvals)
            cap *= 2;
        float *p = realloc(reg->stage, cap * sizeof(float));
        if (p == NULL)
            return AMX_ENOMEM;
        reg->stage = p;
        reg->stage_cap = cap;
    }
    if (nruns > reg->runs_cap) {
        size_t cap = reg->runs_cap ? reg->runs_cap : 1024;
        while (cap < nruns)
            cap *= 2;
        amx_run_t *p = realloc(reg->runs, cap * sizeof(amx_run_t));
        if (p == NULL)
            return AMX_ENOMEM;
        reg->runs = p;
        reg->runs_cap = cap;
    }
    return AMX_OK;
}

static int normalize_slab(float *dst, const void *src, const uint8_t *mask, uint64_t total);
static uint64_t bad_cell(const float *v, const uint8_t *mask, uint64_t total);

amx_status_t amx_registry_send(amx_registry_t *reg, const amx_send_req_t *req, uint64_t *accepted,
                               uint64_t *epoch, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, 1, &j, err));
    uint64_t open = send_epoch(j);
    AMX_CHECK(check_epoch(j, open, req->epoch, req->rank, "SendAmax", err));
    amx_lrank_t *r = local_rank(j, req->rank);
    if (r->in_reconcile && !j->in_flight)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' already entered Reconcile for epoch %llu; send "
                           "amax before calling Reconcile (this update belongs to the next epoch)",
                           req->rank, j->name, (unsigned long long)j->epoch);
    /* Pass 1: names, placements and sizes. */
    uint64_t nvals = 0;
    size_t nruns = 0;
    int overlap = 0;
    if (++j->batch == 0) { /* wrapped: forget old stamps */
        for (uint32_t i = 0; i < j->nlq; i++)
            j->lq[i].stamp = 0;
        j->batch = 1;
    }
    if (req->n > reg->lids_cap) {
        size_t cap = reg->lids_cap ? reg->lids_cap : 1024;
        while (cap < req->n)
            cap *= 2;
        uint32_t *p = realloc(reg->lids, cap * sizeof(uint32_t));
        if (p == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory reading %zu updates", req->n);
        reg->lids = p;
        reg->lids_cap = cap;
    }
    for (size_t u = 0; u < req->n; u++) {
        const amx_update_in_t *up = &req->u[u];
        uint32_t lid;
        if (!amx_strmap_get(&j->lqmap, up->name, &lid) || !lq_live(&j->lq[lid]))
            return amx_err_set(err, AMX_ENOTFOUND,
                               "update %zu: quantizer '%.255s' is not registered in job '%s'", u,
                               up->name, j->name);
        if (lid >= r->cap_of || r->pl_of[lid] == 0)
            return amx_err_set(err, AMX_EPRECOND,
                               "update %zu: rank %u has no placement for quantizer '%s' of job "
                               "'%s'; Register it from this rank first",
                               u, req->rank, up->name, j->name);
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        overlap |= j->lq[lid].stamp == j->batch; /* named twice in this batch */
        j->lq[lid].stamp = j->batch;
        if (up->values_len != pl->ncells * sizeof(float))
            return amx_err_set(err, AMX_EINVAL,
                               "update %zu: quantizer '%s' has %zu bytes of values; rank %u's "
                               "block has %llu float32 cells = %llu bytes",
                               u, up->name, up->values_len, req->rank,
                               (unsigned long long)pl->ncells,
                               (unsigned long long)pl->ncells * sizeof(float));
        if (up->has_data_len != 0 && up->has_data_len != pl->ncells)
            return amx_err_set(err, AMX_EINVAL,
                               "update %zu: quantizer '%s' has_data has %zu bytes; it needs one "
                               "per cell of rank %u's block (%llu) or none",
                               u, up->name, up->has_data_len, req->rank,
                               (unsigned long long)pl->ncells);
        nvals += pl->ncells;
        nruns += amx_placement_nrows(pl);
        reg->lids[u] = lid;
    }
    if (stage_reserve(reg, nvals, nruns) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of memory staging %llu amax values",
                           (unsigned long long)nvals);
    /* Pass 2: values, staged as host floats. */
    stage_ctx_t ctx = {reg, 0, 0};
    for (size_t u = 0; u < req->n; u++) {
        const amx_update_in_t *up = &req->u[u];
        uint32_t lid = reg->lids[u]; /* found in pass 1: one lookup per update */
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        float *dst = reg->stage + ctx.src_base;
        const uint8_t *mask = up->has_data_len ? up->has_data : NULL;
        /* float32 LE on an LE host; cells without data -inf (the merge
         * leaves them as they are). */
        if (!normalize_slab(dst, up->values, mask, pl->ncells)) {
            uint64_t c = bad_cell(dst, mask, pl->ncells);
            return amx_err_set(err, AMX_EINVAL,
                               "update %zu: quantizer '%s' value[%llu] = %g; amax values must "
                               "be finite and >= 0 (nothing of this request was applied)",
                               u, up->name, (unsigned long long)c, (double)dst[c]);
        }
        amx_placement_rows(pl, j->lq[lid].spec->shape, j->lq[lid].base, stage_row, &ctx);
        ctx.src_base += pl->ncells;
    }
    amx_status_t mst =
        j->state->ops->merge(j->state, reg->stage, nvals, reg->runs, ctx.nruns, overlap, err);
    if (mst != AMX_OK)
        return note_fault(reg, mst, err->msg);
    j->updates += req->n;
    if (reg->metrics != NULL) {
        uint64_t bytes = 0;
        for (size_t u = 0; u < req->n; u++)
            bytes += req->u[u].values_len + req->u[u].has_data_len;
        amx_metrics_job_updates(reg->metrics, j->name, req->n, bytes);
    }
    *accepted = req->n;
    *epoch = open;
    return AMX_OK;
}

/* ---- the packed form: slab layouts ---- */

static uint64_t global_slice(const amx_placement_t *pl, const uint32_t *gshape, uint32_t k,
                             uint64_t j);

/* Global slices that quantizer q's block pl overlaps (0 without slices). */
static uint64_t block_slices(const amx_qspec_t *q, const amx_placement_t *pl)
{
    if (q->global_axes == 0 || pl->ncells == 0)
        return 0;
    uint64_t ns = 1;
    for (uint32_t d = 0; d < q->global_axes; d++)
        ns *= pl->shape[d];
    return ns;
}

typedef struct slab_ent {
    const char *name;
    uint32_t lid;
} slab_ent_t;

static int ent_cmp(const void *a, const void *b)
{
    return strcmp(((const slab_ent_t *)a)->name, ((const slab_ent_t *)b)->name);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

typedef struct slab_build {
    amx_slab_t *sl;
    uint64_t slab_base;
    int agreed;
} slab_build_t;

/* One row of a block: merge run (pending <- slab), and for an agreed
 * quantizer the gather run (slab <- outputs); each joined to the run
 * before it when both sides continue it. */
static void slab_row(void *ud, uint64_t flat, uint64_t boff, uint64_t len)
{
    slab_build_t *b = ud;
    amx_slab_t *sl = b->sl;
    uint64_t cell = b->slab_base + boff;
    amx_run_t *m = sl->nmerge ? &sl->merge[sl->nmerge - 1] : NULL;
    if (m != NULL && m->dst + m->len == flat && m->src + m->len == cell)
        m->len += len;
    else
        sl->merge[sl->nmerge++] = (amx_run_t){flat, cell, len};
    if (!b->agreed)
        return;
    amx_run_t *g = sl->ngather ? &sl->gather[sl->ngather - 1] : NULL;
    if (g != NULL && g->src + g->len == flat && g->dst + g->len == cell)
        g->len += len;
    else
        sl->gather[sl->ngather++] = (amx_run_t){cell, flat, len};
    sl->gather_cells += len;
}

/* The rank's slab layout, rebuilt when the job's layout moved on. */
static amx_status_t slab_get(amx_job_t *j, amx_lrank_t *r, amx_slab_t **out, amx_err_t *err)
{
    if (r->slab != NULL && r->slab->gen == j->layout_gen) {
        *out = r->slab;
        return AMX_OK;
    }
    uint32_t n = 0;
    uint64_t nrows = 0, nsl = 0;
    for (uint32_t i = 0; i < r->npls; i++) {
        uint32_t lid = r->pl_lid[i];
        if (r->pl_of[lid] == i + 1 && lq_live(&j->lq[lid])) {
            n++;
            nrows += amx_placement_nrows(&r->pls[i]);
            nsl += block_slices(j->lq[lid].spec, &r->pls[i]);
        }
    }
    amx_slab_t *sl = calloc(1, sizeof(*sl));
    slab_ent_t *e = malloc((n ? n : 1) * sizeof(*e));
    if (sl != NULL) {
        sl->lid = malloc((n ? n : 1) * sizeof(uint32_t));
        sl->off = malloc((n + 1) * sizeof(uint64_t));
        sl->merge = malloc((nrows ? nrows : 1) * sizeof(amx_run_t));
        sl->gather = malloc((nrows ? nrows : 1) * sizeof(amx_run_t));
        sl->soff = malloc((n + 1) * sizeof(uint64_t));
        sl->sg = malloc((nsl ? nsl : 1) * sizeof(uint64_t));
        sl->cidx = malloc((n ? n : 1) * sizeof(uint32_t));
        sl->pendq = malloc((n ? n : 1) * sizeof(uint32_t));
        sl->peerq = malloc((n ? n : 1) * sizeof(uint32_t));
    }
    if (sl == NULL || e == NULL || sl->lid == NULL || sl->off == NULL || sl->merge == NULL ||
        sl->gather == NULL || sl->soff == NULL || sl->sg == NULL || sl->cidx == NULL ||
        sl->pendq == NULL || sl->peerq == NULL) {
        free(e);
        slab_free(sl);
        return amx_err_set(err, AMX_ENOMEM, "out of memory building the slab layout of rank %u",
                           r->rank);
    }
    /* The same quantizers as the slab of before (the usual case: the
     * agreement of this rank's proposals changed their statuses and bases,
     * not the set): their order is kept, without sorting the names again. */
    const amx_slab_t *old = r->slab;
    int same = old != NULL && old->n == n;
    for (uint32_t i = 0; same && i < n; i++) {
        uint32_t lid = old->lid[i];
        same = lid < r->cap_of && r->pl_of[lid] != 0 && r->pl_lid[r->pl_of[lid] - 1] == lid &&
               lq_live(&j->lq[lid]);
    }
    if (same) {
        for (uint32_t i = 0; i < n; i++)
            e[i] = (slab_ent_t){j->lq[old->lid[i]].spec->name, old->lid[i]};
    } else {
        uint32_t k = 0;
        for (uint32_t i = 0; i < r->npls; i++) {
            uint32_t lid = r->pl_lid[i];
            if (r->pl_of[lid] == i + 1 && lq_live(&j->lq[lid]))
                e[k++] = (slab_ent_t){j->lq[lid].spec->name, lid};
        }
        qsort(e, n, sizeof(*e), ent_cmp);
    }
    uint64_t h = 1469598103934665603ull, cell = 0, ns = 0;
    slab_build_t b = {sl, 0, 0};
    for (uint32_t i = 0; i < n; i++) {
        uint32_t lid = e[i].lid;
        const amx_lq_t *q = &j->lq[lid];
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        sl->lid[i] = lid;
        sl->off[i] = cell;
        h = fnv(h, q->spec->name, strlen(q->spec->name) + 1);
        h = fnv(h, q->spec->shape, q->spec->ndim * sizeof(uint32_t));
        h = fnv(h, &pl->ndim, sizeof(pl->ndim));
        h = fnv(h, pl->off, pl->ndim * sizeof(uint32_t));
        h = fnv(h, pl->shape, pl->ndim * sizeof(uint32_t));
        h = fnv(h, &q->spec->recipe.format, sizeof(q->spec->recipe.format));
        h = fnv(h, &q->spec->global_axes, sizeof(q->spec->global_axes));
        sl->soff[i] = ns;
        sl->cidx[i] = q->status == LQ_AGREED ? (uint32_t)q->cidx : UINT32_MAX;
        if (q->status != LQ_AGREED)
            sl->pendq[sl->npendq++] = i;
        if (q->spec->peer_group[0] != '\0')
            sl->peerq[sl->npeerq++] = i;
        uint64_t bs = block_slices(q->spec, pl);
        for (uint64_t s = 0; s < bs; s++)
            sl->sg[ns + s] =
                q->status == LQ_AGREED
                    ? q->gbase + global_slice(pl, q->spec->shape, q->spec->global_axes, s)
                    : UINT64_MAX;
        ns += bs;
        b.slab_base = cell;
        b.agreed = q->status == LQ_AGREED;
        amx_placement_rows(pl, q->spec->shape, q->base, slab_row, &b);
        cell += pl->ncells;
    }
    sl->off[n] = cell;
    sl->soff[n] = ns;
    sl->n = n;
    sl->gen = j->layout_gen;
    sl->id = fnv(h, &n, sizeof(n));
    free(e);
    slab_free(r->slab);
    r->slab = sl;
    *out = sl;
    return AMX_OK;
}

static amx_status_t check_layout_id(const amx_job_t *j, const amx_lrank_t *r, const amx_slab_t *sl,
                                    uint64_t id, const char *what, amx_err_t *err)
{
    if (id == sl->id)
        return AMX_OK;
    return amx_err_set(err, AMX_EPRECOND,
                       "%s of rank %u, job '%s': layout id %016llx is stale (the rank's "
                       "quantizers or placements changed since it was fetched; the layout is now "
                       "%016llx with %u quantizers, %llu cells): fetch the layout again "
                       "(GetLayout) and pack the values by it",
                       what, r->rank, j->name, (unsigned long long)id, (unsigned long long)sl->id,
                       sl->n, (unsigned long long)sl->off[sl->n]);
}

amx_status_t amx_registry_layout(amx_registry_t *reg, const char *job, uint32_t rank,
                                 amx_layout_t *out, amx_arena_t *a, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(ready_job(reg, job, rank, 1, &j, err));
    amx_lrank_t *r = local_rank(j, rank);
    amx_slab_t *sl;
    AMX_CHECK(slab_get(j, r, &sl, err));
    uint32_t n = sl->n;
    size_t nd = 0;
    for (uint32_t i = 0; i < n; i++)
        nd += r->pls[r->pl_of[sl->lid[i]] - 1].ndim;
    memset(out, 0, sizeof(*out));
    out->id = sl->id;
    out->total_cells = sl->off[n];
    out->n = n;
    out->ndims = nd;
    size_t m = n ? n : 1, md = nd ? nd : 1;
    out->names = amx_arena_alloc(a, m * sizeof(char *));
    out->slab_offset = amx_arena_alloc(a, m * sizeof(uint64_t));
    out->ncells = amx_arena_alloc(a, m * sizeof(uint64_t));
    out->ndim = amx_arena_alloc(a, m * sizeof(uint32_t));
    out->format = amx_arena_alloc(a, m * sizeof(int));
    out->block_offset = amx_arena_alloc(a, md * sizeof(uint32_t));
    out->block_shape = amx_arena_alloc(a, md * sizeof(uint32_t));
    out->global_shape = amx_arena_alloc(a, md * sizeof(uint32_t));
    out->global_axes = amx_arena_alloc(a, m * sizeof(uint32_t));
    out->slice_offset = amx_arena_alloc(a, m * sizeof(uint64_t));
    out->total_slices = sl->soff[n];
    if (out->names == NULL || out->slab_offset == NULL || out->ncells == NULL ||
        out->ndim == NULL || out->format == NULL || out->block_offset == NULL ||
        out->block_shape == NULL || out->global_shape == NULL || out->global_axes == NULL ||
        out->slice_offset == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory describing a layout of %u quantizers",
                           n);
    size_t d = 0;
    for (uint32_t i = 0; i < n; i++) {
        const amx_lq_t *q = &j->lq[sl->lid[i]];
        const amx_placement_t *pl = &r->pls[r->pl_of[sl->lid[i]] - 1];
        out->names[i] = q->spec->name;
        out->slab_offset[i] = sl->off[i];
        out->ncells[i] = pl->ncells;
        out->ndim[i] = pl->ndim;
        out->format[i] = q->spec->recipe.format;
        out->global_axes[i] = q->spec->global_axes;
        out->slice_offset[i] = sl->soff[i];
        for (uint32_t k = 0; k < pl->ndim; k++, d++) {
            out->block_offset[d] = pl->off[k];
            out->block_shape[d] = pl->shape[k];
            out->global_shape[d] = q->spec->shape[k];
        }
    }
    return AMX_OK;
}

/*
 * Validates n float32 cells read from src (any alignment; src may be dst)
 * into dst: cells with data (mask NULL: all) must hold a finite value >= 0;
 * -0.0 becomes +0.0 and cells without data -inf. A bad cell keeps its
 * value in dst, so that bad_cell(dst) finds the first whatever the
 * floating-point mode. Returns 0 when some cell with data was bad (the
 * caller refuses the request whole).
 */
static int normalize_slab(float *dst, const void *src, const uint8_t *mask, uint64_t total)
{
    const uint8_t *s = src;
    uint64_t c = 0;
    int ok = 1;
#if defined(__SSE2__)
    const __m128 zero = _mm_setzero_ps(), big = _mm_set1_ps(FLT_MAX), ninf = _mm_set1_ps(-INFINITY);
    __m128 good = _mm_castsi128_ps(_mm_set1_epi32(-1));
    const __m128i z = _mm_setzero_si128();
    for (; total - c >= 4; c += 4) {
        __m128 none = _mm_setzero_ps(); /* lanes without data */
        if (mask != NULL) {
            int32_t m4;
            memcpy(&m4, mask + c, 4);
            __m128i b = _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(m4), z), z);
            none = _mm_castsi128_ps(_mm_cmpeq_epi32(b, z));
        }
        __m128 x = _mm_loadu_ps((const float *)(const void *)(s + 4 * c));
        __m128 valid = _mm_and_ps(_mm_cmpge_ps(x, zero), _mm_cmple_ps(x, big));
        good = _mm_and_ps(good, _mm_or_ps(none, valid));
        /* -0.0 + 0.0 = +0.0 where valid; bad lanes as they were */
        x = _mm_or_ps(_mm_and_ps(valid, _mm_add_ps(x, zero)), _mm_andnot_ps(valid, x));
        _mm_storeu_ps(dst + c, _mm_or_ps(_mm_and_ps(none, ninf), _mm_andnot_ps(none, x)));
    }
    ok = _mm_movemask_ps(good) == 0xf;
#endif
    for (; c < total; c++) {
        float x;
        memcpy(&x, s + 4 * c, 4);
        int has = mask == NULL || mask[c] != 0, valid = x >= 0.0f && x <= FLT_MAX;
        ok &= !has || valid;
        dst[c] = !has ? -INFINITY : valid ? x + 0.0f : x;
    }
    return ok;
}

/* The first cell with data of v[0..total) that normalize_slab refused
 * (there is one when it returned 0). */
static uint64_t bad_cell(const float *v, const uint8_t *mask, uint64_t total)
{
    uint64_t c;
    for (c = 0; c + 1 < total; c++)
        if (!(v[c] >= 0.0f && v[c] <= FLT_MAX) && !(mask != NULL && mask[c] == 0))
            break;
    return c;
}

/* The layout index of slab cell c (binary search over the offsets). */
static uint32_t slab_index(const amx_slab_t *sl, uint64_t c)
{
    uint32_t lo = 0, hi = sl->n;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (sl->off[mid] <= c)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

amx_status_t amx_registry_send_packed(amx_registry_t *reg, const amx_send_packed_req_t *req,
                                      uint64_t *accepted, uint64_t *epoch, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, 1, &j, err));
    uint64_t open = send_epoch(j);
    AMX_CHECK(check_epoch(j, open, req->epoch, req->rank, "SendPacked", err));
    amx_lrank_t *r = local_rank(j, req->rank);
    if (r->in_reconcile && !j->in_flight)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' already entered Reconcile for epoch %llu; send "
                           "amax before calling Reconcile (this update belongs to the next epoch)",
                           req->rank, j->name, (unsigned long long)j->epoch);
    amx_slab_t *sl;
    AMX_CHECK(slab_get(j, r, &sl, err));
    AMX_CHECK(check_layout_id(j, r, sl, req->layout_id, "SendPacked", err));
    uint64_t total = sl->off[sl->n];
    if (req->values_len != total * sizeof(float))
        return amx_err_set(err, AMX_EINVAL,
                           "SendPacked of rank %u, job '%s': %zu bytes of values; the layout "
                           "%016llx has %llu float32 cells = %llu bytes",
                           req->rank, j->name, req->values_len, (unsigned long long)sl->id,
                           (unsigned long long)total, (unsigned long long)total * 4);
    if (req->has_data_len != 0 && req->has_data_len != total)
        return amx_err_set(err, AMX_EINVAL,
                           "SendPacked of rank %u, job '%s': has_data has %zu bytes; it needs one "
                           "per cell of the layout (%llu) or none",
                           req->rank, j->name, req->has_data_len, (unsigned long long)total);
    /* Validate and normalize in place (the request's own buffer): no state
     * changes before every value passed. */
    float *v = req->values;
    const uint8_t *mask = req->has_data_len ? req->has_data : NULL;
    if (!normalize_slab(v, v, mask, total)) {
        uint64_t c = bad_cell(v, mask, total);
        uint32_t qi = slab_index(sl, c);
        return amx_err_set(err, AMX_EINVAL,
                           "SendPacked of rank %u, job '%s': cell %llu (quantizer '%s', its "
                           "value[%llu]) = %g; amax values must be finite and >= 0 (nothing of "
                           "this request was applied)",
                           req->rank, j->name, (unsigned long long)c, j->lq[sl->lid[qi]].spec->name,
                           (unsigned long long)(c - sl->off[qi]), (double)v[c]);
    }
    amx_status_t mst = j->state->ops->merge(j->state, v, total, sl->merge, sl->nmerge, 0, err);
    if (mst != AMX_OK)
        return note_fault(reg, mst, err->msg);
    j->updates += sl->n;
    if (reg->metrics != NULL)
        amx_metrics_job_updates(reg->metrics, j->name, sl->n, req->values_len + req->has_data_len);
    *accepted = sl->n;
    *epoch = open;
    return AMX_OK;
}

/* Whether a cell of a[0..n) holds -inf. */
static int has_neg_inf(const float *a, uint64_t n)
{
    uint64_t c = 0;
    int k = 0;
#if defined(__SSE2__)
    const __m128 ninf = _mm_set1_ps(-INFINITY);
    __m128 any = _mm_setzero_ps();
    for (; n - c >= 4; c += 4)
        any = _mm_or_ps(any, _mm_cmpeq_ps(_mm_loadu_ps(a + c), ninf));
    k = _mm_movemask_ps(any) != 0;
#endif
    for (; c < n; c++)
        k |= a[c] == -INFINITY;
    return k;
}

/* Cells of a[0..n) without data anywhere (-inf) read 0; returns how many. */
static uint32_t zero_missing(float *a, uint64_t n)
{
    uint64_t c = 0, miss = 0;
#if defined(__SSE2__)
    const __m128 ninf = _mm_set1_ps(-INFINITY);
    __m128i cnt = _mm_setzero_si128();
    for (; n - c >= 4; c += 4) {
        __m128 x = _mm_loadu_ps(a + c);
        __m128 none = _mm_cmpeq_ps(x, ninf);
        if (_mm_movemask_ps(none) == 0)
            continue;
        cnt = _mm_sub_epi32(cnt, _mm_castps_si128(none));
        _mm_storeu_ps(a + c, _mm_andnot_ps(none, x)); /* -inf lanes -> +0.0 */
    }
    uint32_t k[4];
    _mm_storeu_si128((__m128i *)(void *)k, cnt);
    miss = (uint64_t)k[0] + k[1] + k[2] + k[3];
#endif
    for (; c < n; c++)
        if (a[c] == -INFINITY) {
            a[c] = 0.0f;
            miss++;
        }
    return (uint32_t)miss;
}

/* The packed answer of rank r: arrays from the waiter's owner, filled
 * from the published outputs in slab order. */
static amx_status_t build_packed(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r, amx_waiter_t *w,
                                 amx_packed_t *p, amx_err_t *err)
{
    amx_slab_t *sl;
    AMX_CHECK(slab_get(j, r, &sl, err));
    memset(p, 0, sizeof(*p));
    p->layout_id = sl->id;
    p->ncells = sl->off[sl->n];
    p->nq = sl->n;
    p->nslices = sl->soff[sl->n];
    p->cache = &r->answer;
    if (w->alloc_packed(w, p) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of memory building a packed answer of %llu cells",
                           (unsigned long long)p->ncells);
    amx_state_t *st = j->state;
    int f = st->front;
    if (sl->ngather > 0) {
        amx_status_t rst =
            st->ops->read_results(st, sl->gather, sl->ngather, sl->gather_cells, p->amax, p->scale,
                                  p->scale_inv, p->block_scales, err);
        if (rst != AMX_OK)
            return note_fault(reg, rst, err->msg);
    }
    int known = 0;
    if (p->filled != NULL && st->ops->read_filled != NULL) {
        amx_err_t ferr = {0};
        /* Without a quantizer in a peer group no cell can be marked: only
         * whether the marks are known is asked (no runs, nothing copied). */
        known = sl->ngather == 0 ||
                st->ops->read_filled(st, sl->gather, sl->npeerq > 0 ? sl->ngather : 0, p->filled,
                                     &ferr) == AMX_OK;
    }
    p->peer_fill_known = known;
    /* Quantizers not agreed yet: no data (their cells were not gathered). */
    for (uint32_t k = 0; k < sl->npendq; k++) {
        uint64_t c0 = sl->off[sl->pendq[k]], c1 = sl->off[sl->pendq[k] + 1];
        for (uint64_t c = c0; c < c1; c++) {
            p->amax[c] = 0.0f;
            p->scale[c] = p->scale_inv[c] = 1.0f;
            p->block_scales[c] = 0;
        }
        if (known)
            memset(p->filled + c0, 0, c1 - c0);
    }
    /* Cells without data anywhere read 0 and are counted per quantizer;
     * most epochs have none, which one pass over the slab finds out. */
    uint64_t total = sl->off[sl->n];
    int any_missing = has_neg_inf(p->amax, total);
    uint32_t fo = st->out_nq[f];
    for (uint32_t i = 0; i < sl->n; i++) {
        uint32_t ci = sl->cidx[i];
        uint64_t c0 = sl->off[i], c1 = sl->off[i + 1];
        if (ci == UINT32_MAX) {
            p->missing[i] = (uint32_t)(c1 - c0);
            p->g_amax[i] = 0.0f;
            p->g_scale[i] = p->g_inv[i] = 1.0f;
            continue;
        }
        p->missing[i] = any_missing ? zero_missing(p->amax + c0, c1 - c0) : 0;
        int have = ci < fo;
        p->g_amax[i] = have ? st->g_amax[f][ci] : 0.0f;
        p->g_scale[i] = have ? st->g_scale[f][ci] : 1.0f;
        p->g_inv[i] = have ? st->g_inv[f][ci] : 1.0f;
    }
    for (uint32_t i = 0; i < sl->n; i++) {
        uint32_t ci = sl->cidx[i];
        int prev = ci < j->prev_n && j->prev_ok[ci];
        p->has_previous[i] = (uint8_t)prev;
        p->prev_amax[i] = prev ? j->prev_ga[ci] : 0.0f;
        p->prev_scale[i] = prev ? j->prev_gs[ci] : 0.0f;
    }
    /* Only a peer group raises cells: the others' marks are 0. */
    uint64_t nfilled = 0;
    for (uint32_t k = 0; known && k < sl->npeerq; k++)
        if (sl->cidx[sl->peerq[k]] != UINT32_MAX)
            for (uint64_t c = sl->off[sl->peerq[k]]; c < sl->off[sl->peerq[k] + 1]; c++)
                nfilled += p->filled[c];
    p->nfilled = nfilled;
    /* Global slices: the state's, as result_slices gives them (0, 1, 1
     * for a quantizer not agreed yet, or before an output has them). */
    for (uint32_t i = 0; p->nslices > 0 && i < sl->n; i++) {
        uint64_t s0 = sl->soff[i], s1 = sl->soff[i + 1];
        if (s0 == s1)
            continue;
        const amx_lq_t *q = &j->lq[sl->lid[i]];
        int have = q->status == LQ_AGREED && st->s_amax[f] != NULL &&
                   q->gbase + amx_qspec_slices(q->spec) <= st->out_ns[f];
        for (uint64_t s = s0; s < s1; s++) {
            uint64_t g = sl->sg[s];
            p->s_amax[s] = have ? st->s_amax[f][g] : 0.0f;
            p->s_scale[s] = have ? st->s_scale[f][g] : 1.0f;
            p->s_inv[s] = have ? st->s_inv[f][g] : 1.0f;
        }
    }
    return AMX_OK;
}

/* ---- results ---- */

/* A result with no data anywhere (a quantizer not agreed yet). */
static amx_status_t empty_result(amx_result_t *res, amx_arena_t *a)
{
    res->amax = amx_arena_alloc(a, res->ncells * sizeof(float));
    res->scale = amx_arena_alloc(a, res->ncells * sizeof(float));
    res->scale_inv = amx_arena_alloc(a, res->ncells * sizeof(float));
    res->bytes = amx_arena_alloc(a, res->ncells ? res->ncells : 1);
    if (res->amax == NULL || res->scale == NULL || res->scale_inv == NULL || res->bytes == NULL)
        return AMX_ENOMEM;
    for (uint64_t c = 0; c < res->ncells; c++)
        res->scale[c] = res->scale_inv[c] = 1.0f;
    res->global_amax = 0.0f;
    res->global_scale = res->global_scale_inv = 1.0f;
    res->missing = (uint32_t)res->ncells;
    return AMX_OK;
}

typedef struct gather_ctx {
    amx_registry_t *reg;
    size_t nruns;
    uint64_t dst_base;
    uint64_t w0, w1; /* the window of the block's cells being gathered */
} gather_ctx_t;

/* One contiguous row of a block (flat cell `flat`, block offset `boff`),
 * clipped to the window. */
static void gather_row(void *ud, uint64_t flat, uint64_t boff, uint64_t len)
{
    gather_ctx_t *c = ud;
    uint64_t lo = boff > c->w0 ? boff : c->w0;
    uint64_t hi = boff + len < c->w1 ? boff + len : c->w1;
    if (lo >= hi)
        return;
    amx_run_t *run = &c->reg->runs[c->nruns++];
    run->src = flat + (lo - boff); /* a cell of the flat buffer */
    run->dst = c->dst_base + (lo - c->w0);
    run->len = hi - lo;
}

/* Validates `names` for a rank (or whole tensors when rank < 0) and counts
 * the results. */
static amx_status_t check_names(amx_job_t *j, int64_t rank, char **names, size_t n, size_t *count,
                                amx_err_t *err)
{
    amx_lrank_t *r = rank >= 0 ? local_rank(j, (uint32_t)rank) : NULL;
    if (n == 0) {
        if (r != NULL) {
            size_t k = 0;
            for (uint32_t i = 0; i < r->npls; i++)
                k += r->pl_of[r->pl_lid[i]] == i + 1 && lq_live(&j->lq[r->pl_lid[i]]);
            *count = k;
        } else {
            *count = j->cat->n;
        }
        return AMX_OK;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t lid;
        if (!amx_strmap_get(&j->lqmap, names[i], &lid) || !lq_live(&j->lq[lid]))
            return amx_err_set(err, AMX_ENOTFOUND,
                               "quantizer '%.255s' is not registered in job '%s'", names[i],
                               j->name);
        if (r != NULL && (lid >= r->cap_of || r->pl_of[lid] == 0))
            return amx_err_set(err, AMX_EPRECOND,
                               "rank %lld has no placement for quantizer '%s' of job '%s'; ask "
                               "with global=true for the whole tensor",
                               (long long)rank, names[i], j->name);
    }
    *count = n;
    return AMX_OK;
}

/* The lid of result i. */
static uint32_t result_lid(amx_job_t *j, amx_lrank_t *r, char **names, size_t n, size_t i,
                           uint32_t *cursor)
{
    uint32_t lid;
    if (n != 0) {
        amx_strmap_get(&j->lqmap, names[i], &lid);
        return lid;
    }
    if (r == NULL) {
        amx_strmap_get(&j->lqmap, j->cat->q[i]->name, &lid);
        return lid;
    }
    /* The rank's placements in registration order, skipping dead ones. */
    while (!(r->pl_of[r->pl_lid[*cursor]] == *cursor + 1 && lq_live(&j->lq[r->pl_lid[*cursor]])))
        (*cursor)++;
    return r->pl_lid[(*cursor)++];
}

/* The block of quantizer `lid` that a result covers. */
static const amx_placement_t *result_block(const amx_job_t *j, const amx_lrank_t *r, uint32_t lid,
                                           amx_placement_t *whole)
{
    if (r == NULL) {
        amx_placement_whole(j->lq[lid].spec, whole);
        return whole;
    }
    return &r->pls[r->pl_of[lid] - 1];
}

/*
 * The global slices that cells [w0, w1) of block `pl` (w0 < w1) of a
 * quantizer with global_axes k > 0 lie in: block slices [*j0, *j0 + return)
 * (a block slice is one index of the block's first k axes, row-major).
 */
static uint64_t window_slices(const amx_placement_t *pl, uint32_t k, uint64_t w0, uint64_t w1,
                              uint64_t *j0)
{
    uint64_t bs = 1;
    for (uint32_t d = k; d < pl->ndim; d++)
        bs *= pl->shape[d];
    *j0 = w0 / bs;
    return (w1 - 1) / bs - *j0 + 1;
}

/* The global slice index (row-major over global_shape[:k]) of block slice j. */
static uint64_t global_slice(const amx_placement_t *pl, const uint32_t *gshape, uint32_t k,
                             uint64_t j)
{
    uint64_t idx[AMX_MAX_DIMS], g = 0;
    for (uint32_t d = k; d-- > 0;) {
        idx[d] = j % pl->shape[d] + pl->off[d];
        j /= pl->shape[d];
    }
    for (uint32_t d = 0; d < k; d++)
        g = g * gshape[d] + idx[d];
    return g;
}

/* The global slices of result `x` (cells of block `pl` of quantizer `q`)
 * from output set `f` (-1: none yet, they read 0, 1, 1), into the arena. */
static amx_status_t result_slices(amx_result_t *x, const amx_state_t *st, const amx_lq_t *q,
                                  const amx_placement_t *pl, int f, amx_arena_t *a)
{
    uint32_t k = q->spec->global_axes;
    if (k == 0 || x->ncells == 0)
        return AMX_OK;
    uint64_t j0, ns = window_slices(pl, k, x->first_cell, x->first_cell + x->ncells, &j0);
    x->s_amax = amx_arena_alloc(a, 3 * ns * sizeof(float));
    if (x->s_amax == NULL)
        return AMX_ENOMEM;
    x->s_scale = x->s_amax + ns;
    x->s_inv = x->s_scale + ns;
    x->nslices = ns;
    x->global_axes = k;
    int have =
        f >= 0 && st->s_amax[f] != NULL && q->gbase + amx_qspec_slices(q->spec) <= st->out_ns[f];
    for (uint64_t i = 0; i < ns; i++) {
        uint64_t g = q->gbase + global_slice(pl, q->spec->shape, k, j0 + i);
        x->s_amax[i] = have ? st->s_amax[f][g] : 0.0f;
        x->s_scale[i] = have ? st->s_scale[f][g] : 1.0f;
        x->s_inv[i] = have ? st->s_inv[f][g] : 1.0f;
    }
    return AMX_OK;
}

/* Bytes of a QuantizerResult of n cells and ns global slices, framing
 * included (an upper estimate: 13 bytes a cell, the name, the block, the
 * scalars). */
static uint64_t result_bytes(const char *name, uint32_t ndim, uint64_t n, uint64_t ns)
{
    /* 13 bytes per cell (amax, scale, scale_inv, block scale) and one for
     * the peer-fill mark, which only quantizers with filled cells carry;
     * 12 per global slice. */
    return 14 * n + 12 * ns + strlen(name) + 12ull * ndim + 112;
}

/*
 * The results for `names` (all of the rank's when none; whole tensors when
 * rank < 0), restricted to cells [start, start + max) of the answer (max 0:
 * all). Refused, before anything is built, when the answer would not fit
 * in max_message_bytes. *total_cells (may be NULL): cells of the whole
 * answer.
 */
static amx_status_t build_results(amx_registry_t *reg, amx_job_t *j, int64_t rank, char **names,
                                  size_t n, uint64_t start, uint64_t max, amx_result_t **out,
                                  size_t *nout, uint64_t *total_cells, amx_arena_t *a,
                                  amx_err_t *err)
{
    size_t count;
    AMX_CHECK(check_names(j, rank, names, n, &count, err));
    amx_lrank_t *r = rank >= 0 ? local_rank(j, (uint32_t)rank) : NULL;
    uint64_t end = max == 0 || start + max < start ? UINT64_MAX : start + max;
    /* Pass 1: sizes, the window, the answer's bytes. */
    uint64_t all = 0, answer = 64, total = 0;
    size_t nres = 0, nruns = 0;
    uint32_t cursor = 0;
    for (size_t i = 0; i < count; i++) {
        uint32_t lid = result_lid(j, r, names, n, i, &cursor);
        amx_placement_t whole;
        const amx_placement_t *pl = result_block(j, r, lid, &whole);
        uint64_t lo = all > start ? all : start,
                 hi = all + pl->ncells < end ? all + pl->ncells : end;
        all += pl->ncells;
        if (lo >= hi)
            continue;
        nres++;
        uint64_t j0, ns = 0;
        if (j->lq[lid].spec->global_axes > 0)
            ns = window_slices(pl, j->lq[lid].spec->global_axes, lo - (all - pl->ncells),
                               hi - (all - pl->ncells), &j0);
        answer += result_bytes(j->lq[lid].spec->name, pl->ndim, hi - lo, ns);
        if (j->lq[lid].status == LQ_AGREED) {
            total += hi - lo;
            nruns += amx_placement_nrows(pl);
        }
    }
    if (total_cells != NULL)
        *total_cells = all;
    if (answer > (uint64_t)reg->cfg->max_message_bytes)
        return amx_err_set(err, AMX_ENOMEM,
                           "the answer (%zu quantizers, %llu cells) would take %llu bytes, more "
                           "than max_message_bytes=%lld: ask for fewer quantizers at a time, or "
                           "for a window of cells (GetScales start_cell and max_cells; the Python "
                           "client's get_scales does this by itself)",
                           nres, (unsigned long long)(max ? (end - start) : all - start),
                           (unsigned long long)answer, (long long)reg->cfg->max_message_bytes);
    amx_result_t *res = amx_arena_alloc(a, (nres ? nres : 1) * sizeof(*res));
    float *amax = amx_arena_alloc(a, (total ? total : 1) * sizeof(float));
    float *scale = amx_arena_alloc(a, (total ? total : 1) * sizeof(float));
    float *inv = amx_arena_alloc(a, (total ? total : 1) * sizeof(float));
    uint8_t *bytes = amx_arena_alloc(a, total ? total : 1);
    uint8_t *filled = j->state->ops->read_filled ? amx_arena_alloc(a, total ? total : 1) : NULL;
    if (res == NULL || amax == NULL || scale == NULL || inv == NULL || bytes == NULL ||
        stage_reserve(reg, 0, nruns) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of memory building results of %llu cells",
                           (unsigned long long)total);
    /* Pass 2: runs, then one gather from the published results. */
    gather_ctx_t g = {reg, 0, 0, 0, 0};
    cursor = 0;
    all = 0;
    size_t k = 0;
    int f = j->state->front;
    for (size_t i = 0; i < count; i++) {
        uint32_t lid = result_lid(j, r, names, n, i, &cursor);
        const amx_lq_t *q = &j->lq[lid];
        amx_placement_t whole;
        const amx_placement_t *pl = result_block(j, r, lid, &whole);
        uint64_t lo = all > start ? all : start,
                 hi = all + pl->ncells < end ? all + pl->ncells : end;
        uint64_t b0 = all;
        all += pl->ncells;
        if (lo >= hi)
            continue;
        amx_result_t *x = &res[k++];
        memset(x, 0, sizeof(*x));
        x->name = q->spec->name;
        x->ndim = pl->ndim;
        memcpy(x->off, pl->off, sizeof(x->off));
        memcpy(x->shape, pl->shape, sizeof(x->shape));
        x->first_cell = lo - b0;
        x->ncells = hi - lo;
        if (q->status != LQ_AGREED) {
            if (empty_result(x, a) != AMX_OK || result_slices(x, j->state, q, pl, -1, a) != AMX_OK)
                return amx_err_set(err, AMX_ENOMEM, "out of memory building results");
            continue;
        }
        x->amax = amax + g.dst_base;
        x->scale = scale + g.dst_base;
        x->scale_inv = inv + g.dst_base;
        x->bytes = bytes + g.dst_base;
        g.w0 = x->first_cell;
        g.w1 = x->first_cell + x->ncells;
        amx_placement_rows(pl, q->spec->shape, q->base, gather_row, &g);
        g.dst_base += x->ncells;
        uint32_t c = (uint32_t)q->cidx;
        int have = c < j->state->out_nq[f];
        x->global_amax = have ? j->state->g_amax[f][c] : 0.0f;
        x->global_scale = have ? j->state->g_scale[f][c] : 1.0f;
        x->global_scale_inv = have ? j->state->g_inv[f][c] : 1.0f;
        if (result_slices(x, j->state, q, pl, f, a) != AMX_OK)
            return amx_err_set(err, AMX_ENOMEM, "out of memory building results");
        if (filled != NULL)
            x->filled = filled + (x->amax - amax);
        if (previous_of(j, lid, &x->previous_global_amax, &x->previous_global_scale))
            x->has_previous = 1;
    }
    if (total > 0) {
        amx_status_t rst = j->state->ops->read_results(j->state, reg->runs, g.nruns, total, amax,
                                                       scale, inv, bytes, err);
        if (rst != AMX_OK)
            return note_fault(reg, rst, err->msg);
        amx_err_t ferr = {0};
        if (filled != NULL &&
            j->state->ops->read_filled(j->state, reg->runs, g.nruns, filled, &ferr) != AMX_OK)
            filled = NULL; /* not known for these outputs: no marks in the answer */
    }
    /* Cells without data anywhere read 0 and are counted (results of
     * quantizers not agreed yet were filled by empty_result). */
    for (size_t i = 0; i < k; i++) {
        amx_result_t *x = &res[i];
        if (x->amax < amax || x->amax >= amax + (total ? total : 1))
            continue;
        uint32_t missing = 0, nfilled = 0;
        for (uint64_t c = 0; c < x->ncells; c++)
            if (x->amax[c] == -INFINITY) {
                x->amax[c] = 0.0f;
                missing++;
            }
        x->missing = missing;
        if (filled == NULL) {
            x->filled = NULL;
            continue;
        }
        for (uint64_t c = 0; c < x->ncells; c++)
            nfilled += x->filled[c];
        x->nfilled = nfilled;
    }
    *out = res;
    *nout = k;
    return AMX_OK;
}

/* Checks `names` for a Reconcile, and that its answer will fit in
 * max_message_bytes (refused before the rank enters the epoch). */
static amx_status_t reconcile_answer_fits(amx_registry_t *reg, amx_job_t *j, uint32_t rank,
                                          char **names, size_t n, amx_err_t *err)
{
    size_t count;
    AMX_CHECK(check_names(j, rank, names, n, &count, err));
    amx_lrank_t *r = local_rank(j, rank);
    uint64_t answer = 64, cells = 0;
    uint32_t cursor = 0;
    for (size_t i = 0; i < count; i++) {
        uint32_t lid = result_lid(j, r, names, n, i, &cursor);
        amx_placement_t whole;
        const amx_placement_t *pl = result_block(j, r, lid, &whole);
        uint64_t j0, ns = 0;
        if (j->lq[lid].spec->global_axes > 0 && pl->ncells > 0)
            ns = window_slices(pl, j->lq[lid].spec->global_axes, 0, pl->ncells, &j0);
        answer += result_bytes(j->lq[lid].spec->name, pl->ndim, pl->ncells, ns);
        cells += pl->ncells;
    }
    if (answer > (uint64_t)reg->cfg->max_message_bytes)
        return amx_err_set(err, AMX_ENOMEM,
                           "the answer to this Reconcile (%zu quantizers, %llu cells) would take "
                           "%llu bytes, more than max_message_bytes=%lld: name fewer quantizers "
                           "in Reconcile and fetch the others with GetScales (in windows of "
                           "cells)",
                           count, (unsigned long long)cells, (unsigned long long)answer,
                           (long long)reg->cfg->max_message_bytes);
    return AMX_OK;
}

amx_status_t amx_registry_get_scales(amx_registry_t *reg, const amx_scales_req_t *req,
                                     amx_reply_t *rep, amx_arena_t *arena, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, !req->whole, &j, err));
    if (j->last_reconciled == 0)
        return amx_err_set(err, AMX_EPRECOND,
                           "no epoch of job '%s' has been reconciled yet: call Reconcile first",
                           j->name);
    memset(rep, 0, sizeof(*rep));
    rep->epoch = j->last_reconciled;
    rep->next_epoch = j->epoch;
    return build_results(reg, j, req->whole ? -1 : (int64_t)req->rank, req->names, req->n_names,
                         req->start_cell, req->max_cells, &rep->results, &rep->nresults,
                         &rep->total_cells, arena, err);
}

/* ---- Reconcile ---- */

static void missing_ranks(const amx_job_t *j, char *buf, size_t len)
{
    size_t k = 0;
    int shown = 0, total = 0;
    buf[0] = '\0';
    for (uint32_t i = 0; i < j->nlocal; i++) {
        if (j->lr[i].in_reconcile)
            continue;
        total++;
        if (shown < 16 && k < len) {
            k += (size_t)snprintf(buf + k, len - k, shown ? ", %u" : "%u", j->lr[i].rank);
            shown++;
        }
    }
    if (total > shown && k < len)
        snprintf(buf + k, len - k, " and %d more", total - shown);
}

static amx_status_t start_epoch(amx_registry_t *reg, amx_job_t *j, amx_err_t *err);

static void start_epoch_or_fail(amx_registry_t *reg, amx_job_t *j)
{
    amx_err_t e2 = {0};
    if (start_epoch(reg, j, &e2) != AMX_OK) {
        AMX_ERROR("registry", "job %s: %s", j->name, e2.msg);
        fail_all_waiters(reg, j, e2.code, e2.msg);
    }
}

/* Growths that ended: their Registers go on, and an epoch whose ranks all
 * entered Reconcile meanwhile starts. */
static void on_grow_async(uv_async_t *h)
{
    amx_registry_t *reg = h->data;
    for (amx_job_t **pp = &reg->zombies; *pp != NULL;) {
        amx_job_t *j = *pp;
        if (j->growing && __atomic_load_n(&j->grow_done, __ATOMIC_ACQUIRE)) {
            pthread_join(j->grow_th, NULL);
            j->growing = 0;
            if (!j->in_flight) {
                *pp = j->next;
                job_free(j);
                continue;
            }
        }
        pp = &j->next;
    }
    for (amx_job_t *j = reg->jobs; j != NULL; j = j->next) {
        if (!j->growing || !__atomic_load_n(&j->grow_done, __ATOMIC_ACQUIRE))
            continue;
        pthread_join(j->grow_th, NULL);
        j->growing = 0;
        AMX_DEBUG("registry", "job %s: pending buffers grown to %llu cells", j->name,
                  (unsigned long long)j->state->pend_cells);
        run_deferred(reg, j);
        if (!j->growing && !j->in_flight && j->nlocal > 0 && j->nin_reconcile == j->nlocal)
            start_epoch_or_fail(reg, j);
    }
}

static amx_status_t start_epoch(amx_registry_t *reg, amx_job_t *j, amx_err_t *err)
{
    if (j->eng == NULL)
        AMX_CHECK(amx_engine_create(j, &reg->env, &j->eng, err));
    uint64_t deadline = UINT64_MAX;
    for (uint32_t i = 0; i < j->nlocal; i++)
        if (j->lr[i].rec_w != NULL && j->lr[i].rec_w->deadline_ms < deadline)
            deadline = j->lr[i].rec_w->deadline_ms;
    j->state->ops->flip(j->state);
    j->in_flight = 1;
    j->flight_deadline = deadline;
    j->flight_started_us = amx_now_us();
    AMX_DEBUG("registry", "job %s: epoch %llu handed to its engine", j->name,
              (unsigned long long)j->epoch);
    amx_engine_start(j->eng, j->epoch, deadline);
    return AMX_OK;
}

/* ReconcilePacked: the layout id is current and the answer fits. */
static amx_status_t packed_answer_fits(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r,
                                       uint64_t id, amx_err_t *err)
{
    amx_slab_t *sl;
    AMX_CHECK(slab_get(j, r, &sl, err));
    AMX_CHECK(check_layout_id(j, r, sl, id, "ReconcilePacked", err));
    uint64_t cells = sl->off[sl->n];
    uint64_t answer = 14 * cells + 26ull * sl->n + 12 * sl->soff[sl->n] + 20 * 20 + 64;
    if (answer > (uint64_t)reg->cfg->max_message_bytes)
        return amx_err_set(err, AMX_ENOMEM,
                           "the packed answer to this Reconcile (%u quantizers, %llu cells) would "
                           "take %llu bytes, more than max_message_bytes=%lld: use Reconcile with "
                           "fewer names and GetScales windows, or raise max_message_bytes",
                           sl->n, (unsigned long long)cells, (unsigned long long)answer,
                           (long long)reg->cfg->max_message_bytes);
    return AMX_OK;
}

amx_status_t amx_registry_reconcile(amx_registry_t *reg, const amx_reconcile_req_t *req,
                                    amx_waiter_t *w, uint64_t now_ms, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, 1, &j, err));
    amx_lrank_t *r = local_rank(j, req->rank);
    if (j->in_flight && r->in_reconcile && r->rec_w == NULL &&
        (req->epoch == 0 || req->epoch == j->epoch)) {
        /* Its earlier call went away while the epoch was in flight: this
         * call takes its place and gets the epoch's answer. */
        if (req->packed)
            AMX_CHECK(packed_answer_fits(reg, j, r, req->layout_id, err));
        else
            AMX_CHECK(reconcile_answer_fits(reg, j, req->rank, req->names, req->n_names, err));
        w->job = j;
        w->rank = req->rank;
        w->kind = WAIT_RECONCILE;
        w->deadline_ms = now_ms + (uint64_t)reg->cfg->reconcile_timeout_ms;
        w->names = req->names;
        w->n_names = req->n_names;
        r->rec_w = w;
        reg->nwaiting++;
        return AMX_OK;
    }
    if (r->in_reconcile || j->in_flight)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is already waiting in Reconcile for epoch %llu on "
                           "another call",
                           req->rank, j->name, (unsigned long long)j->epoch);
    AMX_CHECK(check_epoch(j, j->epoch, req->epoch, req->rank, "Reconcile", err));
    if (req->packed)
        AMX_CHECK(packed_answer_fits(reg, j, r, req->layout_id, err));
    else
        AMX_CHECK(reconcile_answer_fits(reg, j, req->rank, req->names, req->n_names, err));
    w->job = j;
    w->rank = req->rank;
    w->kind = WAIT_RECONCILE;
    w->deadline_ms = now_ms + (uint64_t)reg->cfg->reconcile_timeout_ms;
    w->names = req->names;
    w->n_names = req->n_names;
    w->gone = 0;
    r->rec_w = w;
    r->in_reconcile = 1;
    j->nin_reconcile++;
    reg->nwaiting++;
    if (j->nin_reconcile == j->nlocal && !j->growing)
        start_epoch_or_fail(reg, j); /* else when the growth ends */
    return AMX_OK;
}

/* Installs a new agreed catalog from the engine: every quantizer of it
 * gets (or keeps) a local id, proposals it adopted become agreed. */
static void install_catalog(amx_registry_t *reg, amx_job_t *j, amx_epoch_result_t *res)
{
    amx_catalog_t *nc = res->cat;
    uint32_t fresh = 0, lid0;
    for (uint32_t i = 0; i < nc->n; i++)
        fresh += !amx_strmap_get(&j->lqmap, nc->q[i]->name, &lid0);
    if (job_reserve_lq(j, j->nlq + fresh) != AMX_OK) {
        /* Without room for the table the layout cannot be followed: the
         * job is unusable; fail loudly rather than answer wrong bytes. */
        AMX_ERROR("registry",
                  "job %s: out of memory installing a catalog of %u quantizers; "
                  "aborting",
                  j->name, nc->n);
        abort();
    }
    /* The previous-epoch globals follow their quantizers to the new order
     * (without room for them: no previous values, nothing wrong). */
    float *pga = NULL, *pgs = NULL;
    uint8_t *pok = NULL;
    if (j->prev_n > 0 && nc->n > 0) {
        pga = malloc(nc->n * sizeof(float));
        pgs = malloc(nc->n * sizeof(float));
        pok = calloc(nc->n, 1);
        if (pga == NULL || pgs == NULL || pok == NULL) {
            free(pga), free(pgs), free(pok);
            pga = pgs = NULL;
            pok = NULL;
        }
    }
    for (uint32_t i = 0; i < nc->n; i++) {
        uint32_t lid;
        amx_qspec_t *own = NULL; /* a proposal's own spec, freed once the map key moved */
        if (!amx_strmap_get(&j->lqmap, nc->q[i]->name, &lid)) {
            lid = j->nlq++;
            memset(&j->lq[lid], 0, sizeof(j->lq[lid]));
        } else if (j->lq[lid].status != LQ_AGREED) {
            if (j->lq[lid].status == LQ_PROPOSED)
                j->nprop--;
            own = j->lq[lid].spec;
        }
        amx_lq_t *q = &j->lq[lid];
        if (pok != NULL && q->status == LQ_AGREED && q->cidx >= 0 &&
            (uint32_t)q->cidx < j->prev_n && j->prev_ok[q->cidx]) {
            pok[i] = 1;
            pga[i] = j->prev_ga[q->cidx];
            pgs[i] = j->prev_gs[q->cidx];
        }
        q->spec = nc->q[i];
        q->status = LQ_AGREED;
        q->cidx = (int32_t)i;
        q->base = res->desc[i].base;
        q->gbase = res->desc[i].gbase;
        amx_strmap_put(&j->lqmap, q->spec->name, lid); /* replaces the key: cannot fail */
        amx_qspec_free(own);
    }
    for (size_t k = 0; k < res->nrejected; k++) {
        uint32_t lid;
        if (amx_strmap_get(&j->lqmap, res->rejected[k], &lid) && j->lq[lid].status == LQ_PROPOSED) {
            j->lq[lid].status = LQ_DEAD;
            j->nprop--;
            for (uint32_t s = 0; s < j->nlocal; s++)
                if (lid < j->lr[s].cap_of)
                    j->lr[s].pl_of[lid] = 0;
        }
    }
    /* A quantizer agreed before and missing from the new catalog (which
     * the coordinator must never do: it asks for whole catalogs it does
     * not hold) would keep a pointer into the old one: it is dead here,
     * with its own copy of its spec, and loudly so. */
    for (uint32_t lid = 0; lid < j->nlq; lid++) {
        amx_lq_t *q = &j->lq[lid];
        if (q->status != LQ_AGREED || amx_catalog_find(nc, q->spec->name) >= 0)
            continue;
        amx_qspec_t *copy = amx_qspec_dup(q->spec);
        if (copy == NULL) {
            AMX_ERROR("registry", "job %s: out of memory dropping a quantizer; aborting", j->name);
            abort();
        }
        AMX_ERROR("registry",
                  "job %s: quantizer '%s' is missing from the agreed catalog; its ranks must "
                  "register it again",
                  j->name, copy->name);
        q->spec = copy;
        amx_strmap_put(&j->lqmap, copy->name, lid); /* replaces the key: cannot fail */
        q->status = LQ_DEAD;
        q->cidx = -1;
        if (q->reset) {
            q->reset = 0;
            j->nreset--;
        }
        for (uint32_t s = 0; s < j->nlocal; s++)
            if (lid < j->lr[s].cap_of)
                j->lr[s].pl_of[lid] = 0;
    }
    free(j->prev_ga), free(j->prev_gs), free(j->prev_ok);
    j->prev_ga = pga;
    j->prev_gs = pgs;
    j->prev_ok = pok;
    j->prev_n = j->prev_cap = pok != NULL ? nc->n : 0;
    j->layout_gen++; /* bases, statuses and placements may have moved */
    amx_catalog_free(j->cat);
    free(j->desc);
    j->cat = nc;
    j->desc = res->desc;
    res->cat = NULL;
    res->desc = NULL;
    j->prov_cells = 0;
    j->prov_hist = 0;
    amx_err_t err = {0};
    if (j->state->ops->remap_active(j->state, &res->pend_change, &err) != AMX_OK) {
        AMX_ERROR("registry", "job %s: %s; aborting", j->name, err.msg);
        abort();
    }
    (void)reg;
}

/* Keeps the published global amax and scale of every quantizer of the
 * catalog (the front outputs, made in the installed catalog's layout) as
 * the previous epoch's, in catalog order, before the epoch that just ended
 * is published: two copies of the catalog's globals, no per-quantizer work
 * (install_catalog carries them over to a new catalog's order). */
static void save_previous(amx_job_t *j)
{
    amx_state_t *st = j->state;
    int f = st->front;
    uint32_t n = j->cat->n;
    if (n > j->prev_cap) {
        float *ga = realloc(j->prev_ga, n * sizeof(float));
        if (ga != NULL)
            j->prev_ga = ga;
        float *gs = realloc(j->prev_gs, n * sizeof(float));
        if (gs != NULL)
            j->prev_gs = gs;
        uint8_t *ok = realloc(j->prev_ok, n);
        if (ok != NULL)
            j->prev_ok = ok;
        if (ga == NULL || gs == NULL || ok == NULL) {
            j->prev_n = 0; /* out of memory: no previous values, nothing wrong */
            return;
        }
        j->prev_cap = n;
    }
    uint32_t have = st->g_amax[f] == NULL ? 0 : n < st->out_nq[f] ? n : (uint32_t)st->out_nq[f];
    if (have > 0) {
        memcpy(j->prev_ga, st->g_amax[f], have * sizeof(float));
        memcpy(j->prev_gs, st->g_scale[f], have * sizeof(float));
    }
    memset(j->prev_ok, 1, have);
    memset(j->prev_ok + have, 0, n - have);
    j->prev_n = n;
}

/* After an epoch that continued a donor's state: the previous epoch's
 * globals are the donor's published ones (the front holds this daemon's
 * own, from before it fell behind), in the installed catalog's order. */
static void previous_from_donor(amx_job_t *j, const amx_epoch_result_t *res)
{
    uint32_t n = j->cat->n;
    j->prev_n = 0;
    if (res->prev_cat == NULL || n == 0)
        return;
    if (n > j->prev_cap) {
        float *ga = realloc(j->prev_ga, n * sizeof(float));
        if (ga != NULL)
            j->prev_ga = ga;
        float *gs = realloc(j->prev_gs, n * sizeof(float));
        if (gs != NULL)
            j->prev_gs = gs;
        uint8_t *ok = realloc(j->prev_ok, n);
        if (ok != NULL)
            j->prev_ok = ok;
        if (ga == NULL || gs == NULL || ok == NULL)
            return; /* out of memory: no previous values, nothing wrong */
        j->prev_cap = n;
    }
    for (uint32_t i = 0; i < n; i++) {
        int64_t k = amx_catalog_find(res->prev_cat, j->cat->q[i]->name);
        j->prev_ok[i] = k >= 0;
        j->prev_ga[i] = k >= 0 ? res->prev_ga[k] : 0.0f;
        j->prev_gs[i] = k >= 0 ? res->prev_gs[k] : 0.0f;
    }
    j->prev_n = n;
}

static void epoch_done(amx_registry_t *reg, amx_job_t *j)
{
    amx_epoch_result_t *res = amx_engine_result(j->eng);
    j->in_flight = 0;
    if (res->reconciled && !res->imported && !j->dropped && j->last_reconciled > 0)
        save_previous(j);
    j->last_started_us = j->flight_started_us;
    j->last_engine_begin_us = res->begin_at_us;
    j->last_engine_end_us = res->end_at_us;
    j->last_ended_us = amx_now_us();
    if (res->cat != NULL)
        install_catalog(reg, j, res);
    if (res->imported) {
        j->last_reconciled = res->last_reconciled;
        j->epoch = res->last_reconciled + 1;
        if (res->reconciled && !j->dropped)
            previous_from_donor(j, res);
    }
    j->last_epoch_us = res->total_us;
    j->last_collective_us = res->collective_us;
    j->last_finish_us = res->finish_us;
    j->last_collectives = res->collectives;
    if (j->dropped) {
        /* Dropped while in flight: nobody is waiting any more; a snapshot
         * its engine wrote meanwhile goes too. */
        if (snapshots_on(reg))
            amx_snapshot_remove(reg->cfg->state_dir, j->name);
        for (amx_job_t **p = &reg->zombies; *p != NULL; p = &(*p)->next)
            if (*p == j) {
                *p = j->next;
                break;
            }
        job_free(j);
        return;
    }
    if (res->reconciled) {
        j->state->ops->publish(j->state);
        j->last_reconciled = res->epoch;
        j->epoch = res->epoch + 1;
        j->epochs_ok++;
        note_snapshot(j, res);
        if (reg->metrics != NULL) {
            amx_state_t *st = j->state;
            amx_metrics_job_epoch(reg->metrics, j->name, 1, res->epoch, (double)res->total_us / 1e6,
                                  st->cell_counts, st->last_missing, st->last_filled);
            amx_metrics_job_catalog(reg->metrics, j->name, j->cat->n, j->cat->ncells);
        }
        if (res->resets_applied && j->nreset > 0) {
            for (uint32_t i = 0; i < j->nlq; i++)
                j->lq[i].reset = 0;
            j->nreset = 0;
        }
        AMX_DEBUG("registry",
                  "job %s: epoch %llu reconciled in %llu us (%u collectives, %llu us; header in "
                  "%llu + out %llu us; finish %llu us)",
                  j->name, (unsigned long long)res->epoch, (unsigned long long)res->total_us,
                  res->collectives, (unsigned long long)res->collective_us,
                  (unsigned long long)res->prepare_us, (unsigned long long)res->header_us,
                  (unsigned long long)res->finish_us);
        for (uint32_t i = 0; i < j->nlocal; i++) {
            amx_lrank_t *r = &j->lr[i];
            if (!r->in_reconcile)
                continue;
            r->in_reconcile = 0;
            j->nin_reconcile--;
            amx_waiter_t *w = r->rec_w;
            r->rec_w = NULL;
            if (w == NULL)
                continue; /* its client went away */
            amx_arena_t a = {0};
            amx_err_t e2 = {0};
            amx_reply_t rep;
            memset(&rep, 0, sizeof(rep));
            rep.epoch = res->epoch;
            rep.next_epoch = j->epoch;
            amx_packed_t pk;
            amx_status_t st = w->alloc_packed != NULL
                                  ? build_packed(reg, j, r, w, &pk, &e2)
                                  : build_results(reg, j, r->rank, w->names, w->n_names, 0, 0,
                                                  &rep.results, &rep.nresults, NULL, &a, &e2);
            if (w->alloc_packed != NULL)
                rep.packed = &pk;
            if (st == AMX_OK)
                finish_waiter(reg, w, AMX_OK, NULL, &rep);
            else
                finish_waiter(reg, w, st, e2.msg, NULL);
            amx_arena_free(&a);
        }
        j->last_answered_us = amx_now_us();
    } else {
        note_fault(reg, res->st, res->msg);
        amx_err_t e2 = {0};
        if (j->state->ops->unflip(j->state, &e2) != AMX_OK)
            AMX_ERROR("registry", "job %s: %s", j->name, e2.msg);
        if (res->publish)
            j->state->ops->publish(j->state);
        j->epochs_failed++;
        amx_metrics_job_epoch(reg->metrics, j->name, 0, res->epoch, (double)res->total_us / 1e6, 0,
                              0, 0);
        AMX_WARN("registry", "job %s: %s", j->name, res->msg);
        for (uint32_t i = 0; i < j->nlocal; i++) {
            amx_lrank_t *r = &j->lr[i];
            if (!r->in_reconcile)
                continue;
            r->in_reconcile = 0;
            j->nin_reconcile--;
            amx_waiter_t *w = r->rec_w;
            r->rec_w = NULL;
            if (w != NULL)
                finish_waiter(reg, w, res->st, res->msg, NULL);
        }
    }
    run_deferred(reg, j);
}

void amx_registry_cancel(amx_registry_t *reg, amx_waiter_t *w)
{
    amx_job_t *j = w->job;
    if (j == NULL)
        return;
    w->job = NULL;
    reg->nwaiting--;
    if (w->kind == WAIT_REGISTER || w->kind == WAIT_RESET) {
        for (amx_deferred_t **p = &j->defer_head; *p != NULL; p = &(*p)->next) {
            if ((*p)->w == w) {
                amx_deferred_t *d = *p;
                *p = d->next;
                if (j->defer_tail == &d->next)
                    j->defer_tail = p;
                free(d);
                break;
            }
        }
        return;
    }
    amx_lrank_t *r = local_rank(j, w->rank);
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
            remove_local_rank(j, w->rank);
            if (j->nlocal == 0 && !j->in_flight) {
                job_unlink(reg, j);
                job_free(j);
            }
        } else {
            r->joined = 0;
        }
        return;
    }
    r->rec_w = NULL;
    if (j->in_flight) {
        /* The epoch goes on without it; its answer is dropped. */
        AMX_INFO("registry",
                 "job %s: rank %u left Reconcile of epoch %llu while it was being "
                 "reconciled (client went away)",
                 j->name, w->rank, (unsigned long long)j->epoch);
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
            drop_job(reg, j, msg);
            continue;
        }
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
            missing_ranks(j, missing, sizeof(missing));
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
            finish_waiter(reg, w, AMX_ETIMEDOUT, msg, NULL);
        }
    }
}

/* ---- Reset ---- */

static amx_status_t do_reset(amx_registry_t *reg, amx_job_t *j, const amx_reset_req_t *req,
                             amx_reply_t *rep, amx_err_t *err)
{
    (void)reg;
    for (size_t i = 0; i < req->n_names; i++) {
        uint32_t lid;
        if (!amx_strmap_get(&j->lqmap, req->names[i], &lid) || !lq_live(&j->lq[lid]))
            return amx_err_set(err, AMX_ENOTFOUND,
                               "quantizer '%.255s' is not registered in job '%s' (nothing was "
                               "reset)",
                               req->names[i], j->name);
    }
    uint32_t n = 0;
    for (uint32_t lid = 0; lid < j->nlq; lid++) {
        amx_lq_t *q = &j->lq[lid];
        if (!lq_live(q))
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

static void drop_job(amx_registry_t *reg, amx_job_t *j, const char *why)
{
    AMX_INFO("registry", "job %s dropped (%u quantizers): %s", j->name, j->cat->n + j->nprop, why);
    if (snapshots_on(reg)) {
        int rc = amx_snapshot_remove(reg->cfg->state_dir, j->name);
        if (rc != 0)
            AMX_ERROR("registry", "job %s: cannot remove its snapshot from %s: %s", j->name,
                      reg->cfg->state_dir, strerror(-rc));
    }
    fail_all_waiters(reg, j, AMX_EABORTED, why);
    if (reg->on_drop != NULL)
        reg->on_drop(reg->on_drop_ud, j->name);
    job_remove(reg, j);
}

amx_status_t amx_registry_reset(amx_registry_t *reg, const amx_reset_req_t *req, amx_waiter_t *w,
                                amx_err_t *err)
{
    if (!amx_valid_job_name(req->job))
        return amx_err_set(err, AMX_EINVAL, "job name '%s' is invalid", req->job ? req->job : "");
    amx_job_t *j = find_job(reg, req->job);
    if (j == NULL)
        return amx_err_set(err, AMX_ENOTFOUND, "job '%s' is not known to this daemon", req->job);
    j->last_active_ms = amx_now_ms();
    amx_reply_t rep;
    memset(&rep, 0, sizeof(rep));
    if (req->drop_job) {
        if (req->n_names != 0)
            return amx_err_set(err, AMX_EINVAL, "Reset with drop_job takes no quantizer names");
        rep.reset = j->cat->n + j->nprop;
        char name[AMX_MAX_JOB_NAME + 1];
        snprintf(name, sizeof(name), "%s", j->name);
        drop_job(reg, j, "the job was dropped by Reset");
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
            if (!amx_strmap_get(&j->lqmap, req->names[i], &lid) || !lq_live(&j->lq[lid]))
                return amx_err_set(err, AMX_ENOTFOUND,
                                   "quantizer '%.255s' is not registered in job '%s' (nothing "
                                   "was reset)",
                                   req->names[i], j->name);
        }
        AMX_CHECK(defer(j, WAIT_RESET, w, req, err));
        w->job = j;
        w->kind = WAIT_RESET;
        reg->nwaiting++;
        return AMX_OK;
    }
    AMX_CHECK(do_reset(reg, j, req, &rep, err));
    w->job = NULL;
    w->done(w, AMX_OK, NULL, &rep);
    return AMX_OK;
}

static void run_deferred(amx_registry_t *reg, amx_job_t *j)
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
        amx_status_t st = kind == WAIT_REGISTER ? do_register(reg, j, req, &rep, &deferred, &err)
                                                : do_reset(reg, j, req, &rep, &err);
        if (st == AMX_OK && deferred)
            return; /* it waits, first in line, for the growth it started */
        j->defer_head = d->next;
        if (j->defer_head == NULL)
            j->defer_tail = &j->defer_head;
        free(d);
        if (st != AMX_OK)
            AMX_WARN("rpc", "%s rejected (%s): %s", kind == WAIT_REGISTER ? "Register" : "Reset",
                     amx_strerror(st), err.msg);
        finish_waiter(reg, w, st, st == AMX_OK ? NULL : err.msg, st == AMX_OK ? &rep : NULL);
    }
}

/* ---- Status, List ---- */

amx_status_t amx_registry_status(amx_registry_t *reg, const char *job, amx_job_info_t **jobs,
                                 size_t *njobs, amx_arena_t *arena, amx_err_t *err)
{
    if (job != NULL && job[0] != '\0' && find_job(reg, job) == NULL)
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
    AMX_CHECK(ready_job(reg, job, 0, 0, &j, err));
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
    amx_job_t *j = find_job(reg, job);
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

void amx_registry_peer_abort(amx_registry_t *reg, const char *job, uint64_t gen, uint32_t from,
                             amx_status_t code, const char *reason)
{
    amx_job_t *j = find_job(reg, job);
    if (j == NULL || j->eng == NULL)
        return;
    AMX_INFO("registry",
             "job %s: daemon %u reports that communicator generation %llu failed "
             "(%s)",
             job, from, (unsigned long long)gen, reason);
    char why[900];
    snprintf(why, sizeof(why), "daemon %u: %s", from, reason);
    amx_engine_abort(j->eng, gen, code, code == AMX_EABORTED ? reason : why);
}

void amx_registry_peer_drop(amx_registry_t *reg, const char *job, uint32_t from)
{
    amx_job_t *j = find_job(reg, job);
    if (j == NULL)
        return;
    char why[160];
    snprintf(why, sizeof(why), "the job was dropped by Reset on daemon %u", from);
    drop_job(reg, j, why);
}

amx_status_t amx_registry_fetch_state(amx_registry_t *reg, const char *job, uint64_t seq,
                                      uint64_t offset, uint32_t max, void **data, size_t *len,
                                      uint64_t *total, amx_err_t *err)
{
    amx_job_t *j = find_job(reg, job);
    if (j == NULL || j->eng == NULL)
        return amx_err_set(err, AMX_EUNAVAIL, "job '%s' has no state to give on this daemon", job);
    return amx_engine_fetch(j->eng, seq, offset, max, data, len, total, err);
}

/* ---- snapshots (snapshot.h, docs/OPERATING.md "Durability") ---- */

/* The job's previous-epoch globals in catalog order, for its snapshot. */
static amx_status_t previous_by_catalog(const amx_job_t *j, amx_snap_meta_t *m)
{
    uint32_t n = j->cat->n;
    if (n == 0)
        return AMX_OK;
    m->prev_ok = calloc(n, 1);
    m->prev_ga = calloc(n, 4);
    m->prev_gs = calloc(n, 4);
    if (m->prev_ok == NULL || m->prev_ga == NULL || m->prev_gs == NULL)
        return AMX_ENOMEM;
    m->nprev = n;
    for (uint32_t i = 0; i < n && i < j->prev_n; i++) {
        if (!j->prev_ok[i])
            continue;
        m->prev_ok[i] = 1;
        m->prev_ga[i] = j->prev_ga[i];
        m->prev_gs[i] = j->prev_gs[i];
    }
    return AMX_OK;
}

/* Writes the last reconciled epoch of a job that snapshot_interval_ms left
 * unwritten; the loop, nothing in flight (shutdown). */
static void flush_snapshot(amx_registry_t *reg, amx_job_t *j)
{
    if (!snapshots_on(reg) || !j->ready || j->in_flight || j->last_reconciled == 0 ||
        j->durable_epoch >= j->last_reconciled)
        return;
    amx_err_t err = {0};
    amx_snap_meta_t m = {0};
    void *meta = NULL, *blob = NULL;
    size_t mlen = 0, blen = 0;
    amx_status_t st = amx_jobstate_export(j->name, j->last_reconciled, j->cat, j->desc, j->state, 0,
                                          &blob, &blen, &err);
    if (st == AMX_OK && (st = amx__snapshot_meta(j, j->cat, &m)) != AMX_OK)
        amx_err_set(&err, st, "out of memory");
    if (st == AMX_OK && (st = previous_by_catalog(j, &m)) != AMX_OK)
        amx_err_set(&err, st, "out of memory");
    m.state_len = blen;
    if (st == AMX_OK)
        st = amx_snapshot_encode_meta(&m, &meta, &mlen, &err);
    amx__snapshot_meta_free(&m);
    if (st == AMX_OK)
        st = amx_snapshot_write(reg->cfg->state_dir, j->name, meta, mlen, blob, blen, &err);
    free(meta);
    free(blob);
    if (st != AMX_OK) {
        AMX_ERROR("registry", "job %s: epoch %llu could not be written to its snapshot: %s",
                  j->name, (unsigned long long)j->last_reconciled, err.msg);
        return;
    }
    j->durable_epoch = j->last_reconciled;
    AMX_INFO("registry", "job %s: epoch %llu written to its snapshot at shutdown", j->name,
             (unsigned long long)j->last_reconciled);
}

void amx_registry_flush_snapshots(amx_registry_t *reg)
{
    for (amx_job_t *j = reg->jobs; j != NULL; j = j->next)
        flush_snapshot(reg, j);
}

/* Builds job `s` from a snapshot; EINVAL with a sentence when the snapshot
 * does not describe a job this daemon can serve, ENOMEM over a limit. */
static amx_status_t restore_job(amx_registry_t *reg, amx_snapshot_t *s, amx_err_t *err)
{
    const amx_snap_meta_t *m = &s->meta;
    amx_jobstate_t *js = &s->js;
    amx_catalog_t *cat = js->cat;
    if (m->world > (uint64_t)reg->cfg->max_world_size)
        return amx_err_set(err, AMX_ENOMEM, "its world size %u is above max_world_size=%lld",
                           m->world, (long long)reg->cfg->max_world_size);
    if (m->nranks == 0 || m->nranks > m->world)
        return amx_err_set(err, AMX_EINVAL, "it lists %u ranks of a job of world size %u",
                           m->nranks, m->world);
    /* A daemon that served every rank serves the job again at once; one
     * that served some ranks of a cluster job waits for them to re-join
     * (membership is the coordinator's), then takes part with the state it
     * restored, or catches up from a daemon further ahead. */
    int alone = m->nranks == m->world;
    if (cat->n > (uint64_t)reg->cfg->max_quantizers ||
        cat->ncells + cat->nhist > (uint64_t)reg->cfg->max_cells)
        return amx_err_set(err, AMX_ENOMEM,
                           "its %u quantizers / %llu cells are above max_quantizers=%lld or "
                           "max_cells=%lld",
                           cat->n, (unsigned long long)(cat->ncells + cat->nhist),
                           (long long)reg->cfg->max_quantizers, (long long)reg->cfg->max_cells);
    uint64_t used = 0;
    for (const amx_job_t *o = reg->jobs; o != NULL; o = o->next)
        used += view_cells(o);
    if ((used + cat->ncells + cat->nhist) * AMX_STATE_BYTES_PER_CELL > reg_budget(reg))
        return amx_err_set(err, AMX_ENOMEM,
                           "its %llu cells do not fit in memory_budget=%llu MiB beside the jobs "
                           "restored before it",
                           (unsigned long long)(cat->ncells + cat->nhist),
                           (unsigned long long)(reg_budget(reg) >> 20));
    amx_job_t *j = NULL;
    AMX_CHECK(job_create(reg, m->job, m->world, &j, err));
    amx_status_t st = AMX_ENOMEM;
    amx_epoch_result_t res;
    memset(&res, 0, sizeof(res));
    if (alone) {
        /* Membership: this daemon hosts every rank. */
        const amx_cluster_id_t *id = reg->peer != NULL ? amx_peer_id(reg->peer) : NULL;
        j->mship.world = m->world;
        j->mship.part = calloc(1, sizeof(amx_part_t));
        if (j->mship.part == NULL)
            goto nomem;
        j->mship.npart = 1;
        amx_part_t *p = &j->mship.part[0];
        p->daemon = id ? id->rank : 0;
        p->incarnation = id ? id->incarnation : 0;
        snprintf(p->addr, sizeof(p->addr), "%s", id ? id->advertise : "");
        p->ranks = malloc((size_t)m->world * sizeof(uint32_t));
        if (p->ranks == NULL)
            goto nomem;
        p->nranks = m->world;
        for (uint32_t r = 0; r < m->world; r++) {
            p->ranks[r] = r;
            if (add_local_rank(j, r) == NULL)
                goto nomem;
        }
        j->me = 0;
        j->ready = 1;
    } else {
        for (uint32_t i = 0; i < m->nranks; i++) {
            if (m->ranks[i].rank >= m->world || local_rank(j, m->ranks[i].rank) != NULL) {
                amx_err_set(err, AMX_EINVAL, "it lists rank %u %s", m->ranks[i].rank,
                            m->ranks[i].rank >= m->world ? "out of range" : "twice");
                st = AMX_EINVAL;
                goto fail;
            }
            amx_lrank_t *r = add_local_rank(j, m->ranks[i].rank);
            if (r == NULL)
                goto nomem;
            r->restored = 1;
        }
    }
    /* State: both pending buffers sized, the replicated state and the last
     * results imported and published. */
    if (j->state->ops->reserve_pending(j->state, cat->ncells, err) != AMX_OK)
        goto fail;
    if (j->state->ops->import_state(j->state, cat->ncells, cat->nhist, cat->n, cat->nslices, &js->a,
                                    err) != AMX_OK)
        goto fail;
    j->state->ops->publish(j->state);
    /* Catalog and layout, as an epoch installs them. */
    res.desc = malloc((cat->n ? cat->n : 1) * sizeof(amx_qdesc_t));
    if (res.desc == NULL)
        goto nomem;
    amx_catalog_layout(cat, res.desc);
    for (uint32_t i = 0; i < cat->n; i++)
        res.desc[i].hist_head = js->hist_head[i];
    res.cat = cat;
    js->cat = NULL;
    res.pend_change.ncells = cat->ncells;
    res.pend_change.nhist = cat->nhist;
    res.pend_change.nslices = cat->nslices;
    res.pend_change.nq = cat->n;
    install_catalog(reg, j, &res);
    /* Placements. */
    for (uint32_t i = 0; i < m->nranks; i++) {
        const amx_snap_rank_t *sr = &m->ranks[i];
        amx_lrank_t *r = local_rank(j, sr->rank);
        if (r == NULL || rank_reserve(r, j->nlq, sr->n) != AMX_OK)
            goto nomem;
        for (uint32_t k = 0; k < sr->n; k++) {
            uint32_t lid;
            if (!amx_strmap_get(&j->lqmap, sr->pls[k].name, &lid)) {
                amx_err_set(err, AMX_EINVAL, "rank %u places quantizer '%s', not in the catalog",
                            sr->rank, sr->pls[k].name);
                goto fail;
            }
            const amx_placement_t *in = &sr->pls[k].pl;
            amx_placement_t pl;
            if (r->pl_of[lid] != 0 ||
                amx_placement_parse(j->lq[lid].spec, in->off, in->ndim, in->shape, in->ndim, &pl,
                                    err) != AMX_OK) {
                if (r->pl_of[lid] != 0)
                    amx_err_set(err, AMX_EINVAL, "rank %u places quantizer '%s' twice", sr->rank,
                                sr->pls[k].name);
                st = AMX_EINVAL;
                goto fail;
            }
            r->pls[r->npls] = pl;
            r->pl_lid[r->npls] = lid;
            r->pl_of[lid] = ++r->npls;
            j->lq[lid].nplacements++;
        }
    }
    /* The epoch before the snapshotted one (for has_previous). */
    if (m->nprev == cat->n && cat->n > 0) {
        /* install_catalog made `cat` the job's catalog: the same order. */
        free(j->prev_ga), free(j->prev_gs), free(j->prev_ok);
        j->prev_ga = malloc(cat->n * sizeof(float));
        j->prev_gs = malloc(cat->n * sizeof(float));
        j->prev_ok = malloc(cat->n);
        j->prev_cap = j->prev_n = 0;
        if (j->prev_ga == NULL || j->prev_gs == NULL || j->prev_ok == NULL)
            goto nomem;
        j->prev_cap = j->prev_n = cat->n;
        memcpy(j->prev_ok, m->prev_ok, cat->n);
        memcpy(j->prev_ga, m->prev_ga, cat->n * sizeof(float));
        memcpy(j->prev_gs, m->prev_gs, cat->n * sizeof(float));
    }
    j->last_reconciled = js->last_reconciled;
    j->epoch = js->last_reconciled + 1;
    j->epochs_ok = m->epochs_ok;
    j->epochs_failed = m->epochs_failed;
    j->durable_epoch = js->last_reconciled;
    j->restored = 1;
    j->layout_gen++;
    j->last_active_ms = amx_now_ms();
    return AMX_OK;
nomem:
    amx_err_set(err, AMX_ENOMEM, "out of memory");
fail:
    if (st == AMX_ENOMEM && err->code != AMX_OK)
        st = err->code;
    amx_catalog_free(res.cat);
    free(res.desc);
    job_unlink(reg, j);
    job_free(j);
    return st;
}

static int has_suffix(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n > k && strcmp(s + n - k, suf) == 0;
}

amx_status_t amx_registry_restore(amx_registry_t *reg, amx_err_t *err)
{
    if (!snapshots_on(reg))
        return AMX_OK;
    const char *dir = reg->cfg->state_dir;
    if (mkdir(dir, 0750) != 0 && errno != EEXIST)
        return amx_err_set(err, AMX_EUNAVAIL, "state_dir %s cannot be created: %s", dir,
                           strerror(errno));
    if (access(dir, R_OK | W_OK | X_OK) != 0)
        return amx_err_set(err, AMX_EUNAVAIL, "state_dir %s is not a writable directory: %s", dir,
                           strerror(errno));
    DIR *d = opendir(dir);
    if (d == NULL)
        return amx_err_set(err, AMX_EUNAVAIL, "state_dir %s cannot be read: %s", dir,
                           strerror(errno));
    /* Names first: the directory changes as snapshots are set aside. */
    char **names = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (!has_suffix(e->d_name, AMX_SNAPSHOT_SUFFIX) &&
            !has_suffix(e->d_name, AMX_SNAPSHOT_SUFFIX ".tmp"))
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            char **q = realloc(names, cap * sizeof(char *));
            if (q == NULL)
                break;
            names = q;
        }
        if ((names[n] = strdup(e->d_name)) != NULL)
            n++;
    }
    closedir(d);
    uint32_t restored = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        char path[4096], aside[4200];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        if (has_suffix(names[i], ".tmp")) {
            AMX_WARN("registry",
                     "removing %s: a snapshot write that did not finish (the snapshot before it "
                     "is intact)",
                     path);
            unlink(path);
            free(names[i]);
            continue;
        }
        amx_snapshot_t s;
        amx_err_t e2 = {0};
        amx_status_t st = amx_snapshot_read(path, &s, &e2);
        if (st == AMX_OK) {
            size_t jl = strlen(s.meta.job);
            if (strlen(names[i]) != jl + strlen(AMX_SNAPSHOT_SUFFIX) ||
                strncmp(names[i], s.meta.job, jl) != 0) {
                st = amx_err_set(&e2, AMX_EINVAL, "it holds job '%s', not the one its name says",
                                 s.meta.job);
            } else if (find_job(reg, s.meta.job) != NULL) {
                st = amx_err_set(&e2, AMX_EINVAL, "job '%s' was restored already", s.meta.job);
            } else {
                st = restore_job(reg, &s, &e2);
            }
            if (st == AMX_OK) {
                amx_job_t *j = find_job(reg, s.meta.job);
                AMX_INFO("registry",
                         "job %s restored from %s: epoch %llu reconciled, %u quantizers, %llu "
                         "cells; its %u ranks carry on after they re-join",
                         j->name, path, (unsigned long long)j->last_reconciled, j->cat->n,
                         (unsigned long long)(j->cat->ncells + j->cat->nhist), j->world);
                restored++;
            }
            amx_snapshot_free(&s);
        }
        if (st == AMX_EINVAL) {
            int rc = amx_snapshot_set_aside(path, aside, sizeof(aside));
            AMX_ERROR("registry", "snapshot %s cannot be used: %s; %s%s", path, e2.msg,
                      rc == 0 ? "moved aside to " : "and it could not be moved aside: ",
                      rc == 0 ? aside : strerror(-rc));
            bad++;
        } else if (st != AMX_OK) {
            AMX_ERROR("registry", "snapshot %s was not restored: %s (the file is left in place)",
                      path, e2.msg);
            bad++;
        }
        free(names[i]);
    }
    free(names);
    if (restored > 0 || bad > 0)
        AMX_INFO("registry", "state_dir %s: %u job(s) restored, %u snapshot(s) not used", dir,
                 restored, bad);
    return AMX_OK;
}
