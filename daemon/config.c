#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "version.h"

typedef struct cfg_desc {
    const char *name;
    int type;
    const char *def;
    int64_t min, max;
    const char *values;
    int flags;
    const char *desc;
} cfg_desc_t;

static const cfg_desc_t table[AMX_CFG_COUNT] = {
#define AMX__CFG_DESC(name, type, def, min, max, values, flags, desc)                              \
    {#name, type, def, min, max, values, flags, desc},
    AMX_CONFIG_TABLE(AMX__CFG_DESC)
#undef AMX__CFG_DESC
};

static int find_entry(const char *name)
{
    char norm[64];
    size_t n = strlen(name);
    if (n >= sizeof(norm))
        return -1;
    for (size_t i = 0; i <= n; i++)
        norm[i] = name[i] == '-' ? '_' : (char)tolower((unsigned char)name[i]);
    for (int i = 0; i < AMX_CFG_COUNT; i++)
        if (strcmp(table[i].name, norm) == 0)
            return i;
    return -1;
}

static int enum_allows(const char *values, const char *v)
{
    size_t n = strlen(v);
    for (const char *p = values; *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0)
            return 1;
        p += len + (bar != NULL);
    }
    return 0;
}

/* Parses a value of entry i into *iv; EINVAL with a sentence when it does not fit. */
static amx_status_t parse_value(int i, const char *v, int64_t *iv, amx_err_t *err)
{
    const cfg_desc_t *d = &table[i];
    char *end;
    *iv = 0;
    switch (d->type) {
    case AMX_CFG_STR:
        return AMX_OK;
    case AMX_CFG_ENUM:
        if (!enum_allows(d->values, v))
            return amx_err_set(err, AMX_EINVAL, "config %s: '%s' is not one of %s", d->name, v,
                               d->values);
        return AMX_OK;
    case AMX_CFG_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "yes") || !strcmp(v, "on"))
            *iv = 1;
        else if (!strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "no") || !strcmp(v, "off"))
            *iv = 0;
        else
            return amx_err_set(err, AMX_EINVAL, "config %s: '%s' is not a boolean (true/false)",
                               d->name, v);
        return AMX_OK;
    case AMX_CFG_MODE:
    case AMX_CFG_INT: {
        errno = 0;
        long long x = strtoll(v, &end, d->type == AMX_CFG_MODE ? 8 : 10);
        if (errno != 0 || end == v || *end != '\0')
            return amx_err_set(err, AMX_EINVAL, "config %s: '%s' is not %s", d->name, v,
                               d->type == AMX_CFG_MODE ? "an octal mode" : "an integer");
        if (x < d->min || x > d->max)
            return amx_err_set(err, AMX_EINVAL, "config %s: %s is out of range [%lld, %lld]",
                               d->name, v, (long long)d->min, (long long)d->max);
        *iv = x;
        return AMX_OK;
    }
    }
    return amx_err_set(err, AMX_EINTERNAL, "config %s: unknown type", d->name);
}

static void apply_typed(amx_config_t *cfg, int i, int64_t iv)
{
    const char *t = cfg->text[i];
    switch (i) {
    case AMX_CFG_socket:
        cfg->socket = t;
        break;
    case AMX_CFG_tcp:
        cfg->tcp = t;
        break;
    case AMX_CFG_backend:
        cfg->backend = t;
        break;
    case AMX_CFG_log_level:
        cfg->log_level = t;
        break;
    case AMX_CFG_log_file:
        cfg->log_file = t;
        break;
    case AMX_CFG_shm_dir:
        cfg->shm_dir = t;
        break;
    case AMX_CFG_socket_mode:
        cfg->socket_mode = iv;
        break;
    case AMX_CFG_allow_remote:
        cfg->allow_remote = (int)iv;
        break;
    case AMX_CFG_metrics_listen:
        cfg->metrics_listen = t;
        break;
    case AMX_CFG_metrics_allow_remote:
        cfg->metrics_allow_remote = (int)iv;
        break;
    case AMX_CFG_max_connections:
        cfg->max_connections = iv;
        break;
    case AMX_CFG_max_connections_per_uid:
        cfg->max_connections_per_uid = iv;
        break;
    case AMX_CFG_socket_guard:
        cfg->socket_guard = (int)iv;
        break;
    case AMX_CFG_max_message_bytes:
        cfg->max_message_bytes = iv;
        break;
    case AMX_CFG_max_cells:
        cfg->max_cells = iv;
        break;
    case AMX_CFG_max_quantizers:
        cfg->max_quantizers = iv;
        break;
    case AMX_CFG_max_jobs:
        cfg->max_jobs = iv;
        break;
    case AMX_CFG_max_world_size:
        cfg->max_world_size = iv;
        break;
    case AMX_CFG_max_request_memory:
        cfg->max_request_memory = iv;
        break;
    case AMX_CFG_memory_budget:
        cfg->memory_budget = iv;
        break;
    case AMX_CFG_max_queued_bytes:
        cfg->max_queued_bytes = iv;
        break;
    case AMX_CFG_state_dir:
        cfg->state_dir = t;
        break;
    case AMX_CFG_snapshot_interval_ms:
        cfg->snapshot_interval_ms = iv;
        break;
    case AMX_CFG_job_idle_timeout_ms:
        cfg->job_idle_timeout_ms = iv;
        break;
    case AMX_CFG_join_timeout_ms:
        cfg->join_timeout_ms = iv;
        break;
    case AMX_CFG_reconcile_timeout_ms:
        cfg->reconcile_timeout_ms = iv;
        break;
    case AMX_CFG_shutdown_grace_ms:
        cfg->shutdown_grace_ms = iv;
        break;
    case AMX_CFG_cluster_size:
        cfg->cluster_size = iv;
        break;
    case AMX_CFG_cluster_rank:
        cfg->cluster_rank = iv;
        break;
    case AMX_CFG_peer_port:
        cfg->peer_port = iv;
        break;
    case AMX_CFG_coordinator_failover_ms:
        cfg->coordinator_failover_ms = iv;
        break;
    case AMX_CFG_cuda_device:
        cfg->cuda_device = iv;
        break;
    case AMX_CFG_coordinator:
        cfg->coordinator = t;
        break;
    case AMX_CFG_peer_listen:
        cfg->peer_listen = t;
        break;
    case AMX_CFG_peer_advertise:
        cfg->peer_advertise = t;
        break;
    case AMX_CFG_cluster_secret_file:
        cfg->cluster_secret_file = t;
        break;
    case AMX_CFG_peer_tls_cert:
        cfg->peer_tls_cert = t;
        break;
    case AMX_CFG_peer_tls_key:
        cfg->peer_tls_key = t;
        break;
    case AMX_CFG_peer_tls_ca:
        cfg->peer_tls_ca = t;
        break;
    case AMX_CFG_busy_poll:
        cfg->busy_poll = t;
        break;
    case AMX_CFG_collective:
        cfg->collective = t;
        break;
    case AMX_CFG_gloo_host:
        cfg->gloo_host = t;
        break;
    default:
        break;
    }
}

static amx_status_t set_index(amx_config_t *cfg, int i, const char *value, amx_err_t *err)
{
    int64_t iv;
    AMX_CHECK(parse_value(i, value, &iv, err));
    char *copy = strdup(value);
    if (copy == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    free(cfg->text[i]);
    cfg->text[i] = copy;
    apply_typed(cfg, i, iv);
    return AMX_OK;
}

void amx_config_init(amx_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    for (int i = 0; i < AMX_CFG_COUNT; i++) {
        amx_err_t err = {0};
        if (set_index(cfg, i, table[i].def, &err) != AMX_OK)
            abort(); /* a default that does not parse is a bug in the table */
    }
}

void amx_config_free(amx_config_t *cfg)
{
    for (int i = 0; i < AMX_CFG_COUNT; i++)
        free(cfg->text[i]);
    memset(cfg, 0, sizeof(*cfg));
}

amx_status_t amx_config_set(amx_config_t *cfg, const char *name, const char *value, amx_err_t *err)
{
    int i = find_entry(name);
    if (i < 0)
        return amx_err_set(err, AMX_EINVAL, "unknown config entry '%s' (see --help)", name);
    AMX_CHECK(set_index(cfg, i, value, err));
    cfg->set[i] = 1;
    return AMX_OK;
}

int amx_config_is_set(const amx_config_t *cfg, const char *name)
{
    int i = find_entry(name);
    return i >= 0 && cfg->set[i];
}

int amx_config_busy_poll(const amx_config_t *cfg)
{
    const char *v = cfg->busy_poll != NULL ? cfg->busy_poll : "auto";
    if (strcmp(v, "auto") == 0)
        return sysconf(_SC_NPROCESSORS_ONLN) >= 8;
    return strcmp(v, "on") == 0;
}

typedef struct ini_ctx {
    amx_config_t *cfg;
    amx_err_t *err;
    const char *path;
} ini_ctx_t;

static int cfg_ini_line(void *user, const char *section, const char *name, const char *value)
{
    ini_ctx_t *ctx = user;
    if (section[0] != '\0' && strcmp(section, "amaxd") != 0) {
        amx_err_set(ctx->err, AMX_EINVAL, "%s: unknown section [%s] (use [amaxd])", ctx->path,
                    section);
        return 0;
    }
    amx_err_t e = {0};
    if (amx_config_set(ctx->cfg, name, value, &e) != AMX_OK) {
        amx_err_set(ctx->err, e.code, "%s: %s", ctx->path, e.msg);
        return 0;
    }
    return 1;
}

amx_status_t amx_config_load_file(amx_config_t *cfg, const char *path, amx_err_t *err)
{
    ini_ctx_t ctx = {cfg, err, path};
    int rc = ini_parse(path, cfg_ini_line, &ctx);
    if (rc == -1)
        return amx_err_set(err, AMX_EIO, "cannot open config file %s: %s", path, strerror(errno));
    if (rc == -2)
        return amx_err_set(err, AMX_ENOMEM, "out of memory reading %s", path);
    if (rc > 0)
        return amx_err_set(err, AMX_EINVAL, "%s: line %d is not a valid 'name = value' line", path,
                           rc);
    return AMX_OK;
}

amx_status_t amx_config_load_env(amx_config_t *cfg, amx_err_t *err)
{
    for (int i = 0; i < AMX_CFG_COUNT; i++) {
        char var[80] = "AMAXD_";
        size_t n = strlen(var);
        for (const char *p = table[i].name; *p && n + 1 < sizeof(var); p++)
            var[n++] = (char)toupper((unsigned char)*p);
        var[n] = '\0';
        const char *v = getenv(var);
        if (v == NULL)
            continue;
        amx_err_t e = {0};
        if (set_index(cfg, i, v, &e) != AMX_OK)
            return amx_err_set(err, e.code, "environment %s: %s", var, e.msg);
        cfg->set[i] = 1;
    }
    return AMX_OK;
}

amx_status_t amx_config_from_args(amx_config_t *cfg, int argc, char **argv, int *action,
                                  amx_err_t *err)
{
    const char *file = getenv("AMAXD_CONFIG");
    *action = AMX_CFG_RUN;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            *action = AMX_CFG_HELP;
            return AMX_OK;
        }
        if (!strcmp(argv[i], "-V") || !strcmp(argv[i], "--version")) {
            *action = AMX_CFG_VERSION;
            return AMX_OK;
        }
        if (!strcmp(argv[i], "-c") || !strcmp(argv[i], "--config")) {
            if (i + 1 >= argc)
                return amx_err_set(err, AMX_EINVAL, "%s needs a file name", argv[i]);
            file = argv[++i];
        } else if (!strncmp(argv[i], "--config=", 9)) {
            file = argv[i] + 9;
        }
    }
    if (file != NULL && file[0] != '\0')
        AMX_CHECK(amx_config_load_file(cfg, file, err));
    AMX_CHECK(amx_config_load_env(cfg, err));
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-c") || !strcmp(a, "--config")) {
            i++;
            continue;
        }
        if (!strncmp(a, "--config=", 9))
            continue;
        if (strncmp(a, "--", 2) != 0)
            return amx_err_set(err, AMX_EINVAL, "unexpected argument '%s' (see --help)", a);
        char name[64];
        const char *eq = strchr(a + 2, '=');
        const char *value;
        size_t len = eq ? (size_t)(eq - (a + 2)) : strlen(a + 2);
        if (len >= sizeof(name))
            return amx_err_set(err, AMX_EINVAL, "unknown option '%s' (see --help)", a);
        memcpy(name, a + 2, len);
        name[len] = '\0';
        int idx = find_entry(name);
        if (idx < 0)
            return amx_err_set(err, AMX_EINVAL, "unknown option '--%s' (see --help)", name);
        if (eq != NULL) {
            value = eq + 1;
        } else if (table[idx].type == AMX_CFG_BOOL) {
            value = "true";
        } else {
            if (i + 1 >= argc)
                return amx_err_set(err, AMX_EINVAL, "option --%s needs a value", name);
            value = argv[++i];
        }
        amx_err_t e = {0};
        if (set_index(cfg, idx, value, &e) != AMX_OK)
            return amx_err_set(err, e.code, "option --%s: %s", name, e.msg);
        cfg->set[idx] = 1;
    }
    return AMX_OK;
}

void amx_config_usage(FILE *out, const char *prog)
{
    fprintf(out,
            "Usage: %s [--config FILE] [--NAME=VALUE ...]\n"
            "amaxd %s: reconciles quantizer amax across a training job and serves scales.\n\n"
            "  -c, --config FILE   read NAME = VALUE lines from FILE (also $AMAXD_CONFIG)\n"
            "  -h, --help          show this help and exit\n"
            "  -V, --version       show the version and exit\n\n"
            "Settings (also AMAXD_<NAME> in the environment; command line wins):\n",
            prog, AMAXD_VERSION);
    for (int i = 0; i < AMX_CFG_COUNT; i++) {
        const cfg_desc_t *d = &table[i];
        fprintf(out, "  --%s=%s\n      %s", d->name,
                d->type == AMX_CFG_ENUM   ? d->values
                : d->type == AMX_CFG_BOOL ? "true|false"
                : d->type == AMX_CFG_STR  ? "TEXT"
                                          : "N",
                d->desc);
        fprintf(out, " [default: %s]", d->def[0] ? d->def : "\"\"");
        if (d->type == AMX_CFG_INT)
            fprintf(out, " [%lld..%lld]", (long long)d->min, (long long)d->max);
        fprintf(out, "\n");
    }
}

void amx_config_foreach(const amx_config_t *cfg,
                        void (*fn)(void *ud, const char *name, const char *value, int is_default),
                        void *ud)
{
    for (int i = 0; i < AMX_CFG_COUNT; i++) {
        const char *v = (table[i].flags & AMX_CFG_SECRET) ? "(secret)" : cfg->text[i];
        fn(ud, table[i].name, v, strcmp(cfg->text[i], table[i].def) == 0);
    }
}
