/*
 * test_notify.c - what the daemon tells systemd, read from a datagram
 * socket standing in for the service manager (NOTIFY_SOCKET): nothing
 * without it; READY=1, STATUS= lines (one line each, sent only when they
 * change), STOPPING=1, a failure with its ERRNO=, and watchdog pings from
 * the loop at half the period systemd asked for.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "log.h"
#include "notify.h"
#include "unit.h"

static char dir[32], path[64];
static int sock = -1;
static uv_loop_t loop;

static void setup(void)
{
    amx_log_level = AMX_LOG_ERROR;
    snprintf(dir, sizeof(dir), "/tmp/amx-notify-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/notify", dir);
    sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    ck_assert_int_ge(sock, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
    ck_assert_int_eq(bind(sock, (struct sockaddr *)&a, sizeof(a)), 0);
    unsetenv("NOTIFY_SOCKET");
    unsetenv("WATCHDOG_USEC");
    unsetenv("WATCHDOG_PID");
    ck_assert_int_eq(uv_loop_init(&loop), 0);
}

static void teardown(void)
{
    uv_run(&loop, UV_RUN_DEFAULT);
    ck_assert_int_eq(uv_loop_close(&loop), 0);
    close(sock);
    unlink(path);
    rmdir(dir);
}

/* The next message the "service manager" got, or "" when none is there. */
static const char *next_msg(void)
{
    static char buf[1024];
    ssize_t n = recv(sock, buf, sizeof(buf) - 1, MSG_DONTWAIT);
    buf[n > 0 ? n : 0] = '\0';
    return buf;
}

static void stop_loop(uv_timer_t *t)
{
    uv_stop(t->loop);
}

/* Runs the loop for `ms` milliseconds. */
static void run_for(uint64_t ms)
{
    uv_timer_t t;
    uv_timer_init(&loop, &t);
    uv_timer_start(&t, stop_loop, ms, 0);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_close((uv_handle_t *)&t, NULL);
    uv_run(&loop, UV_RUN_NOWAIT);
}

START_TEST(nothing_without_a_notify_socket)
{
    amx_notify_t *n = amx_notify_create(&loop, NULL, NULL);
    ck_assert_ptr_nonnull(n);
    /* Decided at creation: a socket set later is not used. */
    setenv("NOTIFY_SOCKET", path, 1);
    amx_notify_ready(n, "/run/amaxd/amaxd.sock");
    amx_notify_status(n, "x");
    amx_notify_stopping(n, "y");
    amx_notify_failed(n, 5, "z");
    ck_assert_str_eq(next_msg(), "");
    ck_assert_uint_eq(amx_notify_watchdog_usec(n), 0);
    amx_notify_close(n);
    amx_notify_close(NULL);
    amx_notify_ready(NULL, "x");
}
END_TEST

static void sample(void *ud, amx_notify_status_t *s)
{
    *s = *(amx_notify_status_t *)ud;
}

START_TEST(ready_status_stopping_failed)
{
    setenv("NOTIFY_SOCKET", path, 1);
    amx_notify_status_t now = {2, 1, 0};
    amx_notify_t *n = amx_notify_create(&loop, sample, &now);
    ck_assert_str_eq(next_msg(), ""); /* no watchdog asked for: no ping */
    amx_notify_ready(n, "/run/amaxd/amaxd.sock\nREADY=0");
    ck_assert_str_eq(next_msg(),
                     "READY=1\nSTATUS=ready: listening on /run/amaxd/amaxd.sock READY=0");
    amx_notify_status(n, "line one\nline %d", 2);
    ck_assert_str_eq(next_msg(), "STATUS=line one line 2");
    /* About once a second, the sampled counts; only when they change. */
    run_for(1100);
    ck_assert_str_eq(next_msg(), "STATUS=serving 2 jobs, 1 call in progress, 0 waiting for other "
                                 "ranks");
    run_for(1000);
    ck_assert_str_eq(next_msg(), "");
    now.jobs = 1;
    now.calls = 0;
    run_for(1000);
    ck_assert_str_eq(next_msg(), "STATUS=serving 1 job, 0 calls in progress, 0 waiting for other "
                                 "ranks");
    amx_notify_stopping(n, "SIGTERM\nreceived");
    ck_assert_str_eq(next_msg(), "STOPPING=1\nSTATUS=stopping: SIGTERM received");
    now.jobs = 5;
    run_for(1100);
    ck_assert_str_eq(next_msg(), ""); /* no more status lines once stopping */
    amx_notify_failed(n, 98, "cannot bind\nthe socket");
    ck_assert_str_eq(next_msg(), "STATUS=failed: cannot bind the socket");
    ck_assert_str_eq(next_msg(), "ERRNO=98");
    amx_notify_close(n);
    /* Before the notifier exists (start-up failed early). */
    amx_notify_failed(NULL, 0, "bad config");
    ck_assert_str_eq(next_msg(), "STATUS=failed: bad config");
    ck_assert_str_eq(next_msg(), "");
}
END_TEST

START_TEST(watchdog_pings_at_half_the_period)
{
    char pid[32];
    snprintf(pid, sizeof(pid), "%d", (int)getpid());
    setenv("NOTIFY_SOCKET", path, 1);
    setenv("WATCHDOG_USEC", "200000", 1);
    setenv("WATCHDOG_PID", pid, 1);
    amx_notify_t *n = amx_notify_create(&loop, NULL, NULL);
    ck_assert_uint_eq(amx_notify_watchdog_usec(n), 200000);
    ck_assert_str_eq(next_msg(), "WATCHDOG=1"); /* at once */
    run_for(450);                               /* pings at 100, 200, 300, 400 ms */
    int pings = 0;
    while (strcmp(next_msg(), "WATCHDOG=1") == 0)
        pings++;
    ck_assert_int_ge(pings, 3);
    ck_assert_int_le(pings, 5);
    amx_notify_close(n);
    /* Another process's watchdog (WATCHDOG_PID): none here. */
    setenv("WATCHDOG_PID", "1", 1);
    n = amx_notify_create(&loop, NULL, NULL);
    ck_assert_uint_eq(amx_notify_watchdog_usec(n), 0);
    ck_assert_str_eq(next_msg(), "");
    amx_notify_close(n);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("notify");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, nothing_without_a_notify_socket);
    tcase_add_test(tc, ready_status_stopping_failed);
    tcase_add_test(tc, watchdog_pings_at_half_the_period);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
