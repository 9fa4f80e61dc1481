/* export.h - amaxctl export (export.c). */
#ifndef AMAXCTL_EXPORT_H
#define AMAXCTL_EXPORT_H

#include <stddef.h>
#include <stdint.h>

#include "amaxc.h"

/* Writes job `job`'s last reconciled scales (whole tensors of every agreed
 * quantizer) to the safetensors file `path` (atomically: path.tmp, fsync,
 * rename). 0 with the epoch and quantizer count, or -1 with a sentence. */
int amaxctl_export(amaxc_t *c, double timeout, const char *job, const char *path,
                   uint64_t *epoch_out, size_t *nq_out, char *msg, size_t len);

#endif
