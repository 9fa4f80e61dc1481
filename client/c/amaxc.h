/*
 * amaxc.h - a small synchronous C client for the amaxd API, on the gRPC C
 * core. One amaxc_t is one channel; calls on it are blocking and must not be
 * made from two threads at once.
 */
#ifndef AMAXC_H
#define AMAXC_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>

#include "amaxd/v1/amaxd.pb-c.h"
#include "grpc/health/v1/health.pb-c.h"

typedef struct amaxc amaxc_t;

/*
 * Opens a channel to `target`: "unix:/path", "/path" (a Unix socket) or
 * "host:port". Never blocks (the connection is made by the first call).
 * Returns NULL only when out of memory. Free with amaxc_close.
 */
amaxc_t *amaxc_open(const char *target);

void amaxc_close(amaxc_t *c);

/*
 * Calls `method` (e.g. "/amaxd.v1.Calibration/Status") with `req` and waits
 * at most `timeout_s` seconds. Returns the grpc_status_code (0 = OK). On OK,
 * *resp is the unpacked answer (free it with protobuf_c_message_free_unpacked);
 * otherwise `msg` holds the daemon's (or gRPC's) message.
 */
int amaxc_call(amaxc_t *c, const char *method, const ProtobufCMessage *req,
               const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
               double timeout_s, char *msg, size_t msglen);

/* The name of a gRPC status code ("NOT_FOUND"...). */
const char *amaxc_code_name(int code);

#endif
