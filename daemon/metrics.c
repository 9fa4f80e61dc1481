/*
 * metrics.c - the counters, their Prometheus text rendering and the
 * libmicrohttpd server that serves them.
 */
#include "metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "strmap.h"
#include "version.h"

#define NCODES 17 /* gRPC status codes 0..16 */
#define MAX_METHODS 48

typedef struct job_m {
    char *name;
    uint64_t epochs, failed, last_epoch, updates, bytes;
    uint64_t quantizers, cells;
    int have_cells;
    uint64_t missing, filled, filled_total;
    uint64_t buckets[AMX_METRICS_NBUCKETS + 1]; /* per bucket, not cumulative; last: +Inf */
    double sum;
} job_m_t;

typedef struct method_m {
    char name[48];
    uint64_t by_code[NCODES];
} method_m_t;

struct amx_metrics {
    pthread_mutex_t mu;
    char backend[16], collective[16];
    double start_time; /* seconds since the Unix epoch */
    job_m_t *jobs;
    size_t njobs, cap;
    amx_strmap_t index; /* job name -> index in jobs */
    method_m_t methods[MAX_METHODS];
    size_t nmethods;
    uint32_t calls, waiting, connections;
    uint64_t refused, evicted;
    uint64_t scrapes;
    struct MHD_Daemon *http;
    uint16_t port;
};

static const double bucket_le[AMX_METRICS_NBUCKETS] = AMX_METRICS_BUCKETS;

static const char *const code_name[NCODES] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};

amx_metrics_t *amx_metrics_create(const char *backend, const char *collective)
{
    amx_metrics_t *m = calloc(1, sizeof(*m));
    if (m == NULL)
        return NULL;
    pthread_mutex_init(&m->mu, NULL);
    snprintf(m->backend, sizeof(m->backend), "%s", backend);
    snprintf(m->collective, sizeof(m->collective), "%s", collective);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    m->start_time = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    return m;
}

/* ---- recording (loop thread, under mu) ---- */

/* The entry of `job`, created when missing; NULL when out of memory (the
 * sample is then lost, which a metric may afford). */
static job_m_t *job_get(amx_metrics_t *m, const char *job)
{
    uint32_t i;
    if (amx_strmap_get(&m->index, job, &i))
        return &m->jobs[i];
    if (m->njobs == m->cap) {
        size_t cap = m->cap ? 2 * m->cap : 8;
        job_m_t *nj = realloc(m->jobs, cap * sizeof(*nj));
        if (nj == NULL)
            return NULL;
        m->jobs = nj;
        m->cap = cap;
        /* Keys point into the entries' own name strings: still valid. */
    }
    job_m_t *j = &m->jobs[m->njobs];
    memset(j, 0, sizeof(*j));
    j->name = strdup(job);
    if (j->name == NULL)
        return NULL;
    if (amx_strmap_put(&m->index, j->name, (uint32_t)m->njobs) != 0) {
        free(j->name);
        return NULL;
    }
    m->njobs++;
    return j;
}

void amx_metrics_job_updates(amx_metrics_t *m, const char *job, uint64_t updates, uint64_t bytes)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->mu);
    job_m_t *j = job_get(m, job);
    if (j != NULL) {
        j->updates += updates;
        j->bytes += bytes;
    }
    pthread_mutex_unlock(&m->mu);
}

void amx_metrics_job_epoch(amx_metrics_t *m, const char *job, int ok, uint64_t epoch,
                           double seconds, int have_cells, uint64_t missing, uint64_t filled)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->mu);
    job_m_t *j = job_get(m, job);
    if (j != NULL && !ok) {
        j->failed++;
    } else if (j != NULL) {
        j->epochs++;
        j->last_epoch = epoch;
        size_t b = 0;
        while (b < AMX_METRICS_NBUCKETS && seconds > bucket_le[b])
            b++;
        j->buckets[b]++;
        j->sum += seconds;
        j->have_cells = have_cells;
        if (have_cells) {
            j->missing = missing;
            j->filled = filled;
            j->filled_total += filled;
        }
    }
    pthread_mutex_unlock(&m->mu);
}

void amx_metrics_job_catalog(amx_metrics_t *m, const char *job, uint64_t quantizers, uint64_t cells)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->mu);
    job_m_t *j = job_get(m, job);
    if (j != NULL) {
        j->quantizers = quantizers;
        j->cells = cells;
    }
    pthread_mutex_unlock(&m->mu);
}

void amx_metrics_job_drop(amx_metrics_t *m, const char *job)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->mu);
    uint32_t i;
    if (amx_strmap_get(&m->index, job, &i)) {
        free(m->jobs[i].name);
        m->jobs[i] = m->jobs[--m->njobs];
        /* strmap has no delete: rebuild it (drops are rare). */
        amx_strmap_free(&m->index);
        memset(&m->index, 0, sizeof(m->index));
        for (size_t k = 0; k < m->njobs; k++)
            if (amx_strmap_put(&m->index, m->jobs[k].name, (uint32_t)k) != 0) {
                /* Out of memory: forget the rest rather than keep stale indices. */
                for (size_t r = k; r < m->njobs; r++)
                    free(m->jobs[r].name);
                m->njobs = k;
                break;
            }
    }
    pthread_mutex_unlock(&m->mu);
}

void amx_metrics_call(amx_metrics_t *m, const char *method, int code)
{
    if (m == NULL)
        return;
    if (code < 0 || code >= NCODES)
        code = 2; /* UNKNOWN */
    pthread_mutex_lock(&m->mu);
    method_m_t *x = NULL;
    for (size_t i = 0; i < m->nmethods; i++)
        if (strcmp(m->methods[i].name, method) == 0) {
            x = &m->methods[i];
            break;
        }
    if (x == NULL && m->nmethods < MAX_METHODS) {
        x = &m->methods[m->nmethods++];
        snprintf(x->name, sizeof(x->name), "%s", method);
    }
    if (x != NULL)
        x->by_code[code]++;
    pthread_mutex_unlock(&m->mu);
}

void amx_metrics_set_daemon(amx_metrics_t *m, uint32_t calls, uint32_t waiting,
                            uint32_t connections)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->mu);
    m->calls = calls;
    m->waiting = waiting;
    m->connections = connections;
    pthread_mutex_unlock(&m->mu);
}

void amx_metrics_set_connection_counts(amx_metrics_t *m, uint64_t refused, uint64_t evicted)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&m->mu);
    m->refused = refused;
    m->evicted = evicted;
    pthread_mutex_unlock(&m->mu);
}

/* ---- rendering ---- */

typedef struct buf {
    char *p;
    size_t len, cap;
    int oom;
} buf_t;

static void put(buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(buf_t *b, const char *fmt, ...)
{
    if (b->oom)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n + 1;
        char *np = realloc(b->p, cap);
        if (np == NULL) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
}

size_t amx_metrics_escape_label(const char *in, char *out, size_t cap)
{
    size_t k = 0;
    if (cap == 0)
        return 0;
    for (const char *s = in; *s; s++) {
        const char *rep = NULL;
        char one[2] = {*s, '\0'};
        if (*s == '\\')
            rep = "\\\\";
        else if (*s == '"')
            rep = "\\\"";
        else if (*s == '\n')
            rep = "\\n";
        else
            rep = one;
        size_t n = strlen(rep);
        if (k + n >= cap)
            break;
        memcpy(out + k, rep, n);
        k += n;
    }
    out[k] = '\0';
    return k;
}

static void head(buf_t *b, const char *name, const char *type, const char *help)
{
    put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* Resident memory of this process from /proc/self/statm, bytes (0: unknown). */
static uint64_t rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (f == NULL)
        return 0;
    unsigned long long size = 0, res = 0;
    int n = fscanf(f, "%llu %llu", &size, &res);
    fclose(f);
    long page = sysconf(_SC_PAGESIZE);
    return n == 2 && page > 0 ? res * (uint64_t)page : 0;
}

/* One per-job family: `field` read from each job through `get`. */
typedef uint64_t (*job_get_fn)(const job_m_t *j);
static void per_job(buf_t *b, amx_metrics_t *m, const char *name, const char *type,
                    const char *help, job_get_fn get, int only_with_cells)
{
    head(b, name, type, help);
    for (size_t i = 0; i < m->njobs; i++) {
        const job_m_t *j = &m->jobs[i];
        if (only_with_cells && !j->have_cells)
            continue;
        char lbl[2 * 256 + 1];
        amx_metrics_escape_label(j->name, lbl, sizeof(lbl));
        put(b, "%s{job=\"%s\"} %llu\n", name, lbl, (unsigned long long)get(j));
    }
}

#define GETTER(f)                                                                                  \
    static uint64_t get_##f(const job_m_t *j)                                                      \
    {                                                                                              \
        return j->f;                                                                               \
    }
GETTER(epochs)
GETTER(failed)
GETTER(last_epoch)
GETTER(updates)
GETTER(bytes)
GETTER(quantizers)
GETTER(cells)
GETTER(missing)
GETTER(filled)
GETTER(filled_total)
#undef GETTER

amx_status_t amx_metrics_render(amx_metrics_t *m, char **out, size_t *len)
{
    buf_t b = {malloc(16384), 0, 16384, 0};
    if (b.p == NULL)
        return AMX_ENOMEM;
    uint64_t rss = rss_bytes(); /* outside the lock: a file read */
    pthread_mutex_lock(&m->mu);
    m->scrapes++;
    head(&b, "amaxd_build_info", "gauge",
         "Always 1; the labels say the version, the state backend and the collective.");
    put(&b, "amaxd_build_info{version=\"%s\",backend=\"%s\",collective=\"%s\"} 1\n", AMAXD_VERSION,
        m->backend, m->collective);
    head(&b, "amaxd_start_time_seconds", "gauge", "When the daemon started, seconds since 1970.");
    put(&b, "amaxd_start_time_seconds %.3f\n", m->start_time);
    head(&b, "amaxd_resident_memory_bytes", "gauge", "Resident memory of the daemon process.");
    put(&b, "amaxd_resident_memory_bytes %llu\n", (unsigned long long)rss);
    head(&b, "amaxd_connections", "gauge",
         "Trainer connections on the Unix socket (relayed by the socket guard).");
    put(&b, "amaxd_connections %u\n", m->connections);
    head(&b, "amaxd_connections_refused_total", "counter",
         "Unix-socket connections closed at once: a cap reached with every connection in a call, "
         "or no descriptor left.");
    put(&b, "amaxd_connections_refused_total %llu\n", (unsigned long long)m->refused);
    head(&b, "amaxd_connections_evicted_total", "counter",
         "Idle Unix-socket connections closed to admit a new one (a connection cap reached).");
    put(&b, "amaxd_connections_evicted_total %llu\n", (unsigned long long)m->evicted);
    head(&b, "amaxd_calls_in_progress", "gauge", "gRPC calls started and not yet ended.");
    put(&b, "amaxd_calls_in_progress %u\n", m->calls);
    head(&b, "amaxd_calls_waiting", "gauge",
         "Join and Reconcile calls waiting for the other ranks of their job.");
    put(&b, "amaxd_calls_waiting %u\n", m->waiting);
    head(&b, "amaxd_jobs", "gauge", "Jobs this daemon serves.");
    put(&b, "amaxd_jobs %zu\n", m->njobs);
    head(&b, "amaxd_scrapes_total", "counter", "Scrapes of this endpoint, this one included.");
    put(&b, "amaxd_scrapes_total %llu\n", (unsigned long long)m->scrapes);

    head(&b, "amaxd_requests_total", "counter", "gRPC calls answered, by method and status code.");
    for (size_t i = 0; i < m->nmethods; i++)
        for (int c = 0; c < NCODES; c++)
            if (m->methods[i].by_code[c])
                put(&b, "amaxd_requests_total{method=\"%s\",code=\"%s\"} %llu\n",
                    m->methods[i].name, code_name[c], (unsigned long long)m->methods[i].by_code[c]);
    head(&b, "amaxd_requests_refused_total", "counter",
         "gRPC calls answered with an error status, by method and status code.");
    for (size_t i = 0; i < m->nmethods; i++)
        for (int c = 1; c < NCODES; c++)
            if (m->methods[i].by_code[c])
                put(&b, "amaxd_requests_refused_total{method=\"%s\",code=\"%s\"} %llu\n",
                    m->methods[i].name, code_name[c], (unsigned long long)m->methods[i].by_code[c]);

    per_job(&b, m, "amaxd_job_epochs_total", "counter", "Epochs reconciled.", get_epochs, 0);
    per_job(&b, m, "amaxd_job_epochs_failed_total", "counter",
            "Epochs that failed (timeout, dead peer, conflict, device fault).", get_failed, 0);
    per_job(&b, m, "amaxd_job_last_epoch", "gauge", "Number of the last reconciled epoch.",
            get_last_epoch, 0);
    per_job(&b, m, "amaxd_job_updates_total", "counter",
            "Quantizer amax updates merged (SendAmax and StreamAmax).", get_updates, 0);
    per_job(&b, m, "amaxd_job_received_bytes_total", "counter",
            "Bytes of amax values and has_data masks merged.", get_bytes, 0);
    per_job(&b, m, "amaxd_job_quantizers", "gauge", "Quantizers in the job's catalog.",
            get_quantizers, 0);
    per_job(&b, m, "amaxd_job_cells", "gauge", "float32 amax cells of the job's catalog.",
            get_cells, 0);
    per_job(&b, m, "amaxd_job_last_epoch_missing_cells", "gauge",
            "Cells without data anywhere after the last epoch's peer fill (they read 0).",
            get_missing, 1);
    per_job(&b, m, "amaxd_job_last_epoch_peer_filled_cells", "gauge",
            "Cells without data that took their peer group's max in the last epoch.", get_filled,
            1);
    per_job(&b, m, "amaxd_job_peer_filled_cells_total", "counter",
            "Cells filled from their peer group, summed over epochs.", get_filled_total, 1);

    head(&b, "amaxd_job_reconcile_seconds", "histogram",
         "Time of each reconciled epoch in the engine: agreement, collective and scales.");
    for (size_t i = 0; i < m->njobs; i++) {
        const job_m_t *j = &m->jobs[i];
        char lbl[2 * 256 + 1];
        amx_metrics_escape_label(j->name, lbl, sizeof(lbl));
        uint64_t cum = 0;
        for (size_t k = 0; k < AMX_METRICS_NBUCKETS; k++) {
            cum += j->buckets[k];
            put(&b, "amaxd_job_reconcile_seconds_bucket{job=\"%s\",le=\"%g\"} %llu\n", lbl,
                bucket_le[k], (unsigned long long)cum);
        }
        cum += j->buckets[AMX_METRICS_NBUCKETS];
        put(&b, "amaxd_job_reconcile_seconds_bucket{job=\"%s\",le=\"+Inf\"} %llu\n", lbl,
            (unsigned long long)cum);
        put(&b, "amaxd_job_reconcile_seconds_sum{job=\"%s\"} %.9g\n", lbl, j->sum);
        put(&b, "amaxd_job_reconcile_seconds_count{job=\"%s\"} %llu\n", lbl,
            (unsigned long long)cum);
    }
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.p);
        return AMX_ENOMEM;
    }
    *out = b.p;
    *len = b.len;
    return AMX_OK;
}

/* ---- HTTP (libmicrohttpd's thread) ---- */

static enum MHD_Result answer(struct MHD_Connection *c, unsigned status, const char *type,
                              char *body, size_t len, int must_free, const char *allow)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, body, must_free ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (r == NULL) {
        if (must_free)
            free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (allow != NULL)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload,
                                  size_t *upload_size, void **req_cls)
{
    amx_metrics_t *m = cls;
    static const char text[] = "text/plain; charset=utf-8";
    (void)version;
    (void)upload;
    (void)upload_size;
    (void)req_cls;
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
        static char msg[] = "405 method not allowed: use GET /metrics\n";
        return answer(c, MHD_HTTP_METHOD_NOT_ALLOWED, text, msg, strlen(msg), 0, "GET, HEAD");
    }
    if (strcmp(url, "/metrics") == 0) {
        char *body;
        size_t len;
        if (amx_metrics_render(m, &body, &len) != AMX_OK) {
            static char msg[] = "500 out of memory rendering the metrics\n";
            return answer(c, MHD_HTTP_INTERNAL_SERVER_ERROR, text, msg, strlen(msg), 0, NULL);
        }
        return answer(c, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", body, len, 1,
                      NULL);
    }
    if (strcmp(url, "/") == 0) {
        static char msg[] = "amaxd: Prometheus metrics are at /metrics\n";
        return answer(c, MHD_HTTP_OK, text, msg, strlen(msg), 0, NULL);
    }
    static char msg[] = "404 not found: amaxd serves /metrics only\n";
    return answer(c, MHD_HTTP_NOT_FOUND, text, msg, strlen(msg), 0, NULL);
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    char line[512];
    (void)cls;
    vsnprintf(line, sizeof(line), fmt, ap);
    size_t n = strlen(line);
    while (n > 0 && line[n - 1] == '\n')
        line[--n] = '\0';
    AMX_WARN("metrics", "libmicrohttpd: %s", line);
}

static int is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    if (sa->sa_family == AF_INET6) {
        const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
        if (IN6_IS_ADDR_LOOPBACK(a))
            return 1;
        return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
    }
    return 0;
}

amx_status_t amx_metrics_listen(amx_metrics_t *m, const amx_config_t *cfg, amx_err_t *err)
{
    const char *hp = cfg->metrics_listen;
    char host[256];
    const char *colon = strrchr(hp, ':');
    size_t hn = colon ? (size_t)(colon - hp) : 0;
    if (colon == NULL || hn == 0 || hn >= sizeof(host) || colon[1] == '\0')
        return amx_err_set(err, AMX_EINVAL,
                           "metrics_listen '%s' is not host:port (e.g. 127.0.0.1:9464)", hp);
    memcpy(host, hp, hn);
    host[hn] = '\0';
    if (host[0] == '[' && hn > 2 && host[hn - 1] == ']') { /* [::1]:9464 */
        memmove(host, host + 1, hn - 2);
        host[hn - 2] = '\0';
    }
    char *end;
    errno = 0;
    long port = strtol(colon + 1, &end, 10);
    if (errno != 0 || *end != '\0' || port < 0 || port > 65535)
        return amx_err_set(err, AMX_EINVAL, "metrics_listen '%s': '%s' is not a port (0-65535)", hp,
                           colon + 1);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int rc = getaddrinfo(host, colon + 1, &hints, &ai);
    if (rc != 0 || ai == NULL)
        return amx_err_set(err, AMX_EINVAL, "metrics_listen '%s': cannot resolve '%s': %s", hp,
                           host, gai_strerror(rc));
    if (!is_loopback(ai->ai_addr) && !cfg->metrics_allow_remote) {
        freeaddrinfo(ai);
        return amx_err_set(err, AMX_EINVAL,
                           "metrics_listen '%s' is not a loopback address: the metrics name jobs "
                           "and the endpoint has no authentication; set metrics_allow_remote=true "
                           "to serve them to the network anyway",
                           hp);
    }
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    m->http = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, m,
                               MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL, MHD_OPTION_SOCK_ADDR,
                               ai->ai_addr, MHD_OPTION_CONNECTION_LIMIT, (unsigned)32,
                               MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (m->http == NULL)
        return amx_err_set(err, AMX_EIO,
                           "metrics_listen '%s': cannot serve HTTP there (address in use, or not "
                           "this host's); see the libmicrohttpd line above",
                           hp);
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(m->http, MHD_DAEMON_INFO_BIND_PORT);
    m->port = info != NULL ? info->port : (uint16_t)port;
    AMX_INFO("metrics", "serving Prometheus metrics on %s port %u (GET /metrics)", host,
             (unsigned)m->port);
    return AMX_OK;
}

amx_status_t amx_metrics_start(const amx_config_t *cfg, const char *backend, const char *collective,
                               amx_metrics_t **out, amx_err_t *err)
{
    *out = NULL;
    amx_metrics_t *m = amx_metrics_create(backend, collective);
    if (m == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory creating the metrics");
    amx_status_t st = amx_metrics_listen(m, cfg, err);
    if (st != AMX_OK) {
        amx_metrics_free(m);
        return st;
    }
    *out = m;
    return AMX_OK;
}

uint16_t amx_metrics_port(const amx_metrics_t *m)
{
    return m != NULL ? m->port : 0;
}

void amx_metrics_free(amx_metrics_t *m)
{
    if (m == NULL)
        return;
    if (m->http != NULL)
        MHD_stop_daemon(m->http);
    for (size_t i = 0; i < m->njobs; i++)
        free(m->jobs[i].name);
    free(m->jobs);
    amx_strmap_free(&m->index);
    pthread_mutex_destroy(&m->mu);
    free(m);
}
