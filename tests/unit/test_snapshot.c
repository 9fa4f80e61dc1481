/* test_snapshot.c - the snapshot's job section as read back: the local
 * ranks it lists must each be inside the world and listed once, whatever
 * the checksum says (a file made by hand, or a writer's bug). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "snapshot.h"

/* Writes job "j" (world 4) with one placement per listed rank and a state
 * blob that is not a job state, reads it back, and returns the status;
 * the message goes to `err`. */
static amx_status_t write_and_read(const uint32_t *ranks, uint32_t n, amx_err_t *err)
{
    char dir[] = "/tmp/amx-snap-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    amx_snap_rank_t rk[8];
    amx_snap_pl_t pl[8];
    ck_assert_uint_le(n, 8);
    for (uint32_t i = 0; i < n; i++) {
        memset(&pl[i], 0, sizeof(pl[i]));
        pl[i].name = "layer.w";
        pl[i].pl.ndim = 1;
        pl[i].pl.off[0] = ranks[i] * 4;
        pl[i].pl.shape[0] = 4;
        pl[i].pl.ncells = 4;
        rk[i] = (amx_snap_rank_t){ranks[i], 1, &pl[i]};
    }
    uint8_t blob[64];
    memset(blob, 0xab, sizeof(blob));
    amx_snap_meta_t m = {0};
    m.job = "j";
    m.world = 4;
    m.epochs_ok = 3;
    m.ranks = rk;
    m.nranks = n;
    m.state_len = sizeof(blob);
    void *meta;
    size_t len;
    amx_err_t e = {0};
    ck_assert_int_eq(amx_snapshot_encode_meta(&m, &meta, &len, &e), AMX_OK);
    ck_assert_int_eq(amx_snapshot_write(dir, "j", meta, len, blob, sizeof(blob), &e), AMX_OK);
    free(meta);
    char path[128];
    snprintf(path, sizeof(path), "%s/j.amxs", dir);
    amx_snapshot_t s;
    amx_status_t st = amx_snapshot_read(path, &s, err);
    if (st == AMX_OK)
        amx_snapshot_free(&s);
    unlink(path);
    rmdir(dir);
    return st;
}

START_TEST(rank_listed_twice_is_refused)
{
    const uint32_t ranks[] = {1, 3, 1};
    amx_err_t err = {0};
    ck_assert_int_eq(write_and_read(ranks, 3, &err), AMX_EINVAL);
    ck_assert_msg(strstr(err.msg, "lists rank 1 twice") != NULL, "message: %s", err.msg);
}
END_TEST

START_TEST(rank_outside_the_world_is_refused)
{
    const uint32_t ranks[] = {0, 4};
    amx_err_t err = {0};
    ck_assert_int_eq(write_and_read(ranks, 2, &err), AMX_EINVAL);
    ck_assert_msg(strstr(err.msg, "job section is malformed") != NULL, "message: %s", err.msg);
}
END_TEST

START_TEST(distinct_ranks_pass_the_job_section)
{
    /* Out of order and distinct: the job section is accepted, and the read
     * stops at the state blob, which is not a job state. */
    const uint32_t ranks[] = {3, 0, 2};
    amx_err_t err = {0};
    ck_assert_int_eq(write_and_read(ranks, 3, &err), AMX_EINVAL);
    ck_assert_msg(strstr(err.msg, "job section") == NULL, "message: %s", err.msg);
    ck_assert_msg(strstr(err.msg, "twice") == NULL, "message: %s", err.msg);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("snapshot");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, rank_listed_twice_is_refused);
    tcase_add_test(tc, rank_outside_the_world_is_refused);
    tcase_add_test(tc, distinct_ranks_pass_the_job_section);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? 0 : 1;
}
