/*
 * config.h - the one configuration table of amaxd.
 *
 * Each entry has a name, a type, a default, bounds, flags and a description;
 * the table drives the config file (INI, keys in an [amaxd] section or at top
 * level), AMAXD_<NAME> environment variables, --name=value flags, --help and
 * the Status RPC. Precedence: default < file < environment < command line.
 */
#ifndef AMX_CONFIG_H
#define AMX_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "status.h"

enum { AMX_CFG_STR, AMX_CFG_INT, AMX_CFG_BOOL, AMX_CFG_ENUM, AMX_CFG_MODE };
enum { AMX_CFG_IMMUTABLE = 1, AMX_CFG_SECRET = 2 };

/* X(name, type, default, min, max, enum_values, flags, description) */
#define AMX_CONFIG_TABLE(X)                                                                        \
    X(socket, AMX_CFG_STR, "/run/amaxd/amaxd.sock", 0, 0, NULL, AMX_CFG_IMMUTABLE,                 \
      "Unix socket path trainers connect to (empty: no Unix socket)")                              \
    X(socket_mode, AMX_CFG_MODE, "0660", 0, 0777, NULL, AMX_CFG_IMMUTABLE,                         \
      "permission bits of the Unix socket (octal)")                                                \
    X(tcp, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                                         \
      "also listen on this TCP host:port (empty: none; loopback only unless allow_remote)")        \
    X(allow_remote, AMX_CFG_BOOL, "false", 0, 1, NULL, AMX_CFG_IMMUTABLE,                          \
      "allow a non-loopback tcp address (the API has no authentication)")                          \
    X(metrics_listen, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                              \
      "serve Prometheus metrics over HTTP on this host:port, e.g. 127.0.0.1:9464 (empty: off; "    \
      "loopback only unless metrics_allow_remote)")                                                \
    X(metrics_allow_remote, AMX_CFG_BOOL, "false", 0, 1, NULL, AMX_CFG_IMMUTABLE,                  \
      "allow a non-loopback metrics_listen address (metrics name jobs and have no "                \
      "authentication)")                                                                           \
    X(max_connections, AMX_CFG_INT, "1024", 16, 1048576, NULL, AMX_CFG_IMMUTABLE,                  \
      "most trainer connections on the Unix socket at once (with socket_guard); a new one past "   \
      "it evicts the oldest connection with no call open, or is refused if every one is in a "     \
      "call")                                                                                      \
    X(max_connections_per_uid, AMX_CFG_INT, "0", 0, 1048576, NULL, AMX_CFG_IMMUTABLE,              \
      "most connections one user (peer uid) holds on the Unix socket (with socket_guard); a new "  \
      "one past it evicts that user's oldest connection with no call open (0: half of the "        \
      "connection budget, max_connections or less under a low descriptor limit)")                  \
    X(socket_guard, AMX_CFG_BOOL, "true", 0, 1, NULL, AMX_CFG_IMMUTABLE,                           \
      "the daemon listens on the Unix socket itself and relays each connection to gRPC, capping "  \
      "header blocks and connections (docs/SECURITY.md); false: gRPC listens (faster large "       \
      "transfers, exposed to gRPC 1.51's header-flood and EMFILE bugs)")                           \
    X(shm_dir, AMX_CFG_STR, "/dev/shm", 0, 0, NULL, AMX_CFG_IMMUTABLE,                             \
      "tmpfs directory of the packed form's shared-memory buffers, made with socket_mode's bits "  \
      "(empty: off; docs/API.md)")                                                                 \
    X(backend, AMX_CFG_ENUM, "auto", 0, 0, "auto|host|cuda", AMX_CFG_IMMUTABLE,                    \
      "state backend: cuda keeps amax state in GPU memory; auto = cuda when a GPU is usable")      \
    X(log_level, AMX_CFG_ENUM, "info", 0, 0, "error|warn|info|debug", 0, "log verbosity")          \
    X(log_file, AMX_CFG_STR, "", 0, 0, NULL, 0,                                                    \
      "append logs to this file, re-opened on SIGHUP (empty: stderr)")                             \
    X(max_message_bytes, AMX_CFG_INT, "67108864", 4096, 1073741824, NULL, AMX_CFG_IMMUTABLE,       \
      "largest gRPC message accepted, bytes (larger ones get RESOURCE_EXHAUSTED)")                 \
    X(max_cells, AMX_CFG_INT, "268435456", 1, 4294967295LL, NULL, 0,                               \
      "largest catalog of one job, in float32 amax cells (history included)")                      \
    X(max_quantizers, AMX_CFG_INT, "4194304", 1, 1073741824, NULL, 0,                              \
      "most quantizers in one job")                                                                \
    X(max_jobs, AMX_CFG_INT, "64", 1, 65536, NULL, 0, "most jobs served at once")                  \
    X(max_world_size, AMX_CFG_INT, "65536", 1, 1048576, NULL, 0,                                   \
      "largest world size a job may declare")                                                      \
    X(max_request_memory, AMX_CFG_INT, "268435456", 1048576, 1099511627776LL, NULL, 0,             \
      "most memory one request may take once decoded, bytes (estimated before decoding; more "     \
      "gets RESOURCE_EXHAUSTED)")                                                                  \
    X(memory_budget, AMX_CFG_INT, "0", 0, 1125899906842624LL, NULL, 0,                             \
      "memory the state of all jobs may take together, bytes (0: half of the host's memory, or "   \
      "of the GPU's with the cuda backend)")                                                       \
    X(max_queued_bytes, AMX_CFG_INT, "1073741824", 1048576, 1099511627776LL, NULL, 0,              \
      "answer bytes waiting for slow clients, all calls together; an answer that would pass it "   \
      "gets RESOURCE_EXHAUSTED")                                                                   \
    X(job_idle_timeout_ms, AMX_CFG_INT, "86400000", 0, 31536000000LL, NULL, 0,                     \
      "a job none of whose ranks called for this long is dropped, with a log line (0: never)")     \
    X(state_dir, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                                   \
      "directory of job snapshots, restored at start (empty: none; /var/lib/amaxd under systemd)") \
    X(snapshot_interval_ms, AMX_CFG_INT, "0", 0, 86400000, NULL, 0,                                \
      "0: every reconciled epoch is written before its Reconcile returns; N: at most every N ms "  \
      "(epochs in between are written with a later one or at shutdown)")                           \
    X(join_timeout_ms, AMX_CFG_INT, "300000", 10, 86400000, NULL, 0,                               \
      "how long Join waits for the other ranks before DEADLINE_EXCEEDED")                          \
    X(reconcile_timeout_ms, AMX_CFG_INT, "600000", 10, 86400000, NULL, 0,                          \
      "how long Reconcile waits for the other ranks before DEADLINE_EXCEEDED")                     \
    X(shutdown_grace_ms, AMX_CFG_INT, "5000", 0, 600000, NULL, 0,                                  \
      "on SIGTERM, how long calls in flight may finish before they are cancelled")                 \
    X(cluster_size, AMX_CFG_INT, "1", 1, 65536, NULL, AMX_CFG_IMMUTABLE,                           \
      "daemons in the cluster (else from SLURM_NNODES or WORLD_SIZE; 1: a single daemon)")         \
    X(cluster_rank, AMX_CFG_INT, "0", 0, 65535, NULL, AMX_CFG_IMMUTABLE,                           \
      "this daemon's rank in the cluster; 0 coordinates (else SLURM_NODEID or RANK)")              \
    X(coordinator, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                                 \
      "host:port of rank 0's peer service, or a comma-separated list of the peer services of "     \
      "ranks 0, 1, ...: the coordinator candidates, the lowest live one coordinates (else the "    \
      "first host of SLURM_JOB_NODELIST, or MASTER_ADDR:MASTER_PORT)")                             \
    X(coordinator_failover_ms, AMX_CFG_INT, "3000", 500, 3600000, NULL, AMX_CFG_IMMUTABLE,         \
      "with several coordinator candidates: how long one may not answer before the next takes "    \
      "its role")                                                                                  \
    X(peer_port, AMX_CFG_INT, "7420", 1, 65535, NULL, AMX_CFG_IMMUTABLE,                           \
      "TCP port of the peer service when neither coordinator nor peer_listen names one")           \
    X(peer_listen, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                                 \
      "host:port the peer service binds (empty: all interfaces, the coordinator's port)")          \
    X(peer_advertise, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                              \
      "host:port other daemons reach this one on (empty: this host's name and the listen port)")   \
    X(cluster_secret_file, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                         \
      "file with the cluster's shared secret (>= 16 bytes, mode 0600); needed when "               \
      "cluster_size > 1")                                                                          \
    X(peer_tls_cert, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                               \
      "PEM certificate of this daemon: with peer_tls_key and peer_tls_ca, peers use mutual TLS")   \
    X(peer_tls_key, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE | AMX_CFG_SECRET,               \
      "PEM private key of peer_tls_cert")                                                          \
    X(peer_tls_ca, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                                 \
      "PEM CA certificate that signed every daemon's certificate")                                 \
    X(collective, AMX_CFG_ENUM, "auto", 0, 0, "auto|gloo|nccl", AMX_CFG_IMMUTABLE,                 \
      "how daemons reduce together: nccl (GPU buffers), gloo (CPU, TCP); auto = nccl with the "    \
      "cuda backend, else gloo")                                                                   \
    X(gloo_host, AMX_CFG_STR, "", 0, 0, NULL, AMX_CFG_IMMUTABLE,                                   \
      "address Gloo binds and advertises (empty: the host of peer_advertise)")                     \
    X(cuda_device, AMX_CFG_INT, "0", 0, 255, NULL, AMX_CFG_IMMUTABLE,                              \
      "CUDA device of the cuda backend (and of NCCL)")                                             \
    X(busy_poll, AMX_CFG_ENUM, "auto", 0, 0, "auto|on|off", AMX_CFG_IMMUTABLE,                     \
      "while an epoch is about to start or end, the engine and loop threads poll instead of "      \
      "sleeping (at most 2 ms a time; saves a scheduler wake-up, tens of microseconds, per hop; "  \
      "docs/OPERATING.md); auto = on with 8 or more CPUs online")

enum {
#define AMX__CFG_ENUM(name, type, def, min, max, values, flags, desc) AMX_CFG_##name,
    AMX_CONFIG_TABLE(AMX__CFG_ENUM)
#undef AMX__CFG_ENUM
        AMX_CFG_COUNT
};

typedef struct amx_config {
    char *text[AMX_CFG_COUNT]; /* current value of every entry, as text */
    /* Typed views, kept in step with text[] by amx_config_set. */
    unsigned char set[AMX_CFG_COUNT]; /* given by a file, the environment or a flag */
    const char *socket, *tcp, *backend, *log_level, *log_file, *metrics_listen, *shm_dir;
    int64_t socket_mode, max_message_bytes, max_cells, max_quantizers, max_jobs, max_world_size;
    int64_t max_request_memory, memory_budget, max_queued_bytes, job_idle_timeout_ms;
    int64_t max_connections, max_connections_per_uid;
    const char *state_dir;
    int64_t snapshot_interval_ms;
    int64_t join_timeout_ms, reconcile_timeout_ms, shutdown_grace_ms;
    int allow_remote, socket_guard, metrics_allow_remote;
    int64_t cluster_size, cluster_rank, peer_port, cuda_device, coordinator_failover_ms;
    const char *coordinator, *peer_listen, *peer_advertise, *cluster_secret_file;
    const char *peer_tls_cert, *peer_tls_key, *peer_tls_ca, *collective, *gloo_host;
    const char *busy_poll;
} amx_config_t;

/* Whether busy_poll is in effect (auto: 8 or more CPUs online). */
int amx_config_busy_poll(const amx_config_t *cfg);

/* Whether entry `name` was given explicitly (not its default). */
int amx_config_is_set(const amx_config_t *cfg, const char *name);

/* Fills `cfg` with the defaults. Free with amx_config_free. */
void amx_config_init(amx_config_t *cfg);
void amx_config_free(amx_config_t *cfg);

/* Sets one entry from text, checking type and bounds. `name` may use '-'
 * for '_'. EINVAL with a sentence naming the entry on failure (cfg is then
 * unchanged). */
amx_status_t amx_config_set(amx_config_t *cfg, const char *name, const char *value, amx_err_t *err);

/* Reads an INI file of `name = value` lines. */
amx_status_t amx_config_load_file(amx_config_t *cfg, const char *path, amx_err_t *err);

/* Applies AMAXD_<NAME> variables from the environment. */
amx_status_t amx_config_load_env(amx_config_t *cfg, amx_err_t *err);

enum { AMX_CFG_RUN = 0, AMX_CFG_HELP = 1, AMX_CFG_VERSION = 2 };

/* Applies defaults, --config/AMAXD_CONFIG file, environment and command line
 * in that order. Sets *action to RUN, HELP or VERSION. */
amx_status_t amx_config_from_args(amx_config_t *cfg, int argc, char **argv, int *action,
                                  amx_err_t *err);

/* Writes --help text generated from the table. */
void amx_config_usage(FILE *out, const char *prog);

/* Calls fn for each entry with its current text and whether it is the default. */
void amx_config_foreach(const amx_config_t *cfg,
                        void (*fn)(void *ud, const char *name, const char *value, int is_default),
                        void *ud);

#endif
