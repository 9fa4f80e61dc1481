/*
 * engine_stat.c - the statistics of calibrators beyond max in an epoch
 * (docs/API.md "Calibration beyond max", docs/NUMERICS.md): the SUM
 * collective beside the MAX one, accumulation, each quantizer's
 * calibrated amax (calib.h), and the bases fixed from the reconciled max. The histogram methods run
 * where the state's backend offers them (the CUDA backend: on the device), else on the host; the
 * MSE searches on the host.
 *
 * Engine thread of the job, like the rest of an epoch (engine.c); the
 * replicated basis and epochs live in the state (state.h) and move with
 * it through layout changes, catch-up and snapshots.
 */
#include "engine_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "calib.h"
#include "clock.h"
#include "comm.h"
#include "log.h"

/* Whether some quantizer of the working catalog has an agreed basis that
 * this epoch keeps (a reset clears it): then the statistic is reduced. */
static int any_open(const amx_engine_t *e)
{
    const amx_state_t *st = e->job->state;
    if (e->w_cat->nstat == 0 || st->sq_epoch == NULL)
        return 0;
    for (uint32_t i = 0; i < e->w_cat->n; i++)
        if (e->w_desc[i].stat != 0 && st->sq_epoch[i] != 0 && !e->w_desc[i].reset)
            return 1;
    return 0;
}

amx_status_t amx__engine_stat_collective(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    amx_err_t err = {0};
    if (!any_open(e))
        return AMX_OK;
    uint64_t n = e->w_cat->nstat;
    double *send, *recv;
    void *stream;
    if (e->comm->ops->allreduce_sum_f64 == NULL)
        return amx__engine_fail(e, AMX_EINTERNAL,
                                "job '%s': the %s collective cannot sum statistics", j->name,
                                e->env.collective);
    if (e->comm->ops->soon != NULL)
        e->comm->ops->soon(e->comm);
    amx_status_t st = j->state->ops->stat_prepare(j->state, n, &send, &recv, &stream, &err);
    if (st != AMX_OK)
        return amx__engine_fail(e, st, "job '%s': %s", j->name, err.msg);
    uint64_t t0 = amx_now_us();
    st = e->comm->ops->allreduce_sum_f64(e->comm, send, recv, n, stream, e->deadline, &err);
    e->res.collective_us += amx_now_us() - t0;
    e->res.collectives++;
    if (st != AMX_OK) {
        if (atomic_load(&e->abort_flag))
            return amx__engine_fail_aborted(e, "the statistics' collective");
        return amx__engine_fail(e, st,
                                "job '%s', epoch %llu: the %s all-reduce(SUM) of %llu statistic "
                                "values across %u daemons failed: %s",
                                j->name, (unsigned long long)e->epoch, e->env.collective,
                                (unsigned long long)n, j->mship.npart, err.msg);
    }
    return AMX_OK;
}

static int grow(void **p, uint64_t *cap, uint64_t n, size_t elem)
{
    if (n <= *cap && *p != NULL)
        return 0;
    void *q = realloc(*p, (size_t)(n ? n : 1) * elem);
    if (q == NULL)
        return -1;
    *p = q;
    *cap = n;
    return 0;
}

/* The counts of histogram quantizer i summed (its bins, not the overflow
 * count). */
static double hist_total(const amx_engine_t *e, uint32_t i)
{
    const double *s = e->shost + e->w_desc[i].sbase;
    double total = 0.0;
    for (uint32_t b = 0; b < e->w_cat->q[i]->calib.num_bins; b++)
        total += s[b];
    return total;
}

/* Whether histogram quantizer i's statistic is last epoch's (its amax is
 * in e->ocache). */
static int hist_cached(const amx_engine_t *e, uint32_t i, int cache)
{
    const amx_qdesc_t *d = &e->w_desc[i];
    return cache &&
           memcmp(e->shost + d->sbase, e->sprev + d->sbase, d->svals * sizeof(double)) == 0;
}

/*
 * The histogram quantizers' amax on the state's device where the backend
 * computes them there (state.h stat_hist): every quantizer with counts
 * whose amax is not cached, into e->ovr; what the backend leaves NaN (an
 * entropy near-tie) hist_amax computes on the host.
 */
static amx_status_t hist_on_device(amx_engine_t *e, int cache)
{
    amx_state_t *st = e->job->state;
    const amx_catalog_t *cat = e->w_cat;
    amx_err_t err = {0};
    size_t n = 0;
    for (uint32_t i = 0; i < cat->n; i++)
        n += e->w_desc[i].stat == AMX_CAL_HISTOGRAM && st->sq_epoch[i] != 0;
    if (n == 0 || st->ops->stat_hist == NULL)
        return AMX_OK;
    amx_hist_job_t *jobs = malloc(n * sizeof(*jobs));
    uint32_t *who = malloc(n * sizeof(*who));
    float *out = malloc(n * sizeof(*out));
    if (jobs == NULL || who == NULL || out == NULL) {
        free(jobs), free(who), free(out);
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory for the statistics of job '%s'",
                                e->job->name);
    }
    n = 0;
    for (uint32_t i = 0; i < cat->n; i++) {
        const amx_qdesc_t *d = &e->w_desc[i];
        if (d->stat != AMX_CAL_HISTOGRAM || st->sq_epoch[i] == 0 || !(hist_total(e, i) > 0.0) ||
            hist_cached(e, i, cache))
            continue;
        jobs[n] = (amx_hist_job_t){d->sbase, st->basis[d->obase], 0, cat->q[i]->calib};
        who[n++] = i;
    }
    amx_status_t rs = n > 0 ? st->ops->stat_hist(st, jobs, n, out, &err) : AMX_OK;
    for (size_t k = 0; rs == AMX_OK && k < n; k++)
        e->ovr[e->w_desc[who[k]].obase] = out[k];
    free(jobs), free(who), free(out);
    if (rs != AMX_OK)
        return amx__engine_fail(e, rs, "job '%s', epoch %llu: the histogram methods failed: %s",
                                e->job->name, (unsigned long long)e->epoch, err.msg);
    return AMX_OK;
}

/* The calibrated amax of histogram quantizer i (one stat cell) from the
 * summed counts `s` (the device's when hist_on_device gave one), and its
 * published counts. */
static void hist_amax(amx_engine_t *e, uint32_t i, const double *s, int cached)
{
    const amx_qdesc_t *d = &e->w_desc[i];
    const amx_calib_t *c = &e->w_cat->q[i]->calib;
    amx_stat_result_t *r = &e->sres[i];
    double total = hist_total(e, i);
    r->total = total;
    r->overflow = s[c->num_bins];
    if (!(total > 0.0)) {
        r->state = AMX_STAT_AGREED;
        return;
    }
    r->state = AMX_STAT_COMPUTED;
    if (cached) {
        e->ovr[d->obase] = e->ocache[d->obase];
        return;
    }
    if (isnan(e->ovr[d->obase]))
        e->ovr[d->obase] = amx_hist_amax(c, s, e->job->state->basis[d->obase], e->sscratch);
}

/* The amax of each cell of MSE-search quantizer i with losses: the basis
 * times the candidate of the smallest summed loss. */
static void mse_amax(amx_engine_t *e, uint32_t i, const double *s, float *cand)
{
    const amx_qdesc_t *d = &e->w_desc[i];
    const amx_calib_t *c = &e->w_cat->q[i]->calib;
    const float *basis = e->job->state->basis + d->obase;
    amx_stat_result_t *r = &e->sres[i];
    uint64_t have = 0, k1 = (uint64_t)c->nsteps + 1;
    amx_mse_candidates(c, cand);
    for (uint64_t cell = 0; cell < d->ncells; cell++) {
        const double *l = s + cell * k1;
        if (!(l[c->nsteps] > 0.0))
            continue; /* no rank sent losses for this cell */
        uint32_t k = amx_mse_argmin(l, c->nsteps);
        /* MseCalibrator._compute_candidate_amax: initial_amax * candidate,
         * float32. */
        e->ovr[d->obase + cell] = basis[cell] * cand[k];
        have++;
    }
    r->total = (double)have;
    r->state = have == d->ncells && have > 0 ? AMX_STAT_COMPUTED : AMX_STAT_AGREED;
}

/*
 * The amax of each block of NVFP4 per-block-search quantizer i that a rank
 * searched: per block the summed (amax, amax^2, count) of the ranks that
 * sent one. Ranks that sent the same amax v (replicas of a block, or one
 * rank again in a later epoch) sum to (k v, k v^2, k): v = sum / k, and
 * sum of squares == v * sum holds exactly (v is a float32, k v^2 and k v
 * need at most 53 bits for k <= 32). Different amaxes break it: their
 * candidates differ by more than an eighth, far above float64 rounding.
 * Such a block keeps its max and is counted in `overflow`.
 */
static void nvfp4_amax(amx_engine_t *e, uint32_t i, const double *s)
{
    const amx_qdesc_t *d = &e->w_desc[i];
    float g = e->job->state->basis[d->obase];
    amx_stat_result_t *r = &e->sres[i];
    uint64_t have = 0, clash = 0;
    float cand[AMX_NVFP4_MSE_STEPS];
    amx_nvfp4_mse_candidates(cand);
    for (uint64_t cell = 0; cell < d->ncells; cell++) {
        const double *t = s + 3 * cell;
        if (!(t[2] > 0.0))
            continue; /* no rank searched this block */
        double v = t[0] / t[2];
        if (t[1] != v * t[0] || amx_nvfp4_mse_index(cand, g, v) < 0) {
            clash++;
            continue;
        }
        e->ovr[d->obase + cell] = (float)v;
        have++;
    }
    if (clash > 0)
        AMX_WARN("engine",
                 "job '%s', epoch %llu: quantizer '%s': ranks sent different amaxes for %llu "
                 "blocks of its NVFP4 per-block search; they keep their max (Reset the "
                 "quantizer and let one rank per block search it)",
                 e->job->name, (unsigned long long)e->epoch, e->w_cat->q[i]->name,
                 (unsigned long long)clash);
    r->total = (double)have;
    r->overflow = (double)clash;
    r->state = have == d->ncells && have > 0 ? AMX_STAT_COMPUTED : AMX_STAT_AGREED;
}

amx_status_t amx__engine_stat_begin(amx_engine_t *e, int from_send)
{
    amx_job_t *j = e->job;
    amx_state_t *st = j->state;
    const amx_catalog_t *cat = e->w_cat;
    amx_err_t err = {0};
    st->ovr = NULL;
    if (cat->nstat == 0)
        return AMX_OK;
    uint32_t nq = cat->n;
    uint64_t ns = cat->nscell;
    if (st->sq_epoch == NULL || st->basis == NULL || st->nstat != cat->nstat || st->nscell != ns)
        return amx__engine_fail(
            e, AMX_EINTERNAL, "job '%s': the statistics hold %llu values, the catalog %llu",
            j->name, (unsigned long long)st->nstat, (unsigned long long)cat->nstat);
    size_t scratch = 0;
    for (uint32_t i = 0; i < nq; i++)
        if (e->w_desc[i].stat == AMX_CAL_HISTOGRAM) {
            size_t k = amx_hist_scratch(&cat->q[i]->calib);
            scratch = k > scratch ? k : scratch;
        } else if (e->w_desc[i].stat == AMX_CAL_MSE) {
            size_t k = (size_t)cat->q[i]->calib.nsteps * sizeof(float);
            scratch = k > scratch ? k : scratch;
        }
    if (ns > e->ovr_cap || e->ovr == NULL) {
        float *a = realloc(e->ovr, (size_t)(ns ? ns : 1) * sizeof(float));
        if (a != NULL)
            e->ovr = a;
        float *b = realloc(e->ocache, (size_t)(ns ? ns : 1) * sizeof(float));
        if (b != NULL)
            e->ocache = b;
        float *c = realloc(e->otmp, (size_t)(ns ? ns : 1) * sizeof(float));
        if (c != NULL)
            e->otmp = c;
        if (a == NULL || b == NULL || c == NULL)
            return amx__engine_fail(e, AMX_ENOMEM, "out of memory for the statistics of job '%s'",
                                    j->name);
        e->ovr_cap = ns;
        e->scache_ok = 0;
    }
    uint64_t scap = e->sscratch_cap, rc = e->sres_cap;
    if (grow((void **)&e->shost, &e->shost_cap, cat->nstat, sizeof(double)) != 0 ||
        grow((void **)&e->sres, &rc, nq, sizeof(amx_stat_result_t)) != 0 ||
        grow(&e->sscratch, &scap, scratch, 1) != 0)
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory for the statistics of job '%s'",
                                j->name);
    e->sres_cap = (uint32_t)rc;
    e->sscratch_cap = (size_t)scap;
    amx_run_t *clear = malloc((size_t)(nq ? nq : 1) * sizeof(amx_run_t));
    amx_run_t *add = malloc((size_t)(nq ? nq : 1) * sizeof(amx_run_t));
    if (clear == NULL || add == NULL) {
        free(clear), free(add);
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory for the statistics of job '%s'",
                                j->name);
    }
    size_t nclear = 0, nadd = 0;
    for (uint32_t i = 0; i < nq; i++) {
        const amx_qdesc_t *d = &e->w_desc[i];
        if (d->stat == 0)
            continue;
        if (d->reset) {
            /* Reset: the statistic, the basis and this epoch's values go
             * (they were counted against the basis being cleared). */
            clear[nclear++] = (amx_run_t){d->sbase, d->sbase, d->svals};
            st->sq_epoch[i] = 0;
            memset(st->basis + d->obase, 0, amx_qspec_stat_cells(cat->q[i]) * sizeof(float));
        } else if (st->sq_epoch[i] != 0) {
            add[nadd++] = (amx_run_t){d->sbase, d->sbase, d->svals};
        }
    }
    amx_status_t rs = st->ops->stat_accumulate(st, cat->nstat, clear, nclear, add, nadd, from_send,
                                               e->shost, &err);
    free(clear);
    free(add);
    if (rs != AMX_OK)
        return amx__engine_fail(e, rs, "job '%s', epoch %llu: accumulating statistics failed: %s",
                                j->name, (unsigned long long)e->epoch, err.msg);
    int cache = e->scache_ok && e->scache_gen == e->desc_gen && e->sprev_n == cat->nstat;
    for (uint64_t c = 0; c < ns; c++)
        e->ovr[c] = NAN;
    AMX_CHECK(hist_on_device(e, cache));
    for (uint32_t i = 0; i < nq; i++) {
        const amx_qdesc_t *d = &e->w_desc[i];
        amx_stat_result_t *r = &e->sres[i];
        memset(r, 0, sizeof(*r));
        if (d->stat == 0)
            continue;
        r->epoch = st->sq_epoch[i];
        if (st->sq_epoch[i] == 0) {
            r->state = AMX_STAT_WAITING;
            continue;
        }
        const double *s = e->shost + d->sbase;
        if (d->stat == AMX_CAL_HISTOGRAM) {
            hist_amax(e, i, s, hist_cached(e, i, cache));
        } else if (d->stat == AMX_CAL_NVFP4_MSE) {
            nvfp4_amax(e, i, s);
        } else {
            mse_amax(e, i, s, (float *)e->sscratch);
        }
    }
    uint64_t pn = e->sprev_n;
    if (grow((void **)&e->sprev, &pn, cat->nstat, sizeof(double)) == 0) {
        (void)pn;
        memcpy(e->sprev, e->shost, cat->nstat * sizeof(double));
        memcpy(e->ocache, e->ovr, ns * sizeof(float));
        e->sprev_n = cat->nstat;
        e->scache_gen = e->desc_gen;
        e->scache_ok = 1;
    } else {
        e->scache_ok = 0;
    }
    st->ovr = e->ovr;
    return AMX_OK;
}

amx_status_t amx__engine_stat_end(amx_engine_t *e)
{
    amx_job_t *j = e->job;
    amx_state_t *st = j->state;
    const amx_catalog_t *cat = e->w_cat;
    amx_err_t err = {0};
    st->ovr = NULL;
    if (cat->nstat == 0)
        return AMX_OK; /* nothing to publish: results read p_sq only for calibrators */
    uint32_t nq = cat->n;
    /* Bases: a quantizer without one takes this epoch's reconciled max of
     * every cell once every cell has data. */
    amx_run_t *runs = malloc((size_t)(nq ? nq : 1) * sizeof(amx_run_t));
    if (runs == NULL)
        return amx__engine_fail(e, AMX_ENOMEM, "out of memory for the statistics of job '%s'",
                                j->name);
    size_t nr = 0;
    for (uint32_t i = 0; i < nq; i++) {
        const amx_qdesc_t *d = &e->w_desc[i];
        if (d->stat != 0 && st->sq_epoch[i] == 0)
            runs[nr++] = (amx_run_t){d->obase, d->base, d->ncells};
    }
    amx_status_t rs = AMX_OK;
    if (nr > 0)
        rs = st->ops->read_accum(st, runs, nr, e->otmp, &err);
    free(runs);
    if (rs != AMX_OK)
        return amx__engine_fail(e, rs, "job '%s', epoch %llu: reading the max failed: %s", j->name,
                                (unsigned long long)e->epoch, err.msg);
    for (uint32_t i = 0; nr > 0 && i < nq; i++) {
        const amx_qdesc_t *d = &e->w_desc[i];
        if (d->stat == 0 || st->sq_epoch[i] != 0)
            continue;
        uint64_t ncell = amx_qspec_stat_cells(cat->q[i]);
        int all = 1;
        for (uint64_t c = 0; c < ncell; c++)
            all &= e->otmp[d->obase + c] != -INFINITY;
        if (!all)
            continue;
        if (d->global_of_max) {
            /* The NVFP4 per-block search: its basis is the global amax
             * this epoch reconciled (its scale group's when it has one). */
            float g = st->g_amax[st->front ^ 1][i];
            for (uint64_t c = 0; c < ncell; c++)
                st->basis[d->obase + c] = g;
        } else {
            memcpy(st->basis + d->obase, e->otmp + d->obase, ncell * sizeof(float));
        }
        st->sq_epoch[i] = e->epoch;
        e->sres[i].epoch = e->epoch;
        e->sres[i].state = AMX_STAT_AGREED;
    }
    /* Published with the back outputs. */
    int back = st->front ^ 1;
    AMX_CHECK(amx__state_size_stat_results(st, back, nq, cat->nscell, &err));
    if (cat->nscell > 0)
        memcpy(st->p_basis[back], st->basis, cat->nscell * sizeof(float));
    memcpy(st->p_sq[back], e->sres, (size_t)nq * sizeof(amx_stat_result_t));
    return AMX_OK;
}

void amx__engine_stat_free(amx_engine_t *e)
{
    free(e->shost);
    free(e->sprev);
    free(e->ovr);
    free(e->ocache);
    free(e->otmp);
    free(e->sres);
    free(e->sscratch);
}
