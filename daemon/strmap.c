#include "strmap.h"

#include <stdlib.h>
#include <string.h>

/* FNV-1a, 64 bit: short keys, no adversary worth a keyed hash here. */
static uint64_t hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

int amx_strmap_get(const amx_strmap_t *m, const char *key, uint32_t *val)
{
    if (m->cap == 0)
        return 0;
    for (size_t i = hash(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == NULL)
            return 0;
        if (strcmp(m->keys[i], key) == 0) {
            *val = m->vals[i];
            return 1;
        }
    }
}

static void put_nogrow(amx_strmap_t *m, const char *key, uint32_t val)
{
    for (size_t i = hash(key) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == NULL) {
            m->keys[i] = key;
            m->vals[i] = val;
            m->len++;
            return;
        }
        if (strcmp(m->keys[i], key) == 0) {
            m->keys[i] = key; /* the caller may be replacing the string that owns the key */
            m->vals[i] = val;
            return;
        }
    }
}

int amx_strmap_reserve(amx_strmap_t *m, size_t n)
{
    if (n * 2 <= m->cap)
        return 0;
    size_t cap = 16;
    while (cap < n * 2)
        cap <<= 1;
    amx_strmap_t nm = {calloc(cap, sizeof(char *)), malloc(cap * sizeof(uint32_t)), cap, 0};
    if (nm.keys == NULL || nm.vals == NULL) {
        free(nm.keys);
        free(nm.vals);
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++)
        if (m->keys[i] != NULL)
            put_nogrow(&nm, m->keys[i], m->vals[i]);
    free(m->keys);
    free(m->vals);
    *m = nm;
    return 0;
}

int amx_strmap_put(amx_strmap_t *m, const char *key, uint32_t val)
{
    if (amx_strmap_reserve(m, m->len + 1) != 0)
        return -1;
    put_nogrow(m, key, val);
    return 0;
}

void amx_strmap_free(amx_strmap_t *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof(*m));
}
