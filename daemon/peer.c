/*
 * peer.c - the cluster: identity, secret and authentication, the peer
 * service's handlers, and calls to other daemons (peer.h).
 */
#include "peer.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <inttypes.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "amaxd/peer/v1/peer.pb-c.h"
#include "clock.h"
#include "log.h"
#include "rpc.h"
#include "service.h"

#define AUTH_KEY "x-amaxd-auth"
#define AUTH_SKEW_S 300
#define FETCH_CHUNK (4u << 20)
#define SVC "/amaxd.peer.v1.Peer/"

typedef struct chan {
    char addr[256];
    grpc_channel *ch;
} chan_t;

struct amx_peer {
    uv_loop_t *loop;
    const amx_config_t *cfg;
    amx_cluster_id_t id;
    uint8_t secret[4096];
    size_t slen;
    amx_coord_t *coord;
    amx_registry_t *reg;
    amx_rpc_t *rpc;
    pthread_mutex_t ch_mu;
    chan_t *chans;
    size_t nchans, cap_chans;
    char *tls_cert, *tls_key, *tls_ca;
};

/* ======================= identity ======================= */

static const char *env_or_null(const char *(*env)(const char *), const char *name)
{
    const char *v = env(name);
    return v != NULL && v[0] != '\0' ? v : NULL;
}

static int parse_u32(const char *s, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end != '\0' || v > 0xffffffffUL)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

/* Splits "host:port" (or "[v6]:port"); host may be empty. */
static int split_hostport(const char *hp, char *host, size_t hlen, uint32_t *port)
{
    const char *colon = strrchr(hp, ':');
    if (colon == NULL)
        return -1;
    size_t n = (size_t)(colon - hp);
    if (n >= hlen)
        return -1;
    memcpy(host, hp, n);
    host[n] = '\0';
    if (parse_u32(colon + 1, port) != 0 || *port == 0 || *port > 65535)
        return -1;
    return 0;
}

amx_status_t amx_slurm_first_host(const char *list, char *out, size_t len, amx_err_t *err)
{
    /* The first top-level item: commas inside brackets do not split. */
    size_t k = 0;
    int depth = 0;
    const char *p = list;
    for (; *p; p++) {
        if (*p == ',' && depth == 0)
            break;
        if (*p == '[') {
            if (depth++ != 0)
                goto bad;
            /* The first number (or range start) of the group. */
            const char *q = p + 1;
            while (isdigit((unsigned char)*q)) {
                if (k + 1 >= len)
                    goto bad;
                out[k++] = *q++;
            }
            if (q == p + 1 || (*q != '-' && *q != ',' && *q != ']'))
                goto bad;
            while (*q && *q != ']')
                q++;
            if (*q != ']')
                goto bad;
            depth = 0;
            p = q;
            continue;
        }
        if (*p == ']')
            goto bad;
        if (k + 1 >= len)
            goto bad;
        out[k++] = *p;
    }
    if (k == 0)
        goto bad;
    out[k] = '\0';
    return AMX_OK;
bad:
    return amx_err_set(err, AMX_EINVAL, "cannot read the first host of the Slurm node list '%s'",
                       list);
}

amx_status_t amx_cluster_resolve(const amx_config_t *cfg, const char *(*env)(const char *),
                                 amx_cluster_id_t *id, amx_err_t *err)
{
    memset(id, 0, sizeof(*id));
    uint32_t rank = (uint32_t)cfg->cluster_rank, size = (uint32_t)cfg->cluster_size;
    char coord[256] = "";
    uint32_t port = (uint32_t)cfg->peer_port;
    const char *src = "default";
    const char *s_id = env_or_null(env, "SLURM_NODEID"), *s_nn = env_or_null(env, "SLURM_NNODES");
    const char *s_list = env_or_null(env, "SLURM_JOB_NODELIST");
    if (s_list == NULL)
        s_list = env_or_null(env, "SLURM_NODELIST");
    const char *t_rank = env_or_null(env, "RANK"), *t_ws = env_or_null(env, "WORLD_SIZE");
    const char *t_addr = env_or_null(env, "MASTER_ADDR"), *t_port = env_or_null(env, "MASTER_PORT");
    int set_rank = amx_config_is_set(cfg, "cluster_rank"),
        set_size = amx_config_is_set(cfg, "cluster_size");
    if (s_id != NULL && s_nn != NULL) {
        uint32_t r, n;
        if (parse_u32(s_id, &r) != 0 || parse_u32(s_nn, &n) != 0)
            return amx_err_set(err, AMX_EINVAL, "SLURM_NODEID=%s / SLURM_NNODES=%s are not numbers",
                               s_id, s_nn);
        if (!set_rank)
            rank = r;
        if (!set_size)
            size = n;
        if (s_list != NULL) {
            char host[200];
            AMX_CHECK(amx_slurm_first_host(s_list, host, sizeof(host), err));
            snprintf(coord, sizeof(coord), "%s:%u", host, port);
        }
        src = "slurm";
    } else if (t_rank != NULL && t_ws != NULL) {
        uint32_t r, n;
        if (parse_u32(t_rank, &r) != 0 || parse_u32(t_ws, &n) != 0)
            return amx_err_set(err, AMX_EINVAL, "RANK=%s / WORLD_SIZE=%s are not numbers", t_rank,
                               t_ws);
        if (!set_rank)
            rank = r;
        if (!set_size)
            size = n;
        if (t_addr != NULL) {
            uint32_t p2 = port;
            if (t_port != NULL && parse_u32(t_port, &p2) != 0)
                return amx_err_set(err, AMX_EINVAL, "MASTER_PORT=%s is not a port", t_port);
            snprintf(coord, sizeof(coord), "%s:%u", t_addr, p2);
        }
        src = "torchrun";
    }
    if (set_rank || set_size)
        src = "config";
    if (cfg->coordinator[0] != '\0')
        snprintf(coord, sizeof(coord), "%s", cfg->coordinator);
    if (size == 0 || size > 65536)
        return amx_err_set(err, AMX_EINVAL, "cluster_size %u must be in [1, 65536]", size);
    if (rank >= size)
        return amx_err_set(err, AMX_EINVAL,
                           "cluster_rank %u is out of range for cluster_size %u (from %s)", rank,
                           size, src);
    id->rank = rank;
    id->size = size;
    snprintf(id->source, sizeof(id->source), "%s", src);
    if (getrandom(&id->incarnation, sizeof(id->incarnation), 0) != sizeof(id->incarnation))
        id->incarnation = ((uint64_t)getpid() << 32) ^ amx_now_us();
    if (id->incarnation == 0)
        id->incarnation = 1;
    if (size == 1)
        return AMX_OK;
    /* Several daemons: the peer service. */
    char host[200];
    uint32_t cport = port;
    if (coord[0] == '\0')
        return amx_err_set(err, AMX_EINVAL,
                           "cluster_size is %u but no coordinator address is known: set "
                           "coordinator=HOST:PORT (or run under Slurm / with MASTER_ADDR)",
                           size);
    if (split_hostport(coord, host, sizeof(host), &cport) != 0 || host[0] == '\0')
        return amx_err_set(err, AMX_EINVAL, "coordinator '%s' is not HOST:PORT", coord);
    snprintf(id->coordinator, sizeof(id->coordinator), "%s", coord);
    if (cfg->peer_listen[0] != '\0') {
        uint32_t lp;
        char lh[200];
        if (split_hostport(cfg->peer_listen, lh, sizeof(lh), &lp) != 0)
            return amx_err_set(err, AMX_EINVAL, "peer_listen '%s' is not HOST:PORT",
                               cfg->peer_listen);
        snprintf(id->listen, sizeof(id->listen), "%s", cfg->peer_listen);
    } else {
        uint32_t lp = amx_config_is_set(cfg, "peer_port") ? port : cport;
        snprintf(id->listen, sizeof(id->listen), "0.0.0.0:%u", lp);
    }
    if (cfg->peer_advertise[0] != '\0') {
        uint32_t ap;
        char ah[200];
        if (split_hostport(cfg->peer_advertise, ah, sizeof(ah), &ap) != 0 || ah[0] == '\0')
            return amx_err_set(err, AMX_EINVAL, "peer_advertise '%s' is not HOST:PORT",
                               cfg->peer_advertise);
        snprintf(id->advertise, sizeof(id->advertise), "%s", cfg->peer_advertise);
    } else {
        char lh[200];
        uint32_t lp;
        split_hostport(id->listen, lh, sizeof(lh), &lp);
        if (lh[0] == '\0' || strcmp(lh, "0.0.0.0") == 0 || strcmp(lh, "[::]") == 0) {
            if (gethostname(lh, sizeof(lh)) != 0)
                snprintf(lh, sizeof(lh), "localhost");
            lh[sizeof(lh) - 1] = '\0';
        }
        snprintf(id->advertise, sizeof(id->advertise), "%s:%u", lh, lp);
    }
    if (cfg->cluster_secret_file[0] == '\0')
        return amx_err_set(err, AMX_EINVAL,
                           "cluster_size is %u: set cluster_secret_file to a file holding the "
                           "cluster's shared secret (the same on every daemon)",
                           size);
    return AMX_OK;
}

amx_status_t amx_cluster_load_secret(const char *path, uint8_t *buf, size_t cap, size_t *len,
                                     amx_err_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return amx_err_set(err, AMX_EIO, "cannot read cluster_secret_file %s: %s", path,
                           strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return amx_err_set(err, AMX_EINVAL, "cluster_secret_file %s is not a regular file", path);
    }
    if ((st.st_mode & 077) != 0) {
        close(fd);
        return amx_err_set(err, AMX_EINVAL,
                           "cluster_secret_file %s is readable by others (mode %04o): chmod 600 it",
                           path, (unsigned)(st.st_mode & 07777));
    }
    ssize_t n = read(fd, buf, cap);
    close(fd);
    if (n < 0)
        return amx_err_set(err, AMX_EIO, "cannot read cluster_secret_file %s: %s", path,
                           strerror(errno));
    if ((size_t)n == cap)
        return amx_err_set(err, AMX_EINVAL, "cluster_secret_file %s is longer than %zu bytes", path,
                           cap - 1);
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r'))
        n--;
    if (n < 16)
        return amx_err_set(err, AMX_EINVAL,
                           "cluster_secret_file %s holds %zd bytes; use at least 16 (e.g. head -c "
                           "32 /dev/urandom | base64 > FILE)",
                           path, n);
    *len = (size_t)n;
    return AMX_OK;
}

/* ======================= authentication ======================= */

static void hmac_hex(const uint8_t *secret, size_t slen, const char *msg, char *hex)
{
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int mlen = 0;
    HMAC(EVP_sha256(), secret, (int)slen, (const unsigned char *)msg, strlen(msg), mac, &mlen);
    for (unsigned i = 0; i < mlen; i++)
        sprintf(hex + 2 * i, "%02x", mac[i]);
    hex[2 * mlen] = '\0';
}

void amx_auth_token(const uint8_t *secret, size_t slen, const char *method, long long now,
                    char *out, size_t len)
{
    char msg[512], hex[2 * EVP_MAX_MD_SIZE + 1];
    snprintf(msg, sizeof(msg), "%lld:%s", now, method);
    hmac_hex(secret, slen, msg, hex);
    snprintf(out, len, "%lld:%s", now, hex);
}

int amx_auth_check(const uint8_t *secret, size_t slen, const char *method, long long now,
                   const char *token, size_t tlen, const char **why)
{
    char tok[160];
    if (tlen == 0 || tlen >= sizeof(tok)) {
        *why = "malformed token";
        return -1;
    }
    memcpy(tok, token, tlen);
    tok[tlen] = '\0';
    char *colon = strchr(tok, ':');
    if (colon == NULL) {
        *why = "malformed token";
        return -1;
    }
    *colon = '\0';
    char *end;
    long long ts = strtoll(tok, &end, 10);
    if (*end != '\0' || end == tok) {
        *why = "malformed token";
        return -1;
    }
    if (ts < now - AUTH_SKEW_S || ts > now + AUTH_SKEW_S) {
        *why = "token time is more than 5 minutes off (are the clocks synchronized?)";
        return -1;
    }
    char expect[160];
    amx_auth_token(secret, slen, method, ts, expect, sizeof(expect));
    *colon = ':';
    if (strlen(expect) != tlen || CRYPTO_memcmp(expect, tok, tlen) != 0) {
        *why = "wrong token (another cluster secret?)";
        return -1;
    }
    return 0;
}

static void token_for(const amx_peer_t *p, const char *method, char *out, size_t len)
{
    amx_auth_token(p->secret, p->slen, method, (long long)time(NULL), out, len);
}

/* ======================= the object ======================= */

static char *slurp(const char *path, amx_err_t *err)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        amx_err_set(err, AMX_EIO, "cannot read %s: %s", path, strerror(errno));
        return NULL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 8192;
            char *q = realloc(buf, cap);
            if (q == NULL) {
                free(buf);
                fclose(f);
                amx_err_set(err, AMX_ENOMEM, "out of memory reading %s", path);
                return NULL;
            }
            buf = q;
        }
        size_t n = fread(buf + len, 1, 4096, f);
        len += n;
        if (n < 4096)
            break;
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

static void on_restart_notify(void *ud, const char *job, const amx_membership_t *m,
                              uint32_t restarted, uint64_t gen);

amx_status_t amx_peer_create(uv_loop_t *loop, const amx_config_t *cfg, const amx_cluster_id_t *id,
                             amx_peer_t **out, amx_err_t *err)
{
    amx_peer_t *p = calloc(1, sizeof(*p));
    if (p == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    p->loop = loop;
    p->cfg = cfg;
    p->id = *id;
    pthread_mutex_init(&p->ch_mu, NULL);
    if (id->size > 1) {
        amx_status_t st = amx_cluster_load_secret(cfg->cluster_secret_file, p->secret,
                                                  sizeof(p->secret), &p->slen, err);
        int ntls =
            (cfg->peer_tls_cert[0] != 0) + (cfg->peer_tls_key[0] != 0) + (cfg->peer_tls_ca[0] != 0);
        if (st == AMX_OK && ntls != 0 && ntls != 3)
            st = amx_err_set(err, AMX_EINVAL,
                             "TLS between daemons needs all of peer_tls_cert, peer_tls_key and "
                             "peer_tls_ca");
        if (st == AMX_OK && ntls == 3 &&
            ((p->tls_cert = slurp(cfg->peer_tls_cert, err)) == NULL ||
             (p->tls_key = slurp(cfg->peer_tls_key, err)) == NULL ||
             (p->tls_ca = slurp(cfg->peer_tls_ca, err)) == NULL))
            st = err->code;
        if (st != AMX_OK) {
            amx_peer_destroy(p);
            return st;
        }
    }
    if (id->rank == 0) {
        p->coord = amx_coord_create(id->incarnation, (uint64_t)cfg->join_timeout_ms);
        if (p->coord == NULL) {
            amx_peer_destroy(p);
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        }
        amx_coord_set_notify(p->coord, on_restart_notify, p);
    }
    *out = p;
    return AMX_OK;
}

void amx_peer_attach(amx_peer_t *p, amx_registry_t *reg, amx_rpc_t *rpc)
{
    p->reg = reg;
    p->rpc = rpc;
}

void amx_peer_shutdown(amx_peer_t *p)
{
    if (p->coord != NULL) {
        amx_coord_destroy(p->coord);
        p->coord = amx_coord_create(p->id.incarnation, (uint64_t)p->cfg->join_timeout_ms);
    }
}

void amx_peer_destroy(amx_peer_t *p)
{
    if (p == NULL)
        return;
    amx_coord_destroy(p->coord);
    for (size_t i = 0; i < p->nchans; i++)
        grpc_channel_destroy(p->chans[i].ch);
    free(p->chans);
    pthread_mutex_destroy(&p->ch_mu);
    free(p->tls_cert);
    free(p->tls_key);
    free(p->tls_ca);
    OPENSSL_cleanse(p->secret, sizeof(p->secret));
    free(p);
}

const amx_cluster_id_t *amx_peer_id(const amx_peer_t *p)
{
    return &p->id;
}

amx_coord_t *amx_peer_coord(amx_peer_t *p)
{
    return p->coord;
}

void amx_peer_tick(amx_peer_t *p, uint64_t now_ms)
{
    if (p->coord != NULL)
        amx_coord_expire(p->coord, now_ms);
}

amx_status_t amx_peer_server_credentials(amx_peer_t *p, grpc_server_credentials **out,
                                         amx_err_t *err)
{
    if (p->tls_cert == NULL) {
        *out = grpc_insecure_server_credentials_create();
        return AMX_OK;
    }
    grpc_ssl_pem_key_cert_pair pair = {p->tls_key, p->tls_cert};
    *out = grpc_ssl_server_credentials_create_ex(
        p->tls_ca, &pair, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, NULL);
    if (*out == NULL)
        return amx_err_set(err, AMX_EINVAL, "the peer TLS certificate or key could not be used");
    return AMX_OK;
}

/* A channel to `addr`, shared by every thread. */
static grpc_channel *channel_to(amx_peer_t *p, const char *addr)
{
    pthread_mutex_lock(&p->ch_mu);
    for (size_t i = 0; i < p->nchans; i++)
        if (strcmp(p->chans[i].addr, addr) == 0) {
            grpc_channel *ch = p->chans[i].ch;
            pthread_mutex_unlock(&p->ch_mu);
            return ch;
        }
    if (p->nchans == p->cap_chans) {
        size_t cap = p->cap_chans ? p->cap_chans * 2 : 8;
        chan_t *c = realloc(p->chans, cap * sizeof(*c));
        if (c == NULL) {
            pthread_mutex_unlock(&p->ch_mu);
            return NULL;
        }
        p->chans = c;
        p->cap_chans = cap;
    }
    grpc_arg args[3];
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = -1;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = -1;
    /* A peer that restarted should be found again quickly. */
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = GRPC_ARG_MAX_RECONNECT_BACKOFF_MS;
    args[2].value.integer = 1000;
    grpc_channel_args cargs = {3, args};
    grpc_channel_credentials *creds;
    if (p->tls_cert != NULL) {
        grpc_ssl_pem_key_cert_pair pair = {p->tls_key, p->tls_cert};
        creds = grpc_ssl_credentials_create(p->tls_ca, &pair, NULL, NULL);
    } else {
        creds = grpc_insecure_credentials_create();
    }
    grpc_channel *ch = grpc_channel_create(addr, creds, &cargs);
    grpc_channel_credentials_release(creds);
    snprintf(p->chans[p->nchans].addr, sizeof(p->chans[p->nchans].addr), "%s", addr);
    p->chans[p->nchans++].ch = ch;
    pthread_mutex_unlock(&p->ch_mu);
    return ch;
}

/* ======================= message mapping ======================= */

static void spec_to_pb(const amx_qspec_t *s, Amaxd__V1__QuantizerSpec *q, Amaxd__V1__Recipe *r)
{
    amaxd__v1__quantizer_spec__init(q);
    amaxd__v1__recipe__init(r);
    q->name = s->name;
    q->n_global_shape = s->ndim;
    q->global_shape = (uint32_t *)s->shape;
    r->format = s->recipe.format;
    r->rule = s->recipe.rule;
    r->margin = s->recipe.margin;
    r->history_len = s->recipe.history_len;
    r->history_reduce = s->recipe.history_reduce;
    r->eps = s->recipe.eps;
    r->power_of_2 = s->recipe.power_of_2;
    r->nvfp4_convention = s->recipe.nvfp4_convention;
    r->output_convention = s->recipe.output_convention;
    r->history_convention = s->recipe.history_convention;
    r->mxfp8_convention = s->recipe.mxfp8_convention;
    q->recipe = r;
    q->accumulation = s->accumulation;
    q->peer_group = s->peer_group;
    q->scale_group = s->scale_group;
    q->peer_mode = (Amaxd__V1__PeerMode)s->peer_mode;
    q->global_axes = s->global_axes;
}

/* A spec from a peer, validated like a trainer's (borrowed strings). */
static amx_status_t spec_from_pb(const Amaxd__V1__QuantizerSpec *q, amx_qspec_t *s, amx_err_t *err)
{
    amx_qspec_in_t in;
    memset(&in, 0, sizeof(in));
    in.name = q->name;
    in.global_shape = q->global_shape;
    in.ndim = q->n_global_shape;
    if (q->recipe != NULL) {
        in.recipe.present = 1;
        in.recipe.format = q->recipe->format;
        in.recipe.rule = q->recipe->rule;
        in.recipe.margin = q->recipe->margin;
        in.recipe.history_len = q->recipe->history_len;
        in.recipe.history_reduce = q->recipe->history_reduce;
        in.recipe.eps = q->recipe->eps;
        in.recipe.power_of_2 = q->recipe->power_of_2;
        in.recipe.nvfp4_convention = q->recipe->nvfp4_convention;
        in.recipe.output_convention = q->recipe->output_convention;
        in.recipe.history_convention = q->recipe->history_convention;
        in.recipe.mxfp8_convention = q->recipe->mxfp8_convention;
    }
    in.accumulation = q->accumulation;
    in.peer_group = q->peer_group;
    in.scale_group = q->scale_group;
    in.peer_mode = q->peer_mode;
    in.global_axes = q->global_axes;
    return amx_qspec_parse(&in, UINT64_MAX, s, err);
}

static amx_status_t members_to_pb(const amx_membership_t *m, Amaxd__Peer__V1__Participant ***out,
                                  size_t *n, amx_arena_t *a)
{
    Amaxd__Peer__V1__Participant **v = amx_arena_alloc(a, (m->npart + 1) * sizeof(*v));
    if (v == NULL)
        return AMX_ENOMEM;
    for (uint32_t i = 0; i < m->npart; i++) {
        Amaxd__Peer__V1__Participant *x = amx_arena_alloc(a, sizeof(*x));
        if (x == NULL)
            return AMX_ENOMEM;
        amaxd__peer__v1__participant__init(x);
        x->daemon = m->part[i].daemon;
        x->incarnation = m->part[i].incarnation;
        x->address = (char *)m->part[i].addr;
        x->n_ranks = m->part[i].nranks;
        x->ranks = m->part[i].ranks;
        v[i] = x;
    }
    *out = v;
    *n = m->npart;
    return AMX_OK;
}

static amx_status_t members_from_pb(Amaxd__Peer__V1__Participant **v, size_t n, uint32_t world,
                                    amx_membership_t *m)
{
    memset(m, 0, sizeof(*m));
    m->world = world;
    m->part = calloc(n ? n : 1, sizeof(amx_part_t));
    if (m->part == NULL)
        return AMX_ENOMEM;
    for (size_t i = 0; i < n; i++) {
        amx_part_t *x = &m->part[i];
        x->daemon = v[i]->daemon;
        x->incarnation = v[i]->incarnation;
        snprintf(x->addr, sizeof(x->addr), "%s", v[i]->address);
        x->ranks = malloc((v[i]->n_ranks ? v[i]->n_ranks : 1) * 4);
        m->npart = (uint32_t)i + 1;
        if (x->ranks == NULL) {
            amx_membership_free(m);
            return AMX_ENOMEM;
        }
        if (v[i]->n_ranks > 0)
            memcpy(x->ranks, v[i]->ranks, v[i]->n_ranks * 4);
        x->nranks = (uint32_t)v[i]->n_ranks;
    }
    return AMX_OK;
}

/* Serializes a message with malloc; NULL when out of memory. */
static uint8_t *pack(const ProtobufCMessage *m, size_t *len)
{
    *len = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(*len ? *len : 1);
    if (b != NULL)
        protobuf_c_message_pack(m, b);
    return b;
}

/* ======================= server side ======================= */

static int authed(amx_svc_t *svc, amx_call_t *c)
{
    amx_peer_t *p = svc->peer;
    size_t len = 0;
    const char *tok = amx__call_metadata(c, AUTH_KEY, &len);
    const char *why = "no " AUTH_KEY " metadata";
    if (tok != NULL && amx_auth_check(p->secret, p->slen, amx__call_method(c),
                                      (long long)time(NULL), tok, len, &why) == 0)
        return 1;
    char who[128];
    amx__call_peer(c, who, sizeof(who));
    AMX_WARN("peer",
             "refused %s from %s: %s (every daemon of a cluster needs the same "
             "cluster_secret_file)",
             amx__call_method(c), who, why);
    amx__call_reply(c, AMX_EAUTH,
                    "refused: this call does not carry a valid token of the cluster's secret",
                    NULL);
    return 0;
}

static int need_coord(amx_svc_t *svc, amx_call_t *c)
{
    if (svc->peer->coord != NULL)
        return 1;
    char msg[200];
    snprintf(msg, sizeof(msg), "daemon %u is not the coordinator (cluster rank 0)",
             svc->peer->id.rank);
    AMX_WARN("peer", "%s rejected: %s", amx__call_method(c), msg);
    amx__call_reply(c, AMX_EPRECOND, msg, NULL);
    return 0;
}

static void reply_err(amx_call_t *c, amx_status_t st, const char *msg)
{
    AMX_WARN("peer", "%s rejected (%s): %s", amx__call_method(c), amx_strerror(st), msg);
    amx__call_reply(c, st, msg, NULL);
}

static uint64_t deadline_in(uint32_t timeout_ms)
{
    return amx_now_ms() + (timeout_ms ? timeout_ms : 30000);
}

/* -- Join -- */

static void join_cancelled(amx_waiter_t *w)
{
    amx_call_t *c = amx__waiter_call(w);
    amx_svc_t *svc = w->job;
    if (w->ext != NULL && svc->peer->coord != NULL)
        amx_coord_cancel(svc->peer->coord, w->ext);
    w->ext = NULL;
    w->job = NULL;
    (void)c;
}

static void on_coord_join(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    amx_call_t *c = ud;
    amx_waiter_t *w = amx__call_waiter(c);
    w->on_cancel = NULL;
    w->ext = NULL;
    w->job = NULL;
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__Peer__V1__JoinResponse r = AMAXD__PEER__V1__JOIN_RESPONSE__INIT;
    amx_arena_t a = {0};
    if (members_to_pb(m, &r.participants, &r.n_participants, &a) != AMX_OK) {
        amx__call_reply(c, AMX_ENOMEM, "out of memory", NULL);
    } else {
        r.rejoined = m->rejoined;
        r.coordinator_incarnation = m->coord_inc;
        r.world_size = m->world;
        amx__call_reply(c, AMX_OK, NULL, &r.base);
    }
    amx_arena_free(&a);
}

static void h_join(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__JoinRequest *q = (const void *)m;
    if (!amx_valid_job_name(q->job) || q->daemon >= svc->peer->id.size) {
        reply_err(c, AMX_EINVAL, "Join names an invalid job or daemon");
        return;
    }
    amx_coord_join_req_t req = {
        q->job,         q->world_size, q->rank,     q->daemon,
        q->incarnation, q->address,    q->announce, deadline_in(q->timeout_ms)};
    amx_waiter_t *w = amx__call_waiter(c);
    w->job = svc;
    w->on_cancel = join_cancelled;
    amx_creq_t *h = NULL;
    amx_err_t err = {0};
    if (amx_coord_join(svc->peer->coord, &req, on_coord_join, c, &h, &err) != AMX_OK) {
        w->on_cancel = NULL;
        w->job = NULL;
        reply_err(c, err.code, err.msg);
        return;
    }
    if (w->on_cancel != NULL)
        w->ext = h;
}

/* -- Sync -- */

static void on_coord_sync(void *ud, amx_status_t st, const char *msg,
                          const amx_coord_sync_ans_t *ans)
{
    amx_call_t *c = ud;
    amx_waiter_t *w = amx__call_waiter(c);
    uint64_t caller_hash = w->aux; /* the caller's catalog hash (h_sync) */
    w->on_cancel = NULL;
    w->ext = NULL;
    w->job = NULL;
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__Peer__V1__SyncResponse r = AMAXD__PEER__V1__SYNC_RESPONSE__INIT;
    if (ans->send_catalog) {
        r.send_catalog = 1;
        r.coordinator_incarnation = ans->coord_inc;
        amx__call_reply(c, AMX_OK, NULL, &r.base);
        return;
    }
    amx_arena_t a = {0};
    r.seq = ans->seq;
    r.catalog_hash = ans->catalog_hash;
    int ok = 1;
    if (caller_hash != ans->catalog_hash) {
        r.catalog_included = 1;
        r.n_catalog = ans->catalog->n;
        r.catalog = amx_arena_alloc(&a, (ans->catalog->n + 1) * sizeof(*r.catalog));
        ok = r.catalog != NULL;
        for (uint32_t i = 0; ok && i < ans->catalog->n; i++) {
            Amaxd__V1__QuantizerSpec *q = amx_arena_alloc(&a, sizeof(*q));
            Amaxd__V1__Recipe *rc = amx_arena_alloc(&a, sizeof(*rc));
            ok = q != NULL && rc != NULL;
            if (ok) {
                spec_to_pb(ans->catalog->q[i], q, rc);
                r.catalog[i] = q;
            }
        }
    }
    r.n_rejected = ans->nrejected;
    r.rejected = ans->rejected;
    r.conflict = (char *)(ans->conflict ? ans->conflict : "");
    r.n_resets = ans->nresets;
    r.resets = ans->resets;
    r.target_epoch = ans->target_epoch;
    r.donor = ans->donor;
    r.n_behind = ans->nbehind;
    r.behind = (uint32_t *)ans->behind;
    r.comm_generation = ans->comm_gen;
    r.new_comm = ans->new_comm;
    r.coordinator_incarnation = ans->coord_inc;
    if (ok)
        ok = members_to_pb(ans->members, &r.participants, &r.n_participants, &a) == AMX_OK;
    if (ok)
        amx__call_reply(c, AMX_OK, NULL, &r.base);
    else
        amx__call_reply(c, AMX_ENOMEM, "out of memory answering an agreement", NULL);
    amx_arena_free(&a);
}

static void sync_cancelled(amx_waiter_t *w)
{
    amx_svc_t *svc = w->job;
    if (w->ext != NULL && svc->peer->coord != NULL)
        amx_coord_cancel(svc->peer->coord, w->ext);
    w->ext = NULL;
    w->job = NULL;
}

static void h_sync(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__SyncRequest *q = (const void *)m;
    amx_err_t err = {0};
    if (!amx_valid_job_name(q->job) || q->daemon >= svc->peer->id.size) {
        reply_err(c, AMX_EINVAL, "Sync names an invalid job or daemon");
        return;
    }
    amx_qspec_t *specs = calloc(q->n_proposals ? q->n_proposals : 1, sizeof(*specs));
    amx_qspec_t **ptrs = calloc(q->n_proposals ? q->n_proposals : 1, sizeof(*ptrs));
    if (specs == NULL || ptrs == NULL) {
        free(specs);
        free(ptrs);
        reply_err(c, AMX_ENOMEM, "out of memory");
        return;
    }
    for (size_t i = 0; i < q->n_proposals; i++) {
        if (spec_from_pb(q->proposals[i], &specs[i], &err) != AMX_OK) {
            free(specs);
            free(ptrs);
            reply_err(c, AMX_EINVAL, err.msg);
            return;
        }
        ptrs[i] = &specs[i];
    }
    amx_coord_sync_req_t req = {
        .job = q->job,
        .daemon = q->daemon,
        .incarnation = q->incarnation,
        .last_reconciled = q->last_reconciled,
        .catalog_hash = q->catalog_hash,
        .proposals = ptrs,
        .nprop = q->n_proposals,
        .full_catalog = q->full_catalog,
        .resets = q->resets,
        .nresets = q->n_resets,
        .need_comm = q->need_comm,
        .world = q->world_size,
        .ranks = q->ranks,
        .nranks = (uint32_t)q->n_ranks,
        .addr = q->address,
        .deadline_ms = deadline_in(q->timeout_ms),
    };
    amx_waiter_t *w = amx__call_waiter(c);
    w->job = svc;
    w->on_cancel = sync_cancelled;
    w->aux = q->catalog_hash; /* the answer includes the catalog when it differs */
    amx_creq_t *h = NULL;
    amx_status_t st = amx_coord_sync(svc->peer->coord, &req, on_coord_sync, c, &h, &err);
    free(specs);
    free(ptrs);
    if (st != AMX_OK) {
        w->on_cancel = NULL;
        w->job = NULL;
        reply_err(c, err.code, err.msg);
        return;
    }
    if (w->on_cancel != NULL)
        w->ext = h;
}

/* -- KV -- */

static void h_kvset(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__KvSetRequest *q = (const void *)m;
    amx_coord_kv_set(svc->peer->coord, q->key, q->value.data, q->value.len);
    Amaxd__Peer__V1__KvSetResponse r = AMAXD__PEER__V1__KV_SET_RESPONSE__INIT;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void on_coord_kv(void *ud, amx_status_t st, const char *msg, const void *val, size_t len)
{
    amx_call_t *c = ud;
    amx_waiter_t *w = amx__call_waiter(c);
    w->on_cancel = NULL;
    w->ext = NULL;
    w->job = NULL;
    if (st != AMX_OK) {
        amx__call_reply(c, st, msg, NULL);
        return;
    }
    Amaxd__Peer__V1__KvGetResponse r = AMAXD__PEER__V1__KV_GET_RESPONSE__INIT;
    r.value.data = (uint8_t *)val;
    r.value.len = len;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void h_kvget(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c) || !need_coord(svc, c))
        return;
    const Amaxd__Peer__V1__KvGetRequest *q = (const void *)m;
    amx_waiter_t *w = amx__call_waiter(c);
    w->job = svc;
    w->on_cancel = sync_cancelled; /* the same: cancel the coordinator request */
    amx_creq_t *h = NULL;
    amx_err_t err = {0};
    if (amx_coord_kv_get(svc->peer->coord, q->key, deadline_in(q->timeout_ms), on_coord_kv, c, &h,
                         &err) != AMX_OK) {
        w->on_cancel = NULL;
        w->job = NULL;
        reply_err(c, err.code, err.msg);
        return;
    }
    if (w->on_cancel != NULL)
        w->ext = h;
}

/* -- FetchState, Abort, Progress, Drop -- */

static void h_fetch(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__FetchStateRequest *q = (const void *)m;
    uint32_t max = q->max_bytes == 0 || q->max_bytes > FETCH_CHUNK ? FETCH_CHUNK : q->max_bytes;
    void *data = NULL;
    size_t len = 0;
    uint64_t total = 0;
    amx_err_t err = {0};
    if (amx_registry_fetch_state(svc->reg, q->job, q->seq, q->offset, max, &data, &len, &total,
                                 &err) != AMX_OK) {
        amx__call_reply(c, err.code, err.msg, NULL); /* "not ready" is routine: no log line */
        return;
    }
    Amaxd__Peer__V1__FetchStateResponse r = AMAXD__PEER__V1__FETCH_STATE_RESPONSE__INIT;
    r.total = total;
    r.data.data = data;
    r.data.len = len;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
    free(data);
}

static void h_abort(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__AbortRequest *q = (const void *)m;
    amx_registry_peer_abort(svc->reg, q->job, q->comm_generation, q->from,
                            amx_status_from_grpc((int)q->code), q->reason);
    Amaxd__Peer__V1__AbortResponse r = AMAXD__PEER__V1__ABORT_RESPONSE__INIT;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void h_progress(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__ProgressRequest *q = (const void *)m;
    uint32_t missing[64], n = 0;
    uint64_t open = 0, last = 0;
    int in_flight = 0;
    amx_err_t err = {0};
    if (amx_registry_progress(svc->reg, q->job, q->epoch, missing, 64, &n, &open, &last, &in_flight,
                              &err) != AMX_OK) {
        amx__call_reply(c, err.code, err.msg, NULL);
        return;
    }
    Amaxd__Peer__V1__ProgressResponse r = AMAXD__PEER__V1__PROGRESS_RESPONSE__INIT;
    r.epoch = open;
    r.last_reconciled = last;
    r.missing = missing;
    r.n_missing = n;
    r.in_flight = in_flight;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

static void fan_out_drop(amx_peer_t *p, const char *job, const amx_membership_t *m, uint32_t skip);

static void h_drop(amx_svc_t *svc, amx_call_t *c, const ProtobufCMessage *m)
{
    if (!authed(svc, c))
        return;
    const Amaxd__Peer__V1__DropRequest *q = (const void *)m;
    amx_peer_t *p = svc->peer;
    if (p->coord != NULL) {
        amx_membership_t mem;
        if (amx_coord_drop(p->coord, q->job, &mem) == AMX_OK) {
            AMX_INFO("peer", "job %s dropped at the request of daemon %u", q->job, q->from);
            fan_out_drop(p, q->job, &mem, q->from);
            amx_membership_free(&mem);
        }
    }
    if (q->from != p->id.rank)
        amx_registry_peer_drop(svc->reg, q->job, q->from);
    Amaxd__Peer__V1__DropResponse r = AMAXD__PEER__V1__DROP_RESPONSE__INIT;
    amx__call_reply(c, AMX_OK, NULL, &r.base);
}

const amx_method_t amx__peer_methods[] = {
    {SVC "Join", &amaxd__peer__v1__join_request__descriptor, h_join, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "Sync", &amaxd__peer__v1__sync_request__descriptor, h_sync, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "KvSet", &amaxd__peer__v1__kv_set_request__descriptor, h_kvset, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "KvGet", &amaxd__peer__v1__kv_get_request__descriptor, h_kvget, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "FetchState", &amaxd__peer__v1__fetch_state_request__descriptor, h_fetch, 0,
     AMX_SERVER_PEER, NULL, NULL},
    {SVC "Abort", &amaxd__peer__v1__abort_request__descriptor, h_abort, 0, AMX_SERVER_PEER, NULL,
     NULL},
    {SVC "Progress", &amaxd__peer__v1__progress_request__descriptor, h_progress, 0, AMX_SERVER_PEER,
     NULL, NULL},
    {SVC "Drop", &amaxd__peer__v1__drop_request__descriptor, h_drop, 0, AMX_SERVER_PEER, NULL,
     NULL},
};
const size_t amx__n_peer_methods = sizeof(amx__peer_methods) / sizeof(amx__peer_methods[0]);

/* ======================= loop thread: asynchronous calls ======================= */

/* How much earlier than a member's own deadline the coordinator times out
 * a Join it forwards (at most a tenth of the whole). */
#define JOIN_MARGIN_MS 500

typedef struct join_op {
    amx_peer_t *p;
    amx_peer_join_cb cb;
    void *ud;
    amx_creq_t *creq;  /* local coordinator */
    amx_ccall_t *call; /* remote */
    int done;
    uint64_t started_ms, deadline_ms; /* remote: when the Join was sent, and its deadline */
} join_op_t;

static void on_local_join(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    join_op_t *op = ud;
    op->done = 1;
    op->creq = NULL;
    op->cb(op->ud, st, msg, m);
    free(op);
}

static void on_remote_join(void *ud, amx_status_t st, const char *msg, const uint8_t *data,
                           size_t len)
{
    join_op_t *op = ud;
    char buf[1200];
    if (st != AMX_OK) {
        if (st == AMX_ETIMEDOUT && amx_now_ms() + 50 >= op->deadline_ms) {
            /* Our own deadline, not the coordinator's answer (which comes
             * JOIN_MARGIN_MS earlier): it is stopped, hung or overloaded. */
            snprintf(buf, sizeof(buf),
                     "the coordinator %s did not answer this Join within %llu ms (is its daemon "
                     "running and not stopped? a Join it times out names the ranks that never "
                     "joined)",
                     op->p->id.coordinator, (unsigned long long)(op->deadline_ms - op->started_ms));
            msg = buf;
        } else if (st == AMX_EUNAVAIL || st == AMX_EINTERNAL) {
            snprintf(buf, sizeof(buf), "the coordinator %s could not be reached: %s",
                     op->p->id.coordinator, msg);
            msg = buf;
            st = AMX_EUNAVAIL;
        } else if (st == AMX_EAUTH) {
            snprintf(buf, sizeof(buf),
                     "the coordinator %s refused this daemon (%s): every daemon of a cluster "
                     "needs the same cluster_secret_file",
                     op->p->id.coordinator, msg);
            msg = buf;
        }
        op->cb(op->ud, st, msg, NULL);
        free(op);
        return;
    }
    Amaxd__Peer__V1__JoinResponse *r = amaxd__peer__v1__join_response__unpack(NULL, len, data);
    amx_membership_t m;
    if (r == NULL ||
        members_from_pb(r->participants, r->n_participants, r->world_size, &m) != AMX_OK) {
        op->cb(op->ud, AMX_EINTERNAL, "the coordinator's Join answer could not be read", NULL);
    } else {
        m.rejoined = r->rejoined;
        m.coord_inc = r->coordinator_incarnation;
        op->cb(op->ud, AMX_OK, NULL, &m);
        amx_membership_free(&m);
    }
    if (r != NULL)
        amaxd__peer__v1__join_response__free_unpacked(r, NULL);
    free(op);
}

amx_status_t amx_peer_join(amx_peer_t *p, const char *job, uint32_t world, uint32_t rank,
                           uint64_t deadline_ms, amx_peer_join_cb cb, void *ud, void **h,
                           amx_err_t *err)
{
    *h = NULL;
    join_op_t *op = calloc(1, sizeof(*op));
    if (op == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    op->p = p;
    op->cb = cb;
    op->ud = ud;
    if (p->coord != NULL) {
        amx_coord_join_req_t req = {
            job, world, rank, p->id.rank, p->id.incarnation, p->id.advertise, 0, deadline_ms};
        amx_creq_t *cr = NULL;
        amx_status_t st = amx_coord_join(p->coord, &req, on_local_join, op, &cr, err);
        if (st != AMX_OK) {
            free(op);
            return st;
        }
        if (cr != NULL) {
            op->creq = cr;
            *h = op;
        }
        return AMX_OK;
    }
    Amaxd__Peer__V1__JoinRequest q = AMAXD__PEER__V1__JOIN_REQUEST__INIT;
    q.job = (char *)job;
    q.world_size = world;
    q.rank = rank;
    q.daemon = p->id.rank;
    q.incarnation = p->id.incarnation;
    q.address = p->id.advertise;
    /* The coordinator answers a Join that times out (naming the ranks
     * that never joined) a little before our own deadline, which then
     * only fires when the coordinator does not answer at all: either way
     * the trainer hears within its join_timeout_ms. */
    uint64_t now = amx_now_ms();
    uint64_t left = deadline_ms > now ? deadline_ms - now : 1;
    uint64_t margin = left / 10 < JOIN_MARGIN_MS ? left / 10 : JOIN_MARGIN_MS;
    q.timeout_ms = (uint32_t)(left - margin > 0 ? left - margin : 1);
    op->started_ms = now;
    op->deadline_ms = deadline_ms;
    size_t len;
    uint8_t *buf = pack(&q.base, &len);
    grpc_channel *ch = channel_to(p, p->id.coordinator);
    if (buf == NULL || ch == NULL) {
        free(buf);
        free(op);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    char tok[160];
    token_for(p, SVC "Join", tok, sizeof(tok));
    amx_status_t st = amx_rpc_call(p->rpc, ch, SVC "Join", buf, len, AUTH_KEY, tok, deadline_ms,
                                   on_remote_join, op, &op->call, err);
    free(buf);
    if (st != AMX_OK) {
        free(op);
        return st;
    }
    *h = op;
    return AMX_OK;
}

void amx_peer_join_cancel(amx_peer_t *p, void *h)
{
    join_op_t *op = h;
    if (op == NULL)
        return;
    if (op->creq != NULL)
        amx_coord_cancel(p->coord, op->creq);
    else if (op->call != NULL)
        amx_rpc_call_cancel(p->rpc, op->call); /* the callback is not called: free here */
    free(op);
}

static void ignore_answer(void *ud, amx_status_t st, const char *msg, const uint8_t *d, size_t n)
{
    char *what = ud;
    if (st != AMX_OK)
        AMX_DEBUG("peer", "%s: %s", what, msg);
    free(what);
}

/* Sends `req` to every daemon of `m` but `skip1` and `skip2`, not waiting. */
static void fan_out(amx_peer_t *p, const amx_membership_t *m, uint32_t skip1, uint32_t skip2,
                    const char *method, const ProtobufCMessage *req)
{
    size_t len;
    uint8_t *buf = pack(req, &len);
    if (buf == NULL || p->rpc == NULL) {
        free(buf);
        return;
    }
    char tok[160];
    token_for(p, method, tok, sizeof(tok));
    for (uint32_t i = 0; i < m->npart; i++) {
        const amx_part_t *x = &m->part[i];
        if (x->daemon == skip1 || x->daemon == skip2)
            continue;
        grpc_channel *ch = channel_to(p, x->addr);
        char *what = malloc(300);
        if (ch == NULL || what == NULL) {
            free(what);
            continue;
        }
        snprintf(what, 300, "%s to daemon %u (%s)", method, x->daemon, x->addr);
        amx_err_t err = {0};
        if (amx_rpc_call(p->rpc, ch, method, buf, len, AUTH_KEY, tok, amx_now_ms() + 2000,
                         ignore_answer, what, NULL, &err) != AMX_OK)
            free(what);
    }
    free(buf);
}

static void on_restart_notify(void *ud, const char *job, const amx_membership_t *m,
                              uint32_t restarted, uint64_t gen)
{
    amx_peer_t *p = ud;
    char reason[160];
    snprintf(reason, sizeof(reason), "daemon %u restarted", restarted);
    Amaxd__Peer__V1__AbortRequest q = AMAXD__PEER__V1__ABORT_REQUEST__INIT;
    q.job = (char *)job;
    q.comm_generation = gen;
    q.from = p->id.rank;
    q.reason = reason;
    fan_out(p, m, p->id.rank, restarted, SVC "Abort", &q.base);
    for (uint32_t i = 0; i < m->npart; i++)
        if (m->part[i].daemon == p->id.rank && p->reg != NULL)
            amx_registry_peer_abort(p->reg, job, gen, p->id.rank, AMX_EABORTED, reason);
}

static void fan_out_drop(amx_peer_t *p, const char *job, const amx_membership_t *m, uint32_t skip)
{
    Amaxd__Peer__V1__DropRequest q = AMAXD__PEER__V1__DROP_REQUEST__INIT;
    q.job = (char *)job;
    q.from = skip;
    fan_out(p, m, p->id.rank, skip, SVC "Drop", &q.base);
}

void amx_peer_drop(amx_peer_t *p, const char *job)
{
    if (p->id.size <= 1)
        return;
    if (p->coord != NULL) {
        amx_membership_t mem;
        if (amx_coord_drop(p->coord, job, &mem) == AMX_OK) {
            fan_out_drop(p, job, &mem, p->id.rank);
            amx_membership_free(&mem);
        }
        return;
    }
    Amaxd__Peer__V1__DropRequest q = AMAXD__PEER__V1__DROP_REQUEST__INIT;
    q.job = (char *)job;
    q.from = p->id.rank;
    amx_membership_t only = {0};
    amx_part_t coord = {0};
    coord.daemon = 0;
    snprintf(coord.addr, sizeof(coord.addr), "%s", p->id.coordinator);
    only.npart = 1;
    only.part = &coord;
    fan_out(p, &only, p->id.rank, p->id.rank, SVC "Drop", &q.base);
}

/* ======================= engine threads: blocking calls ======================= */

typedef struct bcall {
    grpc_call *call;
    grpc_metadata md;
    grpc_byte_buffer *send_buf, *recv_buf;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    int done;
} bcall_t;

static int bcall_start(amx_peer_t *p, grpc_completion_queue *cq, bcall_t *b, const char *addr,
                       const char *method, const uint8_t *req, size_t len, uint64_t deadline)
{
    memset(b, 0, sizeof(*b));
    b->details = grpc_empty_slice();
    grpc_metadata_array_init(&b->init_md);
    grpc_metadata_array_init(&b->trail_md);
    grpc_channel *ch = channel_to(p, addr);
    if (ch == NULL)
        return -1;
    char tok[160];
    token_for(p, method, tok, sizeof(tok));
    b->md.key = grpc_slice_from_static_string(AUTH_KEY);
    b->md.value = grpc_slice_from_copied_string(tok);
    b->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                       grpc_slice_from_static_string(method), NULL,
                                       amx_rpc_deadline(deadline), NULL);
    if (b->call == NULL)
        return -1;
    grpc_slice s = grpc_slice_from_copied_buffer((const char *)req, len);
    b->send_buf = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = 1;
    ops[0].data.send_initial_metadata.metadata = &b->md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = b->send_buf;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &b->init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &b->recv_buf;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &b->trail_md;
    ops[5].data.recv_status_on_client.status = &b->status;
    ops[5].data.recv_status_on_client.status_details = &b->details;
    return grpc_call_start_batch(b->call, ops, 6, b, NULL) == GRPC_CALL_OK ? 0 : -1;
}

static void bcall_free(bcall_t *b)
{
    if (b->send_buf)
        grpc_byte_buffer_destroy(b->send_buf);
    if (b->recv_buf)
        grpc_byte_buffer_destroy(b->recv_buf);
    grpc_metadata_array_destroy(&b->init_md);
    grpc_metadata_array_destroy(&b->trail_md);
    grpc_slice_unref(b->details);
    grpc_slice_unref(b->md.value);
    if (b->call)
        grpc_call_unref(b->call);
}

/* The outcome of a finished call; the answer's bytes into *out (malloc). */
static amx_status_t bcall_result(bcall_t *b, uint8_t **out, size_t *len, char *msg, size_t mlen)
{
    amx_status_t st = amx_status_from_grpc((int)b->status);
    snprintf(msg, mlen, "%.*s", (int)GRPC_SLICE_LENGTH(b->details),
             (const char *)GRPC_SLICE_START_PTR(b->details));
    if (st != AMX_OK || out == NULL)
        return st;
    *out = NULL;
    *len = 0;
    if (b->recv_buf == NULL) {
        snprintf(msg, mlen, "the answer carried no message");
        return AMX_EINTERNAL;
    }
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, b->recv_buf)) {
        snprintf(msg, mlen, "the answer could not be read");
        return AMX_EINTERNAL;
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    *len = GRPC_SLICE_LENGTH(s);
    *out = malloc(*len ? *len : 1);
    if (*out == NULL) {
        grpc_slice_unref(s);
        snprintf(msg, mlen, "out of memory");
        return AMX_ENOMEM;
    }
    if (*len > 0)
        memcpy(*out, GRPC_SLICE_START_PTR(s), *len);
    grpc_slice_unref(s);
    return AMX_OK;
}

/* One blocking call: polls every 50 ms for `abort`. */
static amx_status_t call_one(amx_peer_t *p, const char *addr, const char *method,
                             const ProtobufCMessage *req, uint64_t deadline,
                             const volatile int *abort, uint8_t **out, size_t *olen, amx_err_t *err)
{
    size_t len;
    uint8_t *buf = pack(req, &len);
    if (buf == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    bcall_t b;
    int started = bcall_start(p, cq, &b, addr, method, buf, len, deadline) == 0;
    free(buf);
    int cancelled = 0;
    while (started) {
        gpr_timespec slice = amx_rpc_deadline(amx_now_ms() + 50);
        grpc_event ev = grpc_completion_queue_pluck(cq, &b, slice, NULL);
        if (ev.type == GRPC_OP_COMPLETE)
            break;
        if (!cancelled && abort != NULL && *abort) {
            grpc_call_cancel(b.call, NULL);
            cancelled = 1;
        }
    }
    amx_status_t st;
    char msg[700];
    if (!started) {
        st = amx_err_set(err, AMX_EINTERNAL, "cannot start %s to %s", method, addr);
    } else if (cancelled) {
        st = amx_err_set(err, AMX_EABORTED, "%s to %s was abandoned (the epoch was aborted)",
                         method, addr);
    } else {
        st = bcall_result(&b, out, olen, msg, sizeof(msg));
        if (st != AMX_OK)
            amx_err_set(err, st, "%s", msg);
    }
    bcall_free(&b);
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_past(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    return st;
}

void amx_sync_result_free(amx_sync_result_t *r)
{
    for (uint32_t i = 0; i < r->ncatalog; i++)
        amx_qspec_free(r->catalog[i]);
    free(r->catalog);
    for (size_t i = 0; i < r->nrejected; i++)
        free(r->rejected[i]);
    free(r->rejected);
    free(r->conflict);
    for (size_t i = 0; i < r->nresets; i++)
        free(r->resets[i]);
    free(r->resets);
    free(r->behind);
    amx_membership_free(&r->members);
    memset(r, 0, sizeof(*r));
}

static char **dup_strs(char **v, size_t n)
{
    char **out = calloc(n ? n : 1, sizeof(char *));
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++)
        if ((out[i] = strdup(v[i])) == NULL) {
            for (size_t k = 0; k < i; k++)
                free(out[k]);
            free(out);
            return NULL;
        }
    return out;
}

amx_status_t amx_peer_call_sync(amx_peer_t *p, const amx_coord_sync_req_t *req,
                                const volatile int *abort, amx_sync_result_t *res, amx_err_t *err)
{
    memset(res, 0, sizeof(*res));
    Amaxd__Peer__V1__SyncRequest q = AMAXD__PEER__V1__SYNC_REQUEST__INIT;
    amx_arena_t a = {0};
    q.job = (char *)req->job;
    q.daemon = req->daemon;
    q.incarnation = req->incarnation;
    q.last_reconciled = req->last_reconciled;
    q.catalog_hash = req->catalog_hash;
    q.full_catalog = req->full_catalog;
    q.n_resets = req->nresets;
    q.resets = req->resets;
    q.need_comm = req->need_comm;
    uint64_t now = amx_now_ms();
    q.timeout_ms = req->deadline_ms > now ? (uint32_t)(req->deadline_ms - now) : 1;
    q.world_size = req->world;
    q.n_ranks = req->nranks;
    q.ranks = (uint32_t *)req->ranks;
    q.address = (char *)req->addr;
    q.n_proposals = req->nprop;
    q.proposals = amx_arena_alloc(&a, (req->nprop + 1) * sizeof(*q.proposals));
    if (q.proposals == NULL) {
        amx_arena_free(&a);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < req->nprop; i++) {
        Amaxd__V1__QuantizerSpec *s = amx_arena_alloc(&a, sizeof(*s));
        Amaxd__V1__Recipe *r = amx_arena_alloc(&a, sizeof(*r));
        if (s == NULL || r == NULL) {
            amx_arena_free(&a);
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        }
        spec_to_pb(req->proposals[i], s, r);
        q.proposals[i] = s;
    }
    uint8_t *out = NULL;
    size_t olen = 0;
    amx_status_t st = call_one(p, p->id.coordinator, SVC "Sync", &q.base, req->deadline_ms + 1000,
                               abort, &out, &olen, err);
    amx_arena_free(&a);
    if (st != AMX_OK)
        return st;
    Amaxd__Peer__V1__SyncResponse *r = amaxd__peer__v1__sync_response__unpack(NULL, olen, out);
    free(out);
    if (r == NULL)
        return amx_err_set(err, AMX_EINTERNAL,
                           "the coordinator's agreement answer could not be "
                           "read");
    res->coord_inc = r->coordinator_incarnation;
    if (r->send_catalog) {
        res->send_catalog = 1;
        amaxd__peer__v1__sync_response__free_unpacked(r, NULL);
        return AMX_OK;
    }
    res->seq = r->seq;
    res->catalog_hash = r->catalog_hash;
    res->target_epoch = r->target_epoch;
    res->comm_gen = r->comm_generation;
    res->coord_inc = r->coordinator_incarnation;
    res->new_comm = r->new_comm;
    res->catalog_included = r->catalog_included;
    res->donor = r->donor;
    st = AMX_ENOMEM;
    res->catalog = calloc(r->n_catalog ? r->n_catalog : 1, sizeof(amx_qspec_t *));
    if (res->catalog == NULL)
        goto fail;
    for (size_t i = 0; i < r->n_catalog; i++) {
        amx_qspec_t s;
        amx_err_t e2 = {0};
        if (spec_from_pb(r->catalog[i], &s, &e2) != AMX_OK) {
            st = amx_err_set(err, AMX_EINTERNAL, "the coordinator sent a bad spec: %s", e2.msg);
            goto fail;
        }
        if ((res->catalog[res->ncatalog] = amx_qspec_dup(&s)) == NULL)
            goto fail;
        res->ncatalog++;
    }
    res->rejected = dup_strs(r->rejected, r->n_rejected);
    res->resets = dup_strs(r->resets, r->n_resets);
    res->behind = malloc((r->n_behind ? r->n_behind : 1) * sizeof(uint32_t));
    if (res->rejected == NULL || res->resets == NULL || res->behind == NULL)
        goto fail;
    res->nrejected = r->n_rejected;
    res->nresets = r->n_resets;
    if (r->n_behind > 0)
        memcpy(res->behind, r->behind, r->n_behind * sizeof(uint32_t));
    res->nbehind = r->n_behind;
    if (r->conflict[0] != '\0' && (res->conflict = strdup(r->conflict)) == NULL)
        goto fail;
    if (members_from_pb(r->participants, r->n_participants, req->world, &res->members) != AMX_OK)
        goto fail;
    res->members.coord_inc = r->coordinator_incarnation;
    amaxd__peer__v1__sync_response__free_unpacked(r, NULL);
    return AMX_OK;
fail:
    amaxd__peer__v1__sync_response__free_unpacked(r, NULL);
    amx_sync_result_free(res);
    if (st == AMX_ENOMEM)
        amx_err_set(err, AMX_ENOMEM, "out of memory reading an agreement");
    return st;
}

/* -- the rendezvous store -- */

typedef struct kv_ctx {
    amx_peer_t *p;
    const volatile int *abort;
} kv_ctx_t;

static amx_status_t kv_set(void *ud, const char *key, const void *val, size_t len, amx_err_t *err)
{
    kv_ctx_t *k = ud;
    Amaxd__Peer__V1__KvSetRequest q = AMAXD__PEER__V1__KV_SET_REQUEST__INIT;
    q.key = (char *)key;
    q.value.data = (uint8_t *)val;
    q.value.len = len;
    uint8_t *out = NULL;
    size_t olen;
    amx_status_t st = call_one(k->p, k->p->id.coordinator, SVC "KvSet", &q.base,
                               amx_now_ms() + 10000, k->abort, &out, &olen, err);
    free(out);
    return st;
}

static amx_status_t kv_get(void *ud, const char *key, uint64_t deadline, void **val, size_t *len,
                           amx_err_t *err)
{
    kv_ctx_t *k = ud;
    Amaxd__Peer__V1__KvGetRequest q = AMAXD__PEER__V1__KV_GET_REQUEST__INIT;
    q.key = (char *)key;
    uint64_t now = amx_now_ms();
    q.timeout_ms = deadline > now ? (uint32_t)(deadline - now) : 1;
    uint8_t *out = NULL;
    size_t olen = 0;
    amx_status_t st = call_one(k->p, k->p->id.coordinator, SVC "KvGet", &q.base, deadline + 1000,
                               k->abort, &out, &olen, err);
    if (st != AMX_OK)
        return st;
    Amaxd__Peer__V1__KvGetResponse *r = amaxd__peer__v1__kv_get_response__unpack(NULL, olen, out);
    free(out);
    if (r == NULL)
        return amx_err_set(err, AMX_EINTERNAL, "a KvGet answer could not be read");
    *val = malloc(r->value.len ? r->value.len : 1);
    if (*val == NULL) {
        amaxd__peer__v1__kv_get_response__free_unpacked(r, NULL);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    if (r->value.len > 0)
        memcpy(*val, r->value.data, r->value.len);
    *len = r->value.len;
    amaxd__peer__v1__kv_get_response__free_unpacked(r, NULL);
    return AMX_OK;
}

/* The store is only used during one comm creation on one engine thread:
 * its context lives in thread-local storage for as long as that takes. */
static _Thread_local kv_ctx_t tls_kv;

void amx_peer_kv(amx_peer_t *p, const volatile int *abort, amx_kv_t *kv)
{
    tls_kv.p = p;
    tls_kv.abort = abort;
    kv->ud = &tls_kv;
    kv->set = kv_set;
    kv->get = kv_get;
}

/* -- state transfer -- */

amx_status_t amx_peer_call_fetch(amx_peer_t *p, const char *addr, const char *job, uint64_t seq,
                                 uint64_t deadline_ms, const volatile int *abort, void **blob,
                                 size_t *len, amx_err_t *err)
{
    uint8_t *buf = NULL;
    uint64_t total = UINT64_MAX, have = 0;
    while (have < total) {
        Amaxd__Peer__V1__FetchStateRequest q = AMAXD__PEER__V1__FETCH_STATE_REQUEST__INIT;
        q.job = (char *)job;
        q.seq = seq;
        q.offset = have;
        q.max_bytes = FETCH_CHUNK;
        uint8_t *out = NULL;
        size_t olen = 0;
        amx_err_t e2 = {0};
        amx_status_t st =
            call_one(p, addr, SVC "FetchState", &q.base, deadline_ms, abort, &out, &olen, &e2);
        if (st == AMX_EUNAVAIL && have == 0 && amx_now_ms() < deadline_ms && !(abort && *abort)) {
            /* The donor is still writing its state: try again shortly. */
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        if (st != AMX_OK) {
            free(buf);
            return amx_err_set(err, st, "%s", e2.msg);
        }
        Amaxd__Peer__V1__FetchStateResponse *r =
            amaxd__peer__v1__fetch_state_response__unpack(NULL, olen, out);
        free(out);
        if (r == NULL || (total != UINT64_MAX && r->total != total) ||
            r->data.len > r->total - have || (r->data.len == 0 && have < r->total)) {
            if (r)
                amaxd__peer__v1__fetch_state_response__free_unpacked(r, NULL);
            free(buf);
            return amx_err_set(err, AMX_EINTERNAL, "the donor's state answer is inconsistent");
        }
        if (buf == NULL) {
            total = r->total;
            buf = malloc(total ? total : 1);
            if (buf == NULL) {
                amaxd__peer__v1__fetch_state_response__free_unpacked(r, NULL);
                return amx_err_set(err, AMX_ENOMEM, "out of memory for %llu bytes of state",
                                   (unsigned long long)total);
            }
        }
        if (r->data.len > 0)
            memcpy(buf + have, r->data.data, r->data.len);
        have += r->data.len;
        amaxd__peer__v1__fetch_state_response__free_unpacked(r, NULL);
    }
    *blob = buf;
    *len = (size_t)total;
    return AMX_OK;
}

/* -- parallel calls to every other participant -- */

typedef struct multi {
    bcall_t b;
    uint32_t daemon;
    const char *addr;
    int started;
} multi_t;

/* Calls `method` on every participant but `me` with `req`; waits up to
 * timeout_ms in all; fills results in m[] (done set when finished). */
static multi_t *call_all(amx_peer_t *p, const amx_membership_t *m, int me, const char *method,
                         const ProtobufCMessage *req, uint64_t timeout_ms, size_t *n)
{
    size_t len;
    uint8_t *buf = pack(req, &len);
    multi_t *v = calloc(m->npart ? m->npart : 1, sizeof(*v));
    if (buf == NULL || v == NULL) {
        free(buf);
        free(v);
        return NULL;
    }
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    uint64_t deadline = amx_now_ms() + timeout_ms;
    size_t pending = 0;
    for (uint32_t i = 0; i < m->npart; i++) {
        v[i].daemon = m->part[i].daemon;
        v[i].addr = m->part[i].addr;
        if ((int)i == me)
            continue;
        v[i].started =
            bcall_start(p, cq, &v[i].b, m->part[i].addr, method, buf, len, deadline) == 0;
        pending += v[i].started;
    }
    free(buf);
    while (pending > 0) {
        grpc_event ev = grpc_completion_queue_next(cq, amx_rpc_deadline(deadline + 1000), NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            break;
        ((bcall_t *)ev.tag)->done = 1;
        pending--;
    }
    for (uint32_t i = 0; i < m->npart; i++)
        if (v[i].started && !v[i].b.done)
            grpc_call_cancel(v[i].b.call, NULL);
    while (pending > 0) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE)
            break;
        pending--;
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    *n = m->npart;
    return v;
}

static void free_all(multi_t *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (v[i].started)
            bcall_free(&v[i].b);
    free(v);
}

void amx_peer_call_progress(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                            uint64_t epoch, uint64_t timeout_ms, char *buf, size_t len)
{
    Amaxd__Peer__V1__ProgressRequest q = AMAXD__PEER__V1__PROGRESS_REQUEST__INIT;
    q.job = (char *)job;
    q.epoch = epoch;
    size_t n = 0, k = 0;
    buf[0] = '\0';
    multi_t *v = call_all(p, m, me, SVC "Progress", &q.base, timeout_ms, &n);
    if (v == NULL)
        return;
    for (size_t i = 0; i < n && k < len; i++) {
        if (!v[i].started)
            continue;
        char msg[300];
        uint8_t *out = NULL;
        size_t olen = 0;
        amx_status_t st =
            v[i].b.done ? bcall_result(&v[i].b, &out, &olen, msg, sizeof(msg)) : AMX_ETIMEDOUT;
        if (st != AMX_OK) {
            k += (size_t)snprintf(buf + k, len - k, "%sdaemon %u (%s) did not answer (%s)",
                                  k ? "; " : "", v[i].daemon, v[i].addr,
                                  st == AMX_ETIMEDOUT ? "no answer in time" : msg);
            free(out);
            continue;
        }
        Amaxd__Peer__V1__ProgressResponse *r =
            amaxd__peer__v1__progress_response__unpack(NULL, olen, out);
        free(out);
        if (r == NULL)
            continue;
        if (r->n_missing > 0) {
            char ranks[200];
            amx_fmt_ranks(ranks, sizeof(ranks), r->missing, (uint32_t)r->n_missing);
            k += (size_t)snprintf(buf + k, len - k,
                                  "%strainer rank%s %s on daemon %u (%s) did not enter Reconcile "
                                  "of epoch %llu",
                                  k ? "; " : "", r->n_missing > 1 ? "s" : "", ranks, v[i].daemon,
                                  v[i].addr, (unsigned long long)epoch);
        } else if (r->epoch != epoch && !r->in_flight) {
            k += (size_t)snprintf(buf + k, len - k, "%sdaemon %u (%s) is at epoch %llu",
                                  k ? "; " : "", v[i].daemon, v[i].addr,
                                  (unsigned long long)r->epoch);
        }
        amaxd__peer__v1__progress_response__free_unpacked(r, NULL);
    }
    free_all(v, n);
}

void amx_peer_call_abort(amx_peer_t *p, const amx_membership_t *m, int me, const char *job,
                         uint64_t gen, amx_status_t code, const char *reason, uint64_t timeout_ms)
{
    Amaxd__Peer__V1__AbortRequest q = AMAXD__PEER__V1__ABORT_REQUEST__INIT;
    q.job = (char *)job;
    q.comm_generation = gen;
    q.from = p->id.rank;
    q.code = (uint32_t)amx_status_grpc(code);
    char r[760];
    snprintf(r, sizeof(r), "%s", reason);
    q.reason = r;
    size_t n = 0;
    multi_t *v = call_all(p, m, me, SVC "Abort", &q.base, timeout_ms, &n);
    if (v != NULL)
        free_all(v, n);
}
