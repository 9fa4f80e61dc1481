/*
 * state_host.c - the host state backend: every buffer in ordinary memory and
 * the post-processing in plain C, with the per-cell arithmetic of recipe.h
 * and postproc.h (shared with the CUDA kernels).
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "calib_core.h"
#include "clock.h"
#include "postproc.h"
#include "state.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#define HOST_SSE2 1
#endif

typedef struct host_state {
    int simulate_fault; /* AMAXD_TEST_DEVICE_FAULT: finish fails as a device would */
    /* Made by the engine's remap for the loop's remap_active: the active
     * buffer of the new layout, already -inf (the loop only copies). */
    float *next_active;
    uint64_t next_active_n;
    /* Cells grow_pending added and fill_pending has yet to set. */
    uint64_t unfilled_from[2], unfilled_to[2];
    float *pend[2];     /* AMX_HDR_CELLS + pend_n[k] floats */
    uint64_t pend_n[2]; /* data cells of each pending buffer */
    int active;         /* the pending buffer SendAmax merges into */
    float *recv;        /* AMX_HDR_CELLS + recv_n */
    uint64_t recv_n;
    float *accum, *prev;                      /* st->ncells */
    float *hist;                              /* st->nhist */
    float *prev_g;                            /* st->nq */
    float *prev_gs;                           /* st->nslices */
    float *o_amax[2], *o_scale[2], *o_inv[2]; /* st->out_cells[k] */
    uint8_t *o_bytes[2];
    /* Per output set: 1 where finish filled the cell from its peer group;
     * valid only when filled_ok (a remap or import leaves it unknown). */
    uint8_t *o_filled[2];
    uint64_t filled_cap[2];
    int filled_ok[2];
    float *group_max; /* scratch: peer groups then scale groups */
    size_t group_cap;
    /* Statistics (state.h): pending[2] (flipped with pend), receive and
     * accumulated sums, all of st->nstat float64 values; the active
     * buffer remap_active installs, zeroed by remap. */
    double *spend[2], *srecv, *saccum, *snext;
    uint64_t spend_n[2], srecv_n, snext_n;
} host_state_t;

static void fill(float *p, uint64_t n, float v)
{
#ifdef HOST_SSE2
    __m128 x = _mm_set1_ps(v);
    uint64_t n4 = n / 4;
    for (uint64_t k = 0; k < n4; k++)
        _mm_storeu_ps(p + 4 * k, x);
    p += 4 * n4;
    n -= 4 * n4;
#endif
    for (uint64_t i = 0; i < n; i++)
        p[i] = v;
}

/* A fresh array of n floats set to v (n may be 0), or NULL. */
static float *fresh(uint64_t n, float v)
{
    float *p = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (p != NULL)
        fill(p, n, v);
    return p;
}

static void copy_runs(void *dst, const void *src, size_t elem, const amx_run_t *runs, size_t n)
{
    for (size_t r = 0; r < n; r++)
        if (runs[r].len > 0)
            memcpy((char *)dst + runs[r].dst * elem, (const char *)src + runs[r].src * elem,
                   runs[r].len * elem);
}

/* Replaces float array *p (old layout) by a new one of n entries: runs
 * copied, the rest `v`. */
static amx_status_t remap_floats(float **p, uint64_t n, float v, const amx_run_t *runs,
                                 size_t nruns)
{
    float *np = fresh(n, v);
    if (np == NULL)
        return AMX_ENOMEM;
    if (*p != NULL)
        copy_runs(np, *p, sizeof(float), runs, nruns);
    free(*p);
    *p = np;
    return AMX_OK;
}

/* ---- loop thread ---- */

/* Grows pending buffer k to n cells; the new cells are set to -inf now, or
 * left for fill_pending (`lazy`). realloc of a large block moves pages,
 * not bytes, so only the fill is proportional to the growth. */
static amx_status_t grow_pend(host_state_t *h, int k, uint64_t n, int lazy)
{
    if (n <= h->pend_n[k] && h->pend[k] != NULL)
        return AMX_OK;
    float *p = realloc(h->pend[k], (size_t)(AMX_HDR_CELLS + n) * sizeof(float));
    if (p == NULL)
        return AMX_ENOMEM;
    uint64_t old = h->pend[k] == NULL ? 0 : h->pend_n[k];
    if (h->pend[k] == NULL)
        fill(p, AMX_HDR_CELLS, 0.0f);
    if (lazy) {
        if (h->unfilled_to[k] == h->unfilled_from[k])
            h->unfilled_from[k] = old;
        h->unfilled_to[k] = n;
    } else {
        fill(p + AMX_HDR_CELLS + old, n - old, -INFINITY);
    }
    h->pend[k] = p;
    h->pend_n[k] = n;
    return AMX_OK;
}

static void host_fill_pending(amx_state_t *st);

static amx_status_t host_reserve_pending(amx_state_t *st, uint64_t ncells, amx_err_t *err)
{
    host_state_t *h = st->impl;
    host_fill_pending(st); /* cells a growth left unset (it never runs during one) */
    if (grow_pend(h, 0, ncells, 0) != AMX_OK || grow_pend(h, 1, ncells, 0) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory growing pending amax to %llu cells",
                           (unsigned long long)ncells);
    st->pend_cells = h->pend_n[h->active];
    return AMX_OK;
}

static void host_fill_pending(amx_state_t *st);

static amx_status_t host_grow_pending(amx_state_t *st, uint64_t ncells, amx_err_t *err)
{
    host_state_t *h = st->impl;
    if (grow_pend(h, 0, ncells, 1) != AMX_OK || grow_pend(h, 1, ncells, 1) != AMX_OK) {
        host_fill_pending(st); /* what did grow is filled now: no cell stays unset */
        return amx_err_set(err, AMX_ENOMEM, "out of host memory growing pending amax to %llu cells",
                           (unsigned long long)ncells);
    }
    st->pend_cells = h->pend_n[h->active];
    return AMX_OK;
}

static void host_fill_pending(amx_state_t *st)
{
    host_state_t *h = st->impl;
    for (int k = 0; k < 2; k++) {
        if (h->unfilled_to[k] > h->unfilled_from[k])
            fill(h->pend[k] + AMX_HDR_CELLS + h->unfilled_from[k],
                 h->unfilled_to[k] - h->unfilled_from[k], -INFINITY);
        h->unfilled_from[k] = h->unfilled_to[k] = 0;
    }
}

/* dst[i] = amx_fmaxf(dst[i], src[i]) (MAXPS is the same operation). */
static void max_into(float *dst, const float *src, uint64_t n)
{
    uint64_t i = 0;
#ifdef HOST_SSE2
    for (; n - i >= 4; i += 4)
        _mm_storeu_ps(dst + i, _mm_max_ps(_mm_loadu_ps(dst + i), _mm_loadu_ps(src + i)));
#endif
    for (; i < n; i++)
        dst[i] = amx_fmaxf(dst[i], src[i]);
}

static amx_status_t host_merge(amx_state_t *st, const float *vals, uint64_t nvals,
                               const amx_run_t *runs, size_t nruns, int overlap, amx_err_t *err)
{
    host_state_t *h = st->impl;
    float *pend = h->pend[h->active] + AMX_HDR_CELLS;
    (void)nvals, (void)overlap, (void)err;
    for (size_t r = 0; r < nruns; r++)
        max_into(pend + runs[r].dst, vals + runs[r].src, runs[r].len);
    return AMX_OK;
}

static void host_flip(amx_state_t *st)
{
    host_state_t *h = st->impl;
    h->active ^= 1;
    st->pend_cells = h->pend_n[h->active];
}

static amx_status_t host_unflip(amx_state_t *st, int keep, amx_err_t *err)
{
    host_state_t *h = st->impl;
    int fl = h->active ^ 1;
    float *a = h->pend[h->active] + AMX_HDR_CELLS, *f = h->pend[fl] + AMX_HDR_CELLS;
    uint64_t n = h->pend_n[fl] < h->pend_n[h->active] ? h->pend_n[fl] : h->pend_n[h->active];
    (void)err;
    if (keep)
        max_into(a, f, n);
    fill(f, h->pend_n[fl], -INFINITY);
    uint64_t ns = h->spend_n[fl] < h->spend_n[h->active] ? h->spend_n[fl] : h->spend_n[h->active];
    for (uint64_t i = 0; keep && i < ns; i++)
        h->spend[h->active][i] += h->spend[fl][i];
    if (h->spend[fl] != NULL)
        memset(h->spend[fl], 0, h->spend_n[fl] * sizeof(double));
    return AMX_OK;
}

/* Pending buffer k to the layout of lc (data cells lc->ncells). */
static amx_status_t remap_pend(host_state_t *h, int k, const amx_layout_change_t *lc)
{
    float *np = malloc((size_t)(AMX_HDR_CELLS + lc->ncells) * sizeof(float));
    if (np == NULL)
        return AMX_ENOMEM;
    fill(np, AMX_HDR_CELLS, 0.0f);
    fill(np + AMX_HDR_CELLS, lc->ncells, -INFINITY);
    if (h->pend[k] != NULL)
        copy_runs(np + AMX_HDR_CELLS, h->pend[k] + AMX_HDR_CELLS, sizeof(float), lc->pend,
                  lc->npend_runs);
    free(h->pend[k]);
    h->pend[k] = np;
    h->pend_n[k] = lc->ncells;
    return AMX_OK;
}

static amx_status_t host_remap_active(amx_state_t *st, const amx_layout_change_t *lc,
                                      amx_err_t *err)
{
    host_state_t *h = st->impl;
    int k = h->active;
    if (h->next_active != NULL && h->next_active_n == lc->ncells) {
        /* The engine made the buffer (remap): the loop only copies cells. */
        if (h->pend[k] != NULL)
            copy_runs(h->next_active + AMX_HDR_CELLS, h->pend[k] + AMX_HDR_CELLS, sizeof(float),
                      lc->pend, lc->npend_runs);
        free(h->pend[k]);
        h->pend[k] = h->next_active;
        h->pend_n[k] = lc->ncells;
        h->next_active = NULL;
    } else if (remap_pend(h, k, lc) != AMX_OK) {
        return amx_err_set(err, AMX_ENOMEM, "out of host memory remapping pending amax");
    }
    st->pend_cells = h->pend_n[k];
    /* The active stat buffer is empty (statistics are taken only while
     * nothing is in flight): it only takes the new size. */
    if (h->snext != NULL && h->snext_n == lc->nstat) {
        free(h->spend[k]);
        h->spend[k] = h->snext;
        h->spend_n[k] = lc->nstat;
        h->snext = NULL;
    } else if (h->spend_n[k] != lc->nstat || h->spend[k] == NULL) {
        double *z = calloc(lc->nstat ? lc->nstat : 1, sizeof(double));
        if (z == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory remapping pending statistics");
        free(h->spend[k]);
        h->spend[k] = z;
        h->spend_n[k] = lc->nstat;
    }
    return AMX_OK;
}

/* ---- statistics ---- */

/* Stat buffer k at n values at least (new values 0): both pending buffers
 * follow the replicated layout's size, whichever path (remap, import, a
 * restore) set it. */
static amx_status_t ensure_spend(host_state_t *h, int k, uint64_t n)
{
    if (h->spend[k] != NULL && h->spend_n[k] >= n)
        return AMX_OK;
    double *p = realloc(h->spend[k], (size_t)(n ? n : 1) * sizeof(double));
    if (p == NULL)
        return AMX_ENOMEM;
    uint64_t old = h->spend[k] == NULL ? 0 : h->spend_n[k];
    memset(p + old, 0, (size_t)(n - old) * sizeof(double));
    h->spend[k] = p;
    h->spend_n[k] = n;
    return AMX_OK;
}

static amx_status_t host_stat_merge(amx_state_t *st, const double *vals, uint64_t nvals,
                                    const amx_run_t *runs, size_t nruns, amx_err_t *err)
{
    host_state_t *h = st->impl;
    if (ensure_spend(h, h->active, st->nstat) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory for pending statistics");
    double *p = h->spend[h->active];
    (void)nvals;
    for (size_t r = 0; r < nruns; r++) {
        if (p == NULL || runs[r].dst + runs[r].len > h->spend_n[h->active])
            return amx_err_set(err, AMX_EINTERNAL, "statistic run past the stat buffer");
        for (uint64_t i = 0; i < runs[r].len; i++)
            p[runs[r].dst + i] += vals[runs[r].src + i];
    }
    return AMX_OK;
}

static amx_status_t host_stat_prepare(amx_state_t *st, uint64_t n, double **send, double **recv,
                                      void **stream, amx_err_t *err)
{
    host_state_t *h = st->impl;
    int fl = h->active ^ 1;
    if (ensure_spend(h, fl, n) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory for pending statistics");
    if (h->srecv == NULL || n > h->srecv_n) {
        double *r = realloc(h->srecv, (size_t)(n ? n : 1) * sizeof(double));
        if (r == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for a stat receive buffer");
        h->srecv = r;
        h->srecv_n = n;
    }
    *send = h->spend[fl];
    *recv = h->srecv;
    *stream = NULL;
    return AMX_OK;
}

static amx_status_t host_stat_accumulate(amx_state_t *st, uint64_t n, const amx_run_t *clear,
                                         size_t nclear, const amx_run_t *add, size_t nadd,
                                         int from_send, double *host, amx_err_t *err)
{
    host_state_t *h = st->impl;
    int fl = h->active ^ 1;
    if (ensure_spend(h, fl, n) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory for pending statistics");
    if (n != st->nstat || (n > 0 && h->saccum == NULL))
        return amx_err_set(err, AMX_EINTERNAL, "statistics over %llu values, the state holds %llu",
                           (unsigned long long)n, (unsigned long long)st->nstat);
    const double *red = from_send ? h->spend[fl] : h->srecv;
    for (size_t r = 0; r < nclear; r++)
        memset(h->saccum + clear[r].dst, 0, clear[r].len * sizeof(double));
    for (size_t r = 0; r < nadd; r++)
        for (uint64_t i = 0; i < add[r].len; i++)
            h->saccum[add[r].dst + i] += red[add[r].src + i];
    if (h->spend[fl] != NULL)
        memset(h->spend[fl], 0, h->spend_n[fl] * sizeof(double));
    if (n > 0)
        memcpy(host, h->saccum, n * sizeof(double));
    return AMX_OK;
}

static amx_status_t host_read_accum(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                    float *out, amx_err_t *err)
{
    host_state_t *h = st->impl;
    (void)err;
    copy_runs(out, h->accum, sizeof(float), runs, nruns);
    return AMX_OK;
}

/* A float64 array of n values: runs of *p copied, the rest 0. */
static amx_status_t remap_doubles(double **p, uint64_t n, const amx_run_t *runs, size_t nruns)
{
    double *np = calloc(n ? n : 1, sizeof(double));
    if (np == NULL)
        return AMX_ENOMEM;
    if (*p != NULL)
        copy_runs(np, *p, sizeof(double), runs, nruns);
    free(*p);
    *p = np;
    return AMX_OK;
}

static void host_publish(amx_state_t *st)
{
    st->front ^= 1;
}

static amx_status_t host_read_results(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                      uint64_t total, float *amax, float *scale, float *inv,
                                      uint8_t *bytes, amx_err_t *err)
{
    host_state_t *h = st->impl;
    int f = st->front;
    (void)total, (void)err;
    copy_runs(amax, h->o_amax[f], sizeof(float), runs, nruns);
    copy_runs(scale, h->o_scale[f], sizeof(float), runs, nruns);
    copy_runs(inv, h->o_inv[f], sizeof(float), runs, nruns);
    copy_runs(bytes, h->o_bytes[f], 1, runs, nruns);
    return AMX_OK;
}

static amx_status_t host_read_filled(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                     uint8_t *filled, amx_err_t *err)
{
    host_state_t *h = st->impl;
    int f = st->front;
    if (!h->filled_ok[f] || h->o_filled[f] == NULL)
        return amx_err_set(err, AMX_EUNAVAIL, "which cells were filled is not known");
    copy_runs(filled, h->o_filled[f], 1, runs, nruns);
    return AMX_OK;
}

/* ---- engine thread ---- */

/* Output set k sized for n cells and nq quantizers, contents undefined
 * (cells) / kept (globals). */
static amx_status_t size_outputs(amx_state_t *st, int k, uint64_t n, uint32_t nq, uint64_t ns,
                                 amx_err_t *err)
{
    host_state_t *h = st->impl;
    if (n != st->out_cells[k] || h->o_amax[k] == NULL) {
        float *a = realloc(h->o_amax[k], (size_t)(n ? n : 1) * sizeof(float));
        if (a != NULL)
            h->o_amax[k] = a;
        float *s = realloc(h->o_scale[k], (size_t)(n ? n : 1) * sizeof(float));
        if (s != NULL)
            h->o_scale[k] = s;
        float *i = realloc(h->o_inv[k], (size_t)(n ? n : 1) * sizeof(float));
        if (i != NULL)
            h->o_inv[k] = i;
        uint8_t *b = realloc(h->o_bytes[k], (size_t)(n ? n : 1));
        if (b != NULL)
            h->o_bytes[k] = b;
        if (a == NULL || s == NULL || i == NULL || b == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for %llu result cells",
                               (unsigned long long)n);
        st->out_cells[k] = n;
    }
    AMX_CHECK(amx__state_grow_globals(st, k, nq, err));
    st->out_nq[k] = nq;
    AMX_CHECK(amx__state_size_slices(st, k, ns, err));
    return AMX_OK;
}

static amx_status_t host_remap(amx_state_t *st, const amx_layout_change_t *lc, amx_err_t *err)
{
    host_state_t *h = st->impl;
    int fl = h->active ^ 1, back = st->front ^ 1;
    int src = lc->outputs_from_back ? back : st->front;
    if (remap_pend(h, fl, lc) != AMX_OK ||
        remap_floats(&h->accum, lc->ncells, -INFINITY, lc->cells, lc->ncell_runs) != AMX_OK ||
        remap_floats(&h->prev, lc->ncells, 1.0f, lc->cells, lc->ncell_runs) != AMX_OK ||
        remap_floats(&h->hist, lc->nhist, -INFINITY, lc->hist, lc->nhist_runs) != AMX_OK ||
        remap_floats(&h->prev_g, lc->nq, 1.0f, lc->qs, lc->nq_runs) != AMX_OK ||
        remap_floats(&h->prev_gs, lc->nslices, 1.0f, lc->slices, lc->nslice_runs) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory remapping the amax state");
    if (remap_doubles(&h->spend[fl], lc->nstat, lc->spend, lc->nspend_runs) != AMX_OK ||
        remap_doubles(&h->saccum, lc->nstat, lc->stat, lc->nstat_runs) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory remapping statistics");
    h->spend_n[fl] = lc->nstat;
    AMX_CHECK(amx__state_remap_stats(st, lc, src, back, err));
    free(h->snext);
    h->snext = calloc(lc->nstat ? lc->nstat : 1, sizeof(double));
    h->snext_n = lc->nstat;
    st->ncells = lc->ncells;
    st->nhist = lc->nhist;
    st->nq = lc->nq;
    st->nslices = lc->nslices;
    /* The loop's active buffer in the new layout, made here so that the
     * loop's remap_active only copies (without it, it does it all). */
    free(h->next_active);
    h->next_active = malloc((size_t)(AMX_HDR_CELLS + lc->ncells) * sizeof(float));
    h->next_active_n = lc->ncells;
    if (h->next_active != NULL) {
        fill(h->next_active, AMX_HDR_CELLS, 0.0f);
        fill(h->next_active + AMX_HDR_CELLS, lc->ncells, -INFINITY);
    }
    /* Results in the new layout, from the published ones (or the imported
     * ones), so that a failure after this point still publishes results
     * that match the layout. */
    float *na = fresh(lc->ncells, -INFINITY), *ns = fresh(lc->ncells, 1.0f),
          *ni = fresh(lc->ncells, 1.0f);
    uint8_t *nb = calloc(lc->ncells ? lc->ncells : 1, 1);
    float *ga = fresh(lc->nq, 0.0f), *gs = fresh(lc->nq, 1.0f), *gi = fresh(lc->nq, 1.0f);
    float *sa = fresh(lc->nslices, 0.0f), *ss = fresh(lc->nslices, 1.0f),
          *si = fresh(lc->nslices, 1.0f);
    if (na == NULL || ns == NULL || ni == NULL || nb == NULL || ga == NULL || gs == NULL ||
        gi == NULL || sa == NULL || ss == NULL || si == NULL) {
        free(na), free(ns), free(ni), free(nb), free(ga), free(gs), free(gi);
        free(sa), free(ss), free(si);
        return amx_err_set(err, AMX_ENOMEM, "out of host memory remapping results");
    }
    if (h->o_amax[src] != NULL) {
        copy_runs(na, h->o_amax[src], sizeof(float), lc->cells, lc->ncell_runs);
        copy_runs(ns, h->o_scale[src], sizeof(float), lc->cells, lc->ncell_runs);
        copy_runs(ni, h->o_inv[src], sizeof(float), lc->cells, lc->ncell_runs);
        copy_runs(nb, h->o_bytes[src], 1, lc->cells, lc->ncell_runs);
    }
    if (st->g_amax[src] != NULL) {
        copy_runs(ga, st->g_amax[src], sizeof(float), lc->qs, lc->nq_runs);
        copy_runs(gs, st->g_scale[src], sizeof(float), lc->qs, lc->nq_runs);
        copy_runs(gi, st->g_inv[src], sizeof(float), lc->qs, lc->nq_runs);
    }
    if (st->s_amax[src] != NULL) {
        copy_runs(sa, st->s_amax[src], sizeof(float), lc->slices, lc->nslice_runs);
        copy_runs(ss, st->s_scale[src], sizeof(float), lc->slices, lc->nslice_runs);
        copy_runs(si, st->s_inv[src], sizeof(float), lc->slices, lc->nslice_runs);
    }
    free(st->s_amax[back]), free(st->s_scale[back]), free(st->s_inv[back]);
    st->s_amax[back] = sa, st->s_scale[back] = ss, st->s_inv[back] = si;
    st->s_cap[back] = st->out_ns[back] = lc->nslices;
    free(h->o_amax[back]), free(h->o_scale[back]), free(h->o_inv[back]), free(h->o_bytes[back]);
    h->filled_ok[back] = 0; /* remapped results: which cells were filled is not known */
    free(st->g_amax[back]), free(st->g_scale[back]), free(st->g_inv[back]);
    h->o_amax[back] = na, h->o_scale[back] = ns, h->o_inv[back] = ni, h->o_bytes[back] = nb;
    st->g_amax[back] = ga, st->g_scale[back] = gs, st->g_inv[back] = gi;
    st->g_cap[back] = lc->nq;
    st->out_cells[back] = lc->ncells;
    st->out_nq[back] = lc->nq;
    return AMX_OK;
}

static amx_status_t host_prepare(amx_state_t *st, const float *hdr, uint64_t ncells, float **send,
                                 float **recv, void **stream, amx_err_t *err)
{
    host_state_t *h = st->impl;
    float *fl = h->pend[h->active ^ 1];
    if (fl == NULL || ncells > h->pend_n[h->active ^ 1])
        return amx_err_set(err, AMX_EINTERNAL, "in-flight buffer holds %llu cells, not %llu",
                           (unsigned long long)(fl ? h->pend_n[h->active ^ 1] : 0),
                           (unsigned long long)ncells);
    if (h->recv == NULL || ncells > h->recv_n) {
        float *r = realloc(h->recv, (size_t)(AMX_HDR_CELLS + ncells) * sizeof(float));
        if (r == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for a receive buffer");
        h->recv = r;
        h->recv_n = ncells;
    }
    memcpy(fl, hdr, AMX_HDR_CELLS * sizeof(float));
    /* A receive header nothing wrote fails the engine's check. */
    memset(h->recv, 0, AMX_HDR_CELLS * sizeof(float));
    *send = fl;
    *recv = h->recv;
    *stream = NULL;
    return AMX_OK;
}

static amx_status_t host_read_header(amx_state_t *st, float *hdr, amx_err_t *err)
{
    host_state_t *h = st->impl;
    (void)err;
    memcpy(hdr, h->recv, AMX_HDR_CELLS * sizeof(float));
    return AMX_OK;
}

/* ---- finishing an epoch ---- */

/* What the steps of host_finish share. */
typedef struct fin {
    host_state_t *h;
    amx_state_t *st;
    const float *red; /* this epoch's reduced values */
    int back;         /* the output set being written */
    uint64_t nfilled, nmissing;
    float *peer_max, *scale_max;
} fin_t;

/* Step 1 of quantizer q: accumulation into the output amax; returns the
 * max of its cells (-inf when none has data). */
static float fin_accumulate(fin_t *f, const amx_qdesc_t *q)
{
    host_state_t *h = f->h;
    float *out = h->o_amax[f->back] + q->base, *acc = h->accum + q->base;
    const float *red = f->red + q->base;
    uint64_t c = 0;
    float m = -INFINITY;
    if (q->accumulation == AMX_ACC_PER_EPOCH) {
        for (; c < q->ncells; c++) {
            float a = amx_pp_accumulate(q, &acc[c], h->hist + q->hist_base, c, red[c]);
            out[c] = a;
            m = amx_fmaxf(m, a);
        }
        return m;
    }
    if (q->stat != 0 && f->st->ovr != NULL) {
        /* A calibrator beyond max: the running max stays the basis's source;
         * the output is the calibrator's amax where it computed one. */
        const float *o = f->st->ovr + q->obase;
        for (; c < q->ncells; c++) {
            float a = amx_fmaxf(acc[c], red[c]);
            acc[c] = a;
            if (o[c] == o[c])
                a = o[c];
            out[c] = a;
            m = amx_fmaxf(m, a);
        }
        return m;
    }
#ifdef HOST_SSE2
    /* amx_fmaxf(a, b) = a > b ? a : b is exactly MAXPS(a, b); max is
     * exact and the values hold no NaN, so the lanes' order of the max
     * does not matter. */
    __m128 vm = _mm_set1_ps(-INFINITY);
    for (; q->ncells - c >= 4; c += 4) {
        __m128 a = _mm_max_ps(_mm_loadu_ps(acc + c), _mm_loadu_ps(red + c));
        _mm_storeu_ps(acc + c, a);
        _mm_storeu_ps(out + c, a);
        vm = _mm_max_ps(vm, a);
    }
    float l[4];
    _mm_storeu_ps(l, vm);
    m = amx_fmaxf(amx_fmaxf(l[0], l[1]), amx_fmaxf(l[2], l[3]));
#endif
    for (; c < q->ncells; c++) {
        float a = amx_fmaxf(acc[c], red[c]);
        acc[c] = a;
        out[c] = a;
        m = amx_fmaxf(m, a);
    }
    return m;
}

/* Step 2 of quantizer qi: its peer group's stage (marked and counted),
 * its max and its slices' (into the back globals), its scale group's. */
static void fin_peer(fin_t *f, const amx_qdesc_t *q, uint32_t qi)
{
    host_state_t *h = f->h;
    amx_state_t *st = f->st;
    float *out = h->o_amax[f->back] + q->base;
    uint8_t *marks = h->o_filled[f->back] + q->base;
    float m = -INFINITY;
    if (q->peer_group < 0 && q->nslices == 0) {
        /* Nothing raised: the marks are 0; count the cells without data. */
        memset(marks, 0, q->ncells);
        uint64_t c = 0, miss = 0;
#ifdef HOST_SSE2
        __m128 vm = _mm_set1_ps(-INFINITY), ninf = _mm_set1_ps(-INFINITY);
        __m128i cnt = _mm_setzero_si128();
        for (; q->ncells - c >= 4; c += 4) {
            __m128 a = _mm_loadu_ps(out + c);
            vm = _mm_max_ps(vm, a);
            cnt = _mm_sub_epi32(cnt, _mm_castps_si128(_mm_cmpeq_ps(a, ninf)));
        }
        float l[4];
        uint32_t k[4];
        _mm_storeu_ps(l, vm);
        _mm_storeu_si128((__m128i *)(void *)k, cnt);
        m = amx_fmaxf(amx_fmaxf(l[0], l[1]), amx_fmaxf(l[2], l[3]));
        miss = (uint64_t)k[0] + k[1] + k[2] + k[3];
#endif
        for (; c < q->ncells; c++) {
            miss += out[c] == -INFINITY;
            m = amx_fmaxf(m, out[c]);
        }
        f->nmissing += miss;
        if (q->global_of_max) {
            /* The NVFP4 per-block search: the global amax stays phase 1's,
             * the max of the running max, whatever amax the blocks took. */
            const float *acc = h->accum + q->base;
            m = -INFINITY;
            for (c = 0; c < q->ncells; c++)
                m = amx_fmaxf(m, acc[c]);
        }
    } else {
        float gm = q->peer_group >= 0 ? f->peer_max[q->peer_group] : -INFINITY;
        float *samax = st->s_amax[f->back];
        for (uint64_t c = 0; c < q->ncells; c++) {
            float *a = &out[c];
            uint8_t raised = 0;
            if (q->peer_group >= 0)
                *a = amx_pp_peer(q->peer_mode, *a, gm, &raised);
            f->nfilled += raised;
            f->nmissing += *a == -INFINITY;
            marks[c] = raised;
            m = amx_fmaxf(m, *a);
            if (q->nslices > 0) {
                float *sm = &samax[amx_pp_slice(q, c)];
                *sm = amx_fmaxf(*sm, *a);
            }
        }
    }
    st->g_amax[f->back][qi] = m;
    if (q->scale_group >= 0)
        f->scale_max[q->scale_group] = amx_fmaxf(f->scale_max[q->scale_group], m);
}

#ifdef HOST_SSE2
/* amx_pp_cell of FP8 current scaling (TE's output convention) over n
 * cells, four at a time: the same IEEE operations lane by lane (MAXPS is
 * `a > b ? a : b`, DIVPS rounds as DIVSS), so the same bits. */
static void fp8_current_cells(const amx_recipe_t *r, const float *amax, uint64_t n, float *scale,
                              float *inv, uint8_t *bytes)
{
    const __m128 zero = _mm_setzero_ps(), one = _mm_set1_ps(1.0f), inf = _mm_set1_ps(INFINITY),
                 big = _mm_set1_ps(amx_fp8_value_for_inf(r->rule)), eps = _mm_set1_ps(r->eps),
                 fmax = _mm_set1_ps(amx_fp8_max(r->format));
    const __m128 p2 = _mm_castsi128_ps(_mm_set1_epi32(r->power_of_2 ? (int)0xff800000u : -1));
    uint64_t c = 0;
    for (; n - c >= 4; c += 4) {
        __m128 v = _mm_max_ps(_mm_loadu_ps(amax + c), zero); /* a > 0 ? a : 0 */
        __m128 am = _mm_max_ps(eps, v);                      /* v < eps ? eps : v */
        __m128 ok = _mm_and_ps(_mm_cmplt_ps(am, inf), _mm_cmpneq_ps(am, zero));
        __m128 s = _mm_div_ps(fmax, am);
        __m128 fin = _mm_cmplt_ps(s, inf); /* s >= 0: not finite is +inf */
        s = _mm_or_ps(_mm_and_ps(fin, s), _mm_andnot_ps(fin, big));
        s = _mm_and_ps(s, p2);
        s = _mm_or_ps(_mm_and_ps(ok, s), _mm_andnot_ps(ok, one));
        _mm_storeu_ps(scale + c, s);
        _mm_storeu_ps(inv + c, _mm_div_ps(one, s));
    }
    memset(bytes, 0, n);
    for (; c < n; c++) {
        float v = amax[c] > 0.0f ? amax[c] : 0.0f;
        float s =
            amx_fp8_current_scale_rule(r->rule, v, amx_fp8_max(r->format), r->power_of_2, r->eps);
        scale[c] = s;
        inv[c] = amx_fp8_scale_inv(s);
    }
}
#endif

int amx__host_fp8_current_cells(const amx_recipe_t *r, const float *amax, uint64_t n, float *scale,
                                float *inv, uint8_t *bytes)
{
#ifdef HOST_SSE2
    fp8_current_cells(r, amax, n, scale, inv, bytes);
    return 1;
#else
    for (uint64_t c = 0; c < n; c++) {
        float s1, i1;
        uint8_t b1;
        amx_pp_cell(r, amax[c], 0.0f, 1.0f, 1.0f, NULL, &s1, &i1, &b1);
        scale[c] = s1, inv[c] = i1, bytes[c] = b1;
    }
    return 0;
#endif
}

/* Step 3 of quantizer qi: its global amax and scales, its slices', then
 * every cell's scales. */
static void fin_scales(fin_t *f, const amx_qdesc_t *q, uint32_t qi)
{
    host_state_t *h = f->h;
    amx_state_t *st = f->st;
    int back = f->back;
    float *samax = st->s_amax[back];
    float g = q->scale_group >= 0 ? f->scale_max[q->scale_group] : st->g_amax[back][qi];
    g = g > 0.0f ? g : 0.0f;
    st->g_amax[back][qi] = g;
    amx_pp_global(&q->recipe, g, &h->prev_g[qi], &st->g_scale[back][qi], &st->g_inv[back][qi]);
    for (uint64_t k = q->gbase; k < q->gbase + q->nslices; k++) {
        samax[k] = samax[k] > 0.0f ? samax[k] : 0.0f;
        amx_pp_global(&q->recipe, samax[k], &h->prev_gs[k], &st->s_scale[back][k],
                      &st->s_inv[back][k]);
    }
    uint64_t b = q->base;
#ifdef HOST_SSE2
    const amx_recipe_t *r = &q->recipe;
    if ((r->format == AMX_FMT_FP8_E4M3 || r->format == AMX_FMT_FP8_E5M2) &&
        r->rule != AMX_RULE_DELAYED && r->output_convention != AMX_OUT_MODELOPT) {
        fp8_current_cells(r, h->o_amax[back] + b, q->ncells, h->o_scale[back] + b,
                          h->o_inv[back] + b, h->o_bytes[back] + b);
        return;
    }
#endif
    float s_enc = st->g_scale[back][qi], s_dec = 1.0f / s_enc;
    for (uint64_t c = 0; c < q->ncells; c++) {
        uint64_t i = b + c;
        if (q->nslices > 0) {
            uint64_t k = amx_pp_slice(q, c);
            g = samax[k];
            s_enc = st->s_scale[back][k];
            s_dec = 1.0f / s_enc;
        }
        amx_pp_cell(&q->recipe, h->o_amax[back][i], g, s_enc, s_dec, &h->prev[i],
                    &h->o_scale[back][i], &h->o_inv[back][i], &h->o_bytes[back][i]);
    }
}

static amx_status_t host_finish(amx_state_t *st, const amx_qdesc_t *qs, uint32_t nq,
                                uint64_t ncells, uint32_t npeer, uint32_t nscale, int from_send,
                                int desc_dirty, amx_err_t *err)
{
    (void)desc_dirty;
    host_state_t *h = st->impl;
    if (h->simulate_fault)
        return amx_err_set(err, AMX_EDEVICE,
                           "simulated device fault (AMAXD_TEST_DEVICE_FAULT is set; a test aid)");
    uint64_t t0 = amx_now_us();
    int fl = h->active ^ 1, back = st->front ^ 1;
    if (ncells != st->ncells)
        return amx_err_set(err, AMX_EINTERNAL, "finish over %llu cells, the state holds %llu",
                           (unsigned long long)ncells, (unsigned long long)st->ncells);
    size_t ngroups = (size_t)npeer + nscale;
    if (ngroups > h->group_cap) {
        float *g = realloc(h->group_max, ngroups * sizeof(float));
        if (g == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for %zu group maxima", ngroups);
        h->group_max = g;
        h->group_cap = ngroups;
    }
    uint64_t nsl = amx_qdesc_slices(qs, nq);
    if (nsl != st->nslices)
        return amx_err_set(err, AMX_EINTERNAL,
                           "finish over %llu global slices, the state holds %llu",
                           (unsigned long long)nsl, (unsigned long long)st->nslices);
    AMX_CHECK(size_outputs(st, back, ncells, nq, nsl, err));
    const float *red = (from_send ? h->pend[fl] : h->recv) + AMX_HDR_CELLS;
    float *peer_max = h->group_max;
    float *scale_max = h->group_max != NULL ? h->group_max + npeer : NULL;
    for (size_t i = 0; i < ngroups; i++)
        h->group_max[i] = -INFINITY;
    /* 0. Resets agreed for this epoch. */
    for (uint32_t qi = 0; qi < nq; qi++) {
        const amx_qdesc_t *q = &qs[qi];
        if (!q->reset)
            continue;
        fill(h->accum + q->base, q->ncells, -INFINITY);
        fill(h->prev + q->base, q->ncells, 1.0f);
        if (q->accumulation == AMX_ACC_PER_EPOCH)
            fill(h->hist + q->hist_base, (uint64_t)q->hist_len * q->ncells, -INFINITY);
        h->prev_g[qi] = 1.0f;
        if (q->nslices > 0)
            fill(h->prev_gs + q->gbase, q->nslices, 1.0f);
    }
    /* The per-cell arrays of output set `back` and the fill marks. */
    h->filled_ok[back] = 0;
    if (h->filled_cap[back] < ncells || h->o_filled[back] == NULL) {
        uint8_t *nf = realloc(h->o_filled[back], (size_t)(ncells ? ncells : 1));
        if (nf == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for %llu fill marks",
                               (unsigned long long)ncells);
        h->o_filled[back] = nf;
        h->filled_cap[back] = ncells;
    }
    fin_t f = {h, st, red, back, 0, 0, peer_max, scale_max};
    for (uint64_t i = 0; i < nsl; i++)
        st->s_amax[back][i] = -INFINITY;
    /* 1. Accumulate, and collect each peer group's max. A quantizer in no
     * group goes through all three steps at once, while its cells are in
     * the cache (quantizers are independent of each other but through
     * their groups, so the order does not change a bit of the results). */
    for (uint32_t qi = 0; qi < nq; qi++) {
        const amx_qdesc_t *q = &qs[qi];
        float m = fin_accumulate(&f, q);
        if (q->peer_group >= 0)
            peer_max[q->peer_group] = amx_fmaxf(peer_max[q->peer_group], m);
        if (q->peer_group < 0 && q->scale_group < 0) {
            fin_peer(&f, q, qi);
            fin_scales(&f, q, qi);
        }
    }
    /* 2. Peer fill or share (marked and counted), each quantizer's and
     * each slice's max, and scale groups' max. */
    for (uint32_t qi = 0; qi < nq; qi++)
        if (qs[qi].peer_group >= 0 || qs[qi].scale_group >= 0)
            fin_peer(&f, &qs[qi], qi);
    /* 3. Global amax and scales: per quantizer (or scale group), per slice,
     * then per cell with its slice's global when it has slices. */
    for (uint32_t qi = 0; qi < nq; qi++)
        if (qs[qi].peer_group >= 0 || qs[qi].scale_group >= 0)
            fin_scales(&f, &qs[qi], qi);
    uint64_t nfilled = f.nfilled, nmissing = f.nmissing;
    fill(h->pend[fl] + AMX_HDR_CELLS, h->pend_n[fl], -INFINITY);
    h->filled_ok[back] = 1;
    st->cell_counts = 1;
    st->last_filled = nfilled;
    st->last_missing = nmissing;
    st->last_finish_us = amx_now_us() - t0;
    return AMX_OK;
}

static amx_status_t host_export(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                uint64_t nslices, int back, const amx_state_arrays_t *d,
                                amx_err_t *err)
{
    host_state_t *h = st->impl;
    int f = st->front ^ (back != 0);
    if (ncells != st->ncells || nhist != st->nhist || nq != st->nq || ncells != st->out_cells[f] ||
        nq > st->out_nq[f] || nslices != st->nslices || nslices != st->out_ns[f])
        return amx_err_set(err, AMX_EINTERNAL,
                           "state export of %llu cells / %u quantizers, the state holds %llu / %u",
                           (unsigned long long)ncells, nq, (unsigned long long)st->ncells, st->nq);
    if (ncells) {
        memcpy(d->accum, h->accum, ncells * sizeof(float));
        memcpy(d->prev, h->prev, ncells * sizeof(float));
        memcpy(d->out_amax, h->o_amax[f], ncells * sizeof(float));
        memcpy(d->out_scale, h->o_scale[f], ncells * sizeof(float));
        memcpy(d->out_inv, h->o_inv[f], ncells * sizeof(float));
        memcpy(d->out_bytes, h->o_bytes[f], ncells);
    }
    if (nhist)
        memcpy(d->hist, h->hist, nhist * sizeof(float));
    if (nq) {
        memcpy(d->prev_g, h->prev_g, nq * sizeof(float));
        memcpy(d->g_amax, st->g_amax[f], nq * sizeof(float));
        memcpy(d->g_scale, st->g_scale[f], nq * sizeof(float));
        memcpy(d->g_inv, st->g_inv[f], nq * sizeof(float));
    }
    if (nslices) {
        memcpy(d->prev_gs, h->prev_gs, nslices * sizeof(float));
        memcpy(d->s_amax, st->s_amax[f], nslices * sizeof(float));
        memcpy(d->s_scale, st->s_scale[f], nslices * sizeof(float));
        memcpy(d->s_inv, st->s_inv[f], nslices * sizeof(float));
    }
    if (d->nstat != st->nstat || d->nscell != st->nscell)
        return amx_err_set(err, AMX_EINTERNAL,
                           "state export of %llu statistic values, the state holds %llu",
                           (unsigned long long)d->nstat, (unsigned long long)st->nstat);
    if (d->nstat > 0 && d->stat != NULL)
        memcpy(d->stat, h->saccum, d->nstat * sizeof(double));
    amx__state_export_stats(st, nq, f, d);
    return AMX_OK;
}

static amx_status_t host_import(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                uint64_t nslices, const amx_state_arrays_t *s, amx_err_t *err)
{
    host_state_t *h = st->impl;
    int back = st->front ^ 1;
    amx_run_t all_c = {0, 0, ncells}, all_h = {0, 0, nhist}, all_q = {0, 0, nq},
              all_s = {0, 0, nslices};
    /* Fresh arrays of the new sizes, then the imported values. */
    if (remap_floats(&h->accum, ncells, 0.0f, NULL, 0) != AMX_OK ||
        remap_floats(&h->prev, ncells, 0.0f, NULL, 0) != AMX_OK ||
        remap_floats(&h->hist, nhist, 0.0f, NULL, 0) != AMX_OK ||
        remap_floats(&h->prev_g, nq, 0.0f, NULL, 0) != AMX_OK ||
        remap_floats(&h->prev_gs, nslices, 0.0f, NULL, 0) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory importing a job's state");
    copy_runs(h->accum, s->accum, sizeof(float), &all_c, 1);
    copy_runs(h->prev, s->prev, sizeof(float), &all_c, 1);
    copy_runs(h->hist, s->hist, sizeof(float), &all_h, 1);
    copy_runs(h->prev_g, s->prev_g, sizeof(float), &all_q, 1);
    copy_runs(h->prev_gs, s->prev_gs, sizeof(float), &all_s, 1);
    st->ncells = ncells;
    st->nhist = nhist;
    st->nq = nq;
    st->nslices = nslices;
    AMX_CHECK(size_outputs(st, back, ncells, nq, nslices, err));
    h->filled_ok[back] = 0; /* imported results: which cells were filled is not known */
    copy_runs(h->o_amax[back], s->out_amax, sizeof(float), &all_c, 1);
    copy_runs(h->o_scale[back], s->out_scale, sizeof(float), &all_c, 1);
    copy_runs(h->o_inv[back], s->out_inv, sizeof(float), &all_c, 1);
    copy_runs(h->o_bytes[back], s->out_bytes, 1, &all_c, 1);
    copy_runs(st->g_amax[back], s->g_amax, sizeof(float), &all_q, 1);
    copy_runs(st->g_scale[back], s->g_scale, sizeof(float), &all_q, 1);
    copy_runs(st->g_inv[back], s->g_inv, sizeof(float), &all_q, 1);
    copy_runs(st->s_amax[back], s->s_amax, sizeof(float), &all_s, 1);
    copy_runs(st->s_scale[back], s->s_scale, sizeof(float), &all_s, 1);
    copy_runs(st->s_inv[back], s->s_inv, sizeof(float), &all_s, 1);
    /* Statistics: the accumulated sums. The stat buffers keep their
     * layout (the loop's) until the remap that follows every import. */
    uint64_t nst = s->nstat;
    double *acc = calloc(nst ? nst : 1, sizeof(double));
    if (acc == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of host memory importing statistics");
    amx_status_t rc = amx__state_import_stats(st, s, nq, back, err);
    if (rc != AMX_OK) {
        free(acc);
        return rc;
    }
    if (nst > 0 && s->stat != NULL)
        memcpy(acc, s->stat, nst * sizeof(double));
    free(h->saccum);
    h->saccum = acc;
    return AMX_OK;
}

static void host_destroy(amx_state_t *st)
{
    host_state_t *h = st->impl;
    for (int k = 0; k < 2; k++) {
        free(h->pend[k]);
        free(h->o_amax[k]);
        free(h->o_scale[k]);
        free(h->o_inv[k]);
        free(h->o_bytes[k]);
        free(h->o_filled[k]);
    }
    free(h->recv);
    free(h->next_active);
    free(h->accum);
    free(h->prev);
    free(h->hist);
    free(h->prev_g);
    free(h->prev_gs);
    free(h->group_max);
    for (int k = 0; k < 2; k++)
        free(h->spend[k]);
    free(h->srecv);
    free(h->saccum);
    free(h->snext);
    free(h);
}

/*
 * A test aid (AMAXD_TEST_STAT_HIST): stat_hist as the CUDA backend runs it
 * (cuda/calib_cuda.cu), its steps one after the other on the host (the
 * edges, each candidate's value, the pick with the device's near-tie
 * check; calib_core.h), every other job left to the engine (NaN), so that
 * the end-to-end suite covers engine_stat.c's device path without a GPU.
 */
static amx_status_t host_stat_hist(amx_state_t *st, const struct amx_hist_job *jobs, size_t n,
                                   float *out, amx_err_t *err)
{
    host_state_t *h = st->impl;
    for (size_t q = 0; q < n; q++) {
        const amx_calib_t *c = &jobs[q].c;
        uint32_t nc = amx__hist_ncand(c);
        float *edges = malloc(((size_t)c->num_bins + 1) * sizeof(float));
        double *val = malloc(((size_t)nc + 1) * 2 * sizeof(double)), *mag = val + nc + 1;
        if (edges == NULL || val == NULL) {
            free(edges), free(val);
            return amx_err_set(err, AMX_ENOMEM, "out of host memory");
        }
        const double *counts = h->saccum + jobs[q].sbase;
        for (uint32_t e = 0; e <= c->num_bins; e++)
            edges[e] =
                amx__linspace_at(0.0f, jobs[q].g, c->num_bins + 1, amx__torch_fma(c->torch_cpu), e);
        for (uint32_t k = 0; k < nc; k++)
            val[k] = c->method == AMX_HM_ENTROPY ? amx__hist_cand_entropy(c, counts, k, &mag[k])
                                                 : amx__hist_cand_mse(c, counts, edges, k);
        out[q] = q % 2 ? NAN : amx__hist_pick(c, jobs[q].g, counts, edges, val, mag, 1);
        free(edges), free(val);
    }
    return AMX_OK;
}

static const amx_state_ops_t host_ops = {
    .name = "host",
    .on_device = 0,
    .reserve_pending = host_reserve_pending,
    .merge = host_merge,
    .flip = host_flip,
    .unflip = host_unflip,
    .remap_active = host_remap_active,
    .publish = host_publish,
    .read_results = host_read_results,
    .remap = host_remap,
    .prepare = host_prepare,
    .read_header = host_read_header,
    .finish = host_finish,
    .export_state = host_export,
    .import_state = host_import,
    .destroy = host_destroy,
    .grow_pending = host_grow_pending,
    .fill_pending = host_fill_pending,
    .read_filled = host_read_filled,
    .stat_merge = host_stat_merge,
    .stat_prepare = host_stat_prepare,
    .stat_accumulate = host_stat_accumulate,
    .read_accum = host_read_accum,
};

/* host_ops with the test aid's stat_hist, made once. */
static amx_state_ops_t host_ops_hist;
static pthread_once_t host_ops_hist_once = PTHREAD_ONCE_INIT;

static void make_host_ops_hist(void)
{
    host_ops_hist = host_ops;
    host_ops_hist.stat_hist = host_stat_hist;
}

amx_status_t amx__state_host_create(amx_state_t **out, amx_err_t *err)
{
    amx_state_t *st = calloc(1, sizeof(*st));
    host_state_t *h = calloc(1, sizeof(*h));
    if (st == NULL || h == NULL) {
        free(st);
        free(h);
        return amx_err_set(err, AMX_ENOMEM, "out of host memory creating a job state");
    }
    /* For the tests of what a device fault does (CUDA errors are sticky):
     * with AMAXD_TEST_DEVICE_FAULT set, every finish fails like one. */
    const char *f = getenv("AMAXD_TEST_DEVICE_FAULT");
    h->simulate_fault = f != NULL && f[0] != '\0' && strcmp(f, "0") != 0;
    st->ops = &host_ops;
    /* ... and with AMAXD_TEST_STAT_HIST set, the histogram methods go
     * through stat_hist, as on the CUDA backend. */
    const char *t = getenv("AMAXD_TEST_STAT_HIST");
    if (t != NULL && t[0] != '\0' && strcmp(t, "0") != 0) {
        pthread_once(&host_ops_hist_once, make_host_ops_hist);
        st->ops = &host_ops_hist;
    }
    st->impl = h;
    *out = st;
    return AMX_OK;
}
