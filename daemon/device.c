/*
 * device.c - GPU-direct (docs/API.md "Device buffers"): a rank's device
 * slab and answer buffer on its trainer's GPU, shared over CUDA IPC.
 * OpenDevice and CloseDevice; ReconcileDevice's checks, the merge of the
 * device slabs when an epoch starts and the answer written into the
 * device buffers when it ends; the buffers' lifetimes (the trainer's
 * process, the rank, the job, the daemon).
 *
 * The state backend does the device work (state.h dev_*); this file
 * decides what goes where: sizes and offsets, the layout checks, and the
 * maps by which the device gathers the per-quantizer and per-slice globals
 * into the answer buffer after the per-cell arrays.
 */
#include "registry_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "state.h"

#define DEV_ALIGN 256

struct amx_devrank {
    amx_devbuf_t *buf;
    uint64_t id, layout_id;
    uint64_t ncells, nslices;
    uint32_t nq;
    uint64_t has_off;
    uint64_t ready_off, done_off; /* the signals' flags: in the slab, in the answer */
    int signals;                  /* the GPU has the stream memory operations */
    amx_devans_layout_t lay;      /* offsets fixed at OpenDevice; the maps set per answer */
    /* Per global slice of the slab (lay.ns), for the slab of serial
     * slices_key: the end of its quantizer's slices in the state. */
    uint64_t *slice_end;
    uint64_t slices_key;
    uint32_t pid;
    int pidfd; /* -1: none (pid 0, or no pidfd_open: kill(pid, 0)) */
    /* This epoch: a slab to merge (ReconcileDevice send), its has-data
     * bytes; merged once queued; an error to answer instead. */
    int send, has_data, merged;
    int armed; /* this epoch was armed by the doorbell */
    /* The armed epochs' flag page (mapped read-only, 4096 bytes): the
     * trainer's stream writes the ready seq into its first word. */
    const volatile uint32_t *hpage;
    /* A page that came while an epoch was in flight (the engine may be
     * reading hpage): swapped in when the epoch ends. */
    const volatile uint32_t *hpage_next;
    int armed_aborted; /* and amx__dev_abort_armed aborted it */
    uint32_t seq;      /* signals: this epoch's (0: the events) */
    amx_status_t merge_st;
    char merge_msg[1024];
};

static uint64_t align_up(uint64_t x)
{
    return (x + DEV_ALIGN - 1) & ~(uint64_t)(DEV_ALIGN - 1);
}

/* An id nobody guesses by counting: the time, a counter and the address
 * space's randomness mixed (splitmix64). */
static uint64_t new_id(void)
{
    static uint64_t counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t z = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (uintptr_t)&counter ^
                 (++counter * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)getpid() << 17);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z ? z : 1;
}

static void unmap_page(const volatile uint32_t *p)
{
    if (p != NULL && munmap((void *)p, 4096) != 0)
        AMX_WARN("registry", "munmap of a flag page: %s", strerror(errno));
}

int amx_registry_shutting_down(const amx_registry_t *reg)
{
    return reg->shutting_down;
}

void amx__dev_close_rank(amx_job_t *j, amx_lrank_t *r, const char *why)
{
    struct amx_devrank *d = r->dev;
    if (d == NULL)
        return;
    if (why != NULL)
        AMX_INFO("registry", "job %s, rank %u: device buffers %016" PRIx64 " freed: %s", j->name,
                 r->rank, d->id, why);
    if (d->buf != NULL && j->state != NULL && j->state->ops->dev_close != NULL)
        j->state->ops->dev_close(j->state, d->buf);
    if (d->pidfd >= 0)
        close(d->pidfd);
    unmap_page(d->hpage);
    unmap_page(d->hpage_next);
    free(d->slice_end);
    free(d);
    r->dev = NULL;
}

amx_status_t amx_registry_dev_flag_page(amx_registry_t *reg, const char *job, uint32_t rank, int fd,
                                        amx_err_t *err)
{
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, job, rank, 1, &j, err));
    amx_lrank_t *r = amx__local_rank(j, rank);
    if (r == NULL || r->dev == NULL)
        return amx_err_set(err, AMX_EPRECOND, "rank %u of job '%s' has no device buffers", rank,
                           job);
    void *p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
        return amx_err_set(err, AMX_EIO,
                           "job %s, rank %u: the armed epochs' flag page could not be mapped "
                           "(%s): the next epoch is not armed",
                           job, rank, strerror(errno));
    if (j->in_flight) {
        /* The engine may be polling the current page: the new one waits
         * for the epoch's end (amx__dev_epoch_end). */
        unmap_page(r->dev->hpage_next);
        r->dev->hpage_next = p;
        return AMX_OK;
    }
    unmap_page(r->dev->hpage);
    r->dev->hpage = p;
    return AMX_OK;
}

/* The refusal of every GPU-direct call by a daemon without device state. */
amx_status_t amx__dev_need_backend(const amx_registry_t *reg, const char *what, amx_err_t *err)
{
    if (strcmp(reg->backend, "cuda") == 0)
        return AMX_OK;
    return amx_err_set(err, AMX_EPRECOND,
                       "%s: this daemon keeps its state on the host (backend '%s'), so it has no "
                       "device buffers to share; GPU-direct needs a daemon on the CUDA backend "
                       "(--backend cuda) on the trainer's node. Use the packed form "
                       "(GetLayout with shm, SendPacked, ReconcilePacked) instead",
                       what, reg->backend);
}

amx_status_t amx_registry_device_open(amx_registry_t *reg, const amx_dev_open_req_t *req,
                                      amx_dev_opened_t *out, amx_err_t *err)
{
    AMX_CHECK(amx__dev_need_backend(reg, "OpenDevice", err));
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, req->job, req->rank, 1, &j, err));
    amx_lrank_t *r = amx__local_rank(j, req->rank);
    if (j->state->ops->dev_open == NULL)
        return amx__dev_need_backend(reg, "OpenDevice", err);
    if (r->in_reconcile)
        return amx_err_set(err, AMX_EPRECOND,
                           "OpenDevice: rank %u of job '%s' is waiting in Reconcile for epoch "
                           "%llu; open device buffers between epochs",
                           req->rank, j->name, (unsigned long long)j->epoch);
    amx_slab_t *sl;
    AMX_CHECK(amx__slab_get(j, r, &sl, err));
    AMX_CHECK(amx__check_layout_id(j, r, sl, req->layout_id, "OpenDevice", err));
    uint64_t n = sl->off[sl->n], ns = sl->soff[sl->n];
    uint32_t nq = sl->n;
    struct amx_devrank *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    d->pidfd = -1;
    d->id = new_id();
    d->layout_id = sl->id;
    d->ncells = n;
    d->nq = nq;
    d->nslices = ns;
    d->has_off = align_up(4 * n);
    d->ready_off = align_up(d->has_off + n);
    uint64_t slab_bytes = d->ready_off + 4;
    d->lay.amax = 0;
    d->lay.scale = align_up(4 * n);
    d->lay.scale_inv = align_up(d->lay.scale + 4 * n);
    uint64_t at = align_up(d->lay.scale_inv + 4 * n);
    for (int k = 0; k < 9; k++) {
        d->lay.g[k] = align_up(at);
        at = d->lay.g[k] + (k == 8 ? 1 : 4) * (k < 3 || k > 5 ? nq : ns);
    }
    d->lay.block_scales = align_up(at);
    d->lay.missing = align_up(d->lay.block_scales + n);
    d->done_off = align_up(d->lay.missing + 4 * (uint64_t)nq);
    uint64_t answer_bytes = d->done_off + 4;
    if (req->pid != 0) {
        d->pid = req->pid;
#ifdef SYS_pidfd_open
        d->pidfd = (int)syscall(SYS_pidfd_open, (pid_t)req->pid, 0);
        if (d->pidfd < 0 && errno == ESRCH) {
            free(d);
            return amx_err_set(err, AMX_EINVAL,
                               "OpenDevice: no process %u is visible to the daemon; give the "
                               "trainer's pid as the daemon sees it (same PID namespace), or 0",
                               req->pid);
        }
#endif
    }
    amx_devbuf_info_t info;
    amx_status_t st = j->state->ops->dev_open(j->state, req->device, slab_bytes, answer_bytes,
                                              &d->buf, &info, err);
    if (st != AMX_OK) {
        if (d->pidfd >= 0)
            close(d->pidfd);
        free(d);
        if (st == AMX_EDEVICE)
            amx__note_fault(reg, st, err->msg);
        return st;
    }
    amx__dev_close_rank(j, r, "replaced by a new OpenDevice");
    d->signals = info.signals;
    r->dev = d;
    memset(out, 0, sizeof(*out));
    out->id = d->id;
    out->layout_id = d->layout_id;
    out->total_cells = n;
    out->total_slices = ns;
    out->nq = nq;
    out->slab_bytes = slab_bytes;
    out->has_data_off = d->has_off;
    out->answer_bytes = answer_bytes;
    out->amax = d->lay.amax;
    out->scale = d->lay.scale;
    out->scale_inv = d->lay.scale_inv;
    out->block_scales = d->lay.block_scales;
    out->g_amax = d->lay.g[0];
    out->g_scale = d->lay.g[1];
    out->g_inv = d->lay.g[2];
    out->s_amax = d->lay.g[3];
    out->s_scale = d->lay.g[4];
    out->s_inv = d->lay.g[5];
    out->prev_amax = d->lay.g[6];
    out->prev_scale = d->lay.g[7];
    out->has_prev = d->lay.g[8];
    out->missing = d->lay.missing;
    memcpy(out->slab_handle, info.slab, 64);
    memcpy(out->answer_handle, info.answer, 64);
    memcpy(out->ready_event, info.ready, 64);
    memcpy(out->done_event, info.done, 64);
    snprintf(out->bus_id, sizeof(out->bus_id), "%s", info.bus_id);
    out->signals = d->signals;
    out->ready_flag_off = d->ready_off;
    out->done_flag_off = d->done_off;
    AMX_INFO("registry",
             "job %s, rank %u: device buffers %016" PRIx64 " for layout %016" PRIx64
             " (%llu cells) on GPU %d (%s), state on GPU %d, pid %u",
             j->name, r->rank, d->id, d->layout_id, (unsigned long long)n, info.device, info.bus_id,
             info.state_dev, req->pid);
    return AMX_OK;
}

amx_status_t amx_registry_device_close(amx_registry_t *reg, const char *job, uint32_t rank,
                                       uint64_t id, amx_err_t *err)
{
    AMX_CHECK(amx__dev_need_backend(reg, "CloseDevice", err));
    amx_job_t *j;
    AMX_CHECK(amx__ready_job(reg, job, rank, 1, &j, err));
    amx_lrank_t *r = amx__local_rank(j, rank);
    if (r->dev == NULL || r->dev->id != id)
        return amx_err_set(err, AMX_EPRECOND,
                           "CloseDevice: rank %u of job '%s' has no device buffers %016" PRIx64,
                           rank, j->name, id);
    if (r->in_reconcile)
        return amx_err_set(err, AMX_EPRECOND,
                           "CloseDevice: rank %u of job '%s' is waiting in Reconcile for epoch "
                           "%llu; close its device buffers after the answer",
                           rank, j->name, (unsigned long long)j->epoch);
    amx__dev_close_rank(j, r, "CloseDevice");
    return AMX_OK;
}

amx_status_t amx__dev_check_reconcile(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r,
                                      const amx_reconcile_req_t *req, amx_err_t *err)
{
    AMX_CHECK(amx__dev_need_backend(reg, "ReconcileDevice", err));
    if (r->dev == NULL || r->dev->id != req->device_id)
        return amx_err_set(err, AMX_EPRECOND,
                           "ReconcileDevice: rank %u of job '%s' has no device buffers %016" PRIx64
                           " (%s): call OpenDevice after GetLayout, and name the id it answered",
                           r->rank, j->name, req->device_id,
                           r->dev == NULL ? "it has none" : "its buffers have another id");
    amx_slab_t *sl;
    AMX_CHECK(amx__slab_get(j, r, &sl, err));
    AMX_CHECK(amx__check_layout_id(j, r, sl, req->layout_id, "ReconcileDevice", err));
    if (r->dev->layout_id != sl->id)
        return amx_err_set(err, AMX_EPRECOND,
                           "ReconcileDevice: device buffers %016" PRIx64 " of rank %u, job '%s', "
                           "were made for layout %016" PRIx64
                           "; the rank's layout is now %016" PRIx64
                           ": open new ones (OpenDevice) for it",
                           r->dev->id, r->rank, j->name, r->dev->layout_id, sl->id);
    if (req->seq != 0 && !r->dev->signals)
        return amx_err_set(err, AMX_EPRECOND,
                           "ReconcileDevice: signal %u asked, but the CUDA driver of this daemon "
                           "has no stream memory operations (OpenDevice answered signals = "
                           "false): send 0 and use the events",
                           req->seq);
    return AMX_OK;
}

void amx__dev_arm(amx_lrank_t *r, int send, int has_data, uint32_t seq, int armed)
{
    if (r->dev == NULL)
        return;
    r->dev->send = send;
    r->dev->has_data = send && has_data;
    r->dev->seq = seq;
    r->dev->armed = armed;
    r->dev->armed_aborted = 0;
}

int amx__dev_armed(const amx_lrank_t *r)
{
    return r->dev != NULL && r->dev->armed;
}

void amx__dev_abort_armed(amx_job_t *j, amx_lrank_t *r, const char *why)
{
    struct amx_devrank *d = r->dev;
    if (!j->in_flight || d == NULL || !d->armed || !d->merged || d->armed_aborted ||
        j->eng == NULL || j->state->ops->dev_waiting == NULL ||
        !j->state->ops->dev_waiting(j->state, d->buf))
        return;
    d->armed_aborted = 1;
    char msg[256];
    snprintf(msg, sizeof(msg),
             "the armed epoch %llu waited for the ready flag of trainer rank %u, and %s; the "
             "epoch is aborted and that rank's slab is not merged",
             (unsigned long long)j->epoch, r->rank, why);
    AMX_WARN("registry", "job %s: %s", j->name, msg);
    amx_engine_abort(j->eng, 0, 0, 0, 0, AMX_ENGINE_LOCAL, AMX_EABORTED, msg);
}

void amx__dev_merge_epoch(amx_registry_t *reg, amx_job_t *j)
{
    amx_state_t *st = j->state;
    for (uint32_t i = 0; i < j->nlocal; i++) {
        amx_lrank_t *r = &j->lr[i];
        struct amx_devrank *d = r->dev;
        if (!r->in_reconcile || d == NULL || !d->send)
            continue;
        amx_err_t e = {0};
        amx_slab_t *sl;
        amx_status_t rc = amx__slab_get(j, r, &sl, &e);
        if (rc == AMX_OK && sl->id != d->layout_id)
            rc = amx_err_set(&e, AMX_EPRECOND,
                             "the layout of rank %u changed to %016" PRIx64
                             " before epoch %llu started; its device slab (layout %016" PRIx64
                             ") was not merged: open new device buffers (OpenDevice)",
                             r->rank, sl->id, (unsigned long long)j->epoch, d->layout_id);
        amx_devsignal_t ready = {d->ready_off, d->seq, r->rank, d->armed ? d->hpage : NULL};
        if (rc == AMX_OK && d->armed && d->hpage == NULL)
            rc = amx_err_set(&e, AMX_EINTERNAL, "rank %u's epoch is armed without its flag page",
                             r->rank);
        if (rc == AMX_OK)
            rc = st->ops->dev_merge(st, d->buf, sl->merge, sl->nmerge, sl->serial, d->ncells,
                                    d->has_data ? d->has_off : UINT64_MAX,
                                    d->seq != 0 ? &ready : NULL, r->rank, &e);
        if (rc != AMX_OK) {
            if (rc == AMX_EDEVICE)
                amx__note_fault(reg, rc, e.msg);
            d->merge_st = rc;
            snprintf(d->merge_msg, sizeof(d->merge_msg), "%s", e.msg);
            continue;
        }
        d->merged = 1;
        j->updates += sl->n;
    }
}

/* The layout index of slab cell c. */
static uint32_t slab_quantizer(const amx_slab_t *sl, uint64_t c)
{
    uint32_t lo = 0, hi = sl->n;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (sl->off[mid] <= c)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* The maps of the answer's globals (amx_devans_layout_t): the slab's
 * catalog indices and global slices, the end of each slice's quantizer in
 * the state's slice arrays (rebuilt with the slab), the previous globals.
 * results.c amx__slab_globals and amx__build_packed make the same arrays
 * on the host for the packed answer. */
static amx_status_t set_maps(amx_job_t *j, const amx_slab_t *sl, struct amx_devrank *d,
                             amx_err_t *err)
{
    uint64_t ns = sl->soff[sl->n];
    if (ns > 0 && d->slices_key != sl->serial) {
        uint64_t *e = realloc(d->slice_end, ns * sizeof(uint64_t));
        if (e == NULL)
            return amx_err_set(err, AMX_ENOMEM, "out of memory");
        d->slice_end = e;
        for (uint32_t i = 0; i < sl->n; i++) {
            const amx_lq_t *q = &j->lq[sl->lid[i]];
            uint64_t end = q->gbase + amx_qspec_slices(q->spec);
            for (uint64_t s = sl->soff[i]; s < sl->soff[i + 1]; s++)
                e[s] = end;
        }
        d->slices_key = sl->serial;
    }
    d->lay.key = sl->serial;
    d->lay.qoff = sl->off;
    d->lay.nq = sl->n;
    d->lay.cidx = sl->cidx;
    d->lay.ns = ns;
    d->lay.ssrc = sl->sg;
    d->lay.send = d->slice_end;
    d->lay.prev_ga = j->prev_ga;
    d->lay.prev_gs = j->prev_gs;
    d->lay.prev_ok = j->prev_ok;
    d->lay.prev_n = j->prev_n;
    d->lay.prev_key = j->prev_serial;
    d->lay.prev_dev = j->prev_dev;
    if (j->prev_dev)
        d->lay.prev_n = j->cat->n;
    return AMX_OK;
}

amx_status_t amx__dev_bad_slab(amx_job_t *j, amx_lrank_t *r, uint64_t epoch, amx_err_t *err)
{
    struct amx_devrank *d = r->dev;
    amx_slab_t *sl;
    if (d == NULL || !d->merged || amx__slab_get(j, r, &sl, err) != AMX_OK)
        return AMX_OK;
    int64_t bad = j->state->ops->dev_bad(j->state, d->buf);
    if (bad < 0)
        return AMX_OK;
    uint32_t qi = slab_quantizer(sl, (uint64_t)bad);
    return amx_err_set(
        err, AMX_EINVAL,
        "ReconcileDevice of rank %u, job '%s': device slab cell %lld "
        "(quantizer '%s', its value[%llu]) is NaN, infinite or negative; "
        "amax values must be finite and >= 0. Nothing of the slab was "
        "merged, and epoch %llu failed on every rank (the other contributions "
        "are kept for the next epoch)",
        r->rank, j->name, (long long)bad, qi < sl->n ? j->lq[sl->lid[qi]].spec->name : "?",
        (unsigned long long)((uint64_t)bad - sl->off[qi]), (unsigned long long)epoch);
}

amx_status_t amx__dev_answer(amx_registry_t *reg, amx_job_t *j, amx_lrank_t *r, uint64_t epoch,
                             amx_err_t *err)
{
    struct amx_devrank *d = r->dev;
    amx_state_t *st = j->state;
    if (d == NULL)
        return amx_err_set(err, AMX_EPRECOND,
                           "epoch %llu of job '%s' was reconciled, but rank %u's device buffers "
                           "were freed meanwhile: read the results with GetScales, or open new "
                           "buffers (OpenDevice)",
                           (unsigned long long)epoch, j->name, r->rank);
    if (d->merge_st != AMX_OK)
        return amx_err_set(err, d->merge_st, "epoch %llu was reconciled without rank %u's slab: %s",
                           (unsigned long long)epoch, r->rank, d->merge_msg);
    amx_slab_t *sl;
    AMX_CHECK(amx__slab_get(j, r, &sl, err));
    /* A backend whose dev_wait checks the slabs failed the epoch already. */
    AMX_CHECK(amx__dev_bad_slab(j, r, epoch, err));
    if (sl->id != d->layout_id)
        return amx_err_set(err, AMX_EPRECOND,
                           "epoch %llu of job '%s' was reconciled, but rank %u's layout changed "
                           "during it (a quantizer was refused by agreement) to %016" PRIx64
                           "; its device buffers are for %016" PRIx64
                           ": fetch the layout again (GetLayout) and open new buffers; the "
                           "results are in GetScales",
                           (unsigned long long)epoch, j->name, r->rank, sl->id, d->layout_id);
    AMX_CHECK(set_maps(j, sl, d, err));
    amx_devsignal_t done = {d->done_off, d->seq, r->rank, NULL};
    amx_status_t rc = st->ops->dev_answer(st, d->buf, sl->gather, sl->ngather, d->ncells, &d->lay,
                                          d->seq != 0 ? &done : NULL, err);
    if (rc == AMX_EDEVICE)
        return amx__note_fault(reg, rc, err->msg);
    return rc;
}

void amx__dev_epoch_end(amx_lrank_t *r)
{
    if (r->dev == NULL)
        return;
    r->dev->send = 0;
    r->dev->has_data = 0;
    r->dev->seq = 0;
    r->dev->armed = 0;
    r->dev->armed_aborted = 0;
    if (r->dev->hpage_next != NULL) {
        unmap_page(r->dev->hpage);
        r->dev->hpage = r->dev->hpage_next;
        r->dev->hpage_next = NULL;
    }
    r->dev->merged = 0;
    r->dev->merge_st = AMX_OK;
    r->dev->merge_msg[0] = '\0';
}

/* Whether the trainer process of device buffers d has exited. */
static int trainer_gone(const struct amx_devrank *d)
{
    if (d->pid == 0)
        return 0;
    if (d->pidfd >= 0) {
        struct pollfd p = {d->pidfd, POLLIN, 0};
        return poll(&p, 1, 0) > 0;
    }
    return kill((pid_t)d->pid, 0) != 0 && errno == ESRCH;
}

void amx__dev_reap(amx_job_t *j)
{
    char why[96];
    if (j->in_flight) {
        /* An armed epoch waits for the flags of trainers that may be gone:
         * it fails, and the buffers go after it. */
        for (uint32_t i = 0; i < j->nlocal; i++) {
            amx_lrank_t *r = &j->lr[i];
            if (!amx__dev_armed(r) || !trainer_gone(r->dev))
                continue;
            snprintf(why, sizeof(why), "its trainer (pid %u) exited", r->dev->pid);
            amx__dev_abort_armed(j, r, why);
        }
        return;
    }
    for (uint32_t i = 0; i < j->nlocal; i++) {
        amx_lrank_t *r = &j->lr[i];
        if (r->dev == NULL || !trainer_gone(r->dev))
            continue;
        snprintf(why, sizeof(why), "its trainer (pid %u) exited", r->dev->pid);
        amx__dev_close_rank(j, r, why);
    }
}
