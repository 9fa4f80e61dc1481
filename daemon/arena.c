#include "arena.h"

#include <stdlib.h>
#include <string.h>

struct amx_arena_chunk {
    amx_arena_chunk_t *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

/* Chunks start small and double up to CHUNK_MAX: most arenas hold a few
 * hundred bytes (a call's request views, a small answer), and a call that
 * waits (an agreement at the coordinator, N of them at once) would
 * otherwise hold a 64 KiB chunk each, mostly untouched, spreading the
 * heap over pages that every call faults in. */
#define CHUNK_MIN 1024
#define CHUNK_MAX 65536

void *amx_arena_alloc(amx_arena_t *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    amx_arena_chunk_t *c = a->head;
    if (c == NULL || c->cap - c->used < n) {
        size_t cap = c == NULL ? CHUNK_MIN : c->cap < CHUNK_MAX ? 2 * c->cap : CHUNK_MAX;
        if (cap < n)
            cap = n;
        c = malloc(sizeof(*c) + cap);
        if (c == NULL)
            return NULL;
        c->used = 0;
        c->cap = cap;
        c->next = a->head;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    memset(p, 0, n);
    return p;
}

char *amx_arena_strdup(amx_arena_t *a, const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = amx_arena_alloc(a, n);
    if (p != NULL)
        memcpy(p, s, n);
    return p;
}

void amx_arena_free(amx_arena_t *a)
{
    for (amx_arena_chunk_t *c = a->head, *next; c != NULL; c = next) {
        next = c->next;
        free(c);
    }
    a->head = NULL;
}
