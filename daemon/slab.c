/*
 * slab.c - a rank's slab layout for the packed form (job.h amx_slab_t):
 * its live placements in catalog order, where each lies in its flat
 * buffer, and the runs between that buffer and the job's; GetLayout.
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

void amx__slab_free(amx_slab_t *sl)
{
    if (sl == NULL)
        return;
    free(sl->lid);
    free(sl->off);
    free(sl->merge);
    free(sl->gather);
    free(sl->soff);
    free(sl->sg);
    free(sl->cidx);
    free(sl->pendq);
    free(sl->peerq);
    free(sl->stoff);
    free(sl);
}

/* Statistic values quantizer q's block pl takes in the stat slab: a
 * histogram's counts and overflow count, an MSE search's losses per cell
 * (the presence counts are the daemon's own), an NVFP4 search's amax per
 * block; 0 for max. */
static uint64_t block_stats(const amx_qspec_t *q, const amx_placement_t *pl)
{
    if (q->calib.kind == AMX_CAL_HISTOGRAM)
        return q->calib.num_bins + 1ull;
    if (q->calib.kind == AMX_CAL_MSE)
        return (uint64_t)q->calib.nsteps * pl->ncells;
    if (q->calib.kind == AMX_CAL_NVFP4_MSE)
        return pl->ncells;
    return 0;
}

/* Global slices that quantizer q's block pl overlaps (0 without slices). */
static uint64_t block_slices(const amx_qspec_t *q, const amx_placement_t *pl)
{
    if (q->global_axes == 0 || pl->ncells == 0)
        return 0;
    uint64_t ns = 1;
    for (uint32_t d = 0; d < q->global_axes; d++)
        ns *= pl->shape[d];
    return ns;
}

typedef struct slab_ent {
    const char *name;
    uint32_t lid;
} slab_ent_t;

static int ent_cmp(const void *a, const void *b)
{
    return strcmp(((const slab_ent_t *)a)->name, ((const slab_ent_t *)b)->name);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

typedef struct slab_build {
    amx_slab_t *sl;
    uint64_t slab_base;
    int agreed;
} slab_build_t;

/* One row of a block: merge run (pending <- slab), and for an agreed
 * quantizer the gather run (slab <- outputs); each joined to the run
 * before it when both sides continue it. */
static void slab_row(void *ud, uint64_t flat, uint64_t boff, uint64_t len)
{
    slab_build_t *b = ud;
    amx_slab_t *sl = b->sl;
    uint64_t cell = b->slab_base + boff;
    amx_run_t *m = sl->nmerge ? &sl->merge[sl->nmerge - 1] : NULL;
    if (m != NULL && m->dst + m->len == flat && m->src + m->len == cell)
        m->len += len;
    else
        sl->merge[sl->nmerge++] = (amx_run_t){flat, cell, len};
    if (!b->agreed)
        return;
    amx_run_t *g = sl->ngather ? &sl->gather[sl->ngather - 1] : NULL;
    if (g != NULL && g->src + g->len == flat && g->dst + g->len == cell)
        g->len += len;
    else
        sl->gather[sl->ngather++] = (amx_run_t){cell, flat, len};
    sl->gather_cells += len;
}

/* The rank's slab layout, rebuilt when the job's layout moved on. */
amx_status_t amx__slab_get(amx_job_t *j, amx_lrank_t *r, amx_slab_t **out, amx_err_t *err)
{
    if (r->slab != NULL && r->slab->gen == j->layout_gen) {
        *out = r->slab;
        return AMX_OK;
    }
    uint32_t n = 0;
    uint64_t nrows = 0, nsl = 0;
    for (uint32_t i = 0; i < r->npls; i++) {
        uint32_t lid = r->pl_lid[i];
        if (r->pl_of[lid] == i + 1 && amx__lq_live(&j->lq[lid])) {
            n++;
            nrows += amx_placement_nrows(&r->pls[i]);
            nsl += block_slices(j->lq[lid].spec, &r->pls[i]);
        }
    }
    amx_slab_t *sl = calloc(1, sizeof(*sl));
    slab_ent_t *e = malloc((n ? n : 1) * sizeof(*e));
    if (sl != NULL) {
        sl->lid = malloc((n ? n : 1) * sizeof(uint32_t));
        sl->off = malloc((n + 1) * sizeof(uint64_t));
        sl->merge = malloc((nrows ? nrows : 1) * sizeof(amx_run_t));
        sl->gather = malloc((nrows ? nrows : 1) * sizeof(amx_run_t));
        sl->soff = malloc((n + 1) * sizeof(uint64_t));
        sl->sg = malloc((nsl ? nsl : 1) * sizeof(uint64_t));
        sl->cidx = malloc((n ? n : 1) * sizeof(uint32_t));
        sl->pendq = malloc((n ? n : 1) * sizeof(uint32_t));
        sl->peerq = malloc((n ? n : 1) * sizeof(uint32_t));
        sl->stoff = malloc((n + 1) * sizeof(uint64_t));
    }
    if (sl == NULL || e == NULL || sl->lid == NULL || sl->off == NULL || sl->merge == NULL ||
        sl->gather == NULL || sl->soff == NULL || sl->sg == NULL || sl->cidx == NULL ||
        sl->pendq == NULL || sl->peerq == NULL || sl->stoff == NULL) {
        free(e);
        amx__slab_free(sl);
        return amx_err_set(err, AMX_ENOMEM, "out of memory building the slab layout of rank %u",
                           r->rank);
    }
    /* The same quantizers as the slab of before (the usual case: the
     * agreement of this rank's proposals changed their statuses and bases,
     * not the set): their order is kept, without sorting the names again. */
    const amx_slab_t *old = r->slab;
    int same = old != NULL && old->n == n;
    for (uint32_t i = 0; same && i < n; i++) {
        uint32_t lid = old->lid[i];
        same = lid < r->cap_of && r->pl_of[lid] != 0 && r->pl_lid[r->pl_of[lid] - 1] == lid &&
               amx__lq_live(&j->lq[lid]);
    }
    if (same) {
        for (uint32_t i = 0; i < n; i++)
            e[i] = (slab_ent_t){j->lq[old->lid[i]].spec->name, old->lid[i]};
    } else {
        uint32_t k = 0;
        for (uint32_t i = 0; i < r->npls; i++) {
            uint32_t lid = r->pl_lid[i];
            if (r->pl_of[lid] == i + 1 && amx__lq_live(&j->lq[lid]))
                e[k++] = (slab_ent_t){j->lq[lid].spec->name, lid};
        }
        qsort(e, n, sizeof(*e), ent_cmp);
    }
    uint64_t h = 1469598103934665603ull, cell = 0, ns = 0, nst = 0;
    slab_build_t b = {sl, 0, 0};
    for (uint32_t i = 0; i < n; i++) {
        uint32_t lid = e[i].lid;
        const amx_lq_t *q = &j->lq[lid];
        const amx_placement_t *pl = &r->pls[r->pl_of[lid] - 1];
        sl->lid[i] = lid;
        sl->off[i] = cell;
        h = fnv(h, q->spec->name, strlen(q->spec->name) + 1);
        h = fnv(h, q->spec->shape, q->spec->ndim * sizeof(uint32_t));
        h = fnv(h, &pl->ndim, sizeof(pl->ndim));
        h = fnv(h, pl->off, pl->ndim * sizeof(uint32_t));
        h = fnv(h, pl->shape, pl->ndim * sizeof(uint32_t));
        h = fnv(h, &q->spec->recipe.format, sizeof(q->spec->recipe.format));
        h = fnv(h, &q->spec->global_axes, sizeof(q->spec->global_axes));
        sl->stoff[i] = nst;
        uint64_t bst = block_stats(q->spec, pl);
        if (bst > 0) {
            /* Only layouts with calibrators beyond max hash them: the ids
             * of the others are what they were. */
            h = fnv(h, &q->spec->calib.kind, 1);
            h = fnv(h, &bst, sizeof(bst));
            sl->nstatq++;
        }
        nst += bst;
        sl->soff[i] = ns;
        sl->cidx[i] = q->status == LQ_AGREED ? (uint32_t)q->cidx : UINT32_MAX;
        if (q->status != LQ_AGREED)
            sl->pendq[sl->npendq++] = i;
        if (q->spec->peer_group[0] != '\0')
            sl->peerq[sl->npeerq++] = i;
        uint64_t bs = block_slices(q->spec, pl);
        for (uint64_t s = 0; s < bs; s++)
            sl->sg[ns + s] = q->status == LQ_AGREED
                                 ? q->gbase + amx_placement_global_slice(pl, q->spec->shape,
                                                                         q->spec->global_axes, s)
                                 : UINT64_MAX;
        ns += bs;
        b.slab_base = cell;
        b.agreed = q->status == LQ_AGREED;
        amx_placement_rows(pl, q->spec->shape, q->base, slab_row, &b);
        cell += pl->ncells;
    }
    sl->off[n] = cell;
    sl->soff[n] = ns;
    sl->stoff[n] = nst;
    sl->n = n;
    sl->gen = j->layout_gen;
    sl->id = fnv(h, &n, sizeof(n));
    static uint64_t serials; /* under the loop lock */
    sl->serial = ++serials;
    free(e);
    amx__slab_free(r->slab);
    r->slab = sl;
    *out = sl;
    return AMX_OK;
}

amx_status_t amx__check_layout_id(const amx_job_t *j, const amx_lrank_t *r, const amx_slab_t *sl,
                                  uint64_t id, const char *what, amx_err_t *err)
{
    if (id == sl->id)
        return AMX_OK;
    return amx_err_set(err, AMX_EPRECOND,
                       "%s of rank %u, job '%s': layout id %016llx is stale (the rank's "
                       "quantizers or placements changed since it was fetched; the layout is now "
                       "%016llx with %u quantizers, %llu cells): fetch the layout again "
                       "(GetLayout) and pack the values by it",
                       what, r->rank, j->name, (unsigned long long)id, (unsigned long long)sl->id,
                       sl->n, (unsigned long long)sl->off[sl->n]);
}

amx_status_t amx_registry_layout(amx_registry_t *reg, const char *job, uint32_t rank,
                                 amx_layout_t *out, amx_arena_t *a, amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, job, rank, 1, &j, err));
    amx_lrank_t *r = amx__local_rank(j, rank);
    amx_slab_t *sl;
    AMX_CHECK(amx__slab_get(j, r, &sl, err));
    uint32_t n = sl->n;
    size_t nd = 0;
    for (uint32_t i = 0; i < n; i++)
        nd += r->pls[r->pl_of[sl->lid[i]] - 1].ndim;
    memset(out, 0, sizeof(*out));
    out->id = sl->id;
    out->total_cells = sl->off[n];
    out->n = n;
    out->ndims = nd;
    size_t m = n ? n : 1, md = nd ? nd : 1;
    out->names = amx_arena_alloc(a, m * sizeof(char *));
    out->slab_offset = amx_arena_alloc(a, m * sizeof(uint64_t));
    out->ncells = amx_arena_alloc(a, m * sizeof(uint64_t));
    out->ndim = amx_arena_alloc(a, m * sizeof(uint32_t));
    out->format = amx_arena_alloc(a, m * sizeof(int));
    out->block_offset = amx_arena_alloc(a, md * sizeof(uint32_t));
    out->block_shape = amx_arena_alloc(a, md * sizeof(uint32_t));
    out->global_shape = amx_arena_alloc(a, md * sizeof(uint32_t));
    out->global_axes = amx_arena_alloc(a, m * sizeof(uint32_t));
    out->slice_offset = amx_arena_alloc(a, m * sizeof(uint64_t));
    out->total_slices = sl->soff[n];
    if (sl->nstatq > 0) {
        out->calibrator = amx_arena_alloc(a, m * sizeof(int));
        out->stat_offset = amx_arena_alloc(a, m * sizeof(uint64_t));
        out->total_stats = sl->stoff[n];
        if (out->calibrator == NULL || out->stat_offset == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory describing a layout");
    }
    if (out->names == NULL || out->slab_offset == NULL || out->ncells == NULL ||
        out->ndim == NULL || out->format == NULL || out->block_offset == NULL ||
        out->block_shape == NULL || out->global_shape == NULL || out->global_axes == NULL ||
        out->slice_offset == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory describing a layout of %u quantizers",
                           n);
    size_t d = 0;
    for (uint32_t i = 0; i < n; i++) {
        const amx_lq_t *q = &j->lq[sl->lid[i]];
        const amx_placement_t *pl = &r->pls[r->pl_of[sl->lid[i]] - 1];
        out->names[i] = q->spec->name;
        out->slab_offset[i] = sl->off[i];
        out->ncells[i] = pl->ncells;
        out->ndim[i] = pl->ndim;
        out->format[i] = q->spec->recipe.format;
        out->global_axes[i] = q->spec->global_axes;
        out->slice_offset[i] = sl->soff[i];
        if (out->calibrator != NULL) {
            out->calibrator[i] = q->spec->calib.kind;
            out->stat_offset[i] = sl->stoff[i];
        }
        for (uint32_t k = 0; k < pl->ndim; k++, d++) {
            out->block_offset[d] = pl->off[k];
            out->block_shape[d] = pl->shape[k];
            out->global_shape[d] = q->spec->shape[k];
        }
    }
    return AMX_OK;
}
