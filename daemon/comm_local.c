/* comm_local.c - the collective of a single daemon: nothing to exchange. */
#include <stdlib.h>

#include "comm.h"

static amx_status_t local_allreduce_max(amx_comm_t *c, float *buf, size_t n, int on_device,
                                        amx_err_t *err)
{
    (void)c, (void)buf, (void)n, (void)on_device, (void)err;
    return AMX_OK;
}

static void local_destroy(amx_comm_t *c)
{
    free(c);
}

amx_comm_t *amx_comm_local_create(void)
{
    static const amx_comm_t proto = {"local", local_allreduce_max, local_destroy, 1, 0};
    amx_comm_t *c = malloc(sizeof(*c));
    if (c != NULL)
        *c = proto;
    return c;
}
