/*
 * wire.c - a pass over the protobuf wire format before protobuf-c unpacks
 * a request (wire.h).
 */
#include "wire.h"

#include <stdio.h>
#include <string.h>

/* What one malloc costs beyond its size (glibc: a 16-byte header and
 * 16-byte rounding); an upper estimate is what the budget needs. */
#define ALLOC_COST 32

/* protobuf-c's first pass keeps a record of every field of a message it
 * meets (its ScannedMember, about 40 bytes): the first 16 on the stack, then
 * in slabs that double in size, the first of 32 records allocated at the
 * 17th field. Charging every field, the first 16 included, covers the slabs
 * (96 x n >= 40 x 2(n - 16) and 96 x 17 >= 40 x 32); freed when that message
 * is unpacked. The fuzzer checks the bound (tests/fuzz). */
#define SCAN_COST 96

enum { WT_VARINT = 0, WT_64 = 1, WT_LEN = 2, WT_START = 3, WT_END = 4, WT_32 = 5 };

typedef struct walk {
    const amx_wire_limits_t *lim;
    const char *top; /* the top message's name, for sentences */
    size_t total;    /* bytes of the whole input */
    uint64_t decoded;
    amx_err_t *err;
} walk_t;

char *amx_escape(char *buf, size_t len, const char *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    size_t k = 0;
    if (len == 0)
        return buf;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        size_t need = (c < 0x20 || c > 0x7e || c == '\\') ? 4 : 1;
        if (k + need + 4 > len) { /* room for "..." and the NUL */
            if (k + 4 <= len)
                memcpy(buf + k, "...", 3), k += 3;
            break;
        }
        if (need == 4) {
            buf[k++] = '\\';
            buf[k++] = 'x';
            buf[k++] = hex[c >> 4];
            buf[k++] = hex[c & 15];
        } else {
            buf[k++] = (char)c;
        }
    }
    buf[k] = '\0';
    return buf;
}

/* Malformed input: the sentence protobuf-c's refusal would have given,
 * with what is wrong. */
static amx_status_t bad(walk_t *w, size_t at, const char *what)
{
    return amx_err_set(w->err, AMX_EINVAL,
                       "request is not a valid %s message (%zu bytes): %s at byte %zu", w->top,
                       w->total, what, at);
}

static int varint(const uint8_t *p, size_t n, size_t *i, uint64_t *v)
{
    return amx_wire_varint(p, n, i, v, 10);
}

/* The wire type a (non-packed) value of this field has. */
static int wire_type(ProtobufCType t)
{
    switch (t) {
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT:
        return WT_32;
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return WT_64;
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_BYTES:
    case PROTOBUF_C_TYPE_MESSAGE:
        return WT_LEN;
    default:
        return WT_VARINT;
    }
}

/* The size of one element of a repeated field in protobuf-c's array. */
static size_t elem_size(ProtobufCType t)
{
    switch (t) {
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_UINT64:
        return 8;
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    default:
        return 4;
    }
}

static int is_scalar(ProtobufCType t)
{
    return wire_type(t) != WT_LEN;
}

/* A string field's bytes: no NUL, no control byte (bytes above 0x7e are
 * left to the checks of each name). */
static amx_status_t check_string(walk_t *w, const ProtobufCMessageDescriptor *d,
                                 const ProtobufCFieldDescriptor *f, const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (s[i] >= 0x20 && s[i] != 0x7f)
            continue;
        char esc[96], what[32];
        amx_escape(esc, sizeof(esc), (const char *)s, n);
        if (s[i] == 0)
            snprintf(what, sizeof(what), "a NUL byte");
        else
            snprintf(what, sizeof(what), "a control byte 0x%02x", s[i]);
        return amx_err_set(w->err, AMX_EINVAL,
                           "%s.%s holds %s at offset %zu (\"%s\"); names and strings must not "
                           "contain NUL or control characters",
                           d->name, f->name, what, i, esc);
    }
    return AMX_OK;
}

/* Elements of a packed run of `n` bytes, or -1 when it is malformed. */
static int64_t packed_count(ProtobufCType t, const uint8_t *p, size_t n)
{
    int wt = wire_type(t);
    if (wt == WT_32)
        return n % 4 ? -1 : (int64_t)(n / 4);
    if (wt == WT_64)
        return n % 8 ? -1 : (int64_t)(n / 8);
    int64_t c = 0;
    size_t i = 0;
    while (i < n) {
        uint64_t v;
        if (varint(p, n, &i, &v) != 0)
            return -1;
        c++;
    }
    return c;
}

static amx_status_t walk_msg(walk_t *w, const ProtobufCMessageDescriptor *d, const uint8_t *p,
                             size_t n, size_t base, uint32_t depth)
{
    if (d == NULL || d->magic != PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC)
        return amx_err_set(w->err, AMX_EINTERNAL, "no descriptor for a message of %s", w->top);
    w->decoded += d->sizeof_message + ALLOC_COST;
    /* Elements of each repeated field (our messages have few fields). */
    uint64_t counts[64];
    if (d->n_fields > 64)
        return amx_err_set(w->err, AMX_EINTERNAL, "%s has too many fields to check", d->name);
    memset(counts, 0, sizeof(counts));
    size_t i = 0;
    while (i < n) {
        size_t at = base + i;
        uint64_t tag;
        if (amx_wire_varint(p, n, &i, &tag, 5) != 0 || tag > UINT32_MAX)
            return bad(w, at, "a truncated or overlong field tag");
        uint64_t num = tag >> 3;
        int wt = (int)(tag & 7);
        if (num == 0 || num > 536870911u)
            return bad(w, at, "field number 0 or out of range");
        const uint8_t *val = p + i;
        size_t vstart = i, vlen = 0;
        uint64_t v;
        switch (wt) {
        case WT_VARINT:
            if (varint(p, n, &i, &v) != 0)
                return bad(w, at, "a truncated varint");
            break;
        case WT_64:
            if (n - i < 8)
                return bad(w, at, "a truncated 64-bit value");
            i += 8;
            break;
        case WT_32:
            if (n - i < 4)
                return bad(w, at, "a truncated 32-bit value");
            i += 4;
            break;
        case WT_LEN:
            if (amx_wire_varint(p, n, &i, &v, 5) != 0 || v > INT32_MAX || v > n - i)
                return bad(w, at, "a length past the end of the message");
            val = p + i;
            vlen = (size_t)v;
            i += vlen;
            break;
        default:
            return bad(w, at, "a group or an unknown wire type");
        }
        w->decoded += SCAN_COST;
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field(d, (unsigned)num);
        if (f == NULL) {
            /* Kept by protobuf-c as an unknown field (a newer client): its
             * record and a copy of its value. */
            w->decoded +=
                sizeof(ProtobufCMessageUnknownField) + ALLOC_COST + (i - vstart) + ALLOC_COST;
            continue;
        }
        size_t fi = (size_t)(f - d->fields);
        int repeated = f->label == PROTOBUF_C_LABEL_REPEATED;
        if (wt != wire_type(f->type)) {
            if (!(repeated && wt == WT_LEN && is_scalar(f->type)))
                return bad(w, at, "a wire type that does not match its field");
            int64_t c = packed_count(f->type, val, vlen);
            if (c < 0)
                return bad(w, at, "a malformed packed field");
            counts[fi] += (uint64_t)c;
            continue;
        }
        if (repeated)
            counts[fi]++;
        if (f->type == PROTOBUF_C_TYPE_STRING) {
            AMX_CHECK(check_string(w, d, f, val, vlen));
            w->decoded += vlen + 1 + ALLOC_COST;
        } else if (f->type == PROTOBUF_C_TYPE_BYTES) {
            w->decoded += vlen + ALLOC_COST;
        } else if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
            if (depth + 1 > w->lim->max_depth)
                return amx_err_set(w->err, AMX_EINVAL,
                                   "%s: messages nested more than %u deep in %s", w->top,
                                   w->lim->max_depth, d->name);
            AMX_CHECK(walk_msg(w, f->descriptor, val, vlen, base + (size_t)(val - p), depth + 1));
        }
        if (w->decoded > w->lim->max_decoded)
            break; /* said below, once */
    }
    for (unsigned k = 0; k < d->n_fields; k++) {
        if (counts[k] == 0)
            continue;
        const ProtobufCFieldDescriptor *f = &d->fields[k];
        uint64_t max = is_scalar(f->type) ? w->lim->max_scalars : w->lim->max_elements;
        if (counts[k] > max)
            return amx_err_set(w->err, AMX_ENOMEM,
                               "%s: %s.%s has more than %llu elements; split the request", w->top,
                               d->name, f->name, (unsigned long long)max);
        w->decoded += counts[k] * elem_size(f->type) + ALLOC_COST;
    }
    if (w->decoded > w->lim->max_decoded)
        return amx_err_set(w->err, AMX_ENOMEM,
                           "a %s message of %zu bytes would take more than %llu bytes of memory "
                           "unpacked (max_request_memory); split it into smaller requests",
                           w->top, w->total, (unsigned long long)w->lim->max_decoded);
    return AMX_OK;
}

amx_status_t amx_wire_check(const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len,
                            const amx_wire_limits_t *lim, uint64_t *decoded, amx_err_t *err)
{
    walk_t w = {lim, desc ? desc->name : "?", len, 0, err};
    amx_status_t st = walk_msg(&w, desc, data, len, 0, 0);
    if (decoded != NULL)
        *decoded = w.decoded;
    return st;
}
