/*
 * rpc_call.c - a server call's life (rpc_impl.h): posted requests, the
 * request read and checked (amx_wire_check) then handed to its method, the
 * answer (under the cap on unread answer bytes), the call API handlers use
 * (rpc.h), and the end of the call.
 */
#include "rpc_impl.h"

#include <errno.h>
#include <grpc/byte_buffer_reader.h>
#include <malloc.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <stdlib.h>
#include <string.h>

#include "amaxd/v1/amaxd.pb-c.h"
#include "clock.h"
#include "log.h"
#include "wire.h"

/* Requests at least this large give their memory back when freed. */
#define TRIM_REQUEST_BYTES (4u << 20)

/* ---- calls ---- */

static amx_call_t *call_new(amx_rpc_t *rpc, int method)
{
    amx_call_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->rpc = rpc;
    c->method = method;
    c->t_new = (tag_t){c, TAG_NEW};
    c->t_recv = (tag_t){c, TAG_RECV};
    c->t_send = (tag_t){c, TAG_SEND};
    c->t_close = (tag_t){c, TAG_CLOSE};
    c->waiter.job = NULL;
    grpc_metadata_array_init(&c->md);
    grpc_call_details_init(&c->details);
    c->next = rpc->calls;
    if (rpc->calls)
        rpc->calls->prev = c;
    rpc->calls = c;
    rpc->ncalls++;
    rpc->activity++;
    return c;
}

void amx__rpc_call_free(amx_call_t *c)
{
    amx_rpc_t *rpc = c->rpc;
    if (c->prev)
        c->prev->next = c->next;
    else
        rpc->calls = c->next;
    if (c->next)
        c->next->prev = c->prev;
    rpc->ncalls--;
    rpc->queued -= c->queued;
    if (c->waiter.on_cancel != NULL)
        c->waiter.on_cancel(&c->waiter);
    else if (c->waiter.job != NULL)
        rpc->serve.cancel(rpc->serve.ctx, &c->waiter);
    if (c->request)
        protobuf_c_message_free_unpacked(c->request, NULL);
    amx_arena_free(&c->arena);
    /* A request this large (a catalog, an offer) leaves tens of MB free
     * in the heap once decoded and used: give them back to the system. */
    if (c->request_len >= TRIM_REQUEST_BYTES)
        malloc_trim(0);
    if (c->payload)
        grpc_byte_buffer_destroy(c->payload);
    if (c->recv_buf)
        grpc_byte_buffer_destroy(c->recv_buf);
    if (c->send_buf)
        grpc_byte_buffer_destroy(c->send_buf);
    if (c->replied)
        grpc_slice_unref(c->status_details);
    grpc_metadata_array_destroy(&c->md);
    grpc_call_details_destroy(&c->details);
    if (c->call)
        grpc_call_unref(c->call);
    free(c);
}

void amx__rpc_maybe_free(amx_call_t *c)
{
    if (c->closed && !c->send_pending && !c->recv_pending)
        amx__rpc_call_free(c);
}

/* Posts one request for `method` so that a new call of it can be accepted. */
void amx__rpc_post_request(amx_rpc_t *rpc, int method)
{
    if (rpc->stopping)
        return;
    amx_call_t *c = call_new(rpc, method);
    if (c == NULL) {
        AMX_ERROR("rpc", "out of memory posting a request; fewer calls can be accepted");
        return;
    }
    grpc_call_error e;
    if (method < 0) {
        grpc_server *srv = method == UNKNOWN_PEER ? rpc->peer_server : rpc->server;
        e = grpc_server_request_call(srv, &c->call, &c->details, &c->md, rpc->cq, rpc->cq,
                                     &c->t_new);
    } else {
        const amx_method_t *m = rpc->methods[method];
        grpc_server *srv = m->server == AMX_SERVER_PEER ? rpc->peer_server : rpc->server;
        e = grpc_server_request_registered_call(
            srv, rpc->method_handles[method], &c->call, &c->deadline, &c->md,
            m->client_streaming ? NULL : &c->payload, rpc->cq, rpc->cq, &c->t_new);
    }
    if (e != GRPC_CALL_OK) {
        AMX_ERROR("rpc", "grpc_server_request_call failed: %d", (int)e);
        amx__rpc_call_free(c);
    }
}

/* Answers that the cap on unread answer bytes never refuses: small ones
 * (Health, SendAmax, Status...), and those of calls whose work is done and
 * cannot be asked for again the same way (Join, Reconcile: the epoch has
 * been reconciled; both are bounded, one per rank). A client that does not
 * read can only hold back GetScales-sized answers of its own asking. */
#define QUEUE_EXEMPT_BYTES (64u << 10)

static int reply_is_owed(const amx_call_t *c)
{
    if (c->method < 0)
        return 0;
    const char *p = c->rpc->methods[c->method]->path;
    size_t n = strlen(p);
    return (n >= 9 && strcmp(p + n - 9, "Reconcile") == 0) ||
           (n >= 5 && strcmp(p + n - 5, "/Join") == 0);
}

/* An answer of the peer service. Neither cap on answers (max_message_bytes,
 * max_queued_bytes) applies to it: its callers are daemons that proved the
 * cluster's secret, its size is bounded by the job's catalog limits, and
 * refusing one (an agreement answer, a donor's state) would fail an epoch
 * on every daemon of the job for caps meant for trainers. */
static int peer_answer(const amx_call_t *c)
{
    return c->method >= 0 && c->rpc->methods[c->method]->server == AMX_SERVER_PEER;
}

/* Gives up answer bytes that were not handed to gRPC. */
static void drop_buf(uint8_t *buf, void (*release)(void *), void *ud)
{
    if (release != NULL)
        release(ud);
    else
        free(buf);
}

/* Sends the status, and the answer `buf` of `len` bytes when st is OK and
 * buf is not NULL (buf handed to gRPC without a copy; given up with
 * release(ud), or free() when release is NULL); else packed from `resp`. */
static void send_reply(amx_call_t *c, amx_status_t st, const char *msg,
                       const ProtobufCMessage *resp, uint8_t *buf, size_t len,
                       void (*release)(void *), void *ud)
{
    if (c->replied || c->closed) {
        /* Answered already, or the client is gone: nobody to answer. */
        if (buf != NULL)
            drop_buf(buf, release, ud);
        return;
    }
    amx_rpc_t *rpc = c->rpc;
    char why[400];
    int have = st == AMX_OK && (resp != NULL || buf != NULL);
    if (have) {
        /* Answers are bounded (the registry sizes them beforehand; this is
         * the last guard), and so are the bytes held for clients that do
         * not read their answers: gRPC keeps a message until the client's
         * flow-control window lets it go. */
        if (buf == NULL)
            len = protobuf_c_message_get_packed_size(resp);
        if (peer_answer(c)) {
            rpc->queued += len;
            c->queued = len;
        } else if ((int64_t)len > rpc->cfg->max_message_bytes) {
            snprintf(why, sizeof(why),
                     "%s: the answer of %zu bytes exceeds max_message_bytes=%lld; ask for less "
                     "at a time",
                     amx__call_method(c), len, (long long)rpc->cfg->max_message_bytes);
            st = AMX_ENOMEM, msg = why, have = 0;
        } else if (len > QUEUE_EXEMPT_BYTES && !reply_is_owed(c) &&
                   rpc->queued + len > (uint64_t)rpc->cfg->max_queued_bytes) {
            snprintf(why, sizeof(why),
                     "%s: the daemon already holds %llu bytes of answers that clients have not "
                     "read yet (max_queued_bytes=%lld); this answer of %zu bytes is refused: "
                     "read answers before asking for more",
                     amx__call_method(c), (unsigned long long)rpc->queued,
                     (long long)rpc->cfg->max_queued_bytes, len);
            st = AMX_ENOMEM, msg = why, have = 0;
        } else {
            rpc->queued += len;
            c->queued = len;
        }
        if (!have)
            AMX_WARN("rpc", "%s", why);
    }
    grpc_op ops[4];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    n++;
    if (have) {
        grpc_slice s;
        if (buf != NULL) {
            /* No copy: gRPC gives it up when the bytes are sent. */
            s = release != NULL ? grpc_slice_new_with_user_data(buf, len, release, ud)
                                : grpc_slice_new(buf, len, free);
            buf = NULL;
        } else {
            s = grpc_slice_malloc(len);
            protobuf_c_message_pack(resp, GRPC_SLICE_START_PTR(s));
        }
        c->send_buf = grpc_raw_byte_buffer_create(&s, 1);
        grpc_slice_unref(s);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->send_buf;
        n++;
    }
    if (buf != NULL)
        drop_buf(buf, release, ud);
    /* Unknown methods are counted under one label: their paths are the
     * client's text, and a label per path would let a client grow the
     * metrics without bound. */
    amx_metrics_call(rpc->metrics, c->method >= 0 ? rpc->methods[c->method]->path : "unknown",
                     amx_status_grpc(st));
    c->status_details = grpc_slice_from_copied_string(st == AMX_OK ? "" : (msg ? msg : ""));
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)amx_status_grpc(st);
    ops[n].data.send_status_from_server.status_details = &c->status_details;
    n++;
    int with_close = !c->close_posted;
    if (with_close) {
        ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        ops[n].data.recv_close_on_server.cancelled = &c->cancelled;
        n++;
    }
    c->replied = 1;
    c->send_pending = 1;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, &c->t_send, NULL);
    if (e != GRPC_CALL_OK) {
        AMX_ERROR("rpc", "sending a status failed: grpc_call_error %d", (int)e);
        c->send_pending = 0;
    } else if (with_close) {
        c->close_posted = c->close_in_send = 1;
    }
}

void amx__call_reply(amx_call_t *c, amx_status_t st, const char *msg, const ProtobufCMessage *resp)
{
    send_reply(c, st, msg, resp, NULL, 0, NULL, NULL);
}

void amx__call_reply_raw(amx_call_t *c, uint8_t *buf, size_t len, void (*release)(void *), void *ud)
{
    send_reply(c, AMX_OK, NULL, NULL, buf, len, release, ud);
}

amx_waiter_t *amx__call_waiter(amx_call_t *c)
{
    return &c->waiter;
}

amx_call_t *amx__waiter_call(amx_waiter_t *w)
{
    return (amx_call_t *)w; /* the waiter is the call's first member */
}

amx_arena_t *amx__call_arena(amx_call_t *c)
{
    return &c->arena;
}

const char *amx__call_metadata(amx_call_t *c, const char *key, size_t *len)
{
    size_t klen = strlen(key);
    for (size_t i = 0; i < c->md.count; i++) {
        const grpc_metadata *m = &c->md.metadata[i];
        if (GRPC_SLICE_LENGTH(m->key) == klen &&
            memcmp(GRPC_SLICE_START_PTR(m->key), key, klen) == 0) {
            *len = GRPC_SLICE_LENGTH(m->value);
            return (const char *)GRPC_SLICE_START_PTR(m->value);
        }
    }
    return NULL;
}

void amx__call_peer(amx_call_t *c, char *buf, size_t len)
{
    char *p = c->call ? grpc_call_get_peer(c->call) : NULL;
    snprintf(buf, len, "%s", p ? p : "?");
    gpr_free(p);
}

const char *amx__call_method(amx_call_t *c)
{
    return c->method >= 0 ? c->rpc->methods[c->method]->path : "(unknown method)";
}

/* What a request may hold before it is decoded (the configuration may be
 * reloaded, so it is read every time). */
static amx_wire_limits_t wire_limits(const amx_config_t *cfg)
{
    amx_wire_limits_t l;
    l.max_decoded = (uint64_t)cfg->max_request_memory;
    l.max_elements = (uint64_t)(cfg->max_quantizers > cfg->cluster_size ? cfg->max_quantizers
                                                                        : cfg->cluster_size);
    l.max_scalars = (uint64_t)(cfg->max_world_size > 64 ? cfg->max_world_size : 64);
    l.max_depth = 8;
    return l;
}

/* The bytes of a request (one contiguous copy, ours to change), checked
 * against max_message_bytes and by amx_wire_check; AMX_OK or a sentence. */
static amx_status_t read_checked(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                                 int64_t max_bytes, const amx_wire_limits_t *lim, grpc_slice *out,
                                 amx_err_t *err)
{
    size_t len = grpc_byte_buffer_length(bb);
    if ((int64_t)len > max_bytes)
        return amx_err_set(err, AMX_ENOMEM,
                           "a %s message of %zu bytes exceeds max_message_bytes=%lld; split it "
                           "into smaller batches (or stream them)",
                           desc->name, len, (long long)max_bytes);
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return amx_err_set(err, AMX_EINVAL, "request payload could not be read (compressed?)");
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    /* Checked before protobuf-c allocates anything (wire.h). */
    amx_status_t st =
        amx_wire_check(desc, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), lim, NULL, err);
    if (st != AMX_OK) {
        grpc_slice_unref(s);
        return st;
    }
    *out = s;
    return AMX_OK;
}

/* The bytes of a raw request, checked as read_checked does, copied once
 * into rpc->scratch (valid until the next raw request). */
static amx_status_t read_raw(amx_rpc_t *rpc, grpc_byte_buffer *bb,
                             const ProtobufCMessageDescriptor *desc, const amx_wire_limits_t *lim,
                             uint8_t **data, size_t *len, amx_err_t *err)
{
    size_t n = grpc_byte_buffer_length(bb);
    if ((int64_t)n > rpc->cfg->max_message_bytes)
        return amx_err_set(err, AMX_ENOMEM,
                           "a %s message of %zu bytes exceeds max_message_bytes=%lld; split it "
                           "into smaller batches (or stream them)",
                           desc->name, n, (long long)rpc->cfg->max_message_bytes);
    if (n > rpc->scratch_cap || rpc->scratch == NULL) {
        uint8_t *p = realloc(rpc->scratch, n ? n : 1);
        if (p == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory reading a %s message of %zu bytes",
                               desc->name, n);
        rpc->scratch = p;
        rpc->scratch_cap = n ? n : 1;
    }
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return amx_err_set(err, AMX_EINVAL, "request payload could not be read (compressed?)");
    size_t at = 0;
    grpc_slice s;
    while (grpc_byte_buffer_reader_next(&r, &s)) {
        size_t k = GRPC_SLICE_LENGTH(s);
        if (k > n - at)
            k = n - at; /* cannot happen: the length is the slices' sum */
        memcpy(rpc->scratch + at, GRPC_SLICE_START_PTR(s), k);
        at += k;
        grpc_slice_unref(s);
    }
    grpc_byte_buffer_reader_destroy(&r);
    AMX_CHECK(amx_wire_check(desc, rpc->scratch, at, lim, NULL, err));
    *data = rpc->scratch;
    *len = at;
    return AMX_OK;
}

/* Unpacks a byte buffer into a message; NULL and a sentence when it is not one. */
static ProtobufCMessage *unpack(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *desc,
                                int64_t max_bytes, const amx_wire_limits_t *lim, amx_err_t *err)
{
    grpc_slice s;
    if (read_checked(bb, desc, max_bytes, lim, &s, err) != AMX_OK)
        return NULL;
    ProtobufCMessage *m =
        protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    if (m == NULL)
        amx_err_set(err, AMX_EINVAL, "request is not a valid %s message (%zu bytes)", desc->name,
                    (size_t)GRPC_SLICE_LENGTH(s));
    grpc_slice_unref(s);
    return m;
}

static void post_recv(amx_call_t *c)
{
    grpc_op op;
    memset(&op, 0, sizeof(op));
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->recv_buf;
    c->recv_pending = 1;
    if (grpc_call_start_batch(c->call, &op, 1, &c->t_recv, NULL) != GRPC_CALL_OK) {
        c->recv_pending = 0;
        amx__call_reply(c, AMX_EINTERNAL, "could not read the stream", NULL);
    }
}

static void start_call(amx_rpc_t *rpc, amx_call_t *c);

void amx__rpc_on_new(amx_call_t *c, int ok)
{
    amx_rpc_t *rpc = c->rpc;
    if (!ok) {
        /* The server is shutting down: this request will never be a call. */
        amx__rpc_call_free(c);
        return;
    }
    amx__rpc_post_request(rpc, c->method);
    c->started = 1;
    start_call(rpc, c);
    /* A call answered at once watched for its end in the answer's batch
     * (one completion less per unary call); one that waits, streams or
     * could not be answered watches now, so that a client that goes away is
     * seen. The call cannot have been freed: it is not closed yet. */
    if (!c->close_posted) {
        grpc_op op;
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        op.data.recv_close_on_server.cancelled = &c->cancelled;
        c->close_posted = 1;
        if (grpc_call_start_batch(c->call, &op, 1, &c->t_close, NULL) != GRPC_CALL_OK) {
            AMX_ERROR("rpc", "could not watch a call for its end; dropping it");
            c->closed = 1;
            amx__rpc_maybe_free(c);
        }
    }
}

/* Decodes a new call's request and hands it to its method's handler (or
 * answers it at once). */
static void start_call(amx_rpc_t *rpc, amx_call_t *c)
{
    if (c->method < 0) {
        char path[256];
        snprintf(path, sizeof(path), "%.*s", (int)GRPC_SLICE_LENGTH(c->details.method),
                 (const char *)GRPC_SLICE_START_PTR(c->details.method));
        char msg[400];
        snprintf(msg, sizeof(msg), "method %s is not served by amaxd (see proto/amaxd)", path);
        AMX_WARN("rpc", "%s", msg);
        amx__call_reply(c, AMX_EUNIMPL, msg, NULL);
        return;
    }
    const amx_method_t *m = rpc->methods[c->method];
    if (m->client_streaming) {
        post_recv(c);
        return;
    }
    amx_err_t err = {0};
    if (c->payload != NULL)
        c->request_len = grpc_byte_buffer_length(c->payload);
    if (c->payload != NULL && m->raw != NULL) {
        amx_wire_limits_t lim = wire_limits(rpc->cfg);
        uint8_t *data;
        size_t len;
        amx_status_t st = read_raw(rpc, c->payload, m->request, &lim, &data, &len, &err);
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
        if (st != AMX_OK) {
            AMX_WARN("rpc", "%s rejected: %s", m->path, err.msg);
            amx__call_reply(c, err.code, err.msg, NULL);
            return;
        }
        m->raw(rpc->serve.ctx, c, data, len);
        return;
    }
    if (c->payload == NULL) {
        amx_err_set(&err, AMX_EINVAL, "%s: the call carried no request message", m->path);
    } else {
        amx_wire_limits_t lim = wire_limits(rpc->cfg);
        c->request = unpack(c->payload, m->request, rpc->cfg->max_message_bytes, &lim, &err);
        grpc_byte_buffer_destroy(c->payload);
        c->payload = NULL;
    }
    if (c->request == NULL) {
        AMX_WARN("rpc", "%s rejected: %s", m->path, err.msg);
        amx__call_reply(c, err.code, err.msg, NULL);
        return;
    }
    m->handler(rpc->serve.ctx, c, c->request);
}

void amx__rpc_on_recv(amx_call_t *c, int ok)
{
    c->recv_pending = 0;
    c->rpc->activity++;
    if (!ok && !c->replied && !c->closed)
        AMX_WARN("rpc",
                 "StreamAmax: reading message %llu failed (over twice max_message_bytes, "
                 "or the client went away)",
                 (unsigned long long)c->stream_accepted + 1);
    /* closed: with several CQ threads the call's end may be queued before
     * this message; the client is gone, so is the stream. */
    if (!ok || c->replied || c->closed) {
        amx__rpc_maybe_free(c);
        return;
    }
    amx_rpc_t *rpc = c->rpc;
    if (c->recv_buf == NULL) { /* half-close: the stream is complete */
        Amaxd__V1__SendAmaxResponse resp = AMAXD__V1__SEND_AMAX_RESPONSE__INIT;
        resp.accepted = c->stream_accepted;
        resp.epoch = c->stream_epoch;
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
        return;
    }
    amx_err_t err = {0};
    amx_wire_limits_t lim = wire_limits(rpc->cfg);
    const amx_method_t *meth = rpc->methods[c->method];
    uint8_t *data;
    size_t len;
    amx_status_t st = read_raw(rpc, c->recv_buf, meth->request, &lim, &data, &len, &err);
    grpc_byte_buffer_destroy(c->recv_buf);
    c->recv_buf = NULL;
    if (st == AMX_OK) {
        st = meth->raw_stream(rpc->serve.ctx, data, len, &c->stream_accepted, &c->stream_epoch,
                              &err);
    } else {
        AMX_WARN("rpc", "%s rejected after %llu accepted updates: %s", meth->path,
                 (unsigned long long)c->stream_accepted, err.msg);
    }
    if (st != AMX_OK) {
        amx__call_reply(c, st, err.msg, NULL);
        return;
    }
    post_recv(c);
}