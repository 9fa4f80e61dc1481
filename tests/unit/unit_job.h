/*
 * unit_job.h - a job built by hand, as the registry would hold it between
 * epochs, for the tests of what reads a job without the registry: the
 * engine (test_engine.c) and the job's snapshot section (test_job.c).
 *
 * The job is one daemon's (one participant), its agreed catalog laid out
 * in a host state; proposals sit after the agreed cells, as the registry
 * places them; each local rank holds a placement of every quantizer.
 */
#ifndef AMX_TEST_UNIT_JOB_H
#define AMX_TEST_UNIT_JOB_H

#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "job.h"
#include "unit.h"

/* Builds `j` named `name` of `world` ranks, `nlocal` of them here (ranks
 * 0..nlocal-1): agreed specs `agreed` (ownership taken) and proposals
 * `prop` (ownership taken). */
static inline void unit_job_make(amx_job_t *j, const char *name, uint32_t world, uint32_t nlocal,
                                 amx_qspec_t **agreed, uint32_t nagreed, amx_qspec_t **prop,
                                 uint32_t nprop)
{
    amx_err_t err = {0};
    memset(j, 0, sizeof(*j));
    j->name = strdup(name);
    j->world = world;
    j->ready = 1;
    j->epoch = 1;
    if (nagreed == 0) {
        j->cat = amx_catalog_empty();
        ck_assert_ptr_nonnull(j->cat);
    } else {
        ck_assert_int_eq(amx_catalog_build(agreed, nagreed, &j->cat, &err), AMX_OK);
    }
    j->desc = calloc(nagreed ? nagreed : 1, sizeof(amx_qdesc_t));
    amx_catalog_layout(j->cat, j->desc);
    /* The quantizer table: agreed ones first (catalog order), then the
     * proposals with provisional cells after the agreed ones. */
    uint32_t nlq = nagreed + nprop;
    j->lq = calloc(nlq ? nlq : 1, sizeof(amx_lq_t));
    j->cap_lq = nlq;
    ck_assert_int_eq(amx_strmap_reserve(&j->lqmap, nlq), 0);
    for (uint32_t i = 0; i < nagreed; i++) {
        j->lq[i] = (amx_lq_t){.spec = j->cat->q[i],
                              .cidx = (int32_t)i,
                              .status = LQ_AGREED,
                              .base = j->desc[i].base,
                              .gbase = j->desc[i].gbase,
                              .nplacements = nlocal};
        amx_strmap_put(&j->lqmap, j->cat->q[i]->name, i);
    }
    uint64_t prov = j->cat->ncells;
    for (uint32_t k = 0; k < nprop; k++) {
        uint32_t lid = nagreed + k;
        j->lq[lid] = (amx_lq_t){.spec = prop[k],
                                .cidx = -1,
                                .status = LQ_PROPOSED,
                                .base = prov,
                                .nplacements = nlocal};
        prov += prop[k]->ncells;
        j->prov_hist += amx_qspec_hist_cells(prop[k]);
        amx_strmap_put(&j->lqmap, prop[k]->name, lid);
    }
    j->nlq = nlq;
    j->nprop = nprop;
    j->prov_cells = prov - j->cat->ncells;
    /* The state: the agreed layout, pending room for the proposals too. */
    ck_assert_int_eq(amx_state_create("host", 0, &j->state, &err), AMX_OK);
    amx_layout_change_t lc = {.ncells = j->cat->ncells,
                              .nhist = j->cat->nhist,
                              .nq = j->cat->n,
                              .nslices = j->cat->nslices};
    ck_assert_int_eq(j->state->ops->reserve_pending(j->state, j->cat->ncells, &err), AMX_OK);
    ck_assert_int_eq(j->state->ops->remap(j->state, &lc, &err), AMX_OK);
    ck_assert_int_eq(j->state->ops->remap_active(j->state, &lc, &err), AMX_OK);
    ck_assert_int_eq(j->state->ops->reserve_pending(j->state, prov, &err), AMX_OK);
    j->state->ops->publish(j->state);
    /* Membership: this daemon alone. */
    j->mship.world = world;
    j->mship.npart = 1;
    j->mship.part = calloc(1, sizeof(amx_part_t));
    j->mship.part[0].ranks = calloc(nlocal ? nlocal : 1, sizeof(uint32_t));
    j->mship.part[0].nranks = nlocal;
    for (uint32_t r = 0; r < nlocal; r++)
        j->mship.part[0].ranks[r] = r;
    j->me = 0;
    /* Local ranks, each with the whole tensor of every quantizer. */
    j->slot = malloc(world * sizeof(int32_t));
    for (uint32_t r = 0; r < world; r++)
        j->slot[r] = r < nlocal ? (int32_t)r : -1;
    j->lr = calloc(nlocal ? nlocal : 1, sizeof(amx_lrank_t));
    j->nlocal = j->cap_local = nlocal;
    for (uint32_t r = 0; r < nlocal; r++) {
        amx_lrank_t *l = &j->lr[r];
        l->rank = r;
        l->joined = 1;
        l->pl_of = calloc(nlq ? nlq : 1, sizeof(uint32_t));
        l->cap_of = nlq;
        l->pls = calloc(nlq ? nlq : 1, sizeof(amx_placement_t));
        l->pl_lid = calloc(nlq ? nlq : 1, sizeof(uint32_t));
        l->cap_pls = nlq;
        for (uint32_t lid = 0; lid < nlq; lid++) {
            amx_placement_whole(j->lq[lid].spec, &l->pls[l->npls]);
            l->pl_lid[l->npls] = lid;
            l->pl_of[lid] = ++l->npls;
        }
    }
}

/* Merges `vals` (one per cell of the pending layout: agreed cells, then
 * provisional ones) into the active buffer, -inf meaning no data. */
static inline void unit_job_send(amx_job_t *j, const float *vals, uint64_t n)
{
    amx_err_t err = {0};
    amx_run_t all = {0, 0, n};
    ck_assert_int_eq(j->state->ops->merge(j->state, vals, n, &all, 1, 0, &err), AMX_OK);
}

static inline void unit_job_free(amx_job_t *j)
{
    for (uint32_t lid = 0; lid < j->nlq; lid++)
        if (j->lq[lid].status != LQ_AGREED)
            amx_qspec_free(j->lq[lid].spec);
    for (uint32_t r = 0; r < j->nlocal; r++) {
        free(j->lr[r].pl_of);
        free(j->lr[r].pls);
        free(j->lr[r].pl_lid);
    }
    free(j->lr);
    free(j->slot);
    amx_membership_free(&j->mship);
    amx_state_destroy(j->state);
    amx_strmap_free(&j->lqmap);
    free(j->lq);
    free(j->desc);
    amx_catalog_free(j->cat);
    free(j->prev_ga), free(j->prev_gs), free(j->prev_ok);
    free(j->snap_err);
    free(j->name);
    memset(j, 0, sizeof(*j));
}

#endif
