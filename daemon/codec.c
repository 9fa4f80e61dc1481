/*
 * codec.c - protobuf <-> C in one place: recipe, spec and membership
 * mapping, and the in-place codec of the hot messages (codec.h).
 */
#include "codec.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire.h"

/* ---- mapping ---- */

void amx_codec_recipe_in(const Amaxd__V1__Recipe *r, amx_recipe_in_t *out)
{
    memset(out, 0, sizeof(*out));
    if (r == NULL)
        return;
    out->present = 1;
    out->format = r->format;
    out->rule = r->rule;
    out->margin = r->margin;
    out->history_len = r->history_len;
    out->history_reduce = r->history_reduce;
    out->eps = r->eps;
    out->power_of_2 = r->power_of_2;
    out->nvfp4_convention = r->nvfp4_convention;
    out->output_convention = r->output_convention;
    out->history_convention = r->history_convention;
    out->mxfp8_convention = r->mxfp8_convention;
}

void amx_codec_recipe_out(const amx_recipe_t *r, Amaxd__V1__Recipe *out)
{
    amaxd__v1__recipe__init(out);
    out->format = r->format;
    out->rule = r->rule;
    out->margin = r->margin;
    out->history_len = r->history_len;
    out->history_reduce = r->history_reduce;
    out->eps = r->eps;
    out->power_of_2 = r->power_of_2;
    out->nvfp4_convention = r->nvfp4_convention;
    out->output_convention = r->output_convention;
    out->history_convention = r->history_convention;
    out->mxfp8_convention = r->mxfp8_convention;
}

void amx_codec_calib_in(const Amaxd__V1__Calibrator *c, amx_calib_in_t *out)
{
    memset(out, 0, sizeof(*out));
    if (c == NULL)
        return;
    out->present = 1;
    out->kind = c->kind;
    out->num_bins = c->num_bins;
    out->method = c->method;
    out->percentile = c->percentile;
    out->start_bin = c->start_bin;
    out->stride = c->stride;
    out->skip_zeros = c->skip_zeros;
    out->num_bits = c->num_bits;
    out->is_unsigned = c->is_unsigned;
    out->grid = c->grid;
    out->torch_cpu = c->torch_cpu;
    out->start_mult = c->start_multiplier;
    out->stop_mult = c->stop_multiplier;
    out->step_size = c->step_size;
}

void amx_codec_calib_out(const amx_calib_t *c, Amaxd__V1__Calibrator *out)
{
    amaxd__v1__calibrator__init(out);
    out->kind = (Amaxd__V1__CalibratorKind)c->kind;
    out->num_bins = c->num_bins;
    out->method = (Amaxd__V1__HistogramMethod)c->method;
    out->percentile = c->percentile;
    out->start_bin = c->start_bin;
    out->stride = c->stride;
    out->skip_zeros = c->skip_zeros;
    out->num_bits = c->num_bits;
    out->is_unsigned = c->is_unsigned;
    out->grid = (Amaxd__V1__SearchGrid)c->grid;
    out->torch_cpu = (Amaxd__V1__TorchCpu)c->torch_cpu;
    out->start_multiplier = c->start_mult;
    out->stop_multiplier = c->stop_mult;
    out->step_size = c->step_size;
}

void amx_codec_spec_in(const Amaxd__V1__QuantizerSpec *q, amx_qspec_in_t *out)
{
    memset(out, 0, sizeof(*out));
    out->name = q->name;
    out->global_shape = q->global_shape;
    out->ndim = q->n_global_shape;
    amx_codec_recipe_in(q->recipe, &out->recipe);
    out->accumulation = q->accumulation;
    out->peer_group = q->peer_group;
    out->scale_group = q->scale_group;
    out->peer_mode = q->peer_mode;
    out->global_axes = q->global_axes;
    out->offset = q->offset;
    out->n_offset = q->n_offset;
    out->local_shape = q->local_shape;
    out->n_local_shape = q->n_local_shape;
    amx_codec_calib_in(q->calibrator, &out->calib);
}

amx_status_t amx_codec_spec_out(const amx_qspec_t *s, Amaxd__V1__QuantizerSpec *q, amx_arena_t *a)
{
    amaxd__v1__quantizer_spec__init(q);
    Amaxd__V1__Recipe *r = amx_arena_alloc(a, sizeof(*r));
    if (r == NULL)
        return AMX_ENOMEM;
    amx_codec_recipe_out(&s->recipe, r);
    if (s->calib.kind != AMX_CAL_MAX) {
        /* Max quantizers go without one, as before calibrators existed. */
        Amaxd__V1__Calibrator *c = amx_arena_alloc(a, sizeof(*c));
        if (c == NULL)
            return AMX_ENOMEM;
        amx_codec_calib_out(&s->calib, c);
        q->calibrator = c;
    }
    q->name = s->name;
    q->n_global_shape = s->ndim;
    q->global_shape = (uint32_t *)s->shape;
    q->recipe = r;
    q->accumulation = s->accumulation;
    q->peer_group = s->peer_group;
    q->scale_group = s->scale_group;
    q->peer_mode = (Amaxd__V1__PeerMode)s->peer_mode;
    q->global_axes = s->global_axes;
    return AMX_OK;
}

amx_status_t amx_codec_spec_parse(const Amaxd__V1__QuantizerSpec *q, amx_qspec_t *s, amx_err_t *err)
{
    amx_qspec_in_t in;
    amx_codec_spec_in(q, &in);
    /* Another daemon sends agreed specs: no placement. */
    in.offset = in.local_shape = NULL;
    in.n_offset = in.n_local_shape = 0;
    return amx_qspec_parse(&in, UINT64_MAX, s, err);
}

amx_status_t amx_codec_members_out(const amx_membership_t *m, Amaxd__Peer__V1__Participant ***out,
                                   size_t *n, amx_arena_t *a)
{
    Amaxd__Peer__V1__Participant **v = amx_arena_alloc(a, (m->npart + 1) * sizeof(*v));
    if (v == NULL)
        return AMX_ENOMEM;
    for (uint32_t i = 0; i < m->npart; i++) {
        Amaxd__Peer__V1__Participant *x = amx_arena_alloc(a, sizeof(*x));
        if (x == NULL)
            return AMX_ENOMEM;
        amaxd__peer__v1__participant__init(x);
        x->daemon = m->part[i].daemon;
        x->incarnation = m->part[i].incarnation;
        x->address = (char *)m->part[i].addr;
        x->n_ranks = m->part[i].nranks;
        x->ranks = m->part[i].ranks;
        v[i] = x;
    }
    *out = v;
    *n = m->npart;
    return AMX_OK;
}

amx_status_t amx_codec_members_in(Amaxd__Peer__V1__Participant **v, size_t n, uint32_t world,
                                  amx_membership_t *m)
{
    memset(m, 0, sizeof(*m));
    m->world = world;
    m->part = calloc(n ? n : 1, sizeof(amx_part_t));
    if (m->part == NULL)
        return AMX_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        amx_part_t *x = &m->part[i];
        x->daemon = v[i]->daemon;
        x->incarnation = v[i]->incarnation;
        snprintf(x->addr, sizeof(x->addr), "%s", v[i]->address);
        x->ranks = malloc((v[i]->n_ranks ? v[i]->n_ranks : 1) * 4);
        m->npart = (uint32_t)i + 1;
        if (x->ranks == NULL) {
            amx_membership_free(m);
            return AMX_ENOMEM;
        }
        if (v[i]->n_ranks > 0)
            memcpy(x->ranks, v[i]->ranks, v[i]->n_ranks * 4);
        x->nranks = (uint32_t)v[i]->n_ranks;
    }
    return AMX_OK;
}

uint8_t *amx_codec_pack(const ProtobufCMessage *m, size_t *len)
{
    *len = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(*len ? *len : 1);
    if (b != NULL)
        protobuf_c_message_pack(m, b);
    return b;
}

/* ---- reading in place ---- */

/* Skips the value of a field of wire type wt at *i (a message amx_wire_check
 * accepted: no groups, every length within the message). */
static void skip_field(const uint8_t *d, size_t n, size_t *i, unsigned wt)
{
    if (wt == 0)
        (void)amx_wire_get_varint(d, n, i);
    else if (wt == 1)
        *i += 8;
    else if (wt == 5)
        *i += 4;
    else if (wt == 2)
        *i += (size_t)amx_wire_get_varint(d, n, i);
}

/* Copies a string field into the scratch's string space (NUL-terminated). */
static const char *take_str(amx_codec_scratch_t *s, size_t *at, const uint8_t *p, size_t len)
{
    char *out = s->strs + *at;
    memcpy(out, p, len);
    out[len] = '\0';
    *at += len + 1;
    return out;
}

amx_status_t amx_codec_send_parse(amx_codec_scratch_t *s, const uint8_t *d, size_t n,
                                  amx_send_req_t *q, amx_err_t *err)
{
    /* Pass 1: how many updates, how much string space. */
    size_t nup = 0, sbytes = 1, i = 0;
    while (i < n) {
        uint64_t tag = amx_wire_get_varint(d, n, &i);
        unsigned wt = (unsigned)(tag & 7);
        if (wt != 2) {
            skip_field(d, n, &i, wt);
            continue;
        }
        size_t len = (size_t)amx_wire_get_varint(d, n, &i), end = i + len;
        if (tag >> 3 == 1) {
            sbytes += len + 1;
        } else if (tag >> 3 == 4) {
            nup++;
            sbytes += 1;
            while (i < end) {
                uint64_t t = amx_wire_get_varint(d, end, &i);
                if ((t & 7) == 2 && t >> 3 == 1) {
                    size_t k = (size_t)amx_wire_get_varint(d, end, &i);
                    sbytes += k;
                    i += k;
                } else {
                    skip_field(d, end, &i, (unsigned)(t & 7));
                }
            }
        }
        i = end;
    }
    if (nup + 1 > s->ups_cap) {
        amx_update_in_t *p = realloc(s->ups, (nup + 1) * sizeof(*p));
        if (p == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory reading %zu updates", nup);
        s->ups = p;
        s->ups_cap = nup + 1;
    }
    if (sbytes > s->strs_cap) {
        char *p = realloc(s->strs, sbytes);
        if (p == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory reading %zu updates", nup);
        s->strs = p;
        s->strs_cap = sbytes;
    }
    /* Pass 2: the fields. */
    size_t at = 0, u = 0;
    *q = (amx_send_req_t){take_str(s, &at, (const uint8_t *)"", 0), 0, 0, s->ups, nup};
    i = 0;
    while (i < n) {
        uint64_t tag = amx_wire_get_varint(d, n, &i);
        uint64_t f = tag >> 3; /* compared as in pass 1 */
        unsigned wt = (unsigned)(tag & 7);
        if (wt == 0 && (f == 2 || f == 3)) {
            uint64_t v = amx_wire_get_varint(d, n, &i);
            if (f == 2)
                q->rank = (uint32_t)v;
            else
                q->epoch = v;
            continue;
        }
        if (wt != 2) {
            skip_field(d, n, &i, wt);
            continue;
        }
        size_t len = (size_t)amx_wire_get_varint(d, n, &i), end = i + len;
        if (f == 1) {
            q->job = take_str(s, &at, d + i, len);
        } else if (f == 4) {
            amx_update_in_t *up = &s->ups[u++];
            *up = (amx_update_in_t){"", NULL, 0, NULL, 0, NULL, 0, 0};
            const uint8_t *name = NULL;
            size_t name_len = 0;
            while (i < end) {
                uint64_t t = amx_wire_get_varint(d, end, &i);
                if ((t & 7) == 0 && t >> 3 == 5) {
                    up->stat_epoch = amx_wire_get_varint(d, end, &i);
                    continue;
                }
                if ((t & 7) != 2) {
                    skip_field(d, end, &i, (unsigned)(t & 7));
                    continue;
                }
                size_t k = (size_t)amx_wire_get_varint(d, end, &i);
                if (t >> 3 == 1) {
                    name = d + i;
                    name_len = k;
                } else if (t >> 3 == 2) {
                    up->values = d + i;
                    up->values_len = k;
                } else if (t >> 3 == 3) {
                    up->has_data = d + i;
                    up->has_data_len = k;
                } else if (t >> 3 == 4) {
                    up->stat = d + i;
                    up->stat_len = k;
                }
                i += k;
            }
            up->name = take_str(s, &at, name != NULL ? name : (const uint8_t *)"", name_len);
        }
        i = end;
    }
    return AMX_OK;
}

void amx_codec_scratch_trim(amx_codec_scratch_t *s, size_t keep)
{
    if (s->ups_cap * sizeof(*s->ups) > keep || keep == 0) {
        free(s->ups);
        s->ups = NULL;
        s->ups_cap = 0;
    }
    if (s->strs_cap > keep || keep == 0) {
        free(s->strs);
        s->strs = NULL;
        s->strs_cap = 0;
    }
}

amx_status_t amx_codec_packed_parse(uint8_t *d, size_t n, amx_codec_packed_in_t *in, amx_err_t *err)
{
    memset(in, 0, sizeof(*in));
    size_t i = 0;
    while (i < n) {
        uint64_t tag = amx_wire_get_varint(d, n, &i);
        uint32_t f = (uint32_t)(tag >> 3);
        switch (tag & 7) {
        case 0: {
            uint64_t v = amx_wire_get_varint(d, n, &i);
            if (f == 2)
                in->rank = (uint32_t)v;
            else if (f == 3)
                in->epoch = v;
            else if (f == 8)
                in->shm_has_data = v != 0;
            else if (f == 11)
                in->shm_stats = v != 0;
            break;
        }
        case 1:
            if (f == 4)
                memcpy(&in->layout_id, d + i, 8);
            else if (f == 7)
                memcpy(&in->shm_id, d + i, 8);
            i += 8;
            break;
        case 5:
            i += 4;
            break;
        case 2: {
            size_t len = (size_t)amx_wire_get_varint(d, n, &i);
            uint8_t *v = d + i;
            i += len;
            if (f == 1) {
                if (len > AMX_MAX_JOB_NAME)
                    return amx_err_set(err, AMX_EINVAL,
                                       "SendPacked: a job name of %zu bytes; job names have 1..%d "
                                       "characters",
                                       len, AMX_MAX_JOB_NAME);
                memcpy(in->job, v, len);
                in->job[len] = '\0';
            } else if (f == 5) {
                in->values = v;
                in->values_len = len;
            } else if (f == 6) {
                in->has_data = v;
                in->has_data_len = len;
            } else if (f == 9) {
                in->stats = v;
                in->stats_len = len;
            } else if (f == 10) {
                in->stat_epochs = v;
                in->stat_epochs_len = len;
            }
            break;
        }
        default:
            return amx_err_set(err, AMX_EINVAL, "SendPacked: a field of wire type %d",
                               (int)(tag & 7));
        }
    }
    return AMX_OK;
}

/* ---- writing a ReconcilePackedResponse in place ---- */

#define F_ALIGN 31 /* ReconcilePackedResponse.align */
#define ALIGN_TO 16

/* Room an array field of n bytes may take, padding included. */
static size_t array_room(size_t n)
{
    return 3 + ALIGN_TO + 2 + 10 + n;
}

/* Writes the header of bytes field `field` of n bytes at *pos, after a
 * padding field when needed so that the data starts ALIGN_TO-aligned in
 * memory; returns where the data goes. */
static uint8_t *put_array(uint8_t *buf, size_t *pos, uint32_t field, size_t n)
{
    uint64_t tag = ((uint64_t)field << 3) | 2;
    size_t h = amx_wire_varint_len(tag) + amx_wire_varint_len(n);
    size_t mis = (uintptr_t)(buf + *pos + h) % ALIGN_TO;
    if (mis != 0 && n > 0) {
        size_t t = ALIGN_TO - mis; /* total bytes of the padding field, >= 3 */
        while (t < 3)
            t += ALIGN_TO;
        size_t k = *pos;
        k += amx_wire_put_varint(buf + k, ((uint64_t)F_ALIGN << 3) | 2); /* 2 bytes */
        buf[k++] = (uint8_t)(t - 3);
        memset(buf + k, 0, t - 3);
        *pos = k + t - 3;
    }
    *pos += amx_wire_put_varint(buf + *pos, tag);
    *pos += amx_wire_put_varint(buf + *pos, n);
    uint8_t *d = buf + *pos;
    *pos += n;
    return d;
}

size_t amx_codec_packed_cap(size_t n, size_t q, size_t ns, int stats)
{
    size_t st = stats ? array_room(q) + 3 * array_room(8 * q) + array_room(4 * n) : 0;
    return 4 * array_room(4 * n) + 4 * array_room(n) + 7 * array_room(4 * q) + array_room(q) +
           3 * array_room(4 * ns) + st + 64;
}

void amx_codec_packed_layout(uint8_t *buf, amx_packed_t *p, size_t *pos_out, size_t *end_out)
{
    size_t n = (size_t)p->ncells, q = p->nq, ns = (size_t)p->nslices, pos = 0;
    p->amax = (float *)(void *)put_array(buf, &pos, 4, 4 * n);
    p->scale = (float *)(void *)put_array(buf, &pos, 5, 4 * n);
    p->scale_inv = (float *)(void *)put_array(buf, &pos, 6, 4 * n);
    p->g_amax = (float *)(void *)put_array(buf, &pos, 8, 4 * q);
    p->g_scale = (float *)(void *)put_array(buf, &pos, 9, 4 * q);
    p->g_inv = (float *)(void *)put_array(buf, &pos, 10, 4 * q);
    p->missing = (uint32_t *)(void *)put_array(buf, &pos, 11, 4 * q);
    p->prev_amax = (float *)(void *)put_array(buf, &pos, 13, 4 * q);
    p->prev_scale = (float *)(void *)put_array(buf, &pos, 14, 4 * q);
    if (ns > 0) {
        p->s_amax = (float *)(void *)put_array(buf, &pos, 17, 4 * ns);
        p->s_scale = (float *)(void *)put_array(buf, &pos, 18, 4 * ns);
        p->s_inv = (float *)(void *)put_array(buf, &pos, 19, 4 * ns);
    }
    if (p->stats) {
        p->st_epoch = (uint64_t *)(void *)put_array(buf, &pos, 22, 8 * q);
        p->st_total = (double *)(void *)put_array(buf, &pos, 23, 8 * q);
        p->st_over = (double *)(void *)put_array(buf, &pos, 24, 8 * q);
        p->st_basis = (float *)(void *)put_array(buf, &pos, 25, 4 * n);
        p->st_state = put_array(buf, &pos, 21, q);
    }
    p->block_scales = put_array(buf, &pos, 7, n);
    p->has_previous = put_array(buf, &pos, 12, q);
    *pos_out = pos;
    p->filled = put_array(buf, &pos, 16, n);
    *end_out = pos;
}

size_t amx_codec_packed_finish(uint8_t *b, size_t pos, uint64_t epoch, uint64_t next_epoch,
                               uint64_t layout_id, int peer_fill_known)
{
    b[pos++] = (1 << 3) | 0;
    pos += amx_wire_put_varint(b + pos, epoch);
    b[pos++] = (2 << 3) | 0;
    pos += amx_wire_put_varint(b + pos, next_epoch);
    b[pos++] = (3 << 3) | 1;
    memcpy(b + pos, &layout_id, 8); /* fixed64, little-endian host */
    pos += 8;
    if (peer_fill_known) {
        b[pos++] = (15 << 3) | 0;
        b[pos++] = 1;
    }
    return pos;
}
