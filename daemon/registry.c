/*
 * registry.c - jobs, catalogs, placements, contributions and epochs.
 *
 * Layout: a job's quantizers are numbered in the order they were first
 * registered; quantizer i owns cells [desc[i].base, +ncells) of the flat
 * buffers of the job's state backend, and PER_EPOCH quantizers also own
 * hist_len * ncells history cells. Results are keyed by name, so this order
 * never shows in an answer.
 */
#include "registry.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "state.h"
#include "strmap.h"

#define MAX_DIMS 4
#define MAX_NAME 255
#define MAX_JOB_NAME 128

enum { WAIT_JOIN = 1, WAIT_RECONCILE = 2 };

typedef struct placement {
    uint32_t q;
    uint32_t ndim;
    uint32_t off[MAX_DIMS], shape[MAX_DIMS];
    uint64_t ncells;
} placement_t;

typedef struct rank {
    uint8_t joined;
    uint8_t in_reconcile;
    amx_waiter_t *join_w, *rec_w;
    uint32_t *pl_of_q; /* per quantizer: index + 1 into pls, 0 = none */
    uint32_t cap_q;
    placement_t *pls;
    uint32_t npls, cap_pls;
} rank_t;

typedef struct quant {
    char *name;
    uint32_t ndim;
    uint32_t shape[MAX_DIMS];
    uint32_t nplacements;
} quant_t;

typedef struct group_table {
    char **names;
    uint32_t n, cap;
    amx_strmap_t map;
} group_table_t;

typedef struct job {
    char *name;
    uint32_t world;
    uint32_t njoined;
    int ready;
    rank_t *ranks;
    quant_t *q;
    amx_qdesc_t *desc;
    uint32_t *stamp; /* per quantizer: the last SendAmax batch that named it */
    uint32_t batch;
    uint32_t nq, cap_q;
    amx_strmap_t qmap;
    group_table_t peer, scale;
    uint64_t ncells, nhist;
    amx_state_t *state;
    uint64_t epoch;           /* open epoch, from 1 */
    uint64_t last_reconciled; /* 0: none yet */
    uint32_t nin_reconcile;
    uint32_t nwaiting;
    uint64_t updates;
    struct job *next;
} job_t;

struct amx_registry {
    const amx_config_t *cfg;
    char backend[16];
    job_t *jobs;
    uint32_t njobs;
    uint32_t nwaiting;
    /* Scratch for SendAmax: staged values and runs. */
    float *stage;
    uint64_t stage_cap;
    amx_run_t *runs;
    size_t runs_cap;
};

/* ---- validation helpers ---- */

static int valid_job_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > MAX_JOB_NAME)
        return 0;
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && *s != '.' && *s != '_' && *s != '-')
            return 0;
    return 1;
}

static int valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > MAX_NAME)
        return 0;
    for (; *s; s++)
        if ((unsigned char)*s < 0x21 || (unsigned char)*s > 0x7e)
            return 0;
    return 1;
}

static void fmt_shape(char *buf, size_t len, const uint32_t *d, size_t n)
{
    size_t k = (size_t)snprintf(buf, len, "[");
    for (size_t i = 0; i < n && k < len; i++)
        k += (size_t)snprintf(buf + k, len - k, i ? ", %u" : "%u", d[i]);
    if (k < len)
        snprintf(buf + k, len - k, "]");
}

static job_t *find_job(amx_registry_t *reg, const char *name)
{
    for (job_t *j = reg->jobs; j != NULL; j = j->next)
        if (strcmp(j->name, name) == 0)
            return j;
    return NULL;
}

/* The job named in a request, which must exist and be ready, and the rank,
 * which must be inside it. */
static amx_status_t ready_job(amx_registry_t *reg, const char *name, uint32_t rank, int need_rank,
                              job_t **out, amx_err_t *err)
{
    if (name == NULL || !valid_job_name(name))
        return amx_err_set(err, AMX_EINVAL,
                           "job name '%s' is invalid: use 1-%d characters of [A-Za-z0-9._-]",
                           name ? name : "", MAX_JOB_NAME);
    job_t *j = find_job(reg, name);
    if (j == NULL)
        return amx_err_set(err, AMX_ENOTFOUND,
                           "job '%s' is not known to this daemon: call Join first", name);
    if (need_rank && rank >= j->world)
        return amx_err_set(err, AMX_EINVAL, "rank %u is out of range for job '%s' of world size %u",
                           rank, name, j->world);
    if (!j->ready)
        return amx_err_set(err, AMX_EPRECOND,
                           "job '%s' is not ready: %u of %u ranks have joined; wait for Join to "
                           "return",
                           name, j->njoined, j->world);
    *out = j;
    return AMX_OK;
}

/* ---- jobs ---- */

static void group_free(group_table_t *g)
{
    for (uint32_t i = 0; i < g->n; i++)
        free(g->names[i]);
    free(g->names);
    amx_strmap_free(&g->map);
}

static void finish_waiter(amx_registry_t *reg, job_t *j, amx_waiter_t *w, amx_status_t st,
                          const char *msg, const ProtobufCMessage *resp)
{
    rank_t *r = &j->ranks[w->rank];
    if (w->kind == WAIT_JOIN)
        r->join_w = NULL;
    else
        r->rec_w = NULL;
    w->job = NULL;
    j->nwaiting--;
    reg->nwaiting--;
    w->done(w, st, msg, resp);
}

/* Fails every waiter of the job with `st`; used when a job is dropped or
 * the daemon stops. */
static void fail_all_waiters(amx_registry_t *reg, job_t *j, amx_status_t st, const char *why)
{
    char msg[512];
    for (uint32_t r = 0; r < j->world && j->nwaiting > 0; r++) {
        rank_t *rk = &j->ranks[r];
        if (rk->join_w != NULL) {
            snprintf(msg, sizeof(msg), "Join of rank %u to job '%s' ended: %s", r, j->name, why);
            finish_waiter(reg, j, rk->join_w, st, msg, NULL);
        }
        if (rk->rec_w != NULL) {
            snprintf(msg, sizeof(msg), "Reconcile of rank %u, job '%s', epoch %llu ended: %s", r,
                     j->name, (unsigned long long)j->epoch, why);
            rk->in_reconcile = 0;
            j->nin_reconcile--;
            finish_waiter(reg, j, rk->rec_w, st, msg, NULL);
        }
    }
}

static void job_free(job_t *j)
{
    for (uint32_t r = 0; r < j->world; r++) {
        free(j->ranks[r].pl_of_q);
        free(j->ranks[r].pls);
    }
    free(j->ranks);
    for (uint32_t i = 0; i < j->nq; i++)
        free(j->q[i].name);
    free(j->q);
    free(j->desc);
    free(j->stamp);
    amx_strmap_free(&j->qmap);
    group_free(&j->peer);
    group_free(&j->scale);
    amx_state_destroy(j->state);
    free(j->name);
    free(j);
}

static void job_remove(amx_registry_t *reg, job_t *j)
{
    for (job_t **p = &reg->jobs; *p != NULL; p = &(*p)->next) {
        if (*p == j) {
            *p = j->next;
            reg->njobs--;
            break;
        }
    }
    job_free(j);
}

static amx_status_t job_create(amx_registry_t *reg, const char *name, uint32_t world, job_t **out,
                               amx_err_t *err)
{
    if (reg->njobs >= (uint64_t)reg->cfg->max_jobs)
        return amx_err_set(err, AMX_ENOMEM,
                           "this daemon already serves %u jobs (max_jobs); drop a finished job "
                           "with Reset(drop_job) or raise max_jobs",
                           reg->njobs);
    job_t *j = calloc(1, sizeof(*j));
    if (j == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory creating job '%s'", name);
    j->name = strdup(name);
    j->ranks = calloc(world, sizeof(rank_t));
    j->world = world;
    j->epoch = 1;
    amx_status_t st = AMX_ENOMEM;
    if (j->name == NULL || j->ranks == NULL) {
        amx_err_set(err, st, "out of memory creating job '%s' of world size %u", name, world);
        goto fail;
    }
    st = amx_state_create(reg->backend, &j->state, err);
    if (st != AMX_OK)
        goto fail;
    j->next = reg->jobs;
    reg->jobs = j;
    reg->njobs++;
    *out = j;
    return AMX_OK;
fail:
    free(j->name);
    free(j->ranks);
    free(j);
    return st;
}

amx_status_t amx_registry_create(const amx_config_t *cfg, const char *backend, amx_registry_t **out,
                                 amx_err_t *err)
{
    amx_state_t *probe = NULL;
    /* Fail at start-up, not at the first Join, if the backend cannot work. */
    AMX_CHECK(amx_state_create(backend, &probe, err));
    amx_state_destroy(probe);
    amx_registry_t *reg = calloc(1, sizeof(*reg));
    if (reg == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    reg->cfg = cfg;
    snprintf(reg->backend, sizeof(reg->backend), "%s", backend);
    *out = reg;
    return AMX_OK;
}

void amx_registry_destroy(amx_registry_t *reg)
{
    if (reg == NULL)
        return;
    while (reg->jobs != NULL) {
        job_t *j = reg->jobs;
        fail_all_waiters(reg, j, AMX_EUNAVAIL, "the daemon is shutting down; retry after restart");
        job_remove(reg, j);
    }
    free(reg->stage);
    free(reg->runs);
    free(reg);
}

const char *amx_registry_backend(const amx_registry_t *reg)
{
    return reg->backend;
}

uint32_t amx_registry_waiting(const amx_registry_t *reg)
{
    return reg->nwaiting;
}

/* ---- Join ---- */

static void complete_join(amx_registry_t *reg, job_t *j, amx_waiter_t *w, int rejoined)
{
    Amaxd__V1__JoinResponse resp = AMAXD__V1__JOIN_RESPONSE__INIT;
    resp.job = j->name;
    resp.world_size = j->world;
    resp.epoch = j->epoch;
    resp.rejoined = rejoined;
    if (w->job != NULL) {
        finish_waiter(reg, j, w, AMX_OK, NULL, &resp.base);
    } else {
        w->done(w, AMX_OK, NULL, &resp.base);
    }
}

amx_status_t amx_registry_join(amx_registry_t *reg, const Amaxd__V1__JoinRequest *req,
                               amx_waiter_t *w, uint64_t now_ms, amx_err_t *err)
{
    if (!valid_job_name(req->job))
        return amx_err_set(err, AMX_EINVAL,
                           "job name '%s' is invalid: use 1-%d characters of [A-Za-z0-9._-]",
                           req->job, MAX_JOB_NAME);
    if (req->world_size == 0 || req->world_size > (uint64_t)reg->cfg->max_world_size)
        return amx_err_set(err, AMX_EINVAL, "world_size %u of job '%s' must be in [1, %lld]",
                           req->world_size, req->job, (long long)reg->cfg->max_world_size);
    if (req->rank >= req->world_size)
        return amx_err_set(err, AMX_EINVAL, "rank %u is out of range for world size %u (job '%s')",
                           req->rank, req->world_size, req->job);
    job_t *j = find_job(reg, req->job);
    if (j != NULL && j->world != req->world_size)
        return amx_err_set(err, AMX_EPRECOND,
                           "job '%s' exists with world size %u, not %u: every rank must declare "
                           "the same world size (or drop the old job with Reset(drop_job))",
                           req->job, j->world, req->world_size);
    if (j == NULL)
        AMX_CHECK(job_create(reg, req->job, req->world_size, &j, err));
    rank_t *r = &j->ranks[req->rank];
    if (j->ready) {
        AMX_INFO("registry", "job %s: rank %u re-joined; state kept", j->name, req->rank);
        w->job = NULL;
        complete_join(reg, j, w, 1);
        return AMX_OK;
    }
    if (r->join_w != NULL)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is already waiting in Join on another call",
                           req->rank, req->job);
    w->job = j;
    w->rank = req->rank;
    w->kind = WAIT_JOIN;
    w->deadline_ms = now_ms + (uint64_t)reg->cfg->join_timeout_ms;
    r->join_w = w;
    r->joined = 1;
    j->njoined++;
    j->nwaiting++;
    reg->nwaiting++;
    AMX_DEBUG("registry", "job %s: rank %u joined (%u/%u)", j->name, req->rank, j->njoined,
              j->world);
    if (j->njoined == j->world) {
        j->ready = 1;
        AMX_INFO("registry", "job %s: all %u ranks joined", j->name, j->world);
        for (uint32_t i = 0; i < j->world; i++)
            if (j->ranks[i].join_w != NULL)
                complete_join(reg, j, j->ranks[i].join_w, 0);
    }
    return AMX_OK;
}

/* A joining rank gave up (timeout or cancel): it no longer counts. */
static void unjoin(amx_registry_t *reg, job_t *j, uint32_t rank)
{
    j->ranks[rank].joined = 0;
    j->njoined--;
    if (j->njoined == 0 && !j->ready)
        job_remove(reg, j);
}

/* ---- Register ---- */

static amx_status_t normalize_recipe(const char *qname, const Amaxd__V1__Recipe *in, uint8_t acc,
                                     amx_recipe_t *out, amx_err_t *err)
{
    memset(out, 0, sizeof(*out));
    if (in == NULL)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe is missing", qname);
    int fp8 =
        in->format == AMAXD__V1__FORMAT__FP8_E4M3 || in->format == AMAXD__V1__FORMAT__FP8_E5M2;
    if (in->format < 1 || in->format > 4)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.format %d is not FP8_E4M3, FP8_E5M2, NVFP4 or "
                           "MXFP8",
                           qname, (int)in->format);
    out->format = (uint8_t)in->format;
    int rule = in->rule == 0 ? AMX_RULE_CURRENT : (int)in->rule;
    if (rule != AMX_RULE_CURRENT && rule != AMX_RULE_DELAYED)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.rule %d is unknown", qname,
                           (int)in->rule);
    if (!fp8 && in->rule != 0)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.rule applies to FP8 formats only", qname);
    out->rule = (uint8_t)(fp8 ? rule : 0);
    if (!isfinite(in->margin) || in->margin < -100.0f || in->margin > 100.0f)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.margin must be in [-100, 100]",
                           qname);
    if (in->margin != 0.0f && out->rule != AMX_RULE_DELAYED)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.margin applies to FP8 DELAYED scaling only",
                           qname);
    out->margin = in->margin;
    out->history_len = in->history_len == 0 ? 1 : in->history_len;
    if (out->history_len > AMX_HISTORY_MAX)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.history_len %u exceeds %u",
                           qname, in->history_len, AMX_HISTORY_MAX);
    if (out->history_len > 1 && (out->rule != AMX_RULE_DELAYED || acc != AMX_ACC_PER_EPOCH))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.history_len > 1 needs rule DELAYED and "
                           "accumulation PER_EPOCH",
                           qname);
    if (in->history_reduce > 2)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.history_reduce %d is unknown",
                           qname, (int)in->history_reduce);
    out->history_reduce = (uint8_t)(in->history_reduce == 0 ? AMX_HIST_MAX : in->history_reduce);
    if (!isfinite(in->eps) || in->eps < 0.0f)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.eps must be finite and >= 0",
                           qname);
    if ((in->eps != 0.0f || in->power_of_2) && out->rule != AMX_RULE_CURRENT)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.eps and power_of_2 apply to FP8 CURRENT scaling "
                           "only",
                           qname);
    out->eps = in->eps;
    out->power_of_2 = (uint8_t)(in->power_of_2 != 0);
    if (in->nvfp4_convention > 2)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': recipe.nvfp4_convention %d is unknown",
                           qname, (int)in->nvfp4_convention);
    if (in->nvfp4_convention != 0 && in->format != AMAXD__V1__FORMAT__NVFP4)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': recipe.nvfp4_convention applies to NVFP4 only", qname);
    out->nvfp4_convention =
        (uint8_t)(in->format == AMAXD__V1__FORMAT__NVFP4
                      ? (in->nvfp4_convention == 0 ? AMX_NVFP4_TE : in->nvfp4_convention)
                      : 0);
    out->scaled_max = fp8 ? amx_fp8_max(out->format) * powf(2.0f, -out->margin) : 0.0f;
    return AMX_OK;
}

static int recipe_equal(const amx_recipe_t *a, const amx_recipe_t *b)
{
    return a->format == b->format && a->rule == b->rule && a->history_reduce == b->history_reduce &&
           a->nvfp4_convention == b->nvfp4_convention && a->power_of_2 == b->power_of_2 &&
           a->history_len == b->history_len && a->margin == b->margin && a->eps == b->eps;
}

/* One spec after validation, before it is applied. */
typedef struct reg_item {
    const Amaxd__V1__QuantizerSpec *spec;
    amx_recipe_t recipe;
    uint8_t acc;
    uint32_t ndim, shape[MAX_DIMS];
    uint64_t ncells;
    placement_t pl;
    int64_t existing; /* quantizer index, or -1 */
    int same_placement;
    int32_t peer, scale; /* group indices of a new quantizer (phase 2) */
} reg_item_t;

static const char *group_name_of(const group_table_t *g, int32_t idx)
{
    return idx < 0 ? "" : g->names[idx];
}

static amx_status_t validate_spec(amx_registry_t *reg, job_t *j, uint32_t rank,
                                  const Amaxd__V1__QuantizerSpec *s, reg_item_t *it, amx_err_t *err)
{
    char b1[96], b2[96];
    const char *name = s->name;
    if (!valid_name(name))
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer name '%.64s' is invalid: use 1-%d printable ASCII characters "
                           "without spaces",
                           name, MAX_NAME);
    if (s->n_global_shape > MAX_DIMS)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': global_shape has %zu dimensions, at most %d are "
                           "supported",
                           name, s->n_global_shape, MAX_DIMS);
    it->spec = s;
    it->ndim = (uint32_t)s->n_global_shape;
    it->ncells = 1;
    for (uint32_t d = 0; d < it->ndim; d++) {
        if (s->global_shape[d] == 0)
            return amx_err_set(err, AMX_EINVAL, "quantizer '%s': global_shape[%u] is 0", name, d);
        it->shape[d] = s->global_shape[d];
        it->ncells *= s->global_shape[d];
        if (it->ncells > (uint64_t)reg->cfg->max_cells)
            return amx_err_set(err, AMX_ENOMEM,
                               "quantizer '%s': global shape has more than max_cells=%lld cells",
                               name, (long long)reg->cfg->max_cells);
    }
    if (s->accumulation > 2)
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': accumulation %d is unknown", name,
                           (int)s->accumulation);
    it->acc = (uint8_t)(s->accumulation == 0 ? AMX_ACC_RUNNING_MAX : s->accumulation);
    AMX_CHECK(normalize_recipe(name, s->recipe, it->acc, &it->recipe, err));
    if (s->peer_group[0] != '\0' && !valid_name(s->peer_group))
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': peer_group name is invalid", name);
    if (s->scale_group[0] != '\0' && !valid_name(s->scale_group))
        return amx_err_set(err, AMX_EINVAL, "quantizer '%s': scale_group name is invalid", name);
    /* Placement. */
    placement_t *pl = &it->pl;
    memset(pl, 0, sizeof(*pl));
    pl->ndim = it->ndim;
    pl->ncells = 1;
    if (s->n_offset == 0 && s->n_local_shape == 0) {
        memcpy(pl->shape, it->shape, sizeof(pl->shape));
        pl->ncells = it->ncells;
    } else {
        if (s->n_offset != it->ndim || s->n_local_shape != it->ndim)
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': offset has %zu and local_shape %zu entries; both "
                               "need %u (one per global dimension) or none",
                               name, s->n_offset, s->n_local_shape, it->ndim);
        for (uint32_t d = 0; d < it->ndim; d++) {
            if (s->local_shape[d] == 0 ||
                (uint64_t)s->offset[d] + s->local_shape[d] > it->shape[d]) {
                fmt_shape(b1, sizeof(b1), s->offset, s->n_offset);
                fmt_shape(b2, sizeof(b2), s->local_shape, s->n_local_shape);
                return amx_err_set(err, AMX_EINVAL,
                                   "quantizer '%s': block at offset %s of shape %s does not lie "
                                   "inside the global shape (dimension %u)",
                                   name, b1, b2, d);
            }
            pl->off[d] = s->offset[d];
            pl->shape[d] = s->local_shape[d];
            pl->ncells *= s->local_shape[d];
        }
    }
    /* Against the catalog. */
    uint32_t qi;
    it->existing = -1;
    it->same_placement = 0;
    if (amx_strmap_get(&j->qmap, name, &qi)) {
        const quant_t *q = &j->q[qi];
        const amx_qdesc_t *d = &j->desc[qi];
        uint32_t gi;
        int32_t peer = s->peer_group[0] && amx_strmap_get(&j->peer.map, s->peer_group, &gi)
                           ? (int32_t)gi
                           : (s->peer_group[0] ? -2 : -1);
        int32_t scale = s->scale_group[0] && amx_strmap_get(&j->scale.map, s->scale_group, &gi)
                            ? (int32_t)gi
                            : (s->scale_group[0] ? -2 : -1);
        if (q->ndim != it->ndim || memcmp(q->shape, it->shape, it->ndim * sizeof(uint32_t)) != 0) {
            fmt_shape(b1, sizeof(b1), q->shape, q->ndim);
            fmt_shape(b2, sizeof(b2), it->shape, it->ndim);
            return amx_err_set(err, AMX_EPRECOND,
                               "quantizer '%s' of job '%s' is registered with global shape %s, "
                               "rank %u declares %s: all ranks must declare the same global shape",
                               name, j->name, b1, rank, b2);
        }
        if (!recipe_equal(&d->recipe, &it->recipe) || d->accumulation != it->acc)
            return amx_err_set(err, AMX_EPRECOND,
                               "quantizer '%s' of job '%s' is registered with another recipe or "
                               "accumulation than rank %u declares; reset the job or use a new "
                               "name",
                               name, j->name, rank);
        if (peer != d->peer_group || scale != d->scale_group)
            return amx_err_set(err, AMX_EPRECOND,
                               "quantizer '%s' of job '%s' is registered with peer_group '%s' and "
                               "scale_group '%s', rank %u declares '%s' and '%s'",
                               name, j->name, group_name_of(&j->peer, d->peer_group),
                               group_name_of(&j->scale, d->scale_group), rank, s->peer_group,
                               s->scale_group);
        it->existing = qi;
        rank_t *r = &j->ranks[rank];
        if (qi < r->cap_q && r->pl_of_q[qi] != 0) {
            const placement_t *old = &r->pls[r->pl_of_q[qi] - 1];
            if (memcmp(old->off, pl->off, sizeof(pl->off)) != 0 ||
                memcmp(old->shape, pl->shape, sizeof(pl->shape)) != 0) {
                fmt_shape(b1, sizeof(b1), old->off, old->ndim);
                fmt_shape(b2, sizeof(b2), old->shape, old->ndim);
                return amx_err_set(err, AMX_EPRECOND,
                                   "rank %u already placed quantizer '%s' at offset %s with shape "
                                   "%s; a placement cannot change within a job",
                                   rank, name, b1, b2);
            }
            it->same_placement = 1;
        }
    }
    return AMX_OK;
}

static amx_status_t group_intern(group_table_t *g, const char *name, int32_t *idx)
{
    uint32_t gi;
    if (name[0] == '\0') {
        *idx = -1;
        return AMX_OK;
    }
    if (amx_strmap_get(&g->map, name, &gi)) {
        *idx = (int32_t)gi;
        return AMX_OK;
    }
    if (g->n == g->cap) {
        uint32_t cap = g->cap ? g->cap * 2 : 8;
        char **n = realloc(g->names, cap * sizeof(char *));
        if (n == NULL)
            return AMX_ENOMEM;
        g->names = n;
        g->cap = cap;
    }
    char *copy = strdup(name);
    if (copy == NULL || amx_strmap_put(&g->map, copy, g->n) != 0) {
        free(copy);
        return AMX_ENOMEM;
    }
    g->names[g->n] = copy;
    *idx = (int32_t)g->n++;
    return AMX_OK;
}

static amx_status_t rank_reserve(rank_t *r, uint32_t nq, uint32_t npls)
{
    if (nq > r->cap_q) {
        uint32_t cap = r->cap_q ? r->cap_q : 64;
        while (cap < nq)
            cap *= 2;
        uint32_t *p = realloc(r->pl_of_q, cap * sizeof(uint32_t));
        if (p == NULL)
            return AMX_ENOMEM;
        memset(p + r->cap_q, 0, (cap - r->cap_q) * sizeof(uint32_t));
        r->pl_of_q = p;
        r->cap_q = cap;
    }
    if (npls > r->cap_pls) {
        uint32_t cap = r->cap_pls ? r->cap_pls : 64;
        while (cap < npls)
            cap *= 2;
        placement_t *p = realloc(r->pls, cap * sizeof(placement_t));
        if (p == NULL)
            return AMX_ENOMEM;
        r->pls = p;
        r->cap_pls = cap;
    }
    return AMX_OK;
}

static amx_status_t job_reserve_q(job_t *j, uint32_t nq)
{
    if (nq <= j->cap_q)
        return AMX_OK;
    uint32_t cap = j->cap_q ? j->cap_q : 64;
    while (cap < nq)
        cap *= 2;
    quant_t *q = realloc(j->q, cap * sizeof(quant_t));
    if (q == NULL)
        return AMX_ENOMEM;
    j->q = q;
    amx_qdesc_t *d = realloc(j->desc, cap * sizeof(amx_qdesc_t));
    if (d == NULL)
        return AMX_ENOMEM;
    j->desc = d;
    uint32_t *stamp = realloc(j->stamp, cap * sizeof(uint32_t));
    if (stamp == NULL)
        return AMX_ENOMEM;
    memset(stamp + j->cap_q, 0, (cap - j->cap_q) * sizeof(uint32_t));
    j->stamp = stamp;
    j->cap_q = cap;
    if (amx_strmap_reserve(&j->qmap, cap) != 0)
        return AMX_ENOMEM;
    return AMX_OK;
}

amx_status_t amx_registry_register(amx_registry_t *reg, const Amaxd__V1__RegisterRequest *req,
                                   Amaxd__V1__RegisterResponse *resp, amx_err_t *err)
{
    job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, 1, &j, err));
    size_t n = req->n_quantizers;
    if (n == 0)
        return amx_err_set(err, AMX_EINVAL, "Register of rank %u, job '%s' names no quantizer",
                           req->rank, j->name);
    reg_item_t *items = calloc(n, sizeof(*items));
    amx_strmap_t seen = {0};
    char **names = calloc(n, sizeof(char *));
    amx_status_t st = AMX_OK;
    if (items == NULL || names == NULL || amx_strmap_reserve(&seen, n) != 0) {
        st = amx_err_set(err, AMX_ENOMEM, "out of memory registering %zu quantizers", n);
        goto out;
    }
    /* Phase 1: validate everything; nothing changes. */
    uint64_t new_cells = 0, new_hist = 0;
    uint32_t new_q = 0, new_pls = 0;
    for (size_t i = 0; i < n; i++) {
        reg_item_t *it = &items[i];
        AMX_CHECK_GOTO(validate_spec(reg, j, req->rank, req->quantizers[i], it, err), st, out);
        uint32_t prev;
        if (amx_strmap_get(&seen, req->quantizers[i]->name, &prev)) {
            st = amx_err_set(err, AMX_EINVAL,
                             "quantizer '%s' appears twice in one Register request of rank %u",
                             req->quantizers[i]->name, req->rank);
            goto out;
        }
        amx_strmap_put(&seen, req->quantizers[i]->name, (uint32_t)i);
        if (it->existing < 0) {
            names[i] = strdup(req->quantizers[i]->name);
            if (names[i] == NULL) {
                st = amx_err_set(err, AMX_ENOMEM, "out of memory");
                goto out;
            }
            new_q++;
            new_cells += it->ncells;
            if (it->acc == AMX_ACC_PER_EPOCH)
                new_hist += it->ncells * it->recipe.history_len;
        }
        if (!it->same_placement)
            new_pls++;
    }
    if (j->ncells + j->nhist + new_cells + new_hist > (uint64_t)reg->cfg->max_cells) {
        st = amx_err_set(err, AMX_ENOMEM,
                         "job '%s' would hold %llu amax cells (history included), more than "
                         "max_cells=%lld; register fewer or smaller quantizers or raise max_cells",
                         j->name, (unsigned long long)(j->ncells + j->nhist + new_cells + new_hist),
                         (long long)reg->cfg->max_cells);
        goto out;
    }
    if ((uint64_t)j->nq + new_q > (uint64_t)reg->cfg->max_quantizers) {
        st = amx_err_set(
            err, AMX_ENOMEM, "job '%s' would hold %llu quantizers, more than max_quantizers=%lld",
            j->name, (unsigned long long)j->nq + new_q, (long long)reg->cfg->max_quantizers);
        goto out;
    }
    /* Phase 2: make room (may fail, changes nothing visible). */
    rank_t *r = &j->ranks[req->rank];
    if (job_reserve_q(j, j->nq + new_q) != AMX_OK ||
        rank_reserve(r, j->nq + new_q, r->npls + new_pls) != AMX_OK) {
        st = amx_err_set(err, AMX_ENOMEM, "out of memory registering %zu quantizers", n);
        goto out;
    }
    AMX_CHECK_GOTO(j->state->ops->reserve(j->state, j->ncells + new_cells, j->nhist + new_hist,
                                          j->nq + new_q, err),
                   st, out);
    /* Group names too: a name interned for a batch that then fails would only
     * be a group without members, which changes no result. */
    for (size_t i = 0; i < n; i++) {
        reg_item_t *it = &items[i];
        if (it->existing < 0 &&
            (group_intern(&j->peer, it->spec->peer_group, &it->peer) != AMX_OK ||
             group_intern(&j->scale, it->spec->scale_group, &it->scale) != AMX_OK)) {
            st = amx_err_set(err, AMX_ENOMEM, "out of memory interning group names");
            goto out;
        }
    }
    /* Phase 3: apply; nothing below can fail. */
    uint32_t created = 0, existing = 0;
    for (size_t i = 0; i < n; i++) {
        reg_item_t *it = &items[i];
        uint32_t qi;
        if (it->existing >= 0) {
            qi = (uint32_t)it->existing;
            existing++;
        } else {
            qi = j->nq++;
            quant_t *q = &j->q[qi];
            memset(q, 0, sizeof(*q));
            q->name = names[i];
            names[i] = NULL;
            q->ndim = it->ndim;
            memcpy(q->shape, it->shape, sizeof(q->shape));
            amx_strmap_put(&j->qmap, q->name, qi); /* reserved above: cannot fail */
            amx_qdesc_t *d = &j->desc[qi];
            memset(d, 0, sizeof(*d));
            d->base = j->ncells;
            d->ncells = it->ncells;
            d->hist_base = j->nhist;
            d->hist_len = it->acc == AMX_ACC_PER_EPOCH ? it->recipe.history_len : 1;
            d->peer_group = it->peer;
            d->scale_group = it->scale;
            d->accumulation = it->acc;
            d->recipe = it->recipe;
            j->ncells += it->ncells;
            if (it->acc == AMX_ACC_PER_EPOCH)
                j->nhist += it->ncells * it->recipe.history_len;
            created++;
        }
        if (!it->same_placement) {
            it->pl.q = qi;
            r->pls[r->npls] = it->pl;
            r->pl_of_q[qi] = ++r->npls;
            j->q[qi].nplacements++;
        }
    }
    resp->created = created;
    resp->existing = existing;
    resp->catalog_size = j->nq;
    AMX_DEBUG("registry", "job %s: rank %u registered %u new, %u known quantizers (catalog %u)",
              j->name, req->rank, created, existing, j->nq);
out:
    if (names != NULL)
        for (size_t i = 0; i < n; i++)
            free(names[i]);
    free(names);
    free(items);
    amx_strmap_free(&seen);
    return st;
}

/* ---- placement geometry ---- */

/* Row-major strides of a shape. */
static void strides_of(const uint32_t *shape, uint32_t ndim, uint64_t *stride)
{
    uint64_t s = 1;
    for (int d = (int)ndim - 1; d >= 0; d--) {
        stride[d] = s;
        s *= shape[d];
    }
}

/*
 * Calls fn(dst_cell, src_index, len) for each contiguous row of block `pl`
 * inside the global tensor `gshape` whose first cell is `base`; src_index
 * counts cells of the block in row-major order.
 */
typedef void (*row_fn)(void *ud, uint64_t dst, uint64_t src, uint64_t len);

static void for_each_row(const placement_t *pl, const uint32_t *gshape, uint64_t base, row_fn fn,
                         void *ud)
{
    if (pl->ndim == 0) {
        fn(ud, base, 0, 1);
        return;
    }
    uint64_t gstride[MAX_DIMS];
    strides_of(gshape, pl->ndim, gstride);
    uint32_t last = pl->ndim - 1;
    uint64_t rowlen = pl->shape[last];
    uint64_t nrows = pl->ncells / rowlen;
    uint32_t idx[MAX_DIMS] = {0};
    for (uint64_t row = 0; row < nrows; row++) {
        uint64_t dst = base;
        for (uint32_t d = 0; d < pl->ndim; d++)
            dst += (uint64_t)(pl->off[d] + (d == last ? 0 : idx[d])) * gstride[d];
        fn(ud, dst, row * rowlen, rowlen);
        for (int d = (int)last - 1; d >= 0; d--) {
            if (++idx[d] < pl->shape[d])
                break;
            idx[d] = 0;
        }
    }
}

/* ---- SendAmax ---- */

static amx_status_t check_epoch(job_t *j, uint64_t want, uint32_t rank, const char *what,
                                amx_err_t *err)
{
    if (want == 0 || want == j->epoch)
        return AMX_OK;
    if (want < j->epoch)
        return amx_err_set(err, AMX_EPRECOND,
                           "%s of rank %u names epoch %llu of job '%s', which is already "
                           "reconciled; the open epoch is %llu (or pass epoch 0)",
                           what, rank, (unsigned long long)want, j->name,
                           (unsigned long long)j->epoch);
    return amx_err_set(err, AMX_EPRECOND,
                       "%s of rank %u names epoch %llu of job '%s', which is not open yet; the "
                       "open epoch is %llu",
                       what, rank, (unsigned long long)want, j->name, (unsigned long long)j->epoch);
}

typedef struct stage_ctx {
    amx_registry_t *reg;
    size_t nruns;
    uint64_t src_base;
} stage_ctx_t;

static void stage_row(void *ud, uint64_t dst, uint64_t src, uint64_t len)
{
    stage_ctx_t *c = ud;
    amx_run_t *run = &c->reg->runs[c->nruns++];
    run->dst = dst;
    run->src = c->src_base + src;
    run->len = len;
}

static amx_status_t stage_reserve(amx_registry_t *reg, uint64_t nvals, size_t nruns)
{
    if (nvals > reg->stage_cap) {
        uint64_t cap = reg->stage_cap ? reg->stage_cap : 4096;
        while (cap < nvals)
            cap *= 2;
        float *p = realloc(reg->stage, cap * sizeof(float));
        if (p == NULL)
            return AMX_ENOMEM;
        reg->stage = p;
        reg->stage_cap = cap;
    }
    if (nruns > reg->runs_cap) {
        size_t cap = reg->runs_cap ? reg->runs_cap : 1024;
        while (cap < nruns)
            cap *= 2;
        amx_run_t *p = realloc(reg->runs, cap * sizeof(amx_run_t));
        if (p == NULL)
            return AMX_ENOMEM;
        reg->runs = p;
        reg->runs_cap = cap;
    }
    return AMX_OK;
}

amx_status_t amx_registry_send(amx_registry_t *reg, const Amaxd__V1__SendAmaxRequest *req,
                               Amaxd__V1__SendAmaxResponse *resp, amx_err_t *err)
{
    job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, 1, &j, err));
    AMX_CHECK(check_epoch(j, req->epoch, req->rank, "SendAmax", err));
    rank_t *r = &j->ranks[req->rank];
    if (r->in_reconcile)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' already entered Reconcile for epoch %llu; send "
                           "amax before calling Reconcile (this update belongs to the next epoch)",
                           req->rank, j->name, (unsigned long long)j->epoch);
    /* Pass 1: names, placements and sizes. */
    uint64_t nvals = 0;
    size_t nruns = 0;
    int overlap = 0;
    if (++j->batch == 0) { /* wrapped: forget old stamps */
        memset(j->stamp, 0, j->cap_q * sizeof(uint32_t));
        j->batch = 1;
    }
    for (size_t u = 0; u < req->n_updates; u++) {
        const Amaxd__V1__AmaxUpdate *up = req->updates[u];
        uint32_t qi;
        if (!amx_strmap_get(&j->qmap, up->name, &qi))
            return amx_err_set(err, AMX_ENOTFOUND,
                               "update %zu: quantizer '%.255s' is not registered in job '%s'", u,
                               up->name, j->name);
        if (qi >= r->cap_q || r->pl_of_q[qi] == 0)
            return amx_err_set(err, AMX_EPRECOND,
                               "update %zu: rank %u has no placement for quantizer '%s' of job "
                               "'%s'; Register it from this rank first",
                               u, req->rank, up->name, j->name);
        const placement_t *pl = &r->pls[r->pl_of_q[qi] - 1];
        overlap |= j->stamp[qi] == j->batch; /* named twice in this batch */
        j->stamp[qi] = j->batch;
        if (up->values.len != pl->ncells * sizeof(float))
            return amx_err_set(err, AMX_EINVAL,
                               "update %zu: quantizer '%s' has %zu bytes of values; rank %u's "
                               "block has %llu float32 cells = %llu bytes",
                               u, up->name, up->values.len, req->rank,
                               (unsigned long long)pl->ncells,
                               (unsigned long long)pl->ncells * sizeof(float));
        if (up->has_data.len != 0 && up->has_data.len != pl->ncells)
            return amx_err_set(err, AMX_EINVAL,
                               "update %zu: quantizer '%s' has_data has %zu bytes; it needs one "
                               "per cell of rank %u's block (%llu) or none",
                               u, up->name, up->has_data.len, req->rank,
                               (unsigned long long)pl->ncells);
        nvals += pl->ncells;
        nruns += pl->ndim == 0 ? 1 : pl->ncells / pl->shape[pl->ndim - 1];
    }
    if (stage_reserve(reg, nvals, nruns) != AMX_OK)
        return amx_err_set(err, AMX_ENOMEM, "out of memory staging %llu amax values",
                           (unsigned long long)nvals);
    /* Pass 2: values, staged as host floats. */
    stage_ctx_t ctx = {reg, 0, 0};
    for (size_t u = 0; u < req->n_updates; u++) {
        const Amaxd__V1__AmaxUpdate *up = req->updates[u];
        uint32_t qi;
        amx_strmap_get(&j->qmap, up->name, &qi);
        const placement_t *pl = &r->pls[r->pl_of_q[qi] - 1];
        float *dst = reg->stage + ctx.src_base;
        memcpy(dst, up->values.data, up->values.len); /* float32 LE on an LE host */
        const uint8_t *mask = up->has_data.len ? up->has_data.data : NULL;
        for (uint64_t c = 0; c < pl->ncells; c++) {
            if (mask != NULL && mask[c] == 0) {
                dst[c] = -INFINITY; /* no data: the merge leaves the cell as it is */
                continue;
            }
            float v = dst[c];
            if (!(v >= 0.0f) || !isfinite(v))
                return amx_err_set(err, AMX_EINVAL,
                                   "update %zu: quantizer '%s' value[%llu] = %g; amax values must "
                                   "be finite and >= 0 (nothing of this request was applied)",
                                   u, up->name, (unsigned long long)c, (double)v);
            dst[c] = v + 0.0f; /* -0.0 becomes +0.0 */
        }
        for_each_row(pl, j->q[qi].shape, j->desc[qi].base, stage_row, &ctx);
        ctx.src_base += pl->ncells;
    }
    AMX_CHECK(
        j->state->ops->merge(j->state, reg->stage, nvals, reg->runs, ctx.nruns, overlap, err));
    j->updates += req->n_updates;
    resp->accepted = req->n_updates;
    resp->epoch = j->epoch;
    return AMX_OK;
}

/* ---- results ---- */

typedef struct gather_ctx {
    const amx_state_t *st;
    float *amax, *scale, *scale_inv;
    uint8_t *bytes;
    uint32_t missing;
} gather_ctx_t;

static void gather_row(void *ud, uint64_t dst, uint64_t src, uint64_t len)
{
    gather_ctx_t *c = ud;
    for (uint64_t i = 0; i < len; i++) {
        float a = c->st->out_amax[dst + i];
        if (a == -INFINITY) {
            a = 0.0f;
            c->missing++;
        }
        c->amax[src + i] = a;
    }
    memcpy(c->scale + src, c->st->out_scale + dst, len * sizeof(float));
    memcpy(c->scale_inv + src, c->st->out_scale_inv + dst, len * sizeof(float));
    memcpy(c->bytes + src, c->st->out_bytes + dst, len);
}

/* Builds the result of quantizer qi restricted to block pl. */
static Amaxd__V1__QuantizerResult *build_result(job_t *j, uint32_t qi, const placement_t *pl,
                                                amx_arena_t *a)
{
    Amaxd__V1__QuantizerResult *res = amx_arena_alloc(a, sizeof(*res));
    if (res == NULL)
        return NULL;
    amaxd__v1__quantizer_result__init(res);
    res->name = j->q[qi].name;
    res->n_offset = res->n_shape = pl->ndim;
    res->offset = amx_arena_alloc(a, MAX_DIMS * sizeof(uint32_t));
    res->shape = amx_arena_alloc(a, MAX_DIMS * sizeof(uint32_t));
    gather_ctx_t c = {j->state,
                      amx_arena_alloc(a, pl->ncells * sizeof(float)),
                      amx_arena_alloc(a, pl->ncells * sizeof(float)),
                      amx_arena_alloc(a, pl->ncells * sizeof(float)),
                      amx_arena_alloc(a, pl->ncells),
                      0};
    if (res->offset == NULL || res->shape == NULL || c.amax == NULL || c.scale == NULL ||
        c.scale_inv == NULL || c.bytes == NULL)
        return NULL;
    memcpy(res->offset, pl->off, pl->ndim * sizeof(uint32_t));
    memcpy(res->shape, pl->shape, pl->ndim * sizeof(uint32_t));
    for_each_row(pl, j->q[qi].shape, j->desc[qi].base, gather_row, &c);
    res->amax.data = (uint8_t *)c.amax;
    res->amax.len = pl->ncells * sizeof(float);
    res->scale.data = (uint8_t *)c.scale;
    res->scale.len = pl->ncells * sizeof(float);
    res->scale_inv.data = (uint8_t *)c.scale_inv;
    res->scale_inv.len = pl->ncells * sizeof(float);
    res->block_scales.data = c.bytes;
    res->block_scales.len = pl->ncells;
    res->global_amax = j->state->out_gamax[qi];
    res->global_scale = j->state->out_gscale[qi];
    res->global_scale_inv = j->state->out_gscale_inv[qi];
    res->missing = c.missing;
    return res;
}

static void whole_placement(const job_t *j, uint32_t qi, placement_t *pl)
{
    memset(pl, 0, sizeof(*pl));
    pl->q = qi;
    pl->ndim = j->q[qi].ndim;
    memcpy(pl->shape, j->q[qi].shape, sizeof(pl->shape));
    pl->ncells = j->desc[qi].ncells;
}

/* Validates `names` for rank (or global when rank < 0) and counts results. */
static amx_status_t check_names(job_t *j, int64_t rank, char **names, size_t n, size_t *count,
                                amx_err_t *err)
{
    if (n == 0) {
        *count = rank < 0 ? j->nq : j->ranks[rank].npls;
        return AMX_OK;
    }
    for (size_t i = 0; i < n; i++) {
        uint32_t qi;
        if (!amx_strmap_get(&j->qmap, names[i], &qi))
            return amx_err_set(err, AMX_ENOTFOUND,
                               "quantizer '%.255s' is not registered in job '%s'", names[i],
                               j->name);
        if (rank >= 0 && (qi >= j->ranks[rank].cap_q || j->ranks[rank].pl_of_q[qi] == 0))
            return amx_err_set(err, AMX_EPRECOND,
                               "rank %lld has no placement for quantizer '%s' of job '%s'; ask "
                               "with global=true for the whole tensor",
                               (long long)rank, names[i], j->name);
    }
    *count = n;
    return AMX_OK;
}

static amx_status_t build_results(job_t *j, int64_t rank, char **names, size_t n,
                                  Amaxd__V1__QuantizerResult ***out, size_t *nout, amx_arena_t *a,
                                  amx_err_t *err)
{
    size_t count;
    AMX_CHECK(check_names(j, rank, names, n, &count, err));
    Amaxd__V1__QuantizerResult **res = amx_arena_alloc(a, (count ? count : 1) * sizeof(*res));
    if (res == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory building %zu results", count);
    for (size_t i = 0; i < count; i++) {
        placement_t whole;
        const placement_t *pl;
        uint32_t qi;
        if (n == 0)
            qi = rank < 0 ? (uint32_t)i : j->ranks[rank].pls[i].q;
        else
            amx_strmap_get(&j->qmap, names[i], &qi);
        if (rank < 0) {
            whole_placement(j, qi, &whole);
            pl = &whole;
        } else {
            pl = &j->ranks[rank].pls[j->ranks[rank].pl_of_q[qi] - 1];
        }
        res[i] = build_result(j, qi, pl, a);
        if (res[i] == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory building results");
    }
    *out = res;
    *nout = count;
    return AMX_OK;
}

/* ---- Reconcile ---- */

static void missing_ranks(const job_t *j, int joined, char *buf, size_t len)
{
    size_t k = 0;
    int shown = 0, total = 0;
    buf[0] = '\0';
    for (uint32_t r = 0; r < j->world; r++) {
        int missing = joined ? !j->ranks[r].joined : !j->ranks[r].in_reconcile;
        if (!missing)
            continue;
        total++;
        if (shown < 16 && k < len) {
            k += (size_t)snprintf(buf + k, len - k, shown ? ", %u" : "%u", r);
            shown++;
        }
    }
    if (total > shown && k < len)
        snprintf(buf + k, len - k, " and %d more", total - shown);
}

/* All ranks are in: reduce, post-process, answer everyone. */
static void run_epoch(amx_registry_t *reg, job_t *j)
{
    amx_err_t err = {0};
    uint64_t e = j->epoch;
    amx_comm_t *comm = amx_comm_local_create();
    amx_status_t st = comm == NULL ? amx_err_set(&err, AMX_ENOMEM, "out of memory")
                                   : j->state->ops->reconcile(j->state, j->desc, j->nq, j->peer.n,
                                                              j->scale.n, comm, &err);
    if (comm != NULL)
        comm->destroy(comm);
    if (st != AMX_OK) {
        char msg[1024];
        snprintf(msg, sizeof(msg), "epoch %llu of job '%s' could not be reconciled: %s",
                 (unsigned long long)e, j->name, err.msg);
        AMX_ERROR("registry", "%s", msg);
        fail_all_waiters(reg, j, st, msg);
        return;
    }
    for (uint32_t qi = 0; qi < j->nq; qi++)
        if (j->desc[qi].accumulation == AMX_ACC_PER_EPOCH)
            j->desc[qi].hist_head = (j->desc[qi].hist_head + 1) % j->desc[qi].hist_len;
    j->last_reconciled = e;
    j->epoch = e + 1;
    AMX_DEBUG("registry", "job %s: epoch %llu reconciled (%u quantizers, %llu cells)", j->name,
              (unsigned long long)e, j->nq, (unsigned long long)j->ncells);
    for (uint32_t r = 0; r < j->world; r++) {
        rank_t *rk = &j->ranks[r];
        if (!rk->in_reconcile)
            continue;
        rk->in_reconcile = 0;
        j->nin_reconcile--;
        amx_waiter_t *w = rk->rec_w;
        amx_arena_t a = {0};
        amx_err_t e2 = {0};
        Amaxd__V1__ReconcileResponse resp = AMAXD__V1__RECONCILE_RESPONSE__INIT;
        resp.epoch = e;
        resp.next_epoch = j->epoch;
        st = build_results(j, r, w->names, w->n_names, &resp.results, &resp.n_results, &a, &e2);
        if (st == AMX_OK)
            finish_waiter(reg, j, w, AMX_OK, NULL, &resp.base);
        else
            finish_waiter(reg, j, w, st, e2.msg, NULL);
        amx_arena_free(&a);
    }
}

amx_status_t amx_registry_reconcile(amx_registry_t *reg, const Amaxd__V1__ReconcileRequest *req,
                                    amx_waiter_t *w, uint64_t now_ms, amx_err_t *err)
{
    job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, 1, &j, err));
    AMX_CHECK(check_epoch(j, req->epoch, req->rank, "Reconcile", err));
    rank_t *r = &j->ranks[req->rank];
    if (r->in_reconcile)
        return amx_err_set(err, AMX_EPRECOND,
                           "rank %u of job '%s' is already waiting in Reconcile for epoch %llu on "
                           "another call",
                           req->rank, j->name, (unsigned long long)j->epoch);
    size_t count;
    AMX_CHECK(check_names(j, req->rank, req->names, req->n_names, &count, err));
    w->job = j;
    w->rank = req->rank;
    w->kind = WAIT_RECONCILE;
    w->deadline_ms = now_ms + (uint64_t)reg->cfg->reconcile_timeout_ms;
    w->names = req->names;
    w->n_names = req->n_names;
    r->rec_w = w;
    r->in_reconcile = 1;
    j->nin_reconcile++;
    j->nwaiting++;
    reg->nwaiting++;
    if (j->nin_reconcile == j->world)
        run_epoch(reg, j);
    return AMX_OK;
}

void amx_registry_cancel(amx_registry_t *reg, amx_waiter_t *w)
{
    job_t *j = w->job;
    if (j == NULL)
        return;
    rank_t *r = &j->ranks[w->rank];
    w->job = NULL;
    j->nwaiting--;
    reg->nwaiting--;
    if (w->kind == WAIT_JOIN) {
        r->join_w = NULL;
        AMX_INFO("registry", "job %s: rank %u left Join (client went away)", j->name, w->rank);
        unjoin(reg, j, w->rank);
    } else {
        r->rec_w = NULL;
        r->in_reconcile = 0;
        j->nin_reconcile--;
        AMX_INFO("registry", "job %s: rank %u left Reconcile of epoch %llu (client went away)",
                 j->name, w->rank, (unsigned long long)j->epoch);
    }
}

void amx_registry_expire(amx_registry_t *reg, uint64_t now_ms)
{
    char msg[1024], missing[256];
    for (job_t *j = reg->jobs, *next; j != NULL; j = next) {
        next = j->next;
        for (uint32_t rk = 0; rk < j->world && j->nwaiting > 0; rk++) {
            rank_t *r = &j->ranks[rk];
            if (r->join_w != NULL && r->join_w->deadline_ms <= now_ms) {
                missing_ranks(j, 1, missing, sizeof(missing));
                snprintf(msg, sizeof(msg),
                         "Join of rank %u to job '%s' timed out after %lld ms: ranks %s never "
                         "joined (check that every trainer of the job started and uses the same "
                         "world size)",
                         rk, j->name, (long long)reg->cfg->join_timeout_ms, missing);
                AMX_WARN("registry", "%s", msg);
                amx_waiter_t *w = r->join_w;
                int last = j->njoined == 1;
                finish_waiter(reg, j, w, AMX_ETIMEDOUT, msg, NULL);
                unjoin(reg, j, rk);
                if (last)
                    break; /* the job is gone */
                continue;
            }
            if (r->rec_w != NULL && r->rec_w->deadline_ms <= now_ms) {
                missing_ranks(j, 0, missing, sizeof(missing));
                snprintf(msg, sizeof(msg),
                         "Reconcile of rank %u, job '%s', epoch %llu timed out after %lld ms: "
                         "ranks %s did not enter it; this rank's contributions are kept, call "
                         "Reconcile again",
                         rk, j->name, (unsigned long long)j->epoch,
                         (long long)reg->cfg->reconcile_timeout_ms, missing);
                AMX_WARN("registry", "%s", msg);
                r->in_reconcile = 0;
                j->nin_reconcile--;
                finish_waiter(reg, j, r->rec_w, AMX_ETIMEDOUT, msg, NULL);
            }
        }
    }
}

/* ---- GetScales, Reset, Status, List ---- */

amx_status_t amx_registry_get_scales(amx_registry_t *reg, const Amaxd__V1__GetScalesRequest *req,
                                     Amaxd__V1__GetScalesResponse *resp, amx_arena_t *arena,
                                     amx_err_t *err)
{
    job_t *j;
    AMX_CHECK(ready_job(reg, req->job, req->rank, !req->global, &j, err));
    if (j->last_reconciled == 0)
        return amx_err_set(err, AMX_EPRECOND,
                           "no epoch of job '%s' has been reconciled yet: call Reconcile first",
                           j->name);
    resp->epoch = j->last_reconciled;
    return build_results(j, req->global ? -1 : (int64_t)req->rank, req->names, req->n_names,
                         &resp->results, &resp->n_results, arena, err);
}

amx_status_t amx_registry_reset(amx_registry_t *reg, const Amaxd__V1__ResetRequest *req,
                                Amaxd__V1__ResetResponse *resp, amx_err_t *err)
{
    if (!valid_job_name(req->job))
        return amx_err_set(err, AMX_EINVAL, "job name '%s' is invalid", req->job);
    job_t *j = find_job(reg, req->job);
    if (j == NULL)
        return amx_err_set(err, AMX_ENOTFOUND, "job '%s' is not known to this daemon", req->job);
    if (req->drop_job) {
        if (req->n_names != 0)
            return amx_err_set(err, AMX_EINVAL, "Reset with drop_job takes no quantizer names");
        AMX_INFO("registry", "job %s dropped (%u quantizers)", j->name, j->nq);
        resp->reset = j->nq;
        fail_all_waiters(reg, j, AMX_EABORTED, "the job was dropped by Reset");
        job_remove(reg, j);
        return AMX_OK;
    }
    uint32_t n = req->n_names ? (uint32_t)req->n_names : j->nq;
    uint32_t *ids = calloc(n ? n : 1, sizeof(uint32_t));
    if (ids == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < n; i++) {
        if (req->n_names == 0) {
            ids[i] = i;
        } else if (!amx_strmap_get(&j->qmap, req->names[i], &ids[i])) {
            free(ids);
            return amx_err_set(err, AMX_ENOTFOUND,
                               "quantizer '%.255s' is not registered in job '%s' (nothing was "
                               "reset)",
                               req->names[i], j->name);
        }
    }
    amx_status_t st = j->state->ops->reset(j->state, j->desc, ids, n, err);
    if (st == AMX_OK)
        for (uint32_t i = 0; i < n; i++)
            j->desc[ids[i]].hist_head = 0;
    free(ids);
    resp->reset = n;
    if (st == AMX_OK)
        AMX_INFO("registry", "job %s: reset %u quantizers", j->name, n);
    return st;
}

static void add_config(void *ud, const char *name, const char *value, int is_default)
{
    void **ctx = ud;
    Amaxd__V1__StatusResponse *resp = ctx[0];
    amx_arena_t *a = ctx[1];
    Amaxd__V1__ConfigEntry *e = amx_arena_alloc(a, sizeof(*e));
    if (e == NULL)
        return;
    amaxd__v1__config_entry__init(e);
    e->name = (char *)name;
    e->value = (char *)value;
    e->is_default = is_default;
    resp->config[resp->n_config++] = e;
}

amx_status_t amx_registry_status(amx_registry_t *reg, const Amaxd__V1__StatusRequest *req,
                                 Amaxd__V1__StatusResponse *resp, amx_arena_t *arena,
                                 amx_err_t *err)
{
    if (req->job[0] != '\0' && find_job(reg, req->job) == NULL)
        return amx_err_set(err, AMX_ENOTFOUND, "job '%.128s' is not known to this daemon",
                           req->job);
    resp->backend = reg->backend;
    resp->collective = "local";
    resp->jobs = amx_arena_alloc(arena, (reg->njobs + 1) * sizeof(*resp->jobs));
    resp->config = amx_arena_alloc(arena, AMX_CFG_COUNT * sizeof(*resp->config));
    if (resp->jobs == NULL || resp->config == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    for (job_t *j = reg->jobs; j != NULL; j = j->next) {
        if (req->job[0] != '\0' && strcmp(req->job, j->name) != 0)
            continue;
        Amaxd__V1__JobStatus *js = amx_arena_alloc(arena, sizeof(*js));
        if (js == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        amaxd__v1__job_status__init(js);
        js->name = j->name;
        js->world_size = j->world;
        js->joined = j->njoined;
        js->ready = j->ready;
        js->epoch = j->epoch;
        js->reconciled_epochs = j->last_reconciled;
        js->quantizers = j->nq;
        js->cells = j->ncells;
        js->ranks_in_reconcile = j->nin_reconcile;
        js->updates = j->updates;
        resp->jobs[resp->n_jobs++] = js;
    }
    void *ctx[2] = {resp, arena};
    amx_config_foreach(reg->cfg, add_config, ctx);
    return AMX_OK;
}

amx_status_t amx_registry_list(amx_registry_t *reg, const Amaxd__V1__ListQuantizersRequest *req,
                               Amaxd__V1__ListQuantizersResponse *resp, amx_arena_t *a,
                               amx_err_t *err)
{
    job_t *j;
    AMX_CHECK(ready_job(reg, req->job, 0, 0, &j, err));
    resp->quantizers = amx_arena_alloc(a, (j->nq + 1) * sizeof(*resp->quantizers));
    if (resp->quantizers == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    for (uint32_t qi = 0; qi < j->nq; qi++) {
        const amx_qdesc_t *d = &j->desc[qi];
        Amaxd__V1__QuantizerInfo *info = amx_arena_alloc(a, sizeof(*info));
        Amaxd__V1__Recipe *rc = amx_arena_alloc(a, sizeof(*rc));
        if (info == NULL || rc == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        amaxd__v1__quantizer_info__init(info);
        amaxd__v1__recipe__init(rc);
        info->name = j->q[qi].name;
        info->n_global_shape = j->q[qi].ndim;
        info->global_shape = j->q[qi].shape;
        rc->format = d->recipe.format;
        rc->rule = d->recipe.rule;
        rc->margin = d->recipe.margin;
        rc->history_len = d->recipe.history_len;
        rc->history_reduce = d->recipe.history_reduce;
        rc->eps = d->recipe.eps;
        rc->power_of_2 = d->recipe.power_of_2;
        rc->nvfp4_convention = d->recipe.nvfp4_convention;
        info->recipe = rc;
        info->accumulation = d->accumulation;
        info->peer_group = (char *)group_name_of(&j->peer, d->peer_group);
        info->scale_group = (char *)group_name_of(&j->scale, d->scale_group);
        info->placements = j->q[qi].nplacements;
        resp->quantizers[resp->n_quantizers++] = info;
    }
    return AMX_OK;
}
