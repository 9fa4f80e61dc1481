/*
 * notify.c - sd_notify readiness, status, stopping and watchdog pings.
 */
#include "notify.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "log.h"

struct amx_notify {
    uv_timer_t watchdog, status;
    int open_handles;
    int active;     /* NOTIFY_SOCKET is set */
    uint64_t wd_us; /* 0: no watchdog */
    void (*sample)(void *ud, amx_notify_status_t *s);
    void *ud;
    int have_last, stopping;
    amx_notify_status_t last;
};

/* Sends one message; a failure is logged once and otherwise ignored: the
 * daemon serves trainers whether or not systemd hears from it. */
static void send_msg(amx_notify_t *n, const char *msg)
{
    static int warned;
    if (n != NULL && !n->active)
        return;
    int rc = sd_notify(0, msg);
    if (rc < 0 && !warned) {
        warned = 1;
        AMX_WARN("notify", "sd_notify failed: %s (the service manager may not see this state)",
                 strerror(-rc));
    }
}

static void on_watchdog(uv_timer_t *t)
{
    send_msg(t->data, "WATCHDOG=1");
}

static void on_status(uv_timer_t *t)
{
    amx_notify_t *n = t->data;
    if (n->sample == NULL || n->stopping)
        return;
    amx_notify_status_t s = {0};
    n->sample(n->ud, &s);
    if (n->have_last && memcmp(&s, &n->last, sizeof(s)) == 0)
        return;
    n->last = s;
    n->have_last = 1;
    amx_notify_status(n, "serving %u job%s, %u call%s in progress, %u waiting for other ranks",
                      s.jobs, s.jobs == 1 ? "" : "s", s.calls, s.calls == 1 ? "" : "s", s.waiting);
}

amx_notify_t *amx_notify_create(uv_loop_t *loop, void (*sample)(void *ud, amx_notify_status_t *s),
                                void *ud)
{
    amx_notify_t *n = calloc(1, sizeof(*n));
    if (n == NULL)
        return NULL; /* every function takes NULL: no notifications */
    const char *sock = getenv("NOTIFY_SOCKET");
    n->active = sock != NULL && sock[0] != '\0';
    n->sample = sample;
    n->ud = ud;
    uv_timer_init(loop, &n->watchdog);
    uv_timer_init(loop, &n->status);
    n->watchdog.data = n->status.data = n;
    n->open_handles = 2;
    uint64_t us = 0;
    int rc = sd_watchdog_enabled(0, &us);
    if (rc > 0 && us > 0) {
        n->wd_us = us;
        /* Half the period, as sd_watchdog_enabled(3) advises; at least 1 ms. */
        uint64_t every = us / 2000 ? us / 2000 : 1;
        uv_timer_start(&n->watchdog, on_watchdog, every, every);
        send_msg(n, "WATCHDOG=1");
        AMX_INFO("notify", "systemd watchdog: %llu ms, pinged every %llu ms from the loop",
                 (unsigned long long)(us / 1000), (unsigned long long)every);
    } else if (rc < 0) {
        AMX_WARN("notify", "WATCHDOG_USEC is set but invalid (%s): no watchdog pings",
                 strerror(-rc));
    }
    return n;
}

void amx_notify_status(amx_notify_t *n, const char *fmt, ...)
{
    if (n == NULL || !n->active)
        return;
    char msg[512] = "STATUS=";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + 7, sizeof(msg) - 7, fmt, ap);
    va_end(ap);
    /* One line: the protocol is newline-separated assignments. */
    for (char *p = msg; *p; p++)
        if (*p == '\n')
            *p = ' ';
    send_msg(n, msg);
}

void amx_notify_ready(amx_notify_t *n, const char *listening)
{
    if (n == NULL || !n->active)
        return;
    char msg[512];
    snprintf(msg, sizeof(msg), "READY=1\nSTATUS=ready: listening on %s", listening);
    for (char *p = msg + 8; *p; p++)
        if (*p == '\n')
            *p = ' ';
    send_msg(n, msg);
    if (n->sample != NULL)
        uv_timer_start(&n->status, on_status, 1000, 1000);
}

void amx_notify_stopping(amx_notify_t *n, const char *why)
{
    if (n == NULL || !n->active)
        return;
    n->stopping = 1;
    uv_timer_stop(&n->status);
    char msg[512];
    snprintf(msg, sizeof(msg), "STOPPING=1\nSTATUS=stopping: %s", why);
    for (char *p = msg + 11; *p; p++)
        if (*p == '\n')
            *p = ' ';
    send_msg(n, msg);
}

void amx_notify_failed(amx_notify_t *n, int errnum, const char *msg)
{
    if (n != NULL && !n->active)
        return;
    if (n == NULL && getenv("NOTIFY_SOCKET") == NULL)
        return;
    char text[512];
    snprintf(text, sizeof(text), "STATUS=failed: %s", msg);
    for (char *p = text; *p; p++)
        if (*p == '\n')
            *p = ' ';
    sd_notify(0, text);
    if (errnum > 0)
        sd_notifyf(0, "ERRNO=%d", errnum);
}

uint64_t amx_notify_watchdog_usec(const amx_notify_t *n)
{
    return n != NULL ? n->wd_us : 0;
}

static void on_closed(uv_handle_t *h)
{
    amx_notify_t *n = h->data;
    if (--n->open_handles == 0)
        free(n);
}

void amx_notify_close(amx_notify_t *n)
{
    if (n == NULL)
        return;
    uv_close((uv_handle_t *)&n->watchdog, on_closed);
    uv_close((uv_handle_t *)&n->status, on_closed);
}
