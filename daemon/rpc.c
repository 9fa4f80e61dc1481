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
#include "rpc_impl.h"

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
#include "swapq.h"
#include "wire.h"

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
    event_t ev = {tag, ok};
    if (amx_swapq_push(&rpc->events, &ev) != 0) {
        /* Nothing sane remains: an event lost here would hang a call forever. */
        AMX_ERROR("rpc", "out of memory queueing a completion event; aborting");
        abort();
    }
}

static int queued_events(amx_rpc_t *rpc)
{
    return amx_swapq_pending(&rpc->events);
}

static void dispatch_item(void *ud, void *item)
{
    dispatch(ud, item);
}

/* Handles every queued event, the ones queued meanwhile too. Under the
 * loop lock. */
static void drain(amx_rpc_t *rpc)
{
    amx_swapq_drain(&rpc->events, dispatch_item, rpc);
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

static void dispatch(amx_rpc_t *rpc, event_t *ev)
{
    if (ev->tag == NULL) {
        rpc->cq_done = 1;
        amx__rpc_check_stopped(rpc);
        return;
    }
    tag_t *t = ev->tag;
    if (t->what == TAG_SHUTDOWN) {
        rpc->servers_shut++;
        amx__rpc_check_stopped(rpc);
        return;
    }
    if (t->what == TAG_CLIENT) {
        amx__rpc_on_client(t->obj, ev->ok);
        return;
    }
    if (t->what == TAG_TASK) {
        amx_rpc_task_t *k = t->obj;
        k->fn(k->arg);
        return;
    }
    amx_call_t *c = t->obj;
    switch (t->what) {
    case TAG_NEW:
        amx__rpc_on_new(c, ev->ok);
        break;
    case TAG_RECV:
        amx__rpc_on_recv(c, ev->ok);
        break;
    case TAG_SEND:
        c->send_pending = 0;
        rpc->queued -= c->queued;
        c->queued = 0;
        if (c->close_in_send)
            c->closed = 1;
        amx__rpc_maybe_free(c);
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
        amx__rpc_maybe_free(c);
        break;
    }
}

void amx_rpc_task_init(amx_rpc_task_t *t, void (*fn)(void *arg), void *arg)
{
    t->tag.obj = t;
    t->tag.what = TAG_TASK;
    t->fn = fn;
    t->arg = arg;
}

void amx_rpc_run_locked(amx_rpc_t *rpc, amx_rpc_task_t *t)
{
    push(rpc, &t->tag, 1);
    combine(rpc);
}

void amx_rpc_run_queued(amx_rpc_t *rpc)
{
    drain(rpc);
}

static void on_wake(uv_async_t *h)
{
    amx_rpc_t *rpc = h->data;
    drain(rpc);
    pthread_mutex_lock(&rpc->mu);
    int shut = rpc->cq_shut && !queued_events(rpc); /* cq_shut is set after the last push */
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
    amx_swapq_init(&rpc->events, sizeof(event_t));
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
            amx__rpc_post_request(rpc, (int)i);
    amx__rpc_post_request(rpc, UNKNOWN_TRAINER);
    if (serve_peer)
        amx__rpc_post_request(rpc, UNKNOWN_PEER);
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
    amx_swapq_destroy(&rpc->events);
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

void amx__rpc_check_stopped(amx_rpc_t *rpc)
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
        amx__rpc_call_free(rpc->calls);
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
    amx_swapq_destroy(&rpc->events);
    free(rpc->scratch);
    if (rpc->loop_locked)
        pthread_mutex_unlock(&rpc->loop_mu);
    pthread_mutex_destroy(&rpc->loop_mu);
    pthread_mutex_destroy(&rpc->mu);
    free(rpc);
    shutdown_grpc();
}

/* While amx_rpc_expect's window lasts (and no timer is due, t ms): polls
 * the loop's descriptor without sleeping, lock released, until something
 * is there. 0: no window (sleep as usual). */
static int spin(amx_rpc_t *rpc, struct pollfd *p, int t)
{
    uint64_t now = amx_now_us();
    uint64_t until = __atomic_load_n(&rpc->spin_until, __ATOMIC_ACQUIRE);
    if (until <= now)
        return 0;
    if (t >= 0 && now + (uint64_t)t * 1000 < until)
        until = now + (uint64_t)t * 1000;
    for (unsigned i = 1;; i++) {
        if (queued_events(rpc) || poll(p, 1, 0) != 0)
            return 1;
        for (int k = 0; k < 16; k++)
            amx_cpu_relax();
        if ((i & 15) == 0 && amx_now_us() >= until)
            return 1;
    }
}

void amx_rpc_expect(amx_rpc_t *rpc, uint64_t us)
{
    pthread_mutex_lock(&rpc->mu);
    if (us > 0) {
        /* Polls until the last expected end, or its window closes. */
        rpc->expecting++;
        uint64_t until = amx_now_us() + us;
        if (until > __atomic_load_n(&rpc->spin_until, __ATOMIC_RELAXED))
            __atomic_store_n(&rpc->spin_until, until, __ATOMIC_RELEASE);
    } else if (rpc->expecting > 0 && --rpc->expecting == 0) {
        __atomic_store_n(&rpc->spin_until, 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&rpc->mu);
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
        if (!queued_events(rpc) && !spin(rpc, &p, t))
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
