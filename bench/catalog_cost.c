/*
 * catalog_cost.c - what one catalog of Q per-tensor quantizers costs a
 * daemon (bench/coord_sim.py prints it beside the coordinator's figures):
 * the resident memory of its specs and of the catalog built on them (the
 * name index and groups), the time to build it from specs in name order and
 * in another order, and the time of its hash alone.
 *
 *     build/catalog_cost 100000
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "catalog.h"

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static long rss(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, res = 0;
    if (f == NULL || fscanf(f, "%ld %ld", &size, &res) != 2)
        res = 0;
    if (f != NULL)
        fclose(f);
    return res * 4096;
}

/* Q specs as a Register of per-tensor FP8 current-scaling quantizers gives
 * them (the names bench/coord_sim.py uses). */
static amx_qspec_t **make(uint32_t q)
{
    amx_qspec_t **s = malloc(q * sizeof(*s));
    for (uint32_t i = 0; s != NULL && i < q; i++) {
        char name[96];
        snprintf(name, sizeof(name), "model.layers.%05u.q%u.input_quantizer", i / 8, i % 8);
        amx_recipe_in_t r = {.present = 1, .format = 1 /* FP8_E4M3 */, .rule = 1 /* CURRENT */};
        amx_qspec_in_t in = {.name = name, .recipe = r, .peer_group = "", .scale_group = ""};
        amx_err_t err = {0};
        amx_qspec_t parsed;
        if (amx_qspec_parse(&in, UINT64_MAX, &parsed, &err) != AMX_OK) {
            fprintf(stderr, "catalog_cost: %s\n", err.msg);
            exit(1);
        }
        /* As the daemon keeps it: one allocation, strings included. */
        if ((s[i] = amx_qspec_dup(&parsed)) == NULL)
            exit(1);
    }
    return s;
}

int main(int argc, char **argv)
{
    uint32_t q = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 100000;
    long r0 = rss();
    amx_qspec_t **s = make(q);
    long r1 = rss();
    amx_catalog_t *c = NULL;
    amx_err_t err = {0};
    double t0 = now_ms();
    if (amx_catalog_build(s, q, &c, &err) != AMX_OK) {
        fprintf(stderr, "catalog_cost: %s\n", err.msg);
        return 1;
    }
    double t1 = now_ms();
    long r2 = rss();
    uint64_t h = amx_catalog_hash(c->q, c->n);
    double t2 = now_ms();
    /* The same specs in reverse order: the build sorts them. */
    amx_qspec_t **rev = malloc(q * sizeof(*rev));
    uint32_t got = 0;
    amx_qspec_t **own = amx_catalog_take_specs(c, &got);
    for (uint32_t i = 0; i < got; i++)
        rev[i] = own[got - 1 - i];
    free(own);
    amx_catalog_t *c2 = NULL;
    double t3 = now_ms();
    if (amx_catalog_build(rev, got, &c2, &err) != AMX_OK)
        return 1;
    double t4 = now_ms();
    printf("| Q | specs | catalog index | one catalog | build (in order) | build (sorting) | "
           "hash |\n|---|---|---|---|---|---|---|\n");
    printf("| %u | %.1f MB | %.1f MB | %.1f MB | %.1f ms | %.1f ms | %.1f ms |\n", q,
           (double)(r1 - r0) / 1e6, (double)(r2 - r1) / 1e6, (double)(r2 - r0) / 1e6, t1 - t0,
           t4 - t3, t2 - t1);
    printf("# hash %016llx\n", (unsigned long long)(c2->hash == h ? h : 0));
    amx_catalog_free(c2);
    free(rev);
    free(s);
    return 0;
}
