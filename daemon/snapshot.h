/*
 * snapshot.h - a job's durable state on disk (docs/OPERATING.md,
 * "Durability").
 *
 * One file per job, <state_dir>/<job>.amxs, little-endian:
 *
 *   "AMXS", format version, length of the job section
 *   job section: the job's name and world size, epochs reconciled and
 *     failed, the length of the job state, each local rank's placements by
 *     quantizer name, then (format 2) each quantizer's global amax and
 *     scale of the epoch before the snapshotted one, in catalog order
 *   checksum of everything above (64 bits), padding to 8 bytes
 *   the job-state blob (jobstate.h: catalog, history heads, replicated
 *     state, last results; it carries its own checksum)
 *
 * A file is written whole or not at all: <job>.amxs.tmp, fsync, rename
 * over <job>.amxs, fsync of the directory. Reading checks the magic, the
 * version, every length and both checksums before anything is used.
 */
#ifndef AMX_SNAPSHOT_H
#define AMX_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include "jobstate.h"
#include "placement.h"
#include "status.h"

#define AMX_SNAPSHOT_VERSION 2
#define AMX_SNAPSHOT_SUFFIX ".amxs"

/* One placement of a local rank. */
typedef struct amx_snap_pl {
    const char *name; /* quantizer */
    amx_placement_t pl;
} amx_snap_pl_t;

typedef struct amx_snap_rank {
    uint32_t rank;
    uint32_t n;
    amx_snap_pl_t *pls;
} amx_snap_rank_t;

/* The job section. */
typedef struct amx_snap_meta {
    const char *job;
    uint32_t world;
    uint64_t epochs_ok, epochs_failed;
    amx_snap_rank_t *ranks;
    uint32_t nranks;
    uint64_t state_len; /* bytes of the job-state blob that follows */
    /* The epoch before: per quantizer of the catalog (nprev is 0 or its
     * size), whether it had one, its global amax and scale (malloc'd). */
    uint32_t nprev;
    uint8_t *prev_ok;
    float *prev_ga, *prev_gs;
} amx_snap_meta_t;

/* Encodes the job section (with its checksum and padding) into a malloc'd
 * buffer. */
amx_status_t amx_snapshot_encode_meta(const amx_snap_meta_t *m, void **out, size_t *len,
                                      amx_err_t *err);

/* Writes section + blob atomically as <dir>/<job>.amxs (see above). Any
 * thread; the caller keeps two writers of one job apart. */
amx_status_t amx_snapshot_write(const char *dir, const char *job, const void *meta, size_t meta_len,
                                const void *blob, size_t blob_len, amx_err_t *err);

/* A snapshot read back: the file's bytes (owned, 8-byte aligned), its job
 * section (strings and arrays owned) and its parsed job state (borrowing
 * from the bytes). */
typedef struct amx_snapshot {
    void *buf;
    size_t len;
    amx_snap_meta_t meta;
    amx_jobstate_t js;
} amx_snapshot_t;

/* Reads and checks <path>. EINVAL with a sentence saying what is wrong
 * (truncated, checksum, version) when it cannot be used; EIO when it
 * cannot be read. */
amx_status_t amx_snapshot_read(const char *path, amx_snapshot_t *out, amx_err_t *err);

void amx_snapshot_free(amx_snapshot_t *s);

/* Removes <dir>/<job>.amxs (a dropped job); 0, or -errno (ENOENT is 0). */
int amx_snapshot_remove(const char *dir, const char *job);

/* Moves a snapshot that cannot be used aside, to <path>.corrupt (or
 * .corrupt.N when that exists); writes the new name into `to`. */
int amx_snapshot_set_aside(const char *path, char *to, size_t to_len);

#endif
