/*
 * test_comm.c - the collective interface's factory (comm.c) and the
 * backend of a job with one participant (comm_local.c): which backends this
 * build has, the refusal of unknown or absent ones, and the local
 * all-reduce. The Gloo backend has its own file (test_comm_gloo.c).
 */
#include <check.h>
#include <string.h>

#include "comm.h"
#include "unit.h"

START_TEST(backends_by_name)
{
    ck_assert_int_eq(amx_comm_available("local"), 1);
#ifdef AMX_HAVE_GLOO
    ck_assert_int_eq(amx_comm_available("gloo"), 1);
#else
    ck_assert_int_eq(amx_comm_available("gloo"), 0);
#endif
#ifdef AMX_HAVE_NCCL
    ck_assert_int_eq(amx_comm_available("nccl"), 1);
#else
    ck_assert_int_eq(amx_comm_available("nccl"), 0);
    amx_comm_t *n = NULL;
    amx_err_t e = {0};
    amx_comm_params_t np = {0};
    ck_assert_int_eq(amx_comm_create("nccl", &np, &n, &e), AMX_EUNAVAIL);
    AMX_ASSERT_HAS(e.msg, "built without NCCL");
    ck_assert_ptr_null(n);
#endif
    ck_assert_int_eq(amx_comm_available("mpi"), 0);
    amx_comm_t *c = NULL;
    amx_err_t err = {0};
    amx_comm_params_t p = {0};
    ck_assert_int_eq(amx_comm_create("mpi", &p, &c, &err), AMX_EINVAL);
    ck_assert_str_eq(err.msg, "unknown collective backend 'mpi'");
    ck_assert_ptr_null(c);
}
END_TEST

START_TEST(local_allreduce_is_a_copy)
{
    amx_comm_t *c = NULL;
    amx_err_t err = {0};
    amx_comm_params_t p = {.rank = 0, .size = 1};
    ck_assert_int_eq(amx_comm_create("local", &p, &c, &err), AMX_OK);
    ck_assert_str_eq(c->ops->name, "local");
    ck_assert_int_eq(c->rank, 0);
    ck_assert_int_eq(c->size, 1);
    ck_assert_int_eq(c->on_device, 0);
    float send[5] = {1, -2, 3.5f, 0, 7}, recv[5] = {9, 9, 9, 9, 9};
    ck_assert_int_eq(c->ops->allreduce_max(c, send, recv, 4, NULL, 0, &err), AMX_OK);
    for (int i = 0; i < 4; i++)
        ck_assert_float_eq(recv[i], send[i]);
    ck_assert_float_eq(recv[4], 9.0f); /* n cells, no more */
    /* In place is fine too. */
    ck_assert_int_eq(c->ops->allreduce_max(c, send, send, 5, NULL, 0, &err), AMX_OK);
    ck_assert_float_eq(send[2], 3.5f);
    c->ops->abort(c); /* idempotent, and nothing to abort */
    c->ops->abort(c);
    c->ops->destroy(c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("comm");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, backends_by_name);
    tcase_add_test(tc, local_allreduce_is_a_copy);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
