/*
 * comm.c - the collective backends by name (comm.h): which ones this build
 * has, the factory, and the stand-ins of those it was built without.
 */
#include <stdlib.h>
#include <string.h>

#include "comm.h"

#ifndef AMX_HAVE_GLOO
amx_status_t amx__comm_gloo_create(const amx_comm_params_t *p, amx_comm_t **out, amx_err_t *err)
{
    (void)p, (void)out;
    return amx_err_set(err, AMX_EUNAVAIL, "this amaxd was built without Gloo");
}
#endif

#ifndef AMX_HAVE_NCCL
amx_status_t amx__comm_nccl_create(const amx_comm_params_t *p, amx_comm_t **out, amx_err_t *err)
{
    (void)p, (void)out;
    return amx_err_set(err, AMX_EUNAVAIL,
                       "this amaxd was built without NCCL (build with -DAMAXD_CUDA=ON)");
}
#endif

int amx_comm_available(const char *name)
{
    if (strcmp(name, "local") == 0)
        return 1;
#ifdef AMX_HAVE_GLOO
    if (strcmp(name, "gloo") == 0)
        return 1;
#endif
#ifdef AMX_HAVE_NCCL
    if (strcmp(name, "nccl") == 0)
        return 1;
#endif
    return 0;
}

amx_status_t amx_comm_create(const char *name, const amx_comm_params_t *p, amx_comm_t **out,
                             amx_err_t *err)
{
    if (strcmp(name, "local") == 0)
        return amx__comm_local_create(p, out, err);
    if (strcmp(name, "gloo") == 0)
        return amx__comm_gloo_create(p, out, err);
    if (strcmp(name, "nccl") == 0)
        return amx__comm_nccl_create(p, out, err);
    return amx_err_set(err, AMX_EINVAL, "unknown collective backend '%s'", name);
}

const char *amx_comm_process_init(void)
{
#ifdef AMX_HAVE_NCCL
    const char *b = getenv("AMAXD_NCCL_BLOCKING");
    if (b != NULL && strcmp(b, "0") == 0)
        return "NCCL: all-reduces on the non-blocking communicator (AMAXD_NCCL_BLOCKING=0)";
    const char *rc = getenv("NCCL_RUNTIME_CONNECT");
    if (rc == NULL) {
        setenv("NCCL_RUNTIME_CONNECT", "0", 1);
        return "NCCL: all-reduces on a blocking child communicator; NCCL_RUNTIME_CONNECT=0 "
               "(connections made during the communicator's init)";
    }
    if (strcmp(rc, "0") != 0)
        return "NCCL: all-reduces on the non-blocking communicator (NCCL_RUNTIME_CONNECT is set "
               "by the environment: a blocking communicator could wait for a peer while it "
               "connects)";
    return "NCCL: all-reduces on a blocking child communicator";
#else
    return NULL;
#endif
}
