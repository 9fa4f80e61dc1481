/*
 * peer.h - the calls this daemon makes to the other daemons of its cluster
 * (amaxd.peer.v1.Peer over TCP, authenticated with the cluster's secret;
 * docs/CLUSTER.md). The service it serves to them is service_peer.c.
 *
 * Threads. amx_peer_join, _join_cancel, _drop, _tell_drop and _abort_all
 * run with the loop lock and never block (asynchronous gRPC on the RPC
 * layer's completion queue). The amx_peer_call_* functions and amx_peer_kv
 * block the calling thread: they are for engine threads only (never the
 * loop), check an abort flag every 50 ms and honour a deadline. The
 * channel cache is shared by all threads (its own mutex).
 */
#ifndef AMX_PEER_H
#define AMX_PEER_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "catalog.h"
#include "cluster.h"
#include "comm.h"
#include "config.h"
#include "coord.h"
#include "status.h"

/* The metadata key of the token, the service's path prefix, and the most
 * bytes of a state one FetchState answer carries. */
#define AMX_PEER_AUTH_KEY "x-amaxd-auth"
#define AMX_PEER_SVC "/amaxd.peer.v1.Peer/"
#define AMX_PEER_FETCH_CHUNK (4u << 20)

typedef struct amx_rpc amx_rpc_t;
typedef struct amx_peer amx_peer_t;

/* The calls of a daemon of cluster `cl` (borrowed); `coord` is its own
 * coordinator (borrowed) on a coordinator candidate (a rank of the
 * `coordinator` list), else NULL. Loop thread, at start. */
amx_status_t amx_peer_create(uv_loop_t *loop, const amx_config_t *cfg, const amx_cluster_t *cl,
                             amx_coord_t *coord, amx_peer_t **out, amx_err_t *err);

/* The RPC layer whose completion queue carries the loop's asynchronous
 * calls (none are made before). Loop thread, at start. */
void amx_peer_set_rpc(amx_peer_t *p, amx_rpc_t *rpc);

/* Frees it (after the registry and its engines are gone, before the RPC
 * layer shuts gRPC down). Loop thread. */
void amx_peer_destroy(amx_peer_t *p);

/* This daemon's identity. Any thread. */
const amx_cluster_id_t *amx_peer_id(const amx_peer_t *p);

/* ---- the coordinator's role (docs/CLUSTER.md, "Coordinator failover") ----
 *
 * The coordinator is the lowest-ranked candidate of the `coordinator` list
 * that this daemon heard from within coordinator_failover_ms (itself, when
 * it is one). With several candidates a watcher thread pings the
 * candidates below this daemon a few times per coordinator_failover_ms;
 * the calls to the coordinator go to the one it names, and an agreement or
 * rendezvous call that finds it gone waits for the next one and is sent
 * again there, within its deadline. */

/* The coordinator as this daemon sees it now: its rank and address; returns
 * a number that changes whenever that does. Any thread. */
uint32_t amx_peer_coordinator(amx_peer_t *p, uint32_t *rank, char *addr, size_t len);

/* Makes this daemon's own coordinator serve or step down when the watcher
 * found that its role changed. Loop thread, often (the daemon's tick). */
void amx_peer_tick(amx_peer_t *p);

/* Whether this daemon serves the coordinator's calls now. Loop thread. */
int amx_peer_coordinating(const amx_peer_t *p);

/* ---- loop thread, asynchronous ---- */

typedef void (*amx_peer_join_cb)(void *ud, amx_status_t st, const char *msg,
                                 const amx_membership_t *m);

/* Joins trainer rank `rank` of `job` at the coordinator. cb runs once on the
 * loop thread unless the join is cancelled; *h identifies it. A Join the
 * coordinator does not answer ends at deadline_ms with DEADLINE_EXCEEDED
 * naming it. */
amx_status_t amx_peer_join(amx_peer_t *p, const char *job, uint32_t world, uint32_t rank,
                           uint64_t deadline_ms, amx_peer_join_cb cb, void *ud, void **h,
                           amx_err_t *err);

/* Withdraws a Join: its callback is not called. */
void amx_peer_join_cancel(amx_peer_t *p, void *h);

/* Asks the coordinator to drop the job everywhere (best effort; on the
 * coordinator's daemon, drops it there at once). */
void amx_peer_drop(amx_peer_t *p, const char *job);

/* Tells the participants of `m` but this daemon and `skip` that `job` was
 * dropped (the coordinator, after a drop). */
void amx_peer_tell_drop(amx_peer_t *p, const char *job, const amx_membership_t *m, uint32_t skip);

/* Tells the participants of `m` but this daemon and `skip` to drop the
 * job's communicator `gen` (ABORTED, `reason`). */
void amx_peer_abort_all(amx_peer_t *p, const amx_membership_t *m, const char *job, uint64_t gen,
                        uint32_t skip, const char *reason);

/* ---- engine threads, blocking ---- */

/* The coordinator's agreement answer, owned by the caller. */
typedef struct amx_sync_result {
    uint64_t seq, catalog_hash, target_epoch, comm_gen, coord_inc;
    int new_comm;
    int catalog_included;
    amx_qspec_t **catalog; /* owned specs, sorted */
    uint32_t ncatalog;
    char **rejected;
    size_t nrejected;
    char *conflict; /* NULL or the sentence */
    char **resets;
    size_t nresets;
    uint32_t donor;
    uint32_t *behind;
    size_t nbehind;
    amx_membership_t members; /* npart 0 when omitted (the caller's: members_omitted) */
    int members_omitted;
    int catalog_delta; /* catalog holds only the specs agreed since the caller's */
    int catalog_yours; /* the agreed catalog is the caller's plus its proposals */
    int send_catalog;  /* alone: call again with the whole catalog (coord.h) */
    int send_offer;    /* alone: call again with the offer's specs */
} amx_sync_result_t;

/* Frees what a result owns. */
void amx_sync_result_free(amx_sync_result_t *r);

/* One agreement round at the coordinator (Sync), until req->deadline_ms or
 * *abort. */
amx_status_t amx_peer_call_sync(amx_peer_t *p, const amx_coord_sync_req_t *req,
                                const atomic_int *abort, amx_sync_result_t *res, amx_err_t *err);

/* A rendezvous store on the coordinator's key-value store (comm.h). Its
 * gets end early on *abort, or when `watch` (if not NULL; comm.h's, asked
 * every AMX_COMM_WATCH_MS of a get's wait) says a participant is gone:
 * EUNAVAIL with the watch's reason. */
void amx_peer_kv(amx_peer_t *p, const atomic_int *abort, int (*watch)(void *, char *, size_t),
                 void *watch_ud, amx_kv_t *kv);

/* The state a donor published for agreement `seq` of `job` (malloc'd). */
amx_status_t amx_peer_call_fetch(amx_peer_t *p, const char *addr, const char *job, uint64_t seq,
                                 uint64_t deadline_ms, const atomic_int *abort, void **blob,
                                 size_t *len, amx_err_t *err);

/* Progress of `job` on each daemon of `m` but index `me`, in parallel, each
 * within `timeout_ms`: writes one line per daemon into buf ("" when all
 * fine). */
void amx_peer_call_progress(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                            uint64_t epoch, uint64_t timeout_ms, char *buf, size_t len);

/* What a communicator's watch pings: the ring neighbours of one
 * participant (both, or the one there is), their peer addresses resolved
 * once (amx_peer_watch_init, when the communicator is made). */
typedef struct amx_peer_watch {
    uint32_t n;
    amx_part_t part[2]; /* daemon, incarnation, addr (ranks not kept) */
    amx_netaddrs_t addr[2];
} amx_peer_watch_t;

/* The neighbours of index `me` among the participants of `m`, resolved
 * (blocks for their name lookups). */
void amx_peer_watch_init(amx_peer_watch_t *w, const amx_membership_t *m, int me);

/* Pings them (parallel, within `timeout_ms`): 1 when one is gone, with a
 * sentence naming it in `why`: its ping failed UNAVAILABLE and a TCP
 * connect to its resolved peer address was refused (the process is dead
 * or stopping; UNAVAILABLE alone is no proof, a channel in its reconnect
 * backoff fails calls at once), or it answered with another incarnation
 * than the communicator was made with (it restarted). A daemon that does
 * not answer in time (stopped, overloaded, unreachable) is not taken for
 * gone: the collective's deadline covers it. No name lookup. */
int amx_peer_call_alive(amx_peer_t *p, const amx_peer_watch_t *w, uint64_t timeout_ms, char *why,
                        size_t len);

/* Tells the participants of `m` but index `me` that communicator `gen` of
 * `job` (gen 0: the attempt of epoch `epoch` that took part in agreement
 * `agreement` of coordinator `coord_inc`, 0 and 0 before it agreed)
 * failed with `code` and `reason` (parallel, best effort, each within
 * `timeout_ms`). */
void amx_peer_call_abort(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                         uint64_t gen, uint64_t epoch, uint64_t agreement, uint64_t coord_inc,
                         amx_status_t code, const char *reason, uint64_t timeout_ms);

#endif
