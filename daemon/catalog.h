/*
 * catalog.h - quantizer specs and the canonical catalog of a job.
 *
 * A spec is what every rank declares about a quantizer (name, global shape,
 * recipe, accumulation, groups); a catalog is a set of specs in canonical
 * order: sorted by name (byte order). The catalog's layout (where each
 * quantizer's cells lie in the flat buffers) and its hash are pure functions
 * of that set, so every daemon that holds the same catalog holds the same
 * layout, whatever the order in which quantizers were registered.
 *
 * Pure data structures: no gRPC, no protobuf, no threads. A catalog is
 * immutable once built, so the loop thread and a job's engine thread may
 * read the same catalog at once.
 */
#ifndef AMX_CATALOG_H
#define AMX_CATALOG_H

#include <stddef.h>
#include <stdint.h>

#include "calib.h"
#include "recipe.h"
#include "state.h"
#include "status.h"
#include "strmap.h"

#define AMX_MAX_DIMS 4
#define AMX_MAX_NAME 255
#define AMX_MAX_JOB_NAME 128

/* A validated, normalized spec. Strings are owned by the spec (amx_qspec_dup)
 * or borrowed from a request (amx_qspec_parse); the owner says which. */
typedef struct amx_qspec {
    char *name;
    uint32_t ndim;
    uint32_t shape[AMX_MAX_DIMS];
    uint64_t ncells;
    amx_recipe_t recipe;
    uint8_t accumulation; /* AMX_ACC_* */
    char *peer_group;     /* "" = none */
    char *scale_group;    /* "" = none */
    uint8_t peer_mode;    /* AMX_PEER_FILL / AMX_PEER_SHARE with a peer group, else 0 */
    uint8_t global_axes;  /* 0, or the leading axes that index separate globals (< ndim) */
    amx_calib_t calib;    /* how data becomes amax (calib.h); kind AMX_CAL_MAX: the max */
} amx_qspec_t;

/* A recipe as it came off the wire, before defaults are resolved. */
typedef struct amx_recipe_in {
    int present;
    int format, rule, history_reduce, nvfp4_convention, power_of_2;
    int output_convention, history_convention, mxfp8_convention;
    uint32_t history_len;
    float margin, eps;
} amx_recipe_in_t;

/* A calibrator as it came off the wire (proto Calibrator). */
typedef struct amx_calib_in {
    int present;
    int kind, method, grid, torch_cpu;
    uint32_t num_bins, num_bits, start_bin, stride;
    int is_unsigned, skip_zeros;
    double percentile, start_mult, stop_mult, step_size;
} amx_calib_in_t;

/* One quantizer of a Register request, as it came off the wire. */
typedef struct amx_qspec_in {
    const char *name;
    const uint32_t *global_shape;
    size_t ndim;
    amx_recipe_in_t recipe;
    int accumulation;
    const char *peer_group, *scale_group;
    const uint32_t *offset, *local_shape;
    size_t n_offset, n_local_shape;
    int peer_mode;
    uint32_t global_axes;
    amx_calib_in_t calib;
} amx_qspec_in_t;

/* Whether `s` is a valid job name: 1..128 characters of [A-Za-z0-9._-]. */
int amx_valid_job_name(const char *s);

/* Whether `s` is a valid quantizer or group name: 1..255 printable ASCII
 * characters without spaces. */
int amx_valid_name(const char *s);

/*
 * Validates `in` and fills `out` with a normalized spec whose strings are
 * borrowed from `in`. A quantizer of more than `max_cells` cells is
 * RESOURCE_EXHAUSTED; everything else that is wrong is INVALID_ARGUMENT
 * with a sentence naming the quantizer and the field.
 */
amx_status_t amx_qspec_parse(const amx_qspec_in_t *in, uint64_t max_cells, amx_qspec_t *out,
                             amx_err_t *err);

/* Everything but the placement equal? */
int amx_qspec_equal(const amx_qspec_t *a, const amx_qspec_t *b);

/* A deep copy (owned strings), or NULL when out of memory. */
amx_qspec_t *amx_qspec_dup(const amx_qspec_t *s);

/* Frees a spec made by amx_qspec_dup. NULL is fine. */
void amx_qspec_free(amx_qspec_t *s);

/* Writes "[a, b]" for a shape. */
void amx_fmt_shape(char *buf, size_t len, const uint32_t *d, size_t n);

/* One sentence saying how `b` differs from `a` (the first difference). */
void amx_qspec_diff(const amx_qspec_t *a, const amx_qspec_t *b, char *buf, size_t len);

/* History cells a spec needs: ncells * H for PER_EPOCH, else 0. */
uint64_t amx_qspec_hist_cells(const amx_qspec_t *s);

/* AMX_OK when s->calib is a normalized calibrator valid for the rest of
 * the spec (what amx_qspec_parse makes); EINVAL otherwise. For specs that
 * come from stored or transferred state. */
amx_status_t amx_qspec_check_calib(const amx_qspec_t *s);

/* Statistic values a spec holds in the stat buffers (state.h): a
 * histogram's num_bins counts and its overflow count; an MSE search's
 * nsteps losses and one presence count per cell (cell-major). 0 for max
 * quantizers. */
uint64_t amx_qspec_stat_values(const amx_qspec_t *s);

/* Stat cells (basis and calibrated amax) a spec holds: 1 for a histogram
 * (one per tensor), its cells for an MSE search, 0 for max. */
uint64_t amx_qspec_stat_cells(const amx_qspec_t *s);

/* Global slices a spec has: prod(shape[:global_axes]) when global_axes > 0,
 * else 0 (the quantizer's one global lives in the per-quantizer arrays). */
uint64_t amx_qspec_slices(const amx_qspec_t *s);

/* "PEER_FILL" / "PEER_SHARE" (or "none" without a group). */
const char *amx_peer_mode_name(int mode);

/* The agreed catalog of a job: specs sorted by name, owned. */
typedef struct amx_catalog {
    amx_qspec_t **q;
    uint32_t n;
    char **peer, **scale; /* sorted unique group names (borrowed from the specs) */
    uint32_t npeer, nscale;
    uint64_t ncells, nhist;
    uint64_t nslices; /* global slices of all quantizers (amx_qspec_slices) */
    uint64_t nstat;   /* statistic values of all quantizers (amx_qspec_stat_values) */
    uint64_t nscell;  /* stat cells of all quantizers (amx_qspec_stat_cells) */
    uint64_t hash;
    amx_strmap_t map; /* name -> index in q */
} amx_catalog_t;

/*
 * Builds a catalog from `n` specs with distinct names, taking ownership of
 * the specs (and of the array's contents, not of the array itself). ENOMEM
 * leaves the specs owned by the caller.
 */
amx_status_t amx_catalog_build(amx_qspec_t **specs, uint32_t n, amx_catalog_t **out,
                               amx_err_t *err);

/* An empty catalog, or NULL when out of memory. */
amx_catalog_t *amx_catalog_empty(void);

/* Frees a catalog and its specs. NULL is fine. */
void amx_catalog_free(amx_catalog_t *c);

/* qsort comparator of spec pointers: a catalog's order (names, bytewise). */
int amx_qspec_name_cmp(const void *x, const void *y);

/* Frees the catalog but its specs, which the caller takes (the array, of
 * *n specs in catalog order, is the caller's to free). */
amx_qspec_t **amx_catalog_take_specs(amx_catalog_t *c, uint32_t *n);

/* Index of `name` in c, or -1. */
int64_t amx_catalog_find(const amx_catalog_t *c, const char *name);

/*
 * The layout: desc[i] for quantizer i of c (base, ncells, history base and
 * length, global slices, group indices and peer mode, accumulation, recipe;
 * hist_head 0). `desc` has room for c->n entries.
 */
void amx_catalog_layout(const amx_catalog_t *c, amx_qdesc_t *desc);

/* The hash of a list of specs in the given order (FNV-1a, 64 bits, over
 * every field of every spec). amx_catalog_build stores it in c->hash. */
uint64_t amx_catalog_hash(amx_qspec_t *const *q, uint32_t n);

#endif
