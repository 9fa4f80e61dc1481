/*
 * unary_client.c - unary calls per second from the gRPC C core, with a
 * fixed number of calls in flight on one channel (one completion-queue
 * thread). The request is a serialized message read from a file.
 *
 *   unary_client TARGET METHOD REQUEST_FILE INFLIGHT SECONDS
 *
 * Prints "calls N seconds S rate R errors E" (non-OK statuses are counted;
 * the first one's message goes to stderr).
 */
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct call {
    grpc_call *call;
    grpc_byte_buffer *send, *recv;
    grpc_metadata_array im, tm;
    grpc_status_code status;
    grpc_slice details;
} call_t;

static grpc_channel *ch;
static grpc_completion_queue *cq;
static grpc_slice path, req;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void start(call_t *c)
{
    memset(c, 0, sizeof(*c));
    c->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, path, NULL,
                                       gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    c->send = grpc_raw_byte_buffer_create(&req, 1);
    grpc_metadata_array_init(&c->im);
    grpc_metadata_array_init(&c->tm);
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = c->send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &c->im;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &c->recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &c->tm;
    ops[5].data.recv_status_on_client.status = &c->status;
    ops[5].data.recv_status_on_client.status_details = &c->details;
    grpc_call_start_batch(c->call, ops, 6, c, NULL);
}

static void finish(call_t *c)
{
    grpc_byte_buffer_destroy(c->send);
    if (c->recv)
        grpc_byte_buffer_destroy(c->recv);
    grpc_metadata_array_destroy(&c->im);
    grpc_metadata_array_destroy(&c->tm);
    grpc_slice_unref(c->details);
    grpc_call_unref(c->call);
}

int main(int argc, char **argv)
{
    if (argc < 6) {
        fprintf(stderr, "usage: %s TARGET METHOD REQUEST_FILE INFLIGHT SECONDS\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[3], "rb");
    if (f == NULL) {
        perror(argv[3]);
        return 2;
    }
    static unsigned char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    int inflight = atoi(argv[4]);
    double secs = atof(argv[5]);
    grpc_init();
    grpc_channel_credentials *cr = grpc_insecure_credentials_create();
    ch = grpc_channel_create(argv[1], cr, NULL);
    grpc_channel_credentials_release(cr);
    cq = grpc_completion_queue_create_for_next(NULL);
    path = grpc_slice_from_copied_string(argv[2]);
    req = grpc_slice_from_copied_buffer((const char *)buf, n);
    call_t *calls = calloc((size_t)inflight, sizeof(call_t));
    long done = 0, errors = 0, warm = 0;
    for (int i = 0; i < inflight; i++)
        start(&calls[i]);
    double t0 = 0, end = now() + secs + 0.5; /* the first 0.5 s warm up */
    int timing = 0;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        call_t *c = ev.tag;
        if (c->status != GRPC_STATUS_OK && errors++ == 0)
            fprintf(stderr, "status %d: %.*s\n", (int)c->status, (int)GRPC_SLICE_LENGTH(c->details),
                    (const char *)GRPC_SLICE_START_PTR(c->details));
        finish(c);
        double t = now();
        if (!timing && t > end - secs) {
            timing = 1;
            t0 = t;
            warm = done;
        }
        done++;
        if (t >= end) {
            inflight--;
            if (inflight == 0) {
                double dt = t - t0;
                printf("calls %ld seconds %.3f rate %.1f errors %ld\n", done - warm, dt,
                       (double)(done - warm) / dt, errors);
                break;
            }
            continue;
        }
        start(c);
    }
    free(calls);
    grpc_slice_unref(path);
    grpc_slice_unref(req);
    grpc_channel_destroy(ch);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    grpc_shutdown_blocking();
    return 0;
}
