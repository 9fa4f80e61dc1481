/*
 * swapq.c - the swap-buffer hand-off queue (swapq.h).
 */
#include "swapq.h"

#include "grow.h"

#include <stdlib.h>
#include <string.h>

void amx_swapq_init(amx_swapq_t *q, size_t elem)
{
    memset(q, 0, sizeof(*q));
    pthread_mutex_init(&q->mu, NULL);
    q->elem = elem;
}

void amx_swapq_destroy(amx_swapq_t *q)
{
    free(q->items);
    free(q->spare);
    pthread_mutex_destroy(&q->mu);
    q->items = q->spare = NULL;
}

int amx_swapq_push(amx_swapq_t *q, const void *item)
{
    pthread_mutex_lock(&q->mu);
    if (amx_grow(&q->items, &q->cap, q->n + 1, q->elem, 64, 0) != 0) {
        pthread_mutex_unlock(&q->mu);
        return -1;
    }
    memcpy(q->items + q->n * q->elem, item, q->elem);
    q->n++;
    pthread_mutex_unlock(&q->mu);
    return 0;
}

int amx_swapq_pending(amx_swapq_t *q)
{
    pthread_mutex_lock(&q->mu);
    int n = q->n > 0;
    pthread_mutex_unlock(&q->mu);
    return n;
}

size_t amx_swapq_drain(amx_swapq_t *q, void (*fn)(void *ud, void *item), void *ud)
{
    size_t total = 0;
    for (;;) {
        /* Take the whole queue by swapping buffers: no copy, no allocation. */
        pthread_mutex_lock(&q->mu);
        unsigned char *batch = q->items;
        size_t n = q->n, cap = q->cap;
        q->items = q->spare;
        q->cap = q->spare_cap;
        q->n = 0;
        pthread_mutex_unlock(&q->mu);
        for (size_t i = 0; i < n; i++)
            fn(ud, batch + i * q->elem);
        q->spare = batch;
        q->spare_cap = cap;
        total += n;
        if (n == 0)
            return total;
    }
}
