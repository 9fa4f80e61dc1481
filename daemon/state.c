/*
 * state.c - what every state backend shares (state.h): the factory that
 * picks one by name, the per-quantizer and per-slice result arrays both
 * fill (in host memory the backend may pin), and the stand-ins of the
 * CUDA backend in a build without it.
 */
#include "state.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *globals_alloc(amx_state_t *st, size_t bytes)
{
    return st->host_alloc != NULL ? st->host_alloc(st, bytes) : malloc(bytes);
}

static void globals_free(amx_state_t *st, void *p)
{
    if (p == NULL)
        return;
    if (st->host_free != NULL)
        st->host_free(st, p);
    else
        free(p);
}

amx_status_t amx__state_grow_globals(amx_state_t *st, int k, uint32_t nq, amx_err_t *err)
{
    if (nq <= st->out_nq[k])
        return AMX_OK;
    float **arr[3] = {&st->g_amax[k], &st->g_scale[k], &st->g_inv[k]};
    static const float init[3] = {0.0f, 1.0f, 1.0f};
    if (nq > st->g_cap[k] || st->g_amax[k] == NULL) {
        /* Capacity doubles: a catalog that grows a little at a time does
         * not reallocate (pinned, for the CUDA backend) every time. */
        uint32_t cap = st->g_cap[k] > UINT32_MAX / 2 ? UINT32_MAX : 2 * st->g_cap[k];
        cap = cap > nq ? cap : nq;
        float *grown[3];
        for (int a = 0; a < 3; a++) {
            grown[a] = globals_alloc(st, (size_t)cap * sizeof(float));
            if (grown[a] == NULL) {
                while (a-- > 0)
                    globals_free(st, grown[a]);
                return amx_err_set(err, AMX_ENOMEM, "out of host memory for %u quantizer results",
                                   nq);
            }
        }
        for (int a = 0; a < 3; a++) {
            if (*arr[a] != NULL && st->out_nq[k] > 0)
                memcpy(grown[a], *arr[a], (size_t)st->out_nq[k] * sizeof(float));
            globals_free(st, *arr[a]);
            *arr[a] = grown[a];
        }
        st->g_cap[k] = cap;
    }
    for (int a = 0; a < 3; a++)
        for (uint32_t q = st->out_nq[k]; q < nq; q++)
            (*arr[a])[q] = init[a];
    st->out_nq[k] = nq;
    return AMX_OK;
}

amx_status_t amx__state_size_slices(amx_state_t *st, int k, uint64_t ns, amx_err_t *err)
{
    float **arr[3] = {&st->s_amax[k], &st->s_scale[k], &st->s_inv[k]};
    static const float init[3] = {0.0f, 1.0f, 1.0f};
    if (ns > st->s_cap[k] || st->s_amax[k] == NULL) {
        uint64_t cap = ns > 2 * st->s_cap[k] ? ns : 2 * st->s_cap[k];
        float *grown[3];
        for (int a = 0; a < 3; a++) {
            grown[a] = globals_alloc(st, (size_t)(cap ? cap : 1) * sizeof(float));
            if (grown[a] == NULL) {
                while (a-- > 0)
                    globals_free(st, grown[a]);
                return amx_err_set(err, AMX_ENOMEM,
                                   "out of host memory for %llu global slice results",
                                   (unsigned long long)ns);
            }
        }
        for (int a = 0; a < 3; a++) {
            uint64_t keep = st->out_ns[k] < ns ? st->out_ns[k] : ns;
            if (*arr[a] != NULL && keep > 0)
                memcpy(grown[a], *arr[a], (size_t)keep * sizeof(float));
            globals_free(st, *arr[a]);
            *arr[a] = grown[a];
        }
        st->s_cap[k] = cap;
    }
    for (int a = 0; a < 3; a++)
        for (uint64_t i = st->out_ns[k]; i < ns; i++)
            (*arr[a])[i] = init[a];
    st->out_ns[k] = ns;
    return AMX_OK;
}

/* ---- statistics (calibrators beyond max) ---- */

/* Copies the runs of `src` (src_n elements) into dst; the part of a run
 * beyond src_n is left as it is (zero). A side of the published statistic
 * results is only rewritten by epochs that have statistics, so it may
 * still be in an older, smaller layout than the runs assume. */
static void copy_runs(void *dst, const void *src, size_t elem, const amx_run_t *runs, size_t n,
                      uint64_t src_n)
{
    for (size_t r = 0; r < n; r++) {
        uint64_t len = runs[r].len;
        if (runs[r].src >= src_n)
            continue;
        if (len > src_n - runs[r].src)
            len = src_n - runs[r].src;
        if (len > 0)
            memcpy((char *)dst + runs[r].dst * elem, (const char *)src + runs[r].src * elem,
                   len * elem);
    }
}

amx_status_t amx__state_size_stat_results(amx_state_t *st, int k, uint32_t nq, uint64_t nscell,
                                          amx_err_t *err)
{
    if (nq != st->p_nq[k] || st->p_sq[k] == NULL) {
        amx_stat_result_t *p = realloc(st->p_sq[k], (size_t)(nq ? nq : 1) * sizeof(*p));
        if (p == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for %u statistic results", nq);
        st->p_sq[k] = p;
        st->p_nq[k] = nq;
    }
    if (nscell != st->p_nscell[k] || st->p_basis[k] == NULL) {
        float *p = realloc(st->p_basis[k], (size_t)(nscell ? nscell : 1) * sizeof(float));
        if (p == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of host memory for %llu statistic bases",
                               (unsigned long long)nscell);
        st->p_basis[k] = p;
        st->p_nscell[k] = nscell;
    }
    return AMX_OK;
}

amx_status_t amx__state_remap_stats(amx_state_t *st, const amx_layout_change_t *lc, int src,
                                    int back, amx_err_t *err)
{
    uint64_t ns = lc->nscell;
    uint32_t nq = lc->nq;
    float *basis = calloc(ns ? ns : 1, sizeof(float));
    float *pb = calloc(ns ? ns : 1, sizeof(float));
    uint64_t *ep = calloc(nq ? nq : 1, sizeof(uint64_t));
    amx_stat_result_t *ps = calloc(nq ? nq : 1, sizeof(*ps));
    if (basis == NULL || pb == NULL || ep == NULL || ps == NULL) {
        free(basis), free(pb), free(ep), free(ps);
        return amx_err_set(err, AMX_ENOMEM, "out of host memory remapping statistics");
    }
    if (st->basis != NULL)
        copy_runs(basis, st->basis, sizeof(float), lc->scells, lc->nscell_runs, st->nscell);
    if (st->sq_epoch != NULL)
        copy_runs(ep, st->sq_epoch, sizeof(uint64_t), lc->qs, lc->nq_runs, st->sq_n);
    if (st->p_basis[src] != NULL)
        copy_runs(pb, st->p_basis[src], sizeof(float), lc->scells, lc->nscell_runs,
                  st->p_nscell[src]);
    if (st->p_sq[src] != NULL)
        copy_runs(ps, st->p_sq[src], sizeof(*ps), lc->qs, lc->nq_runs, st->p_nq[src]);
    free(st->basis);
    free(st->sq_epoch);
    free(st->p_basis[back]);
    free(st->p_sq[back]);
    st->basis = basis;
    st->sq_epoch = ep;
    st->sq_n = nq;
    st->p_basis[back] = pb;
    st->p_sq[back] = ps;
    st->p_nscell[back] = ns;
    st->p_nq[back] = nq;
    st->nstat = lc->nstat;
    st->nscell = ns;
    return AMX_OK;
}

amx_status_t amx__state_import_stats(amx_state_t *st, const amx_state_arrays_t *a, uint32_t nq,
                                     int back, amx_err_t *err)
{
    uint64_t ns = a->nscell;
    float *basis = calloc(ns ? ns : 1, sizeof(float));
    uint64_t *ep = calloc(nq ? nq : 1, sizeof(uint64_t));
    if (basis == NULL || ep == NULL) {
        free(basis), free(ep);
        return amx_err_set(err, AMX_ENOMEM, "out of host memory importing statistics");
    }
    AMX_CHECK(amx__state_size_stat_results(st, back, nq, ns, err));
    if (ns > 0 && a->basis != NULL) {
        memcpy(basis, a->basis, ns * sizeof(float));
        memcpy(st->p_basis[back], a->basis, ns * sizeof(float));
    }
    for (uint32_t i = 0; i < nq; i++) {
        amx_stat_result_t r = {0};
        if (a->sq != NULL)
            r = a->sq[i];
        st->p_sq[back][i] = r;
        ep[i] = r.epoch;
    }
    free(st->basis);
    free(st->sq_epoch);
    st->basis = basis;
    st->sq_epoch = ep;
    st->sq_n = nq;
    st->nstat = a->nstat;
    st->nscell = ns;
    return AMX_OK;
}

void amx__state_export_stats(const amx_state_t *st, uint32_t nq, int f, const amx_state_arrays_t *d)
{
    if (d->nscell > 0 && d->basis != NULL && st->basis != NULL)
        memcpy(d->basis, st->basis, d->nscell * sizeof(float));
    for (uint32_t i = 0; d->sq != NULL && i < nq; i++) {
        amx_stat_result_t r = {0};
        if (st->p_sq[f] != NULL && i < st->p_nq[f])
            r = st->p_sq[f][i];
        d->sq[i] = r;
    }
}

#ifndef AMX_HAVE_CUDA
amx_status_t amx__state_cuda_create(int device, amx_state_t **out, amx_err_t *err)
{
    (void)device, (void)out;
    return amx_err_set(err, AMX_EUNAVAIL,
                       "this amaxd was built without CUDA; use --backend=host or rebuild with "
                       "-DAMAXD_CUDA=ON");
}

int amx__state_cuda_probe(void)
{
    return 0;
}

uint64_t amx__state_cuda_memory(int device)
{
    (void)device;
    return 0;
}
#endif

uint64_t amx_state_memory(const char *backend, int device)
{
    if (strcmp(backend, "cuda") == 0)
        return amx__state_cuda_memory(device);
    long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size : 0;
}

int amx_state_cuda_available(void)
{
    return amx__state_cuda_probe();
}

amx_status_t amx_state_create(const char *backend, int device, amx_state_t **out, amx_err_t *err)
{
    if (strcmp(backend, "host") == 0)
        return amx__state_host_create(out, err);
    if (strcmp(backend, "cuda") == 0)
        return amx__state_cuda_create(device, out, err);
    return amx_err_set(err, AMX_EINVAL, "unknown state backend '%s' (host or cuda)", backend);
}

void amx_state_destroy(amx_state_t *st)
{
    if (st == NULL)
        return;
    /* Before the backend goes: its host_free may need it. */
    for (int k = 0; k < 2; k++) {
        globals_free(st, st->g_amax[k]);
        globals_free(st, st->g_scale[k]);
        globals_free(st, st->g_inv[k]);
        globals_free(st, st->s_amax[k]);
        globals_free(st, st->s_scale[k]);
        globals_free(st, st->s_inv[k]);
        free(st->p_basis[k]);
        free(st->p_sq[k]);
    }
    free(st->basis);
    free(st->sq_epoch);
    st->ops->destroy(st);
    free(st);
}
