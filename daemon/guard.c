/*
 * guard.c - the Unix socket's own listener and HTTP/2 header guard (guard.h).
 *
 * One thread with its own libuv loop. The listening socket is polled and
 * accepted by hand (at most ACCEPT_BATCH per wake-up, so that a connect
 * flood cannot starve the relay); EMFILE/ENFILE sheds the waiting connection
 * through a reserve descriptor and never stops the listener. Each client
 * gets a socketpair whose other end is given to gRPC
 * (grpc_server_add_channel_from_fd); bytes are copied both ways, with
 * back-pressure, and the client's frames are followed header by header.
 *
 * Admission. Each connection belongs to the user at the other end
 * (SO_PEERCRED) and is, at any moment, in a call (a stream the client
 * opened with a complete header block that neither side has ended yet:
 * gRPC's frames are followed too, END_STREAM or RST_STREAM ends one),
 * "fresh" (no call open and none ever answered) or "idle" (no call open,
 * at least one answered). The fresh and the idle connections of a user
 * sit in two lists, each in the order they entered it, so that the one to
 * evict is a list head: O(1) per connection, and O(users) to find the user
 * holding the most connections at the guard-wide cap.
 * A connection whose answers go by splice (below) is no longer followed
 * and counts as in a call until it closes.
 */
#define _GNU_SOURCE /* splice, pipe2, F_SETPIPE_SZ */
#include "guard.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/types.h>
#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "log.h"

#define ACCEPT_BATCH 32
#define READ_CHUNK (256u << 10) /* large answers move in few reads and writes */
#define SPARE_CHUNKS 16         /* read buffers kept for reuse (no fresh pages per read) */
#define SPLICE_PIPE (1u << 20)  /* pipe asked for by a connection in splice mode */
#define HIGH_WATER (1u << 20)   /* stop reading the other side above this */
#define LOW_WATER (256u << 10)
#define MAX_BUFFERED (256u << 20) /* all connections together: stop reading above */
#define SMALL_READ 4096           /* reads below this are moved to a buffer of their size */
#define DRAIN_MS 1000             /* at exit, how long answers may drain to slow clients */
#define FD_RESERVE 128            /* descriptors left for gRPC, logs, peers */
#define H2_PREFACE_LEN 24
#define MAX_TRACKED 1024 /* streams followed per connection; more: it counts as in a call */
#define PEER_BUCKETS 64  /* hash buckets of the per-user table */
#define LOG_EVERY_MS 1000

enum { H2_DATA = 0, H2_HEADERS = 1, H2_RST_STREAM = 3, H2_PUSH_PROMISE = 5, H2_CONTINUATION = 9 };
enum { H2_END_STREAM = 0x1, H2_END_HEADERS = 0x4 };

/* Where a connection stands for eviction: the two lists it may be in. */
enum { TIER_NONE = -1, TIER_FRESH = 0, TIER_IDLE = 1, NTIERS = 2 };

struct conn;

typedef struct tlist {
    struct conn *head, *tail; /* head: the one that entered first */
} tlist_t;

/* The connections of one user (peer uid). */
typedef struct peer {
    uid_t uid;
    uint32_t n; /* its connections, closing ones not counted */
    tlist_t tiers[NTIERS];
    struct peer *next; /* hash chain */
} peer_t;

typedef struct conn {
    uv_pipe_t cl, gr; /* the client's connection, our end of gRPC's socketpair */
    uv_shutdown_t shut;
    struct amx_guard *g;
    int closing, closed, paused_cl, paused_gr, shutting, shut_started;
    int nhandles; /* handles conn_close closes (2, or more in splice mode) */
    /* Splice mode, taken once gRPC writes a large answer (a full read):
     * gRPC's bytes go to the client through a pipe with splice(2), moved
     * as pages instead of copied twice. The client's bytes still go the
     * copying way (they are inspected). sp_in/sp_out poll duplicates of
     * gr's and cl's descriptors (libuv keeps one handle per descriptor). */
    int sp, sp_in_init, sp_out_init, sp_in_on, sp_out_on, sp_eof;
    int sp_rd, sp_wr, sp_in_fd, sp_out_fd;
    size_t sp_room, inpipe;
    uv_poll_t sp_in, sp_out;
    uint32_t preface_left, payload_left, block;
    uint8_t hdr[9];
    int hdr_have;
    /* Calls: the client's streams open now (a complete header block seen,
     * not ended by either side), followed from both sides' frame headers;
     * gRPC's frames are followed while not in splice mode. */
    uint32_t hsid;    /* stream of the header block being read (0: none) */
    uint32_t max_sid; /* highest stream the client opened */
    uint32_t *open, nopen, capopen;
    int answered; /* gRPC has ended a call on it (END_STREAM) */
    int opaque;   /* calls no longer followed (splice mode): never evicted */
    uint32_t s_payload_left;
    uint8_t s_hdr[9];
    int s_hdr_have;
    /* Admission (guard.h). */
    peer_t *peer; /* NULL once closing */
    int tier;
    uint64_t since, born;       /* loop ms: entered its tier, accepted */
    struct conn *tprev, *tnext; /* in its user's list of its tier */
    struct conn *prev, *next;
} conn_t;

typedef struct wreq {
    uv_write_t req;
    char *base;
    size_t len;
    int chunk; /* base is a READ_CHUNK buffer of on_alloc */
} wreq_t;

struct amx_guard {
    uv_loop_t loop;
    uv_poll_t lpoll;
    uv_timer_t retry;
    uv_async_t wake;
    uv_timer_t drain;
    pthread_t thread;
    pthread_mutex_t mu;
    int lfd, reserve, stop_listen, exit, listening, exiting;
    grpc_server *server;
    grpc_server_credentials *creds;
    size_t max_header_block;
    uint32_t nconn, max_conn, max_per_uid; /* nconn: connections not closing */
    uint64_t buffered;                     /* bytes read and not yet written on, all connections */
    uint64_t accepted, shed, killed, evicted, last_shed_log, last_kill_log, last_evict_log;
    conn_t *conns;
    peer_t *peers[PEER_BUCKETS];
    char *spare[SPARE_CHUNKS]; /* free READ_CHUNK buffers */
    int nspare;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

/* ---- admission: users, calls, tiers ---- */

static void set_tier(conn_t *c, int tier)
{
    if (c->tier == tier)
        return;
    if (c->tier != TIER_NONE) {
        tlist_t *l = &c->peer->tiers[c->tier];
        if (c->tprev)
            c->tprev->tnext = c->tnext;
        else
            l->head = c->tnext;
        if (c->tnext)
            c->tnext->tprev = c->tprev;
        else
            l->tail = c->tprev;
        c->tprev = c->tnext = NULL;
    }
    c->tier = tier;
    if (tier != TIER_NONE) {
        tlist_t *l = &c->peer->tiers[tier];
        c->since = uv_now(&c->g->loop);
        c->tprev = l->tail;
        c->tnext = NULL;
        if (l->tail)
            l->tail->tnext = c;
        else
            l->head = c;
        l->tail = c;
    }
}

/* Puts `c` in the list its calls say (none while one is open). */
static void retier(conn_t *c)
{
    if (c->peer == NULL)
        return; /* closing */
    set_tier(c, c->opaque || c->nopen > 0 ? TIER_NONE : c->answered ? TIER_IDLE : TIER_FRESH);
}

/* The client opened stream `sid` (its header block is complete). */
static void stream_open(conn_t *c, uint32_t sid)
{
    if ((sid & 1) == 0 || sid <= c->max_sid)
        return; /* not a new stream of the client's: trailers, or gRPC refuses it */
    c->max_sid = sid;
    if (c->nopen == c->capopen) {
        uint32_t cap = c->capopen ? 2 * c->capopen : 4;
        uint32_t *p = cap <= MAX_TRACKED ? realloc(c->open, cap * sizeof(*p)) : NULL;
        if (p == NULL) {
            c->opaque = 1; /* cannot follow it: take it as in a call */
            return;
        }
        c->open = p, c->capopen = cap;
    }
    c->open[c->nopen++] = sid;
}

/* Stream `sid` ended; 1 if it was open. */
static int stream_end(conn_t *c, uint32_t sid)
{
    for (uint32_t i = 0; i < c->nopen; i++)
        if (c->open[i] == sid) {
            c->open[i] = c->open[--c->nopen];
            return 1;
        }
    return 0;
}

static uint32_t frame_sid(const uint8_t *hdr)
{
    return ((uint32_t)hdr[5] << 24 | (uint32_t)hdr[6] << 16 | (uint32_t)hdr[7] << 8 | hdr[8]) &
           0x7fffffffu;
}

/* Follows gRPC's frames to `c`'s client: the end of each call. */
static void follow_server(conn_t *c, const uint8_t *p, size_t n)
{
    while (n > 0 && !c->opaque) {
        if (c->s_payload_left > 0) {
            size_t k = n < c->s_payload_left ? n : c->s_payload_left;
            c->s_payload_left -= (uint32_t)k;
            p += k;
            n -= k;
            continue;
        }
        c->s_hdr[c->s_hdr_have++] = *p++;
        n--;
        if (c->s_hdr_have < 9)
            continue;
        c->s_hdr_have = 0;
        const uint8_t *h = c->s_hdr;
        c->s_payload_left = (uint32_t)h[0] << 16 | (uint32_t)h[1] << 8 | h[2];
        if ((h[3] == H2_HEADERS || h[3] == H2_DATA) && (h[4] & H2_END_STREAM)) {
            if (stream_end(c, frame_sid(h)))
                c->answered = 1;
        } else if (h[3] == H2_RST_STREAM) {
            stream_end(c, frame_sid(h));
        }
    }
}

static peer_t *peer_find(amx_guard_t *g, uid_t uid)
{
    peer_t *u = g->peers[uid % PEER_BUCKETS];
    while (u != NULL && u->uid != uid)
        u = u->next;
    return u;
}

/* The entry of `uid`, made when it has none; NULL when out of memory. */
static peer_t *peer_get(amx_guard_t *g, uid_t uid)
{
    peer_t *u = peer_find(g, uid);
    if (u == NULL && (u = calloc(1, sizeof(*u))) != NULL) {
        u->uid = uid;
        u->next = g->peers[uid % PEER_BUCKETS];
        g->peers[uid % PEER_BUCKETS] = u;
    }
    return u;
}

/* Frees `u` once it has no connection. */
static void peer_put(amx_guard_t *g, peer_t *u)
{
    if (u->n > 0)
        return;
    peer_t **pp = &g->peers[u->uid % PEER_BUCKETS];
    while (*pp != u)
        pp = &(*pp)->next;
    *pp = u->next;
    free(u);
}

/* Takes `c` out of the admission counts and lists (it is closing). */
static void untrack(conn_t *c)
{
    amx_guard_t *g = c->g;
    if (c->peer == NULL)
        return;
    set_tier(c, TIER_NONE);
    c->peer->n--;
    peer_put(g, c->peer);
    c->peer = NULL;
    __atomic_sub_fetch(&g->nconn, 1, __ATOMIC_RELAXED);
}

/* ---- relay ---- */

static void conn_closed(uv_handle_t *h)
{
    conn_t *c = h->data;
    if (++c->closed < c->nhandles)
        return;
    amx_guard_t *g = c->g;
    if (c->sp) {
        close(c->sp_rd);
        close(c->sp_wr);
    }
    if (c->sp_in_init)
        close(c->sp_in_fd);
    if (c->sp_out_init)
        close(c->sp_out_fd);
    if (c->prev)
        c->prev->next = c->next;
    else
        g->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    free(c->open);
    free(c);
    /* Exiting and every connection has drained: the loop may end. */
    if (g->exiting && g->conns == NULL && !uv_is_closing((uv_handle_t *)&g->drain))
        uv_close((uv_handle_t *)&g->drain, NULL);
}

static void conn_close(conn_t *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    untrack(c); /* its descriptors close now (uv_close), its place is free */
    uv_close((uv_handle_t *)&c->cl, conn_closed);
    uv_close((uv_handle_t *)&c->gr, conn_closed);
    if (c->sp_in_init)
        uv_close((uv_handle_t *)&c->sp_in, conn_closed);
    if (c->sp_out_init)
        uv_close((uv_handle_t *)&c->sp_out, conn_closed);
}

/* Follows the client's frames (the streams it opens and resets); -1 when
 * a header block exceeds the cap. */
static int inspect(conn_t *c, const uint8_t *p, size_t n)
{
    size_t max = c->g->max_header_block;
    while (n > 0) {
        if (c->preface_left > 0 || c->payload_left > 0) {
            uint32_t *left = c->preface_left > 0 ? &c->preface_left : &c->payload_left;
            size_t k = n < *left ? n : *left;
            *left -= (uint32_t)k;
            p += k;
            n -= k;
            continue;
        }
        c->hdr[c->hdr_have++] = *p++;
        n--;
        if (c->hdr_have < 9)
            continue;
        c->hdr_have = 0;
        uint32_t len = (uint32_t)c->hdr[0] << 16 | (uint32_t)c->hdr[1] << 8 | c->hdr[2];
        uint8_t type = c->hdr[3], flags = c->hdr[4];
        c->payload_left = len;
        /* A block is HEADERS (or PUSH_PROMISE) and the CONTINUATION frames
         * after it; whatever else comes in between, gRPC refuses itself. A
         * call starts once its block is complete (END_HEADERS). */
        if (type == H2_HEADERS || type == H2_PUSH_PROMISE) {
            c->block = len;
            c->hsid = type == H2_HEADERS ? frame_sid(c->hdr) : 0;
        } else if (type == H2_CONTINUATION) {
            c->block += len;
        } else {
            if (type == H2_RST_STREAM)
                stream_end(c, frame_sid(c->hdr));
            continue;
        }
        if (c->block > max)
            return -1;
        if ((flags & H2_END_HEADERS) && c->hsid != 0) {
            stream_open(c, c->hsid);
            c->hsid = 0;
        }
    }
    return 0;
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    amx_guard_t *g = ((conn_t *)h->data)->g;
    (void)hint;
    buf->base = g->nspare > 0 ? g->spare[--g->nspare] : malloc(READ_CHUNK);
    buf->len = buf->base ? READ_CHUNK : 0;
}

/* Gives up a buffer of on_alloc (is_chunk) or a small copy. */
static void put_buf(amx_guard_t *g, char *p, int is_chunk)
{
    if (p != NULL && is_chunk && g->nspare < SPARE_CHUNKS)
        g->spare[g->nspare++] = p;
    else
        free(p);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

/* Reads again on either side of `c` that was paused and whose destination
 * queue is short, unless the guard as a whole holds too much. */
static void resume(conn_t *c)
{
    if (c->closing || c->g->buffered > MAX_BUFFERED)
        return;
    if (c->paused_cl && uv_stream_get_write_queue_size((uv_stream_t *)&c->gr) < LOW_WATER) {
        c->paused_cl = 0;
        uv_read_start((uv_stream_t *)&c->cl, on_alloc, on_read);
    }
    if (c->paused_gr && !c->shutting && !c->sp &&
        uv_stream_get_write_queue_size((uv_stream_t *)&c->cl) < LOW_WATER) {
        c->paused_gr = 0;
        uv_read_start((uv_stream_t *)&c->gr, on_alloc, on_read);
    }
}

static void on_shut(uv_shutdown_t *req, int status)
{
    (void)status;
    conn_close((conn_t *)req->data);
}

/* Ends the client's side once every byte for it has been written. */
static void start_shutdown(conn_t *c)
{
    if (c->shut_started || c->closing)
        return;
    c->shut_started = 1;
    c->shut.data = c;
    if (uv_shutdown(&c->shut, (uv_stream_t *)&c->cl, on_shut) != 0)
        conn_close(c);
}

static void sp_pump(conn_t *c);

/* gRPC ended the connection (or the guard stops): what gRPC wrote still
 * goes to the client, then the connection closes, so that a slow reader
 * gets its last answer. */
static void drain_and_close(conn_t *c)
{
    if (c->closing || c->shutting)
        return;
    c->shutting = 1;
    uv_read_stop((uv_stream_t *)&c->gr);
    uv_read_stop((uv_stream_t *)&c->cl);
    if (c->sp) {
        sp_pump(c); /* shuts down once the pipe is empty */
        return;
    }
    start_shutdown(c);
}

/* ---- splice mode ---- */

static void set_poll(uv_poll_t *h, int *on, int want, int events, uv_poll_cb cb)
{
    if (want && !*on)
        *on = uv_poll_start(h, events, cb) == 0;
    else if (!want && *on) {
        uv_poll_stop(h);
        *on = 0;
    }
}

static void on_sp(uv_poll_t *h, int status, int events)
{
    conn_t *c = h->data;
    (void)events;
    if (c->closing)
        return;
    if (status < 0) {
        conn_close(c);
        return;
    }
    sp_pump(c);
}

/* Moves gRPC's bytes into the pipe and the pipe's to the client, as far
 * as each side takes them; then waits for whichever side can go on. */
static void sp_pump(conn_t *c)
{
    if (c->closing)
        return;
    uv_stream_t *cl = (uv_stream_t *)&c->cl;
    for (;;) {
        int moved = 0;
        if (!c->sp_eof && !c->shutting && c->inpipe < c->sp_room) {
            ssize_t n = splice(c->sp_in_fd, NULL, c->sp_wr, NULL, c->sp_room - c->inpipe,
                               SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
            if (n > 0)
                c->inpipe += (size_t)n, moved = 1;
            else if (n == 0 || (errno != EAGAIN && errno != EINTR))
                c->sp_eof = 1; /* gRPC is done with the connection */
        }
        /* Bytes the copying path queued for the client before go first. */
        if (c->inpipe > 0 && uv_stream_get_write_queue_size(cl) == 0) {
            ssize_t n = splice(c->sp_rd, NULL, c->sp_out_fd, NULL, c->inpipe,
                               SPLICE_F_MOVE | SPLICE_F_NONBLOCK);
            if (n > 0) {
                c->inpipe -= (size_t)n, moved = 1;
            } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
                conn_close(c); /* the client is gone */
                return;
            }
        }
        if (!moved)
            break;
    }
    set_poll(&c->sp_in, &c->sp_in_on, !c->sp_eof && !c->shutting && c->inpipe < c->sp_room,
             UV_READABLE, on_sp);
    set_poll(&c->sp_out, &c->sp_out_on, c->inpipe > 0 && uv_stream_get_write_queue_size(cl) == 0,
             UV_WRITABLE, on_sp);
    if (c->inpipe == 0 && c->shutting)
        start_shutdown(c);
    else if (c->inpipe == 0 && c->sp_eof)
        drain_and_close(c);
}

/* Takes splice mode for connection c (reading gRPC's side through libuv
 * stops); stays in the copying mode when a descriptor or the pipe cannot
 * be had (the descriptor limit is near: the copying mode needs none). */
static void sp_start(conn_t *c)
{
    amx_guard_t *g = c->g;
    uv_os_fd_t gfd, cfd;
    int p[2];
    if (c->sp || c->closing || c->shutting || uv_fileno((uv_handle_t *)&c->gr, &gfd) != 0 ||
        uv_fileno((uv_handle_t *)&c->cl, &cfd) != 0 || c->sp_in_init || c->sp_out_init)
        return;
    if (pipe2(p, O_NONBLOCK | O_CLOEXEC) != 0)
        return;
    int in = fcntl(gfd, F_DUPFD_CLOEXEC, 0), out = in >= 0 ? fcntl(cfd, F_DUPFD_CLOEXEC, 0) : -1;
    if (in < 0 || out < 0 || uv_poll_init(&g->loop, &c->sp_in, in) != 0) {
        close(p[0]), close(p[1]);
        if (in >= 0)
            close(in);
        if (out >= 0)
            close(out);
        return;
    }
    c->sp_in_init = 1, c->sp_in_fd = in, c->nhandles++;
    c->sp_in.data = c;
    if (uv_poll_init(&g->loop, &c->sp_out, out) != 0) {
        close(out), close(p[0]), close(p[1]);
        return; /* sp_in is closed with the connection */
    }
    c->sp_out_init = 1, c->sp_out_fd = out, c->nhandles++;
    c->sp_out.data = c;
    fcntl(p[1], F_SETPIPE_SZ, (int)SPLICE_PIPE); /* a smaller pipe works too */
    int room = fcntl(p[1], F_GETPIPE_SZ);
    c->sp_room = room > 0 ? (size_t)room : 65536;
    c->sp_rd = p[0], c->sp_wr = p[1];
    c->sp = 1;
    c->opaque = 1; /* gRPC's frames go by unread: its calls are not followed any more */
    retier(c);
    uv_read_stop((uv_stream_t *)&c->gr);
    c->paused_gr = 0;
    sp_pump(c);
}

static void on_written(uv_write_t *req, int status)
{
    wreq_t *w = (wreq_t *)req;
    conn_t *c = req->handle->data;
    amx_guard_t *g = c->g;
    uv_stream_t *dst = req->handle;
    int was_over = g->buffered > MAX_BUFFERED;
    g->buffered -= w->len;
    put_buf(g, w->base, w->chunk);
    free(w);
    if (c->closing)
        return;
    if (status < 0) {
        conn_close(c);
        return;
    }
    if (c->sp && dst == (uv_stream_t *)&c->cl) {
        sp_pump(c); /* the client's queue may have emptied: the pipe goes on */
        if (c->closing)
            return;
    }
    if (was_over && g->buffered <= MAX_BUFFERED) {
        /* Below the guard-wide limit again: every paused connection whose
         * own queue allows it reads again. */
        for (conn_t *o = g->conns; o != NULL; o = o->next)
            resume(o);
        return;
    }
    resume(c);
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    conn_t *c = s->data;
    int from_client = s == (uv_stream_t *)&c->cl;
    if (nread <= 0 || c->closing || c->shutting) {
        put_buf(c->g, buf->base, 1);
        if (nread < 0 && !from_client)
            drain_and_close(c); /* gRPC is done: let its last bytes reach the client */
        else if (nread < 0)
            conn_close(c); /* the client is gone */
        return;
    }
    if (from_client && inspect(c, (const uint8_t *)buf->base, (size_t)nread) != 0) {
        amx_guard_t *g = c->g;
        uint64_t now = uv_now(&g->loop);
        if (g->killed++ == 0 || now - g->last_kill_log >= 1000) {
            g->last_kill_log = now;
            AMX_WARN("guard",
                     "closing a connection whose HTTP/2 header block exceeds %zu bytes (%llu "
                     "closed so far)",
                     g->max_header_block, (unsigned long long)g->killed);
        }
        put_buf(g, buf->base, 1);
        conn_close(c);
        return;
    }
    if (!from_client)
        follow_server(c, (const uint8_t *)buf->base, (size_t)nread);
    retier(c); /* a call may have started or ended */
    uv_stream_t *dst = from_client ? (uv_stream_t *)&c->gr : (uv_stream_t *)&c->cl;
    wreq_t *w = malloc(sizeof(*w));
    if (w == NULL) {
        put_buf(c->g, buf->base, 1);
        conn_close(c);
        return;
    }
    /* A small read does not keep a whole read buffer alive while it waits
     * to be written (many small answers to a client that does not read). */
    char *data = buf->base;
    w->chunk = 1;
    if (nread < SMALL_READ) {
        char *small = malloc((size_t)nread);
        if (small != NULL) {
            memcpy(small, data, (size_t)nread);
            put_buf(c->g, data, 1);
            data = small;
            w->chunk = 0;
        }
    }
    w->base = data;
    w->len = (size_t)nread;
    amx_guard_t *g = c->g;
    g->buffered += w->len;
    uv_buf_t b = uv_buf_init(data, (unsigned)nread);
    if (uv_write(&w->req, dst, &b, 1, on_written) != 0) {
        g->buffered -= w->len;
        put_buf(g, w->base, w->chunk);
        free(w);
        conn_close(c);
        return;
    }
    if (uv_stream_get_write_queue_size(dst) > HIGH_WATER || g->buffered > MAX_BUFFERED) {
        uv_read_stop(s);
        *(from_client ? &c->paused_cl : &c->paused_gr) = 1;
    }
    if (!from_client && nread == READ_CHUNK)
        sp_start(c); /* a large answer: the rest of this one and later ones without copies */
}

/* ---- accepting ---- */

static void shed(amx_guard_t *g, int fd, const char *why)
{
    if (fd >= 0)
        close(fd);
    uint64_t shed = __atomic_add_fetch(&g->shed, 1, __ATOMIC_RELAXED);
    uint64_t now = uv_now(&g->loop);
    if (g->last_shed_log == 0 || now - g->last_shed_log >= LOG_EVERY_MS) {
        g->last_shed_log = now;
        AMX_WARN("guard", "refusing connections: %s (%llu refused so far, %u open)", why,
                 (unsigned long long)shed, g->nconn);
    }
}

/* The connection of user `u` to close for a new one: the fresh one that
 * came first, else the one idle longest; NULL when each is in a call. */
static conn_t *victim(const peer_t *u)
{
    return u->tiers[TIER_FRESH].head != NULL ? u->tiers[TIER_FRESH].head : u->tiers[TIER_IDLE].head;
}

/* At the guard-wide cap: the victim of the user who holds the most
 * connections and has one to give (on a tie, a fresh one before an idle
 * one, then the one that entered its list first); NULL when every
 * connection is in a call. A user under its own cap thus takes from the
 * largest holder, never from a user who holds fewer. */
static conn_t *largest_victim(amx_guard_t *g)
{
    conn_t *best = NULL;
    for (int i = 0; i < PEER_BUCKETS; i++)
        for (peer_t *u = g->peers[i]; u != NULL; u = u->next) {
            conn_t *v = victim(u);
            if (v == NULL)
                continue;
            if (best == NULL || u->n > best->peer->n ||
                (u->n == best->peer->n &&
                 (v->tier < best->tier || (v->tier == best->tier && v->since < best->since))))
                best = v;
        }
    return best;
}

/* Closes `v` so that a connection of user `uid` gets its place (`limit`
 * names the cap that was reached), with a log line at most every second. */
static void evict(amx_guard_t *g, conn_t *v, uid_t uid, const char *limit, uint32_t value)
{
    uint64_t n = __atomic_add_fetch(&g->evicted, 1, __ATOMIC_RELAXED);
    uint64_t now = uv_now(&g->loop);
    if (g->last_evict_log == 0 || now - g->last_evict_log >= LOG_EVERY_MS) {
        g->last_evict_log = now;
        char what[96];
        if (v->tier == TIER_FRESH)
            snprintf(what, sizeof(what), "open %.1f s, never completed a call",
                     (double)(now - v->born) / 1000.0);
        else
            snprintf(what, sizeof(what), "idle %.1f s since its last call",
                     (double)(now - v->since) / 1000.0);
        AMX_WARN("guard",
                 "%s=%u reached: evicting the oldest idle connection (user %u, %s) for a new "
                 "one of user %u (%llu evicted so far, %u open)",
                 limit, value, (unsigned)v->peer->uid, what, (unsigned)uid, (unsigned long long)n,
                 g->nconn);
    }
    conn_close(v);
}

/* The uid of the process at the other end of `fd` ((uid_t)-1 if unknown). */
static uid_t peer_uid(int fd)
{
    struct ucred cr;
    socklen_t len = sizeof(cr);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 || len != sizeof(cr))
        return (uid_t)-1;
    return cr.uid;
}

/* Gives `fd` to the server unless stop_listening has run. */
static int give(amx_guard_t *g, int fd)
{
    pthread_mutex_lock(&g->mu);
    int ok = !g->stop_listen;
    if (ok)
        grpc_server_add_channel_from_fd(g->server, fd, g->creds);
    pthread_mutex_unlock(&g->mu);
    if (!ok)
        close(fd);
    return ok;
}

/* Admits connection `fd` (guard.h): past its user's cap, the oldest fresh
 * connection (else the one idle longest) of that user makes room; past the
 * guard's, one of the user holding the most connections; when each of
 * those is in a call, `fd` is refused. */
static void take(amx_guard_t *g, int fd)
{
    g->accepted++;
    uid_t uid = peer_uid(fd);
    peer_t *u = peer_find(g, uid);
    conn_t *v = NULL;
    const char *limit = NULL;
    uint32_t value = 0;
    if (u != NULL && u->n >= g->max_per_uid) {
        /* The per-user cap is the guard's own when nothing made it lower. */
        limit = g->max_per_uid < g->max_conn ? "max_connections_per_uid" : "max_connections";
        value = g->max_per_uid;
        if ((v = victim(u)) == NULL) {
            char why[128];
            snprintf(why, sizeof(why), "user %u holds %u connections, each in a call (%s=%u)",
                     (unsigned)uid, u->n, limit, value);
            shed(g, fd, why);
            return;
        }
    } else if (g->nconn >= g->max_conn) {
        limit = "max_connections", value = g->max_conn;
        if ((v = largest_victim(g)) == NULL) {
            shed(g, fd, "connection limit reached, each connection in a call");
            return;
        }
    }
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) != 0) {
        shed(g, fd, strerror(errno));
        return;
    }
    conn_t *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        close(sv[0]);
        close(sv[1]);
        shed(g, fd, "out of memory");
        return;
    }
    if (v != NULL)
        evict(g, v, uid, limit, value); /* may free u */
    if ((u = peer_get(g, uid)) == NULL) {
        close(sv[0]);
        close(sv[1]);
        free(c);
        shed(g, fd, "out of memory");
        return;
    }
    c->g = g;
    c->nhandles = 2;
    c->preface_left = H2_PREFACE_LEN;
    uv_pipe_init(&g->loop, &c->cl, 0);
    uv_pipe_init(&g->loop, &c->gr, 0);
    c->cl.data = c->gr.data = c;
    c->next = g->conns;
    if (g->conns)
        g->conns->prev = c;
    g->conns = c;
    __atomic_add_fetch(&g->nconn, 1, __ATOMIC_RELAXED);
    c->peer = u;
    u->n++;
    c->tier = TIER_NONE;
    c->born = uv_now(&g->loop);
    set_tier(c, TIER_FRESH);
    int bad = 0;
    if (uv_pipe_open(&c->cl, fd) != 0) /* an open handle closes its descriptor */
        close(fd), bad = 1;
    if (uv_pipe_open(&c->gr, sv[0]) != 0)
        close(sv[0]), bad = 1;
    if (bad) {
        close(sv[1]);
        conn_close(c);
        return;
    }
    if (!give(g, sv[1])) {
        conn_close(c);
        return;
    }
    uv_read_start((uv_stream_t *)&c->cl, on_alloc, on_read);
    uv_read_start((uv_stream_t *)&c->gr, on_alloc, on_read);
}

static void on_listen(uv_poll_t *p, int status, int events);

static void on_retry(uv_timer_t *t)
{
    amx_guard_t *g = t->data;
    if (g->listening)
        uv_poll_start(&g->lpoll, UV_READABLE, on_listen);
}

static void pause_accepting(amx_guard_t *g, uint64_t ms)
{
    uv_poll_stop(&g->lpoll);
    uv_timer_start(&g->retry, on_retry, ms, 0);
}

static void on_listen(uv_poll_t *p, int status, int events)
{
    amx_guard_t *g = p->data;
    (void)events;
    if (status < 0) {
        AMX_ERROR("guard", "polling the listening socket: %s; retrying in 1 s",
                  uv_strerror(status));
        pause_accepting(g, 1000);
        return;
    }
    for (int i = 0; i < ACCEPT_BATCH; i++) {
        int fd = accept4(g->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            take(g, fd);
            continue;
        }
        switch (errno) {
        case EAGAIN:
#if EWOULDBLOCK != EAGAIN
        case EWOULDBLOCK:
#endif
            return;
        case EINTR:
        case ECONNABORTED:
        case EPROTO:
        case EPERM:
            continue;
        case EMFILE:
        case ENFILE:
            /* Out of descriptors: take the waiting connection with the
             * reserve one and close it, so that its client gets an answer
             * (EOF) instead of hanging in the backlog, and go on listening. */
            if (g->reserve >= 0) {
                close(g->reserve);
                g->reserve = -1;
                int f = accept4(g->lfd, NULL, NULL, SOCK_CLOEXEC);
                shed(g, f, "out of file descriptors"); /* closes f: its slot is the reserve's */
                g->reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
                if (f >= 0 && g->reserve >= 0)
                    continue;
            } else {
                g->reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
                shed(g, -1, "out of file descriptors");
            }
            pause_accepting(g, 100);
            return;
        default:
            AMX_ERROR("guard", "accept: %s; retrying in 100 ms", strerror(errno));
            pause_accepting(g, 100);
            return;
        }
    }
}

/* ---- thread and control ---- */

static void on_listener_closed(uv_handle_t *h)
{
    amx_guard_t *g = h->data;
    close(g->lfd); /* only now: the loop no longer watches the descriptor */
    g->lfd = -1;
}

static void close_listener(amx_guard_t *g)
{
    if (!g->listening)
        return;
    g->listening = 0;
    uv_close((uv_handle_t *)&g->retry, NULL);
    uv_close((uv_handle_t *)&g->lpoll, on_listener_closed);
}

static void on_drained(uv_timer_t *t)
{
    amx_guard_t *g = t->data;
    for (conn_t *c = g->conns; c != NULL; c = c->next)
        conn_close(c);
    if (!uv_is_closing((uv_handle_t *)&g->drain))
        uv_close((uv_handle_t *)&g->drain, NULL);
}

static void on_wake(uv_async_t *a)
{
    amx_guard_t *g = a->data;
    pthread_mutex_lock(&g->mu);
    int stop = g->stop_listen, ex = g->exit;
    pthread_mutex_unlock(&g->mu);
    if (stop)
        close_listener(g);
    if (ex && !g->exiting) {
        g->exiting = 1;
        /* Answers gRPC has written still go to their clients, for at most
         * DRAIN_MS; then every connection closes. */
        for (conn_t *c = g->conns; c != NULL; c = c->next)
            drain_and_close(c);
        uv_close((uv_handle_t *)&g->wake, NULL);
        if (g->conns != NULL)
            uv_timer_start(&g->drain, on_drained, DRAIN_MS, 0);
        else
            uv_close((uv_handle_t *)&g->drain, NULL);
    }
}

static void *guard_main(void *arg)
{
    amx_guard_t *g = arg;
    uv_run(&g->loop, UV_RUN_DEFAULT);
    return NULL;
}

amx_status_t amx_guard_start(const char *path, unsigned mode, grpc_server *server,
                             size_t max_header_block, uint32_t max_connections,
                             uint32_t max_per_uid, uint32_t reserved_fds, amx_guard_t **out,
                             amx_err_t *err)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa.sun_path))
        return amx_err_set(err, AMX_EINVAL, "socket path '%s' is too long", path);
    memcpy(sa.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return amx_err_set(err, AMX_EIO, "socket(): %s", strerror(errno));
    /* Created with `mode` already (never wider for a moment); the chmod
     * only corrects an unusual umask. */
    mode_t old_mask = umask((mode_t)(~mode & 0777));
    int rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    int bind_errno = errno;
    umask(old_mask);
    if (rc != 0 || listen(fd, 4096) != 0) {
        amx_err_set(err, AMX_EIO, "cannot listen on unix:%s: %s (permissions?)", path,
                    strerror(rc != 0 ? bind_errno : errno));
        if (rc == 0)
            unlink(path);
        close(fd);
        return err->code;
    }
    if (chmod(path, (mode_t)mode) != 0)
        AMX_WARN("guard", "chmod %s %o: %s", path, mode, strerror(errno));
    amx_guard_t *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        close(fd);
        unlink(path);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    g->lfd = fd;
    memcpy(g->path, path, strlen(path) + 1);
    g->server = server;
    g->creds = grpc_insecure_server_credentials_create();
    g->max_header_block = max_header_block;
    g->reserve = open("/dev/null", O_RDONLY | O_CLOEXEC);
    struct rlimit rl;
    rlim_t soft = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? rl.rlim_cur : 1024;
    if (soft == RLIM_INFINITY || soft > (rlim_t)3 * UINT32_MAX)
        soft = (rlim_t)3 * UINT32_MAX;
    /* A relayed connection costs three descriptors. */
    rlim_t keep = FD_RESERVE + (rlim_t)reserved_fds;
    g->max_conn = soft > keep + 3 * 16 ? (uint32_t)((soft - keep) / 3) : 16;
    if (max_connections > 0 && g->max_conn > max_connections)
        g->max_conn = max_connections;
    g->max_per_uid = max_per_uid > 0 ? max_per_uid : g->max_conn / 2;
    if (g->max_per_uid > g->max_conn)
        g->max_per_uid = g->max_conn;
    if (g->max_per_uid == 0)
        g->max_per_uid = 1;
    pthread_mutex_init(&g->mu, NULL);
    uv_loop_init(&g->loop);
    uv_poll_init(&g->loop, &g->lpoll, fd);
    uv_timer_init(&g->loop, &g->retry);
    uv_timer_init(&g->loop, &g->drain);
    uv_async_init(&g->loop, &g->wake, on_wake);
    g->lpoll.data = g->retry.data = g->wake.data = g->drain.data = g;
    g->listening = 1;
    uv_poll_start(&g->lpoll, UV_READABLE, on_listen);
    if (pthread_create(&g->thread, NULL, guard_main, g) != 0) {
        /* Never started: nothing runs on its loop. */
        uv_close((uv_handle_t *)&g->lpoll, NULL);
        uv_close((uv_handle_t *)&g->retry, NULL);
        uv_close((uv_handle_t *)&g->drain, NULL);
        uv_close((uv_handle_t *)&g->wake, NULL);
        uv_run(&g->loop, UV_RUN_DEFAULT);
        uv_loop_close(&g->loop);
        if (g->reserve >= 0)
            close(g->reserve);
        close(fd);
        unlink(path);
        grpc_server_credentials_release(g->creds);
        free(g);
        return amx_err_set(err, AMX_EINTERNAL, "cannot start the listener thread");
    }
    AMX_INFO("guard",
             "unix:%s: header blocks capped at %zu bytes, at most %u connections "
             "(RLIMIT_NOFILE %llu), %u per user; past a cap the oldest idle connection is "
             "evicted",
             path, max_header_block, g->max_conn, (unsigned long long)soft, g->max_per_uid);
    *out = g;
    return AMX_OK;
}

void amx_guard_stop_listening(amx_guard_t *g)
{
    pthread_mutex_lock(&g->mu);
    g->stop_listen = 1;
    pthread_mutex_unlock(&g->mu);
    uv_async_send(&g->wake);
}

void amx_guard_free(amx_guard_t *g)
{
    if (g == NULL)
        return;
    pthread_mutex_lock(&g->mu);
    g->stop_listen = g->exit = 1;
    pthread_mutex_unlock(&g->mu);
    uv_async_send(&g->wake);
    pthread_join(g->thread, NULL);
    if (g->lfd >= 0)
        close(g->lfd);
    if (g->reserve >= 0)
        close(g->reserve);
    uv_loop_close(&g->loop);
    while (g->nspare > 0)
        free(g->spare[--g->nspare]);
    for (int i = 0; i < PEER_BUCKETS; i++)
        while (g->peers[i] != NULL) { /* none is left once every connection closed */
            peer_t *u = g->peers[i];
            g->peers[i] = u->next;
            free(u);
        }
    unlink(g->path);
    AMX_INFO("guard",
             "stopped: %llu connections accepted, %llu refused, %llu evicted, %llu closed by the "
             "header guard",
             (unsigned long long)g->accepted, (unsigned long long)g->shed,
             (unsigned long long)g->evicted, (unsigned long long)g->killed);
    grpc_server_credentials_release(g->creds);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

uint32_t amx_guard_connections(const amx_guard_t *g)
{
    return g != NULL ? __atomic_load_n(&g->nconn, __ATOMIC_RELAXED) : 0;
}

void amx_guard_counts(const amx_guard_t *g, uint64_t *refused, uint64_t *evicted)
{
    *refused = g != NULL ? __atomic_load_n(&g->shed, __ATOMIC_RELAXED) : 0;
    *evicted = g != NULL ? __atomic_load_n(&g->evicted, __ATOMIC_RELAXED) : 0;
}
