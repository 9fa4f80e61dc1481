/* test_metrics.c - the Prometheus rendering: label escaping, counters,
 * the histogram's cumulative buckets, dropped jobs, the listen checks. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "metrics.h"

START_TEST(escape_label)
{
    char out[64];
    size_t n = amx_metrics_escape_label("a\"b\\c\nd", out, sizeof(out));
    ck_assert_str_eq(out, "a\\\"b\\\\c\\nd");
    ck_assert_uint_eq(n, strlen(out));
    /* Truncation never splits an escape. */
    n = amx_metrics_escape_label("ab\"", out, 4);
    ck_assert_str_eq(out, "ab");
    n = amx_metrics_escape_label("", out, sizeof(out));
    ck_assert_str_eq(out, "");
    ck_assert_uint_eq(n, 0);
}
END_TEST

static char *render(amx_metrics_t *m)
{
    char *text;
    size_t len;
    ck_assert_int_eq(amx_metrics_render(m, &text, &len), AMX_OK);
    ck_assert_uint_eq(strlen(text), len);
    return text;
}

static void has(const char *text, const char *line)
{
    ck_assert_msg(strstr(text, line) != NULL, "missing line: %s\n--- in ---\n%s", line, text);
}

START_TEST(counters_and_histogram)
{
    amx_metrics_t *m = amx_metrics_create("host", "local");
    ck_assert_ptr_nonnull(m);
    const char *job = "j\"1\\x"; /* the renderer escapes whatever it is given */
    amx_metrics_job_updates(m, job, 3, 120);
    amx_metrics_job_updates(m, job, 2, 80);
    amx_metrics_job_epoch(m, job, 1, 1, 0.003, 1, 5, 7);  /* bucket 0.005 */
    amx_metrics_job_epoch(m, job, 1, 2, 0.2, 1, 0, 1);    /* bucket 0.25 */
    amx_metrics_job_epoch(m, job, 1, 3, 1000.0, 1, 2, 0); /* +Inf only */
    amx_metrics_job_epoch(m, job, 0, 4, 0.1, 0, 0, 0);    /* failed: not observed */
    amx_metrics_call(m, "/amaxd.v1.Calibration/SendAmax", 0);
    amx_metrics_call(m, "/amaxd.v1.Calibration/SendAmax", 3);
    amx_metrics_call(m, "/amaxd.v1.Calibration/SendAmax", 3);
    amx_metrics_call(m, "unknown", 99); /* out of range: UNKNOWN */
    amx_metrics_set_daemon(m, 4, 2, 9);
    amx_metrics_set_connection_counts(m, 5, 1234);
    char *t = render(m);
    const char *l = "{job=\"j\\\"1\\\\x\"}";
    char line[256];
#define HAS(fmt, v)                                                                                \
    do {                                                                                           \
        snprintf(line, sizeof(line), fmt, l, v);                                                   \
        has(t, line);                                                                              \
    } while (0)
    HAS("amaxd_job_updates_total%s %d\n", 5);
    HAS("amaxd_job_received_bytes_total%s %d\n", 200);
    HAS("amaxd_job_epochs_total%s %d\n", 3);
    HAS("amaxd_job_epochs_failed_total%s %d\n", 1);
    HAS("amaxd_job_last_epoch%s %d\n", 3);
    HAS("amaxd_job_last_epoch_missing_cells%s %d\n", 2);
    HAS("amaxd_job_last_epoch_peer_filled_cells%s %d\n", 0);
    HAS("amaxd_job_peer_filled_cells_total%s %d\n", 8);
    HAS("amaxd_job_reconcile_seconds_count%s %d\n", 3);
#undef HAS
    has(t, "amaxd_job_reconcile_seconds_bucket{job=\"j\\\"1\\\\x\",le=\"0.0025\"} 0\n");
    has(t, "amaxd_job_reconcile_seconds_bucket{job=\"j\\\"1\\\\x\",le=\"0.005\"} 1\n");
    has(t, "amaxd_job_reconcile_seconds_bucket{job=\"j\\\"1\\\\x\",le=\"0.25\"} 2\n");
    has(t, "amaxd_job_reconcile_seconds_bucket{job=\"j\\\"1\\\\x\",le=\"300\"} 2\n");
    has(t, "amaxd_job_reconcile_seconds_bucket{job=\"j\\\"1\\\\x\",le=\"+Inf\"} 3\n");
    has(t, "amaxd_requests_total{method=\"/amaxd.v1.Calibration/SendAmax\",code=\"OK\"} 1\n");
    has(t, "amaxd_requests_refused_total{method=\"/amaxd.v1.Calibration/SendAmax\","
           "code=\"INVALID_ARGUMENT\"} 2\n");
    has(t, "amaxd_requests_refused_total{method=\"unknown\",code=\"UNKNOWN\"} 1\n");
    ck_assert_ptr_null(strstr(t, "code=\"OK\"} 1\namaxd_requests_refused"));
    has(t, "amaxd_calls_in_progress 4\n");
    has(t, "amaxd_calls_waiting 2\n");
    has(t, "amaxd_connections 9\n");
    has(t, "amaxd_connections_refused_total 5\n");
    has(t, "amaxd_connections_evicted_total 1234\n");
    has(t, "# TYPE amaxd_connections_evicted_total counter\n");
    has(t, "amaxd_build_info{version=");
    has(t, "# TYPE amaxd_job_reconcile_seconds histogram\n");
    has(t, "# HELP amaxd_job_epochs_total ");
    free(t);
    /* A second job, then the first dropped: only the second's series stay. */
    amx_metrics_job_updates(m, "other", 1, 4);
    amx_metrics_job_drop(m, job);
    t = render(m);
    ck_assert_ptr_null(strstr(t, "j\\\"1"));
    has(t, "amaxd_job_updates_total{job=\"other\"} 1\n");
    has(t, "amaxd_jobs 1\n");
    free(t);
    amx_metrics_job_drop(m, "other");
    amx_metrics_job_drop(m, "never-seen");
    t = render(m);
    ck_assert_ptr_null(strstr(t, "{job="));
    free(t);
    amx_metrics_free(m);
}
END_TEST

START_TEST(null_is_off)
{
    amx_metrics_job_updates(NULL, "j", 1, 1);
    amx_metrics_job_epoch(NULL, "j", 1, 1, 0.1, 1, 0, 0);
    amx_metrics_call(NULL, "x", 0);
    amx_metrics_job_drop(NULL, "j");
    amx_metrics_free(NULL);
    ck_assert_uint_eq(amx_metrics_port(NULL), 0);
}
END_TEST

START_TEST(listen_checks)
{
    amx_config_t c;
    amx_err_t err = {0};
    amx_metrics_t *m = NULL;
    amx_config_init(&c);
    static const char *const bad[] = {"9464", "127.0.0.1:", ":9464", "127.0.0.1:x",
                                      "127.0.0.1:70000"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        amx_err_clear(&err);
        ck_assert_int_eq(amx_config_set(&c, "metrics_listen", bad[i], &err), AMX_OK);
        ck_assert_int_eq(amx_metrics_start(&c, "host", "local", &m, &err), AMX_EINVAL);
        ck_assert_ptr_null(m);
    }
    amx_err_clear(&err);
    amx_config_set(&c, "metrics_listen", "10.1.2.3:9464", &err);
    ck_assert_int_eq(amx_metrics_start(&c, "host", "local", &m, &err), AMX_EINVAL);
    ck_assert_msg(strstr(err.msg, "metrics_allow_remote") != NULL, "%s", err.msg);
    amx_err_clear(&err);
    amx_config_set(&c, "metrics_listen", "[::1]:0", &err);
    amx_status_t st = amx_metrics_start(&c, "host", "local", &m, &err);
    if (st == AMX_OK) { /* hosts without IPv6 get EIO: nothing to check there */
        ck_assert_uint_ne(amx_metrics_port(m), 0);
        amx_metrics_free(m);
    }
    amx_err_clear(&err);
    amx_config_set(&c, "metrics_listen", "127.0.0.1:0", &err);
    ck_assert_int_eq(amx_metrics_start(&c, "host", "local", &m, &err), AMX_OK);
    ck_assert_uint_ne(amx_metrics_port(m), 0);
    amx_metrics_free(m);
    amx_config_free(&c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("metrics");
    TCase *tc = tcase_create("metrics");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, escape_label);
    tcase_add_test(tc, counters_and_histogram);
    tcase_add_test(tc, null_is_off);
    tcase_add_test(tc, listen_checks);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
