/*
 * registry.h - the jobs this daemon serves: their local ranks, catalogs,
 * placements, contributions and epochs.
 *
 * The registry is owned by the loop lock's holder: every function here must
 * be called with the loop lock held (the loop thread, or a completion-queue
 * thread that took it: rpc.h). It knows nothing of gRPC or protobuf:
 * requests and answers are the C structs of request.h (service.c maps them
 * to amaxd.v1 messages). Calls
 * that may wait (Join, Reconcile, and Register/Reset while an epoch of the
 * job is in flight) complete through an amx_waiter_t whose callback the
 * registry calls exactly once, or return an error and never call it.
 *
 * Every request is validated completely before any state changes, so a
 * rejected request leaves the job exactly as it was.
 */
#ifndef AMX_REGISTRY_H
#define AMX_REGISTRY_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "arena.h"
#include "catalog.h"
#include "config.h"
#include "request.h"
#include "status.h"

typedef struct amx_registry amx_registry_t;
typedef struct amx_peer amx_peer_t;

/*
 * Creates an empty registry whose jobs use state backend `backend` ("host"
 * or "cuda") and the limits of `cfg` (borrowed; must outlive the registry).
 * Epoch outcomes are delivered on `loop`. `peer` (may be NULL for a single
 * daemon) is the cluster's membership and peer service.
 */
amx_status_t amx_registry_create(uv_loop_t *loop, const amx_config_t *cfg, const char *backend,
                                 amx_peer_t *peer, amx_registry_t **out, amx_err_t *err);

/* Restores every job snapshotted under state_dir (creating the directory
 * when missing); snapshots that cannot be used are moved aside with a log
 * line. EUNAVAIL when state_dir is unusable. Before serving. */
amx_status_t amx_registry_restore(amx_registry_t *reg, amx_err_t *err);

/* Writes the epochs that snapshot_interval_ms left unwritten (shutdown,
 * after the engines stopped: amx_registry_destroy calls it). */
void amx_registry_flush_snapshots(amx_registry_t *reg);
typedef struct amx_metrics amx_metrics_t;

/* Records into `m` (may be NULL) from now on: updates and bytes merged,
 * epochs, latencies, missing and filled cells, dropped jobs. `m` must
 * outlive the registry. Loop thread. */
void amx_registry_set_metrics(amx_registry_t *reg, amx_metrics_t *m);

/* Completes every waiter with EUNAVAIL, stops every engine, frees everything. */
void amx_registry_destroy(amx_registry_t *reg);

/* Aborts epochs in flight and fails waiting calls (shutdown); `why` is
 * their message. The registry stays usable for amx_registry_destroy. */
void amx_registry_shutdown(amx_registry_t *reg, const char *why);

/* The state backend's name ("host" or "cuda"). */
const char *amx_registry_backend(const amx_registry_t *reg);

/* The collective backend jobs of several daemons use ("gloo", "nccl"),
 * or "local" for a single daemon. */
const char *amx_registry_collective(const amx_registry_t *reg);

/* The requests. Each is validated completely before anything changes (an
 * error leaves the job as it was). Those that take a waiter either return
 * an error and never call it, or call w->done exactly once, now or later
 * (docs/API.md says when each waits). */

/* Joins a rank; completes when all ranks of the job joined some daemon. */
amx_status_t amx_registry_join(amx_registry_t *reg, const amx_join_req_t *req, amx_waiter_t *w,
                               uint64_t now_ms, amx_err_t *err);

/* Registers a rank's quantizers and placements; atomic; waits while an
 * epoch of the job is in flight (or its buffers grow). */
amx_status_t amx_registry_register(amx_registry_t *reg, const amx_register_req_t *req,
                                   amx_waiter_t *w, amx_err_t *err);

/* Merges named updates into the open epoch; atomic. The values are read
 * during the call only. */
amx_status_t amx_registry_send(amx_registry_t *reg, const amx_send_req_t *req, uint64_t *accepted,
                               uint64_t *epoch, amx_err_t *err);

/* The slab layout of a rank (the packed form); arrays in the arena. */
amx_status_t amx_registry_layout(amx_registry_t *reg, const char *job, uint32_t rank,
                                 amx_layout_t *out, amx_arena_t *arena, amx_err_t *err);

/* fn(ud, job) is called whenever a job is dropped (Reset, idle timeout,
 * a peer's drop), before it is gone. */
void amx_registry_on_drop(amx_registry_t *reg, void (*fn)(void *ud, const char *job), void *ud);

/* fn(ud, us) (any thread) is told when an engine's end of epoch is due
 * within `us` microseconds (0: it came), so that the loop can wait for it
 * without sleeping (rpc.h amx_rpc_expect). */
void amx_registry_on_expect(amx_registry_t *reg, void (*fn)(void *ud, uint64_t us), void *ud);

/* Merges a slab into the open epoch; atomic. A layout id that is not the
 * rank's current one is FAILED_PRECONDITION. req->values is normalized in
 * place. */
amx_status_t amx_registry_send_packed(amx_registry_t *reg, const amx_send_packed_req_t *req,
                                      uint64_t *accepted, uint64_t *epoch, amx_err_t *err);

/* Ends the rank's epoch; completes with its results (named, or packed
 * through w->alloc_packed) once every rank of the job entered. */
amx_status_t amx_registry_reconcile(amx_registry_t *reg, const amx_reconcile_req_t *req,
                                    amx_waiter_t *w, uint64_t now_ms, amx_err_t *err);

/* The last reconciled results (a window of them), in the arena. */
amx_status_t amx_registry_get_scales(amx_registry_t *reg, const amx_scales_req_t *req,
                                     amx_reply_t *reply, amx_arena_t *arena, amx_err_t *err);

/* Resets quantizers at the next epoch, or drops the job everywhere. */
amx_status_t amx_registry_reset(amx_registry_t *reg, const amx_reset_req_t *req, amx_waiter_t *w,
                                amx_err_t *err);

/* Removes a waiter whose client went away; its callback is not called. */
void amx_registry_cancel(amx_registry_t *reg, amx_waiter_t *w);

/* OpenDevice (GPU-direct): device buffers for a rank's current layout on
 * the trainer's GPU, replacing the rank's earlier ones. FAILED_PRECONDITION
 * on a daemon whose state backend has no device buffers (host) and for a
 * layout id that is not the rank's current one. */
amx_status_t amx_registry_device_open(amx_registry_t *reg, const amx_dev_open_req_t *req,
                                      amx_dev_opened_t *out, amx_err_t *err);

/* The flag page of rank `rank`'s armed epochs (docs/API.md "Armed
 * epochs"): maps fd (the caller closes it) for its device buffers,
 * replacing the last. */
amx_status_t amx_registry_dev_flag_page(amx_registry_t *reg, const char *job, uint32_t rank, int fd,
                                        amx_err_t *err);

/* Whether shutdown began (amx_registry_shutdown): nothing is armed then. */
int amx_registry_shutting_down(const amx_registry_t *reg);

/* CloseDevice: frees a rank's device buffers `id`. */
amx_status_t amx_registry_device_close(amx_registry_t *reg, const char *job, uint32_t rank,
                                       uint64_t id, amx_err_t *err);

/* The state backend's device fault (a sticky CUDA error), or NULL. */
const char *amx_registry_fault(const amx_registry_t *reg);

/* Fails waiters whose deadline is before `now_ms` with ETIMEDOUT. */
void amx_registry_expire(amx_registry_t *reg, uint64_t now_ms);

/* Number of calls waiting in Join or Reconcile. */
uint32_t amx_registry_waiting(const amx_registry_t *reg);

/* Status: `job` empty = all jobs. NOT_FOUND for an unknown job. The infos
 * are allocated in the arena. */
amx_status_t amx_registry_status(amx_registry_t *reg, const char *job, amx_job_info_t **jobs,
                                 size_t *njobs, amx_arena_t *arena, amx_err_t *err);

/* The local view of a job's catalog (agreed, then proposals). */
amx_status_t amx_registry_list(amx_registry_t *reg, const char *job, amx_qinfo_t **q, size_t *n,
                               amx_arena_t *arena, amx_err_t *err);

/* ---- for the peer service (peer.c) ---- */

/* Ranks of `job` hosted here that have not entered Reconcile for `epoch`
 * (written into `missing`, at most `cap`); NOT_FOUND when unknown. */
amx_status_t amx_registry_progress(amx_registry_t *reg, const char *job, uint64_t epoch,
                                   uint32_t *missing, uint32_t cap, uint32_t *nmissing,
                                   uint64_t *open_epoch, uint64_t *last, int *in_flight,
                                   amx_err_t *err);

/* A peer says the job's communicator `gen` failed with `code` (or the job
 * changed membership: AMX_EABORTED; or, gen 0 with an epoch, that epoch's
 * attempt of `agreement` under coordinator `coord_inc` (0 and 0: before
 * it agreed) failed on the peer): abort what is in flight, failing it
 * with that status and the peer's sentence, and agree again at the next
 * epoch (amx_engine_abort). */
void amx_registry_peer_abort(amx_registry_t *reg, const char *job, uint64_t gen, uint64_t epoch,
                             uint64_t agreement, uint64_t coord_inc, uint32_t from,
                             amx_status_t code, const char *reason);

/* The coordinator dropped the job (Reset(drop_job) on some daemon). */
void amx_registry_peer_drop(amx_registry_t *reg, const char *job, uint32_t from);

/* A donor's published state for sync `seq`: copies up to `max` bytes at
 * `offset` (allocated with malloc into *data). EUNAVAIL when not (yet)
 * published. Any thread is fine for this one (it locks). */
amx_status_t amx_registry_fetch_state(amx_registry_t *reg, const char *job, uint64_t seq,
                                      uint64_t offset, uint32_t max, void **data, size_t *len,
                                      uint64_t *total, amx_err_t *err);

#endif
