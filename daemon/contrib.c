/*
 * contrib.c - contributions: Register (validation, the local view of the
 * catalog, provisional cells and their growth), SendAmax and SendPacked
 * (validated completely, then merged into the active pending buffer).
 *
 * A quantizer registered here is a proposal (with provisional cells after
 * the agreed ones) until an epoch's agreement adopts it into the agreed
 * catalog, whose layout is canonical (catalog.h).
 */
#include "registry_impl.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "bytebuf.h"
#include "clock.h"
#include "log.h"
#include "snapshot.h"
#include "state.h"

/* ---- Register ---- */

/* One spec after validation, before it is applied. */
typedef struct reg_item {
    amx_qspec_t spec; /* borrowed strings */
    amx_placement_t pl;
    int64_t lid; /* an existing live local quantizer, or -1 */
    int same_placement;
} reg_item_t;

static amx_status_t validate_item(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r,
                                  const amx_qspec_in_t *in, reg_item_t *it, amx_err_t *err)
{
    AMX_CHECK(amx_qspec_parse(in, (uint64_t)reg->cfg->max_cells, &it->spec, err));
    AMX_CHECK(amx_placement_parse(&it->spec, in->offset, in->n_offset, in->local_shape,
                                  in->n_local_shape, &it->pl, err));
    it->lid = -1;
    it->same_placement = 0;
    uint32_t lid;
    if (!amx_strmap_get(&j->lqmap, it->spec.name, &lid) || !amx__lq_live(&j->lq[lid]))
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

amx_status_t amx__rank_reserve(amx_lrank_t *r, uint32_t nlq, uint32_t npls)
{
    if (amx_grow(&r->pl_of, &r->cap_of, nlq, sizeof(uint32_t), 64, 1) != 0)
        return AMX_ENOMEM;
    /* pls and pl_lid share one capacity: it moves once both have grown. */
    size_t c1 = r->cap_pls, c2 = r->cap_pls;
    if (amx_grow(&r->pls, &c1, npls, sizeof(amx_placement_t), 64, 0) != 0 ||
        amx_grow(&r->pl_lid, &c2, npls, sizeof(uint32_t), 64, 0) != 0)
        return AMX_ENOMEM;
    r->cap_pls = c1;
    return AMX_OK;
}

amx_status_t amx__job_reserve_lq(amx_job_t *j, uint32_t n)
{
    if (amx_grow(&j->lq, &j->cap_lq, n, sizeof(amx_lq_t), 64, 0) != 0)
        return AMX_ENOMEM;
    return amx_strmap_reserve(&j->lqmap, n) == 0 ? AMX_OK : AMX_ENOMEM;
}

/* Cells a local view holds: agreed, history, provisional. */
uint64_t amx__view_cells(const amx_job_t *j)
{
    /* A statistic value (float64, four copies) counts as a cell. */
    return j->cat->ncells + j->cat->nhist + j->cat->nstat + j->prov_cells + j->prov_hist;
}

/* The memory budget (configuration may be reloaded: an explicit value is
 * read every time; 0 means the default found at start). */
uint64_t amx__reg_budget(const amx_registry_t *reg)
{
    return reg->cfg->memory_budget > 0 ? (uint64_t)reg->cfg->memory_budget : reg->budget;
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
        if (!amx__lq_live(q) || q->spec->peer_group[0] == '\0' ||
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

amx_status_t amx__do_register(amx_registry_t *reg, amx_job_t *j, const amx_register_req_t *req,
                              amx_reply_t *rep, int *deferred, amx_err_t *err)
{
    *deferred = 0;
    amx_lrank_t *r = amx__local_rank(j, req->rank);
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
            new_hist += amx_qspec_hist_cells(&it->spec) + amx_qspec_stat_values(&it->spec);
        }
        if (!it->same_placement)
            new_pls++;
    }
    AMX_CHECK_GOTO(check_peer_modes(j, items, n, err), st, out);
    uint64_t have = amx__view_cells(j);
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
            uint64_t v = amx__view_cells(o), p = o->state ? o->state->pend_cells : 0;
            used += v > p ? v : p;
        }
    if (j->state != NULL && j->state->pend_cells > amx__view_cells(j))
        used -= j->state->pend_cells - amx__view_cells(j); /* this job's growth is counted as new */
    if ((used + new_cells + new_hist) * AMX_STATE_BYTES_PER_CELL > amx__reg_budget(reg)) {
        st = amx_err_set(
            err, AMX_ENOMEM,
            "the jobs of this daemon would hold %llu amax cells, about %llu MiB of "
            "state (%d bytes a cell), more than memory_budget=%llu MiB (%s); "
            "register fewer or smaller quantizers, drop unused jobs, or raise "
            "memory_budget",
            (unsigned long long)(used + new_cells + new_hist),
            (unsigned long long)((used + new_cells + new_hist) * AMX_STATE_BYTES_PER_CELL >> 20),
            AMX_STATE_BYTES_PER_CELL, (unsigned long long)(amx__reg_budget(reg) >> 20),
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
    if (amx__job_reserve_lq(j, j->nlq + new_q) != AMX_OK ||
        amx__rank_reserve(r, j->nlq + new_q, r->npls + new_pls) != AMX_OK) {
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
        amx__note_fault(reg, st, err->msg);
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
            j->prov_hist += amx_qspec_hist_cells(q->spec) + amx_qspec_stat_values(q->spec);
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

amx_status_t amx__defer(amx_registry_t *reg, amx_job_t *j, int kind, amx_waiter_t *w,
                        const void *req, amx_err_t *err)
{
    amx_deferred_t *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    d->kind = kind;
    d->w = w;
    d->req = req;
    *j->defer_tail = d;
    j->defer_tail = &d->next;
    w->job = j;
    w->kind = kind;
    reg->nwaiting++;
    return AMX_OK;
}

amx_status_t amx_registry_register(amx_registry_t *reg, const amx_register_req_t *req,
                                   amx_waiter_t *w, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, req->job, req->rank, 1, &j, err));
    int deferred = 0;
    amx_reply_t rep;
    memset(&rep, 0, sizeof(rep));
    /* The catalog and the buffers belong to the engine until it returns,
     * and new cells wait for a growth to end. */
    if (!j->in_flight && !j->growing)
        AMX_CHECK(amx__do_register(reg, j, req, &rep, &deferred, err));
    if (j->in_flight || j->growing) {
        return amx__defer(reg, j, WAIT_REGISTER, w, req, err);
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

amx_status_t amx__check_epoch(const amx_job_t *j, uint64_t open, uint64_t want, uint32_t rank,
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

amx_status_t amx__stage_reserve(amx_registry_t *reg, uint64_t nvals, size_t nruns)
{
    if (nvals > SIZE_MAX / sizeof(float) ||
        amx_grow(&reg->stage, &reg->stage_cap, (size_t)nvals, sizeof(float), 4096, 0) != 0 ||
        amx_grow(&reg->runs, &reg->runs_cap, nruns, sizeof(amx_run_t), 1024, 0) != 0)
        return AMX_ENOMEM;
    return AMX_OK;
}

static int normalize_slab(float *dst, const void *src, const uint8_t *mask, uint64_t total);

static uint64_t bad_cell(const float *v, const uint8_t *mask, uint64_t total);

/* ---- statistics of calibrators beyond max ---- */

/* 2^53: float64 holds every integer up to it, so counts below it sum
 * exactly in any order. */
#define STAT_COUNT_MAX 9007199254740992.0

/* The published statistic of agreed quantizer `cidx` (NULL: none yet). */
static const amx_stat_result_t *published_stat(const amx_job_t *j, int32_t cidx)
{
    const amx_state_t *st = j->state;
    int f = st->front;
    if (cidx < 0 || st->p_sq[f] == NULL || (uint32_t)cidx >= st->p_nq[f])
        return NULL;
    return &st->p_sq[f][cidx];
}

/*
 * Checks that quantizer `lid` takes a statistic now (`what` names the
 * request, `u` the update or -1): a calibrator beyond max, agreed, with
 * an agreed basis of epoch `stat_epoch`, while no epoch of the job is in
 * flight; and that `len` bytes are a statistic of it for rank block `pl`:
 * a histogram's num_bins counts (overflow count optional unless `exact`),
 * an MSE search's nsteps losses per cell. *nvals: float64 values sent.
 */
static amx_status_t check_stat(const amx_job_t *j, uint32_t lid, const amx_placement_t *pl,
                               size_t len, uint64_t stat_epoch, int exact, uint32_t rank,
                               const char *what, amx_err_t *err)
{
    const amx_lq_t *q = &j->lq[lid];
    const amx_calib_t *c = &q->spec->calib;
    if (c->kind == AMX_CAL_MAX)
        return amx_err_set(err, AMX_EINVAL,
                           "%s of rank %u, job '%s': quantizer '%s' is a max quantizer "
                           "(calibrator CALIBRATOR_MAX) and takes no statistic; register it "
                           "with a histogram or MSE calibrator (under a new name or after "
                           "Reset(drop_job)) or send only its max",
                           what, rank, j->name, q->spec->name);
    if (j->in_flight)
        return amx_err_set(err, AMX_EPRECOND,
                           "%s of rank %u, job '%s': an epoch of the job is being reconciled; "
                           "send the statistic of quantizer '%s' after this rank's Reconcile "
                           "answer, against the basis it carries",
                           what, rank, j->name, q->spec->name);
    const amx_stat_result_t *ps = q->status == LQ_AGREED ? published_stat(j, q->cidx) : NULL;
    if (ps == NULL || ps->epoch == 0)
        return amx_err_set(err, AMX_EPRECOND,
                           "%s of rank %u, job '%s': quantizer '%s' has no agreed basis yet (%s); "
                           "send its max, reconcile, then count against the basis the answer "
                           "carries (stat_basis, stat_epoch)",
                           what, rank, j->name, q->spec->name,
                           q->status != LQ_AGREED ? "it is not agreed yet"
                                                  : "no epoch reconciled its max");
    if (stat_epoch != ps->epoch)
        return amx_err_set(err, AMX_EPRECOND,
                           "%s of rank %u, job '%s': the statistic of quantizer '%s' names the "
                           "basis of epoch %llu, the agreed basis is that of epoch %llu (a Reset "
                           "cleared the other); compute it again against the last answer's "
                           "stat_basis and stat_epoch",
                           what, rank, j->name, q->spec->name, (unsigned long long)stat_epoch,
                           (unsigned long long)ps->epoch);
    if (len % 8 != 0)
        return amx_err_set(err, AMX_EINVAL,
                           "%s of rank %u, job '%s': the statistic of quantizer '%s' has %zu "
                           "bytes, not a multiple of 8 (float64 LE values)",
                           what, rank, j->name, q->spec->name, len);
    uint64_t n = len / 8;
    if (c->kind == AMX_CAL_HISTOGRAM) {
        if (n != c->num_bins + 1ull && (exact || n != c->num_bins))
            return amx_err_set(err, AMX_EINVAL,
                               "%s of rank %u, job '%s': histogram quantizer '%s' has %u bins; "
                               "its statistic is %u counts%s (got %llu values)",
                               what, rank, j->name, q->spec->name, c->num_bins,
                               exact ? c->num_bins + 1 : c->num_bins,
                               exact ? " (the bins, then the overflow count)"
                                     : ", optionally followed by the overflow count",
                               (unsigned long long)n);
    } else if (c->kind == AMX_CAL_NVFP4_MSE) {
        if (n != pl->ncells)
            return amx_err_set(err, AMX_EINVAL,
                               "%s of rank %u, job '%s': NVFP4_MSE quantizer '%s': rank %u's block "
                               "has %llu blocks; its statistic is one amax per block (got %llu "
                               "values)",
                               what, rank, j->name, q->spec->name, rank,
                               (unsigned long long)pl->ncells, (unsigned long long)n);
    } else if (n != (uint64_t)c->nsteps * pl->ncells) {
        return amx_err_set(err, AMX_EINVAL,
                           "%s of rank %u, job '%s': MSE quantizer '%s' has %u candidates and "
                           "rank %u's block %llu cells; its statistic is %llu losses (got %llu)",
                           what, rank, j->name, q->spec->name, c->nsteps, rank,
                           (unsigned long long)pl->ncells,
                           (unsigned long long)c->nsteps * pl->ncells, (unsigned long long)n);
    }
    return AMX_OK;
}

/* The global amax an NVFP4_MSE quantizer's basis fixed (every stat cell
 * holds it; check_stat found the basis published). */
static float nvfp4_basis(const amx_job_t *j, uint32_t lid)
{
    const amx_state_t *st = j->state;
    const amx_qdesc_t *d = &j->desc[j->lq[lid].cidx];
    int f = st->front;
    if (st->p_basis[f] == NULL || d->obase >= st->p_nscell[f])
        return 0.0f;
    return st->p_basis[f][d->obase];
}

/* Validates `n` float64 LE statistic values of quantizer lid read from
 * `src` into `dst` (histogram counts: non-negative integers below 2^53;
 * losses: finite and >= 0; NVFP4 block amaxes: one of the candidates of
 * the basis's global amax; -0 becomes +0). */
static amx_status_t read_stat(const amx_job_t *j, uint32_t lid, const uint8_t *src, uint64_t n,
                              double *dst, uint32_t rank, const char *what, amx_err_t *err)
{
    const amx_qspec_t *spec = j->lq[lid].spec;
    int hist = spec->calib.kind == AMX_CAL_HISTOGRAM;
    int fp4 = spec->calib.kind == AMX_CAL_NVFP4_MSE;
    float g = fp4 ? nvfp4_basis(j, lid) : 0.0f;
    float cand[AMX_NVFP4_MSE_STEPS];
    if (fp4)
        amx_nvfp4_mse_candidates(cand);
    for (uint64_t i = 0; i < n; i++) {
        double v;
        memcpy(&v, src + 8 * i, 8);
        if (!(v >= 0.0 && v <= DBL_MAX) || (hist && (v != floor(v) || v > STAT_COUNT_MAX)))
            return amx_err_set(err, AMX_EINVAL,
                               "%s of rank %u, job '%s': quantizer '%s' statistic[%llu] = %g; %s "
                               "(nothing of this request was applied)",
                               what, rank, j->name, spec->name, (unsigned long long)i, v,
                               hist  ? "bin counts must be integers in [0, 2^53]"
                               : fp4 ? "block amaxes must be finite and >= 0"
                                     : "losses must be finite and >= 0");
        v += 0.0;
        if (fp4 && v > (double)g)
            return amx_err_set(err, AMX_EINVAL,
                               "%s of rank %u, job '%s': NVFP4_MSE quantizer '%s' block %llu of "
                               "rank %u's block: amax %.9g is above the global amax %.9g that "
                               "phase 1 fixed (the largest candidate is the global amax itself; "
                               "nothing of this request was applied)",
                               what, rank, j->name, spec->name, (unsigned long long)i, rank, v,
                               (double)g);
        if (fp4 && amx_nvfp4_mse_index(cand, g, v) < 0)
            return amx_err_set(err, AMX_EINVAL,
                               "%s of rank %u, job '%s': NVFP4_MSE quantizer '%s' block %llu of "
                               "rank %u's block: amax %.9g is not one of the candidates "
                               "float32(g * e4m3/448) of the global amax g = %.9g (search against "
                               "the basis the answer carries; nothing of this request was "
                               "applied)",
                               what, rank, j->name, spec->name, (unsigned long long)i, rank, v,
                               (double)g);
        dst[i] = v;
    }
    return AMX_OK;
}

typedef struct stat_ctx {
    amx_registry_t *reg;
    uint64_t sbase, src_base, per_cell;
} stat_ctx_t;

/* An MSE search's block row: `len` cells of per_cell values each. */
static void stat_row(void *ud, uint64_t dst, uint64_t src, uint64_t len)
{
    stat_ctx_t *c = ud;
    c->reg->sruns[c->reg->nsruns++] = (amx_run_t){
        c->sbase + dst * c->per_cell, c->src_base + src * c->per_cell, len * c->per_cell};
}

/* Stages quantizer lid's validated statistic (n values at `vals`, already
 * checked) for rank block `pl`: histogram counts as they are (overflow 0
 * when absent); MSE losses with one presence count after each cell's.
 * Room was reserved. */
static void stage_stat(amx_registry_t *reg, const amx_job_t *j, uint32_t lid,
                       const amx_placement_t *pl, const double *vals, uint64_t n)
{
    const amx_lq_t *q = &j->lq[lid];
    const amx_qdesc_t *d = &j->desc[q->cidx];
    const amx_calib_t *c = &q->spec->calib;
    double *dst = reg->sstage + reg->nsstage;
    if (c->kind == AMX_CAL_HISTOGRAM) {
        memmove(dst, vals, n * sizeof(double)); /* vals may lie inside dst's room */
        if (n == c->num_bins)
            dst[n] = 0.0;
        reg->sruns[reg->nsruns++] = (amx_run_t){d->sbase, reg->nsstage, c->num_bins + 1ull};
        reg->nsstage += c->num_bins + 1ull;
        return;
    }
    if (c->kind == AMX_CAL_NVFP4_MSE) {
        /* Per block its amax, its square and a presence count: summed over
         * ranks, equal amaxes stay recognizable (engine_stat.c). */
        for (uint64_t cell = 0; cell < pl->ncells; cell++) {
            double v = vals[cell]; /* read before dst's writes reach it */
            dst[3 * cell] = v;
            dst[3 * cell + 1] = v * v;
            dst[3 * cell + 2] = 1.0;
        }
        stat_ctx_t ctx = {reg, d->sbase, reg->nsstage, 3};
        amx_placement_rows(pl, q->spec->shape, 0, stat_row, &ctx);
        reg->nsstage += pl->ncells * 3;
        return;
    }
    uint64_t k = c->nsteps;
    for (uint64_t cell = 0; cell < pl->ncells; cell++) {
        memmove(dst + cell * (k + 1), vals + cell * k, k * sizeof(double));
        dst[cell * (k + 1) + k] = 1.0;
    }
    stat_ctx_t ctx = {reg, d->sbase, reg->nsstage, k + 1};
    amx_placement_rows(pl, q->spec->shape, 0, stat_row, &ctx);
    reg->nsstage += pl->ncells * (k + 1);
}

/* Staged values a statistic of quantizer lid takes (stage_stat). */
static uint64_t staged_size(const amx_job_t *j, uint32_t lid, const amx_placement_t *pl)
{
    const amx_calib_t *c = &j->lq[lid].spec->calib;
    if (c->kind == AMX_CAL_NVFP4_MSE)
        return pl->ncells * 3;
    return c->kind == AMX_CAL_HISTOGRAM ? c->num_bins + 1ull : pl->ncells * (c->nsteps + 1ull);
}

static amx_status_t sstage_reserve(amx_registry_t *reg, uint64_t nvals, size_t nruns)
{
    reg->nsstage = 0;
    reg->nsruns = 0;
    if (nvals > SIZE_MAX / sizeof(double) ||
        amx_grow(&reg->sstage, &reg->sstage_cap, (size_t)nvals, sizeof(double), 1024, 0) != 0 ||
        amx_grow(&reg->sruns, &reg->sruns_cap, nruns, sizeof(amx_run_t), 64, 0) != 0)
        return AMX_ENOMEM;
    return AMX_OK;
}

amx_status_t amx_registry_send(amx_registry_t *reg, const amx_send_req_t *req, uint64_t *accepted,
                               uint64_t *epoch, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, req->job, req->rank, 1, &j, err));
    uint64_t open = send_epoch(j);
    AMX_CHECK(amx__check_epoch(j, open, req->epoch, req->rank, "SendAmax", err));
    amx_lrank_t *r = amx__local_rank(j, req->rank);
    if (r->in_reconcile && !j->in_flight)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' already entered Reconcile for epoch %llu; send "
                           "amax before calling Reconcile (this update belongs to the next epoch)",
                           req->rank, j->name, (unsigned long long)j->epoch);
    /* Pass 1: names, placements and sizes. */
    uint64_t nvals = 0, nstat = 0;
    size_t nruns = 0, nsruns = 0;
    int overlap = 0;
    if (++j->batch == 0) { /* wrapped: forget old stamps */
        for (uint32_t i = 0; i < j->nlq; i++)
            j->lq[i].stamp = 0;
        j->batch = 1;
    }
    if (amx_grow(&reg->lids, &reg->lids_cap, req->n, sizeof(uint32_t), 1024, 0) != 0)
        return amx_err_set(err, AMX_ENOMEM, "out of memory reading %zu updates", req->n);
    for (size_t u = 0; u < req->n; u++) {
        const amx_update_in_t *up = &req->u[u];
        uint32_t lid;
        if (!amx_strmap_get(&j->lqmap, up->name, &lid) || !amx__lq_live(&j->lq[lid]))
            return amx_err_set(err, AMX_ENOTFOUND,
                               "update %zu: quantizer '%.255s' is not registered in job '%s'", u,
                               up->name, j->name);
        if (lid >= r->cap_of || r->pl_of[lid] == 0)
            return amx_err_set(err, AMX_EPRECOND,
                               "update %zu: rank %u has no placement for quantizer '%s' of job "
                               "'%s'; Register it from this rank first",
                               u, req->rank, up->name, j->name);
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        int twice = j->lq[lid].stamp == j->batch; /* named twice in this batch */
        overlap |= twice;
        j->lq[lid].stamp = j->batch;
        if (up->stat_len > 0) {
            AMX_CHECK(check_stat(j, lid, pl, up->stat_len, up->stat_epoch, 0, req->rank, "SendAmax",
                                 err));
            if (twice)
                return amx_err_set(err, AMX_EINVAL,
                                   "update %zu: quantizer '%s' is named twice in one request "
                                   "with a statistic; send its statistic once per request",
                                   u, up->name);
            nstat += staged_size(j, lid, pl);
            nsruns +=
                j->lq[lid].spec->calib.kind == AMX_CAL_HISTOGRAM ? 1 : amx_placement_nrows(pl);
        } else if (up->stat_epoch != 0) {
            return amx_err_set(err, AMX_EINVAL,
                               "update %zu: quantizer '%s' has a stat_epoch but no statistic", u,
                               up->name);
        }
        if (up->values_len == 0 && up->stat_len > 0 && up->has_data_len == 0) {
            reg->lids[u] = lid; /* a statistic alone: no max this time */
            continue;
        }
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
    if (amx__stage_reserve(reg, nvals, nruns) != AMX_OK ||
        sstage_reserve(reg, nstat, nsruns) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of memory staging %llu amax values",
                           (unsigned long long)nvals);
    /* Pass 2: values, staged as host floats; statistics as float64. */
    stage_ctx_t ctx = {reg, 0, 0};
    for (size_t u = 0; u < req->n; u++) {
        const amx_update_in_t *up = &req->u[u];
        uint32_t lid = reg->lids[u]; /* found in pass 1: one lookup per update */
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        if (up->stat_len > 0) {
            /* Read into the stage's tail, then placed by stage_stat. */
            uint64_t n = up->stat_len / 8;
            double *tmp = reg->sstage + reg->nsstage + (staged_size(j, lid, pl) - n);
            AMX_CHECK(read_stat(j, lid, up->stat, n, tmp, req->rank, "SendAmax", err));
            stage_stat(reg, j, lid, pl, tmp, n);
        }
        if (up->values_len == 0 && up->stat_len > 0 && up->has_data_len == 0)
            continue;
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
        return amx__note_fault(reg, mst, err->msg);
    if (reg->nsruns > 0) {
        mst = j->state->ops->stat_merge(j->state, reg->sstage, reg->nsstage, reg->sruns,
                                        reg->nsruns, err);
        if (mst != AMX_OK)
            return amx__note_fault(reg, mst, err->msg);
    }
    j->updates += req->n;
    if (reg->metrics != NULL) {
        uint64_t bytes = 0;
        for (size_t u = 0; u < req->n; u++)
            bytes += req->u[u].values_len + req->u[u].has_data_len + req->u[u].stat_len;
        amx_metrics_job_updates(reg->metrics, j->name, req->n, bytes);
    }
    *accepted = req->n;
    *epoch = open;
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

/* Validates and stages the statistics of a SendPacked (reg->sstage,
 * reg->sruns; none when the request has none). Nothing is merged. */
static amx_status_t packed_stats(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r,
                                 const amx_slab_t *sl, const amx_send_packed_req_t *req,
                                 amx_err_t *err)
{
    reg->nsstage = reg->nsruns = 0;
    if (req->stats_len == 0 && req->stat_epochs_len == 0)
        return AMX_OK;
    uint32_t n = sl->n;
    if (sl->nstatq == 0)
        return amx_err_set(err, AMX_EINVAL,
                           "SendPacked of rank %u, job '%s': statistics sent, but no quantizer of "
                           "the layout has a histogram or MSE calibrator",
                           req->rank, j->name);
    if (req->stats_len != sl->stoff[n] * 8 || req->stat_epochs_len != (size_t)n * 8)
        return amx_err_set(err, AMX_EINVAL,
                           "SendPacked of rank %u, job '%s': %zu bytes of stats and %zu of "
                           "stat_epochs; the layout %016llx has %llu float64 statistic values "
                           "(%llu bytes) and %u quantizers (one uint64 stat_epoch each)",
                           req->rank, j->name, req->stats_len, req->stat_epochs_len,
                           (unsigned long long)sl->id, (unsigned long long)sl->stoff[n],
                           (unsigned long long)sl->stoff[n] * 8, n);
    uint64_t nvals = 0;
    size_t nruns = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t ep;
        memcpy(&ep, req->stat_epochs + 8 * (size_t)i, 8);
        uint32_t lid = sl->lid[i];
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        uint64_t k = sl->stoff[i + 1] - sl->stoff[i];
        if (ep == 0) {
            for (uint64_t v = 0; v < k; v++) {
                double x;
                memcpy(&x, req->stats + 8 * (sl->stoff[i] + v), 8);
                if (x != 0.0)
                    return amx_err_set(err, AMX_EINVAL,
                                       "SendPacked of rank %u, job '%s': quantizer '%s' has a "
                                       "statistic (value %llu = %g) but stat_epochs[%u] is 0; "
                                       "name the basis it was computed against, or send zeros",
                                       req->rank, j->name, j->lq[lid].spec->name,
                                       (unsigned long long)v, x, i);
            }
            continue;
        }
        if (k == 0)
            return amx_err_set(err, AMX_EINVAL,
                               "SendPacked of rank %u, job '%s': stat_epochs[%u] is %llu for "
                               "quantizer '%s', which takes no statistic",
                               req->rank, j->name, i, (unsigned long long)ep,
                               j->lq[lid].spec->name);
        AMX_CHECK(check_stat(j, lid, pl, (size_t)k * 8, ep, 1, req->rank, "SendPacked", err));
        nvals += staged_size(j, lid, pl);
        nruns += j->lq[lid].spec->calib.kind == AMX_CAL_HISTOGRAM ? 1 : amx_placement_nrows(pl);
    }
    if (sstage_reserve(reg, nvals, nruns) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of memory staging %llu statistic values",
                           (unsigned long long)nvals);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t ep;
        memcpy(&ep, req->stat_epochs + 8 * (size_t)i, 8);
        if (ep == 0)
            continue;
        uint32_t lid = sl->lid[i];
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        uint64_t k = sl->stoff[i + 1] - sl->stoff[i];
        double *tmp = reg->sstage + reg->nsstage + (staged_size(j, lid, pl) - k);
        AMX_CHECK(
            read_stat(j, lid, req->stats + 8 * sl->stoff[i], k, tmp, req->rank, "SendPacked", err));
        stage_stat(reg, j, lid, pl, tmp, k);
    }
    return AMX_OK;
}

amx_status_t amx_registry_send_packed(amx_registry_t *reg, const amx_send_packed_req_t *req,
                                      uint64_t *accepted, uint64_t *epoch, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, req->job, req->rank, 1, &j, err));
    uint64_t open = send_epoch(j);
    AMX_CHECK(amx__check_epoch(j, open, req->epoch, req->rank, "SendPacked", err));
    amx_lrank_t *r = amx__local_rank(j, req->rank);
    if (r->in_reconcile && !j->in_flight)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' already entered Reconcile for epoch %llu; send "
                           "amax before calling Reconcile (this update belongs to the next epoch)",
                           req->rank, j->name, (unsigned long long)j->epoch);
    amx_slab_t *sl;
    AMX_CHECK(amx__slab_get(j, r, &sl, err));
    AMX_CHECK(amx__check_layout_id(j, r, sl, req->layout_id, "SendPacked", err));
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
    AMX_CHECK(packed_stats(reg, j, r, sl, req, err));
    amx_status_t mst = j->state->ops->merge(j->state, v, total, sl->merge, sl->nmerge, 0, err);
    if (mst != AMX_OK)
        return amx__note_fault(reg, mst, err->msg);
    if (reg->nsruns > 0) {
        mst = j->state->ops->stat_merge(j->state, reg->sstage, reg->nsstage, reg->sruns,
                                        reg->nsruns, err);
        if (mst != AMX_OK)
            return amx__note_fault(reg, mst, err->msg);
    }
    j->updates += sl->n;
    if (reg->metrics != NULL)
        amx_metrics_job_updates(reg->metrics, j->name, sl->n, req->values_len + req->has_data_len);
    *accepted = sl->n;
    *epoch = open;
    return AMX_OK;
}
