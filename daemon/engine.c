/*
 * engine.c - the epoch engine of one job (engine.h, docs/CLUSTER.md).
 *
 * One thread per job runs each epoch as straight-line blocking code:
 *
 *   [agreement]  when this daemon has no communicator or must agree anyway
 *   collective   [header | agreed cells], out of place
 *   [agreement + collective again]  when some daemon raised the flag
 *   finish       resets, accumulation, fill, scales into the back results
 *
 * A job of one participant has no collective: its proposals are adopted
 * locally and finish reads the in-flight buffer itself.
 *
 * Ownership while in flight: this thread alone writes the job's desc, the
 * state backend's in-flight and replicated buffers and the fields below; it
 * reads (never writes) the job's catalog, quantizer table and membership,
 * which the loop thread leaves alone while the job is in flight.
 */
#include "engine.h"
#include "job_snap.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "comm.h"
#include "jobstate.h"
#include "log.h"
#include "peer.h"
#include "snapshot.h"

/* Header cells (AMX_HDR_CELLS = 32): each field as 16-bit pieces and their
 * complements, so that after an element-wise MAX max(piece) == 65535 -
 * max(complement) holds exactly when every daemon sent the same value. */
enum {
    H_EPOCH = 0,  /* 4 pieces + 4 complements */
    H_HASH = 8,   /* 4 + 4 */
    H_GEN = 16,   /* 4 + 4 */
    H_CELLS = 24, /* 3 + 3 */
    H_FLAG = 30,  /* max: some daemon needs an agreement round */
    H_VERSION = 31,
};
#define HDR_VERSION 1.0f

struct amx_engine {
    amx_job_t *job;
    amx_engine_env_t env;
    pthread_t th;
    int started;
    pthread_mutex_t mu; /* work hand-off, comm pointer, abort */
    pthread_cond_t cv;
    int have_work, quit;
    uint64_t epoch, deadline;
    atomic_int abort_flag;
    amx_status_t abort_code; /* with abort_flag: the status to fail with (under mu) */
    uint32_t abort_from;     /* the daemon that aborted it (AMX_ENGINE_LOCAL: this one) */
    int passed_on;           /* this attempt failed with another daemon's status and sentence */
    int aborted_here;        /* ... or because this daemon aborted it (peer_why says why) */
    char peer_why[768];
    char abort_why[768];
    amx_comm_t *comm;
    _Atomic uint64_t comm_gen;
    uint64_t last_gen;  /* the generation of the last communicator held (engine thread) */
    int need_sync;      /* agree before the next collective */
    uint64_t coord_inc; /* the coordinator incarnation of our last agreement */
    amx_epoch_result_t res;
    /* A donor's state, published for FetchState. */
    pthread_mutex_t blob_mu;
    void *blob;
    size_t blob_len;
    uint64_t blob_seq;
    /* Working layout of this attempt. */
    amx_catalog_t *w_cat; /* the agreed catalog as this attempt knows it */
    amx_qdesc_t *w_desc;
    int w_owned;            /* w_cat/w_desc were made here (res.cat/res.desc) */
    int pend_original;      /* the in-flight buffer still has the loop's layout */
    amx_catalog_t *imp_cat; /* an imported catalog (the state's layout), owned */
    amx_qdesc_t *imp_desc;
    uint64_t last_reconciled; /* of the state, as this attempt knows it */
    int synced;               /* an agreement round happened in this attempt */
    /* Descriptor generations: bumped by every layout change; the backend
     * may keep a copy of the descriptors the last finish saw. */
    uint64_t desc_gen, fin_gen;
    int fin_had_reset;
    int marked;       /* some w_desc[].reset may be set: clean epochs skip the O(n) scans */
    int fin_ok;       /* the last finish succeeded (its descriptors may be reused) */
    uint64_t snap_ms; /* when this engine last wrote the job's snapshot (0: never) */
};

/* ---- results ---- */

static void res_clear(amx_epoch_result_t *r)
{
    amx_catalog_free(r->cat);
    amx_catalog_free(r->prev_cat);
    free(r->prev_ga);
    free(r->prev_gs);
    free(r->desc);
    free(r->pend_runs);
    for (size_t i = 0; i < r->nrejected; i++)
        free(r->rejected[i]);
    free(r->rejected);
    memset(r, 0, sizeof(*r));
}

static amx_status_t fail(amx_engine_t *e, amx_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static amx_status_t fail(amx_engine_t *e, amx_status_t st, const char *fmt, ...)
{
    if (e->res.st == AMX_OK) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->res.msg, sizeof(e->res.msg), fmt, ap);
        va_end(ap);
        e->res.st = st;
    }
    return st;
}

/* The epoch was aborted (amx_engine_abort) while `during` ran: it fails
 * with the status another daemon's epoch failed with, passing on its
 * sentence (which names the daemon or rank that did not come), or with
 * ABORTED. */
static amx_status_t fail_aborted(amx_engine_t *e, const char *during)
{
    char why[sizeof(e->abort_why)];
    pthread_mutex_lock(&e->mu);
    amx_status_t code = e->abort_code;
    uint32_t from = e->abort_from;
    snprintf(why, sizeof(why), "%s", e->abort_why);
    pthread_mutex_unlock(&e->mu);
    const char *job = e->job->name;
    unsigned long long ep = (unsigned long long)e->epoch;
    if (from == AMX_ENGINE_LOCAL) {
        if (e->res.st == AMX_OK) {
            e->aborted_here = 1; /* the others hear `why` itself */
            snprintf(e->peer_why, sizeof(e->peer_why), "%s", why);
        }
        return fail(e, AMX_EABORTED, "job '%s', epoch %llu: %s was aborted: %s", job, ep, during,
                    why);
    }
    if (code == AMX_OK || code == AMX_EABORTED)
        return fail(e, AMX_EABORTED, "job '%s', epoch %llu: %s was aborted by daemon %u: %s", job,
                    ep, during, from, why);
    if (e->res.st == AMX_OK)
        e->passed_on = 1; /* explained already by the daemon that failed */
    return fail(e, code, "job '%s', epoch %llu failed on daemon %u: %s", job, ep, from, why);
}

/* ---- header ---- */

static void put_pieces(float *h, int at, uint64_t v, int n)
{
    for (int k = 0; k < n; k++) {
        unsigned p = (unsigned)((v >> (16 * k)) & 0xffff);
        h[at + k] = (float)p;
        h[at + n + k] = (float)(65535u - p);
    }
}

/* The field's value when all daemons agree; -1 when they did not. */
static int64_t get_pieces(const float *h, int at, int n, uint64_t *v)
{
    uint64_t x = 0;
    for (int k = 0; k < n; k++) {
        float hi = h[at + k], lo = 65535.0f - h[at + n + k];
        if (hi != lo)
            return -1;
        x |= (uint64_t)hi << (16 * k);
    }
    *v = x;
    return 0;
}

static void make_header(float *h, uint64_t epoch, uint64_t hash, uint64_t gen, uint64_t cells,
                        int flag)
{
    memset(h, 0, AMX_HDR_CELLS * sizeof(float));
    put_pieces(h, H_EPOCH, epoch, 4);
    put_pieces(h, H_HASH, hash, 4);
    put_pieces(h, H_GEN, gen, 4);
    put_pieces(h, H_CELLS, cells, 3);
    h[H_FLAG] = flag ? 1.0f : 0.0f;
    h[H_VERSION] = HDR_VERSION;
}

/* ---- communicator ---- */

static void drop_comm(amx_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    amx_comm_t *c = e->comm;
    e->comm = NULL;
    uint64_t gen = atomic_exchange(&e->comm_gen, 0);
    if (gen != 0)
        e->last_gen = gen;
    pthread_mutex_unlock(&e->mu);
    if (c != NULL) {
        c->ops->abort(c);
        c->ops->destroy(c);
    }
}

/* ---- layout changes ---- */

/* Runs for moving a state laid out as `from` (desc `fdesc`) to `to`
 * (`sl`: per-slice runs; NULL when the caller needs none). */
static amx_status_t state_runs(const amx_catalog_t *from, const amx_qdesc_t *fdesc,
                               const amx_catalog_t *to, amx_qdesc_t *tdesc, amx_run_t **cells,
                               size_t *nc, amx_run_t **hist, size_t *nh, amx_run_t **qs, size_t *nq,
                               amx_run_t **sl, size_t *ns)
{
    *cells = malloc((to->n ? to->n : 1) * sizeof(amx_run_t));
    *hist = malloc((to->n ? to->n : 1) * sizeof(amx_run_t));
    *qs = malloc((to->n ? to->n : 1) * sizeof(amx_run_t));
    if (sl != NULL)
        *sl = malloc((to->n ? to->n : 1) * sizeof(amx_run_t));
    if (*cells == NULL || *hist == NULL || *qs == NULL || (sl != NULL && *sl == NULL))
        return AMX_ENOMEM;
    *nc = *nh = *nq = 0;
    if (ns != NULL)
        *ns = 0;
    for (uint32_t i = 0; i < to->n; i++) {
        int64_t k = from ? amx_catalog_find(from, to->q[i]->name) : -1;
        if (k < 0)
            continue;
        const amx_qdesc_t *f = &fdesc[k];
        amx_qdesc_t *t = &tdesc[i];
        (*cells)[(*nc)++] = (amx_run_t){t->base, f->base, t->ncells};
        if (t->accumulation == AMX_ACC_PER_EPOCH)
            (*hist)[(*nh)++] =
                (amx_run_t){t->hist_base, f->hist_base, (uint64_t)t->hist_len * t->ncells};
        (*qs)[(*nq)++] = (amx_run_t){i, (uint64_t)k, 1};
        if (sl != NULL && t->nslices > 0)
            (*sl)[(*ns)++] = (amx_run_t){t->gbase, f->gbase, t->nslices};
        t->hist_head = f->hist_head;
    }
    return AMX_OK;
}

/* Runs for moving the loop's pending layout (agreed bases and provisional
 * bases of the quantizer table, frozen while in flight) to `to`. */
static amx_status_t pend_runs_original(const amx_job_t *j, const amx_catalog_t *to,
                                       const amx_qdesc_t *tdesc, amx_run_t **runs, size_t *n)
{
    *runs = malloc((to->n ? to->n : 1) * sizeof(amx_run_t));
    if (*runs == NULL)
        return AMX_ENOMEM;
    *n = 0;
    for (uint32_t i = 0; i < to->n; i++) {
        uint32_t lid;
        if (!amx_strmap_get(&j->lqmap, to->q[i]->name, &lid))
            continue;
        const amx_lq_t *q = &j->lq[lid];
        if (q->status != LQ_AGREED && q->status != LQ_PROPOSED)
            continue;
        (*runs)[(*n)++] = (amx_run_t){tdesc[i].base, q->base, tdesc[i].ncells};
    }
    return AMX_OK;
}

/*
 * Moves everything to catalog `to` (owned by the caller until success,
 * then by the engine as the working catalog): the in-flight buffer, the
 * replicated state (laid out as the import's catalog, or the working one)
 * and the results.
 */
static amx_status_t change_layout(amx_engine_t *e, amx_catalog_t *to)
{
    amx_job_t *j = e->job;
    amx_err_t err = {0};
    amx_qdesc_t *tdesc = malloc((to->n ? to->n : 1) * sizeof(amx_qdesc_t));
    amx_run_t *cells = NULL, *hist = NULL, *qs = NULL, *sl = NULL, *pend = NULL, *pend_loop = NULL;
    size_t nc = 0, nh = 0, nq = 0, ns = 0, np = 0, npl = 0;
    amx_status_t st = AMX_ENOMEM;
    if (tdesc == NULL)
        goto out;
    amx_catalog_layout(to, tdesc);
    const amx_catalog_t *scat = e->imp_cat ? e->imp_cat : e->w_cat;
    const amx_qdesc_t *sdesc = e->imp_cat ? e->imp_desc : e->w_desc;
    if (state_runs(scat, sdesc, to, tdesc, &cells, &nc, &hist, &nh, &qs, &nq, &sl, &ns) != AMX_OK)
        goto out;
    if (pend_runs_original(j, to, tdesc, &pend_loop, &npl) != AMX_OK)
        goto out;
    if (e->pend_original) {
        pend = pend_loop;
        np = npl;
    } else {
        /* The in-flight buffer already follows the working catalog. */
        amx_run_t *c2, *h2, *q2;
        size_t a, b, c;
        amx_qdesc_t *scratch = malloc((to->n ? to->n : 1) * sizeof(amx_qdesc_t));
        if (scratch == NULL)
            goto out;
        memcpy(scratch, tdesc, (to->n ? to->n : 1) * sizeof(amx_qdesc_t));
        st = state_runs(e->w_cat, e->w_desc, to, scratch, &c2, &a, &h2, &b, &q2, &c, NULL, NULL);
        free(scratch);
        free(h2);
        free(q2);
        if (st != AMX_OK) {
            free(c2);
            goto out;
        }
        pend = c2;
        np = a;
    }
    amx_layout_change_t lc = {
        .ncells = to->ncells,
        .nhist = to->nhist,
        .nq = to->n,
        .cells = cells,
        .ncell_runs = nc,
        .hist = hist,
        .nhist_runs = nh,
        .qs = qs,
        .nq_runs = nq,
        .pend = pend,
        .npend_runs = np,
        .nslices = to->nslices,
        .slices = sl,
        .nslice_runs = ns,
        .outputs_from_back = e->imp_cat != NULL || e->w_owned,
    };
    st = j->state->ops->remap(j->state, &lc, &err);
    if (st != AMX_OK) {
        fail(e, st, "remapping the amax state of job '%s' to %u quantizers failed: %s", j->name,
             to->n, err.msg);
        goto out;
    }
    /* The loop moves its active buffer from its own layout at the end. */
    free(e->res.pend_runs);
    e->res.pend_runs = pend_loop;
    if (pend == pend_loop)
        pend = NULL;
    pend_loop = NULL;
    e->res.pend_change = (amx_layout_change_t){.ncells = to->ncells,
                                               .nhist = to->nhist,
                                               .nslices = to->nslices,
                                               .nq = to->n,
                                               .pend = e->res.pend_runs,
                                               .npend_runs = npl};
    if (e->w_owned) {
        amx_catalog_free(e->res.cat);
        free(e->res.desc);
    }
    e->res.cat = to;
    e->res.desc = tdesc;
    e->res.publish = 1;
    tdesc = NULL;
    e->w_cat = to;
    e->w_desc = e->res.desc;
    e->w_owned = 1;
    e->desc_gen++;
    e->pend_original = 0;
    amx_catalog_free(e->imp_cat);
    free(e->imp_desc);
    e->imp_cat = NULL;
    e->imp_desc = NULL;
    st = AMX_OK;
out:
    if (st == AMX_ENOMEM && e->res.st == AMX_OK)
        fail(e, st, "out of memory changing the layout of job '%s'", j->name);
    if (pend != pend_loop)
        free(pend);
    free(pend_loop);
    free(cells);
    free(hist);
    free(qs);
    free(sl);
    free(tdesc);
    return st;
}

/* The agreed catalog plus this daemon's proposals (one participant). */
static amx_status_t adopt_locally(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    uint32_t n = j->cat->n + j->nprop, k = 0;
    amx_qspec_t **specs = calloc(n ? n : 1, sizeof(*specs));
    if (specs == NULL)
        return fail(e, AMX_ENOMEM, "out of memory adopting %u proposals", j->nprop);
    for (uint32_t i = 0; i < j->cat->n; i++)
        specs[k++] = amx_qspec_dup(j->cat->q[i]);
    for (uint32_t lid = 0; lid < j->nlq; lid++)
        if (j->lq[lid].status == LQ_PROPOSED)
            specs[k++] = amx_qspec_dup(j->lq[lid].spec);
    amx_catalog_t *c = NULL;
    amx_err_t err = {0};
    int ok = k == n;
    for (uint32_t i = 0; i < k; i++)
        ok &= specs[i] != NULL;
    if (!ok || amx_catalog_build(specs, n, &c, &err) != AMX_OK) {
        for (uint32_t i = 0; i < k; i++)
            amx_qspec_free(specs[i]);
        free(specs);
        return fail(e, AMX_ENOMEM, "out of memory adopting %u proposals", j->nprop);
    }
    free(specs);
    amx_status_t st = change_layout(e, c);
    if (st != AMX_OK)
        amx_catalog_free(c);
    return st;
}

/* Sets desc.reset for the named quantizers of the working catalog. */
static void mark_resets_by_name(amx_engine_t *e, char **names, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int64_t k = amx_catalog_find(e->w_cat, names[i]);
        if (k >= 0) {
            e->w_desc[k].reset = 1;
            e->marked = 1;
        }
    }
}

static void mark_local_resets(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    if (j->nreset == 0)
        return;
    for (uint32_t lid = 0; lid < j->nlq; lid++)
        if (j->lq[lid].reset &&
            (j->lq[lid].status == LQ_AGREED || j->lq[lid].status == LQ_PROPOSED)) {
            int64_t k = amx_catalog_find(e->w_cat, j->lq[lid].spec->name);
            if (k >= 0) {
                e->w_desc[k].reset = 1;
                e->marked = 1;
            }
        }
}

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
    amx_status_t st = amx_jobstate_export(j->name, e->last_reconciled, e->w_cat, e->w_desc,
                                          j->state, 0, &blob, &len, &err);
    if (st != AMX_OK)
        return fail(e, st, "job '%s': preparing the state for daemons that are behind: %s", j->name,
                    err.msg);
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
    amx_catalog_t *c = NULL;
    amx_err_t err = {0};
    int ok = copy != NULL && ga != NULL && gs != NULL;
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
        return AMX_ENOMEM;
    }
    free(copy);
    for (uint32_t i = 0; i < n; i++) {
        int64_t k = amx_catalog_find(c, js->cat->q[i]->name);
        ga[k] = js->a.g_amax[i];
        gs[k] = js->a.g_scale[i];
    }
    amx_catalog_free(e->res.prev_cat);
    free(e->res.prev_ga);
    free(e->res.prev_gs);
    e->res.prev_cat = c;
    e->res.prev_ga = ga;
    e->res.prev_gs = gs;
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
        return fail(e, AMX_EINTERNAL, "job '%s': the donor daemon %u is not a participant", j->name,
                    sr->donor);
    amx_err_t err = {0};
    void *blob = NULL;
    size_t len = 0;
    amx_status_t st = amx_peer_call_fetch(j->eng->env.peer, addr, j->name, sr->seq, e->deadline,
                                          &e->abort_flag, &blob, &len, &err);
    if (st != AMX_OK && atomic_load(&e->abort_flag))
        return fail_aborted(e, "fetching the job's state");
    if (st != AMX_OK)
        return fail(e, st, "job '%s': fetching the job's state from daemon %u (%s) failed: %s",
                    j->name, sr->donor, addr, err.msg);
    amx_jobstate_t js;
    st = amx_jobstate_parse(blob, len, &js, &err);
    if (st == AMX_OK && strcmp(js.job, j->name) != 0)
        st = amx_err_set(&err, AMX_EINVAL, "it is the state of job '%s'", js.job);
    if (st == AMX_OK)
        st = j->state->ops->import_state(j->state, js.cat->ncells, js.cat->nhist, js.cat->n,
                                         js.cat->nslices, &js.a, &err);
    if (st != AMX_OK) {
        amx_jobstate_free(&js);
        free(blob);
        return fail(e, st, "job '%s': the state from daemon %u could not be used: %s", j->name,
                    sr->donor, err.msg);
    }
    amx_qdesc_t *d = malloc((js.cat->n ? js.cat->n : 1) * sizeof(amx_qdesc_t));
    if (d == NULL || stash_previous(e, &js) != AMX_OK) {
        free(d);
        amx_jobstate_free(&js);
        free(blob);
        return fail(e, AMX_ENOMEM, "out of memory importing the state of job '%s'", j->name);
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
    if (!ok || change_layout(e, target) != AMX_OK) {
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

static amx_status_t make_comm(amx_engine_t *e, const amx_sync_result_t *sr)
{
    amx_job_t *j = e->job;
    drop_comm(e);
    const amx_cluster_id_t *id = amx_peer_id(e->env.peer);
    int me = my_index(&sr->members, id->rank);
    if (me < 0)
        return fail(e, AMX_EINTERNAL, "job '%s': this daemon is not among the participants",
                    j->name);
    char prefix[256];
    snprintf(prefix, sizeof(prefix), "comm/%s/%016" PRIx64 "/%" PRIu64 "/", j->name, sr->coord_inc,
             sr->comm_gen);
    amx_kv_t kv;
    amx_peer_kv(e->env.peer, &e->abort_flag, &kv);
    amx_comm_params_t p = {
        .rank = me,
        .size = (int)sr->members.npart,
        .kv = &kv,
        .prefix = prefix,
        .host = e->env.gloo_host,
        .cuda_device = e->env.cuda_device,
        .deadline_ms = e->deadline,
    };
    amx_err_t err = {0};
    amx_comm_t *c = NULL;
    uint64_t t0 = amx_now_ms();
    amx_status_t st = amx_comm_create(e->env.collective, &p, &c, &err);
    if (st != AMX_OK && atomic_load(&e->abort_flag))
        return fail_aborted(e, "making the communicator");
    if (st != AMX_OK)
        return fail(e, st,
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
        drop_comm(e);
        return fail_aborted(e, "making the communicator");
    }
    AMX_INFO("epoch", "job %s: %s communicator generation %llu ready (%d of %u) in %llu ms",
             j->name, e->env.collective, (unsigned long long)sr->comm_gen, me, sr->members.npart,
             (unsigned long long)(amx_now_ms() - t0));
    return AMX_OK;
}

static amx_status_t sync_round(amx_engine_t *e, int full, amx_sync_result_t *out);
static amx_status_t after_sync(amx_engine_t *e, amx_sync_result_t *sr);

/* One agreement round at the coordinator, and what follows from it. */
static amx_status_t agree(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    /* A job restored from a snapshot brings its catalog to its first
     * agreement, as does a daemon that knows the coordinator restarted;
     * otherwise the coordinator asks for it (send_catalog) when this
     * daemon's agreed catalog is not its master. */
    int full = (e->coord_inc != 0 && e->coord_inc != j->mship.coord_inc) ||
               (e->coord_inc == 0 && j->restored && e->w_cat->n > 0);
    amx_sync_result_t sr;
    for (;;) {
        amx_status_t st = sync_round(e, full, &sr);
        if (st != AMX_OK)
            return st;
        if (!sr.send_catalog)
            break;
        amx_sync_result_free(&sr);
        if (full)
            return fail(e, AMX_EINTERNAL,
                        "job '%s': the coordinator asked for the whole catalog although it was "
                        "sent",
                        j->name);
        AMX_INFO("epoch",
                 "job %s: the coordinator does not hold this daemon's catalog (%u quantizers, "
                 "%016" PRIx64 "): sending it whole",
                 j->name, e->w_cat->n, e->w_cat->hash);
        full = 1;
    }
    return after_sync(e, &sr);
}

/* One Sync call: this daemon's proposals, resets and (with `full`) its
 * whole agreed catalog. */
static amx_status_t sync_round(amx_engine_t *e, int full, amx_sync_result_t *out)
{
    amx_job_t *j = e->job;
    const amx_cluster_id_t *id = amx_peer_id(e->env.peer);
    /* Proposals: this daemon's, or (after the coordinator restarted, or
     * restored from a snapshot) the whole agreed catalog as well. */
    uint32_t cap = j->nprop + (full ? e->w_cat->n : 0);
    amx_qspec_t **prop = calloc(cap ? cap : 1, sizeof(*prop));
    char **resets = calloc(j->nlq ? j->nlq : 1, sizeof(char *));
    if (prop == NULL || resets == NULL) {
        free(prop);
        free(resets);
        return fail(e, AMX_ENOMEM, "out of memory preparing the agreement of job '%s'", j->name);
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
        return fail_aborted(e, "the agreement round");
    if (st != AMX_OK)
        return fail(e, st,
                    "job '%s', epoch %llu: the agreement round at the coordinator failed: "
                    "%s",
                    j->name, (unsigned long long)e->epoch, err.msg);
    if (!out->send_catalog)
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
static amx_status_t after_sync(amx_engine_t *e, amx_sync_result_t *srp)
{
    amx_job_t *j = e->job;
    const amx_cluster_id_t *id = amx_peer_id(e->env.peer);
    amx_sync_result_t sr = *srp;
    amx_err_t err = {0};
    e->synced = 1;
    e->coord_inc = sr.coord_inc;
    int behind = 0;
    for (size_t i = 0; i < sr.nbehind; i++)
        behind |= sr.behind[i] == id->rank;
    /* 1. The donor serves its state before it changes anything. */
    if (sr.nbehind > 0 && sr.donor == id->rank && publish_state(e, sr.seq) != AMX_OK)
        goto out;
    /* 2. Those behind catch up. */
    if (behind && catch_up(e, &sr) != AMX_OK)
        goto out;
    /* 3. The catalog. */
    amx_catalog_t *target = NULL;
    if (sr.catalog_included) {
        if (amx_catalog_build(sr.catalog, sr.ncatalog, &target, &err) != AMX_OK) {
            fail(e, AMX_ENOMEM, "out of memory building the agreed catalog of job '%s'", j->name);
            goto out;
        }
        sr.ncatalog = 0; /* the catalog owns the specs */
    }
    if (target == NULL && e->w_cat->hash != sr.catalog_hash) {
        fail(e, AMX_EINTERNAL,
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
            fail(e, AMX_ENOMEM, "out of memory copying the catalog of job '%s'", j->name);
            goto out;
        }
        free(copy);
    }
    if (target != NULL && change_layout(e, target) != AMX_OK) {
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
    mark_resets_by_name(e, sr.resets, sr.nresets);
    if (sr.conflict != NULL) {
        fail(e, AMX_EPRECOND, "%s", sr.conflict);
        goto out;
    }
    /* 6. The communicator. */
    if (sr.new_comm || e->comm == NULL || atomic_load(&e->comm_gen) != sr.comm_gen)
        if (make_comm(e, &sr) != AMX_OK)
            goto out;
    e->need_sync = 0;
out:
    amx_sync_result_free(&sr);
    return e->res.st;
}

/* ---- the epoch ---- */

static amx_status_t check_header(amx_engine_t *e, const float *h, uint64_t cells, int *flag)
{
    amx_job_t *j = e->job;
    uint64_t ep, hash, gen, nc;
    if (h[H_VERSION] != HDR_VERSION)
        return fail(e, AMX_EINTERNAL,
                    "job '%s': a daemon of another amaxd version took part in "
                    "the collective",
                    j->name);
    if (get_pieces(h, H_EPOCH, 4, &ep) != 0)
        return fail(e, AMX_EINTERNAL,
                    "job '%s': the daemons reduced different epochs together; "
                    "they will agree again at the next epoch",
                    j->name);
    if (get_pieces(h, H_HASH, 4, &hash) != 0 || get_pieces(h, H_CELLS, 3, &nc) != 0 || nc != cells)
        return fail(e, AMX_EINTERNAL,
                    "job '%s': the daemons reduced different catalogs together "
                    "(this must not happen; the results were discarded)",
                    j->name);
    if (get_pieces(h, H_GEN, 4, &gen) != 0)
        return fail(e, AMX_EINTERNAL, "job '%s': the daemons used different communicators",
                    j->name);
    *flag = h[H_FLAG] != 0.0f;
    return AMX_OK;
}

static amx_status_t collective(amx_engine_t *e, int *flag)
{
    amx_job_t *j = e->job;
    amx_err_t err = {0};
    float hdr[AMX_HDR_CELLS], *send, *recv;
    void *stream;
    uint64_t cells = e->w_cat->ncells;
    int want = !e->synced && (j->nprop > 0 || j->nreset > 0);
    if (e->comm->ops->soon != NULL)
        e->comm->ops->soon(e->comm); /* wakes the NCCL thread while we prepare */
    make_header(hdr, e->epoch, e->w_cat->hash, atomic_load(&e->comm_gen), cells, want);
    uint64_t tp = amx_now_us();
    amx_status_t st = j->state->ops->prepare(j->state, hdr, cells, &send, &recv, &stream, &err);
    if (st != AMX_OK)
        return fail(e, st, "job '%s': %s", j->name, err.msg);
    uint64_t t0 = amx_now_us();
    e->res.prepare_us += t0 - tp;
    st = e->comm->ops->allreduce_max(e->comm, send, recv, AMX_HDR_CELLS + cells, stream,
                                     e->deadline, &err);
    uint64_t t1 = amx_now_us();
    e->res.collective_us += t1 - t0;
    e->res.collectives++;
    if (st != AMX_OK) {
        if (atomic_load(&e->abort_flag))
            return fail_aborted(e, "the collective");
        return fail(e, st,
                    "job '%s', epoch %llu: the %s all-reduce of %llu cells across %u "
                    "daemons failed: %s",
                    j->name, (unsigned long long)e->epoch, e->env.collective,
                    (unsigned long long)cells, j->mship.npart, err.msg);
    }
    float rh[AMX_HDR_CELLS];
    st = j->state->ops->read_header(j->state, rh, &err);
    if (st != AMX_OK)
        return fail(e, st, "job '%s': %s", j->name, err.msg);
    e->res.header_us += amx_now_us() - t1;
    return check_header(e, rh, cells, flag);
}

static amx_status_t finish(amx_engine_t *e, int from_send)
{
    amx_job_t *j = e->job;
    amx_err_t err = {0};
    if (from_send)
        mark_local_resets(e);
    /* The descriptors change with the layout, a reset, or the history
     * heads (which move every epoch when there is a history). */
    int dirty = !e->fin_ok || e->desc_gen != e->fin_gen || e->w_cat->nhist > 0 || e->fin_had_reset;
    int had_reset = 0;
    for (uint32_t i = 0; e->marked && !had_reset && i < e->w_cat->n; i++)
        had_reset = e->w_desc[i].reset;
    dirty |= had_reset;
    uint64_t t0 = amx_now_us();
    amx_status_t st =
        j->state->ops->finish(j->state, e->w_desc, e->w_cat->n, e->w_cat->ncells, e->w_cat->npeer,
                              e->w_cat->nscale, from_send, dirty, &err);
    /* The backend's copy has reset flags that are cleared below: upload
     * the descriptors again next time. After a failure, the backend's copy
     * is not trusted at all. */
    e->fin_had_reset = had_reset;
    e->fin_gen = e->desc_gen;
    e->fin_ok = st == AMX_OK;
    e->res.finish_us = amx_now_us() - t0;
    if (st != AMX_OK)
        return fail(e, st, "job '%s', epoch %llu: finishing failed: %s", j->name,
                    (unsigned long long)e->epoch, err.msg);
    if (e->marked || e->w_cat->nhist > 0)
        for (uint32_t i = 0; i < e->w_cat->n; i++) {
            amx_qdesc_t *d = &e->w_desc[i];
            if (d->reset)
                d->hist_head = 0;
            d->reset = 0;
            if (d->accumulation == AMX_ACC_PER_EPOCH)
                d->hist_head = (d->hist_head + 1) % d->hist_len;
        }
    e->marked = 0;
    e->res.resets_applied = 1;
    e->res.publish = 1;
    return AMX_OK;
}

/* ---- durability ---- */

/* The epoch before the one being written: the published (front) globals,
 * in the layout of the job's installed catalog, for the catalog `cat` the
 * epoch ran with (a quantizer new this epoch has none). Engine thread,
 * while the loop keeps to reading the front. */
static amx_status_t snapshot_previous(const amx_job_t *j, const amx_catalog_t *cat,
                                      const amx_epoch_result_t *res, amx_snap_meta_t *m)
{
    const amx_state_t *st = j->state;
    int f = st->front;
    if (cat->n == 0)
        return AMX_OK;
    m->prev_ok = calloc(cat->n, 1);
    m->prev_ga = calloc(cat->n, 4);
    m->prev_gs = calloc(cat->n, 4);
    if (m->prev_ok == NULL || m->prev_ga == NULL || m->prev_gs == NULL)
        return AMX_ENOMEM;
    m->nprev = cat->n;
    if (res->imported) {
        /* This epoch continued a donor's state: its globals are the
         * previous ones, not this daemon's own stale front. */
        for (uint32_t i = 0; res->prev_cat != NULL && i < cat->n; i++) {
            int64_t k = amx_catalog_find(res->prev_cat, cat->q[i]->name);
            if (k < 0)
                continue;
            m->prev_ok[i] = 1;
            m->prev_ga[i] = res->prev_ga[k];
            m->prev_gs[i] = res->prev_gs[k];
        }
        return AMX_OK;
    }
    if (j->last_reconciled == 0 || st->g_amax[f] == NULL || j->cat == NULL)
        return AMX_OK;
    for (uint32_t i = 0; i < cat->n; i++) {
        int64_t old = cat == j->cat ? (int64_t)i : amx_catalog_find(j->cat, cat->q[i]->name);
        if (old < 0 || (uint64_t)old >= st->out_nq[f])
            continue;
        m->prev_ok[i] = 1;
        m->prev_ga[i] = st->g_amax[f][old];
        m->prev_gs[i] = st->g_scale[f][old];
    }
    return AMX_OK;
}

/* Writes the epoch just finished (the back results) into the job's
 * snapshot, before the loop answers Reconcile: with snapshot_interval_ms
 * 0, an epoch whose Reconcile returned is on disk. Every daemon of a
 * cluster job writes its own (the replicated state is the same on each;
 * the placements are its own ranks'). */
static void write_snapshot(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    const amx_config_t *cfg = e->env.cfg;
    if (cfg == NULL || cfg->state_dir == NULL || cfg->state_dir[0] == '\0')
        return;
    uint64_t now = amx_now_ms();
    if (cfg->snapshot_interval_ms > 0 && e->snap_ms != 0 &&
        now < e->snap_ms + (uint64_t)cfg->snapshot_interval_ms)
        return; /* written with a later epoch, or at shutdown */
    uint64_t t0 = amx_now_us();
    amx_err_t err = {0};
    amx_snap_meta_t m = {0};
    void *meta = NULL, *blob = NULL;
    size_t mlen = 0, blen = 0;
    amx_status_t st = amx_jobstate_export(j->name, e->epoch, e->w_cat, e->w_desc, j->state, 1,
                                          &blob, &blen, &err);
    if (st == AMX_OK && (st = amx_job_snap_meta(j, e->w_cat, &m)) != AMX_OK)
        amx_err_set(&err, st, "out of memory");
    if (st == AMX_OK && (st = snapshot_previous(j, e->w_cat, &e->res, &m)) != AMX_OK)
        amx_err_set(&err, st, "out of memory");
    m.epochs_ok++; /* this epoch */
    m.state_len = blen;
    if (st == AMX_OK)
        st = amx_snapshot_encode_meta(&m, &meta, &mlen, &err);
    amx_job_snap_meta_free(&m);
    if (st == AMX_OK)
        st = amx_snapshot_write(cfg->state_dir, j->name, meta, mlen, blob, blen, &err);
    free(meta);
    free(blob);
    e->res.snapshot_us = amx_now_us() - t0;
    if (st != AMX_OK) {
        snprintf(e->res.snapshot_err, sizeof(e->res.snapshot_err),
                 "epoch %llu of job '%s' was reconciled but not written to its snapshot: %.380s",
                 (unsigned long long)e->epoch, j->name, err.msg);
        return;
    }
    e->snap_ms = now;
    e->res.snapshot_ok = 1;
    e->res.snapshot_bytes = mlen + blen;
}

/* What the other daemons say about an epoch that did not complete. */
static void explain(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    if ((e->res.st != AMX_ETIMEDOUT && e->res.st != AMX_EUNAVAIL) || e->passed_on)
        return;
    char buf[768];
    amx_peer_call_progress(e->env.peer, &j->mship, j->me, j->name, e->epoch, 500, buf, sizeof(buf));
    if (buf[0] != '\0') {
        size_t n = strlen(e->res.msg);
        snprintf(e->res.msg + n, sizeof(e->res.msg) - n, "; %s", buf);
    }
}

static void run_epoch(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    uint64_t t0 = amx_now_us();
    e->res.begin_at_us = t0;
    e->w_cat = j->cat;
    e->w_desc = j->desc;
    e->w_owned = 0;
    e->pend_original = 1;
    e->imp_cat = NULL;
    e->imp_desc = NULL;
    e->last_reconciled = j->last_reconciled;
    e->synced = 0;
    e->passed_on = 0;
    e->aborted_here = 0;
    uint64_t full_deadline = e->deadline;
    if (j->mship.npart <= 1) {
        if (j->nprop > 0 && adopt_locally(e) != AMX_OK)
            goto out;
        if (finish(e, 1) != AMX_OK)
            goto out;
        e->res.reconciled = 1;
        goto out;
    }
    /* Keep a little time to find out and say why, should this fail. */
    uint64_t now = amx_now_ms();
    if (e->deadline != UINT64_MAX && e->deadline > now) {
        uint64_t spare = (e->deadline - now) / 5;
        e->deadline -= spare < 1500 ? spare : 1500;
    }
    if (atomic_load(&e->abort_flag)) {
        fail_aborted(e, "the epoch");
        goto out;
    }
    if (e->comm == NULL || e->need_sync) {
        if (agree(e) != AMX_OK)
            goto out;
    }
    for (int round = 0;; round++) {
        int flag = 0;
        if (collective(e, &flag) != AMX_OK)
            goto out;
        if (!flag)
            break;
        if (round > 0 || e->synced) {
            fail(e, AMX_EINTERNAL, "job '%s': a daemon asked for a second agreement in one epoch",
                 j->name);
            goto out;
        }
        if (agree(e) != AMX_OK)
            goto out;
    }
    if (finish(e, 0) != AMX_OK)
        goto out;
    e->res.reconciled = 1;
out:
    e->deadline = full_deadline;
    if (e->res.reconciled) {
        e->res.st = AMX_OK;
        e->res.epoch = e->epoch;
        write_snapshot(e);
        /* Resets sent to the coordinator were applied with everyone's. */
        e->res.resets_applied = 1;
    } else {
        e->res.epoch = e->epoch;
        if (j->mship.npart > 1) {
            explain(e);
            /* Peers still blocked in a collective of our communicator would
             * wait for their deadline: tell them why, before our side of
             * it closes (over Gloo they would otherwise see only a broken
             * connection). */
            uint64_t gen = atomic_load(&e->comm_gen);
            if (gen == 0)
                gen = e->last_gen;
            if (gen != 0 && !e->passed_on)
                amx_peer_call_abort(e->env.peer, &j->mship, j->me, j->name, gen, e->res.st,
                                    e->aborted_here ? e->peer_why : e->res.msg, 500);
            drop_comm(e);
            e->need_sync = 1;
        }
        for (uint32_t i = 0; e->marked && i < e->w_cat->n; i++)
            e->w_desc[i].reset = 0;
        e->marked = 0;
        e->res.resets_applied = 0;
    }
    amx_catalog_free(e->imp_cat);
    free(e->imp_desc);
    e->imp_cat = NULL;
    e->imp_desc = NULL;
    pthread_mutex_lock(&e->blob_mu);
    free(e->blob);
    e->blob = NULL;
    e->blob_len = 0;
    pthread_mutex_unlock(&e->blob_mu);
    e->res.end_at_us = amx_now_us();
    e->res.total_us = e->res.end_at_us - t0;
}

static void *engine_main(void *arg)
{
    amx_engine_t *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->have_work && !e->quit)
            pthread_cond_wait(&e->cv, &e->mu);
        if (e->quit)
            break;
        pthread_mutex_unlock(&e->mu);
        run_epoch(e);
        pthread_mutex_lock(&e->mu);
        e->have_work = 0;
        pthread_mutex_unlock(&e->mu);
        e->env.post(e->env.ud, e->job);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    drop_comm(e);
    return NULL;
}

/* ---- loop-side API ---- */

amx_status_t amx_engine_create(amx_job_t *job, const amx_engine_env_t *env, amx_engine_t **out,
                               amx_err_t *err)
{
    amx_engine_t *e = calloc(1, sizeof(*e));
    if (e == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory creating an engine");
    e->job = job;
    e->env = *env;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->blob_mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    atomic_init(&e->abort_flag, 0);
    atomic_init(&e->comm_gen, 0);
    if (pthread_create(&e->th, NULL, engine_main, e) != 0) {
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        pthread_mutex_destroy(&e->blob_mu);
        free(e);
        return amx_err_set(err, AMX_EINTERNAL, "cannot start the engine thread of job '%s'",
                           job->name);
    }
    e->started = 1;
    *out = e;
    return AMX_OK;
}

void amx_engine_start(amx_engine_t *e, uint64_t epoch, uint64_t deadline_ms)
{
    res_clear(&e->res);
    pthread_mutex_lock(&e->mu);
    e->epoch = epoch;
    e->deadline = deadline_ms;
    atomic_store(&e->abort_flag, 0);
    e->abort_why[0] = '\0';
    e->abort_code = AMX_OK;
    e->abort_from = AMX_ENGINE_LOCAL;
    e->have_work = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

amx_epoch_result_t *amx_engine_result(amx_engine_t *e)
{
    return &e->res;
}

void amx_engine_abort(amx_engine_t *e, uint64_t gen, uint32_t from, amx_status_t code,
                      const char *why)
{
    pthread_mutex_lock(&e->mu);
    uint64_t cur = atomic_load(&e->comm_gen);
    if (gen != 0 && gen != cur) {
        /* About a communicator this daemon no longer uses: an attempt
         * that is already agreeing again must not be disturbed. */
        pthread_mutex_unlock(&e->mu);
        return;
    }
    snprintf(e->abort_why, sizeof(e->abort_why), "%s", why);
    e->abort_code = code;
    e->abort_from = from;
    if (e->have_work) {
        atomic_store(&e->abort_flag, 1);
        if (e->comm != NULL)
            e->comm->ops->abort(e->comm);
    }
    e->need_sync = 1;
    pthread_mutex_unlock(&e->mu);
}

void amx_engine_destroy(amx_engine_t *e)
{
    if (e == NULL)
        return;
    pthread_mutex_lock(&e->mu);
    e->quit = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->started)
        pthread_join(e->th, NULL);
    res_clear(&e->res);
    free(e->blob);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    pthread_mutex_destroy(&e->blob_mu);
    free(e);
}

uint64_t amx_engine_comm_gen(const amx_engine_t *e)
{
    return atomic_load(&((amx_engine_t *)e)->comm_gen);
}

amx_status_t amx_engine_fetch(amx_engine_t *e, uint64_t seq, uint64_t offset, uint32_t max,
                              void **data, size_t *len, uint64_t *total, amx_err_t *err)
{
    pthread_mutex_lock(&e->blob_mu);
    if (e->blob == NULL || e->blob_seq != seq) {
        pthread_mutex_unlock(&e->blob_mu);
        return amx_err_set(err, AMX_EUNAVAIL, "the state for agreement %llu is not ready here",
                           (unsigned long long)seq);
    }
    if (offset > e->blob_len) {
        pthread_mutex_unlock(&e->blob_mu);
        return amx_err_set(err, AMX_EINVAL, "offset %llu is past the state's %zu bytes",
                           (unsigned long long)offset, e->blob_len);
    }
    size_t n = e->blob_len - (size_t)offset;
    if (n > max)
        n = max;
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        pthread_mutex_unlock(&e->blob_mu);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    if (n > 0)
        memcpy(p, (char *)e->blob + offset, n);
    *total = e->blob_len;
    pthread_mutex_unlock(&e->blob_mu);
    *data = p;
    *len = n;
    return AMX_OK;
}
