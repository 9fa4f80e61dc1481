/*
 * guard.h - the Unix socket's own listener and HTTP/2 header guard.
 *
 * gRPC 1.51 cannot be trusted with the trainer socket: its listener stops
 * accepting for good after one EMFILE (CVE-2023-4785), and its HPACK parser
 * buffers an unbounded header block, checks the metadata limit per frame and
 * re-copies a header split over CONTINUATION frames on every frame
 * (CVE-2023-33953). The guard listens on the socket itself, on its own
 * thread: it never stops accepting (a reserve descriptor sheds connections
 * it cannot take), caps the number of connections, and relays every
 * connection to the gRPC server through a socketpair while reading only the
 * HTTP/2 frame headers: a header block (HEADERS + CONTINUATION) larger than
 * max_header_block closes the connection before gRPC sees the excess.
 *
 * Admission: a crowd of connections that never call must not lock the
 * node's trainers out. When a new connection finds its user (the peer uid,
 * SO_PEERCRED) at max_per_uid connections, or the guard at its connection
 * cap, one connection makes room: the oldest of those that have no call
 * open and never had a call answered, else the one idle longest since its
 * last call, of that user (at the guard's cap: of the user holding the
 * most connections), closed with a log line. A connection with a call
 * open (a stream it opened that neither side has ended) is never closed
 * for another; only when every candidate is in a call is the new
 * connection refused.
 */
#ifndef AMX_GUARD_H
#define AMX_GUARD_H

#include <grpc/grpc.h>
#include <stddef.h>

#include "status.h"

typedef struct amx_guard amx_guard_t;

/* Binds and listens on `path` (a stale socket must be gone), chmods it to
 * `mode`, and starts the guard thread, which relays connections to `server`
 * (started, insecure). A relayed connection costs three descriptors; at most
 * max_connections, and (RLIMIT_NOFILE - 128 - reserved_fds) / 3, are held
 * at once (reserved_fds: descriptors the daemon keeps for other uses, the
 * shared buffers of the packed form), at most max_per_uid by one user (0:
 * half of that); past a cap a connection is evicted or the new one refused
 * (above). The guard holds at most 1 MiB read from either side of a
 * connection and not yet written on, 256 MiB for all of them. */
amx_status_t amx_guard_start(const char *path, unsigned mode, grpc_server *server,
                             size_t max_header_block, uint32_t max_connections,
                             uint32_t max_per_uid, uint32_t reserved_fds, amx_guard_t **out,
                             amx_err_t *err);

/* Stops accepting and closes the listening socket; connections stay. Returns
 * once no connection can be handed to the server any more. Any thread. */
void amx_guard_stop_listening(amx_guard_t *g);

/* Connections relayed now, closing ones not counted (0 for NULL). Any thread. */
uint32_t amx_guard_connections(const amx_guard_t *g);

/* Connections refused and evicted since the start (0 for NULL). Any thread. */
void amx_guard_counts(const amx_guard_t *g, uint64_t *refused, uint64_t *evicted);

/* Closes every relayed connection, joins the thread, removes the socket file
 * and frees the guard. NULL is allowed. */
void amx_guard_free(amx_guard_t *g);

#endif
