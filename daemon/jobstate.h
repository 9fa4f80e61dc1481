/*
 * jobstate.h - a job's replicated state as one self-describing,
 * checksummed byte string: what a donor sends to a daemon that is behind
 * (docs/CLUSTER.md, "Agreement").
 *
 * Layout (little-endian): "AMXJ", format version, the job name, the last
 * reconciled epoch, the agreed catalog (every spec field) with each
 * quantizer's history head, then the arrays of the replicated state and of
 * the published results (8-byte aligned), and a 64-bit checksum of
 * everything before it. Parsing checks every length and the checksum
 * before anything is used. Any thread.
 */
#ifndef AMX_JOBSTATE_H
#define AMX_JOBSTATE_H

#include <stddef.h>
#include <stdint.h>

#include "catalog.h"
#include "state.h"
#include "status.h"

/* 3: each spec carries its peer mode and global axes, and the state its
 * per-slice arrays (previous delayed global scales; global amax, scale and
 * inverse of the published results). 4: each spec its calibrator, and the
 * state the statistics of calibrators beyond max (accumulated sums,
 * bases, published stat results). 5: the previous epoch's globals
 * (pprev_*). Versions 3 and 4 are still read. */
#define AMX_JOBSTATE_VERSION 5 /* 5: the globals of the epoch before the last (below) */

typedef struct amx_jobstate {
    char *job;
    uint64_t last_reconciled;
    amx_catalog_t *cat;   /* owned */
    uint32_t *hist_head;  /* per catalog index, owned */
    amx_state_arrays_t a; /* point into the parsed blob (kept alive by the caller) */
    /* Format 5: per quantizer, the global amax and scale of the epoch
     * before last_reconciled as the exporter's answers carried them
     * (previous_global_*; NaN: none). NULL in older formats. */
    const float *pprev_ga, *pprev_gs;
} amx_jobstate_t;

/*
 * Serializes the replicated state of `st` (layout of `cat` / `desc`, whose
 * hist_head fields are saved) and its published results (`back`: the back
 * results finish just wrote) into a malloc'd blob. Engine thread of the job
 * (it reads the state backend), or the loop while nothing is in flight.
 */
amx_status_t amx_jobstate_export(const char *job, uint64_t last_reconciled,
                                 const amx_catalog_t *cat, const amx_qdesc_t *desc, amx_state_t *st,
                                 int back, void **blob, size_t *len, amx_err_t *err);

/* The same; where g_ok (per quantizer of cat) is 0, the quantizer's
 * global amax, scale and inverse are written as NaN: the state holds no
 * published global for it, only a layout change's placeholder. */
amx_status_t amx_jobstate_export_marked(const char *job, uint64_t last_reconciled,
                                        const amx_catalog_t *cat, const amx_qdesc_t *desc,
                                        amx_state_t *st, int back, const uint8_t *g_ok, void **blob,
                                        size_t *len, amx_err_t *err);

/* The same, with the previous epoch's globals (per quantizer of cat; NULL:
 * none, written as NaN). */
amx_status_t amx_jobstate_export_prev(const char *job, uint64_t last_reconciled,
                                      const amx_catalog_t *cat, const amx_qdesc_t *desc,
                                      amx_state_t *st, int back, const uint8_t *g_ok,
                                      const float *pprev_ga, const float *pprev_gs, void **blob,
                                      size_t *len, amx_err_t *err);

/* Parses and checks a blob; on AMX_OK `out` owns a catalog and borrows
 * arrays from `blob`, which must stay alive and 8-byte aligned. */
amx_status_t amx_jobstate_parse(const void *blob, size_t len, amx_jobstate_t *out, amx_err_t *err);

void amx_jobstate_free(amx_jobstate_t *js);

/* The checksum used (64 bits over 8-byte words). */
uint64_t amx_checksum64(const void *p, size_t n);

#endif
