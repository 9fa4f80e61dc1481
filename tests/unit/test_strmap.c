/* test_strmap.c - the keyed hash map: SipHash reference vectors, lookups,
 * and that names crafted against one key do not pile up under another. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strmap.h"

static const uint64_t ref_key[2] = {0x0706050403020100ull, 0x0f0e0d0c0b0a0908ull};

START_TEST(siphash_reference_vectors)
{
    /* SipHash-2-4 of the paper (Aumasson, Bernstein), key 00..0f. */
    uint8_t msg[64];
    for (int i = 0; i < 64; i++)
        msg[i] = (uint8_t)i;
    ck_assert_uint_eq(amx_siphash(ref_key, msg, 0, 2, 4), 0x726fdb47dd0e0e31ull);
    ck_assert_uint_eq(amx_siphash(ref_key, msg, 15, 2, 4), 0xa129ca6149be45e5ull);
    /* Every length hashes differently, and the key matters. */
    uint64_t other[2] = {1, 2};
    for (size_t n = 0; n < 64; n++) {
        ck_assert_uint_ne(amx_siphash(ref_key, msg, n, 1, 3), amx_siphash(other, msg, n, 1, 3));
        if (n > 0)
            ck_assert_uint_ne(amx_siphash(ref_key, msg, n, 1, 3),
                              amx_siphash(ref_key, msg, n - 1, 1, 3));
    }
}
END_TEST

START_TEST(put_get_many)
{
    enum { N = 100000 };
    char **names = malloc(N * sizeof(char *));
    amx_strmap_t m = {0};
    for (uint32_t i = 0; i < N; i++) {
        char b[64];
        snprintf(b, sizeof(b), "decoder.layers.%u.mlp.linear_fc1.weight_quantizer", i);
        names[i] = strdup(b);
        ck_assert_int_eq(amx_strmap_put(&m, names[i], i), 0);
    }
    ck_assert_uint_eq(m.len, N);
    size_t probes = 0;
    for (uint32_t i = 0; i < N; i++) {
        uint32_t v = UINT32_MAX;
        ck_assert_int_eq(amx_strmap_get(&m, names[i], &v), 1);
        ck_assert_uint_eq(v, i);
        probes += amx_strmap_probe_len(&m, names[i]);
    }
    ck_assert_msg(probes < 3 * (size_t)N, "mean probe length %.2f", (double)probes / N);
    uint32_t v;
    ck_assert_int_eq(amx_strmap_get(&m, "decoder.layers.100000.mlp", &v), 0);
    /* Replacing a key's value keeps one entry. */
    ck_assert_int_eq(amx_strmap_put(&m, names[7], 70), 0);
    ck_assert_int_eq(amx_strmap_get(&m, names[7], &v), 1);
    ck_assert_uint_eq(v, 70);
    ck_assert_uint_eq(m.len, N);
    amx_strmap_free(&m);
    for (uint32_t i = 0; i < N; i++)
        free(names[i]);
    free(names);
}
END_TEST

START_TEST(crafted_names_do_not_collide_under_another_key)
{
    /* An attacker who knew key A finds names that all hash to slot 0 of a
     * 4096-slot table (1 in 4096 names qualifies). Under key A a map of
     * them degenerates into one run of slots (quadratic inserts); under
     * the process's real key, which a client cannot know, they spread. */
    enum { K = 400, SLOTS = 4096 };
    amx_strmap_set_key(0x1111, 0x2222);
    char **names = malloc(K * sizeof(char *));
    int k = 0;
    for (unsigned long i = 0; k < K; i++) {
        char b[32];
        int n = snprintf(b, sizeof(b), "q%lu", i);
        if ((amx_siphash(amx_strmap_key(), b, (size_t)n, 1, 3) & (SLOTS - 1)) == 0)
            names[k++] = strdup(b);
    }
    amx_strmap_t m = {0};
    ck_assert_int_eq(amx_strmap_reserve(&m, SLOTS / 2), 0);
    ck_assert_uint_eq(m.cap, SLOTS);
    size_t crafted = 0;
    for (int i = 0; i < K; i++)
        amx_strmap_put(&m, names[i], (uint32_t)i);
    for (int i = 0; i < K; i++)
        crafted += amx_strmap_probe_len(&m, names[i]);
    amx_strmap_free(&m);
    ck_assert_msg(crafted > (size_t)K * K / 4, "crafted names under their key: %zu probes",
                  crafted);
    amx_strmap_set_key(0x9e3779b97f4a7c15ull, 0xbf58476d1ce4e5b9ull); /* "unknown" to the client */
    ck_assert_int_eq(amx_strmap_reserve(&m, SLOTS / 2), 0);
    for (int i = 0; i < K; i++)
        amx_strmap_put(&m, names[i], (uint32_t)i);
    size_t spread = 0;
    for (int i = 0; i < K; i++) {
        uint32_t v;
        ck_assert_int_eq(amx_strmap_get(&m, names[i], &v), 1);
        ck_assert_int_eq((int)v, i);
        spread += amx_strmap_probe_len(&m, names[i]);
    }
    ck_assert_msg(spread < (size_t)K * 2, "the same names under another key: %zu probes", spread);
    amx_strmap_free(&m);
    for (int i = 0; i < K; i++)
        free(names[i]);
    free(names);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("strmap");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, siphash_reference_vectors);
    tcase_add_test(tc, put_get_many);
    tcase_add_test(tc, crafted_names_do_not_collide_under_another_key);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed == 0 ? 0 : 1;
}
