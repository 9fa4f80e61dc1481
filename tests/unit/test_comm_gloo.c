/*
 * test_comm_gloo.c - the Gloo collective backend (comm_gloo.cc) over
 * loopback: rendezvous through an in-test key-value store, bit-exact MAX
 * against a scalar reference, deadlines, peers that go away, abort.
 *
 * Ranks are threads of the test (Check runs each test in a forked child),
 * or forked processes where a rank must die. The key-value store lives in
 * a MAP_SHARED mapping with process-shared locks, so both kinds share it.
 * Timings are printed on stderr ("timing: ...") for the notes.
 */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "comm.h"
#include "log.h"

/* ---- an in-test key-value store (amx_kv_t) ---- */

enum { KV_SLOTS = 256, KV_KEY = 160, KV_VAL = 2048, MAX_RANKS = 4 };

typedef struct kv_entry {
    int used;
    char key[KV_KEY];
    size_t len;
    unsigned char val[KV_VAL];
} kv_entry_t;

/* What a forked rank reports back. */
typedef struct proc_result {
    amx_status_t create_st, op_st;
    uint64_t t_op_end;
    char msg[768];
} proc_result_t;

typedef struct shared {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int cancelled; /* gets fail with EABORTED (a caller cancelling a rendezvous) */
    kv_entry_t e[KV_SLOTS];
    uint64_t t_death; /* when the dying rank went away */
    proc_result_t res[MAX_RANKS];
} shared_t;

static shared_t *sh;
static amx_kv_t kv;

static kv_entry_t *kv_find(const char *key)
{
    for (int i = 0; i < KV_SLOTS; i++)
        if (sh->e[i].used && strcmp(sh->e[i].key, key) == 0)
            return &sh->e[i];
    return NULL;
}

static amx_status_t kv_set(void *ud, const char *key, const void *val, size_t len, amx_err_t *err)
{
    (void)ud;
    if (strlen(key) >= KV_KEY || len > KV_VAL)
        return amx_err_set(err, AMX_ERANGE, "test kv: key or value too long");
    pthread_mutex_lock(&sh->mu);
    kv_entry_t *e = kv_find(key);
    for (int i = 0; e == NULL && i < KV_SLOTS; i++)
        if (!sh->e[i].used)
            e = &sh->e[i];
    if (e == NULL) {
        pthread_mutex_unlock(&sh->mu);
        return amx_err_set(err, AMX_ENOMEM, "test kv: full");
    }
    e->used = 1;
    strcpy(e->key, key);
    memcpy(e->val, val, len);
    e->len = len;
    pthread_cond_broadcast(&sh->cv);
    pthread_mutex_unlock(&sh->mu);
    return AMX_OK;
}

static amx_status_t kv_get(void *ud, const char *key, uint64_t deadline_ms, void **val, size_t *len,
                           amx_err_t *err)
{
    (void)ud;
    struct timespec ts = {(time_t)(deadline_ms / 1000), (long)(deadline_ms % 1000) * 1000000L};
    amx_status_t st = AMX_OK;
    pthread_mutex_lock(&sh->mu);
    kv_entry_t *e;
    while ((e = kv_find(key)) == NULL) {
        if (sh->cancelled) {
            st = amx_err_set(err, AMX_EABORTED, "test kv: cancelled while waiting for '%s'", key);
            break;
        }
        if (pthread_cond_timedwait(&sh->cv, &sh->mu, &ts) == ETIMEDOUT && kv_find(key) == NULL) {
            st = amx_err_set(err, AMX_ETIMEDOUT, "test kv: no key '%s' by the deadline", key);
            break;
        }
    }
    if (e != NULL) {
        *val = malloc(e->len ? e->len : 1);
        memcpy(*val, e->val, e->len);
        *len = e->len;
    }
    pthread_mutex_unlock(&sh->mu);
    return st;
}

static void kv_cancel(void)
{
    pthread_mutex_lock(&sh->mu);
    sh->cancelled = 1;
    pthread_cond_broadcast(&sh->cv);
    pthread_mutex_unlock(&sh->mu);
}

static void setup(void)
{
    amx_log_level = AMX_LOG_ERROR;
    sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    ck_assert_ptr_ne(sh, MAP_FAILED);
    memset(sh, 0, sizeof(*sh));
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutex_init(&sh->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines are amx_now_ms() values */
    pthread_cond_init(&sh->cv, &ca);
    pthread_condattr_destroy(&ca);
    kv.ud = NULL;
    kv.set = kv_set;
    kv.get = kv_get;
}

static void teardown(void)
{
    pthread_cond_destroy(&sh->cv);
    pthread_mutex_destroy(&sh->mu);
    munmap(sh, sizeof(*sh));
}

/* ---- helpers ---- */

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
    }
}

static amx_comm_params_t params(int rank, int size, const char *prefix, uint64_t deadline_ms)
{
    amx_comm_params_t p;
    memset(&p, 0, sizeof(p));
    p.rank = rank;
    p.size = size;
    p.kv = &kv;
    p.prefix = prefix;
    p.host = "127.0.0.1";
    p.cuda_device = -1;
    p.deadline_ms = deadline_ms;
    return p;
}

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Amax-like cells: finite >= 0 (subnormals, +0 and -0 included) or -inf. */
static void fill(float *v, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < n; i++) {
        uint64_t x = rng_next(&s);
        unsigned k = (unsigned)(x % 100);
        if (k < 10) {
            v[i] = -INFINITY;
        } else if (k < 15) {
            v[i] = 0.0f;
        } else if (k < 20) {
            v[i] = -0.0f;
        } else {
            uint32_t bits = ((uint32_t)((x >> 8) % 255u) << 23) | ((uint32_t)(x >> 32) & 0x7FFFFFu);
            memcpy(&v[i], &bits, sizeof(bits));
        }
    }
}

/* The contract's MAX: +0 beats -0, so that the result is order-free. */
static float ref_max(float a, float b)
{
    return (b > a || (b == a && !signbit(b))) ? b : a;
}

/* Asserts bit equality and prints the first differing cell. */
static void assert_same_bits(const float *got, const float *want, size_t n, const char *what)
{
    if (memcmp(got, want, n * sizeof(float)) == 0)
        return;
    for (size_t i = 0; i < n; i++) {
        uint32_t g, w;
        memcpy(&g, &got[i], 4);
        memcpy(&w, &want[i], 4);
        ck_assert_msg(g == w, "%s: cell %zu of %zu: got %a (0x%08x), want %a (0x%08x)", what, i, n,
                      (double)got[i], g, (double)want[i], w);
    }
}

/* ---- one rank on a thread ---- */

typedef struct rank_t rank_t;
struct rank_t {
    int rank, size;
    const char *prefix;
    uint64_t create_deadline;
    amx_comm_t *comm;
    amx_status_t create_st;
    amx_err_t create_err;
    uint64_t t_create_end;
    /* the scenario after create, run on the rank's thread */
    void (*body)(rank_t *r);
    /* a collective */
    size_t n;
    float *send, *recv;
    uint64_t op_deadline;
    amx_status_t op_st;
    amx_err_t op_err;
    uint64_t t_op_start, t_op_end;
    /* a second collective, right after the first */
    amx_status_t op2_st;
    uint64_t op2_ms;
    /* scenario knobs: what the body does (see each body), and when */
    int flag;
    int abort_first;
    uint64_t t_mark;
};

static void *rank_main(void *arg)
{
    rank_t *r = arg;
    amx_comm_params_t p = params(r->rank, r->size, r->prefix, r->create_deadline);
    r->create_st = amx__comm_gloo_create(&p, &r->comm, &r->create_err);
    r->t_create_end = amx_now_ms();
    if (r->create_st == AMX_OK && r->body != NULL)
        r->body(r);
    return NULL;
}

static void run_ranks(rank_t *rs, int k)
{
    pthread_t t[MAX_RANKS + 1];
    for (int i = 0; i < k; i++)
        ck_assert_int_eq(pthread_create(&t[i], NULL, rank_main, &rs[i]), 0);
    for (int i = 0; i < k; i++)
        pthread_join(t[i], NULL);
}

static void rank_init(rank_t *r, int rank, int size, const char *prefix, uint64_t deadline_ms)
{
    memset(r, 0, sizeof(*r));
    r->rank = rank;
    r->size = size;
    r->prefix = prefix;
    r->create_deadline = deadline_ms;
}

static void do_op(rank_t *r)
{
    r->t_op_start = amx_now_ms();
    r->op_st = r->comm->ops->allreduce_max(r->comm, r->send, r->recv, r->n, NULL, r->op_deadline,
                                           &r->op_err);
    r->t_op_end = amx_now_ms();
}

/* A second call after the first; it must fail fast if the first failed. */
static void do_op_again(rank_t *r)
{
    amx_err_t err = {0};
    uint64_t t0 = amx_now_ms();
    r->op2_st = r->comm->ops->allreduce_max(r->comm, r->send, r->recv, r->n, NULL,
                                            amx_now_ms() + 30000, &err);
    r->op2_ms = amx_now_ms() - t0;
}

static void destroy_all(rank_t *rs, int k)
{
    for (int i = 0; i < k; i++)
        if (rs[i].comm != NULL)
            rs[i].comm->ops->destroy(rs[i].comm);
}

/* ---- tests ---- */

START_TEST(test_size1)
{
    rank_t r;
    rank_init(&r, 0, 1, "t/size1", amx_now_ms() + 5000);
    run_ranks(&r, 1);
    ck_assert_int_eq(r.create_st, AMX_OK);
    ck_assert_str_eq(r.comm->ops->name, "gloo");
    ck_assert_int_eq(r.comm->rank, 0);
    ck_assert_int_eq(r.comm->size, 1);
    ck_assert_int_eq(r.comm->on_device, 0);

    float send[5] = {1.0f, -INFINITY, 0.0f, 3.5f, -0.0f}, keep[5], recv[5] = {0};
    memcpy(keep, send, sizeof(send));
    amx_err_t err = {0};
    ck_assert_int_eq(
        r.comm->ops->allreduce_max(r.comm, send, recv, 5, NULL, amx_now_ms() + 1000, &err), AMX_OK);
    assert_same_bits(recv, keep, 5, "size 1 result");
    assert_same_bits(send, keep, 5, "size 1 send");
    ck_assert_int_eq(r.comm->ops->allreduce_max(r.comm, NULL, NULL, 0, NULL, 0, &err), AMX_OK);

    r.comm->ops->abort(r.comm);
    r.comm->ops->abort(r.comm); /* idempotent */
    ck_assert_int_eq(
        r.comm->ops->allreduce_max(r.comm, send, recv, 5, NULL, amx_now_ms() + 1000, &err),
        AMX_EABORTED);
    ck_assert_int_eq(err.code, AMX_EABORTED);
    r.comm->ops->destroy(r.comm);
}
END_TEST

START_TEST(test_bad_params)
{
    amx_comm_t *c = (amx_comm_t *)&c; /* not NULL: create must clear it */
    amx_err_t err = {0};
    amx_comm_params_t p = params(2, 2, "t/bad", amx_now_ms() + 1000);
    ck_assert_int_eq(amx__comm_gloo_create(&p, &c, &err), AMX_EINVAL);
    ck_assert_ptr_null(c);
    p = params(0, 2, "t/bad", amx_now_ms() + 1000);
    p.kv = NULL;
    ck_assert_int_eq(amx__comm_gloo_create(&p, &c, NULL), AMX_EINVAL);
    p = params(0, 2, "t/bad", amx_now_ms() + 1000);
    p.host = "";
    ck_assert_int_eq(amx__comm_gloo_create(&p, &c, NULL), AMX_EINVAL);
    ck_assert_int_eq(amx__comm_gloo_create(NULL, &c, NULL), AMX_EINVAL);

    /* gloo itself crashes on a name that does not resolve: the shim checks. */
    amx_err_clear(&err);
    p = params(0, 2, "t/bad", amx_now_ms() + 1000);
    p.host = "no-such-host.invalid";
    ck_assert_int_eq(amx__comm_gloo_create(&p, &c, &err), AMX_EINVAL);
    ck_assert_ptr_nonnull(strstr(err.msg, "no-such-host.invalid"));
    amx_err_clear(&err);
    p.host = "192.0.2.1"; /* TEST-NET-1: not an address of this machine */
    ck_assert_int_eq(amx__comm_gloo_create(&p, &c, &err), AMX_EINVAL);
    ck_assert_ptr_null(c);
}
END_TEST

/* Several collectives of several sizes (n < size included), bit-exact. */
static const size_t sizes[] = {10007, 1, 2, 3, 0, 4099, 64};
enum { NSIZES = sizeof(sizes) / sizeof(sizes[0]) };

typedef struct exact_run {
    float *send[NSIZES], *keep[NSIZES], *recv[NSIZES];
    amx_status_t st[NSIZES];
    amx_err_t err[NSIZES];
} exact_run_t;

static exact_run_t exact[MAX_RANKS];

static void body_exact(rank_t *r)
{
    exact_run_t *x = &exact[r->rank];
    for (int j = 0; j < NSIZES; j++)
        x->st[j] = r->comm->ops->allreduce_max(r->comm, x->send[j], x->recv[j], sizes[j], NULL,
                                               amx_now_ms() + 20000, &x->err[j]);
}

static void check_exact(int size, const char *prefix)
{
    rank_t rs[MAX_RANKS];
    for (int i = 0; i < size; i++) {
        rank_init(&rs[i], i, size, prefix, amx_now_ms() + 10000);
        rs[i].body = body_exact;
        for (int j = 0; j < NSIZES; j++) {
            size_t n = sizes[j] ? sizes[j] : 1;
            exact[i].send[j] = malloc(n * sizeof(float));
            exact[i].keep[j] = malloc(n * sizeof(float));
            exact[i].recv[j] = malloc(n * sizeof(float));
            fill(exact[i].send[j], n, (uint64_t)(size * 1000 + i * 10 + j));
            memcpy(exact[i].keep[j], exact[i].send[j], n * sizeof(float));
            memset(exact[i].recv[j], 0x5A, n * sizeof(float));
        }
    }
    run_ranks(rs, size);
    for (int i = 0; i < size; i++)
        ck_assert_int_eq(rs[i].create_st, AMX_OK);
    for (int j = 0; j < NSIZES; j++) {
        size_t n = sizes[j];
        float *want = malloc((n ? n : 1) * sizeof(float));
        for (size_t k = 0; k < n; k++) {
            want[k] = exact[0].keep[j][k];
            for (int i = 1; i < size; i++)
                want[k] = ref_max(want[k], exact[i].keep[j][k]);
        }
        for (int i = 0; i < size; i++) {
            ck_assert_msg(exact[i].st[j] == AMX_OK, "rank %d, n %zu: status %d (%s)", i, n,
                          exact[i].st[j], exact[i].err[j].msg);
            assert_same_bits(exact[i].recv[j], want, n, "result");
            assert_same_bits(exact[i].send[j], exact[i].keep[j], n, "send buffer");
        }
        free(want);
    }
    destroy_all(rs, size);
    for (int i = 0; i < size; i++)
        for (int j = 0; j < NSIZES; j++) {
            free(exact[i].send[j]);
            free(exact[i].keep[j]);
            free(exact[i].recv[j]);
        }
}

START_TEST(test_exact_2)
{
    check_exact(2, "t/exact2");
}
END_TEST

START_TEST(test_exact_3)
{
    check_exact(3, "t/exact3");
}
END_TEST

START_TEST(test_exact_4)
{
    check_exact(4, "t/exact4");
}
END_TEST

static void body_large(rank_t *r)
{
    for (int k = 0; k < 3; k++) {
        do_op(r);
        if (r->op_st != AMX_OK)
            return;
        fprintf(stderr, "timing: rank %d: allreduce of %zu floats over 3 ranks: %llu ms\n", r->rank,
                r->n, (unsigned long long)(r->t_op_end - r->t_op_start));
    }
}

START_TEST(test_large)
{
    enum { N = 3000000, P = 3 };
    rank_t rs[P];
    float *keep[P];
    for (int i = 0; i < P; i++) {
        rank_init(&rs[i], i, P, "t/large", amx_now_ms() + 10000);
        rs[i].body = body_large;
        rs[i].n = N;
        rs[i].send = malloc(N * sizeof(float));
        rs[i].recv = malloc(N * sizeof(float));
        keep[i] = malloc(N * sizeof(float));
        fill(rs[i].send, N, 77 + i);
        memcpy(keep[i], rs[i].send, N * sizeof(float));
        rs[i].op_deadline = amx_now_ms() + 60000;
    }
    run_ranks(rs, P);
    float *want = malloc(N * sizeof(float));
    for (size_t k = 0; k < N; k++)
        want[k] = ref_max(ref_max(keep[0][k], keep[1][k]), keep[2][k]);
    for (int i = 0; i < P; i++) {
        ck_assert_int_eq(rs[i].create_st, AMX_OK);
        ck_assert_msg(rs[i].op_st == AMX_OK, "rank %d: %d (%s)", i, rs[i].op_st, rs[i].op_err.msg);
        assert_same_bits(rs[i].recv, want, N, "large result");
        assert_same_bits(rs[i].send, keep[i], N, "large send");
    }
    destroy_all(rs, P);
    for (int i = 0; i < P; i++) {
        free(rs[i].send);
        free(rs[i].recv);
        free(keep[i]);
    }
    free(want);
}
END_TEST

/* Rank 2 never joins: ranks 0 and 1 fail with ETIMEDOUT by the deadline. */
START_TEST(test_missing_rank)
{
    rank_t rs[2];
    uint64_t t0 = amx_now_ms(), deadline = t0 + 1500;
    for (int i = 0; i < 2; i++)
        rank_init(&rs[i], i, 3, "t/missing", deadline);
    run_ranks(rs, 2);
    for (int i = 0; i < 2; i++) {
        ck_assert_int_eq(rs[i].create_st, AMX_ETIMEDOUT);
        ck_assert_int_eq(rs[i].create_err.code, AMX_ETIMEDOUT);
        ck_assert_ptr_null(rs[i].comm);
        ck_assert_ptr_nonnull(strstr(rs[i].create_err.msg, "rendezvous"));
        fprintf(stderr, "timing: missing rank: rank %d failed %lld ms after its deadline\n", i,
                (long long)(rs[i].t_create_end - deadline));
        ck_assert_uint_ge(rs[i].t_create_end, deadline);
        ck_assert_uint_lt(rs[i].t_create_end, deadline + 500);
    }
}
END_TEST

/* The caller cancels a rendezvous through its kv store: create returns the
 * store's status at once (the API has no handle to abort before create). */
static void *cancel_later(void *arg)
{
    (void)arg;
    sleep_ms(200);
    kv_cancel();
    return NULL;
}

START_TEST(test_kv_cancel)
{
    rank_t r;
    rank_init(&r, 0, 2, "t/cancel", amx_now_ms() + 30000);
    pthread_t t;
    ck_assert_int_eq(pthread_create(&t, NULL, cancel_later, NULL), 0);
    uint64_t t0 = amx_now_ms();
    run_ranks(&r, 1);
    pthread_join(t, NULL);
    ck_assert_int_eq(r.create_st, AMX_EABORTED);
    ck_assert_uint_lt(r.t_create_end - t0, 1000);
}
END_TEST

/*
 * The end of a job: every rank destroys its communicator right after a
 * collective that succeeded, half of the rounds with abort first (as
 * engine.c's drop_comm does). A rank that finishes first closes its
 * connections while a neighbour may still be finishing; that must not fail
 * the neighbour's collective. Rank 1 is sometimes slow to enter (2 ms);
 * many rounds, two sizes.
 */
static void body_op_then_destroy(rank_t *r)
{
    if (r->flag)
        sleep_ms(r->flag);
    do_op(r);
    if (r->abort_first)
        r->comm->ops->abort(r->comm);
    r->comm->ops->destroy(r->comm);
    r->comm = NULL;
}

START_TEST(test_destroy_right_after)
{
    enum { P = 3, ROUNDS = 12 };
    static const size_t ns[2] = {1 << 20, 5};
    char prefix[32];
    for (int round = 0; round < ROUNDS; round++) {
        size_t n = ns[round % 2];
        rank_t rs[P];
        snprintf(prefix, sizeof(prefix), "t/end%d", round);
        for (int i = 0; i < P; i++) {
            rank_init(&rs[i], i, P, prefix, amx_now_ms() + 10000);
            rs[i].n = n;
            rs[i].send = malloc(n * sizeof(float));
            rs[i].recv = malloc(n * sizeof(float));
            fill(rs[i].send, n, (uint64_t)(round * 10 + i));
            rs[i].op_deadline = amx_now_ms() + 20000;
            rs[i].body = body_op_then_destroy;
            rs[i].flag = (i == 1 && round % 4 < 2) ? 2 : 0;
            rs[i].abort_first = round % 4 == 1 || round % 4 == 2;
        }
        run_ranks(rs, P);
        for (int i = 0; i < P; i++) {
            ck_assert_int_eq(rs[i].create_st, AMX_OK);
            ck_assert_msg(rs[i].op_st == AMX_OK, "round %d, rank %d: %d (%s)", round, i,
                          rs[i].op_st, rs[i].op_err.msg);
        }
        float *want = malloc(n * sizeof(float));
        for (size_t k = 0; k < n; k++)
            want[k] = ref_max(ref_max(rs[0].send[k], rs[1].send[k]), rs[2].send[k]);
        for (int i = 0; i < P; i++)
            assert_same_bits(rs[i].recv, want, n, "result after destroy");
        free(want);
        for (int i = 0; i < P; i++) {
            free(rs[i].send);
            free(rs[i].recv);
        }
    }
}
END_TEST

/*
 * Ranks 0 and 1 block in a collective (deadline 30 s away); rank 2, which
 * never enters it, goes away after 300 ms: by destroy or by abort. The
 * others must fail with EUNAVAIL within 2 s, and fail again at once.
 */
static void body_wait_op(rank_t *r)
{
    do_op(r);
    do_op_again(r);
}

static void body_leave(rank_t *r)
{
    sleep_ms(300);
    r->t_mark = amx_now_ms();
    if (r->flag == 0) {
        r->comm->ops->destroy(r->comm);
        r->comm = NULL;
    } else {
        r->comm->ops->abort(r->comm);
        r->t_op_end = amx_now_ms(); /* abort's own duration */
        do_op_again(r);
    }
}

static void check_peer_leaves(int by_abort, const char *prefix)
{
    enum { P = 3, N = 100000 };
    rank_t rs[P];
    for (int i = 0; i < P; i++) {
        rank_init(&rs[i], i, P, prefix, amx_now_ms() + 10000);
        rs[i].n = N;
        rs[i].send = calloc(N, sizeof(float));
        rs[i].recv = calloc(N, sizeof(float));
        rs[i].op_deadline = amx_now_ms() + 30000;
        rs[i].body = i < 2 ? body_wait_op : body_leave;
        rs[i].flag = by_abort;
    }
    run_ranks(rs, P);
    for (int i = 0; i < P; i++)
        ck_assert_int_eq(rs[i].create_st, AMX_OK);
    if (by_abort) {
        ck_assert_uint_lt(rs[2].t_op_end - rs[2].t_mark, 50); /* abort does not block */
        ck_assert_int_eq(rs[2].op2_st, AMX_EABORTED);
    }
    for (int i = 0; i < 2; i++) {
        long long after = (long long)rs[i].t_op_end - (long long)rs[2].t_mark;
        fprintf(stderr, "timing: rank 2 %s: rank %d failed %lld ms later (%s); again: %llu ms\n",
                by_abort ? "aborted" : "destroyed", i, after, amx_strerror(rs[i].op_st),
                (unsigned long long)rs[i].op2_ms);
        ck_assert_msg(rs[i].op_st == AMX_EUNAVAIL, "rank %d: %d (%s)", i, rs[i].op_st,
                      rs[i].op_err.msg);
        ck_assert_ptr_nonnull(strstr(rs[i].op_err.msg, "gloo allreduce of 100000 floats"));
        ck_assert_int_ge(after, 0);
        ck_assert_int_lt(after, 2000);
        ck_assert_int_eq(rs[i].op2_st, AMX_EUNAVAIL);
        ck_assert_uint_lt(rs[i].op2_ms, 100);
    }
    destroy_all(rs, P);
    for (int i = 0; i < P; i++) {
        free(rs[i].send);
        free(rs[i].recv);
    }
}

START_TEST(test_peer_destroys)
{
    check_peer_leaves(0, "t/destroy");
}
END_TEST

START_TEST(test_peer_aborts)
{
    check_peer_leaves(1, "t/abort");
}
END_TEST

/*
 * abort() from another thread while this rank blocks in the collective
 * (rank 2 is alive but never enters it): EABORTED at once here, EUNAVAIL
 * soon on rank 1, and both fail fast afterwards.
 */
static amx_comm_t *volatile to_abort;
static volatile uint64_t t_abort_call, t_abort_done;

static void *abort_later(void *arg)
{
    (void)arg;
    sleep_ms(300);
    t_abort_call = amx_now_ms();
    to_abort->ops->abort(to_abort);
    t_abort_done = amx_now_ms();
    return NULL;
}

static void body_abort_target(rank_t *r)
{
    pthread_t t;
    to_abort = r->comm;
    if (pthread_create(&t, NULL, abort_later, NULL) != 0)
        return;
    do_op(r);
    pthread_join(t, NULL);
    do_op_again(r);
}

static void body_idle(rank_t *r)
{
    sleep_ms(2500); /* alive, but never in the collective */
    (void)r;
}

START_TEST(test_abort_thread)
{
    enum { P = 3, N = 50000 };
    rank_t rs[P];
    for (int i = 0; i < P; i++) {
        rank_init(&rs[i], i, P, "t/abortthread", amx_now_ms() + 10000);
        rs[i].n = N;
        rs[i].send = calloc(N, sizeof(float));
        rs[i].recv = calloc(N, sizeof(float));
        rs[i].op_deadline = amx_now_ms() + 30000;
    }
    rs[0].body = body_abort_target;
    rs[1].body = body_wait_op;
    rs[2].body = body_idle;
    run_ranks(rs, P);
    for (int i = 0; i < P; i++)
        ck_assert_int_eq(rs[i].create_st, AMX_OK);
    long long r0 = (long long)rs[0].t_op_end - (long long)t_abort_call;
    long long r1 = (long long)rs[1].t_op_end - (long long)t_abort_call;
    fprintf(stderr,
            "timing: abort from another thread: abort() took %llu ms, rank 0 returned %lld ms "
            "later (%s), rank 1 %lld ms later (%s); again: %llu ms, %llu ms\n",
            (unsigned long long)(t_abort_done - t_abort_call), r0, amx_strerror(rs[0].op_st), r1,
            amx_strerror(rs[1].op_st), (unsigned long long)rs[0].op2_ms,
            (unsigned long long)rs[1].op2_ms);
    ck_assert_uint_lt(t_abort_done - t_abort_call, 50);
    ck_assert_msg(rs[0].op_st == AMX_EABORTED, "rank 0: %d (%s)", rs[0].op_st, rs[0].op_err.msg);
    ck_assert_int_ge(r0, 0);
    ck_assert_int_lt(r0, 500);
    ck_assert_msg(rs[1].op_st == AMX_EUNAVAIL, "rank 1: %d (%s)", rs[1].op_st, rs[1].op_err.msg);
    ck_assert_int_lt(r1, 2000);
    ck_assert_int_eq(rs[0].op2_st, AMX_EABORTED);
    ck_assert_uint_lt(rs[0].op2_ms, 100);
    ck_assert_int_eq(rs[1].op2_st, AMX_EUNAVAIL);
    ck_assert_uint_lt(rs[1].op2_ms, 100);
    destroy_all(rs, P);
    for (int i = 0; i < P; i++) {
        free(rs[i].send);
        free(rs[i].recv);
    }
}
END_TEST

/*
 * A collective that times out: ETIMEDOUT at the deadline, then ETIMEDOUT at
 * once; the peer that enters later fails at once with EUNAVAIL, because the
 * failed rank closed its connections.
 */
static void body_timeout_first(rank_t *r)
{
    r->op_deadline = amx_now_ms() + 1000;
    do_op(r);
    do_op_again(r);
}

static void body_late(rank_t *r)
{
    sleep_ms(1500);
    r->op_deadline = amx_now_ms() + 30000;
    do_op(r);
}

START_TEST(test_timeout_then_fail_fast)
{
    enum { P = 2, N = 1000 };
    rank_t rs[P];
    for (int i = 0; i < P; i++) {
        rank_init(&rs[i], i, P, "t/timeout", amx_now_ms() + 10000);
        rs[i].n = N;
        rs[i].send = calloc(N, sizeof(float));
        rs[i].recv = calloc(N, sizeof(float));
    }
    rs[0].body = body_timeout_first;
    rs[1].body = body_late;
    run_ranks(rs, P);
    for (int i = 0; i < P; i++)
        ck_assert_int_eq(rs[i].create_st, AMX_OK);
    fprintf(stderr,
            "timing: timeout: rank 0 failed %lld ms after its deadline (%s), again %llu ms; "
            "rank 1 failed in %llu ms (%s)\n",
            (long long)rs[0].t_op_end - (long long)rs[0].op_deadline, amx_strerror(rs[0].op_st),
            (unsigned long long)rs[0].op2_ms,
            (unsigned long long)(rs[1].t_op_end - rs[1].t_op_start), amx_strerror(rs[1].op_st));
    ck_assert_msg(rs[0].op_st == AMX_ETIMEDOUT, "rank 0: %d (%s)", rs[0].op_st, rs[0].op_err.msg);
    ck_assert_uint_ge(rs[0].t_op_end + 1, rs[0].op_deadline);
    ck_assert_uint_lt(rs[0].t_op_end, rs[0].op_deadline + 500);
    ck_assert_ptr_nonnull(strstr(rs[0].op_err.msg, "gloo allreduce of 1000 floats"));
    ck_assert_int_eq(rs[0].op2_st, AMX_ETIMEDOUT);
    ck_assert_uint_lt(rs[0].op2_ms, 100);
    ck_assert_msg(rs[1].op_st == AMX_EUNAVAIL, "rank 1: %d (%s)", rs[1].op_st, rs[1].op_err.msg);
    ck_assert_uint_lt(rs[1].t_op_end - rs[1].t_op_start, 100);
    destroy_all(rs, P);
    for (int i = 0; i < P; i++) {
        free(rs[i].send);
        free(rs[i].recv);
    }
}
END_TEST

/*
 * Ranks as processes, so that one can die: it exits without destroy, or is
 * killed (SIGKILL) in the middle of a large collective. The others must fail
 * with EUNAVAIL within 2 s of its death, their deadline being 30 s away.
 *
 * The kill lands while rank 2 is sending its first chunk (it has written a
 * third of it, by /proc/self/io's wchar): then a neighbour's transfer is
 * half done, which gloo does not fail by itself (it would wait for the
 * deadline); the shim's watchdogs must. Without /proc, 40 ms after the start.
 */
enum { DIE_EXIT_IDLE = 0, DIE_KILL_IN_OP = 1 };

static long long bytes_written(void)
{
    char line[256];
    long long v = -1;
    FILE *f = fopen("/proc/self/io", "r");
    while (f != NULL && fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, "wchar:", 6) == 0)
            v = atoll(line + 6);
    if (f != NULL)
        fclose(f);
    return v;
}

static long long kill_after_bytes;

static void *killer(void *arg)
{
    (void)arg;
    long long w0 = bytes_written();
    if (w0 < 0) {
        sleep_ms(40);
    } else {
        while (bytes_written() < w0 + kill_after_bytes)
            usleep(100);
    }
    sh->t_death = amx_now_ms();
    raise(SIGKILL);
    return NULL;
}

static void proc_rank(int rank, int size, size_t n, int how)
{
    proc_result_t *res = &sh->res[rank];
    amx_comm_params_t p = params(rank, size, how ? "p/kill" : "p/exit", amx_now_ms() + 10000);
    amx_comm_t *c = NULL;
    amx_err_t err = {0};
    res->create_st = amx__comm_gloo_create(&p, &c, &err);
    if (res->create_st != AMX_OK) {
        snprintf(res->msg, sizeof(res->msg), "%s", err.msg);
        _exit(1);
    }
    float *send = malloc(n * sizeof(float)), *recv = malloc(n * sizeof(float));
    fill(send, n, (uint64_t)rank);
    if (rank == size - 1) {
        if (how == DIE_EXIT_IDLE) {
            sleep_ms(300);
            sh->t_death = amx_now_ms();
            _exit(0); /* no destroy: the kernel closes the sockets */
        }
        kill_after_bytes = (long long)(n / size * sizeof(float) / 3);
        pthread_t t;
        pthread_create(&t, NULL, killer, NULL);
    }
    res->op_st = c->ops->allreduce_max(c, send, recv, n, NULL, amx_now_ms() + 30000, &err);
    res->t_op_end = amx_now_ms();
    snprintf(res->msg, sizeof(res->msg), "%s", err.msg);
    c->ops->destroy(c);
    free(send);
    free(recv);
    _exit(0);
}

static void check_peer_dies(int how, size_t n)
{
    enum { P = 3 };
    pid_t pid[P];
    for (int i = 0; i < P; i++) {
        pid[i] = fork();
        ck_assert_int_ge(pid[i], 0);
        if (pid[i] == 0)
            proc_rank(i, P, n, how);
    }
    int status[P];
    for (int i = 0; i < P; i++)
        ck_assert_int_eq(waitpid(pid[i], &status[i], 0), pid[i]);
    if (how == DIE_KILL_IN_OP)
        ck_assert(WIFSIGNALED(status[P - 1]) && WTERMSIG(status[P - 1]) == SIGKILL);
    for (int i = 0; i < P - 1; i++) {
        proc_result_t *res = &sh->res[i];
        ck_assert_msg(WIFEXITED(status[i]) && WEXITSTATUS(status[i]) == 0, "rank %d: status %d", i,
                      status[i]);
        ck_assert_int_eq(res->create_st, AMX_OK);
        long long after = (long long)res->t_op_end - (long long)sh->t_death;
        fprintf(stderr, "timing: rank 2 %s: rank %d failed %lld ms later (%s)\n",
                how ? "killed while sending in a collective of 8M floats" : "exited while idle", i,
                after, amx_strerror(res->op_st));
        ck_assert_msg(res->op_st == AMX_EUNAVAIL, "rank %d: %d (%s)", i, res->op_st, res->msg);
        ck_assert_int_lt(after, 2000);
    }
}

START_TEST(test_peer_exits)
{
    check_peer_dies(DIE_EXIT_IDLE, 100000);
}
END_TEST

START_TEST(test_peer_killed_in_op)
{
    check_peer_dies(DIE_KILL_IN_OP, 8u << 20);
}
END_TEST

static Suite *comm_gloo_suite(void)
{
    Suite *s = suite_create("comm_gloo");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_size1);
    tcase_add_test(tc, test_bad_params);
    tcase_add_test(tc, test_exact_2);
    tcase_add_test(tc, test_exact_3);
    tcase_add_test(tc, test_exact_4);
    tcase_add_test(tc, test_large);
    tcase_add_test(tc, test_destroy_right_after);
    tcase_add_test(tc, test_missing_rank);
    tcase_add_test(tc, test_kv_cancel);
    tcase_add_test(tc, test_peer_destroys);
    tcase_add_test(tc, test_peer_aborts);
    tcase_add_test(tc, test_abort_thread);
    tcase_add_test(tc, test_timeout_then_fail_fast);
    tcase_add_test(tc, test_peer_exits);
    tcase_add_test(tc, test_peer_killed_in_op);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(comm_gloo_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
