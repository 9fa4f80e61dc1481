/*
 * service_peer.c - the peer service (amaxd.peer.v1.Peer) that this daemon
 * serves to the others of its cluster: every call is checked against the
 * cluster's secret; Join, Sync, KvSet, KvGet and Drop go to the
 * coordinator (while this daemon has the role), FetchState, Abort,
 * Progress and Drop to the registry; Ping is answered here. Beside the trainer service (service.c),
 * above everything else.
 */
#include "service.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amaxd/peer/v1/peer.pb-c.h"
#include "bytebuf.h"
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

/* The coordinator's calls are served by the candidate that has the role
 * now; another candidate answers UNAVAILABLE (the caller finds the
 * coordinator again), any other daemon FAILED_PRECONDITION. */
static int need_coord(amx_svc_t *svc, amx_call_t *c)
{
    /* A daemon that was stopped drops its stale coordinator before it
     * answers anything with it (the tick may not have run yet). */
    if (svc->peer != NULL)
        amx_peer_tick(svc->peer);
    if (amx_coord_active(svc->coord))
        return 1;
    const amx_cluster_id_t *id = amx_cluster_id(svc->cluster);
    char msg[400];
    if (svc->coord != NULL && svc->peer != NULL) {
        uint32_t r;
        char addr[256];
        amx_peer_coordinator(svc->peer, &r, addr, sizeof(addr));
        snprintf(msg, sizeof(msg),
                 "daemon %u is not the coordinator now: daemon %u (%s) is, as far as it knows",
                 id->rank, r, addr);
        AMX_INFO("peer", "%s refused: %s", amx__call_method(c), msg);
        amx__call_reply(c, AMX_EUNAVAIL, msg, NULL);
        return 0;
    }
    snprintf(msg, sizeof(msg),
             "daemon %u is not the coordinator (nor a candidate: the coordinator list names "
             "ranks 0-%u)",
             id->rank, id->ncoord > 0 ? id->ncoord - 1 : 0);
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

/* A call the coordinator answered (or refused): it waits no more, and a
 * cancellation has nothing left to cancel. */
static amx_waiter_t *coord_answered(amx_call_t *c)
{
    amx_waiter_t *w = amx__call_waiter(c);
    w->on_cancel = NULL;
    w->ext = NULL;
    w->job = NULL;
    return w;
}

typedef struct join_cache {
    uint64_t hash;
    int rejoined;
    amx_replybuf_t *buf;
    size_t len;
} join_cache_t;

static join_cache_t g_join; /* loop lock */

static void on_coord_join(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    amx_call_t *c = ud;
    coord_answered(c);
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    /* Every rank of a job gets the same membership when the last one
     * joins: serialized once, shared by reference. */
    uint64_t h = amx_membership_hash(m) ^ (m->coord_inc * 0x9e3779b97f4a7c15ull);
    if (g_join.buf != NULL && g_join.hash == h && g_join.rejoined == m->rejoined) {
        atomic_fetch_add(&g_join.buf->refs, 1);
        amx__call_reply_raw(c, g_join.buf->data, g_join.len, amx_replybuf_unref, g_join.buf);
        return;
    }
    Amaxd__Peer__V1__JoinResponse r = AMAXD__PEER__V1__JOIN_RESPONSE__INIT;
    amx_arena_t a = {0};
    amx_replybuf_t *buf = NULL;
    size_t len = 0;
    if (amx_codec_members_out(m, &r.participants, &r.n_participants, &a) == AMX_OK) {
        r.rejoined = m->rejoined;
        r.coordinator_incarnation = m->coord_inc;
        r.world_size = m->world;
        len = protobuf_c_message_get_packed_size(&r.base);
        buf = amx_replybuf_take(&buf, len ? len : 1);
        if (buf != NULL)
            protobuf_c_message_pack(&r.base, buf->data);
    }
    amx_arena_free(&a);
    if (buf == NULL) {
        amx__call_reply(c, AMX_ENOMEM, "out of memory answering a Join", NULL);
        return;
    }
    /* amx_replybuf_take gave two references: the cache keeps one, the
     * answer holds the other. */
    amx_replybuf_unref(g_join.buf);
    g_join = (join_cache_t){h, m->rejoined, buf, len};
    amx__call_reply_raw(c, buf->data, len, amx_replybuf_unref, buf);
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
        coord_answered(c);
        reply_err(c, err.code, err.msg);
        return;
    }
    if (w->on_cancel != NULL)
        w->ext = h;
}

/* -- Sync -- */

/* What a Sync's caller holds, kept with its call for the answer. */
typedef struct sync_caller {
    uint64_t catalog_hash, membership_hash, union_hash;
    int want_catalog;
} sync_caller_t;

/* The specs agreed since `from` (a version the coordinator still keeps),
 * in the arena; -1 when it does not keep it. */
static int delta_since(const amx_coord_sync_ans_t *ans, uint64_t from,
                       Amaxd__V1__QuantizerSpec ***out, size_t *n, amx_arena_t *a)
{
    const amx_coord_version_t *v = NULL;
    for (size_t i = ans->nversions; i-- > 0 && v == NULL;)
        if (ans->versions[i].hash == from)
            v = &ans->versions[i];
    if (v == NULL || v->nadded > ans->catalog->n)
        return -1;
    size_t k = ans->catalog->n - v->nadded;
    Amaxd__V1__QuantizerSpec **q = amx_arena_alloc(a, (k + 1) * sizeof(*q));
    if (q == NULL)
        return -1;
    for (size_t i = 0; i < k; i++) {
        Amaxd__V1__QuantizerSpec *s = amx_arena_alloc(a, sizeof(*s));
        if (s == NULL || amx_codec_spec_out(ans->catalog->agreed[v->nadded + i], s, a) != AMX_OK)
            return -1;
        q[i] = s;
    }
    *out = q;
    *n = k;
    return 0;
}

/* An agreement's answers are the same for every caller that holds the same
 * catalog and membership: serialized once, shared by reference. */
typedef struct answer_cache {
    uint64_t inc, round, from; /* the coordinator's incarnation and round */
    int whole, members, yours;
    amx_replybuf_t *buf;
    size_t len, nspecs;
} answer_cache_t;

static void count_answer(const amx_coord_sync_ans_t *ans, const answer_cache_t *e)
{
    if (ans->stats == NULL)
        return;
    ans->stats->specs_sent += e->nspecs;
    ans->stats->members_sent += e->members;
    ans->stats->answer_bytes += e->len;
}

#define ANSWER_CACHE 4
static answer_cache_t g_answers[ANSWER_CACHE]; /* loop lock */

void amx__service_peer_free(void)
{
    amx_replybuf_unref(g_join.buf);
    g_join.buf = NULL;
    for (int i = 0; i < ANSWER_CACHE; i++) {
        amx_replybuf_unref(g_answers[i].buf);
        g_answers[i].buf = NULL;
    }
}

static void on_coord_sync(void *ud, amx_status_t st, const char *msg,
                          const amx_coord_sync_ans_t *ans)
{
    amx_call_t *c = ud;
    const sync_caller_t *caller = coord_answered(c)->ext2;
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__Peer__V1__SyncResponse r = AMAXD__PEER__V1__SYNC_RESPONSE__INIT;
    if (ans->send_catalog || ans->send_offer) {
        r.send_catalog = ans->send_catalog;
        r.send_offer = ans->send_offer;
        r.coordinator_incarnation = ans->coord_inc;
        amx__call_reply(c, AMX_OK, NULL, &r.base);
        return;
    }
    uint64_t from = caller->catalog_hash;
    /* Nothing to send when the caller holds the agreed catalog, or makes it
     * from its own catalog and proposals (the common case: every daemon
     * registered the same quantizers). */
    int yours = from != ans->catalog_hash && caller->union_hash == ans->catalog_hash &&
                !caller->want_catalog;
    int none = from == ans->catalog_hash || yours;
    if (yours)
        from = caller->union_hash; /* its own cache entry */
    int whole = !none && caller->want_catalog;
    int members = caller->membership_hash != ans->members_hash;
    for (int i = 0; i < ANSWER_CACHE; i++) {
        answer_cache_t *e = &g_answers[i];
        if (e->buf != NULL && e->inc == ans->coord_inc && e->round == ans->round &&
            (none ? e->from == from : e->from == from && e->whole == whole) &&
            e->members == members && e->yours == yours) {
            atomic_fetch_add(&e->buf->refs, 1);
            count_answer(ans, e);
            amx__call_reply_raw(c, e->buf->data, e->len, amx_replybuf_unref, e->buf);
            return;
        }
    }
    amx_arena_t a = {0};
    r.seq = ans->seq;
    r.catalog_hash = ans->catalog_hash;
    int ok = 1;
    size_t nspecs = 0;
    if (!none && !whole && delta_since(ans, from, &r.catalog, &r.n_catalog, &a) == 0) {
        r.catalog_included = 1;
        r.catalog_delta = 1;
        nspecs = r.n_catalog;
    } else if (!none) {
        whole = 1;
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
        nspecs = ans->catalog->n;
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
    r.members_omitted = !members;
    r.catalog_yours = yours;
    if (ok && members)
        ok = amx_codec_members_out(ans->members, &r.participants, &r.n_participants, &a) == AMX_OK;
    size_t len = ok ? protobuf_c_message_get_packed_size(&r.base) : 0;
    amx_replybuf_t *buf = NULL;
    if (ok && (buf = amx_replybuf_take(&buf, len ? len : 1)) == NULL)
        ok = 0;
    if (!ok) {
        amx__call_reply(c, AMX_ENOMEM, "out of memory answering an agreement", NULL);
        amx_arena_free(&a);
        return;
    }
    protobuf_c_message_pack(&r.base, buf->data);
    amx_arena_free(&a);
    if (ans->stats != NULL)
        ans->stats->answers_built++;
    /* The cache keeps the slot's reference; the answer holds the one
     * amx_replybuf_take gave. The oldest entry makes room. */
    answer_cache_t *e = &g_answers[ans->round % ANSWER_CACHE];
    for (int i = 0; i < ANSWER_CACHE; i++)
        if (g_answers[i].buf == NULL) {
            e = &g_answers[i];
            break;
        }
    amx_replybuf_unref(e->buf);
    *e =
        (answer_cache_t){ans->coord_inc, ans->round, from, whole, members, yours, buf, len, nspecs};
    count_answer(ans, e);
    amx__call_reply_raw(c, buf->data, len, amx_replybuf_unref, buf);
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
        .offer_hash = q->offer_hash,
        .offer_count = q->offer_count,
        .offer_included = q->offer_included,
        .union_hash = q->union_hash,
    };
    if (!q->offer_included && q->n_proposals > 0) {
        free(specs);
        free(ptrs);
        reply_err(c, AMX_EINVAL, "Sync carries specs without offer_included");
        return;
    }
    /* What the caller holds, for its answer (the call's arena). */
    sync_caller_t *caller = amx_arena_alloc(amx__call_arena(c), sizeof(*caller));
    if (caller == NULL) {
        free(specs);
        free(ptrs);
        reply_err(c, AMX_ENOMEM, "out of memory");
        return;
    }
    *caller = (sync_caller_t){q->catalog_hash, q->membership_hash, q->union_hash, q->want_catalog};
    amx_waiter_t *w = amx__call_waiter(c);
    w->job = svc;
    w->on_cancel = sync_cancelled;
    w->ext2 = caller;
    amx_creq_t *h = NULL;
    amx_status_t st = amx_coord_sync(svc->coord, &req, on_coord_sync, c, &h, &err);
    free(specs);
    free(ptrs);
    if (st != AMX_OK) {
        coord_answered(c);
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
    coord_answered(c);
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
        coord_answered(c);
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
    amx_registry_peer_abort(svc->reg, q->job, q->comm_generation, q->epoch, q->agreement,
                            q->coordinator_incarnation, q->from, amx_status_from_grpc((int)q->code),
                            q->reason);
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
    if (amx_coord_active(svc->coord)) {
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

static void h_ping(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    (void)m;
    if (!authed(svc, c))
        return;
    const amx_cluster_id_t *id = amx_cluster_id(svc->cluster);
    Amaxd__Peer__V1__PingResponse r = AMAXD__PEER__V1__PING_RESPONSE__INIT;
    r.daemon = id->rank;
    r.incarnation = id->incarnation;
    r.coordinating = amx_coord_active(svc->coord);
    if (svc->peer != NULL)
        amx_peer_coordinator(svc->peer, &r.coordinator, NULL, 0);
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
    {SVC "Ping", &amaxd__peer__v1__ping_request__descriptor, h_ping, 0, AMX_SERVER_PEER, NULL,
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
            amx_registry_peer_abort(svc->reg, job, gen, 0, 0, 0, me, AMX_EABORTED, reason);
}
