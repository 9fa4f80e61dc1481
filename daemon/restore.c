/*
 * restore.c - jobs and snapshots (snapshot.h, docs/OPERATING.md
 * "Durability"): a job's snapshot written at shutdown or when due, and
 * jobs restored from state_dir at start.
 */
#include "registry_impl.h"

#include "job_snap.h"

#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bytebuf.h"
#include "clock.h"
#include "log.h"
#include "snapshot.h"
#include "state.h"

/* ---- snapshots (snapshot.h, docs/OPERATING.md "Durability") ---- */

/* The job's previous-epoch globals in catalog order, for its snapshot. */
static amx_status_t previous_by_catalog(const amx_job_t *j, amx_snap_meta_t *m)
{
    uint32_t n = j->cat->n;
    if (n == 0)
        return AMX_OK;
    m->prev_ok = calloc(n, 1);
    m->prev_ga = calloc(n, 4);
    m->prev_gs = calloc(n, 4);
    if (m->prev_ok == NULL || m->prev_ga == NULL || m->prev_gs == NULL)
        return AMX_ENOMEM;
    m->nprev = n;
    for (uint32_t i = 0; i < n && i < j->prev_n; i++) {
        if (!j->prev_ok[i])
            continue;
        m->prev_ok[i] = 1;
        m->prev_ga[i] = j->prev_ga[i];
        m->prev_gs[i] = j->prev_gs[i];
    }
    return AMX_OK;
}

/* Writes the last reconciled epoch of a job that snapshot_interval_ms left
 * unwritten; the loop, nothing in flight (shutdown). */
static void flush_snapshot(amx_registry_t *reg, amx_job_t *j)
{
    if (!amx__snapshots_on(reg) || !j->ready || j->in_flight || j->last_reconciled == 0 ||
        j->durable_epoch >= j->last_reconciled)
        return;
    amx_err_t err = {0};
    amx_snap_meta_t m = {0};
    void *meta = NULL, *blob = NULL;
    size_t mlen = 0, blen = 0;
    /* A quantizer whose front global is a layout change's placeholder is
     * marked (NaN), as for a daemon that catches up. */
    uint8_t *g_ok = NULL;
    if (j->pub_ok != NULL && (g_ok = calloc(j->cat->n ? j->cat->n : 1, 1)) != NULL)
        for (uint32_t i = 0; i < j->cat->n; i++)
            g_ok[i] = amx_job_published(j, i);
    amx_status_t st = amx_jobstate_export_marked(j->name, j->last_reconciled, j->cat, j->desc,
                                                 j->state, 0, g_ok, &blob, &blen, &err);
    free(g_ok);
    if (st == AMX_OK && (st = amx_job_snap_meta(j, j->cat, &m)) != AMX_OK)
        amx_err_set(&err, st, "out of memory");
    if (st == AMX_OK && (st = previous_by_catalog(j, &m)) != AMX_OK)
        amx_err_set(&err, st, "out of memory");
    m.state_len = blen;
    if (st == AMX_OK)
        st = amx_snapshot_encode_meta(&m, &meta, &mlen, &err);
    amx_job_snap_meta_free(&m);
    if (st == AMX_OK)
        st = amx_snapshot_write(reg->cfg->state_dir, j->name, meta, mlen, blob, blen, &err);
    free(meta);
    free(blob);
    if (st != AMX_OK) {
        AMX_ERROR("registry", "job %s: epoch %llu could not be written to its snapshot: %s",
                  j->name, (unsigned long long)j->last_reconciled, err.msg);
        return;
    }
    j->durable_epoch = j->last_reconciled;
    AMX_INFO("registry", "job %s: epoch %llu written to its snapshot at shutdown", j->name,
             (unsigned long long)j->last_reconciled);
}

void amx_registry_flush_snapshots(amx_registry_t *reg)
{
    for (amx_job_t *j = reg->jobs; j != NULL; j = j->next)
        flush_snapshot(reg, j);
}

/* Builds job `s` from a snapshot; EINVAL with a sentence when the snapshot
 * does not describe a job this daemon can serve, ENOMEM over a limit. */
static amx_status_t restore_job(amx_registry_t *reg, amx_snapshot_t *s, amx_err_t *err)
{
    const amx_snap_meta_t *m = &s->meta;
    amx_jobstate_t *js = &s->js;
    amx_catalog_t *cat = js->cat;
    if (m->world > (uint64_t)reg->cfg->max_world_size)
        return amx_err_set(err, AMX_ENOMEM, "its world size %u is above max_world_size=%lld",
                           m->world, (long long)reg->cfg->max_world_size);
    if (m->nranks == 0 || m->nranks > m->world)
        return amx_err_set(err, AMX_EINVAL, "it lists %u ranks of a job of world size %u",
                           m->nranks, m->world);
    /* A daemon that served every rank serves the job again at once; one
     * that served some ranks of a cluster job waits for them to re-join
     * (membership is the coordinator's), then takes part with the state it
     * restored, or catches up from a daemon further ahead. */
    int alone = m->nranks == m->world;
    if (cat->n > (uint64_t)reg->cfg->max_quantizers ||
        cat->ncells + cat->nhist > (uint64_t)reg->cfg->max_cells)
        return amx_err_set(err, AMX_ENOMEM,
                           "its %u quantizers / %llu cells are above max_quantizers=%lld or "
                           "max_cells=%lld",
                           cat->n, (unsigned long long)(cat->ncells + cat->nhist),
                           (long long)reg->cfg->max_quantizers, (long long)reg->cfg->max_cells);
    uint64_t used = 0;
    for (const amx_job_t *o = reg->jobs; o != NULL; o = o->next)
        used += amx__view_cells(o);
    if ((used + cat->ncells + cat->nhist) * AMX_STATE_BYTES_PER_CELL > amx__reg_budget(reg))
        return amx_err_set(err, AMX_ENOMEM,
                           "its %llu cells do not fit in memory_budget=%llu MiB beside the jobs "
                           "restored before it",
                           (unsigned long long)(cat->ncells + cat->nhist),
                           (unsigned long long)(amx__reg_budget(reg) >> 20));
    amx_job_t *j = NULL;
    AMX_CHECK(amx__job_create(reg, m->job, m->world, &j, err));
    amx_status_t st = AMX_ENOMEM;
    amx_epoch_result_t res;
    memset(&res, 0, sizeof(res));
    if (alone) {
        /* Membership: this daemon hosts every rank. */
        const amx_cluster_id_t *id = reg->peer != NULL ? amx_peer_id(reg->peer) : NULL;
        j->mship.world = m->world;
        j->mship.part = calloc(1, sizeof(amx_part_t));
        if (j->mship.part == NULL)
            goto nomem;
        j->mship.npart = 1;
        amx_part_t *p = &j->mship.part[0];
        p->daemon = id ? id->rank : 0;
        p->incarnation = id ? id->incarnation : 0;
        snprintf(p->addr, sizeof(p->addr), "%s", id ? id->advertise : "");
        p->ranks = malloc((size_t)m->world * sizeof(uint32_t));
        if (p->ranks == NULL)
            goto nomem;
        p->nranks = m->world;
        for (uint32_t r = 0; r < m->world; r++) {
            p->ranks[r] = r;
            if (amx__add_local_rank(j, r) == NULL)
                goto nomem;
        }
        j->me = 0;
        j->ready = 1;
    } else {
        for (uint32_t i = 0; i < m->nranks; i++) {
            if (m->ranks[i].rank >= m->world || amx__local_rank(j, m->ranks[i].rank) != NULL) {
                amx_err_set(err, AMX_EINVAL, "it lists rank %u %s", m->ranks[i].rank,
                            m->ranks[i].rank >= m->world ? "out of range" : "twice");
                st = AMX_EINVAL;
                goto fail;
            }
            amx_lrank_t *r = amx__add_local_rank(j, m->ranks[i].rank);
            if (r == NULL)
                goto nomem;
            r->restored = 1;
        }
    }
    /* State: both pending buffers sized, the replicated state and the last
     * results imported and published. */
    if (j->state->ops->reserve_pending(j->state, cat->ncells, err) != AMX_OK)
        goto fail;
    /* NaN globals: the quantizer had none published (a flush after an
     * epoch that agreed on it failed); the state takes the placeholder. */
    uint8_t *pub = calloc(cat->n ? cat->n : 1, 1);
    int all_pub = 1;
    if (pub == NULL)
        goto nomem;
    for (uint32_t i = 0; i < cat->n; i++) {
        pub[i] = !isnan(js->a.g_amax[i]);
        all_pub &= pub[i];
        if (!pub[i]) {
            js->a.g_amax[i] = 0.0f;
            js->a.g_scale[i] = js->a.g_inv[i] = 1.0f;
        }
    }
    if (j->state->ops->import_state(j->state, cat->ncells, cat->nhist, cat->n, cat->nslices, &js->a,
                                    err) != AMX_OK) {
        free(pub);
        goto fail;
    }
    j->state->ops->publish(j->state);
    /* Catalog and layout, as an epoch installs them. */
    res.desc = malloc((cat->n ? cat->n : 1) * sizeof(amx_qdesc_t));
    if (res.desc == NULL) {
        free(pub);
        goto nomem;
    }
    amx_catalog_layout(cat, res.desc);
    for (uint32_t i = 0; i < cat->n; i++)
        res.desc[i].hist_head = js->hist_head[i];
    res.cat = cat;
    js->cat = NULL;
    res.pend_change.ncells = cat->ncells;
    res.pend_change.nhist = cat->nhist;
    res.pend_change.nslices = cat->nslices;
    res.pend_change.nq = cat->n;
    res.pend_change.nstat = cat->nstat;
    res.pend_change.nscell = cat->nscell;
    amx__install_catalog(reg, j, &res);
    /* The restored outputs are what the last epoch published, but for
     * the marked placeholders. */
    free(j->pub_ok);
    j->pub_ok = all_pub ? NULL : pub;
    j->pub_n = all_pub ? 0 : cat->n;
    if (all_pub)
        free(pub);
    /* Placements. */
    for (uint32_t i = 0; i < m->nranks; i++) {
        const amx_snap_rank_t *sr = &m->ranks[i];
        amx_lrank_t *r = amx__local_rank(j, sr->rank);
        if (r == NULL || amx__rank_reserve(r, j->nlq, sr->n) != AMX_OK)
            goto nomem;
        for (uint32_t k = 0; k < sr->n; k++) {
            uint32_t lid;
            if (!amx_strmap_get(&j->lqmap, sr->pls[k].name, &lid)) {
                amx_err_set(err, AMX_EINVAL, "rank %u places quantizer '%s', not in the catalog",
                            sr->rank, sr->pls[k].name);
                goto fail;
            }
            const amx_placement_t *in = &sr->pls[k].pl;
            amx_placement_t pl;
            if (r->pl_of[lid] != 0 ||
                amx_placement_parse(j->lq[lid].spec, in->off, in->ndim, in->shape, in->ndim, &pl,
                                    err) != AMX_OK) {
                if (r->pl_of[lid] != 0)
                    amx_err_set(err, AMX_EINVAL, "rank %u places quantizer '%s' twice", sr->rank,
                                sr->pls[k].name);
                st = AMX_EINVAL;
                goto fail;
            }
            r->pls[r->npls] = pl;
            r->pl_lid[r->npls] = lid;
            r->pl_of[lid] = ++r->npls;
            j->lq[lid].nplacements++;
        }
    }
    /* The epoch before the snapshotted one (for has_previous). */
    if (m->nprev == cat->n && cat->n > 0) {
        /* amx__install_catalog made `cat` the job's catalog: the same order. */
        free(j->prev_ga), free(j->prev_gs), free(j->prev_ok);
        j->prev_ga = malloc(cat->n * sizeof(float));
        j->prev_gs = malloc(cat->n * sizeof(float));
        j->prev_ok = malloc(cat->n);
        j->prev_cap = j->prev_n = 0;
        if (j->prev_ga == NULL || j->prev_gs == NULL || j->prev_ok == NULL)
            goto nomem;
        j->prev_cap = j->prev_n = cat->n;
        memcpy(j->prev_ok, m->prev_ok, cat->n);
        memcpy(j->prev_ga, m->prev_ga, cat->n * sizeof(float));
        memcpy(j->prev_gs, m->prev_gs, cat->n * sizeof(float));
    }
    j->prev_serial++;
    j->front_finished = 0;
    j->last_reconciled = js->last_reconciled;
    j->epoch = js->last_reconciled + 1;
    j->epochs_ok = m->epochs_ok;
    j->epochs_failed = m->epochs_failed;
    j->durable_epoch = js->last_reconciled;
    j->restored = 1;
    j->layout_gen++;
    j->last_active_ms = amx_now_ms();
    return AMX_OK;
nomem:
    amx_err_set(err, AMX_ENOMEM, "out of memory");
fail:
    if (st == AMX_ENOMEM && err->code != AMX_OK)
        st = err->code;
    amx_catalog_free(res.cat);
    free(res.desc);
    amx__job_unlink(reg, j);
    amx__job_free(j);
    return st;
}

static int has_suffix(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n > k && strcmp(s + n - k, suf) == 0;
}

amx_status_t amx_registry_restore(amx_registry_t *reg, amx_err_t *err)
{
    if (!amx__snapshots_on(reg))
        return AMX_OK;
    const char *dir = reg->cfg->state_dir;
    if (mkdir(dir, 0750) != 0 && errno != EEXIST)
        return amx_err_set(err, AMX_EUNAVAIL, "state_dir %s cannot be created: %s", dir,
                           strerror(errno));
    if (access(dir, R_OK | W_OK | X_OK) != 0)
        return amx_err_set(err, AMX_EUNAVAIL, "state_dir %s is not a writable directory: %s", dir,
                           strerror(errno));
    DIR *d = opendir(dir);
    if (d == NULL)
        return amx_err_set(err, AMX_EUNAVAIL, "state_dir %s cannot be read: %s", dir,
                           strerror(errno));
    /* Names first: the directory changes as snapshots are set aside. */
    char **names = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (!has_suffix(e->d_name, AMX_SNAPSHOT_SUFFIX) &&
            !has_suffix(e->d_name, AMX_SNAPSHOT_SUFFIX ".tmp"))
            continue;
        if (amx_grow(&names, &cap, n + 1, sizeof(char *), 16, 0) != 0)
            break;
        if ((names[n] = strdup(e->d_name)) != NULL)
            n++;
    }
    closedir(d);
    uint32_t restored = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        char path[4096], aside[4200];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        if (has_suffix(names[i], ".tmp")) {
            AMX_WARN("registry",
                     "removing %s: a snapshot write that did not finish (the snapshot before it "
                     "is intact)",
                     path);
            unlink(path);
            free(names[i]);
            continue;
        }
        amx_snapshot_t s;
        amx_err_t e2 = {0};
        amx_status_t st = amx_snapshot_read(path, &s, &e2);
        if (st == AMX_OK) {
            size_t jl = strlen(s.meta.job);
            if (strlen(names[i]) != jl + strlen(AMX_SNAPSHOT_SUFFIX) ||
                strncmp(names[i], s.meta.job, jl) != 0) {
                st = amx_err_set(&e2, AMX_EINVAL, "it holds job '%s', not the one its name says",
                                 s.meta.job);
            } else if (amx__find_job(reg, s.meta.job) != NULL) {
                st = amx_err_set(&e2, AMX_EINVAL, "job '%s' was restored already", s.meta.job);
            } else {
                st = restore_job(reg, &s, &e2);
            }
            if (st == AMX_OK) {
                amx_job_t *j = amx__find_job(reg, s.meta.job);
                AMX_INFO("registry",
                         "job %s restored from %s: epoch %llu reconciled, %u quantizers, %llu "
                         "cells; its %u ranks carry on after they re-join",
                         j->name, path, (unsigned long long)j->last_reconciled, j->cat->n,
                         (unsigned long long)(j->cat->ncells + j->cat->nhist), j->world);
                restored++;
            }
            amx_snapshot_free(&s);
        }
        if (st == AMX_EINVAL) {
            int rc = amx_snapshot_set_aside(path, aside, sizeof(aside));
            AMX_ERROR("registry", "snapshot %s cannot be used: %s; %s%s", path, e2.msg,
                      rc == 0 ? "moved aside to " : "and it could not be moved aside: ",
                      rc == 0 ? aside : strerror(-rc));
            bad++;
        } else if (st != AMX_OK) {
            AMX_ERROR("registry", "snapshot %s was not restored: %s (the file is left in place)",
                      path, e2.msg);
            bad++;
        }
        free(names[i]);
    }
    free(names);
    if (restored > 0 || bad > 0)
        AMX_INFO("registry", "state_dir %s: %u job(s) restored, %u snapshot(s) not used", dir,
                 restored, bad);
    return AMX_OK;
}
