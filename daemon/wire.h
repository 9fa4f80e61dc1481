/*
 * wire.h - checks a serialized protobuf message before protobuf-c unpacks
 * it. protobuf-c allocates everything a message describes before any of
 * amaxd's checks run, copies strings up to their first NUL byte only, and
 * a few bytes of input can describe a great deal of memory (an empty
 * sub-message is two bytes on the wire and a hundred in memory). This
 * module walks the wire format once, with the message's descriptor, and
 * refuses:
 *   - anything protobuf-c would refuse (bad varints, lengths past the end,
 *     wire types that do not match the field, groups);
 *   - strings holding a NUL byte or a control byte (names are printable;
 *     a NUL would silently cut them short, a newline would forge a log
 *     line);
 *   - repeated fields with more elements than allowed;
 *   - messages nested deeper than allowed;
 *   - messages whose unpacked form would take more memory than allowed
 *     (an upper estimate of what protobuf-c allocates, malloc overhead
 *     included).
 * Pure function of its input: no allocation, any thread.
 */
#ifndef AMX_WIRE_H
#define AMX_WIRE_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

typedef struct amx_wire_limits {
    uint64_t max_decoded;  /* bytes the unpacked message may take */
    uint64_t max_elements; /* of a repeated message, string or bytes field */
    uint64_t max_scalars;  /* of a repeated number field */
    uint32_t max_depth;    /* nested messages below the top one */
} amx_wire_limits_t;

/*
 * AMX_OK when `data` is a message of type `desc` within `lim`; *decoded
 * (may be NULL) gets the estimate of its unpacked size. Otherwise
 * AMX_EINVAL (malformed, or a string with a NUL or control byte) or
 * AMX_ENOMEM (over a limit), with a sentence naming the field; the input
 * is never echoed unescaped.
 */
amx_status_t amx_wire_check(const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len,
                            const amx_wire_limits_t *lim, uint64_t *decoded, amx_err_t *err);

/*
 * The varint of protobuf's wire format, the one implementation amaxd has.
 * amx_wire_varint reads one of at most `max` bytes (protobuf-c takes tags
 * and lengths of at most 5, values of at most 10) at *i of p[0, n) and
 * advances *i: 0, or -1 when it is malformed or runs past n. Any thread.
 */
static inline int amx_wire_varint(const uint8_t *p, size_t n, size_t *i, uint64_t *v, int max)
{
    uint64_t r = 0;
    for (int k = 0, shift = 0; k < max; k++, shift += 7) {
        if (*i >= n)
            return -1;
        uint8_t b = p[(*i)++];
        if (shift == 63 && b > 1)
            return -1; /* more than 64 bits */
        r |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = r;
            return 0;
        }
    }
    return -1;
}

/* A varint of a message amx_wire_check accepted (0 if it were malformed). */
static inline uint64_t amx_wire_get_varint(const uint8_t *p, size_t n, size_t *i)
{
    uint64_t v = 0;
    return amx_wire_varint(p, n, i, &v, 10) == 0 ? v : 0;
}

/* Bytes the varint of v takes. */
static inline size_t amx_wire_varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

/* Writes the varint of v at p; returns its length. */
static inline size_t amx_wire_put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/*
 * Writes `s` (n bytes) into buf as printable ASCII: bytes outside 0x20..0x7e
 * and the backslash become \xNN; at most `len` - 1 characters, cut with
 * "..." when longer. Returns buf.
 */
char *amx_escape(char *buf, size_t len, const char *s, size_t n);

#endif
