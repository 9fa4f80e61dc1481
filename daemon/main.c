/*
 * main.c - amaxd start-up, signals and shutdown.
 *
 * The daemon context lives on main's stack and is passed by pointer; the
 * libuv loop thread owns it. SIGTERM/SIGINT stop gracefully and exit 0,
 * SIGHUP re-opens the log file.
 */
#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <sys/resource.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "cluster.h"
#include "config.h"
#include "coord.h"
#include "doorbell.h"
#include "log.h"
#include "metrics.h"
#include "notify.h"
#include "peer.h"
#include "registry.h"
#include "rpc.h"
#include "service.h"
#include "comm.h"
#include "state.h"
#include "version.h"

typedef struct amx_daemon {
    uv_loop_t loop;
    amx_config_t cfg;
    amx_cluster_id_t id;
    amx_cluster_t *cluster;
    amx_coord_t *coord; /* coordinator candidates only (rank 0 and the list's) */
    amx_peer_t *peer;
    amx_registry_t *reg;
    amx_svc_t *svc;
    amx_rpc_t *rpc;
    amx_door_t *door; /* the device doorbell; NULL: none */
    amx_notify_t *notify;
    amx_metrics_t *metrics;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t tick;
    int stopping;
    uint64_t activity; /* amx_rpc_activity at the last idle check */
    uint64_t idle_ticks;
    int trimmed; /* memory given back since the last activity */
} amx_daemon_t;

/*
 * Memory: request payloads (up to max_message_bytes), staging and answers
 * come and go with every message. glibc would give such blocks back to the
 * kernel at once (a mapping of its own for each block over its mmap
 * threshold, heap tops trimmed past 2x that) and fault fresh zeroed pages
 * in for the next message: ~12% of the daemon's time while streaming 8 MiB
 * messages (bench/NOTES.md). Blocks up to 32 MiB (glibc's ceiling) come
 * from the heap instead, and a heap keeps up to AMX_TRIM_BYTES of free
 * memory at its top (process-wide settings). After AMX_IDLE_TRIM_TICKS
 * ticks without a call or a stream message, the buffers kept from message
 * to message are freed (amx_rpc_trim, above AMX_KEEP_BYTES) and
 * malloc_trim gives back every free page except those at the top of a
 * thread's arena, which glibc trims only when a block is freed into a top
 * past the threshold: at most AMX_TRIM_BYTES each.
 */
#define AMX_MMAP_BYTES (32 << 20)
#define AMX_TRIM_BYTES (8 << 20)
#define AMX_KEEP_BYTES (1 << 20)
#define AMX_IDLE_TRIM_TICKS 40 /* x 50 ms */

static void tune_malloc(void)
{
    /* Refused by an allocator that is not glibc's (a sanitizer's). */
    if (!mallopt(M_MMAP_THRESHOLD, AMX_MMAP_BYTES) || !mallopt(M_TRIM_THRESHOLD, AMX_TRIM_BYTES))
        AMX_INFO("main", "the allocator took no mallopt settings (not glibc's malloc?); "
                         "large messages may cost page faults");
}

static void trim_when_idle(amx_daemon_t *d)
{
    uint64_t a = amx_rpc_activity(d->rpc);
    if (a != d->activity) {
        d->activity = a;
        d->idle_ticks = 0;
        d->trimmed = 0;
        return;
    }
    if (!d->trimmed && ++d->idle_ticks >= AMX_IDLE_TRIM_TICKS) {
        amx_rpc_trim(d->rpc, AMX_KEEP_BYTES);
        malloc_trim(0);
        d->trimmed = 1;
    }
}

static void on_tick(uv_timer_t *t)
{
    amx_daemon_t *d = t->data;
    uint64_t now = amx__now_ms();
    amx_registry_expire(d->reg, now);
    amx_peer_tick(d->peer); /* the coordinator's role, when it moved */
    if (amx_coord_active(d->coord))
        amx_coord_expire(d->coord, now);
    trim_when_idle(d);
    if (d->metrics != NULL) {
        uint64_t refused, evicted;
        amx_rpc_connection_counts(d->rpc, &refused, &evicted);
        amx_metrics_set_daemon(d->metrics, amx_rpc_calls(d->rpc), amx_registry_waiting(d->reg),
                               amx_rpc_connections(d->rpc));
        amx_metrics_set_connection_counts(d->metrics, refused, evicted);
    }
}

/* The STATUS= line systemd shows (`systemctl status amaxd`). */
static void sample_status(void *ud, amx_notify_status_t *s)
{
    amx_daemon_t *d = ud;
    amx_arena_t a = {0};
    amx_job_info_t *jobs;
    size_t njobs = 0;
    amx_err_t err = {0};
    if (amx_registry_status(d->reg, "", &jobs, &njobs, &a, &err) == AMX_OK)
        s->jobs = (uint32_t)njobs;
    amx_arena_free(&a);
    s->calls = amx_rpc_calls(d->rpc);
    s->waiting = amx_registry_waiting(d->reg);
}

static void on_rpc_stopped(void *ud)
{
    amx_daemon_t *d = ud;
    uv_close((uv_handle_t *)&d->tick, NULL);
    uv_close((uv_handle_t *)&d->sig_term, NULL);
    uv_close((uv_handle_t *)&d->sig_int, NULL);
    uv_close((uv_handle_t *)&d->sig_hup, NULL);
    amx_notify_close(d->notify);
    d->notify = NULL;
}

static void on_stop_signal(uv_signal_t *s, int signum)
{
    amx_daemon_t *d = s->data;
    if (d->stopping) {
        AMX_WARN("main", "signal %d again while stopping; still waiting for calls to end", signum);
        return;
    }
    d->stopping = 1;
    AMX_INFO("main", "signal %d: shutting down", signum);
    char why[96];
    snprintf(why, sizeof(why), "signal %d, %u call%s in progress", signum, amx_rpc_calls(d->rpc),
             amx_rpc_calls(d->rpc) == 1 ? "" : "s");
    amx_notify_stopping(d->notify, why);
    amx_registry_shutdown(d->reg, "amaxd is shutting down; the job's state is lost unless it was "
                                  "snapshotted: re-join after the daemon restarts");
    amx_rpc_stop(d->rpc, (uint64_t)d->cfg.shutdown_grace_ms, on_rpc_stopped, d);
}

static void on_hup(uv_signal_t *s, int signum)
{
    amx_daemon_t *d = s->data;
    (void)signum;
    int rc = amx_log_open(d->cfg.log_file);
    if (rc != 0)
        AMX_ERROR("main", "SIGHUP: cannot re-open log file %s: %s", d->cfg.log_file, strerror(-rc));
    else
        AMX_INFO("main", "SIGHUP: log re-opened");
}

/* The cluster's objects, in the order they depend on each other. */
static void free_cluster(amx_daemon_t *d)
{
    amx_peer_destroy(d->peer);
    amx_coord_destroy(d->coord);
    amx_cluster_free(d->cluster);
    d->peer = NULL;
    d->coord = NULL;
    d->cluster = NULL;
}

static void expect_loop(void *ud, uint64_t us)
{
    amx_rpc_expect(ud, us);
}

/* The services and the transport that serves them. */
static amx_status_t start_services(amx_daemon_t *d, double start, amx_err_t *err)
{
    AMX_CHECK(
        amx_service_create(&d->cfg, d->reg, d->cluster, d->coord, d->peer, start, &d->svc, err));
    amx_rpc_serve_t serve;
    amx_service_serve(d->svc, &serve);
    if (serve.peer_methods != NULL)
        AMX_CHECK(amx_cluster_server_credentials(d->cluster, &serve.peer_creds, err));
    return amx_rpc_start(&d->loop, &d->cfg, &serve, &d->rpc, err);
}

/* The device doorbell next to the Unix socket (doorbell.h). Without it
 * trainers reconcile device buffers over gRPC: a failure is a warning. */
static void start_doorbell(amx_daemon_t *d)
{
    if (d->cfg.socket[0] == '\0')
        return;
    char path[4096];
    snprintf(path, sizeof(path), "%s.door", d->cfg.socket);
    amx_err_t err = {0};
    if (amx_door_start(path, (unsigned)d->cfg.socket_mode, d->reg, d->rpc, &d->door, &err) !=
        AMX_OK)
        AMX_WARN("main", "%s; device buffers are reconciled over gRPC", err.msg);
    snprintf(d->svc->doorbell, sizeof(d->svc->doorbell), "%s", amx_door_path(d->door));
}

/* Start-up failed after the loop was made: closes what is open on it. */
static int fail_start(amx_daemon_t *d, const char *msg)
{
    amx_notify_failed(d->notify, EINVAL, msg);
    amx_notify_close(d->notify);
    uv_close((uv_handle_t *)&d->sig_term, NULL);
    uv_close((uv_handle_t *)&d->sig_int, NULL);
    uv_close((uv_handle_t *)&d->sig_hup, NULL);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    uv_loop_close(&d->loop);
    amx_log_close();
    amx_config_free(&d->cfg);
    return 1;
}

static void log_setting(void *ud, const char *name, const char *value, int is_default)
{
    (void)ud;
    if (!is_default)
        AMX_INFO("config", "%s = %s", name, value);
}

/* Every connection costs descriptors (three through the socket guard); the
 * soft limit (1024 under systemd) is only a default: take the hard one. */
static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == rl.rlim_max)
        return;
    rlim_t was = rl.rlim_cur;
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
        AMX_WARN("main", "cannot raise RLIMIT_NOFILE to %llu: %s", (unsigned long long)rl.rlim_max,
                 strerror(errno));
    else
        AMX_INFO("main", "RLIMIT_NOFILE raised from %llu to %llu", (unsigned long long)was,
                 (unsigned long long)rl.rlim_max);
}

int main(int argc, char **argv)
{
    amx_daemon_t d;
    amx_err_t err = {0};
    int action;
    memset(&d, 0, sizeof(d));
    amx_config_init(&d.cfg);
    if (amx_config_from_args(&d.cfg, argc, argv, &action, &err) != AMX_OK) {
        fprintf(stderr, "amaxd: %s\n", err.msg);
        amx_config_free(&d.cfg);
        return 2;
    }
    if (action == AMX_CFG_HELP) {
        amx_config_usage(stdout, argv[0]);
        amx_config_free(&d.cfg);
        return 0;
    }
    if (action == AMX_CFG_VERSION) {
        printf("amaxd %s (cuda backend %s; collectives: local%s%s)\n", AMAXD_VERSION,
               AMAXD_HAVE_CUDA ? "compiled in" : "not compiled in",
               amx_comm_available("gloo") ? ", gloo" : "",
               amx_comm_available("nccl") ? ", nccl" : "");
        amx_config_free(&d.cfg);
        return 0;
    }
    amx_log_level = amx_log_parse_level(d.cfg.log_level);
    if (amx_log_open(d.cfg.log_file) != 0) {
        fprintf(stderr, "amaxd: cannot open log file %s\n", d.cfg.log_file);
        amx_config_free(&d.cfg);
        return 1;
    }
    signal(SIGPIPE, SIG_IGN);
    AMX_INFO("main", "amaxd %s starting (pid %d)", AMAXD_VERSION, (int)getpid());
    tune_malloc();
    raise_nofile();
    const char *comm_init = amx_comm_process_init();
    if (comm_init != NULL)
        AMX_INFO("main", "%s", comm_init);
    amx_config_foreach(&d.cfg, log_setting, NULL);

    if (amx_cluster_resolve(&d.cfg, (const char *(*)(const char *))getenv, &d.id, &err) != AMX_OK) {
        AMX_ERROR("main", "%s", err.msg);
        amx_notify_failed(NULL, EINVAL, err.msg);
        amx_log_close();
        amx_config_free(&d.cfg);
        return 1;
    }
    const char *backend = d.cfg.backend;
    if (strcmp(backend, "auto") == 0)
        backend = amx_state_cuda_available() ? "cuda" : "host";
    uv_loop_init(&d.loop);
    /* Signals are caught before anything exists that a signal's default
     * action would leave behind (the socket): one that arrives while the
     * daemon starts is handled once the loop runs, as a graceful stop. */
    uv_signal_init(&d.loop, &d.sig_term);
    uv_signal_init(&d.loop, &d.sig_int);
    uv_signal_init(&d.loop, &d.sig_hup);
    d.sig_term.data = d.sig_int.data = d.sig_hup.data = &d;
    uv_signal_start(&d.sig_term, on_stop_signal, SIGTERM);
    uv_signal_start(&d.sig_int, on_stop_signal, SIGINT);
    uv_signal_start(&d.sig_hup, on_hup, SIGHUP);
    d.notify = amx_notify_create(&d.loop, sample_status, &d);
    if (amx_cluster_create(&d.cfg, &d.id, &d.cluster, &err) != AMX_OK) {
        AMX_ERROR("main", "%s", err.msg);
        return fail_start(&d, err.msg);
    }
    /* Rank 0 and the other coordinator candidates (docs/CLUSTER.md). */
    if ((d.id.rank == 0 || d.id.rank < d.id.ncoord) &&
        (d.coord = amx_coord_create(d.id.incarnation, (uint64_t)d.cfg.join_timeout_ms)) == NULL) {
        amx_cluster_free(d.cluster);
        return fail_start(&d, "out of memory");
    }
    if (amx_peer_create(&d.loop, &d.cfg, d.cluster, d.coord, &d.peer, &err) != AMX_OK) {
        AMX_ERROR("main", "%s", err.msg);
        free_cluster(&d);
        return fail_start(&d, err.msg);
    }
    if (amx_registry_create(&d.loop, &d.cfg, backend, d.peer, &d.reg, &err) != AMX_OK) {
        AMX_ERROR("main", "state backend %s: %s", backend, err.msg);
        free_cluster(&d);
        return fail_start(&d, err.msg);
    }
    if (amx_registry_restore(d.reg, &err) != AMX_OK) {
        AMX_ERROR("main", "%s", err.msg);
        amx_registry_destroy(d.reg);
        free_cluster(&d);
        return fail_start(&d, err.msg);
    }
    if (d.id.size > 1)
        AMX_INFO("main",
                 "cluster: rank %u of %u (from %s), coordinator %s, this daemon %s, "
                 "peer service on %s",
                 d.id.rank, d.id.size, d.id.source, d.id.coordinator, d.id.advertise, d.id.listen);
    AMX_INFO("main", "state backend: %s, collective: %s", backend, amx_registry_collective(d.reg));

    double start = (double)amx__now_ms() / 1000.0;
    if (d.cfg.metrics_listen[0] != '\0') {
        if (amx_metrics_start(&d.cfg, backend, amx_registry_collective(d.reg), &d.metrics, &err) !=
            AMX_OK) {
            AMX_ERROR("main", "%s", err.msg);
            amx_registry_destroy(d.reg);
            free_cluster(&d);
            return fail_start(&d, err.msg);
        }
        amx_registry_set_metrics(d.reg, d.metrics);
    }
    if (start_services(&d, start, &err) != AMX_OK) {
        AMX_ERROR("main", "%s", err.msg);
        amx_registry_destroy(d.reg);
        amx_service_free(d.svc);
        free_cluster(&d);
        amx_metrics_free(d.metrics);
        return fail_start(&d, err.msg);
    }
    amx_peer_set_rpc(d.peer, d.rpc);
    amx_registry_on_expect(d.reg, expect_loop, d.rpc);
    if (amx_config_busy_poll(&d.cfg))
        AMX_INFO("main", "busy polling around epochs (busy_poll=%s, %ld CPUs online)",
                 d.cfg.busy_poll, sysconf(_SC_NPROCESSORS_ONLN));
    amx_rpc_set_metrics(d.rpc, d.metrics);
    start_doorbell(&d);
    uv_timer_init(&d.loop, &d.tick);
    d.tick.data = &d;
    uv_timer_start(&d.tick, on_tick, 50, 50);
    AMX_INFO("main", "ready");
    char listening[600];
    snprintf(listening, sizeof(listening), "%s%s%s", d.cfg.socket,
             d.cfg.tcp[0] && d.cfg.socket[0] ? " and " : "", d.cfg.tcp);
    amx_notify_ready(d.notify, listening);

    amx_rpc_run(d.rpc); /* uv_run that lets the completion-queue threads in */

    amx_door_free(d.door, d.rpc); /* its waiting requests, before the registry goes */

    amx_registry_destroy(d.reg); /* joins the engine threads */
    uv_run(&d.loop, UV_RUN_DEFAULT);
    amx_service_free(d.svc); /* after the registry's last drop hook */
    free_cluster(&d);
    amx_rpc_free(d.rpc);         /* shuts gRPC down */
    amx_metrics_free(d.metrics); /* after the last writer (the loop) is done */
    if (uv_loop_close(&d.loop) != 0)
        AMX_WARN("main", "event loop closed with handles still open");
    AMX_INFO("main", "stopped");
    amx_log_close();
    amx_config_free(&d.cfg);
    return 0;
}
