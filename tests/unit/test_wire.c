/*
 * test_wire.c - the wire check before protobuf-c unpacks a request, and
 * the one varint: malformed varints and tags, lengths past the end, wire
 * types that do not match their field, groups, NUL and control bytes in
 * strings, each limit (elements, scalars, depth, memory), unknown fields;
 * and, over thousands of mutated messages, the check's contract: what it
 * accepts protobuf-c unpacks, within the memory it estimated.
 */
#include <check.h>
#include <protobuf-c/protobuf-c.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amaxd/v1/amaxd.pb-c.h"
#include "wire.h"
#include "unit.h"

static const amx_wire_limits_t roomy = {64u << 20, 1000, 1000, 8};

/* The check of `n` bytes as SendAmaxRequest (or `d`), with `lim`. */
static amx_status_t check_as(const ProtobufCMessageDescriptor *d, const void *p, size_t n,
                             const amx_wire_limits_t *lim, amx_err_t *err)
{
    amx_err_clear(err);
    uint64_t est = 0;
    return amx_wire_check(d, p, n, lim, &est, err);
}

#define SEND (&amaxd__v1__send_amax_request__descriptor)

/* ---- the varint ---- */

START_TEST(varint_bounds)
{
    static const struct {
        uint64_t v;
        size_t len;
    } vals[] = {{0, 1},
                {1, 1},
                {127, 1},
                {128, 2},
                {16383, 2},
                {16384, 3},
                {UINT32_MAX, 5},
                {(uint64_t)1 << 35, 6},
                {UINT64_MAX >> 1, 9},
                {UINT64_MAX, 10}};
    for (size_t k = 0; k < sizeof(vals) / sizeof(vals[0]); k++) {
        uint8_t b[16];
        size_t n = amx_wire_put_varint(b, vals[k].v);
        ck_assert_uint_eq(n, vals[k].len);
        ck_assert_uint_eq(amx_wire_varint_len(vals[k].v), vals[k].len);
        size_t i = 0;
        uint64_t v = 0;
        ck_assert_int_eq(amx_wire_varint(b, n, &i, &v, 10), 0);
        ck_assert_uint_eq(v, vals[k].v);
        ck_assert_uint_eq(i, n);
        /* One byte short: runs past the end. */
        i = 0;
        ck_assert_int_eq(amx_wire_varint(b, n - 1, &i, &v, 10), -1);
        /* Longer than `max` bytes allows. */
        i = 0;
        ck_assert_int_eq(amx_wire_varint(b, n, &i, &v, 5), n <= 5 ? 0 : -1);
    }
    /* Ten bytes whose last one carries more than bit 63. */
    uint8_t over[10] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02};
    size_t i = 0;
    uint64_t v = 0;
    ck_assert_int_eq(amx_wire_varint(over, 10, &i, &v, 10), -1);
    /* Eleven bytes: too long whatever they hold. */
    uint8_t eleven[11] = {0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00};
    i = 0;
    ck_assert_int_eq(amx_wire_varint(eleven, 11, &i, &v, 10), -1);
    /* A redundant (non-minimal) encoding is still a value. */
    uint8_t padded[3] = {0x81, 0x80, 0x00};
    i = 0;
    ck_assert_int_eq(amx_wire_varint(padded, 3, &i, &v, 10), 0);
    ck_assert_uint_eq(v, 1);
    /* The accepted-message reader: malformed reads as 0. */
    i = 0;
    ck_assert_uint_eq(amx_wire_get_varint(over, 10, &i), 0);
    i = 0;
    ck_assert_uint_eq(amx_wire_get_varint(padded, 3, &i), 1);
}
END_TEST

START_TEST(escape_is_printable)
{
    char b[64];
    ck_assert_str_eq(amx_escape(b, sizeof(b), "a\\b\x01\x7f\xc3", 6), "a\\x5cb\\x01\\x7f\\xc3");
    ck_assert_str_eq(amx_escape(b, sizeof(b), "with\0nul", 8), "with\\x00nul");
    /* Cut with "..." within the buffer (11 characters and the NUL). */
    char small[12];
    ck_assert_str_eq(amx_escape(small, sizeof(small), "abcdefghijklmnop", 16), "abcdefgh...");
    /* An escape that would not fit whole is not cut in the middle. */
    ck_assert_str_eq(amx_escape(small, sizeof(small), "abcdefg\x01zzzz", 12), "abcdefg...");
    char tiny[4];
    ck_assert_str_eq(amx_escape(tiny, sizeof(tiny), "\x01\x02", 2), "...");
    char three[3];
    ck_assert_str_eq(amx_escape(three, sizeof(three), "\x01", 1), "");
    char one = 'x';
    amx_escape(&one, 0, "abc", 3); /* no room at all: untouched */
    ck_assert_int_eq(one, 'x');
}
END_TEST

/* ---- malformed messages ---- */

START_TEST(malformed_input_is_refused)
{
    static const struct {
        const char *what;
        uint8_t bytes[16];
        size_t n;
        const char *phrase;
    } cases[] = {
        {"tag of 6 bytes",
         {0x80, 0x80, 0x80, 0x80, 0x80, 0x01},
         6,
         "truncated or overlong field tag"},
        {"tag cut short", {0x80}, 1, "truncated or overlong field tag"},
        {"field number 0", {0x00, 0x01}, 2, "field number 0 or out of range"},
        {"rank's varint cut", {0x10, 0x80}, 2, "a truncated varint at byte 0"},
        {"varint of 11 bytes",
         {0x10, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01},
         12,
         "a truncated varint"},
        {"job longer than the message", {0x0a, 0x05, 'a', 'b'}, 4, "a length past the end"},
        {"length of 6 bytes",
         {0x0a, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00},
         7,
         "a length past the end"},
        {"job as a varint", {0x08, 0x01}, 2, "a wire type that does not match its field"},
        {"rank as bytes", {0x12, 0x01, 0x01}, 3, "a wire type that does not match its field"},
        {"updates as fixed32", {0x25, 1, 2, 3, 4}, 5, "a wire type that does not match its field"},
        {"a group", {0x0b, 0x0c}, 2, "a group or an unknown wire type"},
        {"wire type 7", {0x0f}, 1, "a group or an unknown wire type"},
        {"unknown fixed64 cut", {0x79, 1, 2, 3}, 4, "a truncated 64-bit value"},
        {"unknown fixed32 cut", {0x7d, 1, 2}, 3, "a truncated 32-bit value"},
        {"second field bad", {0x10, 0x05, 0x0a, 0x09, 'x'}, 5, "at byte 2"},
    };
    for (size_t k = 0; k < sizeof(cases) / sizeof(cases[0]); k++) {
        amx_err_t err = {0};
        amx_status_t st = check_as(SEND, cases[k].bytes, cases[k].n, &roomy, &err);
        ck_assert_msg(st == AMX_EINVAL, "%s: status %d (%s)", cases[k].what, st, err.msg);
        AMX_ASSERT_HAS(err.msg, cases[k].phrase);
        AMX_ASSERT_HAS(err.msg, "request is not a valid amaxd.v1.SendAmaxRequest message");
        /* ... and protobuf-c refuses each of them too. */
        ProtobufCMessage *m = protobuf_c_message_unpack(SEND, NULL, cases[k].n, cases[k].bytes);
        ck_assert_msg(m == NULL, "%s: protobuf-c unpacks it", cases[k].what);
    }
    /* A malformed varint inside a packed repeated field (global_shape). */
    uint8_t packed[] = {0x12, 0x02, 0x80, 0x80};
    amx_err_t err = {0};
    ck_assert_int_eq(
        check_as(&amaxd__v1__quantizer_spec__descriptor, packed, sizeof(packed), &roomy, &err),
        AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "a malformed packed field");
    /* Empty: a message of defaults. */
    ck_assert_int_eq(check_as(SEND, "", 0, &roomy, &err), AMX_OK);
}
END_TEST

START_TEST(strings_without_nul_or_control_bytes)
{
    amx_err_t err = {0};
    uint8_t nul[] = {0x0a, 0x03, 'a', 0x00, 'b'};
    ck_assert_int_eq(check_as(SEND, nul, sizeof(nul), &roomy, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "amaxd.v1.SendAmaxRequest.job holds a NUL byte at offset 1 "
                              "(\"a\\x00b\"); names and strings must not contain NUL or control "
                              "characters");
    uint8_t nl[] = {0x22, 0x05, 0x0a, 0x03, 'q', '\n', 'x'}; /* updates[0].name */
    ck_assert_int_eq(check_as(SEND, nl, sizeof(nl), &roomy, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "amaxd.v1.AmaxUpdate.name holds a control byte 0x0a at offset 1");
    uint8_t del[] = {0x0a, 0x01, 0x7f};
    ck_assert_int_eq(check_as(SEND, del, sizeof(del), &roomy, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "a control byte 0x7f");
    /* Bytes above 0x7e (UTF-8) are left to the name checks; bytes fields
     * may hold anything. */
    uint8_t utf8[] = {0x0a, 0x02, 0xc3, 0xa9};
    ck_assert_int_eq(check_as(SEND, utf8, sizeof(utf8), &roomy, &err), AMX_OK);
    uint8_t values[] = {0x22, 0x04, 0x12, 0x02, 0x00, 0x0a};
    ck_assert_int_eq(check_as(SEND, values, sizeof(values), &roomy, &err), AMX_OK);
}
END_TEST

/* ---- limits ---- */

/* A SendAmaxRequest of `n` updates named "u", packed by protobuf-c. */
static uint8_t *send_of(size_t n, size_t *len)
{
    Amaxd__V1__SendAmaxRequest r = AMAXD__V1__SEND_AMAX_REQUEST__INIT;
    Amaxd__V1__AmaxUpdate *u = calloc(n, sizeof(*u)), **pu = calloc(n, sizeof(*pu));
    for (size_t i = 0; i < n; i++) {
        amaxd__v1__amax_update__init(&u[i]);
        u[i].name = "u";
        pu[i] = &u[i];
    }
    r.job = "j";
    r.n_updates = n;
    r.updates = pu;
    *len = protobuf_c_message_get_packed_size(&r.base);
    uint8_t *b = malloc(*len);
    protobuf_c_message_pack(&r.base, b);
    free(u);
    free(pu);
    return b;
}

START_TEST(element_scalar_depth_and_memory_limits)
{
    amx_err_t err = {0};
    amx_wire_limits_t lim = roomy;
    size_t len;
    uint8_t *b = send_of(10, &len);
    lim.max_elements = 10;
    ck_assert_int_eq(check_as(SEND, b, len, &lim, &err), AMX_OK);
    lim.max_elements = 9;
    ck_assert_int_eq(check_as(SEND, b, len, &lim, &err), AMX_ENOMEM);
    ck_assert_str_eq(err.msg, "amaxd.v1.SendAmaxRequest: amaxd.v1.SendAmaxRequest.updates has "
                              "more than 9 elements; split the request");
    /* Memory: the estimate of this message, exactly, passes; one byte
     * less does not. */
    uint64_t est = 0;
    ck_assert_int_eq(amx_wire_check(SEND, b, len, &roomy, &est, &err), AMX_OK);
    lim = roomy;
    lim.max_decoded = est;
    ck_assert_int_eq(check_as(SEND, b, len, &lim, &err), AMX_OK);
    lim.max_decoded = est - 1;
    ck_assert_int_eq(check_as(SEND, b, len, &lim, &err), AMX_ENOMEM);
    AMX_ASSERT_HAS(err.msg, "would take more than");
    AMX_ASSERT_HAS(err.msg, "(max_request_memory); split it into smaller requests");
    free(b);
    /* Scalars: a packed run and single values count alike. */
    uint8_t shape[] = {0x12, 0x03, 1, 2, 3, 0x10, 4, 0x10, 5};
    lim = roomy;
    lim.max_scalars = 5;
    ck_assert_int_eq(
        check_as(&amaxd__v1__quantizer_spec__descriptor, shape, sizeof(shape), &lim, &err), AMX_OK);
    lim.max_scalars = 4;
    ck_assert_int_eq(
        check_as(&amaxd__v1__quantizer_spec__descriptor, shape, sizeof(shape), &lim, &err),
        AMX_ENOMEM);
    AMX_ASSERT_HAS(err.msg, "global_shape has more than 4 elements");
    /* Depth: RegisterRequest > QuantizerSpec > Recipe. */
    uint8_t nested[] = {0x1a, 0x04, 0x1a, 0x02, 0x08, 0x01};
    lim = roomy;
    lim.max_depth = 2;
    ck_assert_int_eq(
        check_as(&amaxd__v1__register_request__descriptor, nested, sizeof(nested), &lim, &err),
        AMX_OK);
    lim.max_depth = 1;
    ck_assert_int_eq(
        check_as(&amaxd__v1__register_request__descriptor, nested, sizeof(nested), &lim, &err),
        AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "messages nested more than 1 deep in amaxd.v1.QuantizerSpec");
}
END_TEST

START_TEST(unknown_fields_are_accepted_and_charged)
{
    amx_err_t err = {0};
    uint64_t e0 = 0, e1 = 0;
    uint8_t plain[] = {0x10, 0x05};
    uint8_t extra[] = {0x10, 0x05, 0xfa, 0x01, 0x04, 'a', 'b', 'c', 'd'}; /* field 31, bytes */
    ck_assert_int_eq(amx_wire_check(SEND, plain, sizeof(plain), &roomy, &e0, &err), AMX_OK);
    ck_assert_int_eq(amx_wire_check(SEND, extra, sizeof(extra), &roomy, &e1, &err), AMX_OK);
    ck_assert_uint_gt(e1, e0 + 4);
    /* protobuf-c keeps it. */
    Amaxd__V1__SendAmaxRequest *m =
        amaxd__v1__send_amax_request__unpack(NULL, sizeof(extra), extra);
    ck_assert_ptr_nonnull(m);
    ck_assert_uint_eq(m->base.n_unknown_fields, 1);
    ck_assert_uint_eq(m->rank, 5);
    amaxd__v1__send_amax_request__free_unpacked(m, NULL);
}
END_TEST

/* ---- the contract, over mutated messages ---- */

static size_t g_alloc;

static void *count_alloc(void *ud, size_t n)
{
    (void)ud;
    g_alloc += n + 32; /* malloc's own cost, as wire.c assumes */
    return malloc(n);
}

static void count_free(void *ud, void *p)
{
    (void)ud;
    free(p);
}

static ProtobufCAllocator counting = {count_alloc, count_free, NULL};

static uint64_t rng = 0x853c49e6748fea9bull;

static uint32_t next_rand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* Valid messages of three request types, packed by protobuf-c. */
static uint8_t *seed(int k, const ProtobufCMessageDescriptor **d, size_t *len)
{
    uint32_t shape[3] = {4, 300, 70000}, off[3] = {0, 128, 1}, ls[3] = {4, 2, 9};
    float vals[3] = {1.5f, 0, 448};
    uint8_t has[3] = {1, 0, 1};
    ProtobufCMessage *m;
    Amaxd__V1__SendAmaxRequest s = AMAXD__V1__SEND_AMAX_REQUEST__INIT;
    Amaxd__V1__AmaxUpdate u[2] = {AMAXD__V1__AMAX_UPDATE__INIT, AMAXD__V1__AMAX_UPDATE__INIT};
    Amaxd__V1__AmaxUpdate *pu[2] = {&u[0], &u[1]};
    Amaxd__V1__RegisterRequest r = AMAXD__V1__REGISTER_REQUEST__INIT;
    Amaxd__V1__QuantizerSpec q = AMAXD__V1__QUANTIZER_SPEC__INIT, *pq = &q;
    Amaxd__V1__Recipe rc = AMAXD__V1__RECIPE__INIT;
    Amaxd__V1__SendPackedRequest p = AMAXD__V1__SEND_PACKED_REQUEST__INIT;
    if (k == 0) {
        s.job = "job-1";
        s.rank = 3;
        s.epoch = 1ull << 40;
        u[0].name = "layer.0.w";
        u[0].values = (ProtobufCBinaryData){sizeof(vals), (uint8_t *)vals};
        u[0].has_data = (ProtobufCBinaryData){sizeof(has), has};
        u[1].name = "b";
        s.n_updates = 2;
        s.updates = pu;
        m = &s.base;
    } else if (k == 1) {
        rc.format = AMAXD__V1__FORMAT__NVFP4;
        rc.margin = 1.0f;
        rc.history_len = 4;
        q.name = "experts.w";
        q.n_global_shape = 3;
        q.global_shape = shape;
        q.n_offset = 3;
        q.offset = off;
        q.n_local_shape = 3;
        q.local_shape = ls;
        q.recipe = &rc;
        q.peer_group = "g";
        q.global_axes = 1;
        r.job = "j";
        r.n_quantizers = 1;
        r.quantizers = &pq;
        m = &r.base;
    } else {
        p.job = "packed";
        p.rank = 1;
        p.layout_id = 0x1122334455667788ull;
        p.values = (ProtobufCBinaryData){sizeof(vals), (uint8_t *)vals};
        p.has_data = (ProtobufCBinaryData){sizeof(has), has};
        p.shm_has_data = 1;
        m = &p.base;
    }
    *d = m->descriptor;
    *len = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(*len);
    ck_assert_uint_eq(protobuf_c_message_pack(m, b), *len);
    return b;
}

START_TEST(accepted_means_unpacked_within_the_estimate)
{
    int accepted = 0, refused = 0;
    for (int k = 0; k < 3; k++) {
        const ProtobufCMessageDescriptor *d;
        size_t len;
        uint8_t *orig = seed(k, &d, &len);
        uint8_t buf[512];
        ck_assert_uint_le(len + 8, sizeof(buf));
        for (int t = 0; t < 4000; t++) {
            memcpy(buf, orig, len);
            size_t n = len;
            int edits = 1 + (int)(next_rand() % 3);
            for (int e = 0; e < edits; e++) {
                uint32_t r = next_rand();
                switch (r % 4) {
                case 0: /* flip a bit */
                    buf[(r >> 8) % n] ^= (uint8_t)(1u << ((r >> 4) % 8));
                    break;
                case 1: /* a random byte */
                    buf[(r >> 8) % n] = (uint8_t)(r >> 24);
                    break;
                case 2: /* cut */
                    n = n > 1 ? 1 + (r >> 8) % (n - 1) : n;
                    break;
                default: /* a byte inserted */
                    if (n < len + 8) {
                        size_t at = (r >> 8) % n;
                        memmove(buf + at + 1, buf + at, n - at);
                        buf[at] = (uint8_t)(r >> 24);
                        n++;
                    }
                }
            }
            amx_err_t err = {0};
            uint64_t est = 0;
            if (amx_wire_check(d, buf, n, &roomy, &est, &err) != AMX_OK) {
                ck_assert_msg(err.msg[0] != '\0', "a refusal without a sentence");
                refused++;
                continue;
            }
            accepted++;
            g_alloc = 0;
            ProtobufCMessage *m = protobuf_c_message_unpack(d, &counting, n, buf);
            ck_assert_msg(m != NULL, "seed %d, try %d: accepted, but protobuf-c refuses it", k, t);
            ck_assert_msg(g_alloc <= est, "seed %d, try %d: unpacked into %zu bytes, estimate %llu",
                          k, t, g_alloc, (unsigned long long)est);
            protobuf_c_message_free_unpacked(m, &counting);
        }
        free(orig);
    }
    /* The mutations reach both sides of the check. */
    ck_assert_int_gt(accepted, 500);
    ck_assert_int_gt(refused, 500);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("wire");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, varint_bounds);
    tcase_add_test(tc, escape_is_printable);
    tcase_add_test(tc, malformed_input_is_refused);
    tcase_add_test(tc, strings_without_nul_or_control_bytes);
    tcase_add_test(tc, element_scalar_depth_and_memory_limits);
    tcase_add_test(tc, unknown_fields_are_accepted_and_charged);
    tcase_add_test(tc, accepted_means_unpacked_within_the_estimate);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
