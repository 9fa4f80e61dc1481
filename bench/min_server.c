/*
 * min_server.c - the floor of a unary call: a minimal gRPC C-core server
 * on a Unix socket that answers every call of any registered path with an
 * empty message, on one completion-queue thread, with no decoding and no
 * hand-off to another thread. bench/datapath.py runs it beside amaxd.
 *
 *   min_server unix:/path/sock [posted=64]
 *
 * Runs until SIGTERM/SIGINT.
 */
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct call {
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_byte_buffer *reply;
    grpc_slice details;
    int cancelled;
    int stage; /* 0: requested, 1: answered */
} call_t;

static grpc_server *srv;
static grpc_completion_queue *cq;
static void *method;
static volatile sig_atomic_t stop;

static void on_signal(int s)
{
    (void)s;
    stop = 1;
}

static void post(void)
{
    call_t *c = calloc(1, sizeof(*c));
    grpc_metadata_array_init(&c->md);
    grpc_server_request_registered_call(srv, method, &c->call, &c->deadline, &c->md, &c->payload,
                                        cq, cq, c);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s unix:/path [posted]\n", argv[0]);
        return 2;
    }
    int posted = argc > 2 ? atoi(argv[2]) : 64;
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    grpc_init();
    srv = grpc_server_create(NULL, NULL);
    cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(srv, cq, NULL);
    method = grpc_server_register_method(srv, "/amaxd.v1.Calibration/SendAmax", NULL,
                                         GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    grpc_server_credentials *cr = grpc_insecure_server_credentials_create();
    if (!grpc_server_add_http2_port(srv, argv[1], cr)) {
        fprintf(stderr, "cannot listen on %s\n", argv[1]);
        return 1;
    }
    grpc_server_credentials_release(cr);
    grpc_server_start(srv);
    for (int i = 0; i < posted; i++)
        post();
    grpc_slice empty = grpc_empty_slice();
    while (!stop) {
        grpc_event ev = grpc_completion_queue_next(
            cq, gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(200, GPR_TIMESPAN)),
            NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        call_t *c = ev.tag;
        if (c->stage == 0 && ev.success) {
            post();
            c->stage = 1;
            /* An empty SendAmaxResponse: zero bytes. */
            c->reply = grpc_raw_byte_buffer_create(&empty, 1);
            c->details = grpc_empty_slice();
            grpc_op ops[4];
            memset(ops, 0, sizeof(ops));
            ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
            ops[1].op = GRPC_OP_SEND_MESSAGE;
            ops[1].data.send_message.send_message = c->reply;
            ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
            ops[2].data.send_status_from_server.status = GRPC_STATUS_OK;
            ops[2].data.send_status_from_server.status_details = &c->details;
            ops[3].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
            ops[3].data.recv_close_on_server.cancelled = &c->cancelled;
            grpc_call_start_batch(c->call, ops, 4, c, NULL);
            continue;
        }
        if (c->payload)
            grpc_byte_buffer_destroy(c->payload);
        if (c->reply)
            grpc_byte_buffer_destroy(c->reply);
        grpc_metadata_array_destroy(&c->md);
        if (c->call)
            grpc_call_unref(c->call);
        free(c);
    }
    grpc_server_shutdown_and_notify(srv, cq, NULL);
    grpc_server_cancel_all_calls(srv);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_server_destroy(srv);
    grpc_completion_queue_destroy(cq);
    grpc_shutdown_blocking();
    return 0;
}
