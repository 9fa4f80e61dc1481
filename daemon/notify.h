/*
 * notify.h - the service manager's side of the daemon: readiness, status
 * lines, stopping and the watchdog (sd_notify(3), libsystemd).
 *
 * Everything here is a no-op when the daemon was not started by systemd
 * (no NOTIFY_SOCKET): the same binary runs by hand, under Slurm or in a
 * container. The watchdog is pinged from a timer of the loop thread, so a
 * loop that stops turning stops the pings and systemd restarts the daemon.
 */
#ifndef AMX_NOTIFY_H
#define AMX_NOTIFY_H

#include <stdint.h>
#include <uv.h>

typedef struct amx_notify amx_notify_t;

/* What the daemon tells the service manager in its STATUS= line. */
typedef struct amx_notify_status {
    uint32_t jobs, calls, waiting;
} amx_notify_status_t;

/*
 * Creates the notifier on `loop`. When systemd asked for a watchdog
 * (WATCHDOG_USEC, for this pid), a loop timer pings it every half period
 * from now on. `sample` (may be NULL) is called on the loop thread about
 * once a second after amx_notify_ready to refresh the STATUS= line, which
 * is sent only when it changed. Never fails: without NOTIFY_SOCKET it
 * does nothing. Loop thread.
 */
amx_notify_t *amx_notify_create(uv_loop_t *loop, void (*sample)(void *ud, amx_notify_status_t *s),
                                void *ud);

/* Sends "STATUS=<text>" now. Loop thread. */
void amx_notify_status(amx_notify_t *n, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The daemon listens: READY=1 with a STATUS= line. Loop thread. */
void amx_notify_ready(amx_notify_t *n, const char *listening);

/* The daemon began a graceful stop: STOPPING=1 with a STATUS= line; the
 * watchdog keeps being pinged while the loop runs. Loop thread. */
void amx_notify_stopping(amx_notify_t *n, const char *why);

/* Start-up failed: STATUS=<msg> and ERRNO= (systemd shows both). Any
 * thread; `n` may be NULL (the notifier was not made yet). */
void amx_notify_failed(amx_notify_t *n, int errnum, const char *msg);

/* The watchdog period systemd asked for, microseconds (0: none). */
uint64_t amx_notify_watchdog_usec(const amx_notify_t *n);

/* Closes the loop handles; `n` is freed once they are closed (the loop
 * must run once more). NULL is allowed. Loop thread. */
void amx_notify_close(amx_notify_t *n);

#endif
