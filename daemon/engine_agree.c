/*
 * engine_agree.c - the agreement side of an epoch (engine_impl.h): one
 * round at the coordinator (the whole catalog when it asks for it), the
 * donor's state served and fetched by those behind, the agreed catalog
 * installed, and a new communicator made through the rendezvous store.
 * Engine thread.
 */
#include "engine_impl.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <math.h>

#include "clock.h"
#include "comm.h"
#include "jobstate.h"
#include "log.h"

/* ---- agreement ---- */

static int my_index(const amx_membership_t *m, uint32_t me)
{
    for (uint32_t p = 0; p < m->npart; p++)
        if (m->part[p].daemon == me)
            return (int)p;
    return -1;
}

/* The donor publishes its state for those behind. */
static amx_status_t publish_state(amx_engine_t *e, uint64_t seq)
{
    amx_job_t *j = e->job;
    amx_err_t err = {0};
    void *blob;
    size_t len;
    /* Quantizers whose front global is a layout change's placeholder (an
     * epoch that agreed on them failed) are marked: the daemon behind must
     * not take it for the previous epoch's global. */
    uint8_t *g_ok = calloc(e->w_cat->n ? e->w_cat->n : 1, 1);
    if (g_ok == NULL)
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory serving the state of job '%s'",
                                j->name);
    /* The previous globals its answers of that epoch carried (the loop's
     * copy, which changes only between epochs): a daemon behind answers
     * them too. */
    float *pga = malloc((e->w_cat->n ? e->w_cat->n : 1) * sizeof(float));
    float *pgs = malloc((e->w_cat->n ? e->w_cat->n : 1) * sizeof(float));
    for (uint32_t i = 0; i < e->w_cat->n; i++) {
        int64_t k =
            e->w_cat == j->cat ? (int64_t)i : amx_catalog_find(j->cat, e->w_cat->q[i]->name);
        g_ok[i] = k >= 0 && amx_job_published(j, (uint32_t)k);
        int had = k >= 0 && (uint64_t)k < j->prev_n && j->prev_ok[k];
        if (pga != NULL && pgs != NULL) {
            pga[i] = had ? j->prev_ga[k] : NAN;
            pgs[i] = had ? j->prev_gs[k] : NAN;
        }
    }
    int with_prev = pga != NULL && pgs != NULL; /* out of memory: none, as before format 5 */
    amx_status_t st = amx_jobstate_export_prev(j->name, e->last_reconciled, e->w_cat, e->w_desc,
                                               j->state, 0, g_ok, with_prev ? pga : NULL,
                                               with_prev ? pgs : NULL, &blob, &len, &err);
    free(g_ok);
    free(pga);
    free(pgs);
    if (st != AMX_OK)
        return amx__engine_fail(e, st,
                                "job '%s': preparing the state for daemons that are behind: %s",
                                j->name, err.msg);
    pthread_mutex_lock(&e->blob_mu);
    free(e->blob);
    e->blob = blob;
    e->blob_len = len;
    e->blob_seq = seq;
    pthread_mutex_unlock(&e->blob_mu);
    AMX_INFO("epoch", "job %s: serving my state (epoch %llu, %zu bytes) to daemons behind", j->name,
             (unsigned long long)e->last_reconciled, len);
    return AMX_OK;
}

/* Keeps the donor's published globals (its last epoch's) for the loop to
 * use as the previous epoch's once this epoch is published; the state's
 * own front results are this daemon's, from before it fell behind. */
static amx_status_t stash_previous(amx_engine_t *e, const amx_jobstate_t *js)
{
    uint32_t n = js->cat->n;
    amx_qspec_t **copy = calloc(n ? n : 1, sizeof(*copy));
    float *ga = malloc((n ? n : 1) * sizeof(float)), *gs = malloc((n ? n : 1) * sizeof(float));
    float *pga = NULL, *pgs = NULL;
    if (js->pprev_ga != NULL) {
        pga = malloc((n ? n : 1) * sizeof(float));
        pgs = malloc((n ? n : 1) * sizeof(float));
    }
    amx_catalog_t *c = NULL;
    amx_err_t err = {0};
    int ok = copy != NULL && ga != NULL && gs != NULL &&
             (js->pprev_ga == NULL || (pga != NULL && pgs != NULL));
    for (uint32_t i = 0; ok && i < n; i++)
        ok = (copy[i] = amx_qspec_dup(js->cat->q[i])) != NULL;
    if (ok)
        ok = amx_catalog_build(copy, n, &c, &err) == AMX_OK;
    if (!ok) {
        for (uint32_t i = 0; copy != NULL && i < n; i++)
            amx_qspec_free(copy[i]);
        free(copy);
        free(ga);
        free(gs);
        free(pga);
        free(pgs);
        return AMX_ENOMEM;
    }
    free(copy);
    for (uint32_t i = 0; i < n; i++) {
        int64_t k = amx_catalog_find(c, js->cat->q[i]->name);
        ga[k] = js->a.g_amax[i];
        gs[k] = js->a.g_scale[i];
        if (pga != NULL) {
            memcpy(&pga[k], &js->pprev_ga[i], sizeof(float)); /* unaligned-safe */
            memcpy(&pgs[k], &js->pprev_gs[i], sizeof(float));
        }
    }
    amx_catalog_free(e->res.prev_cat);
    free(e->res.prev_ga);
    free(e->res.prev_gs);
    free(e->res.pprev_ga);
    free(e->res.pprev_gs);
    e->res.prev_cat = c;
    e->res.prev_ga = ga;
    e->res.prev_gs = gs;
    e->res.pprev_ga = pga;
    e->res.pprev_gs = pgs;
    return AMX_OK;
}

/* Fetches and imports the donor's state. */
static amx_status_t catch_up(amx_engine_t *e, const amx_sync_result_t *sr)
{
    amx_job_t *j = e->job;
    const char *addr = NULL;
    for (uint32_t p = 0; p < sr->members.npart; p++)
        if (sr->members.part[p].daemon == sr->donor)
            addr = sr->members.part[p].addr;
    if (addr == NULL)
        return amx__engine_fail(e, AMX_EINTERNAL,
                                "job '%s': the donor daemon %u is not a participant", j->name,
                                sr->donor);
    amx_err_t err = {0};
    void *blob = NULL;
    size_t len = 0;
    amx_status_t st = amx_peer_call_fetch(j->eng->env.peer, addr, j->name, sr->seq, e->deadline,
                                          &e->abort_flag, &blob, &len, &err);
    if (st != AMX_OK && atomic_load(&e->abort_flag))
        return amx__engine_fail_aborted(e, "fetching the job's state");
    if (st != AMX_OK)
        return amx__engine_fail(e, st,
                                "job '%s': fetching the job's state from daemon %u (%s) failed: %s",
                                j->name, sr->donor, addr, err.msg);
    amx_jobstate_t js;
    st = amx_jobstate_parse(blob, len, &js, &err);
    if (st == AMX_OK && strcmp(js.job, j->name) != 0)
        st = amx_err_set(&err, AMX_EINVAL, "it is the state of job '%s'", js.job);
    /* The donor's globals are the previous epoch's (NaN: it had none);
     * the state takes the placeholders a layout change gives. */
    if (st == AMX_OK && stash_previous(e, &js) != AMX_OK)
        st = amx_err_set(&err, AMX_ENOMEM, "out of memory");
    for (uint32_t i = 0; st == AMX_OK && i < js.cat->n; i++)
        if (isnan(js.a.g_amax[i])) {
            js.a.g_amax[i] = 0.0f;
            js.a.g_scale[i] = js.a.g_inv[i] = 1.0f;
        }
    if (st == AMX_OK)
        st = j->state->ops->import_state(j->state, js.cat->ncells, js.cat->nhist, js.cat->n,
                                         js.cat->nslices, &js.a, &err);
    if (st != AMX_OK) {
        amx_jobstate_free(&js);
        free(blob);
        return amx__engine_fail(e, st, "job '%s': the state from daemon %u could not be used: %s",
                                j->name, sr->donor, err.msg);
    }
    amx_qdesc_t *d = malloc((js.cat->n ? js.cat->n : 1) * sizeof(amx_qdesc_t));
    if (d == NULL) {
        free(d);
        amx_jobstate_free(&js);
        free(blob);
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory importing the state of job '%s'",
                                j->name);
    }
    amx_catalog_layout(js.cat, d);
    for (uint32_t i = 0; i < js.cat->n; i++)
        d[i].hist_head = js.hist_head[i];
    amx_catalog_free(e->imp_cat);
    free(e->imp_desc);
    e->imp_cat = js.cat;
    e->imp_desc = d;
    js.cat = NULL;
    AMX_INFO("epoch", "job %s: caught up with daemon %u: epoch %llu -> %llu (%zu bytes)", j->name,
             sr->donor, (unsigned long long)e->last_reconciled,
             (unsigned long long)js.last_reconciled, len);
    e->last_reconciled = js.last_reconciled;
    e->epoch = js.last_reconciled + 1;
    e->res.imported = 1;
    e->res.last_reconciled = js.last_reconciled;
    e->res.publish = 1;
    amx_jobstate_free(&js);
    free(blob);
    /* With the agreed catalog in this answer, the next step moves the
     * imported state and the in-flight buffer (in the loop's layout: this
     * daemon's proposals keep their provisional cells) to it together.
     * Without one, the donor's catalog becomes the working one at once, so
     * that the replicated state and the job's layout never disagree. */
    if (sr->catalog_included)
        return AMX_OK;
    amx_qspec_t **copy = calloc(e->imp_cat->n ? e->imp_cat->n : 1, sizeof(*copy));
    amx_catalog_t *target = NULL;
    int ok = copy != NULL;
    for (uint32_t i = 0; ok && i < e->imp_cat->n; i++)
        ok = (copy[i] = amx_qspec_dup(e->imp_cat->q[i])) != NULL;
    if (ok)
        ok = amx_catalog_build(copy, e->imp_cat->n, &target, &err) == AMX_OK;
    if (!ok || amx__engine_change_layout(e, target) != AMX_OK) {
        /* The state was replaced but cannot follow: nothing sane remains. */
        AMX_ERROR("epoch",
                  "job %s: out of memory adopting the imported state's layout; "
                  "aborting",
                  j->name);
        abort();
    }
    free(copy);
    return AMX_OK;
}

/* For the communicator's create: whether the epoch was aborted. */
static int engine_aborted(void *ud)
{
    amx_engine_t *e = ud;
    return atomic_load(&e->abort_flag) != 0;
}

/* The communicator's watch (comm.h): whether a participant died or
 * restarted while a collective of this job waits for it. */
static int engine_watch(void *ud, char *why, size_t len)
{
    amx_engine_t *e = ud;
    int gone = amx_peer_call_alive(e->env.peer, &e->watch, AMX_COMM_WATCH_MS / 2, why, len);
    if (gone)
        e->watch_gone = 1; /* the failure is told to every participant (engine.c) */
    return gone;
}

/* Tests only: AMAXD_TEST_RENDEZVOUS_PAUSE="R:MS" makes the daemon of
 * cluster rank R wait MS ms before its rendezvous (a window for a test to
 * kill it there), with a log line. */
static void test_rendezvous_pause(amx_engine_t *e)
{
    const char *v = getenv("AMAXD_TEST_RENDEZVOUS_PAUSE");
    unsigned rank, ms;
    if (v == NULL || sscanf(v, "%u:%u", &rank, &ms) != 2 || rank != amx_peer_id(e->env.peer)->rank)
        return;
    AMX_WARN("engine", "job %s: AMAXD_TEST_RENDEZVOUS_PAUSE: waiting %u ms before the rendezvous",
             e->job->name, ms);
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static amx_status_t make_comm(amx_engine_t *e, const amx_sync_result_t *sr)
{
    amx_job_t *j = e->job;
    amx__engine_drop_comm(e);
    const amx_cluster_id_t *id = amx_peer_id(e->env.peer);
    int me = my_index(&sr->members, id->rank);
    if (me < 0)
        return amx__engine_fail(e, AMX_EINTERNAL,
                                "job '%s': this daemon is not among the participants", j->name);
    amx_peer_watch_init(&e->watch, &sr->members, me);
    char prefix[256];
    snprintf(prefix, sizeof(prefix), "comm/%s/%016" PRIx64 "/%" PRIu64 "/", j->name, sr->coord_inc,
             sr->comm_gen);
    amx_kv_t kv;
    amx_peer_kv(e->env.peer, &e->abort_flag, e->watch.n > 0 ? engine_watch : NULL, e, &kv);
    test_rendezvous_pause(e);
    amx_comm_params_t p = {
        .rank = me,
        .size = (int)sr->members.npart,
        .kv = &kv,
        .prefix = prefix,
        .host = e->env.gloo_host,
        .cuda_device = e->env.cuda_device,
        .deadline_ms = e->deadline,
        .aborted = engine_aborted,
        .abort_ud = e,
        .watch = e->watch.n > 0 ? engine_watch : NULL,
        .watch_ud = e,
    };
    amx_err_t err = {0};
    amx_comm_t *c = NULL;
    uint64_t t0 = amx_now_ms();
    amx_status_t st = amx_comm_create(e->env.collective, &p, &c, &err);
    if (st != AMX_OK && atomic_load(&e->abort_flag))
        return amx__engine_fail_aborted(e, "making the communicator");
    if (st != AMX_OK)
        return amx__engine_fail(
            e, st,
            "job '%s': creating the %s communicator (generation %llu, %u daemons) "
            "failed: %s",
            j->name, e->env.collective, (unsigned long long)sr->comm_gen, sr->members.npart,
            err.msg);
    pthread_mutex_lock(&e->mu);
    e->comm = c;
    atomic_store(&e->comm_gen, sr->comm_gen);
    int aborted = atomic_load(&e->abort_flag);
    pthread_mutex_unlock(&e->mu);
    if (aborted) {
        amx__engine_drop_comm(e);
        return amx__engine_fail_aborted(e, "making the communicator");
    }
    AMX_INFO("epoch", "job %s: %s communicator generation %llu ready (%d of %u) in %llu ms",
             j->name, e->env.collective, (unsigned long long)sr->comm_gen, me, sr->members.npart,
             (unsigned long long)(amx_now_ms() - t0));
    return AMX_OK;
}

static amx_status_t sync_round(amx_engine_t *e, int full, int specs, int want,
                               amx_sync_result_t *out);
static amx_status_t after_sync(amx_engine_t *e, amx_sync_result_t *sr);

/* One agreement round at the coordinator, and what follows from it. */
/* Offers of at most this many specs travel with the first Sync; larger
 * ones go by hash and are sent only when the coordinator asks. */
#define INLINE_OFFER 32

/* A delta answer (the specs agreed since this daemon's catalog) made whole:
 * 0, or -1 when it does not give the coordinator's hash (ask again for the
 * whole catalog). */
static int apply_delta(amx_engine_t *e, amx_sync_result_t *sr)
{
    uint32_t n0 = e->w_cat->n, n = n0 + sr->ncatalog;
    amx_qspec_t **all = calloc(n ? n : 1, sizeof(*all));
    if (all == NULL)
        return -1;
    int ok = 1;
    for (uint32_t i = 0; ok && i < n0; i++)
        ok = (all[i] = amx_qspec_dup(e->w_cat->q[i])) != NULL;
    if (ok)
        memcpy(all + n0, sr->catalog, sr->ncatalog * sizeof(*all));
    if (ok) {
        qsort(all, n, sizeof(*all), amx_qspec_name_cmp);
        ok = amx_catalog_hash(all, n) == sr->catalog_hash;
    }
    if (!ok) {
        for (uint32_t i = 0; i < n0; i++)
            amx_qspec_free(all[i]);
        free(all);
        return -1;
    }
    free(sr->catalog);
    sr->catalog = all;
    sr->ncatalog = n;
    sr->catalog_delta = 0;
    return 0;
}

/* The agreed catalog is this daemon's own plus every proposal it made
 * (catalog_yours): made here, as if the coordinator had sent it. 0, or -1
 * when it does not give the agreed hash. */
static int make_yours(amx_engine_t *e, amx_sync_result_t *sr)
{
    amx_job_t *j = e->job;
    uint32_t n = e->w_cat->n + j->nprop, k = 0;
    amx_qspec_t **all = calloc(n ? n : 1, sizeof(*all));
    int ok = all != NULL;
    for (uint32_t i = 0; ok && i < e->w_cat->n; i++)
        ok = (all[k++] = amx_qspec_dup(e->w_cat->q[i])) != NULL;
    for (uint32_t lid = 0; ok && lid < j->nlq; lid++)
        if (j->lq[lid].status == LQ_PROPOSED)
            ok = (all[k++] = amx_qspec_dup(j->lq[lid].spec)) != NULL;
    if (ok) {
        qsort(all, k, sizeof(*all), amx_qspec_name_cmp);
        ok = amx_catalog_hash(all, k) == sr->catalog_hash;
    }
    if (!ok) {
        for (uint32_t i = 0; all != NULL && i < k; i++)
            amx_qspec_free(all[i]);
        free(all);
        return -1;
    }
    free(sr->catalog);
    sr->catalog = all;
    sr->ncatalog = k;
    sr->catalog_included = 1;
    sr->catalog_yours = 0;
    return 0;
}

amx_status_t amx__engine_agree(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    /* A job restored from a snapshot brings its catalog to its first
     * agreement, as does a daemon that knows the coordinator restarted;
     * otherwise the coordinator asks for it (send_catalog) when this
     * daemon's agreed catalog is not its master. An offer goes by hash
     * unless it is small or the coordinator asks for it (send_offer). */
    int full = (e->coord_inc != 0 && e->coord_inc != j->mship.coord_inc) ||
               (e->coord_inc == 0 && j->restored && e->w_cat->n > 0);
    int specs = 0, want = 0;
    amx_sync_result_t sr;
    for (int round = 0;; round++) {
        if (round == 6)
            return amx__engine_fail(e, AMX_EINTERNAL,
                                    "job '%s': the agreement round did not settle after %d "
                                    "requests",
                                    j->name, round);
        amx_status_t st = sync_round(e, full, specs, want, &sr);
        if (st != AMX_OK)
            return st;
        if (sr.send_catalog && !full) {
            AMX_INFO("epoch",
                     "job %s: the coordinator does not hold this daemon's catalog (%u "
                     "quantizers, %016" PRIx64 "): sending it whole",
                     j->name, e->w_cat->n, e->w_cat->hash);
            full = 1;
            amx_sync_result_free(&sr);
            continue;
        }
        if (sr.send_offer && !specs) {
            specs = 1;
            amx_sync_result_free(&sr);
            continue;
        }
        if (sr.send_catalog || sr.send_offer) {
            amx_sync_result_free(&sr);
            return amx__engine_fail(e, AMX_EINTERNAL,
                                    "job '%s': the coordinator asked again for what was sent",
                                    j->name);
        }
        if (sr.catalog_yours && make_yours(e, &sr) != 0) {
            AMX_WARN("epoch",
                     "job %s: this daemon's catalog and proposals do not give the agreed "
                     "catalog %016" PRIx64 "; asking for it whole",
                     j->name, sr.catalog_hash);
            want = 1;
            amx_sync_result_free(&sr);
            continue;
        }
        if (sr.catalog_delta && apply_delta(e, &sr) != 0) {
            AMX_WARN("epoch",
                     "job %s: the coordinator's delta does not give its catalog %016" PRIx64
                     "; asking for it whole",
                     j->name, sr.catalog_hash);
            want = 1;
            amx_sync_result_free(&sr);
            continue;
        }
        break;
    }
    if (sr.members_omitted) {
        /* The membership this daemon holds is the coordinator's. */
        amx_membership_free(&sr.members);
        if (amx_membership_copy(&j->mship, &sr.members) != AMX_OK) {
            amx_sync_result_free(&sr);
            return amx__engine_fail(e, AMX_ENOMEM, "out of memory in the agreement of job '%s'",
                                    j->name);
        }
    } else if (amx_membership_hash(&sr.members) != amx_membership_hash(&j->mship)) {
        /* A new membership (a daemon restarted): the loop installs it. */
        amx_membership_free(&e->res.members);
        if (amx_membership_copy(&sr.members, &e->res.members) == AMX_OK)
            e->res.members_changed = 1;
    }
    return after_sync(e, &sr);
}

/* One Sync call: this daemon's offer (its proposals, with `full` its whole
 * agreed catalog too) by hash, with its specs when `specs` or small, and
 * its resets; `want` asks for the whole catalog rather than a delta. */
static amx_status_t sync_round(amx_engine_t *e, int full, int specs, int want,
                               amx_sync_result_t *out)
{
    amx_job_t *j = e->job;
    const amx_cluster_id_t *id = amx_peer_id(e->env.peer);
    uint32_t cap = j->nprop + (full ? e->w_cat->n : 0);
    amx_qspec_t **prop = calloc(cap ? cap : 1, sizeof(*prop));
    char **resets = calloc(j->nlq ? j->nlq : 1, sizeof(char *));
    if (prop == NULL || resets == NULL) {
        free(prop);
        free(resets);
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory preparing the agreement of job '%s'",
                                j->name);
    }
    uint32_t np = 0;
    size_t nr = 0;
    if (full)
        for (uint32_t i = 0; i < e->w_cat->n; i++)
            prop[np++] = e->w_cat->q[i];
    for (uint32_t lid = 0; lid < j->nlq; lid++) {
        const amx_lq_t *q = &j->lq[lid];
        if (q->status == LQ_PROPOSED)
            prop[np++] = q->spec;
        if (q->reset && (q->status == LQ_AGREED || q->status == LQ_PROPOSED))
            resets[nr++] = q->spec->name;
    }
    /* The offer's hash is the catalog hash of its specs in name order (the
     * agreed catalog is sorted already; proposals are not). */
    qsort(prop, np, sizeof(*prop), amx_qspec_name_cmp);
    uint64_t offer_hash = np > 0 ? amx_catalog_hash(prop, np) : 0;
    /* ... and of the agreed catalog with the proposals: when the agreement
     * adopts exactly that, the answer carries no catalog. */
    uint64_t union_hash = offer_hash;
    if (!full) {
        amx_qspec_t **u = malloc((e->w_cat->n + np + 1) * sizeof(*u));
        if (u == NULL) {
            free(prop);
            free(resets);
            return amx__engine_fail(e, AMX_ENOMEM,
                                    "out of memory preparing the agreement of job '%s'", j->name);
        }
        uint32_t a = 0, b = 0, k = 0;
        while (a < e->w_cat->n || b < np)
            u[k++] = b == np || (a < e->w_cat->n && strcmp(e->w_cat->q[a]->name, prop[b]->name) < 0)
                         ? e->w_cat->q[a++]
                         : prop[b++];
        union_hash = amx_catalog_hash(u, k);
        free(u);
    }
    const amx_part_t *mine = j->me >= 0 ? &j->mship.part[j->me] : NULL;
    amx_coord_sync_req_t req = {
        .job = j->name,
        .daemon = id->rank,
        .incarnation = id->incarnation,
        .last_reconciled = e->last_reconciled,
        .catalog_hash = e->w_cat->hash,
        .proposals = prop,
        .nprop = np,
        .full_catalog = full,
        .offer_hash = offer_hash,
        .offer_count = np,
        .offer_included = np > 0 && (specs || np <= INLINE_OFFER),
        .membership_hash = amx_membership_hash(&j->mship),
        .want_catalog = want,
        .union_hash = union_hash,
        .resets = resets,
        .nresets = nr,
        .need_comm = e->comm == NULL,
        .world = j->world,
        .ranks = mine ? mine->ranks : NULL,
        .nranks = mine ? mine->nranks : 0,
        .addr = id->advertise,
        .deadline_ms = e->deadline,
    };
    amx_err_t err = {0};
    uint64_t t0 = amx_now_ms();
    amx_status_t st = amx_peer_call_sync(e->env.peer, &req, &e->abort_flag, out, &err);
    free(prop);
    free(resets);
    if (st != AMX_OK && atomic_load(&e->abort_flag))
        return amx__engine_fail_aborted(e, "the agreement round");
    if (st != AMX_OK) {
        uint32_t crank;
        char caddr[256];
        amx_peer_coordinator(e->env.peer, &crank, caddr, sizeof(caddr));
        return amx__engine_fail(
            e, st,
            "job '%s', epoch %llu: the agreement round at the coordinator (daemon %u, %s) "
            "failed: %s",
            j->name, (unsigned long long)e->epoch, crank, caddr, err.msg);
    }
    if (!out->send_catalog && !out->send_offer)
        AMX_DEBUG("epoch",
                  "job %s: agreement %llu in %llu ms: catalog %016" PRIx64 "%s, target "
                  "epoch %llu, %zu behind, comm generation %llu%s",
                  j->name, (unsigned long long)out->seq, (unsigned long long)(amx_now_ms() - t0),
                  out->catalog_hash, out->catalog_included ? " (sent)" : "",
                  (unsigned long long)out->target_epoch, out->nbehind,
                  (unsigned long long)out->comm_gen, out->new_comm ? " (new)" : "");
    return AMX_OK;
}

/* What follows from the coordinator's answer `sr` (freed here). */
/* The agreed catalog holds quantizers that other daemons' ranks
 * registered: this daemon checks it against its own limits, as Register
 * did for its own ranks. A daemon configured below its peers fails the
 * epoch here, and its peers hear why (engine.c passes it on). */
static int over_limits(amx_engine_t *e, const amx_catalog_t *c)
{
    const amx_config_t *cfg = e->env.cfg;
    uint64_t cells = c->ncells + c->nhist;
    if ((int64_t)c->n <= cfg->max_quantizers && (int64_t)cells <= cfg->max_cells)
        return 0;
    amx__engine_fail(e, AMX_ENOMEM,
                     "job '%s': the agreed catalog has %u quantizers and %llu cells, more than "
                     "daemon %u's max_quantizers=%lld or max_cells=%lld allow; give every daemon "
                     "of the cluster the same limits",
                     e->job->name, c->n, (unsigned long long)cells, amx_peer_id(e->env.peer)->rank,
                     (long long)cfg->max_quantizers, (long long)cfg->max_cells);
    return 1;
}

static amx_status_t after_sync(amx_engine_t *e, amx_sync_result_t *srp)
{
    amx_job_t *j = e->job;
    const amx_cluster_id_t *id = amx_peer_id(e->env.peer);
    amx_sync_result_t sr = *srp;
    amx_err_t err = {0};
    e->synced = 1;
    e->coord_inc = sr.coord_inc;
    pthread_mutex_lock(&e->mu);
    e->agreed_seq = sr.seq;
    e->agreed_inc = sr.coord_inc;
    pthread_mutex_unlock(&e->mu);
    int behind = 0;
    for (size_t i = 0; i < sr.nbehind; i++)
        behind |= sr.behind[i] == id->rank;
    /* A daemon behind: its ranks sent for the epoch after its own last,
     * which is not the cluster's open epoch. After epochs of its own (a
     * restored snapshot, an epoch its peers completed) that epoch is one
     * the cluster already reconciled (their answers were lost with a crash
     * or a failure at the last moment); without any (it restarted without
     * the job: no state_dir, its disk lost) its numbers start over at 1.
     * Carried into the epoch after the donor's, those values would be
     * another epoch's data in every rank's answer, or an answer labelled
     * with an epoch they never asked for: they are dropped below and the
     * attempt fails, so that its ranks send again for the open epoch. */
    uint64_t own_last = e->last_reconciled, stale_epoch = e->epoch;
    /* 1. The donor serves its state before it changes anything. */
    if (sr.nbehind > 0 && sr.donor == id->rank && publish_state(e, sr.seq) != AMX_OK)
        goto out;
    /* 2. Those behind catch up. From here on its ranks' contributions are
     * dropped whatever else fails (res.stale, below). */
    if (behind && catch_up(e, &sr) != AMX_OK)
        goto out;
    if (behind) {
        e->res.stale = 1;
        if (own_last == 0)
            snprintf(e->res.stale_why, sizeof(e->res.stale_why),
                     "job '%s': daemon %u had reconciled no epoch of the job (it restarted "
                     "without its snapshot, or failed the job's first epoch, which its peers "
                     "completed) and caught up with daemon %u at epoch %llu; its ranks' "
                     "contributions were for its own epoch %llu, not the cluster's open epoch "
                     "%llu, so they were dropped and this attempt at epoch %llu is aborted on "
                     "every daemon: the ranks of daemon %u send for epoch %llu (epoch %llu's "
                     "results: GetScales), the others call Reconcile again",
                     j->name, id->rank, sr.donor, (unsigned long long)e->last_reconciled,
                     (unsigned long long)stale_epoch, (unsigned long long)e->epoch,
                     (unsigned long long)e->epoch, id->rank, (unsigned long long)e->epoch,
                     (unsigned long long)e->last_reconciled);
        else
            snprintf(e->res.stale_why, sizeof(e->res.stale_why),
                     "job '%s': daemon %u was behind (its last epoch %llu) and caught up with "
                     "daemon %u at epoch %llu; its ranks' contributions were for epoch %llu, "
                     "which the cluster had already reconciled, so they were dropped and this "
                     "attempt at epoch %llu is aborted on every daemon: the ranks of daemon %u "
                     "read epoch %llu's results with GetScales and send for epoch %llu, the "
                     "others call Reconcile again",
                     j->name, id->rank, (unsigned long long)own_last, sr.donor,
                     (unsigned long long)e->last_reconciled, (unsigned long long)stale_epoch,
                     (unsigned long long)e->epoch, id->rank, (unsigned long long)e->last_reconciled,
                     (unsigned long long)e->epoch);
        /* The peers attempt e->epoch: an abort of it (another daemon
         * behind failing the same attempt) is about this attempt now, and
         * one kept for it as not started here yet is too. */
        pthread_mutex_lock(&e->mu);
        e->relabeled = e->epoch;
        if (e->pend_epoch == e->epoch)
            e->pend_epoch = 0;
        pthread_mutex_unlock(&e->mu);
    }
    /* 3. The catalog. */
    amx_catalog_t *target = NULL;
    if (sr.catalog_included) {
        if (amx_catalog_build(sr.catalog, sr.ncatalog, &target, &err) != AMX_OK) {
            amx__engine_fail(e, AMX_ENOMEM, "out of memory building the agreed catalog of job '%s'",
                             j->name);
            goto out;
        }
        sr.ncatalog = 0; /* the catalog owns the specs */
    }
    if (target == NULL && e->w_cat->hash != sr.catalog_hash) {
        amx__engine_fail(e, AMX_EINTERNAL,
                         "job '%s': the coordinator's catalog %016" PRIx64 " was not sent "
                         "although this daemon holds %016" PRIx64,
                         j->name, sr.catalog_hash, e->w_cat->hash);
        goto out;
    }
    if (target == NULL && e->pend_original && j->nprop > 0) {
        /* Every proposal was rejected: the catalog stays, the provisional
         * cells go. */
        amx_qspec_t **copy = calloc(e->w_cat->n ? e->w_cat->n : 1, sizeof(*copy));
        int ok = copy != NULL;
        for (uint32_t i = 0; ok && i < e->w_cat->n; i++)
            ok = (copy[i] = amx_qspec_dup(e->w_cat->q[i])) != NULL;
        if (!ok || amx_catalog_build(copy, e->w_cat->n, &target, &err) != AMX_OK) {
            for (uint32_t i = 0; copy && i < e->w_cat->n; i++)
                amx_qspec_free(copy[i]);
            free(copy);
            amx__engine_fail(e, AMX_ENOMEM, "out of memory copying the catalog of job '%s'",
                             j->name);
            goto out;
        }
        free(copy);
    }
    if (target != NULL && over_limits(e, target)) {
        amx_catalog_free(target);
        goto out;
    }
    if (target != NULL && amx__engine_change_layout(e, target) != AMX_OK) {
        amx_catalog_free(target);
        goto out;
    }
    /* 4. Rejected proposals. */
    if (sr.nrejected > 0) {
        char **r = realloc(e->res.rejected, (e->res.nrejected + sr.nrejected) * sizeof(char *));
        if (r != NULL) {
            e->res.rejected = r;
            for (size_t i = 0; i < sr.nrejected; i++)
                if ((r[e->res.nrejected] = strdup(sr.rejected[i])) != NULL)
                    e->res.nrejected++;
        }
    }
    /* 5. Resets of every daemon, applied by finish. */
    amx__engine_mark_resets(e, sr.resets, sr.nresets);
    if (sr.conflict != NULL) {
        amx__engine_fail(e, AMX_EPRECOND, "%s", sr.conflict);
        goto out;
    }
    /* 6. Contributions for an epoch the cluster had reconciled, or for
     * an epoch numbered by a daemon that lost the job (stale_why). */
    if (behind) {
        e->stale_here = 1;
        amx__engine_fail(e, AMX_EABORTED, "%s", e->res.stale_why);
        goto out;
    }
    /* 7. The communicator. */
    if (sr.new_comm || e->comm == NULL || atomic_load(&e->comm_gen) != sr.comm_gen)
        if (make_comm(e, &sr) != AMX_OK)
            goto out;
    e->need_sync = 0;
out:
    amx_sync_result_free(&sr);
    return e->res.st;
}