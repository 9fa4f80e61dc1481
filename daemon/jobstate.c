/* jobstate.c - serialization of a job's replicated state. */
#include "jobstate.h"

#include "bytebuf.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAGIC 0x4a584d41u /* "AMXJ" */

uint64_t amx_checksum64(const void *p, size_t n)
{
    /* Multiply-xorshift over 8-byte words: fast enough for hundreds of MB,
     * and any flipped bit changes the result. */
    const unsigned char *b = p;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h ^= w;
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 32;
    }
    uint64_t tail = 0;
    if (n > i)
        memcpy(&tail, b + i, n - i);
    h ^= tail;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    return h;
}

/* ---- writing ---- */

/* Room for n bytes at an aligned offset; returns the offset. */
static size_t reserve(amx_wbuf_t *w, size_t n)
{
    amx_put_align8(w);
    size_t off = w->len;
    if (amx_wbuf_grow(w, n) != 0)
        return 0;
    w->len += n;
    return off;
}

amx_status_t amx_jobstate_export(const char *job, uint64_t last_reconciled,
                                 const amx_catalog_t *cat, const amx_qdesc_t *desc, amx_state_t *st,
                                 int back, void **blob, size_t *len, amx_err_t *err)
{
    return amx_jobstate_export_marked(job, last_reconciled, cat, desc, st, back, NULL, blob, len,
                                      err);
}

amx_status_t amx_jobstate_export_marked(const char *job, uint64_t last_reconciled,
                                        const amx_catalog_t *cat, const amx_qdesc_t *desc,
                                        amx_state_t *st, int back, const uint8_t *g_ok, void **blob,
                                        size_t *len, amx_err_t *err)
{
    return amx_jobstate_export_prev(job, last_reconciled, cat, desc, st, back, g_ok, NULL, NULL,
                                    blob, len, err);
}

amx_status_t amx_jobstate_export_prev(const char *job, uint64_t last_reconciled,
                                      const amx_catalog_t *cat, const amx_qdesc_t *desc,
                                      amx_state_t *st, int back, const uint8_t *g_ok,
                                      const float *pprev_ga, const float *pprev_gs, void **blob,
                                      size_t *len, amx_err_t *err)
{
    amx_wbuf_t w = {0};
    amx_put32(&w, MAGIC);
    amx_put32(&w, AMX_JOBSTATE_VERSION);
    amx_putstr(&w, job);
    amx_put64(&w, last_reconciled);
    amx_put32(&w, cat->n);
    for (uint32_t i = 0; i < cat->n; i++) {
        const amx_qspec_t *s = cat->q[i];
        const amx_recipe_t *r = &s->recipe;
        amx_putstr(&w, s->name);
        amx_put32(&w, s->ndim);
        amx_put(&w, s->shape, sizeof(s->shape));
        unsigned char b[11] = {
            r->format,           r->rule,         r->history_reduce,    r->nvfp4_convention,
            r->power_of_2,       s->accumulation, r->output_convention, r->history_convention,
            r->mxfp8_convention, s->peer_mode,    s->global_axes};
        amx_put(&w, b, sizeof(b));
        amx_put32(&w, r->history_len);
        amx_put(&w, &r->margin, 4);
        amx_put(&w, &r->eps, 4);
        amx_put(&w, &r->scaled_max, 4);
        amx_putstr(&w, s->peer_group);
        amx_putstr(&w, s->scale_group);
        amx_put32(&w, desc[i].hist_head);
        const amx_calib_t *c = &s->calib;
        unsigned char cb[6] = {c->kind,        c->method,     c->grid,
                               c->is_unsigned, c->skip_zeros, c->torch_cpu};
        amx_put(&w, cb, sizeof(cb));
        amx_put32(&w, c->num_bins);
        amx_put32(&w, c->num_bits);
        amx_put32(&w, c->start_bin);
        amx_put32(&w, c->stride);
        amx_put32(&w, c->nsteps);
        amx_put(&w, &c->percentile, 8);
        amx_put(&w, &c->start_mult, 8);
        amx_put(&w, &c->stop_mult, 8);
        amx_put(&w, &c->step_size, 8);
    }
    uint64_t nc = cat->ncells, nh = cat->nhist, nq = cat->n, ns = cat->nslices;
    uint64_t nst = cat->nstat, nsc = cat->nscell;
    amx_put64(&w, nc);
    amx_put64(&w, nh);
    amx_put64(&w, ns);
    amx_put64(&w, nst);
    amx_put64(&w, nsc);
    size_t o_accum = reserve(&w, nc * 4), o_prev = reserve(&w, nc * 4),
           o_hist = reserve(&w, nh * 4), o_prevg = reserve(&w, nq * 4),
           o_amax = reserve(&w, nc * 4), o_scale = reserve(&w, nc * 4), o_inv = reserve(&w, nc * 4),
           o_bytes = reserve(&w, nc), o_ga = reserve(&w, nq * 4), o_gs = reserve(&w, nq * 4),
           o_gi = reserve(&w, nq * 4), o_pgs = reserve(&w, ns * 4), o_sa = reserve(&w, ns * 4),
           o_ss = reserve(&w, ns * 4), o_si = reserve(&w, ns * 4);
    size_t o_st = reserve(&w, nst * 8), o_sb = reserve(&w, nsc * 4),
           o_sq = reserve(&w, nst > 0 ? nq * sizeof(amx_stat_result_t) : 0);
    size_t o_ppa = reserve(&w, nq * 4), o_pps = reserve(&w, nq * 4);
    amx_put_align8(&w);
    size_t body = w.len;
    amx_put64(&w, 0); /* checksum, below */
    if (w.oom) {
        free(w.p);
        return amx_err_set(err, AMX_ENOMEM, "out of memory serializing the state of job '%s'", job);
    }
    amx_state_arrays_t a = {
        .accum = (float *)(w.p + o_accum),
        .prev = (float *)(w.p + o_prev),
        .hist = (float *)(w.p + o_hist),
        .prev_g = (float *)(w.p + o_prevg),
        .out_amax = (float *)(w.p + o_amax),
        .out_scale = (float *)(w.p + o_scale),
        .out_inv = (float *)(w.p + o_inv),
        .g_amax = (float *)(w.p + o_ga),
        .g_scale = (float *)(w.p + o_gs),
        .g_inv = (float *)(w.p + o_gi),
        .out_bytes = w.p + o_bytes,
        .prev_gs = (float *)(w.p + o_pgs),
        .s_amax = (float *)(w.p + o_sa),
        .s_scale = (float *)(w.p + o_ss),
        .s_inv = (float *)(w.p + o_si),
        .nstat = nst,
        .nscell = nsc,
        .stat = (double *)(w.p + o_st),
        .basis = (float *)(w.p + o_sb),
        .sq = nst > 0 ? (amx_stat_result_t *)(w.p + o_sq) : NULL,
    };
    amx_status_t rc = st->ops->export_state(st, nc, nh, (uint32_t)nq, ns, back, &a, err);
    if (rc != AMX_OK) {
        free(w.p);
        return rc;
    }
    for (uint32_t i = 0; g_ok != NULL && i < cat->n; i++)
        if (!g_ok[i])
            a.g_amax[i] = a.g_scale[i] = a.g_inv[i] = NAN;
    for (uint32_t i = 0; i < cat->n; i++) {
        float ga = pprev_ga != NULL ? pprev_ga[i] : NAN, gs = pprev_gs != NULL ? pprev_gs[i] : NAN;
        memcpy(w.p + o_ppa + 4 * (size_t)i, &ga, 4);
        memcpy(w.p + o_pps + 4 * (size_t)i, &gs, 4);
    }
    uint64_t sum = amx_checksum64(w.p, body);
    memcpy(w.p + body, &sum, 8);
    *blob = w.p;
    *len = w.len;
    return AMX_OK;
}

/* ---- reading ---- */

/* A string copied into `buf` (cap bytes with the NUL). */
static int getstr(amx_rbuf_t *r, char *buf, size_t cap)
{
    uint32_t n = amx_get32(r);
    if (n >= cap) {
        r->bad = 1;
        return 0;
    }
    const void *q = amx_get(r, n);
    if (q == NULL)
        return 0;
    if (n > 0)
        memcpy(buf, q, n);
    buf[n] = '\0';
    return memchr(buf, '\0', n) == NULL;
}

static const void *get_array(amx_rbuf_t *r, uint64_t n)
{
    r->off += (8 - r->off % 8) % 8;
    if (r->off > r->len || n > r->len - r->off) {
        r->bad = 1;
        return NULL;
    }
    return amx_get(r, (size_t)n);
}

amx_status_t amx_jobstate_parse(const void *blob, size_t len, amx_jobstate_t *out, amx_err_t *err)
{
    memset(out, 0, sizeof(*out));
    if (len < 16 || len % 8 != 0 || ((uintptr_t)blob % 8) != 0)
        return amx_err_set(err, AMX_EINVAL, "job state of %zu bytes is truncated", len);
    uint64_t sum;
    memcpy(&sum, (const unsigned char *)blob + len - 8, 8);
    if (amx_checksum64(blob, len - 8) != sum)
        return amx_err_set(err, AMX_EINVAL, "job state of %zu bytes fails its checksum", len);
    amx_rbuf_t r = {blob, len - 8, 0, 0};
    if (amx_get32(&r) != MAGIC)
        return amx_err_set(err, AMX_EINVAL, "not a job state (bad magic)");
    uint32_t ver = amx_get32(&r);
    if (ver < 3 || ver > AMX_JOBSTATE_VERSION)
        return amx_err_set(err, AMX_EINVAL,
                           "job state format %u is not one of the supported 3 to %u", ver,
                           AMX_JOBSTATE_VERSION);
    char name[AMX_MAX_JOB_NAME + 1], qname[AMX_MAX_NAME + 1], pg[AMX_MAX_NAME + 1],
        sg[AMX_MAX_NAME + 1];
    amx_qspec_t **specs = NULL;
    uint32_t n = 0, made = 0;
    amx_status_t st = AMX_EINVAL;
    if (!getstr(&r, name, sizeof(name)))
        goto bad;
    out->last_reconciled = amx_get64(&r);
    n = amx_get32(&r);
    if (r.bad || (uint64_t)n * 40 > len)
        goto bad;
    specs = calloc(n ? n : 1, sizeof(*specs));
    out->hist_head = calloc(n ? n : 1, sizeof(uint32_t));
    out->job = strdup(name);
    if (specs == NULL || out->hist_head == NULL || out->job == NULL) {
        st = amx_err_set(err, AMX_ENOMEM, "out of memory parsing a job state");
        goto fail;
    }
    for (uint32_t i = 0; i < n; i++) {
        amx_qspec_t s;
        memset(&s, 0, sizeof(s));
        if (!getstr(&r, qname, sizeof(qname)))
            goto bad;
        s.name = qname;
        s.ndim = amx_get32(&r);
        const void *shape = amx_get(&r, sizeof(s.shape));
        const unsigned char *b = amx_get(&r, 11);
        if (r.bad || s.ndim > AMX_MAX_DIMS)
            goto bad;
        memcpy(s.shape, shape, sizeof(s.shape));
        s.ncells = 1;
        for (uint32_t d = 0; d < s.ndim; d++) {
            if (s.shape[d] == 0)
                goto bad;
            s.ncells *= s.shape[d];
        }
        s.recipe.format = b[0];
        s.recipe.rule = b[1];
        s.recipe.history_reduce = b[2];
        s.recipe.nvfp4_convention = b[3];
        s.recipe.power_of_2 = b[4];
        s.accumulation = b[5];
        s.recipe.output_convention = b[6];
        s.recipe.history_convention = b[7];
        s.recipe.mxfp8_convention = b[8];
        s.peer_mode = b[9];
        s.global_axes = b[10];
        s.recipe.history_len = amx_get32(&r);
        const void *m = amx_get(&r, 4), *e = amx_get(&r, 4), *sm = amx_get(&r, 4);
        if (r.bad)
            goto bad;
        memcpy(&s.recipe.margin, m, 4);
        memcpy(&s.recipe.eps, e, 4);
        memcpy(&s.recipe.scaled_max, sm, 4);
        if (!getstr(&r, pg, sizeof(pg)) || !getstr(&r, sg, sizeof(sg)))
            goto bad;
        s.peer_group = pg;
        s.scale_group = sg;
        out->hist_head[i] = amx_get32(&r);
        if (r.bad || s.recipe.format < 1 || s.recipe.format > 4 ||
            b[3] > AMX_NVFP4_TE_PARTIAL_CAST || b[6] > 2 || b[7] > 2 || b[8] > AMX_MX_TE_2_18 ||
            b[9] > 2 || (b[9] != 0) != (s.peer_group[0] != '\0') ||
            (b[10] != 0 && (b[10] >= s.ndim || sg[0] != '\0')) ||
            (s.accumulation != 1 && s.accumulation != 2) || s.recipe.history_len == 0 ||
            s.recipe.history_len > AMX_HISTORY_MAX ||
            out->hist_head[i] >= (s.accumulation == 2 ? s.recipe.history_len : 1) ||
            !amx_valid_name(s.name) || (i > 0 && strcmp(specs[i - 1]->name, s.name) >= 0))
            goto bad;
        if (ver >= 4) {
            const unsigned char *cb = amx_get(&r, 6);
            if (r.bad)
                goto bad;
            amx_calib_t *c = &s.calib;
            c->kind = cb[0], c->method = cb[1], c->grid = cb[2];
            c->is_unsigned = cb[3], c->skip_zeros = cb[4], c->torch_cpu = cb[5];
            c->num_bins = amx_get32(&r);
            c->num_bits = amx_get32(&r);
            c->start_bin = amx_get32(&r);
            c->stride = amx_get32(&r);
            c->nsteps = amx_get32(&r);
            const void *d[4];
            for (int k = 0; k < 4; k++)
                d[k] = amx_get(&r, 8);
            if (r.bad)
                goto bad;
            memcpy(&c->percentile, d[0], 8);
            memcpy(&c->start_mult, d[1], 8);
            memcpy(&c->stop_mult, d[2], 8);
            memcpy(&c->step_size, d[3], 8);
            if (amx_qspec_check_calib(&s) != AMX_OK)
                goto bad;
        }
        if ((specs[i] = amx_qspec_dup(&s)) == NULL) {
            st = amx_err_set(err, AMX_ENOMEM, "out of memory parsing a job state");
            goto fail;
        }
        made++;
    }
    uint64_t nc = amx_get64(&r), nh = amx_get64(&r), ns = amx_get64(&r), nst = 0, nsc = 0;
    if (ver >= 4) {
        nst = amx_get64(&r);
        nsc = amx_get64(&r);
    }
    if (r.bad)
        goto bad;
    if (amx_catalog_build(specs, n, &out->cat, err) != AMX_OK) {
        st = AMX_ENOMEM;
        goto fail;
    }
    made = 0; /* the catalog owns the specs now */
    if (out->cat->ncells != nc || out->cat->nhist != nh || out->cat->nslices != ns ||
        out->cat->nstat != nst || out->cat->nscell != nsc)
        goto bad;
    out->a.accum = (float *)get_array(&r, nc * 4);
    out->a.prev = (float *)get_array(&r, nc * 4);
    out->a.hist = (float *)get_array(&r, nh * 4);
    out->a.prev_g = (float *)get_array(&r, (uint64_t)n * 4);
    out->a.out_amax = (float *)get_array(&r, nc * 4);
    out->a.out_scale = (float *)get_array(&r, nc * 4);
    out->a.out_inv = (float *)get_array(&r, nc * 4);
    out->a.out_bytes = (uint8_t *)get_array(&r, nc);
    out->a.g_amax = (float *)get_array(&r, (uint64_t)n * 4);
    out->a.g_scale = (float *)get_array(&r, (uint64_t)n * 4);
    out->a.g_inv = (float *)get_array(&r, (uint64_t)n * 4);
    out->a.prev_gs = (float *)get_array(&r, ns * 4);
    out->a.s_amax = (float *)get_array(&r, ns * 4);
    out->a.s_scale = (float *)get_array(&r, ns * 4);
    out->a.s_inv = (float *)get_array(&r, ns * 4);
    out->a.nstat = nst;
    out->a.nscell = nsc;
    if (ver >= 4) {
        out->a.stat = (double *)get_array(&r, nst * 8);
        out->a.basis = (float *)get_array(&r, nsc * 4);
        out->a.sq =
            nst > 0 ? (amx_stat_result_t *)get_array(&r, (uint64_t)n * sizeof(amx_stat_result_t))
                    : NULL;
    }
    if (ver >= 5) {
        out->pprev_ga = (const float *)get_array(&r, (uint64_t)n * 4);
        out->pprev_gs = (const float *)get_array(&r, (uint64_t)n * 4);
    }
    r.off += (8 - r.off % 8) % 8;
    if (r.bad || r.off != r.len)
        goto bad;
    free(specs);
    return AMX_OK;
bad:
    st = amx_err_set(err, AMX_EINVAL, "job state is malformed (at byte %zu of %zu)", r.off, len);
fail:
    for (uint32_t i = 0; i < made; i++)
        amx_qspec_free(specs[i]);
    free(specs);
    amx_jobstate_free(out);
    return st;
}

void amx_jobstate_free(amx_jobstate_t *js)
{
    free(js->job);
    free(js->hist_head);
    amx_catalog_free(js->cat);
    memset(js, 0, sizeof(*js));
}
