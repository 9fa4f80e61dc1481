/* test_config.c - the config table: defaults, bounds, file, env, CLI. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"

START_TEST(defaults)
{
    amx_config_t c;
    amx_config_init(&c);
    ck_assert_str_eq(c.socket, "/run/amaxd/amaxd.sock");
    ck_assert_int_eq(c.socket_mode, 0660);
    ck_assert_str_eq(c.backend, "auto");
    ck_assert_int_eq(c.allow_remote, 0);
    ck_assert_int_eq(c.max_message_bytes, 64 << 20);
    ck_assert_int_eq(c.max_connections, 1024);
    ck_assert_int_eq(c.max_connections_per_uid, 0); /* half of the connection budget */
    amx_config_free(&c);
}
END_TEST

START_TEST(bounds_and_types)
{
    amx_config_t c;
    amx_err_t err = {0};
    amx_config_init(&c);
    ck_assert_int_eq(amx_config_set(&c, "join_timeout_ms", "5", &err), AMX_EINVAL);
    ck_assert_msg(strstr(err.msg, "out of range") != NULL, "%s", err.msg);
    ck_assert_int_eq(c.join_timeout_ms, 300000); /* unchanged */
    amx_err_clear(&err);
    ck_assert_int_eq(amx_config_set(&c, "join-timeout-ms", "2000", &err), AMX_OK);
    ck_assert_int_eq(c.join_timeout_ms, 2000);
    ck_assert_int_eq(amx_config_set(&c, "backend", "tpu", &err), AMX_EINVAL);
    ck_assert_int_eq(amx_config_set(&c, "allow_remote", "maybe", &err), AMX_EINVAL);
    ck_assert_int_eq(amx_config_set(&c, "max_jobs", "12x", &err), AMX_EINVAL);
    ck_assert_int_eq(amx_config_set(&c, "socket_mode", "0600", &err), AMX_OK);
    ck_assert_int_eq(c.socket_mode, 0600);
    ck_assert_int_eq(amx_config_set(&c, "socket_mode", "999", &err), AMX_EINVAL);
    ck_assert_int_eq(amx_config_set(&c, "no_such_thing", "1", &err), AMX_EINVAL);
    /* busy_poll: auto follows the CPUs online, on and off are what they say. */
    ck_assert_str_eq(c.busy_poll, "auto");
    ck_assert_int_eq(amx_config_busy_poll(&c), sysconf(_SC_NPROCESSORS_ONLN) >= 8);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_config_set(&c, "busy_poll", "sometimes", &err), AMX_EINVAL);
    ck_assert_msg(strstr(err.msg, "auto|on|off") != NULL, "%s", err.msg);
    ck_assert_int_eq(amx_config_set(&c, "busy-poll", "on", &err), AMX_OK);
    ck_assert_int_eq(amx_config_busy_poll(&c), 1);
    ck_assert_int_eq(amx_config_set(&c, "busy_poll", "off", &err), AMX_OK);
    ck_assert_int_eq(amx_config_busy_poll(&c), 0);
    amx_config_free(&c);
}
END_TEST

START_TEST(precedence_file_env_cli)
{
    char path[] = "/tmp/amaxd-test-XXXXXX";
    int fd = mkstemp(path);
    ck_assert_int_ge(fd, 0);
    const char *text = "[amaxd]\nsocket = /tmp/from-file.sock\nmax_jobs = 7\nlog_level = debug\n";
    ck_assert_int_eq(write(fd, text, strlen(text)), (int)strlen(text));
    close(fd);
    setenv("AMAXD_MAX_JOBS", "9", 1);
    char *argv[] = {"amaxd",          "--config",       path, "--log-level=warn", "--tcp",
                    "127.0.0.1:7777", "--allow-remote", NULL};
    amx_config_t c;
    amx_err_t err = {0};
    int action;
    amx_config_init(&c);
    ck_assert_int_eq(amx_config_from_args(&c, 7, argv, &action, &err), AMX_OK);
    ck_assert_int_eq(action, AMX_CFG_RUN);
    ck_assert_str_eq(c.socket, "/tmp/from-file.sock"); /* file */
    ck_assert_int_eq(c.max_jobs, 9);                   /* env beats file */
    ck_assert_str_eq(c.log_level, "warn");             /* CLI beats file */
    ck_assert_str_eq(c.tcp, "127.0.0.1:7777");
    ck_assert_int_eq(c.allow_remote, 1);
    amx_config_free(&c);
    unsetenv("AMAXD_MAX_JOBS");
    unlink(path);
}
END_TEST

START_TEST(bad_file_and_args)
{
    char path[] = "/tmp/amaxd-test-XXXXXX";
    int fd = mkstemp(path);
    const char *text = "[amaxd]\nmax_jobs = 0\n";
    ck_assert_int_eq(write(fd, text, strlen(text)), (int)strlen(text));
    close(fd);
    amx_config_t c;
    amx_err_t err = {0};
    amx_config_init(&c);
    ck_assert_int_eq(amx_config_load_file(&c, path, &err), AMX_EINVAL);
    ck_assert_msg(strstr(err.msg, "max_jobs") != NULL, "%s", err.msg);
    amx_err_clear(&err);
    ck_assert_int_eq(amx_config_load_file(&c, "/nonexistent/amaxd.conf", &err), AMX_EIO);
    char *argv[] = {"amaxd", "stray", NULL};
    int action;
    amx_err_clear(&err);
    ck_assert_int_eq(amx_config_from_args(&c, 2, argv, &action, &err), AMX_EINVAL);
    char *argv2[] = {"amaxd", "--help", NULL};
    ck_assert_int_eq(amx_config_from_args(&c, 2, argv2, &action, &err), AMX_OK);
    ck_assert_int_eq(action, AMX_CFG_HELP);
    amx_config_free(&c);
    unlink(path);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("config");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, defaults);
    tcase_add_test(tc, bounds_and_types);
    tcase_add_test(tc, precedence_file_env_cli);
    tcase_add_test(tc, bad_file_and_args);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
