/*
 * service.h - the handlers of amaxd.v1.Calibration and grpc.health.v1.Health
 * (service.c) and of amaxd.peer.v1.Peer (peer.c), between the RPC plumbing
 * (rpc.c) and the registry. protobuf <-> C mapping happens here, nowhere
 * else. Loop thread only.
 */
#ifndef AMX_SERVICE_H
#define AMX_SERVICE_H

#include <protobuf-c/protobuf-c.h>

#include "arena.h"
#include "registry.h"
#include "status.h"

typedef struct amx_call amx_call_t;
typedef struct amx_peer amx_peer_t;
typedef struct amx_shm amx_shm_t;

typedef struct amx_svc {
    amx_registry_t *reg;
    amx_peer_t *peer;
    const amx_config_t *cfg;
    amx_shm_t *shm;    /* the packed form's shared buffers; NULL: off */
    double start_time; /* CLOCK_MONOTONIC seconds at start */
    int stopping;      /* health answers NOT_SERVING once set */
    /* SendAmax/StreamAmax read in place: the updates and their names,
     * reused from request to request (service.c). */
    amx_update_in_t *ups;
    size_t ups_cap;
    char *strs;
    size_t strs_cap;
} amx_svc_t;

/*
 * Answers a call: status (AMX_OK with `resp`, or an error with `msg`). Each
 * call is answered once; a call whose client is gone is dropped silently.
 * Provided by rpc.c.
 */
void amx__call_reply(amx_call_t *c, amx_status_t st, const char *msg, const ProtobufCMessage *resp);

/* The waiter embedded in a call, for calls that may wait. Provided by rpc.c. */
amx_waiter_t *amx__call_waiter(amx_call_t *c);

/* The call whose waiter this is. Provided by rpc.c. */
amx_call_t *amx__waiter_call(amx_waiter_t *w);

/* An arena freed with the call: request views that must outlive the
 * handler (a deferred Register). Provided by rpc.c. */
amx_arena_t *amx__call_arena(amx_call_t *c);

/* The value of request metadata `key` (not NUL-terminated; *len set), or
 * NULL. Provided by rpc.c. */
const char *amx__call_metadata(amx_call_t *c, const char *key, size_t *len);

/* The caller's address ("ipv4:10.0.0.2:51234"), into buf. Provided by rpc.c. */
void amx__call_peer(amx_call_t *c, char *buf, size_t len);

/* The method path of a call. Provided by rpc.c. */
const char *amx__call_method(amx_call_t *c);

/* Milliseconds of CLOCK_MONOTONIC. */
uint64_t amx__now_ms(void);

typedef void (*amx_handler_fn)(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *req);

/* A method read without protobuf-c (the packed form): `data` is the whole
 * serialized request, already checked by amx_wire_check against the
 * method's descriptor, writable, and valid during the call only. */
typedef void (*amx_raw_fn)(amx_svc_t *svc, amx_call_t *c, uint8_t *data, size_t len);

/* One message of a raw client stream; an error ends the stream. */
typedef amx_status_t (*amx_raw_stream_fn)(amx_svc_t *svc, uint8_t *data, size_t len,
                                          uint64_t *accepted, uint64_t *epoch, amx_err_t *err);

/*
 * Answers a call with an already serialized message of `len` bytes in
 * `buf`, handed to gRPC without a copy. Ownership passes to the call,
 * which gives the bytes up once sent, whatever happens: release(ud) (from
 * any thread), or free(buf) when release is NULL. Loop thread; provided
 * by rpc.c.
 */
void amx__call_reply_raw(amx_call_t *c, uint8_t *buf, size_t len, void (*release)(void *),
                         void *ud);

enum { AMX_SERVER_TRAINER = 0, AMX_SERVER_PEER = 1 };

typedef struct amx_method {
    const char *path; /* "/package.Service/Method" */
    const ProtobufCMessageDescriptor *request;
    amx_handler_fn handler;       /* unary methods */
    int client_streaming;         /* StreamAmax, StreamPacked: raw_stream set */
    int server;                   /* AMX_SERVER_* */
    amx_raw_fn raw;               /* unary, read without protobuf-c (handler NULL) */
    amx_raw_stream_fn raw_stream; /* client stream, read without protobuf-c */
} amx_method_t;

extern const amx_method_t amx__methods[];
extern const size_t amx__n_methods;
extern const amx_method_t amx__peer_methods[];
extern const size_t amx__n_peer_methods;

/*
 * The registry's view of a serialized SendAmaxRequest that amx_wire_check
 * accepted, read in place (values and has_data point into `d`; names are
 * copied into svc's string space, valid until the next call). Means what
 * protobuf-c's unpacking means; the fuzzer holds it to that.
 */
amx_status_t amx__service_send_parse(amx_svc_t *svc, const uint8_t *d, size_t n, amx_send_req_t *q,
                                     amx_err_t *err);

/* Frees what the service keeps from request to request when it is over
 * `keep` bytes (an idle daemon: amx_rpc_trim). */
void amx__service_trim(amx_svc_t *svc, size_t keep);

/* Frees what the service keeps from request to request. */
void amx__service_free(amx_svc_t *svc);

#endif
