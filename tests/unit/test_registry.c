/*
 * test_registry.c - jobs, placement merge, validation, epochs, accumulation,
 * peer fill, scale groups and the canonical catalog, on the host backend of
 * a single daemon, without gRPC traffic. Epochs run on the job's engine
 * thread: the tests drive the libuv loop until the waiters are answered.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "log.h"
#include "peer.h"
#include "registry.h"

/* Everything a test allocates is tracked and freed at teardown, so that
 * LeakSanitizer sees only the registry's own leaks, if any. */
static void *tracked[8192];
static size_t ntracked;

static void *track(void *p)
{
    ck_assert_ptr_nonnull(p);
    ck_assert_uint_lt(ntracked, 8192);
    tracked[ntracked++] = p;
    return p;
}

/* A waiter that records its outcome and a deep copy of the reply. */
typedef struct rec {
    amx_waiter_t w;
    int called;
    amx_status_t st;
    char msg[1024];
    amx_reply_t rep;
} rec_t;

static void rec_done(amx_waiter_t *w, amx_status_t st, const char *msg, const amx_reply_t *r)
{
    rec_t *x = (rec_t *)w;
    x->called++;
    x->st = st;
    snprintf(x->msg, sizeof(x->msg), "%s", msg ? msg : "");
    if (r == NULL)
        return;
    x->rep = *r;
    x->rep.results = track(calloc(r->nresults + 1, sizeof(amx_result_t)));
    for (size_t i = 0; i < r->nresults; i++) {
        amx_result_t *d = &x->rep.results[i];
        const amx_result_t *s = &r->results[i];
        *d = *s;
        size_t n = s->ncells ? s->ncells : 1;
        d->name = track(strdup(s->name));
        d->amax = memcpy(track(malloc(n * 4)), s->amax, s->ncells * 4);
        d->scale = memcpy(track(malloc(n * 4)), s->scale, s->ncells * 4);
        d->scale_inv = memcpy(track(malloc(n * 4)), s->scale_inv, s->ncells * 4);
        d->bytes = memcpy(track(malloc(n)), s->bytes, s->ncells);
    }
}

static rec_t *rec_new(void)
{
    rec_t *x = track(calloc(1, sizeof(*x)));
    x->w.done = rec_done;
    return x;
}

static uv_loop_t loop;
static uv_timer_t keep;
static amx_config_t cfg;
static amx_cluster_t *cluster;
static amx_coord_t *coord;
static amx_peer_t *peer;
static amx_registry_t *reg;

static const char *no_env(const char *name)
{
    (void)name;
    return NULL;
}

static void make_registry(void)
{
    amx_err_t err = {0};
    amx_cluster_id_t id;
    ck_assert_int_eq(amx_cluster_resolve(&cfg, no_env, &id, &err), AMX_OK);
    ck_assert_int_eq(amx_cluster_create(&cfg, &id, &cluster, &err), AMX_OK);
    coord = amx_coord_create(id.incarnation, (uint64_t)cfg.join_timeout_ms);
    ck_assert_ptr_nonnull(coord);
    ck_assert_int_eq(amx_peer_create(&loop, &cfg, cluster, coord, &peer, &err), AMX_OK);
    ck_assert_int_eq(amx_registry_create(&loop, &cfg, "host", peer, &reg, &err), AMX_OK);
}

static void setup(void)
{
    amx_err_t err = {0};
    uv_loop_init(&loop);
    uv_timer_init(&loop, &keep);
    amx_config_init(&cfg);
    amx_config_set(&cfg, "log_level", "error", &err);
    amx_log_level = AMX_LOG_ERROR;
    amx_config_set(&cfg, "join_timeout_ms", "1000", &err);
    amx_config_set(&cfg, "reconcile_timeout_ms", "1000", &err);
    make_registry();
}

static void teardown(void)
{
    amx_registry_destroy(reg);
    uv_close((uv_handle_t *)&keep, NULL);
    uv_run(&loop, UV_RUN_DEFAULT);
    amx_peer_destroy(peer);
    amx_coord_destroy(coord);
    amx_cluster_free(cluster);
    ck_assert_int_eq(uv_loop_close(&loop), 0);
    for (size_t i = 0; i < ntracked; i++)
        free(tracked[i]);
    ntracked = 0;
    amx_config_free(&cfg);
}

static void noop(uv_timer_t *t)
{
    (void)t;
}

/* Runs the loop until the waiter has been answered (the engine thread posts
 * the end of an epoch through an async handle that keeps no reference). */
static void wait_for(rec_t *x)
{
    uv_timer_start(&keep, noop, 1, 1);
    for (int i = 0; i < 20000 && !x->called; i++)
        uv_run(&loop, UV_RUN_ONCE);
    uv_timer_stop(&keep);
    ck_assert_msg(x->called, "the waiter was never answered");
}

static void join_all(const char *job, uint32_t world)
{
    for (uint32_t r = 0; r < world; r++) {
        rec_t *x = rec_new();
        amx_join_req_t req = {job, r, world};
        amx_err_t err = {0};
        ck_assert_int_eq(amx_registry_join(reg, &req, &x->w, 0, &err), AMX_OK);
    }
}

static const amx_recipe_in_t fp8 = {.present = 1, .format = AMX_FMT_FP8_E4M3};

/* Registers one quantizer for `rank`; returns the status. */
static amx_status_t reg1(const char *job, uint32_t rank, const char *name, uint32_t ndim,
                         const uint32_t *shape, const uint32_t *off, const uint32_t *lshape,
                         const char *peer_g, const char *scale_g, const amx_recipe_in_t *recipe,
                         int acc, amx_err_t *err)
{
    amx_qspec_in_t s;
    memset(&s, 0, sizeof(s));
    s.name = name;
    s.ndim = ndim;
    s.global_shape = shape;
    if (off != NULL) {
        s.n_offset = s.n_local_shape = ndim;
        s.offset = off;
        s.local_shape = lshape;
    }
    s.peer_group = peer_g ? peer_g : "";
    s.scale_group = scale_g ? scale_g : "";
    s.recipe = recipe ? *recipe : fp8;
    s.accumulation = acc;
    amx_register_req_t req = {job, rank, &s, 1};
    rec_t *x = rec_new();
    amx_status_t st = amx_registry_register(reg, &req, &x->w, err);
    if (st == AMX_OK)
        ck_assert_int_eq(x->called, 1); /* nothing in flight: answered at once */
    return st;
}

static amx_status_t send1(const char *job, uint32_t rank, uint64_t epoch, const char *name,
                          const float *v, size_t n, amx_err_t *err)
{
    amx_update_in_t u = {name, (const uint8_t *)v, n * sizeof(float), NULL, 0, NULL, 0, 0};
    amx_send_req_t req = {job, rank, epoch, &u, 1};
    uint64_t acc, ep;
    return amx_registry_send(reg, &req, &acc, &ep, err);
}

/* All `world` ranks reconcile; returns rank `want`'s reply. */
static amx_reply_t *reconcile_all(const char *job, uint32_t world, uint32_t want)
{
    rec_t **x = track(calloc(world, sizeof(rec_t *)));
    for (uint32_t r = 0; r < world; r++) {
        x[r] = rec_new();
        amx_reconcile_req_t req = {job, r, 0, NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        amx_err_t err = {0};
        ck_assert_int_eq(amx_registry_reconcile(reg, &req, &x[r]->w, 0, &err), AMX_OK);
    }
    for (uint32_t r = 0; r < world; r++) {
        wait_for(x[r]);
        ck_assert_int_eq(x[r]->called, 1);
        ck_assert_msg(x[r]->st == AMX_OK, "rank %u: %s", r, x[r]->msg);
    }
    return &x[want]->rep;
}

static const amx_result_t *find(const amx_reply_t *r, const char *name)
{
    for (size_t i = 0; i < r->nresults; i++)
        if (!strcmp(r->results[i].name, name))
            return &r->results[i];
    ck_abort_msg("no result for %s", name);
    return NULL;
}

static amx_job_info_t job_info(const char *job)
{
    amx_arena_t ar = {0};
    amx_job_info_t *jobs = NULL, out;
    size_t n = 0;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_status(reg, job, &jobs, &n, &ar, &err), AMX_OK);
    ck_assert_uint_eq(n, 1);
    out = jobs[0];
    out.name = NULL;
    out.collective = NULL;
    amx_arena_free(&ar);
    return out;
}

START_TEST(join_world_one_completes_at_once)
{
    rec_t *x = rec_new();
    amx_join_req_t req = {"j", 0, 1};
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &x->w, 0, &err), AMX_OK);
    ck_assert_int_eq(x->called, 1);
    ck_assert_int_eq(x->st, AMX_OK);
    ck_assert_uint_eq(amx_registry_waiting(reg), 0);
}
END_TEST

START_TEST(join_waits_for_all_then_rejoin)
{
    rec_t *a = rec_new(), *b = rec_new(), *c = rec_new();
    amx_join_req_t req = {"j", 0, 2};
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &a->w, 0, &err), AMX_OK);
    ck_assert_int_eq(a->called, 0);
    /* The same rank again while waiting: refused, first call untouched. */
    ck_assert_int_eq(amx_registry_join(reg, &req, &c->w, 0, &err), AMX_EPRECOND);
    req.rank = 1;
    ck_assert_int_eq(amx_registry_join(reg, &req, &b->w, 0, &err), AMX_OK);
    ck_assert_int_eq(a->called, 1);
    ck_assert_int_eq(b->called, 1);
    /* A restarted rank re-joins a ready job at once. */
    c = rec_new();
    ck_assert_int_eq(amx_registry_join(reg, &req, &c->w, 0, &err), AMX_OK);
    ck_assert_int_eq(c->called, 1);
    ck_assert(c->rep.rejoined);
    /* Another world size for the same job is a conflict. */
    req.world = 4;
    amx_err_clear(&err);
    ck_assert_int_eq(amx_registry_join(reg, &req, &c->w, 0, &err), AMX_EPRECOND);
    ck_assert_ptr_nonnull(strstr(err.msg, "world size 2"));
}
END_TEST

START_TEST(join_timeout_names_missing_ranks)
{
    rec_t *a = rec_new();
    amx_join_req_t req = {"j", 0, 3};
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &a->w, 100, &err), AMX_OK);
    amx_coord_expire(coord, 1099);
    ck_assert_int_eq(a->called, 0);
    amx_coord_expire(coord, 1100);
    ck_assert_int_eq(a->called, 1);
    ck_assert_int_eq(a->st, AMX_ETIMEDOUT);
    ck_assert_msg(strstr(a->msg, "ranks 1, 2 never joined") != NULL, "%s", a->msg);
    /* The job is gone: a new world size is accepted. */
    a = rec_new();
    req.world = 1;
    ck_assert_int_eq(amx_registry_join(reg, &req, &a->w, 0, &err), AMX_OK);
    ck_assert_int_eq(a->st, AMX_OK);
}
END_TEST

START_TEST(cancelled_join_leaves_no_trace)
{
    rec_t *a = rec_new();
    amx_join_req_t req = {"j", 0, 2};
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_join(reg, &req, &a->w, 0, &err), AMX_OK);
    amx_registry_cancel(reg, &a->w);
    ck_assert_int_eq(a->called, 0);
    ck_assert_uint_eq(amx_registry_waiting(reg), 0);
    amx_arena_t ar = {0};
    amx_job_info_t *jobs = NULL;
    size_t n = 9;
    ck_assert_int_eq(amx_registry_status(reg, "", &jobs, &n, &ar, &err), AMX_OK);
    ck_assert_uint_eq(n, 0);
    amx_arena_free(&ar);
    /* The coordinator forgot the rank too: a job of another size is fine. */
    a = rec_new();
    req.world = 1;
    ck_assert_int_eq(amx_registry_join(reg, &req, &a->w, 0, &err), AMX_OK);
    ck_assert_int_eq(a->st, AMX_OK);
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
    amx_reply_t *r = reconcile_all("j", 2, 1);
    const amx_result_t *q = find(r, "w");
    ck_assert_uint_eq(q->off[0], 4);
    ck_assert_float_eq(q->amax[0], 9.0f);
    ck_assert_float_eq(q->amax[3], 8.0f);
    ck_assert_float_eq(q->global_amax, 9.0f);
    ck_assert_float_eq(q->scale[1], 448.0f / 6.0f);
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
    amx_scales_req_t gr = {"j", 0, NULL, 0, 1, 0, 0};
    amx_reply_t rep;
    amx_arena_t ar = {0};
    ck_assert_int_eq(amx_registry_get_scales(reg, &gr, &rep, &ar, &err), AMX_OK);
    const amx_result_t *q = &rep.results[0];
    /* Row 1 of the global tensor: rank 0's row 1 then rank 1's row 1. */
    ck_assert_float_eq(q->amax[6], 4.0f);
    ck_assert_float_eq(q->amax[8], 6.0f);
    ck_assert_float_eq(q->amax[9], 103.0f);
    ck_assert_float_eq(q->amax[23], 111.0f);
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
    amx_reply_t *r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(find(r, "e2")->amax[0], 5.0f); /* never fed: group max */
    ck_assert_uint_eq(find(r, "e2")->missing, 0);
    ck_assert_float_eq(find(r, "e0")->amax[0], 2.0f); /* fed: its own */
    ck_assert_float_eq(find(r, "q")->amax[0], 1.0f);
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
    amx_reply_t *r = reconcile_all("j", 2, 0);
    ck_assert_float_eq(find(r, "w")->amax[0], 1.0f);
    ck_assert_float_eq(find(r, "w")->amax[1], 1.0f);
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
    amx_recipe_in_t nv = {.present = 1, .format = AMX_FMT_NVFP4};
    ck_assert_int_eq(reg1("j", 1, "w", 1, g, NULL, NULL, NULL, NULL, &nv, 0, &err), AMX_EPRECOND);
    /* Two specs, the second bad: the first is not registered either. */
    amx_qspec_in_t s[2];
    memset(s, 0, sizeof(s));
    s[0].name = "ok";
    s[0].recipe = fp8;
    s[1].name = "bad name";
    s[1].recipe = fp8;
    amx_register_req_t req = {"j", 0, s, 2};
    rec_t *x = rec_new();
    ck_assert_int_eq(amx_registry_register(reg, &req, &x->w, &err), AMX_EINVAL);
    ck_assert_int_eq(x->called, 0);
    amx_qinfo_t *q = NULL;
    size_t n = 0;
    amx_arena_t ar = {0};
    ck_assert_int_eq(amx_registry_list(reg, "j", &q, &n, &ar, &err), AMX_OK);
    ck_assert_uint_eq(n, 1);
    ck_assert_int_eq(q[0].agreed, 0); /* a proposal until the first epoch */
    amx_arena_free(&ar);
    /* Recipe checks. */
    amx_recipe_in_t bad = {.present = 1};
    ck_assert_int_eq(reg1("j", 0, "r0", 0, NULL, NULL, NULL, NULL, NULL, &bad, 0, &err),
                     AMX_EINVAL);
    bad.format = AMX_FMT_FP8_E4M3;
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
    amx_recipe_in_t del = {
        .present = 1, .format = AMX_FMT_FP8_E4M3, .rule = AMX_RULE_DELAYED, .history_len = 2};
    ck_assert_int_eq(reg1("j", 0, "run", 0, NULL, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    ck_assert_int_eq(
        reg1("j", 0, "hist", 0, NULL, NULL, NULL, NULL, NULL, &del, AMX_ACC_PER_EPOCH, &err),
        AMX_OK);
    float seq[3] = {4, 2, 1}, expect_run[3] = {4, 4, 4}, expect_hist[3] = {4, 4, 2};
    for (int e = 0; e < 3; e++) {
        ck_assert_int_eq(send1("j", 0, 0, "run", &seq[e], 1, &err), AMX_OK);
        ck_assert_int_eq(send1("j", 0, 0, "hist", &seq[e], 1, &err), AMX_OK);
        amx_reply_t *r = reconcile_all("j", 1, 0);
        ck_assert_float_eq(find(r, "run")->amax[0], expect_run[e]);
        ck_assert_float_eq(find(r, "hist")->amax[0], expect_hist[e]);
        ck_assert_float_eq(find(r, "hist")->scale[0], 448.0f / expect_hist[e]);
    }
    /* Epochs without data: TE's history rule (the default) leaves the
     * window alone and keeps the previous scale, 448/2 of the last epoch
     * (docs/NUMERICS.md; the unfused rule is tested in test_recipe.c). */
    reconcile_all("j", 1, 0);
    amx_reply_t *r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(find(r, "hist")->scale[0], 448.0f / 2.0f);
    ck_assert_uint_eq(find(r, "hist")->missing, 1);
    /* Reset takes effect at the next reconciliation: the running max
     * restarts from what this epoch brings, sent before or after the
     * Reset (docs/API.md). */
    float half = 0.5f, one = 1.0f;
    ck_assert_int_eq(send1("j", 0, 0, "run", &half, 1, &err), AMX_OK);
    amx_reset_req_t rr = {"j", NULL, 0, 0};
    rec_t *x = rec_new();
    ck_assert_int_eq(amx_registry_reset(reg, &rr, &x->w, &err), AMX_OK);
    ck_assert_int_eq(x->called, 1);
    ck_assert_uint_eq(x->rep.reset, 2);
    ck_assert_int_eq(send1("j", 0, 0, "run", &one, 1, &err), AMX_OK);
    r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(find(r, "run")->amax[0], 1.0f);
    /* ... and it was applied once: the running max goes on from there. */
    ck_assert_int_eq(send1("j", 0, 0, "run", &half, 1, &err), AMX_OK);
    r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(find(r, "run")->amax[0], 1.0f);
}
END_TEST

START_TEST(reconcile_timeout_then_retry)
{
    amx_err_t err = {0};
    join_all("j", 2);
    ck_assert_int_eq(reg1("j", 0, "a", 0, NULL, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    float v = 3.0f;
    ck_assert_int_eq(send1("j", 0, 0, "a", &v, 1, &err), AMX_OK);
    rec_t *x = rec_new();
    amx_reconcile_req_t req = {"j", 0, 0, NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    ck_assert_int_eq(amx_registry_reconcile(reg, &req, &x->w, 0, &err), AMX_OK);
    /* A rank in Reconcile cannot send more to this epoch. */
    ck_assert_int_eq(send1("j", 0, 0, "a", &v, 1, &err), AMX_EPRECOND);
    amx_registry_expire(reg, 1000);
    ck_assert_int_eq(x->st, AMX_ETIMEDOUT);
    ck_assert_msg(strstr(x->msg, "ranks 1 did not enter") != NULL, "%s", x->msg);
    /* Contributions were kept: a retry by everyone gives the value. */
    amx_reply_t *r = reconcile_all("j", 2, 0);
    ck_assert_float_eq(find(r, "a")->amax[0], 3.0f);
    ck_assert_uint_eq(r->epoch, 1);
}
END_TEST

START_TEST(drop_job_aborts_waiters)
{
    join_all("j", 2);
    rec_t *x = rec_new();
    amx_reconcile_req_t req = {"j", 0, 0, NULL, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    amx_err_t err = {0};
    ck_assert_int_eq(amx_registry_reconcile(reg, &req, &x->w, 0, &err), AMX_OK);
    amx_reset_req_t rr = {"j", NULL, 0, 1};
    rec_t *y = rec_new();
    ck_assert_int_eq(amx_registry_reset(reg, &rr, &y->w, &err), AMX_OK);
    ck_assert_int_eq(x->st, AMX_EABORTED);
    ck_assert_int_eq(y->st, AMX_OK);
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

/* The layout is a pure function of the catalog: two jobs that register the
 * same quantizers in different orders, in different batches, agree on the
 * catalog hash and give the same bytes. */
START_TEST(catalog_order_does_not_matter)
{
    amx_err_t err = {0};
    const char *names[] = {"z.w", "a.w", "m.in", "b.x", "q"};
    uint32_t g[5][1] = {{3}, {2}, {1}, {4}, {2}};
    const char *jobs[2] = {"first", "second"};
    for (int k = 0; k < 2; k++) {
        join_all(jobs[k], 1);
        for (int i = 0; i < 5; i++) {
            int n = k == 0 ? i : 4 - i;
            ck_assert_int_eq(reg1(jobs[k], 0, names[n], 1, g[n], NULL, NULL, n % 2 ? "grp" : NULL,
                                  NULL, NULL, 0, &err),
                             AMX_OK);
            if (k == 1 && i == 2) /* half of them agreed in an epoch of their own */
                reconcile_all(jobs[k], 1, 0);
        }
    }
    float v[4] = {1, 2, 3, 4};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 5; i++)
            if (i != 3) /* b.x gets no data: peer-filled from a.w */
                ck_assert_int_eq(send1(jobs[k], 0, 0, names[i], v, g[i][0], &err), AMX_OK);
    amx_reply_t *r0 = reconcile_all("first", 1, 0), *r1 = reconcile_all("second", 1, 0);
    amx_job_info_t a = job_info("first"), b = job_info("second");
    ck_assert_uint_eq(a.catalog_hash, b.catalog_hash);
    ck_assert_uint_eq(a.quantizers, 5);
    ck_assert_uint_eq(a.proposals, 0);
    ck_assert_uint_eq(r0->nresults, r1->nresults);
    for (int i = 0; i < 5; i++) {
        const amx_result_t *x = find(r0, names[i]), *y = find(r1, names[i]);
        ck_assert_mem_eq(x->amax, y->amax, x->ncells * 4);
        ck_assert_mem_eq(x->scale, y->scale, x->ncells * 4);
        ck_assert_float_eq(x->global_amax, y->global_amax);
    }
    ck_assert_float_eq(find(r0, "b.x")->amax[3], 2.0f);
}
END_TEST

/* A quantizer registered after the first epoch is a proposal with its own
 * cells until the next epoch adopts it; contributions sent meanwhile are
 * kept across the layout change. */
START_TEST(late_registration_keeps_contributions)
{
    amx_err_t err = {0};
    join_all("j", 1);
    uint32_t g[1] = {2};
    ck_assert_int_eq(reg1("j", 0, "m", 1, g, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    float v[2] = {3, 4};
    ck_assert_int_eq(send1("j", 0, 0, "m", v, 2, &err), AMX_OK);
    reconcile_all("j", 1, 0);
    /* "a" sorts before "m": the layout changes under m's accumulated state. */
    ck_assert_int_eq(reg1("j", 0, "a", 1, g, NULL, NULL, NULL, NULL, NULL, 0, &err), AMX_OK);
    float w[2] = {7, 1}, small[2] = {0.5f, 0.5f};
    ck_assert_int_eq(send1("j", 0, 0, "a", w, 2, &err), AMX_OK);
    ck_assert_int_eq(send1("j", 0, 0, "m", small, 2, &err), AMX_OK);
    amx_reply_t *r = reconcile_all("j", 1, 0);
    ck_assert_float_eq(find(r, "a")->amax[0], 7.0f);
    ck_assert_float_eq(find(r, "m")->amax[0], 3.0f); /* running max survived the move */
    ck_assert_float_eq(find(r, "m")->amax[1], 4.0f);
}
END_TEST

int main(void)
{
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
    tcase_add_test(tc, catalog_order_does_not_matter);
    tcase_add_test(tc, late_registration_keeps_contributions);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
