/*
 * swapq.h - a queue that threads push fixed-size items into and one
 * consumer drains by swapping buffers: the producers hold the mutex only
 * to append, the consumer only to swap, and nothing is copied or
 * allocated in steady state. Used for completions handed to the loop lock
 * (rpc.c) and epoch outcomes handed to the loop (registry.c).
 */
#ifndef AMX_SWAPQ_H
#define AMX_SWAPQ_H

#include <pthread.h>
#include <stddef.h>

typedef struct amx_swapq {
    pthread_mutex_t mu;
    unsigned char *items, *spare; /* spare: the consumer's only */
    size_t n, cap, spare_cap, elem;
} amx_swapq_t;

/* An empty queue of items of `elem` bytes. */
void amx_swapq_init(amx_swapq_t *q, size_t elem);

/* Frees the buffers (nothing may push or drain any more). */
void amx_swapq_destroy(amx_swapq_t *q);

/* Appends a copy of `item`; -1 when out of memory. Any thread. */
int amx_swapq_push(amx_swapq_t *q, const void *item);

/* Whether something is queued now. Any thread. */
int amx_swapq_pending(amx_swapq_t *q);

/* Calls fn(ud, item) for every queued item, those pushed meanwhile too,
 * outside the mutex; returns how many. The one consumer only. */
size_t amx_swapq_drain(amx_swapq_t *q, void (*fn)(void *ud, void *item), void *ud);

#endif
