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
 * Writes `s` (n bytes) into buf as printable ASCII: bytes outside 0x20..0x7e
 * and the backslash become \xNN; at most `len` - 1 characters, cut with
 * "..." when longer. Returns buf.
 */
char *amx_escape(char *buf, size_t len, const char *s, size_t n);

#endif
