/*
 * test_status.c - the status enum and the error record: each status's
 * text and gRPC code (and back), unknown values, and that the first
 * error recorded wins.
 */
#include <check.h>
#include <string.h>

#include "status.h"

START_TEST(texts_and_grpc_codes)
{
    static const struct {
        amx_status_t st;
        int grpc;
        const char *text;
    } want[] = {
        {AMX_OK, 0, "ok"},
        {AMX_EINVAL, 3, "invalid argument"},
        {AMX_ENOTFOUND, 5, "not found"},
        {AMX_EEXIST, 6, "already exists"},
        {AMX_EPRECOND, 9, "failed precondition"},
        {AMX_EABORTED, 10, "aborted"},
        {AMX_ERANGE, 11, "out of range"},
        {AMX_ENOMEM, 8, "resource exhausted"},
        {AMX_EUNIMPL, 12, "unimplemented"},
        {AMX_ETIMEDOUT, 4, "deadline exceeded"},
        {AMX_EUNAVAIL, 14, "unavailable"},
        {AMX_ECANCELLED, 1, "cancelled"},
        {AMX_EINTERNAL, 13, "internal error"},
        {AMX_EIO, 13, "I/O error"},
        {AMX_EDEVICE, 13, "device error"},
        {AMX_EAUTH, 16, "unauthenticated"},
    };
    ck_assert_int_eq(sizeof(want) / sizeof(want[0]), AMX__STATUS_MAX);
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        ck_assert_str_eq(amx_strerror(want[i].st), want[i].text);
        ck_assert_int_eq(amx_status_grpc(want[i].st), want[i].grpc);
        /* Back from gRPC: the same status, but the codes several share. */
        if (want[i].grpc != 13)
            ck_assert_int_eq(amx_status_from_grpc(want[i].grpc), want[i].st);
    }
    ck_assert_int_eq(amx_status_from_grpc(13), AMX_EINTERNAL);
    ck_assert_int_eq(amx_status_from_grpc(2), AMX_EINTERNAL); /* UNKNOWN */
    ck_assert_int_eq(amx_status_from_grpc(7), AMX_EINTERNAL); /* PERMISSION_DENIED */
    ck_assert_int_eq(amx_status_from_grpc(99), AMX_EINTERNAL);
    ck_assert_str_eq(amx_strerror(AMX__STATUS_MAX), "unknown status");
    ck_assert_str_eq(amx_strerror((amx_status_t)-1), "unknown status");
    ck_assert_int_eq(amx_status_grpc(AMX__STATUS_MAX), 2);
}
END_TEST

static amx_status_t fails_twice(amx_err_t *err)
{
    amx_err_set(err, AMX_ENOMEM, "first: %d bytes", 12);
    return amx_err_set(err, AMX_EIO, "second");
}

static amx_status_t checked(amx_err_t *err, int *reached)
{
    AMX_CHECK(amx_err_set(err, AMX_EPRECOND, "stop here"));
    *reached = 1;
    return AMX_OK;
}

START_TEST(first_error_wins)
{
    amx_err_t err = {0};
    /* The call returns its own code; the record keeps the first. */
    ck_assert_int_eq(fails_twice(&err), AMX_EIO);
    ck_assert_int_eq(err.code, AMX_ENOMEM);
    ck_assert_str_eq(err.msg, "first: 12 bytes");
    amx_err_clear(&err);
    ck_assert_int_eq(err.code, AMX_OK);
    ck_assert_str_eq(err.msg, "");
    /* NULL record: only the code. */
    ck_assert_int_eq(amx_err_set(NULL, AMX_EINVAL, "x"), AMX_EINVAL);
    /* A long message is cut, NUL-terminated. */
    char big[2000];
    memset(big, 'm', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    amx_err_set(&err, AMX_EINVAL, "%s", big);
    ck_assert_uint_eq(strlen(err.msg), sizeof(err.msg) - 1);
    /* AMX_CHECK returns at the first failure. */
    amx_err_clear(&err);
    int reached = 0;
    ck_assert_int_eq(checked(&err, &reached), AMX_EPRECOND);
    ck_assert_int_eq(reached, 0);
    amx_status_t st = AMX_OK;
    AMX_CHECK_GOTO(AMX_ETIMEDOUT, st, out);
    ck_abort_msg("AMX_CHECK_GOTO did not jump");
out:
    ck_assert_int_eq(st, AMX_ETIMEDOUT);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("status");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, texts_and_grpc_codes);
    tcase_add_test(tc, first_error_wins);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
