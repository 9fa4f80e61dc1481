/*
 * test_registry.c - jobs, placement merge, validation, epochs, accumulation,
 * peer fill and scale groups, on the host backend, without gRPC.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "registry.h"

/* Everything a test allocates is tracked and freed at teardown, so that
 * LeakSanitizer sees only the registry's own leaks, if any. */
static void *tracked[4096];
static size_t ntracked;
static ProtobufCMessage *msgs[256];
static size_t nmsgs;

static void *track(void *p)
{
    ck_assert_uint_lt(ntracked, 4096);
    tracked[ntracked++] = p;
    return p;
}

static void *track_msg(ProtobufCMessage *m)
{
    ck_assert_ptr_nonnull(m);
    msgs[nmsgs++] = m;
    return m;
}

/* A waiter that records its outcome; the response is kept packed. */
typedef struct rec {
    amx_waiter_t w;
    int called;
    amx_status_t st;
    char msg[1024];
    uint8_t *packed;
    size_t len;
} rec_t;

static void rec_done(amx_waiter_t *w, amx_status_t st, const char *msg, const ProtobufCMessage *r)
{
    rec_t *x = (rec_t *)w;
    x->called++;
    x->st = st;
    snprintf(x->msg, sizeof(x->msg), "%s", msg ? msg : "");
    if (r != NULL) {
        x->len = protobuf_c_message_get_packed_size(r);
        x->packed = track(malloc(x->len ? x->len : 1));
        protobuf_c_message_pack(r, x->packed);
    }
}

static void rec_init(rec_t *x)
{
    memset(x, 0, sizeof(*x));
    x->w.done = rec_done;
}

static amx_config_t cfg;
static amx_registry_t *reg;

static void setup(void)
{
    amx_err_t err = {0};
    amx_config_init(&cfg);
    amx_config_set(&cfg, "log_level", "error", &err);
    amx_log_level = AMX_LOG_ERROR;
    amx_config_set(&cfg, "join_timeout_ms", "1000", &err);
    amx_config_set(&cfg, "reconcile_timeout_ms", "1000", &err);
    ck_assert_int_eq(amx_registry_create(&cfg, "host", &reg, &err), AMX_OK);
}

static void teardown(void)
{
    amx_registry_destroy(reg);
    for (size_t i = 0; i < nmsgs; i++)
        protobuf_c_message_free_unpacked(msgs[i], NULL);
    for (size_t i = 0; i < ntracked; i++)
        free(tracked[i]);
    nmsgs = ntracked = 0;
    amx_config_free(&cfg);
}

static void join_all(const char *job, uint32_t world)
{
    for (uint32_t r = 0; r < world; r++) {
        rec_t *x = track(calloc(1, sizeof(*x)));
        rec_init(x);
        Amaxd__V1__JoinRequest req = AMAXD__V1__JOIN_REQUEST__INIT;
        req.job = (char *)job;
        req.rank = r;
        req.world_size = world;
        amx_err_t err = {0};
        ck_assert_int_eq(amx_registry_join(reg, &req, &x->w, 0, &err), AMX_OK);
    }
}

static Amaxd__V1__Recipe fp8 = AMAXD__V1__RECIPE__INIT;

/* Registers one quantizer for `rank`; returns the status. */
static amx_status_t reg1(const char *job, uint32_t rank, const char *name, uint32_t ndim,
                         const uint32_t *shape, const uint32_t *off, const uint32_t *lshape,
                         const char *peer, const char *scale, Amaxd__V1__Recipe *recipe, int acc,
                         amx_err_t *err)
{
    Amaxd__V1__QuantizerSpec s = AMAXD__V1__QUANTIZER_SPEC__INIT, *ps = &s;
    s.name = (char *)name;
    s.n_global_shape = ndim;
    s.global_shape = (uint32_t *)shape;
    if (off != NULL) {
        s.n_offset = s.n_local_shape = ndim;
        s.offset = (uint32_t *)off;
        s.local_shape = (uint32_t *)lshape;
    }
    s.peer_group = (char *)(peer ? peer : "");
    s.scale_group = (char *)(scale ? scale : "");
    s.recipe = recipe ? recipe : &fp8;
    s.accumulation = acc;
    Amaxd__V1__RegisterRequest req = AMAXD__V1__REGISTER_REQUEST__INIT;
    req.job = (char *)job;
    req.rank = rank;
    req.n_quantizers = 1;
    req.quantizers = &ps;
    Amaxd__V1__RegisterResponse resp = AMAXD__V1__REGISTER_RESPONSE__INIT;
    return amx_registry_register(reg, &req, &resp, err);
}

static amx_status_t send1(const char *job, uint32_t rank, uint64_t epoch, const char *name,
                          const float *v, size_t n, amx_err_t *err)
{
    Amaxd__V1__AmaxUpdate u = AMAXD__V1__AMAX_UPDATE__INIT, *pu = &u;
    u.name = (char *)name;
    u.values.data = (uint8_t *)v;
    u.values.len = n * sizeof(float);
    Amaxd__V1__SendAmaxRequest req = AMAXD__V1__SEND_AMAX_REQUEST__INIT;
    req.job = (char *)job;
    req.rank = rank;
    req.epoch = epoch;
    req.n_updates = 1;
    req.updates = &pu;
    Amaxd__V1__SendAmaxResponse resp = AMAXD__V1__SEND_AMAX_RESPONSE__INIT;
    return amx_registry_send(reg, &req, &resp, err);
}

/* All `world` ranks reconcile; returns rank `want`'s unpacked response. */
static Amaxd__V1__ReconcileResponse *reconcile_all(const char *job, uint32_t world, uint32_t want)
{
    rec_t *x = track(calloc(world, sizeof(rec_t)));
    for (uint32_t r = 0; r < world; r++) {
        rec_init(&x[r]);
        Amaxd__V1__ReconcileRequest req = AMAXD__V1__RECONCILE_REQUEST__INIT;
        req.job = (char *)job;
        req.rank = r;
        amx_err_t err = {0};
        ck_assert_int_eq(amx_registry_reconcile(reg, &req, &x[r].w, 0, &err), AMX_OK);
    }
    for (uint32_t r = 0; r < world; r++) {
        ck_assert_int_eq(x[r].called, 1);
        ck_assert_msg(x[r].st == AMX_OK, "rank %u: %s", r, x[r].msg);
    }
    return track_msg(protobuf_c_message_unpack(&amaxd__v1__reconcile_response__descriptor, NULL,
                                               x[want].len, x[want].packed));
}

static const Amaxd__V1__QuantizerResult *find(const Amaxd__V1__ReconcileResponse *r,
                                              const char *name)
{
    for (size_t i = 0; i < r->n_results; i++)
        if (!strcmp(r->results[i]->name, name))
            return r->results[i];
    ck_abort_msg("no result for %s", name);
    return NULL;
}

static float cell(const ProtobufCBinaryData *b, size_t i)
{
    float f;
    memcpy(&f, b->data + 4 * i, 4);
    return f;
}

START_TEST(join_world_one_completes_at_once)
{
    rec_t x;
    rec_init(&x);
    Amaxd__V1__JoinRequest req = AMAXD__V1__JOIN_REQUEST__INIT;
    req.job = "j";
    req.world_size = 1;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &x.w, 0, &err), AMX_OK);
    ck_assert_int_eq(x.called, 1);
    ck_assert_int_eq(x.st, AMX_OK);
    ck_assert_uint_eq(amx_registry_waiting(reg), 0);
}
END_TEST

START_TEST(join_waits_for_all_then_rejoin)
{
    rec_t a, b, c;
    rec_init(&a), rec_init(&b), rec_init(&c);
    Amaxd__V1__JoinRequest req = AMAXD__V1__JOIN_REQUEST__INIT;
    req.job = "j";
    req.world_size = 2;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &a.w, 0, &err), AMX_OK);
    ck_assert_int_eq(a.called, 0);
    /* The same rank again while waiting: refused, first call untouched. */
    ck_assert_int_eq(amx_registry_join(reg, &req, &c.w, 0, &err), AMX_EPRECOND);
    req.rank = 1;
    ck_assert_int_eq(amx_registry_join(reg, &req, &b.w, 0, &err), AMX_OK);
    ck_assert_int_eq(a.called, 1);
    ck_assert_int_eq(b.called, 1);
    /* A restarted rank re-joins a ready job at once. */
    rec_init(&c);
    ck_assert_int_eq(amx_registry_join(reg, &req, &c.w, 0, &err), AMX_OK);
    Amaxd__V1__JoinResponse *jr = (void *)protobuf_c_message_unpack(
        &amaxd__v1__join_response__descriptor, NULL, c.len, c.packed);
    ck_assert(jr->rejoined);
    protobuf_c_message_free_unpacked(&jr->base, NULL);
    /* Another world size for the same job is a conflict. */
    req.world_size = 4;
    amx_err_clear(&err);
    ck_assert_int_eq(amx_registry_join(reg, &req, &c.w, 0, &err), AMX_EPRECOND);
    ck_assert_ptr_nonnull(strstr(err.msg, "world size 2"));
}
END_TEST

START_TEST(join_timeout_names_missing_ranks)
{
    rec_t a;
    rec_init(&a);
    Amaxd__V1__JoinRequest req = AMAXD__V1__JOIN_REQUEST__INIT;
    req.job = "j";
    req.world_size = 3;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &a.w, 100, &err), AMX_OK);
    amx_registry_expire(reg, 1099);
    ck_assert_int_eq(a.called, 0);
    amx_registry_expire(reg, 1100);
    ck_assert_int_eq(a.called, 1);
    ck_assert_int_eq(a.st, AMX_ETIMEDOUT);
    ck_assert_msg(strstr(a.msg, "ranks 1, 2 never joined") != NULL, "%s", a.msg);
    /* The job is gone: a new world size is accepted. */
    rec_init(&a);
    req.world_size = 1;
    ck_assert_int_eq(amx_registry_join(reg, &req, &a.w, 0, &err), AMX_OK);
    ck_assert_int_eq(a.st, AMX_OK);
}
END_TEST

START_TEST(cancelled_join_leaves_no_trace)
{
    rec_t a;
    rec_init(&a);
    Amaxd__V1__JoinRequest req = AMAXD__V1__JOIN_REQUEST__INIT;
    req.job = "j";
    req.world_size = 2;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &a.w, 0, &err), AMX_OK);
    amx_registry_cancel(reg, &a.w);
    ck_assert_int_eq(a.called, 0);
    ck_assert_uint_eq(amx_registry_waiting(reg), 0);
    Amaxd__V1__StatusRequest sreq = AMAXD__V1__STATUS_REQUEST__INIT;
    Amaxd__V1__StatusResponse sresp = AMAXD__V1__STATUS_RESPONSE__INIT;
    amx_arena_t ar = {0};
    ck_assert_int_eq(amx_registry_status(reg, &sreq, &sresp, &ar, &err), AMX_OK);
    ck_assert_uint_eq(sresp.n_jobs, 0);
    amx_arena_free(&ar);
}
END_TEST

START_TEST(column_parallel_merge_and_slices)
{
    uint32_t g[1] = {8}, l[1] = {4}, o0[1] = {0}, o1[1] = {4};
    amx_err_t err = {0};
    join_all("j", 2);
    ck_assert_int_eq(reg1("j", 0, "w", 1, g, o0, l, NULL, NULL, NULL, 0, &err), AMX_OK);
    ck_assert_int_eq(reg1("j", 1, "w", 1, g, o1, l, NULL, NULL, NULL, 0, &err), AMX_OK);
    float v0[4] = {1, 2, 3, 4}, v1[4] = {5, 6, 7, 8}, v1b[4] = {9, 0, 0, 0};
    ck_assert_int_eq(send1("j", 0, 0, "w", v0, 4, &err), AMX_OK);
    ck_assert_int_eq(send1("j", 1, 1, "w", v1, 4, &err), AMX_OK);
    ck_assert_int_eq(send1("j", 1, 0, "w", v1b, 4, &err), AMX_OK); /* max-merged */
    Amaxd__V1__ReconcileResponse *r = reconcile_all("j", 2, 1);
    const Amaxd__V1__QuantizerResult *q = find(r, "w");
    ck_assert_uint_eq(q->offset[0], 4);
    ck_assert_float_eq(cell(&q->amax, 0), 9.0f);
    ck_assert_float_eq(cell(&q->amax, 3), 8.0f);
    ck_assert_float_eq(q->global_amax, 9.0f);
    ck_assert_float_eq(cell(&q->scale, 1), 448.0f / 6.0f);
    ck_assert_uint_eq(q->missing, 0);
    ck_assert_uint_eq(r->epoch, 1);
    ck_assert_uint_eq(r->next_epoch, 2);
}
END_TEST

START_TEST(block_placement_2d)
{
    /* [4, 6] per-block amax, split along dim 1 (row-parallel). */
    uint32_t g[2] = {4, 6}, l[2] = {4, 3}, o0[2] = {0, 0}, o1[2] = {0, 3};
    amx_err_t err = {0};
    join_all("j", 2);
    ck_assert_int_eq(reg1("j", 0, "b", 2, g, o0, l, NULL, NULL, NULL, 0, &err), AMX_OK);
    ck_assert_int_eq(reg1("j", 1, "b", 2, g, o1, l, NULL, NULL, NULL, 0, &err), AMX_OK);
    float v0[12], v1[12];
    for (int i = 0; i < 12; i++)
        v0[i] = (float)(i + 1), v1[i] = (float)(100 + i);
    ck_assert_int_eq(send1("j", 0, 0, "b", v0, 12, &err), AMX_OK);
    ck_assert_int_eq(send1("j", 1, 0, "b", v1, 12, &err), AMX_OK);
    reconcile_all("j", 2, 0);
    Amaxd__V1__GetScalesRequest gr = AMAXD__V1__GET_SCALES_REQUEST__INIT;
    gr.job = "j";
    gr.global = 1;
    Amaxd__V1__GetScalesResponse resp = AMAXD__V1__GET_SCALES_RESPONSE__INIT;
    amx_arena_t ar = {0};
    ck_assert_int_eq(amx_registry_get_scales(reg, &gr, &resp, &ar, &err), AMX_OK);
    const Amaxd__V1__QuantizerResult *q = resp.results[0];
    /* Row 1 of the global tensor: rank 0's row 1 then rank 1's row 1. */
    ck_assert_float_eq(cell(&q->amax, 6), 4.0f);
    ck_assert_float_eq(cell(&q->amax, 8), 6.0f);
    ck_assert_float_eq(cell(&q->amax, 9), 103.0f);
    ck_assert_float_eq(cell(&q->amax, 23), 111.0f);
    amx_arena_free(&ar);
}
END_TEST

START_TEST(peer_fill_and_scale_group)
{
    uint32_t g[1] = {1};
    amx_err_t err = {0};
    join_all("j", 1);
    const char *names[] = {"e0", "e1", "e2"};
    for (int i = 0; i < 3; i++)
        ck_assert_int_eq(
            reg1("j", 0, names[i], 1, g, NULL, NULL, "layer0.fc2", NULL, NULL, 0, &err), AMX_OK);
    ck_assert_int_eq(reg1("j", 0, "q", 0, NULL, NULL, NULL, NULL, "qkv", NULL, 0, &err), AMX_OK);
    ck_assert_int_eq(reg1("j", 0, "k", 0, NULL, NULL, NULL, NULL, "qkv", NULL, 0, &err), AMX_OK);
    float a = 2.0f, b = 5.0f, q = 1.0f, k = 7.0f;
    ck_assert_int_eq(send1("j", 0, 0, "e0", &a, 1, &err), AMX_OK);
    ck_assert_int_eq(send1("j", 0, 0, "e1", &b, 1, &err), AMX_OK);
    ck_assert_int_eq(send1("j", 0, 0, "q", &q, 1, &err), AMX_OK);
    ck_assert_int_eq(send1("j", 0, 0, "k", &k, 1, &err), AMX_OK);
    Amaxd__V1__ReconcileResponse *r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(cell(&find(r, "e2")->amax, 0), 5.0f); /* never fed: group max */
    ck_assert_uint_eq(find(r, "e2")->missing, 0);
    ck_assert_float_eq(cell(&find(r, "e0")->amax, 0), 2.0f); /* fed: its own */
    ck_assert_float_eq(cell(&find(r, "q")->amax, 0), 1.0f);
    ck_assert_float_eq(find(r, "q")->global_amax, 7.0f); /* shared with k */
    ck_assert_float_eq(find(r, "q")->global_scale, 64.0f);
}
END_TEST

START_TEST(bad_updates_change_nothing)
{
    uint32_t g[1] = {2};
    amx_err_t err = {0};
    join_all("j", 2);
    ck_assert_int_eq(reg1("j", 0, "w", 1, g, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    float good[2] = {1, 1}, nan2[2] = {3, NAN}, neg[2] = {3, -1}, inf[2] = {INFINITY, 3};
#define EXPECT(call, code)                                                                         \
    do {                                                                                           \
        amx_err_clear(&err);                                                                       \
        ck_assert_int_eq((call), (code));                                                          \
        ck_assert_msg(err.msg[0] != '\0', "no message");                                           \
    } while (0)
    ck_assert_int_eq(send1("j", 0, 0, "w", good, 2, &err), AMX_OK);
    EXPECT(send1("j", 0, 0, "w", nan2, 2, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "value[1] = nan"));
    EXPECT(send1("j", 0, 0, "w", neg, 2, &err), AMX_EINVAL);
    EXPECT(send1("j", 0, 0, "w", inf, 2, &err), AMX_EINVAL);
    EXPECT(send1("j", 0, 0, "w", good, 1, &err), AMX_EINVAL);
    EXPECT(send1("j", 0, 0, "nope", good, 2, &err), AMX_ENOTFOUND);
    EXPECT(send1("j", 1, 0, "w", good, 2, &err), AMX_EPRECOND); /* rank 1 has no placement */
    EXPECT(send1("j", 0, 9, "w", good, 2, &err), AMX_EPRECOND); /* epoch not open */
    EXPECT(send1("j", 5, 0, "w", good, 2, &err), AMX_EINVAL);   /* rank out of range */
    EXPECT(send1("zz", 0, 0, "w", good, 2, &err), AMX_ENOTFOUND);
    Amaxd__V1__ReconcileResponse *r = reconcile_all("j", 2, 0);
    ck_assert_float_eq(cell(&find(r, "w")->amax, 0), 1.0f);
    ck_assert_float_eq(cell(&find(r, "w")->amax, 1), 1.0f);
    /* Epoch 1 is closed now. */
    EXPECT(send1("j", 0, 1, "w", good, 2, &err), AMX_EPRECOND);
    ck_assert_ptr_nonnull(strstr(err.msg, "already reconciled"));
}
END_TEST

START_TEST(register_is_atomic_and_checks_conflicts)
{
    uint32_t g[1] = {4}, g2[1] = {8}, off[1] = {2}, l[1] = {4};
    amx_err_t err = {0};
    join_all("j", 2);
    /* A bad placement: nothing registered. */
    ck_assert_int_eq(reg1("j", 0, "w", 1, g, off, l, NULL, NULL, NULL, 0, &err), AMX_EINVAL);
    ck_assert_int_eq(reg1("j", 0, "w", 1, g, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    ck_assert_int_eq(reg1("j", 1, "w", 1, g, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    amx_err_clear(&err);
    ck_assert_int_eq(reg1("j", 1, "w", 1, g2, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_EPRECOND);
    ck_assert_ptr_nonnull(strstr(err.msg, "global shape [4]"));
    Amaxd__V1__Recipe nv = AMAXD__V1__RECIPE__INIT;
    nv.format = AMAXD__V1__FORMAT__NVFP4;
    ck_assert_int_eq(reg1("j", 1, "w", 1, g, NULL, NULL, NULL, NULL, &nv, 0, &err), AMX_EPRECOND);
    /* Two specs, the second bad: the first is not registered either. */
    Amaxd__V1__QuantizerSpec s1 = AMAXD__V1__QUANTIZER_SPEC__INIT,
                             s2 = AMAXD__V1__QUANTIZER_SPEC__INIT;
    s1.name = "ok";
    s1.recipe = &fp8;
    s2.name = "bad name";
    s2.recipe = &fp8;
    Amaxd__V1__QuantizerSpec *ps[2] = {&s1, &s2};
    Amaxd__V1__RegisterRequest req = AMAXD__V1__REGISTER_REQUEST__INIT;
    req.job = "j";
    req.n_quantizers = 2;
    req.quantizers = ps;
    Amaxd__V1__RegisterResponse resp = AMAXD__V1__REGISTER_RESPONSE__INIT;
    ck_assert_int_eq(amx_registry_register(reg, &req, &resp, &err), AMX_EINVAL);
    Amaxd__V1__ListQuantizersRequest lr = AMAXD__V1__LIST_QUANTIZERS_REQUEST__INIT;
    lr.job = "j";
    Amaxd__V1__ListQuantizersResponse lresp = AMAXD__V1__LIST_QUANTIZERS_RESPONSE__INIT;
    amx_arena_t ar = {0};
    ck_assert_int_eq(amx_registry_list(reg, &lr, &lresp, &ar, &err), AMX_OK);
    ck_assert_uint_eq(lresp.n_quantizers, 1);
    amx_arena_free(&ar);
    /* Recipe checks. */
    Amaxd__V1__Recipe bad = AMAXD__V1__RECIPE__INIT;
    ck_assert_int_eq(reg1("j", 0, "r0", 0, NULL, NULL, NULL, NULL, NULL, &bad, 0, &err),
                     AMX_EINVAL);
    bad.format = AMAXD__V1__FORMAT__FP8_E4M3;
    bad.history_len = 4; /* needs DELAYED + PER_EPOCH */
    ck_assert_int_eq(reg1("j", 0, "r1", 0, NULL, NULL, NULL, NULL, NULL, &bad, 0, &err),
                     AMX_EINVAL);
    bad.history_len = 0;
    bad.margin = NAN;
    ck_assert_int_eq(reg1("j", 0, "r2", 0, NULL, NULL, NULL, NULL, NULL, &bad, 0, &err),
                     AMX_EINVAL);
}
END_TEST

START_TEST(running_max_and_per_epoch_history)
{
    amx_err_t err = {0};
    join_all("j", 1);
    Amaxd__V1__Recipe del = AMAXD__V1__RECIPE__INIT;
    del.format = AMAXD__V1__FORMAT__FP8_E4M3;
    del.rule = AMAXD__V1__SCALE_RULE__DELAYED;
    del.history_len = 2;
    ck_assert_int_eq(reg1("j", 0, "run", 0, NULL, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    ck_assert_int_eq(reg1("j", 0, "hist", 0, NULL, NULL, NULL, NULL, NULL, &del,
                          AMAXD__V1__ACCUMULATION__PER_EPOCH, &err),
                     AMX_OK);
    float seq[3] = {4, 2, 1}, expect_run[3] = {4, 4, 4}, expect_hist[3] = {4, 4, 2};
    for (int e = 0; e < 3; e++) {
        ck_assert_int_eq(send1("j", 0, 0, "run", &seq[e], 1, &err), AMX_OK);
        ck_assert_int_eq(send1("j", 0, 0, "hist", &seq[e], 1, &err), AMX_OK);
        Amaxd__V1__ReconcileResponse *r = reconcile_all("j", 1, 0);
        ck_assert_float_eq(cell(&find(r, "run")->amax, 0), expect_run[e]);
        ck_assert_float_eq(cell(&find(r, "hist")->amax, 0), expect_hist[e]);
        ck_assert_float_eq(cell(&find(r, "hist")->scale, 0), 448.0f / expect_hist[e]);
    }
    /* An epoch without data: delayed scaling keeps the previous scale once
     * the history window holds no data. */
    reconcile_all("j", 1, 0);
    Amaxd__V1__ReconcileResponse *r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(cell(&find(r, "hist")->scale, 0), 448.0f / 1.0f);
    ck_assert_uint_eq(find(r, "hist")->missing, 1);
    /* Reset clears the running max. */
    Amaxd__V1__ResetRequest rr = AMAXD__V1__RESET_REQUEST__INIT;
    rr.job = "j";
    Amaxd__V1__ResetResponse rresp = AMAXD__V1__RESET_RESPONSE__INIT;
    ck_assert_int_eq(amx_registry_reset(reg, &rr, &rresp, &err), AMX_OK);
    float one = 1.0f;
    ck_assert_int_eq(send1("j", 0, 0, "run", &one, 1, &err), AMX_OK);
    r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(cell(&find(r, "run")->amax, 0), 1.0f);
}
END_TEST

START_TEST(reconcile_timeout_then_retry)
{
    amx_err_t err = {0};
    join_all("j", 2);
    ck_assert_int_eq(reg1("j", 0, "a", 0, NULL, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    float v = 3.0f;
    ck_assert_int_eq(send1("j", 0, 0, "a", &v, 1, &err), AMX_OK);
    rec_t x;
    rec_init(&x);
    Amaxd__V1__ReconcileRequest req = AMAXD__V1__RECONCILE_REQUEST__INIT;
    req.job = "j";
    ck_assert_int_eq(amx_registry_reconcile(reg, &req, &x.w, 0, &err), AMX_OK);
    /* A rank in Reconcile cannot send more to this epoch. */
    ck_assert_int_eq(send1("j", 0, 0, "a", &v, 1, &err), AMX_EPRECOND);
    amx_registry_expire(reg, 1000);
    ck_assert_int_eq(x.st, AMX_ETIMEDOUT);
    ck_assert_msg(strstr(x.msg, "ranks 1 did not enter") != NULL, "%s", x.msg);
    /* Contributions were kept: a retry by everyone gives the value. */
    Amaxd__V1__ReconcileResponse *r = reconcile_all("j", 2, 0);
    ck_assert_float_eq(cell(&find(r, "a")->amax, 0), 3.0f);
    ck_assert_uint_eq(r->epoch, 1);
}
END_TEST

START_TEST(drop_job_aborts_waiters)
{
    amx_err_t err = {0};
    join_all("j", 2);
    rec_t x;
    rec_init(&x);
    Amaxd__V1__ReconcileRequest req = AMAXD__V1__RECONCILE_REQUEST__INIT;
    req.job = "j";
    ck_assert_int_eq(amx_registry_reconcile(reg, &req, &x.w, 0, &err), AMX_OK);
    Amaxd__V1__ResetRequest rr = AMAXD__V1__RESET_REQUEST__INIT;
    rr.job = "j";
    rr.drop_job = 1;
    Amaxd__V1__ResetResponse rresp = AMAXD__V1__RESET_RESPONSE__INIT;
    ck_assert_int_eq(amx_registry_reset(reg, &rr, &rresp, &err), AMX_OK);
    ck_assert_int_eq(x.st, AMX_EABORTED);
    ck_assert_uint_eq(amx_registry_waiting(reg), 0);
}
END_TEST

START_TEST(catalog_limit_is_resource_exhausted)
{
    amx_err_t err = {0};
    amx_config_set(&cfg, "max_cells", "10", &err);
    join_all("j", 1);
    uint32_t g[1] = {11};
    ck_assert_int_eq(reg1("j", 0, "big", 1, g, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_ENOMEM);
}
END_TEST

int main(void)
{
    fp8.format = AMAXD__V1__FORMAT__FP8_E4M3;
    Suite *s = suite_create("registry");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, join_world_one_completes_at_once);
    tcase_add_test(tc, join_waits_for_all_then_rejoin);
    tcase_add_test(tc, join_timeout_names_missing_ranks);
    tcase_add_test(tc, cancelled_join_leaves_no_trace);
    tcase_add_test(tc, column_parallel_merge_and_slices);
    tcase_add_test(tc, block_placement_2d);
    tcase_add_test(tc, peer_fill_and_scale_group);
    tcase_add_test(tc, bad_updates_change_nothing);
    tcase_add_test(tc, register_is_atomic_and_checks_conflicts);
    tcase_add_test(tc, running_max_and_per_epoch_history);
    tcase_add_test(tc, reconcile_timeout_then_retry);
    tcase_add_test(tc, drop_job_aborts_waiters);
    tcase_add_test(tc, catalog_limit_is_resource_exhausted);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
