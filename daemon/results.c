/*
 * results.c - answers: a rank's named results (Reconcile, GetScales, in
 * windows), its packed answer, and the previous-epoch globals they carry.
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

/* The previous-epoch globals of quantizer `lid` (0: none). */
static int previous_of(const amx_job_t *j, uint32_t lid, float *ga, float *gs)
{
    const amx_lq_t *q = &j->lq[lid];
    if (q->status != LQ_AGREED || q->cidx < 0)
        return 0;
    return amx_job_previous(j, (uint32_t)q->cidx, ga, gs);
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

typedef struct basis_ctx {
    const float *basis; /* the quantizer's stat cells */
    float *out;
    uint64_t w0, w1;
} basis_ctx_t;

/* One block row (global cell `flat`, block cell `boff`), clipped to the
 * window: the basis of its cells. */
static void basis_row(void *ud, uint64_t flat, uint64_t boff, uint64_t len)
{
    basis_ctx_t *c = ud;
    uint64_t lo = boff > c->w0 ? boff : c->w0;
    uint64_t hi = boff + len < c->w1 ? boff + len : c->w1;
    for (uint64_t b = lo; b < hi; b++)
        c->out[b - c->w0] = c->basis[flat + (b - boff)];
}

/* The published statistic of result `x` (cells [first_cell, + ncells)
 * of block `pl` of stat quantizer `q`) from output set `f` (-1: none yet):
 * state, epoch and counts, and the basis into x->stat_basis (x->ncells
 * floats, left alone without a basis). 1 when it has a basis. */
static int basis_into(amx_result_t *x, const amx_job_t *j, const amx_lq_t *q,
                      const amx_placement_t *pl, int f)
{
    const amx_state_t *st = j->state;
    x->stat_state = AMX_STAT_WAITING;
    if (f < 0 || q->status != LQ_AGREED || q->cidx < 0 || st->p_sq[f] == NULL ||
        (uint32_t)q->cidx >= st->p_nq[f])
        return 0;
    const amx_stat_result_t *r = &st->p_sq[f][q->cidx];
    x->stat_state = r->state != AMX_STAT_NONE ? r->state : AMX_STAT_WAITING;
    x->stat_epoch = r->epoch;
    x->stat_total = r->total;
    x->stat_overflow = r->overflow;
    const amx_qdesc_t *d = &j->desc[q->cidx];
    if (r->epoch == 0 || st->p_basis[f] == NULL ||
        d->obase + amx_qspec_stat_cells(q->spec) > st->p_nscell[f] || x->ncells == 0)
        return 0;
    if (q->spec->calib.kind == AMX_CAL_HISTOGRAM) {
        x->stat_basis[0] = st->p_basis[f][d->obase]; /* one cell */
        return 1;
    }
    basis_ctx_t bc = {st->p_basis[f] + d->obase, x->stat_basis, x->first_cell,
                      x->first_cell + x->ncells};
    amx_placement_rows(pl, q->spec->shape, 0, basis_row, &bc);
    return 1;
}

/* result_stat for a named result: the basis in the arena. */
static amx_status_t result_stat(amx_result_t *x, const amx_job_t *j, const amx_lq_t *q,
                                const amx_placement_t *pl, int f, amx_arena_t *a)
{
    if (q->spec->calib.kind == AMX_CAL_MAX)
        return AMX_OK;
    float *b = amx_arena_alloc(a, (x->ncells ? x->ncells : 1) * sizeof(float));
    if (b == NULL)
        return AMX_ENOMEM;
    x->stat_basis = b;
    if (!basis_into(x, j, q, pl, f))
        x->stat_basis = NULL;
    return AMX_OK;
}

/* The packed answer of rank r: arrays from the waiter's owner, filled
 * from the published outputs in slab order. */
amx_status_t amx__build_packed(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r, amx_waiter_t *w,
                               amx_packed_t *p, amx_err_t *err)
{
    amx_slab_t *sl;
    AMX_CHECK(amx__slab_get(j, r, &sl, err));
    memset(p, 0, sizeof(*p));
    p->layout_id = sl->id;
    p->ncells = sl->off[sl->n];
    p->nq = sl->n;
    p->nslices = sl->soff[sl->n];
    p->stats = sl->nstatq > 0;
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
            return amx__note_fault(reg, rst, err->msg);
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
    for (uint32_t i = 0; i < sl->n; i++) {
        uint32_t ci = sl->cidx[i];
        uint64_t c0 = sl->off[i], c1 = sl->off[i + 1];
        if (ci == UINT32_MAX) {
            p->missing[i] = (uint32_t)(c1 - c0);
            continue;
        }
        p->missing[i] = any_missing ? zero_missing(p->amax + c0, c1 - c0) : 0;
    }
    amx__slab_globals(j, sl, p->g_amax, p->g_scale, p->g_inv, p->s_amax, p->s_scale, p->s_inv);
    for (uint32_t i = 0; i < sl->n; i++) {
        float ga = 0.0f, gs = 0.0f;
        int prev = amx_job_previous(j, sl->cidx[i], &ga, &gs); /* UINT32_MAX: none */
        p->has_previous[i] = (uint8_t)prev;
        p->prev_amax[i] = prev ? ga : 0.0f;
        p->prev_scale[i] = prev ? gs : 0.0f;
    }
    /* Only a peer group raises cells: the others' marks are 0. */
    uint64_t nfilled = 0;
    for (uint32_t k = 0; known && k < sl->npeerq; k++)
        if (sl->cidx[sl->peerq[k]] != UINT32_MAX)
            for (uint64_t c = sl->off[sl->peerq[k]]; c < sl->off[sl->peerq[k] + 1]; c++)
                nfilled += p->filled[c];
    p->nfilled = nfilled;
    /* Calibrators beyond max: as result_stat gives them. */
    for (uint32_t i = 0; p->stats && i < sl->n; i++) {
        const amx_lq_t *q = &j->lq[sl->lid[i]];
        uint64_t c0 = sl->off[i], c1 = sl->off[i + 1];
        amx_result_t x;
        memset(&x, 0, sizeof(x));
        x.ncells = c1 - c0;
        x.stat_basis = p->st_basis + c0;
        memset(x.stat_basis, 0, (c1 - c0) * sizeof(float));
        if (q->spec->calib.kind != AMX_CAL_MAX) {
            const amx_placement_t *pl = &r->pls[r->pl_of[sl->lid[i]] - 1];
            basis_into(&x, j, q, pl, f);
        }
        p->st_state[i] = (uint8_t)x.stat_state;
        p->st_epoch[i] = x.stat_epoch;
        p->st_total[i] = x.stat_total;
        p->st_over[i] = x.stat_overflow;
    }
    return AMX_OK;
}

void amx__slab_globals(const amx_job_t *j, const amx_slab_t *sl, float *ga, float *gs, float *gi,
                       float *sa, float *ss, float *si)
{
    const amx_state_t *st = j->state;
    int f = st->front;
    uint32_t fo = st->out_nq[f];
    for (uint32_t i = 0; i < sl->n; i++) {
        uint32_t ci = sl->cidx[i];
        int have = ci != UINT32_MAX && ci < fo;
        ga[i] = have ? st->g_amax[f][ci] : 0.0f;
        gs[i] = have ? st->g_scale[f][ci] : 1.0f;
        gi[i] = have ? st->g_inv[f][ci] : 1.0f;
    }
    /* Global slices: the state's, as result_slices gives them. */
    for (uint32_t i = 0; sl->soff[sl->n] > 0 && i < sl->n; i++) {
        uint64_t s0 = sl->soff[i], s1 = sl->soff[i + 1];
        if (s0 == s1)
            continue;
        const amx_lq_t *q = &j->lq[sl->lid[i]];
        int have = q->status == LQ_AGREED && st->s_amax[f] != NULL &&
                   q->gbase + amx_qspec_slices(q->spec) <= st->out_ns[f];
        for (uint64_t s = s0; s < s1; s++) {
            uint64_t g = sl->sg[s];
            sa[s] = have ? st->s_amax[f][g] : 0.0f;
            ss[s] = have ? st->s_scale[f][g] : 1.0f;
            si[s] = have ? st->s_inv[f][g] : 1.0f;
        }
    }
}

/* ---- named results ---- */

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
    amx_lrank_t *r = rank >= 0 ? amx__local_rank(j, (uint32_t)rank) : NULL;
    if (n == 0) {
        if (r != NULL) {
            size_t k = 0;
            for (uint32_t i = 0; i < r->npls; i++)
                k += r->pl_of[r->pl_lid[i]] == i + 1 && amx__lq_live(&j->lq[r->pl_lid[i]]);
            *count = k;
        } else {
            *count = j->cat->n;
        }
        return AMX_OK;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t lid;
        if (!amx_strmap_get(&j->lqmap, names[i], &lid) || !amx__lq_live(&j->lq[lid]))
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
    while (
        !(r->pl_of[r->pl_lid[*cursor]] == *cursor + 1 && amx__lq_live(&j->lq[r->pl_lid[*cursor]])))
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
        uint64_t g = q->gbase + amx_placement_global_slice(pl, q->spec->shape, k, j0 + i);
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
    return 18 * n + 12 * ns + strlen(name) + 12ull * ndim + 160;
}

/*
 * The results for `names` (all of the rank's when none; whole tensors when
 * rank < 0), restricted to cells [start, start + max) of the answer (max 0:
 * all). Refused, before anything is built, when the answer would not fit
 * in max_message_bytes. *total_cells (may be NULL): cells of the whole
 * answer.
 */
amx_status_t amx__build_results(amx_registry_t *reg, amx_job_t *j, int64_t rank, char **names,
                                size_t n, uint64_t start, uint64_t max, amx_result_t **out,
                                size_t *nout, uint64_t *total_cells, amx_arena_t *a, amx_err_t *err)
{
    size_t count;
    AMX_CHECK(check_names(j, rank, names, n, &count, err));
    amx_lrank_t *r = rank >= 0 ? amx__local_rank(j, (uint32_t)rank) : NULL;
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
        amx__stage_reserve(reg, 0, nruns) != AMX_OK)
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
            if (empty_result(x, a) != AMX_OK ||
                result_slices(x, j->state, q, pl, -1, a) != AMX_OK ||
                result_stat(x, j, q, pl, -1, a) != AMX_OK)
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
        if (result_slices(x, j->state, q, pl, f, a) != AMX_OK ||
            result_stat(x, j, q, pl, f, a) != AMX_OK)
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
            return amx__note_fault(reg, rst, err->msg);
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
amx_status_t amx__reconcile_answer_fits(amx_registry_t *reg, amx_job_t *j, uint32_t rank,
                                        char **names, size_t n, amx_err_t *err)
{
    size_t count;
    AMX_CHECK(check_names(j, rank, names, n, &count, err));
    amx_lrank_t *r = amx__local_rank(j, rank);
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
    AMX_CHECK(amx__ready_job(reg, req->job, req->rank, !req->whole, &j, err));
    if (j->last_reconciled == 0)
        return amx_err_set(err, AMX_EPRECOND,
                           "no epoch of job '%s' has been reconciled yet: call Reconcile first",
                           j->name);
    memset(rep, 0, sizeof(*rep));
    rep->epoch = j->last_reconciled;
    rep->next_epoch = j->epoch;
    return amx__build_results(reg, j, req->whole ? -1 : (int64_t)req->rank, req->names,
                              req->n_names, req->start_cell, req->max_cells, &rep->results,
                              &rep->nresults, &rep->total_cells, arena, err);
}
