/*
 * rpc.c - gRPC C-core plumbing: servers and the loop's client calls.
 *
 * Each server call is an amx_call_t with four tags (new, recv, send, close).
 * A call is freed when its status has been sent (or it was abandoned) and
 * RECV_CLOSE_ON_SERVER has completed, whichever is last.
 *
 * The loop lock. Everything the loop thread owns (the registry, the calls,
 * the loop's handles) is owned by whichever thread holds rpc->loop_mu. The
 * loop thread holds it except while it sleeps in poll() on the loop's
 * backend descriptor (amx_rpc_run); a completion-queue thread that takes an
 * event off the queue handles it itself, as the loop thread would have, when
 * the lock is free, else queues it for the holder (combine()) and goes back
 * to gRPC: no thread sleeps on the lock, so a long handler does not stop
 * gRPC's reading of other connections. Handing every event to the loop thread instead
 * cost two wakeups per completion, three completions per unary call: most
 * of a small call's time on two cores. After handling an event the thread
 * wakes the loop only when the loop's next deadline moved earlier than the
 * one it sleeps on (a timer started, a handle closing). The queue's end
 * (GRPC_QUEUE_SHUTDOWN) still goes to the loop thread, which joins the
 * completion-queue threads.
 *
 * So handlers must not start I/O watchers on the loop (uv_poll_start,
 * uv_read_start, a uv_write that has to wait): libuv 1.44's
 * uv_backend_timeout does not see its watcher queue, and a sleeping loop
 * would not notice them before its next wake-up. Timers are seen, but are
 * reckoned from the loop's time when it went to sleep. None do today: a
 * handler reaches the loop only through uv_async_send, and the daemon's
 * timers are started on the loop thread (main, notify, rpc's grace).
 *
 * Two servers share the one completion queue: the trainer server (Unix
 * socket, optional loopback TCP: amaxd.v1 and health) and, in a cluster,
 * the peer server (TCP: amaxd.peer.v1). For every registered method several
 * requests stay posted, and one grpc_server_request_call per server stays
 * posted for unknown methods, which are answered UNIMPLEMENTED (otherwise
 * they would hang until their deadline).
 *
 * Client calls of the loop thread (amx_rpc_call) use the same queue: one
 * batch with every op, one tag, one callback.
 *
 * CQ_THREADS threads call grpc_completion_queue_next: gRPC reads, parses
 * and accepts inside that call, and one connection that keeps its socket
 * full keeps its thread there, so a single thread lets one client stall
 * every other. The Unix socket is not gRPC's: the guard (guard.h) listens
 * on it and relays each connection, because gRPC 1.51's listener dies on
 * EMFILE and its HPACK parser has no bound on a header block.
 */
#include "rpc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "amaxd/v1/amaxd.pb-c.h"
#include "clock.h"
#include "guard.h"
#include "metrics.h"
#include "log.h"
#include "wire.h"

/* absl_tune.cc: Abseil's deadlock detection off (a debugging aid that
 * Debian's build leaves on in every mutex gRPC takes). */
void amx__absl_tune(void);

#define POSTED_PER_METHOD 8
#define MAX_METHODS 32
#define UNKNOWN_TRAINER -1
#define UNKNOWN_PEER -2
#define CQ_THREADS 4
#define MAX_HEADER_BLOCK (64 * 1024) /* bytes of one HEADERS + CONTINUATION block */

enum { TAG_NEW, TAG_RECV, TAG_SEND, TAG_CLOSE, TAG_SHUTDOWN, TAG_CLIENT };

typedef struct tag {
    void *obj; /* the amx_call_t or amx_ccall_t */
    int what;
} tag_t;

struct amx_ccall {
    tag_t tag;
    amx_rpc_t *rpc;
    grpc_call *call;
    grpc_metadata md;
    grpc_byte_buffer *send_buf, *recv_buf;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    amx_ccall_cb cb;
    void *ud;
    int cancelled;
    struct amx_ccall *prev, *next;
};

struct amx_call {
    amx_waiter_t waiter; /* first member: amx__waiter_call recovers the call */
    amx_rpc_t *rpc;
    int method; /* index into rpc->methods, or UNKNOWN_* */
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details details;
    grpc_byte_buffer *payload;
    grpc_byte_buffer *recv_buf;
    grpc_byte_buffer *send_buf;
    grpc_slice status_details;
    int cancelled;
    int started, replied, closed, recv_pending, send_pending;
    /* RECV_CLOSE_ON_SERVER posted; close_in_send: as part of the answer's
     * batch (an answer given at once), whose completion then ends the call. */
    int close_posted, close_in_send;
    ProtobufCMessage *request; /* kept while the call waits in the registry */
    amx_arena_t arena;         /* request views that live as long as the call */
    uint64_t stream_accepted, stream_epoch;
    uint64_t queued; /* bytes of its answer counted in rpc->queued */
    tag_t t_new, t_recv, t_send, t_close;
    struct amx_call *prev, *next; /* live calls */
};

typedef struct event {
    void *tag;
    int ok;
} event_t;

struct amx_rpc {
    uv_loop_t *loop;
    const amx_config_t *cfg;
    amx_rpc_serve_t serve; /* the caller's methods, context and hooks */
    grpc_server *server, *peer_server;
    int nservers, servers_shut;
    grpc_completion_queue *cq;
    const amx_method_t *methods[MAX_METHODS];
    void *method_handles[MAX_METHODS];
    size_t nmethods;
    amx_ccall_t *ccalls; /* client calls in flight */
    pthread_t cq_threads[CQ_THREADS];
    int n_cq_threads;    /* started */
    int cq_threads_live; /* not yet past GRPC_QUEUE_SHUTDOWN; under mu */
    uv_async_t wake;
    pthread_mutex_t mu;
    pthread_mutex_t loop_mu; /* the loop lock (see the top of this file) */
    uint64_t wait_until;     /* loop time the loop thread sleeps until; under loop_mu */
    int loop_locked;         /* the loop thread holds loop_mu (set at start) */
    int cq_shut;             /* the queue has ended; under mu */
    int loop_wants;          /* the loop thread waits for loop_mu (atomic) */
    event_t *queue;          /* filled by the CQ thread */
    size_t qlen, qcap;
    event_t *spare; /* drained by the loop, then swapped back */
    size_t spare_cap;
    amx_call_t *calls; /* live calls */
    uint32_t ncalls;
    uint64_t activity; /* calls posted + stream messages read (amx_rpc_activity) */
    uint64_t queued;   /* answer bytes handed to gRPC and not sent yet */
    int stopping, cq_done;
    tag_t t_shutdown, t_shutdown_peer;
    uv_timer_t grace;
    int grace_started;
    void (*on_stopped)(void *);
    void *stopped_ud;
    char unix_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    amx_guard_t *guard; /* listens on unix_path */
    /* The bytes of the raw request being handled (loop thread only; a raw
     * handler does not keep them): reused, so that large requests do not
     * get fresh pages every time. Grows to the largest raw request. */
    uint8_t *scratch;
    size_t scratch_cap;
    amx_metrics_t *metrics; /* NULL: not recorded */
};

/* ---- completion-queue threads ---- */

static void dispatch(amx_rpc_t *rpc, event_t *ev);

/* After an event handled off the loop thread (under the loop lock): wakes
 * the sleeping loop when what was done gave it something to do sooner than
 * it planned (a timer due earlier, a handle to close, nothing left to run).
 * uv_now is the loop's cached time, the base of the deadline it sleeps on. */
static void wake_if_earlier(amx_rpc_t *rpc)
{
    int t = uv_backend_timeout(rpc->loop);
    uint64_t until = t < 0 ? UINT64_MAX : uv_now(rpc->loop) + (uint64_t)t;
    if (until < rpc->wait_until) {
        rpc->wait_until = until;
        uv_async_send(&rpc->wake);
    }
}

/* Appends an event to the queue (any thread). */
static void push(amx_rpc_t *rpc, void *tag, int ok)
{
    pthread_mutex_lock(&rpc->mu);
    if (rpc->qlen == rpc->qcap) {
        size_t cap = rpc->qcap ? rpc->qcap * 2 : 256;
        event_t *q = realloc(rpc->queue, cap * sizeof(event_t));
        if (q == NULL) {
            /* Nothing sane remains: an event lost here would hang a call forever. */
            AMX_ERROR("rpc", "out of memory queueing a completion event; aborting");
            abort();
        }
        rpc->queue = q;
        rpc->qcap = cap;
    }
    rpc->queue[rpc->qlen].tag = tag;
    rpc->queue[rpc->qlen].ok = ok;
    rpc->qlen++;
    pthread_mutex_unlock(&rpc->mu);
}

static int queued_events(amx_rpc_t *rpc)
{
    pthread_mutex_lock(&rpc->mu);
    int n = rpc->qlen > 0;
    pthread_mutex_unlock(&rpc->mu);
    return n;
}

/* Handles every queued event, the ones queued meanwhile too. Under the
 * loop lock. */
static void drain(amx_rpc_t *rpc)
{
    for (;;) {
        /* Take the whole queue by swapping buffers: no copy, no allocation. */
        pthread_mutex_lock(&rpc->mu);
        event_t *batch = rpc->queue;
        size_t n = rpc->qlen, cap = rpc->qcap;
        rpc->queue = rpc->spare;
        rpc->qcap = rpc->spare_cap;
        rpc->qlen = 0;
        pthread_mutex_unlock(&rpc->mu);
        for (size_t i = 0; i < n; i++)
            dispatch(rpc, &batch[i]);
        rpc->spare = batch; /* only the holder of the loop lock touches spare */
        rpc->spare_cap = cap;
        if (n == 0)
            return;
    }
}

/* Whoever holds the loop lock handles the queue; a thread that finds it
 * held leaves its event there and goes back to gRPC instead of sleeping
 * on the lock. Every holder looks at the queue again after letting go, so
 * an event queued while it held the lock is never left behind. */
static void combine(amx_rpc_t *rpc)
{
    /* A loop thread that woke up and waits for the lock goes first (it
     * drains the queue before it sleeps again): completions that keep
     * coming cannot keep it, its timers and epoch outcomes out. */
    while (!__atomic_load_n(&rpc->loop_wants, __ATOMIC_ACQUIRE) &&
           pthread_mutex_trylock(&rpc->loop_mu) == 0) {
        drain(rpc);
        wake_if_earlier(rpc);
        pthread_mutex_unlock(&rpc->loop_mu);
        if (!queued_events(rpc))
            return;
    }
}

static void *cq_main(void *arg)
{
    amx_rpc_t *rpc = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(rpc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_OP_COMPLETE) {
            push(rpc, ev.tag, ev.success);
            combine(rpc);
            continue;
        }
        /* GRPC_QUEUE_SHUTDOWN, after every event. Every thread sees it; the
         * last one reports it to the loop thread (which joins the threads),
         * after the others have queued their last events. */
        pthread_mutex_lock(&rpc->mu);
        int last = --rpc->cq_threads_live == 0;
        if (last)
            rpc->cq_shut = 1;
        pthread_mutex_unlock(&rpc->mu);
        if (last)
            uv_async_send(&rpc->wake);
        return NULL;
    }
}

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

static void call_free(amx_call_t *c)
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

static void maybe_free(amx_call_t *c)
{
    if (c->closed && !c->send_pending && !c->recv_pending)
        call_free(c);
}

/* Posts one request for `method` so that a new call of it can be accepted. */
static void post_request(amx_rpc_t *rpc, int method)
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
        call_free(c);
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
        if ((int64_t)len > rpc->cfg->max_message_bytes) {
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

static void on_new(amx_call_t *c, int ok)
{
    amx_rpc_t *rpc = c->rpc;
    if (!ok) {
        /* The server is shutting down: this request will never be a call. */
        call_free(c);
        return;
    }
    post_request(rpc, c->method);
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
            maybe_free(c);
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

static void on_recv(amx_call_t *c, int ok)
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
        maybe_free(c);
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

static void check_stopped(amx_rpc_t *rpc);

/* ---- client calls ---- */

static void ccall_free(amx_ccall_t *cc)
{
    amx_rpc_t *rpc = cc->rpc;
    if (cc->prev)
        cc->prev->next = cc->next;
    else
        rpc->ccalls = cc->next;
    if (cc->next)
        cc->next->prev = cc->prev;
    if (cc->send_buf)
        grpc_byte_buffer_destroy(cc->send_buf);
    if (cc->recv_buf)
        grpc_byte_buffer_destroy(cc->recv_buf);
    grpc_metadata_array_destroy(&cc->init_md);
    grpc_metadata_array_destroy(&cc->trail_md);
    grpc_slice_unref(cc->details);
    grpc_slice_unref(cc->md.key);
    grpc_slice_unref(cc->md.value);
    if (cc->call)
        grpc_call_unref(cc->call);
    free(cc);
}

gpr_timespec amx_rpc_deadline(uint64_t deadline_ms)
{
    if (deadline_ms == UINT64_MAX)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    uint64_t now = amx_now_ms();
    int64_t left = deadline_ms > now ? (int64_t)(deadline_ms - now) : 0;
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(left, GPR_TIMESPAN));
}

amx_status_t amx_rpc_call(amx_rpc_t *rpc, grpc_channel *ch, const char *method, const uint8_t *req,
                          size_t len, const char *md_key, const char *md_val, uint64_t deadline_ms,
                          amx_ccall_cb cb, void *ud, amx_ccall_t **out, amx_err_t *err)
{
    if (rpc->stopping)
        return amx_err_set(err, AMX_EUNAVAIL, "amaxd is shutting down");
    amx_ccall_t *cc = calloc(1, sizeof(*cc));
    if (cc == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    cc->tag = (tag_t){cc, TAG_CLIENT};
    cc->rpc = rpc;
    cc->cb = cb;
    cc->ud = ud;
    cc->details = grpc_empty_slice();
    cc->md.key = grpc_slice_from_copied_string(md_key ? md_key : "");
    cc->md.value = grpc_slice_from_copied_string(md_val ? md_val : "");
    grpc_metadata_array_init(&cc->init_md);
    grpc_metadata_array_init(&cc->trail_md);
    grpc_slice path = grpc_slice_from_static_string(method);
    cc->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, rpc->cq, path, NULL,
                                        amx_rpc_deadline(deadline_ms), NULL);
    cc->next = rpc->ccalls;
    if (rpc->ccalls)
        rpc->ccalls->prev = cc;
    rpc->ccalls = cc;
    if (cc->call == NULL) {
        ccall_free(cc);
        return amx_err_set(err, AMX_EINTERNAL, "cannot create a call of %s", method);
    }
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)req, len);
    cc->send_buf = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = md_key ? 1 : 0;
    ops[0].data.send_initial_metadata.metadata = md_key ? &cc->md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = cc->send_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &cc->init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &cc->recv_buf;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &cc->trail_md;
    ops[5].data.recv_status_on_client.status = &cc->status;
    ops[5].data.recv_status_on_client.status_details = &cc->details;
    if (grpc_call_start_batch(cc->call, ops, 6, &cc->tag, NULL) != GRPC_CALL_OK) {
        ccall_free(cc);
        return amx_err_set(err, AMX_EINTERNAL, "cannot start a call of %s", method);
    }
    if (out)
        *out = cc;
    return AMX_OK;
}

void amx_rpc_call_cancel(amx_rpc_t *rpc, amx_ccall_t *cc)
{
    (void)rpc;
    cc->cancelled = 1;
    grpc_call_cancel(cc->call, NULL);
}

static void on_client(amx_ccall_t *cc, int ok)
{
    if (!cc->cancelled) {
        char msg[1024];
        amx_status_t st;
        uint8_t *data = NULL;
        size_t len = 0;
        if (!ok) {
            st = AMX_EINTERNAL;
            snprintf(msg, sizeof(msg), "the call could not be completed");
        } else {
            st = amx_status_from_grpc((int)cc->status);
            snprintf(msg, sizeof(msg), "%.*s", (int)GRPC_SLICE_LENGTH(cc->details),
                     (const char *)GRPC_SLICE_START_PTR(cc->details));
        }
        grpc_slice all = grpc_empty_slice();
        if (st == AMX_OK && cc->recv_buf != NULL) {
            grpc_byte_buffer_reader r;
            if (grpc_byte_buffer_reader_init(&r, cc->recv_buf)) {
                all = grpc_byte_buffer_reader_readall(&r);
                grpc_byte_buffer_reader_destroy(&r);
                data = GRPC_SLICE_START_PTR(all);
                len = GRPC_SLICE_LENGTH(all);
            }
        } else if (st == AMX_OK) {
            st = AMX_EINTERNAL;
            snprintf(msg, sizeof(msg), "the answer carried no message");
        }
        cc->cb(cc->ud, st, msg, data, len);
        grpc_slice_unref(all);
    }
    amx_rpc_t *rpc = cc->rpc;
    ccall_free(cc);
    if (rpc->stopping)
        check_stopped(rpc);
}

static void dispatch(amx_rpc_t *rpc, event_t *ev)
{
    if (ev->tag == NULL) {
        rpc->cq_done = 1;
        check_stopped(rpc);
        return;
    }
    tag_t *t = ev->tag;
    if (t->what == TAG_SHUTDOWN) {
        rpc->servers_shut++;
        check_stopped(rpc);
        return;
    }
    if (t->what == TAG_CLIENT) {
        on_client(t->obj, ev->ok);
        return;
    }
    amx_call_t *c = t->obj;
    switch (t->what) {
    case TAG_NEW:
        on_new(c, ev->ok);
        break;
    case TAG_RECV:
        on_recv(c, ev->ok);
        break;
    case TAG_SEND:
        c->send_pending = 0;
        rpc->queued -= c->queued;
        c->queued = 0;
        if (c->close_in_send)
            c->closed = 1;
        maybe_free(c);
        break;
    case TAG_CLOSE:
        c->closed = 1;
        if (c->waiter.on_cancel != NULL) {
            /* Gone while waiting at the coordinator. */
            void (*fn)(amx_waiter_t *) = c->waiter.on_cancel;
            c->waiter.on_cancel = NULL;
            fn(&c->waiter);
        } else if (c->waiter.job != NULL) {
            /* Cancelled or past its deadline while waiting in the registry. */
            rpc->serve.cancel(rpc->serve.ctx, &c->waiter);
        }
        maybe_free(c);
        break;
    }
}

static void on_wake(uv_async_t *h)
{
    amx_rpc_t *rpc = h->data;
    drain(rpc);
    pthread_mutex_lock(&rpc->mu);
    int shut = rpc->cq_shut && rpc->qlen == 0;
    rpc->cq_shut = shut ? 0 : rpc->cq_shut;
    pthread_mutex_unlock(&rpc->mu);
    if (shut) {
        event_t end = {NULL, 1};
        dispatch(rpc, &end);
    }
}

/* ---- listening ---- */

static amx_status_t check_unix_path(const char *path, int *stale, amx_err_t *err)
{
    struct sockaddr_un sa;
    *stale = 0;
    if (strlen(path) >= sizeof(sa.sun_path))
        return amx_err_set(err, AMX_EINVAL, "socket path '%s' is longer than %zu bytes", path,
                           sizeof(sa.sun_path) - 1);
    char dir[sizeof(sa.sun_path)];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash != NULL && slash != dir) {
        *slash = '\0';
        struct stat stt;
        if (stat(dir, &stt) != 0 || !S_ISDIR(stt.st_mode))
            return amx_err_set(err, AMX_EIO,
                               "cannot listen on %s: directory %s does not exist (under systemd, "
                               "RuntimeDirectory=amaxd creates it)",
                               path, dir);
    }
    struct stat stt;
    if (lstat(path, &stt) != 0)
        return AMX_OK;
    if (!S_ISSOCK(stt.st_mode))
        return amx_err_set(err, AMX_EEXIST,
                           "cannot listen on %s: a file that is not a socket is there", path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return amx_err_set(err, AMX_EIO, "socket(): %s", strerror(errno));
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
    close(fd);
    if (rc == 0)
        return amx_err_set(err, AMX_EEXIST,
                           "another process (an amaxd?) is already listening on %s", path);
    *stale = 1;
    return AMX_OK;
}

static int is_loopback(const char *hostport)
{
    char host[256];
    const char *colon = strrchr(hostport, ':');
    if (colon == NULL)
        return 0;
    size_t n = (size_t)(colon - hostport);
    if (n >= sizeof(host))
        return 0;
    memcpy(host, hostport, n);
    host[n] = '\0';
    if (strcmp(host, "localhost") == 0 || strcmp(host, "[::1]") == 0)
        return 1;
    struct in_addr a;
    if (inet_pton(AF_INET, host, &a) == 1)
        return (ntohl(a.s_addr) >> 24) == 127;
    return 0;
}

static void register_methods(amx_rpc_t *rpc, const amx_method_t *tab, size_t n)
{
    for (size_t i = 0; i < n && rpc->nmethods < MAX_METHODS; i++) {
        grpc_server *srv = tab[i].server == AMX_SERVER_PEER ? rpc->peer_server : rpc->server;
        rpc->methods[rpc->nmethods] = &tab[i];
        rpc->method_handles[rpc->nmethods] = grpc_server_register_method(
            srv, tab[i].path, NULL,
            tab[i].client_streaming ? GRPC_SRM_PAYLOAD_NONE
                                    : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER,
            0);
        rpc->nmethods++;
    }
}

static grpc_server *make_server(const amx_config_t *cfg)
{
    grpc_arg args[2];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    /* The daemon enforces max_message_bytes itself (a precise status and a
     * log line); the core's limit is only a ceiling against absurd sizes. */
    args[0].value.integer =
        cfg->max_message_bytes > INT_MAX / 2 ? INT_MAX : (int)(2 * cfg->max_message_bytes);
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = -1;
    grpc_channel_args cargs = {2, args};
    return grpc_server_create(&cargs, NULL);
}

amx_status_t amx_rpc_start(uv_loop_t *loop, const amx_config_t *cfg, const amx_rpc_serve_t *serve,
                           amx_rpc_t **out, amx_err_t *err)
{
    amx_status_t st = AMX_OK;
    int stale = 0;
    grpc_server_credentials *pcreds = serve->peer_creds; /* ours to release from here on */
    if (cfg->socket[0] == '\0' && cfg->tcp[0] == '\0')
        st = amx_err_set(err, AMX_EINVAL, "neither socket nor tcp is set: nothing to listen on");
    else if (cfg->tcp[0] != '\0' && !cfg->allow_remote && !is_loopback(cfg->tcp))
        st = amx_err_set(err, AMX_EINVAL,
                         "tcp=%s is not a loopback address; the API has no authentication, so "
                         "set allow_remote=true only on a trusted network",
                         cfg->tcp);
    else if (cfg->socket[0] != '\0')
        st = check_unix_path(cfg->socket, &stale, err);
    int serve_peer = serve->peer_methods != NULL;
    if (!serve_peer && pcreds != NULL) {
        grpc_server_credentials_release(pcreds);
        pcreds = NULL;
    }
    amx_rpc_t *rpc = st == AMX_OK ? calloc(1, sizeof(*rpc)) : NULL;
    if (st == AMX_OK && rpc == NULL)
        st = amx_err_set(err, AMX_ENOMEM, "out of memory");
    if (st != AMX_OK) {
        if (pcreds != NULL)
            grpc_server_credentials_release(pcreds);
        return st;
    }
    rpc->loop = loop;
    rpc->cfg = cfg;
    rpc->serve = *serve;
    rpc->serve.peer_creds = NULL;
    rpc->t_shutdown = (tag_t){NULL, TAG_SHUTDOWN};
    rpc->t_shutdown_peer = (tag_t){NULL, TAG_SHUTDOWN};
    pthread_mutex_init(&rpc->mu, NULL);
    pthread_mutex_init(&rpc->loop_mu, NULL);

    amx__absl_tune(); /* before gRPC takes its first mutex */
    grpc_init();
    rpc->server = make_server(cfg);
    rpc->nservers = 1;
    rpc->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(rpc->server, rpc->cq, NULL);
    if (serve_peer) {
        rpc->peer_server = make_server(cfg);
        rpc->nservers = 2;
        grpc_server_register_completion_queue(rpc->peer_server, rpc->cq, NULL);
    }
    register_methods(rpc, serve->methods, serve->nmethods);
    if (serve_peer)
        register_methods(rpc, serve->peer_methods, serve->npeer_methods);

    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    if (cfg->socket[0] != '\0') {
        if (stale) {
            AMX_WARN("rpc", "removing stale socket %s", cfg->socket);
            unlink(cfg->socket);
        }
        snprintf(rpc->unix_path, sizeof(rpc->unix_path), "%s", cfg->socket);
        if (!cfg->socket_guard) {
            /* gRPC listens itself. The socket is created with socket_mode
             * already (never wider for a moment). */
            char addr[300];
            snprintf(addr, sizeof(addr), "unix:%s", cfg->socket);
            mode_t old_mask = umask((mode_t)(~cfg->socket_mode & 0777));
            int bound = grpc_server_add_http2_port(rpc->server, addr, creds);
            umask(old_mask);
            if (bound == 0) {
                st = amx_err_set(err, AMX_EIO, "cannot listen on %s (permissions?)", addr);
                goto fail_creds;
            }
            if (chmod(cfg->socket, (mode_t)cfg->socket_mode) != 0)
                AMX_WARN("rpc", "chmod %s %llo: %s", cfg->socket,
                         (unsigned long long)cfg->socket_mode, strerror(errno));
        }
    }
    if (cfg->tcp[0] != '\0' && grpc_server_add_http2_port(rpc->server, cfg->tcp, creds) == 0) {
        st = amx_err_set(err, AMX_EIO, "cannot listen on tcp %s (address in use?)", cfg->tcp);
        goto fail_creds;
    }
    if (serve_peer) {
        const char *listen = serve->peer_listen;
        if (grpc_server_add_http2_port(rpc->peer_server, listen, pcreds) == 0) {
            st = amx_err_set(err, AMX_EIO,
                             "cannot listen for peers on %s (address in use, or not an address "
                             "of this host?)",
                             listen);
            goto fail_creds;
        }
        grpc_server_credentials_release(pcreds);
        pcreds = NULL;
    }
    grpc_server_credentials_release(creds);
    grpc_server_start(rpc->server);
    if (serve_peer)
        grpc_server_start(rpc->peer_server);

    uv_async_init(loop, &rpc->wake, on_wake);
    rpc->wake.data = rpc;
    if (rpc->unix_path[0] != '\0' && cfg->socket_guard &&
        amx_guard_start(rpc->unix_path, (unsigned)cfg->socket_mode, rpc->server, MAX_HEADER_BLOCK,
                        (uint32_t)cfg->max_connections, (uint32_t)cfg->max_connections_per_uid,
                        serve->reserved_fds, &rpc->guard, err) != AMX_OK) {
        st = err->code;
        goto fail_started;
    }
    /* The caller is the loop thread: it holds the loop lock from here on,
     * but while amx_rpc_run sleeps. */
    pthread_mutex_lock(&rpc->loop_mu);
    rpc->loop_locked = 1;
    rpc->cq_threads_live = CQ_THREADS;
    for (int i = 0; i < CQ_THREADS; i++) {
        if (pthread_create(&rpc->cq_threads[i], NULL, cq_main, rpc) != 0) {
            pthread_mutex_lock(&rpc->mu);
            rpc->cq_threads_live -= CQ_THREADS - i;
            pthread_mutex_unlock(&rpc->mu);
            if (i == 0) {
                st = amx_err_set(err, AMX_EINTERNAL, "cannot start the completion-queue thread");
                amx_guard_free(rpc->guard);
                pthread_mutex_unlock(&rpc->loop_mu);
                goto fail_started;
            }
            AMX_WARN("rpc", "only %d of %d completion-queue threads started", i, CQ_THREADS);
            break;
        }
        rpc->n_cq_threads++;
    }
    for (size_t i = 0; i < rpc->nmethods; i++)
        for (int k = 0; k < POSTED_PER_METHOD; k++)
            post_request(rpc, (int)i);
    post_request(rpc, UNKNOWN_TRAINER);
    if (serve_peer)
        post_request(rpc, UNKNOWN_PEER);
    if (rpc->unix_path[0] != '\0')
        AMX_INFO("rpc", "listening on unix:%s (mode %04llo)", rpc->unix_path,
                 (unsigned long long)cfg->socket_mode);
    if (cfg->tcp[0] != '\0')
        AMX_INFO("rpc", "listening on tcp %s", cfg->tcp);
    if (serve_peer)
        AMX_INFO("rpc", "peer service listening on %s", serve->peer_listen);
    *out = rpc;
    return AMX_OK;

fail_creds:
    if (pcreds != NULL)
        grpc_server_credentials_release(pcreds);
    grpc_server_credentials_release(creds);
    grpc_server_destroy(rpc->server);
    if (rpc->peer_server != NULL)
        grpc_server_destroy(rpc->peer_server);
    grpc_completion_queue_shutdown(rpc->cq);
    while (grpc_completion_queue_next(rpc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(rpc->cq);
    grpc_shutdown_blocking();
    pthread_mutex_destroy(&rpc->loop_mu);
    pthread_mutex_destroy(&rpc->mu);
    free(rpc);
    return st;
fail_started:
    grpc_server_shutdown_and_notify(rpc->server, rpc->cq, &rpc->t_shutdown);
    grpc_server_cancel_all_calls(rpc->server);
    if (rpc->peer_server != NULL) {
        grpc_server_shutdown_and_notify(rpc->peer_server, rpc->cq, &rpc->t_shutdown_peer);
        grpc_server_cancel_all_calls(rpc->peer_server);
    }
    grpc_completion_queue_shutdown(rpc->cq);
    while (grpc_completion_queue_next(rpc->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_server_destroy(rpc->server);
    if (rpc->peer_server != NULL)
        grpc_server_destroy(rpc->peer_server);
    grpc_completion_queue_destroy(rpc->cq);
    grpc_shutdown_blocking();
    uv_close((uv_handle_t *)&rpc->wake, NULL);
    return st; /* rpc is leaked deliberately: the async handle is closing */
}

/* ---- stopping ---- */

static void on_grace(uv_timer_t *t)
{
    amx_rpc_t *rpc = t->data;
    if (rpc->server == NULL)
        return; /* everything has ended already */
    if (amx_rpc_calls(rpc) > 0)
        AMX_WARN("rpc", "grace period over: cancelling %u calls in flight", amx_rpc_calls(rpc));
    grpc_server_cancel_all_calls(rpc->server);
    if (rpc->peer_server != NULL)
        grpc_server_cancel_all_calls(rpc->peer_server);
}

static void on_closed(uv_handle_t *h)
{
    amx_rpc_t *rpc = h->data;
    if (--rpc->grace_started == 0 && rpc->on_stopped)
        rpc->on_stopped(rpc->stopped_ud);
}

static void check_stopped(amx_rpc_t *rpc)
{
    if (rpc->servers_shut == rpc->nservers && !rpc->cq_done && rpc->server != NULL) {
        if (rpc->ccalls != NULL)
            return; /* client calls end (cancelled) before the queue shuts down */
        /* Every call is finished: the servers and the queue can go. */
        amx_guard_free(rpc->guard);
        rpc->guard = NULL;
        grpc_server_destroy(rpc->server);
        rpc->server = NULL;
        if (rpc->peer_server != NULL) {
            grpc_server_destroy(rpc->peer_server);
            rpc->peer_server = NULL;
        }
        grpc_completion_queue_shutdown(rpc->cq);
        return;
    }
    if (!rpc->cq_done)
        return;
    for (int i = 0; i < rpc->n_cq_threads; i++)
        pthread_join(rpc->cq_threads[i], NULL);
    rpc->n_cq_threads = 0;
    while (rpc->calls != NULL) {
        rpc->calls->closed = 1;
        rpc->calls->send_pending = rpc->calls->recv_pending = 0;
        call_free(rpc->calls);
    }
    grpc_completion_queue_destroy(rpc->cq);
    rpc->cq = NULL;
    if (rpc->unix_path[0] != '\0') {
        struct stat stt;
        if (lstat(rpc->unix_path, &stt) == 0 && S_ISSOCK(stt.st_mode))
            unlink(rpc->unix_path);
    }
    AMX_INFO("rpc", "server stopped");
    rpc->grace_started = 2;
    uv_timer_stop(&rpc->grace);
    uv_close((uv_handle_t *)&rpc->grace, on_closed);
    uv_close((uv_handle_t *)&rpc->wake, on_closed);
}

void amx_rpc_stop(amx_rpc_t *rpc, uint64_t grace_ms, void (*on_stopped)(void *ud), void *ud)
{
    if (rpc->stopping)
        return;
    rpc->stopping = 1;
    rpc->serve.stopping(rpc->serve.ctx);
    rpc->on_stopped = on_stopped;
    rpc->stopped_ud = ud;
    AMX_INFO("rpc", "stopping: %u calls in flight, grace %llu ms", amx_rpc_calls(rpc),
             (unsigned long long)grace_ms);
    if (rpc->guard != NULL)
        amx_guard_stop_listening(rpc->guard); /* before the server stops taking connections */
    grpc_server_shutdown_and_notify(rpc->server, rpc->cq, &rpc->t_shutdown);
    if (rpc->peer_server != NULL)
        grpc_server_shutdown_and_notify(rpc->peer_server, rpc->cq, &rpc->t_shutdown_peer);
    /* Client calls would keep the queue from shutting down. */
    for (amx_ccall_t *cc = rpc->ccalls; cc != NULL; cc = cc->next)
        grpc_call_cancel(cc->call, NULL);
    /* Calls that wait for other ranks would outlast any grace period. */
    for (amx_call_t *c = rpc->calls; c != NULL; c = c->next) {
        if (c->waiter.job != NULL) {
            rpc->serve.cancel(rpc->serve.ctx, &c->waiter);
            amx__call_reply(c, AMX_EUNAVAIL,
                            "amaxd is shutting down; the job's state is lost unless it was "
                            "snapshotted: re-join after the daemon restarts",
                            NULL);
        }
    }
    uv_timer_init(rpc->loop, &rpc->grace);
    rpc->grace.data = rpc;
    uv_timer_start(&rpc->grace, on_grace, grace_ms, 0);
}

/* The gRPC library is shut down when the daemon has stopped using it (the
 * peer channels too), by amx_rpc_free. */
/* gRPC's own shutdown, on a thread of its own: after a large answer,
 * gRPC 1.51 can leave an executor thread polling with a 10 s timeout, and
 * grpc_shutdown_blocking() joins it (a daemon that takes 10 s to stop
 * delays every restart). The server, its calls and the queue are gone by
 * now; what is left is gRPC's process-wide state, which exit() releases. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
} grpc_down_t;

static grpc_down_t g_down = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};

static void *grpc_down_main(void *arg)
{
    (void)arg;
    grpc_shutdown_blocking();
    pthread_mutex_lock(&g_down.mu);
    g_down.done = 1;
    pthread_cond_signal(&g_down.cv);
    pthread_mutex_unlock(&g_down.mu);
    return NULL;
}

#define GRPC_SHUTDOWN_WAIT_MS 1000

static void shutdown_grpc(void)
{
    pthread_t t;
    if (pthread_create(&t, NULL, grpc_down_main, NULL) != 0) {
        grpc_shutdown_blocking();
        return;
    }
    pthread_detach(t);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += GRPC_SHUTDOWN_WAIT_MS / 1000;
    pthread_mutex_lock(&g_down.mu);
    int rc = 0;
    while (!g_down.done && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&g_down.cv, &g_down.mu, &until);
    int done = g_down.done;
    pthread_mutex_unlock(&g_down.mu);
    if (!done)
        AMX_INFO("rpc",
                 "gRPC's shutdown still waits on one of its threads after %d ms; exiting without "
                 "it",
                 GRPC_SHUTDOWN_WAIT_MS);
}

void amx_rpc_free(amx_rpc_t *rpc)
{
    if (rpc == NULL)
        return;
    free(rpc->queue);
    free(rpc->spare);
    free(rpc->scratch);
    if (rpc->loop_locked)
        pthread_mutex_unlock(&rpc->loop_mu);
    pthread_mutex_destroy(&rpc->loop_mu);
    pthread_mutex_destroy(&rpc->mu);
    free(rpc);
    shutdown_grpc();
}

int amx_rpc_run(amx_rpc_t *rpc)
{
    uv_loop_t *loop = rpc->loop;
    struct pollfd p = {.fd = uv_backend_fd(loop), .events = POLLIN};
    int alive;
    while ((alive = uv_run(loop, UV_RUN_NOWAIT)) != 0) {
        drain(rpc); /* what completion-queue threads left while it was awake */
        /* The callbacks and the drain took time: the timeout is reckoned
         * from now, as uv_run(UV_RUN_DEFAULT) would, not from the start of
         * this pass (timers would fire late by the pass's length). */
        uv_update_time(loop);
        int t = uv_backend_timeout(loop);
        if (t == 0)
            continue;
        rpc->wait_until = t < 0 ? UINT64_MAX : uv_now(loop) + (uint64_t)t;
        pthread_mutex_unlock(&rpc->loop_mu);
        /* EINTR and spurious returns are harmless: uv_run looks again. An
         * event queued after the drain while the lock was held is ours. */
        if (!queued_events(rpc))
            (void)poll(&p, 1, t);
        __atomic_store_n(&rpc->loop_wants, 1, __ATOMIC_RELEASE);
        pthread_mutex_lock(&rpc->loop_mu);
        __atomic_store_n(&rpc->loop_wants, 0, __ATOMIC_RELEASE);
        rpc->wait_until = 0; /* awake: nobody needs to wake it */
    }
    return alive;
}

void amx_rpc_set_metrics(amx_rpc_t *rpc, amx_metrics_t *m)
{
    rpc->metrics = m;
}

uint32_t amx_rpc_connections(const amx_rpc_t *rpc)
{
    return amx_guard_connections(rpc->guard);
}

void amx_rpc_connection_counts(const amx_rpc_t *rpc, uint64_t *refused, uint64_t *evicted)
{
    amx_guard_counts(rpc->guard, refused, evicted);
}

uint64_t amx_rpc_activity(const amx_rpc_t *rpc)
{
    return rpc->activity;
}

void amx_rpc_trim(amx_rpc_t *rpc, size_t keep)
{
    if (rpc->scratch_cap > keep) {
        free(rpc->scratch);
        rpc->scratch = NULL;
        rpc->scratch_cap = 0;
    }
    rpc->serve.trim(rpc->serve.ctx, keep);
}

uint32_t amx_rpc_calls(const amx_rpc_t *rpc)
{
    uint32_t n = 0;
    for (const amx_call_t *c = rpc->calls; c != NULL; c = c->next)
        n += c->started;
    return n;
}
