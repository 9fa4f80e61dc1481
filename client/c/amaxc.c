#include "amaxc.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct amaxc {
    grpc_channel *ch;
    grpc_completion_queue *cq;
};

amaxc_t *amaxc_open(const char *target)
{
    char addr[512];
    if (target[0] == '/')
        snprintf(addr, sizeof(addr), "unix:%s", target);
    else
        snprintf(addr, sizeof(addr), "%s", target);
    amaxc_t *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    grpc_init();
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_arg arg = {GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, {.integer = -1}};
    grpc_channel_args args = {1, &arg};
    c->ch = grpc_channel_create(addr, creds, &args);
    grpc_channel_credentials_release(creds);
    c->cq = grpc_completion_queue_create_for_pluck(NULL);
    return c;
}

void amaxc_close(amaxc_t *c)
{
    if (c == NULL)
        return;
    grpc_channel_destroy(c->ch);
    grpc_completion_queue_shutdown(c->cq);
    while (
        grpc_completion_queue_pluck(c->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
        GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(c->cq);
    grpc_shutdown_blocking();
    free(c);
}

int amaxc_call(amaxc_t *c, const char *method, const ProtobufCMessage *req,
               const ProtobufCMessageDescriptor *resp_desc, ProtobufCMessage **resp,
               double timeout_s, char *msg, size_t msglen)
{
    gpr_timespec deadline =
        gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                     gpr_time_from_millis((int64_t)(timeout_s * 1000), GPR_TIMESPAN));
    grpc_slice mslice = grpc_slice_from_copied_string(method);
    grpc_call *call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, c->cq, mslice,
                                               NULL, deadline, NULL);
    grpc_slice_unref(mslice);
    size_t len = protobuf_c_message_get_packed_size(req);
    grpc_slice s = grpc_slice_malloc(len);
    protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *send = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_byte_buffer *recv = NULL;
    grpc_metadata_array init_md, trail_md;
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trail_md);
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trail_md;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    int tag;
    grpc_call_error e = grpc_call_start_batch(call, ops, 6, &tag, NULL);
    if (e == GRPC_CALL_OK)
        grpc_completion_queue_pluck(c->cq, &tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    else
        status = GRPC_STATUS_INTERNAL;
    *resp = NULL;
    if (status == GRPC_STATUS_OK && recv != NULL) {
        grpc_byte_buffer_reader r;
        grpc_byte_buffer_reader_init(&r, recv);
        grpc_slice all = grpc_byte_buffer_reader_readall(&r);
        grpc_byte_buffer_reader_destroy(&r);
        *resp = protobuf_c_message_unpack(resp_desc, NULL, GRPC_SLICE_LENGTH(all),
                                          GRPC_SLICE_START_PTR(all));
        grpc_slice_unref(all);
        if (*resp == NULL) {
            status = GRPC_STATUS_INTERNAL;
            snprintf(msg, msglen, "the daemon's answer is not a valid %s", resp_desc->name);
        }
    } else if (status == GRPC_STATUS_OK) {
        status = GRPC_STATUS_INTERNAL;
        snprintf(msg, msglen, "the daemon answered OK without a message");
    } else {
        snprintf(msg, msglen, "%.*s", (int)GRPC_SLICE_LENGTH(details),
                 (const char *)GRPC_SLICE_START_PTR(details));
    }
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trail_md);
    grpc_byte_buffer_destroy(send);
    if (recv)
        grpc_byte_buffer_destroy(recv);
    grpc_call_unref(call);
    return (int)status;
}

const char *amaxc_code_name(int code)
{
    static const char *const names[] = {"OK",
                                        "CANCELLED",
                                        "UNKNOWN",
                                        "INVALID_ARGUMENT",
                                        "DEADLINE_EXCEEDED",
                                        "NOT_FOUND",
                                        "ALREADY_EXISTS",
                                        "PERMISSION_DENIED",
                                        "RESOURCE_EXHAUSTED",
                                        "FAILED_PRECONDITION",
                                        "ABORTED",
                                        "OUT_OF_RANGE",
                                        "UNIMPLEMENTED",
                                        "INTERNAL",
                                        "UNAVAILABLE",
                                        "DATA_LOSS",
                                        "UNAUTHENTICATED"};
    return code >= 0 && code <= 16 ? names[code] : "UNKNOWN";
}
