/*
 * strmap.h - an open-addressing hash map from a string to a uint32 index.
 * Keys are borrowed: the caller keeps them alive while they are in the map.
 * Slots come from SipHash-1-3 under a key drawn at random once per process,
 * so that names a client chooses cannot pile up in one run of slots.
 * Single thread (the owner's); the key is set up thread-safely.
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

/* Slots a lookup of `key` visits (1 when it is where it hashes), for tests. */
size_t amx_strmap_probe_len(const amx_strmap_t *m, const char *key);

/* SipHash-c-d of `len` bytes under the 128-bit `key` (little-endian
 * words): c = 2, d = 4 is the reference SipHash-2-4. Pure; any thread. */
uint64_t amx_siphash(const uint64_t key[2], const void *data, size_t len, int crounds, int drounds);

/* The process's map key (drawn from getrandom on first use); any thread. */
const uint64_t *amx_strmap_key(void);

/* Replaces the process's map key: tests only, before any map is filled. */
void amx_strmap_set_key(uint64_t k0, uint64_t k1);

#endif
