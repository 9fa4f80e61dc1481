/*
 * test_placement.c - a rank's block of a global amax tensor: parse errors,
 * the whole tensor, equality, the contiguous rows of a block in the flat
 * buffer (checked against a cell-by-cell walk), and the global slice of
 * each block slice.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "placement.h"
#include "unit.h"

/* A spec of the given shape (borrowed strings). */
static amx_qspec_t shaped(const uint32_t *shape, uint32_t ndim)
{
    amx_qspec_t s;
    memset(&s, 0, sizeof(s));
    s.name = "w";
    s.ndim = ndim;
    s.ncells = 1;
    for (uint32_t d = 0; d < ndim; d++) {
        s.shape[d] = shape[d];
        s.ncells *= shape[d];
    }
    s.peer_group = s.scale_group = "";
    return s;
}

START_TEST(parse_errors)
{
    uint32_t g[2] = {4, 6};
    amx_qspec_t s = shaped(g, 2);
    amx_placement_t pl;
    amx_err_t err = {0};
    uint32_t off[2] = {2, 3}, sh[2] = {2, 3};
    ck_assert_int_eq(amx_placement_parse(&s, off, 2, sh, 2, &pl, &err), AMX_OK);
    ck_assert_uint_eq(pl.ncells, 6);
    ck_assert_uint_eq(pl.ndim, 2);
    /* One of the two lists missing, or of another length. */
    ck_assert_int_eq(amx_placement_parse(&s, off, 2, sh, 0, &pl, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "quantizer 'w': offset has 2 and local_shape 0 entries; both need "
                              "2 (one per global dimension) or none");
    amx_err_clear(&err);
    ck_assert_int_eq(amx_placement_parse(&s, off, 1, sh, 1, &pl, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "offset has 1 and local_shape 1 entries");
    /* Past the edge, and empty. */
    uint32_t far[2] = {2, 4};
    amx_err_clear(&err);
    ck_assert_int_eq(amx_placement_parse(&s, far, 2, sh, 2, &pl, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "quantizer 'w': block at offset [2, 4] of shape [2, 3] does not lie "
                              "inside the global shape (dimension 1)");
    uint32_t empty[2] = {0, 3};
    amx_err_clear(&err);
    ck_assert_int_eq(amx_placement_parse(&s, off, 2, empty, 2, &pl, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "(dimension 0)");
    /* Offsets that overflow 32 bits when added are still outside. */
    uint32_t huge[2] = {UINT32_MAX, 0}, one[2] = {1, 1};
    amx_err_clear(&err);
    ck_assert_int_eq(amx_placement_parse(&s, huge, 2, one, 2, &pl, &err), AMX_EINVAL);
    /* Both empty: the whole tensor, equal to amx_placement_whole. */
    amx_placement_t whole;
    ck_assert_int_eq(amx_placement_parse(&s, NULL, 0, NULL, 0, &pl, &err), AMX_OK);
    amx_placement_whole(&s, &whole);
    ck_assert_int_eq(amx_placement_equal(&pl, &whole), 1);
    ck_assert_uint_eq(pl.ncells, 24);
    ck_assert_uint_eq(pl.off[0] + pl.off[1], 0);
    ck_assert_uint_eq(pl.shape[1], 6);
    ck_assert_int_eq(amx_placement_parse(&s, off, 2, sh, 2, &whole, &err), AMX_OK);
    ck_assert_int_eq(amx_placement_equal(&pl, &whole), 0);
}
END_TEST

typedef struct rows {
    uint64_t n;
    uint64_t dst[64], src[64], len[64];
} rows_t;

static void on_row(void *ud, uint64_t dst, uint64_t src, uint64_t len)
{
    rows_t *r = ud;
    ck_assert_uint_lt(r->n, 64);
    r->dst[r->n] = dst;
    r->src[r->n] = src;
    r->len[r->n] = len;
    r->n++;
}

/* Every block of a few shapes: the rows cover exactly the block's cells,
 * each where a cell-by-cell walk puts it. */
START_TEST(rows_match_a_cell_walk)
{
    uint32_t shapes[3][3] = {{5, 0, 0}, {3, 4, 0}, {2, 3, 4}};
    for (uint32_t ndim = 1; ndim <= 3; ndim++) {
        uint32_t *g = shapes[ndim - 1];
        amx_qspec_t s = shaped(g, ndim);
        /* Every offset and shape in range (small enough to try them all). */
        uint32_t off[3] = {0}, sh[3] = {1, 1, 1};
        for (;;) {
            amx_placement_t pl;
            amx_err_t err = {0};
            ck_assert_int_eq(amx_placement_parse(&s, off, ndim, sh, ndim, &pl, &err), AMX_OK);
            rows_t r = {0};
            amx_placement_rows(&pl, g, 100, on_row, &r);
            ck_assert_uint_eq(r.n, amx_placement_nrows(&pl));
            /* Cell by cell: block cell i, row-major, lies at global index. */
            uint64_t i = 0;
            for (uint64_t k = 0; k < r.n; k++) {
                ck_assert_uint_eq(r.src[k], i);
                ck_assert_uint_eq(r.len[k], sh[ndim - 1]);
                for (uint64_t c = 0; c < r.len[k]; c++, i++) {
                    uint64_t rem = i, gidx = 0;
                    uint32_t idx[3];
                    for (int d = (int)ndim - 1; d >= 0; d--) {
                        idx[d] = (uint32_t)(rem % sh[d]) + off[d];
                        rem /= sh[d];
                    }
                    for (uint32_t d = 0; d < ndim; d++)
                        gidx = gidx * g[d] + idx[d];
                    ck_assert_uint_eq(r.dst[k] + c, 100 + gidx);
                }
            }
            ck_assert_uint_eq(i, pl.ncells);
            /* Next (offset, shape), odometer style. */
            int d = 0;
            for (; d < (int)ndim; d++) {
                if (++sh[d] + off[d] <= g[d])
                    break;
                sh[d] = 1;
                if (++off[d] < g[d])
                    break;
                off[d] = 0;
            }
            if (d == (int)ndim)
                break;
        }
    }
}
END_TEST

START_TEST(scalar_is_one_row)
{
    amx_qspec_t s = shaped(NULL, 0);
    amx_placement_t pl;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_placement_parse(&s, NULL, 0, NULL, 0, &pl, &err), AMX_OK);
    ck_assert_uint_eq(pl.ncells, 1);
    ck_assert_uint_eq(amx_placement_nrows(&pl), 1);
    rows_t r = {0};
    amx_placement_rows(&pl, NULL, 7, on_row, &r);
    ck_assert_uint_eq(r.n, 1);
    ck_assert_uint_eq(r.dst[0], 7);
    ck_assert_uint_eq(r.src[0], 0);
    ck_assert_uint_eq(r.len[0], 1);
}
END_TEST

/* Experts [E=6, R=4, C=8], each rank holding experts [2, 5) and rows
 * [1, 3): block slice j is expert-major, as the global one. */
START_TEST(global_slices_of_a_block)
{
    uint32_t g[3] = {6, 4, 8};
    amx_qspec_t s = shaped(g, 3);
    uint32_t off[3] = {2, 1, 0}, sh[3] = {3, 2, 8};
    amx_placement_t pl;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_placement_parse(&s, off, 3, sh, 3, &pl, &err), AMX_OK);
    /* k = 1: one global per expert. */
    for (uint64_t j = 0; j < 3; j++)
        ck_assert_uint_eq(amx_placement_global_slice(&pl, g, 1, j), 2 + j);
    /* k = 2: one per (expert, row), row-major over [6, 4]. */
    for (uint64_t j = 0; j < 6; j++) {
        uint64_t e = 2 + j / 2, r = 1 + j % 2;
        ck_assert_uint_eq(amx_placement_global_slice(&pl, g, 2, j), e * 4 + r);
    }
    /* The whole tensor: block slices are the global ones. */
    amx_placement_whole(&s, &pl);
    for (uint64_t j = 0; j < 24; j++)
        ck_assert_uint_eq(amx_placement_global_slice(&pl, g, 2, j), j);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("placement");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, parse_errors);
    tcase_add_test(tc, rows_match_a_cell_walk);
    tcase_add_test(tc, scalar_is_one_row);
    tcase_add_test(tc, global_slices_of_a_block);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
