/*
 * cluster.h - this daemon's identity in its cluster, the cluster's shared
 * secret and the authentication tokens made from it, and the peer
 * service's TLS material (docs/CLUSTER.md, "Security").
 *
 * amx_cluster_resolve and the secret are read once at start; after that an
 * amx_cluster_t is read-only and may be used from any thread.
 */
#ifndef AMX_CLUSTER_H
#define AMX_CLUSTER_H

#include <grpc/grpc_security.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "config.h"
#include "status.h"

/* At most this many coordinator candidates (the `coordinator` list). */
#define AMX_MAX_COORDS 8

/* Who this daemon is in the cluster (config.c + cluster sources). */
typedef struct amx_cluster_id {
    uint32_t rank, size;
    char coordinator[256]; /* host:port of rank 0's peer service */
    /* The coordinator candidates: the peer services of ranks 0..ncoord-1
     * (coords[0] is `coordinator`); the lowest live one coordinates. */
    uint32_t ncoord;
    char coords[AMX_MAX_COORDS][256];
    char listen[256];     /* host:port the peer service binds */
    char advertise[256];  /* host:port the others reach it on */
    char source[64];      /* where rank/size came from: config, slurm, torchrun, default */
    uint64_t incarnation; /* random at each start */
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

/* The addresses a peer address HOST:PORT ("[v6]:PORT" too) resolves to
 * (at most 4): resolved once, probed later without a name lookup. */
typedef struct amx_netaddrs {
    int n;
    struct sockaddr_storage a[4];
    socklen_t len[4];
} amx_netaddrs_t;

/* Resolves `hostport` (getaddrinfo: blocks for as long as the name
 * lookup takes). 0, or -1 when it is not HOST:PORT or does not resolve
 * (out->n = 0). */
int amx_cluster_addr_resolve(const char *hostport, amx_netaddrs_t *out);

/* Whether nothing listens there: 1 when a TCP connect to every address
 * was refused (ECONNREFUSED: the host is up and the port closed, as when
 * the daemon there died or stopped), 0 when one connected or took longer
 * than `timeout_ms` (at most one such wait: the first address that does
 * not refuse ends the probe), or there are none. No name lookup. */
int amx_cluster_addrs_refuse(const amx_netaddrs_t *a, uint64_t timeout_ms);

/* Both at once (tests, tools): resolve, then probe. */
int amx_cluster_addr_refuses(const char *hostport, uint64_t timeout_ms);

typedef struct amx_cluster amx_cluster_t;

/* The identity plus, in a cluster of several daemons, the secret and the
 * TLS files of the config (EINVAL/EIO with a sentence when they are not
 * usable). Start-up, loop thread. */
amx_status_t amx_cluster_create(const amx_config_t *cfg, const amx_cluster_id_t *id,
                                amx_cluster_t **out, amx_err_t *err);

/* Frees it, wiping the secret. */
void amx_cluster_free(amx_cluster_t *c);

/* This daemon's identity. Any thread. */
const amx_cluster_id_t *amx_cluster_id(const amx_cluster_t *c);

/* The token a call of `method` carries now. Any thread. */
void amx_cluster_token(const amx_cluster_t *c, const char *method, char *out, size_t len);

/* 0 when `token` (tlen bytes) is valid for `method` now, else -1 with a
 * reason for the log. Any thread. */
int amx_cluster_check(const amx_cluster_t *c, const char *method, const char *token, size_t tlen,
                      const char **why);

/* Credentials of the peer server (insecure, or mutual TLS). Loop thread. */
amx_status_t amx_cluster_server_credentials(const amx_cluster_t *c, grpc_server_credentials **out,
                                            amx_err_t *err);

/* Credentials of a channel to another daemon (the caller releases them).
 * Any thread. */
grpc_channel_credentials *amx_cluster_channel_credentials(const amx_cluster_t *c);

#endif
