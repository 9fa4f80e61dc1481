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
#include "postproc.h"
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

/* -0 and 0 are the same recipe field: parsed alike, so equal specs hash
 * alike on every daemon (the hash reads the bytes). */
START_TEST(negative_zero_recipe_fields_hash_alike)
{
    amx_err_t err = {0};
    uint32_t shape[1] = {2};
    amx_qspec_in_t in;
    memset(&in, 0, sizeof(in));
    in.name = "q";
    in.global_shape = shape;
    in.ndim = 1;
    in.recipe.present = 1;
    in.recipe.format = AMX_FMT_FP8_E4M3;
    in.recipe.rule = AMX_RULE_CURRENT;
    amx_qspec_t s0, s1;
    in.recipe.eps = 0.0f;
    ck_assert_int_eq(amx_qspec_parse(&in, UINT64_MAX, &s0, &err), AMX_OK);
    in.recipe.eps = -0.0f;
    ck_assert_int_eq(amx_qspec_parse(&in, UINT64_MAX, &s1, &err), AMX_OK);
    ck_assert(!signbit(s1.recipe.eps));
    amx_qspec_t *a[1] = {amx_qspec_dup(&s0)}, *b[1] = {amx_qspec_dup(&s1)};
    amx_catalog_t *ca, *cb;
    ck_assert_int_eq(amx_catalog_build(a, 1, &ca, &err), AMX_OK);
    ck_assert_int_eq(amx_catalog_build(b, 1, &cb, &err), AMX_OK);
    ck_assert(amx_qspec_equal(ca->q[0], cb->q[0]));
    ck_assert_uint_eq(ca->hash, cb->hash);
    amx_catalog_free(ca);
    amx_catalog_free(cb);
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

/* ---- peer modes and global slices ---- */

/* A parsed (borrowed) spec of `shape` with the given group fields. */
static amx_status_t parse(const char *name, const uint32_t *shape, size_t ndim, int format,
                          const char *peer, int mode, uint32_t axes, const char *sg,
                          amx_qspec_t *out, amx_err_t *err)
{
    amx_qspec_in_t in;
    memset(&in, 0, sizeof(in));
    in.name = name;
    in.global_shape = shape;
    in.ndim = ndim;
    in.recipe.present = 1;
    in.recipe.format = format;
    in.peer_group = peer;
    in.scale_group = sg;
    in.peer_mode = mode;
    in.global_axes = axes;
    amx_err_clear(err);
    return amx_qspec_parse(&in, 1u << 20, out, err);
}

START_TEST(spec_peer_mode_and_global_axes)
{
    amx_err_t err = {0};
    amx_qspec_t a, b;
    uint32_t sh[3] = {4, 3, 8};
    /* Unspecified and FILL are the same mode; no group means no mode. */
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "g", 0, 0, NULL, &a, &err), AMX_OK);
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "g", 1, 0, NULL, &b, &err), AMX_OK);
    ck_assert_int_eq(a.peer_mode, AMX_PEER_FILL);
    ck_assert(amx_qspec_equal(&a, &b));
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, NULL, 0, 0, NULL, &a, &err), AMX_OK);
    ck_assert_int_eq(a.peer_mode, 0);
    /* SHARE differs from FILL: equality, diff, hash. */
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "g", 2, 0, NULL, &a, &err), AMX_OK);
    ck_assert_int_eq(a.peer_mode, AMX_PEER_SHARE);
    ck_assert(!amx_qspec_equal(&a, &b));
    char diff[200];
    amx_qspec_diff(&b, &a, diff, sizeof(diff));
    ck_assert_str_eq(diff, "peer_mode PEER_FILL vs PEER_SHARE");
    amx_qspec_t *pa = &a, *pb = &b;
    ck_assert_uint_ne(amx_catalog_hash(&pa, 1), amx_catalog_hash(&pb, 1));
    /* Bad modes. */
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "g", 3, 0, NULL, &a, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "peer_mode 3 is unknown"));
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "", 2, 0, NULL, &a, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "PEER_SHARE needs a peer_group"));
    /* global_axes: 0 < k < ndim, not with a scale group. */
    ck_assert_int_eq(parse("w", sh, 3, AMX_FMT_NVFP4, NULL, 0, 1, NULL, &a, &err), AMX_OK);
    ck_assert_uint_eq(amx_qspec_slices(&a), 4);
    ck_assert_int_eq(parse("w", sh, 3, AMX_FMT_NVFP4, NULL, 0, 2, NULL, &b, &err), AMX_OK);
    ck_assert_uint_eq(amx_qspec_slices(&b), 12);
    amx_qspec_diff(&a, &b, diff, sizeof(diff));
    ck_assert_str_eq(diff, "global_axes 1 vs 2");
    ck_assert_uint_ne(amx_catalog_hash(&pa, 1), amx_catalog_hash(&pb, 1));
    ck_assert_int_eq(parse("w", sh, 3, AMX_FMT_NVFP4, NULL, 0, 0, NULL, &a, &err), AMX_OK);
    ck_assert_uint_eq(amx_qspec_slices(&a), 0);
    ck_assert_int_eq(parse("w", sh, 3, AMX_FMT_NVFP4, NULL, 0, 3, NULL, &a, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "quantizer 'w': global_axes 3 must be less than the 3 dimensions "
                              "of global_shape (0: one global amax; k: one per index of the "
                              "first k axes)");
    ck_assert_int_eq(parse("w", sh, 0, AMX_FMT_NVFP4, NULL, 0, 1, NULL, &a, &err), AMX_EINVAL);
    ck_assert_int_eq(parse("w", sh, 2, AMX_FMT_NVFP4, NULL, 0, 1, "qkv", &a, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "cannot be combined with scale_group 'qkv'"));
}
END_TEST

/* A state of the host backend laid out for `cat`, with `vals` (ncells,
 * -inf = no data) as one epoch's reduced values, finished once. */
static amx_state_t *finished(const amx_catalog_t *cat, amx_qdesc_t *d, const float *vals)
{
    amx_err_t err = {0};
    amx_state_t *st;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    amx_catalog_layout(cat, d);
    amx_layout_change_t lc = {
        .ncells = cat->ncells, .nhist = cat->nhist, .nq = cat->n, .nslices = cat->nslices};
    ck_assert_int_eq(st->ops->reserve_pending(st, cat->ncells, &err), AMX_OK);
    ck_assert_int_eq(st->ops->remap(st, &lc, &err), AMX_OK);
    amx_run_t run = {0, 0, cat->ncells};
    ck_assert_int_eq(st->ops->merge(st, vals, cat->ncells, &run, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    ck_assert_int_eq(
        st->ops->finish(st, d, cat->n, cat->ncells, cat->npeer, cat->nscale, 1, 1, &err), AMX_OK);
    st->ops->publish(st);
    return st;
}

static amx_qspec_t *spec_mode(const char *name, uint32_t n, const char *peer, int mode)
{
    amx_qspec_t *s = spec(name, n, peer);
    s->peer_mode = (uint8_t)mode;
    return s;
}

START_TEST(host_finish_fill_and_share)
{
    amx_err_t err = {0};
    const float X = -INFINITY;
    /* Sorted: f.a f.b s.a s.b; groups "fill" and "share", same data. */
    amx_qspec_t *q[4] = {
        spec_mode("f.a", 3, "fill", AMX_PEER_FILL), spec_mode("f.b", 2, "fill", AMX_PEER_FILL),
        spec_mode("s.a", 3, "share", AMX_PEER_SHARE), spec_mode("s.b", 2, "share", AMX_PEER_SHARE)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 4, &cat, &err), AMX_OK);
    amx_qdesc_t d[4];
    float v[10] = {1, X, 5, X, X, 1, X, 5, X, X};
    amx_state_t *st = finished(cat, d, v);
    ck_assert_int_eq(d[2].peer_mode, AMX_PEER_SHARE);
    float amax[10], scale[10], inv[10];
    uint8_t bytes[10], marks[10];
    amx_run_t run = {0, 0, 10};
    ck_assert_int_eq(st->ops->read_results(st, &run, 1, 10, amax, scale, inv, bytes, &err), AMX_OK);
    ck_assert_int_eq(st->ops->read_filled(st, &run, 1, marks, &err), AMX_OK);
    static const float want[10] = {1, 5, 5, 5, 5, 5, 5, 5, 5, 5};
    static const uint8_t raised[10] = {0, 1, 0, 1, 1, 1, 1, 0, 1, 1};
    for (int i = 0; i < 10; i++) {
        ck_assert_float_eq(amax[i], want[i]);
        ck_assert_uint_eq(marks[i], raised[i]);
        ck_assert_float_eq(scale[i], 448.0f / want[i]);
    }
    ck_assert_uint_eq(st->last_filled, 7);
    ck_assert_uint_eq(st->last_missing, 0);
    for (int i = 0; i < 4; i++)
        ck_assert_float_eq(st->g_amax[st->front][i], 5.0f);
    amx_state_destroy(st);
    amx_catalog_free(cat);
    /* The per-cell rule itself. */
    uint8_t r;
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_SHARE, 2.0f, 5.0f, &r), 5.0f);
    ck_assert_uint_eq(r, 1);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_FILL, 2.0f, 5.0f, &r), 2.0f);
    ck_assert_uint_eq(r, 0);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_SHARE, X, X, &r), X);
    ck_assert_uint_eq(r, 0);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_FILL, X, 3.0f, &r), 3.0f);
    ck_assert_uint_eq(r, 1);
}
END_TEST

/* A [4, 2, 3] NVFP4 spec with global_axes k. */
static amx_qspec_t *spec_sliced(const char *name, uint32_t k)
{
    amx_qspec_t *s = spec(name, 4, NULL);
    s->ndim = 3;
    s->shape[1] = 2;
    s->shape[2] = 3;
    s->ncells = 24;
    s->recipe.format = AMX_FMT_NVFP4;
    s->recipe.rule = 0;
    s->recipe.nvfp4_convention = AMX_NVFP4_TE;
    s->recipe.output_convention = AMX_OUT_TE;
    s->recipe.scaled_max = 0.0f;
    s->global_axes = (uint8_t)k;
    return s;
}

START_TEST(host_finish_global_slices)
{
    amx_err_t err = {0};
    /* "a" scalar, "w" per-expert globals, "z" per-[E, R] globals. */
    amx_qspec_t *q[3] = {spec("a", 0, NULL), spec_sliced("w", 1), spec_sliced("z", 2)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 3, &cat, &err), AMX_OK);
    ck_assert_uint_eq(cat->nslices, 12);
    amx_qdesc_t d[3];
    float v[49];
    v[0] = 2.0f;
    for (int i = 0; i < 24; i++)
        v[1 + i] = v[25 + i] = (float)(i % 5 + 1) * (float)(1 << (4 * (i / 6)));
    v[1 + 7] = -INFINITY; /* a cell without data reads 0 */
    amx_state_t *st = finished(cat, d, v);
    ck_assert_uint_eq(d[0].nslices, 0);
    ck_assert_uint_eq(d[1].gbase, 0);
    ck_assert_uint_eq(d[1].nslices, 4);
    ck_assert_uint_eq(d[1].slice_cells, 6);
    ck_assert_uint_eq(d[2].gbase, 4);
    ck_assert_uint_eq(d[2].slice_cells, 3);
    int f = st->front;
    ck_assert_uint_eq(st->out_ns[f], 12);
    float amax[49], scale[49], inv[49];
    uint8_t bytes[49];
    amx_run_t run = {0, 0, 49};
    ck_assert_int_eq(st->ops->read_results(st, &run, 1, 49, amax, scale, inv, bytes, &err), AMX_OK);
    for (uint32_t qi = 1; qi < 3; qi++) {
        for (uint64_t sl = 0; sl < d[qi].nslices; sl++) {
            float m = 0.0f;
            for (uint64_t c = 0; c < d[qi].slice_cells; c++) {
                float a = v[d[qi].base + sl * d[qi].slice_cells + c];
                m = a > m ? a : m;
            }
            uint64_t g = d[qi].gbase + sl;
            ck_assert_float_eq(st->s_amax[f][g], m);
            ck_assert_float_eq(st->s_scale[f][g], amx_nvfp4_global_encode(m));
            ck_assert_float_eq(st->s_inv[f][g], amx_nvfp4_global_decode(AMX_OUT_TE, m));
            for (uint64_t c = 0; c < d[qi].slice_cells; c++) {
                uint64_t i = d[qi].base + sl * d[qi].slice_cells + c;
                float a = v[i] > 0.0f ? v[i] : 0.0f;
                ck_assert_uint_eq(bytes[i], amx_nvfp4_block_te(a, amx_nvfp4_global_encode(m)));
            }
        }
        /* The per-quantizer global keeps its meaning: the max over all. */
        ck_assert_float_eq(st->g_amax[f][qi], 5.0f * 4096.0f);
    }
    /* Serialized and imported: the same per-slice state. */
    void *blob;
    size_t len;
    ck_assert_int_eq(amx_jobstate_export("job", 1, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    amx_jobstate_t js;
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    ck_assert_uint_eq(js.cat->nslices, 12);
    ck_assert_uint_eq(js.cat->hash, cat->hash);
    ck_assert_int_eq(js.cat->q[1]->global_axes, 1);
    for (int i = 0; i < 12; i++)
        ck_assert_float_eq(js.a.s_amax[i], st->s_amax[f][i]);
    amx_state_t *st2;
    ck_assert_int_eq(amx_state_create("host", 0, &st2, &err), AMX_OK);
    ck_assert_int_eq(st2->ops->import_state(st2, js.cat->ncells, js.cat->nhist, js.cat->n,
                                            js.cat->nslices, &js.a, &err),
                     AMX_OK);
    st2->ops->publish(st2);
    for (int i = 0; i < 12; i++) {
        ck_assert_float_eq(st2->s_amax[st2->front][i], st->s_amax[f][i]);
        ck_assert_float_eq(st2->s_scale[st2->front][i], st->s_scale[f][i]);
    }
    amx_jobstate_free(&js);
    free(blob);
    amx_state_destroy(st2);
    /* A layout change keeps a sliced quantizer's slices (runs move them). */
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
    int send_catalog;
    char conflict[1024];
    char val[64];
} answer_t;

/* The catalog hash the daemons of these tests hold: the last agreed one. */
static uint64_t held_hash;

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
    a->send_catalog = s->send_catalog;
    if (s->send_catalog)
        return;
    held_hash = s->catalog_hash;
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

/* An offer's hash: the catalog hash of its specs in name order. */
static uint64_t offer_hash(amx_qspec_t **p, size_t np)
{
    if (np == 0)
        return 0;
    amx_qspec_t **sorted = malloc(np * sizeof(*sorted));
    memcpy(sorted, p, np * sizeof(*sorted));
    qsort(sorted, np, sizeof(*sorted), amx_qspec_name_cmp);
    uint64_t h = amx_catalog_hash(sorted, (uint32_t)np);
    free(sorted);
    return h;
}

static void sync1(amx_coord_t *co, uint32_t daemon, uint64_t last, amx_qspec_t **p, size_t np,
                  char **resets, size_t nr, answer_t *a)
{
    amx_coord_sync_req_t r = {.offer_hash = offer_hash(p, np),
                              .offer_count = (uint32_t)np,
                              .offer_included = np > 0,
                              .job = "j",
                              .daemon = daemon,
                              .incarnation = 1,
                              .last_reconciled = last,
                              .catalog_hash = held_hash,
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
    held_hash = amx_catalog_hash(NULL, 0);
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

/* A coordinator that restarted knows neither the job nor its catalog: a
 * daemon's agreement request names its ranks (which completes a Join
 * waiting for them), and a daemon holding a catalog the coordinator does
 * not have is asked for it whole before anything is agreed. */
START_TEST(coordinator_restarted_rebuilds_from_members)
{
    amx_coord_t *co = amx_coord_create(43, 1000);
    answer_t j0 = {0};
    join(co, 0, 0, 1, &j0); /* the coordinator's own trainer, ranks 1-3 unknown */
    ck_assert_int_eq(j0.called, 0);
    /* Daemon 1 held an agreed catalog {a, b} and sends only its hash. */
    amx_qspec_t *held[2] = {spec("a", 1, NULL), spec("b", 2, NULL)};
    amx_qspec_t *cp[2] = {amx_qspec_dup(held[0]), amx_qspec_dup(held[1])};
    amx_catalog_t *cat = NULL;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_catalog_build(cp, 2, &cat, &err), AMX_OK);
    uint32_t ranks1[3] = {1, 2, 3};
    amx_coord_sync_req_t r = {.job = "j",
                              .daemon = 1,
                              .incarnation = 1,
                              .last_reconciled = 5,
                              .catalog_hash = cat->hash,
                              .world = 4,
                              .ranks = ranks1,
                              .nranks = 3,
                              .addr = "h:2",
                              .deadline_ms = 5000};
    answer_t s1 = {0};
    amx_creq_t *h = (amx_creq_t *)1;
    ck_assert_int_eq(amx_coord_sync(co, &r, on_sync, &s1, &h, &err), AMX_OK);
    ck_assert_int_eq(s1.called, 1);
    ck_assert_int_eq(s1.send_catalog, 1);
    ck_assert_ptr_null(h); /* nothing waits */
    /* ... but its ranks are known now: the waiting Join completed. */
    ck_assert_int_eq(j0.called, 1);
    ck_assert_int_eq(j0.st, AMX_OK);
    ck_assert_uint_eq(j0.npart, 2);
    /* Whole, it waits for daemon 0, whose own catalog is empty. */
    r.proposals = held;
    r.nprop = 2;
    r.full_catalog = 1;
    r.offer_hash = offer_hash(held, 2);
    r.offer_count = 2;
    r.offer_included = 1;
    answer_t s1b = {0}, s0 = {0};
    ck_assert_int_eq(amx_coord_sync(co, &r, on_sync, &s1b, &h, &err), AMX_OK);
    ck_assert_int_eq(s1b.called, 0);
    amx_qspec_t *p0[1] = {spec("c", 1, NULL)};
    uint32_t ranks0[1] = {0};
    amx_coord_sync_req_t r0 = {.offer_hash = offer_hash(p0, 1),
                               .offer_count = 1,
                               .offer_included = 1,
                               .job = "j",
                               .daemon = 0,
                               .incarnation = 1,
                               .catalog_hash = amx_catalog_hash(NULL, 0),
                               .proposals = p0,
                               .nprop = 1,
                               .world = 4,
                               .ranks = ranks0,
                               .nranks = 1,
                               .addr = "h:1",
                               .deadline_ms = 5000};
    ck_assert_int_eq(amx_coord_sync(co, &r0, on_sync, &s0, &h, &err), AMX_OK);
    ck_assert_int_eq(s0.called + s1b.called, 2);
    ck_assert_uint_eq(s0.ncat, 3); /* a, b from daemon 1, c from daemon 0 */
    ck_assert_uint_eq(s0.hash, s1b.hash);
    ck_assert_uint_eq(s0.nbehind, 1); /* daemon 0, at epoch 0 */
    ck_assert_uint_eq(s0.donor, 1);
    ck_assert_uint_eq(s0.target, 5);
    for (int i = 0; i < 2; i++)
        amx_qspec_free(held[i]);
    amx_qspec_free(p0[0]);
    amx_catalog_free(cat);
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
    tcase_add_test(tc, negative_zero_recipe_fields_hash_alike);
    tcase_add_test(tc, jobstate_round_trip_and_corruption);
    tcase_add_test(tc, spec_peer_mode_and_global_axes);
    tcase_add_test(tc, host_finish_fill_and_share);
    tcase_add_test(tc, host_finish_global_slices);
    tcase_add_test(tc, coordinator_membership_and_agreement);
    tcase_add_test(tc, coordinator_restarted_rebuilds_from_members);
    tcase_add_test(tc, coordinator_join_timeout_and_kv);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
