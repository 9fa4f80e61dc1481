/*
 * service.c - one handler per RPC: decode is done by rpc.c, this file calls
 * the registry, logs rejected requests and answers.
 */
#include "service.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

#include "arena.h"
#include "grpc/health/v1/health.pb-c.h"
#include "log.h"
#include "version.h"

uint64_t amx__now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Answers an error and logs it: every rejected request leaves a line. */
static void reply_err(amx_call_t *c, const char *method, const amx_err_t *err)
{
    AMX_WARN("rpc", "%s rejected (%s): %s", method, amx_strerror(err->code), err->msg);
    amx__call_reply(c, err->code, err->msg, NULL);
}

static void waiter_done(amx_waiter_t *w, amx_status_t st, const char *msg,
                        const ProtobufCMessage *resp)
{
    amx_call_t *c = (amx_call_t *)w; /* the waiter is the call's first member (rpc.c) */
    amx__call_reply(c, st, msg, resp);
}

static void h_join(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__JoinRequest *req = (const void *)m;
    amx_err_t err = {0};
    amx_waiter_t *w = amx__call_waiter(c);
    w->done = waiter_done;
    if (amx_registry_join(svc->reg, req, w, amx__now_ms(), &err) != AMX_OK)
        reply_err(c, "Join", &err);
}

static void h_reconcile(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Amaxd__V1__ReconcileRequest *req = (const void *)m;
    amx_err_t err = {0};
    amx_waiter_t *w = amx__call_waiter(c);
    w->done = waiter_done;
    if (amx_registry_reconcile(svc->reg, req, w, amx__now_ms(), &err) != AMX_OK)
        reply_err(c, "Reconcile", &err);
}

static void h_register(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    Amaxd__V1__RegisterResponse resp = AMAXD__V1__REGISTER_RESPONSE__INIT;
    amx_err_t err = {0};
    if (amx_registry_register(svc->reg, (const void *)m, &resp, &err) != AMX_OK)
        reply_err(c, "Register", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
}

static void h_send(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    Amaxd__V1__SendAmaxResponse resp = AMAXD__V1__SEND_AMAX_RESPONSE__INIT;
    amx_err_t err = {0};
    if (amx_registry_send(svc->reg, (const void *)m, &resp, &err) != AMX_OK)
        reply_err(c, "SendAmax", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
}

amx_status_t amx__service_stream_msg(amx_svc_t *svc, const ProtobufCMessage *m, uint64_t *accepted,
                                     uint64_t *epoch, amx_err_t *err)
{
    Amaxd__V1__SendAmaxResponse resp = AMAXD__V1__SEND_AMAX_RESPONSE__INIT;
    amx_status_t st = amx_registry_send(svc->reg, (const void *)m, &resp, err);
    if (st != AMX_OK) {
        AMX_WARN("rpc", "StreamAmax message rejected after %llu accepted updates (%s): %s",
                 (unsigned long long)*accepted, amx_strerror(st), err->msg);
        return st;
    }
    *accepted += resp.accepted;
    *epoch = resp.epoch;
    return AMX_OK;
}

static void h_get_scales(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    Amaxd__V1__GetScalesResponse resp = AMAXD__V1__GET_SCALES_RESPONSE__INIT;
    amx_err_t err = {0};
    amx_arena_t a = {0};
    if (amx_registry_get_scales(svc->reg, (const void *)m, &resp, &a, &err) != AMX_OK)
        reply_err(c, "GetScales", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
    amx_arena_free(&a);
}

static void h_reset(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    Amaxd__V1__ResetResponse resp = AMAXD__V1__RESET_RESPONSE__INIT;
    amx_err_t err = {0};
    if (amx_registry_reset(svc->reg, (const void *)m, &resp, &err) != AMX_OK)
        reply_err(c, "Reset", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
}

static void h_status(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    Amaxd__V1__StatusResponse resp = AMAXD__V1__STATUS_RESPONSE__INIT;
    amx_err_t err = {0};
    amx_arena_t a = {0};
    resp.version = AMAXD_VERSION;
    resp.uptime_s = (double)amx__now_ms() / 1000.0 - svc->start_time;
    resp.pid = (uint32_t)getpid();
    if (amx_registry_status(svc->reg, (const void *)m, &resp, &a, &err) != AMX_OK)
        reply_err(c, "Status", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
    amx_arena_free(&a);
}

static void h_list(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    Amaxd__V1__ListQuantizersResponse resp = AMAXD__V1__LIST_QUANTIZERS_RESPONSE__INIT;
    amx_err_t err = {0};
    amx_arena_t a = {0};
    if (amx_registry_list(svc->reg, (const void *)m, &resp, &a, &err) != AMX_OK)
        reply_err(c, "ListQuantizers", &err);
    else
        amx__call_reply(c, AMX_OK, NULL, &resp.base);
    amx_arena_free(&a);
}

/* grpc.health.v1.Health/Check: "" and "amaxd.v1.Calibration" are served. */
static void h_health(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    const Grpc__Health__V1__HealthCheckRequest *req = (const void *)m;
    Grpc__Health__V1__HealthCheckResponse resp = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    if (req->service[0] != '\0' && strcmp(req->service, "amaxd.v1.Calibration") != 0) {
        amx_err_t err = {0};
        amx_err_set(&err, AMX_ENOTFOUND, "health: unknown service '%.128s'", req->service);
        reply_err(c, "Health/Check", &err);
        return;
    }
    resp.status = svc->stopping
                      ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING
                      : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
    amx__call_reply(c, AMX_OK, NULL, &resp.base);
}

const amx_method_t amx__methods[] = {
    {"/amaxd.v1.Calibration/Join", &amaxd__v1__join_request__descriptor, h_join, 0},
    {"/amaxd.v1.Calibration/RegisterQuantizers", &amaxd__v1__register_request__descriptor,
     h_register, 0},
    {"/amaxd.v1.Calibration/SendAmax", &amaxd__v1__send_amax_request__descriptor, h_send, 0},
    {"/amaxd.v1.Calibration/StreamAmax", &amaxd__v1__send_amax_request__descriptor, NULL, 1},
    {"/amaxd.v1.Calibration/Reconcile", &amaxd__v1__reconcile_request__descriptor, h_reconcile, 0},
    {"/amaxd.v1.Calibration/GetScales", &amaxd__v1__get_scales_request__descriptor, h_get_scales,
     0},
    {"/amaxd.v1.Calibration/Reset", &amaxd__v1__reset_request__descriptor, h_reset, 0},
    {"/amaxd.v1.Calibration/Status", &amaxd__v1__status_request__descriptor, h_status, 0},
    {"/amaxd.v1.Calibration/ListQuantizers", &amaxd__v1__list_quantizers_request__descriptor,
     h_list, 0},
    {"/grpc.health.v1.Health/Check", &grpc__health__v1__health_check_request__descriptor, h_health,
     0},
};
const size_t amx__n_methods = sizeof(amx__methods) / sizeof(amx__methods[0]);
