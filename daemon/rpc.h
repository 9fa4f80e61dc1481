/*
 * rpc.h - the gRPC plumbing: the trainer server (Unix socket, optional
 * loopback TCP), the peer server (TCP, several daemons), the
 * completion-queue thread, and the loop thread's asynchronous client calls.
 *
 * Threads: "the loop thread" below means whichever thread holds the loop
 * lock: the loop thread itself while it is awake (amx_rpc_run), or a
 * completion-queue thread that handles a completion while the loop sleeps
 * (parsing, the registry, answers, client callbacks). Either way, one at a
 * time, so what the loop thread owns needs no other lock.
 */
#ifndef AMX_RPC_H
#define AMX_RPC_H

#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <protobuf-c/protobuf-c.h>
#include <uv.h>

#include "arena.h"
#include "config.h"
#include "request.h"
#include "status.h"

typedef struct amx_rpc amx_rpc_t;
typedef struct amx_call amx_call_t;

/* The handlers' context: the caller's, opaque here (the services' amx_svc_t). */
typedef struct amx_svc amx_svc_t;

/* ---- the methods a server serves ---- */

typedef void (*amx_handler_fn)(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *req);

/* A method read without protobuf-c (the packed form): `data` is the whole
 * serialized request, already checked by amx_wire_check against the
 * method's descriptor, writable, and valid during the call only. */
typedef void (*amx_raw_fn)(amx_svc_t *svc, amx_call_t *c, uint8_t *data, size_t len);

/* One message of a raw client stream; an error ends the stream. */
typedef amx_status_t (*amx_raw_stream_fn)(amx_svc_t *svc, uint8_t *data, size_t len,
                                          uint64_t *accepted, uint64_t *epoch, amx_err_t *err);

enum { AMX_SERVER_TRAINER = 0, AMX_SERVER_PEER = 1 };

typedef struct amx_method {
    const char *path; /* "/package.Service/Method" */
    const ProtobufCMessageDescriptor *request;
    amx_handler_fn handler;       /* unary methods */
    int client_streaming;         /* StreamAmax, StreamPacked: raw_stream set */
    int server;                   /* AMX_SERVER_* */
    amx_raw_fn raw;               /* unary, read without protobuf-c (handler NULL) */
    amx_raw_stream_fn raw_stream; /* client stream, read without protobuf-c */
} amx_method_t;

/* What the transport serves and whom it tells; all borrowed, outliving the
 * server. Hooks run with the loop lock held. */
typedef struct amx_rpc_serve {
    const amx_method_t *methods; /* trainer server */
    size_t nmethods;
    const amx_method_t *peer_methods; /* peer server; NULL: none */
    size_t npeer_methods;
    const char *peer_listen;             /* host:port of the peer server */
    grpc_server_credentials *peer_creds; /* taken over (released) by amx_rpc_start */
    amx_svc_t *ctx;                      /* handed to every handler and hook */
    /* The client of a call waiting in the registry went away (or the
     * server stops): withdraw the waiter. */
    void (*cancel)(amx_svc_t *ctx, amx_waiter_t *w);
    /* Idle: give back what is kept from request to request over `keep`. */
    void (*trim)(amx_svc_t *ctx, size_t keep);
    /* The server begins to stop: fail what waits outside the calls. */
    void (*stopping)(amx_svc_t *ctx);
    /* Descriptors the caller holds apart from connections (the socket
     * guard leaves them out of its budget). */
    uint32_t reserved_fds;
} amx_rpc_serve_t;

/* Creates the servers, binds the Unix socket and/or TCP address of `cfg`
 * (and the peer service's address when `serve` has peer methods), starts
 * the completion-queue threads and begins accepting calls on `loop`.
 * Borrowed arguments must outlive the server. On success the calling
 * thread holds the loop lock: it must run `loop` with amx_rpc_run, not
 * uv_run, until the server has stopped, and keeps the lock until
 * amx_rpc_free. Loop thread. */
amx_status_t amx_rpc_start(uv_loop_t *loop, const amx_config_t *cfg, const amx_rpc_serve_t *serve,
                           amx_rpc_t **out, amx_err_t *err);

/* ---- a call, for its handler (loop lock) ---- */

/* Answers a call: status (AMX_OK with `resp`, or an error with `msg`). Each
 * call is answered once; a call whose client is gone is dropped silently. */
void amx__call_reply(amx_call_t *c, amx_status_t st, const char *msg, const ProtobufCMessage *resp);

/*
 * Answers a call with an already serialized message of `len` bytes in
 * `buf`, handed to gRPC without a copy. Ownership passes to the call,
 * which gives the bytes up once sent, whatever happens: release(ud) (from
 * any thread), or free(buf) when release is NULL.
 */
void amx__call_reply_raw(amx_call_t *c, uint8_t *buf, size_t len, void (*release)(void *),
                         void *ud);

/* The waiter embedded in a call, for calls that may wait. */
amx_waiter_t *amx__call_waiter(amx_call_t *c);

/* The call whose waiter this is. */
amx_call_t *amx__waiter_call(amx_waiter_t *w);

/* An arena freed with the call: request views that must outlive the
 * handler (a deferred Register). */
amx_arena_t *amx__call_arena(amx_call_t *c);

/* The value of request metadata `key` (not NUL-terminated; *len set), or
 * NULL. */
const char *amx__call_metadata(amx_call_t *c, const char *key, size_t *len);

/* The caller's address ("ipv4:10.0.0.2:51234"), into buf. */
void amx__call_peer(amx_call_t *c, char *buf, size_t len);

/* The method path of a call. */
const char *amx__call_method(amx_call_t *c);

/*
 * Begins a graceful stop: no new calls, waiting calls fail with UNAVAILABLE,
 * client calls are cancelled, calls in flight get `grace_ms` to finish
 * before they are cancelled. When everything is closed, the socket file is
 * removed, `on_stopped(ud)` is called once on the loop thread, and the
 * server may be freed. Loop thread.
 */
void amx_rpc_stop(amx_rpc_t *rpc, uint64_t grace_ms, void (*on_stopped)(void *ud), void *ud);

/* Runs the loop like uv_run(UV_RUN_DEFAULT) until nothing is left on it,
 * letting go of the loop lock only while it sleeps; returns with the lock
 * held (uv_run's return value). Loop thread, after amx_rpc_start. */
int amx_rpc_run(amx_rpc_t *rpc);

/* Any thread: something will wake the loop within `us` microseconds (an
 * epoch's end): until then the loop thread, once awake (the caller wakes
 * it), polls its descriptor without sleeping, so that the wake-up costs no
 * scheduler latency. 0: one announced end came (the window closes when
 * every one did, or when the latest window passed). The loop lock stays
 * free meanwhile. */
void amx_rpc_expect(amx_rpc_t *rpc, uint64_t us);

/* Frees a stopped server and lets go of the loop lock. Loop thread. */
void amx_rpc_free(amx_rpc_t *rpc);

/* ---- work for the loop lock from other threads ---- */

/* fn(arg), to run under the loop lock. The tag is rpc.c's. */
typedef struct amx_rpc_task {
    struct amx_rpc_tag {
        void *obj;
        int what;
    } tag;
    void (*fn)(void *arg);
    void *arg;
} amx_rpc_task_t;

void amx_rpc_task_init(amx_rpc_task_t *t, void (*fn)(void *arg), void *arg);

/* Runs t->fn(t->arg) under the loop lock: on this thread at once when the
 * lock is free, else on the thread that holds it before it lets go (as a
 * completion-queue thread hands over a completion). Never waits for the
 * lock. `t` must stay valid until its fn has run; it may be queued again
 * before that (fn runs once per call). Any thread but the lock's holder. */
void amx_rpc_run_locked(amx_rpc_t *rpc, amx_rpc_task_t *t);

/* Runs the tasks and completions queued for the lock's holder now. Loop
 * thread, holding the lock (after amx_rpc_run returned, before
 * amx_rpc_free): what another thread queued last is not left unrun. */
void amx_rpc_run_queued(amx_rpc_t *rpc);

typedef struct amx_metrics amx_metrics_t;

/* Counts every answered call in `m` (may be NULL) by method and status
 * from now on; `m` must outlive the server. Loop thread. */
void amx_rpc_set_metrics(amx_rpc_t *rpc, amx_metrics_t *m);

/* Trainer connections on the Unix socket now (relayed by the socket guard;
 * 0 without it). Any thread. */
uint32_t amx_rpc_connections(const amx_rpc_t *rpc);

/* Unix-socket connections the socket guard refused and evicted since the
 * start (0 without it). Any thread. */
void amx_rpc_connection_counts(const amx_rpc_t *rpc, uint64_t *refused, uint64_t *evicted);

/* Calls that have started and not yet ended (posted requests not counted). */
uint32_t amx_rpc_calls(const amx_rpc_t *rpc);

/* A count that moves with every call taken and every stream message read:
 * unchanged between two looks means the daemon was idle. Loop thread. */
uint64_t amx_rpc_activity(const amx_rpc_t *rpc);

/* Frees the request buffers kept from message to message (the largest
 * message read so far, its names and updates, the last shared slab read)
 * where one is over `keep` bytes; they grow again with the next message.
 * Loop thread, when idle. */
void amx_rpc_trim(amx_rpc_t *rpc, size_t keep);

/* ---- client calls from the loop thread ---- */

typedef struct amx_ccall amx_ccall_t;

/* Called once on the loop thread: st/msg from the call's status; `data`
 * is the serialized answer (valid during the call) when st == AMX_OK. */
typedef void (*amx_ccall_cb)(void *ud, amx_status_t st, const char *msg, const uint8_t *data,
                             size_t len);

/*
 * Starts a unary call of `method` ("/pkg.Service/Method") on `ch` with the
 * serialized request `req` and one metadata pair (`md_key`, `md_val`; NULL
 * for none), ending at `deadline_ms` (CLOCK_MONOTONIC). On AMX_OK `cb` will
 * be called exactly once (unless amx_rpc_call_cancel is called first);
 * otherwise never. Loop thread.
 */
amx_status_t amx_rpc_call(amx_rpc_t *rpc, grpc_channel *ch, const char *method, const uint8_t *req,
                          size_t len, const char *md_key, const char *md_val, uint64_t deadline_ms,
                          amx_ccall_cb cb, void *ud, amx_ccall_t **out, amx_err_t *err);

/* Cancels a client call; its callback is not called. Loop thread. */
void amx_rpc_call_cancel(amx_rpc_t *rpc, amx_ccall_t *cc);

/* A gpr_timespec deadline from a CLOCK_MONOTONIC ms value. Any thread. */
gpr_timespec amx_rpc_deadline(uint64_t deadline_ms);

#endif
