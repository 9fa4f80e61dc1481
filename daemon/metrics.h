/*
 * metrics.h - Prometheus metrics over HTTP (text format 0.0.4), served by
 * libmicrohttpd from a thread of its own.
 *
 * Threads. The holder of the loop lock (the loop thread or a completion-
 * queue thread, rpc.h), and only it, records: each call below takes the
 * metrics' mutex for a few counter updates and returns. The HTTP thread
 * takes the same mutex only to render the page from those counters; it
 * never calls into the loop, the registry or gRPC, and the loop never
 * waits for a scrape beyond that short render. Off unless metrics_listen
 * is set; every recording function takes NULL and does nothing.
 */
#ifndef AMX_METRICS_H
#define AMX_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "status.h"

typedef struct amx_metrics amx_metrics_t;

/* Upper bounds of the reconcile latency histogram, seconds (+Inf added). */
#define AMX_METRICS_BUCKETS                                                                        \
    {                                                                                              \
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,    \
            300                                                                                    \
    }
#define AMX_METRICS_NBUCKETS 17

/* Creates the counters of a daemon whose state backend and collective are
 * the given names (copied). No HTTP server yet (see amx_metrics_listen):
 * unit tests render without one. NULL when out of memory. */
amx_metrics_t *amx_metrics_create(const char *backend, const char *collective);

/* Starts the HTTP server on cfg->metrics_listen ("host:port"; port 0 picks
 * a free one, logged). EINVAL for an address that does not parse or is not
 * loopback without cfg->metrics_allow_remote; EIO when it cannot bind. */
amx_status_t amx_metrics_listen(amx_metrics_t *m, const amx_config_t *cfg, amx_err_t *err);

/* create + listen: the daemon's start-up. *out is NULL on failure. */
amx_status_t amx_metrics_start(const amx_config_t *cfg, const char *backend, const char *collective,
                               amx_metrics_t **out, amx_err_t *err);

/* The TCP port the server listens on (0: none). Any thread. */
uint16_t amx_metrics_port(const amx_metrics_t *m);

/* Stops the HTTP thread (a scrape in progress ends first) and frees
 * everything. NULL is allowed. Main thread, after the loop stopped. */
void amx_metrics_free(amx_metrics_t *m);

/* ---- recording: loop thread ---- */

/* `job` merged `updates` quantizer updates of `bytes` request bytes
 * (values and has_data masks). */
void amx_metrics_job_updates(amx_metrics_t *m, const char *job, uint64_t updates, uint64_t bytes);

/*
 * An epoch of `job` ended: `ok` reconciled (else failed) after `seconds`
 * in the engine. For a reconciled epoch `epoch` is its number and, when
 * `have_cells`, `missing` cells had no data anywhere after peer fill and
 * `filled` cells took their peer group's max (the backend counts them).
 */
void amx_metrics_job_epoch(amx_metrics_t *m, const char *job, int ok, uint64_t epoch,
                           double seconds, int have_cells, uint64_t missing, uint64_t filled);

/* The job's catalog: quantizers and amax cells (after each epoch). */
void amx_metrics_job_catalog(amx_metrics_t *m, const char *job, uint64_t quantizers,
                             uint64_t cells);

/* The job is gone (Reset drop, idle timeout, peer drop): its series go. */
void amx_metrics_job_drop(amx_metrics_t *m, const char *job);

/* A call of `method` (a short name such as "SendAmax", or "unknown") was
 * answered with gRPC status `code`. */
void amx_metrics_call(amx_metrics_t *m, const char *method, int code);

/* Daemon gauges, sampled by the loop (tick): calls in progress, calls
 * waiting for other ranks, Unix-socket connections. */
void amx_metrics_set_daemon(amx_metrics_t *m, uint32_t calls, uint32_t waiting,
                            uint32_t connections);

/* Unix-socket connections the socket guard has refused and evicted since
 * the start (counters, sampled by the loop's tick). */
void amx_metrics_set_connection_counts(amx_metrics_t *m, uint64_t refused, uint64_t evicted);

/* ---- for the HTTP thread and tests ---- */

/* Renders the exposition text into a malloc'd string (*out, *len). ENOMEM
 * on failure. Any thread. */
amx_status_t amx_metrics_render(amx_metrics_t *m, char **out, size_t *len);

/* Writes `in` as the body of a Prometheus label value (backslash, double
 * quote and newline escaped) into `out` (cap bytes, always terminated;
 * truncated on a character boundary of the escaping). Returns the length
 * written. */
size_t amx_metrics_escape_label(const char *in, char *out, size_t cap);

#endif
