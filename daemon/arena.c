#include "arena.h"

#include <stdlib.h>
#include <string.h>

struct amx_arena_chunk {
    amx_arena_chunk_t *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *amx_arena_alloc(amx_arena_t *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    amx_arena_chunk_t *c = a->head;
    if (c == NULL || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
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
