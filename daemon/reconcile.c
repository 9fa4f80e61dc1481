/*
 * reconcile.c - Reconcile and the end of an epoch: when every local rank
 * has entered Reconcile the epoch goes to the job's engine (engine.c);
 * its outcome comes back through amx__epoch_done, which installs a new
 * catalog, publishes or rolls back, and answers the waiting ranks.
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
#include "log.h"
#include "snapshot.h"
#include "state.h"

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

/* ---- Reconcile ---- */

void amx__missing_ranks(const amx_job_t *j, char *buf, size_t len)
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
        amx__fail_all_waiters(reg, j, e2.code, e2.msg);
    }
}

/* Growths that ended: their Registers go on, and an epoch whose ranks all
 * entered Reconcile meanwhile starts. */
void amx__on_grow_async(uv_async_t *h)
{
    amx_registry_t *reg = h->data;
    for (amx_job_t **pp = &reg->zombies; *pp != NULL;) {
        amx_job_t *j = *pp;
        if (j->growing && __atomic_load_n(&j->grow_done, __ATOMIC_ACQUIRE)) {
            pthread_join(j->grow_th, NULL);
            j->growing = 0;
            if (!j->in_flight) {
                *pp = j->next;
                amx__job_free(j);
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
        amx__run_deferred(reg, j);
        if (!j->growing && !j->in_flight && j->nlocal > 0 && j->nin_reconcile == j->nlocal)
            start_epoch_or_fail(reg, j);
    }
}

static amx_status_t start_epoch(amx_registry_t *reg, amx_job_t *j, amx_err_t *err)
{
    if (j->eng == NULL)
        AMX_CHECK(amx_engine_create(j, &reg->env, &j->eng, err));
    uint64_t deadline = UINT64_MAX;
    int armed = 0;
    for (uint32_t i = 0; i < j->nlocal; i++) {
        if (j->lr[i].rec_w != NULL && j->lr[i].rec_w->deadline_ms < deadline)
            deadline = j->lr[i].rec_w->deadline_ms;
        armed |= amx__dev_armed(&j->lr[i]);
    }
    /* Only armed calls (no deadline until their flags passed): the
     * epoch's deadline runs from when the slabs were merged. */
    uint64_t armed_ms =
        armed && deadline == UINT64_MAX ? (uint64_t)reg->cfg->reconcile_timeout_ms : 0;
    j->flight_entered_us = amx_now_us();
    amx_engine_expect(j->eng);
    j->state->ops->flip(j->state);
    amx__dev_merge_epoch(reg, j);
    j->in_flight = 1;
    j->flight_deadline = deadline;
    j->flight_started_us = amx_now_us();
    AMX_DEBUG("registry", "job %s: epoch %llu handed to its engine", j->name,
              (unsigned long long)j->epoch);
    amx_engine_start(j->eng, j->epoch, deadline, armed_ms);
    return AMX_OK;
}

/* ReconcilePacked: the layout id is current and the answer fits. */
static amx_status_t packed_answer_fits(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r,
                                       uint64_t id, amx_err_t *err)
{
    amx_slab_t *sl;
    AMX_CHECK(amx__slab_get(j, r, &sl, err));
    AMX_CHECK(amx__check_layout_id(j, r, sl, id, "ReconcilePacked", err));
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
    if (req->device)
        AMX_CHECK(amx__dev_need_backend(reg, "ReconcileDevice", err));
    AMX_CHECK(amx__ready_job(reg, req->job, req->rank, 1, &j, err));
    amx_lrank_t *r = amx__local_rank(j, req->rank);
    if (j->in_flight && r->in_reconcile && r->rec_w == NULL &&
        (req->epoch == 0 || req->epoch == j->epoch)) {
        /* Its earlier call went away while the epoch was in flight: this
         * call takes its place and gets the epoch's answer. */
        if (req->device)
            AMX_CHECK(amx__dev_check_reconcile(reg, j, r, req, err));
        else if (req->packed)
            AMX_CHECK(packed_answer_fits(reg, j, r, req->layout_id, err));
        else
            AMX_CHECK(amx__reconcile_answer_fits(reg, j, req->rank, req->names, req->n_names, err));
        w->job = j;
        w->rank = req->rank;
        w->kind = WAIT_RECONCILE;
        w->deadline_ms = now_ms + (uint64_t)reg->cfg->reconcile_timeout_ms;
        w->names = req->names;
        w->n_names = req->n_names;
        w->device_answer = req->device;
        r->rec_w = w;
        reg->nwaiting++;
        return AMX_OK;
    }
    if (j->in_flight && r->in_reconcile && r->rec_w == NULL && req->epoch == j->epoch + 1) {
        /* Its earlier call entered the epoch in flight and went away (a
         * trainer that restarted and called Reconcile of the next epoch
         * without Join, which would have waited too). The epoch in flight
         * goes on with what that call's rank sent; this call waits until
         * it has ended, then enters the next one (or is refused, naming
         * the open epoch, if that one failed). */
        amx_reconcile_req_t *copy = malloc(sizeof(*copy));
        if (copy == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        *copy = *req;
        w->rank = req->rank;
        if (amx__defer(reg, j, WAIT_RECONCILE_NEXT, w, copy, err) != AMX_OK) {
            free(copy);
            return err->code;
        }
        AMX_INFO("registry",
                 "job %s: rank %u's Reconcile of epoch %llu waits until epoch %llu, which its "
                 "earlier call entered, has ended",
                 j->name, req->rank, (unsigned long long)req->epoch, (unsigned long long)j->epoch);
        return AMX_OK;
    }
    if (r->in_reconcile || j->in_flight)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is already waiting in Reconcile for epoch %llu on "
                           "another call",
                           req->rank, j->name, (unsigned long long)j->epoch);
    AMX_CHECK(amx__check_epoch(j, j->epoch, req->epoch, req->rank, "Reconcile", err));
    if (req->device)
        AMX_CHECK(amx__dev_check_reconcile(reg, j, r, req, err));
    else if (req->packed)
        AMX_CHECK(packed_answer_fits(reg, j, r, req->layout_id, err));
    else
        AMX_CHECK(amx__reconcile_answer_fits(reg, j, req->rank, req->names, req->n_names, err));
    /* The device slab is merged only for a ReconcileDevice that sends it
     * (not for one of an earlier call that went away). */
    amx__dev_arm(r, req->device && req->send, req->has_data, req->seq, req->device && req->armed);
    w->job = j;
    w->rank = req->rank;
    w->kind = WAIT_RECONCILE;
    w->deadline_ms =
        req->device && req->armed ? UINT64_MAX : now_ms + (uint64_t)reg->cfg->reconcile_timeout_ms;
    w->names = req->names;
    w->n_names = req->n_names;
    w->gone = 0;
    w->device_answer = req->device;
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
void amx__install_catalog(amx_registry_t *reg, amx_job_t *j, amx_epoch_result_t *res)
{
    amx_catalog_t *nc = res->cat;
    uint32_t fresh = 0, lid0;
    for (uint32_t i = 0; i < nc->n; i++)
        fresh += !amx_strmap_get(&j->lqmap, nc->q[i]->name, &lid0);
    if (amx__job_reserve_lq(j, j->nlq + fresh) != AMX_OK) {
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
    /* So do the marks of published globals; a quantizer new to the
     * catalog has none (its front global is a placeholder). */
    uint8_t *pub = calloc(nc->n ? nc->n : 1, 1);
    if (pub == NULL) {
        AMX_ERROR("registry", "job %s: out of memory installing a catalog; aborting", j->name);
        abort();
    }
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
        pub[i] = q->status == LQ_AGREED && q->cidx >= 0 && amx_job_published(j, (uint32_t)q->cidx);
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
    free(j->pub_ok);
    j->pub_ok = pub;
    j->pub_n = nc->n;
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

/* Room for the previous globals of n quantizers (-1: out of memory; the
 * three arrays share prev_cap, which moves once all have grown). */
static int reserve_previous(amx_job_t *j, uint32_t n)
{
    size_t c1 = j->prev_cap, c2 = j->prev_cap, c3 = j->prev_cap;
    if (amx_grow(&j->prev_ga, &c1, n, sizeof(float), 64, 0) != 0 ||
        amx_grow(&j->prev_gs, &c2, n, sizeof(float), 64, 0) != 0 ||
        amx_grow(&j->prev_ok, &c3, n, 1, 64, 0) != 0)
        return -1;
    j->prev_cap = c1;
    return 0;
}

/* Keeps the published global amax and scale of every quantizer of the
 * catalog (output set f, the front before this epoch's publish, made in
 * the installed catalog's layout) as the previous epoch's (j->prev_*), in
 * catalog order: two copies of the catalog's globals, no per-quantizer
 * work (amx__install_catalog carries them over to a new catalog's order).
 * Before the answers, or after them when they read the set in place
 * (previous_in_front). */
static void save_previous(amx_job_t *j, int f)
{
    amx_state_t *st = j->state;
    uint32_t n = j->cat->n;
    if (reserve_previous(j, n) != 0) {
        j->prev_n = 0; /* out of memory: no previous values, nothing wrong */
        return;
    }
    uint32_t have = st->g_amax[f] == NULL ? 0 : n < st->out_nq[f] ? n : (uint32_t)st->out_nq[f];
    if (have > 0) {
        memcpy(j->prev_ga, st->g_amax[f], have * sizeof(float));
        memcpy(j->prev_gs, st->g_scale[f], have * sizeof(float));
    }
    if (j->pub_ok == NULL) { /* every global published: the usual case */
        if (n > 0) {
            memset(j->prev_ok, 1, have);
            memset(j->prev_ok + have, 0, n - have);
        }
    } else {
        for (uint32_t i = 0; i < n; i++)
            j->prev_ok[i] = i < have && amx_job_published(j, i);
    }
    j->prev_n = n;
}

/* After an epoch that continued a donor's state: the previous epoch's
 * globals are the donor's published ones (the front holds this daemon's
 * own, from before it fell behind), in the installed catalog's order. */
/* The previous globals from the donor's (ga/gs per quantizer of
 * res->prev_cat; NaN: none): its last epoch's, for the answers of the epoch
 * after it (res->prev_*), or, after an attempt that failed once it caught
 * up, those its answers of that last epoch carried (res->pprev_*, NULL
 * from a donor of an older format: none). */
static void previous_from_donor(amx_job_t *j, const amx_epoch_result_t *res, const float *ga,
                                const float *gs)
{
    uint32_t n = j->cat->n;
    j->prev_n = 0;
    if (res->prev_cat == NULL || ga == NULL || gs == NULL || n == 0)
        return;
    if (reserve_previous(j, n) != 0)
        return; /* out of memory: no previous values, nothing wrong */
    for (uint32_t i = 0; i < n; i++) {
        int64_t k = amx_catalog_find(res->prev_cat, j->cat->q[i]->name);
        /* NaN: the donor had no published global for it either. */
        j->prev_ok[i] = k >= 0 && !isnan(ga[k]);
        j->prev_ga[i] = j->prev_ok[i] ? ga[k] : 0.0f;
        j->prev_gs[i] = j->prev_ok[i] ? gs[k] : 0.0f;
    }
    j->prev_n = n;
}

/* Whether the previous globals of this epoch's answers can be read from
 * the output set behind the front once published, so that the host copy
 * (save_previous) waits for the answers: the front set is the last
 * finish's, of this catalog, and every global of it was published. Then
 * the device answers read them on the device (prev_dev; *all_device: every
 * rank in Reconcile waits for one) and the others in place (prev_front_*:
 * none does). A mix of both copies first. The other readers of j->prev_*
 * cannot run before the late copy: amx__install_catalog only with a new
 * catalog (res->cat, excluded here), the engine's publish_state only in a
 * later epoch (the next starts under the loop lock, after this returns). */
static int previous_in_front(const amx_job_t *j, const amx_epoch_result_t *res, int *all_device)
{
    const amx_state_t *st = j->state;
    int f = st->front, ndev = 0, nhost = 0;
    if (!j->front_finished || res->cat != NULL || j->pub_ok != NULL || j->cat == NULL ||
        j->cat->n == 0 || st->g_amax[f] == NULL || st->g_scale[f] == NULL ||
        st->out_nq[f] < j->cat->n)
        return 0;
    for (uint32_t i = 0; i < j->nlocal; i++) {
        const amx_lrank_t *r = &j->lr[i];
        if (!r->in_reconcile || r->rec_w == NULL)
            continue;
        if (r->rec_w->device_answer)
            ndev++;
        else
            nhost++;
    }
    if (ndev > 0 && (nhost > 0 || st->ops->dev_answer == NULL))
        return 0;
    *all_device = ndev > 0;
    return 1;
}

void amx__epoch_done(amx_registry_t *reg, amx_job_t *j)
{
    amx_epoch_result_t *res = amx_engine_result(j->eng);
    uint64_t t_in = amx_now_us();
    int f_prev = j->state->front;
    int installed = res->cat != NULL; /* amx__install_catalog clears res->cat */
    j->in_flight = 0;
    j->prev_serial++; /* what follows may change the previous globals */
    j->prev_dev = 0;
    j->prev_front_ga = j->prev_front_gs = NULL;
    int prev_late = 0; /* save_previous after the answers */
    if (res->reconciled && !res->imported && !j->dropped && j->last_reconciled > 0) {
        int all_device = 0;
        prev_late = previous_in_front(j, res, &all_device);
        if (!prev_late) {
            save_previous(j, f_prev);
        } else if (all_device) {
            j->prev_dev = 1;
        } else {
            j->prev_front_ga = j->state->g_amax[f_prev];
            j->prev_front_gs = j->state->g_scale[f_prev];
        }
    }
    /* Moves on below, after a reconciled epoch that changed nothing else. */
    j->front_finished = 0;
    uint64_t t_prev = amx_now_us();
    j->last_started_us = j->flight_started_us;
    j->last_entered_us = j->flight_entered_us;
    j->last_engine_begin_us = res->begin_at_us;
    j->last_engine_end_us = res->end_at_us;
    j->last_ended_us = amx_now_us();
    if (res->cat != NULL)
        amx__install_catalog(reg, j, res);
    if (res->members_changed && !j->dropped) {
        /* The coordinator's membership (a daemon restarted): from now on
         * agreement answers leave it out again. */
        uint32_t me = amx_peer_id(reg->peer)->rank;
        for (uint32_t p = 0; p < res->members.npart; p++)
            if (res->members.part[p].daemon == me) {
                amx_membership_free(&j->mship);
                j->mship = res->members;
                j->me = (int32_t)p;
                memset(&res->members, 0, sizeof(res->members));
                break;
            }
        res->members_changed = 0;
    }
    if (res->imported) {
        j->last_reconciled = res->last_reconciled;
        j->epoch = res->last_reconciled + 1;
        if (res->reconciled && !j->dropped)
            previous_from_donor(j, res, res->prev_ga, res->prev_gs);
        if (!res->reconciled && !j->dropped && j->cat != NULL)
            /* The front is the donor's last epoch now (GetScales answers
             * it), with the previous globals the donor's answers of it
             * carried. */
            previous_from_donor(j, res, res->pprev_ga, res->pprev_gs);
        if (!res->reconciled && !j->dropped && j->cat != NULL && res->prev_cat != NULL) {
            /* The front holds the donor's globals now (published with the
             * imported state): those it had published itself. */
            uint8_t *pub = calloc(j->cat->n ? j->cat->n : 1, 1);
            for (uint32_t i = 0; pub != NULL && i < j->cat->n; i++) {
                int64_t k = amx_catalog_find(res->prev_cat, j->cat->q[i]->name);
                pub[i] = k >= 0 && !isnan(res->prev_ga[k]);
            }
            free(j->pub_ok);
            j->pub_ok = pub; /* out of memory: NULL, as before this mark existed */
            j->pub_n = pub != NULL ? j->cat->n : 0;
        }
    }
    j->last_epoch_us = res->total_us;
    j->last_collective_us = res->collective_us;
    j->last_finish_us = res->finish_us;
    j->last_collectives = res->collectives;
    if (j->dropped) {
        /* Dropped while in flight: nobody is waiting any more; a snapshot
         * its engine wrote meanwhile goes too. */
        if (amx__snapshots_on(reg))
            amx_snapshot_remove(reg->cfg->state_dir, j->name);
        for (amx_job_t **p = &reg->zombies; *p != NULL; p = &(*p)->next)
            if (*p == j) {
                *p = j->next;
                break;
            }
        amx__job_free(j);
        return;
    }
    if (res->reconciled) {
        /* Every quantizer of the epoch's catalog has its global now. */
        free(j->pub_ok);
        j->pub_ok = NULL;
        j->pub_n = 0;
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
        j->last_published_us = amx_now_us();
        uint64_t dev_us = 0; /* AMAXD_PROFILE: the loop's time in device answers */
        uint32_t ndev = 0;
        for (uint32_t i = 0; i < j->nlocal; i++) {
            amx_lrank_t *r = &j->lr[i];
            if (!r->in_reconcile)
                continue;
            r->in_reconcile = 0;
            j->nin_reconcile--;
            amx_waiter_t *w = r->rec_w;
            r->rec_w = NULL;
            if (w == NULL) {
                amx__dev_epoch_end(r);
                continue; /* its client went away */
            }
            amx_arena_t a = {0};
            amx_err_t e2 = {0};
            amx_reply_t rep;
            memset(&rep, 0, sizeof(rep));
            rep.epoch = res->epoch;
            rep.next_epoch = j->epoch;
            amx_packed_t pk;
            amx_status_t st;
            if (w->device_answer) {
                uint64_t t = amx_now_us();
                st = amx__dev_answer(reg, j, r, res->epoch, &e2);
                dev_us += amx_now_us() - t;
                ndev++;
            } else if (w->alloc_packed != NULL)
                st = amx__build_packed(reg, j, r, w, &pk, &e2);
            else
                st = amx__build_results(reg, j, r->rank, w->names, w->n_names, 0, 0, &rep.results,
                                        &rep.nresults, NULL, &a, &e2);
            amx__dev_epoch_end(r);
            if (w->alloc_packed != NULL && !w->device_answer)
                rep.packed = &pk;
            if (st == AMX_OK)
                amx__finish_waiter(reg, w, AMX_OK, NULL, &rep);
            else
                amx__finish_waiter(reg, w, st, e2.msg, NULL);
            amx_arena_free(&a);
        }
        j->last_answered_us = amx_now_us();
        if (prev_late) {
            /* The answers read them on the device or in place; the host's
             * copy now. */
            j->prev_front_ga = j->prev_front_gs = NULL;
            save_previous(j, f_prev);
            j->prev_dev = 0;
        }
        j->front_finished = !res->imported && !installed;
        if (amx_log_profiling())
            AMX_INFO("profile",
                     "job %s, epoch %llu answered: %llu us, device answers %llu us (%u rank(s)); "
                     "the loop took the epoch %llu us after the engine ended it, previous "
                     "globals %llu, install and publish %llu",
                     j->name, (unsigned long long)res->epoch,
                     (unsigned long long)(j->last_answered_us - j->last_published_us),
                     (unsigned long long)dev_us, ndev,
                     (unsigned long long)(t_in > res->end_at_us ? t_in - res->end_at_us : 0),
                     (unsigned long long)(t_prev - t_in),
                     (unsigned long long)(j->last_published_us - t_prev));
    } else {
        amx__note_fault(reg, res->st, res->msg);
        amx_err_t e2 = {0};
        if (j->state->ops->unflip(j->state, !res->stale, &e2) != AMX_OK)
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
            /* The rank whose slab failed the check hears which cell. */
            amx_err_t e2 = {0};
            int bad =
                w != NULL && w->device_answer && amx__dev_bad_slab(j, r, res->epoch, &e2) != AMX_OK;
            amx__dev_epoch_end(r);
            /* Contributions for an epoch the cluster had reconciled (or
             * numbered by a daemon that lost the job): that epoch is closed
             * for this rank (FAILED_PRECONDITION, as for an update that
             * came too late), not aborted; when something else failed the
             * attempt first, the rank hears both. */
            amx_status_t code = bad ? AMX_EINVAL : res->stale ? AMX_EPRECOND : res->st;
            const char *msg = bad ? e2.msg : res->msg;
            char both[sizeof(res->msg) + sizeof(res->stale_why) + 16];
            if (!bad && res->stale && strcmp(res->msg, res->stale_why) != 0) {
                snprintf(both, sizeof(both), "%s; and: %s", res->msg, res->stale_why);
                msg = both;
            }
            if (w != NULL)
                amx__finish_waiter(reg, w, code, msg, NULL);
        }
    }
    amx__run_deferred(reg, j);
}
