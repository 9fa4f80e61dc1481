/*
 * doorbell.h - the device doorbell (docs/API.md "Device buffers", "The
 * doorbell"): ReconcileDevice without gRPC, for trainers on the daemon's
 * host that hold device buffers.
 *
 * A Unix SOCK_SEQPACKET socket next to the daemon's socket (its path and
 * ".door", the socket's permission bits). Each datagram a trainer sends is
 * one ReconcileDevice (job, rank, epoch, layout id, device buffers id,
 * send, has_data: the fields of ReconcileDeviceRequest, and a signal
 * sequence number: flags in the buffers instead of the events); each answer is
 * one datagram back (the gRPC status code, the message, the epoch, the
 * next epoch, the layout id). One request at a time per connection: the
 * next is read after the answer. The registry checks and serves the
 * request exactly as it serves the gRPC call; the doorbell only saves the
 * trip through gRPC (HTTP/2 framing, the socket guard's relay, the
 * completion queue) both ways.
 *
 * One thread (epoll) accepts connections and reads requests; it hands
 * each to the loop lock's holder (amx_rpc_run_locked) and never waits for
 * the lock. Answers are sent by whichever thread holds the loop lock when
 * the epoch ends. A connection that closes while its request waits
 * cancels the wait, as a gRPC call that goes away does.
 */
#ifndef AMX_DOORBELL_H
#define AMX_DOORBELL_H

#include <stdint.h>

#include "registry.h"
#include "rpc.h"
#include "status.h"

/* The wire format, little-endian, packed (docs/API.md "The doorbell"). */
#define AMX_DOOR_MAGIC 0x31424441u /* "ADB1" */
#define AMX_DOOR_REQ_BYTES 48      /* then the job name (job_len bytes, no NUL) */
#define AMX_DOOR_ANS_BYTES 40      /* then the message (msg_len bytes, no NUL) */
#define AMX_DOOR_MAX_JOB 255
#define AMX_DOOR_MAX_MSG 2048
#define AMX_DOOR_SEND 1u     /* flags: merge the device slab */
#define AMX_DOOR_HAS_DATA 2u /* flags: with its has-data bytes */
#define AMX_DOOR_ARM 4u      /* flags: then arm the next epoch (docs/API.md "Armed epochs") */
#define AMX_DOOR_DISARM 8u   /* flags, alone: do not arm again after the armed epoch */
#define AMX_DOOR_ARMED 1u    /* answer bytes 36-39: the next epoch is armed for the trainer */
#define AMX_DOOR_MAX_CONNS 1024

typedef struct amx_door amx_door_t;

/* Listens at `path` (a Unix socket path, permission bits `mode`) and
 * starts the doorbell thread. A path too long for a Unix socket gives
 * *out = NULL and a warning: trainers use gRPC. Loop thread. */
amx_status_t amx_door_start(const char *path, unsigned mode, amx_registry_t *reg, amx_rpc_t *rpc,
                            amx_door_t **out, amx_err_t *err);

/* The socket's path ("" for NULL). Any thread. */
const char *amx_door_path(const amx_door_t *d);

/* Stops the thread, cancels waiting requests, closes every connection and
 * removes the socket. Loop thread holding the loop lock, after
 * amx_rpc_run returned and before the registry is destroyed. NULL is
 * fine. */
void amx_door_free(amx_door_t *d, amx_rpc_t *rpc);

#endif
