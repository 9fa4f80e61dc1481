/*
 * fuzz_requests - libFuzzer target over request decoding and validation of
 * every amaxd method, in process and without gRPC (tests/fuzz/README.md).
 *
 * Input: one byte that picks a method (trainer methods, then the peer
 * service's), then the request bytes. Each input goes through what rpc.c
 * does with a request: the wire check (wire.h) with the daemon's limits,
 * protobuf-c unpacking, and, for the trainer methods, the real handler of
 * service.c against a real registry (host backend, one daemon) whose jobs
 * persist from input to input, so that sequences of Join, Register,
 * SendAmax, Reconcile and GetScales reach deep states. The peer service's
 * handlers run too, on a daemon that is its own cluster of one (they stop
 * at authentication: the harness sends no token).
 *
 * Oracles, besides the sanitizers: a request the wire check accepts must
 * unpack; its unpacked size must stay within the wire check's estimate; a
 * SendAmax request read in place (amx_codec_send_parse) must equal its
 * unpacking field for field; an answer must be a valid gRPC status and
 * pack within max_message_bytes.
 *
 * AMAXD_FUZZ_LIST=1 prints the method table (tests/fuzz/make_seeds.py
 * uses it) and exits.
 */
#include <protobuf-c/protobuf-c.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "amaxd/v1/amaxd.pb-c.h"
#include "clock.h"
#include "config.h"
#include "log.h"
#include "peer.h"
#include "registry.h"
#include "rpc.h"
#include "service.h"
#include "wire.h"

/* ---- the call, as rpc.c would have it ---- */

struct amx_call {
    amx_waiter_t waiter; /* first member, as in rpc.c */
    amx_arena_t arena;
    int replied;
    amx_status_t st;
};

static const amx_config_t *g_cfg;

void amx__call_reply(amx_call_t *c, amx_status_t st, const char *msg, const ProtobufCMessage *resp)
{
    if (c->replied)
        abort(); /* answered twice */
    c->replied = 1;
    c->st = st;
    if (amx_status_grpc(st) < 0 || amx_status_grpc(st) > 16)
        abort();
    if (st != AMX_OK && (msg == NULL || msg[0] == '\0'))
        abort(); /* every error says why */
    if (st == AMX_OK && resp != NULL) {
        size_t len = protobuf_c_message_get_packed_size(resp);
        if ((int64_t)len > g_cfg->max_message_bytes)
            abort(); /* the registry sizes answers before building them */
        uint8_t *buf = malloc(len ? len : 1);
        if (buf == NULL || protobuf_c_message_pack(resp, buf) != len)
            abort();
        free(buf);
    }
}

void amx__call_reply_raw(amx_call_t *c, uint8_t *buf, size_t len, void (*release)(void *), void *ud)
{
    if (c->replied)
        abort(); /* answered twice */
    c->replied = 1;
    c->st = AMX_OK;
    if ((int64_t)len > g_cfg->max_message_bytes)
        abort(); /* the registry sizes answers before building them */
    /* A packed answer must be a valid message of the protobuf. */
    ProtobufCMessage *m = protobuf_c_message_unpack(
        &amaxd__v1__reconcile_packed_response__descriptor, NULL, len, buf);
    if (m == NULL)
        abort();
    protobuf_c_message_free_unpacked(m, NULL);
    if (release != NULL)
        release(ud);
    else
        free(buf);
}

amx_waiter_t *amx__call_waiter(amx_call_t *c)
{
    return &c->waiter;
}

amx_call_t *amx__waiter_call(amx_waiter_t *w)
{
    return (amx_call_t *)w;
}

amx_arena_t *amx__call_arena(amx_call_t *c)
{
    return &c->arena;
}

const char *amx__call_metadata(amx_call_t *c, const char *key, size_t *len)
{
    (void)c, (void)key, (void)len;
    return NULL;
}

void amx__call_peer(amx_call_t *c, char *buf, size_t len)
{
    (void)c;
    snprintf(buf, len, "fuzz");
}

const char *amx__call_method(amx_call_t *c)
{
    (void)c;
    return "fuzz";
}

/* The loop's client calls (peer.c) are never made by one daemon. */
amx_status_t amx_rpc_call(amx_rpc_t *rpc, grpc_channel *ch, const char *method, const uint8_t *req,
                          size_t len, const char *md_key, const char *md_val, uint64_t deadline_ms,
                          amx_ccall_cb cb, void *ud, amx_ccall_t **out, amx_err_t *err)
{
    (void)rpc, (void)ch, (void)method, (void)req, (void)len, (void)md_key, (void)md_val;
    (void)deadline_ms, (void)cb, (void)ud, (void)out, (void)err;
    abort();
}

void amx_rpc_call_cancel(amx_rpc_t *rpc, amx_ccall_t *cc)
{
    (void)rpc, (void)cc;
    abort();
}

gpr_timespec amx_rpc_deadline(uint64_t deadline_ms)
{
    (void)deadline_ms;
    return gpr_inf_future(GPR_CLOCK_MONOTONIC);
}

/* ---- unpacking, counted ---- */

static size_t g_alloc;

static void *count_alloc(void *ud, size_t n)
{
    (void)ud;
    g_alloc += n + 32; /* the same malloc cost wire.c assumes */
    return malloc(n);
}

static void count_free(void *ud, void *p)
{
    (void)ud;
    free(p);
}

static ProtobufCAllocator g_counting = {count_alloc, count_free, NULL};

/* ---- the daemon ---- */

static uv_loop_t g_loop;
static amx_config_t g_config;
static amx_registry_t *g_reg;
static amx_cluster_id_t g_id;
static amx_cluster_t *g_cluster;
static amx_coord_t *g_coord;
static amx_peer_t *g_peer;
static amx_svc_t g_svc;

typedef struct {
    const char *path;
    const ProtobufCMessageDescriptor *desc;
    const amx_method_t *m;
} entry_t;

static entry_t g_tab[64];
static size_t g_n;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    for (size_t i = 0; i < amx__n_methods && g_n < 64; i++)
        g_tab[g_n++] = (entry_t){amx__methods[i].path, amx__methods[i].request, &amx__methods[i]};
    for (size_t i = 0; i < amx__n_peer_methods && g_n < 64; i++)
        g_tab[g_n++] = (entry_t){amx__peer_methods[i].path, amx__peer_methods[i].request,
                                 &amx__peer_methods[i]};
    if (getenv("AMAXD_FUZZ_LIST") != NULL) {
        for (size_t i = 0; i < g_n; i++)
            printf("%zu %s\n", i, g_tab[i].path);
        exit(0);
    }
    amx_config_init(&g_config);
    amx_err_t err = {0};
    static const char *const set[][2] = {
        {"max_message_bytes", "65536"}, {"max_cells", "65536"},
        {"max_quantizers", "512"},      {"max_jobs", "4"},
        {"max_world_size", "8"},        {"max_request_memory", "4194304"},
        {"memory_budget", "16777216"},  {"join_timeout_ms", "50"},
        {"reconcile_timeout_ms", "50"}, {"job_idle_timeout_ms", "0"},
    };
    for (size_t i = 0; i < sizeof(set) / sizeof(set[0]); i++)
        if (amx_config_set(&g_config, set[i][0], set[i][1], &err) != AMX_OK) {
            fprintf(stderr, "fuzz: %s\n", err.msg);
            exit(2);
        }
    g_cfg = &g_config;
    amx_log_level = getenv("AMAXD_FUZZ_LOG") ? AMX_LOG_DEBUG : -1;
    uv_loop_init(&g_loop);
    if (amx_cluster_resolve(&g_config, (const char *(*)(const char *))getenv, &g_id, &err) !=
            AMX_OK ||
        amx_cluster_create(&g_config, &g_id, &g_cluster, &err) != AMX_OK ||
        (g_coord = amx_coord_create(g_id.incarnation, 50)) == NULL ||
        amx_peer_create(&g_loop, &g_config, g_cluster, g_coord, &g_peer, &err) != AMX_OK ||
        amx_registry_create(&g_loop, &g_config, "host", g_peer, &g_reg, &err) != AMX_OK) {
        fprintf(stderr, "fuzz: %s\n", err.msg);
        exit(2);
    }
    g_svc.reg = g_reg;
    g_svc.peer = g_peer;
    g_svc.cluster = g_cluster;
    g_svc.coord = g_coord;
    g_svc.cfg = &g_config;
    return 0;
}

/* Runs the loop until the call is answered (an epoch on the engine
 * thread), at most about 200 ms; then gives up on it as a client would. */
static void settle(amx_call_t *c)
{
    for (int i = 0; i < 200 && !c->replied && c->waiter.job != NULL; i++) {
        uv_run(&g_loop, UV_RUN_NOWAIT);
        if (!c->replied && c->waiter.job != NULL) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    if (!c->replied && c->waiter.job != NULL)
        amx_registry_cancel(g_reg, &c->waiter);
    amx_registry_expire(g_reg, amx_now_ms());
    uv_run(&g_loop, UV_RUN_NOWAIT);
}

/* SendAmax is read in place (amx_codec_send_parse): it must mean what
 * protobuf-c's unpacking means, field for field. */
static int same_bytes(const uint8_t *a, size_t na, const uint8_t *b, size_t nb)
{
    return na == nb && (na == 0 || memcmp(a, b, na) == 0);
}

static void same_as_protobuf_c(const uint8_t *p, size_t n, const Amaxd__V1__SendAmaxRequest *m)
{
    amx_send_req_t q;
    amx_err_t err = {0};
    if (amx_codec_send_parse(&g_svc.scratch, p, n, &q, &err) != AMX_OK)
        return; /* out of memory: nothing to compare */
    if (strcmp(q.job, m->job) != 0 || q.rank != m->rank || q.epoch != m->epoch ||
        q.n != m->n_updates)
        abort();
    for (size_t i = 0; i < q.n; i++) {
        const Amaxd__V1__AmaxUpdate *x = m->updates[i];
        const amx_update_in_t *u = &q.u[i];
        if (strcmp(u->name, x->name) != 0 ||
            !same_bytes(u->values, u->values_len, x->values.data, x->values.len) ||
            !same_bytes(u->has_data, u->has_data_len, x->has_data.data, x->has_data.len))
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const entry_t *e = &g_tab[data[0] % g_n];
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    amx_wire_limits_t lim = {
        (uint64_t)g_config.max_request_memory, (uint64_t)g_config.max_quantizers,
        (uint64_t)(g_config.max_world_size > 64 ? g_config.max_world_size : 64), 8};
    amx_err_t err = {0};
    uint64_t est = 0;
    if (amx_wire_check(e->desc, p, n, &lim, &est, &err) != AMX_OK) {
        if (err.msg[0] == '\0')
            abort();
        return 0;
    }
    g_alloc = 0;
    ProtobufCMessage *m = protobuf_c_message_unpack(e->desc, &g_counting, n, p);
    if (m == NULL)
        abort(); /* the wire check let through what protobuf-c refuses */
    if (g_alloc > est)
        abort(); /* the estimate is an upper bound */
    if (e->desc == &amaxd__v1__send_amax_request__descriptor)
        same_as_protobuf_c(p, n, (const Amaxd__V1__SendAmaxRequest *)(const void *)m);
    {
        amx_call_t c;
        memset(&c, 0, sizeof(c));
        if (e->m->raw != NULL || e->m->raw_stream != NULL) {
            /* Read without protobuf-c, in place: a writable copy. */
            uint8_t *copy = malloc(n ? n : 1);
            if (copy == NULL)
                abort();
            memcpy(copy, p, n);
            uint64_t accepted = 0, epoch = 0;
            if (e->m->raw != NULL) {
                e->m->raw(&g_svc, &c, copy, n);
                if (!c.replied)
                    abort(); /* a unary raw method answers at once */
            } else {
                e->m->raw_stream(&g_svc, copy, n, &accepted, &epoch, &err);
            }
            free(copy);
        } else {
            e->m->handler(&g_svc, &c, m);
            settle(&c);
        }
        amx_arena_free(&c.arena);
    }
    protobuf_c_message_free_unpacked(m, &g_counting);
    return 0;
}
