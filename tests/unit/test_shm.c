/*
 * test_shm.c - the packed form's shared-memory buffers, with this process
 * as both the daemon and the trainer: the feature off, a bad directory,
 * the files' modes, a slab written by the trainer and read by the daemon,
 * the answer built in the mapping and read through the trainer's file,
 * files unlinked at first use, the statistics after the slab, refusals
 * (layout, id, replaced buffer, truncated slab or statistics, answer too
 * large, too many buffers), drops, and the
 * sweep of files no running daemon holds.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "log.h"
#include "shm.h"
#include "unit.h"

static char dir[64];

static void setup(void)
{
    amx_log_level = AMX_LOG_ERROR;
    snprintf(dir, sizeof(dir), "/tmp/amx-shm-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

/* A buffer of `cells` cells without statistics, answers up to `answer`. */
static const amx_shm_sizes_t *sizes(uint64_t cells, uint64_t answer)
{
    static amx_shm_sizes_t sz;
    sz = (amx_shm_sizes_t){cells, 0, 0, answer};
    return &sz;
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}

static int exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

START_TEST(off_and_bad_directories)
{
    amx_shm_t *s = (amx_shm_t *)1;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_shm_create("", 0660, 8, &s, &err), AMX_OK);
    ck_assert_ptr_null(s);
    amx_shm_region_t r;
    ck_assert_int_eq(amx_shm_open(NULL, "j", 0, 1, sizes(4, 64), &r, &err), AMX_EPRECOND);
    ck_assert_str_eq(err.msg, "GetLayout: shared-memory buffers are off on this daemon (shm_dir "
                              "is empty); use the packed form without shm");
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_check(NULL, "j", 0, 1, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "ReconcilePacked: shared-memory buffers are off");
    amx_err_clear(&err);
    ck_assert_ptr_null(amx_shm_answer(NULL, "j", 0, 1, 8, &err));
    amx_err_clear(&err);
    amx_shm_slab_t b;
    ck_assert_int_eq(amx_shm_read(NULL, "j", 0, 1, 1, 0, 0, &b, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "SendPacked: shared-memory buffers are off");
    amx_shm_free(NULL);
    amx_shm_trim(NULL, 0);
    amx_shm_drop_job(NULL, "j");
    /* Missing, or not a directory. */
    char path[128];
    snprintf(path, sizeof(path), "%s/none", dir);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_create(path, 0660, 8, &s, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "No such file or directory (set shm_dir to a tmpfs directory");
    snprintf(path, sizeof(path), "%s/file", dir);
    fclose(fopen(path, "w"));
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_create(path, 0660, 8, &s, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "Not a directory");
}
END_TEST

START_TEST(slab_in_answer_out)
{
    amx_shm_t *s;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_shm_create(dir, 0666, 8, &s, &err), AMX_OK);
    amx_shm_region_t r;
    ck_assert_int_eq(amx_shm_open(s, "j", 3, 0xabc, sizes(4, 128), &r, &err), AMX_OK);
    ck_assert_uint_ne(r.id, 0);
    ck_assert_uint_eq(r.layout_id, 0xabc);
    ck_assert_uint_eq(r.cells, 4);
    ck_assert_uint_eq(r.has_data_off, 16);
    ck_assert_int_eq(strncmp(r.path, dir, strlen(dir)), 0);
    /* Never to every user: the slab the trainers' group may write, the
     * answer only read. */
    struct stat st;
    ck_assert_int_eq(stat(r.path, &st), 0);
    ck_assert_uint_eq(st.st_mode & 0777, 0660);
    ck_assert_int_eq(stat(r.answer_path, &st), 0);
    ck_assert_uint_eq(st.st_mode & 0777, 0640);
    ck_assert_uint_eq((uint64_t)st.st_size, 128); /* reserved */
    /* The trainer opens both and writes its slab. */
    int slab = open(r.path, O_RDWR), ans = open(r.answer_path, O_RDONLY);
    ck_assert_int_ge(slab, 0);
    ck_assert_int_ge(ans, 0);
    float vals[4] = {1.5f, 0, 448, 3};
    uint8_t has[4] = {1, 0, 1, 1};
    ck_assert_int_eq(pwrite(slab, vals, 16, 0), 16);
    ck_assert_int_eq(pwrite(slab, has, 4, 16), 4);
    amx_shm_slab_t b;
    ck_assert_int_eq(amx_shm_read(s, "j", 3, r.id, 0xabc, 1, 0, &b, &err), AMX_OK);
    ck_assert_uint_eq(b.cells, 4);
    ck_assert_int_eq(memcmp(b.values, vals, 16), 0);
    ck_assert_int_eq(memcmp(b.has_data, has, 4), 0);
    /* Read into the daemon's memory: a later write by the trainer does not
     * change what was read. */
    float other = 9;
    ck_assert_int_eq(pwrite(slab, &other, 4, 0), 4);
    ck_assert_float_eq(b.values[0], 1.5f);
    ck_assert_int_eq(amx_shm_read(s, "j", 3, r.id, 0xabc, 0, 0, &b, &err), AMX_OK);
    ck_assert_ptr_null(b.has_data);
    ck_assert_ptr_null(b.stats);
    ck_assert_float_eq(b.values[0], 9.0f);
    /* First use unlinked both files: nothing is left when a side dies. */
    ck_assert_int_eq(exists(r.path), 0);
    ck_assert_int_eq(exists(r.answer_path), 0);
    /* The answer, built in the mapping, read through the trainer's file. */
    uint8_t *a = amx_shm_answer(s, "j", 3, r.id, 128, &err);
    ck_assert_ptr_nonnull(a);
    memcpy(a, "answer bytes", 12);
    char got[13] = {0};
    ck_assert_int_eq(pread(ans, got, 12, 0), 12);
    ck_assert_str_eq(got, "answer bytes");
    ck_assert_ptr_null(amx_shm_answer(s, "j", 3, r.id, 129, &err));
    AMX_ASSERT_HAS(err.msg, "an answer of up to 129 bytes");
    ck_assert_int_eq(amx_shm_check(s, "j", 3, r.id, &err), AMX_OK);
    /* A trainer that truncates its slab gets a refusal, never a fault. */
    ck_assert_int_eq(ftruncate(slab, 6), 0);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_read(s, "j", 3, r.id, 0xabc, 1, 0, &b, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "the shared buffer ends 6 bytes into the values");
    AMX_ASSERT_HAS(err.msg, "it was truncated");
    close(slab);
    close(ans);
    amx_shm_trim(s, 0);
    amx_shm_free(s);
}
END_TEST

START_TEST(statistics_after_the_slab)
{
    amx_shm_t *s;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_shm_create(dir, 0660, 8, &s, &err), AMX_OK);
    amx_shm_region_t r;
    amx_shm_sizes_t sz = {3, 4, 2, 64};
    ck_assert_int_eq(amx_shm_open(s, "j", 0, 7, &sz, &r, &err), AMX_OK);
    /* values 12 bytes, has-data 3: the statistics at 16 (8-aligned), their
     * epochs after the 4 values. */
    ck_assert_uint_eq(r.has_data_off, 12);
    ck_assert_uint_eq(r.stats_off, 16);
    ck_assert_uint_eq(r.stat_epochs_off, 48);
    int slab = open(r.path, O_RDWR);
    ck_assert_int_ge(slab, 0);
    float vals[3] = {1, 2, 3};
    double st[4] = {1, 0, 2.5, 7};
    uint64_t ep[2] = {5, 0};
    ck_assert_int_eq(pwrite(slab, vals, 12, 0), 12);
    ck_assert_int_eq(pwrite(slab, st, 32, 16), 32);
    /* The epochs are missing: the file ends inside the statistics' part. */
    amx_shm_slab_t b;
    ck_assert_int_eq(amx_shm_read(s, "j", 0, r.id, 7, 0, 1, &b, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "ends 0 bytes into the stat epochs (16 bytes at offset 48)");
    ck_assert_int_eq(pwrite(slab, ep, 16, 48), 16);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_read(s, "j", 0, r.id, 7, 0, 1, &b, &err), AMX_OK);
    ck_assert_ptr_null(b.has_data);
    ck_assert_uint_eq(b.stats_len, 32);
    ck_assert_uint_eq(b.epochs_len, 16);
    ck_assert_uint_eq((uintptr_t)b.stats % 8, 0);
    ck_assert_int_eq(memcmp(b.stats, st, 32), 0);
    ck_assert_int_eq(memcmp(b.stat_epochs, ep, 16), 0);
    ck_assert_int_eq(memcmp(b.values, vals, 12), 0);
    /* Without with_stats nothing of them is read. */
    ck_assert_int_eq(amx_shm_read(s, "j", 0, r.id, 7, 1, 0, &b, &err), AMX_OK);
    ck_assert_ptr_null(b.stats);
    ck_assert_uint_eq(b.stats_len + b.epochs_len, 0);
    ck_assert_int_eq(ftruncate(slab, 20), 0);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_read(s, "j", 0, r.id, 7, 1, 1, &b, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "ends 4 bytes into the statistics (32 bytes at offset 16)");
    /* Sizes no buffer can hold are refused. */
    amx_shm_sizes_t huge = {1, UINT64_MAX / 2, 1, 8};
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_open(s, "j", 1, 7, &huge, &r, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "do not fit a shared buffer");
    close(slab);
    amx_shm_free(s);
}
END_TEST

START_TEST(refusals_replacement_and_drops)
{
    amx_shm_t *s;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_shm_create(dir, 0660, 2, &s, &err), AMX_OK);
    amx_shm_region_t a, b, c;
    ck_assert_int_eq(amx_shm_open(s, "j", 0, 1, sizes(2, 0), &a, &err), AMX_OK);
    amx_shm_slab_t sb;
    ck_assert_int_eq(amx_shm_read(s, "j", 0, a.id, 2, 0, 0, &sb, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "was made for layout 0000000000000001, the request names layout "
                            "0000000000000002");
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_check(s, "j", 1, a.id, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "job 'j' rank 1 has no shared buffer");
    /* The rank's new buffer replaces its old one (files of the old gone). */
    char old_path[4096];
    snprintf(old_path, sizeof(old_path), "%s", a.path);
    ck_assert_int_eq(amx_shm_open(s, "j", 0, 2, sizes(2, 0), &b, &err), AMX_OK);
    ck_assert_uint_ne(b.id, a.id);
    ck_assert_int_eq(exists(old_path), 0);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_check(s, "j", 0, a.id, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "(it was replaced by a newer one)");
    /* At most 2 buffers: a third rank is refused, a replacement is not. */
    ck_assert_int_eq(amx_shm_open(s, "k", 0, 1, sizes(1, 0), &c, &err), AMX_OK);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_open(s, "k", 1, 1, sizes(1, 0), &c, &err), AMX_ENOMEM);
    AMX_ASSERT_HAS(err.msg, "2 shared buffers are open, the most this daemon keeps");
    ck_assert_int_eq(amx_shm_open(s, "k", 0, 3, sizes(1, 0), &c, &err), AMX_OK);
    /* Dropping job "j" removes its buffer (and its still-linked files)
     * and frees its place. */
    ck_assert_int_eq(exists(b.path), 1);
    char b_path[4096];
    snprintf(b_path, sizeof(b_path), "%s", b.path);
    amx_shm_drop_job(s, "j");
    ck_assert_int_eq(exists(b_path), 0);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_shm_check(s, "j", 0, b.id, &err), AMX_EPRECOND);
    ck_assert_int_eq(amx_shm_check(s, "k", 0, c.id, &err), AMX_OK);
    ck_assert_int_eq(amx_shm_open(s, "k", 1, 1, sizes(1, 0), &c, &err), AMX_OK);
    amx_shm_free(s);
}
END_TEST

/* Makes `name` in the test's directory; mtime `age` seconds ago. */
static void make(const char *name, int age)
{
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fclose(f);
    struct timeval tv[2];
    gettimeofday(&tv[0], NULL);
    tv[0].tv_sec -= age;
    tv[1] = tv[0];
    ck_assert_int_eq(utimes(p, tv), 0);
}

static int present(const char *name)
{
    char p[256];
    snprintf(p, sizeof(p), "%s/%s", dir, name);
    return exists(p);
}

START_TEST(sweep_of_files_no_daemon_holds)
{
    make("amaxd-999999-00000000000000aa-s", 0); /* a dead daemon's */
    make("amaxd-999998-00000000000000bb-a", 0); /* held: another daemon's */
    make(".new-amaxd-00000000000000cc-s", 0);   /* being made right now */
    make(".new-amaxd-00000000000000dd-s", 600); /* its maker died long ago */
    make("amaxd-notapid", 0);
    make("other-file", 0);
    char held[256];
    snprintf(held, sizeof(held), "%s/amaxd-999998-00000000000000bb-a", dir);
    int fd = open(held, O_RDONLY);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(flock(fd, LOCK_SH), 0);
    amx_shm_t *s;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_shm_create(dir, 0660, 8, &s, &err), AMX_OK);
    ck_assert_int_eq(present("amaxd-999999-00000000000000aa-s"), 0);
    ck_assert_int_eq(present("amaxd-999998-00000000000000bb-a"), 1);
    ck_assert_int_eq(present(".new-amaxd-00000000000000cc-s"), 1);
    ck_assert_int_eq(present(".new-amaxd-00000000000000dd-s"), 0);
    ck_assert_int_eq(present("amaxd-notapid"), 1);
    ck_assert_int_eq(present("other-file"), 1);
    /* A running daemon's own buffers survive another daemon's start. */
    amx_shm_region_t r;
    ck_assert_int_eq(amx_shm_open(s, "j", 0, 1, sizes(1, 8), &r, &err), AMX_OK);
    amx_shm_t *s2;
    ck_assert_int_eq(amx_shm_create(dir, 0660, 8, &s2, &err), AMX_OK);
    ck_assert_int_eq(exists(r.path), 1);
    ck_assert_int_eq(exists(r.answer_path), 1);
    amx_shm_free(s2);
    /* Freed: its linked files go. */
    char p1[4096], p2[4096];
    snprintf(p1, sizeof(p1), "%s", r.path);
    snprintf(p2, sizeof(p2), "%s", r.answer_path);
    amx_shm_free(s);
    ck_assert_int_eq(exists(p1), 0);
    ck_assert_int_eq(exists(p2), 0);
    close(fd);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("shm");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, off_and_bad_directories);
    tcase_add_test(tc, slab_in_answer_out);
    tcase_add_test(tc, statistics_after_the_slab);
    tcase_add_test(tc, refusals_replacement_and_drops);
    tcase_add_test(tc, sweep_of_files_no_daemon_holds);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
