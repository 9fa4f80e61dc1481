/*
 * strmap.h - an open-addressing hash map from a string to a uint32 index.
 * Keys are borrowed: the caller keeps them alive while they are in the map.
 * Single thread (the owner's).
 */
#ifndef AMX_STRMAP_H
#define AMX_STRMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct amx_strmap {
    const char **keys;
    uint32_t *vals;
    size_t cap; /* power of two, or 0 */
    size_t len;
} amx_strmap_t;

/* Looks `key` up; returns 1 and sets *val when present, else 0. */
int amx_strmap_get(const amx_strmap_t *m, const char *key, uint32_t *val);

/* Inserts or replaces (key pointer and value); returns 0, or -1 when out of
 * memory (map unchanged). */
int amx_strmap_put(amx_strmap_t *m, const char *key, uint32_t val);

/* Makes room for `n` entries in total; returns 0 or -1 (out of memory). */
int amx_strmap_reserve(amx_strmap_t *m, size_t n);

void amx_strmap_free(amx_strmap_t *m);

#endif
