/*
 * state.h - where a job's amax state lives and how an epoch is finished.
 *
 * The agreed catalog is laid out in flat float32 buffers of `ncells` cells
 * (catalog.h: quantizers sorted by name); PER_EPOCH quantizers also own
 * history cells. A state backend holds:
 *
 *   pending[2]  contributions (-inf = nobody wrote), double buffered: the
 *               active buffer takes SendAmax; at the start of an epoch it is
 *               flipped to be the in-flight buffer that the collective sends,
 *               and the other (clean) one becomes active. Each starts with
 *               AMX_HDR_CELLS header cells, then the agreed cells, then the
 *               provisional cells of quantizers not yet agreed.
 *   recv        the reduced [header | agreed cells]: the collective writes
 *               here, never into pending, so a failed collective changes
 *               nothing.
 *   accum, prev, history, prev_g
 *               running max, previous delayed scales (per cell, per
 *               quantizer) and history rings: the replicated state, changed
 *               only by a successful finish.
 *   outputs[2]  results (per cell: amax, scale, scale_inv, one byte; per
 *               quantizer: global amax, scale, scale_inv). "front" is
 *               published (read by GetScales on the loop thread); the engine
 *               writes "back"; publish swaps them.
 *
 * Threads. The loop thread calls reserve_pending, merge, flip, unflip,
 * remap_active, publish and read_results; it never calls them on an
 * in-flight buffer. While an epoch is in flight the job's engine thread
 * alone calls remap, prepare, read_header, finish, export_state and
 * import_state, and alone touches recv, the replicated state and the back
 * outputs. The CUDA backend uses one stream per thread.
 */
#ifndef AMX_STATE_H
#define AMX_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "recipe.h"
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Header cells at the front of pending and recv (docs/CLUSTER.md). */
#define AMX_HDR_CELLS 32

/* What a backend needs to know of one quantizer to post-process it. */
typedef struct amx_qdesc {
    uint64_t base;      /* first cell in the flat buffers */
    uint64_t ncells;    /* cells of the global amax tensor */
    uint64_t hist_base; /* first cell of its history ring (PER_EPOCH) */
    uint32_t hist_len;  /* H slots (1 when RUNNING_MAX) */
    uint32_t hist_head; /* the slot this epoch writes */
    int32_t peer_group; /* index, or -1 */
    int32_t scale_group;
    uint8_t accumulation;
    uint8_t reset;     /* finish: clear accumulated state before this epoch's values */
    uint8_t peer_mode; /* AMX_PEER_FILL / AMX_PEER_SHARE (with a peer group) */
    uint8_t stat;      /* its calibrator's kind (calib.h AMX_CAL_*): 0 for max */
    /* The global amax is the max of the accumulated (running) max, not of
     * the calibrated cells: the NVFP4 per-block search keeps phase 1's. */
    uint8_t global_of_max;
    uint8_t pad[3];
    /* Global slices (global_axes > 0): nslices globals, entries
     * [gbase, gbase + nslices) of the per-slice arrays; cell c (of this
     * quantizer) belongs to slice c / slice_cells. nslices 0: the one
     * global of the per-quantizer arrays; gbase is then the slices of the
     * quantizers before this one (so gbase never decreases). */
    uint64_t gbase;
    uint64_t nslices;
    uint64_t slice_cells;
    /* Calibrators beyond max (stat != 0): its statistic values are
     * [sbase, sbase + svals) of the stat buffers, its stat cells (basis and
     * calibrated amax, one per histogram, one per cell of an MSE search)
     * start at obase of the stat-cell arrays. */
    uint64_t sbase, svals, obase;
    amx_recipe_t recipe;
} amx_qdesc_t;

/* A run of contiguous cells: cells [dst, dst+len) take cells [src, src+len)
 * of a source (merge: max-merged from staged values; remap: copied). */
typedef struct amx_run {
    uint64_t dst;
    uint64_t src;
    uint64_t len;
} amx_run_t;

/* A layout change: the new sizes and, for each quantizer kept, where its
 * cells, history, per-quantizer and per-slice entries move. Cells not
 * covered by a run start fresh (-inf, or 1 for previous scales). */
typedef struct amx_layout_change {
    uint64_t ncells, nhist; /* the new layout's agreed cells and history cells */
    uint64_t nslices;       /* the new layout's global slices */
    uint32_t nq;
    const amx_run_t *cells; /* replicated state and outputs: old cell -> new cell */
    size_t ncell_runs;
    const amx_run_t *hist;
    size_t nhist_runs;
    const amx_run_t *qs; /* per-quantizer arrays */
    size_t nq_runs;
    const amx_run_t *pend; /* pending (agreed and provisional) -> new agreed cells */
    size_t npend_runs;
    const amx_run_t *slices; /* per-slice arrays */
    size_t nslice_runs;
    /* Statistics (calibrators beyond max): the new layout's stat values and
     * stat cells, and runs moving the accumulated statistic (stat, from
     * the replicated state's layout), the in-flight stat buffer (spend,
     * from the layout its values were merged in), the basis and the
     * published basis (scells). The active stat buffer is never remapped:
     * the loop takes statistics only while nothing is in flight, so it is
     * empty. */
    uint64_t nstat, nscell;
    const amx_run_t *stat;
    size_t nstat_runs;
    const amx_run_t *spend;
    size_t nspend_runs;
    const amx_run_t *scells;
    size_t nscell_runs;
    int outputs_from_back; /* remap the back outputs (after an import) instead of the front */
} amx_layout_change_t;

/* Host views of one output set, filled by export/import and read_results. */
typedef struct amx_state_arrays {
    float *accum, *prev, *hist, *prev_g;                              /* replicated state */
    float *out_amax, *out_scale, *out_inv, *g_amax, *g_scale, *g_inv; /* outputs */
    uint8_t *out_bytes;
    float *prev_gs;                  /* per slice: previous delayed global scale (replicated) */
    float *s_amax, *s_scale, *s_inv; /* per slice: global amax, scale, inverse (outputs) */
    /* Statistics: nstat accumulated values and nscell bases (replicated),
     * and per quantizer its published amx_stat_result_t (nq entries; its
     * epoch is the replicated one). The sizes travel here so that
     * export_state and import_state keep their signatures; 0 and NULL for
     * a job without calibrators beyond max. */
    uint64_t nstat, nscell;
    double *stat;
    float *basis;
    struct amx_stat_result *sq;
} amx_state_arrays_t;

/* The published statistic of one quantizer (calibrators beyond max). */
enum {
    AMX_STAT_NONE = 0,     /* a max quantizer */
    AMX_STAT_WAITING = 1,  /* no basis yet: send the max first */
    AMX_STAT_AGREED = 2,   /* basis fixed; no statistic yet: the amax is the max */
    AMX_STAT_COMPUTED = 3, /* the amax is the calibrator's (every cell had a statistic) */
};
typedef struct amx_stat_result {
    uint64_t epoch;  /* the epoch whose results fixed the basis (0: none) */
    double total;    /* histogram: counts summed (the overflow count included) */
    double overflow; /* histogram: values above the agreed range, counted in the last bin */
    uint8_t state;   /* AMX_STAT_* */
    uint8_t pad[7];
} amx_stat_result_t;

/* The global slices of a layout: the last quantizer's gbase + nslices. */
static inline uint64_t amx_qdesc_slices(const struct amx_qdesc *q, uint32_t nq)
{
    return nq ? q[nq - 1].gbase + q[nq - 1].nslices : 0;
}

typedef struct amx_state amx_state_t;

/* A histogram quantizer whose amax a backend computes (calib.h, stat_hist). */
struct amx_hist_job;

/* Device buffers shared with one trainer (dev_open). */
typedef struct amx_devbuf amx_devbuf_t;
#define AMX_IPC_HANDLE_BYTES 64 /* cudaIpcMemHandle_t, cudaIpcEventHandle_t */
typedef struct amx_devbuf_info {
    uint8_t slab[AMX_IPC_HANDLE_BYTES], answer[AMX_IPC_HANDLE_BYTES];
    uint8_t ready[AMX_IPC_HANDLE_BYTES], done[AMX_IPC_HANDLE_BYTES]; /* events */
    int device;      /* the buffers' CUDA ordinal in this process */
    int state_dev;   /* the state's */
    char bus_id[32]; /* the buffers' PCI bus id */
    int signals;     /* 32-bit stream memory operations work on the buffers' GPU */
} amx_devbuf_info_t;
/* A flag word in the device buffers instead of an interprocess event
 * (docs/API.md "Signals"): the uint32 at byte `flag_off` of the slab
 * (ready: wait until it reaches `seq`, cyclically) or of the answer (done:
 * write `seq` there). */
typedef struct amx_devsignal {
    uint64_t flag_off;
    uint32_t seq;
    uint32_t rank; /* ready: the trainer rank whose slab it orders (messages) */
    /* ready of an armed epoch (docs/API.md "Armed epochs"): the trainer's
     * stream writes seq into this word of host memory shared with the
     * daemon instead; dev_merge queues nothing behind it (no stream of the
     * daemon waits for a trainer's step): dev_wait polls it and launches
     * the merge when it passed. */
    const volatile uint32_t *host;
} amx_devsignal_t;
/* What dev_answer writes where: byte offsets of the device answer's
 * arrays, and the maps from the slab's quantizers and slices to the
 * state's. `missing`: a uint32 per quantizer of the slab, the count of
 * its cells without data (amax -inf, or in no gather run), counted on the
 * device; `qoff`: the slab's nq + 1 quantizer offsets (cells), which say
 * whose cell is whose. The globals are gathered on the device from the
 * front output set: g[0..2] global amax, scale and scale_inv per
 * quantizer (catalog index cidx[i], UINT32_MAX while not agreed: 0, 1,
 * 1), g[3..5] the same per global slice (state slice ssrc[s] when
 * send[s], the end of its quantizer's slices, lies within the front set;
 * else 0, 1, 1), g[6..7] the previous epoch's global amax and scale
 * (float32) and g[8] has_previous (a byte): prev_ga, prev_gs, prev_ok in
 * catalog order, prev_n of them (host memory, copied to the device once
 * per prev_key); or, with prev_dev, the global amax and scale of the
 * device's output set behind the front (the one published before), every
 * one of the prev_n previous (no host arrays, no copy).
 * `key`: the slab's serial; the gather runs, qoff, cidx, ssrc and send are
 * uploaded only when it changed. */
typedef struct amx_devans_layout {
    uint64_t key;
    uint64_t amax, scale, scale_inv, block_scales, missing;
    uint64_t g[9];
    const uint64_t *qoff;
    uint32_t nq;
    const uint32_t *cidx;
    uint64_t ns;
    const uint64_t *ssrc, *send;
    const float *prev_ga, *prev_gs;
    const uint8_t *prev_ok;
    uint32_t prev_n;
    uint64_t prev_key; /* changes whenever the prev_* arrays do (0: copy them every time) */
    int prev_dev;
} amx_devans_layout_t;

typedef struct amx_state_ops {
    const char *name;
    int on_device;
    /* Loop. Grows both pending buffers to at least `ncells` data cells
     * (new cells -inf); never shrinks. No epoch in flight. */
    amx_status_t (*reserve_pending)(amx_state_t *st, uint64_t ncells, amx_err_t *err);
    /* Loop. Max-merges `nruns` runs of `vals` (run.src indexes vals) into the
     * active pending buffer. The values were validated (finite and >= 0, or
     * -inf for "no data"); `overlap`: two runs may hit the same cell. */
    amx_status_t (*merge)(amx_state_t *st, const float *vals, uint64_t nvals, const amx_run_t *runs,
                          size_t nruns, int overlap, amx_err_t *err);
    /* Loop. The active buffer becomes the in-flight one. */
    void (*flip)(amx_state_t *st);
    /* Loop, after a failed epoch: with `keep`, the in-flight contributions
     * are max-merged back into the active buffer (the next attempt takes
     * them); without, they are dropped (they were for an epoch the cluster
     * had already reconciled). The in-flight buffer is cleared. */
    amx_status_t (*unflip)(amx_state_t *st, int keep, amx_err_t *err);
    /* Loop, after an epoch whose engine changed the layout: moves the active
     * buffer's cells (lc->pend) to the new layout of lc->ncells cells. */
    amx_status_t (*remap_active)(amx_state_t *st, const amx_layout_change_t *lc, amx_err_t *err);
    /* Loop. Swaps front and back outputs. */
    void (*publish)(amx_state_t *st);
    /* Loop. Gathers the front outputs of `nruns` runs (run.src = cell,
     * run.dst = index in the destination arrays, `total` cells in all) into
     * host arrays. */
    amx_status_t (*read_results)(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                 uint64_t total, float *amax, float *scale, float *inv,
                                 uint8_t *bytes, amx_err_t *err);

    /* Engine. Applies a layout change to the in-flight pending buffer, the
     * replicated state and the outputs (into the back set). */
    amx_status_t (*remap)(amx_state_t *st, const amx_layout_change_t *lc, amx_err_t *err);
    /* Engine. Writes `hdr` into the in-flight buffer and returns the
     * collective's buffers: *send = [header | ncells cells] of the in-flight
     * buffer, *recv = the receive buffer (grown as needed), *stream the
     * engine's cudaStream_t (NULL for host). */
    amx_status_t (*prepare)(amx_state_t *st, const float *hdr, uint64_t ncells, float **send,
                            float **recv, void **stream, amx_err_t *err);
    /* Engine. Copies the reduced header out of recv. */
    amx_status_t (*read_header)(amx_state_t *st, float *hdr, amx_err_t *err);
    /* Engine. Finishes an epoch over the `nq` quantizers of `q` (the current
     * layout, `ncells` cells, amx_qdesc_slices(q, nq) slices): quantizers
     * with q[i].reset set lose their accumulated state first; then
     * accumulation of the reduced values (recv, or the in-flight buffer
     * itself when `from_send`: one participant), peer fill or share, global
     * amax (per quantizer and per slice), scale groups and scales into the
     * back outputs;
     * the in-flight buffer is cleared. `desc_dirty`: q differs from the last
     * finish's (a device copy may be reused otherwise). On error the replicated state may be
     * partly updated: the caller treats the job's device as broken. */
    amx_status_t (*finish)(amx_state_t *st, const amx_qdesc_t *q, uint32_t nq, uint64_t ncells,
                           uint32_t npeer, uint32_t nscale, int from_send, int desc_dirty,
                           amx_err_t *err);
    /* Engine (or the loop while no epoch is in flight). Copies the
     * replicated state and the front outputs (`back`: the back ones, just
     * written by finish and not yet published) of a layout of (ncells,
     * nhist, nq, nslices) into host arrays: a donor's state transfer, a
     * snapshot. */
    amx_status_t (*export_state)(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                 uint64_t nslices, int back, const amx_state_arrays_t *dst,
                                 amx_err_t *err);
    /* Engine. Replaces the replicated state and the back outputs with host
     * arrays of a layout of (ncells, nhist, nq, nslices). */
    amx_status_t (*import_state)(amx_state_t *st, uint64_t ncells, uint64_t nhist, uint32_t nq,
                                 uint64_t nslices, const amx_state_arrays_t *src, amx_err_t *err);
    void (*destroy)(amx_state_t *st);

    /* Optional (NULL: reserve_pending does it all). Loop. Like
     * reserve_pending, but the new cells are left for fill_pending: cheap
     * on the loop however large the growth. Until fill_pending has run,
     * nothing may read or write the new cells and no epoch may start. */
    amx_status_t (*grow_pending)(amx_state_t *st, uint64_t ncells, amx_err_t *err);
    /* Any thread, while the loop keeps off the new cells: sets the cells
     * grow_pending added to -inf. */
    void (*fill_pending)(amx_state_t *st);

    /* Optional (NULL: not known). Loop. Gathers, like read_results, one
     * byte per cell of the front outputs: 1 where the cell had no data and
     * took its peer group's max in the epoch that made them. EUNAVAIL when
     * the front outputs were not made by a finish (a remap or an import). */
    amx_status_t (*read_filled)(amx_state_t *st, const amx_run_t *runs, size_t nruns,
                                uint8_t *filled, amx_err_t *err);
    /* Statistics (calibrators beyond max; docs/API.md). A backend keeps
     * stat buffers of float64 values laid out by the agreed catalog
     * (amx_qdesc_t.sbase): pending[2] flipped with the amax buffers, a
     * receive buffer, and the accumulated sums. remap moves them with
     * lc->stat, remap_active resizes the (empty) active one, unflip adds
     * the in-flight values back, export_state and import_state carry the
     * accumulated sums in amx_state_arrays_t.
     *
     * Loop, nothing in flight. Adds `nruns` runs of `vals` (run.src
     * indexes vals) into the active stat buffer; runs never overlap. */
    amx_status_t (*stat_merge)(amx_state_t *st, const double *vals, uint64_t nvals,
                               const amx_run_t *runs, size_t nruns, amx_err_t *err);
    /* Engine. The SUM collective's buffers: *send the in-flight stat
     * buffer's first n values, *recv a receive buffer of n (device memory
     * for the CUDA backend), *stream as prepare. */
    amx_status_t (*stat_prepare)(amx_state_t *st, uint64_t n, double **send, double **recv,
                                 void **stream, amx_err_t *err);
    /* Engine. Accumulates the reduced statistic (recv, or the in-flight
     * buffer itself when `from_send`): the runs `clear` of the accumulated
     * sums are zeroed first, then the runs `add` take += the reduced
     * values; the in-flight stat buffer is zeroed. Copies all n = nstat
     * accumulated values into `host`. */
    amx_status_t (*stat_accumulate)(amx_state_t *st, uint64_t n, const amx_run_t *clear,
                                    size_t nclear, const amx_run_t *add, size_t nadd, int from_send,
                                    double *host, amx_err_t *err);
    /* Engine. Copies the replicated accumulated amax (running max, -inf =
     * no data) of `nruns` runs (run.src = cell, run.dst = index in `out`)
     * into host memory: the max a basis is fixed from. */
    amx_status_t (*read_accum)(amx_state_t *st, const amx_run_t *runs, size_t nruns, float *out,
                               amx_err_t *err);

    /* Device buffers shared with a trainer (GPU-direct, docs/API.md
     * "Device buffers"). NULL for a backend whose state is not on a GPU:
     * the service then answers FAILED_PRECONDITION. All on the loop
     * thread.
     *
     * Allocates on the device named by `device` (a PCI bus id or a GPU
     * UUID, as the trainer sees its GPU) a slab of `slab_bytes` and an
     * answer buffer of `answer_bytes`, and two interprocess events, and
     * fills `info` with their CUDA IPC handles. EINVAL / ENOTFOUND for a
     * device string that names no GPU of this process, EPRECOND when the
     * state's device cannot reach it by peer access, ENOMEM. Free with
     * dev_close. */
    amx_status_t (*dev_open)(amx_state_t *st, const char *device, uint64_t slab_bytes,
                             uint64_t answer_bytes, struct amx_devbuf **out,
                             struct amx_devbuf_info *info, amx_err_t *err);
    /* Loop, just after flip: queues on the backend's device-in stream,
     * behind the trainer's ready event, a check of the slab's `ncells`
     * float32 values (with `has_data_off` != UINT64_MAX, one has-data byte
     * per cell at that offset of the slab) and, when every value with data
     * is finite and >= 0, their max-merge along `runs` (run.src = slab
     * cell, sorted) into the in-flight pending buffer. With `ready`, behind
     * its flag instead of the ready event. Never waits for the
     * trainer: the engine's stream waits for the merge (prepare, remap,
     * finish and unflip do). `rank`: the trainer rank of the slab (dev_wait's
     * messages). `key`: the slab's serial; the runs are uploaded only when
     * it changed. */
    amx_status_t (*dev_merge)(amx_state_t *st, struct amx_devbuf *d, const amx_run_t *runs,
                              size_t nruns, uint64_t key, uint64_t ncells, uint64_t has_data_off,
                              const amx_devsignal_t *ready, uint32_t rank, amx_err_t *err);
    /* Loop, after the epoch of the last dev_merge ended: the first slab
     * cell that failed its check (the slab was then not merged), or -1
     * (also for a slab dev_wait released). */
    int64_t (*dev_bad)(amx_state_t *st, struct amx_devbuf *d);
    /* Optional. Any thread: whether the last dev_merge of d still waits
     * for its trainer's ready flag (it was neither passed nor released). */
    int (*dev_waiting)(amx_state_t *st, struct amx_devbuf *d);
    /* Loop. Writes the front outputs of the `ngather` runs (run.src =
     * output cell, run.dst = slab cell, sorted by dst) of a slab of
     * `ncells` cells into the answer buffer in slab order: amax (no data:
     * 0), scale, scale_inv and the byte at the offsets of `lay`; cells of
     * no run read 0, 1, 1, 0; and per quantizer of the slab (lay->qoff) the
     * count of its cells without data (-inf or no run) at lay->missing.
     * Then the globals at lay->g (amx_devans_layout_t), and records the
     * done event (with `done`: writes its flag instead). Returns once the
     * daemon's side is queued and its own buffers may be reused; nothing
     * of it waits for the trainer. */
    amx_status_t (*dev_answer)(amx_state_t *st, struct amx_devbuf *d, const amx_run_t *gather,
                               size_t ngather, uint64_t ncells, const struct amx_devans_layout *lay,
                               const amx_devsignal_t *done, amx_err_t *err);
    /* Loop. Waits for the buffers' queued work and frees them. */
    void (*dev_close)(amx_state_t *st, struct amx_devbuf *d);

    /* Optional (NULL: engine_stat.c computes every amax on the host).
     * Engine, after stat_accumulate: the amax of the histogram quantizers
     * `jobs` (calib.h amx_hist_job_t; job.sbase indexes the accumulated
     * sums) by their methods, with the host's arithmetic (calib_core.h),
     * into out[i]; NaN where the backend does not decide the host's bits
     * (an entropy near-tie, cuda/calib_cuda.cu): the engine computes
     * those. */
    amx_status_t (*stat_hist)(amx_state_t *st, const struct amx_hist_job *jobs, size_t n,
                              float *out, amx_err_t *err);

    /* Optional (NULL: nothing to wait for). Engine, before anything of
     * the epoch touches the in-flight buffer: waits on the host, until
     * `deadline_ms` (amx_now_ms; UINT64_MAX: none), for the device slabs
     * the loop queued at the flip (dev_merge) to be merged. When the
     * deadline passes first, every slab whose trainer never wrote its
     * ready flag is released: its merge is cancelled (the slab is not
     * merged) and the daemon writes the flag itself from another stream,
     * so its streams go on; then ETIMEDOUT naming those ranks. A slab
     * ordered by the ready event instead cannot be released (a stream
     * wait on an event cannot be cancelled): then this logs why and
     * waits on, as without a deadline. `aborted(ud)` (may be NULL) is
     * polled as well: once it is non-zero the stuck signal slabs are
     * released the same way and the wait ends with EABORTED. Once every
     * slab is merged, a slab that failed its check (dev_bad) fails the
     * wait with EINVAL naming its rank and cell: the epoch must fail on
     * every rank, not go on without that slab. `spin`: poll without
     * sleeping (a core busy while it waits), else sleep 50 us between
     * polls once the first thousand found nothing. */
    amx_status_t (*dev_wait)(amx_state_t *st, uint64_t deadline_ms, int spin,
                             int (*aborted)(void *ud), void *ud, amx_err_t *err);
    /* Engine, optional; after prepare. Pinned host memory for the reduced
     * header and, in *dev, where it is on the device (recv): a collective
     * that can copy it out behind itself (amx_comm_ops_t.tail) saves the
     * copy and sync of read_header. */
    float *(*header_copy)(amx_state_t *st, const float **dev);
} amx_state_ops_t;

struct amx_state {
    const amx_state_ops_t *ops;
    void *impl;
    /* Sizes, kept by the backend. */
    uint64_t pend_cells;    /* data cells of each pending buffer */
    uint64_t ncells, nhist; /* replicated state */
    uint32_t nq;
    uint64_t nslices;
    uint64_t out_cells[2]; /* per output set */
    uint32_t out_nq[2];
    int front; /* index of the published output set */
    /* Per-quantizer results of both output sets, host memory. */
    float *g_amax[2], *g_scale[2], *g_inv[2];
    uint32_t g_cap[2]; /* entries allocated in each of them */
    /* Per-slice results (global_axes > 0) of both output sets, host memory
     * allocated like the per-quantizer ones: out_ns[k] entries valid. */
    float *s_amax[2], *s_scale[2], *s_inv[2];
    uint64_t s_cap[2], out_ns[2];
    /* How those arrays are allocated and freed; NULL: malloc and free. The
     * CUDA backend pins them so that finish copies results straight in. */
    void *(*host_alloc)(struct amx_state *st, size_t bytes);
    void (*host_free)(struct amx_state *st, void *p);
    /* Engine timings of the last finish, microseconds (for Status). */
    uint64_t last_finish_us;
    /* Cells of the last finish that took their peer group's max, and cells
     * left without data after the fill; set by backends that count them
     * (cell_counts = 1), for metrics. Written by the engine in finish. */
    int cell_counts;
    uint64_t last_filled, last_missing;
    /* Statistics (calibrators beyond max), host memory, kept by state.c's
     * helpers for every backend. Sizes of the replicated layout: */
    uint64_t nstat, nscell;
    /* Replicated (engine while in flight, like the backend's buffers): the
     * basis of each stat cell (0 until fixed) and, per quantizer, the
     * epoch that fixed it (0: not yet). */
    float *basis;
    uint64_t *sq_epoch;
    uint64_t sq_n; /* entries of sq_epoch */
    /* Engine, for finish only (NULL: none): per stat cell the amax its
     * calibrator computed, NaN where the cell keeps its max. */
    const float *ovr;
    /* Published with the outputs (front / back, swapped by publish): the
     * basis of each stat cell and each quantizer's amx_stat_result_t. */
    float *p_basis[2];
    amx_stat_result_t *p_sq[2];
    uint64_t p_nscell[2];
    uint32_t p_nq[2];
};

/* Creates an empty state of the named backend ("host" or "cuda") on CUDA
 * device `device` (ignored by host). EUNAVAIL when the backend is not
 * compiled in or no GPU is usable. Free with amx_state_destroy. */
amx_status_t amx_state_create(const char *backend, int device, amx_state_t **out, amx_err_t *err);

void amx_state_destroy(amx_state_t *st);

/* True when a CUDA device is present and the cuda backend is compiled in. */
int amx_state_cuda_available(void);

/* Bytes of state a backend keeps per amax cell (pending x2, receive,
 * accumulated, previous scale, two result sets), for memory budgets. */
#define AMX_STATE_BYTES_PER_CELL 48

/* The memory a backend's state lives in: the host's physical memory, or
 * the CUDA device's (0 when unknown). */
uint64_t amx_state_memory(const char *backend, int device);
uint64_t amx__state_cuda_memory(int device);

/* The host backend's per-cell scales of an FP8 current-scaling quantizer
 * (the SSE2 path where the build has it, else the scalar one); 1 when the
 * SSE2 path ran. For tests: the same bytes as amx_pp_cell. */
int amx__host_fp8_current_cells(const amx_recipe_t *r, const float *amax, uint64_t n, float *scale,
                                float *inv, uint8_t *bytes);

/* Host backend constructor (state_host.c). */
amx_status_t amx__state_host_create(amx_state_t **out, amx_err_t *err);
/* CUDA backend constructor (cuda/state_cuda.cu), when built. */
amx_status_t amx__state_cuda_create(int device, amx_state_t **out, amx_err_t *err);
int amx__state_cuda_probe(void);

/* For backends: grows output set `k`'s host per-quantizer arrays to `nq`
 * (new entries: 0, 1, 1). ENOMEM leaves them unchanged. */
amx_status_t amx__state_grow_globals(amx_state_t *st, int k, uint32_t nq, amx_err_t *err);

/* For backends: sizes output set `k`'s host per-slice arrays for `ns`
 * slices (kept entries unchanged, new ones 0, 1, 1). ENOMEM leaves them
 * unchanged. */
amx_status_t amx__state_size_slices(amx_state_t *st, int k, uint64_t ns, amx_err_t *err);

/* For backends' remap: the replicated basis and epochs and the published
 * stat results (from output set `src` into `back`) moved to layout `lc`.
 * ENOMEM leaves everything as it was. */
amx_status_t amx__state_remap_stats(amx_state_t *st, const amx_layout_change_t *lc, int src,
                                    int back, amx_err_t *err);

/* For backends' import_state: the replicated basis and epochs, and output
 * set `back`'s published stat results, from `a` (a layout of nq
 * quantizers). ENOMEM leaves everything as it was. */
amx_status_t amx__state_import_stats(amx_state_t *st, const amx_state_arrays_t *a, uint32_t nq,
                                     int back, amx_err_t *err);

/* For backends' export_state: the replicated basis and output set f's
 * published stat results into `d` (nq quantizers). */
void amx__state_export_stats(const amx_state_t *st, uint32_t nq, int f,
                             const amx_state_arrays_t *d);

/* Engine: sizes output set k's published stat arrays for nq quantizers
 * and nscell stat cells (contents undefined). */
amx_status_t amx__state_size_stat_results(amx_state_t *st, int k, uint32_t nq, uint64_t nscell,
                                          amx_err_t *err);

#ifdef __cplusplus
}
#endif

#endif
