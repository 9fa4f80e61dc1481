/*
 * placement.h - a rank's block of a quantizer's global amax tensor, and the
 * geometry of walking it row by row. Pure functions; any thread.
 */
#ifndef AMX_PLACEMENT_H
#define AMX_PLACEMENT_H

#include <stddef.h>
#include <stdint.h>

#include "catalog.h"
#include "status.h"

typedef struct amx_placement {
    uint32_t ndim;
    uint32_t off[AMX_MAX_DIMS], shape[AMX_MAX_DIMS];
    uint64_t ncells;
} amx_placement_t;

/*
 * The block (offset, local_shape) of a rank in quantizer `s`: both empty
 * means the whole tensor. INVALID_ARGUMENT with a sentence when the block
 * does not lie inside the global shape.
 */
amx_status_t amx_placement_parse(const amx_qspec_t *s, const uint32_t *off, size_t n_off,
                                 const uint32_t *shape, size_t n_shape, amx_placement_t *out,
                                 amx_err_t *err);

/* The whole tensor of `s`. */
void amx_placement_whole(const amx_qspec_t *s, amx_placement_t *out);

/* Equal blocks? */
int amx_placement_equal(const amx_placement_t *a, const amx_placement_t *b);

/* For a quantizer with global_axes k > 0 of global shape `gshape`: the
 * global slice index (row-major over gshape[:k]) of block slice j of `pl`
 * (a block slice is one index of the block's first k axes, row-major). */
uint64_t amx_placement_global_slice(const amx_placement_t *pl, const uint32_t *gshape, uint32_t k,
                                    uint64_t j);

/* Contiguous rows of a block: the number of amx_placement_rows callbacks. */
uint64_t amx_placement_nrows(const amx_placement_t *pl);

/*
 * Calls fn(ud, dst, src, len) for each contiguous row of block `pl` inside
 * a global tensor of shape `gshape` whose first cell is `base`: cells
 * [dst, dst+len) of the flat buffer are cells [src, src+len) of the block in
 * row-major order.
 */
typedef void (*amx_row_fn)(void *ud, uint64_t dst, uint64_t src, uint64_t len);
void amx_placement_rows(const amx_placement_t *pl, const uint32_t *gshape, uint64_t base,
                        amx_row_fn fn, void *ud);

#endif
