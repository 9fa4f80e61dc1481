/*
 * service.h - the handlers of amaxd.v1.Calibration and grpc.health.v1.Health,
 * between the RPC plumbing (rpc.c) and the registry. Loop thread only.
 */
#ifndef AMX_SERVICE_H
#define AMX_SERVICE_H

#include <protobuf-c/protobuf-c.h>

#include "registry.h"
#include "status.h"

typedef struct amx_call amx_call_t;

typedef struct amx_svc {
    amx_registry_t *reg;
    const amx_config_t *cfg;
    double start_time; /* CLOCK_MONOTONIC seconds at start */
    int stopping;      /* health answers NOT_SERVING once set */
} amx_svc_t;

/*
 * Answers a call: status (AMX_OK with `resp`, or an error with `msg`). Each
 * call is answered once; a call whose client is gone is dropped silently.
 * Provided by rpc.c.
 */
void amx__call_reply(amx_call_t *c, amx_status_t st, const char *msg, const ProtobufCMessage *resp);

/* The waiter embedded in a call, for Join and Reconcile. Provided by rpc.c. */
amx_waiter_t *amx__call_waiter(amx_call_t *c);

/* Milliseconds of CLOCK_MONOTONIC. */
uint64_t amx__now_ms(void);

typedef void (*amx_handler_fn)(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *req);

typedef struct amx_method {
    const char *path; /* "/package.Service/Method" */
    const ProtobufCMessageDescriptor *request;
    amx_handler_fn handler; /* unary methods */
    int client_streaming;   /* StreamAmax: see amx__service_stream_* */
} amx_method_t;

extern const amx_method_t amx__methods[];
extern const size_t amx__n_methods;

/* StreamAmax: one message; adds to *accepted. An error ends the stream. */
amx_status_t amx__service_stream_msg(amx_svc_t *svc, const ProtobufCMessage *req,
                                     uint64_t *accepted, uint64_t *epoch, amx_err_t *err);

#endif
