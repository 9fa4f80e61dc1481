/*
 * export.c - amaxctl export: a job's last reconciled scales as a
 * safetensors file, the same bytes as the Python client's Client.export
 * (client/python/amaxd/export.py describes the layout).
 */
#include "export.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *fmt_name[] = {"", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp8"};
static const char *block_name[] = {"", "", "", "e4m3", "e8m0"};

typedef struct q {
    const Amaxd__V1__QuantizerInfo *info;
    uint64_t ncells, got;
    float *amax, *scale, *inv;
    uint8_t *bytes;
    float g[3];
    /* global_axes k > 0: one global per slice (global_shape[:k]), cells of
     * one slice at a time (prod(global_shape[k:])). */
    uint64_t nslices, slice_cells;
    float *sg[3];
} q_t;

/* amaxc_call; on an error the message starts with the status code's name. */
static int rpc(amaxc_t *c, const char *method, const ProtobufCMessage *req,
               const ProtobufCMessageDescriptor *d, ProtobufCMessage **resp, double timeout,
               char *msg, size_t len)
{
    char m[1024] = "";
    int code = amaxc_call(c, method, req, d, resp, timeout, m, sizeof(m));
    if (code != 0)
        snprintf(msg, len, "%s: %s", amaxc_code_name(code), m);
    return code;
}

static int cmp_info(const void *a, const void *b)
{
    const Amaxd__V1__QuantizerInfo *x = *(const Amaxd__V1__QuantizerInfo *const *)a;
    const Amaxd__V1__QuantizerInfo *y = *(const Amaxd__V1__QuantizerInfo *const *)b;
    return strcmp(x->name, y->name);
}

static void free_qs(q_t *qs, size_t n)
{
    for (size_t i = 0; qs != NULL && i < n; i++) {
        free(qs[i].amax);
        free(qs[i].scale);
        free(qs[i].inv);
        free(qs[i].bytes);
        for (int k = 0; k < 3; k++)
            free(qs[i].sg[k]);
    }
    free(qs);
}

/* One pass over every window; 1 when an epoch was reconciled in between
 * (start again), 0 when done, -1 on an error (in msg). */
static int fetch(amaxc_t *c, double timeout, const char *job, char **names, q_t *qs, size_t n,
                 uint64_t *epoch, char *msg, size_t len)
{
    uint64_t window = 1u << 21, start = 0;
    int have_epoch = 0;
    size_t cur = 0;
    for (size_t i = 0; i < n; i++)
        qs[i].got = 0;
    for (;;) {
        Amaxd__V1__GetScalesRequest req = AMAXD__V1__GET_SCALES_REQUEST__INIT;
        req.job = (char *)job;
        req.global = 1;
        req.n_names = n;
        req.names = names;
        req.start_cell = start;
        req.max_cells = window;
        Amaxd__V1__GetScalesResponse *r = NULL;
        int code = rpc(c, "/amaxd.v1.Calibration/GetScales", &req.base,
                       &amaxd__v1__get_scales_response__descriptor, (ProtobufCMessage **)&r,
                       timeout, msg, len);
        if (code == 8 /* RESOURCE_EXHAUSTED */ && window > 1) {
            window /= 2;
            continue;
        }
        if (code != 0)
            return -1;
        if (!have_epoch) {
            *epoch = r->epoch;
            have_epoch = 1;
        } else if (r->epoch != *epoch) {
            protobuf_c_message_free_unpacked(&r->base, NULL);
            return 1;
        }
        uint64_t got = 0;
        for (size_t k = 0; k < r->n_results; k++) {
            Amaxd__V1__QuantizerResult *x = r->results[k];
            while (cur < n && strcmp(qs[cur].info->name, x->name) != 0)
                cur++;
            if (cur == n) {
                snprintf(msg, len, "the daemon answered for '%s', not asked for or out of order",
                         x->name);
                protobuf_c_message_free_unpacked(&r->base, NULL);
                return -1;
            }
            q_t *q = &qs[cur];
            uint64_t m = x->amax.len / 4;
            if (x->first_cell != q->got || q->got + m > q->ncells || x->scale.len != m * 4 ||
                x->scale_inv.len != m * 4 || x->block_scales.len != m) {
                snprintf(msg, len, "the answer for '%s' does not fit its shape", x->name);
                protobuf_c_message_free_unpacked(&r->base, NULL);
                return -1;
            }
            memcpy(q->amax + q->got, x->amax.data, m * 4);
            memcpy(q->scale + q->got, x->scale.data, m * 4);
            memcpy(q->inv + q->got, x->scale_inv.data, m * 4);
            memcpy(q->bytes + q->got, x->block_scales.data, m);
            q->got += m;
            q->g[0] = x->global_amax;
            q->g[1] = x->global_scale;
            q->g[2] = x->global_scale_inv;
            if (q->nslices > 0 && m > 0) {
                /* The window's slices, from block slice first_cell / slice_cells. */
                uint64_t j0 = x->first_cell / q->slice_cells, ns = x->global_amaxes.len / 4;
                if (j0 + ns > q->nslices || x->global_scales.len != ns * 4 ||
                    x->global_scale_invs.len != ns * 4) {
                    snprintf(msg, len, "the global slices for '%s' do not fit its shape", x->name);
                    protobuf_c_message_free_unpacked(&r->base, NULL);
                    return -1;
                }
                memcpy(q->sg[0] + j0, x->global_amaxes.data, ns * 4);
                memcpy(q->sg[1] + j0, x->global_scales.data, ns * 4);
                memcpy(q->sg[2] + j0, x->global_scale_invs.data, ns * 4);
            }
            got += m;
        }
        uint64_t total = r->total_cells;
        protobuf_c_message_free_unpacked(&r->base, NULL);
        start += got;
        if (got == 0 || start >= total)
            break;
    }
    for (size_t i = 0; i < n; i++)
        if (qs[i].got != qs[i].ncells) {
            snprintf(msg, len, "'%s': %llu of %llu cells returned", qs[i].info->name,
                     (unsigned long long)qs[i].got, (unsigned long long)qs[i].ncells);
            return -1;
        }
    return 0;
}

/* A tensor of the header: the first `ndims` dimensions of the quantizer's
 * global shape (0: a scalar). */
static void add_tensor(cJSON *h, const char *qname, const char *suffix, const char *dtype,
                       const Amaxd__V1__QuantizerInfo *info, size_t ndims, uint64_t *off,
                       uint64_t bytes)
{
    char key[1200];
    snprintf(key, sizeof(key), "%s.%s", qname, suffix);
    cJSON *t = cJSON_AddObjectToObject(h, key);
    cJSON_AddStringToObject(t, "dtype", dtype);
    cJSON *sh = cJSON_AddArrayToObject(t, "shape");
    for (size_t d = 0; d < ndims && d < info->n_global_shape; d++)
        cJSON_AddItemToArray(sh, cJSON_CreateNumber(info->global_shape[d]));
    cJSON *o = cJSON_AddArrayToObject(t, "data_offsets");
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)*off));
    cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(*off + bytes)));
    *off += bytes;
}

static int write_file(const char *path, const char *job, uint64_t epoch, q_t *qs, size_t n,
                      char *msg, size_t len)
{
    cJSON *h = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(h, "__metadata__");
    cJSON *list = cJSON_CreateArray();
    for (size_t i = 0; i < n; i++) {
        const Amaxd__V1__QuantizerInfo *in = qs[i].info;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "name", in->name);
        cJSON *sh = cJSON_AddArrayToObject(o, "shape");
        for (size_t d = 0; d < in->n_global_shape; d++)
            cJSON_AddItemToArray(sh, cJSON_CreateNumber(in->global_shape[d]));
        cJSON_AddStringToObject(o, "format", fmt_name[in->recipe->format]);
        cJSON_AddStringToObject(o, "block_scale", block_name[in->recipe->format]);
        if (in->global_axes > 0)
            cJSON_AddNumberToObject(o, "global_axes", in->global_axes);
        /* Calibrators beyond max (issue 23): the amax is the method's. */
        const Amaxd__V1__Calibrator *cal = in->calibrator;
        if (cal != NULL && cal->kind == AMAXD__V1__CALIBRATOR_KIND__CALIBRATOR_MSE)
            cJSON_AddStringToObject(o, "calibrator", "mse");
        else if (cal != NULL && cal->kind == AMAXD__V1__CALIBRATOR_KIND__CALIBRATOR_NVFP4_MSE)
            cJSON_AddStringToObject(o, "calibrator", "nvfp4_mse");
        else if (cal != NULL && cal->kind == AMAXD__V1__CALIBRATOR_KIND__CALIBRATOR_HISTOGRAM) {
            static const char *method[] = {"", "entropy", "percentile", "mse"};
            char name[32];
            snprintf(name, sizeof(name), "histogram/%s",
                     cal->method >= 1 && cal->method <= 3 ? method[cal->method] : "");
            cJSON_AddStringToObject(o, "calibrator", name);
        }
        cJSON_AddItemToArray(list, o);
    }
    char *ls = cJSON_PrintUnformatted(list);
    cJSON_Delete(list);
    char ep[32];
    snprintf(ep, sizeof(ep), "%llu", (unsigned long long)epoch);
    cJSON_AddStringToObject(meta, "amaxd.format", "scales/1");
    cJSON_AddStringToObject(meta, "amaxd.job", job);
    cJSON_AddStringToObject(meta, "amaxd.epoch", ep);
    cJSON_AddStringToObject(meta, "amaxd.quantizers", ls ? ls : "[]");
    free(ls);
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const Amaxd__V1__QuantizerInfo *in = qs[i].info;
        uint64_t c = qs[i].ncells, g = qs[i].nslices ? qs[i].nslices : 1;
        size_t all = in->n_global_shape, gd = qs[i].nslices ? in->global_axes : 0;
        add_tensor(h, in->name, "amax", "F32", in, all, &off, c * 4);
        add_tensor(h, in->name, "scale", "F32", in, all, &off, c * 4);
        add_tensor(h, in->name, "scale_inv", "F32", in, all, &off, c * 4);
        if (in->recipe->format == 3 || in->recipe->format == 4)
            add_tensor(h, in->name, "block_scale", "U8", in, all, &off, c);
        add_tensor(h, in->name, "global_amax", "F32", in, gd, &off, g * 4);
        add_tensor(h, in->name, "global_scale", "F32", in, gd, &off, g * 4);
        add_tensor(h, in->name, "global_scale_inv", "F32", in, gd, &off, g * 4);
    }
    char *hs = cJSON_PrintUnformatted(h);
    cJSON_Delete(h);
    if (hs == NULL) {
        snprintf(msg, len, "out of memory");
        return -1;
    }
    size_t hl = strlen(hs), pad = (8 - hl % 8) % 8;
    uint64_t hlen = hl + pad;
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (f == NULL) {
        snprintf(msg, len, "cannot create %s", tmp);
        free(hs);
        return -1;
    }
    int ok = fwrite(&hlen, 8, 1, f) == 1 && fwrite(hs, 1, hl, f) == hl &&
             fwrite("        ", 1, pad, f) == pad;
    free(hs);
    for (size_t i = 0; ok && i < n; i++) {
        const q_t *q = &qs[i];
        ok = fwrite(q->amax, 4, q->ncells, f) == q->ncells &&
             fwrite(q->scale, 4, q->ncells, f) == q->ncells &&
             fwrite(q->inv, 4, q->ncells, f) == q->ncells;
        if (ok && (q->info->recipe->format == 3 || q->info->recipe->format == 4))
            ok = fwrite(q->bytes, 1, q->ncells, f) == q->ncells;
        if (ok && q->nslices > 0)
            for (int k = 0; ok && k < 3; k++)
                ok = fwrite(q->sg[k], 4, q->nslices, f) == q->nslices;
        else if (ok)
            ok = fwrite(q->g, 4, 3, f) == 3;
    }
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        snprintf(msg, len, "cannot write %s", path);
        unlink(tmp);
        return -1;
    }
    return 0;
}

int amaxctl_export(amaxc_t *c, double timeout, const char *job, const char *path,
                   uint64_t *epoch_out, size_t *nq_out, char *msg, size_t len)
{
    Amaxd__V1__ListQuantizersRequest lreq = AMAXD__V1__LIST_QUANTIZERS_REQUEST__INIT;
    lreq.job = (char *)job;
    Amaxd__V1__ListQuantizersResponse *lr = NULL;
    if (rpc(c, "/amaxd.v1.Calibration/ListQuantizers", &lreq.base,
            &amaxd__v1__list_quantizers_response__descriptor, (ProtobufCMessage **)&lr, timeout,
            msg, len) != 0)
        return -1;
    size_t n = 0;
    Amaxd__V1__QuantizerInfo **infos = calloc(lr->n_quantizers + 1, sizeof(*infos));
    q_t *qs = calloc(lr->n_quantizers + 1, sizeof(q_t));
    char **names = calloc(lr->n_quantizers + 1, sizeof(char *));
    int rc = -1;
    if (infos == NULL || qs == NULL || names == NULL) {
        snprintf(msg, len, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < lr->n_quantizers; i++)
        if (lr->quantizers[i]->agreed && lr->quantizers[i]->recipe != NULL &&
            lr->quantizers[i]->recipe->format >= 1 && lr->quantizers[i]->recipe->format <= 4)
            infos[n++] = lr->quantizers[i];
    qsort(infos, n, sizeof(*infos), cmp_info);
    for (size_t i = 0; i < n; i++) {
        q_t *q = &qs[i];
        q->info = infos[i];
        names[i] = infos[i]->name;
        q->ncells = 1;
        for (size_t d = 0; d < infos[i]->n_global_shape; d++)
            q->ncells *= infos[i]->global_shape[d];
        q->amax = malloc(q->ncells * 4);
        q->scale = malloc(q->ncells * 4);
        q->inv = malloc(q->ncells * 4);
        q->bytes = malloc(q->ncells);
        uint32_t k = infos[i]->global_axes;
        if (k > 0 && k < infos[i]->n_global_shape) {
            q->nslices = 1;
            for (uint32_t d = 0; d < k; d++)
                q->nslices *= infos[i]->global_shape[d];
            q->slice_cells = q->ncells / q->nslices;
            for (int a = 0; a < 3; a++)
                q->sg[a] = calloc(q->nslices, 4);
        }
        if (!q->amax || !q->scale || !q->inv || !q->bytes ||
            (q->nslices && (!q->sg[0] || !q->sg[1] || !q->sg[2]))) {
            snprintf(msg, len, "out of memory for '%s'", q->info->name);
            goto out;
        }
    }
    uint64_t epoch = 0;
    if (n > 0) {
        int tries = 0, f;
        while ((f = fetch(c, timeout, job, names, qs, n, &epoch, msg, len)) == 1 && ++tries < 8)
            ;
        if (f == 1)
            snprintf(msg, len, "epochs kept being reconciled while the results were read");
        if (f != 0)
            goto out;
    } else {
        /* No agreed quantizer: the epoch from Status. */
        Amaxd__V1__StatusRequest sreq = AMAXD__V1__STATUS_REQUEST__INIT;
        sreq.job = (char *)job;
        Amaxd__V1__StatusResponse *st = NULL;
        if (rpc(c, "/amaxd.v1.Calibration/Status", &sreq.base,
                &amaxd__v1__status_response__descriptor, (ProtobufCMessage **)&st, timeout, msg,
                len) != 0)
            goto out;
        epoch = st->n_jobs ? st->jobs[0]->reconciled_epochs : 0;
        protobuf_c_message_free_unpacked(&st->base, NULL);
    }
    if (write_file(path, job, epoch, qs, n, msg, len) != 0)
        goto out;
    *epoch_out = epoch;
    *nq_out = n;
    rc = 0;
out:
    free_qs(qs, n);
    free(infos);
    free(names);
    protobuf_c_message_free_unpacked(&lr->base, NULL);
    return rc;
}
