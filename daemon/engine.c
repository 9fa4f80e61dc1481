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
#include "engine_impl.h"

#include "job_snap.h"

#include <inttypes.h>
#include <math.h>
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

/* ---- results ---- */

static void res_clear(amx_epoch_result_t *r)
{
    amx_catalog_free(r->cat);
    amx_catalog_free(r->prev_cat);
    amx_membership_free(&r->members);
    free(r->prev_ga);
    free(r->prev_gs);
    free(r->pprev_ga);
    free(r->pprev_gs);
    free(r->desc);
    free(r->pend_runs);
    for (size_t i = 0; i < r->nrejected; i++)
        free(r->rejected[i]);
    free(r->rejected);
    memset(r, 0, sizeof(*r));
}

amx_status_t amx__engine_fail(amx_engine_t *e, amx_status_t st, const char *fmt, ...)
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
amx_status_t amx__engine_fail_aborted(amx_engine_t *e, const char *during)
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
        return amx__engine_fail(e, AMX_EABORTED, "job '%s', epoch %llu: %s was aborted: %s", job,
                                ep, during, why);
    }
    if (code == AMX_OK || code == AMX_EABORTED)
        return amx__engine_fail(e, AMX_EABORTED,
                                "job '%s', epoch %llu: %s was aborted by daemon %u: %s", job, ep,
                                during, from, why);
    if (e->res.st == AMX_OK)
        e->passed_on = 1; /* explained already by the daemon that failed */
    return amx__engine_fail(e, code, "job '%s', epoch %llu failed on daemon %u: %s", job, ep, from,
                            why);
}

/* A failure of this daemon's own, which its peers cannot know of: not a
 * wait that ran out or a coordinator that went away (every participant
 * sees those itself), not an abort, not a conflict (the same answer went to
 * everyone). */
/* How long an abort of an epoch not yet started here stays good. */
#define PEND_ABORT_MS 5000

static int failed_here(amx_status_t st)
{
    return st != AMX_OK && st != AMX_ETIMEDOUT && st != AMX_EUNAVAIL && st != AMX_EABORTED &&
           st != AMX_ECANCELLED && st != AMX_EPRECOND;
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
        /* A header of a collective stopped under way holds anything: a
         * piece is a whole number of 0..65535 or the field is not one. */
        if (hi != lo || !(hi >= 0.0f && hi <= 65535.0f) || (float)(uint32_t)hi != hi)
            return -1;
        x |= (uint64_t)hi << (16 * k);
    }
    *v = x;
    return 0;
}

void amx__engine_make_header(float *h, uint64_t epoch, uint64_t hash, uint64_t gen, uint64_t cells,
                             int flag)
{
    memset(h, 0, AMX_HDR_CELLS * sizeof(float));
    put_pieces(h, H_EPOCH, epoch, 4);
    put_pieces(h, H_HASH, hash, 4);
    put_pieces(h, H_GEN, gen, 4);
    put_pieces(h, H_CELLS, cells, 3);
    h[H_FLAG] = flag ? 1.0f : 0.0f;
    h[H_VERSION] = -HDR_VERSION;
}

/* ---- communicator ---- */

void amx__engine_drop_comm(amx_engine_t *e)
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

/* Runs for moving statistics laid out as `from` (desc `fdesc`) to `to`:
 * their values (*stat) and their stat cells (*scells). A quantizer keeps
 * its statistic only under the same calibrator. */
static amx_status_t stat_runs(const amx_catalog_t *from, const amx_qdesc_t *fdesc,
                              const amx_catalog_t *to, const amx_qdesc_t *tdesc, amx_run_t **stat,
                              size_t *ns, amx_run_t **scells, size_t *nsc)
{
    *stat = malloc((to->n ? to->n : 1) * sizeof(amx_run_t));
    *scells = malloc((to->n ? to->n : 1) * sizeof(amx_run_t));
    if (*stat == NULL || *scells == NULL)
        return AMX_ENOMEM;
    *ns = *nsc = 0;
    for (uint32_t i = 0; from != NULL && to->nstat > 0 && i < to->n; i++) {
        if (tdesc[i].stat == 0)
            continue;
        int64_t k = amx_catalog_find(from, to->q[i]->name);
        if (k < 0 || !amx_calib_equal(&from->q[k]->calib, &to->q[i]->calib) ||
            from->q[k]->ncells != to->q[i]->ncells)
            continue;
        (*stat)[(*ns)++] = (amx_run_t){tdesc[i].sbase, fdesc[k].sbase, tdesc[i].svals};
        (*scells)[(*nsc)++] =
            (amx_run_t){tdesc[i].obase, fdesc[k].obase, amx_qspec_stat_cells(to->q[i])};
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
amx_status_t amx__engine_change_layout(amx_engine_t *e, amx_catalog_t *to)
{
    amx_job_t *j = e->job;
    amx_err_t err = {0};
    amx_qdesc_t *tdesc = malloc((to->n ? to->n : 1) * sizeof(amx_qdesc_t));
    amx_run_t *cells = NULL, *hist = NULL, *qs = NULL, *sl = NULL, *pend = NULL, *pend_loop = NULL;
    amx_run_t *srun = NULL, *scrun = NULL, *sprun = NULL, *spscratch = NULL;
    size_t nc = 0, nh = 0, nq = 0, ns = 0, np = 0, npl = 0, nsr = 0, nscr = 0, nspr = 0, nspx = 0;
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
    /* Statistics: the accumulated sums as the replicated state; the
     * in-flight values in the agreed layout they were merged in. */
    if (stat_runs(scat, sdesc, to, tdesc, &srun, &nsr, &scrun, &nscr) != AMX_OK)
        goto out;
    if (stat_runs(e->pend_original ? j->cat : e->w_cat, e->pend_original ? j->desc : e->w_desc, to,
                  tdesc, &sprun, &nspr, &spscratch, &nspx) != AMX_OK)
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
        .nstat = to->nstat,
        .nscell = to->nscell,
        .stat = srun,
        .nstat_runs = nsr,
        .spend = sprun,
        .nspend_runs = nspr,
        .scells = scrun,
        .nscell_runs = nscr,
    };
    st = j->state->ops->remap(j->state, &lc, &err);
    if (st != AMX_OK) {
        amx__engine_fail(e, st, "remapping the amax state of job '%s' to %u quantizers failed: %s",
                         j->name, to->n, err.msg);
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
                                               .npend_runs = npl,
                                               .nstat = to->nstat,
                                               .nscell = to->nscell};
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
        amx__engine_fail(e, st, "out of memory changing the layout of job '%s'", j->name);
    if (pend != pend_loop)
        free(pend);
    free(pend_loop);
    free(cells);
    free(hist);
    free(qs);
    free(sl);
    free(srun);
    free(scrun);
    free(sprun);
    free(spscratch);
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
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory adopting %u proposals", j->nprop);
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
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory adopting %u proposals", j->nprop);
    }
    free(specs);
    amx_status_t st = amx__engine_change_layout(e, c);
    if (st != AMX_OK)
        amx_catalog_free(c);
    return st;
}

/* Sets desc.reset for the named quantizers of the working catalog. */
void amx__engine_mark_resets(amx_engine_t *e, char **names, size_t n)
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

/* ---- the epoch ---- */

amx_hdr_verdict_t amx__engine_header_verdict(const float *h, uint64_t epoch, uint64_t hash,
                                             uint64_t gen, uint64_t cells)
{
    uint64_t ep, hh, g, nc;
    /* Exactly what the older header wrote (+1.0), with the same epoch
     * (whose pieces it wrote the same way): a daemon of that version. Any
     * other value is not a version: a contribution that is missing (the
     * poisoned 0), or the data of a collective stopped under way (a
     * peer's abort, a communicator torn down), which can hold anything,
     * 1.0 included (a data cell's value). */
    if (h[H_VERSION] == 1.0f && get_pieces(h, H_EPOCH, 4, &ep) == 0 && ep == epoch)
        return AMX_HDR_OLD_VERSION;
    if (h[H_VERSION] != -HDR_VERSION || get_pieces(h, H_EPOCH, 4, &ep) != 0 || ep != epoch)
        return AMX_HDR_INCOMPLETE;
    if (get_pieces(h, H_HASH, 4, &hh) != 0 || get_pieces(h, H_CELLS, 3, &nc) != 0 || nc != cells ||
        hh != hash)
        return AMX_HDR_CATALOG;
    if (get_pieces(h, H_GEN, 4, &g) != 0 || g != gen)
        return AMX_HDR_COMM;
    return AMX_HDR_OK;
}

static amx_status_t check_header(amx_engine_t *e, const float *h, uint64_t cells, int *flag)
{
    amx_job_t *j = e->job;
    unsigned long long epoch = (unsigned long long)e->epoch;
    /* A collective that "completes" without every daemon's contribution
     * (a daemon that died with the communicator, as NCCL peers can) must
     * be an error, never results: every field is checked against this
     * daemon's own, and the presence of all in the version cell. */
    amx_hdr_verdict_t v =
        amx__engine_header_verdict(h, e->epoch, e->w_cat->hash, atomic_load(&e->comm_gen), cells);
    if (v != AMX_HDR_OK && atomic_load(&e->abort_flag)) {
        /* An abort came while the collective ran (its communicator torn
         * down under it): that is the cause, not what its data says. */
        AMX_WARN("epoch", "job %s, epoch %llu: the aborted collective's header was discarded",
                 j->name, epoch);
        return amx__engine_fail_aborted(e, "the collective");
    }
    switch (v) {
    case AMX_HDR_OK:
        break;
    case AMX_HDR_OLD_VERSION:
        return amx__engine_fail(e, AMX_EINTERNAL,
                                "job '%s': a daemon of another amaxd version took part in "
                                "the collective",
                                j->name);
    case AMX_HDR_INCOMPLETE:
        return amx__engine_fail(e, AMX_EUNAVAIL,
                                "job '%s', epoch %llu: the collective ended without a current "
                                "contribution of every daemon (one died, restarted, aborted or "
                                "left the communicator; its header's version cell read %g); the "
                                "results were discarded and the daemons agree again at the next "
                                "attempt",
                                j->name, epoch, (double)h[H_VERSION]);
    case AMX_HDR_CATALOG:
        return amx__engine_fail(e, AMX_EINTERNAL,
                                "job '%s', epoch %llu: the daemons reduced different catalogs "
                                "together (this must not happen; the results were discarded)",
                                j->name, epoch);
    case AMX_HDR_COMM:
        return amx__engine_fail(e, AMX_EUNAVAIL,
                                "job '%s', epoch %llu: the daemons used different communicators",
                                j->name, epoch);
    }
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
    amx__engine_make_header(hdr, e->epoch, e->w_cat->hash, atomic_load(&e->comm_gen), cells, want);
    uint64_t tp = amx_now_us();
    amx_status_t st = j->state->ops->prepare(j->state, hdr, cells, &send, &recv, &stream, &err);
    if (st != AMX_OK)
        return amx__engine_fail(e, st, "job '%s': %s", j->name, err.msg);
    /* The reduced header comes out with the collective where it can. */
    float *hcopy = NULL;
    const float *hsrc = NULL;
    if (e->comm->ops->tail != NULL && j->state->ops->header_copy != NULL) {
        hcopy = j->state->ops->header_copy(j->state, &hsrc);
        if (hcopy != NULL)
            e->comm->ops->tail(e->comm, hcopy, hsrc, AMX_HDR_CELLS * sizeof(float));
    }
    uint64_t t0 = amx_now_us();
    e->res.prepare_us += t0 - tp;
    st = e->comm->ops->allreduce_max(e->comm, send, recv, AMX_HDR_CELLS + cells, stream,
                                     e->deadline, &err);
    uint64_t t1 = amx_now_us();
    e->res.collective_us += t1 - t0;
    e->res.collectives++;
    if (st != AMX_OK) {
        if (atomic_load(&e->abort_flag))
            return amx__engine_fail_aborted(e, "the collective");
        return amx__engine_fail(e, st,
                                "job '%s', epoch %llu: the %s all-reduce of %llu cells across %u "
                                "daemons failed: %s",
                                j->name, (unsigned long long)e->epoch, e->env.collective,
                                (unsigned long long)cells, j->mship.npart, err.msg);
    }
    float rh[AMX_HDR_CELLS];
    if (hcopy != NULL)
        memcpy(rh, hcopy, sizeof(rh));
    else
        st = j->state->ops->read_header(j->state, rh, &err);
    if (st != AMX_OK)
        return amx__engine_fail(e, st, "job '%s': %s", j->name, err.msg);
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
    if (amx__engine_stat_begin(e, from_send) != AMX_OK) {
        j->state->ovr = NULL;
        e->fin_ok = 0;
        return e->res.st;
    }
    amx_status_t st =
        j->state->ops->finish(j->state, e->w_desc, e->w_cat->n, e->w_cat->ncells, e->w_cat->npeer,
                              e->w_cat->nscale, from_send, dirty, &err);
    j->state->ovr = NULL;
    if (st == AMX_OK && amx__engine_stat_end(e) != AMX_OK)
        st = e->res.st;
    /* The backend's copy has reset flags that are cleared below: upload
     * the descriptors again next time. After a failure, the backend's copy
     * is not trusted at all. */
    e->fin_had_reset = had_reset;
    e->fin_gen = e->desc_gen;
    e->fin_ok = st == AMX_OK;
    e->res.finish_us = amx_now_us() - t0;
    if (st != AMX_OK)
        return amx__engine_fail(e, st, "job '%s', epoch %llu: finishing failed: %s", j->name,
                                (unsigned long long)e->epoch, err.msg[0] ? err.msg : e->res.msg);
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
            if (k < 0 || isnan(res->prev_ga[k]))
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
        if (old < 0 || (uint64_t)old >= st->out_nq[f] || !amx_job_published(j, (uint32_t)old))
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
/* A connection a neighbour closed is often the echo of another daemon's
 * failure, whose Abort (with its cause) may still be on its way: waits up
 * to wait_ms for it and, when it comes, fails with its status and sentence
 * instead of the bare broken connection. */
static int cause_from_peer(amx_engine_t *e, uint64_t wait_ms)
{
    uint64_t end = amx_now_ms() + wait_ms;
    for (;;) {
        char why[sizeof(e->abort_why)];
        pthread_mutex_lock(&e->mu);
        amx_status_t code = e->abort_code;
        uint32_t from = e->abort_from;
        snprintf(why, sizeof(why), "%s", e->abort_why);
        pthread_mutex_unlock(&e->mu);
        if (from != AMX_ENGINE_LOCAL && code != AMX_OK && code != AMX_EABORTED) {
            e->res.st = code;
            snprintf(e->res.msg, sizeof(e->res.msg), "job '%s', epoch %llu failed on daemon %u: %s",
                     e->job->name, (unsigned long long)e->epoch, from, why);
            e->passed_on = 1;
            return 1;
        }
        if (amx_now_ms() >= end)
            return 0;
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
}

static void explain(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    if ((e->res.st != AMX_ETIMEDOUT && e->res.st != AMX_EUNAVAIL) || e->passed_on)
        return;
    if (e->res.st == AMX_EUNAVAIL && cause_from_peer(e, 300))
        return;
    char buf[768];
    amx_peer_call_progress(e->env.peer, &j->mship, j->me, j->name, e->epoch, 500, buf, sizeof(buf));
    if (buf[0] != '\0') {
        size_t n = strlen(e->res.msg);
        snprintf(e->res.msg + n, sizeof(e->res.msg) - n, "; %s", buf);
    }
}

/* The trainers' device slabs queued at the flip are merged, or, past
 * `deadline`, those whose trainers never wrote their ready flags were
 * released (state.h dev_wait): the epoch fails with the ranks named, on
 * every daemon (peers hear it through the abort of run_epoch). */
/* For the device slabs' wait: whether the epoch was aborted (a job drop,
 * a peer's abort, shutdown). */
static int wait_aborted(void *ud)
{
    amx_engine_t *e = ud;
    return atomic_load(&e->abort_flag) != 0;
}

static amx_status_t wait_device_slabs(amx_engine_t *e, uint64_t deadline)
{
    amx_job_t *j = e->job;
    if (j->state->ops->dev_wait == NULL)
        return AMX_OK;
    amx_err_t err = {0};
    uint64_t t0 = amx_now_us();
    /* Spin (busy_poll) only for an armed epoch's flag page: a plain
     * epoch's trainers wrote their flags before they called. */
    amx_status_t st = j->state->ops->dev_wait(j->state, deadline, e->busy_poll && e->armed_ms != 0,
                                              wait_aborted, e, &err);
    e->res.wait_us += amx_now_us() - t0;
    if (st == AMX_EABORTED && atomic_load(&e->abort_flag)) {
        /* The trainers hear the abort's own cause; what the wait did is
         * logged. */
        AMX_WARN("epoch", "job %s, epoch %llu: %s", j->name, (unsigned long long)e->epoch, err.msg);
        return amx__engine_fail_aborted(e, "waiting for the device slabs");
    }
    if (st != AMX_OK)
        return amx__engine_fail(e, st, "job '%s', epoch %llu: %s", j->name,
                                (unsigned long long)e->epoch, err.msg);
    return AMX_OK;
}

/* How long the loop polls for the end of an epoch once the device slabs
 * are in (env.expect): the rest of an epoch of ten million cells takes
 * about a millisecond and a half on a GPU; a longer one ends with the
 * usual wake-up. */
#define EXPECT_END_US 2000

static void expect_end(amx_engine_t *e)
{
    if (e->busy_poll && e->env.expect != NULL) {
        e->env.expect(e->env.ud, EXPECT_END_US);
        e->res.expected_end = 1;
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
    e->stale_here = 0;
    e->watch_gone = 0;
    uint64_t full_deadline = e->deadline;
    int slabs_in = 0;
    if (e->armed_ms != 0) {
        /* Armed (docs/API.md "Armed epochs"): the trainers' ready flags
         * come when their next steps end; the epoch's deadline runs from
         * then. An abort meanwhile (a trainer gone, a peer, a drop) ends
         * the wait as it would any. */
        if (wait_device_slabs(e, UINT64_MAX) != AMX_OK)
            goto out;
        e->deadline = amx_now_ms() + e->armed_ms;
        full_deadline = e->deadline;
        slabs_in = 1;
    }
    if (j->mship.npart <= 1) {
        if (!slabs_in && wait_device_slabs(e, e->deadline) != AMX_OK)
            goto out;
        expect_end(e);
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
        /* Aborted before it began here: the device slabs' merges still
         * end first (the wait sees the abort at once and releases those
         * whose trainers are late), or the loop's unflip would wait for
         * them. */
        if (slabs_in || wait_device_slabs(e, e->deadline) == AMX_OK)
            amx__engine_fail_aborted(e, "the epoch");
        goto out;
    }
    if (!slabs_in && wait_device_slabs(e, e->deadline) != AMX_OK)
        goto out;
    expect_end(e);
    if (e->comm == NULL || e->need_sync) {
        if (amx__engine_agree(e) != AMX_OK)
            goto out;
    }
    for (int round = 0;; round++) {
        int flag = 0;
        if (collective(e, &flag) != AMX_OK)
            goto out;
        if (!flag)
            break;
        if (round > 0 || e->synced) {
            amx__engine_fail(e, AMX_EINTERNAL,
                             "job '%s': a daemon asked for a second agreement in one epoch",
                             j->name);
            goto out;
        }
        if (amx__engine_agree(e) != AMX_OK)
            goto out;
    }
    if (amx__engine_stat_collective(e) != AMX_OK)
        goto out;
    if (finish(e, 0) != AMX_OK)
        goto out;
    e->res.reconciled = 1;
out:
    e->deadline = full_deadline;
    pthread_mutex_lock(&e->mu);
    if (!e->res.reconciled && e->agreed_seq != 0) {
        e->failed_seq = e->agreed_seq;
        e->failed_inc = e->agreed_inc;
    }
    uint64_t agreed_seq = e->agreed_seq, agreed_inc = e->agreed_inc;
    pthread_mutex_unlock(&e->mu);
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
            const char *why = e->aborted_here ? e->peer_why : e->res.msg;
            /* After a catch-up its peers attempt the epoch after the
             * donor's (this daemon's e->epoch since), not the one this
             * daemon started. */
            uint64_t ep = e->res.imported ? e->epoch : e->start_epoch;
            if (!e->passed_on && (e->stale_here || e->watch_gone || failed_here(e->res.st)))
                /* A failure of this daemon's own (or a participant its
                 * watch found gone): every participant of this epoch hears
                 * it, whatever communicator it is using or making (it may
                 * be agreeing on a new generation this daemon never got),
                 * instead of waiting for this daemon and then blaming its
                 * ranks; and one still on this daemon's communicator (it
                 * completed the same collective and went on to its next
                 * epoch) drops it. */
                amx_peer_call_abort(e->env.peer, &j->mship, j->me, j->name, gen, ep, agreed_seq,
                                    agreed_inc, e->res.st, why, 500);
            else if (gen != 0 && !e->passed_on)
                amx_peer_call_abort(e->env.peer, &j->mship, j->me, j->name, gen, 0, 0, 0, e->res.st,
                                    why, 500);
            amx__engine_drop_comm(e);
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
    /* The state served to daemons behind goes once an epoch completed. An
     * attempt that failed keeps it: the others fail the same agreement
     * (a catalog conflict) while a daemon behind may still be fetching it;
     * the next publish replaces it. */
    if (e->res.reconciled) {
        pthread_mutex_lock(&e->blob_mu);
        free(e->blob);
        e->blob = NULL;
        e->blob_len = 0;
        pthread_mutex_unlock(&e->blob_mu);
    }
    e->res.end_at_us = amx_now_us();
    e->res.total_us = e->res.end_at_us - t0;
    if (amx_log_profiling())
        AMX_INFO("profile",
                 "job %s, epoch %llu (%s): %llu us in the engine: device slabs %llu, prepare "
                 "%llu, collectives %llu (%u), header %llu, finish %llu, snapshot %llu, the rest "
                 "%llu",
                 j->name, (unsigned long long)e->epoch, e->res.reconciled ? "reconciled" : "failed",
                 (unsigned long long)e->res.total_us, (unsigned long long)e->res.wait_us,
                 (unsigned long long)e->res.prepare_us, (unsigned long long)e->res.collective_us,
                 e->res.collectives, (unsigned long long)e->res.header_us,
                 (unsigned long long)e->res.finish_us, (unsigned long long)e->res.snapshot_us,
                 (unsigned long long)(e->res.total_us -
                                      (e->res.wait_us + e->res.prepare_us + e->res.collective_us +
                                       e->res.header_us + e->res.finish_us + e->res.snapshot_us)));
}

/* How long the engine thread spins for an expected epoch (amx_engine_expect)
 * before it sleeps again: the loop's flip of the epoch (the device slabs'
 * merges queued) takes tens of microseconds; an epoch that does not come
 * (start_epoch failed) costs this much of a core once. */
#define EXPECT_SPIN_US 2000

/* Under e->mu: an expected epoch, spun for outside the lock; returns with
 * the lock held again. */
static void spin_for_work(amx_engine_t *e)
{
    atomic_store(&e->expect, 0);
    pthread_mutex_unlock(&e->mu);
    uint64_t until = amx_now_us() + EXPECT_SPIN_US;
    for (unsigned i = 0; !atomic_load(&e->work); i++) {
        amx_cpu_relax();
        if ((i & 255) == 0 && amx_now_us() >= until)
            break;
    }
    pthread_mutex_lock(&e->mu);
}

static void *engine_main(void *arg)
{
    amx_engine_t *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        while (!e->have_work && !e->quit) {
            if (atomic_load(&e->expect))
                spin_for_work(e);
            else
                pthread_cond_wait(&e->cv, &e->mu);
        }
        if (e->quit)
            break;
        atomic_store(&e->work, 0);
        atomic_store(&e->expect, 0); /* taken without spinning: no spin after it */
        pthread_mutex_unlock(&e->mu);
        run_epoch(e);
        pthread_mutex_lock(&e->mu);
        e->have_work = 0;
        pthread_mutex_unlock(&e->mu);
        e->env.post(e->env.ud, e->job);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    amx__engine_drop_comm(e);
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
    atomic_init(&e->expect, 0);
    e->busy_poll = env->cfg != NULL && amx_config_busy_poll(env->cfg);
    atomic_init(&e->work, 0);
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

/* Whether an Abort about agreement `seq` of coordinator `inc` came late:
 * an attempt of that round (or of an earlier one) failed here already, or
 * this attempt agreed another round (one agreement per attempt). Under mu. */
static int abort_is_late(const amx_engine_t *e, uint64_t seq, uint64_t inc)
{
    if (seq == 0)
        return 0;
    if (e->failed_seq != 0 && inc == e->failed_inc && seq <= e->failed_seq)
        return 1;
    return e->agreed_seq != 0 && (inc != e->agreed_inc || seq < e->agreed_seq);
}

void amx_engine_start(amx_engine_t *e, uint64_t epoch, uint64_t deadline_ms, uint64_t armed_ms)
{
    res_clear(&e->res);
    pthread_mutex_lock(&e->mu);
    e->armed_ms = armed_ms;
    e->epoch = epoch;
    e->start_epoch = epoch;
    e->relabeled = 0;
    e->agreed_seq = 0;
    e->agreed_inc = 0;
    e->deadline = deadline_ms;
    atomic_store(&e->abort_flag, 0);
    e->abort_why[0] = '\0';
    e->abort_code = AMX_OK;
    e->abort_from = AMX_ENGINE_LOCAL;
    if (e->pend_epoch == epoch && amx_now_ms() - e->pend_at_ms <= PEND_ABORT_MS &&
        !abort_is_late(e, e->pend_seq, e->pend_inc)) {
        /* A peer failed this epoch before it started here. */
        atomic_store(&e->abort_flag, 1);
        snprintf(e->abort_why, sizeof(e->abort_why), "%s", e->pend_why);
        e->abort_code = e->pend_code;
        e->abort_from = e->pend_from;
    }
    if (e->pend_epoch <= epoch)
        e->pend_epoch = 0;
    e->have_work = 1;
    atomic_store(&e->work, 1);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

void amx_engine_expect(amx_engine_t *e)
{
    if (!e->busy_poll || atomic_exchange(&e->expect, 1))
        return;
    pthread_mutex_lock(&e->mu);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

amx_epoch_result_t *amx_engine_result(amx_engine_t *e)
{
    return &e->res;
}

void amx_engine_abort(amx_engine_t *e, uint64_t gen, uint64_t epoch, uint64_t agreement,
                      uint64_t coord_inc, uint32_t from, amx_status_t code, const char *why)
{
    pthread_mutex_lock(&e->mu);
    uint64_t cur = atomic_load(&e->comm_gen);
    /* About the communicator in use here (the sender dropped it): whatever
     * the epoch, what runs on it would wait for the sender. */
    int on_comm = gen != 0 && gen == cur;
    if (!on_comm && epoch != 0) {
        if (abort_is_late(e, agreement, coord_inc)) {
            AMX_INFO("engine",
                     "job %s: the abort of epoch %llu from daemon %u is about agreement %llu, "
                     "an attempt that has ended here: ignored",
                     e->job->name, (unsigned long long)epoch, from, (unsigned long long)agreement);
            pthread_mutex_unlock(&e->mu);
            return;
        }
        if (e->relabeled != 0 && epoch == e->relabeled) {
            /* The epoch this attempt became when it caught up: about it. */
            epoch = e->start_epoch;
        }
        if (epoch > e->start_epoch) {
            /* An epoch not started here yet: kept for when it starts. */
            e->pend_epoch = epoch;
            e->pend_seq = agreement;
            e->pend_inc = coord_inc;
            e->pend_at_ms = amx_now_ms();
            e->pend_code = code;
            e->pend_from = from;
            snprintf(e->pend_why, sizeof(e->pend_why), "%s", why);
            pthread_mutex_unlock(&e->mu);
            return;
        }
    }
    if (!on_comm && (gen != 0 || epoch != 0) && (epoch == 0 || epoch != e->start_epoch)) {
        /* About a communicator this daemon no longer uses, or another
         * epoch: an attempt that is already agreeing again must not be
         * disturbed. (gen 0 and epoch 0: a local abort of whatever runs.) */
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
    amx__engine_stat_free(e);
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
