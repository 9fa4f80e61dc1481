/*
 * arena.h - a bump allocator for building one response: every allocation is
 * freed at once by amx_arena_free. Single thread.
 */
#ifndef AMX_ARENA_H
#define AMX_ARENA_H

#include <stddef.h>

typedef struct amx_arena_chunk amx_arena_chunk_t;

typedef struct amx_arena {
    amx_arena_chunk_t *head;
} amx_arena_t;

/* Zeroed memory of `n` bytes aligned to 16, or NULL when out of memory. */
void *amx_arena_alloc(amx_arena_t *a, size_t n);

/* A copy of `s` in the arena, or NULL. */
char *amx_arena_strdup(amx_arena_t *a, const char *s);

void amx_arena_free(amx_arena_t *a);

#endif
