/*
 * test_log.c - the logging macro and its lines: levels (arguments not
 * evaluated when off), the file destination and its reopening, the
 * journald priority prefix, and control characters escaped so that one
 * message stays one line.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

static char dir[64];

static void setup(void)
{
    snprintf(dir, sizeof(dir), "/tmp/amx-log-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}

/* The contents of file `name` in the test's directory (static buffer). */
static const char *slurp(const char *name)
{
    static char buf[8192];
    char path[128];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return buf;
}

static int evaluated;

static int side_effect(void)
{
    return ++evaluated;
}

START_TEST(levels_and_file_lines)
{
    ck_assert_int_eq(amx_log_parse_level("error"), AMX_LOG_ERROR);
    ck_assert_int_eq(amx_log_parse_level("debug"), AMX_LOG_DEBUG);
    ck_assert_int_eq(amx_log_parse_level("verbose"), -1);
    ck_assert_int_eq(amx_log_parse_level("INFO"), -1);
    char path[128];
    snprintf(path, sizeof(path), "%s/a.log", dir);
    ck_assert_int_eq(amx_log_open(path), 0);
    amx_log_level = AMX_LOG_WARN;
    AMX_INFO("test", "hidden %d", side_effect());
    ck_assert_int_eq(evaluated, 0);
    AMX_WARN("rpc", "shown %d", side_effect());
    ck_assert_int_eq(evaluated, 1);
    AMX_ERROR("coord", "job '%s' failed", "j");
    const char *s = slurp("a.log");
    /* "2025-01-02T03:04:05.678Z warn  rpc: shown 1" */
    ck_assert_msg(strlen(s) > 25 && s[4] == '-' && s[10] == 'T' && s[19] == '.' && s[23] == 'Z',
                  "no timestamp in '%s'", s);
    ck_assert_ptr_nonnull(strstr(s, "Z warn  rpc: shown 1\n"));
    ck_assert_ptr_nonnull(strstr(s, "Z error coord: job 'j' failed\n"));
    ck_assert_ptr_null(strstr(s, "hidden"));
    /* Reopened elsewhere (SIGHUP after a rotation): the new file gets the
     * lines from now on. */
    snprintf(path, sizeof(path), "%s/b.log", dir);
    ck_assert_int_eq(amx_log_open(path), 0);
    AMX_ERROR("main", "after");
    ck_assert_ptr_null(strstr(slurp("a.log"), "after"));
    ck_assert_ptr_nonnull(strstr(slurp("b.log"), "error main: after\n"));
    /* A file that cannot be opened keeps the old destination. */
    ck_assert_int_lt(amx_log_open("/nonexistent-dir/x.log"), 0);
    AMX_ERROR("main", "still");
    ck_assert_ptr_nonnull(strstr(slurp("b.log"), "still"));
    amx_log_close();
}
END_TEST

START_TEST(control_bytes_are_escaped)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/c.log", dir);
    ck_assert_int_eq(amx_log_open(path), 0);
    amx_log_level = AMX_LOG_INFO;
    AMX_INFO("svc", "name '%s'", "a\nb\r\x1b[31m\x7f\\z");
    const char *s = slurp("c.log");
    const char *m = strstr(s, "svc: ");
    ck_assert_ptr_nonnull(m);
    ck_assert_str_eq(m, "svc: name 'a\\x0ab\\x0d\\x1b[31m\\x7f\\z'\n");
    /* One line, however long the message: cut, with its newline. */
    char big[5000];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    AMX_INFO("svc", "%s", big);
    s = slurp("c.log");
    int lines = 0;
    for (const char *p = s; *p; p++)
        lines += *p == '\n';
    ck_assert_int_eq(lines, 2);
    ck_assert_uint_lt(strlen(s), 2 * 2048);
    amx_log_close();
}
END_TEST

/* Under systemd (JOURNAL_STREAM, logging to stderr): "<N>subsys: " and no
 * timestamp. Decided once per process: fork mode gives this test its own. */
START_TEST(journal_priority_prefix)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/journal", dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ck_assert_int_ge(fd, 0);
    ck_assert_int_eq(dup2(fd, 2), 2);
    close(fd);
    setenv("JOURNAL_STREAM", "8:1234", 1);
    amx_log_level = AMX_LOG_DEBUG;
    AMX_ERROR("main", "e");
    AMX_WARN("main", "w");
    AMX_INFO("main", "i");
    AMX_DEBUG("main", "d");
    ck_assert_str_eq(slurp("journal"), "<3>main: e\n<4>main: w\n<6>main: i\n<7>main: d\n");
}
END_TEST

int main(void)
{
    Suite *s = suite_create("log");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, levels_and_file_lines);
    tcase_add_test(tc, control_bytes_are_escaped);
    tcase_add_test(tc, journal_priority_prefix);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
