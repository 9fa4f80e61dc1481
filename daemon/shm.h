/*
 * shm.h - shared-memory buffers of the packed form (docs/API.md, "Packed
 * form over shared memory").
 *
 * A rank on the daemon's host may ask GetLayout for a buffer: files the
 * daemon creates in `shm_dir` (tmpfs) with the socket's permission bits
 * (never other users'), opened by the trainer. The trainer writes its slab
 * (and has-data bytes) at the offsets the daemon gave and sends a
 * SendPacked naming the buffer instead of carrying the bytes;
 * ReconcilePacked naming it gets the whole packed answer built in the
 * buffer and only its length over gRPC.
 *
 * The slab file also holds the statistics of calibrators beyond max (the
 * float64 stat slab and its stat epochs) when the trainer puts them there
 * (SendPackedRequest.shm_stats).
 *
 * A buffer is two files. The trainer writes the slab file; the daemon
 * never maps it but reads it with pread(2) into its own memory, so a
 * trainer that truncates, grows or rewrites it can give it short reads or
 * other values (refused or merged as any sent values would be), never a
 * SIGBUS or a value that changes between validation and merge. The
 * answer file is the daemon's: its pages reserved when it is made, mapped
 * by the daemon, which builds answers in it in place, readable (not
 * writable) by the trainers' group. Both are unlinked at the buffer's
 * first use (the trainer has opened them by then), so
 * nothing is left behind when either side dies after that; files that
 * no running daemon holds (each holds a shared flock on its linked
 * buffers) are removed when a daemon starts.
 *
 * Loop thread (under the loop lock) only.
 */
#ifndef AMX_SHM_H
#define AMX_SHM_H

#include <stddef.h>
#include <stdint.h>

#include "status.h"

/* Shared buffers of the packed form a daemon keeps at once, at most. */
#define SHM_MAX_REGIONS 4096

typedef struct amx_shm amx_shm_t;

/* What a buffer holds: the layout's cells, statistic values (float64)
 * and quantizers (one uint64 stat epoch each), and the most bytes of an
 * answer. */
typedef struct amx_shm_sizes {
    uint64_t cells, stats, quantizers, answer_bytes;
} amx_shm_sizes_t;

/* The slab file: values (cells float32) at 0, has-data bytes (cells) at
 * has_data_off, statistics (stats float64) at stats_off (8-aligned), their
 * stat epochs (quantizers uint64) at stat_epochs_off. */
typedef struct amx_shm_region {
    uint64_t id; /* random, never 0: requests name the buffer by it */
    uint64_t layout_id;
    uint64_t cells, stats, quantizers;
    uint64_t has_data_off, stats_off, stat_epochs_off;
    const char *path;        /* the slab file; valid until the region goes */
    const char *answer_path; /* the answer file (at 0), read-only to trainers */
} amx_shm_region_t;

/* A slab read from a buffer (amx_shm_read), in memory of the amx_shm_t. */
typedef struct amx_shm_slab {
    float *values;           /* cells floats, writable: the registry normalizes them in place */
    const uint8_t *has_data; /* cells bytes, or NULL */
    const uint8_t *stats, *stat_epochs;  /* or NULL; 8-aligned */
    size_t cells, stats_len, epochs_len; /* the last two in bytes */
} amx_shm_slab_t;

/* Buffers in `dir` (created with permission bits `mode`), at most
 * `max_regions` at once. An empty `dir` gives *out = NULL: the feature is
 * off. Removes the files of daemons that are no longer running. */
amx_status_t amx_shm_create(const char *dir, unsigned mode, size_t max_regions, amx_shm_t **out,
                            amx_err_t *err);
/* Closes every buffer and unlinks those still linked. NULL is fine. */
void amx_shm_free(amx_shm_t *s);

/* Frees the slab read buffer when it is over `keep` bytes (an idle
 * daemon). NULL is fine. */
void amx_shm_trim(amx_shm_t *s, size_t keep);

/* A new buffer for (job, rank) of layout `layout_id` sized by `sz`,
 * replacing the rank's previous one. */
amx_status_t amx_shm_open(amx_shm_t *s, const char *job, uint32_t rank, uint64_t layout_id,
                          const amx_shm_sizes_t *sz, amx_shm_region_t *out, amx_err_t *err);

/* Reads the slab of buffer `id` of (job, rank), which must belong to
 * layout `layout_id`: its values, and the has-data bytes when
 * with_has_data, the statistics and their stat epochs when with_stats
 * (else NULL, length 0), into *out, in memory of `s` valid until the next
 * call. A file that ends before a part: AMX_EPRECOND naming the part. */
amx_status_t amx_shm_read(amx_shm_t *s, const char *job, uint32_t rank, uint64_t id,
                          uint64_t layout_id, int with_has_data, int with_stats,
                          amx_shm_slab_t *out, amx_err_t *err);

/* Whether (job, rank) has buffer `id` (a ReconcilePacked is refused
 * before it waits, not after its epoch). */
amx_status_t amx_shm_check(amx_shm_t *s, const char *job, uint32_t rank, uint64_t id,
                           amx_err_t *err);

/* Where to build an answer of up to `need` bytes for buffer `id` of
 * (job, rank): the answer file's mapping (valid until the buffer is
 * replaced or dropped), or NULL with *err. */
uint8_t *amx_shm_answer(amx_shm_t *s, const char *job, uint32_t rank, uint64_t id, size_t need,
                        amx_err_t *err);

/* Drops the buffers of `job` (the registry's drop hook: `s` is an
 * amx_shm_t, NULL is fine). */
void amx_shm_drop_job(void *s, const char *job);

#endif
