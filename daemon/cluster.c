/*
 * cluster.c - who this daemon is in its cluster (rank, size, addresses,
 * from the config, Slurm or torchrun variables), the cluster's shared
 * secret and the tokens made from it, and the TLS material of the peer
 * service (cluster.h).
 */
#include "cluster.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "grow.h"

#define AUTH_SKEW_S 300

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

/* The comma-separated coordinator list into id->coords. */
static amx_status_t parse_coords(const char *list, amx_cluster_id_t *id, amx_err_t *err)
{
    const char *p = list;
    id->ncoord = 0;
    for (;;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        /* "a:1, b:2" is as good as "a:1,b:2". */
        while (n > 0 && isspace((unsigned char)*p))
            p++, n--;
        while (n > 0 && isspace((unsigned char)p[n - 1]))
            n--;
        char one[256], host[200];
        uint32_t port;
        if (id->ncoord == AMX_MAX_COORDS)
            return amx_err_set(err, AMX_EINVAL, "coordinator lists more than %d candidates: '%s'",
                               AMX_MAX_COORDS, list);
        if (n == 0 || n >= sizeof(one))
            return amx_err_set(err, AMX_EINVAL, "coordinator '%s' has an empty or overlong entry",
                               list);
        memcpy(one, p, n);
        one[n] = '\0';
        if (split_hostport(one, host, sizeof(host), &port) != 0 || host[0] == '\0')
            return amx_err_set(err, AMX_EINVAL, "coordinator entry %u '%s' is not HOST:PORT",
                               id->ncoord, one);
        for (uint32_t i = 0; i < id->ncoord; i++)
            if (strcmp(id->coords[i], one) == 0)
                return amx_err_set(err, AMX_EINVAL,
                                   "coordinator names %s twice (entries %u and %u): each entry is "
                                   "another daemon's peer service",
                                   one, i, id->ncoord);
        snprintf(id->coords[id->ncoord++], sizeof(id->coords[0]), "%s", one);
        if (end == NULL)
            return AMX_OK;
        p = end + 1;
    }
}

amx_status_t amx_cluster_resolve(const amx_config_t *cfg, const char *(*env)(const char *),
                                 amx_cluster_id_t *id, amx_err_t *err)
{
    memset(id, 0, sizeof(*id));
    uint32_t rank = (uint32_t)cfg->cluster_rank, size = (uint32_t)cfg->cluster_size;
    char coord[AMX_MAX_COORDS * 256] = "";
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
    AMX_CHECK(parse_coords(coord, id, err));
    if (id->ncoord > size)
        return amx_err_set(err, AMX_EINVAL,
                           "coordinator names %u candidates but cluster_size is %u: entry i is "
                           "the peer service of cluster rank i",
                           id->ncoord, size);
    /* A candidate listens where the list says others reach it. */
    const char *own = rank < id->ncoord ? id->coords[rank] : id->coords[0];
    split_hostport(own, host, sizeof(host), &cport);
    snprintf(id->coordinator, sizeof(id->coordinator), "%s", id->coords[0]);
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
    /* A candidate must be where the list says: entry `rank` is how the
     * others reach it when it takes the coordinator's role. */
    if (id->ncoord > 1 && rank < id->ncoord) {
        char eh[200], lh[200];
        uint32_t ep = 0, lp = 0;
        split_hostport(id->coords[rank], eh, sizeof(eh), &ep);
        split_hostport(id->listen, lh, sizeof(lh), &lp);
        if (lp != ep)
            return amx_err_set(err, AMX_EINVAL,
                               "coordinator entry %u is %s, but this daemon (cluster rank %u) "
                               "listens on %s: entry i must be the peer service of rank i",
                               rank, id->coords[rank], rank, id->listen);
        if (cfg->peer_advertise[0] != '\0' && strcmp(cfg->peer_advertise, id->coords[rank]) != 0)
            return amx_err_set(err, AMX_EINVAL,
                               "coordinator entry %u is %s, but this daemon (cluster rank %u) "
                               "advertises %s: entry i must be the peer service of rank i",
                               rank, id->coords[rank], rank, cfg->peer_advertise);
    }
    if (cfg->peer_advertise[0] == '\0' && id->ncoord > 1 && rank < id->ncoord) {
        snprintf(id->advertise, sizeof(id->advertise), "%s", id->coords[rank]);
    } else if (cfg->peer_advertise[0] != '\0') {
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

/* One non-blocking connect: 1 refused, 0 connected, -1 anything else. */
static int connect_refused(const struct sockaddr *sa, socklen_t len, int timeout_ms)
{
    int fd = socket(sa->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int rc = connect(fd, sa, len);
    int e = rc == 0 ? 0 : errno;
    if (e == EINPROGRESS) {
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        int n;
        do
            n = poll(&pf, 1, timeout_ms);
        while (n < 0 && errno == EINTR);
        socklen_t sl = sizeof(e);
        if (n <= 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &sl) != 0)
            e = ETIMEDOUT;
    }
    close(fd);
    return e == 0 ? 0 : e == ECONNREFUSED ? 1 : -1;
}

int amx_cluster_addr_resolve(const char *hostport, amx_netaddrs_t *out)
{
    out->n = 0;
    char host[200];
    uint32_t port = 0;
    if (hostport == NULL || split_hostport(hostport, host, sizeof(host), &port) != 0 ||
        host[0] == '\0')
        return -1;
    size_t hl = strlen(host);
    if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    }
    char serv[16];
    snprintf(serv, sizeof(serv), "%u", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(host, serv, &hints, &res) != 0 || res == NULL)
        return -1;
    for (const struct addrinfo *a = res; a != NULL && out->n < 4; a = a->ai_next) {
        if (a->ai_addrlen > sizeof(out->a[0]))
            continue;
        memcpy(&out->a[out->n], a->ai_addr, a->ai_addrlen);
        out->len[out->n++] = a->ai_addrlen;
    }
    freeaddrinfo(res);
    return out->n > 0 ? 0 : -1;
}

int amx_cluster_addrs_refuse(const amx_netaddrs_t *a, uint64_t timeout_ms)
{
    int ms = timeout_ms > 60000 ? 60000 : (int)timeout_ms;
    if (a->n == 0)
        return 0;
    for (int i = 0; i < a->n; i++)
        if (connect_refused((const struct sockaddr *)&a->a[i], a->len[i], ms) != 1)
            return 0;
    return 1;
}

int amx_cluster_addr_refuses(const char *hostport, uint64_t timeout_ms)
{
    amx_netaddrs_t a;
    return amx_cluster_addr_resolve(hostport, &a) == 0 && amx_cluster_addrs_refuse(&a, timeout_ms);
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

/* The time of a token ("<ts>:<hex>"), checked against now: 0, or -1 with
 * a reason. */
static int token_time(const char *token, size_t tlen, long long now, long long *ts,
                      const char **why)
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
    *ts = strtoll(tok, &end, 10);
    if (*end != '\0' || end == tok) {
        *why = "malformed token";
        return -1;
    }
    if (*ts < now - AUTH_SKEW_S || *ts > now + AUTH_SKEW_S) {
        *why = "token time is more than 5 minutes off (are the clocks synchronized?)";
        return -1;
    }
    return 0;
}

/* Whether a token is the one expected, in constant time. */
static int token_is(const char *expect, const char *token, size_t tlen, const char **why)
{
    if (strlen(expect) != tlen || CRYPTO_memcmp(expect, token, tlen) != 0) {
        *why = "wrong token (another cluster secret?)";
        return -1;
    }
    return 0;
}

int amx_auth_check(const uint8_t *secret, size_t slen, const char *method, long long now,
                   const char *token, size_t tlen, const char **why)
{
    long long ts;
    if (token_time(token, tlen, now, &ts, why) != 0)
        return -1;
    char expect[160];
    amx_auth_token(secret, slen, method, ts, expect, sizeof(expect));
    return token_is(expect, token, tlen, why);
}

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
        if (amx_grow(&buf, &cap, len + 4096 + 1, 1, 8192, 0) != 0) {
            free(buf);
            fclose(f);
            amx_err_set(err, AMX_ENOMEM, "out of memory reading %s", path);
            return NULL;
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

/* The tokens expected lately, by method and second: every daemon's calls
 * of one method in one second carry the same token, so N daemons coming
 * to an agreement at once cost the coordinator one HMAC, not N. */
#define EXPECTED_TOKENS 8

typedef struct expected {
    long long ts;
    char method[96]; /* "" = unused */
    char token[160];
} expected_t;

typedef struct token_cache {
    pthread_mutex_t mu;
    expected_t e[EXPECTED_TOKENS];
    unsigned next; /* the slot a miss fills */
} token_cache_t;

struct amx_cluster {
    amx_cluster_id_t id;
    uint8_t secret[4096];
    size_t slen;
    char *tls_cert, *tls_key, *tls_ca; /* PEM; all or none */
    token_cache_t *expected;           /* mutable behind a const cluster */
};

amx_status_t amx_cluster_create(const amx_config_t *cfg, const amx_cluster_id_t *id,
                                amx_cluster_t **out, amx_err_t *err)
{
    amx_cluster_t *c = calloc(1, sizeof(*c));
    if (c == NULL || (c->expected = calloc(1, sizeof(*c->expected))) == NULL) {
        free(c);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    pthread_mutex_init(&c->expected->mu, NULL);
    c->id = *id;
    if (id->size > 1) {
        amx_status_t st = amx_cluster_load_secret(cfg->cluster_secret_file, c->secret,
                                                  sizeof(c->secret), &c->slen, err);
        int ntls =
            (cfg->peer_tls_cert[0] != 0) + (cfg->peer_tls_key[0] != 0) + (cfg->peer_tls_ca[0] != 0);
        if (st == AMX_OK && ntls != 0 && ntls != 3)
            st = amx_err_set(err, AMX_EINVAL,
                             "TLS between daemons needs all of peer_tls_cert, peer_tls_key and "
                             "peer_tls_ca");
        if (st == AMX_OK && ntls == 3 &&
            ((c->tls_cert = slurp(cfg->peer_tls_cert, err)) == NULL ||
             (c->tls_key = slurp(cfg->peer_tls_key, err)) == NULL ||
             (c->tls_ca = slurp(cfg->peer_tls_ca, err)) == NULL))
            st = err->code;
        if (st != AMX_OK) {
            amx_cluster_free(c);
            return st;
        }
    }
    *out = c;
    return AMX_OK;
}

void amx_cluster_free(amx_cluster_t *c)
{
    if (c == NULL)
        return;
    free(c->tls_cert);
    free(c->tls_key);
    free(c->tls_ca);
    OPENSSL_cleanse(c->secret, sizeof(c->secret));
    pthread_mutex_destroy(&c->expected->mu);
    OPENSSL_cleanse(c->expected, sizeof(*c->expected));
    free(c->expected);
    free(c);
}

const amx_cluster_id_t *amx_cluster_id(const amx_cluster_t *c)
{
    return &c->id;
}

void amx_cluster_token(const amx_cluster_t *c, const char *method, char *out, size_t len)
{
    amx_auth_token(c->secret, c->slen, method, (long long)time(NULL), out, len);
}

int amx_cluster_check(const amx_cluster_t *c, const char *method, const char *token, size_t tlen,
                      const char **why)
{
    long long ts;
    if (token_time(token, tlen, (long long)time(NULL), &ts, why) != 0)
        return -1;
    token_cache_t *tc = c->expected;
    char expect[160] = "";
    pthread_mutex_lock(&tc->mu);
    for (int i = 0; i < EXPECTED_TOKENS && expect[0] == '\0'; i++)
        if (tc->e[i].ts == ts && strcmp(tc->e[i].method, method) == 0)
            memcpy(expect, tc->e[i].token, sizeof(expect));
    pthread_mutex_unlock(&tc->mu);
    if (expect[0] == '\0') {
        amx_auth_token(c->secret, c->slen, method, ts, expect, sizeof(expect));
        if (strlen(method) < sizeof(tc->e[0].method)) {
            pthread_mutex_lock(&tc->mu);
            expected_t *e = &tc->e[tc->next++ % EXPECTED_TOKENS];
            e->ts = ts;
            snprintf(e->method, sizeof(e->method), "%s", method);
            memcpy(e->token, expect, sizeof(e->token));
            pthread_mutex_unlock(&tc->mu);
        }
    }
    return token_is(expect, token, tlen, why);
}

amx_status_t amx_cluster_server_credentials(const amx_cluster_t *c, grpc_server_credentials **out,
                                            amx_err_t *err)
{
    if (c->tls_cert == NULL) {
        *out = grpc_insecure_server_credentials_create();
        return AMX_OK;
    }
    grpc_ssl_pem_key_cert_pair pair = {c->tls_key, c->tls_cert};
    *out = grpc_ssl_server_credentials_create_ex(
        c->tls_ca, &pair, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, NULL);
    if (*out == NULL)
        return amx_err_set(err, AMX_EINVAL, "the peer TLS certificate or key could not be used");
    return AMX_OK;
}

grpc_channel_credentials *amx_cluster_channel_credentials(const amx_cluster_t *c)
{
    if (c->tls_cert == NULL)
        return grpc_insecure_credentials_create();
    grpc_ssl_pem_key_cert_pair pair = {c->tls_key, c->tls_cert};
    return grpc_ssl_credentials_create(c->tls_ca, &pair, NULL, NULL);
}
