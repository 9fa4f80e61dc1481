/*
 * rpc_client.c - the loop's asynchronous client calls (rpc.h amx_rpc_call):
 * one batch with every op on the transport's completion queue, one tag, one
 * callback.
 */
#include "rpc_impl.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"

/* ---- client calls ---- */

static void ccall_free(amx_ccall_t *cc)
{
    amx_rpc_t *rpc = cc->rpc;
    if (cc->prev)
        cc->prev->next = cc->next;
    else
        rpc->ccalls = cc->next;
    if (cc->next)
        cc->next->prev = cc->prev;
    if (cc->send_buf)
        grpc_byte_buffer_destroy(cc->send_buf);
    if (cc->recv_buf)
        grpc_byte_buffer_destroy(cc->recv_buf);
    grpc_metadata_array_destroy(&cc->init_md);
    grpc_metadata_array_destroy(&cc->trail_md);
    grpc_slice_unref(cc->details);
    grpc_slice_unref(cc->md.key);
    grpc_slice_unref(cc->md.value);
    if (cc->call)
        grpc_call_unref(cc->call);
    free(cc);
}

gpr_timespec amx_rpc_deadline(uint64_t deadline_ms)
{
    if (deadline_ms == UINT64_MAX)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    uint64_t now = amx_now_ms();
    int64_t left = deadline_ms > now ? (int64_t)(deadline_ms - now) : 0;
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(left, GPR_TIMESPAN));
}

amx_status_t amx_rpc_call(amx_rpc_t *rpc, grpc_channel *ch, const char *method, const uint8_t *req,
                          size_t len, const char *md_key, const char *md_val, uint64_t deadline_ms,
                          amx_ccall_cb cb, void *ud, amx_ccall_t **out, amx_err_t *err)
{
    if (rpc->stopping)
        return amx_err_set(err, AMX_EUNAVAIL, "amaxd is shutting down");
    amx_ccall_t *cc = calloc(1, sizeof(*cc));
    if (cc == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    cc->tag = (tag_t){cc, TAG_CLIENT};
    cc->rpc = rpc;
    cc->cb = cb;
    cc->ud = ud;
    cc->details = grpc_empty_slice();
    cc->md.key = grpc_slice_from_copied_string(md_key ? md_key : "");
    cc->md.value = grpc_slice_from_copied_string(md_val ? md_val : "");
    grpc_metadata_array_init(&cc->init_md);
    grpc_metadata_array_init(&cc->trail_md);
    grpc_slice path = grpc_slice_from_static_string(method);
    cc->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, rpc->cq, path, NULL,
                                        amx_rpc_deadline(deadline_ms), NULL);
    cc->next = rpc->ccalls;
    if (rpc->ccalls)
        rpc->ccalls->prev = cc;
    rpc->ccalls = cc;
    if (cc->call == NULL) {
        ccall_free(cc);
        return amx_err_set(err, AMX_EINTERNAL, "cannot create a call of %s", method);
    }
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)req, len);
    cc->send_buf = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = md_key ? 1 : 0;
    ops[0].data.send_initial_metadata.metadata = md_key ? &cc->md : NULL;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = cc->send_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &cc->init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &cc->recv_buf;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &cc->trail_md;
    ops[5].data.recv_status_on_client.status = &cc->status;
    ops[5].data.recv_status_on_client.status_details = &cc->details;
    if (grpc_call_start_batch(cc->call, ops, 6, &cc->tag, NULL) != GRPC_CALL_OK) {
        ccall_free(cc);
        return amx_err_set(err, AMX_EINTERNAL, "cannot start a call of %s", method);
    }
    if (out)
        *out = cc;
    return AMX_OK;
}

void amx_rpc_call_cancel(amx_rpc_t *rpc, amx_ccall_t *cc)
{
    (void)rpc;
    cc->cancelled = 1;
    grpc_call_cancel(cc->call, NULL);
}

void amx__rpc_on_client(amx_ccall_t *cc, int ok)
{
    if (!cc->cancelled) {
        char msg[1024];
        amx_status_t st;
        uint8_t *data = NULL;
        size_t len = 0;
        if (!ok) {
            st = AMX_EINTERNAL;
            snprintf(msg, sizeof(msg), "the call could not be completed");
        } else {
            st = amx_status_from_grpc((int)cc->status);
            snprintf(msg, sizeof(msg), "%.*s", (int)GRPC_SLICE_LENGTH(cc->details),
                     (const char *)GRPC_SLICE_START_PTR(cc->details));
        }
        grpc_slice all = grpc_empty_slice();
        if (st == AMX_OK && cc->recv_buf != NULL) {
            grpc_byte_buffer_reader r;
            if (grpc_byte_buffer_reader_init(&r, cc->recv_buf)) {
                all = grpc_byte_buffer_reader_readall(&r);
                grpc_byte_buffer_reader_destroy(&r);
                data = GRPC_SLICE_START_PTR(all);
                len = GRPC_SLICE_LENGTH(all);
            }
        } else if (st == AMX_OK) {
            st = AMX_EINTERNAL;
            snprintf(msg, sizeof(msg), "the answer carried no message");
        }
        cc->cb(cc->ud, st, msg, data, len);
        grpc_slice_unref(all);
    }
    amx_rpc_t *rpc = cc->rpc;
    ccall_free(cc);
    if (rpc->stopping)
        amx__rpc_check_stopped(rpc);
}