/*
 * shm.c - shared-memory buffers of the packed form (shm.h).
 */
#define _GNU_SOURCE
#include "shm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

#define PREFIX "amaxd-"

typedef struct file {
    int fd;
    int linked; /* the path still names the file */
    char path[PATH_MAX];
} file_t;

typedef struct region {
    char *job;
    uint32_t rank;
    file_t slab;   /* the trainer writes: values, has-data bytes */
    file_t answer; /* the daemon writes (mapped), the trainer reads */
    uint8_t *map;
    size_t map_len;
    amx_shm_region_t r;
} region_t;

struct amx_shm {
    char dir[PATH_MAX];
    unsigned mode;
    size_t max;
    region_t *v;
    size_t n, cap;
    uint8_t *scratch; /* the last slab read */
    size_t scratch_cap;
};

static void close_file(file_t *f)
{
    if (f->linked && unlink(f->path) != 0 && errno != ENOENT)
        AMX_WARN("shm", "unlink %s: %s", f->path, strerror(errno));
    if (f->fd >= 0)
        close(f->fd);
    f->fd = -1;
    f->linked = 0;
}

static void close_region(region_t *g)
{
    if (g->map != NULL)
        munmap(g->map, g->map_len);
    close_file(&g->slab);
    close_file(&g->answer);
    free(g->job);
    memset(g, 0, sizeof(*g));
    g->slab.fd = g->answer.fd = -1;
}

static void remove_at(amx_shm_t *s, size_t i)
{
    close_region(&s->v[i]);
    s->v[i] = s->v[--s->n];
}

/* Files "amaxd-<pid>-..." of ours that no daemon holds: every daemon
 * keeps a shared lock on each of its buffers while they have a path (from
 * before the name exists), so a file whose exclusive lock can be taken
 * belongs to no running daemon, whatever PID namespace it ran in and
 * whether its pid was reused. A file still under its temporary name
 * ".new-amaxd-..." (a daemon killed between making and renaming it) is
 * taken only once SWEEP_NEW_S old: its maker takes the lock right after
 * creating it, and the sweep must not win that race. */
#define SWEEP_NEW_S 60

static void sweep(amx_shm_t *s)
{
    DIR *d = opendir(s->dir);
    if (d == NULL)
        return;
    struct dirent *e;
    size_t removed = 0;
    time_t now = time(NULL);
    while ((e = readdir(d)) != NULL) {
        int fresh_ok = 0;
        if (strncmp(e->d_name, ".new-" PREFIX, strlen(".new-" PREFIX)) == 0) {
            fresh_ok = 1;
        } else {
            if (strncmp(e->d_name, PREFIX, strlen(PREFIX)) != 0)
                continue;
            char *end = NULL;
            long pid = strtol(e->d_name + strlen(PREFIX), &end, 10);
            if (end == NULL || *end != '-' || pid <= 0 || pid > INT_MAX)
                continue;
        }
        int fd = openat(dirfd(d), e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0)
            continue;
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == geteuid() &&
            (!fresh_ok || st.st_mtime + SWEEP_NEW_S < now) && flock(fd, LOCK_EX | LOCK_NB) == 0 &&
            unlinkat(dirfd(d), e->d_name, 0) == 0)
            removed++;
        close(fd);
    }
    closedir(d);
    if (removed > 0)
        AMX_INFO("shm", "removed %zu shared buffers of daemons no longer running from %s", removed,
                 s->dir);
}

amx_status_t amx_shm_create(const char *dir, unsigned mode, size_t max_regions, amx_shm_t **out,
                            amx_err_t *err)
{
    *out = NULL;
    if (dir == NULL || dir[0] == '\0')
        return AMX_OK;
    struct stat st;
    if (strlen(dir) >= PATH_MAX - 64)
        return amx_err_set(err, AMX_EINVAL, "shm_dir=%.64s...: path too long", dir);
    int bad = stat(dir, &st) != 0 ? errno : !S_ISDIR(st.st_mode) ? ENOTDIR : 0;
    if (bad != 0)
        return amx_err_set(err, AMX_EINVAL,
                           "shm_dir=%s: %s (set shm_dir to a tmpfs directory, or to \"\" to turn "
                           "shared-memory buffers off)",
                           dir, strerror(bad));
    if (access(dir, W_OK | X_OK) != 0)
        return amx_err_set(err, AMX_EINVAL, "shm_dir=%s: not writable by the daemon: %s", dir,
                           strerror(errno));
    amx_shm_t *s = calloc(1, sizeof(*s));
    if (s == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    snprintf(s->dir, sizeof(s->dir), "%s", dir);
    s->mode = mode & 0660; /* never to every user, whatever the socket's bits */
    s->max = max_regions;
    sweep(s);
    *out = s;
    return AMX_OK;
}

void amx_shm_trim(amx_shm_t *s, size_t keep)
{
    if (s != NULL && s->scratch_cap > keep) {
        free(s->scratch);
        s->scratch = NULL;
        s->scratch_cap = 0;
    }
}

void amx_shm_free(amx_shm_t *s)
{
    if (s == NULL)
        return;
    while (s->n > 0)
        remove_at(s, s->n - 1);
    free(s->v);
    free(s->scratch);
    free(s);
}

static region_t *find(amx_shm_t *s, const char *job, uint32_t rank)
{
    for (size_t i = 0; i < s->n; i++)
        if (s->v[i].rank == rank && strcmp(s->v[i].job, job) == 0)
            return &s->v[i];
    return NULL;
}

static amx_status_t off(const char *what, amx_err_t *err)
{
    return amx_err_set(err, AMX_EPRECOND,
                       "%s: shared-memory buffers are off on this daemon (shm_dir is empty); use "
                       "the packed form without shm",
                       what);
}

/* One file of a buffer, made under a name the sweep ignores, locked
 * (held while the file has a path: another daemon's sweep leaves it
 * alone), given its bits (open() applied the umask), then renamed into
 * place. */
static amx_status_t make_file(amx_shm_t *s, uint64_t rnd, char kind, unsigned mode, file_t *f,
                              amx_err_t *err)
{
    char tmp[PATH_MAX];
    int pl = snprintf(f->path, sizeof(f->path), "%s/" PREFIX "%d-%016" PRIx64 "-%c", s->dir,
                      (int)getpid(), rnd, kind);
    int tl = snprintf(tmp, sizeof(tmp), "%s/.new-" PREFIX "%016" PRIx64 "-%c", s->dir, rnd, kind);
    if (pl < 0 || (size_t)pl >= sizeof(f->path) || tl < 0 || (size_t)tl >= sizeof(tmp))
        return amx_err_set(err, AMX_EINTERNAL, "GetLayout: shm_dir path too long");
    f->fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (f->fd < 0)
        return amx_err_set(
            err, errno == EMFILE || errno == ENFILE || errno == ENOSPC ? AMX_ENOMEM : AMX_EINTERNAL,
            "GetLayout: creating %s: %s", tmp, strerror(errno));
    const char *fail = flock(f->fd, LOCK_SH | LOCK_NB) != 0 ? "flock"
                       : fchmod(f->fd, mode) != 0           ? "chmod"
                       : renameat2(AT_FDCWD, tmp, AT_FDCWD, f->path, RENAME_NOREPLACE) != 0
                           ? "rename"
                           : NULL;
    if (fail != NULL) {
        amx_err_set(err, AMX_EINTERNAL, "GetLayout: %s %s: %s", fail, tmp, strerror(errno));
        unlink(tmp);
        close_file(f);
        return err->code;
    }
    f->linked = 1;
    return AMX_OK;
}

/* Where the statistics start: after the values and has-data bytes,
 * 8-aligned (in the file and in the read buffer alike). */
static uint64_t stats_at(uint64_t cells)
{
    return (5 * cells + 7) & ~(uint64_t)7;
}

amx_status_t amx_shm_open(amx_shm_t *s, const char *job, uint32_t rank, uint64_t layout_id,
                          const amx_shm_sizes_t *sz, amx_shm_region_t *out, amx_err_t *err)
{
    uint64_t cells = sz->cells, answer_bytes = sz->answer_bytes;
    if (s == NULL)
        return off("GetLayout", err);
    region_t *old = find(s, job, rank);
    if (old == NULL && s->n >= s->max)
        return amx_err_set(err, AMX_ENOMEM,
                           "GetLayout: %zu shared buffers are open, the most this daemon keeps; "
                           "ask for the layout without shm",
                           s->n);
    /* The layout's limits keep them far below these; the slab's parts must
     * have offsets that fit memory. */
    const uint64_t lim = (uint64_t)SIZE_MAX / 32;
    if (cells > lim || sz->stats > lim || sz->quantizers > lim ||
        answer_bytes > (uint64_t)SIZE_MAX / 2)
        return amx_err_set(err, AMX_EINVAL,
                           "GetLayout: %" PRIu64 " cells, %" PRIu64 " statistic values and %" PRIu64
                           " quantizers do not fit a shared buffer",
                           cells, sz->stats, sz->quantizers);
    /* The id and the file's name are drawn apart: the name, visible to
     * whoever can list shm_dir, does not tell the id. */
    uint64_t rnd[2] = {0, 0};
    while (rnd[0] == 0) {
        if (getrandom(rnd, sizeof(rnd), 0) != sizeof(rnd))
            return amx_err_set(err, AMX_EINTERNAL, "getrandom: %s", strerror(errno));
    }
    uint64_t id = rnd[0];
    region_t g = {0};
    g.slab.fd = g.answer.fd = -1;
    AMX_CHECK(make_file(s, rnd[1], 's', s->mode, &g.slab, err));
    /* The answer file is the daemon's to write: the trainers' group may
     * only read it, so nobody but the daemon's user can truncate it under
     * its mapping. Its pages are reserved now (a full tmpfs is an error
     * here, never a SIGBUS when the answer is written). */
    amx_status_t st = make_file(s, rnd[1], 'a', s->mode & 0640, &g.answer, err);
    if (st == AMX_OK && answer_bytes > 0) {
        int e = posix_fallocate(g.answer.fd, 0, (off_t)answer_bytes);
        if (e != 0) {
            st = amx_err_set(err, e == ENOSPC ? AMX_ENOMEM : AMX_EINTERNAL,
                             "GetLayout: reserving %" PRIu64 " bytes in %s: %s", answer_bytes,
                             g.answer.path, strerror(e));
        } else {
            g.map = mmap(NULL, (size_t)answer_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                         g.answer.fd, 0);
            if (g.map == MAP_FAILED) {
                g.map = NULL;
                st = amx_err_set(err, AMX_ENOMEM, "GetLayout: mapping %s: %s", g.answer.path,
                                 strerror(errno));
            } else {
                g.map_len = (size_t)answer_bytes;
            }
        }
    }
    if (st != AMX_OK) {
        close_region(&g);
        return st;
    }
    g.job = strdup(job);
    if (g.job == NULL) {
        close_region(&g);
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    }
    g.rank = rank;
    g.r.id = id;
    g.r.layout_id = layout_id;
    g.r.cells = cells;
    g.r.stats = sz->stats;
    g.r.quantizers = sz->quantizers;
    g.r.has_data_off = 4 * cells;
    g.r.stats_off = stats_at(cells);
    g.r.stat_epochs_off = g.r.stats_off + 8 * sz->stats;
    if (old != NULL) {
        close_region(old);
        *old = g;
        old->r.path = old->slab.path;
        old->r.answer_path = old->answer.path;
        *out = old->r;
    } else {
        if (s->n == s->cap) {
            size_t nc = s->cap ? 2 * s->cap : 8;
            region_t *nv = realloc(s->v, nc * sizeof(*nv));
            if (nv == NULL) {
                close_region(&g);
                return amx_err_set(err, AMX_ENOMEM, "out of memory");
            }
            s->v = nv;
            s->cap = nc;
        }
        s->v[s->n] = g;
        s->v[s->n].r.path = s->v[s->n].slab.path;
        s->v[s->n].r.answer_path = s->v[s->n].answer.path;
        *out = s->v[s->n++].r;
    }
    return AMX_OK;
}

static region_t *named(amx_shm_t *s, const char *what, const char *job, uint32_t rank, uint64_t id,
                       amx_err_t *err)
{
    region_t *g = find(s, job, rank);
    if (g == NULL || g->r.id != id) {
        amx_err_set(err, AMX_EPRECOND,
                    "%s: job '%s' rank %u has no shared buffer %016" PRIx64
                    "%s; fetch the layout again with shm",
                    what, job, rank, id, g != NULL ? " (it was replaced by a newer one)" : "");
        return NULL;
    }
    /* The trainer opened it before using it: nothing is left if either
     * side dies from now on. */
    file_t *fs[2] = {&g->slab, &g->answer};
    for (int k = 0; k < 2; k++) {
        if (fs[k]->linked && unlink(fs[k]->path) != 0 && errno != ENOENT)
            AMX_WARN("shm", "unlink %s: %s", fs[k]->path, strerror(errno));
        fs[k]->linked = 0;
    }
    return g;
}

static amx_status_t read_at(int fd, uint8_t *dst, size_t len, uint64_t at, const char *what,
                            amx_err_t *err)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, dst + got, len - got, (off_t)(at + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return amx_err_set(err, AMX_EINTERNAL, "SendPacked: reading the shared buffer: %s",
                               strerror(errno));
        if (r == 0)
            return amx_err_set(err, AMX_EPRECOND,
                               "SendPacked: the shared buffer ends %zu bytes into the %s (%zu "
                               "bytes at offset %" PRIu64 "): it was truncated",
                               got, what, len, at);
        got += (size_t)r;
    }
    return AMX_OK;
}

amx_status_t amx_shm_read(amx_shm_t *s, const char *job, uint32_t rank, uint64_t id,
                          uint64_t layout_id, int with_has_data, int with_stats,
                          amx_shm_slab_t *out, amx_err_t *err)
{
    memset(out, 0, sizeof(*out));
    if (s == NULL)
        return off("SendPacked", err);
    region_t *g = named(s, "SendPacked", job, rank, id, err);
    if (g == NULL)
        return err->code;
    if (g->r.layout_id != layout_id)
        return amx_err_set(
            err, AMX_EPRECOND,
            "SendPacked: shared buffer %016" PRIx64 " was made for layout %016" PRIx64
            ", the request names layout %016" PRIx64 "; fetch the layout again with shm",
            id, g->r.layout_id, layout_id);
    /* In memory as in the file: values, has-data bytes, then (8-aligned)
     * the statistics and their epochs. */
    size_t n = (size_t)g->r.cells, sl = 8 * (size_t)g->r.stats, el = 8 * (size_t)g->r.quantizers;
    size_t at = (size_t)stats_at(g->r.cells);
    size_t need = with_stats ? at + sl + el : 4 * n + (with_has_data ? n : 0);
    if (need > s->scratch_cap) {
        uint8_t *p = NULL;
        if (posix_memalign((void **)&p, 64, need > 0 ? need : 64) != 0)
            return amx_err_set(err, AMX_ENOMEM, "SendPacked: out of memory reading %zu bytes",
                               need);
        free(s->scratch);
        s->scratch = p;
        s->scratch_cap = need;
    }
    AMX_CHECK(read_at(g->slab.fd, s->scratch, 4 * n, 0, "values", err));
    if (with_has_data)
        AMX_CHECK(
            read_at(g->slab.fd, s->scratch + 4 * n, n, g->r.has_data_off, "has-data bytes", err));
    if (with_stats) {
        AMX_CHECK(read_at(g->slab.fd, s->scratch + at, sl, g->r.stats_off, "statistics", err));
        AMX_CHECK(read_at(g->slab.fd, s->scratch + at + sl, el, g->r.stat_epochs_off, "stat epochs",
                          err));
        out->stats = s->scratch + at;
        out->stat_epochs = s->scratch + at + sl;
        out->stats_len = sl;
        out->epochs_len = el;
    }
    out->values = (float *)(void *)s->scratch;
    out->has_data = with_has_data ? s->scratch + 4 * n : NULL;
    out->cells = n;
    return AMX_OK;
}

amx_status_t amx_shm_check(amx_shm_t *s, const char *job, uint32_t rank, uint64_t id,
                           amx_err_t *err)
{
    if (s == NULL)
        return off("ReconcilePacked", err);
    return named(s, "ReconcilePacked", job, rank, id, err) != NULL ? AMX_OK : err->code;
}

uint8_t *amx_shm_answer(amx_shm_t *s, const char *job, uint32_t rank, uint64_t id, size_t need,
                        amx_err_t *err)
{
    if (s == NULL) {
        off("ReconcilePacked", err);
        return NULL;
    }
    region_t *g = named(s, "ReconcilePacked", job, rank, id, err);
    if (g == NULL)
        return NULL;
    if (need > g->map_len) {
        amx_err_set(err, AMX_EPRECOND,
                    "ReconcilePacked: an answer of up to %zu bytes, shared buffer %016" PRIx64
                    " holds %zu (the rank's layout changed during the epoch)",
                    need, id, g->map_len);
        return NULL;
    }
    return g->map;
}

void amx_shm_drop_job(void *ud, const char *job)
{
    amx_shm_t *s = ud;
    if (s == NULL)
        return;
    for (size_t i = 0; i < s->n;) {
        if (strcmp(s->v[i].job, job) == 0)
            remove_at(s, i);
        else
            i++;
    }
}
