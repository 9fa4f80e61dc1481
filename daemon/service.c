/*
 * service.c - the trainer-facing service: one handler per amaxd.v1 RPC
 * (rpc.c decodes the message, the handler maps it to the registry's C
 * request with codec.h, calls the registry, logs refused requests and
 * maps the answer back), Health, and the services' object (service.h).
 */
#include "service.h"

#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "amaxd/v1/amaxd.pb-c.h"
#include "arena.h"
#include "bytebuf.h"
#include "clock.h"
#include "grpc/health/v1/health.pb-c.h"
#include "log.h"
#include "peer.h"
#include "shm.h"
#include "version.h"

uint64_t amx__now_ms(void)
{
    return amx_now_ms();
}

/* Answers an error and logs it: every rejected request leaves a line. */
static void reply_err(amx_call_t *c, const char *method, const amx_err_t *err)
{
    AMX_WARN("rpc", "%s rejected (%s): %s", method, amx_strerror(err->code), err->msg);
    amx__call_reply(c, err->code, err->msg, NULL);
}

/* ---- answers ---- */

static Amaxd__V1__QuantizerResult **results_to_pb(const amx_reply_t *rep, amx_arena_t *a)
{
    Amaxd__V1__QuantizerResult **v = amx_arena_alloc(a, (rep->nresults + 1) * sizeof(*v));
    if (v == NULL)
        return NULL;
    for (size_t i = 0; i < rep->nresults; i++) {
        const amx_result_t *x = &rep->results[i];
        Amaxd__V1__QuantizerResult *r = amx_arena_alloc(a, sizeof(*r));
        if (r == NULL)
            return NULL;
        amaxd__v1__quantizer_result__init(r);
        r->name = (char *)x->name;
        r->n_offset = r->n_shape = x->ndim;
        r->offset = (uint32_t *)x->off;
        r->shape = (uint32_t *)x->shape;
        r->amax.data = (uint8_t *)x->amax;
        r->amax.len = x->ncells * sizeof(float);
        r->scale.data = (uint8_t *)x->scale;
        r->scale.len = x->ncells * sizeof(float);
        r->scale_inv.data = (uint8_t *)x->scale_inv;
        r->scale_inv.len = x->ncells * sizeof(float);
        r->block_scales.data = x->bytes;
        r->block_scales.len = x->ncells;
        r->global_amax = x->global_amax;
        r->global_scale = x->global_scale;
        r->global_scale_inv = x->global_scale_inv;
        r->missing = x->missing;
        r->first_cell = x->first_cell;
        r->global_axes = x->global_axes;
        if (x->nslices > 0) {
            r->global_amaxes.data = (uint8_t *)x->s_amax;
            r->global_amaxes.len = x->nslices * sizeof(float);
            r->global_scales.data = (uint8_t *)x->s_scale;
            r->global_scales.len = x->nslices * sizeof(float);
            r->global_scale_invs.data = (uint8_t *)x->s_inv;
            r->global_scale_invs.len = x->nslices * sizeof(float);
        }
        if (x->filled != NULL) {
            r->peer_fill_known = 1;
            r->peer_filled = x->nfilled;
            if (x->nfilled > 0) { /* the marks only where there is something to mark */
                r->filled.data = x->filled;
                r->filled.len = x->ncells;
            }
        }
        if (x->has_previous) {
            r->has_previous = 1;
            r->previous_global_amax = x->previous_global_amax;
            r->previous_global_scale = x->previous_global_scale;
        }
        if (x->stat_state != AMX_STAT_NONE) {
            r->stat_state = (Amaxd__V1__StatState)x->stat_state;
            r->stat_epoch = x->stat_epoch;
            r->stat_total = x->stat_total;
            r->stat_overflow = x->stat_overflow;
            if (x->stat_basis != NULL) {
                r->stat_basis.data = (uint8_t *)x->stat_basis;
                r->stat_basis.len = x->ncells * sizeof(float);
            }
        }
        v[i] = r;
    }
    return v;
}

/* The waiting calls' callbacks: the reply becomes the method's message. */
static void join_done(amx_waiter_t *w, amx_status_t st, const char *msg, const amx_reply_t *rep)
{
    amx_call_t *c = amx__waiter_call(w);
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__V1__JoinResponse r = AMAXD__V1__JOIN_RESPONSE__INIT;
    const Amaxd__V1__JoinRequest *req = (const void *)w->ext;
    r.job = req->job;
    r.world_size = rep->world;
    r.epoch = rep->epoch;
    r.rejoined = rep->rejoined;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void reconcile_done(amx_waiter_t *w, amx_status_t st, const char *msg,
                           const amx_reply_t *rep)
{
    amx_call_t *c = amx__waiter_call(w);
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    amx_arena_t a = {0};
    Amaxd__V1__ReconcileResponse r = AMAXD__V1__RECONCILE_RESPONSE__INIT;
    r.epoch = rep->epoch;
    r.next_epoch = rep->next_epoch;
    r.n_results = rep->nresults;
    r.results = results_to_pb(rep, &a);
    if (r.results == NULL)
        amx__call_reply(c, AMX_ENOMEM, "out of memory building the answer", NULL);
    else
        amx__call_reply(c, AMX_OK, NULL, &r.base);
    amx_arena_free(&a);
}

static void register_done(amx_waiter_t *w, amx_status_t st, const char *msg, const amx_reply_t *rep)
{
    amx_call_t *c = amx__waiter_call(w);
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__V1__RegisterResponse r = AMAXD__V1__REGISTER_RESPONSE__INIT;
    r.created = rep->created;
    r.existing = rep->existing;
    r.catalog_size = rep->catalog_size;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void reset_done(amx_waiter_t *w, amx_status_t st, const char *msg, const amx_reply_t *rep)
{
    amx_call_t *c = amx__waiter_call(w);
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__V1__ResetResponse r = AMAXD__V1__RESET_RESPONSE__INIT;
    r.reset = rep->reset;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

/* ---- handlers ---- */

static void h_join(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__JoinRequest *req = (const void *)m;
    amx_join_req_t q = {req->job, req->rank, req->world_size};
    amx_err_t err = {0};
    amx_waiter_t *w = amx__call_waiter(c);
    w->done = join_done;
    w->ext = (void *)req;
    if (amx_registry_join(svc->reg, &q, w, amx__now_ms(), &err) != AMX_OK)
        reply_err(c, "Join", &err);
}

static void h_reconcile(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__ReconcileRequest *req = (const void *)m;
    amx_reconcile_req_t q = {req->job, req->rank, req->epoch, req->names, req->n_names, 0, 0, 0, 0,
                             0,        0,         0,          0};
    amx_err_t err = {0};
    amx_waiter_t *w = amx__call_waiter(c);
    w->done = reconcile_done;
    if (amx_registry_reconcile(svc->reg, &q, w, amx__now_ms(), &err) != AMX_OK)
        reply_err(c, "Reconcile", &err);
}

static void h_register(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__RegisterRequest *req = (const void *)m;
    amx_err_t err = {0};
    /* The request may wait for an epoch in flight: its views live with the
     * call. */
    amx_arena_t *a = amx__call_arena(c);
    amx_register_req_t *q = amx_arena_alloc(a, sizeof(*q));
    amx_qspec_in_t *in = amx_arena_alloc(a, (req->n_quantizers + 1) * sizeof(*in));
    if (q == NULL || in == NULL) {
        amx_err_set(&err, AMX_ENOMEM, "out of memory reading a Register of %zu quantizers",
                    req->n_quantizers);
        reply_err(c, "Register", &err);
        return;
    }
    for (size_t i = 0; i < req->n_quantizers; i++)
        amx_codec_spec_in(req->quantizers[i], &in[i]);
    *q = (amx_register_req_t){req->job, req->rank, in, req->n_quantizers};
    amx_waiter_t *w = amx__call_waiter(c);
    w->done = register_done;
    if (amx_registry_register(svc->reg, q, w, &err) != AMX_OK)
        reply_err(c, "Register", &err);
}

/* ---- named updates ---- */

static void h_send(amx_svc_t *svc, amx_call_t *c, uint8_t *data, size_t len)
{
    Amaxd__V1__SendAmaxResponse resp = AMAXD__V1__SEND_AMAX_RESPONSE__INIT;
    amx_err_t err = {0};
    amx_send_req_t q;
    if (amx_codec_send_parse(&svc->scratch, data, len, &q, &err) != AMX_OK ||
        amx_registry_send(svc->reg, &q, &resp.accepted, &resp.epoch, &err) != AMX_OK)
        reply_err(c, "SendAmax", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
}

static amx_status_t stream_named(amx_svc_t *svc, uint8_t *data, size_t len, uint64_t *accepted,
                                 uint64_t *epoch, amx_err_t *err)
{
    amx_send_req_t q;
    uint64_t n = 0, e = 0;
    amx_status_t st = amx_codec_send_parse(&svc->scratch, data, len, &q, err);
    if (st == AMX_OK)
        st = amx_registry_send(svc->reg, &q, &n, &e, err);
    if (st != AMX_OK) {
        AMX_WARN("rpc", "StreamAmax message rejected after %llu accepted updates (%s): %s",
                 (unsigned long long)*accepted, amx_strerror(st), err->msg);
        return st;
    }
    *accepted += n;
    *epoch = e;
    return AMX_OK;
}

static void h_get_scales(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__GetScalesRequest *req = (const void *)m;
    amx_scales_req_t q = {req->job,    req->rank,       req->names,    req->n_names,
                          req->global, req->start_cell, req->max_cells};
    amx_err_t err = {0};
    amx_arena_t a = {0};
    amx_reply_t rep;
    if (amx_registry_get_scales(svc->reg, &q, &rep, &a, &err) != AMX_OK) {
        reply_err(c, "GetScales", &err);
    } else {
        Amaxd__V1__GetScalesResponse r = AMAXD__V1__GET_SCALES_RESPONSE__INIT;
        r.epoch = rep.epoch;
        r.total_cells = rep.total_cells;
        r.n_results = rep.nresults;
        r.results = results_to_pb(&rep, &a);
        if (r.results == NULL)
            amx__call_reply(c, AMX_ENOMEM, "out of memory building the answer", NULL);
        else
            amx__call_reply(c, AMX_OK, NULL, &r.base);
    }
    amx_arena_free(&a);
}

static void h_reset(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__ResetRequest *req = (const void *)m;
    amx_arena_t *a = amx__call_arena(c);
    amx_reset_req_t *q = amx_arena_alloc(a, sizeof(*q));
    amx_err_t err = {0};
    if (q == NULL) {
        amx_err_set(&err, AMX_ENOMEM, "out of memory");
        reply_err(c, "Reset", &err);
        return;
    }
    *q = (amx_reset_req_t){req->job, req->names, req->n_names, req->drop_job};
    amx_waiter_t *w = amx__call_waiter(c);
    w->done = reset_done;
    if (amx_registry_reset(svc->reg, q, w, &err) != AMX_OK)
        reply_err(c, "Reset", &err);
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

static void h_status(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__StatusRequest *req = (const void *)m;
    Amaxd__V1__StatusResponse resp = AMAXD__V1__STATUS_RESPONSE__INIT;
    amx_err_t err = {0};
    amx_arena_t a = {0};
    amx_job_info_t *jobs = NULL;
    size_t n = 0;
    resp.version = AMAXD_VERSION;
    resp.uptime_s = (double)amx__now_ms() / 1000.0 - svc->start_time;
    resp.pid = (uint32_t)getpid();
    resp.backend = (char *)amx_registry_backend(svc->reg);
    resp.collective = (char *)amx_registry_collective(svc->reg);
    const amx_cluster_id_t *id = amx_cluster_id(svc->cluster);
    resp.cluster_rank = id->rank;
    resp.cluster_size = id->size;
    char coord_addr[256] = "";
    if (svc->peer != NULL && id->size > 1)
        amx_peer_coordinator(svc->peer, &resp.coordinator_rank, coord_addr, sizeof(coord_addr));
    resp.coordinator = coord_addr;
    resp.peer_address = (char *)id->advertise;
    Amaxd__V1__CoordinatorStatus cs = AMAXD__V1__COORDINATOR_STATUS__INIT;
    if (amx_coord_active(svc->coord) && id->size > 1) {
        const amx_coord_stats_t *x = amx_coord_stats(svc->coord);
        amx_coord_counts(svc->coord, &cs.jobs, &cs.waiting, &cs.keys);
        cs.syncs = x->syncs;
        cs.rounds = x->rounds;
        cs.specs_received = x->specs_received;
        cs.offers_asked = x->offers_asked;
        cs.catalogs_asked = x->catalogs_asked;
        cs.specs_sent = x->specs_sent;
        cs.members_sent = x->members_sent;
        cs.answers_built = x->answers_built;
        cs.offers_known = x->offers_known;
        cs.answer_bytes = x->answer_bytes;
        resp.coordinator_status = &cs;
    }
    if (amx_registry_status(svc->reg, req->job, &jobs, &n, &a, &err) != AMX_OK) {
        reply_err(c, "Status", &err);
        amx_arena_free(&a);
        return;
    }
    resp.jobs = amx_arena_alloc(&a, (n + 1) * sizeof(*resp.jobs));
    resp.config = amx_arena_alloc(&a, AMX_CFG_COUNT * sizeof(*resp.config));
    if (resp.jobs == NULL || resp.config == NULL) {
        amx_err_set(&err, AMX_ENOMEM, "out of memory");
        reply_err(c, "Status", &err);
        amx_arena_free(&a);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        const amx_job_info_t *x = &jobs[i];
        Amaxd__V1__JobStatus *js = amx_arena_alloc(&a, sizeof(*js));
        if (js == NULL)
            break;
        amaxd__v1__job_status__init(js);
        js->name = (char *)x->name;
        js->world_size = x->world;
        js->joined = x->joined;
        js->ready = x->ready;
        js->epoch = x->epoch;
        js->reconciled_epochs = x->reconciled;
        js->quantizers = x->quantizers;
        js->cells = x->cells;
        js->ranks_in_reconcile = x->ranks_in_reconcile;
        js->updates = x->updates;
        js->local_ranks = x->local_ranks;
        js->participants = x->participants;
        js->proposals = x->proposals;
        js->in_flight = x->in_flight;
        js->epochs_failed = x->epochs_failed;
        js->catalog_hash = x->catalog_hash;
        js->comm_generation = x->comm_generation;
        js->collective = (char *)x->collective;
        js->last_epoch_us = x->last_epoch_us;
        js->last_collective_us = x->last_collective_us;
        js->last_finish_us = x->last_finish_us;
        js->last_collectives = x->last_collectives;
        js->last_epoch_started_us = x->last_started_us;
        js->last_epoch_ended_us = x->last_ended_us;
        js->last_engine_begin_us = x->last_engine_begin_us;
        js->last_engine_end_us = x->last_engine_end_us;
        js->last_answered_us = x->last_answered_us;
        js->last_epoch_entered_us = x->last_entered_us;
        js->last_published_us = x->last_published_us;
        js->durable_epoch = x->durable_epoch;
        if (x->snapshot_error != NULL)
            js->snapshot_error = (char *)x->snapshot_error;
        js->restored = x->restored;
        resp.jobs[resp.n_jobs++] = js;
    }
    void *ctx[2] = {&resp, &a};
    amx_config_foreach(svc->cfg, add_config, ctx);
    amx__call_reply(c, AMX_OK, NULL, &resp.base);
    amx_arena_free(&a);
}

static void h_list(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__ListQuantizersRequest *req = (const void *)m;
    Amaxd__V1__ListQuantizersResponse resp = AMAXD__V1__LIST_QUANTIZERS_RESPONSE__INIT;
    amx_err_t err = {0};
    amx_arena_t a = {0};
    amx_qinfo_t *q = NULL;
    size_t n = 0;
    if (amx_registry_list(svc->reg, req->job, &q, &n, &a, &err) != AMX_OK) {
        reply_err(c, "ListQuantizers", &err);
        amx_arena_free(&a);
        return;
    }
    resp.quantizers = amx_arena_alloc(&a, (n + 1) * sizeof(*resp.quantizers));
    for (size_t i = 0; resp.quantizers != NULL && i < n; i++) {
        const amx_qspec_t *s = q[i].spec;
        Amaxd__V1__QuantizerInfo *info = amx_arena_alloc(&a, sizeof(*info));
        Amaxd__V1__Recipe *rc = amx_arena_alloc(&a, sizeof(*rc));
        if (info == NULL || rc == NULL) {
            resp.quantizers = NULL;
            break;
        }
        amaxd__v1__quantizer_info__init(info);
        amx_codec_recipe_out(&s->recipe, rc);
        info->name = s->name;
        info->n_global_shape = s->ndim;
        info->global_shape = (uint32_t *)s->shape;
        info->recipe = rc;
        info->accumulation = s->accumulation;
        info->peer_group = s->peer_group;
        info->scale_group = s->scale_group;
        info->peer_mode = (Amaxd__V1__PeerMode)s->peer_mode;
        info->global_axes = s->global_axes;
        if (s->calib.kind != AMX_CAL_MAX) {
            Amaxd__V1__Calibrator *cal = amx_arena_alloc(&a, sizeof(*cal));
            if (cal == NULL) {
                resp.quantizers = NULL;
                break;
            }
            amx_codec_calib_out(&s->calib, cal);
            info->calibrator = cal;
        }
        info->placements = q[i].placements;
        info->agreed = q[i].agreed;
        resp.quantizers[resp.n_quantizers++] = info;
    }
    if (resp.quantizers == NULL) {
        amx_err_set(&err, AMX_ENOMEM, "out of memory");
        reply_err(c, "ListQuantizers", &err);
    } else {
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
    }
    amx_arena_free(&a);
}

/* ---- the packed form ---- */

static void h_get_layout(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__GetLayoutRequest *req = (const void *)m;
    amx_err_t err = {0};
    amx_arena_t a = {0};
    amx_layout_t l;
    if (amx_registry_layout(svc->reg, req->job, req->rank, &l, &a, &err) != AMX_OK) {
        reply_err(c, "GetLayout", &err);
        amx_arena_free(&a);
        return;
    }
    Amaxd__V1__GetLayoutResponse r = AMAXD__V1__GET_LAYOUT_RESPONSE__INIT;
    r.layout_id = l.id;
    r.total_cells = l.total_cells;
    r.n_names = r.n_slab_offset = r.n_ncells = r.n_ndim = r.n_format = l.n;
    r.names = (char **)l.names;
    r.slab_offset = l.slab_offset;
    r.ncells = l.ncells;
    r.ndim = l.ndim;
    r.format = (Amaxd__V1__Format *)l.format; /* an enum is an int in protobuf-c */
    r.n_block_offset = r.n_block_shape = r.n_global_shape = l.ndims;
    r.block_offset = l.block_offset;
    r.block_shape = l.block_shape;
    r.global_shape = l.global_shape;
    r.n_global_axes = r.n_slice_offset = l.n;
    r.global_axes = l.global_axes;
    r.slice_offset = l.slice_offset;
    r.total_slices = l.total_slices;
    if (l.calibrator != NULL) {
        r.n_calibrator = r.n_stat_offset = l.n;
        r.calibrator = (Amaxd__V1__CalibratorKind *)l.calibrator;
        r.stat_offset = l.stat_offset;
        r.total_stats = l.total_stats;
    }
    amx_shm_region_t g;
    if (req->shm) {
        amx_shm_sizes_t sz = {
            l.total_cells, l.total_stats, l.n,
            amx_codec_packed_cap(l.total_cells, l.n, l.total_slices, l.calibrator != NULL)};
        if (amx_shm_open(svc->shm, req->job, req->rank, l.id, &sz, &g, &err) != AMX_OK) {
            reply_err(c, "GetLayout", &err);
            amx_arena_free(&a);
            return;
        }
        r.shm_id = g.id;
        r.shm_path = (char *)g.path;
        r.shm_has_data_offset = g.has_data_off;
        r.shm_answer_path = (char *)g.answer_path;
        if (l.total_stats > 0) {
            r.shm_stats_offset = g.stats_off;
            r.shm_stat_epochs_offset = g.stat_epochs_off;
        }
    }
    amx__call_reply(c, AMX_OK, NULL, &r.base);
    amx_arena_free(&a);
}

/* ---- ReconcilePacked ---- */

typedef struct packed_out {
    amx_replybuf_t *rb; /* the rank's reused buffer (our reference) */
    uint8_t *buf;
    size_t cap, pos; /* bytes written before the filled field */
    size_t end;      /* ... and after it */
    amx_svc_t *svc;
    const char *job; /* the request's (in the call's arena) */
    uint32_t rank;
    uint64_t shm_id; /* answer into this shared buffer; 0: over gRPC */
} packed_out_t;

static amx_status_t alloc_packed(amx_waiter_t *w, amx_packed_t *p)
{
    packed_out_t *o = w->ext;
    size_t n = (size_t)p->ncells, q = p->nq, ns = (size_t)p->nslices;
    o->cap = amx_codec_packed_cap(n, q, ns, p->stats);
    o->buf = NULL;
    if (o->shm_id != 0) {
        /* Built in place in the rank's answer file. */
        amx_err_t err = {0};
        o->buf = amx_shm_answer(o->svc->shm, o->job, o->rank, o->shm_id, o->cap, &err);
        if (o->buf == NULL) /* the epoch is over: its answer must not be lost */
            AMX_WARN("rpc", "%s; answered in the message instead", err.msg);
    }
    if (o->buf == NULL) {
        /* The rank's buffer of the last epoch when gRPC is done with it: no
         * fresh pages (and their faults) for every answer. */
        o->rb = amx_replybuf_take(p->cache, o->cap);
        if (o->rb == NULL)
            return AMX_ENOMEM;
        o->buf = o->rb->data;
    }
    amx_codec_packed_layout(o->buf, p, &o->pos, &o->end);
    return AMX_OK;
}

static void reconcile_packed_done(amx_waiter_t *w, amx_status_t st, const char *msg,
                                  const amx_reply_t *rep)
{
    amx_call_t *c = amx__waiter_call(w);
    packed_out_t *o = w->ext;
    if (st != AMX_OK) {
        amx_replybuf_unref(o->rb); /* NULL when alloc_packed was not reached */
        o->rb = NULL;
        o->buf = NULL;
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    const amx_packed_t *p = rep->packed;
    /* The fill marks only when a cell was filled; the scalars after. */
    size_t pos = p->peer_fill_known && p->nfilled > 0 ? o->end : o->pos;
    uint8_t *b = o->buf;
    pos = amx_codec_packed_finish(b, pos, rep->epoch, rep->next_epoch, p->layout_id,
                                  p->peer_fill_known);
    amx_replybuf_t *rb = o->rb;
    o->buf = NULL;
    o->rb = NULL;
    if (rb == NULL) { /* built in the shared buffer */
        Amaxd__V1__ReconcilePackedResponse r = AMAXD__V1__RECONCILE_PACKED_RESPONSE__INIT;
        r.epoch = rep->epoch;
        r.next_epoch = rep->next_epoch;
        r.layout_id = p->layout_id;
        r.peer_fill_known = p->peer_fill_known;
        r.shm_bytes = pos;
        amx__call_reply(c, AMX_OK, NULL, &r.base);
        return;
    }
    amx__call_reply_raw(c, b, pos, amx_replybuf_unref, rb);
}

static void h_reconcile_packed(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__ReconcilePackedRequest *req = (const void *)m;
    amx_reconcile_req_t q = {req->job, req->rank, req->epoch, NULL, 0, 1, req->layout_id,
                             0,        0,         0,          0,    0, 0};
    amx_err_t err = {0};
    amx_waiter_t *w = amx__call_waiter(c);
    packed_out_t *o = amx_arena_alloc(amx__call_arena(c), sizeof(*o));
    if (o == NULL) {
        amx_err_set(&err, AMX_ENOMEM, "out of memory");
        reply_err(c, "ReconcilePacked", &err);
        return;
    }
    memset(o, 0, sizeof(*o));
    o->svc = svc;
    o->job = req->job;
    o->rank = req->rank;
    o->shm_id = req->shm_id;
    if (req->shm_id != 0 &&
        amx_shm_check(svc->shm, req->job, req->rank, req->shm_id, &err) != AMX_OK) {
        reply_err(c, "ReconcilePacked", &err);
        return;
    }
    w->done = reconcile_packed_done;
    w->alloc_packed = alloc_packed;
    w->ext = o;
    if (amx_registry_reconcile(svc->reg, &q, w, amx__now_ms(), &err) != AMX_OK)
        reply_err(c, "ReconcilePacked", &err);
}

/* ---- GPU-direct: device buffers (docs/API.md "Device buffers") ---- */

static void h_open_device(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__OpenDeviceRequest *req = (const void *)m;
    amx_dev_open_req_t q = {req->job, req->rank, req->layout_id, req->device, req->pid};
    amx_dev_opened_t o;
    amx_err_t err = {0};
    if (amx_registry_device_open(svc->reg, &q, &o, &err) != AMX_OK) {
        reply_err(c, "OpenDevice", &err);
        return;
    }
    Amaxd__V1__OpenDeviceResponse r = AMAXD__V1__OPEN_DEVICE_RESPONSE__INIT;
    r.device_id = o.id;
    r.layout_id = o.layout_id;
    r.total_cells = o.total_cells;
    r.quantizers = o.nq;
    r.total_slices = o.total_slices;
    r.slab_handle.data = o.slab_handle;
    r.slab_handle.len = sizeof(o.slab_handle);
    r.slab_bytes = o.slab_bytes;
    r.has_data_offset = o.has_data_off;
    r.answer_handle.data = o.answer_handle;
    r.answer_handle.len = sizeof(o.answer_handle);
    r.answer_bytes = o.answer_bytes;
    r.ready_event.data = o.ready_event;
    r.ready_event.len = sizeof(o.ready_event);
    r.done_event.data = o.done_event;
    r.done_event.len = sizeof(o.done_event);
    r.amax_offset = o.amax;
    r.scale_offset = o.scale;
    r.scale_inv_offset = o.scale_inv;
    r.block_scales_offset = o.block_scales;
    r.global_amax_offset = o.g_amax;
    r.global_scale_offset = o.g_scale;
    r.global_scale_inv_offset = o.g_inv;
    r.global_amaxes_offset = o.s_amax;
    r.global_scales_offset = o.s_scale;
    r.global_scale_invs_offset = o.s_inv;
    r.missing_offset = o.missing;
    r.has_previous_offset = o.has_prev;
    r.previous_global_amax_offset = o.prev_amax;
    r.previous_global_scale_offset = o.prev_scale;
    r.device_bus_id = o.bus_id;
    r.doorbell = svc->doorbell;
    r.signals = o.signals != 0;
    r.ready_flag_offset = o.ready_flag_off;
    r.done_flag_offset = o.done_flag_off;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void h_close_device(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__CloseDeviceRequest *req = (const void *)m;
    amx_err_t err = {0};
    if (amx_registry_device_close(svc->reg, req->job, req->rank, req->device_id, &err) != AMX_OK) {
        reply_err(c, "CloseDevice", &err);
        return;
    }
    Amaxd__V1__CloseDeviceResponse r = AMAXD__V1__CLOSE_DEVICE_RESPONSE__INIT;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void reconcile_device_done(amx_waiter_t *w, amx_status_t st, const char *msg,
                                  const amx_reply_t *rep)
{
    amx_call_t *c = amx__waiter_call(w);
    if (st != AMX_OK) {
        AMX_WARN("rpc", "ReconcileDevice answered %s: %s", amx_strerror(st), msg);
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__V1__ReconcileDeviceResponse r = AMAXD__V1__RECONCILE_DEVICE_RESPONSE__INIT;
    r.epoch = rep->epoch;
    r.next_epoch = rep->next_epoch;
    r.layout_id = (uint64_t)(uintptr_t)w->ext;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void h_reconcile_device(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__ReconcileDeviceRequest *req = (const void *)m;
    amx_reconcile_req_t q = {
        req->job, req->rank,      req->epoch, NULL,          0, 0, req->layout_id,
        1,        req->device_id, req->send,  req->has_data, 0, 0};
    amx_err_t err = {0};
    amx_waiter_t *w = amx__call_waiter(c);
    w->done = reconcile_device_done;
    w->alloc_packed = NULL;
    w->ext = (void *)(uintptr_t)req->layout_id; /* answered as the layout it was checked for */
    if (amx_registry_reconcile(svc->reg, &q, w, amx__now_ms(), &err) != AMX_OK)
        reply_err(c, "ReconcileDevice", &err);
}

/* ---- SendPacked ---- */

static amx_status_t send_packed(amx_svc_t *svc, uint8_t *data, size_t len, uint64_t *accepted,
                                uint64_t *epoch, amx_err_t *err)
{
    amx_codec_packed_in_t in;
    AMX_CHECK(amx_codec_packed_parse(data, len, &in, err));
    if (in.shm_id != 0) {
        if (in.values_len != 0 || in.has_data_len != 0)
            return amx_err_set(err, AMX_EINVAL,
                               "SendPacked: values or has_data given with shm_id (%zu and %zu "
                               "bytes); the slab is either in the request or in the shared "
                               "buffer",
                               in.values_len, in.has_data_len);
        if (in.shm_stats && (in.stats_len != 0 || in.stat_epochs_len != 0))
            return amx_err_set(err, AMX_EINVAL,
                               "SendPacked: stats or stat_epochs given with shm_stats (%zu and "
                               "%zu bytes); the statistics are either in the request or in the "
                               "shared buffer",
                               in.stats_len, in.stat_epochs_len);
        amx_shm_slab_t b;
        AMX_CHECK(amx_shm_read(svc->shm, in.job, in.rank, in.shm_id, in.layout_id, in.shm_has_data,
                               in.shm_stats, &b, err));
        amx_send_packed_req_t q = {
            in.job,   in.rank,      in.epoch,       in.layout_id,
            b.values, 4 * b.cells,  b.has_data,     b.has_data != NULL ? b.cells : 0,
            in.stats, in.stats_len, in.stat_epochs, in.stat_epochs_len};
        if (in.shm_stats) {
            q.stats = b.stats;
            q.stats_len = b.stats_len;
            q.stat_epochs = b.stat_epochs;
            q.stat_epochs_len = b.epochs_len;
        }
        return amx_registry_send_packed(svc->reg, &q, accepted, epoch, err);
    }
    if (in.shm_has_data || in.shm_stats)
        return amx_err_set(err, AMX_EINVAL, "SendPacked: %s without shm_id",
                           in.shm_has_data ? "shm_has_data" : "shm_stats");
    float *vals = (float *)(void *)in.values;
    void *copy = NULL;
    if (((uintptr_t)in.values & 3) != 0 && in.values_len > 0) {
        /* A client that did not align the values (SendPackedRequest.align):
         * one copy. */
        copy = malloc(in.values_len);
        if (copy == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory reading %zu bytes of values",
                               in.values_len);
        memcpy(copy, in.values, in.values_len);
        vals = copy;
    }
    amx_send_packed_req_t q = {in.job,   in.rank,       in.epoch,       in.layout_id,
                               vals,     in.values_len, in.has_data,    in.has_data_len,
                               in.stats, in.stats_len,  in.stat_epochs, in.stat_epochs_len};
    amx_status_t st = amx_registry_send_packed(svc->reg, &q, accepted, epoch, err);
    free(copy);
    return st;
}

static void h_send_packed(amx_svc_t *svc, amx_call_t *c, uint8_t *data, size_t len)
{
    Amaxd__V1__SendAmaxResponse resp = AMAXD__V1__SEND_AMAX_RESPONSE__INIT;
    amx_err_t err = {0};
    if (send_packed(svc, data, len, &resp.accepted, &resp.epoch, &err) != AMX_OK)
        reply_err(c, "SendPacked", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
}

static amx_status_t stream_packed(amx_svc_t *svc, uint8_t *data, size_t len, uint64_t *accepted,
                                  uint64_t *epoch, amx_err_t *err)
{
    uint64_t n = 0, e = 0;
    amx_status_t st = send_packed(svc, data, len, &n, &e, err);
    if (st != AMX_OK) {
        AMX_WARN("rpc", "StreamPacked message rejected after %llu accepted updates (%s): %s",
                 (unsigned long long)*accepted, amx_strerror(st), err->msg);
        return st;
    }
    *accepted += n;
    *epoch = e;
    return AMX_OK;
}

/* grpc.health.v1.Health/Check: "" and "amaxd.v1.Calibration" are served. */
static void h_health(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)m;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    if (req->service[0] != '\0' && strcmp(req->service, "amaxd.v1.Calibration") != 0) {
        amx_err_t err = {0};
        amx_err_set(&err, AMX_ENOTFOUND, "health: unknown service '%.128s'", req->service);
        reply_err(c, "Health/Check", &err);
        return;
    }
    /* Not serving while stopping, or once the state backend has failed
     * (every epoch would fail: an orchestrator should restart the daemon). */
    resp.status = svc->stopping || amx_registry_fault(svc->reg) != NULL
                      ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    amx__call_reply(c, AMX_OK, NULL, &resp.base);
}

#define T AMX_SERVER_TRAINER
const amx_method_t amx__methods[] = {
    {"/amaxd.v1.Calibration/Join", &amaxd__v1__join_request__descriptor, h_join, 0, T, NULL, NULL},
    {"/amaxd.v1.Calibration/RegisterQuantizers", &amaxd__v1__register_request__descriptor,
     h_register, 0, T, NULL, NULL},
    {"/amaxd.v1.Calibration/SendAmax", &amaxd__v1__send_amax_request__descriptor, NULL, 0, T,
     h_send, NULL},
    {"/amaxd.v1.Calibration/StreamAmax", &amaxd__v1__send_amax_request__descriptor, NULL, 1, T,
     NULL, stream_named},
    {"/amaxd.v1.Calibration/Reconcile", &amaxd__v1__reconcile_request__descriptor, h_reconcile, 0,
     T, NULL, NULL},
    {"/amaxd.v1.Calibration/GetScales", &amaxd__v1__get_scales_request__descriptor, h_get_scales, 0,
     T, NULL, NULL},
    {"/amaxd.v1.Calibration/Reset", &amaxd__v1__reset_request__descriptor, h_reset, 0, T, NULL,
     NULL},
    {"/amaxd.v1.Calibration/Status", &amaxd__v1__status_request__descriptor, h_status, 0, T, NULL,
     NULL},
    {"/amaxd.v1.Calibration/ListQuantizers", &amaxd__v1__list_quantizers_request__descriptor,
     h_list, 0, T, NULL, NULL},
    {"/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_request__descriptor, h_health,
     0, T, NULL, NULL},
    {"/amaxd.v1.Calibration/GetLayout", &amaxd__v1__get_layout_request__descriptor, h_get_layout, 0,
     T, NULL, NULL},
    {"/amaxd.v1.Calibration/SendPacked", &amaxd__v1__send_packed_request__descriptor, NULL, 0, T,
     h_send_packed, NULL},
    {"/amaxd.v1.Calibration/StreamPacked", &amaxd__v1__send_packed_request__descriptor, NULL, 1, T,
     NULL, stream_packed},
    {"/amaxd.v1.Calibration/ReconcilePacked", &amaxd__v1__reconcile_packed_request__descriptor,
     h_reconcile_packed, 0, T, NULL, NULL},
    {"/amaxd.v1.Calibration/OpenDevice", &amaxd__v1__open_device_request__descriptor, h_open_device,
     0, T, NULL, NULL},
    {"/amaxd.v1.Calibration/ReconcileDevice", &amaxd__v1__reconcile_device_request__descriptor,
     h_reconcile_device, 0, T, NULL, NULL},
    {"/amaxd.v1.Calibration/CloseDevice", &amaxd__v1__close_device_request__descriptor,
     h_close_device, 0, T, NULL, NULL},
};
#undef T
const size_t amx__n_methods = sizeof(amx__methods) / sizeof(amx__methods[0]);

/* ---- the services' object ---- */

static void hook_cancel(amx_svc_t *svc, amx_waiter_t *w)
{
    amx_registry_cancel(svc->reg, w);
}

static void hook_trim(amx_svc_t *svc, size_t keep)
{
    amx_codec_scratch_trim(&svc->scratch, keep);
    amx_shm_trim(svc->shm, keep);
}

static void hook_stopping(amx_svc_t *svc)
{
    svc->stopping = 1;
    /* The coordinator's waiting requests are calls of the peer server. */
    if (svc->coord != NULL)
        amx_coord_fail_all(svc->coord, "the coordinator is shutting down");
}

amx_status_t amx_service_create(const amx_config_t *cfg, amx_registry_t *reg,
                                const amx_cluster_t *cluster, amx_coord_t *coord, amx_peer_t *peer,
                                double start_time, amx_svc_t **out, amx_err_t *err)
{
    amx_svc_t *svc = calloc(1, sizeof(*svc));
    if (svc == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    svc->reg = reg;
    svc->cfg = cfg;
    svc->cluster = cluster;
    svc->coord = coord;
    svc->peer = peer;
    svc->start_time = start_time;
    /* Each shared buffer holds two descriptors: an eighth of the limit at
     * most, kept out of the socket guard's budget. */
    struct rlimit rl;
    rlim_t soft = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? rl.rlim_cur : 1024;
    svc->shm_max = soft / 16 < SHM_MAX_REGIONS ? (uint32_t)(soft / 16) : SHM_MAX_REGIONS;
    if (amx_shm_create(cfg->shm_dir, (unsigned)cfg->socket_mode, svc->shm_max, &svc->shm, err) !=
        AMX_OK) {
        if (amx_config_is_set(cfg, "shm_dir")) {
            free(svc);
            return err->code;
        }
        AMX_WARN("rpc", "%s; shared-memory buffers are off", err->msg);
        svc->shm = NULL;
    }
    if (svc->shm == NULL)
        svc->shm_max = 0;
    amx_registry_on_drop(reg, amx_shm_drop_job, svc->shm);
    if (coord != NULL)
        amx_coord_set_notify(coord, amx__service_on_restart, svc);
    *out = svc;
    return AMX_OK;
}

void amx_service_serve(amx_svc_t *svc, amx_rpc_serve_t *out)
{
    memset(out, 0, sizeof(*out));
    out->methods = amx__methods;
    out->nmethods = amx__n_methods;
    if (svc->cluster != NULL && amx_cluster_id(svc->cluster)->size > 1) {
        out->peer_methods = amx__peer_methods;
        out->npeer_methods = amx__n_peer_methods;
        out->peer_listen = amx_cluster_id(svc->cluster)->listen;
    }
    out->ctx = svc;
    out->cancel = hook_cancel;
    out->trim = hook_trim;
    out->stopping = hook_stopping;
    out->reserved_fds = 2 * svc->shm_max;
}

void amx_service_free(amx_svc_t *svc)
{
    if (svc == NULL)
        return;
    amx_shm_free(svc->shm);
    amx_codec_scratch_trim(&svc->scratch, 0);
    amx__service_peer_free();
    free(svc);
}
