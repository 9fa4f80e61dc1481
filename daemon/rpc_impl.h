/*
 * rpc_impl.h - the transport's internals, shared by its files: rpc.c (the
 * loop lock, the completion-queue threads, the servers' life), rpc_call.c
 * (a server call from its acceptance to its answer) and rpc_client.c (the
 * loop's client calls). Everything here runs with the loop lock held
 * unless it says otherwise.
 */
#ifndef AMX_RPC_IMPL_H
#define AMX_RPC_IMPL_H

#include <grpc/grpc.h>
#include <pthread.h>
#include <sys/un.h>

#include "guard.h"
#include "metrics.h"
#include "rpc.h"
#include "swapq.h"

#define POSTED_PER_METHOD 8
#define MAX_METHODS 32
#define UNKNOWN_TRAINER -1
#define UNKNOWN_PEER -2
#define CQ_THREADS 4
#define MAX_HEADER_BLOCK (64 * 1024) /* bytes of one HEADERS + CONTINUATION block */

enum { TAG_NEW, TAG_RECV, TAG_SEND, TAG_CLOSE, TAG_SHUTDOWN, TAG_CLIENT, TAG_TASK };

/* obj: the amx_call_t, amx_ccall_t or amx_rpc_task_t (rpc.h). */
typedef struct amx_rpc_tag tag_t;

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
    size_t request_len;        /* its bytes on the wire */
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
    uint64_t spin_until;     /* amx_rpc_expect: CLOCK_MONOTONIC us to poll until (atomic) */
    uint32_t expecting;      /* amx_rpc_expect: ends announced and not come yet (under mu) */
    amx_swapq_t events;      /* event_t, from the CQ threads to the loop lock's holder */
    amx_call_t *calls;       /* live calls */
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

/* absl_tune.cc: Abseil's deadlock detection off (a debugging aid that
 * Debian's build leaves on in every mutex gRPC takes). Before grpc_init. */
void amx__absl_tune(void);

/* rpc_call.c: a server call. */

/* Frees a call that is closed and has no operation pending. */
void amx__rpc_call_free(amx_call_t *c);

/* Frees the call when nothing of it is pending any more. */
void amx__rpc_maybe_free(amx_call_t *c);

/* Posts one request for `method` so that a new call of it can be accepted. */
void amx__rpc_post_request(amx_rpc_t *rpc, int method);

/* A call was accepted (ok) or its request was abandoned. */
void amx__rpc_on_new(amx_call_t *c, int ok);

/* A message (or a client stream's end) was read. */
void amx__rpc_on_recv(amx_call_t *c, int ok);

/* rpc_client.c: the batch of a client call completed. */
void amx__rpc_on_client(amx_ccall_t *cc, int ok);

/* rpc.c: while stopping, ends the stop once every server, call and client
 * call is done. */
void amx__rpc_check_stopped(amx_rpc_t *rpc);

#endif
