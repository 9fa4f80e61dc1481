/*
 * amaxctl - look at a running amaxd.
 *
 *   amaxctl [options] status [JOB]
 *   amaxctl [options] list [JOB]
 *   amaxctl [options] dump [JOB] QUANTIZER
 *   amaxctl [options] health
 *   amaxctl [options] export [JOB] FILE
 *
 * JOB may be left out when the daemon serves exactly one job. Exit status:
 * 0 on success, 1 when the daemon answered with an error or cannot be
 * reached, 2 on a usage error.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amaxc.h"
#include "export.h"

static const char *usage =
    "Usage: amaxctl [--socket PATH | --target ADDR] [--json] [--timeout SECONDS] COMMAND\n"
    "Commands:\n"
    "  status [JOB]          daemon and job status\n"
    "  list [JOB]            quantizers of a job\n"
    "  dump [JOB] QUANTIZER  the reconciled amax and scales of one quantizer (whole tensor)\n"
    "  health                grpc.health.v1 Check\n"
    "  export [JOB] FILE     the last reconciled scales as a safetensors file\n"
    "JOB may be left out when the daemon serves one job. The socket defaults to\n"
    "$AMAXD_SOCKET, then /run/amaxd/amaxd.sock.\n";

static const char *fmt_names[] = {"unspecified", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp8"};
static const char *rule_names[] = {"", "current", "delayed"};
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
        const char *rule = rule_names[q->recipe->rule <= 2 ? q->recipe->rule : 0];
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
            cJSON_AddStringToObject(o, "scale_group", q->scale_group);
            cJSON_AddNumberToObject(o, "placements", q->placements);
            cJSON_AddItemToArray(arr, o);
        } else {
            printf("%-60s %-14s %-9s %-8s %-11s %s%s%s\n", q->name, shape, fmt, rule, acc,
                   q->peer_group, q->scale_group[0] ? " / " : "", q->scale_group);
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
    else {
        fprintf(stderr, "amaxctl: bad command line\n%s", usage);
        rc = 2;
    }
    amaxc_close(x.c);
    return rc;
}
