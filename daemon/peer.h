/*
 * peer.h - the cluster: this daemon's identity, the peer service it serves
 * to other daemons (amaxd.peer.v1.Peer over TCP, authenticated), and the
 * calls it makes to them (docs/CLUSTER.md).
 *
 * Threads. amx_peer_create, _start, _join, _join_cancel, _notify_abort and
 * _drop run on the loop thread and never block (asynchronous gRPC on the
 * loop's completion queue). The amx_peer_call_* functions block the calling
 * thread: they are for engine threads only (never the loop thread), check
 * an abort flag every 50 ms and honour a deadline.
 */
#ifndef AMX_PEER_H
#define AMX_PEER_H

#include <grpc/grpc_security.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "catalog.h"
#include "comm.h"
#include "config.h"
#include "coord.h"
#include "registry.h"
#include "status.h"

typedef struct amx_rpc amx_rpc_t;

/* Who this daemon is in the cluster (config.c + cluster sources). */
typedef struct amx_cluster_id {
    uint32_t rank, size;
    char coordinator[256]; /* host:port of rank 0's peer service */
    char listen[256];      /* host:port the peer service binds */
    char advertise[256];   /* host:port the others reach it on */
    char source[64];       /* where rank/size came from: config, slurm, torchrun, default */
    uint64_t incarnation;  /* random at each start */
} amx_cluster_id_t;

/*
 * Resolves the cluster identity from the config (explicit settings win),
 * then Slurm (SLURM_NODEID, SLURM_NNODES, first host of SLURM_JOB_NODELIST),
 * then torchrun-style RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. `env` is
 * getenv (tests pass their own). EINVAL with a sentence when inconsistent.
 */
amx_status_t amx_cluster_resolve(const amx_config_t *cfg, const char *(*env)(const char *),
                                 amx_cluster_id_t *id, amx_err_t *err);

/* Expands the first host of a Slurm node list ("gpu[07-10,12],cpu3" ->
 * "gpu07"). EINVAL on a malformed list. */
amx_status_t amx_slurm_first_host(const char *list, char *out, size_t len, amx_err_t *err);

/* Loads the cluster secret: at least 16 bytes, the file not readable by
 * group or others. */
amx_status_t amx_cluster_load_secret(const char *path, uint8_t *buf, size_t cap, size_t *len,
                                     amx_err_t *err);

/* The auth token for `method` at unix time `now` ("<now>:<hex hmac>"), and
 * its check (0 = valid; else a reason for the log). */
void amx_auth_token(const uint8_t *secret, size_t slen, const char *method, long long now,
                    char *out, size_t len);
int amx_auth_check(const uint8_t *secret, size_t slen, const char *method, long long now,
                   const char *token, size_t tlen, const char **why);

typedef struct amx_peer amx_peer_t;

/* Creates the cluster object: for rank 0 with its coordinator. Loop. */
amx_status_t amx_peer_create(uv_loop_t *loop, const amx_config_t *cfg, const amx_cluster_id_t *id,
                             amx_peer_t **out, amx_err_t *err);

/* Attaches the registry and the RPC layer (the peer server and the loop's
 * client calls live on its completion queue). Loop. */
void amx_peer_attach(amx_peer_t *p, amx_registry_t *reg, amx_rpc_t *rpc);

/* Fails the coordinator's waiting requests (the daemon is stopping). Loop. */
void amx_peer_shutdown(amx_peer_t *p);

/* Frees it (after the registry and its engines are gone, before the RPC
 * layer shuts gRPC down). */
void amx_peer_destroy(amx_peer_t *p);

/* Credentials of the peer server (insecure, or mutual TLS). */
amx_status_t amx_peer_server_credentials(amx_peer_t *p, grpc_server_credentials **out,
                                         amx_err_t *err);

const amx_cluster_id_t *amx_peer_id(const amx_peer_t *p);
amx_coord_t *amx_peer_coord(amx_peer_t *p); /* NULL unless rank 0 */

/* Loop: expires the coordinator's waiting requests. */
void amx_peer_tick(amx_peer_t *p, uint64_t now_ms);

/* ---- loop thread, asynchronous ---- */

typedef void (*amx_peer_join_cb)(void *ud, amx_status_t st, const char *msg,
                                 const amx_membership_t *m);

/* Joins trainer rank `rank` of `job` at the coordinator. cb runs once on the
 * loop thread unless the join is cancelled; *h identifies it. */
amx_status_t amx_peer_join(amx_peer_t *p, const char *job, uint32_t world, uint32_t rank,
                           uint64_t deadline_ms, amx_peer_join_cb cb, void *ud, void **h,
                           amx_err_t *err);
void amx_peer_join_cancel(amx_peer_t *p, void *h);

/* Asks the coordinator to drop the job everywhere (best effort). */
void amx_peer_drop(amx_peer_t *p, const char *job);

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
    amx_membership_t members;
    int send_catalog; /* alone: call again with the whole catalog (coord.h) */
} amx_sync_result_t;

void amx_sync_result_free(amx_sync_result_t *r);

amx_status_t amx_peer_call_sync(amx_peer_t *p, const amx_coord_sync_req_t *req,
                                const volatile int *abort, amx_sync_result_t *res, amx_err_t *err);

/* A rendezvous store on the coordinator's key-value store. */
void amx_peer_kv(amx_peer_t *p, const volatile int *abort, amx_kv_t *kv);

amx_status_t amx_peer_call_fetch(amx_peer_t *p, const char *addr, const char *job, uint64_t seq,
                                 uint64_t deadline_ms, const volatile int *abort, void **blob,
                                 size_t *len, amx_err_t *err);

/* Progress of `job` on each daemon of `addrs`, in parallel, each within
 * `timeout_ms`: writes one line per daemon into buf ("" when all fine). */
void amx_peer_call_progress(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                            uint64_t epoch, uint64_t timeout_ms, char *buf, size_t len);

/* Abort notifications from an engine thread (parallel, best effort). */
void amx_peer_call_abort(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                         uint64_t gen, amx_status_t code, const char *reason, uint64_t timeout_ms);

#endif
