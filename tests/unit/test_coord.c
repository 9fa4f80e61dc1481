/*
 * test_coord.c - the coordinator's logic without I/O: membership and Join
 * timeouts, the agreement barrier (proposals merged into the master
 * catalog, conflicts, resets, donors, communicator generations), a
 * coordinator that restarted, the key-value store, drops, notices and
 * cancellations.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord.h"
#include "log.h"
#include "unit.h"

/* ---- coordinator ---- */

typedef struct answer {
    int called;
    amx_status_t st;
    char msg[1024];
    uint32_t npart;
    int rejoined;
    uint64_t hash, target, gen, seq;
    uint32_t donor, nbehind, ncat, nres, nrej;
    int new_comm;
    int send_catalog, send_offer;
    char conflict[1024];
    char val[64];
    char names[64], agreed[64]; /* the master's names in name order, in agreed order */
} answer_t;

/* The catalog hash the daemons of these tests hold: the last agreed one. */
static uint64_t held_hash;

static void on_join(void *ud, amx_status_t st, const char *msg, const amx_membership_t *m)
{
    answer_t *a = ud;
    a->called++;
    a->st = st;
    snprintf(a->msg, sizeof(a->msg), "%s", msg ? msg : "");
    if (m != NULL) {
        a->npart = m->npart;
        a->rejoined = m->rejoined;
    }
}

static void on_sync(void *ud, amx_status_t st, const char *msg, const amx_coord_sync_ans_t *s)
{
    answer_t *a = ud;
    a->called++;
    a->st = st;
    snprintf(a->msg, sizeof(a->msg), "%s", msg ? msg : "");
    if (s == NULL)
        return;
    a->send_catalog = s->send_catalog;
    a->send_offer = s->send_offer;
    if (s->send_catalog || s->send_offer)
        return;
    held_hash = s->catalog_hash;
    a->hash = s->catalog_hash;
    a->target = s->target_epoch;
    a->gen = s->comm_gen;
    a->seq = s->seq;
    a->donor = s->donor;
    a->nbehind = (uint32_t)s->nbehind;
    a->ncat = s->catalog->n;
    a->names[0] = a->agreed[0] = '\0';
    for (uint32_t i = 0; i < s->catalog->n; i++) {
        size_t n = strlen(a->names), k = strlen(a->agreed);
        snprintf(a->names + n, sizeof(a->names) - n, "%s ", s->catalog->q[i]->name);
        snprintf(a->agreed + k, sizeof(a->agreed) - k, "%s ", s->catalog->agreed[i]->name);
    }
    a->nres = (uint32_t)s->nresets;
    a->nrej = (uint32_t)s->nrejected;
    a->new_comm = s->new_comm;
    snprintf(a->conflict, sizeof(a->conflict), "%s", s->conflict ? s->conflict : "");
}

static void on_kv(void *ud, amx_status_t st, const char *msg, const void *v, size_t len)
{
    answer_t *a = ud;
    a->called++;
    a->st = st;
    snprintf(a->msg, sizeof(a->msg), "%s", msg ? msg : "");
    if (v != NULL) {
        /* Bytes, not a string: a value may hold a NUL. */
        size_t n = len < sizeof(a->val) - 1 ? len : sizeof(a->val) - 1;
        memcpy(a->val, v, n);
        a->val[n] = '\0';
    }
}

static void join(amx_coord_t *co, uint32_t rank, uint32_t daemon, uint64_t inc, answer_t *a)
{
    amx_coord_join_req_t r = {"j", 4, rank, daemon, inc, "h:1", 0, 1000};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, a, &h, &err), AMX_OK);
}

/* An offer's hash: the catalog hash of its specs in name order. */
static uint64_t offer_hash(amx_qspec_t **p, size_t np)
{
    if (np == 0)
        return 0;
    amx_qspec_t **sorted = malloc(np * sizeof(*sorted));
    ck_assert_ptr_nonnull(sorted);
    memcpy(sorted, p, np * sizeof(*sorted));
    qsort(sorted, np, sizeof(*sorted), amx_qspec_name_cmp);
    uint64_t h = amx_catalog_hash(sorted, (uint32_t)np);
    free(sorted);
    return h;
}

/* An agreement request of daemon `daemon` (last reconciled epoch `last`),
 * holding the catalog of held_hash, with its offer p by hash (the specs
 * included or not), the union hash of both, and resets. */
static void sync_req(amx_coord_t *co, uint32_t daemon, uint64_t last, amx_qspec_t **p, size_t np,
                     int included, uint64_t union_hash, char **resets, size_t nr, answer_t *a)
{
    amx_coord_sync_req_t r = {.offer_hash = offer_hash(p, np),
                              .offer_count = (uint32_t)np,
                              .offer_included = included,
                              .union_hash = union_hash,
                              .job = "j",
                              .daemon = daemon,
                              .incarnation = 1,
                              .last_reconciled = last,
                              .catalog_hash = held_hash,
                              .proposals = included ? p : NULL,
                              .nprop = included ? np : 0,
                              .resets = resets,
                              .nresets = nr,
                              .deadline_ms = 5000};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_sync(co, &r, on_sync, a, &h, &err), AMX_OK);
}

/* An offer by hash, the specs included or not. */
static void sync_offer(amx_coord_t *co, uint32_t daemon, amx_qspec_t **p, size_t np, int included,
                       answer_t *a)
{
    sync_req(co, daemon, 0, p, np, included, 0, NULL, 0, a);
}

static void sync1(amx_coord_t *co, uint32_t daemon, uint64_t last, amx_qspec_t **p, size_t np,
                  char **resets, size_t nr, answer_t *a)
{
    sync_req(co, daemon, last, p, np, np > 0, 0, resets, nr, a);
}

/* An offer included, with the union hash of the daemon's catalog and it. */
static void sync_union(amx_coord_t *co, uint32_t daemon, amx_qspec_t **p, size_t np,
                       uint64_t union_hash, answer_t *a)
{
    sync_req(co, daemon, 0, p, np, np > 0, union_hash, NULL, 0, a);
}

/* A coordinator whose job "j" has ranks 0-1 on daemon 0 and 2-3 on daemon
 * 1, all joined (their answers in j); the daemons hold no catalog yet. */
static amx_coord_t *two_daemons(answer_t j[4])
{
    held_hash = amx_catalog_hash(NULL, 0);
    amx_coord_t *co = amx_coord_create(42, 1000);
    for (uint32_t r = 0; r < 4; r++)
        join(co, r, r / 2, 1, &j[r]);
    return co;
}

/* The master grows by what a round adds, names in name order wherever they
 * fall, in the order agreed beside it; its hash is the catalog hash of the
 * whole, taken from the daemon whose catalog and offer the round adopts
 * (it is not hashed again) and computed otherwise. */
START_TEST(coordinator_master_grows)
{
    answer_t j[4] = {{0}};
    amx_coord_t *co = two_daemons(j);
    amx_qspec_t *all[6] = {unit_spec("a", 1, NULL), unit_spec("c", 1, NULL),
                           unit_spec("d", 3, NULL), unit_spec("e", 1, NULL),
                           unit_spec("m", 2, NULL), unit_spec("z", 1, NULL)};
    amx_qspec_t *a = all[0], *c = all[1], *d = all[2], *e = all[3], *m = all[4], *z = all[5];
    /* Daemon 0 offers m, c; daemon 1 nothing: its hash is daemon 0's union. */
    amx_qspec_t *r1[2] = {m, c}, *cm[2] = {c, m};
    uint64_t h_cm = amx_catalog_hash(cm, 2);
    answer_t s0 = {0}, s1 = {0};
    sync_union(co, 0, r1, 2, h_cm, &s0);
    sync_union(co, 1, NULL, 0, held_hash, &s1);
    ck_assert_int_eq(s1.called, 1);
    ck_assert_uint_eq(s1.hash, h_cm);
    ck_assert_str_eq(s1.names, "c m ");
    /* One name before the others: in its place; the hash still adopted. */
    amx_qspec_t *r2[1] = {a}, *acm[3] = {a, c, m};
    uint64_t h_acm = amx_catalog_hash(acm, 3);
    answer_t t0 = {0}, t1 = {0};
    sync_union(co, 1, r2, 1, h_acm, &t1);
    sync_union(co, 0, NULL, 0, held_hash, &t0);
    ck_assert_uint_eq(t0.hash, h_acm);
    ck_assert_str_eq(t0.names, "a c m ");
    ck_assert_str_eq(t0.agreed, "c m a ");
    /* It is taken, not checked (the daemons check it against their own):
     * a union hash that is not the catalog's shows which path ran. */
    amx_qspec_t *r3[1] = {z};
    answer_t u0 = {0}, u1 = {0};
    sync_union(co, 0, r3, 1, 0x5eed, &u0);
    sync_union(co, 1, NULL, 0, held_hash, &u1);
    ck_assert_uint_eq(u1.hash, 0x5eed);
    ck_assert_str_eq(u1.names, "a c m z ");
    /* Computed when two offers add (each daemon's union is only its own),
     * when an offer holds an agreed spec, and without a union hash. */
    amx_qspec_t *r4a[1] = {e}, *r4b[1] = {d}, *acdemz[6] = {a, c, d, e, m, z};
    answer_t v0 = {0}, v1 = {0};
    sync_union(co, 0, r4a, 1, 0x5eed, &v0);
    sync_union(co, 1, r4b, 1, 0x5eed, &v1);
    ck_assert_uint_eq(v1.hash, amx_catalog_hash(acdemz, 6));
    ck_assert_str_eq(v1.names, "a c d e m z ");
    ck_assert_str_eq(v1.agreed, "c m a z e d ");
    amx_qspec_t *b = unit_spec("b", 1, NULL), *r5[2] = {b, m};
    amx_qspec_t *abcdemz[7] = {a, b, c, d, e, m, z};
    answer_t w0 = {0}, w1 = {0};
    sync_union(co, 0, r5, 2, 0x5eed, &w0);
    sync_union(co, 1, NULL, 0, held_hash, &w1);
    ck_assert_uint_eq(w1.hash, amx_catalog_hash(abcdemz, 7));
    ck_assert_str_eq(w1.names, "a b c d e m z ");
    amx_qspec_t *y = unit_spec("y", 1, NULL), *r6[1] = {y};
    amx_qspec_t *abcdemyz[8] = {a, b, c, d, e, m, y, z};
    answer_t x0 = {0}, x1 = {0};
    sync_union(co, 0, r6, 1, 0, &x0);
    sync_union(co, 1, NULL, 0, held_hash, &x1);
    ck_assert_uint_eq(x1.hash, amx_catalog_hash(abcdemyz, 8));
    ck_assert_str_eq(x1.agreed, "c m a z e d b y ");
    for (int i = 0; i < 6; i++)
        amx_qspec_free(all[i]);
    amx_qspec_free(b);
    amx_qspec_free(y);
    amx_coord_destroy(co);
}
END_TEST

START_TEST(coordinator_membership_and_agreement)
{
    held_hash = amx_catalog_hash(NULL, 0);
    amx_coord_t *co = amx_coord_create(42, 1000);
    answer_t j[4] = {{0}};
    join(co, 0, 0, 1, &j[0]);
    join(co, 1, 0, 1, &j[1]);
    join(co, 2, 1, 1, &j[2]);
    ck_assert_int_eq(j[0].called + j[1].called + j[2].called, 0);
    /* A rank cannot move to another daemon. */
    amx_coord_join_req_t moved = {"j", 4, 1, 1, 1, "h:2", 0, 1000};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_join(co, &moved, on_join, &j[3], &h, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "served by daemon 0");
    join(co, 3, 1, 1, &j[3]);
    for (int i = 0; i < 4; i++) {
        ck_assert_int_eq(j[i].called, 1);
        ck_assert_int_eq(j[i].st, AMX_OK);
        ck_assert_uint_eq(j[i].npart, 2);
    }
    /* Agreement: daemon 0 proposes a, b; daemon 1 proposes b, c; both resets. */
    amx_qspec_t *p0[2] = {unit_spec("b", 2, NULL), unit_spec("a", 1, NULL)};
    amx_qspec_t *p1[2] = {unit_spec("c", 1, NULL), unit_spec("b", 2, NULL)};
    char *r0[1] = {"a"}, *r1[2] = {"a", "c"};
    answer_t s0 = {0}, s1 = {0};
    sync1(co, 0, 3, p0, 2, r0, 1, &s0);
    ck_assert_int_eq(s0.called, 0); /* waits for daemon 1 */
    sync1(co, 1, 2, p1, 2, r1, 2, &s1);
    ck_assert_int_eq(s0.called, 1);
    ck_assert_int_eq(s1.called, 1);
    ck_assert_uint_eq(s0.hash, s1.hash);
    ck_assert_uint_eq(s0.ncat, 3);
    ck_assert_uint_eq(s0.nres, 2);
    ck_assert_uint_eq(s0.target, 3);
    ck_assert_uint_eq(s0.donor, 0);
    ck_assert_uint_eq(s0.nbehind, 1);
    ck_assert_int_eq(s0.new_comm, 1);
    ck_assert_str_eq(s0.conflict, "");
    /* A conflict: the same answer for both, the name rejected, others kept. */
    amx_qspec_t *q0[2] = {unit_spec("w", 4, NULL), unit_spec("d", 1, NULL)};
    amx_qspec_t *q1[1] = {unit_spec("w", 8, NULL)};
    answer_t t0 = {0}, t1 = {0};
    sync1(co, 0, 3, q0, 2, NULL, 0, &t0);
    sync1(co, 1, 3, q1, 1, NULL, 0, &t1);
    ck_assert_str_eq(t0.conflict, t1.conflict);
    AMX_ASSERT_HAS(t0.conflict, "quantizer 'w'");
    AMX_ASSERT_HAS(t0.conflict, "global shape [4] vs [8]");
    AMX_ASSERT_HAS(t0.conflict, "daemon 0 (ranks 0-1)");
    AMX_ASSERT_HAS(t0.conflict, "daemon 1 (ranks 2-3)");
    ck_assert_uint_eq(t0.nrej, 1);
    ck_assert_uint_eq(t0.ncat, 4); /* a, b, c, d */
    ck_assert_int_eq(t0.new_comm, 0);
    ck_assert_uint_eq(t0.gen, s0.gen);
    /* A proposal against the agreed catalog. */
    amx_qspec_t *u0[1] = {unit_spec("a", 5, NULL)};
    answer_t v0 = {0}, v1 = {0};
    sync1(co, 0, 3, u0, 1, NULL, 0, &v0);
    sync1(co, 1, 3, NULL, 0, NULL, 0, &v1);
    AMX_ASSERT_HAS(v1.conflict, "the agreed catalog");
    /* A daemon that restarted re-joins: new communicator next time. */
    answer_t rj = {0};
    join(co, 2, 1, 99, &rj);
    ck_assert_int_eq(rj.called, 1);
    ck_assert_int_eq(rj.rejoined, 1);
    answer_t w0 = {0}, w1 = {0};
    sync1(co, 0, 3, NULL, 0, NULL, 0, &w0);
    sync1(co, 1, 0, NULL, 0, NULL, 0, &w1);
    ck_assert_int_eq(w0.new_comm, 1);
    ck_assert_uint_gt(w0.gen, s0.gen);
    ck_assert_uint_eq(w1.nbehind, 1);
    /* An agreement nobody completes times out naming who is missing. */
    answer_t x0 = {0};
    sync1(co, 0, 3, NULL, 0, NULL, 0, &x0);
    amx_coord_expire(co, 4999);
    ck_assert_int_eq(x0.called, 0);
    amx_coord_expire(co, 5000);
    ck_assert_int_eq(x0.st, AMX_ETIMEDOUT);
    ck_assert_msg(strstr(x0.msg, "daemon 1 (h:1, ranks 2-3)") != NULL, "%s", x0.msg);
    for (int i = 0; i < 2; i++) {
        amx_qspec_free(p0[i]), amx_qspec_free(p1[i]);
        amx_qspec_free(q0[i]);
    }
    amx_qspec_free(q1[0]);
    amx_qspec_free(u0[0]);
    amx_coord_destroy(co);
}
END_TEST

/* Offers by hash: the coordinator asks one daemon for an offer it lacks
 * and the others that make the same offer wait for it, so N identical
 * daemons send it once; an offer asked for but never sent is asked of
 * every participant that waits on it, never a deadlock. */
START_TEST(coordinator_offers_by_hash)
{
    answer_t j[4] = {{0}};
    amx_coord_t *co = two_daemons(j);
    ck_assert_int_eq(j[3].called, 1);
    amx_qspec_t *p[2] = {unit_spec("b", 2, NULL), unit_spec("a", 1, NULL)};
    answer_t a0 = {0}, a1 = {0}, b0 = {0};
    sync_offer(co, 0, p, 2, 0, &a0);
    ck_assert_int_eq(a0.called, 1);
    ck_assert_int_eq(a0.send_offer, 1);
    sync_offer(co, 1, p, 2, 0, &a1); /* the same offer: waits for daemon 0's */
    ck_assert_int_eq(a1.called, 0);
    ck_assert_uint_eq(amx_coord_stats(co)->offers_asked, 1);
    sync_offer(co, 0, p, 2, 1, &b0);
    ck_assert_int_eq(b0.called, 1);
    ck_assert_int_eq(a1.called, 1);
    ck_assert_int_eq(a1.st, AMX_OK);
    ck_assert_int_eq(a1.send_offer, 0);
    ck_assert_uint_eq(a1.ncat, 2);
    ck_assert_uint_eq(a1.hash, b0.hash);
    const amx_coord_stats_t *x = amx_coord_stats(co);
    ck_assert_uint_eq(x->specs_received, 2);
    ck_assert_uint_eq(x->offers_asked, 1);
    ck_assert_uint_eq(x->rounds, 1);
    /* Asked, never sent: daemon 0 is asked for {c}, then comes back by
     * hash again (it restarted); both wait on an offer nobody holds, and
     * both are asked once everyone is here. */
    amx_qspec_t *q[1] = {unit_spec("c", 3, NULL)};
    answer_t c0 = {0}, c0b = {0}, c1 = {0};
    sync_offer(co, 0, q, 1, 0, &c0);
    ck_assert_int_eq(c0.send_offer, 1);
    sync_offer(co, 0, q, 1, 0, &c0b);
    ck_assert_int_eq(c0b.called, 0);
    sync_offer(co, 1, q, 1, 0, &c1);
    ck_assert_int_eq(c0b.called, 1);
    ck_assert_int_eq(c1.called, 1);
    ck_assert_int_eq(c0b.send_offer, 1);
    ck_assert_int_eq(c1.send_offer, 1);
    ck_assert_uint_eq(amx_coord_stats(co)->rounds, 1);
    answer_t d0 = {0}, d1 = {0};
    sync_offer(co, 0, q, 1, 1, &d0);
    sync_offer(co, 1, q, 1, 1, &d1);
    ck_assert_int_eq(d0.called + d1.called, 2);
    ck_assert_uint_eq(d0.ncat, 3);
    ck_assert_uint_eq(amx_coord_stats(co)->rounds, 2);
    ck_assert_uint_eq(amx_coord_stats(co)->specs_received, 3); /* {c} once */
    /* An offer that is not what its hash says is refused. */
    amx_coord_sync_req_t bad = {.offer_hash = offer_hash(p, 2),
                                .offer_count = 1,
                                .offer_included = 1,
                                .job = "j",
                                .daemon = 0,
                                .incarnation = 1,
                                .catalog_hash = held_hash,
                                .proposals = q,
                                .nprop = 1,
                                .deadline_ms = 5000};
    amx_creq_t *h;
    amx_err_t err = {0};
    answer_t e0 = {0};
    ck_assert_int_eq(amx_coord_sync(co, &bad, on_sync, &e0, &h, &err), AMX_EINVAL);
    ck_assert_int_eq(e0.called, 0);
    for (int i = 0; i < 2; i++)
        amx_qspec_free(p[i]);
    amx_qspec_free(q[0]);
    amx_coord_destroy(co);
}
END_TEST

/* A coordinator that restarted knows neither the job nor its catalog: a
 * daemon's agreement request names its ranks (which completes a Join
 * waiting for them), and a daemon holding a catalog the coordinator does
 * not have is asked for it whole before anything is agreed. */
START_TEST(coordinator_restarted_rebuilds_from_members)
{
    amx_coord_t *co = amx_coord_create(43, 1000);
    answer_t j0 = {0};
    join(co, 0, 0, 1, &j0); /* the coordinator's own trainer, ranks 1-3 unknown */
    ck_assert_int_eq(j0.called, 0);
    /* Daemon 1 held an agreed catalog {a, b} and sends only its hash. */
    amx_qspec_t *held[2] = {unit_spec("a", 1, NULL), unit_spec("b", 2, NULL)};
    amx_qspec_t *cp[2] = {amx_qspec_dup(held[0]), amx_qspec_dup(held[1])};
    amx_catalog_t *cat = NULL;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_catalog_build(cp, 2, &cat, &err), AMX_OK);
    uint32_t ranks1[3] = {1, 2, 3};
    amx_coord_sync_req_t r = {.job = "j",
                              .daemon = 1,
                              .incarnation = 1,
                              .last_reconciled = 5,
                              .catalog_hash = cat->hash,
                              .world = 4,
                              .ranks = ranks1,
                              .nranks = 3,
                              .addr = "h:2",
                              .deadline_ms = 5000};
    answer_t s1 = {0};
    amx_creq_t *h = (amx_creq_t *)1;
    ck_assert_int_eq(amx_coord_sync(co, &r, on_sync, &s1, &h, &err), AMX_OK);
    ck_assert_int_eq(s1.called, 1);
    ck_assert_int_eq(s1.send_catalog, 1);
    ck_assert_ptr_null(h); /* nothing waits */
    /* ... but its ranks are known now: the waiting Join completed. */
    ck_assert_int_eq(j0.called, 1);
    ck_assert_int_eq(j0.st, AMX_OK);
    ck_assert_uint_eq(j0.npart, 2);
    /* Whole, it waits for daemon 0, whose own catalog is empty. */
    r.proposals = held;
    r.nprop = 2;
    r.full_catalog = 1;
    r.offer_hash = offer_hash(held, 2);
    r.offer_count = 2;
    r.offer_included = 1;
    answer_t s1b = {0}, s0 = {0};
    ck_assert_int_eq(amx_coord_sync(co, &r, on_sync, &s1b, &h, &err), AMX_OK);
    ck_assert_int_eq(s1b.called, 0);
    amx_qspec_t *p0[1] = {unit_spec("c", 1, NULL)};
    uint32_t ranks0[1] = {0};
    amx_coord_sync_req_t r0 = {.offer_hash = offer_hash(p0, 1),
                               .offer_count = 1,
                               .offer_included = 1,
                               .job = "j",
                               .daemon = 0,
                               .incarnation = 1,
                               .catalog_hash = amx_catalog_hash(NULL, 0),
                               .proposals = p0,
                               .nprop = 1,
                               .world = 4,
                               .ranks = ranks0,
                               .nranks = 1,
                               .addr = "h:1",
                               .deadline_ms = 5000};
    ck_assert_int_eq(amx_coord_sync(co, &r0, on_sync, &s0, &h, &err), AMX_OK);
    ck_assert_int_eq(s0.called + s1b.called, 2);
    ck_assert_uint_eq(s0.ncat, 3); /* a, b from daemon 1, c from daemon 0 */
    ck_assert_uint_eq(s0.hash, s1b.hash);
    ck_assert_uint_eq(s0.nbehind, 1); /* daemon 0, at epoch 0 */
    ck_assert_uint_eq(s0.donor, 1);
    ck_assert_uint_eq(s0.target, 5);
    for (int i = 0; i < 2; i++)
        amx_qspec_free(held[i]);
    amx_qspec_free(p0[0]);
    amx_catalog_free(cat);
    amx_coord_destroy(co);
}
END_TEST

START_TEST(coordinator_join_timeout_and_kv)
{
    amx_coord_t *co = amx_coord_create(42, 1000);
    answer_t a = {0};
    join(co, 1, 0, 1, &a);
    amx_coord_expire(co, 999);
    ck_assert_int_eq(a.called, 0);
    amx_coord_expire(co, 1000);
    ck_assert_int_eq(a.st, AMX_ETIMEDOUT);
    AMX_ASSERT_HAS(a.msg, "ranks 0, 2, 3 never joined");
    uint32_t jobs, waiting, keys;
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(jobs, 0); /* forgotten with its last rank */
    /* KV: a get waits for the set. */
    answer_t g = {0}, g2 = {0};
    amx_creq_t *h;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_kv_get(co, "k", 500, on_kv, &g, &h, &err), AMX_OK);
    ck_assert_int_eq(g.called, 0);
    amx_coord_kv_set(co, "k", "value", 5);
    ck_assert_int_eq(g.called, 1);
    ck_assert_str_eq(g.val, "value");
    ck_assert_int_eq(amx_coord_kv_get(co, "k", 500, on_kv, &g2, &h, &err), AMX_OK);
    ck_assert_str_eq(g2.val, "value");
    answer_t g3 = {0};
    ck_assert_int_eq(amx_coord_kv_get(co, "missing", 500, on_kv, &g3, &h, &err), AMX_OK);
    amx_coord_expire(co, 500);
    ck_assert_int_eq(g3.st, AMX_ETIMEDOUT);
    amx_coord_destroy(co);
}
END_TEST

START_TEST(ranks_are_formatted_as_ranges)
{
    char b[64];
    uint32_t r[7] = {0, 1, 2, 3, 8, 10, 11};
    amx_fmt_ranks(b, sizeof(b), r, 7);
    ck_assert_str_eq(b, "0-3, 8, 10-11");
    amx_fmt_ranks(b, sizeof(b), r, 0);
    ck_assert_str_eq(b, "");
    amx_fmt_ranks(b, sizeof(b), r + 4, 1);
    ck_assert_str_eq(b, "8");
    /* Cut short, never overrun. */
    char small[8];
    memset(small, 'x', sizeof(small));
    amx_fmt_ranks(small, 6, r, 7);
    ck_assert_uint_lt(strlen(small), 6);
    ck_assert_int_eq(small[7], 'x');
}
END_TEST

START_TEST(join_refusals)
{
    amx_coord_t *co = amx_coord_create(7, 1000);
    ck_assert_uint_eq(amx_coord_incarnation(co), 7);
    amx_creq_t *h = (amx_creq_t *)1;
    amx_err_t err = {0};
    answer_t a = {0};
    amx_coord_join_req_t r = {"j", 2, 2, 0, 1, "h:1", 0, 1000};
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, &a, &h, &err), AMX_EINVAL);
    AMX_ASSERT_HAS(err.msg, "rank 2 is out of range for world size 2 (job 'j')");
    ck_assert_ptr_null(h);
    r.world = 0;
    r.rank = 0;
    amx_err_clear(&err);
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, &a, &h, &err), AMX_EINVAL);
    join(co, 0, 0, 1, &a);
    r.world = 2;
    r.rank = 1;
    amx_err_clear(&err);
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, &a, &h, &err), AMX_EPRECOND);
    AMX_ASSERT_HAS(err.msg, "job 'j' exists with world size 4, not 2");
    ck_assert_int_eq(a.called, 0);
    amx_coord_destroy(co);
    /* Destroying it failed the waiting Join. */
    ck_assert_int_eq(a.called, 1);
    ck_assert_int_eq(a.st, AMX_EUNAVAIL);
    AMX_ASSERT_HAS(a.msg, "shutting down");
}
END_TEST

/* An announce (a daemon re-telling the coordinator about a rank it serves)
 * is answered at once, ready or not; a cancelled Join forgets the rank. */
START_TEST(announce_and_cancel)
{
    amx_coord_t *co = amx_coord_create(1, 1000);
    answer_t a = {0}, b = {0};
    amx_coord_join_req_t r = {"j", 2, 0, 0, 1, "h:1", 1, 1000};
    amx_creq_t *h = (amx_creq_t *)1;
    amx_err_t err = {0};
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, &a, &h, &err), AMX_OK);
    ck_assert_int_eq(a.called, 1);
    ck_assert_int_eq(a.st, AMX_OK);
    ck_assert_uint_eq(a.npart, 0); /* not ready: no membership yet */
    ck_assert_ptr_null(h);
    r.announce = 0;
    r.rank = 1;
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, &b, &h, &err), AMX_OK);
    /* Rank 0 was announced: the job is ready with rank 1. */
    ck_assert_int_eq(b.called, 1);
    ck_assert_uint_eq(b.npart, 1);
    /* A Join that waits, cancelled: no callback, and its rank is free. */
    answer_t c = {0};
    r.job = "k";
    r.rank = 0;
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, &c, &h, &err), AMX_OK);
    ck_assert_ptr_nonnull(h);
    uint32_t jobs, waiting, keys;
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(jobs, 2);
    ck_assert_uint_eq(waiting, 1);
    amx_coord_cancel(co, h);
    ck_assert_int_eq(c.called, 0);
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(jobs, 1); /* "k" had no other rank: forgotten */
    ck_assert_uint_eq(waiting, 0);
    /* ... so another world size for "k" is fine now. */
    r.world = 1;
    ck_assert_int_eq(amx_coord_join(co, &r, on_join, &c, &h, &err), AMX_OK);
    ck_assert_int_eq(c.called, 1);
    amx_coord_destroy(co);
}
END_TEST

typedef struct notice {
    int called;
    char job[32];
    uint32_t restarted, npart;
    uint64_t gen;
} notice_t;

static void on_notify(void *ud, const char *job, const amx_membership_t *m, uint32_t restarted,
                      uint64_t gen)
{
    notice_t *n = ud;
    n->called++;
    snprintf(n->job, sizeof(n->job), "%s", job);
    n->restarted = restarted;
    n->npart = m->npart;
    n->gen = gen;
}

/* Members, the notice of a restarted daemon, and a drop: waiting requests
 * fail with ABORTED, the job's rendezvous keys go, others stay. */
START_TEST(members_notify_and_drop)
{
    held_hash = amx_catalog_hash(NULL, 0);
    amx_coord_t *co = amx_coord_create(5, 1000);
    notice_t n = {0};
    amx_coord_set_notify(co, on_notify, &n);
    amx_membership_t m;
    ck_assert_int_eq(amx_coord_members(co, "j", &m), AMX_ENOTFOUND);
    answer_t j[4] = {{0}};
    for (uint32_t r = 0; r < 4; r++)
        join(co, r, r / 2, 1, &j[r]);
    ck_assert_int_eq(amx_coord_members(co, "j", &m), AMX_OK);
    ck_assert_uint_eq(m.npart, 2);
    ck_assert_uint_eq(m.world, 4);
    ck_assert_uint_eq(m.part[1].daemon, 1);
    ck_assert_uint_eq(m.part[1].nranks, 2);
    ck_assert_uint_eq(m.part[1].ranks[0], 2);
    ck_assert_str_eq(m.part[1].addr, "h:1");
    /* A deep copy: freeing one leaves the other. */
    amx_membership_t c;
    ck_assert_int_eq(amx_membership_copy(&m, &c), AMX_OK);
    ck_assert_ptr_ne(c.part, m.part);
    ck_assert_ptr_ne(c.part[0].ranks, m.part[0].ranks);
    amx_membership_free(&m);
    ck_assert_uint_eq(c.part[1].ranks[1], 3);
    amx_membership_free(&c);
    /* No communicator yet: a restart needs no notice. */
    answer_t rj = {0};
    join(co, 3, 1, 2, &rj);
    ck_assert_int_eq(n.called, 0);
    /* An agreement makes generation 1, and drops the job's rendezvous
     * keys of the generation before; then daemon 1 restarts again. */
    amx_coord_kv_set(co, "comm/j/0/stale", "s", 1);
    uint32_t jobs, waiting, keys;
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(keys, 1);
    answer_t s0 = {0}, s1 = {0};
    sync1(co, 0, 0, NULL, 0, NULL, 0, &s0);
    sync1(co, 1, 0, NULL, 0, NULL, 0, &s1);
    ck_assert_int_eq(s0.st, AMX_OK);
    ck_assert_int_eq(s0.new_comm, 1);
    ck_assert_uint_ne(s0.gen, 0);
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(keys, 0);
    join(co, 2, 1, 3, &rj);
    ck_assert_int_eq(n.called, 1);
    ck_assert_str_eq(n.job, "j");
    ck_assert_uint_eq(n.restarted, 1);
    ck_assert_uint_eq(n.npart, 2);
    ck_assert_uint_eq(n.gen, s0.gen);
    /* Keys: the job's rendezvous keys go with it. */
    amx_coord_kv_set(co, "comm/j/1/rank0", "a", 1);
    amx_coord_kv_set(co, "comm/other/1/rank0", "b", 1);
    answer_t w = {0};
    sync1(co, 0, 0, NULL, 0, NULL, 0, &w);
    ck_assert_int_eq(w.called, 0);
    ck_assert_int_eq(amx_coord_drop(co, "j", &m), AMX_OK);
    ck_assert_uint_eq(m.npart, 2);
    amx_membership_free(&m);
    ck_assert_int_eq(w.called, 1);
    ck_assert_int_eq(w.st, AMX_EABORTED);
    AMX_ASSERT_HAS(w.msg, "the job was dropped");
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(jobs, 0);
    ck_assert_uint_eq(waiting, 0);
    ck_assert_uint_eq(keys, 1);
    ck_assert_int_eq(amx_coord_drop(co, "j", &m), AMX_ENOTFOUND);
    amx_coord_destroy(co);
}
END_TEST

START_TEST(kv_overwrite_cancel_and_fail_all)
{
    amx_coord_t *co = amx_coord_create(1, 1000);
    amx_creq_t *h;
    amx_err_t err = {0};
    answer_t a = {0}, b = {0}, c = {0};
    /* Two gets wait for one key; a set answers both. */
    ck_assert_int_eq(amx_coord_kv_get(co, "k", 500, on_kv, &a, &h, &err), AMX_OK);
    ck_assert_int_eq(amx_coord_kv_get(co, "k", 500, on_kv, &b, &h, &err), AMX_OK);
    amx_coord_kv_set(co, "other", "x", 1);
    ck_assert_int_eq(a.called + b.called, 0);
    amx_coord_kv_set(co, "k", "one", 3);
    ck_assert_str_eq(a.val, "one");
    ck_assert_str_eq(b.val, "one");
    /* A set replaces the value; binary values keep their length. */
    amx_coord_kv_set(co, "k", "two\0z", 5);
    answer_t d = {0};
    ck_assert_int_eq(amx_coord_kv_get(co, "k", 500, on_kv, &d, &h, &err), AMX_OK);
    ck_assert_ptr_null(h);
    ck_assert_int_eq(memcmp(d.val, "two\0z", 5), 0);
    uint32_t jobs, waiting, keys;
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(keys, 2);
    /* A cancelled get is never answered. */
    ck_assert_int_eq(amx_coord_kv_get(co, "later", 500, on_kv, &c, &h, &err), AMX_OK);
    amx_coord_cancel(co, h);
    amx_coord_kv_set(co, "later", "v", 1);
    ck_assert_int_eq(c.called, 0);
    /* fail_all: every waiting request fails with UNAVAILABLE and the
     * reason; the coordinator stays usable. */
    answer_t e = {0}, f = {0};
    ck_assert_int_eq(amx_coord_kv_get(co, "never", 500, on_kv, &e, &h, &err), AMX_OK);
    join(co, 0, 0, 1, &f);
    amx_coord_fail_all(co, "the daemon is stopping");
    ck_assert_int_eq(e.st, AMX_EUNAVAIL);
    ck_assert_str_eq(e.msg, "the daemon is stopping");
    ck_assert_int_eq(f.st, AMX_EUNAVAIL);
    amx_coord_counts(co, &jobs, &waiting, &keys);
    ck_assert_uint_eq(waiting, 0);
    answer_t g = {0};
    ck_assert_int_eq(amx_coord_kv_get(co, "later", 500, on_kv, &g, &h, &err), AMX_OK);
    ck_assert_str_eq(g.val, "v");
    amx_coord_destroy(co);
}
END_TEST

int main(void)
{
    amx_log_level = AMX_LOG_ERROR;
    Suite *s = suite_create("coord");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 30);
    tcase_add_test(tc, coordinator_membership_and_agreement);
    tcase_add_test(tc, coordinator_restarted_rebuilds_from_members);
    tcase_add_test(tc, coordinator_offers_by_hash);
    tcase_add_test(tc, coordinator_master_grows);
    tcase_add_test(tc, coordinator_join_timeout_and_kv);
    tcase_add_test(tc, ranks_are_formatted_as_ranges);
    tcase_add_test(tc, join_refusals);
    tcase_add_test(tc, announce_and_cancel);
    tcase_add_test(tc, members_notify_and_drop);
    tcase_add_test(tc, kv_overwrite_cancel_and_fail_all);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
