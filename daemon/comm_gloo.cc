/*
 * comm_gloo.cc - the Gloo collective backend: a C++ shim behind the C
 * interface of comm.h (CPU buffers, TCP transport, libgloo 0.0~git20220518).
 *
 * What it owns: per communicator, one gloo tcp Device (which owns one epoll
 * thread of gloo's), one gloo Context connected to the two ring neighbours
 * only (RingContext: two TCP connections, two rendezvous keys read), one
 * "sentinel" receive per ring neighbour and one watchdog thread per ring
 * neighbour (none for a single participant). Nothing else outlives a call:
 * the rendezvous store, the buffers of an allreduce and the strings of
 * amx_comm_params_t are used only during the call.
 *
 * Threads: create, allreduce_max and destroy are called on one thread at a
 * time (the job's engine thread); abort may be called from any thread, at
 * any time between create's return and destroy's call, also while
 * allreduce_max blocks on another thread. No C++ exception leaves this file.
 *
 * Why an own ring instead of gloo::allreduce: gloo::allreduce waits on a
 * scratch buffer of its own that nothing outside it can wake, and gloo's
 * public API has no "fail every pending operation" call (tcp::Context::
 * signalException is protected, and the headers that declare it,
 * gloo/transport/tcp/{pair,context,unbound_buffer}.h, do not even compile
 * with Debian's libgloo-dev, which lacks gloo/common/memory.h). The ring
 * below uses only public API (UnboundBuffer send/recv/wait and abortWait*,
 * Context::closeConnections), on buffers this file owns, so that it can wake
 * every wait it makes.
 *
 * What abort can and cannot do with this gloo version:
 *  - An allreduce_max blocked on another thread returns EABORTED at once:
 *    abort calls abortWaitRecv/abortWaitSend on the buffers it waits on.
 *  - Every connection is then reset (Context::closeConnections, SO_LINGER 0)
 *    by a watchdog thread, as after any failed collective, so that peers
 *    blocked on us fail with EUNAVAIL within milliseconds. Neither abort nor
 *    the failing call waits for that ((P-1) gloo loop ticks of up to 10 ms):
 *    abort takes a mutex and sets flags.
 *  - An abort while no collective runs: a watchdog thread resets the
 *    connections, 50 ms later unless destroy came first. destroy closes
 *    them gracefully (FIN after the data queued in the kernel), which a
 *    reset would discard: abort+destroy right after a collective that
 *    succeeded here must not fail it on a neighbour still reading our last
 *    segment (engine.c's drop_comm does abort then destroy).
 *  - gloo's own abortWaitRecv/abortWaitSend interrupt one wait, not an
 *    operation (gloo::allreduce ignores their false return and goes on),
 *    and Context::closeConnections closes the sockets without waking local
 *    waiters; so neither alone aborts a gloo::allreduce in flight.
 *  - create cannot be aborted: the caller has no communicator until create
 *    returns. A rendezvous ends at p->deadline_ms, or early when the kv
 *    store's get fails (its status, e.g. EABORTED, is returned as is).
 *    gloo's TCP connect, which follows the rendezvous, waits at most five
 *    times the context timeout (tcp/pair.h waitUntil), so the context
 *    timeout is a fifth of the time left. create may end after the deadline
 *    only when a peer dies between publishing its address and connecting:
 *    that connect then waits up to the time that was left when create began.
 *
 * Peers that go away: gloo fails the pending operations of a connection
 * that its peer closed or reset, but not the one transfer that was half done
 * (Pair::signalException skips the operations in rx_/tx_), which would wait
 * for the deadline. The watchdogs cover that case: each waits on a sentinel
 * receive (from a neighbour, on a slot nobody sends to) which gloo fails
 * when that connection dies, and then wakes the allreduce, which looks once
 * more for a completion and otherwise fails with EUNAVAIL. A death does not
 * fail a collective that no longer needs that neighbour (the end of a job:
 * the first rank to finish destroys its communicator while its neighbours
 * still complete theirs).
 *
 * The caller's buffers: send is only read. recv may be written by gloo's
 * thread only until allreduce_max returns (UnboundBuffer's destructor waits
 * for its users), so recv is the caller's again on return, even on failure
 * (its contents are then unspecified).
 */
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <netdb.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "comm.h"
#include "status.h"
extern "C" {
#include "clock.h"
#include "log.h"
}

namespace
{

using Ms = std::chrono::milliseconds;
using gloo::transport::UnboundBuffer;

/* The slot of the sentinel receives; the ring's slots start far above it. */
constexpr uint64_t kSentinelSlot = 1;
constexpr uint64_t kFirstRingSlot = 1u << 20;

/* A watchdog waits "forever"; gloo treats the end of a wait as a timeout
 * that closes every connection, so this must outlive any communicator. */
constexpr auto kWatchdogWait = std::chrono::hours(100);

/* How long a watchdog lets destroy follow an abort before it resets the
 * connections itself (see the top). */
constexpr Ms kAbortGrace(50);

/* An error with an amx status, thrown by this file's code (also from inside
 * gloo's rendezvous, through the store) and caught at the C boundary. */
struct AmxError : std::runtime_error {
    amx_status_t code;
    AmxError(amx_status_t c, const std::string &msg) : std::runtime_error(msg), code(c) {}
};

uint64_t ms_left(uint64_t deadline_ms)
{
    uint64_t now = amx_now_ms();
    return deadline_ms > now ? deadline_ms - now : 0;
}

/* gloo takes relative timeouts; at least 1 ms because 0 means "none". */
Ms timeout_until(uint64_t deadline_ms)
{
    return Ms(std::max<uint64_t>(1, ms_left(deadline_ms)));
}

/* gloo reports timeouts and I/O errors with the same exception type; only
 * the text tells them apart ("Timed out waiting", "Read timeout",
 * "Connect timeout", ...). */
bool is_timeout_text(const char *what)
{
    return std::strstr(what, "imeout") != nullptr || std::strstr(what, "imed out") != nullptr;
}

/*
 * Blocks SIGPIPE on the calling thread for the guard's lifetime. gloo
 * writes with writev(2), which raises SIGPIPE on a connection the peer
 * reset; amaxd ignores SIGPIPE (main.c), but this file must not depend on
 * it. A SIGPIPE raised meanwhile is consumed before the old mask returns.
 * Threads started under the guard (gloo's epoll thread, the watchdogs)
 * inherit the blocked mask for good.
 */
class SigpipeGuard
{
  public:
    SigpipeGuard()
    {
        sigset_t set, pending;
        sigemptyset(&set);
        sigaddset(&set, SIGPIPE);
        sigemptyset(&pending);
        sigpending(&pending);
        was_pending_ = sigismember(&pending, SIGPIPE) == 1;
        blocked_ = pthread_sigmask(SIG_BLOCK, &set, &old_) == 0;
    }
    ~SigpipeGuard()
    {
        if (!blocked_)
            return;
        int saved = errno;
        if (!was_pending_) {
            sigset_t set;
            sigemptyset(&set);
            sigaddset(&set, SIGPIPE);
            struct timespec zero = {0, 0};
            while (sigtimedwait(&set, nullptr, &zero) == -1 && errno == EINTR) {
            }
        }
        pthread_sigmask(SIG_SETMASK, &old_, nullptr);
        errno = saved;
    }
    SigpipeGuard(const SigpipeGuard &) = delete;
    SigpipeGuard &operator=(const SigpipeGuard &) = delete;

  private:
    sigset_t old_;
    bool was_pending_ = false;
    bool blocked_ = false;
};

/*
 * A gloo Context with pairs to the two ring neighbours only: the ring below
 * uses no other, and gloo's connectFullMesh costs every rank N-1 reads of
 * N-1 addresses each from the coordinator's store (Theta(N^2) reads and
 * Theta(N^3) bytes through one process per communicator). Each rank
 * publishes the addresses of its pairs to its left and right neighbour
 * under its rank ("<rank>": left's then right's; one address when both are
 * the same rank) and reads its two neighbours' keys: 2N reads of two
 * addresses. gloo's Context keeps a pair slot per rank; the others stay
 * empty (closeConnections skips them).
 */
class RingContext : public gloo::Context
{
  public:
    RingContext(int rank, int size) : gloo::Context(rank, size) {}

    void connectRing(gloo::rendezvous::Store &store, std::shared_ptr<gloo::transport::Device> &dev)
    {
        std::shared_ptr<gloo::transport::Context> tc = dev->createContext(rank, size);
        tc->setTimeout(getTimeout());
        std::vector<int> peers = neighbours(rank);
        std::vector<char> mine;
        for (int p : peers) {
            std::vector<char> b = tc->createPair(p)->address().bytes();
            mine.insert(mine.end(), b.begin(), b.end());
        }
        store.set(std::to_string(rank), mine);
        /* A pair's connect blocks until the other side connects too: every
         * rank connects its neighbours in increasing rank order, which is
         * one global order of the ring's edges (by higher rank, then lower),
         * so the first unconnected edge always has both sides at it. */
        std::sort(peers.begin(), peers.end());
        for (int p : peers) {
            std::vector<char> theirs = store.get(std::to_string(p));
            std::vector<int> of = neighbours(p);
            if (theirs.empty() || theirs.size() % of.size() != 0)
                throw AmxError(AMX_EINVAL, "rendezvous key '" + std::to_string(p) + "' holds " +
                                               std::to_string(theirs.size()) + " bytes, not " +
                                               std::to_string(of.size()) + " addresses");
            size_t len = theirs.size() / of.size();
            size_t at = of[0] == rank ? 0 : 1;
            std::vector<char> addr(theirs.begin() + (long)(at * len),
                                   theirs.begin() + (long)((at + 1) * len));
            tc->getPair(p)->connect(addr);
        }
        device_ = dev;
        transportContext_ = std::move(tc);
    }

  private:
    /* Left, then right; one rank when they are the same; none alone. */
    std::vector<int> neighbours(int r) const
    {
        std::vector<int> v;
        if (size < 2)
            return v;
        v.push_back((r + size - 1) % size);
        if ((r + 1) % size != v[0])
            v.push_back((r + 1) % size);
        return v;
    }
};

/*
 * The rendezvous store: gloo's Store on top of the caller's amx_kv_t. gets
 * block until the communicator's deadline (gloo's own timeouts are ignored:
 * the context timeout is only a fifth of the time left, see connect()).
 * Values are cached because gloo waits for a key and then gets it.
 */
class KvStore : public gloo::rendezvous::Store
{
  public:
    KvStore(const amx_kv_t *kv, uint64_t deadline_ms) : kv_(kv), deadline_ms_(deadline_ms) {}

    void set(const std::string &key, const std::vector<char> &data) override
    {
        amx_err_t err = {};
        amx_status_t st = kv_->set(kv_->ud, key.c_str(), data.data(), data.size(), &err);
        if (st != AMX_OK)
            throw AmxError(st, "storing rendezvous key '" + key + "' failed: " + text(st, err));
    }

    std::vector<char> get(const std::string &key) override
    {
        return fetch(key);
    }

    void wait(const std::vector<std::string> &keys) override
    {
        for (const auto &key : keys)
            fetch(key);
    }

    void wait(const std::vector<std::string> &keys, const Ms & /*timeout*/) override
    {
        wait(keys);
    }

  private:
    static std::string text(amx_status_t st, const amx_err_t &err)
    {
        return err.msg[0] != '\0' ? std::string(err.msg) : std::string(amx_strerror(st));
    }

    const std::vector<char> &fetch(const std::string &key)
    {
        auto it = cache_.find(key);
        if (it != cache_.end())
            return it->second;
        void *val = nullptr;
        size_t len = 0;
        amx_err_t err = {};
        amx_status_t st = kv_->get(kv_->ud, key.c_str(), deadline_ms_, &val, &len, &err);
        if (st != AMX_OK)
            throw AmxError(st, "rendezvous key '" + key + "' not available: " + text(st, err));
        std::unique_ptr<void, decltype(&free)> owned(val, free);
        const char *bytes = static_cast<const char *>(val);
        std::vector<char> copy(bytes, bytes + (bytes != nullptr ? len : 0));
        return cache_.emplace(key, std::move(copy)).first->second;
    }

    const amx_kv_t *kv_;
    uint64_t deadline_ms_;
    std::map<std::string, std::vector<char>> cache_;
};

/*
 * Returns the numeric form of the first address of `host` that a socket can
 * bind to. gloo's CreateDevice resolves the name itself, but this version
 * crashes (SIGSEGV) on a name that does not resolve: its check of
 * getaddrinfo's result is `rv != -1`, and EAI_* codes are other negative
 * numbers. So gloo only ever sees a numeric address known to work.
 */
std::string bindable_address(const std::string &host, int *family)
{
    struct addrinfo hints;
    std::memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    struct addrinfo *res = nullptr;
    int rv = getaddrinfo(host.c_str(), nullptr, &hints, &res);
    if (rv != 0)
        throw AmxError(AMX_EINVAL, "cannot resolve gloo host '" + host + "': " + gai_strerror(rv));
    std::unique_ptr<struct addrinfo, decltype(&freeaddrinfo)> owned(res, freeaddrinfo);
    int last_errno = 0;
    for (struct addrinfo *a = res; a != nullptr; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            last_errno = errno;
            continue;
        }
        int b = bind(fd, a->ai_addr, a->ai_addrlen);
        last_errno = errno;
        close(fd);
        if (b != 0)
            continue;
        char num[NI_MAXHOST];
        if (getnameinfo(a->ai_addr, a->ai_addrlen, num, sizeof(num), nullptr, 0, NI_NUMERICHOST) !=
            0)
            continue;
        *family = a->ai_family;
        return num;
    }
    throw AmxError(AMX_EINVAL,
                   "gloo host '" + host +
                       "' has no address this machine can bind to: " + std::strerror(last_errno));
}

/* acc[i] = max(acc[i], in[i]); +0 wins over -0 so that the result does not
 * depend on the order of the ring (NaN is outside the contract). */
void max_into(float *acc, const float *in, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float a = acc[i], b = in[i];
        if (b > a || (b == a && !std::signbit(b)))
            acc[i] = b;
    }
}

struct GlooComm;

/* What the C side holds: amx_comm_t first, so that the pointer converts. */
struct Handle {
    amx_comm_t base;
    GlooComm *self;
};

struct GlooComm {
    Handle h;
    std::string host; /* copies: p's strings are borrowed for create only */
    std::string prefix;
    int left = -1; /* receive from left, send to right */
    int right = -1;
    uint64_t next_slot = kFirstRingSlot;

    std::shared_ptr<gloo::transport::Device> dev;
    std::shared_ptr<RingContext> ctx;
    bool connected = false; /* connectRing returned: ctx has its pairs */

    /* Sentinel receives and their watchdogs: [0] left, [1] right (only [0]
     * when left == right, i.e. two participants). Set up in create, torn
     * down in destroy; the watchdogs only read them. */
    int nwatch = 0;
    int watch_rank[2] = {-1, -1};
    float sentinel_mem[2] = {0, 0};
    std::unique_ptr<UnboundBuffer> sentinel[2];
    std::thread watchdog[2];

    /* Everything below is guarded by mu (lock order: mu, then gloo's
     * buffer locks; gloo never calls back into this file under its locks,
     * except the store during create, which takes no lock here). */
    std::mutex mu;
    std::condition_variable cv; /* watchdogs wait here for abort or destroy */
    bool aborted = false;
    bool stopping = false;      /* destroy has begun */
    bool closed = false;        /* closeConnections was called */
    bool reset_now = false;     /* a collective failed: watchdogs reset at once */
    amx_status_t dead = AMX_OK; /* the first failure: later calls fail alike */
    std::string dead_msg;
    std::vector<std::string> gone; /* per rank: why its connection died ("" if alive) */
    UnboundBuffer *live[2] = {nullptr, nullptr}; /* what allreduce may be waiting on */

    GlooComm(const amx_comm_params_t *p) : host(p->host), prefix(p->prefix)
    {
        h.base.ops = nullptr;
        h.base.rank = p->rank;
        h.base.size = p->size;
        h.base.on_device = 0;
        h.self = this;
        gone.resize(p->size);
    }

    ~GlooComm()
    {
        teardown();
    }

    int rank() const
    {
        return h.base.rank;
    }
    int size() const
    {
        return h.base.size;
    }

    /* Wakes whatever allreduce waits on; mu held. */
    void poke_locked()
    {
        for (UnboundBuffer *b : live) {
            if (b != nullptr) {
                b->abortWaitRecv();
                b->abortWaitSend();
            }
        }
    }

    /* Makes the watchdogs reset every connection now; mu held. */
    void request_reset_locked()
    {
        reset_now = true;
        for (int k = 0; k < nwatch; k++)
            if (sentinel[k])
                sentinel[k]->abortWaitRecv();
        cv.notify_all();
    }

    /* Resets every connection (once), so that peers blocked on this
     * participant fail at once. Never called with mu held. */
    void close_connections() noexcept
    {
        {
            std::lock_guard<std::mutex> lk(mu);
            if (closed || !connected)
                return;
            closed = true;
        }
        try {
            ctx->closeConnections();
        } catch (...) {
            /* Pair::close is noexcept; nothing else can throw here. */
        }
    }

    void connect(const amx_comm_params_t *p);
    void watch(int k) noexcept;
    void teardown() noexcept;
    template <typename T> void ring(T *recv, size_t n, uint64_t deadline_ms);
    void wait(UnboundBuffer *b, bool is_recv, int peer, uint64_t deadline_ms, bool later_left,
              bool later_right);
};

/*
 * Binds the device, connects the ring neighbours through the kv store (RingContext),
 * then posts the sentinel receives and starts the watchdogs. Throws.
 */
void GlooComm::connect(const amx_comm_params_t *p)
{
    int family = AF_UNSPEC;
    gloo::transport::tcp::attr attr;
    attr.hostname = bindable_address(host, &family);
    attr.ai_family = family;
    try {
        dev = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception &e) {
        throw AmxError(AMX_EINVAL, "cannot bind a gloo device to host '" + host + "' (" +
                                       attr.hostname + "): " + e.what());
    }

    uint64_t left_ms = ms_left(p->deadline_ms);
    if (left_ms == 0)
        throw AmxError(AMX_ETIMEDOUT, "the rendezvous deadline had passed before it began");
    ctx = std::make_shared<RingContext>(rank(), size());
    /* A fifth: gloo waits up to 5x this for a TCP connect (see the top). */
    ctx->setTimeout(Ms(std::max<uint64_t>(1, left_ms / 5)));
    KvStore store(p->kv, p->deadline_ms);
    gloo::rendezvous::PrefixStore prefixed(prefix, store);
    ctx->connectRing(prefixed, dev);
    {
        std::lock_guard<std::mutex> lk(mu);
        connected = true;
    }

    left = (rank() + size() - 1) % size();
    right = (rank() + 1) % size();
    watch_rank[nwatch++] = left;
    if (right != left)
        watch_rank[nwatch++] = right;
    for (int k = 0; k < nwatch; k++) {
        sentinel[k] = ctx->createUnboundBuffer(&sentinel_mem[k], sizeof(float));
        sentinel[k]->recv(watch_rank[k], kSentinelSlot, 0, sizeof(float));
    }
    for (int k = 0; k < nwatch; k++)
        watchdog[k] = std::thread(&GlooComm::watch, this, k);
}

/*
 * A watchdog: waits until the connection to neighbour watch_rank[k] dies
 * (gloo fails the sentinel receive) or it is poked (abort, destroy). A death
 * is recorded and wakes allreduce. Then it waits for abort, a failed
 * collective or destroy: it resets every connection at once after a failed
 * collective, and after an abort that destroy does not follow within
 * kAbortGrace. A death alone does not reset the other connections: the
 * other neighbour may still be reading our last segment of a collective
 * that succeeded.
 */
void GlooComm::watch(int k) noexcept
{
    std::string why;
    try {
        if (sentinel[k]->waitRecv(nullptr, kWatchdogWait))
            why = "rank " + std::to_string(watch_rank[k]) + " sent on the reserved sentinel slot";
    } catch (const std::exception &e) {
        why = e.what();
    } catch (...) {
        why = "unknown error";
    }
    bool close = false;
    try {
        std::unique_lock<std::mutex> lk(mu);
        if (!why.empty()) {
            gone[watch_rank[k]] = why;
            poke_locked();
        }
        cv.wait(lk, [this] { return aborted || stopping || reset_now; });
        if (!reset_now)
            cv.wait_for(lk, kAbortGrace, [this] { return stopping || reset_now; });
        close = reset_now || !stopping;
    } catch (...) {
    }
    if (close)
        close_connections();
}

/* Stops the watchdogs and frees everything; also the cleanup of a failed
 * create. Connections not reset before are closed gracefully by the
 * context's destructor (FIN after the queued data: a neighbour still
 * reading our last segment gets it; one blocked on us sees EOF at once). */
void GlooComm::teardown() noexcept
{
    try {
        {
            std::lock_guard<std::mutex> lk(mu);
            stopping = true;
        }
        cv.notify_all();
        for (int k = 0; k < 2; k++)
            if (sentinel[k])
                sentinel[k]->abortWaitRecv();
        for (int k = 0; k < 2; k++)
            if (watchdog[k].joinable())
                watchdog[k].join();
        /* Buffers first: each holds the transport context. */
        for (int k = 0; k < 2; k++)
            sentinel[k].reset();
        ctx.reset();
        dev.reset();
    } catch (...) {
    }
}

/*
 * Waits for one receive (or send) completion on `b`, whose transfer comes
 * from (or goes to) neighbour `peer`. A false return from gloo means a poke:
 * abort, or a watchdog saw a neighbour's connection die. A dead neighbour
 * fails the wait if this transfer involves it and has not completed, or if
 * a later step of the ring still needs it (later_left: a receive from left;
 * later_right: a send to right); otherwise the collective can still finish,
 * as at the end of a job, when a neighbour that finished first goes away.
 */
void GlooComm::wait(UnboundBuffer *b, bool is_recv, int peer, uint64_t deadline_ms, bool later_left,
                    bool later_right)
{
    /* The state is looked at before every wait, not only after a poke: a
     * poke is delivered once, and may have been taken by an earlier wait. */
    for (;;) {
        int dead_rank = -1;
        std::string why;
        {
            std::lock_guard<std::mutex> lk(mu);
            if (aborted)
                throw AmxError(AMX_EABORTED, "the communicator was aborted");
            if (!gone[peer].empty()) {
                dead_rank = peer;
            } else if (later_left && !gone[left].empty()) {
                dead_rank = left;
            } else if (later_right && !gone[right].empty()) {
                dead_rank = right;
            }
            if (dead_rank >= 0)
                why = gone[dead_rank];
        }
        const std::string text =
            dead_rank < 0 ? std::string()
                          : "the connection to rank " + std::to_string(dead_rank) + " died: " + why;
        if (dead_rank >= 0 && dead_rank != peer)
            throw AmxError(AMX_EUNAVAIL, text);
        /* With `peer` dead nothing more can complete, but a completion
         * counted before its connection closed may not have been taken yet
         * (a poke wins over it in gloo): look once more, for 1 ms. A timeout
         * then resets connections that are dead anyway. */
        const Ms t = dead_rank == peer ? Ms(1) : timeout_until(deadline_ms);
        bool done;
        try {
            done = is_recv ? b->waitRecv(nullptr, t) : b->waitSend(nullptr, t);
        } catch (const std::exception &) {
            if (dead_rank == peer)
                throw AmxError(AMX_EUNAVAIL, text);
            throw;
        }
        if (done)
            return;
        /* A poke (abort, or a watchdog saw a connection die): look again. */
    }
}

/* Element offset of chunk i of n elements split over p ranks. */
size_t chunk_off(size_t n, int p, int i)
{
    return n / p * i + std::min<size_t>(i, n % p);
}

/*
 * Ring allreduce(MAX) in place on `recv` (a copy of send): P-1 steps of
 * reduce-scatter into a scratch chunk, then P-1 steps of allgather. Each
 * step posts one receive from `left` and one send to `right` and waits for
 * both, on buffers registered in `live` so that abort can wake the waits.
 * Empty chunks (n < P) are skipped on both sides of a transfer alike.
 */
/* The reduction of one step: MAX of float32 (the amax), SUM of float64
 * (statistics of calibrators beyond max). */
void reduce_into(float *acc, const float *in, size_t n)
{
    max_into(acc, in, n);
}

void reduce_into(double *acc, const double *in, size_t n)
{
    for (size_t i = 0; i < n; i++)
        acc[i] += in[i];
}

template <typename T> void GlooComm::ring(T *recv, size_t n, uint64_t deadline_ms)
{
    const int P = size(), r = rank();
    auto mod = [P](long x) { return static_cast<int>(((x % P) + P) % P); };
    auto off = [&](int c) { return chunk_off(n, P, c); };
    auto len = [&](int c) { return chunk_off(n, P, c + 1) - chunk_off(n, P, c); };
    const size_t fsz = sizeof(T);

    /* Offsets and lengths in elements; a step with slen (rlen) 0 sends
     * (receives) nothing. later_*: whether a step after this one still
     * receives from left / sends to right (see wait()). */
    struct Step {
        bool reduce;
        size_t soff, slen, roff, rlen;
        bool later_left, later_right;
    };
    std::vector<Step> steps;
    for (int s = 0; s < P - 1; s++) {
        const int sc = mod(r - s), rc = mod(r - s - 1);
        steps.push_back({true, off(sc), len(sc), off(rc), len(rc), false, false});
    }
    for (int s = 0; s < P - 1; s++) {
        const int sc = mod(r + 1 - s), rc = mod(r - s);
        steps.push_back({false, off(sc), len(sc), off(rc), len(rc), false, false});
    }
    for (size_t i = steps.size() - 1; i > 0; i--) {
        steps[i - 1].later_left = steps[i].later_left || steps[i].rlen > 0;
        steps[i - 1].later_right = steps[i].later_right || steps[i].slen > 0;
    }

    std::vector<T> tmp(len(0)); /* chunk 0 is the largest */
    std::unique_ptr<UnboundBuffer> out = ctx->createUnboundBuffer(recv, n * fsz);
    std::unique_ptr<UnboundBuffer> scratch = ctx->createUnboundBuffer(tmp.data(), tmp.size() * fsz);

    struct Unregister {
        GlooComm *c;
        ~Unregister()
        {
            std::lock_guard<std::mutex> lk(c->mu);
            c->live[0] = c->live[1] = nullptr;
        }
    };
    {
        std::lock_guard<std::mutex> lk(mu);
        if (aborted)
            throw AmxError(AMX_EABORTED, "the communicator was aborted");
        live[0] = out.get();
        live[1] = scratch.get();
    }
    Unregister unregister{this}; /* before the buffers die (declared after) */

    for (const Step &st : steps) {
        /* Every rank runs the same steps, so the slots match pairwise. */
        const uint64_t slot = next_slot++;
        UnboundBuffer *into = st.reduce ? scratch.get() : out.get();
        if (st.rlen > 0)
            into->recv(left, slot, st.reduce ? 0 : st.roff * fsz, st.rlen * fsz);
        if (st.slen > 0)
            out->send(right, slot, st.soff * fsz, st.slen * fsz);
        if (st.rlen > 0) {
            wait(into, true, left, deadline_ms, st.later_left, st.later_right);
            if (st.reduce)
                reduce_into(recv + st.roff, tmp.data(), st.rlen);
        }
        if (st.slen > 0)
            wait(out.get(), false, right, deadline_ms, st.later_left, st.later_right);
    }
}

GlooComm *self(amx_comm_t *c)
{
    return reinterpret_cast<Handle *>(c)->self;
}

/* Maps an exception caught at the C boundary to a status and its text. */
amx_status_t classify(std::exception_ptr ep, std::string *msg)
{
    try {
        std::rethrow_exception(ep);
    } catch (const AmxError &e) {
        *msg = e.what();
        return e.code;
    } catch (const gloo::IoException &e) {
        *msg = e.what();
        return is_timeout_text(e.what()) ? AMX_ETIMEDOUT : AMX_EUNAVAIL;
    } catch (const gloo::EnforceNotMet &e) {
        *msg = e.what();
        return AMX_EINTERNAL;
    } catch (const std::bad_alloc &) {
        *msg = "out of memory";
        return AMX_ENOMEM;
    } catch (const std::exception &e) {
        *msg = e.what();
        return is_timeout_text(e.what()) ? AMX_ETIMEDOUT : AMX_EINTERNAL;
    } catch (...) {
        *msg = "unknown exception";
        return AMX_EINTERNAL;
    }
}

template <typename T>
amx_status_t gloo_allreduce(amx_comm_t *base, const T *send, T *recv, size_t n,
                            uint64_t deadline_ms, const char *what, amx_err_t *err) noexcept
{
    GlooComm *c = self(base);
    const int r = c->rank(), P = c->size();
    amx_status_t st = AMX_OK;
    std::string msg;
    bool first_failure = false;
    try {
        {
            std::lock_guard<std::mutex> lk(c->mu);
            if (c->dead != AMX_OK)
                return amx_err_set(err, c->dead,
                                   "gloo communicator (rank %d of %d) is unusable after an "
                                   "earlier failure: %s",
                                   r, P, c->dead_msg.c_str());
            if (c->aborted)
                return amx_err_set(err, AMX_EABORTED,
                                   "gloo communicator (rank %d of %d) was aborted", r, P);
        }
        if (n == 0)
            return AMX_OK;
        /* Bad arguments fail the communicator too: the peers are already
         * in this collective and must not wait for us until the deadline. */
        if (send == nullptr || recv == nullptr || n > SIZE_MAX / sizeof(T))
            throw AmxError(AMX_EINVAL, "NULL buffer or too many elements");
        const char *sb = reinterpret_cast<const char *>(send);
        const char *rb = reinterpret_cast<const char *>(recv);
        if (sb < rb + n * sizeof(T) && rb < sb + n * sizeof(T))
            throw AmxError(AMX_EINVAL, "send and recv overlap");

        if (P == 1) {
            std::memcpy(recv, send, n * sizeof(T));
            return AMX_OK;
        }
        {
            std::lock_guard<std::mutex> lk(c->mu);
            for (int nb : {c->left, c->right})
                if (!c->gone[nb].empty())
                    throw AmxError(AMX_EUNAVAIL, "the connection to rank " + std::to_string(nb) +
                                                     " died: " + c->gone[nb]);
        }
        if (ms_left(deadline_ms) == 0)
            throw AmxError(AMX_ETIMEDOUT, "the deadline had passed before the collective began");
        SigpipeGuard guard;
        std::memcpy(recv, send, n * sizeof(T));
        c->ring(recv, n, deadline_ms);
        return AMX_OK;
    } catch (...) {
        st = classify(std::current_exception(), &msg);
    }
    try {
        std::lock_guard<std::mutex> lk(c->mu);
        if (c->aborted)
            st = AMX_EABORTED; /* whatever the wait saw, abort caused it */
        if (c->dead == AMX_OK) {
            c->dead = st;
            c->dead_msg = msg;
            first_failure = true;
        }
        c->request_reset_locked(); /* peers blocked on us fail now, not at their deadline */
    } catch (...) {
    }
    amx_status_t ret = amx_err_set(err, st, "gloo allreduce of %zu %s (rank %d of %d) failed: %s",
                                   n, what, r, P, msg.c_str());
    if (first_failure)
        AMX_WARN("gloo", "allreduce of %zu %s (rank %d of %d) failed: %s: %s", n, what, r, P,
                 amx_strerror(st), msg.c_str());
    return ret;
}

amx_status_t gloo_allreduce_max(amx_comm_t *base, const float *send, float *recv, size_t n,
                                void *stream, uint64_t deadline_ms, amx_err_t *err) noexcept
{
    (void)stream;
    return gloo_allreduce<float>(base, send, recv, n, deadline_ms, "floats", err);
}

amx_status_t gloo_allreduce_sum_f64(amx_comm_t *base, const double *send, double *recv, size_t n,
                                    void *stream, uint64_t deadline_ms, amx_err_t *err) noexcept
{
    (void)stream;
    return gloo_allreduce<double>(base, send, recv, n, deadline_ms, "float64 sums", err);
}

void gloo_abort(amx_comm_t *base) noexcept
{
    GlooComm *c = self(base);
    try {
        std::lock_guard<std::mutex> lk(c->mu);
        if (c->aborted)
            return;
        c->aborted = true;
        c->poke_locked();
        /* The watchdogs wake, and one of them resets the connections. */
        for (int k = 0; k < c->nwatch; k++)
            if (c->sentinel[k])
                c->sentinel[k]->abortWaitRecv();
        c->cv.notify_all();
    } catch (...) {
    }
}

void gloo_destroy(amx_comm_t *base) noexcept
{
    if (base == nullptr)
        return;
    SigpipeGuard guard;
    delete self(base);
}

const amx_comm_ops_t gloo_ops = {"gloo",  gloo_allreduce_max,     gloo_abort, gloo_destroy,
                                 nullptr, gloo_allreduce_sum_f64, nullptr};

} // namespace

/*
 * Creates a Gloo communicator (see comm.h). Engine thread; blocks until
 * every participant has joined or p->deadline_ms passes. The result is
 * owned by the caller (ops->destroy); p and its strings are not kept.
 */
extern "C" amx_status_t amx__comm_gloo_create(const amx_comm_params_t *p, amx_comm_t **out,
                                              amx_err_t *err)
{
    if (out != nullptr)
        *out = nullptr;
    if (p == nullptr || out == nullptr || p->size < 1 || p->rank < 0 || p->rank >= p->size ||
        p->prefix == nullptr || p->host == nullptr || p->host[0] == '\0' ||
        (p->size > 1 && (p->kv == nullptr || p->kv->set == nullptr || p->kv->get == nullptr)))
        return amx_err_set(err, AMX_EINVAL,
                           "gloo communicator: bad parameters (rank, size, kv, prefix or host)");
    SigpipeGuard guard;
    std::unique_ptr<GlooComm> c;
    amx_status_t st;
    std::string msg;
    try {
        c.reset(new GlooComm(p));
        c->h.base.ops = &gloo_ops;
        /* A single participant has nobody to talk to: no device, no
         * rendezvous; allreduce_max copies. */
        if (p->size > 1)
            c->connect(p);
        *out = &c.release()->h.base;
        return AMX_OK;
    } catch (...) {
        st = classify(std::current_exception(), &msg);
    }
    c.reset(); /* stops what connect started, closes what it opened */
    AMX_WARN("gloo", "rendezvous of rank %d of %d (prefix '%s', host '%s') failed: %s: %s", p->rank,
             p->size, p->prefix, p->host, amx_strerror(st), msg.c_str());
    return amx_err_set(err, st,
                       "gloo rendezvous of rank %d of %d (prefix '%s', host '%s') failed: %s",
                       p->rank, p->size, p->prefix, p->host, msg.c_str());
}

/* Whether this backend is compiled in (comm.c asks). Any thread. */
extern "C" int amx__comm_gloo_compiled(void)
{
    return 1;
}
