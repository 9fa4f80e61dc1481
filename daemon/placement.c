/* placement.c - block geometry. */
#include "placement.h"

#include <string.h>

amx_status_t amx_placement_parse(const amx_qspec_t *s, const uint32_t *off, size_t n_off,
                                 const uint32_t *shape, size_t n_shape, amx_placement_t *out,
                                 amx_err_t *err)
{
    char b1[96], b2[96];
    memset(out, 0, sizeof(*out));
    out->ndim = s->ndim;
    out->ncells = 1;
    if (n_off == 0 && n_shape == 0) {
        amx_placement_whole(s, out);
        return AMX_OK;
    }
    if (n_off != s->ndim || n_shape != s->ndim)
        return amx_err_set(err, AMX_EINVAL,
                           "quantizer '%s': offset has %zu and local_shape %zu entries; both "
                           "need %u (one per global dimension) or none",
                           s->name, n_off, n_shape, s->ndim);
    for (uint32_t d = 0; d < s->ndim; d++) {
        if (shape[d] == 0 || (uint64_t)off[d] + shape[d] > s->shape[d]) {
            amx_fmt_shape(b1, sizeof(b1), off, n_off);
            amx_fmt_shape(b2, sizeof(b2), shape, n_shape);
            return amx_err_set(err, AMX_EINVAL,
                               "quantizer '%s': block at offset %s of shape %s does not lie "
                               "inside the global shape (dimension %u)",
                               s->name, b1, b2, d);
        }
        out->off[d] = off[d];
        out->shape[d] = shape[d];
        out->ncells *= shape[d];
    }
    return AMX_OK;
}

void amx_placement_whole(const amx_qspec_t *s, amx_placement_t *out)
{
    memset(out, 0, sizeof(*out));
    out->ndim = s->ndim;
    memcpy(out->shape, s->shape, sizeof(out->shape));
    out->ncells = s->ncells;
}

int amx_placement_equal(const amx_placement_t *a, const amx_placement_t *b)
{
    return a->ndim == b->ndim && memcmp(a->off, b->off, sizeof(a->off)) == 0 &&
           memcmp(a->shape, b->shape, sizeof(a->shape)) == 0;
}

uint64_t amx_placement_nrows(const amx_placement_t *pl)
{
    return pl->ndim == 0 ? 1 : pl->ncells / pl->shape[pl->ndim - 1];
}

void amx_placement_rows(const amx_placement_t *pl, const uint32_t *gshape, uint64_t base,
                        amx_row_fn fn, void *ud)
{
    if (pl->ndim == 0) {
        fn(ud, base, 0, 1);
        return;
    }
    uint64_t gstride[AMX_MAX_DIMS], s = 1;
    for (int d = (int)pl->ndim - 1; d >= 0; d--) {
        gstride[d] = s;
        s *= gshape[d];
    }
    uint32_t last = pl->ndim - 1;
    uint64_t rowlen = pl->shape[last];
    uint64_t nrows = pl->ncells / rowlen;
    uint32_t idx[AMX_MAX_DIMS] = {0};
    for (uint64_t row = 0; row < nrows; row++) {
        uint64_t dst = base;
        for (uint32_t d = 0; d < pl->ndim; d++)
            dst += (uint64_t)(pl->off[d] + (d == last ? 0 : idx[d])) * gstride[d];
        fn(ud, dst, row * rowlen, rowlen);
        for (int d = (int)last - 1; d >= 0; d--) {
            if (++idx[d] < pl->shape[d])
                break;
            idx[d] = 0;
        }
    }
}

uint64_t amx_placement_global_slice(const amx_placement_t *pl, const uint32_t *gshape, uint32_t k,
                                    uint64_t j)
{
    uint64_t idx[AMX_MAX_DIMS], g = 0;
    for (uint32_t d = k; d-- > 0;) {
        idx[d] = j % pl->shape[d] + pl->off[d];
        j /= pl->shape[d];
    }
    for (uint32_t d = 0; d < k; d++)
        g = g * gshape[d] + idx[d];
    return g;
}
