/*
 * job_snap.c - a job's own section of its snapshot (job_snap.h): its
 * counters and its local ranks' placements by name; the replicated state
 * is jobstate.c's, the file format snapshot.c's.
 */
#include "job_snap.h"

#include <stdlib.h>
#include <string.h>

/* The job section of a snapshot: every local rank's placements of the
 * quantizers of the catalog `cat`. The loop defers Register while the job
 * is in flight, so the ranks' tables hold still. Free with amx_job_snap_meta_free. */
amx_status_t amx_job_snap_meta(const amx_job_t *j, const amx_catalog_t *cat, amx_snap_meta_t *m)
{
    memset(m, 0, sizeof(*m));
    m->job = j->name;
    m->world = j->world;
    m->epochs_ok = j->epochs_ok;
    m->epochs_failed = j->epochs_failed;
    m->ranks = calloc(j->nlocal ? j->nlocal : 1, sizeof(*m->ranks));
    if (m->ranks == NULL)
        return AMX_ENOMEM;
    m->nranks = j->nlocal;
    for (uint32_t i = 0; i < j->nlocal; i++) {
        const amx_lrank_t *r = &j->lr[i];
        amx_snap_rank_t *sr = &m->ranks[i];
        sr->rank = r->rank;
        sr->pls = calloc(r->npls ? r->npls : 1, sizeof(*sr->pls));
        if (sr->pls == NULL)
            return AMX_ENOMEM;
        for (uint32_t k = 0; k < r->npls; k++) {
            uint32_t lid = r->pl_lid[k];
            if (lid >= r->cap_of || r->pl_of[lid] != k + 1)
                continue; /* superseded */
            const char *name = j->lq[lid].spec->name;
            if (amx_catalog_find(cat, name) < 0)
                continue; /* not agreed (rejected, or dead) */
            sr->pls[sr->n].name = name;
            sr->pls[sr->n].pl = r->pls[k];
            sr->n++;
        }
    }
    return AMX_OK;
}

void amx_job_snap_meta_free(amx_snap_meta_t *m)
{
    for (uint32_t i = 0; m->ranks != NULL && i < m->nranks; i++)
        free(m->ranks[i].pls);
    free(m->ranks);
    free(m->prev_ok);
    free(m->prev_ga);
    free(m->prev_gs);
    memset(m, 0, sizeof(*m));
}
