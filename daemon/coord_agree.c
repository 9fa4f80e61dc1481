/*
 * coord_agree.c - the coordinator's agreement barrier (coord.h): offers by
 * hash, one per distinct offer and round; the merge of a round's offers into
 * the master catalog, with conflicts, resets, donors and communicator
 * generations; the master itself, which grows by what a round adds; the
 * master's version log for answers that carry only what changed. Loop
 * thread only; no I/O of its own.
 */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord_impl.h"
#include "grow.h"
#include "log.h"
#include "strmap.h"

/* Offers this large give their memory back to the system when freed: the
 * first agreement of a big catalog would otherwise leave the coordinator's
 * resident size at its peak (the request, its parse and the offer). */
#define TRIM_SPECS 16384

void amx__coord_offers_clear(cjob_t *j)
{
    size_t freed = 0;
    for (size_t i = 0; i < j->noffers; i++) {
        for (uint32_t k = 0; k < j->offers[i].n; k++)
            amx_qspec_free(j->offers[i].specs[k]);
        free(j->offers[i].specs);
        freed += j->offers[i].n;
    }
    j->noffers = 0;
    j->nasked = 0;
    if (freed >= TRIM_SPECS)
        malloc_trim(0);
}

static int offer_asked(const cjob_t *j, uint64_t hash)
{
    for (size_t i = 0; i < j->nasked; i++)
        if (j->asked[i] == hash)
            return 1;
    return 0;
}

static coffer_t *offer_find(cjob_t *j, uint64_t hash)
{
    for (size_t i = 0; i < j->noffers; i++)
        if (j->offers[i].hash == hash)
            return &j->offers[i];
    return NULL;
}

/* Records an offer (copies of its specs), after checking that they are
 * what its hash says. */
static amx_status_t offer_add(amx_coord_t *co, cjob_t *j, const amx_coord_sync_req_t *req,
                              amx_err_t *err)
{
    size_t n = req->nprop;
    if (n != req->offer_count)
        return amx_err_set(err, AMX_EINVAL, "an offer of %u specs carries %zu", req->offer_count,
                           n);
    amx_qspec_t **specs = calloc(n ? n : 1, sizeof(*specs));
    if (specs == NULL ||
        amx_grow(&j->offers, &j->cap_offers, j->noffers + 1, sizeof(coffer_t), 4, 0) != 0) {
        free(specs);
        return amx_err_set(err, AMX_ENOMEM, "out of memory recording an offer");
    }
    for (size_t i = 0; i < n; i++)
        if ((specs[i] = amx_qspec_dup(req->proposals[i])) == NULL) {
            for (size_t k = 0; k < i; k++)
                amx_qspec_free(specs[k]);
            free(specs);
            return amx_err_set(err, AMX_ENOMEM, "out of memory recording an offer");
        }
    qsort(specs, n, sizeof(*specs), amx_qspec_name_cmp);
    if (amx_catalog_hash(specs, (uint32_t)n) != req->offer_hash) {
        for (size_t k = 0; k < n; k++)
            amx_qspec_free(specs[k]);
        free(specs);
        return amx_err_set(err, AMX_EINVAL,
                           "daemon %u's offer of %zu specs does not have the hash it names",
                           req->daemon, n);
    }
    j->offers[j->noffers++] = (coffer_t){req->offer_hash, specs, (uint32_t)n, req->daemon, 0};
    co->stats.specs_received += n;
    return AMX_OK;
}

/* ---- the master ---- */

void amx__coord_master_free(cmaster_t *m)
{
    for (uint32_t i = 0; i < m->view.n; i++)
        amx_qspec_free(m->view.agreed[i]);
    free(m->view.agreed);
    free(m->view.q);
    amx_strmap_free(&m->names);
    amx_strmap_free(&m->groups);
    memset(m, 0, sizeof(*m));
    m->view.hash = amx_catalog_hash(NULL, 0);
}

static const amx_qspec_t *master_find(const cmaster_t *m, const char *name)
{
    uint32_t i;
    return amx_strmap_get(&m->names, name, &i) ? m->view.agreed[i] : NULL;
}

/* The first quantizer of the master in peer group `g`, or NULL. */
static const amx_qspec_t *master_group(const cmaster_t *m, const char *g)
{
    uint32_t i;
    return amx_strmap_get(&m->groups, g, &i) ? m->view.agreed[i] : NULL;
}

/*
 * Adds k specs whose names the master lacks, in the order given (the order
 * they are agreed in); the master owns them once this returns 0. -1: out
 * of memory, the master unchanged and the specs still the caller's. The
 * hash is the caller's to set. O(k log(n + k)) comparisons, O(k) map
 * insertions, and one move of each pointer of q that sorts after the
 * first new name.
 */
static int master_add(cmaster_t *m, amx_qspec_t *const *specs, size_t k)
{
    amx_coord_catalog_t *v = &m->view;
    size_t n = v->n, ngroups = 0;
    for (size_t i = 0; i < k; i++)
        ngroups += specs[i]->peer_group[0] != '\0';
    amx_qspec_t **fresh = malloc((k ? k : 1) * sizeof(*fresh));
    if (fresh == NULL || n + k > UINT32_MAX ||
        amx_grow(&v->q, &m->cap_q, n + k, sizeof(*v->q), 64, 0) != 0 ||
        amx_grow(&v->agreed, &m->cap_agreed, n + k, sizeof(*v->agreed), 64, 0) != 0 ||
        amx_strmap_reserve(&m->names, n + k) != 0 ||
        amx_strmap_reserve(&m->groups, m->groups.len + ngroups) != 0) {
        free(fresh);
        return -1;
    }
    /* From here nothing can fail (the maps have their room). The new
     * names go into q from the last: each one's place among the old ones
     * by a binary search, the old ones after it moved up once. */
    memcpy(fresh, specs, k * sizeof(*fresh));
    size_t sorted = 1; /* often in order already: one offer's adds are */
    while (sorted < k && amx_qspec_name_cmp(&fresh[sorted - 1], &fresh[sorted]) < 0)
        sorted++;
    if (sorted < k)
        qsort(fresh, k, sizeof(*fresh), amx_qspec_name_cmp);
    size_t end = n;
    for (size_t b = k; b-- > 0;) {
        size_t lo = 0, hi = end;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (strcmp(v->q[mid]->name, fresh[b]->name) < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        memmove(&v->q[lo + b + 1], &v->q[lo], (end - lo) * sizeof(*v->q));
        v->q[lo + b] = fresh[b];
        end = lo;
    }
    free(fresh);
    for (size_t i = 0; i < k; i++) {
        const amx_qspec_t *s = specs[i];
        uint32_t at = (uint32_t)(n + i), dummy;
        v->agreed[at] = specs[i];
        amx_strmap_put(&m->names, s->name, at);
        if (s->peer_group[0] != '\0' && !amx_strmap_get(&m->groups, s->peer_group, &dummy))
            amx_strmap_put(&m->groups, s->peer_group, at);
    }
    v->n = (uint32_t)(n + k);
    return 0;
}

/* The master changed: a version (the oldest goes past KEEP_VERSIONS). */
static void note_version(cjob_t *j)
{
    if (j->nver == KEEP_VERSIONS) {
        memmove(j->ver, j->ver + 1, (KEEP_VERSIONS - 1) * sizeof(cver_t));
        j->nver--;
    }
    if (amx_grow(&j->ver, &j->cap_ver, j->nver + 1, sizeof(cver_t), 8, 0) == 0)
        j->ver[j->nver++] = (cver_t){j->master.view.hash, j->master.view.n};
}

/*
 * The master's new hash without hashing it all again, when the round adopts
 * exactly one daemon's catalog and offer: its catalog is the master (a
 * daemon that holds another one sends it whole, full), the one offer merged
 * is its own and every spec of it was added (none known, none in conflict),
 * so the new master is what that daemon hashed as union_hash. 1 and *h, or
 * 0: the caller hashes the master.
 */
static int adopted_hash(cjob_t *j, amx_creq_t *const *w, const coffer_t *only, size_t nmerged,
                        size_t nadd, uint64_t old_hash, uint64_t *h)
{
    if (nmerged != 1 || nadd != only->n)
        return 0;
    for (uint32_t p = 0; p < j->mship.npart; p++)
        if (w[p]->offer_hash == only->hash && !w[p]->full && w[p]->catalog_hash == old_hash &&
            w[p]->union_hash != 0) {
            *h = w[p]->union_hash;
            return 1;
        }
    return 0;
}

int amx__coord_sync_waiting(amx_coord_t *co, cjob_t *j, uint32_t daemon, amx_creq_t **out)
{
    (void)co;
    amx_creq_t *r = daemon < j->cap_sync_of ? j->sync_of[daemon] : NULL;
    if (r != NULL && out != NULL)
        *out = r;
    return r != NULL;
}

static const char *daemon_ranks(cjob_t *j, uint32_t d, char *buf, size_t len)
{
    for (uint32_t p = 0; p < j->mship.npart; p++)
        if (j->mship.part[p].daemon == d) {
            char r[160];
            amx_fmt_ranks(r, sizeof(r), j->mship.part[p].ranks, j->mship.part[p].nranks);
            snprintf(buf, len, "daemon %u (ranks %s)", d, r);
            return buf;
        }
    snprintf(buf, len, "daemon %u", d);
    return buf;
}

/* Every participant is waiting: compute the one answer and give it to all. */
static void complete_sync(amx_coord_t *co, cjob_t *j)
{
    amx_creq_t **w = calloc(j->mship.npart, sizeof(*w));
    size_t nadd = 0, cap_add = 0, nrej = 0, nconf = 0, nres = 0;
    add_t *adds = NULL;
    amx_strmap_t add_idx = {0}, rej_idx = {0}, res_idx = {0}; /* name -> index */
    char **rej = NULL, **res = NULL;
    char conflict[1024] = "";
    uint32_t *behind = NULL;
    const char *oom = NULL;
    const coffer_t *only = NULL; /* the offer merged, when there is one */
    size_t nmerged = 0;
    if (w == NULL) {
        oom = "out of memory";
        goto fail;
    }
    for (uint32_t p = 0; p < j->mship.npart; p++)
        amx__coord_sync_waiting(co, j, j->mship.part[p].daemon, &w[p]);
    cmaster_t *master = &j->master;
    /* 1. The offers of this round against the master and against each
     * other: each distinct one once, in the participants' order (so that
     * a conflict names the same daemons whatever the order of arrival).
     * An offer no waiting request names (superseded) is left out. */
    for (size_t o = 0; o < j->noffers; o++)
        j->offers[o].done = 0;
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        coffer_t *of = w[p]->offer_hash != 0 ? offer_find(j, w[p]->offer_hash) : NULL;
        if (of == NULL || of->done)
            continue;
        of->done = 1;
        only = of;
        nmerged++;
        uint32_t origin = w[p]->daemon; /* the first participant that offers it */
        for (size_t i = 0; i < of->n; i++) {
            amx_qspec_t *s = of->specs[i];
            const amx_qspec_t *other = master_find(master, s->name);
            uint32_t other_d = UINT32_MAX;
            if (other != NULL) {
                if (amx_qspec_equal(other, s))
                    continue;
            } else {
                uint32_t a;
                int known = amx_strmap_get(&add_idx, s->name, &a);
                if (known && amx_qspec_equal(adds[a].spec, s))
                    continue;
                if (known) {
                    other = adds[a].spec;
                    other_d = adds[a].origin;
                } else {
                    if (amx_grow(&adds, &cap_add, nadd + 1, sizeof(*adds), 64, 0) != 0) {
                        oom = "out of memory merging proposals";
                        goto fail;
                    }
                    if (amx_strmap_put(&add_idx, s->name, (uint32_t)nadd) != 0) {
                        oom = "out of memory merging proposals";
                        goto fail;
                    }
                    adds[nadd++] = (add_t){s, origin, &of->specs[i]};
                    continue;
                }
            }
            /* A conflict. */
            uint32_t seen;
            if (!amx_strmap_get(&rej_idx, s->name, &seen)) {
                char **q = realloc(rej, (nrej + 1) * sizeof(char *));
                if (q == NULL || (q[nrej] = strdup(s->name)) == NULL ||
                    amx_strmap_put(&rej_idx, q[nrej], (uint32_t)nrej) != 0) {
                    if (q != NULL && q[nrej] != NULL)
                        free(q[nrej]);
                    rej = q ? q : rej;
                    oom = "out of memory";
                    goto fail;
                }
                rej = q;
                nrej++;
            }
            if (nconf++ == 0) {
                char diff[512], d1[200], d2[200];
                amx_qspec_diff(other, s, diff, sizeof(diff));
                if (other_d == UINT32_MAX)
                    snprintf(d1, sizeof(d1), "the agreed catalog");
                else
                    daemon_ranks(j, other_d, d1, sizeof(d1));
                daemon_ranks(j, origin, d2, sizeof(d2));
                snprintf(conflict, sizeof(conflict),
                         "the catalog of job '%s' cannot be agreed: quantizer '%s' is declared "
                         "with %s by %s and by %s",
                         j->name, s->name, diff, d1, d2);
            }
        }
    }
    /* 1b. A peer group's mode is the group's: a proposal whose group
     * already has another mode (in the master, or in an earlier proposal)
     * is a conflict too. */
    {
        amx_strmap_t gm = {0}; /* group new to the master -> its first add */
        for (size_t a = 0; a < nadd; a++) {
            const amx_qspec_t *s = adds[a].spec;
            uint32_t k = UINT32_MAX, dummy;
            if (s->peer_group[0] == '\0' || amx_strmap_get(&rej_idx, s->name, &dummy))
                continue;
            const amx_qspec_t *o = master_group(master, s->peer_group);
            if (o == NULL && amx_strmap_get(&gm, s->peer_group, &k))
                o = adds[k].spec;
            if (o == NULL) {
                if (amx_strmap_put(&gm, s->peer_group, (uint32_t)a) != 0) {
                    amx_strmap_free(&gm);
                    oom = "out of memory checking peer groups";
                    goto fail;
                }
                continue;
            }
            if (o->peer_mode == s->peer_mode)
                continue;
            char **q = realloc(rej, (nrej + 1) * sizeof(char *));
            if (q == NULL || (q[nrej] = strdup(s->name)) == NULL ||
                amx_strmap_put(&rej_idx, q[nrej], (uint32_t)nrej) != 0) {
                if (q != NULL && q[nrej] != NULL)
                    free(q[nrej]);
                rej = q ? q : rej;
                amx_strmap_free(&gm);
                oom = "out of memory";
                goto fail;
            }
            rej = q;
            nrej++;
            if (nconf++ == 0) {
                char d1[200], d2[200];
                if (k == UINT32_MAX)
                    snprintf(d1, sizeof(d1), "the agreed catalog");
                else
                    daemon_ranks(j, adds[k].origin, d1, sizeof(d1));
                daemon_ranks(j, adds[a].origin, d2, sizeof(d2));
                snprintf(conflict, sizeof(conflict),
                         "the catalog of job '%s' cannot be agreed: peer group '%s' has peer_mode "
                         "%s (quantizer '%s', %s) and %s (quantizer '%s', %s); every member of a "
                         "peer group must declare the same peer_mode",
                         j->name, s->peer_group, amx_peer_mode_name(o->peer_mode), o->name, d1,
                         amx_peer_mode_name(s->peer_mode), s->name, d2);
            }
        }
        amx_strmap_free(&gm);
    }
    if (nconf > 0) {
        size_t n = strlen(conflict);
        if (nrej > 1)
            n += (size_t)snprintf(conflict + n, sizeof(conflict) - n,
                                  " (and %zu more quantizer(s) in conflict)", nrej - 1);
        snprintf(conflict + n, sizeof(conflict) - n,
                 "; every rank must declare the same spec: the conflicting registrations were "
                 "dropped, register them again consistently");
    }
    /* 2. The new master: the old one plus the proposals not in conflict. */
    size_t keep = 0;
    uint32_t dummy;
    for (size_t a = 0; a < nadd; a++)
        if (!amx_strmap_get(&rej_idx, adds[a].spec->name, &dummy))
            adds[keep++] = adds[a];
    nadd = keep;
    if (nadd > 0) {
        /* The new specs move from the offers (which go at the end of the
         * round) into the master: nothing is copied, so the coordinator
         * holds one copy of each spec. */
        amx_qspec_t **fresh = malloc(nadd * sizeof(*fresh));
        uint64_t old_hash = master->view.hash, h;
        for (size_t a = 0; fresh != NULL && a < nadd; a++)
            fresh[a] = *adds[a].slot;
        if (fresh == NULL || master_add(master, fresh, nadd) != 0) {
            free(fresh); /* the master is as it was */
            oom = "out of memory adding to the master catalog";
            goto fail;
        }
        free(fresh);
        for (size_t a = 0; a < nadd; a++)
            *adds[a].slot = NULL;
        /* The hash is of the whole catalog in name order (FNV-1a, which
         * cannot take an insertion without hashing what follows it again,
         * and starts with the count): taken from the daemon whose catalog
         * and offer the round adopts when one does, else computed. */
        if (!adopted_hash(j, w, only, nmerged, nadd, old_hash, &h))
            h = amx_catalog_hash(master->view.q, master->view.n);
        master->view.hash = h;
        note_version(j);
    }
    /* 3. Resets of every daemon, names of the master only. */
    for (uint32_t p = 0; p < j->mship.npart; p++)
        for (size_t i = 0; i < w[p]->nresets; i++) {
            const char *s = w[p]->resets[i];
            if (master_find(master, s) == NULL || amx_strmap_get(&res_idx, s, &dummy))
                continue;
            char **q = realloc(res, (nres + 1) * sizeof(char *));
            if (q == NULL || amx_strmap_put(&res_idx, s, (uint32_t)nres) != 0) {
                res = q ? q : res;
                oom = "out of memory";
                goto fail;
            }
            res = q;
            res[nres++] = w[p]->resets[i]; /* borrowed until the answers are given */
        }
    /* 4. Who is behind, and who gives them the state. */
    uint64_t target = 0;
    for (uint32_t p = 0; p < j->mship.npart; p++)
        if (w[p]->last_reconciled > target)
            target = w[p]->last_reconciled;
    uint32_t donor = UINT32_MAX;
    size_t nbehind = 0;
    behind = calloc(j->mship.npart, sizeof(uint32_t));
    if (behind == NULL) {
        oom = "out of memory";
        goto fail;
    }
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        if (w[p]->last_reconciled < target)
            behind[nbehind++] = w[p]->daemon;
        else if (donor == UINT32_MAX)
            donor = w[p]->daemon;
    }
    /* 5. The communicator. */
    int new_comm = j->comm_dirty || j->comm_gen == 0;
    for (uint32_t p = 0; p < j->mship.npart; p++)
        new_comm |= w[p]->need_comm;
    if (new_comm) {
        char prefix[200];
        snprintf(prefix, sizeof(prefix), "comm/%s/", j->name);
        amx__coord_kv_drop_prefix(co, prefix);
        j->comm_gen++;
        j->comm_dirty = 0;
    }
    j->seq++;
    AMX_INFO("coord",
             "job %s: agreement %llu: %u quantizers (%zu new%s), epoch %llu, %zu "
             "behind, communicator generation %llu%s, coordinator incarnation %016llx",
             j->name, (unsigned long long)j->seq, master->view.n, nadd, nconf ? ", conflicts" : "",
             (unsigned long long)target, nbehind, (unsigned long long)j->comm_gen,
             new_comm ? " (new)" : "", (unsigned long long)co->incarnation);
    amx_coord_sync_ans_t ans = {
        .seq = j->seq,
        .catalog_hash = master->view.hash,
        .catalog = &master->view,
        .rejected = rej,
        .nrejected = nrej,
        .conflict = nconf ? conflict : NULL,
        .resets = res,
        .nresets = nres,
        .target_epoch = target,
        .donor = donor,
        .behind = behind,
        .nbehind = nbehind,
        .comm_gen = j->comm_gen,
        .new_comm = new_comm,
        .members = &j->mship,
        .members_hash = amx_membership_hash(&j->mship),
        .coord_inc = co->incarnation,
        .versions = j->ver,
        .nversions = j->nver,
        .stats = &co->stats,
        .round = ++co->stats.rounds,
    };
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        amx__coord_req_unlink(co, w[p]);
        w[p]->cb.sync(w[p]->ud, AMX_OK, NULL, &ans);
    }
    for (uint32_t p = 0; p < j->mship.npart; p++)
        amx__coord_req_free(w[p]);
    amx__coord_offers_clear(j); /* the round is over */
    goto out;
fail:
    AMX_ERROR("coord", "job %s: agreement failed: %s", j->name, oom);
    for (uint32_t p = 0; w != NULL && p < j->mship.npart; p++)
        amx__coord_req_fail(co, w[p], AMX_ENOMEM, oom);
out:
    amx_strmap_free(&add_idx);
    amx_strmap_free(&rej_idx);
    amx_strmap_free(&res_idx);
    free(w);
    free(adds);
    for (size_t i = 0; i < nrej; i++)
        free(rej[i]);
    free(rej);
    free(res);
    free(behind);
}

void amx__coord_try_sync(amx_coord_t *co, cjob_t *j)
{
    if (!j->ready || amx__coord_build_mship(co, j) != AMX_OK || j->nsync < j->mship.npart)
        return;
    for (uint32_t p = 0; p < j->mship.npart; p++)
        if (!amx__coord_sync_waiting(co, j, j->mship.part[p].daemon, NULL))
            return;
    /* Everyone is here: an offer that another daemon was asked for but
     * never sent (it went away, or was superseded) is asked of each
     * participant that waits on it; the round completes when they resend. */
    int missing = 0;
    for (uint32_t p = 0; p < j->mship.npart; p++) {
        amx_creq_t *r = NULL;
        amx__coord_sync_waiting(co, j, j->mship.part[p].daemon, &r);
        if (r == NULL || r->offer_hash == 0 || offer_find(j, r->offer_hash) != NULL)
            continue;
        missing = 1;
        co->stats.offers_asked++;
        amx__coord_req_unlink(co, r);
        amx_coord_sync_ans_t ans = {.send_offer = 1, .coord_inc = co->incarnation};
        r->cb.sync(r->ud, AMX_OK, NULL, &ans);
        amx__coord_req_free(r);
    }
    if (!missing)
        complete_sync(co, j);
}

amx_status_t amx_coord_sync(amx_coord_t *co, const amx_coord_sync_req_t *req, amx_coord_sync_cb cb,
                            void *ud, amx_creq_t **h, amx_err_t *err)
{
    *h = NULL;
    cjob_t *j = amx__coord_find(co, req->job);
    if (j == NULL) {
        /* Unknown here: the coordinator restarted (or the job was dropped
         * meanwhile). Rebuild the membership from what the daemons say. */
        if (req->world == 0 || req->nranks == 0)
            return amx_err_set(err, AMX_ENOTFOUND, "job '%s' is not known to the coordinator",
                               req->job);
        if ((j = amx__coord_job_new(co, req->job, req->world)) == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        AMX_INFO("coord", "job %s: rebuilding its membership from daemon %u's agreement request",
                 req->job, req->daemon);
    }
    if (req->world != 0 && req->world != j->world)
        return amx_err_set(err, AMX_EPRECOND, "job '%s' has world size %u here, not %u", req->job,
                           j->world, req->world);
    for (uint32_t k = 0; k < req->nranks; k++) {
        uint32_t r = req->ranks[k];
        if (r >= j->world)
            return amx_err_set(err, AMX_EINVAL, "rank %u is out of range for job '%s'", r,
                               req->job);
        if (j->host[r] != 0 && j->host[r] - 1 != req->daemon)
            return amx_err_set(err, AMX_EPRECOND,
                               "daemon %u claims rank %u of job '%s', which daemon %u serves",
                               req->daemon, r, req->job, j->host[r] - 1);
    }
    for (uint32_t k = 0; k < req->nranks; k++)
        if (j->host[req->ranks[k]] == 0) {
            j->host[req->ranks[k]] = req->daemon + 1;
            j->njoined++;
            j->mship_dirty = 1;
        }
    if (amx__coord_note_daemon(j, req->daemon, req->incarnation, req->addr))
        j->comm_dirty = 1;
    if (!j->ready && j->njoined == j->world) {
        j->ready = 1;
        AMX_INFO("coord", "job %s: all %u ranks known again (from daemon %u's agreement request)",
                 j->name, j->world, req->daemon);
        /* Trainers of a daemon that restarted with the coordinator wait in
         * Join for ranks the other daemons' agreement requests named. */
        amx__coord_complete_joins(co, j);
    }
    if (j->ready && amx__coord_daemon_of(j, req->daemon) != NULL) {
        /* The ranks it names were checked above: one of them is its own
         * unless it names none (then every rank is looked at). */
        int member = 0;
        for (uint32_t k = 0; k < req->nranks && !member; k++)
            member = j->host[req->ranks[k]] - 1 == req->daemon;
        for (uint32_t r = 0; r < j->world && !member && req->nranks == 0; r++)
            member = j->host[r] - 1 == req->daemon;
        if (!member)
            return amx_err_set(err, AMX_EPRECOND,
                               "daemon %u hosts no rank of job '%s' and takes no part in it",
                               req->daemon, req->job);
    }
    /* A daemon whose agreed catalog this coordinator does not hold must
     * send it whole first: otherwise what only its ranks registered would
     * be missing from the master, and every daemon would drop it. */
    uint64_t master_hash = j->master.view.hash;
    if (!req->full_catalog && req->catalog_hash != master_hash) {
        AMX_INFO("coord",
                 "job %s: daemon %u holds catalog %016llx, not the master %016llx: asking for it "
                 "whole",
                 j->name, req->daemon, (unsigned long long)req->catalog_hash,
                 (unsigned long long)master_hash);
        co->stats.catalogs_asked++;
        amx_coord_sync_ans_t ans = {.send_catalog = 1, .coord_inc = co->incarnation};
        cb(ud, AMX_OK, NULL, &ans);
        return AMX_OK;
    }
    /* Its offer, by hash: the coordinator keeps one copy per distinct
     * offer of the round, and asks for the specs only when it has none
     * and has not asked another daemon for the same offer already (then
     * this request waits; should that offer still be missing when every
     * participant has arrived, amx__coord_try_sync asks this daemon). */
    if (req->offer_count > 0 && offer_find(j, req->offer_hash) == NULL) {
        if (!req->offer_included && !offer_asked(j, req->offer_hash)) {
            if (amx_grow(&j->asked, &j->cap_asked, j->nasked + 1, sizeof(*j->asked), 8, 0) != 0)
                return amx_err_set(err, AMX_ENOMEM, "out of memory");
            j->asked[j->nasked++] = req->offer_hash;
            co->stats.offers_asked++;
            amx_coord_sync_ans_t ans = {.send_offer = 1, .coord_inc = co->incarnation};
            cb(ud, AMX_OK, NULL, &ans);
            return AMX_OK;
        }
        if (req->offer_included)
            AMX_CHECK(offer_add(co, j, req, err));
    } else if (req->offer_included) {
        co->stats.offers_known++; /* sent anyway (small), already held */
    }
    if (amx_grow(&j->sync_of, &j->cap_sync_of, (size_t)req->daemon + 1, sizeof(*j->sync_of), 16,
                 1) != 0)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    co->stats.syncs++;
    amx_creq_t *old;
    if (amx__coord_sync_waiting(co, j, req->daemon, &old))
        amx__coord_req_fail(co, old, AMX_EABORTED, "superseded by a newer agreement request");
    amx_creq_t *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    r->kind = REQ_SYNC;
    r->job = j;
    r->daemon = req->daemon;
    r->incarnation = req->incarnation;
    r->last_reconciled = req->last_reconciled;
    r->catalog_hash = req->catalog_hash;
    r->offer_hash = req->offer_count > 0 ? req->offer_hash : 0;
    r->union_hash = req->union_hash;
    r->need_comm = req->need_comm;
    r->full = req->full_catalog;
    r->deadline = req->deadline_ms;
    r->cb.sync = cb;
    r->ud = ud;
    r->resets = calloc(req->nresets ? req->nresets : 1, sizeof(char *));
    int ok = r->resets != NULL;
    for (size_t i = 0; ok && i < req->nresets; i++)
        ok = (r->resets[r->nresets++] = strdup(req->resets[i])) != NULL;
    if (!ok) {
        amx__coord_req_free(r);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    amx__coord_req_link(co, r);
    *h = r;
    amx__coord_try_sync(co, j);
    if (!amx__coord_sync_waiting(co, j, req->daemon, NULL))
        *h = NULL; /* answered already */
    return AMX_OK;
}
