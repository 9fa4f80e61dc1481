#include "status.h"

#include <stdio.h>
#include <string.h>

static const char *const status_text[] = {
#define AMX__TEXT(name, grpc, text) text,
    AMX_STATUS_MAP(AMX__TEXT)
#undef AMX__TEXT
};

static const int status_grpc[] = {
#define AMX__GRPC(name, grpc, text) grpc,
    AMX_STATUS_MAP(AMX__GRPC)
#undef AMX__GRPC
};

const char *amx_strerror(amx_status_t st)
{
    if ((unsigned)st >= AMX__STATUS_MAX)
        return "unknown status";
    return status_text[st];
}

int amx_status_grpc(amx_status_t st)
{
    if ((unsigned)st >= AMX__STATUS_MAX)
        return 2; /* GRPC_STATUS_UNKNOWN */
    return status_grpc[st];
}

amx_status_t amx_err_set(amx_err_t *err, amx_status_t code, const char *fmt, ...)
{
    if (err == NULL || err->code != AMX_OK)
        return code;
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
    return code;
}

void amx_err_clear(amx_err_t *err)
{
    err->code = AMX_OK;
    err->msg[0] = '\0';
}

amx_status_t amx_status_from_grpc(int code)
{
    switch (code) {
    case 0:
        return AMX_OK;
    case 1:
        return AMX_ECANCELLED;
    case 3:
        return AMX_EINVAL;
    case 4:
        return AMX_ETIMEDOUT;
    case 5:
        return AMX_ENOTFOUND;
    case 6:
        return AMX_EEXIST;
    case 8:
        return AMX_ENOMEM;
    case 9:
        return AMX_EPRECOND;
    case 10:
        return AMX_EABORTED;
    case 11:
        return AMX_ERANGE;
    case 12:
        return AMX_EUNIMPL;
    case 14:
        return AMX_EUNAVAIL;
    case 16:
        return AMX_EAUTH;
    default:
        return AMX_EINTERNAL;
    }
}
