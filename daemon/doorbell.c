/*
 * doorbell.c - ReconcileDevice over a Unix SOCK_SEQPACKET socket (see
 * doorbell.h for the protocol and the threads).
 *
 * A connection is owned by the doorbell thread while it reads, by the
 * loop lock's holder while its request is served, and freed under the
 * loop lock only (its close task), after its wait was cancelled. While a
 * request is served the thread listens for the connection's hang-up only,
 * so answers (sent under the loop lock) and errors of a malformed request
 * (sent by the thread) never interleave.
 */
#define _GNU_SOURCE /* accept4 */
#include "doorbell.h"

#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <linux/magic.h>
#include <sys/un.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"

typedef struct conn {
    amx_door_t *door;
    int fd;
    int dead; /* doorbell thread: out of epoll, its close task queued */
    amx_waiter_t w;
    amx_rpc_task_t t_req, t_close;
    struct conn *prev, *next; /* door->conns, under door->mu */
    /* The request being served. */
    char job[AMX_DOOR_MAX_JOB + 1];
    uint32_t rank, flags, seq;
    uint64_t epoch, layout_id, device_id;
    int armed;   /* the request being served is an epoch the daemon armed */
    int flag_fd; /* the arm request's flag page (SCM_RIGHTS), until served; -1 */
    /* Under the loop lock: its armed request is queued (t_req), so a close
     * task queued before it only marks it (close_wanted) and serve frees. */
    int rearm_queued, close_wanted;
} conn_t;

struct amx_door {
    amx_registry_t *reg;
    amx_rpc_t *rpc;
    int lfd, efd, stopfd;
    pthread_t th;
    int th_started;
    pthread_mutex_t mu;
    conn_t *conns;
    uint32_t nconns;
    uint64_t refused;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get64(const uint8_t *p)
{
    return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

/* Listen for requests (1) or for the hang-up only (0). */
static void want_requests(conn_t *c, int on)
{
    struct epoll_event ev = {.events = EPOLLRDHUP | (on ? EPOLLIN : 0u), .data.ptr = c};
    /* ENOENT: the thread took it out of epoll (it hung up) meanwhile. */
    (void)epoll_ctl(c->door->efd, EPOLL_CTL_MOD, c->fd, &ev);
}

/* Sends one answer and reads the next request. A peer that cannot take it
 * has hung up or never reads: the thread sees the hang-up; a full socket
 * loses the answer (the trainer is told nothing it was not told already:
 * it times out), and the daemon does not wait for it. */
static void answer_as(conn_t *c, amx_status_t st, const char *msg, uint64_t epoch,
                      uint64_t next_epoch, uint64_t layout_id, int armed, int more)
{
    uint8_t buf[AMX_DOOR_ANS_BYTES + AMX_DOOR_MAX_MSG];
    size_t n = msg != NULL ? strnlen(msg, AMX_DOOR_MAX_MSG) : 0;
    memset(buf, 0, AMX_DOOR_ANS_BYTES);
    put32(buf, AMX_DOOR_MAGIC);
    put32(buf + 4, (uint32_t)amx_status_grpc(st));
    put64(buf + 8, epoch);
    put64(buf + 16, next_epoch);
    put64(buf + 24, layout_id);
    put32(buf + 32, (uint32_t)n);
    put32(buf + 36, armed ? AMX_DOOR_ARMED : 0u);
    memcpy(buf + AMX_DOOR_ANS_BYTES, msg != NULL ? msg : "", n);
    if (send(c->fd, buf, AMX_DOOR_ANS_BYTES + n, MSG_DONTWAIT | MSG_NOSIGNAL) < 0)
        AMX_DEBUG("door", "an answer was not sent (%s): the trainer went away", strerror(errno));
    if (!armed && !more)
        want_requests(c, 1);
}

static void answer(conn_t *c, amx_status_t st, const char *msg, uint64_t epoch, uint64_t next_epoch,
                   uint64_t layout_id)
{
    answer_as(c, st, msg, epoch, next_epoch, layout_id, 0, 0);
}

static void refuse(conn_t *c, amx_status_t st, const char *msg)
{
    AMX_WARN("door", "ReconcileDevice rejected (%s): %s", amx_strerror(st), msg);
    answer(c, st, msg, 0, 0, 0);
}

static ssize_t recv_with_fd(conn_t *c, uint8_t *buf, size_t len, int *fd);

/* Under the loop lock, answering an epoch of a connection that asked to
 * be armed (the thread reads nothing of it meanwhile): whether the trainer
 * sent nothing but disarms since, which are taken. Anything else ends the
 * arming too (*other: a request it should not have sent). */
static int still_armed(conn_t *c, int *other)
{
    uint8_t buf[AMX_DOOR_REQ_BYTES + AMX_DOOR_MAX_JOB];
    int keep = 1;
    *other = 0;
    for (;;) {
        int fd;
        ssize_t n = recv_with_fd(c, buf, sizeof(buf), &fd);
        if (fd >= 0)
            close(fd);
        if (n <= 0)
            return keep; /* nothing more (a hang-up: the thread sees it) */
        keep = 0;
        if (n < AMX_DOOR_REQ_BYTES || (size_t)n > sizeof(buf) || get32(buf) != AMX_DOOR_MAGIC ||
            get32(buf + 4) != AMX_DOOR_DISARM)
            *other = 1;
    }
}

static void serve(void *arg);

/* The registry's answer (under the loop lock). */
static void on_done(amx_waiter_t *w, amx_status_t st, const char *msg, const amx_reply_t *rep)
{
    conn_t *c = (conn_t *)(void *)((char *)w - offsetof(conn_t, w));
    c->w.job = NULL;
    if (st != AMX_OK) {
        AMX_WARN("door", "ReconcileDevice%s answered %s: %s", c->armed ? " (armed)" : "",
                 amx_strerror(st), msg);
        c->armed = 0;
        answer(c, st, msg, 0, 0, 0);
        return;
    }
    int other = 0;
    if (!(c->flags & AMX_DOOR_ARM) || !still_armed(c, &other) ||
        amx_registry_shutting_down(c->door->reg)) {
        c->armed = 0;
        /* Reading goes on after the last datagram of the two, not between
         * them (a request read in between would be served twice). */
        answer_as(c, AMX_OK, NULL, rep->epoch, rep->next_epoch, c->layout_id, 0, other);
        if (other)
            refuse(c, AMX_EINVAL,
                   "doorbell: a request came while the connection was armed; only a disarm "
                   "(flags 8) may be sent then. The arming ended with this answer");
        return;
    }
    /* Armed: the same request, for the next epoch and signal, served once
     * the loop lock is let go (not inside the epoch's end). */
    c->armed = 1;
    c->epoch = rep->next_epoch;
    c->seq = c->seq + 1 ? c->seq + 1 : 1;
    answer_as(c, AMX_OK, NULL, rep->epoch, rep->next_epoch, c->layout_id, 1, 0);
    c->rearm_queued = 1;
    amx_rpc_run_locked(c->door->rpc, &c->t_req);
}

static void close_conn(void *arg);

/* Serves the request read by the thread (under the loop lock). */
static void serve(void *arg)
{
    conn_t *c = arg;
    c->rearm_queued = 0;
    if (c->close_wanted) {
        close_conn(c); /* it hung up before its armed request was served */
        return;
    }
    amx_reconcile_req_t q = {0};
    q.job = c->job;
    q.rank = c->rank;
    q.epoch = c->epoch;
    q.layout_id = c->layout_id;
    q.device = 1;
    q.device_id = c->device_id;
    q.send = (c->flags & AMX_DOOR_SEND) != 0;
    q.has_data = (c->flags & AMX_DOOR_HAS_DATA) != 0;
    q.seq = c->seq;
    q.armed = c->armed;
    int fd = c->flag_fd;
    c->flag_fd = -1;
    memset(&c->w, 0, sizeof(c->w));
    c->w.done = on_done;
    amx_err_t err = {0};
    amx_status_t st = amx_registry_reconcile(c->door->reg, &q, &c->w, amx_now_ms(), &err);
    if (st == AMX_OK) {
        /* The arm request's flag page, for the epochs it arms. Should it
         * not map, this epoch goes on (its answer may even be sent by
         * now) and the next is not armed. */
        if (fd >= 0 &&
            amx_registry_dev_flag_page(c->door->reg, c->job, c->rank, fd, &err) != AMX_OK) {
            c->flags &= ~AMX_DOOR_ARM;
            AMX_WARN("door", "%s", err.msg);
        }
        if (fd >= 0)
            close(fd);
        return;
    }
    if (fd >= 0)
        close(fd);
    c->w.job = NULL;
    if (!c->armed) {
        refuse(c, err.code, err.msg);
        return;
    }
    /* The trainer hears it as the answer of the armed epoch. */
    c->armed = 0;
    char msg[AMX_DOOR_MAX_MSG];
    snprintf(msg, sizeof(msg), "arming epoch %llu failed: %s", (unsigned long long)c->epoch,
             err.msg);
    refuse(c, err.code, msg);
}

/* Frees a connection that hung up (under the loop lock). */
static void close_conn(void *arg)
{
    conn_t *c = arg;
    amx_door_t *d = c->door;
    if (c->rearm_queued) {
        c->close_wanted = 1;
        return;
    }
    if (c->w.job != NULL)
        amx_registry_cancel(d->reg, &c->w);
    if (c->flag_fd >= 0)
        close(c->flag_fd);
    close(c->fd);
    pthread_mutex_lock(&d->mu);
    if (c->prev != NULL)
        c->prev->next = c->next;
    else
        d->conns = c->next;
    if (c->next != NULL)
        c->next->prev = c->prev;
    d->nconns--;
    pthread_mutex_unlock(&d->mu);
    free(c);
}

/* Doorbell thread: the connection is done with; its close waits for the
 * loop lock. */
static void drop(conn_t *c)
{
    c->dead = 1;
    (void)epoll_ctl(c->door->efd, EPOLL_CTL_DEL, c->fd, NULL);
    amx_rpc_run_locked(c->door->rpc, &c->t_close);
}

/* One datagram of c into buf; a file descriptor it carried (SCM_RIGHTS)
 * into *fd (-1: none; any more are closed). */
static ssize_t recv_with_fd(conn_t *c, uint8_t *buf, size_t len, int *fd)
{
    union {
        struct cmsghdr h;
        char b[CMSG_SPACE(4 * sizeof(int))];
    } ctl;
    struct iovec iov = {buf, len};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctl.b;
    m.msg_controllen = sizeof(ctl.b);
    *fd = -1;
    ssize_t n = recvmsg(c->fd, &m, MSG_DONTWAIT | MSG_TRUNC | MSG_CMSG_CLOEXEC);
    if (n < 0)
        return n;
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&m); h != NULL; h = CMSG_NXTHDR(&m, h)) {
        if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int f;
            memcpy(&f, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
            if (*fd < 0)
                *fd = f;
            else
                close(f);
        }
    }
    if (m.msg_flags & MSG_CTRUNC)
        AMX_WARN("door", "a datagram carried more file descriptors than one: closed");
    return n;
}

/* Whether fd is a flag page an armed epoch may read: at least a page,
 * sealed against shrinking (the daemon's reads can never fault). */
static int flag_page_ok(int fd)
{
    struct stat st;
#ifdef F_GET_SEALS
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 || !(seals & F_SEAL_SHRINK))
        return 0;
#else
    return 0;
#endif
    struct statfs fs; /* shmem (a plain memfd), not hugetlbfs: a 4096-byte mapping */
    return fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size >= 4096 &&
           fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC;
}

/* Doorbell thread: one datagram from c. */
static void read_request(conn_t *c)
{
    uint8_t buf[AMX_DOOR_REQ_BYTES + AMX_DOOR_MAX_JOB];
    int fd;
    ssize_t n = recv_with_fd(c, buf, sizeof(buf), &fd);
    if (n < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (n <= 0) {
        if (fd >= 0)
            close(fd);
        drop(c);
        return;
    }
    char msg[200];
    uint32_t job_len = n >= AMX_DOOR_REQ_BYTES ? get32(buf + 36) : 0;
    if ((size_t)n > sizeof(buf) || n < AMX_DOOR_REQ_BYTES)
        snprintf(msg, sizeof(msg),
                 "doorbell: a request is %d to %zu bytes (%zu: the header, then the job name), "
                 "not %zd",
                 AMX_DOOR_REQ_BYTES + 1, sizeof(buf), (size_t)AMX_DOOR_REQ_BYTES, n);
    else if (get32(buf) != AMX_DOOR_MAGIC)
        snprintf(msg, sizeof(msg),
                 "doorbell: a request starts with 0x%08x (\"ADB1\" little-endian), not 0x%08x",
                 AMX_DOOR_MAGIC, get32(buf));
    else if (job_len == 0)
        snprintf(msg, sizeof(msg), "doorbell: the request names no job (job_len 0)");
    else if (AMX_DOOR_REQ_BYTES + (size_t)job_len != (size_t)n)
        snprintf(msg, sizeof(msg),
                 "doorbell: the request names a job of %u bytes but carries %zd after its "
                 "header",
                 job_len, n - AMX_DOOR_REQ_BYTES);
    else if (get32(buf + 4) == AMX_DOOR_DISARM)
        msg[0] = '\1'; /* a disarm after the arming ended (an error answered it): nothing to do */
    else if ((get32(buf + 4) & ~(AMX_DOOR_SEND | AMX_DOOR_HAS_DATA | AMX_DOOR_ARM)) != 0)
        snprintf(msg, sizeof(msg),
                 "doorbell: unknown request flags 0x%x (1: send, 2: has_data, 4: arm; 8, alone: "
                 "disarm)",
                 get32(buf + 4));
    else if ((get32(buf + 4) & AMX_DOOR_ARM) &&
             (!(get32(buf + 4) & AMX_DOOR_SEND) || get32(buf + 40) == 0))
        snprintf(msg, sizeof(msg),
                 "doorbell: arm (flag 4) needs send (flag 1) and a signal (seq != 0): an armed "
                 "epoch starts when the trainer's ready flag reaches seq + 1");
    else if ((get32(buf + 4) & AMX_DOOR_ARM) && (fd < 0 || !flag_page_ok(fd)))
        snprintf(msg, sizeof(msg),
                 "doorbell: arm (flag 4) needs its flag page with the request: a memfd of at "
                 "least 4096 bytes sealed against shrinking (F_SEAL_SHRINK), passed with "
                 "SCM_RIGHTS (%s)",
                 fd < 0 ? "none came" : "the one that came is not");
    else if (get32(buf + 44) != 0)
        snprintf(msg, sizeof(msg), "doorbell: bytes 44-47 of a request are reserved (0), not 0x%x",
                 get32(buf + 44));
    else
        msg[0] = '\0';
    if (fd >= 0 && (msg[0] != '\0' || !(get32(buf + 4) & AMX_DOOR_ARM))) {
        close(fd);
        fd = -1;
    }
    if (msg[0] == '\1') {
        AMX_DEBUG("door", "a disarm on a connection that is not armed: ignored");
        return;
    }
    if (msg[0] != '\0') {
        refuse(c, AMX_EINVAL, msg);
        return;
    }
    if (c->flag_fd >= 0)
        close(c->flag_fd);
    c->flag_fd = fd;
    c->flags = get32(buf + 4);
    c->device_id = get64(buf + 8);
    c->epoch = get64(buf + 16);
    c->layout_id = get64(buf + 24);
    c->rank = get32(buf + 32);
    c->seq = get32(buf + 40);
    memcpy(c->job, buf + AMX_DOOR_REQ_BYTES, job_len);
    c->job[job_len] = '\0';
    c->armed = 0;
    want_requests(c, 0);
    amx_rpc_run_locked(c->door->rpc, &c->t_req);
}

static void accept_all(amx_door_t *d)
{
    for (;;) {
        int fd = accept4(d->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
                AMX_WARN("door", "accept on %s: %s", d->path, strerror(errno));
            return;
        }
        conn_t *c = NULL;
        pthread_mutex_lock(&d->mu);
        if (d->nconns < AMX_DOOR_MAX_CONNS)
            c = calloc(1, sizeof(*c));
        if (c != NULL) {
            c->door = d;
            c->fd = fd;
            c->flag_fd = -1;
            amx_rpc_task_init(&c->t_req, serve, c);
            amx_rpc_task_init(&c->t_close, close_conn, c);
            c->next = d->conns;
            if (d->conns != NULL)
                d->conns->prev = c;
            d->conns = c;
            d->nconns++;
        }
        pthread_mutex_unlock(&d->mu);
        struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = c};
        if (c == NULL) {
            if (d->refused++ % 1000 == 0)
                AMX_WARN("door",
                         "%s: a connection refused (%u open, at most %d; or out of "
                         "memory); %llu refused so far",
                         d->path, d->nconns, AMX_DOOR_MAX_CONNS, (unsigned long long)d->refused);
            close(fd);
        } else if (epoll_ctl(d->efd, EPOLL_CTL_ADD, fd, &ev) != 0) {
            AMX_WARN("door", "epoll_ctl: %s", strerror(errno));
            c->dead = 1;
            amx_rpc_run_locked(d->rpc, &c->t_close);
        }
    }
}

static void *door_main(void *arg)
{
    amx_door_t *d = arg;
    struct epoll_event evs[64];
    for (;;) {
        int n = epoll_wait(d->efd, evs, 64, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            AMX_ERROR("door", "epoll_wait: %s; the doorbell stops", strerror(errno));
            return NULL;
        }
        for (int i = 0; i < n; i++) {
            void *p = evs[i].data.ptr;
            if (p == NULL)
                return NULL; /* amx_door_free */
            if (p == d) {
                accept_all(d);
                continue;
            }
            conn_t *c = p;
            if (c->dead)
                continue;
            if (evs[i].events & EPOLLIN)
                read_request(c);
            else if (evs[i].events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR))
                drop(c);
        }
    }
}

const char *amx_door_path(const amx_door_t *d)
{
    return d != NULL ? d->path : "";
}

static void close_fds(amx_door_t *d)
{
    if (d->lfd >= 0)
        close(d->lfd);
    if (d->efd >= 0)
        close(d->efd);
    if (d->stopfd >= 0)
        close(d->stopfd);
}

amx_status_t amx_door_start(const char *path, unsigned mode, amx_registry_t *reg, amx_rpc_t *rpc,
                            amx_door_t **out, amx_err_t *err)
{
    *out = NULL;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(a.sun_path)) {
        AMX_WARN("door",
                 "no doorbell: %s is too long for a Unix socket (%zu bytes at most); "
                 "device buffers are reconciled over gRPC",
                 path, sizeof(a.sun_path) - 1);
        return AMX_OK;
    }
    amx_door_t *d = calloc(1, sizeof(*d));
    if (d == NULL)
        return amx_err_set(err, AMX_ENOMEM, "out of memory");
    d->reg = reg;
    d->rpc = rpc;
    d->lfd = d->efd = d->stopfd = -1;
    snprintf(d->path, sizeof(d->path), "%s", path);
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
    pthread_mutex_init(&d->mu, NULL);
    const char *what = "socket";
    d->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (d->lfd >= 0) {
        what = "bind";
        (void)unlink(path); /* ours: the daemon's socket next to it was free */
        mode_t old = umask((mode_t)(~mode & 0777));
        int rc = bind(d->lfd, (struct sockaddr *)&a, sizeof(a));
        umask(old);
        if (rc == 0 && chmod(path, (mode_t)mode) != 0)
            AMX_WARN("door", "chmod %s %o: %s", path, mode, strerror(errno));
        if (rc == 0)
            what = "listen";
        if (rc == 0 && listen(d->lfd, 128) == 0)
            what = NULL;
    }
    if (what == NULL) {
        what = "epoll";
        d->efd = epoll_create1(EPOLL_CLOEXEC);
        d->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        struct epoll_event el = {.events = EPOLLIN, .data.ptr = d};
        struct epoll_event es = {.events = EPOLLIN, .data.ptr = NULL};
        if (d->efd >= 0 && d->stopfd >= 0 && epoll_ctl(d->efd, EPOLL_CTL_ADD, d->lfd, &el) == 0 &&
            epoll_ctl(d->efd, EPOLL_CTL_ADD, d->stopfd, &es) == 0)
            what = NULL;
    }
    if (what == NULL && pthread_create(&d->th, NULL, door_main, d) != 0)
        what = "pthread_create";
    if (what != NULL) {
        amx_status_t st =
            amx_err_set(err, AMX_EIO, "doorbell %s: %s: %s", path, what, strerror(errno));
        close_fds(d);
        (void)unlink(path);
        pthread_mutex_destroy(&d->mu);
        free(d);
        return st;
    }
    d->th_started = 1;
    AMX_INFO("door", "device doorbell on %s", path);
    *out = d;
    return AMX_OK;
}

void amx_door_free(amx_door_t *d, amx_rpc_t *rpc)
{
    if (d == NULL)
        return;
    if (d->th_started) {
        uint64_t one = 1;
        if (write(d->stopfd, &one, sizeof(one)) != (ssize_t)sizeof(one))
            AMX_WARN("door", "stopping the doorbell thread: %s", strerror(errno));
        pthread_join(d->th, NULL);
    }
    /* Requests and closes the thread handed over last. */
    amx_rpc_run_queued(rpc);
    while (d->conns != NULL) {
        conn_t *c = d->conns;
        d->conns = c->next;
        if (c->w.job != NULL)
            amx_registry_cancel(d->reg, &c->w);
        if (c->flag_fd >= 0)
            close(c->flag_fd);
        close(c->fd);
        free(c);
    }
    close_fds(d);
    (void)unlink(d->path);
    pthread_mutex_destroy(&d->mu);
    free(d);
}
