/* snapshot.c - a job's durable state on disk (snapshot.h). */
#include "snapshot.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "bytebuf.h"
#include "catalog.h"

#define MAGIC 0x53584d41u /* "AMXS" */

/* ---- encoding the job section ---- */

amx_status_t amx_snapshot_encode_meta(const amx_snap_meta_t *m, void **out, size_t *len,
                                      amx_err_t *err)
{
    amx_wbuf_t w = {0};
    amx_put32(&w, MAGIC);
    amx_put32(&w, AMX_SNAPSHOT_VERSION);
    amx_put64(&w, 0); /* section length, below */
    amx_putstr(&w, m->job);
    amx_put32(&w, m->world);
    amx_put64(&w, m->epochs_ok);
    amx_put64(&w, m->epochs_failed);
    amx_put64(&w, m->state_len);
    amx_put32(&w, m->nranks);
    for (uint32_t i = 0; i < m->nranks; i++) {
        const amx_snap_rank_t *r = &m->ranks[i];
        amx_put32(&w, r->rank);
        amx_put32(&w, r->n);
        for (uint32_t k = 0; k < r->n; k++) {
            const amx_placement_t *pl = &r->pls[k].pl;
            amx_putstr(&w, r->pls[k].name);
            amx_put32(&w, pl->ndim);
            amx_put(&w, pl->off, sizeof(pl->off));
            amx_put(&w, pl->shape, sizeof(pl->shape));
        }
    }
    amx_put32(&w, m->nprev);
    if (m->nprev > 0) {
        amx_put(&w, m->prev_ok, m->nprev);
        amx_put(&w, m->prev_ga, (size_t)m->nprev * 4);
        amx_put(&w, m->prev_gs, (size_t)m->nprev * 4);
    }
    if (w.oom) {
        free(w.p);
        return amx_err_set(err, AMX_ENOMEM, "out of memory encoding the snapshot of job '%s'",
                           m->job);
    }
    uint64_t body = w.len;
    memcpy(w.p + 8, &body, 8);
    uint64_t sum = amx_checksum64(w.p, body);
    amx_put64(&w, sum);
    static const unsigned char z[8] = {0};
    amx_put(&w, z, (8 - w.len % 8) % 8);
    if (w.oom) {
        free(w.p);
        return amx_err_set(err, AMX_ENOMEM, "out of memory encoding the snapshot of job '%s'",
                           m->job);
    }
    *out = w.p;
    *len = w.len;
    return AMX_OK;
}

/* ---- writing ---- */

static int write_all(int fd, const void *a, size_t alen, const void *b, size_t blen)
{
    struct iovec v[2] = {{(void *)a, alen}, {(void *)b, blen}};
    int iv = 0;
    while (iv < 2) {
        if (v[iv].iov_len == 0) {
            iv++;
            continue;
        }
        ssize_t n = writev(fd, v + iv, 2 - iv);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        size_t k = (size_t)n;
        while (iv < 2 && k >= v[iv].iov_len) {
            k -= v[iv].iov_len;
            v[iv].iov_len = 0;
            iv++;
        }
        if (iv < 2) {
            v[iv].iov_base = (char *)v[iv].iov_base + k;
            v[iv].iov_len -= k;
        }
    }
    return 0;
}

amx_status_t amx_snapshot_write(const char *dir, const char *job, const void *meta, size_t meta_len,
                                const void *blob, size_t blob_len, amx_err_t *err)
{
    char path[PATH_MAX], tmp[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/%s%s", dir, job, AMX_SNAPSHOT_SUFFIX) >=
            (int)sizeof(path) ||
        snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
        return amx_err_set(err, AMX_EINVAL, "state_dir path '%s' is too long", dir);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return amx_err_set(err, AMX_EUNAVAIL, "cannot create %s: %s", tmp, strerror(errno));
    int rc = write_all(fd, meta, meta_len, blob, blob_len);
    if (rc == 0 && fsync(fd) != 0)
        rc = -errno;
    if (close(fd) != 0 && rc == 0)
        rc = -errno;
    if (rc != 0) {
        unlink(tmp);
        return amx_err_set(err, AMX_EUNAVAIL, "cannot write %s (%zu bytes): %s", tmp,
                           meta_len + blob_len, strerror(-rc));
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return amx_err_set(err, AMX_EUNAVAIL, "cannot rename %s to %s: %s", tmp, path, strerror(e));
    }
    /* The rename itself is durable once the directory is. */
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return amx_err_set(err, AMX_EUNAVAIL, "cannot open directory %s to sync it: %s", dir,
                           strerror(errno));
    rc = fsync(dfd) != 0 ? -errno : 0;
    close(dfd);
    if (rc != 0)
        return amx_err_set(err, AMX_EUNAVAIL, "cannot sync directory %s: %s", dir, strerror(-rc));
    return AMX_OK;
}

int amx_snapshot_remove(const char *dir, const char *job)
{
    char path[PATH_MAX];
    if (snprintf(path, sizeof(path), "%s/%s%s", dir, job, AMX_SNAPSHOT_SUFFIX) >= (int)sizeof(path))
        return -ENAMETOOLONG;
    if (unlink(path) != 0 && errno != ENOENT)
        return -errno;
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
    return 0;
}

int amx_snapshot_set_aside(const char *path, char *to, size_t to_len)
{
    struct stat sb;
    for (int k = 0; k < 1000; k++) {
        if (k == 0)
            snprintf(to, to_len, "%s.corrupt", path);
        else
            snprintf(to, to_len, "%s.corrupt.%d", path, k);
        if (lstat(to, &sb) != 0 && errno == ENOENT)
            return rename(path, to) == 0 ? 0 : -errno;
    }
    return -EEXIST;
}

/* ---- reading ---- */

/* A malloc'd copy of a string of at most `max` bytes without NUL bytes. */
static char *getstr(amx_rbuf_t *r, size_t max)
{
    uint32_t n = amx_get32(r);
    if (n > max) {
        r->bad = 1;
        return NULL;
    }
    const char *q = amx_get(r, n);
    if (q == NULL || memchr(q, '\0', n) != NULL) {
        r->bad = 1;
        return NULL;
    }
    char *s = malloc((size_t)n + 1);
    if (s == NULL) {
        r->bad = 1;
        return NULL;
    }
    memcpy(s, q, n);
    s[n] = '\0';
    return s;
}

static void meta_free(amx_snap_meta_t *m)
{
    for (uint32_t i = 0; m->ranks != NULL && i < m->nranks; i++) {
        for (uint32_t k = 0; k < m->ranks[i].n; k++)
            free((char *)m->ranks[i].pls[k].name);
        free(m->ranks[i].pls);
    }
    free(m->ranks);
    free((char *)m->job);
    free(m->prev_ok);
    free(m->prev_ga);
    free(m->prev_gs);
    memset(m, 0, sizeof(*m));
}

static amx_status_t read_file(const char *path, void **out, size_t *len, amx_err_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return amx_err_set(err, AMX_EUNAVAIL, "cannot open: %s", strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return amx_err_set(err, AMX_EINVAL, "not a regular file");
    }
    size_t n = (size_t)sb.st_size;
    /* 8-byte aligned: the job state's arrays are read in place. */
    void *buf = NULL;
    if (posix_memalign(&buf, 64, n ? n : 8) != 0) {
        close(fd);
        return amx_err_set(err, AMX_ENOMEM, "out of memory reading %zu bytes", n);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(fd, (char *)buf + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            int e = k < 0 ? errno : EIO;
            close(fd);
            free(buf);
            return amx_err_set(err, AMX_EUNAVAIL, "read failed after %zu of %zu bytes: %s", got, n,
                               strerror(e));
        }
        got += (size_t)k;
    }
    close(fd);
    *out = buf;
    *len = n;
    return AMX_OK;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

amx_status_t amx_snapshot_read(const char *path, amx_snapshot_t *out, amx_err_t *err)
{
    memset(out, 0, sizeof(*out));
    AMX_CHECK(read_file(path, &out->buf, &out->len, err));
    amx_rbuf_t r = {out->buf, out->len, 0, 0};
    amx_snap_meta_t *m = &out->meta;
    if (out->len < 24)
        goto truncated;
    if (amx_get32(&r) != MAGIC) {
        amx_snapshot_free(out);
        return amx_err_set(err, AMX_EINVAL, "not an amaxd snapshot (bad magic)");
    }
    uint32_t ver = amx_get32(&r);
    if (ver != AMX_SNAPSHOT_VERSION) {
        amx_snapshot_free(out);
        return amx_err_set(err, AMX_EINVAL,
                           "snapshot format %u; this amaxd reads format %u (written by another "
                           "version)",
                           ver, AMX_SNAPSHOT_VERSION);
    }
    uint64_t body = amx_get64(&r);
    if (body < 16 || body > out->len - 8)
        goto truncated;
    uint64_t sum;
    memcpy(&sum, (const unsigned char *)out->buf + body, 8);
    if (amx_checksum64(out->buf, body) != sum) {
        amx_snapshot_free(out);
        return amx_err_set(err, AMX_EINVAL,
                           "the job section fails its checksum (the file was changed or damaged)");
    }
    r.len = body;
    m->job = getstr(&r, AMX_MAX_JOB_NAME);
    m->world = amx_get32(&r);
    m->epochs_ok = amx_get64(&r);
    m->epochs_failed = amx_get64(&r);
    m->state_len = amx_get64(&r);
    m->nranks = amx_get32(&r);
    if (r.bad || !amx_valid_job_name(m->job) || m->world == 0 || m->nranks > m->world ||
        (uint64_t)m->nranks * 8 > body)
        goto malformed;
    m->ranks = calloc(m->nranks ? m->nranks : 1, sizeof(*m->ranks));
    if (m->ranks == NULL)
        goto malformed;
    for (uint32_t i = 0; i < m->nranks; i++) {
        amx_snap_rank_t *rk = &m->ranks[i];
        rk->rank = amx_get32(&r);
        uint32_t n = amx_get32(&r);
        if (r.bad || rk->rank >= m->world || (uint64_t)n * 20 > body)
            goto malformed;
        rk->pls = calloc(n ? n : 1, sizeof(*rk->pls));
        if (rk->pls == NULL)
            goto malformed;
        for (uint32_t k = 0; k < n; k++) {
            amx_snap_pl_t *p = &rk->pls[k];
            p->name = getstr(&r, AMX_MAX_NAME);
            rk->n = k + 1; /* freed from here on */
            p->pl.ndim = amx_get32(&r);
            const void *off = amx_get(&r, sizeof(p->pl.off)),
                       *shape = amx_get(&r, sizeof(p->pl.shape));
            if (r.bad || !amx_valid_name(p->name) || p->pl.ndim > AMX_MAX_DIMS)
                goto malformed;
            memcpy(p->pl.off, off, sizeof(p->pl.off));
            memcpy(p->pl.shape, shape, sizeof(p->pl.shape));
            p->pl.ncells = 1;
            for (uint32_t d = 0; d < p->pl.ndim; d++)
                p->pl.ncells *= p->pl.shape[d];
        }
    }
    /* Each local rank once: a rank restored twice would have its
     * placements applied twice (a file made by hand, or a writer's bug). */
    if (m->nranks > 1) {
        uint32_t *ids = malloc((size_t)m->nranks * sizeof(*ids));
        if (ids == NULL)
            goto malformed;
        for (uint32_t i = 0; i < m->nranks; i++)
            ids[i] = m->ranks[i].rank;
        qsort(ids, m->nranks, sizeof(*ids), cmp_u32);
        for (uint32_t i = 1; i < m->nranks; i++)
            if (ids[i] == ids[i - 1]) {
                uint32_t dup = ids[i];
                free(ids);
                amx_snapshot_free(out);
                return amx_err_set(err, AMX_EINVAL,
                                   "the job section lists rank %u twice (malformed)", dup);
            }
        free(ids);
    }
    m->nprev = amx_get32(&r);
    if (r.bad || (uint64_t)m->nprev * 9 > body)
        goto malformed;
    if (m->nprev > 0) {
        const void *ok = amx_get(&r, m->nprev), *ga = amx_get(&r, (size_t)m->nprev * 4),
                   *gs = amx_get(&r, (size_t)m->nprev * 4);
        m->prev_ok = malloc(m->nprev);
        m->prev_ga = malloc((size_t)m->nprev * 4);
        m->prev_gs = malloc((size_t)m->nprev * 4);
        if (r.bad || m->prev_ok == NULL || m->prev_ga == NULL || m->prev_gs == NULL)
            goto malformed;
        memcpy(m->prev_ok, ok, m->nprev);
        memcpy(m->prev_ga, ga, (size_t)m->nprev * 4);
        memcpy(m->prev_gs, gs, (size_t)m->nprev * 4);
    }
    if (r.off != body)
        goto malformed;
    size_t at = (size_t)body + 8;
    at += (8 - at % 8) % 8;
    if (at > out->len || out->len - at != m->state_len) {
        size_t flen = out->len;
        uint64_t want = at + m->state_len;
        amx_snapshot_free(out);
        return amx_err_set(err, AMX_EINVAL, "truncated: %zu bytes, its header says %llu", flen,
                           (unsigned long long)want);
    }
    amx_status_t st = amx_jobstate_parse((const char *)out->buf + at, out->len - at, &out->js, err);
    if (st != AMX_OK) {
        amx_snapshot_free(out);
        return st;
    }
    if (strcmp(out->js.job, m->job) != 0) {
        amx_snapshot_free(out);
        return amx_err_set(err, AMX_EINVAL, "the job section and the state name different jobs");
    }
    return AMX_OK;
truncated : {
    size_t flen = out->len;
    amx_snapshot_free(out);
    return amx_err_set(err, AMX_EINVAL, "truncated (%zu bytes)", flen);
}
malformed:
    amx_snapshot_free(out);
    return amx_err_set(err, AMX_EINVAL, "the job section is malformed (at byte %zu)", r.off);
}

void amx_snapshot_free(amx_snapshot_t *s)
{
    meta_free(&s->meta);
    amx_jobstate_free(&s->js);
    free(s->buf);
    memset(s, 0, sizeof(*s));
}
