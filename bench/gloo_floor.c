/*
 * gloo_floor.c - the floor of an epoch over Gloo: one all-reduce of the
 * same bytes an epoch reduces, through amaxd's own Gloo shim (comm.h),
 * without the daemon around it (bench/calib_bench.py runs it in the same
 * run as the cluster it compares with).
 *
 *   gloo_floor RANKS SUM_VALUES MAX_CELLS REPS
 *
 * RANKS processes (forked, as daemons are processes) rendezvous through a
 * key-value store in shared memory, then each repetition runs one
 * all-reduce(SUM) of SUM_VALUES float64 values and one all-reduce(MAX) of
 * MAX_CELLS float32 cells (0: skip), timed on rank 0 from a barrier. Prints
 * one JSON line: the median and the min of each, in microseconds.
 */
#include <errno.h>
#include <pthread.h>
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

enum { KV_SLOTS = 256, KV_KEY = 160, KV_VAL = 2048, MAX_REPS = 1000 };

typedef struct kv_entry {
    int used;
    char key[KV_KEY];
    size_t len;
    unsigned char val[KV_VAL];
} kv_entry_t;

typedef struct shared {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kv_entry_t e[KV_SLOTS];
    uint64_t sum_us[MAX_REPS], max_us[MAX_REPS];
    int failed;
} shared_t;

static shared_t *sh;

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
        return amx_err_set(err, AMX_ERANGE, "kv: key or value too long");
    pthread_mutex_lock(&sh->mu);
    kv_entry_t *e = kv_find(key);
    for (int i = 0; e == NULL && i < KV_SLOTS; i++)
        if (!sh->e[i].used)
            e = &sh->e[i];
    if (e == NULL) {
        pthread_mutex_unlock(&sh->mu);
        return amx_err_set(err, AMX_ENOMEM, "kv: full");
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
    while ((e = kv_find(key)) == NULL)
        if (pthread_cond_timedwait(&sh->cv, &sh->mu, &ts) == ETIMEDOUT && kv_find(key) == NULL) {
            st = amx_err_set(err, AMX_ETIMEDOUT, "kv: no key '%s'", key);
            break;
        }
    if (e != NULL) {
        *val = malloc(e->len ? e->len : 1);
        memcpy(*val, e->val, e->len);
        *len = e->len;
    }
    pthread_mutex_unlock(&sh->mu);
    return st;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int rank_main(int rank, int n, uint64_t nsum, uint64_t nmax, int reps)
{
    amx_kv_t kv = {NULL, kv_set, kv_get};
    amx_comm_params_t p = {.rank = rank,
                           .size = n,
                           .kv = &kv,
                           .prefix = "floor/",
                           .host = "127.0.0.1",
                           .deadline_ms = amx_now_ms() + 60000};
    amx_comm_t *c = NULL;
    amx_err_t err = {0};
    if (amx_comm_create("gloo", &p, &c, &err) != AMX_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, err.msg);
        return 1;
    }
    double *ss = malloc((nsum ? nsum : 1) * sizeof(double)),
           *sr = malloc((nsum ? nsum : 1) * sizeof(double));
    float *ms = malloc((nmax ? nmax : 1) * sizeof(float)),
          *mr = malloc((nmax ? nmax : 1) * sizeof(float));
    for (uint64_t i = 0; i < nsum; i++)
        ss[i] = (double)((i * 7 + (uint64_t)rank) % 1000);
    for (uint64_t i = 0; i < nmax; i++)
        ms[i] = (float)((i * 13 + (uint64_t)rank) % 997);
    int rc = 0;
    for (int r = -2; r < reps && rc == 0; r++) { /* two warm-up rounds */
        /* A MAX of one cell as the barrier before each timed step. */
        float b = 0, br;
        if (c->ops->allreduce_max(c, &b, &br, 1, NULL, amx_now_ms() + 60000, &err) != AMX_OK)
            rc = 1;
        uint64_t t0 = amx_now_us();
        if (nsum &&
            c->ops->allreduce_sum_f64(c, ss, sr, nsum, NULL, amx_now_ms() + 60000, &err) != AMX_OK)
            rc = 1;
        uint64_t t1 = amx_now_us();
        if (nmax &&
            c->ops->allreduce_max(c, ms, mr, nmax, NULL, amx_now_ms() + 60000, &err) != AMX_OK)
            rc = 1;
        uint64_t t2 = amx_now_us();
        if (rank == 0 && r >= 0) {
            sh->sum_us[r] = t1 - t0;
            sh->max_us[r] = t2 - t1;
        }
    }
    if (rc != 0)
        fprintf(stderr, "rank %d: %s\n", rank, err.msg);
    c->ops->destroy(c);
    free(ss), free(sr), free(ms), free(mr);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s RANKS SUM_VALUES MAX_CELLS REPS\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[1]), reps = atoi(argv[4]);
    uint64_t nsum = strtoull(argv[2], NULL, 10), nmax = strtoull(argv[3], NULL, 10);
    if (n < 2 || reps < 1 || reps > MAX_REPS) {
        fprintf(stderr, "RANKS >= 2, 1 <= REPS <= %d\n", MAX_REPS);
        return 2;
    }
    sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED)
        return 1;
    memset(sh, 0, sizeof(*sh));
    pthread_mutexattr_t ma;
    pthread_condattr_t ca;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&sh->mu, &ma);
    pthread_cond_init(&sh->cv, &ca);
    pid_t pids[64];
    for (int r = 0; r < n && r < 64; r++) {
        pids[r] = fork();
        if (pids[r] == 0)
            _exit(rank_main(r, n, nsum, nmax, reps));
    }
    int bad = 0;
    for (int r = 0; r < n && r < 64; r++) {
        int stt = 0;
        waitpid(pids[r], &stt, 0);
        bad |= !WIFEXITED(stt) || WEXITSTATUS(stt) != 0;
    }
    if (bad)
        return 1;
    qsort(sh->sum_us, (size_t)reps, sizeof(uint64_t), cmp_u64);
    qsort(sh->max_us, (size_t)reps, sizeof(uint64_t), cmp_u64);
    printf("{\"ranks\": %d, \"sum_values\": %llu, \"max_cells\": %llu, \"reps\": %d, "
           "\"sum_median_us\": %llu, \"sum_min_us\": %llu, \"max_median_us\": %llu, "
           "\"max_min_us\": %llu}\n",
           n, (unsigned long long)nsum, (unsigned long long)nmax, reps,
           (unsigned long long)sh->sum_us[reps / 2], (unsigned long long)sh->sum_us[0],
           (unsigned long long)sh->max_us[reps / 2], (unsigned long long)sh->max_us[0]);
    return 0;
}
