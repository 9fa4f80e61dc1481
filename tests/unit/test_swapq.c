/*
 * test_swapq.c - the swap-buffer hand-off queue: items come out in the
 * order each producer pushed them, none lost or repeated, with several
 * producer threads and one consumer draining while they push; items pushed
 * during a drain are drained by it; in steady state the two buffers are
 * reused, not reallocated.
 */
#include <check.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "swapq.h"

typedef struct item {
    uint32_t producer;
    uint32_t seq;
    uint64_t check; /* a function of both, so that a torn copy shows */
} item_t;

static uint64_t check_of(uint32_t p, uint32_t s)
{
    return ((uint64_t)p << 32 | s) * 0x9e3779b97f4a7c15ull;
}

/* What the consumer saw: the next sequence number expected per producer. */
typedef struct seen {
    uint32_t next[16];
    uint64_t total;
    amx_swapq_t *q; /* when set, push one more item from inside the drain */
    int pushed_inside;
} seen_t;

static void take(void *ud, void *p)
{
    seen_t *s = ud;
    item_t it;
    memcpy(&it, p, sizeof(it));
    /* Checked cheaply, asserted (with both values) only when wrong: this
     * runs for every item. */
    if (it.producer >= 16 || it.check != check_of(it.producer, it.seq) ||
        it.seq != s->next[it.producer]) {
        ck_assert_uint_lt(it.producer, 16);
        ck_assert_uint_eq(it.check, check_of(it.producer, it.seq));
        ck_assert_uint_eq(it.seq, s->next[it.producer]);
    }
    s->next[it.producer]++;
    s->total++;
    if (s->q != NULL && !s->pushed_inside) {
        s->pushed_inside = 1;
        item_t more = {15, 0, check_of(15, 0)};
        ck_assert_int_eq(amx_swapq_push(s->q, &more), 0);
    }
}

START_TEST(fifo_and_pushes_during_a_drain)
{
    amx_swapq_t q;
    amx_swapq_init(&q, sizeof(item_t));
    ck_assert_int_eq(amx_swapq_pending(&q), 0);
    seen_t s = {{0}, 0, NULL, 0};
    ck_assert_uint_eq(amx_swapq_drain(&q, take, &s), 0);
    for (uint32_t i = 0; i < 1000; i++) {
        item_t it = {3, i, check_of(3, i)};
        ck_assert_int_eq(amx_swapq_push(&q, &it), 0);
    }
    ck_assert_int_eq(amx_swapq_pending(&q), 1);
    /* An item pushed by the callback (another thread would do the same
     * while the consumer is outside the mutex) is drained too. */
    s.q = &q;
    ck_assert_uint_eq(amx_swapq_drain(&q, take, &s), 1001);
    ck_assert_uint_eq(s.next[3], 1000);
    ck_assert_uint_eq(s.next[15], 1);
    ck_assert_int_eq(amx_swapq_pending(&q), 0);
    /* Steady state: once both buffers are large enough (after a first
     * round), no new allocation. */
    unsigned char *a = NULL, *b = NULL;
    s.q = NULL;
    for (int round = 0; round < 10; round++) {
        if (round == 1)
            a = q.items, b = q.spare;
        for (uint32_t i = 0; i < 500; i++) {
            item_t it = {3, s.next[3] + i, check_of(3, s.next[3] + i)};
            ck_assert_int_eq(amx_swapq_push(&q, &it), 0);
        }
        ck_assert_uint_eq(amx_swapq_drain(&q, take, &s), 500);
        ck_assert_msg(round == 0 || (q.items == a && q.spare == b) ||
                          (q.items == b && q.spare == a),
                      "round %d: the queue's buffers changed", round);
    }
    amx_swapq_destroy(&q);
}
END_TEST

enum { PRODUCERS = 4, PER_PRODUCER = 25000 };

typedef struct producer {
    amx_swapq_t *q;
    uint32_t id;
    pthread_t th;
} producer_t;

static void *produce(void *arg)
{
    producer_t *p = arg;
    for (uint32_t i = 0; i < PER_PRODUCER; i++) {
        item_t it = {p->id, i, check_of(p->id, i)};
        while (amx_swapq_push(p->q, &it) != 0)
            ;
        if (i % 4096 == 0)
            sched_yield();
    }
    return NULL;
}

START_TEST(several_producers_one_consumer)
{
    amx_swapq_t q;
    amx_swapq_init(&q, sizeof(item_t));
    producer_t p[PRODUCERS];
    for (uint32_t i = 0; i < PRODUCERS; i++) {
        p[i] = (producer_t){&q, i, 0};
        ck_assert_int_eq(pthread_create(&p[i].th, NULL, produce, &p[i]), 0);
    }
    /* Drain while they push: order per producer kept, nothing repeated. */
    seen_t s = {{0}, 0, NULL, 0};
    while (s.total < (uint64_t)PRODUCERS * PER_PRODUCER)
        amx_swapq_drain(&q, take, &s);
    for (uint32_t i = 0; i < PRODUCERS; i++)
        ck_assert_int_eq(pthread_join(p[i].th, NULL), 0);
    /* Nothing left, nothing lost. */
    ck_assert_uint_eq(amx_swapq_drain(&q, take, &s), 0);
    ck_assert_int_eq(amx_swapq_pending(&q), 0);
    for (uint32_t i = 0; i < PRODUCERS; i++)
        ck_assert_uint_eq(s.next[i], PER_PRODUCER);
    ck_assert_uint_eq(s.total, (uint64_t)PRODUCERS * PER_PRODUCER);
    amx_swapq_destroy(&q);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("swapq");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, fifo_and_pushes_during_a_drain);
    tcase_add_test(tc, several_producers_one_consumer);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
