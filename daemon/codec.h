/*
 * codec.h - protobuf <-> C, in one place: the mapping of amaxd.v1 recipes,
 * quantizer specs and amaxd.peer.v1 participants to the daemon's C types
 * (both services and the calls to other daemons use it), and the hand
 * codec of the hot messages, read and written in place without
 * protobuf-c: SendAmaxRequest, SendPackedRequest (read) and
 * ReconcilePackedResponse (written). The hand codec reads only messages
 * amx_wire_check accepted and means what protobuf-c's unpacking means
 * (tests/fuzz/fuzz_requests.c holds it to that; varints: wire.h).
 *
 * Pure functions of their arguments; any thread (a scratch is its
 * caller's).
 */
#ifndef AMX_CODEC_H
#define AMX_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "amaxd/peer/v1/peer.pb-c.h"
#include "amaxd/v1/amaxd.pb-c.h"
#include "arena.h"
#include "catalog.h"
#include "coord.h"
#include "request.h"
#include "status.h"

/* ---- mapping ---- */

/* A request's recipe as amx_qspec_parse takes it (r NULL: absent). */
void amx_codec_recipe_in(const Amaxd__V1__Recipe *r, amx_recipe_in_t *out);

/* A spec's recipe for an answer (strings and arrays borrowed from s). */
void amx_codec_recipe_out(const amx_recipe_t *r, Amaxd__V1__Recipe *out);

/* A trainer's QuantizerSpec, placement included, as amx_qspec_parse and the
 * registry take it (borrows q's strings and arrays). */
void amx_codec_spec_in(const Amaxd__V1__QuantizerSpec *q, amx_qspec_in_t *out);

/* A request's calibrator as amx_qspec_parse takes it (c NULL: absent, max). */
void amx_codec_calib_in(const Amaxd__V1__Calibrator *c, amx_calib_in_t *out);

/* A spec's calibrator for an answer. */
void amx_codec_calib_out(const amx_calib_t *c, Amaxd__V1__Calibrator *out);

/* An agreed spec for another daemon (borrows s's strings and arrays; the
 * recipe and calibrator messages q points to are allocated in `a`).
 * ENOMEM when the arena cannot grow. */
amx_status_t amx_codec_spec_out(const amx_qspec_t *s, Amaxd__V1__QuantizerSpec *q, amx_arena_t *a);

/* A spec from another daemon, validated as a trainer's is (borrows q's
 * strings). */
amx_status_t amx_codec_spec_parse(const Amaxd__V1__QuantizerSpec *q, amx_qspec_t *s,
                                  amx_err_t *err);

/* A membership as Participant messages in arena `a` (borrows m). */
amx_status_t amx_codec_members_out(const amx_membership_t *m, Amaxd__Peer__V1__Participant ***out,
                                   size_t *n, amx_arena_t *a);

/* A membership from Participant messages (owned copy; free with
 * amx_membership_free). */
amx_status_t amx_codec_members_in(Amaxd__Peer__V1__Participant **v, size_t n, uint32_t world,
                                  amx_membership_t *m);

/* Serializes a message into malloc'd bytes; NULL when out of memory. */
uint8_t *amx_codec_pack(const ProtobufCMessage *m, size_t *len);

/* ---- SendAmaxRequest, read in place ---- */

/* What a reader keeps from message to message: the updates and their
 * NUL-terminated names (reused, grown as needed). */
typedef struct amx_codec_scratch {
    amx_update_in_t *ups;
    size_t ups_cap;
    char *strs;
    size_t strs_cap;
} amx_codec_scratch_t;

/*
 * The registry's view of a SendAmaxRequest that amx_wire_check accepted:
 * values and has_data point into `d` (valid while it is); names are
 * copied into the scratch (valid until its next use). The last of a
 * repeated scalar or string wins; absent strings are "".
 */
amx_status_t amx_codec_send_parse(amx_codec_scratch_t *s, const uint8_t *d, size_t n,
                                  amx_send_req_t *q, amx_err_t *err);

/* Frees what the scratch keeps when it is over `keep` bytes (keep 0:
 * everything). */
void amx_codec_scratch_trim(amx_codec_scratch_t *s, size_t keep);

/* ---- SendPackedRequest, read in place ---- */

typedef struct amx_codec_packed_in {
    char job[AMX_MAX_JOB_NAME + 2];
    uint32_t rank;
    uint64_t epoch, layout_id, shm_id;
    int shm_has_data, shm_stats;
    uint8_t *values, *has_data; /* into the message */
    size_t values_len, has_data_len;
    uint8_t *stats, *stat_epochs; /* into the message */
    size_t stats_len, stat_epochs_len;
} amx_codec_packed_in_t;

/* The fields of a SendPackedRequest that amx_wire_check accepted. EINVAL
 * for a job name that cannot be one. */
amx_status_t amx_codec_packed_parse(uint8_t *d, size_t n, amx_codec_packed_in_t *in,
                                    amx_err_t *err);

/* ---- ReconcilePackedResponse, written in place ---- */

/* The most bytes a packed answer of n cells, q quantizers and ns global
 * slices takes (`stats`: with the arrays of calibrators beyond max). */
size_t amx_codec_packed_cap(size_t n, size_t q, size_t ns, int stats);

/*
 * Lays out the array fields of a packed answer in `buf` (at least
 * amx_codec_packed_cap bytes) and points p's arrays into it, each 16-byte
 * aligned in memory; the registry fills them. *pos is where the scalars go
 * when the fill marks are left out, *end where they go after them.
 */
void amx_codec_packed_layout(uint8_t *buf, amx_packed_t *p, size_t *pos, size_t *end);

/* Writes the scalars of the answer at `pos`; returns the message's length. */
size_t amx_codec_packed_finish(uint8_t *buf, size_t pos, uint64_t epoch, uint64_t next_epoch,
                               uint64_t layout_id, int peer_fill_known);

#endif
