/*
 * test_cluster.c - this daemon's identity in its cluster (config, Slurm
 * and torchrun variables), the cluster secret and the authentication
 * tokens made from it, whether a peer address refuses connections (local
 * sockets only). No threads. The catalog, job state,
 * host finish and coordinator tests that were here moved to their
 * modules' files (test_catalog.c, test_jobstate.c, test_state_host.c,
 * test_coord.c).
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cluster.h"
#include "log.h"
#include "unit.h"

/* ---- identity ---- */

static const char *const *fake_env;

static const char *env_get(const char *name)
{
    for (const char *const *p = fake_env; p && *p; p += 2)
        if (strcmp(p[0], name) == 0)
            return p[1];
    return NULL;
}

static amx_status_t resolve(const char *const *env, const char *const *cfgkv, amx_cluster_id_t *id,
                            amx_err_t *err)
{
    amx_config_t cfg;
    amx_config_init(&cfg);
    for (const char *const *p = cfgkv; p && *p; p += 2)
        ck_assert_int_eq(amx_config_set(&cfg, p[0], p[1], err), AMX_OK);
    fake_env = env;
    amx_status_t st = amx_cluster_resolve(&cfg, env_get, id, err);
    amx_config_free(&cfg);
    return st;
}

START_TEST(slurm_first_host)
{
    char h[64];
    amx_err_t err = {0};
    struct {
        const char *in, *out;
    } ok[] = {{"node[01-04,07],gpu5", "node01"},
              {"gpu5", "gpu5"},
              {"a[1-2]b[3-4]", "a1b3"},
              {"n[007]", "n007"},
              {"x1,x2", "x1"},
              {"r[3,1]s", "r3s"},
              {"dgx-a100-[12-13]", "dgx-a100-12"}};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        ck_assert_int_eq(amx_slurm_first_host(ok[i].in, h, sizeof(h), &err), AMX_OK);
        ck_assert_str_eq(h, ok[i].out);
    }
    const char *bad[] = {"", "x[", "x[]", "x[a-b]", "]x", "x[1[2]]", ",x"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        amx_err_clear(&err);
        ck_assert_msg(amx_slurm_first_host(bad[i], h, sizeof(h), &err) == AMX_EINVAL, "%s", bad[i]);
        AMX_ASSERT_HAS(err.msg, "Slurm node list");
    }
}
END_TEST

START_TEST(identity_sources)
{
    amx_cluster_id_t id;
    amx_err_t err = {0};
    /* Nothing set: one daemon. */
    ck_assert_int_eq(resolve(NULL, NULL, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.size, 1);
    ck_assert_uint_eq(id.rank, 0);
    ck_assert_str_eq(id.source, "default");
    ck_assert_uint_ne(id.incarnation, 0);
    const char *sec[] = {"cluster_secret_file", "/s", NULL};
    /* Slurm: node id, node count, first host of the node list. */
    const char *slurm[] = {"SLURM_NODEID", "2", "SLURM_NNODES", "4", "SLURM_JOB_NODELIST",
                           "gpu[07-10]",   NULL};
    ck_assert_int_eq(resolve(slurm, sec, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.rank, 2);
    ck_assert_uint_eq(id.size, 4);
    ck_assert_str_eq(id.coordinator, "gpu07:7420");
    ck_assert_str_eq(id.listen, "0.0.0.0:7420");
    ck_assert_str_eq(id.source, "slurm");
    /* torchrun-style. */
    const char *tr[] = {"RANK",     "1",           "WORLD_SIZE", "2", "MASTER_ADDR",
                        "10.0.0.9", "MASTER_PORT", "29500",      NULL};
    ck_assert_int_eq(resolve(tr, sec, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.rank, 1);
    ck_assert_uint_eq(id.size, 2);
    ck_assert_str_eq(id.coordinator, "10.0.0.9:29500");
    ck_assert_str_eq(id.listen, "0.0.0.0:29500");
    /* Explicit settings win over the environment. */
    const char *cfg[] = {"cluster_rank",
                         "3",
                         "cluster_size",
                         "5",
                         "coordinator",
                         "c0:1234",
                         "peer_listen",
                         "127.0.0.1:5000",
                         "peer_advertise",
                         "me:5000",
                         "cluster_secret_file",
                         "/s",
                         NULL};
    ck_assert_int_eq(resolve(slurm, cfg, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.rank, 3);
    ck_assert_uint_eq(id.size, 5);
    ck_assert_str_eq(id.coordinator, "c0:1234");
    ck_assert_str_eq(id.listen, "127.0.0.1:5000");
    ck_assert_str_eq(id.advertise, "me:5000");
    ck_assert_str_eq(id.source, "config");
    /* Inconsistent or incomplete. */
    const char *out[] = {"cluster_rank", "4", "cluster_size", "4", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(NULL, out, &id, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "out of range");
    const char *nocoord[] = {"cluster_size", "2", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(NULL, nocoord, &id, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "no coordinator address");
    const char *nosecret[] = {"cluster_size", "2", "coordinator", "h:1", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(NULL, nosecret, &id, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "cluster_secret_file");
    const char *badenv[] = {"SLURM_NODEID", "x", "SLURM_NNODES", "2", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(badenv, NULL, &id, &err), AMX_EINVAL);
}
END_TEST

/* ---- authentication ---- */

/* The coordinator list: entry i is the peer service of rank i; those
 * daemons are the candidates (docs/CLUSTER.md, "Coordinator failover"). */
START_TEST(coordinator_candidates)
{
    amx_cluster_id_t id;
    amx_err_t err = {0};
    const char *three[] = {"cluster_size",
                           "4",
                           "cluster_rank",
                           "2",
                           "coordinator",
                           "h0:7420,h1:7421,h2:7422",
                           "cluster_secret_file",
                           "/x",
                           NULL};
    ck_assert_int_eq(resolve(NULL, three, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.ncoord, 3);
    ck_assert_str_eq(id.coords[0], "h0:7420");
    ck_assert_str_eq(id.coords[2], "h2:7422");
    ck_assert_str_eq(id.coordinator, "h0:7420");
    /* A candidate listens on its own entry's port and is reached there. */
    ck_assert_str_eq(id.listen, "0.0.0.0:7422");
    ck_assert_str_eq(id.advertise, "h2:7422");
    /* A daemon beyond the list listens on the first entry's port. */
    three[3] = "3";
    ck_assert_int_eq(resolve(NULL, three, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.ncoord, 3);
    ck_assert_str_eq(id.listen, "0.0.0.0:7420");
    /* A candidate that listens or advertises elsewhere than its entry. */
    const char *moved[] = {"cluster_size",
                           "4",
                           "cluster_rank",
                           "1",
                           "coordinator",
                           "h0:7420,h1:7421",
                           "cluster_secret_file",
                           "/x",
                           "peer_listen",
                           "0.0.0.0:7500",
                           NULL};
    ck_assert_int_eq(resolve(NULL, moved, &id, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "entry 1 is h1:7421, but this daemon (cluster rank 1) listens on");
    const char *other[] = {
        "cluster_size",        "4",  "cluster_rank",   "1",       "coordinator", "h0:7420,h1:7421",
        "cluster_secret_file", "/x", "peer_advertise", "h0:7421", NULL};
    amx_err_clear(&err);
    ck_assert_int_eq(resolve(NULL, other, &id, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "advertises h0:7421");
    /* Spaces around entries do not matter. */
    const char *spaced[] = {"cluster_size",
                            "4",
                            "cluster_rank",
                            "3",
                            "coordinator",
                            " h0:7420 , h1:7421",
                            "cluster_secret_file",
                            "/x",
                            NULL};
    ck_assert_int_eq(resolve(NULL, spaced, &id, &err), AMX_OK);
    ck_assert_str_eq(id.coords[1], "h1:7421");
    /* One entry: one candidate, as before. */
    const char *one[] = {
        "cluster_size", "2", "cluster_rank", "1", "coordinator", "h0:7420", "cluster_secret_file",
        "/x",           NULL};
    ck_assert_int_eq(resolve(NULL, one, &id, &err), AMX_OK);
    ck_assert_uint_eq(id.ncoord, 1);
    struct {
        const char *list, *says;
    } bad[] = {{"h0:1,h0:1", "names h0:1 twice"},
               {"h0:1,,h2:3", "empty"},
               {"h0:1,h1", "entry 1 'h1' is not HOST:PORT"},
               {"h0:1,h1:2,h2:3,h3:4,h4:5", "5 candidates but cluster_size is 4"},
               {"a:1,b:1,c:1,d:1,e:1,f:1,g:1,h:1,i:1", "more than 8"}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *kv[] = {"cluster_size",
                            "4",
                            "cluster_rank",
                            "1",
                            "coordinator",
                            bad[i].list,
                            "cluster_secret_file",
                            "/x",
                            NULL};
        if (strcmp(bad[i].says, "more than 8") == 0)
            kv[1] = "16";
        amx_err_clear(&err);
        ck_assert_msg(resolve(NULL, kv, &id, &err) == AMX_EINVAL, "%s", bad[i].list);
        AMX_ASSERT_HAS(err.msg, bad[i].says);
    }
}
END_TEST

START_TEST(auth_tokens)
{
    const uint8_t s1[] = "0123456789abcdef", s2[] = "fedcba9876543210";
    char tok[160];
    const char *why = NULL;
    amx_auth_token(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1000, tok, sizeof(tok));
    ck_assert_int_eq(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1000, tok, strlen(tok), &why), 0);
    ck_assert_int_eq(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1299, tok, strlen(tok), &why), 0);
    /* Another secret, another method, too old, malformed. */
    ck_assert_int_ne(
        amx_auth_check(s2, 16, "/amaxd.peer.v1.Peer/Sync", 1000, tok, strlen(tok), &why), 0);
    AMX_ASSERT_HAS(why, "wrong token");
    ck_assert_int_ne(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Join", 1000, tok, strlen(tok), &why), 0);
    ck_assert_int_ne(
        amx_auth_check(s1, 16, "/amaxd.peer.v1.Peer/Sync", 1301, tok, strlen(tok), &why), 0);
    AMX_ASSERT_HAS(why, "5 minutes");
    ck_assert_int_ne(amx_auth_check(s1, 16, "/m", 1000, "garbage", 7, &why), 0);
    ck_assert_int_ne(amx_auth_check(s1, 16, "/m", 1000, "", 0, &why), 0);
    /* The secret never appears in the token. */
    ck_assert_ptr_null(strstr(tok, "0123456789abcdef"));
}
END_TEST

/* ---- the secret and the cluster object ---- */

/* Writes `data` to a new file of mode `mode` in `dir`; returns its path. */
static char *secret_file(const char *dir, const char *name, const char *data, mode_t mode)
{
    static char path[4][256];
    static int k;
    char *p = path[k++ % 4];
    snprintf(p, 256, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(data, f);
    fclose(f);
    ck_assert_int_eq(chmod(p, mode), 0);
    return p;
}

START_TEST(secret_file_rules)
{
    char dir[] = "/tmp/amx-secret-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    uint8_t buf[64];
    size_t len = 0;
    amx_err_t err = {0};
    /* Trailing newlines are not part of the secret. */
    char *ok = secret_file(dir, "ok", "0123456789abcdefXYZ\n\r\n", 0600);
    ck_assert_int_eq(amx_cluster_load_secret(ok, buf, sizeof(buf), &len, &err), AMX_OK);
    ck_assert_uint_eq(len, 19);
    ck_assert_int_eq(memcmp(buf, "0123456789abcdefXYZ", 19), 0);
    char *shared = secret_file(dir, "shared", "0123456789abcdefXYZ", 0640);
    ck_assert_int_eq(amx_cluster_load_secret(shared, buf, sizeof(buf), &len, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "is readable by others (mode 0640): chmod 600 it");
    amx_err_clear(&err);
    char *short_ = secret_file(dir, "short", "too short\n", 0600);
    ck_assert_int_eq(amx_cluster_load_secret(short_, buf, sizeof(buf), &len, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "holds 9 bytes; use at least 16");
    amx_err_clear(&err);
    char *longer = secret_file(dir, "long", "0123456789abcdef0123456789abcdef", 0600);
    ck_assert_int_eq(amx_cluster_load_secret(longer, buf, 20, &len, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "is longer than 19 bytes");
    amx_err_clear(&err);
    ck_assert_int_eq(amx_cluster_load_secret(dir, buf, sizeof(buf), &len, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "is not a regular file");
    amx_err_clear(&err);
    char missing[300];
    snprintf(missing, sizeof(missing), "%s/none", dir);
    ck_assert_int_eq(amx_cluster_load_secret(missing, buf, sizeof(buf), &len, &err), AMX_EIO);
    AMX_ASSERT_HAS(err.msg, "cannot read cluster_secret_file");
    unlink(ok), unlink(shared), unlink(short_), unlink(longer);
    rmdir(dir);
}
END_TEST

/* Two daemons of one cluster, one secret: each accepts the other's
 * tokens; a daemon of another secret does not. */
START_TEST(cluster_tokens_between_daemons)
{
    char dir[] = "/tmp/amx-secret-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    char *s1 = secret_file(dir, "s1", "the cluster's secret, 1", 0600);
    char *s2 = secret_file(dir, "s2", "another cluster's secret", 0600);
    const char *c0[] = {"cluster_size",
                        "2",
                        "cluster_rank",
                        "0",
                        "coordinator",
                        "h:1",
                        "cluster_secret_file",
                        s1,
                        NULL};
    const char *c1[] = {"cluster_size",
                        "2",
                        "cluster_rank",
                        "1",
                        "coordinator",
                        "h:1",
                        "cluster_secret_file",
                        s1,
                        NULL};
    const char *cx[] = {"cluster_size",
                        "2",
                        "cluster_rank",
                        "1",
                        "coordinator",
                        "h:1",
                        "cluster_secret_file",
                        s2,
                        NULL};
    const char *const *cfgs[3] = {c0, c1, cx};
    amx_cluster_t *cl[3];
    for (int i = 0; i < 3; i++) {
        amx_config_t cfg;
        amx_config_init(&cfg);
        amx_err_t err = {0};
        for (const char *const *p = cfgs[i]; *p; p += 2)
            ck_assert_int_eq(amx_config_set(&cfg, p[0], p[1], &err), AMX_OK);
        amx_cluster_id_t id;
        fake_env = NULL;
        ck_assert_int_eq(amx_cluster_resolve(&cfg, env_get, &id, &err), AMX_OK);
        ck_assert_msg(amx_cluster_create(&cfg, &id, &cl[i], &err) == AMX_OK, "%s", err.msg);
        amx_config_free(&cfg);
    }
    ck_assert_uint_eq(amx_cluster_id(cl[1])->rank, 1);
    char tok[160];
    const char *why = NULL;
    amx_cluster_token(cl[0], "/amaxd.peer.v1.Peer/Sync", tok, sizeof(tok));
    ck_assert_int_eq(amx_cluster_check(cl[1], "/amaxd.peer.v1.Peer/Sync", tok, strlen(tok), &why),
                     0);
    ck_assert_int_ne(amx_cluster_check(cl[1], "/amaxd.peer.v1.Peer/Join", tok, strlen(tok), &why),
                     0);
    ck_assert_int_ne(amx_cluster_check(cl[2], "/amaxd.peer.v1.Peer/Sync", tok, strlen(tok), &why),
                     0);
    AMX_ASSERT_HAS(why, "wrong token");
    /* Again (the expected token now comes from the cache): still valid,
     * and a token of that method and second made with another secret, or
     * one byte off, is still refused. */
    ck_assert_int_eq(amx_cluster_check(cl[1], "/amaxd.peer.v1.Peer/Sync", tok, strlen(tok), &why),
                     0);
    char other[160];
    amx_cluster_token(cl[2], "/amaxd.peer.v1.Peer/Sync", other, sizeof(other));
    if (strncmp(other, tok, strchr(tok, ':') - tok) == 0) { /* the same second */
        why = NULL;
        ck_assert_int_ne(
            amx_cluster_check(cl[1], "/amaxd.peer.v1.Peer/Sync", other, strlen(other), &why), 0);
        AMX_ASSERT_HAS(why, "wrong token");
    }
    tok[strlen(tok) - 1] ^= 1;
    ck_assert_int_ne(amx_cluster_check(cl[1], "/amaxd.peer.v1.Peer/Sync", tok, strlen(tok), &why),
                     0);
    for (int i = 0; i < 3; i++)
        amx_cluster_free(cl[i]);
    /* TLS needs all three files. */
    amx_config_t cfg;
    amx_config_init(&cfg);
    amx_err_t err = {0};
    for (const char *const *p = c0; *p; p += 2)
        amx_config_set(&cfg, p[0], p[1], &err);
    ck_assert_int_eq(amx_config_set(&cfg, "peer_tls_cert", s1, &err), AMX_OK);
    amx_cluster_id_t id;
    ck_assert_int_eq(amx_cluster_resolve(&cfg, env_get, &id, &err), AMX_OK);
    amx_cluster_t *bad = NULL;
    ck_assert_int_eq(amx_cluster_create(&cfg, &id, &bad, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "needs all of peer_tls_cert, peer_tls_key and peer_tls_ca");
    amx_config_free(&cfg);
    unlink(s1), unlink(s2);
    rmdir(dir);
}
END_TEST

/* ---- a peer that is gone: its port refuses connections ---- */

/* A listening IPv4 socket on 127.0.0.1, its port in *port. */
static int listen_local(unsigned *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    ck_assert_int_eq(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    ck_assert_int_eq(listen(fd, 4), 0);
    socklen_t sl = sizeof(a);
    ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

START_TEST(addr_refuses)
{
    unsigned port = 0;
    int fd = listen_local(&port);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    /* Listening (the backlog accepts even when nobody calls accept): not gone. */
    ck_assert_int_eq(amx_cluster_addr_refuses(addr, 200), 0);
    ck_assert_int_eq(amx_cluster_addr_refuses(addr, 200), 0);
    /* "localhost" may resolve to ::1 too, which refuses: one address that
     * connects is enough. */
    snprintf(addr, sizeof(addr), "localhost:%u", port);
    ck_assert_int_eq(amx_cluster_addr_refuses(addr, 200), 0);
    /* The process is gone: the port is closed, every address refuses. */
    close(fd);
    snprintf(addr, sizeof(addr), "127.0.0.1:%u", port);
    ck_assert_int_eq(amx_cluster_addr_refuses(addr, 200), 1);
    snprintf(addr, sizeof(addr), "localhost:%u", port);
    ck_assert_int_eq(amx_cluster_addr_refuses(addr, 200), 1);
    /* What says nothing of the process is never taken for gone: a name
     * that does not resolve, an address that is not HOST:PORT. */
    ck_assert_int_eq(amx_cluster_addr_refuses("no-such-host.invalid:7421", 200), 0);
    ck_assert_int_eq(amx_cluster_addr_refuses("127.0.0.1", 200), 0);
    ck_assert_int_eq(amx_cluster_addr_refuses("127.0.0.1:0", 200), 0);
    ck_assert_int_eq(amx_cluster_addr_refuses(":7421", 200), 0);
    ck_assert_int_eq(amx_cluster_addr_refuses(NULL, 200), 0);
    /* (An address with no route is not tested: a host whose firewall
     * rejects outgoing connections answers ECONNREFUSED for it, as the GPU
     * hosts did: docs/CLUSTER.md lists that among what can make a live
     * daemon look gone.) */
    /* Resolved once, probed later without a lookup. */
    amx_netaddrs_t a;
    ck_assert_int_eq(amx_cluster_addr_resolve("127.0.0.1:9", &a), 0);
    ck_assert_int_eq(a.n, 1);
    ck_assert_int_eq(amx_cluster_addr_resolve("no-such-host.invalid:9", &a), -1);
    ck_assert_int_eq(a.n, 0);
    ck_assert_int_eq(amx_cluster_addrs_refuse(&a, 200), 0); /* nothing resolved: never gone */
}
END_TEST

/* The bracketed IPv6 form, where the host has IPv6 loopback. */
START_TEST(addr_refuses_v6)
{
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(fd, 4) != 0) {
        if (fd >= 0)
            close(fd);
        return; /* no IPv6 loopback here */
    }
    socklen_t sl = sizeof(a);
    ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&a, &sl), 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "[::1]:%u", ntohs(a.sin6_port));
    ck_assert_int_eq(amx_cluster_addr_refuses(addr, 200), 0);
    close(fd);
    ck_assert_int_eq(amx_cluster_addr_refuses(addr, 200), 1);
}
END_TEST

int main(void)
{
    amx_log_level = AMX_LOG_ERROR;
    Suite *s = suite_create("cluster");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, slurm_first_host);
    tcase_add_test(tc, identity_sources);
    tcase_add_test(tc, coordinator_candidates);
    tcase_add_test(tc, auth_tokens);
    tcase_add_test(tc, secret_file_rules);
    tcase_add_test(tc, cluster_tokens_between_daemons);
    tcase_add_test(tc, addr_refuses);
    tcase_add_test(tc, addr_refuses_v6);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
