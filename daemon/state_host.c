/*
 * state_host.c - the host state backend: every buffer in ordinary memory and
 * the post-processing in plain C, with the per-cell arithmetic of recipe.h.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "postproc.h"
#include "state.h"

typedef struct host_state {
    float *pending;     /* ncells */
    float *accum;       /* ncells */
    float *prev_scale;  /* ncells */
    float *history;     /* nhist */
    float *prev_gscale; /* nq */
    float *group_max;   /* scratch: peer groups then scale groups */
    size_t group_cap;
    uint64_t cap_cells, cap_hist;
    uint32_t cap_q;
} host_state_t;

static amx_status_t grow_floats(float **p, uint64_t old_n, uint64_t new_n, float fill)
{
    float *np = realloc(*p, (size_t)(new_n ? new_n : 1) * sizeof(float));
    if (np == NULL)
        return AMX_ENOMEM;
    for (uint64_t i = old_n; i < new_n; i++)
        np[i] = fill;
    *p = np;
    return AMX_OK;
}

amx_status_t amx__state_grow_outputs(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                     amx_err_t *err)
{
    amx_status_t rc = AMX_OK;
    if (ncells > st->ncells) {
        uint8_t *b = realloc(st->out_bytes, (size_t)ncells);
        if (b == NULL)
            goto nomem;
        memset(b + st->ncells, 0, (size_t)(ncells - st->ncells));
        st->out_bytes = b;
        if (grow_floats(&st->out_amax, st->ncells, ncells, -INFINITY) != AMX_OK ||
            grow_floats(&st->out_scale, st->ncells, ncells, 1.0f) != AMX_OK ||
            grow_floats(&st->out_scale_inv, st->ncells, ncells, 1.0f) != AMX_OK)
            goto nomem;
    }
    if (nq > st->nq) {
        if (grow_floats(&st->out_gamax, st->nq, nq, 0.0f) != AMX_OK ||
            grow_floats(&st->out_gscale, st->nq, nq, 1.0f) != AMX_OK ||
            grow_floats(&st->out_gscale_inv, st->nq, nq, 1.0f) != AMX_OK)
            goto nomem;
    }
    st->ncells = ncells > st->ncells ? ncells : st->ncells;
    st->nhist = nhist > st->nhist ? nhist : st->nhist;
    st->nq = nq > st->nq ? nq : st->nq;
    return rc;
nomem:
    return amx_err_set(err, AMX_ENOMEM, "out of host memory growing result buffers to %llu cells",
                       (unsigned long long)ncells);
}

static amx_status_t host_reserve(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                 amx_err_t *err)
{
    host_state_t *h = st->impl;
    if (ncells > h->cap_cells) {
        if (grow_floats(&h->pending, h->cap_cells, ncells, -INFINITY) != AMX_OK ||
            grow_floats(&h->accum, h->cap_cells, ncells, -INFINITY) != AMX_OK ||
            grow_floats(&h->prev_scale, h->cap_cells, ncells, 1.0f) != AMX_OK)
            goto nomem;
        h->cap_cells = ncells;
    }
    if (nhist > h->cap_hist) {
        if (grow_floats(&h->history, h->cap_hist, nhist, -INFINITY) != AMX_OK)
            goto nomem;
        h->cap_hist = nhist;
    }
    if (nq > h->cap_q) {
        if (grow_floats(&h->prev_gscale, h->cap_q, nq, 1.0f) != AMX_OK)
            goto nomem;
        h->cap_q = nq;
    }
    return amx__state_grow_outputs(st, ncells, nhist, nq, err);
nomem:
    return amx_err_set(err, AMX_ENOMEM, "out of host memory growing the amax state to %llu cells",
                       (unsigned long long)ncells);
}

static amx_status_t host_merge(amx_state_t *st, const float *vals, uint64_t nvals,
                               const amx_run_t *runs, size_t nruns, int overlap, amx_err_t *err)
{
    host_state_t *h = st->impl;
    (void)nvals, (void)overlap, (void)err;
    for (size_t r = 0; r < nruns; r++) {
        float *dst = h->pending + runs[r].dst;
        const float *src = vals + runs[r].src;
        for (uint64_t i = 0; i < runs[r].len; i++)
            dst[i] = amx_fmaxf(dst[i], src[i]);
    }
    return AMX_OK;
}

static amx_status_t host_reconcile(amx_state_t *st, const amx_qdesc_t *qs, uint32_t nq,
                                   uint32_t npeer, uint32_t nscale, amx_comm_t *comm,
                                   amx_err_t *err)
{
    host_state_t *h = st->impl;
    size_t ngroups = (size_t)npeer + nscale;
    if (ngroups > h->group_cap) {
        float *g = realloc(h->group_max, ngroups * sizeof(float));
        if (g == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for %zu group maxima", ngroups);
        h->group_max = g;
        h->group_cap = ngroups;
    }
    float *peer_max = h->group_max, *scale_max = h->group_max + npeer;
    for (size_t i = 0; i < ngroups; i++)
        h->group_max[i] = -INFINITY;

    /* Reduce across daemons first: if a peer is gone, nothing has changed. */
    AMX_CHECK(comm->allreduce_max(comm, h->pending, (size_t)st->ncells, 0, err));

    /* 1. Accumulate, and collect each peer group's max. */
    for (uint32_t qi = 0; qi < nq; qi++) {
        const amx_qdesc_t *q = &qs[qi];
        float m = -INFINITY;
        for (uint64_t c = 0; c < q->ncells; c++) {
            float a = amx_pp_accumulate(q, &h->accum[q->base + c], h->history + q->hist_base, c,
                                        h->pending[q->base + c]);
            st->out_amax[q->base + c] = a;
            m = amx_fmaxf(m, a);
        }
        if (q->peer_group >= 0)
            peer_max[q->peer_group] = amx_fmaxf(peer_max[q->peer_group], m);
    }
    /* 2. Peer fill, each quantizer's max, and scale groups' max. */
    for (uint32_t qi = 0; qi < nq; qi++) {
        const amx_qdesc_t *q = &qs[qi];
        float fill = q->peer_group >= 0 ? peer_max[q->peer_group] : -INFINITY;
        float m = -INFINITY;
        for (uint64_t c = 0; c < q->ncells; c++) {
            float *a = &st->out_amax[q->base + c];
            if (*a == -INFINITY)
                *a = fill;
            m = amx_fmaxf(m, *a);
        }
        st->out_gamax[qi] = m;
        if (q->scale_group >= 0)
            scale_max[q->scale_group] = amx_fmaxf(scale_max[q->scale_group], m);
    }
    /* 3. Global amax and scales. */
    for (uint32_t qi = 0; qi < nq; qi++) {
        const amx_qdesc_t *q = &qs[qi];
        float g = q->scale_group >= 0 ? scale_max[q->scale_group] : st->out_gamax[qi];
        g = g > 0.0f ? g : 0.0f;
        st->out_gamax[qi] = g;
        amx_pp_global(&q->recipe, g, &h->prev_gscale[qi], &st->out_gscale[qi],
                      &st->out_gscale_inv[qi]);
        float s_enc = st->out_gscale[qi], s_dec = st->out_gscale_inv[qi];
        for (uint64_t i = q->base; i < q->base + q->ncells; i++)
            amx_pp_cell(&q->recipe, st->out_amax[i], g, s_enc, s_dec, &h->prev_scale[i],
                        &st->out_scale[i], &st->out_scale_inv[i], &st->out_bytes[i]);
    }
    for (uint64_t i = 0; i < st->ncells; i++)
        h->pending[i] = -INFINITY;
    return AMX_OK;
}

static amx_status_t host_reset(amx_state_t *st, const amx_qdesc_t *qs, const uint32_t *ids,
                               uint32_t n, amx_err_t *err)
{
    host_state_t *h = st->impl;
    (void)err;
    for (uint32_t i = 0; i < n; i++) {
        const amx_qdesc_t *q = &qs[ids[i]];
        for (uint64_t c = 0; c < q->ncells; c++) {
            h->pending[q->base + c] = -INFINITY;
            h->accum[q->base + c] = -INFINITY;
            h->prev_scale[q->base + c] = 1.0f;
        }
        if (q->accumulation == AMX_ACC_PER_EPOCH)
            for (uint64_t c = 0; c < (uint64_t)q->hist_len * q->ncells; c++)
                h->history[q->hist_base + c] = -INFINITY;
        h->prev_gscale[ids[i]] = 1.0f;
    }
    return AMX_OK;
}

static void host_destroy(amx_state_t *st)
{
    host_state_t *h = st->impl;
    free(h->pending);
    free(h->accum);
    free(h->prev_scale);
    free(h->history);
    free(h->prev_gscale);
    free(h->group_max);
    free(h);
}

static const amx_state_ops_t host_ops = {
    "host", host_reserve, host_merge, host_reconcile, host_reset, host_destroy,
};

amx_status_t amx__state_host_create(amx_state_t **out, amx_err_t *err)
{
    amx_state_t *st = calloc(1, sizeof(*st));
    host_state_t *h = calloc(1, sizeof(*h));
    if (st == NULL || h == NULL) {
        free(st);
        free(h);
        return amx_err_set(err, AMX_ENOMEM, "out of host memory creating a job state");
    }
    st->ops = &host_ops;
    st->impl = h;
    *out = st;
    return AMX_OK;
}

#ifndef AMX_HAVE_CUDA
amx_status_t amx__state_cuda_create(amx_state_t **out, amx_err_t *err)
{
    (void)out;
    return amx_err_set(err, AMX_EUNAVAIL,
                       "this amaxd was built without CUDA; use --backend=host or rebuild with "
                       "-DAMAXD_CUDA=ON");
}

int amx__state_cuda_probe(void)
{
    return 0;
}
#endif

int amx_state_cuda_available(void)
{
    return amx__state_cuda_probe();
}

amx_status_t amx_state_create(const char *backend, amx_state_t **out, amx_err_t *err)
{
    if (strcmp(backend, "host") == 0)
        return amx__state_host_create(out, err);
    if (strcmp(backend, "cuda") == 0)
        return amx__state_cuda_create(out, err);
    return amx_err_set(err, AMX_EINVAL, "unknown state backend '%s' (host or cuda)", backend);
}

void amx_state_destroy(amx_state_t *st)
{
    if (st == NULL)
        return;
    st->ops->destroy(st);
    free(st->out_amax);
    free(st->out_scale);
    free(st->out_scale_inv);
    free(st->out_bytes);
    free(st->out_gamax);
    free(st->out_gscale);
    free(st->out_gscale_inv);
    free(st);
}
