/*
 * amaxctl - look at a running amaxd.
 *
 *   amaxctl [options] status [JOB]
 *   amaxctl [options] list [JOB]
 *   amaxctl [options] dump [JOB] QUANTIZER
 *   amaxctl [options] health
 *   amaxctl [options] export [JOB] FILE
 *   amaxctl [options] watch [JOB] [--interval SECONDS] [--count N]
 *   amaxctl [options] report [JOB] [-o FILE]
 *
 * JOB may be left out when the daemon serves exactly one job. Exit status:
 * 0 on success, 1 when the daemon answered with an error or cannot be
 * reached, 2 on a usage error.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "amaxc.h"
#include "export.h"
#include "report.h"

static const char *usage =
    "Usage: amaxctl [--socket PATH | --target ADDR] [--json] [--timeout SECONDS] COMMAND\n"
    "Commands:\n"
    "  status [JOB]          daemon and job status\n"
    "  list [JOB]            quantizers of a job\n"
    "  dump [JOB] QUANTIZER  the reconciled amax and scales of one quantizer (whole tensor)\n"
    "  health                grpc.health.v1 Check\n"
    "  export [JOB] FILE     the last reconciled scales as a safetensors file\n"
    "  watch [JOB] [--interval SECONDS] [--count N]\n"
    "                        a live view of the jobs (or one), refreshed every SECONDS\n"
    "                        (default 2) until Ctrl-C or N refreshes; --json: a line each\n"
    "  report [JOB] [-o FILE] the job's calibration report, a self-contained HTML page\n"
    "                        (per-layer and per-expert amax, cold experts, scales that\n"
    "                        moved most); stdout without -o\n"
    "JOB may be left out when the daemon serves one job. The socket defaults to\n"
    "$AMAXD_SOCKET, then /run/amaxd/amaxd.sock.\n";

static const char *fmt_names[] = {"unspecified", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp8"};
static const char *rule_names[] = {"", "current", "delayed", "block_bf16", "block_fp16"};
static const char *acc_names[] = {"running_max", "running_max", "per_epoch"};

typedef struct ctx {
    amaxc_t *c;
    int json;
    double timeout;
} ctx_t;

static int call(ctx_t *x, const char *method, const ProtobufCMessage *req,
                const ProtobufCMessageDescriptor *d, ProtobufCMessage **resp)
{
    char msg[1024] = "";
    int code = amaxc_call(x->c, method, req, d, resp, x->timeout, msg, sizeof(msg));
    if (code != 0) {
        if (x->json) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "error", amaxc_code_name(code));
            cJSON_AddStringToObject(o, "message", msg);
            char *s = cJSON_Print(o);
            printf("%s\n", s);
            free(s);
            cJSON_Delete(o);
        }
        fprintf(stderr, "amaxctl: %s: %s\n", amaxc_code_name(code), msg);
        return 1;
    }
    return 0;
}

static void print_json(cJSON *o)
{
    char *s = cJSON_Print(o);
    printf("%s\n", s);
    free(s);
    cJSON_Delete(o);
}

/* The job to use: the one given, or the only one the daemon serves. */
static int pick_job(ctx_t *x, const char *given, char *out, size_t len)
{
    if (given != NULL) {
        snprintf(out, len, "%s", given);
        return 0;
    }
    Amaxd__V1__StatusRequest req = AMAXD__V1__STATUS_REQUEST__INIT;
    Amaxd__V1__StatusResponse *st = NULL;
    if (call(x, "/amaxd.v1.Calibration/Status", &req.base, &amaxd__v1__status_response__descriptor,
             (ProtobufCMessage **)&st))
        return 1;
    int rc = 0;
    if (st->n_jobs != 1) {
        fprintf(stderr, "amaxctl: the daemon serves %zu jobs; name one\n", st->n_jobs);
        rc = 2;
    } else {
        snprintf(out, len, "%s", st->jobs[0]->name);
    }
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return rc;
}

static int cmd_status(ctx_t *x, const char *job)
{
    Amaxd__V1__StatusRequest req = AMAXD__V1__STATUS_REQUEST__INIT;
    req.job = (char *)(job ? job : "");
    Amaxd__V1__StatusResponse *st = NULL;
    if (call(x, "/amaxd.v1.Calibration/Status", &req.base, &amaxd__v1__status_response__descriptor,
             (ProtobufCMessage **)&st))
        return 1;
    if (x->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "version", st->version);
        cJSON_AddStringToObject(o, "backend", st->backend);
        cJSON_AddStringToObject(o, "collective", st->collective);
        cJSON_AddNumberToObject(o, "uptime_s", st->uptime_s);
        cJSON_AddNumberToObject(o, "pid", st->pid);
        cJSON *jobs = cJSON_AddArrayToObject(o, "jobs");
        for (size_t i = 0; i < st->n_jobs; i++) {
            Amaxd__V1__JobStatus *j = st->jobs[i];
            cJSON *jo = cJSON_CreateObject();
            cJSON_AddStringToObject(jo, "name", j->name);
            cJSON_AddNumberToObject(jo, "world_size", j->world_size);
            cJSON_AddNumberToObject(jo, "joined", j->joined);
            cJSON_AddBoolToObject(jo, "ready", j->ready);
            cJSON_AddNumberToObject(jo, "epoch", (double)j->epoch);
            cJSON_AddNumberToObject(jo, "reconciled_epochs", (double)j->reconciled_epochs);
            cJSON_AddNumberToObject(jo, "quantizers", j->quantizers);
            cJSON_AddNumberToObject(jo, "cells", (double)j->cells);
            cJSON_AddNumberToObject(jo, "ranks_in_reconcile", j->ranks_in_reconcile);
            cJSON_AddNumberToObject(jo, "updates", (double)j->updates);
            cJSON_AddItemToArray(jobs, jo);
        }
        cJSON *cfg = cJSON_AddObjectToObject(o, "config");
        for (size_t i = 0; i < st->n_config; i++)
            cJSON_AddStringToObject(cfg, st->config[i]->name, st->config[i]->value);
        print_json(o);
    } else {
        printf("amaxd %s  pid %u  up %.1fs  backend %s  collective %s\n", st->version, st->pid,
               st->uptime_s, st->backend, st->collective);
        printf("%-24s %6s %6s %6s %8s %10s %12s %12s\n", "JOB", "WORLD", "JOINED", "READY", "EPOCH",
               "QUANTIZERS", "CELLS", "UPDATES");
        for (size_t i = 0; i < st->n_jobs; i++) {
            Amaxd__V1__JobStatus *j = st->jobs[i];
            printf("%-24s %6u %6u %6s %8llu %10u %12llu %12llu\n", j->name, j->world_size,
                   j->joined, j->ready ? "yes" : "no", (unsigned long long)j->epoch, j->quantizers,
                   (unsigned long long)j->cells, (unsigned long long)j->updates);
        }
    }
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return 0;
}

static void shape_str(char *buf, size_t len, const uint32_t *d, size_t n)
{
    size_t k = (size_t)snprintf(buf, len, "[");
    for (size_t i = 0; i < n && k < len; i++)
        k += (size_t)snprintf(buf + k, len - k, i ? ",%u" : "%u", d[i]);
    if (k < len)
        snprintf(buf + k, len - k, "]");
}

static int cmd_list(ctx_t *x, const char *given)
{
    char job[256];
    int rc = pick_job(x, given, job, sizeof(job));
    if (rc)
        return rc;
    Amaxd__V1__ListQuantizersRequest req = AMAXD__V1__LIST_QUANTIZERS_REQUEST__INIT;
    req.job = job;
    Amaxd__V1__ListQuantizersResponse *r = NULL;
    if (call(x, "/amaxd.v1.Calibration/ListQuantizers", &req.base,
             &amaxd__v1__list_quantizers_response__descriptor, (ProtobufCMessage **)&r))
        return 1;
    cJSON *arr = x->json ? cJSON_CreateArray() : NULL;
    if (!x->json)
        printf("%-60s %-14s %-9s %-8s %-11s %s\n", "QUANTIZER", "SHAPE", "FORMAT", "RULE", "ACCUM",
               "GROUPS");
    for (size_t i = 0; i < r->n_quantizers; i++) {
        Amaxd__V1__QuantizerInfo *q = r->quantizers[i];
        char shape[64];
        shape_str(shape, sizeof(shape), q->global_shape, q->n_global_shape);
        const char *fmt = fmt_names[q->recipe->format <= 4 ? q->recipe->format : 0];
        const char *rule = rule_names[q->recipe->rule <= 4 ? q->recipe->rule : 0];
        const char *acc = acc_names[q->accumulation <= 2 ? q->accumulation : 0];
        if (x->json) {
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "name", q->name);
            cJSON *sh = cJSON_AddArrayToObject(o, "global_shape");
            for (size_t d = 0; d < q->n_global_shape; d++)
                cJSON_AddItemToArray(sh, cJSON_CreateNumber(q->global_shape[d]));
            cJSON_AddStringToObject(o, "format", fmt);
            cJSON_AddStringToObject(o, "rule", rule);
            cJSON_AddStringToObject(o, "accumulation", acc);
            cJSON_AddStringToObject(o, "peer_group", q->peer_group);
            cJSON_AddStringToObject(o, "peer_mode",
                                    q->peer_mode == AMAXD__V1__PEER_MODE__PEER_SHARE  ? "share"
                                    : q->peer_mode == AMAXD__V1__PEER_MODE__PEER_FILL ? "fill"
                                                                                      : "");
            cJSON_AddStringToObject(o, "scale_group", q->scale_group);
            cJSON_AddNumberToObject(o, "global_axes", q->global_axes);
            cJSON_AddNumberToObject(o, "placements", q->placements);
            cJSON_AddItemToArray(arr, o);
        } else {
            printf("%-60s %-14s %-9s %-8s %-11s %s%s%s%s\n", q->name, shape, fmt, rule, acc,
                   q->peer_group,
                   q->peer_mode == AMAXD__V1__PEER_MODE__PEER_SHARE ? " (share)" : "",
                   q->scale_group[0] ? " / " : "", q->scale_group);
        }
    }
    if (x->json)
        print_json(arr);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return 0;
}

static cJSON *float_array(const ProtobufCBinaryData *b)
{
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; i + 4 <= b->len; i += 4) {
        float f;
        memcpy(&f, b->data + i, 4);
        cJSON_AddItemToArray(a, cJSON_CreateNumber(f));
    }
    return a;
}

static int cmd_dump(ctx_t *x, const char *given, const char *name)
{
    char job[256];
    int rc = pick_job(x, given, job, sizeof(job));
    if (rc)
        return rc;
    Amaxd__V1__GetScalesRequest req = AMAXD__V1__GET_SCALES_REQUEST__INIT;
    req.job = job;
    req.global = 1;
    req.n_names = 1;
    req.names = (char **)&name;
    Amaxd__V1__GetScalesResponse *r = NULL;
    if (call(x, "/amaxd.v1.Calibration/GetScales", &req.base,
             &amaxd__v1__get_scales_response__descriptor, (ProtobufCMessage **)&r))
        return 1;
    Amaxd__V1__QuantizerResult *q = r->results[0];
    size_t n = q->amax.len / 4;
    if (x->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "job", job);
        cJSON_AddStringToObject(o, "name", q->name);
        cJSON_AddNumberToObject(o, "epoch", (double)r->epoch);
        cJSON *sh = cJSON_AddArrayToObject(o, "shape");
        for (size_t d = 0; d < q->n_shape; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber(q->shape[d]));
        cJSON_AddItemToObject(o, "amax", float_array(&q->amax));
        cJSON_AddItemToObject(o, "scale", float_array(&q->scale));
        cJSON_AddItemToObject(o, "scale_inv", float_array(&q->scale_inv));
        cJSON *b = cJSON_AddArrayToObject(o, "block_scales");
        for (size_t i = 0; i < q->block_scales.len; i++)
            cJSON_AddItemToArray(b, cJSON_CreateNumber(q->block_scales.data[i]));
        cJSON_AddNumberToObject(o, "global_amax", q->global_amax);
        cJSON_AddNumberToObject(o, "global_scale", q->global_scale);
        cJSON_AddNumberToObject(o, "global_scale_inv", q->global_scale_inv);
        cJSON_AddNumberToObject(o, "missing", q->missing);
        print_json(o);
    } else {
        char shape[64];
        shape_str(shape, sizeof(shape), q->shape, q->n_shape);
        printf("%s  job %s  epoch %llu  shape %s  missing %u\n", q->name, job,
               (unsigned long long)r->epoch, shape, q->missing);
        printf("global_amax %.9g  global_scale %.9g  global_scale_inv %.9g\n", q->global_amax,
               q->global_scale, q->global_scale_inv);
        printf("%8s %16s %16s %16s %6s\n", "CELL", "AMAX", "SCALE", "SCALE_INV", "BYTE");
        for (size_t i = 0; i < n; i++) {
            float a, s, si;
            memcpy(&a, q->amax.data + 4 * i, 4);
            memcpy(&s, q->scale.data + 4 * i, 4);
            memcpy(&si, q->scale_inv.data + 4 * i, 4);
            printf("%8zu %16.9g %16.9g %16.9g   0x%02x\n", i, a, s, si, q->block_scales.data[i]);
        }
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return 0;
}

static int cmd_health(ctx_t *x)
{
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    Grpc__Health__V1__HealthCheckResponse *r = NULL;
    if (call(x, "/grpc.health.v1.Health/Check", &req.base,
             &grpc__health__v1__health_check_response__descriptor, (ProtobufCMessage **)&r))
        return 1;
    const char *s = r->status == 1 ? "SERVING" : r->status == 2 ? "NOT_SERVING" : "UNKNOWN";
    if (x->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", s);
        print_json(o);
    } else {
        printf("%s\n", s);
    }
    int rc = r->status == 1 ? 0 : 1;
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return rc;
}

static int cmd_export(ctx_t *x, const char *given, const char *path)
{
    char job[256], msg[1024] = "";
    int rc = pick_job(x, given, job, sizeof(job));
    if (rc)
        return rc;
    uint64_t epoch = 0;
    size_t nq = 0;
    if (amaxctl_export(x->c, x->timeout, job, path, &epoch, &nq, msg, sizeof(msg)) != 0) {
        fprintf(stderr, "amaxctl: export of job %s: %s\n", job, msg);
        return 1;
    }
    if (x->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "job", job);
        cJSON_AddStringToObject(o, "file", path);
        cJSON_AddNumberToObject(o, "epoch", (double)epoch);
        cJSON_AddNumberToObject(o, "quantizers", (double)nq);
        print_json(o);
    } else {
        printf("job %s, epoch %llu: %zu quantizers written to %s\n", job, (unsigned long long)epoch,
               nq, path);
    }
    return 0;
}

/* ---- watch ---- */

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
    (void)sig;
    interrupted = 1;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sleeps `s` seconds or until Ctrl-C. */
static void nap(double s)
{
    double end = mono_s() + s;
    while (!interrupted) {
        double left = end - mono_s();
        if (left <= 0)
            return;
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        nanosleep(&ts, NULL); /* EINTR on Ctrl-C: the loop sees the flag */
    }
}

typedef struct seen {
    char name[160];
    unsigned long long updates, reconciled;
} seen_t;

static int cmd_watch(ctx_t *x, const char *job, double interval, long count)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL); /* no SA_RESTART: a sleep ends at once */
    sigaction(SIGTERM, &sa, NULL);
    int tty = isatty(1) && !x->json;
    seen_t *prev = NULL;
    size_t nprev = 0;
    double prev_t = 0;
    int rc = 0;
    for (long k = 0; !interrupted && (count <= 0 || k < count); k++) {
        if (k > 0)
            nap(interval);
        if (interrupted)
            break;
        Amaxd__V1__StatusRequest req = AMAXD__V1__STATUS_REQUEST__INIT;
        req.job = (char *)(job ? job : "");
        Amaxd__V1__StatusResponse *st = NULL;
        char msg[1024] = "";
        int code = amaxc_call(x->c, "/amaxd.v1.Calibration/Status", &req.base,
                              &amaxd__v1__status_response__descriptor, (ProtobufCMessage **)&st,
                              x->timeout, msg, sizeof(msg));
        double now = mono_s(), dt = prev_t > 0 ? now - prev_t : 0;
        if (tty)
            fputs("\033[H\033[2J", stdout);
        if (code != 0) {
            rc = 1;
            if (x->json)
                printf("{\"error\":\"%s\"}\n", amaxc_code_name(code));
            else
                printf("amaxctl watch: %s: %s (retrying every %gs)\n", amaxc_code_name(code), msg,
                       interval);
            fflush(stdout);
            continue;
        }
        rc = 0;
        seen_t *cur = calloc(st->n_jobs ? st->n_jobs : 1, sizeof(*cur));
        if (cur == NULL) {
            protobuf_c_message_free_unpacked(&st->base, NULL);
            fprintf(stderr, "amaxctl: out of memory\n");
            free(prev);
            return 1;
        }
        cJSON *frame = x->json ? cJSON_CreateObject() : NULL;
        cJSON *jarr = NULL;
        if (frame != NULL) {
            cJSON_AddNumberToObject(frame, "refresh", (double)k);
            cJSON_AddNumberToObject(frame, "uptime_s", st->uptime_s);
            jarr = cJSON_AddArrayToObject(frame, "jobs");
        } else {
            printf("amaxd %s  pid %u  up %.0fs  backend %s  collective %s  (every %gs; Ctrl-C "
                   "stops)\n",
                   st->version, st->pid, st->uptime_s, st->backend, st->collective, interval);
            printf("%-24s %5s %6s %7s %7s %6s %10s %10s %11s %9s %9s %7s\n", "JOB", "WORLD",
                   "JOINED", "EPOCH", "DONE", "FAILED", "QUANTIZERS", "CELLS", "UPDATES", "UPD/S",
                   "EPOCH_MS", "WAITING");
        }
        for (size_t i = 0; i < st->n_jobs; i++) {
            Amaxd__V1__JobStatus *j = st->jobs[i];
            snprintf(cur[i].name, sizeof(cur[i].name), "%s", j->name);
            cur[i].updates = j->updates;
            cur[i].reconciled = j->reconciled_epochs;
            double rate = 0;
            for (size_t p = 0; p < nprev; p++)
                if (strcmp(prev[p].name, j->name) == 0 && dt > 0 && j->updates >= prev[p].updates)
                    rate = (double)(j->updates - prev[p].updates) / dt;
            if (frame != NULL) {
                cJSON *o = cJSON_CreateObject();
                cJSON_AddStringToObject(o, "name", j->name);
                cJSON_AddNumberToObject(o, "world_size", j->world_size);
                cJSON_AddNumberToObject(o, "joined", j->joined);
                cJSON_AddNumberToObject(o, "epoch", (double)j->epoch);
                cJSON_AddNumberToObject(o, "reconciled_epochs", (double)j->reconciled_epochs);
                cJSON_AddNumberToObject(o, "epochs_failed", (double)j->epochs_failed);
                cJSON_AddNumberToObject(o, "quantizers", j->quantizers);
                cJSON_AddNumberToObject(o, "cells", (double)j->cells);
                cJSON_AddNumberToObject(o, "updates", (double)j->updates);
                cJSON_AddNumberToObject(o, "updates_per_s", rate);
                cJSON_AddNumberToObject(o, "last_epoch_ms", (double)j->last_epoch_us / 1000.0);
                cJSON_AddNumberToObject(o, "ranks_in_reconcile", j->ranks_in_reconcile);
                cJSON_AddItemToArray(jarr, o);
            } else {
                printf("%-24s %5u %6u %7llu %7llu %6llu %10u %10llu %11llu %9.1f %9.2f %7u\n",
                       j->name, j->world_size, j->joined, (unsigned long long)j->epoch,
                       (unsigned long long)j->reconciled_epochs,
                       (unsigned long long)j->epochs_failed, j->quantizers,
                       (unsigned long long)j->cells, (unsigned long long)j->updates, rate,
                       (double)j->last_epoch_us / 1000.0, j->ranks_in_reconcile);
            }
        }
        if (frame != NULL) {
            char *line = cJSON_PrintUnformatted(frame);
            printf("%s\n", line);
            free(line);
            cJSON_Delete(frame);
        } else if (st->n_jobs == 0) {
            printf("(no jobs)\n");
        }
        fflush(stdout);
        free(prev);
        prev = cur;
        nprev = st->n_jobs;
        prev_t = now;
        protobuf_c_message_free_unpacked(&st->base, NULL);
    }
    free(prev);
    return rc;
}

/* ---- report ---- */

/* The whole tensors of every quantizer in `list`, in its order, fetched in
 * windows of at most 1M cells (GetScales start_cell/max_cells) and joined.
 * The results are malloc'd (free_results). */
static int fetch_results(ctx_t *x, const char *job, const Amaxd__V1__ListQuantizersResponse *l,
                         Amaxd__V1__QuantizerResult ***out, unsigned long long *epoch)
{
    size_t n = l->n_quantizers;
    Amaxd__V1__QuantizerResult **res = calloc(n ? n : 1, sizeof(*res));
    char **names = calloc(n ? n : 1, sizeof(*names));
    if (res == NULL || names == NULL) {
        free(res), free(names);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        const Amaxd__V1__QuantizerInfo *q = l->quantizers[i];
        size_t cells = 1;
        for (size_t d = 0; d < q->n_global_shape; d++)
            cells *= q->global_shape[d];
        names[i] = q->name;
        res[i] = calloc(1, sizeof(*res[i]));
        if (res[i] == NULL)
            goto oom;
        amaxd__v1__quantizer_result__init(res[i]);
        res[i]->name = q->name;
        res[i]->amax.data = calloc(cells ? cells : 1, 4);
        res[i]->amax.len = cells * 4;
        res[i]->filled.data = calloc(cells ? cells : 1, 1);
        res[i]->filled.len = cells;
        res[i]->n_shape = q->n_global_shape;
        res[i]->shape = q->global_shape;
        res[i]->peer_fill_known = 1;
        if (res[i]->amax.data == NULL || res[i]->filled.data == NULL)
            goto oom;
    }
    uint64_t start = 0, total = 1;
    size_t qi = 0;
    while (start < total) {
        Amaxd__V1__GetScalesRequest req = AMAXD__V1__GET_SCALES_REQUEST__INIT;
        req.job = (char *)job;
        req.global = 1;
        req.names = names;
        req.n_names = n;
        req.start_cell = start;
        req.max_cells = 1 << 20;
        Amaxd__V1__GetScalesResponse *r = NULL;
        if (call(x, "/amaxd.v1.Calibration/GetScales", &req.base,
                 &amaxd__v1__get_scales_response__descriptor, (ProtobufCMessage **)&r))
            goto fail;
        total = r->total_cells;
        *epoch = r->epoch;
        uint64_t got = 0;
        for (size_t k = 0; k < r->n_results; k++) {
            Amaxd__V1__QuantizerResult *p = r->results[k];
            while (qi < n && strcmp(names[qi], p->name) != 0)
                qi++;
            if (qi == n) {
                fprintf(stderr, "amaxctl: GetScales answered '%s', not asked for\n", p->name);
                protobuf_c_message_free_unpacked(&r->base, NULL);
                goto fail;
            }
            Amaxd__V1__QuantizerResult *d = res[qi];
            size_t off = (size_t)p->first_cell, pc = p->amax.len / 4;
            if ((off + pc) * 4 > d->amax.len) {
                fprintf(stderr, "amaxctl: GetScales answered too many cells for '%s'\n", p->name);
                protobuf_c_message_free_unpacked(&r->base, NULL);
                goto fail;
            }
            memcpy(d->amax.data + off * 4, p->amax.data, pc * 4);
            if (p->peer_filled > 0 && p->filled.len == pc)
                memcpy(d->filled.data + off, p->filled.data, pc);
            d->peer_fill_known &= p->peer_fill_known;
            d->peer_filled += p->peer_filled;
            d->missing += p->missing;
            d->global_amax = p->global_amax;
            d->global_scale = p->global_scale;
            d->global_scale_inv = p->global_scale_inv;
            d->has_previous = p->has_previous;
            d->previous_global_amax = p->previous_global_amax;
            d->previous_global_scale = p->previous_global_scale;
            got += pc;
        }
        protobuf_c_message_free_unpacked(&r->base, NULL);
        if (got == 0)
            break; /* nothing more (an empty job) */
        start += got;
    }
    free(names);
    *out = res;
    return 0;
oom:
    fprintf(stderr, "amaxctl: out of memory\n");
fail:
    for (size_t i = 0; i < n; i++)
        if (res[i] != NULL) {
            free(res[i]->amax.data);
            free(res[i]->filled.data);
            free(res[i]);
        }
    free(res), free(names);
    return -1;
}

static void free_results(Amaxd__V1__QuantizerResult **res, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(res[i]->amax.data);
        free(res[i]->filled.data);
        free(res[i]);
    }
    free(res);
}

static int cmd_report(ctx_t *x, const char *given, const char *path)
{
    char job[256];
    int rc = pick_job(x, given, job, sizeof(job));
    if (rc)
        return rc;
    Amaxd__V1__StatusRequest sreq = AMAXD__V1__STATUS_REQUEST__INIT;
    sreq.job = job;
    Amaxd__V1__StatusResponse *st = NULL;
    if (call(x, "/amaxd.v1.Calibration/Status", &sreq.base, &amaxd__v1__status_response__descriptor,
             (ProtobufCMessage **)&st))
        return 1;
    Amaxd__V1__ListQuantizersRequest lreq = AMAXD__V1__LIST_QUANTIZERS_REQUEST__INIT;
    lreq.job = job;
    Amaxd__V1__ListQuantizersResponse *l = NULL;
    if (call(x, "/amaxd.v1.Calibration/ListQuantizers", &lreq.base,
             &amaxd__v1__list_quantizers_response__descriptor, (ProtobufCMessage **)&l)) {
        protobuf_c_message_free_unpacked(&st->base, NULL);
        return 1;
    }
    Amaxd__V1__QuantizerResult **res = NULL;
    report_in_t in = {job, st, st->n_jobs ? st->jobs[0] : NULL, l, NULL, l->n_quantizers, 0};
    if (fetch_results(x, job, l, &res, &in.epoch) != 0) {
        rc = 1;
        goto out;
    }
    in.results = res;
    FILE *o = stdout;
    char tmp[4096];
    if (path != NULL && strcmp(path, "-") != 0) {
        /* Written next to the target and renamed: a reader never sees half a page. */
        snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
        o = fopen(tmp, "w");
        if (o == NULL) {
            fprintf(stderr, "amaxctl: cannot write %s: %s\n", tmp, strerror(errno));
            rc = 1;
            goto out;
        }
    }
    int wrc = report_write(o, &in);
    if (o != stdout) {
        if (fclose(o) != 0 || wrc != 0 || rename(tmp, path) != 0) {
            fprintf(stderr, "amaxctl: cannot write %s: %s\n", path,
                    wrc ? "out of memory" : strerror(errno));
            unlink(tmp);
            rc = 1;
            goto out;
        }
        if (!x->json)
            fprintf(stderr, "amaxctl: report of job %s (epoch %llu, %zu quantizers) in %s\n", job,
                    in.epoch, in.nresults, path);
    } else if (wrc != 0 || fflush(stdout) != 0) {
        fprintf(stderr, "amaxctl: writing the report failed\n");
        rc = 1;
    }
out:
    if (res != NULL)
        free_results(res, l->n_quantizers);
    protobuf_c_message_free_unpacked(&l->base, NULL);
    protobuf_c_message_free_unpacked(&st->base, NULL);
    return rc;
}

/* Splits a command's arguments into positionals and its own options. */
static int cmd_opts(int argc, char **argv, int i, const char **pos, int *npos, double *interval,
                    long *count, const char **out)
{
    *npos = 0;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (interval && !strcmp(a, "--interval") && i + 1 < argc) {
            char *end;
            *interval = strtod(argv[++i], &end);
            if (*end != '\0' || !(*interval > 0) || *interval > 86400) {
                fprintf(stderr, "amaxctl: --interval needs seconds in (0, 86400]\n");
                return 2;
            }
        } else if (count && !strcmp(a, "--count") && i + 1 < argc) {
            char *end;
            *count = strtol(argv[++i], &end, 10);
            if (*end != '\0' || *count <= 0) {
                fprintf(stderr, "amaxctl: --count needs a positive number\n");
                return 2;
            }
        } else if (out && (!strcmp(a, "-o") || !strcmp(a, "--output")) && i + 1 < argc) {
            *out = argv[++i];
        } else if (a[0] == '-' && a[1] != '\0') {
            fprintf(stderr, "amaxctl: unknown option %s\n%s", a, usage);
            return 2;
        } else if (*npos < 1) {
            pos[(*npos)++] = a;
        } else {
            fprintf(stderr, "amaxctl: bad command line\n%s", usage);
            return 2;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    ctx_t x = {NULL, 0, 10.0};
    const char *target = getenv("AMAXD_SOCKET");
    if (target == NULL || target[0] == '\0')
        target = "/run/amaxd/amaxd.sock";
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "--json")) {
            x.json = 1;
        } else if ((!strcmp(argv[i], "--socket") || !strcmp(argv[i], "--target")) && i + 1 < argc) {
            target = argv[++i];
        } else if (!strcmp(argv[i], "--timeout") && i + 1 < argc) {
            x.timeout = atof(argv[++i]);
            if (!(x.timeout > 0)) {
                fprintf(stderr, "amaxctl: --timeout needs a positive number of seconds\n");
                return 2;
            }
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(usage, stdout);
            return 0;
        } else {
            fprintf(stderr, "amaxctl: unknown option %s\n%s", argv[i], usage);
            return 2;
        }
    }
    if (i >= argc) {
        fputs(usage, stderr);
        return 2;
    }
    const char *cmd = argv[i++];
    int nargs = argc - i;
    x.c = amaxc_open(target);
    if (x.c == NULL) {
        fprintf(stderr, "amaxctl: out of memory\n");
        return 1;
    }
    int rc;
    if (!strcmp(cmd, "status") && nargs <= 1)
        rc = cmd_status(&x, nargs ? argv[i] : NULL);
    else if (!strcmp(cmd, "list") && nargs <= 1)
        rc = cmd_list(&x, nargs ? argv[i] : NULL);
    else if (!strcmp(cmd, "dump") && (nargs == 1 || nargs == 2))
        rc = cmd_dump(&x, nargs == 2 ? argv[i] : NULL, argv[argc - 1]);
    else if (!strcmp(cmd, "export") && (nargs == 1 || nargs == 2))
        rc = cmd_export(&x, nargs == 2 ? argv[i] : NULL, argv[argc - 1]);
    else if (!strcmp(cmd, "health") && nargs == 0)
        rc = cmd_health(&x);
    else if (!strcmp(cmd, "watch") || !strcmp(cmd, "report")) {
        const char *pos[1] = {NULL}, *out = NULL;
        int npos;
        double interval = 2.0;
        long count = 0;
        int w = !strcmp(cmd, "watch");
        rc = cmd_opts(argc, argv, i, pos, &npos, w ? &interval : NULL, w ? &count : NULL,
                      w ? NULL : &out);
        if (rc == 0)
            rc = w ? cmd_watch(&x, pos[0], interval, count) : cmd_report(&x, pos[0], out);
    } else {
        fprintf(stderr, "amaxctl: bad command line\n%s", usage);
        rc = 2;
    }
    amaxc_close(x.c);
    return rc;
}
