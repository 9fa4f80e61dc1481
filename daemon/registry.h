/*
 * registry.h - jobs, their ranks and catalogs, contributions and epochs.
 *
 * The registry is the daemon's state. It is owned by the loop thread and
 * every function here must be called on that thread. It knows nothing of
 * gRPC: requests and responses are the protobuf-c structs of amaxd.v1, and
 * calls that wait (Join, Reconcile) are represented by an amx_waiter_t
 * whose callback the registry calls exactly once.
 *
 * Every request is validated completely before any state changes, so a
 * rejected request leaves the job exactly as it was.
 */
#ifndef AMX_REGISTRY_H
#define AMX_REGISTRY_H

#include <stdint.h>

#include "amaxd/v1/amaxd.pb-c.h"
#include "arena.h"
#include "config.h"
#include "status.h"

typedef struct amx_registry amx_registry_t;
typedef struct amx_waiter amx_waiter_t;

/*
 * A call waiting in Join or Reconcile. The owner (the RPC layer, or a test)
 * embeds it and fills `done`; the registry fills the rest. `done` runs once
 * on the loop thread: with st == AMX_OK and the response (valid only during
 * the callback), or with an error status and a message. The waiter may be
 * freed inside `done`.
 */
struct amx_waiter {
    void (*done)(amx_waiter_t *w, amx_status_t st, const char *msg, const ProtobufCMessage *resp);
    /* Reconcile: the names the answer is restricted to (borrowed). */
    char **names;
    size_t n_names;
    /* Registry-private. */
    void *job;
    uint32_t rank;
    int kind;
    uint64_t deadline_ms;
};

/* Creates an empty registry whose jobs use state backend `backend` ("host"
 * or "cuda") and the limits of `cfg` (borrowed; must outlive the registry). */
amx_status_t amx_registry_create(const amx_config_t *cfg, const char *backend, amx_registry_t **out,
                                 amx_err_t *err);

/* Completes every waiter with EUNAVAIL and frees everything. */
void amx_registry_destroy(amx_registry_t *reg);

/* The state backend's name ("host" or "cuda"). */
const char *amx_registry_backend(const amx_registry_t *reg);

/*
 * Join: on AMX_OK, w->done will be (or already was) called; on error it
 * never is, and err says why. `now_ms` is a monotonic clock in ms.
 */
amx_status_t amx_registry_join(amx_registry_t *reg, const Amaxd__V1__JoinRequest *req,
                               amx_waiter_t *w, uint64_t now_ms, amx_err_t *err);

/* Reconcile: as Join. */
amx_status_t amx_registry_reconcile(amx_registry_t *reg, const Amaxd__V1__ReconcileRequest *req,
                                    amx_waiter_t *w, uint64_t now_ms, amx_err_t *err);

/* Removes a waiter whose client went away; its callback is not called. */
void amx_registry_cancel(amx_registry_t *reg, amx_waiter_t *w);

/* Fails waiters whose deadline is before `now_ms` with ETIMEDOUT. */
void amx_registry_expire(amx_registry_t *reg, uint64_t now_ms);

/* Number of calls waiting in Join or Reconcile. */
uint32_t amx_registry_waiting(const amx_registry_t *reg);

/* The synchronous calls: they fill *resp (allocated in `arena`) or return an
 * error with a message in err. */
amx_status_t amx_registry_register(amx_registry_t *reg, const Amaxd__V1__RegisterRequest *req,
                                   Amaxd__V1__RegisterResponse *resp, amx_err_t *err);
amx_status_t amx_registry_send(amx_registry_t *reg, const Amaxd__V1__SendAmaxRequest *req,
                               Amaxd__V1__SendAmaxResponse *resp, amx_err_t *err);
amx_status_t amx_registry_get_scales(amx_registry_t *reg, const Amaxd__V1__GetScalesRequest *req,
                                     Amaxd__V1__GetScalesResponse *resp, amx_arena_t *arena,
                                     amx_err_t *err);
amx_status_t amx_registry_reset(amx_registry_t *reg, const Amaxd__V1__ResetRequest *req,
                                Amaxd__V1__ResetResponse *resp, amx_err_t *err);
amx_status_t amx_registry_status(amx_registry_t *reg, const Amaxd__V1__StatusRequest *req,
                                 Amaxd__V1__StatusResponse *resp, amx_arena_t *arena,
                                 amx_err_t *err);
amx_status_t amx_registry_list(amx_registry_t *reg, const Amaxd__V1__ListQuantizersRequest *req,
                               Amaxd__V1__ListQuantizersResponse *resp, amx_arena_t *arena,
                               amx_err_t *err);

#endif
