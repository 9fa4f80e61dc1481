/*
 * test_catalog.c - quantizer specs and the canonical catalog: name rules,
 * every refusal of amx_qspec_parse and the defaults it fills in, equality,
 * copies and differences, the sorted catalog, its hash and its layout.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "catalog.h"
#include "unit.h"

/* ---- names ---- */

START_TEST(job_and_quantizer_names)
{
    char name[300];
    memset(name, 'a', sizeof(name));
    name[AMX_MAX_JOB_NAME] = '\0';
    ck_assert_int_eq(amx_valid_job_name(name), 1);
    name[AMX_MAX_JOB_NAME] = 'a';
    name[AMX_MAX_JOB_NAME + 1] = '\0';
    ck_assert_int_eq(amx_valid_job_name(name), 0);
    ck_assert_int_eq(amx_valid_job_name("run-7.b_2"), 1);
    const char *bad_jobs[] = {"", "a b", "a/b", "a:b", "caf\xc3\xa9", "a\nb"};
    for (size_t i = 0; i < sizeof(bad_jobs) / sizeof(bad_jobs[0]); i++)
        ck_assert_msg(!amx_valid_job_name(bad_jobs[i]), "job name '%s' accepted", bad_jobs[i]);
    ck_assert_int_eq(amx_valid_job_name(NULL), 0);

    memset(name, 'q', sizeof(name));
    name[AMX_MAX_NAME] = '\0';
    ck_assert_int_eq(amx_valid_name(name), 1);
    name[AMX_MAX_NAME] = 'q';
    name[AMX_MAX_NAME + 1] = '\0';
    ck_assert_int_eq(amx_valid_name(name), 0);
    ck_assert_int_eq(amx_valid_name("model.layers.0/attn:q[1]~"), 1);
    const char *bad[] = {"", "a b", "a\tb", "a\x7f", "\xc3\xa9"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        ck_assert_msg(!amx_valid_name(bad[i]), "quantizer name '%s' accepted", bad[i]);
    ck_assert_int_eq(amx_valid_name(NULL), 0);
}
END_TEST

START_TEST(shapes_are_formatted)
{
    char b[64];
    uint32_t d[3] = {4, 30, 7};
    amx_fmt_shape(b, sizeof(b), d, 0);
    ck_assert_str_eq(b, "[]");
    amx_fmt_shape(b, sizeof(b), d, 3);
    ck_assert_str_eq(b, "[4, 30, 7]");
    /* A short buffer is cut, never overrun. */
    char small[6];
    memset(small, 'x', sizeof(small));
    amx_fmt_shape(small, 5, d, 3);
    ck_assert_uint_lt(strlen(small), 5);
    ck_assert_int_eq(small[5], 'x');
}
END_TEST

/* ---- parsing ---- */

/* A valid FP8 E4M3 spec of shape [4, 8] to change one field of. */
static amx_qspec_in_t base_in(void)
{
    static const uint32_t shape[2] = {4, 8};
    amx_qspec_in_t in;
    memset(&in, 0, sizeof(in));
    in.name = "layer.w";
    in.global_shape = shape;
    in.ndim = 2;
    in.recipe.present = 1;
    in.recipe.format = AMX_FMT_FP8_E4M3;
    return in;
}

/* Parses `in` expecting EINVAL (or `code`) and a message holding `phrase`. */
static void refused(const amx_qspec_in_t *in, amx_status_t code, const char *phrase)
{
    amx_err_t err = {0};
    amx_qspec_t s;
    ck_assert_int_eq(amx_qspec_parse(in, 1u << 20, &s, &err), code);
    AMX_ASSERT_HAS(err.msg, phrase);
}

START_TEST(parse_refuses_bad_specs)
{
    amx_qspec_in_t in = base_in();
    in.name = "bad name";
    refused(&in, AMX_EINVAL, "quantizer name 'bad name' is invalid");
    in = base_in();
    in.name = NULL;
    refused(&in, AMX_EINVAL, "quantizer name '' is invalid");
    in = base_in();
    uint32_t five[5] = {1, 1, 1, 1, 1};
    in.global_shape = five;
    in.ndim = 5;
    refused(&in, AMX_EINVAL, "global_shape has 5 dimensions, at most 4");
    in = base_in();
    uint32_t zero[2] = {4, 0};
    in.global_shape = zero;
    refused(&in, AMX_EINVAL, "global_shape[1] is 0");
    in = base_in();
    uint32_t huge[2] = {1u << 11, 1u << 10};
    in.global_shape = huge;
    refused(&in, AMX_ENOMEM, "more than max_cells=1048576 cells");
    in = base_in();
    in.accumulation = 3;
    refused(&in, AMX_EINVAL, "accumulation 3 is unknown");
    in = base_in();
    in.peer_group = "a b";
    refused(&in, AMX_EINVAL, "peer_group name is invalid");
    in = base_in();
    in.scale_group = "\x01";
    refused(&in, AMX_EINVAL, "scale_group name is invalid");
}
END_TEST

/* Bad recipe k (0.. until NULL): changes `in` and returns the phrase its
 * refusal must hold. */
static const char *bad_recipe(int k, amx_qspec_in_t *in)
{
    amx_recipe_in_t *r = &in->recipe;
    switch (k) {
    case 0:
        r->present = 0;
        return "recipe is missing";
    case 1:
        r->format = 0;
        return "recipe.format 0 is not FP8_E4M3";
    case 2:
        r->format = 5;
        return "recipe.format 5 is not";
    case 3:
        r->rule = AMX_RULE_BLOCK_FP16 + 1;
        return "recipe.rule 5 is unknown (use CURRENT, DELAYED, BLOCK_BF16 or BLOCK_FP16)";
    case 4:
        r->format = AMX_FMT_NVFP4, r->rule = AMX_RULE_CURRENT;
        return "recipe.rule applies to FP8 formats only";
    case 5:
        r->margin = NAN;
        return "recipe.margin must be in [-100, 100]";
    case 6:
        r->margin = 101.0f;
        return "recipe.margin must be in [-100, 100]";
    case 7:
        r->margin = 1.0f;
        return "recipe.margin applies to FP8 DELAYED scaling only";
    case 8:
        r->rule = AMX_RULE_DELAYED, in->accumulation = AMX_ACC_PER_EPOCH, r->history_len = 1025;
        return "recipe.history_len 1025 exceeds 1024";
    case 9:
        r->history_len = 2;
        return "history_len > 1 needs rule DELAYED and accumulation PER_EPOCH";
    case 10:
        r->rule = AMX_RULE_DELAYED, r->history_len = 2;
        return "history_len > 1 needs rule DELAYED and accumulation PER_EPOCH";
    case 11:
        r->history_reduce = 3;
        return "recipe.history_reduce 3 is unknown";
    case 12:
        r->eps = -1.0f;
        return "recipe.eps must be finite and >= 0";
    case 13:
        r->eps = INFINITY;
        return "recipe.eps must be finite and >= 0";
    case 14:
        r->rule = AMX_RULE_DELAYED, r->eps = 1e-6f;
        return "eps and power_of_2 apply to FP8 CURRENT (and BLOCK_BF16, BLOCK_FP16) scaling "
               "only";
    case 15:
        r->rule = AMX_RULE_DELAYED, r->power_of_2 = 1;
        return "eps and power_of_2 apply to FP8 CURRENT (and BLOCK_BF16, BLOCK_FP16) scaling "
               "only";
    case 16:
        r->format = AMX_FMT_NVFP4, r->nvfp4_convention = AMX_NVFP4_TE_PARTIAL_CAST + 1;
        return "recipe.nvfp4_convention 6 is unknown";
    case 17:
        r->nvfp4_convention = AMX_NVFP4_TE;
        return "nvfp4_convention applies to NVFP4 only";
    case 18:
        r->output_convention = 3;
        return "recipe.output_convention 3 is unknown";
    case 19:
        r->rule = AMX_RULE_DELAYED, r->output_convention = AMX_OUT_MODELOPT;
        return "ModelOpt has no delayed scaling";
    case 20:
        r->format = AMX_FMT_MXFP8, r->output_convention = AMX_OUT_MODELOPT;
        return "ModelOpt has no MXFP8 export factors";
    case 21:
        r->history_convention = 3;
        return "recipe.history_convention 3 is unknown";
    case 22:
        r->history_convention = AMX_HISTCONV_TE;
        return "history_convention applies to FP8 DELAYED scaling only";
    case 23:
        r->format = AMX_FMT_MXFP8, r->mxfp8_convention = AMX_MX_TE_2_18 + 1;
        return "recipe.mxfp8_convention 6 is unknown";
    case 24:
        r->mxfp8_convention = AMX_MX_TE;
        return "mxfp8_convention applies to MXFP8 only";
    case 25:
        r->rule = AMX_RULE_BLOCK_BF16, r->output_convention = AMX_OUT_MODELOPT;
        return "ModelOpt has no FP8 block-scaling rules";
    case 26:
        r->format = AMX_FMT_MXFP8, r->rule = AMX_RULE_BLOCK_FP16;
        return "recipe.rule applies to FP8 formats only";
    default:
        return NULL;
    }
}

START_TEST(parse_refuses_bad_recipes)
{
    int k = 0;
    for (;; k++) {
        amx_qspec_in_t in = base_in();
        const char *phrase = bad_recipe(k, &in);
        if (phrase == NULL)
            break;
        amx_err_t err = {0};
        amx_qspec_t s;
        ck_assert_msg(amx_qspec_parse(&in, 1u << 20, &s, &err) == AMX_EINVAL,
                      "bad recipe %d was not refused (message '%s')", k, err.msg);
        AMX_ASSERT_HAS(err.msg, phrase);
        /* Every sentence names the quantizer. */
        AMX_ASSERT_HAS(err.msg, "quantizer 'layer.w'");
    }
    ck_assert_int_eq(k, 27);
}
END_TEST

START_TEST(parse_fills_defaults)
{
    amx_err_t err = {0};
    amx_qspec_t s;
    amx_qspec_in_t in = base_in();
    ck_assert_int_eq(amx_qspec_parse(&in, 32, &s, &err), AMX_OK);
    ck_assert_str_eq(s.name, "layer.w");
    ck_assert_uint_eq(s.ncells, 32);
    ck_assert_int_eq(s.accumulation, AMX_ACC_RUNNING_MAX);
    ck_assert_int_eq(s.recipe.rule, AMX_RULE_CURRENT);
    ck_assert_uint_eq(s.recipe.history_len, 1);
    ck_assert_int_eq(s.recipe.history_reduce, AMX_HIST_MAX);
    ck_assert_int_eq(s.recipe.output_convention, AMX_OUT_TE);
    ck_assert_int_eq(s.recipe.nvfp4_convention, 0);
    ck_assert_int_eq(s.recipe.mxfp8_convention, 0);
    ck_assert_int_eq(s.recipe.history_convention, 0);
    ck_assert_float_eq(s.recipe.scaled_max, AMX_E4M3_MAX);
    ck_assert_str_eq(s.peer_group, "");
    ck_assert_str_eq(s.scale_group, "");
    ck_assert_int_eq(s.peer_mode, 0);
    /* The strings are borrowed from the request. */
    ck_assert_ptr_eq(s.name, in.name);
    /* Delayed scaling with a margin: the scaled max is fp8 max * 2^-margin. */
    in.recipe.format = AMX_FMT_FP8_E5M2;
    in.recipe.rule = AMX_RULE_DELAYED;
    in.recipe.margin = 2.0f;
    in.recipe.history_len = 16;
    in.accumulation = AMX_ACC_PER_EPOCH;
    ck_assert_int_eq(amx_qspec_parse(&in, 32, &s, &err), AMX_OK);
    ck_assert_float_eq(s.recipe.scaled_max, AMX_E5M2_MAX / 4.0f);
    ck_assert_int_eq(s.recipe.history_convention, AMX_HISTCONV_TE);
    ck_assert_uint_eq(amx_qspec_hist_cells(&s), 32 * 16);
    /* NVFP4 and MXFP8: no rule, their conventions' defaults. */
    in = base_in();
    in.recipe.format = AMX_FMT_NVFP4;
    ck_assert_int_eq(amx_qspec_parse(&in, 32, &s, &err), AMX_OK);
    ck_assert_int_eq(s.recipe.rule, 0);
    ck_assert_int_eq(s.recipe.nvfp4_convention, AMX_NVFP4_TE);
    ck_assert_float_eq(s.recipe.scaled_max, 0.0f);
    ck_assert_uint_eq(amx_qspec_hist_cells(&s), 0);
    in.recipe.format = AMX_FMT_MXFP8;
    ck_assert_int_eq(amx_qspec_parse(&in, 32, &s, &err), AMX_OK);
    ck_assert_int_eq(s.recipe.mxfp8_convention, AMX_MX_TE);
    /* TE's FP8 block-scaling rules: current scaling's formula, eps and
     * power of 2 included. */
    in = base_in();
    in.recipe.rule = AMX_RULE_BLOCK_FP16;
    in.recipe.eps = 1e-6f;
    in.recipe.power_of_2 = 1;
    ck_assert_int_eq(amx_qspec_parse(&in, 32, &s, &err), AMX_OK);
    ck_assert_int_eq(s.recipe.rule, AMX_RULE_BLOCK_FP16);
    ck_assert_int_eq(s.recipe.power_of_2, 1);
    ck_assert_float_eq(s.recipe.scaled_max, AMX_E4M3_MAX);
    /* A scalar: no dimensions, one cell. */
    in = base_in();
    in.ndim = 0;
    ck_assert_int_eq(amx_qspec_parse(&in, 1, &s, &err), AMX_OK);
    ck_assert_uint_eq(s.ncells, 1);
    ck_assert_str_eq(err.msg, "");
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
    ck_assert_int_eq(signbit(s1.recipe.eps), 0);
    amx_qspec_t *a[1] = {amx_qspec_dup(&s0)}, *b[1] = {amx_qspec_dup(&s1)};
    amx_catalog_t *ca, *cb;
    ck_assert_int_eq(amx_catalog_build(a, 1, &ca, &err), AMX_OK);
    ck_assert_int_eq(amx_catalog_build(b, 1, &cb, &err), AMX_OK);
    ck_assert_int_eq(amx_qspec_equal(ca->q[0], cb->q[0]), 1);
    ck_assert_uint_eq(ca->hash, cb->hash);
    amx_catalog_free(ca);
    amx_catalog_free(cb);
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
    ck_assert_int_eq(amx_qspec_equal(&a, &b), 1);
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, NULL, 0, 0, NULL, &a, &err), AMX_OK);
    ck_assert_int_eq(a.peer_mode, 0);
    /* SHARE differs from FILL: equality, diff, hash. */
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "g", 2, 0, NULL, &a, &err), AMX_OK);
    ck_assert_int_eq(a.peer_mode, AMX_PEER_SHARE);
    ck_assert_int_eq(amx_qspec_equal(&a, &b), 0);
    char diff[200];
    amx_qspec_diff(&b, &a, diff, sizeof(diff));
    ck_assert_str_eq(diff, "peer_mode PEER_FILL vs PEER_SHARE");
    amx_qspec_t *pa = &a, *pb = &b;
    ck_assert_uint_ne(amx_catalog_hash(&pa, 1), amx_catalog_hash(&pb, 1));
    /* Bad modes. */
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "g", 3, 0, NULL, &a, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "peer_mode 3 is unknown");
    ck_assert_int_eq(parse("a", sh, 1, AMX_FMT_FP8_E4M3, "", 2, 0, NULL, &a, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "PEER_SHARE needs a peer_group");
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
    AMX_ASSERT_HAS(err.msg, "cannot be combined with scale_group 'qkv'");
    ck_assert_str_eq(amx_peer_mode_name(0), "none");
}
END_TEST

/* ---- copies and differences ---- */

START_TEST(dup_equal_and_diff)
{
    amx_err_t err = {0};
    amx_qspec_in_t in = base_in();
    char name[] = "layer.w", pg[] = "experts", sg[] = "";
    in.name = name;
    in.peer_group = pg;
    in.scale_group = sg;
    amx_qspec_t s;
    ck_assert_int_eq(amx_qspec_parse(&in, 64, &s, &err), AMX_OK);
    amx_qspec_t *d = amx_qspec_dup(&s);
    ck_assert_ptr_nonnull(d);
    ck_assert_int_eq(amx_qspec_equal(&s, d), 1);
    /* The copy owns its strings: changing the request changes only s. */
    ck_assert_ptr_ne(d->name, s.name);
    name[0] = 'L';
    pg[0] = 'E';
    ck_assert_str_eq(d->name, "layer.w");
    ck_assert_str_eq(d->peer_group, "experts");
    ck_assert_int_eq(amx_qspec_equal(&s, d), 0);
    char diff[512];
    amx_qspec_diff(d, d, diff, sizeof(diff));
    ck_assert_str_eq(diff, "no difference");
    /* The first difference, field by field. */
    amx_qspec_t t = *d;
    t.shape[1] = 9;
    amx_qspec_diff(d, &t, diff, sizeof(diff));
    ck_assert_str_eq(diff, "global shape [4, 8] vs [4, 9]");
    t = *d;
    t.recipe.format = AMX_FMT_MXFP8;
    amx_qspec_diff(d, &t, diff, sizeof(diff));
    ck_assert_str_eq(diff, "format FP8_E4M3 vs MXFP8");
    t = *d;
    t.recipe.eps = 0.5f;
    amx_qspec_diff(d, &t, diff, sizeof(diff));
    AMX_ASSERT_HAS(diff, "eps 0,");
    AMX_ASSERT_HAS(diff, "eps 0.5,");
    ck_assert_int_eq(amx_qspec_equal(d, &t), 0);
    t = *d;
    t.accumulation = AMX_ACC_PER_EPOCH;
    amx_qspec_diff(d, &t, diff, sizeof(diff));
    ck_assert_str_eq(diff, "accumulation RUNNING_MAX vs PER_EPOCH");
    t = *d;
    t.scale_group = "qkv";
    amx_qspec_diff(d, &t, diff, sizeof(diff));
    ck_assert_str_eq(diff, "scale_group '' vs 'qkv'");
    amx_qspec_free(d);
    amx_qspec_free(NULL);
}
END_TEST

/* ---- catalogs ---- */

START_TEST(catalog_is_canonical)
{
    amx_err_t err = {0};
    amx_qspec_t *a[4] = {unit_spec("z", 3, "g2"), unit_spec("b", 1, NULL), unit_spec("m", 2, "g1"),
                         unit_spec("a", 4, "g2")};
    amx_qspec_t *b[4] = {unit_spec("a", 4, "g2"), unit_spec("m", 2, "g1"), unit_spec("z", 3, "g2"),
                         unit_spec("b", 1, NULL)};
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
    amx_qspec_t *c[1] = {unit_spec("a", 4, "g3")}, *e[1] = {unit_spec("a", 4, "g2")};
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

START_TEST(empty_catalog)
{
    amx_catalog_t *c = amx_catalog_empty();
    ck_assert_ptr_nonnull(c);
    ck_assert_uint_eq(c->n, 0);
    ck_assert_uint_eq(c->ncells, 0);
    ck_assert_uint_eq(c->hash, amx_catalog_hash(NULL, 0));
    ck_assert_int_eq(amx_catalog_find(c, "a"), -1);
    /* Built from nothing, the same catalog. */
    amx_catalog_t *b;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_catalog_build(NULL, 0, &b, &err), AMX_OK);
    ck_assert_uint_eq(b->hash, c->hash);
    /* ... and not the hash of a catalog of one. */
    amx_qspec_t *one = unit_spec("a", 1, NULL);
    ck_assert_uint_ne(amx_catalog_hash(&one, 1), c->hash);
    amx_qspec_free(one);
    amx_catalog_free(b);
    amx_catalog_free(c);
    amx_catalog_free(NULL);
}
END_TEST

/* Every field that two daemons must agree on changes the hash. */
START_TEST(hash_covers_every_field)
{
    amx_qspec_t *base = unit_spec("q", 4, "pg");
    uint64_t h0 = amx_catalog_hash(&base, 1);
    for (int f = 0; f < 16; f++) {
        amx_qspec_t *s = amx_qspec_dup(base);
        switch (f) {
        case 0:
            s->name[0] = 'r';
            break;
        case 1:
            s->shape[0] = 5;
            break;
        case 2:
            s->recipe.format = AMX_FMT_FP8_E5M2;
            break;
        case 3:
            s->recipe.rule = AMX_RULE_DELAYED;
            break;
        case 4:
            s->recipe.history_reduce = AMX_HIST_MOST_RECENT;
            break;
        case 5:
            s->recipe.nvfp4_convention = 2;
            break;
        case 6:
            s->recipe.power_of_2 = 1;
            break;
        case 7:
            s->accumulation = AMX_ACC_PER_EPOCH;
            break;
        case 8:
            s->recipe.output_convention = AMX_OUT_MODELOPT;
            break;
        case 9:
            s->recipe.history_convention = 2;
            break;
        case 10:
            s->recipe.mxfp8_convention = 3;
            break;
        case 11:
            s->recipe.history_len = 2;
            break;
        case 12:
            s->recipe.margin = 1.0f;
            break;
        case 13:
            s->recipe.eps = 1e-3f;
            break;
        case 14:
            s->peer_mode = AMX_PEER_SHARE;
            break;
        case 15:
            s->global_axes = 1;
            break;
        }
        ck_assert_msg(amx_catalog_hash(&s, 1) != h0, "field %d does not change the hash", f);
        amx_qspec_free(s);
    }
    /* Group names: a scale group, and the peer group itself. */
    amx_qspec_t t = *base;
    t.scale_group = "sg";
    amx_qspec_t *pt = &t;
    ck_assert_uint_ne(amx_catalog_hash(&pt, 1), h0);
    t = *base;
    t.peer_group = "ph";
    ck_assert_uint_ne(amx_catalog_hash(&pt, 1), h0);
    amx_qspec_free(base);
}
END_TEST

START_TEST(layout_of_history_groups_and_slices)
{
    amx_err_t err = {0};
    /* "a" PER_EPOCH with a history of 3, "b" in scale group "s1", "c" in
     * scale group "s0", "d" NVFP4 [2, 4] with a global per row. */
    amx_qspec_t *q[4] = {unit_spec("c", 2, NULL), unit_spec("a", 5, NULL), unit_spec("b", 1, NULL),
                         unit_spec("d", 2, NULL)};
    q[1]->accumulation = AMX_ACC_PER_EPOCH;
    q[1]->recipe.rule = AMX_RULE_DELAYED;
    q[1]->recipe.history_len = 3;
    q[2]->scale_group = "s1";
    q[0]->scale_group = "s0";
    q[3]->ndim = 2;
    q[3]->shape[1] = 4;
    q[3]->ncells = 8;
    q[3]->recipe.format = AMX_FMT_NVFP4;
    q[3]->global_axes = 1;
    amx_catalog_t *c;
    ck_assert_int_eq(amx_catalog_build(q, 4, &c, &err), AMX_OK);
    ck_assert_uint_eq(c->ncells, 5 + 1 + 2 + 8);
    ck_assert_uint_eq(c->nhist, 15);
    ck_assert_uint_eq(c->nslices, 2);
    ck_assert_uint_eq(c->nscale, 2);
    ck_assert_uint_eq(c->npeer, 0);
    amx_qdesc_t d[4];
    amx_catalog_layout(c, d);
    ck_assert_uint_eq(d[0].hist_base, 0);
    ck_assert_uint_eq(d[0].hist_len, 3);
    ck_assert_int_eq(d[0].accumulation, AMX_ACC_PER_EPOCH);
    ck_assert_uint_eq(d[1].hist_len, 1);
    ck_assert_uint_eq(d[1].hist_base, 15);
    ck_assert_int_eq(d[1].scale_group, 1); /* "s1" */
    ck_assert_int_eq(d[2].scale_group, 0); /* "s0" */
    ck_assert_int_eq(d[3].scale_group, -1);
    ck_assert_uint_eq(d[2].base, 6);
    ck_assert_uint_eq(d[3].base, 8);
    ck_assert_uint_eq(d[3].gbase, 0);
    ck_assert_uint_eq(d[3].nslices, 2);
    ck_assert_uint_eq(d[3].slice_cells, 4);
    ck_assert_uint_eq(d[2].nslices, 0);
    ck_assert_uint_eq(amx_qdesc_slices(d, 4), 2);
    ck_assert_int_eq(d[3].recipe.format, AMX_FMT_NVFP4);
    amx_catalog_free(c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("catalog");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, job_and_quantizer_names);
    tcase_add_test(tc, shapes_are_formatted);
    tcase_add_test(tc, parse_refuses_bad_specs);
    tcase_add_test(tc, parse_refuses_bad_recipes);
    tcase_add_test(tc, parse_fills_defaults);
    tcase_add_test(tc, negative_zero_recipe_fields_hash_alike);
    tcase_add_test(tc, spec_peer_mode_and_global_axes);
    tcase_add_test(tc, dup_equal_and_diff);
    tcase_add_test(tc, catalog_is_canonical);
    tcase_add_test(tc, empty_catalog);
    tcase_add_test(tc, hash_covers_every_field);
    tcase_add_test(tc, layout_of_history_groups_and_slices);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
