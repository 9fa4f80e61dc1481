/*
 * strmap.c - open addressing with linear probing, keyed by SipHash-1-3.
 *
 * Names come from clients. With an unkeyed hash (FNV) a client can pick
 * names that all land in one run of slots, and every insert and lookup then
 * walks that run: a Register of n such names costs n^2/2 string compares.
 * SipHash with a key drawn at random once per process makes the slots
 * unpredictable to a client.
 */
#include "strmap.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

static uint64_t g_key[2];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init_key(void)
{
    if (getrandom(g_key, sizeof(g_key), 0) != (ssize_t)sizeof(g_key)) {
        /* No entropy source: still unpredictable enough to a remote client. */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        g_key[0] = (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
        g_key[1] = (uint64_t)ts.tv_sec * 0xbf58476d1ce4e5b9ull ^ (uint64_t)(uintptr_t)&ts;
    }
}

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                                   \
    do {                                                                                           \
        v0 += v1;                                                                                  \
        v1 = ROTL(v1, 13);                                                                         \
        v1 ^= v0;                                                                                  \
        v0 = ROTL(v0, 32);                                                                         \
        v2 += v3;                                                                                  \
        v3 = ROTL(v3, 16);                                                                         \
        v3 ^= v2;                                                                                  \
        v0 += v3;                                                                                  \
        v3 = ROTL(v3, 21);                                                                         \
        v3 ^= v0;                                                                                  \
        v2 += v1;                                                                                  \
        v1 = ROTL(v1, 17);                                                                         \
        v1 ^= v2;                                                                                  \
        v2 = ROTL(v2, 32);                                                                         \
    } while (0)

static uint64_t load64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only, as the rest of amaxd */
    return v;
}

uint64_t amx_siphash(const uint64_t key[2], const void *data, size_t len, int crounds, int drounds)
{
    const uint8_t *in = data;
    uint64_t v0 = 0x736f6d6570736575ull ^ key[0];
    uint64_t v1 = 0x646f72616e646f6dull ^ key[1];
    uint64_t v2 = 0x6c7967656e657261ull ^ key[0];
    uint64_t v3 = 0x7465646279746573ull ^ key[1];
    const uint8_t *end = in + len - (len % 8);
    for (; in != end; in += 8) {
        uint64_t m = load64(in);
        v3 ^= m;
        for (int i = 0; i < crounds; i++)
            SIPROUND;
        v0 ^= m;
    }
    uint64_t b = (uint64_t)len << 56;
    switch (len & 7) {
    case 7:
        b |= (uint64_t)in[6] << 48; /* fall through */
    case 6:
        b |= (uint64_t)in[5] << 40; /* fall through */
    case 5:
        b |= (uint64_t)in[4] << 32; /* fall through */
    case 4:
        b |= (uint64_t)in[3] << 24; /* fall through */
    case 3:
        b |= (uint64_t)in[2] << 16; /* fall through */
    case 2:
        b |= (uint64_t)in[1] << 8; /* fall through */
    case 1:
        b |= (uint64_t)in[0];
        break;
    case 0:
        break;
    }
    v3 ^= b;
    for (int i = 0; i < crounds; i++)
        SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    for (int i = 0; i < drounds; i++)
        SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

const uint64_t *amx_strmap_key(void)
{
    pthread_once(&g_once, init_key);
    return g_key;
}

void amx_strmap_set_key(uint64_t k0, uint64_t k1)
{
    pthread_once(&g_once, init_key);
    g_key[0] = k0;
    g_key[1] = k1;
}

static uint64_t hash(const char *s, size_t n)
{
    return amx_siphash(amx_strmap_key(), s, n, 1, 3);
}

int amx_strmap_get(const amx_strmap_t *m, const char *key, uint32_t *val)
{
    if (m->cap == 0)
        return 0;
    size_t n = strlen(key);
    for (size_t i = hash(key, n) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
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
    size_t n = strlen(key);
    for (size_t i = hash(key, n) & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
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

size_t amx_strmap_probe_len(const amx_strmap_t *m, const char *key)
{
    if (m->cap == 0)
        return 0;
    size_t n = strlen(key), steps = 1;
    for (size_t i = hash(key, n) & (m->cap - 1); m->keys[i] != NULL && strcmp(m->keys[i], key) != 0;
         i = (i + 1) & (m->cap - 1))
        steps++;
    return steps;
}

void amx_strmap_free(amx_strmap_t *m)
{
    free(m->keys);
    free(m->vals);
    memset(m, 0, sizeof(*m));
}
