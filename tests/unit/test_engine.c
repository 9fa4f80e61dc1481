/*
 * test_engine.c - the epoch engine of a job with one participant (this
 * daemon alone: no agreement, no collective), driven as the registry
 * drives it: the loop flips the pending buffers, hands the epoch to the
 * engine thread and reads the outcome when the engine posts it. Epochs
 * finish on the host backend; proposals are adopted locally and the
 * layout changes under them; resets and history heads move as agreed; a
 * device fault fails the epoch; a reconciled epoch is written to the job's
 * snapshot. Jobs of several daemons need peers and a coordinator: the
 * cluster suite (tests/cluster) runs them.
 */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "engine_impl.h"
#include "log.h"
#include "snapshot.h"
#include "unit_job.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int posted;
static amx_job_t *posted_job;

/* env.post: on the engine thread. */
static void on_post(void *ud, amx_job_t *job)
{
    (void)ud;
    pthread_mutex_lock(&mu);
    posted++;
    posted_job = job;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
}

static amx_config_t cfg;
static amx_engine_env_t env;
static amx_job_t job;

static void setup(void)
{
    amx_log_level = AMX_LOG_ERROR;
    amx_config_init(&cfg);
    env = (amx_engine_env_t){.cfg = &cfg, .collective = "local", .post = on_post};
    posted = 0;
    posted_job = NULL;
}

static void teardown(void)
{
    amx_engine_destroy(job.eng);
    unit_job_free(&job);
    amx_config_free(&cfg);
}

/* What the loop does to start an epoch, then waits (10 s at most) for the
 * engine's post; returns the outcome. */
static amx_epoch_result_t *run_epoch(amx_job_t *j)
{
    amx_err_t err = {0};
    if (j->eng == NULL)
        ck_assert_int_eq(amx_engine_create(j, &env, &j->eng, &err), AMX_OK);
    pthread_mutex_lock(&mu);
    int before = posted;
    pthread_mutex_unlock(&mu);
    j->state->ops->flip(j->state);
    j->in_flight = 1;
    amx_engine_start(j->eng, j->epoch, UINT64_MAX, 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    pthread_mutex_lock(&mu);
    while (posted == before)
        if (pthread_cond_timedwait(&cv, &mu, &until) != 0)
            break;
    int done = posted > before;
    pthread_mutex_unlock(&mu);
    ck_assert_msg(done, "the engine did not post epoch %llu", (unsigned long long)j->epoch);
    ck_assert_ptr_eq(posted_job, j);
    j->in_flight = 0;
    return amx_engine_result(j->eng);
}

/* The loop's side of a reconciled epoch (reconcile.c): publish, count. */
static void publish(amx_job_t *j, const amx_epoch_result_t *r)
{
    if (r->publish)
        j->state->ops->publish(j->state);
    if (r->reconciled) {
        j->last_reconciled = j->epoch;
        j->epoch++;
        j->epochs_ok++;
    }
}

/* The published amax of cells [0, n). */
static void results(amx_job_t *j, uint64_t n, float *amax, float *scale)
{
    amx_err_t err = {0};
    float inv[64];
    uint8_t bytes[64];
    ck_assert_uint_le(n, 64);
    amx_run_t all = {0, 0, n};
    ck_assert_int_eq(
        j->state->ops->read_results(j->state, &all, 1, n, amax, scale, inv, bytes, &err), AMX_OK);
}

START_TEST(epochs_of_one_participant)
{
    amx_qspec_t *q[2] = {unit_spec("b", 1, NULL), unit_spec("a", 2, NULL)};
    unit_job_make(&job, "j", 1, 1, q, 2, NULL, 0);
    float e1[3] = {2, 4, 1};
    unit_job_send(&job, e1, 3);
    amx_epoch_result_t *r = run_epoch(&job);
    ck_assert_msg(r->st == AMX_OK, "%s", r->msg);
    ck_assert_int_eq(r->reconciled, 1);
    ck_assert_uint_eq(r->epoch, 1);
    ck_assert_int_eq(r->publish, 1);
    ck_assert_int_eq(r->resets_applied, 1);
    ck_assert_ptr_null(r->cat); /* no proposal: the layout did not change */
    ck_assert_uint_eq(r->collectives, 0);
    ck_assert_int_eq(r->imported, 0);
    ck_assert_int_eq(r->snapshot_ok, 0); /* snapshots are off */
    ck_assert_uint_le(r->begin_at_us, r->end_at_us);
    ck_assert_uint_eq(amx_engine_comm_gen(job.eng), 0);
    publish(&job, r);
    float amax[3], scale[3];
    results(&job, 3, amax, scale);
    ck_assert_float_eq(amax[0], 2.0f); /* a (sorted first) */
    ck_assert_float_eq(amax[1], 4.0f);
    ck_assert_float_eq(amax[2], 1.0f); /* b */
    ck_assert_float_eq(scale[1], 112.0f);
    /* The next epoch: the running max goes on; a cell without data this
     * epoch keeps its value. */
    float e2[3] = {3, -INFINITY, 0.5f};
    unit_job_send(&job, e2, 3);
    r = run_epoch(&job);
    ck_assert_msg(r->st == AMX_OK, "%s", r->msg);
    ck_assert_uint_eq(r->epoch, 2);
    publish(&job, r);
    results(&job, 3, amax, scale);
    ck_assert_float_eq(amax[0], 3.0f);
    ck_assert_float_eq(amax[1], 4.0f);
    ck_assert_float_eq(amax[2], 1.0f);
    ck_assert_float_eq(job.state->g_amax[job.state->front][0], 4.0f);
    /* An abort while idle changes nothing for a job of one daemon. */
    amx_engine_abort(job.eng, 0, 0, 0, 0, AMX_ENGINE_LOCAL, AMX_EABORTED, "test");
    float e3[3] = {0, 0, 9};
    unit_job_send(&job, e3, 3);
    r = run_epoch(&job);
    ck_assert_msg(r->st == AMX_OK, "%s", r->msg);
    publish(&job, r);
    results(&job, 3, amax, scale);
    ck_assert_float_eq(amax[2], 9.0f);
}
END_TEST

/* Proposals of a job of one daemon are adopted at its next epoch: a new
 * catalog, its layout, and the contributions moved from their provisional
 * cells into it. */
START_TEST(proposals_adopted_locally)
{
    amx_qspec_t *agreed[1] = {unit_spec("m", 1, NULL)};
    amx_qspec_t *prop[2] = {unit_spec("z", 2, NULL), unit_spec("a", 1, NULL)};
    unit_job_make(&job, "j", 1, 1, agreed, 1, prop, 2);
    ck_assert_uint_eq(job.prov_cells, 3);
    /* Pending layout: m at 0, z at 1..2, a at 3. */
    float v[4] = {5, 7, 8, 9};
    unit_job_send(&job, v, 4);
    amx_epoch_result_t *r = run_epoch(&job);
    ck_assert_msg(r->st == AMX_OK, "%s", r->msg);
    ck_assert_int_eq(r->reconciled, 1);
    ck_assert_ptr_nonnull(r->cat);
    ck_assert_uint_eq(r->cat->n, 3);
    ck_assert_str_eq(r->cat->q[0]->name, "a");
    ck_assert_str_eq(r->cat->q[1]->name, "m");
    ck_assert_str_eq(r->cat->q[2]->name, "z");
    ck_assert_uint_eq(r->desc[2].base, 2);
    ck_assert_uint_eq(r->nrejected, 0);
    /* The loop's active buffer moves with it: runs from the old pending
     * layout (m 0, z 1, a 3) to the new one (a 0, m 1, z 2). */
    ck_assert_uint_eq(r->pend_change.ncells, 4);
    ck_assert_uint_eq(r->pend_change.npend_runs, 3);
    uint64_t src_of[4] = {~0ull, ~0ull, ~0ull, ~0ull};
    for (size_t k = 0; k < r->pend_change.npend_runs; k++)
        for (uint64_t c = 0; c < r->pend_change.pend[k].len; c++)
            src_of[r->pend_change.pend[k].dst + c] = r->pend_change.pend[k].src + c;
    ck_assert_uint_eq(src_of[0], 3);
    ck_assert_uint_eq(src_of[1], 0);
    ck_assert_uint_eq(src_of[2], 1);
    ck_assert_uint_eq(src_of[3], 2);
    /* The state follows the new catalog. */
    ck_assert_uint_eq(job.state->ncells, 4);
    ck_assert_uint_eq(job.state->nq, 3);
    amx_err_t err = {0};
    ck_assert_int_eq(job.state->ops->remap_active(job.state, &r->pend_change, &err), AMX_OK);
    publish(&job, r);
    float amax[4], scale[4];
    results(&job, 4, amax, scale);
    ck_assert_float_eq(amax[0], 9.0f); /* a */
    ck_assert_float_eq(amax[1], 5.0f); /* m */
    ck_assert_float_eq(amax[2], 7.0f); /* z */
    ck_assert_float_eq(amax[3], 8.0f);
    ck_assert_float_eq(job.state->g_amax[job.state->front][2], 8.0f);
}
END_TEST

/* A Reset waiting for the epoch: applied by the engine's finish, and the
 * descriptor's flag cleared; a PER_EPOCH history's head moves round. */
START_TEST(resets_and_history_heads)
{
    amx_qspec_t *q[2] = {unit_spec("h", 1, NULL), unit_spec("r", 1, NULL)};
    q[0]->accumulation = AMX_ACC_PER_EPOCH;
    q[0]->recipe.rule = AMX_RULE_DELAYED;
    q[0]->recipe.history_len = 3;
    q[0]->recipe.history_convention = AMX_HISTCONV_TE_UNFUSED;
    unit_job_make(&job, "j", 1, 1, q, 2, NULL, 0);
    static const uint32_t heads[4] = {1, 2, 0, 1};
    float amax[2], scale[2];
    for (int e = 0; e < 4; e++) {
        float v[2] = {(float)(10 - e), (float)(10 - e)};
        if (e == 2) {
            /* Reset "r" (lid 1) before epoch 3. */
            job.lq[1].reset = 1;
            job.nreset = 1;
        }
        unit_job_send(&job, v, 2);
        amx_epoch_result_t *r = run_epoch(&job);
        ck_assert_msg(r->st == AMX_OK, "%s", r->msg);
        publish(&job, r);
        if (e == 2) {
            job.lq[1].reset = 0;
            job.nreset = 0;
        }
        ck_assert_uint_eq(job.desc[0].hist_head, heads[e]);
        ck_assert_uint_eq(job.desc[1].hist_head, 0);
        ck_assert_int_eq(job.desc[1].reset, 0);
        results(&job, 2, amax, scale);
        /* The window of 3 keeps the max of the last three epochs. */
        ck_assert_float_eq(amax[0], 10.0f - (float)(e > 2 ? e - 2 : 0));
        /* The running max restarts at the reset. */
        ck_assert_float_eq(amax[1], e < 2 ? 10.0f : 8.0f);
    }
}
END_TEST

START_TEST(device_fault_fails_the_epoch)
{
    setenv("AMAXD_TEST_DEVICE_FAULT", "1", 1); /* fork mode: this test only */
    amx_qspec_t *q[1] = {unit_spec("a", 2, NULL)};
    unit_job_make(&job, "jf", 1, 1, q, 1, NULL, 0);
    float v[2] = {1, 2};
    unit_job_send(&job, v, 2);
    amx_epoch_result_t *r = run_epoch(&job);
    ck_assert_int_eq(r->st, AMX_EDEVICE);
    ck_assert_int_eq(r->reconciled, 0);
    ck_assert_int_eq(r->resets_applied, 0);
    ck_assert_uint_eq(r->epoch, 1);
    ck_assert_str_eq(r->msg, "job 'jf', epoch 1: finishing failed: simulated device fault "
                             "(AMAXD_TEST_DEVICE_FAULT is set; a test aid)");
    /* The loop gives the contributions back to the active buffer. */
    amx_err_t err = {0};
    ck_assert_int_eq(job.state->ops->unflip(job.state, 1, &err), AMX_OK);
}
END_TEST

/* A reconciled epoch is on disk before Reconcile is answered: the job's
 * section and its state, as restore.c reads them. */
START_TEST(reconciled_epoch_is_snapshotted)
{
    char dir[] = "/tmp/amx-engine-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    amx_err_t err = {0};
    ck_assert_int_eq(amx_config_set(&cfg, "state_dir", dir, &err), AMX_OK);
    amx_qspec_t *q[2] = {unit_spec("a", 2, NULL), unit_spec("b", 1, NULL)};
    unit_job_make(&job, "snapjob", 4, 2, q, 2, NULL, 0);
    float v[3] = {1, 6, 3};
    unit_job_send(&job, v, 3);
    amx_epoch_result_t *r = run_epoch(&job);
    ck_assert_msg(r->st == AMX_OK, "%s", r->msg);
    ck_assert_msg(r->snapshot_ok, "no snapshot: %s", r->snapshot_err);
    ck_assert_uint_gt(r->snapshot_bytes, 0);
    char path[128];
    snprintf(path, sizeof(path), "%s/snapjob.amxs", dir);
    amx_snapshot_t s;
    ck_assert_msg(amx_snapshot_read(path, &s, &err) == AMX_OK, "%s", err.msg);
    ck_assert_str_eq(s.meta.job, "snapjob");
    ck_assert_uint_eq(s.meta.world, 4);
    ck_assert_uint_eq(s.meta.epochs_ok, 1);
    ck_assert_uint_eq(s.meta.nranks, 2);
    ck_assert_uint_eq(s.meta.ranks[1].rank, 1);
    ck_assert_uint_eq(s.meta.ranks[1].n, 2);
    ck_assert_str_eq(s.meta.ranks[1].pls[0].name, "a");
    ck_assert_uint_eq(s.meta.ranks[1].pls[0].pl.ncells, 2);
    ck_assert_uint_eq(s.js.last_reconciled, 1);
    ck_assert_uint_eq(s.js.cat->hash, job.cat->hash);
    /* The epoch's own results (the back set, not yet published). */
    ck_assert_float_eq(s.js.a.out_amax[1], 6.0f);
    ck_assert_float_eq(s.js.a.g_amax[1], 3.0f);
    amx_snapshot_free(&s);
    unlink(path);
    rmdir(dir);
}
END_TEST

START_TEST(fetch_without_a_published_state)
{
    amx_qspec_t *q[1] = {unit_spec("a", 1, NULL)};
    unit_job_make(&job, "j", 1, 1, q, 1, NULL, 0);
    amx_err_t err = {0};
    ck_assert_int_eq(amx_engine_create(&job, &env, &job.eng, &err), AMX_OK);
    void *data = NULL;
    size_t len = 0;
    uint64_t total = 0;
    ck_assert_int_eq(amx_engine_fetch(job.eng, 5, 0, 1024, &data, &len, &total, &err),
                     AMX_EUNAVAIL);
    ck_assert_str_eq(err.msg, "the state for agreement 5 is not ready here");
    ck_assert_ptr_null(data);
}
END_TEST

/* The reduced header (engine_impl.h): the element-wise MAX of every
 * daemon's, as the collective gives it. */
static void hdr_max(float *into, const float *h)
{
    for (int i = 0; i < AMX_HDR_CELLS; i++)
        into[i] = fmaxf(into[i], h[i]);
}

START_TEST(header_verdicts)
{
    const uint64_t ep = 7, hash = 0x1234abcd5678ef90ull, gen = 3, cells = 1000;
    float mine[AMX_HDR_CELLS], peer[AMX_HDR_CELLS], r[AMX_HDR_CELLS];
    amx__engine_make_header(mine, ep, hash, gen, cells, 0);
    amx__engine_make_header(peer, ep, hash, gen, cells, 1);
    memcpy(r, mine, sizeof(r));
    hdr_max(r, peer);
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_OK);
    ck_assert_float_eq(r[H_FLAG], 1.0f); /* some daemon asked for an agreement */

    /* A daemon missing: its part of the receive buffer stayed poisoned (0). */
    memcpy(r, mine, sizeof(r));
    r[H_VERSION] = 0.0f;
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);

    /* A daemon of the older header wrote +1.0 there (and its epoch's
     * pieces as this one does). */
    memcpy(r, mine, sizeof(r));
    r[H_VERSION] = fmaxf(r[H_VERSION], 1.0f);
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_OLD_VERSION);
    /* 1.0 with the epoch's pieces garbage: a data value, not a version
     * (the GPU test's slabs hold 1.0). */
    r[H_EPOCH] = 1.0f;
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);

    /* A collective stopped under way (4 daemons over NCCL, one aborting an
     * armed epoch, 2026-11-27) left any positive value there: incomplete,
     * not "another version". */
    memcpy(r, mine, sizeof(r));
    r[H_VERSION] = 3.5e7f;
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);
    r[H_VERSION] = 2.0f;
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);

    /* Garbage in a piece of the epoch, or every daemon on another epoch. */
    memcpy(r, mine, sizeof(r));
    r[H_EPOCH + 1] = 17.0f;
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);
    /* A piece and its complement that agree on what no piece can be
     * (negative, fractional, past 65535): not a field. */
    const float bad[] = {-3.0f, 0.5f, 70000.0f, NAN};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        memcpy(r, mine, sizeof(r));
        r[H_EPOCH + 3] = bad[i];
        r[H_EPOCH + 3 + 4] = 65535.0f - bad[i];
        ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);
    }
    amx__engine_make_header(r, ep + 1, hash, gen, cells, 0);
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);
    amx__engine_make_header(peer, ep - 1, hash, gen, cells, 0);
    memcpy(r, mine, sizeof(r));
    hdr_max(r, peer);
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_INCOMPLETE);

    /* Every daemon there, different catalogs (hash or cells). */
    amx__engine_make_header(peer, ep, hash ^ 0x10000ull, gen, cells, 0);
    memcpy(r, mine, sizeof(r));
    hdr_max(r, peer);
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_CATALOG);
    amx__engine_make_header(peer, ep, hash, gen, cells + 1, 0);
    memcpy(r, mine, sizeof(r));
    hdr_max(r, peer);
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_CATALOG);

    /* Every daemon there, different communicators. */
    amx__engine_make_header(peer, ep, hash, gen + 1, cells, 0);
    memcpy(r, mine, sizeof(r));
    hdr_max(r, peer);
    ck_assert_int_eq(amx__engine_header_verdict(r, ep, hash, gen, cells), AMX_HDR_COMM);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("engine");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, epochs_of_one_participant);
    tcase_add_test(tc, proposals_adopted_locally);
    tcase_add_test(tc, resets_and_history_heads);
    tcase_add_test(tc, device_fault_fails_the_epoch);
    tcase_add_test(tc, reconciled_epoch_is_snapshotted);
    tcase_add_test(tc, fetch_without_a_published_state);
    tcase_add_test(tc, header_verdicts);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
