/*
 * comm.h - the collective backend: how daemons of one job reduce their flat
 * buffers. "local" (a single daemon) is the only backend of this version;
 * NCCL and Gloo implement the same interface.
 */
#ifndef AMX_COMM_H
#define AMX_COMM_H

#include <stddef.h>

#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct amx_comm amx_comm_t;

struct amx_comm {
    const char *name;
    /* Element-wise MAX all-reduce of `n` floats in place. `on_device` says
     * whether buf is device memory. Must be entered by every daemon of the
     * job in the same order; returns ETIMEDOUT/EUNAVAIL when a peer is gone. */
    amx_status_t (*allreduce_max)(amx_comm_t *c, float *buf, size_t n, int on_device,
                                  amx_err_t *err);
    void (*destroy)(amx_comm_t *c);
    int world; /* daemons in the collective */
    int rank;
};

/* The collective of a job served by this daemon alone. Never fails. */
amx_comm_t *amx_comm_local_create(void);

#ifdef __cplusplus
}
#endif

#endif
