/*
 * test_job.c - a job's own section of its snapshot (job_snap.c): counters,
 * every local rank's live placements by quantizer name (superseded ones and
 * quantizers outside the catalog left out), through the snapshot file and
 * back; and the rank-to-slot lookup of job.h.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "job_snap.h"
#include "log.h"
#include "unit_job.h"

static amx_job_t job;

static void teardown(void)
{
    unit_job_free(&job);
}

START_TEST(placements_by_name)
{
    amx_qspec_t *agreed[2] = {unit_spec("w", 8, NULL), unit_spec("b", 1, NULL)};
    amx_qspec_t *prop[1] = {unit_spec("new", 2, NULL)};
    unit_job_make(&job, "j", 3, 2, agreed, 2, prop, 1);
    job.epochs_ok = 7;
    job.epochs_failed = 2;
    /* Rank 1 re-registered "w" (lid 1) with another block: its first
     * placement is superseded. */
    amx_lrank_t *r1 = &job.lr[1];
    ck_assert_uint_eq(r1->pl_lid[1], 1);
    amx_placement_t half = {1, {4}, {4}, 4};
    r1->pls = realloc(r1->pls, (r1->npls + 1) * sizeof(*r1->pls));
    r1->pl_lid = realloc(r1->pl_lid, (r1->npls + 1) * sizeof(*r1->pl_lid));
    r1->pls[r1->npls] = half;
    r1->pl_lid[r1->npls] = 1;
    r1->pl_of[1] = ++r1->npls;
    amx_snap_meta_t m;
    ck_assert_int_eq(amx_job_snap_meta(&job, job.cat, &m), AMX_OK);
    ck_assert_str_eq(m.job, "j");
    ck_assert_ptr_eq(m.job, job.name); /* borrowed */
    ck_assert_uint_eq(m.world, 3);
    ck_assert_uint_eq(m.epochs_ok, 7);
    ck_assert_uint_eq(m.epochs_failed, 2);
    ck_assert_uint_eq(m.nranks, 2);
    /* Rank 0: b and w (catalog order of its table), not the proposal. */
    ck_assert_uint_eq(m.ranks[0].rank, 0);
    ck_assert_uint_eq(m.ranks[0].n, 2);
    ck_assert_str_eq(m.ranks[0].pls[0].name, "b");
    ck_assert_str_eq(m.ranks[0].pls[1].name, "w");
    ck_assert_uint_eq(m.ranks[0].pls[1].pl.ncells, 8);
    /* Rank 1: b, and w's live block only. */
    ck_assert_uint_eq(m.ranks[1].n, 2);
    ck_assert_str_eq(m.ranks[1].pls[1].name, "w");
    ck_assert_uint_eq(m.ranks[1].pls[1].pl.off[0], 4);
    ck_assert_uint_eq(m.ranks[1].pls[1].pl.ncells, 4);
    ck_assert_ptr_null(m.prev_ok);
    /* Through the snapshot file and back. */
    char dir[] = "/tmp/amx-jobsnap-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    amx_err_t err = {0};
    void *blob;
    size_t blen;
    ck_assert_int_eq(
        amx_jobstate_export("j", 7, job.cat, job.desc, job.state, 0, &blob, &blen, &err), AMX_OK);
    m.state_len = blen;
    void *meta;
    size_t mlen;
    ck_assert_int_eq(amx_snapshot_encode_meta(&m, &meta, &mlen, &err), AMX_OK);
    ck_assert_int_eq(amx_snapshot_write(dir, "j", meta, mlen, blob, blen, &err), AMX_OK);
    free(meta);
    free(blob);
    amx_job_snap_meta_free(&m);
    ck_assert_ptr_null(m.ranks);
    ck_assert_uint_eq(m.nranks, 0);
    char path[128];
    snprintf(path, sizeof(path), "%s/j.amxs", dir);
    amx_snapshot_t s;
    ck_assert_msg(amx_snapshot_read(path, &s, &err) == AMX_OK, "%s", err.msg);
    ck_assert_uint_eq(s.meta.epochs_ok, 7);
    ck_assert_uint_eq(s.meta.ranks[1].n, 2);
    ck_assert_str_eq(s.meta.ranks[1].pls[1].name, "w");
    ck_assert_int_eq(amx_placement_equal(&s.meta.ranks[1].pls[1].pl, &half), 1);
    amx_snapshot_free(&s);
    unlink(path);
    rmdir(dir);
}
END_TEST

/* Over another catalog (the engine writes the one its epoch agreed): only
 * its quantizers. */
START_TEST(only_the_given_catalog)
{
    amx_qspec_t *agreed[2] = {unit_spec("x", 2, NULL), unit_spec("y", 2, NULL)};
    unit_job_make(&job, "j", 1, 1, agreed, 2, NULL, 0);
    amx_qspec_t *only[1] = {unit_spec("y", 2, NULL)};
    amx_catalog_t *c;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_catalog_build(only, 1, &c, &err), AMX_OK);
    amx_snap_meta_t m;
    ck_assert_int_eq(amx_job_snap_meta(&job, c, &m), AMX_OK);
    ck_assert_uint_eq(m.ranks[0].n, 1);
    ck_assert_str_eq(m.ranks[0].pls[0].name, "y");
    amx_job_snap_meta_free(&m);
    amx_catalog_free(c);
    /* A job with no local rank: an empty section. */
    uint32_t n = job.nlocal;
    job.nlocal = 0;
    ck_assert_int_eq(amx_job_snap_meta(&job, job.cat, &m), AMX_OK);
    ck_assert_uint_eq(m.nranks, 0);
    amx_job_snap_meta_free(&m);
    job.nlocal = n;
}
END_TEST

START_TEST(slot_of_a_rank)
{
    unit_job_make(&job, "j", 4, 2, NULL, 0, NULL, 0);
    ck_assert_int_eq(amx__job_slot(&job, 0), 0);
    ck_assert_int_eq(amx__job_slot(&job, 1), 1);
    ck_assert_int_eq(amx__job_slot(&job, 3), -1); /* another daemon's */
    ck_assert_int_eq(amx__job_slot(&job, 4), -1); /* outside the world */
    ck_assert_int_eq(amx__job_slot(&job, UINT32_MAX), -1);
}
END_TEST

int main(void)
{
    amx_log_level = AMX_LOG_ERROR;
    Suite *s = suite_create("job");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, NULL, teardown);
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, placements_by_name);
    tcase_add_test(tc, only_the_given_catalog);
    tcase_add_test(tc, slot_of_a_rank);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
