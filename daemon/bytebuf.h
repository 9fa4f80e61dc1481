/*
 * bytebuf.h - growable write buffer and bounds-checked read cursor for the
 * little-endian formats of jobstate.c and snapshot.c. A failed allocation
 * sets `oom` and later puts do nothing; a read past the end sets `bad`
 * and returns NULL / 0. Header-only (static inline).
 */
#ifndef AMX_BYTEBUF_H
#define AMX_BYTEBUF_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "grow.h"

typedef struct amx_wbuf {
    unsigned char *p;
    size_t len, cap;
    int oom;
} amx_wbuf_t;

/* Room for n more bytes; 0 on success. */
static inline int amx_wbuf_grow(amx_wbuf_t *w, size_t n)
{
    if (w->oom)
        return -1;
    if (n <= w->cap - w->len) /* len <= cap always: no wrap */
        return 0;
    if (n > SIZE_MAX - w->len || amx_grow(&w->p, &w->cap, w->len + n, 1, 1024, 0) != 0) {
        w->oom = 1;
        return -1;
    }
    return 0;
}

static inline void amx_put(amx_wbuf_t *w, const void *src, size_t n)
{
    if (amx_wbuf_grow(w, n) != 0)
        return;
    if (n > 0)
        memcpy(w->p + w->len, src, n);
    w->len += n;
}

static inline void amx_put32(amx_wbuf_t *w, uint32_t v)
{
    amx_put(w, &v, 4);
}

static inline void amx_put64(amx_wbuf_t *w, uint64_t v)
{
    amx_put(w, &v, 8);
}

/* A string as a 32-bit length and its bytes. */
static inline void amx_putstr(amx_wbuf_t *w, const char *s)
{
    uint32_t n = (uint32_t)strlen(s);
    amx_put32(w, n);
    amx_put(w, s, n);
}

static inline void amx_put_align8(amx_wbuf_t *w)
{
    static const unsigned char z[8] = {0};
    amx_put(w, z, (8 - w->len % 8) % 8);
}

typedef struct amx_rbuf {
    const unsigned char *p;
    size_t len, off;
    int bad;
} amx_rbuf_t;

static inline const void *amx_get(amx_rbuf_t *r, size_t n)
{
    if (r->bad || n > r->len - r->off) {
        r->bad = 1;
        return NULL;
    }
    const void *q = r->p + r->off;
    r->off += n;
    return q;
}

static inline uint32_t amx_get32(amx_rbuf_t *r)
{
    uint32_t v = 0;
    const void *q = amx_get(r, 4);
    if (q)
        memcpy(&v, q, 4);
    return v;
}

static inline uint64_t amx_get64(amx_rbuf_t *r)
{
    uint64_t v = 0;
    const void *q = amx_get(r, 8);
    if (q)
        memcpy(&v, q, 8);
    return v;
}

/*
 * A reply buffer that is reused from one answer to the next while gRPC
 * may still hold the last one: reference counted (atomically: gRPC drops
 * its reference from its own threads). The owner keeps one reference in
 * its slot; each answer in flight holds another.
 */
typedef struct amx_replybuf {
    atomic_int refs;
    size_t cap;
    unsigned char data[];
} amx_replybuf_t;

/* Drops one reference (any thread); the last one frees. */
static inline void amx_replybuf_unref(void *p)
{
    amx_replybuf_t *b = p;
    if (b != NULL && atomic_fetch_sub(&b->refs, 1) == 1)
        free(b);
}

/* A buffer of at least `cap` bytes for one answer: the slot's when nobody
 * else holds it and it is large enough, else a new one that replaces it
 * in the slot. The caller gets its own reference (amx_replybuf_unref when
 * the answer is gone); NULL when out of memory. Owner's thread only. */
static inline amx_replybuf_t *amx_replybuf_take(amx_replybuf_t **slot, size_t cap)
{
    amx_replybuf_t *b = *slot;
    if (b == NULL || b->cap < cap || atomic_load(&b->refs) != 1) {
        amx_replybuf_t *n = malloc(sizeof(*n) + cap);
        if (n == NULL)
            return NULL;
        atomic_init(&n->refs, 1);
        n->cap = cap;
        amx_replybuf_unref(b);
        *slot = b = n;
    }
    atomic_fetch_add(&b->refs, 1);
    return b;
}

#endif
