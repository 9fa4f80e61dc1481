/*
 * test_codec.c - protobuf <-> C, held to protobuf-c itself: recipes, specs
 * and memberships through pack and unpack and back; SendAmaxRequest and
 * SendPackedRequest read in place against protobuf-c's unpacking of the
 * same bytes, field by field (generated messages, repeated and unknown
 * fields, scratch reuse); and the packed answer written in place
 * (amx_codec_packed_layout + amx_codec_packed_finish) as protobuf-c reads
 * it, with every array 16-byte aligned in memory wherever the buffer lies.
 */
#include <check.h>
#include <protobuf-c/protobuf-c.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "codec.h"
#include "wire.h"
#include "unit.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint32_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* Packs with protobuf-c (malloc'd). */
static uint8_t *pack(const ProtobufCMessage *m, size_t *len)
{
    *len = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(*len ? *len : 1);
    ck_assert_uint_eq(protobuf_c_message_pack(m, b), *len);
    return b;
}

/* ---- mapping ---- */

/* Specs that use every field: parsed as a trainer's would be. */
static void parsed_spec(int k, amx_qspec_t *out, uint32_t *shape)
{
    amx_qspec_in_t in;
    memset(&in, 0, sizeof(in));
    in.recipe.present = 1;
    in.global_shape = shape;
    switch (k) {
    case 0: /* FP8 delayed, with a history window and a margin */
        in.name = "layer.0.fc1.input";
        shape[0] = 8, shape[1] = 16;
        in.ndim = 2;
        in.recipe.format = AMX_FMT_FP8_E5M2;
        in.recipe.rule = AMX_RULE_DELAYED;
        in.recipe.margin = -1.5f;
        in.recipe.history_len = 16;
        in.recipe.history_reduce = AMX_HIST_MOST_RECENT;
        in.recipe.history_convention = AMX_HISTCONV_TE_UNFUSED;
        in.accumulation = AMX_ACC_PER_EPOCH;
        in.scale_group = "qkv";
        break;
    case 1: /* NVFP4, one global per expert, shared within a group */
        in.name = "experts.w";
        shape[0] = 4, shape[1] = 3, shape[2] = 2;
        in.ndim = 3;
        in.recipe.format = AMX_FMT_NVFP4;
        in.recipe.nvfp4_convention = AMX_NVFP4_MODELOPT_STATIC;
        in.recipe.output_convention = AMX_OUT_MODELOPT;
        in.peer_group = "moe";
        in.peer_mode = AMX_PEER_SHARE;
        in.global_axes = 1;
        break;
    case 2: /* MXFP8 */
        in.name = "m";
        shape[0] = 64;
        in.ndim = 1;
        in.recipe.format = AMX_FMT_MXFP8;
        in.recipe.mxfp8_convention = AMX_MX_OCP;
        in.peer_group = "g";
        break;
    default: /* FP8 current, power of 2, eps; a scalar */
        in.name = "s";
        in.ndim = 0;
        in.recipe.format = AMX_FMT_FP8_E4M3;
        in.recipe.power_of_2 = 1;
        in.recipe.eps = 1e-12f;
        break;
    }
    amx_err_t err = {0};
    ck_assert_msg(amx_qspec_parse(&in, UINT64_MAX, out, &err) == AMX_OK, "spec %d: %s", k, err.msg);
}

START_TEST(specs_round_trip_through_protobuf)
{
    for (int k = 0; k < 4; k++) {
        uint32_t shape[4];
        amx_qspec_t s;
        parsed_spec(k, &s, shape);
        /* Out (another daemon's view), packed, unpacked, parsed back. */
        Amaxd__V1__QuantizerSpec q;
        amx_arena_t ar = {0};
        ck_assert_int_eq(amx_codec_spec_out(&s, &q, &ar), AMX_OK);
        size_t len;
        uint8_t *b = pack(&q.base, &len);
        Amaxd__V1__QuantizerSpec *u = amaxd__v1__quantizer_spec__unpack(NULL, len, b);
        ck_assert_ptr_nonnull(u);
        amx_qspec_t back;
        amx_err_t err = {0};
        ck_assert_msg(amx_codec_spec_parse(u, &back, &err) == AMX_OK, "spec %d: %s", k, err.msg);
        char diff[512];
        amx_qspec_diff(&s, &back, diff, sizeof(diff));
        ck_assert_msg(amx_qspec_equal(&s, &back), "spec %d: %s", k, diff);
        ck_assert_float_eq(back.recipe.scaled_max, s.recipe.scaled_max);
        amx_qspec_t *ps = &s, *pb = &back;
        ck_assert_uint_eq(amx_catalog_hash(&ps, 1), amx_catalog_hash(&pb, 1));
        /* The recipe alone, both ways. */
        amx_recipe_in_t rin;
        amx_codec_recipe_in(u->recipe, &rin);
        ck_assert_int_eq(rin.present, 1);
        ck_assert_int_eq(rin.format, s.recipe.format);
        ck_assert_int_eq(rin.history_reduce, s.recipe.history_reduce);
        ck_assert_int_eq(rin.mxfp8_convention, s.recipe.mxfp8_convention);
        ck_assert_uint_eq(rin.history_len, s.recipe.history_len);
        ck_assert_float_eq(rin.margin, s.recipe.margin);
        ck_assert_float_eq(rin.eps, s.recipe.eps);
        amaxd__v1__quantizer_spec__free_unpacked(u, NULL);
        free(b);
        amx_arena_free(&ar);
    }
    /* No recipe: absent, which parsing refuses. */
    amx_recipe_in_t rin;
    memset(&rin, 0xff, sizeof(rin));
    amx_codec_recipe_in(NULL, &rin);
    ck_assert_int_eq(rin.present, 0);
    ck_assert_int_eq(rin.format, 0);
}
END_TEST

/* A trainer's spec keeps its placement; another daemon's loses it. */
START_TEST(spec_in_keeps_the_placement)
{
    uint32_t shape[2] = {8, 4}, off[2] = {4, 0}, ls[2] = {4, 4};
    Amaxd__V1__Recipe r = AMAXD__V1__RECIPE__INIT;
    r.format = AMAXD__V1__FORMAT__FP8_E4M3;
    Amaxd__V1__QuantizerSpec q = AMAXD__V1__QUANTIZER_SPEC__INIT;
    q.name = "w";
    q.n_global_shape = 2;
    q.global_shape = shape;
    q.n_offset = 2;
    q.offset = off;
    q.n_local_shape = 2;
    q.local_shape = ls;
    q.recipe = &r;
    q.accumulation = AMAXD__V1__ACCUMULATION__PER_EPOCH;
    q.peer_group = "p";
    q.scale_group = "s";
    amx_qspec_in_t in;
    amx_codec_spec_in(&q, &in);
    ck_assert_str_eq(in.name, "w");
    ck_assert_uint_eq(in.ndim, 2);
    ck_assert_uint_eq(in.n_offset, 2);
    ck_assert_uint_eq(in.offset[0], 4);
    ck_assert_uint_eq(in.n_local_shape, 2);
    ck_assert_uint_eq(in.local_shape[1], 4);
    ck_assert_int_eq(in.accumulation, AMX_ACC_PER_EPOCH);
    ck_assert_str_eq(in.peer_group, "p");
    ck_assert_str_eq(in.scale_group, "s");
    ck_assert_int_eq(in.recipe.present, 1);
    amx_qspec_t s;
    amx_err_t err = {0};
    /* The placement is not part of a spec: parsed alike either way. */
    ck_assert_int_eq(amx_codec_spec_parse(&q, &s, &err), AMX_OK);
    ck_assert_uint_eq(s.ncells, 32);
    /* A bad spec from another daemon is refused as a trainer's would be. */
    q.global_axes = 2;
    q.scale_group = "";
    ck_assert_int_eq(amx_codec_spec_parse(&q, &s, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "global_axes 2 must be less than the 2 dimensions");
}
END_TEST

START_TEST(membership_round_trip)
{
    uint32_t r0[2] = {0, 1}, r1[3] = {2, 5, 7};
    amx_part_t parts[3] = {{0, 111, "h0:7420", r0, 2},
                           {3, 0xfedcba9876543210ull, "h3:7420", r1, 3},
                           {4, 1, "", NULL, 0}};
    amx_membership_t m = {8, 3, parts, 0, 9};
    amx_arena_t a = {0};
    Amaxd__Peer__V1__Participant **v;
    size_t n;
    ck_assert_int_eq(amx_codec_members_out(&m, &v, &n, &a), AMX_OK);
    ck_assert_uint_eq(n, 3);
    /* Through the wire, one by one. */
    Amaxd__Peer__V1__Participant *u[3];
    for (size_t i = 0; i < n; i++) {
        size_t len;
        uint8_t *b = pack(&v[i]->base, &len);
        u[i] = amaxd__peer__v1__participant__unpack(NULL, len, b);
        ck_assert_ptr_nonnull(u[i]);
        free(b);
    }
    amx_arena_free(&a);
    amx_membership_t back;
    ck_assert_int_eq(amx_codec_members_in(u, n, 8, &back), AMX_OK);
    ck_assert_uint_eq(back.world, 8);
    ck_assert_uint_eq(back.npart, 3);
    for (uint32_t i = 0; i < 3; i++) {
        ck_assert_uint_eq(back.part[i].daemon, parts[i].daemon);
        ck_assert_uint_eq(back.part[i].incarnation, parts[i].incarnation);
        ck_assert_str_eq(back.part[i].addr, parts[i].addr);
        ck_assert_uint_eq(back.part[i].nranks, parts[i].nranks);
        for (uint32_t k = 0; k < parts[i].nranks; k++)
            ck_assert_uint_eq(back.part[i].ranks[k], parts[i].ranks[k]);
        amaxd__peer__v1__participant__free_unpacked(u[i], NULL);
    }
    amx_membership_free(&back);
}
END_TEST

START_TEST(pack_is_protobuf_c_pack)
{
    Amaxd__V1__JoinRequest j = AMAXD__V1__JOIN_REQUEST__INIT;
    j.job = "job";
    j.rank = 300;
    j.world_size = 512;
    size_t n1, n2;
    uint8_t *a = amx_codec_pack(&j.base, &n1), *b = pack(&j.base, &n2);
    ck_assert_uint_eq(n1, n2);
    ck_assert_int_eq(memcmp(a, b, n1), 0);
    free(a);
    free(b);
    Amaxd__V1__StatusRequest e = AMAXD__V1__STATUS_REQUEST__INIT;
    a = amx_codec_pack(&e.base, &n1);
    ck_assert_ptr_nonnull(a); /* an empty message is zero bytes, not NULL */
    ck_assert_uint_eq(n1, 0);
    free(a);
}
END_TEST

/* ---- SendAmaxRequest, read in place ---- */

/* Appends a field (tag and, for bytes, the length) to b at *n. */
static void put_tag(uint8_t *b, size_t *n, uint32_t field, int wt)
{
    *n += amx_wire_put_varint(b + *n, ((uint64_t)field << 3) | (uint64_t)wt);
}

static void put_bytes(uint8_t *b, size_t *n, uint32_t field, const void *p, size_t len)
{
    put_tag(b, n, field, 2);
    *n += amx_wire_put_varint(b + *n, len);
    memcpy(b + *n, p, len);
    *n += len;
}

static int same_bytes(const uint8_t *a, size_t an, const uint8_t *b, size_t bn)
{
    return an == bn && (an == 0 || memcmp(a, b, an) == 0);
}

/* A random SendAmaxRequest: protobuf-c's packing, then (sometimes) fields
 * protobuf-c would not write itself: a repeated scalar or string (the last
 * wins), unknown fields of every wire type. */
static uint8_t *random_send(size_t *len, uint8_t *vals)
{
    static char names[32][16];
    Amaxd__V1__SendAmaxRequest r = AMAXD__V1__SEND_AMAX_REQUEST__INIT;
    Amaxd__V1__AmaxUpdate u[32], *pu[32];
    size_t nu = next_rand() % 12;
    for (size_t i = 0; i < nu; i++) {
        amaxd__v1__amax_update__init(&u[i]);
        int nl = (int)(next_rand() % 12);
        for (int c = 0; c < nl; c++)
            names[i][c] = (char)('a' + next_rand() % 26);
        names[i][nl] = '\0';
        u[i].name = names[i];
        size_t nv = next_rand() % 9;
        u[i].values = (ProtobufCBinaryData){4 * nv, vals + 4 * (next_rand() % 64)};
        if (next_rand() % 2)
            u[i].has_data = (ProtobufCBinaryData){nv, vals + next_rand() % 64};
        pu[i] = &u[i];
    }
    r.job = next_rand() % 4 ? "job.a" : "";
    r.rank = next_rand() % 3 ? next_rand() : 0;
    r.epoch = next_rand() % 3 ? ((uint64_t)next_rand() << 32 | next_rand()) : 0;
    r.n_updates = nu;
    r.updates = pu;
    size_t n = protobuf_c_message_get_packed_size(&r.base);
    uint8_t *b = malloc(n + 256);
    protobuf_c_message_pack(&r.base, b);
    if (next_rand() % 2) {
        put_tag(b, &n, 2, 0);
        n += amx_wire_put_varint(b + n, 77);
        put_bytes(b, &n, 1, "job.b", 5);
    }
    if (next_rand() % 2) {
        put_tag(b, &n, 9, 0);
        n += amx_wire_put_varint(b + n, UINT64_MAX);
        put_tag(b, &n, 10, 1);
        memset(b + n, 0xee, 8), n += 8;
        put_tag(b, &n, 11, 5);
        memset(b + n, 0xdd, 4), n += 4;
        put_bytes(b, &n, 12, "zz", 2);
        /* An update with an unknown field and a repeated name. */
        uint8_t up[64];
        size_t k = 0;
        put_bytes(up, &k, 1, "first", 5);
        put_tag(up, &k, 7, 0);
        up[k++] = 1;
        put_bytes(up, &k, 1, "second", 6);
        put_bytes(b, &n, 4, up, k);
    }
    *len = n;
    return b;
}

START_TEST(send_parse_equals_protobuf_c)
{
    uint8_t vals[512];
    for (size_t i = 0; i < sizeof(vals); i++)
        vals[i] = (uint8_t)next_rand();
    amx_codec_scratch_t sc = {0};
    const amx_wire_limits_t lim = {1u << 20, 100, 100, 8};
    for (int t = 0; t < 3000; t++) {
        size_t n;
        uint8_t *d = random_send(&n, vals);
        amx_err_t err = {0};
        ck_assert_msg(amx_wire_check(&amaxd__v1__send_amax_request__descriptor, d, n, &lim, NULL,
                                     &err) == AMX_OK,
                      "try %d: %s", t, err.msg);
        Amaxd__V1__SendAmaxRequest *m = amaxd__v1__send_amax_request__unpack(NULL, n, d);
        ck_assert_ptr_nonnull(m);
        amx_send_req_t q;
        ck_assert_int_eq(amx_codec_send_parse(&sc, d, n, &q, &err), AMX_OK);
        ck_assert_str_eq(q.job, m->job);
        ck_assert_uint_eq(q.rank, m->rank);
        ck_assert_uint_eq(q.epoch, m->epoch);
        ck_assert_uint_eq(q.n, m->n_updates);
        for (size_t i = 0; i < q.n; i++) {
            const Amaxd__V1__AmaxUpdate *x = m->updates[i];
            const amx_update_in_t *u = &q.u[i];
            ck_assert_str_eq(u->name, x->name);
            ck_assert_msg(same_bytes(u->values, u->values_len, x->values.data, x->values.len),
                          "try %d, update %zu: values differ", t, i);
            ck_assert_msg(
                same_bytes(u->has_data, u->has_data_len, x->has_data.data, x->has_data.len),
                "try %d, update %zu: has_data differ", t, i);
            /* In place: the values point into the message. */
            if (u->values_len > 0)
                ck_assert_msg(u->values >= d && u->values + u->values_len <= d + n,
                              "try %d: values at offset %td of a %zu-byte message", t,
                              u->values - d, n);
        }
        amaxd__v1__send_amax_request__free_unpacked(m, NULL);
        free(d);
        /* Now and then the idle daemon trims its scratch. */
        if (t % 500 == 499)
            amx_codec_scratch_trim(&sc, t % 1000 == 999 ? 0 : 64);
    }
    amx_codec_scratch_trim(&sc, 0);
    ck_assert_ptr_null(sc.ups);
    ck_assert_ptr_null(sc.strs);
}
END_TEST

/* ---- SendPackedRequest, read in place ---- */

START_TEST(packed_parse_equals_protobuf_c)
{
    uint8_t vals[256];
    for (size_t i = 0; i < sizeof(vals); i++)
        vals[i] = (uint8_t)next_rand();
    for (int t = 0; t < 500; t++) {
        Amaxd__V1__SendPackedRequest r = AMAXD__V1__SEND_PACKED_REQUEST__INIT;
        char job[AMX_MAX_JOB_NAME + 1];
        size_t jl = next_rand() % (AMX_MAX_JOB_NAME + 1);
        memset(job, 'j', jl);
        job[jl] = '\0';
        r.job = job;
        r.rank = next_rand();
        r.epoch = (uint64_t)next_rand() << 20;
        r.layout_id = (uint64_t)next_rand() << 32 | next_rand();
        r.values = (ProtobufCBinaryData){next_rand() % 200, vals};
        if (next_rand() % 2)
            r.has_data = (ProtobufCBinaryData){next_rand() % 50, vals + 1};
        if (next_rand() % 2)
            r.align = (ProtobufCBinaryData){next_rand() % 16, vals + 2};
        r.shm_id = next_rand() % 2 ? (uint64_t)next_rand() << 32 : 0;
        r.shm_has_data = next_rand() % 2;
        if (next_rand() % 2)
            r.stats = (ProtobufCBinaryData){next_rand() % 80, vals + 3};
        if (next_rand() % 2)
            r.stat_epochs = (ProtobufCBinaryData){next_rand() % 40, vals + 4};
        r.shm_stats = next_rand() % 2;
        size_t n;
        uint8_t *d = pack(&r.base, &n);
        Amaxd__V1__SendPackedRequest *m = amaxd__v1__send_packed_request__unpack(NULL, n, d);
        ck_assert_ptr_nonnull(m);
        amx_codec_packed_in_t in;
        amx_err_t err = {0};
        ck_assert_int_eq(amx_codec_packed_parse(d, n, &in, &err), AMX_OK);
        ck_assert_str_eq(in.job, m->job);
        ck_assert_uint_eq(in.rank, m->rank);
        ck_assert_uint_eq(in.epoch, m->epoch);
        ck_assert_uint_eq(in.layout_id, m->layout_id);
        ck_assert_uint_eq(in.shm_id, m->shm_id);
        ck_assert_int_eq(in.shm_has_data, m->shm_has_data);
        ck_assert_int_eq(in.shm_stats, m->shm_stats);
        ck_assert_msg(same_bytes(in.stats, in.stats_len, m->stats.data, m->stats.len),
                      "try %d: stats of %zu bytes, protobuf-c %zu", t, in.stats_len, m->stats.len);
        ck_assert_msg(
            same_bytes(in.stat_epochs, in.stat_epochs_len, m->stat_epochs.data, m->stat_epochs.len),
            "try %d: stat_epochs of %zu bytes, protobuf-c %zu", t, in.stat_epochs_len,
            m->stat_epochs.len);
        ck_assert_msg(same_bytes(in.values, in.values_len, m->values.data, m->values.len),
                      "try %d: values of %zu bytes, protobuf-c %zu", t, in.values_len,
                      m->values.len);
        ck_assert_msg(same_bytes(in.has_data, in.has_data_len, m->has_data.data, m->has_data.len),
                      "try %d: has_data of %zu bytes, protobuf-c %zu", t, in.has_data_len,
                      m->has_data.len);
        if (in.values_len > 0)
            ck_assert_msg(in.values > d && in.values + in.values_len <= d + n,
                          "try %d: values at offset %td of a %zu-byte message", t, in.values - d,
                          n);
        amaxd__v1__send_packed_request__free_unpacked(m, NULL);
        free(d);
    }
    /* A job name longer than any job's: refused before it is copied. */
    char longjob[AMX_MAX_JOB_NAME + 2];
    memset(longjob, 'x', sizeof(longjob) - 1);
    longjob[sizeof(longjob) - 1] = '\0';
    Amaxd__V1__SendPackedRequest r = AMAXD__V1__SEND_PACKED_REQUEST__INIT;
    r.job = longjob;
    size_t n;
    uint8_t *d = pack(&r.base, &n);
    amx_codec_packed_in_t in;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_codec_packed_parse(d, n, &in, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "SendPacked: a job name of 129 bytes; job names have 1..128 "
                              "characters");
    free(d);
    /* A group's wire type (the wire check refuses it first) is refused. */
    uint8_t group[] = {0x0b};
    amx_err_clear(&err);
    ck_assert_int_eq(amx_codec_packed_parse(group, 1, &in, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "a field of wire type 3");
}
END_TEST

/* ---- ReconcilePackedResponse, written in place ---- */

static void fill_pattern(void *p, size_t bytes, uint8_t seed)
{
    uint8_t *b = p;
    for (size_t i = 0; i < bytes; i++)
        b[i] = (uint8_t)(seed + 7 * i);
}

/* Field `name` holds the bytes fill_pattern wrote with `seed`; on failure
 * both lengths, or the first differing byte and both values. */
static void check_field(const char *name, const ProtobufCBinaryData *f, size_t bytes, uint8_t seed,
                        size_t z)
{
    ck_assert_msg(f->len == bytes, "size %zu: %s has %zu bytes, expected %zu", z, name, f->len,
                  bytes);
    for (size_t i = 0; i < bytes; i++)
        if (f->data[i] != (uint8_t)(seed + 7 * i))
            ck_abort_msg("size %zu: %s byte %zu is 0x%02x, expected 0x%02x", z, name, i, f->data[i],
                         (uint8_t)(seed + 7 * i));
}

static int aligned(const void *p)
{
    return (uintptr_t)p % 16 == 0;
}

START_TEST(packed_answer_is_what_protobuf_c_reads)
{
    static const size_t sizes[][3] = {{0, 0, 0},  {1, 1, 0},     {5, 2, 0},
                                      {64, 3, 4}, {1000, 17, 9}, {4099, 1, 1}};
    for (size_t z = 0; z < sizeof(sizes) / sizeof(sizes[0]); z++) {
        size_t n = sizes[z][0], q = sizes[z][1], ns = sizes[z][2];
        size_t cap = amx_codec_packed_cap(n, q, ns, 0);
        uint8_t *mem = malloc(cap + 16);
        for (size_t shift = 0; shift < 16; shift += 3) { /* wherever the buffer lies */
            for (int with_fill = 0; with_fill < 2; with_fill++) {
                uint8_t *buf = mem + shift;
                memset(buf, 0xcc, cap);
                amx_packed_t p;
                memset(&p, 0, sizeof(p));
                p.ncells = n;
                p.nq = (uint32_t)q;
                p.nslices = ns;
                size_t pos, end;
                amx_codec_packed_layout(buf, &p, &pos, &end);
                ck_assert_uint_le(pos, end);
                ck_assert_uint_le(end, cap);
                /* Every array non-empty is aligned, and lies in the buffer. */
                void *arrays[] = {p.amax,  p.scale,   p.scale_inv, p.g_amax,    p.g_scale,
                                  p.g_inv, p.missing, p.prev_amax, p.prev_scale};
                for (size_t a = 0; a < 9; a++) {
                    size_t bytes = a < 3 ? 4 * n : 4 * q;
                    if (bytes > 0)
                        ck_assert_msg(aligned(arrays[a]), "size %zu, shift %zu: array %zu at %p", z,
                                      shift, a, arrays[a]);
                    ck_assert_msg((uint8_t *)arrays[a] >= buf &&
                                      (uint8_t *)arrays[a] + bytes <= buf + end,
                                  "size %zu: array %zu at offset %td, %zu bytes, end %zu", z, a,
                                  (uint8_t *)arrays[a] - buf, bytes, end);
                }
                if (ns > 0) {
                    ck_assert_msg(aligned(p.s_amax) && aligned(p.s_scale) && aligned(p.s_inv),
                                  "size %zu, shift %zu: slice arrays at %p %p %p", z, shift,
                                  (void *)p.s_amax, (void *)p.s_scale, (void *)p.s_inv);
                } else {
                    ck_assert_ptr_null(p.s_amax);
                }
                if (n > 0) {
                    ck_assert_msg(aligned(p.block_scales) && aligned(p.filled),
                                  "size %zu, shift %zu: byte arrays at %p %p", z, shift,
                                  (void *)p.block_scales, (void *)p.filled);
                }
                /* The registry fills them. */
                fill_pattern(p.amax, 4 * n, 1);
                fill_pattern(p.scale, 4 * n, 2);
                fill_pattern(p.scale_inv, 4 * n, 3);
                fill_pattern(p.block_scales, n, 4);
                fill_pattern(p.g_amax, 4 * q, 5);
                fill_pattern(p.g_scale, 4 * q, 6);
                fill_pattern(p.g_inv, 4 * q, 7);
                fill_pattern(p.missing, 4 * q, 8);
                fill_pattern(p.has_previous, q, 9);
                fill_pattern(p.prev_amax, 4 * q, 10);
                fill_pattern(p.prev_scale, 4 * q, 11);
                fill_pattern(p.filled, n, 12);
                if (ns > 0) {
                    fill_pattern(p.s_amax, 4 * ns, 13);
                    fill_pattern(p.s_scale, 4 * ns, 14);
                    fill_pattern(p.s_inv, 4 * ns, 15);
                }
                uint64_t epoch = 1ull << 33, next = epoch + 1, layout = 0x8877665544332211ull;
                size_t len = amx_codec_packed_finish(buf, with_fill ? end : pos, epoch, next,
                                                     layout, with_fill);
                ck_assert_uint_le(len, cap);
                Amaxd__V1__ReconcilePackedResponse *m =
                    amaxd__v1__reconcile_packed_response__unpack(NULL, len, buf);
                ck_assert_msg(m != NULL, "size %zu, shift %zu: protobuf-c cannot read it", z,
                              shift);
                ck_assert_uint_eq(m->epoch, epoch);
                ck_assert_uint_eq(m->next_epoch, next);
                ck_assert_uint_eq(m->layout_id, layout);
                ck_assert_int_eq(m->peer_fill_known, with_fill);
                check_field("amax", &m->amax, 4 * n, 1, z);
                check_field("scale", &m->scale, 4 * n, 2, z);
                check_field("scale_inv", &m->scale_inv, 4 * n, 3, z);
                check_field("block_scales", &m->block_scales, n, 4, z);
                check_field("global_amax", &m->global_amax, 4 * q, 5, z);
                check_field("global_scale", &m->global_scale, 4 * q, 6, z);
                check_field("global_scale_inv", &m->global_scale_inv, 4 * q, 7, z);
                check_field("missing", &m->missing, 4 * q, 8, z);
                check_field("has_previous", &m->has_previous, q, 9, z);
                check_field("previous_global_amax", &m->previous_global_amax, 4 * q, 10, z);
                check_field("previous_global_scale", &m->previous_global_scale, 4 * q, 11, z);
                /* The fill marks only when asked for. */
                check_field("filled", &m->filled, with_fill ? n : 0, 12, z);
                check_field("global_amaxes", &m->global_amaxes, 4 * ns, 13, z);
                check_field("global_scales", &m->global_scales, 4 * ns, 14, z);
                check_field("global_scale_invs", &m->global_scale_invs, 4 * ns, 15, z);
                ck_assert_uint_eq(m->shm_bytes, 0);
                /* Padding, if any, is in the ignored field and nowhere else. */
                ck_assert_uint_eq(m->base.n_unknown_fields, 0);
                amaxd__v1__reconcile_packed_response__free_unpacked(m, NULL);
            }
        }
        free(mem);
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("codec");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, specs_round_trip_through_protobuf);
    tcase_add_test(tc, spec_in_keeps_the_placement);
    tcase_add_test(tc, membership_round_trip);
    tcase_add_test(tc, pack_is_protobuf_c_pack);
    tcase_add_test(tc, send_parse_equals_protobuf_c);
    tcase_add_test(tc, packed_parse_equals_protobuf_c);
    tcase_add_test(tc, packed_answer_is_what_protobuf_c_reads);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
