/*
 * rpc.h - the gRPC server: listening sockets, the completion-queue thread,
 * and the calls that move between it and the libuv loop.
 *
 * Threads: one completion-queue thread only takes events off the queue and
 * hands them to the loop (uv_async_send; the loop drains the whole batch).
 * Everything else (parsing, the registry, answers) runs on the loop thread.
 */
#ifndef AMX_RPC_H
#define AMX_RPC_H

#include <uv.h>

#include "config.h"
#include "registry.h"
#include "status.h"

typedef struct amx_rpc amx_rpc_t;

/* Creates the server, binds the Unix socket and/or TCP address of `cfg`,
 * starts the completion-queue thread and begins accepting calls on `loop`.
 * `cfg` and `reg` are borrowed and must outlive the server. Loop thread. */
amx_status_t amx_rpc_start(uv_loop_t *loop, const amx_config_t *cfg, amx_registry_t *reg,
                           double start_time, amx_rpc_t **out, amx_err_t *err);

/*
 * Begins a graceful stop: no new calls, waiting calls fail with UNAVAILABLE,
 * calls in flight get `grace_ms` to finish before they are cancelled. When
 * everything is closed, the socket file is removed, `on_stopped(ud)` is
 * called once on the loop thread, and the server may be freed. Loop thread.
 */
void amx_rpc_stop(amx_rpc_t *rpc, uint64_t grace_ms, void (*on_stopped)(void *ud), void *ud);

/* Frees a stopped server. Loop thread. */
void amx_rpc_free(amx_rpc_t *rpc);

/* Calls that have started and not yet ended (posted requests not counted). */
uint32_t amx_rpc_calls(const amx_rpc_t *rpc);

#endif
