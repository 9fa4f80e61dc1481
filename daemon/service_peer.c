/*
 * service_peer.c - the peer service (amaxd.peer.v1.Peer) that this daemon
 * serves to the others of its cluster: every call is checked against the
 * cluster's secret; Join, Sync, KvSet, KvGet and Drop go to the
 * coordinator (rank 0 only), FetchState, Abort, Progress and Drop to the
 * registry. Beside the trainer service (service.c), above everything else.
 */
#include "service.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amaxd/peer/v1/peer.pb-c.h"
#include "clock.h"
#include "log.h"

#define AUTH_KEY AMX_PEER_AUTH_KEY
#define SVC AMX_PEER_SVC

static int authed(amx_svc_t *svc, amx_call_t *c)
{
    size_t len = 0;
    const char *tok = amx__call_metadata(c, AUTH_KEY, &len);
    const char *why = "no " AUTH_KEY " metadata";
    if (tok != NULL && amx_cluster_check(svc->cluster, amx__call_method(c), tok, len, &why) == 0)
        return 1;
    char who[128];
    amx__call_peer(c, who, sizeof(who));
    AMX_WARN("peer",
             "refused %s from %s: %s (every daemon of a cluster needs the same "
             "cluster_secret_file)",
             amx__call_method(c), who, why);
    amx__call_reply(c, AMX_EAUTH,
                    "refused: this call does not carry a valid token of the cluster's secret",
                    NULL);
    return 0;
}

static int need_coord(amx_svc_t *svc, amx_call_t *c)
{
    if (svc->coord != NULL)
        return 1;
    char msg[200];
    snprintf(msg, sizeof(msg), "daemon %u is not the coordinator (cluster rank 0)",
             amx_cluster_id(svc->cluster)->rank);
    AMX_WARN("peer", "%s rejected: %s", amx__call_method(c), msg);
    amx__call_reply(c, AMX_EPRECOND, msg, NULL);
    return 0;
}

static void reply_err(amx_call_t *c, amx_status_t st, const char *msg)
{
    AMX_WARN("peer", "%s rejected (%s): %s", amx__call_method(c), amx_strerror(st), msg);
    amx__call_reply(c, st, msg, NULL);
}

static uint64_t deadline_in(uint32_t timeout_ms)
{
    return amx_now_ms() + (timeout_ms ? timeout_ms : 30000);
}

/* -- Join -- */

static void join_cancelled(amx_waiter_t *w)
{
    amx_call_t *c = amx__waiter_call(w);
    amx_svc_t *svc = w->job;
    if (w->ext != NULL && svc->coord != NULL)
        amx_coord_cancel(svc->coord, w->ext);
    w->ext = NULL;
    w->job = NULL;
    (void)c;
}

static void on_coord_join(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    amx_call_t *c = ud;
    amx_waiter_t *w = amx__call_waiter(c);
    w->on_cancel = NULL;
    w->ext = NULL;
    w->job = NULL;
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__Peer__V1__JoinResponse r = AMAXD__PEER__V1__JOIN_RESPONSE__INIT;
    amx_arena_t a = {0};
    if (amx_codec_members_out(m, &r.participants, &r.n_participants, &a) != AMX_OK) {
        amx__call_reply(c, AMX_ENOMEM, "out of memory", NULL);
    } else {
        r.rejoined = m->rejoined;
        r.coordinator_incarnation = m->coord_inc;
        r.world_size = m->world;
        amx__call_reply(c, AMX_OK, NULL, &r.base);
    }
    amx_arena_free(&a);
}

static void h_join(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__JoinRequest *q = (const void *)m;
    if (!amx_valid_job_name(q->job) || q->daemon >= amx_cluster_id(svc->cluster)->size) {
        reply_err(c, AMX_EINVAL, "Join names an invalid job or daemon");
        return;
    }
    amx_coord_join_req_t req = {
        q->job,         q->world_size, q->rank,     q->daemon,
        q->incarnation, q->address,    q->announce, deadline_in(q->timeout_ms)};
    amx_waiter_t *w = amx__call_waiter(c);
    w->job = svc;
    w->on_cancel = join_cancelled;
    amx_creq_t *h = NULL;
    amx_err_t err = {0};
    if (amx_coord_join(svc->coord, &req, on_coord_join, c, &h, &err) != AMX_OK) {
        w->on_cancel = NULL;
        w->job = NULL;
        reply_err(c, err.code, err.msg);
        return;
    }
    if (w->on_cancel != NULL)
        w->ext = h;
}

/* -- Sync -- */

static void on_coord_sync(void *ud, amx_status_t st, const char *msg,
                          const amx_coord_sync_ans_t *ans)
{
    amx_call_t *c = ud;
    amx_waiter_t *w = amx__call_waiter(c);
    uint64_t caller_hash = w->aux; /* the caller's catalog hash (h_sync) */
    w->on_cancel = NULL;
    w->ext = NULL;
    w->job = NULL;
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__Peer__V1__SyncResponse r = AMAXD__PEER__V1__SYNC_RESPONSE__INIT;
    if (ans->send_catalog) {
        r.send_catalog = 1;
        r.coordinator_incarnation = ans->coord_inc;
        amx__call_reply(c, AMX_OK, NULL, &r.base);
        return;
    }
    amx_arena_t a = {0};
    r.seq = ans->seq;
    r.catalog_hash = ans->catalog_hash;
    int ok = 1;
    if (caller_hash != ans->catalog_hash) {
        r.catalog_included = 1;
        r.n_catalog = ans->catalog->n;
        r.catalog = amx_arena_alloc(&a, (ans->catalog->n + 1) * sizeof(*r.catalog));
        ok = r.catalog != NULL;
        for (uint32_t i = 0; ok && i < ans->catalog->n; i++) {
            Amaxd__V1__QuantizerSpec *q = amx_arena_alloc(&a, sizeof(*q));
            ok = q != NULL && amx_codec_spec_out(ans->catalog->q[i], q, &a) == AMX_OK;
            if (ok)
                r.catalog[i] = q;
        }
    }
    r.n_rejected = ans->nrejected;
    r.rejected = ans->rejected;
    r.conflict = (char *)(ans->conflict ? ans->conflict : "");
    r.n_resets = ans->nresets;
    r.resets = ans->resets;
    r.target_epoch = ans->target_epoch;
    r.donor = ans->donor;
    r.n_behind = ans->nbehind;
    r.behind = (uint32_t *)ans->behind;
    r.comm_generation = ans->comm_gen;
    r.new_comm = ans->new_comm;
    r.coordinator_incarnation = ans->coord_inc;
    if (ok)
        ok = amx_codec_members_out(ans->members, &r.participants, &r.n_participants, &a) == AMX_OK;
    if (ok)
        amx__call_reply(c, AMX_OK, NULL, &r.base);
    else
        amx__call_reply(c, AMX_ENOMEM, "out of memory answering an agreement", NULL);
    amx_arena_free(&a);
}

static void sync_cancelled(amx_waiter_t *w)
{
    amx_svc_t *svc = w->job;
    if (w->ext != NULL && svc->coord != NULL)
        amx_coord_cancel(svc->coord, w->ext);
    w->ext = NULL;
    w->job = NULL;
}

static void h_sync(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__SyncRequest *q = (const void *)m;
    amx_err_t err = {0};
    if (!amx_valid_job_name(q->job) || q->daemon >= amx_cluster_id(svc->cluster)->size) {
        reply_err(c, AMX_EINVAL, "Sync names an invalid job or daemon");
        return;
    }
    amx_qspec_t *specs = calloc(q->n_proposals ? q->n_proposals : 1, sizeof(*specs));
    amx_qspec_t **ptrs = calloc(q->n_proposals ? q->n_proposals : 1, sizeof(*ptrs));
    if (specs == NULL || ptrs == NULL) {
        free(specs);
        free(ptrs);
        reply_err(c, AMX_ENOMEM, "out of memory");
        return;
    }
    for (size_t i = 0; i < q->n_proposals; i++) {
        if (amx_codec_spec_parse(q->proposals[i], &specs[i], &err) != AMX_OK) {
            free(specs);
            free(ptrs);
            reply_err(c, AMX_EINVAL, err.msg);
            return;
        }
        ptrs[i] = &specs[i];
    }
    amx_coord_sync_req_t req = {
        .job = q->job,
        .daemon = q->daemon,
        .incarnation = q->incarnation,
        .last_reconciled = q->last_reconciled,
        .catalog_hash = q->catalog_hash,
        .proposals = ptrs,
        .nprop = q->n_proposals,
        .full_catalog = q->full_catalog,
        .resets = q->resets,
        .nresets = q->n_resets,
        .need_comm = q->need_comm,
        .world = q->world_size,
        .ranks = q->ranks,
        .nranks = (uint32_t)q->n_ranks,
        .addr = q->address,
        .deadline_ms = deadline_in(q->timeout_ms),
    };
    amx_waiter_t *w = amx__call_waiter(c);
    w->job = svc;
    w->on_cancel = sync_cancelled;
    w->aux = q->catalog_hash; /* the answer includes the catalog when it differs */
    amx_creq_t *h = NULL;
    amx_status_t st = amx_coord_sync(svc->coord, &req, on_coord_sync, c, &h, &err);
    free(specs);
    free(ptrs);
    if (st != AMX_OK) {
        w->on_cancel = NULL;
        w->job = NULL;
        reply_err(c, err.code, err.msg);
        return;
    }
    if (w->on_cancel != NULL)
        w->ext = h;
}

/* -- KV -- */

static void h_kvset(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__KvSetRequest *q = (const void *)m;
    amx_coord_kv_set(svc->coord, q->key, q->value.data, q->value.len);
    Amaxd__Peer__V1__KvSetResponse r = AMAXD__PEER__V1__KV_SET_RESPONSE__INIT;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void on_coord_kv(void *ud, amx_status_t st, const char *msg, const void *val, size_t len)
{
    amx_call_t *c = ud;
    amx_waiter_t *w = amx__call_waiter(c);
    w->on_cancel = NULL;
    w->ext = NULL;
    w->job = NULL;
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__Peer__V1__KvGetResponse r = AMAXD__PEER__V1__KV_GET_RESPONSE__INIT;
    r.value.data = (uint8_t *)val;
    r.value.len = len;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void h_kvget(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__KvGetRequest *q = (const void *)m;
    amx_waiter_t *w = amx__call_waiter(c);
    w->job = svc;
    w->on_cancel = sync_cancelled; /* the same: cancel the coordinator request */
    amx_creq_t *h = NULL;
    amx_err_t err = {0};
    if (amx_coord_kv_get(svc->coord, q->key, deadline_in(q->timeout_ms), on_coord_kv, c, &h,
                         &err) != AMX_OK) {
        w->on_cancel = NULL;
        w->job = NULL;
        reply_err(c, err.code, err.msg);
        return;
    }
    if (w->on_cancel != NULL)
        w->ext = h;
}

/* -- FetchState, Abort, Progress, Drop -- */

static void h_fetch(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__FetchStateRequest *q = (const void *)m;
    uint32_t max = q->max_bytes == 0 || q->max_bytes > AMX_PEER_FETCH_CHUNK ? AMX_PEER_FETCH_CHUNK
                                                                            : q->max_bytes;
    void *data = NULL;
    size_t len = 0;
    uint64_t total = 0;
    amx_err_t err = {0};
    if (amx_registry_fetch_state(svc->reg, q->job, q->seq, q->offset, max, &data, &len, &total,
                                 &err) != AMX_OK) {
        amx__call_reply(c, err.code, err.msg, NULL); /* "not ready" is routine: no log line */
        return;
    }
    Amaxd__Peer__V1__FetchStateResponse r = AMAXD__PEER__V1__FETCH_STATE_RESPONSE__INIT;
    r.total = total;
    r.data.data = data;
    r.data.len = len;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
    free(data);
}

static void h_abort(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__AbortRequest *q = (const void *)m;
    amx_registry_peer_abort(svc->reg, q->job, q->comm_generation, q->from,
                            amx_status_from_grpc((int)q->code), q->reason);
    Amaxd__Peer__V1__AbortResponse r = AMAXD__PEER__V1__ABORT_RESPONSE__INIT;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void h_progress(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__ProgressRequest *q = (const void *)m;
    uint32_t missing[64], n = 0;
    uint64_t open = 0, last = 0;
    int in_flight = 0;
    amx_err_t err = {0};
    if (amx_registry_progress(svc->reg, q->job, q->epoch, missing, 64, &n, &open, &last, &in_flight,
                              &err) != AMX_OK) {
        amx__call_reply(c, err.code, err.msg, NULL);
        return;
    }
    Amaxd__Peer__V1__ProgressResponse r = AMAXD__PEER__V1__PROGRESS_RESPONSE__INIT;
    r.epoch = open;
    r.last_reconciled = last;
    r.missing = missing;
    r.n_missing = n;
    r.in_flight = in_flight;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void h_drop(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__DropRequest *q = (const void *)m;
    if (svc->coord != NULL) {
        amx_membership_t mem;
        if (amx_coord_drop(svc->coord, q->job, &mem) == AMX_OK) {
            AMX_INFO("peer", "job %s dropped at the request of daemon %u", q->job, q->from);
            amx_peer_tell_drop(svc->peer, q->job, &mem, q->from);
            amx_membership_free(&mem);
        }
    }
    if (q->from != amx_cluster_id(svc->cluster)->rank)
        amx_registry_peer_drop(svc->reg, q->job, q->from);
    Amaxd__Peer__V1__DropResponse r = AMAXD__PEER__V1__DROP_RESPONSE__INIT;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

const amx_method_t amx__peer_methods[] = {
    {SVC "Join", &amaxd__peer__v1__join_request__descriptor, h_join, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "Sync", &amaxd__peer__v1__sync_request__descriptor, h_sync, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "KvSet", &amaxd__peer__v1__kv_set_request__descriptor, h_kvset, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "KvGet", &amaxd__peer__v1__kv_get_request__descriptor, h_kvget, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "FetchState", &amaxd__peer__v1__fetch_state_request__descriptor, h_fetch, 0,
     AMX_SERVER_PEER, NULL, NULL},
    {SVC "Abort", &amaxd__peer__v1__abort_request__descriptor, h_abort, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "Progress", &amaxd__peer__v1__progress_request__descriptor, h_progress, 0, AMX_SERVER_PEER,
     NULL, NULL},
    {SVC "Drop", &amaxd__peer__v1__drop_request__descriptor, h_drop, 0, AMX_SERVER_PEER, NULL,
     NULL},
};
const size_t amx__n_peer_methods = sizeof(amx__peer_methods) / sizeof(amx__peer_methods[0]);

/* ---- the coordinator's notices ---- */

void amx__service_on_restart(void *ud, const char *job, const amx_membership_t *m,
                             uint32_t restarted, uint64_t gen)
{
    amx_svc_t *svc = ud;
    uint32_t me = amx_cluster_id(svc->cluster)->rank;
    char reason[160];
    snprintf(reason, sizeof(reason), "daemon %u restarted", restarted);
    amx_peer_abort_all(svc->peer, m, job, gen, restarted, reason);
    for (uint32_t i = 0; i < m->npart; i++)
        if (m->part[i].daemon == me)
            amx_registry_peer_abort(svc->reg, job, gen, me, AMX_EABORTED, reason);
}
