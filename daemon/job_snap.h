/*
 * job_snap.h - a job's own section of its snapshot: counters and every
 * local rank's placements of the quantizers of a catalog, by name (the
 * names are borrowed from the job). Written by the job's engine after an
 * epoch (while in flight it alone reads the job) and by the loop at
 * shutdown; read back by restore.c.
 */
#ifndef AMX_JOB_SNAP_H
#define AMX_JOB_SNAP_H

#include "catalog.h"
#include "job.h"
#include "snapshot.h"
#include "status.h"

/* The section of `j` over catalog `cat`; ENOMEM leaves *m to be freed. */
amx_status_t amx_job_snap_meta(const amx_job_t *j, const amx_catalog_t *cat, amx_snap_meta_t *m);

/* Frees what a section holds (previous-epoch arrays included). */
void amx_job_snap_meta_free(amx_snap_meta_t *m);

#endif
