/*
 * peer.c - calls to other daemons of the cluster (peer.h): Join and Drop at
 * the coordinator and notices to participants from the loop thread,
 * without blocking; agreement, state transfer, rendezvous, progress and
 * abort from engine threads, blocking with a deadline. The coordinator's
 * own daemon reaches its coordinator directly for Join and Drop.
 */
#include "peer.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "amaxd/peer/v1/peer.pb-c.h"
#include "clock.h"
#include "codec.h"
#include "grow.h"
#include "log.h"
#include "rpc.h"

#define AUTH_KEY AMX_PEER_AUTH_KEY
#define SVC AMX_PEER_SVC

typedef struct chan {
    char addr[256];
    grpc_channel *ch;
} chan_t;

struct amx_peer {
    uv_loop_t *loop;
    const amx_config_t *cfg;
    const amx_cluster_t *cl;
    amx_cluster_id_t id;
    amx_coord_t *coord; /* this daemon's coordinator (a candidate), borrowed; else NULL */
    amx_rpc_t *rpc;
    pthread_mutex_t ch_mu;
    chan_t *chans;
    size_t nchans, cap_chans;
    /* The coordinator's role: candidates (ranks 0..ncand-1), the one this
     * daemon takes for the coordinator and when each candidate last
     * answered a ping (co_mu); co_gen changes with `cur`. */
    uint32_t ncand;
    uint64_t failover_ms;
    pthread_mutex_t co_mu;
    pthread_cond_t co_cv;
    uint32_t cur;
    atomic_uint co_gen;
    uint64_t last_ok[AMX_MAX_COORDS];
    int w_stop, watching;
    pthread_t watcher;
    atomic_int want_active; /* the watcher's word: this daemon coordinates */
    int active;             /* loop thread: what its coordinator does */
    struct join_op *joins;  /* loop thread: remote Joins waiting */
    uint64_t last_tick;     /* loop thread */
};

static void *watch_main(void *arg);

/* ======================= the object ======================= */

amx_status_t amx_peer_create(uv_loop_t *loop, const amx_config_t *cfg, const amx_cluster_t *cl,
                             amx_coord_t *coord, amx_peer_t **out, amx_err_t *err)
{
    amx_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    p->loop = loop;
    p->cfg = cfg;
    p->cl = cl;
    p->id = *amx_cluster_id(cl);
    p->coord = coord;
    pthread_mutex_init(&p->ch_mu, NULL);
    pthread_mutex_init(&p->co_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&p->co_cv, &ca);
    pthread_condattr_destroy(&ca);
    p->ncand = p->id.size > 1 && p->id.ncoord > 0 ? p->id.ncoord : 1;
    p->failover_ms = (uint64_t)cfg->coordinator_failover_ms;
    uint64_t now = amx_now_ms();
    for (uint32_t i = 0; i < AMX_MAX_COORDS; i++)
        p->last_ok[i] = now; /* every candidate has its grace period at start */
    /* Rank 0 coordinates from the start; another candidate once the ones
     * below it stopped answering. */
    if (coord != NULL && p->id.rank != 0)
        amx_coord_step_down(coord, "not the coordinator");
    p->active = amx_coord_active(coord);
    atomic_store(&p->want_active, p->active);
    *out = p;
    return AMX_OK;
}

void amx_peer_set_rpc(amx_peer_t *p, amx_rpc_t *rpc)
{
    p->rpc = rpc;
    /* The watcher pings the candidates below this daemon. */
    if (p->ncand > 1 && p->id.rank != 0 && !p->watching)
        p->watching = pthread_create(&p->watcher, NULL, watch_main, p) == 0;
    if (p->ncand > 1 && p->id.rank != 0 && !p->watching)
        AMX_ERROR("peer",
                  "cannot start the coordinator watcher: this daemon never takes over "
                  "from coordinator %s",
                  p->id.coords[0]);
}

void amx_peer_destroy(amx_peer_t *p)
{
    if (p == NULL)
        return;
    if (p->watching) {
        pthread_mutex_lock(&p->co_mu);
        p->w_stop = 1;
        pthread_cond_signal(&p->co_cv);
        pthread_mutex_unlock(&p->co_mu);
        pthread_join(p->watcher, NULL);
    }
    pthread_cond_destroy(&p->co_cv);
    pthread_mutex_destroy(&p->co_mu);
    for (size_t i = 0; i < p->nchans; i++)
        grpc_channel_destroy(p->chans[i].ch);
    free(p->chans);
    pthread_mutex_destroy(&p->ch_mu);
    free(p);
}

const amx_cluster_id_t *amx_peer_id(const amx_peer_t *p)
{
    return &p->id;
}

uint32_t amx_peer_coordinator(amx_peer_t *p, uint32_t *rank, char *addr, size_t len)
{
    pthread_mutex_lock(&p->co_mu);
    uint32_t r = p->cur;
    unsigned gen = atomic_load(&p->co_gen);
    pthread_mutex_unlock(&p->co_mu);
    if (rank != NULL)
        *rank = r;
    if (addr != NULL)
        snprintf(addr, len, "%s", p->ncand > 1 ? p->id.coords[r] : p->id.coordinator);
    return gen;
}

int amx_peer_coordinating(const amx_peer_t *p)
{
    return p->coord != NULL && p->active;
}

/* A new incarnation for this daemon's coordinator. */
static uint64_t new_incarnation(const amx_peer_t *p)
{
    uint64_t inc = 0;
    if (getrandom(&inc, sizeof(inc), 0) != sizeof(inc))
        inc = amx_now_us() ^ ((uint64_t)p->id.rank << 48);
    return inc | 1;
}

static void abandon_joins(amx_peer_t *p);

static void resend_joins(amx_peer_t *p);

void amx_peer_tick(amx_peer_t *p)
{
    if (p->ncand > 1 && p->joins != NULL) {
        abandon_joins(p);
        resend_joins(p);
    }
    if (p->coord == NULL || p->ncand <= 1)
        return;
    uint64_t now = amx_now_ms(), gap = p->last_tick ? now - p->last_tick : 0;
    p->last_tick = now;
    if (p->active && gap >= p->failover_ms) {
        /* This daemon did not run for that long (stopped, or starved): the
         * others may have moved on under another coordinator, so what it
         * holds is stale. It starts over as if it had restarted. */
        char why[300];
        snprintf(why, sizeof(why),
                 "daemon %u did not run for %llu ms (stopped?); it keeps the coordinator's role "
                 "but drops what it held: the members rebuild it",
                 p->id.rank, (unsigned long long)gap);
        amx_coord_step_down(p->coord, why);
        amx_coord_take_over(p->coord, new_incarnation(p));
        AMX_WARN("peer", "%s", why);
    }
    int want = atomic_load(&p->want_active);
    if (want == p->active)
        return;
    if (want) {
        amx_coord_take_over(p->coord, new_incarnation(p));
        AMX_WARN("peer",
                 "this daemon (rank %u) is the coordinator now: no candidate below it answered "
                 "within %llu ms; the members rebuild its membership and catalogs",
                 p->id.rank, (unsigned long long)p->failover_ms);
    } else {
        uint32_t r;
        char addr[256], why[400];
        amx_peer_coordinator(p, &r, addr, sizeof(addr));
        snprintf(why, sizeof(why),
                 "daemon %u is no longer the coordinator: daemon %u (%s) answers again and takes "
                 "the role back",
                 p->id.rank, r, addr);
        amx_coord_step_down(p->coord, why);
        AMX_WARN("peer", "%s", why);
    }
    p->active = want;
}

static void token_for(const amx_peer_t *p, const char *method, char *out, size_t len)
{
    amx_cluster_token(p->cl, method, out, len);
}

/* A channel to `addr`, shared by every thread. */
static grpc_channel *channel_to(amx_peer_t *p, const char *addr)
{
    pthread_mutex_lock(&p->ch_mu);
    for (size_t i = 0; i < p->nchans; i++)
        if (strcmp(p->chans[i].addr, addr) == 0) {
            grpc_channel *ch = p->chans[i].ch;
            pthread_mutex_unlock(&p->ch_mu);
            return ch;
        }
    if (amx_grow(&p->chans, &p->cap_chans, p->nchans + 1, sizeof(*p->chans), 8, 0) != 0) {
        pthread_mutex_unlock(&p->ch_mu);
        return NULL;
    }
    grpc_arg args[3];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = -1;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = -1;
    /* A peer that restarted should be found again quickly. */
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
    args[2].value.integer = 1000;
    grpc_channel_args cargs = {3, args};
    grpc_channel_credentials *creds = amx_cluster_channel_credentials(p->cl);
    grpc_channel *ch = grpc_channel_create(addr, creds, &cargs);
    grpc_channel_credentials_release(creds);
    snprintf(p->chans[p->nchans].addr, sizeof(p->chans[p->nchans].addr), "%s", addr);
    p->chans[p->nchans++].ch = ch;
    pthread_mutex_unlock(&p->ch_mu);
    return ch;
}

/* ======================= loop thread: asynchronous calls ======================= */

/* How much earlier than a member's own deadline the coordinator times out
 * a Join it forwards (at most a tenth of the whole). */
#define JOIN_MARGIN_MS 500

typedef struct join_op {
    struct join_op *prev, *next; /* remote: pending (amx_peer.joins) */
    unsigned gen;                /* remote: the coordinator it went to */
    amx_peer_t *p;
    amx_peer_join_cb cb;
    void *ud;
    amx_creq_t *creq;  /* local coordinator */
    amx_ccall_t *call; /* remote */
    char addr[256];    /* remote: the coordinator it went to */
    uint32_t crank;
    int done;
    uint64_t started_ms, deadline_ms; /* remote: when the Join was sent, and its deadline */
    /* A Join refused UNAVAILABLE while the coordinator's role moves is sent
     * again by the tick (retry_at != 0: waiting for it), within `until`. */
    char *job;
    uint32_t world, rank;
    uint64_t retry_at, until;
} join_op_t;

static void join_op_free(join_op_t *op)
{
    free(op->job);
    free(op);
}

static void on_local_join(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    join_op_t *op = ud;
    op->done = 1;
    op->creq = NULL;
    op->cb(op->ud, st, msg, m);
    join_op_free(op);
}

static void join_unlink(join_op_t *op)
{
    if (op->prev != NULL)
        op->prev->next = op->next;
    else if (op->p->joins == op)
        op->p->joins = op->next;
    if (op->next != NULL)
        op->next->prev = op->prev;
    op->prev = op->next = NULL;
}

static void join_link(join_op_t *op)
{
    amx_peer_t *p = op->p;
    op->prev = NULL;
    op->next = p->joins;
    if (p->joins != NULL)
        p->joins->prev = op;
    p->joins = op;
}

static void on_remote_join(void *ud, amx_status_t st, const char *msg, const uint8_t *data,
                           size_t len)
{
    join_op_t *op = ud;
    join_unlink(op);
    char buf[1200];
    uint64_t now = amx_now_ms();
    if ((st == AMX_EUNAVAIL || st == AMX_EINTERNAL) && op->p->ncand > 1 && now < op->until &&
        now + 100 < op->deadline_ms) {
        /* The coordinator died, or a candidate refused because it has not
         * taken the role yet (members decide a moment apart): the tick
         * sends it again, to whoever is named then, until the role has
         * had time to move (the trainer is not told to Join again). */
        AMX_DEBUG("peer", "Join of job %s, rank %u: %s; sent again shortly", op->job, op->rank,
                  msg);
        op->call = NULL;
        op->retry_at = now + 1;
        join_link(op);
        return;
    }
    if (st != AMX_OK) {
        if (st == AMX_ETIMEDOUT && amx_now_ms() + 50 >= op->deadline_ms) {
            /* Our own deadline, not the coordinator's answer (which comes
             * JOIN_MARGIN_MS earlier): it is stopped, hung or overloaded. */
            snprintf(buf, sizeof(buf),
                     "the coordinator %s did not answer this Join within %llu ms (is its daemon "
                     "running and not stopped? a Join it times out names the ranks that never "
                     "joined)",
                     op->addr, (unsigned long long)(op->deadline_ms - op->started_ms));
            msg = buf;
        } else if (st == AMX_EUNAVAIL || st == AMX_EINTERNAL) {
            snprintf(buf, sizeof(buf), "the coordinator %s could not be reached: %s%s", op->addr,
                     msg,
                     op->p->ncand > 1 ? " (another candidate takes its role within "
                                        "coordinator_failover_ms: Join again)"
                                      : "");
            msg = buf;
            st = AMX_EUNAVAIL;
        } else if (st == AMX_EAUTH) {
            snprintf(buf, sizeof(buf),
                     "the coordinator %s refused this daemon (%s): every daemon of a cluster "
                     "needs the same cluster_secret_file",
                     op->addr, msg);
            msg = buf;
        }
        op->cb(op->ud, st, msg, NULL);
        join_op_free(op);
        return;
    }
    Amaxd__Peer__V1__JoinResponse *r = amaxd__peer__v1__join_response__unpack(NULL, len, data);
    amx_membership_t m;
    if (r == NULL ||
        amx_codec_members_in(r->participants, r->n_participants, r->world_size, &m) != AMX_OK) {
        op->cb(op->ud, AMX_EINTERNAL, "the coordinator's Join answer could not be read", NULL);
    } else {
        m.rejoined = r->rejoined;
        m.coord_inc = r->coordinator_incarnation;
        op->cb(op->ud, AMX_OK, NULL, &m);
        amx_membership_free(&m);
    }
    if (r != NULL)
        amaxd__peer__v1__join_response__free_unpacked(r, NULL);
    join_op_free(op);
}

/* Sends op's Join to the coordinator named now: the local one (which may
 * answer at once: then *alive = 0, op is freed) or a remote one (op is
 * linked into p->joins until its answer). */
static amx_status_t send_join(join_op_t *op, int *alive, amx_err_t *err)
{
    amx_peer_t *p = op->p;
    *alive = 1;
    if (amx_peer_coordinating(p)) {
        amx_coord_join_req_t req = {op->job,           op->world,       op->rank, p->id.rank,
                                    p->id.incarnation, p->id.advertise, 0,        op->deadline_ms};
        amx_creq_t *cr = NULL;
        AMX_CHECK(amx_coord_join(p->coord, &req, on_local_join, op, &cr, err));
        if (cr == NULL)
            *alive = 0; /* answered (on_local_join freed it) */
        else
            op->creq = cr;
        return AMX_OK;
    }
    Amaxd__Peer__V1__JoinRequest q = AMAXD__PEER__V1__JOIN_REQUEST__INIT;
    q.job = op->job;
    q.world_size = op->world;
    q.rank = op->rank;
    q.daemon = p->id.rank;
    q.incarnation = p->id.incarnation;
    q.address = p->id.advertise;
    /* The coordinator answers a Join that times out (naming the ranks
     * that never joined) a little before our own deadline, which then
     * only fires when the coordinator does not answer at all: either way
     * the trainer hears within its join_timeout_ms. */
    uint64_t now = amx_now_ms();
    uint64_t left = op->deadline_ms > now ? op->deadline_ms - now : 1;
    uint64_t margin = left / 10 < JOIN_MARGIN_MS ? left / 10 : JOIN_MARGIN_MS;
    q.timeout_ms = (uint32_t)(left - margin > 0 ? left - margin : 1);
    size_t len;
    uint8_t *buf = amx_codec_pack(&q.base, &len);
    op->gen = amx_peer_coordinator(p, &op->crank, op->addr, sizeof(op->addr));
    grpc_channel *ch = channel_to(p, op->addr);
    if (buf == NULL || ch == NULL) {
        free(buf);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    char tok[160];
    token_for(p, SVC "Join", tok, sizeof(tok));
    amx_status_t st = amx_rpc_call(p->rpc, ch, SVC "Join", buf, len, AUTH_KEY, tok, op->deadline_ms,
                                   on_remote_join, op, &op->call, err);
    free(buf);
    if (st != AMX_OK)
        return st;
    join_link(op);
    return AMX_OK;
}

amx_status_t amx_peer_join(amx_peer_t *p, const char *job, uint32_t world, uint32_t rank,
                           uint64_t deadline_ms, amx_peer_join_cb cb, void *ud, void **h,
                           amx_err_t *err)
{
    *h = NULL;
    join_op_t *op = calloc(1, sizeof(*op));
    if (op == NULL || (op->job = strdup(job)) == NULL) {
        free(op);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    op->p = p;
    op->cb = cb;
    op->ud = ud;
    op->world = world;
    op->rank = rank;
    op->started_ms = amx_now_ms();
    op->deadline_ms = deadline_ms;
    op->until = op->started_ms + 2 * p->failover_ms + 1000;
    int alive;
    amx_status_t st = send_join(op, &alive, err);
    if (st != AMX_OK) {
        join_op_free(op);
        return st;
    }
    if (alive)
        *h = op;
    return AMX_OK;
}

/* The tick: Joins waiting to be sent again (on_remote_join). */
static void resend_joins(amx_peer_t *p)
{
    uint64_t now = amx_now_ms();
    for (join_op_t *op = p->joins, *next; op != NULL; op = next) {
        next = op->next;
        if (op->retry_at == 0 || now < op->retry_at)
            continue;
        join_unlink(op);
        op->retry_at = 0;
        amx_err_t e = {0};
        int alive;
        if (send_join(op, &alive, &e) != AMX_OK) {
            op->cb(op->ud, e.code, e.msg, NULL);
            join_op_free(op);
        }
    }
}

/* Remote Joins sent to a coordinator that is not the one any more (it
 * died or was stopped, and may keep its connections open): sent again to
 * the new one (resend_joins) within 2 x coordinator_failover_ms + 1 s of
 * the first send; after that UNAVAILABLE, so that the trainer hears at
 * once rather than at its deadline. */
static void abandon_joins(amx_peer_t *p)
{
    unsigned gen = atomic_load(&p->co_gen);
    for (join_op_t *op = p->joins, *next; op != NULL; op = next) {
        next = op->next;
        if (op->gen == gen || op->call == NULL)
            continue;
        amx_rpc_call_cancel(p->rpc, op->call); /* its callback is not called */
        uint64_t now = amx_now_ms();
        if (now < op->until && now + 100 < op->deadline_ms) {
            AMX_DEBUG("peer",
                      "Join of job %s, rank %u: the coordinator %s (daemon %u) stopped "
                      "answering; sent again to the next one",
                      op->job, op->rank, op->addr, op->crank);
            op->call = NULL; /* sent again to the new coordinator by resend_joins */
            op->retry_at = now + 1;
            continue;
        }
        join_unlink(op);
        char msg[600];
        snprintf(msg, sizeof(msg),
                 "the coordinator %s (daemon %u) stopped answering and another candidate takes "
                 "its role: Join again",
                 op->addr, op->crank);
        op->cb(op->ud, AMX_EUNAVAIL, msg, NULL);
        join_op_free(op);
    }
}

void amx_peer_join_cancel(amx_peer_t *p, void *h)
{
    join_op_t *op = h;
    if (op == NULL)
        return;
    join_unlink(op);
    if (op->creq != NULL)
        amx_coord_cancel(p->coord, op->creq);
    else if (op->call != NULL)
        amx_rpc_call_cancel(p->rpc, op->call); /* the callback is not called: free here */
    join_op_free(op);
}

static void ignore_answer(void *ud, amx_status_t st, const char *msg, const uint8_t *d, size_t n)
{
    char *what = ud;
    if (st != AMX_OK)
        AMX_DEBUG("peer", "%s: %s", what, msg);
    free(what);
}

/* Sends `req` to every daemon of `m` but `skip1` and `skip2`, not waiting. */
static void fan_out(amx_peer_t *p, const amx_membership_t *m, uint32_t skip1, uint32_t skip2,
                    const char *method, const ProtobufCMessage *req)
{
    size_t len;
    uint8_t *buf = amx_codec_pack(req, &len);
    if (buf == NULL || p->rpc == NULL) {
        free(buf);
        return;
    }
    char tok[160];
    token_for(p, method, tok, sizeof(tok));
    for (uint32_t i = 0; i < m->npart; i++) {
        const amx_part_t *x = &m->part[i];
        if (x->daemon == skip1 || x->daemon == skip2)
            continue;
        grpc_channel *ch = channel_to(p, x->addr);
        char *what = malloc(300);
        if (ch == NULL || what == NULL) {
            free(what);
            continue;
        }
        snprintf(what, 300, "%s to daemon %u (%s)", method, x->daemon, x->addr);
        amx_err_t err = {0};
        if (amx_rpc_call(p->rpc, ch, method, buf, len, AUTH_KEY, tok, amx_now_ms() + 2000,
                         ignore_answer, what, NULL, &err) != AMX_OK)
            free(what);
    }
    free(buf);
}

void amx_peer_tell_drop(amx_peer_t *p, const char *job, const amx_membership_t *m, uint32_t skip)
{
    Amaxd__Peer__V1__DropRequest q = AMAXD__PEER__V1__DROP_REQUEST__INIT;
    q.job = (char *)job;
    q.from = skip;
    fan_out(p, m, p->id.rank, skip, SVC "Drop", &q.base);
}

void amx_peer_drop(amx_peer_t *p, const char *job)
{
    if (p->id.size <= 1)
        return;
    if (amx_peer_coordinating(p)) {
        amx_membership_t mem;
        if (amx_coord_drop(p->coord, job, &mem) == AMX_OK) {
            amx_peer_tell_drop(p, job, &mem, p->id.rank);
            amx_membership_free(&mem);
        }
        return;
    }
    Amaxd__Peer__V1__DropRequest q = AMAXD__PEER__V1__DROP_REQUEST__INIT;
    q.job = (char *)job;
    q.from = p->id.rank;
    amx_membership_t only = {0};
    amx_part_t coord = {0};
    amx_peer_coordinator(p, &coord.daemon, coord.addr, sizeof(coord.addr));
    only.npart = 1;
    only.part = &coord;
    fan_out(p, &only, p->id.rank, p->id.rank, SVC "Drop", &q.base);
}

void amx_peer_abort_all(amx_peer_t *p, const amx_membership_t *m, const char *job, uint64_t gen,
                        uint32_t skip, const char *reason)
{
    Amaxd__Peer__V1__AbortRequest q = AMAXD__PEER__V1__ABORT_REQUEST__INIT;
    q.job = (char *)job;
    q.comm_generation = gen;
    q.from = p->id.rank;
    q.reason = (char *)reason;
    fan_out(p, m, p->id.rank, skip, SVC "Abort", &q.base);
}

/* ======================= engine threads: blocking calls ======================= */

typedef struct bcall {
    grpc_call *call;
    grpc_metadata md;
    grpc_byte_buffer *send_buf, *recv_buf;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    int done;
} bcall_t;

static int bcall_start(amx_peer_t *p, grpc_completion_queue *cq, bcall_t *b, const char *addr,
                       const char *method, const uint8_t *req, size_t len, uint64_t deadline)
{
    memset(b, 0, sizeof(*b));
    b->details = grpc_empty_slice();
    grpc_metadata_array_init(&b->init_md);
    grpc_metadata_array_init(&b->trail_md);
    grpc_channel *ch = channel_to(p, addr);
    if (ch == NULL)
        return -1;
    char tok[160];
    token_for(p, method, tok, sizeof(tok));
    b->md.key = grpc_slice_from_static_string(AUTH_KEY);
    b->md.value = grpc_slice_from_copied_string(tok);
    b->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                       grpc_slice_from_static_string(method), NULL,
                                       amx_rpc_deadline(deadline), NULL);
    if (b->call == NULL)
        return -1;
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)req, len);
    b->send_buf = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = 1;
    ops[0].data.send_initial_metadata.metadata = &b->md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = b->send_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &b->init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &b->recv_buf;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &b->trail_md;
    ops[5].data.recv_status_on_client.status = &b->status;
    ops[5].data.recv_status_on_client.status_details = &b->details;
    return grpc_call_start_batch(b->call, ops, 6, b, NULL) == GRPC_CALL_OK ? 0 : -1;
}

static void bcall_free(bcall_t *b)
{
    if (b->send_buf)
        grpc_byte_buffer_destroy(b->send_buf);
    if (b->recv_buf)
        grpc_byte_buffer_destroy(b->recv_buf);
    grpc_metadata_array_destroy(&b->init_md);
    grpc_metadata_array_destroy(&b->trail_md);
    grpc_slice_unref(b->details);
    grpc_slice_unref(b->md.value);
    if (b->call)
        grpc_call_unref(b->call);
}

/* The outcome of a finished call; the answer's bytes into *out (malloc). */
static amx_status_t bcall_result(bcall_t *b, uint8_t **out, size_t *len, char *msg, size_t mlen)
{
    amx_status_t st = amx_status_from_grpc((int)b->status);
    snprintf(msg, mlen, "%.*s", (int)GRPC_SLICE_LENGTH(b->details),
             (const char *)GRPC_SLICE_START_PTR(b->details));
    if (st != AMX_OK || out == NULL)
        return st;
    *out = NULL;
    *len = 0;
    if (b->recv_buf == NULL) {
        snprintf(msg, mlen, "the answer carried no message");
        return AMX_EINTERNAL;
    }
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, b->recv_buf)) {
        snprintf(msg, mlen, "the answer could not be read");
        return AMX_EINTERNAL;
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    *len = GRPC_SLICE_LENGTH(s);
    *out = malloc(*len ? *len : 1);
    if (*out == NULL) {
        grpc_slice_unref(s);
        snprintf(msg, mlen, "out of memory");
        return AMX_ENOMEM;
    }
    if (*len > 0)
        memcpy(*out, GRPC_SLICE_START_PTR(s), *len);
    grpc_slice_unref(s);
    return AMX_OK;
}

/* One blocking call: polls every 50 ms for `abort`, and for `gen` moving
 * away from gen0 (the coordinator changed: UNAVAILABLE) when gen is set. */
static amx_status_t call_one_gen(amx_peer_t *p, const char *addr, const char *method,
                                 const ProtobufCMessage *req, uint64_t deadline,
                                 const atomic_int *abort, const atomic_uint *gen, unsigned gen0,
                                 uint8_t **out, size_t *olen, amx_err_t *err)
{
    size_t len;
    uint8_t *buf = amx_codec_pack(req, &len);
    if (buf == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    bcall_t b;
    int started = bcall_start(p, cq, &b, addr, method, buf, len, deadline) == 0;
    free(buf);
    int cancelled = 0, moved = 0;
    while (started) {
        gpr_timespec slice = amx_rpc_deadline(amx_now_ms() + 50);
        grpc_event ev = grpc_completion_queue_pluck(cq, &b, slice, NULL);
        if (ev.type == GRPC_OP_COMPLETE)
            break;
        if (!cancelled && abort != NULL && atomic_load(abort)) {
            grpc_call_cancel(b.call, NULL);
            cancelled = 1;
        }
        if (!cancelled && !moved && gen != NULL && atomic_load(gen) != gen0) {
            grpc_call_cancel(b.call, NULL);
            moved = 1;
        }
    }
    amx_status_t st;
    char msg[700];
    if (!started) {
        st = amx_err_set(err, AMX_EINTERNAL, "cannot start %s to %s", method, addr);
    } else if (moved && !cancelled) {
        st = amx_err_set(err, AMX_EUNAVAIL,
                         "%s to %s was abandoned: another daemon took the coordinator's role",
                         method, addr);
    } else if (cancelled) {
        st = amx_err_set(err, AMX_EABORTED, "%s to %s was abandoned (the epoch was aborted)",
                         method, addr);
    } else {
        st = bcall_result(&b, out, olen, msg, sizeof(msg));
        if (st != AMX_OK)
            amx_err_set(err, st, "%s", msg);
    }
    bcall_free(&b);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_past(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    return st;
}

static amx_status_t call_one(amx_peer_t *p, const char *addr, const char *method,
                             const ProtobufCMessage *req, uint64_t deadline,
                             const atomic_int *abort, uint8_t **out, size_t *olen, amx_err_t *err)
{
    return call_one_gen(p, addr, method, req, deadline, abort, NULL, 0, out, olen, err);
}

/* A call to the coordinator from an engine thread. With several
 * candidates, one that finds the coordinator gone (UNAVAILABLE, or the
 * watcher names another while it waits) ends UNAVAILABLE, or, with
 * `retry`, waits for the next coordinator and is sent there, until `until` and at most 2 x
 * coordinator_failover_ms + 1 s after the first failure; *timeout_ms (when set) is refreshed to
 * what is left of `until` before each try. */
static amx_status_t call_coord(amx_peer_t *p, const char *method, ProtobufCMessage *req, int retry,
                               uint32_t *timeout_ms, uint64_t until, uint64_t call_deadline,
                               const atomic_int *abort, uint8_t **out, size_t *olen, amx_err_t *err)
{
    uint64_t give_up = 0;
    for (;;) {
        char addr[256];
        uint32_t rank;
        unsigned gen = amx_peer_coordinator(p, &rank, addr, sizeof(addr));
        uint64_t now = amx_now_ms();
        if (timeout_ms != NULL)
            *timeout_ms = until > now ? (uint32_t)(until - now) : 1;
        amx_status_t st = call_one_gen(p, addr, method, req, call_deadline, abort,
                                       p->ncand > 1 ? &p->co_gen : NULL, gen, out, olen, err);
        if (st != AMX_EUNAVAIL || p->ncand <= 1 || !retry || (abort != NULL && atomic_load(abort)))
            return st;
        now = amx_now_ms();
        if (give_up == 0) {
            give_up = now + 2 * p->failover_ms + 1000;
            AMX_INFO("peer",
                     "%s at the coordinator (daemon %u, %s) failed: %s; sent again to the "
                     "coordinator this daemon finds next",
                     method + sizeof(SVC) - 1, rank, addr, err->msg);
        }
        if (now >= until || now >= give_up) {
            char m2[sizeof(err->msg)];
            snprintf(m2, sizeof(m2), "%s", err->msg);
            return amx_err_set(err, st,
                               "%s (no other coordinator candidate took over within %llu ms)", m2,
                               (unsigned long long)(2 * p->failover_ms + 1000));
        }
        /* Until the watcher names another, or 200 ms (the same one may
         * answer again, or refuse because it does not know yet). */
        for (int k = 0; k < 4 && atomic_load(&p->co_gen) == gen; k++) {
            if (abort != NULL && atomic_load(abort))
                return st;
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
}

void amx_sync_result_free(amx_sync_result_t *r)
{
    for (uint32_t i = 0; i < r->ncatalog; i++)
        amx_qspec_free(r->catalog[i]);
    free(r->catalog);
    for (size_t i = 0; i < r->nrejected; i++)
        free(r->rejected[i]);
    free(r->rejected);
    free(r->conflict);
    for (size_t i = 0; i < r->nresets; i++)
        free(r->resets[i]);
    free(r->resets);
    free(r->behind);
    amx_membership_free(&r->members);
    memset(r, 0, sizeof(*r));
}

static char **dup_strs(char **v, size_t n)
{
    char **out = calloc(n ? n : 1, sizeof(char *));
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++)
        if ((out[i] = strdup(v[i])) == NULL) {
            for (size_t k = 0; k < i; k++)
                free(out[k]);
            free(out);
            return NULL;
        }
    return out;
}

amx_status_t amx_peer_call_sync(amx_peer_t *p, const amx_coord_sync_req_t *req,
                                const atomic_int *abort, amx_sync_result_t *res, amx_err_t *err)
{
    memset(res, 0, sizeof(*res));
    Amaxd__Peer__V1__SyncRequest q = AMAXD__PEER__V1__SYNC_REQUEST__INIT;
    amx_arena_t a = {0};
    q.job = (char *)req->job;
    q.daemon = req->daemon;
    q.incarnation = req->incarnation;
    q.last_reconciled = req->last_reconciled;
    q.catalog_hash = req->catalog_hash;
    q.full_catalog = req->full_catalog;
    q.offer_hash = req->offer_hash;
    q.offer_count = req->offer_count;
    q.offer_included = req->offer_included;
    q.membership_hash = req->membership_hash;
    q.want_catalog = req->want_catalog;
    q.union_hash = req->union_hash;
    q.n_resets = req->nresets;
    q.resets = req->resets;
    q.need_comm = req->need_comm;
    q.world_size = req->world;
    q.n_ranks = req->nranks;
    q.ranks = (uint32_t *)req->ranks;
    q.address = (char *)req->addr;
    q.n_proposals = req->offer_included ? req->nprop : 0;
    q.proposals = amx_arena_alloc(&a, (req->nprop + 1) * sizeof(*q.proposals));
    if (q.proposals == NULL) {
        amx_arena_free(&a);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < q.n_proposals; i++) {
        Amaxd__V1__QuantizerSpec *s = amx_arena_alloc(&a, sizeof(*s));
        if (s == NULL || amx_codec_spec_out(req->proposals[i], s, &a) != AMX_OK) {
            amx_arena_free(&a);
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        }
        q.proposals[i] = s;
    }
    uint8_t *out = NULL;
    size_t olen = 0;
    amx_status_t st = call_coord(p, SVC "Sync", &q.base, 1, &q.timeout_ms, req->deadline_ms,
                                 req->deadline_ms + 1000, abort, &out, &olen, err);
    amx_arena_free(&a);
    if (st != AMX_OK)
        return st;
    Amaxd__Peer__V1__SyncResponse *r = amaxd__peer__v1__sync_response__unpack(NULL, olen, out);
    free(out);
    if (r == NULL)
        return amx_err_set(err, AMX_EINTERNAL,
                           "the coordinator's agreement answer could not be "
                           "read");
    res->coord_inc = r->coordinator_incarnation;
    if (r->send_catalog || r->send_offer) {
        res->send_catalog = r->send_catalog;
        res->send_offer = r->send_offer;
        amaxd__peer__v1__sync_response__free_unpacked(r, NULL);
        return AMX_OK;
    }
    res->catalog_delta = r->catalog_delta;
    res->catalog_yours = r->catalog_yours;
    res->members_omitted = r->members_omitted;
    res->seq = r->seq;
    res->catalog_hash = r->catalog_hash;
    res->target_epoch = r->target_epoch;
    res->comm_gen = r->comm_generation;
    res->coord_inc = r->coordinator_incarnation;
    res->new_comm = r->new_comm;
    res->catalog_included = r->catalog_included;
    res->donor = r->donor;
    st = AMX_ENOMEM;
    res->catalog = calloc(r->n_catalog ? r->n_catalog : 1, sizeof(amx_qspec_t *));
    if (res->catalog == NULL)
        goto fail;
    for (size_t i = 0; i < r->n_catalog; i++) {
        amx_qspec_t s;
        amx_err_t e2 = {0};
        if (amx_codec_spec_parse(r->catalog[i], &s, &e2) != AMX_OK) {
            st = amx_err_set(err, AMX_EINTERNAL, "the coordinator sent a bad spec: %s", e2.msg);
            goto fail;
        }
        if ((res->catalog[res->ncatalog] = amx_qspec_dup(&s)) == NULL)
            goto fail;
        res->ncatalog++;
    }
    res->rejected = dup_strs(r->rejected, r->n_rejected);
    res->resets = dup_strs(r->resets, r->n_resets);
    res->behind = malloc((r->n_behind ? r->n_behind : 1) * sizeof(uint32_t));
    if (res->rejected == NULL || res->resets == NULL || res->behind == NULL)
        goto fail;
    res->nrejected = r->n_rejected;
    res->nresets = r->n_resets;
    if (r->n_behind > 0)
        memcpy(res->behind, r->behind, r->n_behind * sizeof(uint32_t));
    res->nbehind = r->n_behind;
    if (r->conflict[0] != '\0' && (res->conflict = strdup(r->conflict)) == NULL)
        goto fail;
    if (amx_codec_members_in(r->participants, r->n_participants, req->world, &res->members) !=
        AMX_OK)
        goto fail;
    res->members.coord_inc = r->coordinator_incarnation;
    amaxd__peer__v1__sync_response__free_unpacked(r, NULL);
    return AMX_OK;
fail:
    amaxd__peer__v1__sync_response__free_unpacked(r, NULL);
    amx_sync_result_free(res);
    if (st == AMX_ENOMEM)
        amx_err_set(err, AMX_ENOMEM, "out of memory reading an agreement");
    return st;
}

/* -- the rendezvous store -- */

typedef struct kv_ctx {
    amx_peer_t *p;
    const atomic_int *abort;
    /* Asked between slices of a get's wait (comm.h's watch; NULL: none). */
    int (*watch)(void *ud, char *why, size_t len);
    void *watch_ud;
} kv_ctx_t;

static amx_status_t kv_set(void *ud, const char *key, const void *val, size_t len, amx_err_t *err)
{
    kv_ctx_t *k = ud;
    Amaxd__Peer__V1__KvSetRequest q = AMAXD__PEER__V1__KV_SET_REQUEST__INIT;
    q.key = (char *)key;
    q.value.data = (uint8_t *)val;
    q.value.len = len;
    uint8_t *out = NULL;
    size_t olen;
    uint64_t until = amx_now_ms() + 10000;
    amx_status_t st =
        call_coord(k->p, SVC "KvSet", &q.base, 0, NULL, until, until, k->abort, &out, &olen, err);
    free(out);
    return st;
}

static amx_status_t kv_get(void *ud, const char *key, uint64_t deadline, void **val, size_t *len,
                           amx_err_t *err)
{
    kv_ctx_t *k = ud;
    Amaxd__Peer__V1__KvGetRequest q = AMAXD__PEER__V1__KV_GET_REQUEST__INIT;
    q.key = (char *)key;
    uint8_t *out = NULL;
    size_t olen = 0;
    amx_status_t st;
    for (;;) {
        /* With a watch, the wait goes in slices: a participant that died
         * before it published its key (an address, the NCCL unique id) is
         * found by its ring neighbours' pings between them, not at the
         * deadline. */
        uint64_t now = amx_now_ms(), until = deadline;
        if (k->watch != NULL && deadline > now + AMX_COMM_WATCH_MS)
            until = now + AMX_COMM_WATCH_MS;
        st = call_coord(k->p, SVC "KvGet", &q.base, 0, &q.timeout_ms, until, until + 1000, k->abort,
                        &out, &olen, err);
        if (st != AMX_ETIMEDOUT || until >= deadline)
            break;
        amx_err_clear(err); /* the slice's "not set in time" */
        if (k->abort != NULL && atomic_load(k->abort))
            return amx_err_set(err, AMX_EABORTED, "aborted while the rendezvous waited for '%s'",
                               key);
        char why[512] = "";
        if (k->watch(k->watch_ud, why, sizeof(why)))
            return amx_err_set(err, AMX_EUNAVAIL, "%s (while the rendezvous waited for '%s')", why,
                               key);
    }
    if (st != AMX_OK)
        return st;
    Amaxd__Peer__V1__KvGetResponse *r = amaxd__peer__v1__kv_get_response__unpack(NULL, olen, out);
    free(out);
    if (r == NULL)
        return amx_err_set(err, AMX_EINTERNAL, "a KvGet answer could not be read");
    *val = malloc(r->value.len ? r->value.len : 1);
    if (*val == NULL) {
        amaxd__peer__v1__kv_get_response__free_unpacked(r, NULL);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    if (r->value.len > 0)
        memcpy(*val, r->value.data, r->value.len);
    *len = r->value.len;
    amaxd__peer__v1__kv_get_response__free_unpacked(r, NULL);
    return AMX_OK;
}

/* The store is only used during one comm creation on one engine thread:
 * its context lives in thread-local storage for as long as that takes. */
static _Thread_local kv_ctx_t tls_kv;

void amx_peer_kv(amx_peer_t *p, const atomic_int *abort, int (*watch)(void *, char *, size_t),
                 void *watch_ud, amx_kv_t *kv)
{
    tls_kv.p = p;
    tls_kv.abort = abort;
    tls_kv.watch = watch;
    tls_kv.watch_ud = watch_ud;
    kv->ud = &tls_kv;
    kv->set = kv_set;
    kv->get = kv_get;
}

/* -- state transfer -- */

amx_status_t amx_peer_call_fetch(amx_peer_t *p, const char *addr, const char *job, uint64_t seq,
                                 uint64_t deadline_ms, const atomic_int *abort, void **blob,
                                 size_t *len, amx_err_t *err)
{
    uint8_t *buf = NULL;
    uint64_t total = UINT64_MAX, have = 0;
    while (have < total) {
        Amaxd__Peer__V1__FetchStateRequest q = AMAXD__PEER__V1__FETCH_STATE_REQUEST__INIT;
        q.job = (char *)job;
        q.seq = seq;
        q.offset = have;
        q.max_bytes = AMX_PEER_FETCH_CHUNK;
        uint8_t *out = NULL;
        size_t olen = 0;
        amx_err_t e2 = {0};
        amx_status_t st =
            call_one(p, addr, SVC "FetchState", &q.base, deadline_ms, abort, &out, &olen, &e2);
        if (st == AMX_EUNAVAIL && have == 0 && amx_now_ms() < deadline_ms &&
            !(abort && atomic_load(abort))) {
            /* The donor is still writing its state: try again shortly. */
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        if (st != AMX_OK) {
            free(buf);
            return amx_err_set(err, st, "%s", e2.msg);
        }
        Amaxd__Peer__V1__FetchStateResponse *r =
            amaxd__peer__v1__fetch_state_response__unpack(NULL, olen, out);
        free(out);
        if (r == NULL || (total != UINT64_MAX && r->total != total) ||
            r->data.len > r->total - have || (r->data.len == 0 && have < r->total)) {
            if (r)
                amaxd__peer__v1__fetch_state_response__free_unpacked(r, NULL);
            free(buf);
            return amx_err_set(err, AMX_EINTERNAL, "the donor's state answer is inconsistent");
        }
        if (buf == NULL) {
            total = r->total;
            buf = malloc(total ? total : 1);
            if (buf == NULL) {
                amaxd__peer__v1__fetch_state_response__free_unpacked(r, NULL);
                return amx_err_set(err, AMX_ENOMEM, "out of memory for %llu bytes of state",
                                   (unsigned long long)total);
            }
        }
        if (r->data.len > 0)
            memcpy(buf + have, r->data.data, r->data.len);
        have += r->data.len;
        amaxd__peer__v1__fetch_state_response__free_unpacked(r, NULL);
    }
    *blob = buf;
    *len = (size_t)total;
    return AMX_OK;
}

/* -- parallel calls to every other participant -- */

typedef struct multi {
    bcall_t b;
    uint32_t daemon;
    const char *addr;
    int started;
} multi_t;

/* Calls `method` on every participant but `me` with `req`; waits up to
 * timeout_ms in all; fills results in m[] (done set when finished). */
static multi_t *call_all(amx_peer_t *p, const amx_membership_t *m, int me, const char *method,
                         const ProtobufCMessage *req, uint64_t timeout_ms, size_t *n)
{
    size_t len;
    uint8_t *buf = amx_codec_pack(req, &len);
    multi_t *v = calloc(m->npart ? m->npart : 1, sizeof(*v));
    if (buf == NULL || v == NULL) {
        free(buf);
        free(v);
        return NULL;
    }
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    uint64_t deadline = amx_now_ms() + timeout_ms;
    size_t pending = 0;
    for (uint32_t i = 0; i < m->npart; i++) {
        v[i].daemon = m->part[i].daemon;
        v[i].addr = m->part[i].addr;
        if ((int)i == me)
            continue;
        v[i].started =
            bcall_start(p, cq, &v[i].b, m->part[i].addr, method, buf, len, deadline) == 0;
        pending += v[i].started;
    }
    free(buf);
    while (pending > 0) {
        grpc_event ev = grpc_completion_queue_next(cq, amx_rpc_deadline(deadline + 1000), NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            break;
        ((bcall_t *)ev.tag)->done = 1;
        pending--;
    }
    for (uint32_t i = 0; i < m->npart; i++)
        if (v[i].started && !v[i].b.done)
            grpc_call_cancel(v[i].b.call, NULL);
    while (pending > 0) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            break;
        pending--;
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    *n = m->npart;
    return v;
}

static void free_all(multi_t *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (v[i].started)
            bcall_free(&v[i].b);
    free(v);
}

void amx_peer_call_progress(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                            uint64_t epoch, uint64_t timeout_ms, char *buf, size_t len)
{
    Amaxd__Peer__V1__ProgressRequest q = AMAXD__PEER__V1__PROGRESS_REQUEST__INIT;
    q.job = (char *)job;
    q.epoch = epoch;
    size_t n = 0, k = 0;
    buf[0] = '\0';
    multi_t *v = call_all(p, m, me, SVC "Progress", &q.base, timeout_ms, &n);
    if (v == NULL)
        return;
    for (size_t i = 0; i < n && k < len; i++) {
        if (!v[i].started)
            continue;
        char msg[300];
        uint8_t *out = NULL;
        size_t olen = 0;
        amx_status_t st =
            v[i].b.done ? bcall_result(&v[i].b, &out, &olen, msg, sizeof(msg)) : AMX_ETIMEDOUT;
        if (st != AMX_OK) {
            k += (size_t)snprintf(buf + k, len - k, "%sdaemon %u (%s) did not answer (%s)",
                                  k ? "; " : "", v[i].daemon, v[i].addr,
                                  st == AMX_ETIMEDOUT ? "no answer in time" : msg);
            free(out);
            continue;
        }
        Amaxd__Peer__V1__ProgressResponse *r =
            amaxd__peer__v1__progress_response__unpack(NULL, olen, out);
        free(out);
        if (r == NULL)
            continue;
        if (r->n_missing > 0) {
            char ranks[200];
            amx_fmt_ranks(ranks, sizeof(ranks), r->missing, (uint32_t)r->n_missing);
            k += (size_t)snprintf(buf + k, len - k,
                                  "%strainer rank%s %s on daemon %u (%s) did not enter Reconcile "
                                  "of epoch %llu",
                                  k ? "; " : "", r->n_missing > 1 ? "s" : "", ranks, v[i].daemon,
                                  v[i].addr, (unsigned long long)epoch);
        } else if (r->epoch != epoch && !r->in_flight) {
            k += (size_t)snprintf(buf + k, len - k, "%sdaemon %u (%s) is at epoch %llu",
                                  k ? "; " : "", v[i].daemon, v[i].addr,
                                  (unsigned long long)r->epoch);
        }
        amaxd__peer__v1__progress_response__free_unpacked(r, NULL);
    }
    free_all(v, n);
}

void amx_peer_call_abort(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                         uint64_t gen, uint64_t epoch, uint64_t agreement, uint64_t coord_inc,
                         amx_status_t code, const char *reason, uint64_t timeout_ms)
{
    Amaxd__Peer__V1__AbortRequest q = AMAXD__PEER__V1__ABORT_REQUEST__INIT;
    q.job = (char *)job;
    q.comm_generation = gen;
    q.epoch = epoch;
    q.agreement = epoch != 0 ? agreement : 0;
    q.coordinator_incarnation = epoch != 0 ? coord_inc : 0;
    q.from = p->id.rank;
    q.code = (uint32_t)amx_status_grpc(code);
    char r[760];
    snprintf(r, sizeof(r), "%s", reason);
    q.reason = r;
    size_t n = 0;
    multi_t *v = call_all(p, m, me, SVC "Abort", &q.base, timeout_ms, &n);
    if (v != NULL)
        free_all(v, n);
}

void amx_peer_watch_init(amx_peer_watch_t *w, const amx_membership_t *m, int me)
{
    /* The ring neighbours only: whoever finds a participant gone fails its
     * epoch and tells every participant (engine.c), so a cluster of N pings
     * 2N times per round, not N^2. */
    memset(w, 0, sizeof(*w));
    uint32_t n = m->npart;
    if (n < 2 || me < 0 || (uint32_t)me >= n)
        return;
    uint32_t idx[2] = {((uint32_t)me + 1) % n, ((uint32_t)me + n - 1) % n};
    for (uint32_t k = 0; k < (n > 2 ? 2u : 1u); k++) {
        const amx_part_t *q = &m->part[idx[k]];
        amx_part_t *d = &w->part[w->n];
        d->daemon = q->daemon;
        d->incarnation = q->incarnation;
        snprintf(d->addr, sizeof(d->addr), "%s", q->addr);
        amx_cluster_addr_resolve(q->addr, &w->addr[w->n]); /* n = 0: never taken for gone */
        w->n++;
    }
}

int amx_peer_call_alive(amx_peer_t *p, const amx_peer_watch_t *w, uint64_t timeout_ms, char *why,
                        size_t len)
{
    if (w->n == 0)
        return 0;
    amx_part_t parts[2];
    memcpy(parts, w->part, sizeof(parts));
    amx_membership_t sub = {.npart = w->n, .part = parts};
    Amaxd__Peer__V1__PingRequest q = AMAXD__PEER__V1__PING_REQUEST__INIT;
    q.from = p->id.rank;
    q.incarnation = p->id.incarnation;
    size_t nv = 0;
    multi_t *v = call_all(p, &sub, -1, SVC "Ping", &q.base, timeout_ms, &nv);
    int gone = 0;
    for (size_t i = 0; v != NULL && i < nv && !gone; i++) {
        if (!v[i].started || !v[i].b.done)
            continue;
        char msg[200];
        uint8_t *out = NULL;
        size_t olen = 0;
        uint64_t inc = 0;
        amx_status_t st = bcall_result(&v[i].b, &out, &olen, msg, sizeof(msg));
        if (st == AMX_OK) {
            Amaxd__Peer__V1__PingResponse *r =
                amaxd__peer__v1__ping_response__unpack(NULL, olen, out);
            inc = r != NULL ? r->incarnation : 0;
            if (r != NULL)
                amaxd__peer__v1__ping_response__free_unpacked(r, NULL);
        }
        free(out);
        /* UNAVAILABLE alone is no proof: a shared channel that saw the peer
         * down fails calls at once for its reconnect backoff, even after the
         * peer is back. A refused TCP connect is (the port is closed). */
        if (st == AMX_EUNAVAIL && amx_cluster_addrs_refuse(&w->addr[i], timeout_ms)) {
            snprintf(why, len,
                     "daemon %u (%s) is gone: nothing listens at its peer service while the "
                     "collective waited (connection refused)",
                     parts[i].daemon, parts[i].addr);
            gone = 1;
        } else if (st == AMX_OK && inc != 0 && parts[i].incarnation != 0 &&
                   inc != parts[i].incarnation) {
            snprintf(why, len,
                     "daemon %u (%s) restarted while the collective waited (incarnation %016" PRIx64
                     ", the communicator was made with %016" PRIx64 ")",
                     parts[i].daemon, parts[i].addr, inc, parts[i].incarnation);
            gone = 1;
        }
    }
    if (v != NULL)
        free_all(v, nv);
    return gone;
}

/* ======================= the watcher: who coordinates ======================= */

/* Pings the candidates below this daemon every quarter of
 * coordinator_failover_ms and names the lowest that answered within it
 * (this daemon itself when it is a candidate and none did). */
static void *watch_main(void *arg)
{
    amx_peer_t *p = arg;
    uint64_t period = p->failover_ms / 4 > 25 ? p->failover_ms / 4 : 25;
    uint64_t ping_ms = period < 1000 ? period : 1000;
    uint32_t me = p->id.rank;
    uint32_t below = me < p->ncand ? me : p->ncand;
    amx_part_t parts[AMX_MAX_COORDS];
    memset(parts, 0, sizeof(parts));
    for (uint32_t i = 0; i < below; i++) {
        parts[i].daemon = i;
        snprintf(parts[i].addr, sizeof(parts[i].addr), "%s", p->id.coords[i]);
    }
    amx_membership_t m = {0};
    m.npart = below;
    m.part = parts;
    Amaxd__Peer__V1__PingRequest q = AMAXD__PEER__V1__PING_REQUEST__INIT;
    q.from = me;
    q.incarnation = p->id.incarnation;
    int none_logged = 0, first = 1;
    uint8_t ever[AMX_MAX_COORDS] = {0}; /* answered since this daemon started */
    pthread_mutex_lock(&p->co_mu);
    while (!p->w_stop) {
        /* The first round at once: a daemon that starts while another
         * candidate coordinates finds it without waiting. */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t wait_ms = first ? 0 : period;
        first = 0;
        ts.tv_sec += (time_t)(wait_ms / 1000);
        ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        if (wait_ms > 0)
            pthread_cond_timedwait(&p->co_cv, &p->co_mu, &ts);
        if (p->w_stop)
            break;
        pthread_mutex_unlock(&p->co_mu);
        size_t n = 0;
        multi_t *v = call_all(p, &m, -1, SVC "Ping", &q.base, ping_ms, &n);
        uint64_t now = amx_now_ms();
        uint32_t serving = UINT32_MAX; /* the lowest candidate that says it coordinates */
        pthread_mutex_lock(&p->co_mu);
        for (size_t i = 0; v != NULL && i < n; i++) {
            char msg[200];
            uint8_t *out = NULL;
            size_t olen = 0;
            if (!v[i].started || !v[i].b.done ||
                bcall_result(&v[i].b, &out, &olen, msg, sizeof(msg)) != AMX_OK) {
                free(out);
                continue;
            }
            p->last_ok[i] = now;
            ever[i] = 1;
            Amaxd__Peer__V1__PingResponse *r =
                amaxd__peer__v1__ping_response__unpack(NULL, olen, out);
            free(out);
            if (r != NULL && r->coordinating && serving == UINT32_MAX)
                serving = (uint32_t)i;
            if (r != NULL)
                amaxd__peer__v1__ping_response__free_unpacked(r, NULL);
        }
        if (v != NULL)
            free_all(v, n);
        uint32_t best = me < p->ncand ? me : UINT32_MAX;
        for (uint32_t i = 0; i < below; i++) {
            /* A candidate that coordinates while those below it never
             * answered this daemon is taken at once, grace or not. */
            if (i == serving) {
                best = i;
                break;
            }
            if (now - p->last_ok[i] < p->failover_ms && (ever[i] || serving == UINT32_MAX)) {
                best = i;
                break;
            }
        }
        if (best == UINT32_MAX) {
            /* Not a candidate and none answers: keep the last one. */
            if (!none_logged)
                AMX_ERROR("peer",
                          "no coordinator candidate answered within %llu ms; calls to the "
                          "coordinator go to daemon %u (%s) until one does",
                          (unsigned long long)p->failover_ms, p->cur, p->id.coords[p->cur]);
            none_logged = 1;
            continue;
        }
        none_logged = 0;
        if (best != p->cur) {
            uint32_t old = p->cur;
            if (best > old)
                AMX_WARN("peer",
                         "coordinator daemon %u (%s) did not answer for %llu ms: daemon %u (%s) "
                         "takes its role",
                         old, p->id.coords[old], (unsigned long long)(now - p->last_ok[old]), best,
                         p->id.coords[best]);
            else
                AMX_WARN("peer",
                         "daemon %u (%s) answers again: it takes the coordinator's role back "
                         "from daemon %u",
                         best, p->id.coords[best], old);
            p->cur = best;
            atomic_fetch_add(&p->co_gen, 1);
        }
        atomic_store(&p->want_active, best == me);
    }
    pthread_mutex_unlock(&p->co_mu);
    return NULL;
}
