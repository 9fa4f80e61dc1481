/*
 * test_cluster.c - the cluster's pure parts: identity from config, Slurm and
 * torchrun variables; auth tokens; the canonical catalog; job-state
 * serialization; the coordinator's membership, agreement and key-value
 * store. No sockets, no threads.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "jobstate.h"
#include "log.h"
#include "peer.h"

/* ---- identity ---- */

static const char *const *fake_env;

static const char *env_get(const char *name)
{
    for (const char *const *p = fake_env; p && *p; p += 2)
        if (strcmp(p[0], name) == 0)
            return p[1];
    return NULL;
}

static amx_status_t resolve(const char *const *env, const char *const *cfgkv, amx_cluster_id_t *id,
                            amx_err_t *err)
{
    amx_config_t cfg;
    amx_config_init(&cfg);
    for (const char *const *p = cfgkv; p && *p; p += 2)
        ck_assert_int_eq(amx_config_set(&cfg, p[0], p[1], err), AMX_OK);
    fake_env = env;
    amx_status_t st = amx_cluster_resolve(&cfg, env_get, id, err);
    amx_config_free(&cfg);
    return st;
}

START_TEST(slurm_first_host)
{
    char h[64];
    amx_err_t err = {0};
    struct {
        const char *in, *out;
    } ok[] = {{"node[01-04,07],gpu5", "node01"},
              {"gpu5", "gpu5"},
              {"a[1-2]b[3-4]", "a1b3"},
              {"n[007]", "n007"},
              {"x1,x2", "x1"},
              {"r[3,1]s", "r3s"},
              {"dgx-a100-[12-13]", "dgx-a100-12"}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        ck_assert_int_eq(amx_slurm_first_host(ok[i].in, h, sizeof(h), &err), AMX_OK);
        ck_assert_str_eq(h, ok[i].out);
    }
    const char *bad[] = {"", "x[", "x[]", "x[a-b]", "]x", "x[1[2]]", ",x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        amx_err_clear(&err);
        ck_assert_msg(amx_slurm_first_host(bad[i], h, sizeof(h), &err) == AMX_EINVAL, "%s", bad[i]);
        ck_assert_ptr_nonnull(strstr(err.msg, "Slurm node list"));
    }
}
END_TEST

START_TEST(identity_sources)
{
    amx_cluster_id_t id;
    amx_err_t err = {0};
    /* Nothing set: one daemon. */
    ck_assert_int_eq(resolve(NULL, NULL, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.size, 1);
    ck_assert_uint_eq(id.rank, 0);
    ck_assert_str_eq(id.source, "default");
    ck_assert_uint_ne(id.incarnation, 0);
    const char *sec[] = {"cluster_secret_file", "/s", NULL};
    /* Slurm: node id, node count, first host of the node list. */
    const char *slurm[] = {"SLURM_NODEID", "2", "SLURM_NNODES", "4", "SLURM_JOB_NODELIST",
                           "gpu[07-10]",   NULL};
    ck_assert_int_eq(resolve(slurm, sec, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.rank, 2);
    ck_assert_uint_eq(id.size, 4);
    ck_assert_str_eq(id.coordinator, "gpu07:7420");
    ck_assert_str_eq(id.listen, "0.0.0.0:7420");
    ck_assert_str_eq(id.source, "slurm");
    /* torchrun-style. */
    const char *tr[] = {"RANK",     "1",           "WORLD_SIZE", "2", "MASTER_ADDR",
                        "10.0.0.9", "MASTER_PORT", "29500",      NULL};
    ck_assert_int_eq(resolve(tr, sec, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.rank, 1);
    ck_assert_uint_eq(id.size, 2);
    ck_assert_str_eq(id.coordinator, "10.0.0.9:29500");
    ck_assert_str_eq(id.listen, "0.0.0.0:29500");
    /* Explicit settings win over the environment. */
    const char *cfg[] = {"cluster_rank",
                         "3",
                         "cluster_size",
                         "5",
                         "coordinator",
                         "c0:1234",
                         "peer_listen",
                         "127.0.0.1:5000",
                         "peer_advertise",
                         "me:5000",
                         "cluster_secret_file",
                         "/s",
                         NULL};
    ck_assert_int_eq(resolve(slurm, cfg, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.rank, 3);
    ck_assert_uint_eq(id.size, 5);
    ck_assert_str_eq(id.coordinator, "c0:1234");
    ck_assert_str_eq(id.listen, "127.0.0.1:5000");
    ck_assert_str_eq(id.advertise, "me:5000");
    ck_assert_str_eq(id.source, "config");
    /* Inconsistent or incomplete. */
    const char *out[] = {"cluster_rank", "4", "cluster_size", "4", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(NULL, out, &id, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "out of range"));
    const char *nocoord[] = {"cluster_size", "2", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(NULL, nocoord, &id, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "no coordinator address"));
    const char *nosecret[] = {"cluster_size", "2", "coordinator", "h:1", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(NULL, nosecret, &id, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "cluster_secret_file"));
    const char *badenv[] = {"SLURM_NODEID", "x", "SLURM_NNODES", "2", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(badenv, NULL, &id, &err), AMX_EINVAL);
}
END_TEST

/* ---- authentication ---- */

START_TEST(auth_tokens)
{
    const uint8_t s1[] = "0123456789abcdef", s2[] = "fedcba9876543210";
    char tok[160];
    const char *why = NULL;
    amx_auth_token(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1000, tok, sizeof(tok));
    ck_assert_int_eq(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1000, tok, strlen(tok), &why), 0);
    ck_assert_int_eq(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1299, tok, strlen(tok), &why), 0);
    /* Another secret, another method, too old, malformed. */
    ck_assert_int_ne(
        amx_auth_check(s2, 16, "/amaxd.peer.v1.Peer/Sync", 1000, tok, strlen(tok), &why), 0);
    ck_assert_ptr_nonnull(strstr(why, "wrong token"));
    ck_assert_int_ne(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Join", 1000, tok, strlen(tok), &why), 0);
    ck_assert_int_ne(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1301, tok, strlen(tok), &why), 0);
    ck_assert_ptr_nonnull(strstr(why, "5 minutes"));
    ck_assert_int_ne(amx_auth_check(s1, 16, "/m", 1000, "garbage", 7, &why), 0);
    ck_assert_int_ne(amx_auth_check(s1, 16, "/m", 1000, "", 0, &why), 0);
    /* The secret never appears in the token. */
    ck_assert_ptr_null(strstr(tok, "0123456789abcdef"));
}
END_TEST

/* ---- catalog ---- */

static amx_qspec_t *spec(const char *name, uint32_t n, const char *peer)
{
    amx_qspec_t s;
    memset(&s, 0, sizeof(s));
    s.name = (char *)name;
    s.ndim = n ? 1 : 0;
    s.shape[0] = n;
    s.ncells = n ? n : 1;
    s.recipe.format = AMX_FMT_FP8_E4M3;
    s.recipe.rule = AMX_RULE_CURRENT;
    s.recipe.history_len = 1;
    s.recipe.history_reduce = AMX_HIST_MAX;
    s.recipe.scaled_max = 448.0f;
    s.accumulation = AMX_ACC_RUNNING_MAX;
    s.peer_group = (char *)(peer ? peer : "");
    s.scale_group = "";
    return amx_qspec_dup(&s);
}

START_TEST(catalog_is_canonical)
{
    amx_err_t err = {0};
    amx_qspec_t *a[4] = {spec("z", 3, "g2"), spec("b", 1, NULL), spec("m", 2, "g1"),
                         spec("a", 4, "g2")};
    amx_qspec_t *b[4] = {spec("a", 4, "g2"), spec("m", 2, "g1"), spec("z", 3, "g2"),
                         spec("b", 1, NULL)};
    amx_catalog_t *ca, *cb;
    ck_assert_int_eq(amx_catalog_build(a, 4, &ca, &err), AMX_OK);
    ck_assert_int_eq(amx_catalog_build(b, 4, &cb, &err), AMX_OK);
    ck_assert_uint_eq(ca->hash, cb->hash);
    ck_assert_str_eq(ca->q[0]->name, "a");
    ck_assert_str_eq(ca->q[3]->name, "z");
    ck_assert_uint_eq(ca->ncells, 10);
    ck_assert_uint_eq(ca->npeer, 2);
    amx_qdesc_t d[4];
    amx_catalog_layout(ca, d);
    ck_assert_uint_eq(d[0].base, 0);      /* a */
    ck_assert_uint_eq(d[1].base, 4);      /* b */
    ck_assert_uint_eq(d[2].base, 5);      /* m */
    ck_assert_uint_eq(d[3].base, 7);      /* z */
    ck_assert_int_eq(d[0].peer_group, 1); /* "g2" sorts after "g1" */
    ck_assert_int_eq(d[1].peer_group, -1);
    ck_assert_int_eq(d[2].peer_group, 0);
    ck_assert_int_eq(amx_catalog_find(ca, "m"), 2);
    ck_assert_int_eq(amx_catalog_find(ca, "nope"), -1);
    /* Any field changes the hash. */
    amx_qspec_t *c[1] = {spec("a", 4, "g3")}, *e[1] = {spec("a", 4, "g2")};
    amx_catalog_t *cc, *ce;
    ck_assert_int_eq(amx_catalog_build(c, 1, &cc, &err), AMX_OK);
    ck_assert_int_eq(amx_catalog_build(e, 1, &ce, &err), AMX_OK);
    ck_assert_uint_ne(cc->hash, ce->hash);
    char diff[200];
    amx_qspec_diff(cc->q[0], ce->q[0], diff, sizeof(diff));
    ck_assert_str_eq(diff, "peer_group 'g3' vs 'g2'");
    amx_catalog_free(ca);
    amx_catalog_free(cb);
    amx_catalog_free(cc);
    amx_catalog_free(ce);
}
END_TEST

/* ---- job state ---- */

START_TEST(jobstate_round_trip_and_corruption)
{
    amx_err_t err = {0};
    amx_qspec_t *q[2] = {spec("x", 3, NULL), spec("y", 0, NULL)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 2, &cat, &err), AMX_OK);
    amx_qdesc_t d[2];
    amx_catalog_layout(cat, d);
    amx_state_t *st;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    amx_layout_change_t lc = {.ncells = cat->ncells, .nhist = cat->nhist, .nq = cat->n};
    ck_assert_int_eq(st->ops->reserve_pending(st, cat->ncells, &err), AMX_OK);
    ck_assert_int_eq(st->ops->remap(st, &lc, &err), AMX_OK);
    float v[4] = {1, 2, 3, 9};
    amx_run_t run = {0, 0, 4};
    ck_assert_int_eq(st->ops->merge(st, v, 4, &run, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    ck_assert_int_eq(st->ops->finish(st, d, 2, 4, 0, 0, 1, 1, &err), AMX_OK);
    st->ops->publish(st);
    void *blob;
    size_t len;
    ck_assert_int_eq(amx_jobstate_export("job", 7, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    amx_jobstate_t js;
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    ck_assert_str_eq(js.job, "job");
    ck_assert_uint_eq(js.last_reconciled, 7);
    ck_assert_uint_eq(js.cat->hash, cat->hash);
    ck_assert_float_eq(js.a.accum[3], 9.0f);
    ck_assert_float_eq(js.a.out_amax[1], 2.0f);
    ck_assert_float_eq(js.a.g_amax[0], 3.0f);
    amx_jobstate_free(&js);
    /* Every single flipped bit is caught. */
    unsigned char *b = blob;
    for (size_t i = 0; i < len; i += 7) {
        b[i] ^= 0x10;
        amx_err_clear(&err);
        ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_EINVAL);
        b[i] ^= 0x10;
    }
    amx_err_clear(&err);
    ck_assert_int_eq(amx_jobstate_parse(blob, len - 8, &js, &err), AMX_EINVAL);
    ck_assert_int_eq(amx_jobstate_parse(blob, 3, &js, &err), AMX_EINVAL);
    free(blob);
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* ---- coordinator ---- */

typedef struct answer {
    int called;
    amx_status_t st;
    char msg[1024];
    uint32_t npart;
    int rejoined;
    uint64_t hash, target, gen, seq;
    uint32_t donor, nbehind, ncat, nres, nrej;
    int new_comm;
    char conflict[1024];
    char val[64];
} answer_t;

static void on_join(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    answer_t *a = ud;
    a->called++;
    a->st = st;
    snprintf(a->msg, sizeof(a->msg), "%s", msg ? msg : "");
    if (m != NULL) {
        a->npart = m->npart;
        a->rejoined = m->rejoined;
    }
}

static void on_sync(void *ud, amx_status_t st, const char *msg, const amx_coord_sync_ans_t *s)
{
    answer_t *a = ud;
    a->called++;
    a->st = st;
    snprintf(a->msg, sizeof(a->msg), "%s", msg ? msg : "");
    if (s == NULL)
        return;
    a->hash = s->catalog_hash;
    a->target = s->target_epoch;
    a->gen = s->comm_gen;
    a->seq = s->seq;
    a->donor = s->donor;
    a->nbehind = (uint32_t)s->nbehind;
    a->ncat = s->catalog->n;
    a->nres = (uint32_t)s->nresets;
    a->nrej = (uint32_t)s->nrejected;
    a->new_comm = s->new_comm;
    snprintf(a->conflict, sizeof(a->conflict), "%s", s->conflict ? s->conflict : "");
}

static void on_kv(void *ud, amx_status_t st, const char *msg, const void *v, size_t len)
{
    answer_t *a = ud;
    a->called++;
    a->st = st;
    snprintf(a->msg, sizeof(a->msg), "%s", msg ? msg : "");
    if (v != NULL)
        snprintf(a->val, sizeof(a->val), "%.*s", (int)len, (const char *)v);
}

static void join(amx_coord_t *co, uint32_t rank, uint32_t daemon, uint64_t inc, answer_t *a)
{
    amx_coord_join_req_t r = {"j", 4, rank, daemon, inc, "h:1", 0, 1000};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, a, &h, &err), AMX_OK);
}

static void sync1(amx_coord_t *co, uint32_t daemon, uint64_t last, amx_qspec_t **p, size_t np,
                  char **resets, size_t nr, answer_t *a)
{
    amx_coord_sync_req_t r = {.job = "j",
                              .daemon = daemon,
                              .incarnation = 1,
                              .last_reconciled = last,
                              .proposals = p,
                              .nprop = np,
                              .resets = resets,
                              .nresets = nr,
                              .deadline_ms = 5000};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_sync(co, &r, on_sync, a, &h, &err), AMX_OK);
}

START_TEST(coordinator_membership_and_agreement)
{
    amx_coord_t *co = amx_coord_create(42, 1000);
    answer_t j[4] = {{0}};
    join(co, 0, 0, 1, &j[0]);
    join(co, 1, 0, 1, &j[1]);
    join(co, 2, 1, 1, &j[2]);
    ck_assert_int_eq(j[0].called + j[1].called + j[2].called, 0);
    /* A rank cannot move to another daemon. */
    amx_coord_join_req_t moved = {"j", 4, 1, 1, 1, "h:2", 0, 1000};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_join(co, &moved, on_join, &j[3], &h, &err), AMX_EPRECOND);
    ck_assert_ptr_nonnull(strstr(err.msg, "served by daemon 0"));
    join(co, 3, 1, 1, &j[3]);
    for (int i = 0; i < 4; i++) {
        ck_assert_int_eq(j[i].called, 1);
        ck_assert_int_eq(j[i].st, AMX_OK);
        ck_assert_uint_eq(j[i].npart, 2);
    }
    /* Agreement: daemon 0 proposes a, b; daemon 1 proposes b, c; both resets. */
    amx_qspec_t *p0[2] = {spec("b", 2, NULL), spec("a", 1, NULL)};
    amx_qspec_t *p1[2] = {spec("c", 1, NULL), spec("b", 2, NULL)};
    char *r0[1] = {"a"}, *r1[2] = {"a", "c"};
    answer_t s0 = {0}, s1 = {0};
    sync1(co, 0, 3, p0, 2, r0, 1, &s0);
    ck_assert_int_eq(s0.called, 0); /* waits for daemon 1 */
    sync1(co, 1, 2, p1, 2, r1, 2, &s1);
    ck_assert_int_eq(s0.called, 1);
    ck_assert_int_eq(s1.called, 1);
    ck_assert_uint_eq(s0.hash, s1.hash);
    ck_assert_uint_eq(s0.ncat, 3);
    ck_assert_uint_eq(s0.nres, 2);
    ck_assert_uint_eq(s0.target, 3);
    ck_assert_uint_eq(s0.donor, 0);
    ck_assert_uint_eq(s0.nbehind, 1);
    ck_assert_int_eq(s0.new_comm, 1);
    ck_assert_str_eq(s0.conflict, "");
    /* A conflict: the same answer for both, the name rejected, others kept. */
    amx_qspec_t *q0[2] = {spec("w", 4, NULL), spec("d", 1, NULL)};
    amx_qspec_t *q1[1] = {spec("w", 8, NULL)};
    answer_t t0 = {0}, t1 = {0};
    sync1(co, 0, 3, q0, 2, NULL, 0, &t0);
    sync1(co, 1, 3, q1, 1, NULL, 0, &t1);
    ck_assert_str_eq(t0.conflict, t1.conflict);
    ck_assert_ptr_nonnull(strstr(t0.conflict, "quantizer 'w'"));
    ck_assert_ptr_nonnull(strstr(t0.conflict, "global shape [4] vs [8]"));
    ck_assert_ptr_nonnull(strstr(t0.conflict, "daemon 0 (ranks 0-1)"));
    ck_assert_ptr_nonnull(strstr(t0.conflict, "daemon 1 (ranks 2-3)"));
    ck_assert_uint_eq(t0.nrej, 1);
    ck_assert_uint_eq(t0.ncat, 4); /* a, b, c, d */
    ck_assert_int_eq(t0.new_comm, 0);
    ck_assert_uint_eq(t0.gen, s0.gen);
    /* A proposal against the agreed catalog. */
    amx_qspec_t *u0[1] = {spec("a", 5, NULL)};
    answer_t v0 = {0}, v1 = {0};
    sync1(co, 0, 3, u0, 1, NULL, 0, &v0);
    sync1(co, 1, 3, NULL, 0, NULL, 0, &v1);
    ck_assert_ptr_nonnull(strstr(v1.conflict, "the agreed catalog"));
    /* A daemon that restarted re-joins: new communicator next time. */
    answer_t rj = {0};
    join(co, 2, 1, 99, &rj);
    ck_assert_int_eq(rj.called, 1);
    ck_assert_int_eq(rj.rejoined, 1);
    answer_t w0 = {0}, w1 = {0};
    sync1(co, 0, 3, NULL, 0, NULL, 0, &w0);
    sync1(co, 1, 0, NULL, 0, NULL, 0, &w1);
    ck_assert_int_eq(w0.new_comm, 1);
    ck_assert_uint_gt(w0.gen, s0.gen);
    ck_assert_uint_eq(w1.nbehind, 1);
    /* An agreement nobody completes times out naming who is missing. */
    answer_t x0 = {0};
    sync1(co, 0, 3, NULL, 0, NULL, 0, &x0);
    amx_coord_expire(co, 4999);
    ck_assert_int_eq(x0.called, 0);
    amx_coord_expire(co, 5000);
    ck_assert_int_eq(x0.st, AMX_ETIMEDOUT);
    ck_assert_msg(strstr(x0.msg, "daemon 1 (h:1, ranks 2-3)") != NULL, "%s", x0.msg);
    for (int i = 0; i < 2; i++) {
        amx_qspec_free(p0[i]), amx_qspec_free(p1[i]);
        amx_qspec_free(q0[i]);
    }
    amx_qspec_free(q1[0]);
    amx_qspec_free(u0[0]);
    amx_coord_destroy(co);
}
END_TEST

START_TEST(coordinator_join_timeout_and_kv)
{
    amx_coord_t *co = amx_coord_create(42, 1000);
    answer_t a = {0};
    join(co, 1, 0, 1, &a);
    amx_coord_expire(co, 999);
    ck_assert_int_eq(a.called, 0);
    amx_coord_expire(co, 1000);
    ck_assert_int_eq(a.st, AMX_ETIMEDOUT);
    ck_assert_ptr_nonnull(strstr(a.msg, "ranks 0, 2, 3 never joined"));
    uint32_t jobs, waiting, keys;
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(jobs, 0); /* forgotten with its last rank */
    /* KV: a get waits for the set. */
    answer_t g = {0}, g2 = {0};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_kv_get(co, "k", 500, on_kv, &g, &h, &err), AMX_OK);
    ck_assert_int_eq(g.called, 0);
    amx_coord_kv_set(co, "k", "value", 5);
    ck_assert_int_eq(g.called, 1);
    ck_assert_str_eq(g.val, "value");
    ck_assert_int_eq(amx_coord_kv_get(co, "k", 500, on_kv, &g2, &h, &err), AMX_OK);
    ck_assert_str_eq(g2.val, "value");
    answer_t g3 = {0};
    ck_assert_int_eq(amx_coord_kv_get(co, "missing", 500, on_kv, &g3, &h, &err), AMX_OK);
    amx_coord_expire(co, 500);
    ck_assert_int_eq(g3.st, AMX_ETIMEDOUT);
    amx_coord_destroy(co);
}
END_TEST

int main(void)
{
    amx_log_level = AMX_LOG_ERROR;
    Suite *s = suite_create("cluster");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, slurm_first_host);
    tcase_add_test(tc, identity_sources);
    tcase_add_test(tc, auth_tokens);
    tcase_add_test(tc, catalog_is_canonical);
    tcase_add_test(tc, jobstate_round_trip_and_corruption);
    tcase_add_test(tc, coordinator_membership_and_agreement);
    tcase_add_test(tc, coordinator_join_timeout_and_kv);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
