/*
 * test_state_host.c - the host state backend (state_host.c) through its
 * ops table: pending buffers (merge, flip, unflip, lazy growth), the
 * collective's buffers, finish (accumulation, resets, peer fill and
 * share, scale groups, global slices, counts), layout changes on both
 * threads' sides, export and import, and the simulated device fault.
 */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "jobstate.h"
#include "log.h"
#include "postproc.h"
#include "unit.h"

/* A state of the host backend laid out for `cat`, with `vals` (ncells,
 * -inf = no data) as one epoch's reduced values, finished once. */
static amx_state_t *finished(const amx_catalog_t *cat, amx_qdesc_t *d, const float *vals)
{
    amx_err_t err = {0};
    amx_state_t *st;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    amx_catalog_layout(cat, d);
    amx_layout_change_t lc = {
        .ncells = cat->ncells, .nhist = cat->nhist, .nq = cat->n, .nslices = cat->nslices};
    ck_assert_int_eq(st->ops->reserve_pending(st, cat->ncells, &err), AMX_OK);
    ck_assert_int_eq(st->ops->remap(st, &lc, &err), AMX_OK);
    amx_run_t run = {0, 0, cat->ncells};
    ck_assert_int_eq(st->ops->merge(st, vals, cat->ncells, &run, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    ck_assert_int_eq(
        st->ops->finish(st, d, cat->n, cat->ncells, cat->npeer, cat->nscale, 1, 1, &err), AMX_OK);
    st->ops->publish(st);
    return st;
}

static amx_qspec_t *spec_mode(const char *name, uint32_t n, const char *peer, int mode)
{
    amx_qspec_t *s = unit_spec(name, n, peer);
    s->peer_mode = (uint8_t)mode;
    return s;
}

START_TEST(host_finish_fill_and_share)
{
    amx_err_t err = {0};
    const float X = -INFINITY;
    /* Sorted: f.a f.b s.a s.b; groups "fill" and "share", same data. */
    amx_qspec_t *q[4] = {
        spec_mode("f.a", 3, "fill", AMX_PEER_FILL), spec_mode("f.b", 2, "fill", AMX_PEER_FILL),
        spec_mode("s.a", 3, "share", AMX_PEER_SHARE), spec_mode("s.b", 2, "share", AMX_PEER_SHARE)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 4, &cat, &err), AMX_OK);
    amx_qdesc_t d[4];
    float v[10] = {1, X, 5, X, X, 1, X, 5, X, X};
    amx_state_t *st = finished(cat, d, v);
    ck_assert_int_eq(d[2].peer_mode, AMX_PEER_SHARE);
    float amax[10], scale[10], inv[10];
    uint8_t bytes[10], marks[10];
    amx_run_t run = {0, 0, 10};
    ck_assert_int_eq(st->ops->read_results(st, &run, 1, 10, amax, scale, inv, bytes, &err), AMX_OK);
    ck_assert_int_eq(st->ops->read_filled(st, &run, 1, marks, &err), AMX_OK);
    static const float want[10] = {1, 5, 5, 5, 5, 5, 5, 5, 5, 5};
    static const uint8_t raised[10] = {0, 1, 0, 1, 1, 1, 1, 0, 1, 1};
    for (int i = 0; i < 10; i++) {
        ck_assert_float_eq(amax[i], want[i]);
        ck_assert_uint_eq(marks[i], raised[i]);
        ck_assert_float_eq(scale[i], 448.0f / want[i]);
    }
    ck_assert_uint_eq(st->last_filled, 7);
    ck_assert_uint_eq(st->last_missing, 0);
    for (int i = 0; i < 4; i++)
        ck_assert_float_eq(st->g_amax[st->front][i], 5.0f);
    amx_state_destroy(st);
    amx_catalog_free(cat);
    /* The per-cell rule itself. */
    uint8_t r;
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_SHARE, 2.0f, 5.0f, &r), 5.0f);
    ck_assert_uint_eq(r, 1);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_FILL, 2.0f, 5.0f, &r), 2.0f);
    ck_assert_uint_eq(r, 0);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_SHARE, X, X, &r), X);
    ck_assert_uint_eq(r, 0);
    ck_assert_float_eq(amx_pp_peer(AMX_PEER_FILL, X, 3.0f, &r), 3.0f);
    ck_assert_uint_eq(r, 1);
}
END_TEST

/* A [4, 2, 3] NVFP4 spec with global_axes k. */
static amx_qspec_t *spec_sliced(const char *name, uint32_t k)
{
    amx_qspec_t *s = unit_spec(name, 4, NULL);
    s->ndim = 3;
    s->shape[1] = 2;
    s->shape[2] = 3;
    s->ncells = 24;
    s->recipe.format = AMX_FMT_NVFP4;
    s->recipe.rule = 0;
    s->recipe.nvfp4_convention = AMX_NVFP4_TE;
    s->recipe.output_convention = AMX_OUT_TE;
    s->recipe.scaled_max = 0.0f;
    s->global_axes = (uint8_t)k;
    return s;
}

START_TEST(host_finish_global_slices)
{
    amx_err_t err = {0};
    /* "a" scalar, "w" per-expert globals, "z" per-[E, R] globals. */
    amx_qspec_t *q[3] = {unit_spec("a", 0, NULL), spec_sliced("w", 1), spec_sliced("z", 2)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 3, &cat, &err), AMX_OK);
    ck_assert_uint_eq(cat->nslices, 12);
    amx_qdesc_t d[3];
    float v[49];
    v[0] = 2.0f;
    for (int i = 0; i < 24; i++)
        v[1 + i] = v[25 + i] = (float)(i % 5 + 1) * (float)(1 << (4 * (i / 6)));
    v[1 + 7] = -INFINITY; /* a cell without data reads 0 */
    amx_state_t *st = finished(cat, d, v);
    ck_assert_uint_eq(d[0].nslices, 0);
    ck_assert_uint_eq(d[1].gbase, 0);
    ck_assert_uint_eq(d[1].nslices, 4);
    ck_assert_uint_eq(d[1].slice_cells, 6);
    ck_assert_uint_eq(d[2].gbase, 4);
    ck_assert_uint_eq(d[2].slice_cells, 3);
    int f = st->front;
    ck_assert_uint_eq(st->out_ns[f], 12);
    float amax[49], scale[49], inv[49];
    uint8_t bytes[49];
    amx_run_t run = {0, 0, 49};
    ck_assert_int_eq(st->ops->read_results(st, &run, 1, 49, amax, scale, inv, bytes, &err), AMX_OK);
    for (uint32_t qi = 1; qi < 3; qi++) {
        for (uint64_t sl = 0; sl < d[qi].nslices; sl++) {
            float m = 0.0f;
            for (uint64_t c = 0; c < d[qi].slice_cells; c++) {
                float a = v[d[qi].base + sl * d[qi].slice_cells + c];
                m = a > m ? a : m;
            }
            uint64_t g = d[qi].gbase + sl;
            ck_assert_float_eq(st->s_amax[f][g], m);
            ck_assert_float_eq(st->s_scale[f][g], amx_nvfp4_global_encode(m));
            ck_assert_float_eq(st->s_inv[f][g], amx_nvfp4_global_decode(AMX_OUT_TE, m));
            for (uint64_t c = 0; c < d[qi].slice_cells; c++) {
                uint64_t i = d[qi].base + sl * d[qi].slice_cells + c;
                float a = v[i] > 0.0f ? v[i] : 0.0f;
                ck_assert_uint_eq(bytes[i], amx_nvfp4_block_te(a, amx_nvfp4_global_encode(m)));
            }
        }
        /* The per-quantizer global keeps its meaning: the max over all. */
        ck_assert_float_eq(st->g_amax[f][qi], 5.0f * 4096.0f);
    }
    /* Serialized and imported: the same per-slice state. */
    void *blob;
    size_t len;
    ck_assert_int_eq(amx_jobstate_export("job", 1, cat, d, st, 0, &blob, &len, &err), AMX_OK);
    amx_jobstate_t js;
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    ck_assert_uint_eq(js.cat->nslices, 12);
    ck_assert_uint_eq(js.cat->hash, cat->hash);
    ck_assert_int_eq(js.cat->q[1]->global_axes, 1);
    for (int i = 0; i < 12; i++)
        ck_assert_float_eq(js.a.s_amax[i], st->s_amax[f][i]);
    amx_state_t *st2;
    ck_assert_int_eq(amx_state_create("host", 0, &st2, &err), AMX_OK);
    ck_assert_int_eq(st2->ops->import_state(st2, js.cat->ncells, js.cat->nhist, js.cat->n,
                                            js.cat->nslices, &js.a, &err),
                     AMX_OK);
    st2->ops->publish(st2);
    for (int i = 0; i < 12; i++) {
        ck_assert_float_eq(st2->s_amax[st2->front][i], st->s_amax[f][i]);
        ck_assert_float_eq(st2->s_scale[st2->front][i], st->s_scale[f][i]);
    }
    amx_jobstate_free(&js);
    free(blob);
    amx_state_destroy(st2);
    /* A layout change keeps a sliced quantizer's slices (runs move them). */
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* ---- pending buffers ---- */

/* The in-flight buffer's data cells as the collective would send them. */
static const float *in_flight(amx_state_t *st, uint64_t ncells)
{
    amx_err_t err = {0};
    float hdr[AMX_HDR_CELLS], *send, *recv;
    void *stream = (void *)1;
    for (int i = 0; i < AMX_HDR_CELLS; i++)
        hdr[i] = (float)i;
    ck_assert_int_eq(st->ops->prepare(st, hdr, ncells, &send, &recv, &stream, &err), AMX_OK);
    ck_assert_ptr_null(stream);
    ck_assert_ptr_ne(send, recv);
    for (int i = 0; i < AMX_HDR_CELLS; i++)
        ck_assert_float_eq(send[i], (float)i);
    return send + AMX_HDR_CELLS;
}

START_TEST(merge_flip_and_unflip)
{
    amx_err_t err = {0};
    amx_state_t *st;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    ck_assert_str_eq(st->ops->name, "host");
    ck_assert_int_eq(st->ops->on_device, 0);
    ck_assert_int_eq(st->ops->reserve_pending(st, 6, &err), AMX_OK);
    ck_assert_uint_eq(st->pend_cells, 6);
    /* Two runs into the same cells: max-merged; cells nobody wrote: -inf. */
    float v[5] = {1, 5, 2, 3, 0.5f};
    amx_run_t runs[2] = {{0, 0, 3}, {1, 3, 2}};
    ck_assert_int_eq(st->ops->merge(st, v, 5, runs, 2, 1, &err), AMX_OK);
    st->ops->flip(st);
    const float *f = in_flight(st, 6);
    static const float want[6] = {1, 5, 2, -INFINITY, -INFINITY, -INFINITY};
    for (int i = 0; i < 6; i++)
        ck_assert_msg(f[i] == want[i], "cell %d: %g, expected %g", i, (double)f[i],
                      (double)want[i]);
    /* The new active buffer is clean: what arrives now lands there. */
    float w[6] = {9, 0, 0, 0, 0, 4};
    amx_run_t all = {0, 0, 6};
    ck_assert_int_eq(st->ops->merge(st, w, 6, &all, 1, 0, &err), AMX_OK);
    /* A failed epoch: the in-flight contributions go back, max-merged,
     * and the in-flight buffer is cleared. */
    ck_assert_int_eq(st->ops->unflip(st, 1, &err), AMX_OK);
    st->ops->flip(st);
    f = in_flight(st, 6);
    static const float back[6] = {9, 5, 2, 0, 0, 4};
    for (int i = 0; i < 6; i++)
        ck_assert_msg(f[i] == back[i], "cell %d: %g, expected %g", i, (double)f[i],
                      (double)back[i]);
    st->ops->flip(st);
    f = in_flight(st, 6);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(f[i] == -INFINITY, "cell %d of the cleared buffer: %g", i, (double)f[i]);
    /* A failed epoch whose contributions were for an epoch the cluster had
     * already reconciled: they are dropped, what arrived since stays. */
    float x[6] = {20, 20, 20, 20, 20, 20};
    ck_assert_int_eq(st->ops->merge(st, x, 6, &all, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    float y[6] = {1, 2, 3, 4, 5, 6};
    ck_assert_int_eq(st->ops->merge(st, y, 6, &all, 1, 0, &err), AMX_OK);
    ck_assert_int_eq(st->ops->unflip(st, 0, &err), AMX_OK);
    st->ops->flip(st);
    f = in_flight(st, 6);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(f[i] == y[i], "cell %d after a dropping unflip: %g, expected %g", i,
                      (double)f[i], (double)y[i]);
    st->ops->flip(st);
    f = in_flight(st, 6);
    for (int i = 0; i < 6; i++)
        ck_assert_msg(f[i] == -INFINITY, "cell %d of the dropped buffer: %g", i, (double)f[i]);
    /* Never shrinks. */
    ck_assert_int_eq(st->ops->reserve_pending(st, 2, &err), AMX_OK);
    ck_assert_uint_eq(st->pend_cells, 6);
    amx_state_destroy(st);
}
END_TEST

/* A large growth: new cells left for fill_pending (another thread), then
 * -inf like any fresh cell; kept cells keep their values. */
START_TEST(lazy_growth)
{
    amx_err_t err = {0};
    amx_state_t *st;
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    ck_assert_ptr_nonnull(st->ops->grow_pending);
    ck_assert_int_eq(st->ops->reserve_pending(st, 3, &err), AMX_OK);
    float v[3] = {7, 8, 9};
    amx_run_t all = {0, 0, 3};
    ck_assert_int_eq(st->ops->merge(st, v, 3, &all, 1, 0, &err), AMX_OK);
    ck_assert_int_eq(st->ops->grow_pending(st, 1000, &err), AMX_OK);
    ck_assert_uint_eq(st->pend_cells, 1000);
    /* Two growths before the fill: one fill covers both. */
    ck_assert_int_eq(st->ops->grow_pending(st, 2000, &err), AMX_OK);
    st->ops->fill_pending(st);
    st->ops->flip(st);
    const float *f = in_flight(st, 2000);
    ck_assert_float_eq(f[0], 7.0f);
    ck_assert_float_eq(f[2], 9.0f);
    for (int i = 3; i < 2000; i++)
        ck_assert_msg(f[i] == -INFINITY, "grown cell %d: %g", i, (double)f[i]);
    /* The other buffer grew too. */
    st->ops->flip(st);
    f = in_flight(st, 2000);
    ck_assert_msg(f[1999] == -INFINITY, "grown cell of the other buffer: %g", (double)f[1999]);
    amx_state_destroy(st);
}
END_TEST

/* ---- finish ---- */

/* Finish reads what the collective wrote into recv (several daemons) or
 * the in-flight buffer itself (one). */
START_TEST(finish_from_recv_or_send)
{
    amx_err_t err = {0};
    amx_qspec_t *q[1] = {unit_spec("a", 3, NULL)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 1, &cat, &err), AMX_OK);
    amx_qdesc_t d[1];
    float mine[3] = {1, 1, 1};
    amx_state_t *st = finished(cat, d, mine); /* from_send */
    ck_assert_float_eq(st->g_amax[st->front][0], 1.0f);
    /* Next epoch: the collective's result (another daemon's max) in recv. */
    amx_run_t all = {0, 0, 3};
    float two[3] = {2, 2, 2};
    ck_assert_int_eq(st->ops->merge(st, two, 3, &all, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    float hdr[AMX_HDR_CELLS] = {0}, *send, *recv, back_hdr[AMX_HDR_CELLS];
    void *stream;
    hdr[5] = 42.0f;
    ck_assert_int_eq(st->ops->prepare(st, hdr, 3, &send, &recv, &stream, &err), AMX_OK);
    memcpy(recv, send, (AMX_HDR_CELLS + 3) * sizeof(float));
    recv[AMX_HDR_CELLS + 1] = 6.0f;
    ck_assert_int_eq(st->ops->read_header(st, back_hdr, &err), AMX_OK);
    ck_assert_float_eq(back_hdr[5], 42.0f);
    ck_assert_int_eq(st->ops->finish(st, d, 1, 3, 0, 0, 0, 0, &err), AMX_OK);
    st->ops->publish(st);
    float amax[3], scale[3], inv[3];
    uint8_t bytes[3];
    ck_assert_int_eq(st->ops->read_results(st, &all, 1, 3, amax, scale, inv, bytes, &err), AMX_OK);
    ck_assert_float_eq(amax[0], 2.0f);
    ck_assert_float_eq(amax[1], 6.0f);
    ck_assert_float_eq(scale[1], 448.0f / 6.0f);
    ck_assert_float_eq(inv[1], 6.0f / 448.0f);
    ck_assert_float_eq(st->g_amax[st->front][0], 6.0f);
    /* The in-flight buffer was cleared by finish (two flips bring it
     * back in flight). */
    st->ops->flip(st);
    st->ops->flip(st);
    const float *f = in_flight(st, 3);
    ck_assert_msg(f[0] == -INFINITY, "in-flight cell after finish: %g", (double)f[0]);
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* One more epoch of `vals` finished from the in-flight buffer and published. */
static void next_epoch(amx_state_t *st, const amx_catalog_t *cat, const amx_qdesc_t *d,
                       const float *vals)
{
    amx_err_t err = {0};
    amx_run_t all = {0, 0, cat->ncells};
    ck_assert_int_eq(st->ops->merge(st, vals, cat->ncells, &all, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    ck_assert_int_eq(
        st->ops->finish(st, d, cat->n, cat->ncells, cat->npeer, cat->nscale, 1, 0, &err), AMX_OK);
    st->ops->publish(st);
}

START_TEST(running_max_reset_and_scale_groups)
{
    amx_err_t err = {0};
    /* "k" and "q" share a scale group; "r" is alone. */
    amx_qspec_t *q[3] = {unit_spec("k", 1, NULL), unit_spec("q", 1, NULL), unit_spec("r", 2, NULL)};
    q[0]->scale_group = "qkv";
    q[1]->scale_group = "qkv";
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 3, &cat, &err), AMX_OK);
    amx_qdesc_t d[3];
    float e1[4] = {7, 1, 4, 2};
    amx_state_t *st = finished(cat, d, e1);
    int f = st->front;
    ck_assert_float_eq(st->g_amax[f][0], 7.0f);
    ck_assert_float_eq(st->g_amax[f][1], 7.0f); /* the group's */
    ck_assert_float_eq(st->g_scale[f][1], 64.0f);
    ck_assert_float_eq(st->g_amax[f][2], 4.0f);
    /* Running max across epochs; cells without data keep it. */
    float e2[4] = {3, -INFINITY, 1, 5};
    next_epoch(st, cat, d, e2);
    f = st->front;
    float amax[4], scale[4], inv[4];
    uint8_t bytes[4];
    amx_run_t all = {0, 0, 4};
    ck_assert_int_eq(st->ops->read_results(st, &all, 1, 4, amax, scale, inv, bytes, &err), AMX_OK);
    ck_assert_float_eq(amax[0], 7.0f);
    ck_assert_float_eq(amax[1], 1.0f);
    ck_assert_float_eq(amax[2], 4.0f);
    ck_assert_float_eq(amax[3], 5.0f);
    ck_assert_uint_eq(st->last_missing, 0);
    /* A reset of "r": its running max restarts from this epoch. */
    d[2].reset = 1;
    float e3[4] = {-INFINITY, -INFINITY, 0.5f, -INFINITY};
    next_epoch(st, cat, d, e3);
    d[2].reset = 0;
    ck_assert_int_eq(st->ops->read_results(st, &all, 1, 4, amax, scale, inv, bytes, &err), AMX_OK);
    ck_assert_float_eq(amax[2], 0.5f);
    ck_assert_msg(amax[3] == -INFINITY, "cell 3 after its reset: %g", (double)amax[3]);
    ck_assert_float_eq(scale[3], 1.0f); /* no data: scale 1 */
    ck_assert_float_eq(amax[0], 7.0f);  /* the others kept theirs */
    ck_assert_uint_eq(st->last_missing, 1);
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

START_TEST(finish_refuses_a_wrong_layout_and_simulates_faults)
{
    amx_err_t err = {0};
    amx_qspec_t *q[1] = {unit_spec("a", 2, NULL)};
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 1, &cat, &err), AMX_OK);
    amx_qdesc_t d[1];
    float v[2] = {1, 2};
    amx_state_t *st = finished(cat, d, v);
    st->ops->flip(st);
    ck_assert_int_eq(st->ops->finish(st, d, 1, 3, 0, 0, 1, 0, &err), AMX_EINTERNAL);
    AMX_ASSERT_HAS(err.msg, "finish over 3 cells, the state holds 2");
    amx_state_destroy(st);
    /* AMAXD_TEST_DEVICE_FAULT (read when a state is made): every finish
     * fails as a device would. Fork mode keeps the variable here. */
    setenv("AMAXD_TEST_DEVICE_FAULT", "1", 1);
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    amx_layout_change_t lc = {.ncells = 2, .nq = 1};
    ck_assert_int_eq(st->ops->reserve_pending(st, 2, &err), AMX_OK);
    ck_assert_int_eq(st->ops->remap(st, &lc, &err), AMX_OK);
    st->ops->flip(st);
    amx_err_clear(&err);
    ck_assert_int_eq(st->ops->finish(st, d, 1, 2, 0, 0, 1, 0, &err), AMX_EDEVICE);
    AMX_ASSERT_HAS(err.msg, "simulated device fault");
    amx_state_destroy(st);
    setenv("AMAXD_TEST_DEVICE_FAULT", "0", 1);
    ck_assert_int_eq(amx_state_create("host", 0, &st, &err), AMX_OK);
    ck_assert_int_eq(st->ops->reserve_pending(st, 2, &err), AMX_OK);
    ck_assert_int_eq(st->ops->remap(st, &lc, &err), AMX_OK);
    st->ops->flip(st);
    ck_assert_int_eq(st->ops->finish(st, d, 1, 2, 0, 0, 1, 0, &err), AMX_OK);
    amx_state_destroy(st);
    amx_catalog_free(cat);
}
END_TEST

/* ---- layout changes ---- */

/* From {a[2], c[1]} to {a[2], b[3], c[1]}: the engine's remap moves the
 * replicated state, the results and the in-flight buffer; the loop's
 * remap_active moves what arrived meanwhile. */
START_TEST(remap_moves_state_results_and_pending)
{
    amx_err_t err = {0};
    amx_qspec_t *q0[2] = {unit_spec("a", 2, NULL), unit_spec("c", 1, NULL)};
    amx_catalog_t *c0;
    ck_assert_int_eq(amx_catalog_build(q0, 2, &c0, &err), AMX_OK);
    amx_qdesc_t d0[2];
    float e1[3] = {1, 2, 3};
    amx_state_t *st = finished(c0, d0, e1);
    /* Sent during the next epoch: in the active buffer, old layout. */
    float late[3] = {-INFINITY, 5, 6};
    amx_run_t all = {0, 0, 3};
    ck_assert_int_eq(st->ops->merge(st, late, 3, &all, 1, 0, &err), AMX_OK);
    /* b's provisional cells sat after the agreed ones, at 3..5. */
    ck_assert_int_eq(st->ops->reserve_pending(st, 6, &err), AMX_OK);
    float bv[3] = {7, 8, 9};
    amx_run_t prov = {3, 0, 3};
    ck_assert_int_eq(st->ops->merge(st, bv, 3, &prov, 1, 0, &err), AMX_OK);
    st->ops->flip(st);
    /* The new layout: a 0..1, b 2..4, c 5. */
    amx_run_t cells[2] = {{0, 0, 2}, {5, 2, 1}}, qs[2] = {{0, 0, 1}, {2, 1, 1}};
    amx_run_t pend[3] = {{0, 0, 2}, {2, 3, 3}, {5, 2, 1}};
    amx_layout_change_t lc = {.ncells = 6,
                              .nq = 3,
                              .cells = cells,
                              .ncell_runs = 2,
                              .qs = qs,
                              .nq_runs = 2,
                              .pend = pend,
                              .npend_runs = 3};
    ck_assert_int_eq(st->ops->remap(st, &lc, &err), AMX_OK);
    ck_assert_uint_eq(st->ncells, 6);
    ck_assert_uint_eq(st->nq, 3);
    /* The in-flight buffer in the new layout. */
    const float *f = in_flight(st, 6);
    static const float want[6] = {-INFINITY, 5, 7, 8, 9, 6};
    for (int i = 0; i < 6; i++)
        ck_assert_msg(f[i] == want[i], "in-flight cell %d: %g, expected %g", i, (double)f[i],
                      (double)want[i]);
    /* The back results: the published ones, moved (b has none yet). */
    st->ops->publish(st);
    float amax[6], scale[6], inv[6];
    uint8_t bytes[6], marks[6];
    amx_run_t six = {0, 0, 6};
    ck_assert_int_eq(st->ops->read_results(st, &six, 1, 6, amax, scale, inv, bytes, &err), AMX_OK);
    ck_assert_float_eq(amax[1], 2.0f);
    ck_assert_msg(amax[2] == -INFINITY, "b's result before its first epoch: %g", (double)amax[2]);
    ck_assert_float_eq(scale[2], 1.0f);
    ck_assert_float_eq(amax[5], 3.0f);
    ck_assert_float_eq(st->g_amax[st->front][2], 3.0f);
    ck_assert_float_eq(st->g_amax[st->front][1], 0.0f);
    /* Which cells were filled is not known for remapped results. */
    ck_assert_int_eq(st->ops->read_filled(st, &six, 1, marks, &err), AMX_EUNAVAIL);
    /* The loop's side: what arrived in its active buffer during the
     * epoch, in the old layout (c at 2, b's provisional cells at 3..5),
     * moves with remap_active. */
    float more[2] = {11, 12};
    amx_run_t old_runs[2] = {{2, 0, 1}, {4, 1, 1}};
    ck_assert_int_eq(st->ops->merge(st, more, 2, old_runs, 2, 0, &err), AMX_OK);
    ck_assert_int_eq(st->ops->remap_active(st, &lc, &err), AMX_OK);
    ck_assert_uint_eq(st->pend_cells, 6);
    st->ops->flip(st);
    f = in_flight(st, 6);
    static const float moved[6] = {-INFINITY, -INFINITY, -INFINITY, 12, -INFINITY, 11};
    for (int i = 0; i < 6; i++)
        ck_assert_msg(f[i] == moved[i], "active cell %d after remap_active: %g, expected %g", i,
                      (double)f[i], (double)moved[i]);
    amx_state_destroy(st);
    amx_catalog_free(c0);
}
END_TEST

/* ---- export and import ---- */

START_TEST(export_import_round_trip)
{
    amx_err_t err = {0};
    amx_qspec_t *q[2] = {unit_spec("d", 2, NULL), unit_spec("e", 3, "g")};
    q[0]->accumulation = AMX_ACC_PER_EPOCH;
    q[0]->recipe.rule = AMX_RULE_DELAYED;
    q[0]->recipe.history_len = 2;
    q[0]->recipe.history_convention = AMX_HISTCONV_TE;
    amx_catalog_t *cat;
    ck_assert_int_eq(amx_catalog_build(q, 2, &cat, &err), AMX_OK);
    amx_qdesc_t d[2];
    float e1[5] = {3, 1, 2, -INFINITY, 4};
    amx_state_t *a = finished(cat, d, e1);
    float e2[5] = {1, 6, -INFINITY, 5, 1};
    next_epoch(a, cat, d, e2);
    /* A's state into B, a fresh state (a daemon catching up). */
    void *blob;
    size_t len;
    ck_assert_int_eq(amx_jobstate_export("j", 2, cat, d, a, 0, &blob, &len, &err), AMX_OK);
    amx_jobstate_t js;
    ck_assert_int_eq(amx_jobstate_parse(blob, len, &js, &err), AMX_OK);
    amx_state_t *b;
    ck_assert_int_eq(amx_state_create("host", 0, &b, &err), AMX_OK);
    ck_assert_int_eq(
        b->ops->import_state(b, cat->ncells, cat->nhist, cat->n, cat->nslices, &js.a, &err),
        AMX_OK);
    b->ops->publish(b);
    ck_assert_int_eq(b->ops->reserve_pending(b, cat->ncells, &err), AMX_OK);
    /* The same results, then the same next epoch on both. */
    float ra[5], rb[5], sa[5], sb[5], ia[5], ib[5];
    uint8_t ba[5], bb[5];
    amx_run_t all = {0, 0, 5};
    ck_assert_int_eq(a->ops->read_results(a, &all, 1, 5, ra, sa, ia, ba, &err), AMX_OK);
    ck_assert_int_eq(b->ops->read_results(b, &all, 1, 5, rb, sb, ib, bb, &err), AMX_OK);
    ck_assert_int_eq(memcmp(ra, rb, sizeof(ra)), 0);
    ck_assert_int_eq(memcmp(sa, sb, sizeof(sa)), 0);
    float e3[5] = {0.5f, 0.25f, 9, -INFINITY, -INFINITY};
    next_epoch(a, cat, d, e3);
    next_epoch(b, cat, d, e3);
    ck_assert_int_eq(a->ops->read_results(a, &all, 1, 5, ra, sa, ia, ba, &err), AMX_OK);
    ck_assert_int_eq(b->ops->read_results(b, &all, 1, 5, rb, sb, ib, bb, &err), AMX_OK);
    for (int i = 0; i < 5; i++) {
        ck_assert_msg(memcmp(&ra[i], &rb[i], 4) == 0, "amax %d: %g vs %g", i, (double)ra[i],
                      (double)rb[i]);
        ck_assert_msg(memcmp(&sa[i], &sb[i], 4) == 0, "scale %d: %g vs %g", i, (double)sa[i],
                      (double)sb[i]);
    }
    /* The window of "d" kept epoch 2's values: 1 and 6 are still in it. */
    ck_assert_float_eq(ra[0], 1.0f);
    ck_assert_float_eq(ra[1], 6.0f);
    ck_assert_float_eq(ra[2], 9.0f);
    ck_assert_float_eq(ra[3], 5.0f); /* peer group "g": running max kept */
    for (int k = 0; k < 2; k++)
        ck_assert_float_eq(a->g_scale[a->front][k], b->g_scale[b->front][k]);
    /* An export that does not match the state's sizes is refused. */
    amx_state_arrays_t none = {0};
    ck_assert_int_eq(a->ops->export_state(a, 4, cat->nhist, cat->n, 0, 0, &none, &err),
                     AMX_EINTERNAL);
    AMX_ASSERT_HAS(err.msg, "state export of 4 cells");
    amx_jobstate_free(&js);
    free(blob);
    amx_state_destroy(a);
    amx_state_destroy(b);
    amx_catalog_free(cat);
}
END_TEST

int main(void)
{
    amx_log_level = AMX_LOG_ERROR;
    Suite *s = suite_create("state_host");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, merge_flip_and_unflip);
    tcase_add_test(tc, lazy_growth);
    tcase_add_test(tc, finish_from_recv_or_send);
    tcase_add_test(tc, running_max_reset_and_scale_groups);
    tcase_add_test(tc, finish_refuses_a_wrong_layout_and_simulates_faults);
    tcase_add_test(tc, host_finish_fill_and_share);
    tcase_add_test(tc, host_finish_global_slices);
    tcase_add_test(tc, remap_moves_state_results_and_pending);
    tcase_add_test(tc, export_import_round_trip);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
