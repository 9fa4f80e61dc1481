/*
 * status.h - the one status enum of amaxd, and the error record that carries
 * a message a person can act on from where an error happens to the gRPC
 * status a trainer sees.
 */
#ifndef AMX_STATUS_H
#define AMX_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * X(name, grpc_status_code, text). The gRPC code is the numeric value of
 * grpc_status_code so that this header needs no gRPC include.
 */
#define AMX_STATUS_MAP(X)                                                                          \
    X(OK, 0, "ok")                                                                                 \
    X(EINVAL, 3, "invalid argument")                                                               \
    X(ENOTFOUND, 5, "not found")                                                                   \
    X(EEXIST, 6, "already exists")                                                                 \
    X(EPRECOND, 9, "failed precondition")                                                          \
    X(EABORTED, 10, "aborted")                                                                     \
    X(ERANGE, 11, "out of range")                                                                  \
    X(ENOMEM, 8, "resource exhausted")                                                             \
    X(EUNIMPL, 12, "unimplemented")                                                                \
    X(ETIMEDOUT, 4, "deadline exceeded")                                                           \
    X(EUNAVAIL, 14, "unavailable")                                                                 \
    X(ECANCELLED, 1, "cancelled")                                                                  \
    X(EINTERNAL, 13, "internal error")                                                             \
    X(EIO, 13, "I/O error")                                                                        \
    X(EDEVICE, 13, "device error")                                                                 \
    X(EAUTH, 16, "unauthenticated")

typedef enum amx_status {
#define AMX__ENUM(name, grpc, text) AMX_##name,
    AMX_STATUS_MAP(AMX__ENUM)
#undef AMX__ENUM
        AMX__STATUS_MAX
} amx_status_t;

/* A short fixed text for a status; never NULL. Any thread. */
const char *amx_strerror(amx_status_t st);

/* The numeric grpc_status_code a status maps to. Any thread. */
int amx_status_grpc(amx_status_t st);

/* The status for a numeric grpc_status_code (a peer's answer). Any thread. */
amx_status_t amx_status_from_grpc(int code);

/* An error: a status and the sentence that explains it. */
typedef struct amx_err {
    amx_status_t code;
    char msg[768];
} amx_err_t;

/*
 * Records `code` and a formatted message in `err` (which may be NULL) unless
 * an error is already recorded there: the first error wins, as in a cleanup
 * path. Returns `code` so that callers can write `return amx_err_set(...)`.
 */
amx_status_t amx_err_set(amx_err_t *err, amx_status_t code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Clears an error record to AMX_OK with an empty message. */
void amx_err_clear(amx_err_t *err);

#define AMX_CHECK(call)                                                                            \
    do {                                                                                           \
        amx_status_t amx__st = (call);                                                             \
        if (amx__st != AMX_OK)                                                                     \
            return amx__st;                                                                        \
    } while (0)

#define AMX_CHECK_GOTO(call, st, label)                                                            \
    do {                                                                                           \
        (st) = (call);                                                                             \
        if ((st) != AMX_OK)                                                                        \
            goto label;                                                                            \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
