#include "log.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

int amx_log_level = AMX_LOG_INFO;

static int log_fd = 2;
static int log_journal = -1; /* -1: not decided yet */

static const char *const level_name[] = {"error", "warn", "info", "debug"};
static const int level_syslog[] = {3, 4, 6, 7};

int amx_log_parse_level(const char *s)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(s, level_name[i]) == 0)
            return i;
    return -1;
}

void amx_log_write(int level, const char *subsys, const char *fmt, ...)
{
    char line[2048];
    size_t n = 0;
    if (level < 0)
        level = 0;
    if (level > 3)
        level = 3;
    if (log_journal < 0)
        log_journal = getenv("JOURNAL_STREAM") != NULL;
    if (log_journal && log_fd == 2) {
        n = (size_t)snprintf(line, sizeof(line), "<%d>%s: ", level_syslog[level], subsys);
    } else {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        gmtime_r(&ts.tv_sec, &tm);
        n = strftime(line, sizeof(line), "%Y-%m-%dT%H:%M:%S", &tm);
        n += (size_t)snprintf(line + n, sizeof(line) - n, ".%03ldZ %-5s %s: ", ts.tv_nsec / 1000000,
                              level_name[level], subsys);
    }
    /* The message may quote what a client sent: control characters are
     * written as \xNN, so that one line stays one line (a newline and a
     * timestamp, or journald's "<N>" priority prefix, cannot be forged).
     * The backslash is left as it is, so that a status message and its log
     * line read the same; messages that quote refused strings escape them
     * fully themselves (wire.c amx_escape: a backslash is \x5c there). */
    char msg[sizeof(line)];
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    size_t mlen = m < 0 ? 0 : (size_t)m < sizeof(msg) ? (size_t)m : sizeof(msg) - 1;
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < mlen && n + 5 < sizeof(line); i++) {
        unsigned char c = (unsigned char)msg[i];
        if (c < 0x20 || c == 0x7f) {
            line[n++] = '\\';
            line[n++] = 'x';
            line[n++] = hex[c >> 4];
            line[n++] = hex[c & 15];
        } else {
            line[n++] = (char)c;
        }
    }
    line[n++] = '\n';
    ssize_t w = write(__atomic_load_n(&log_fd, __ATOMIC_ACQUIRE), line, n);
    (void)w;
}

int amx_log_open(const char *path)
{
    if (path == NULL || path[0] == '\0') {
        int old = log_fd;
        __atomic_store_n(&log_fd, 2, __ATOMIC_RELEASE);
        if (old != 2)
            close(old);
        return 0;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0640);
    if (fd < 0)
        return -errno;
    if (log_fd != 2) {
        /* Other threads may be writing: the descriptor number they use
         * now refers to the new file, at once (never a closed or reused
         * number). */
        if (dup2(fd, log_fd) < 0) {
            int e = errno;
            close(fd);
            return -e;
        }
        close(fd);
        return 0;
    }
    __atomic_store_n(&log_fd, fd, __ATOMIC_RELEASE);
    return 0;
}

void amx_log_close(void)
{
    amx_log_open(NULL);
}

int amx_log_profiling(void)
{
    static atomic_int on = -1;
    int v = atomic_load(&on);
    if (v < 0) {
        const char *e = getenv("AMAXD_PROFILE");
        v = e != NULL && e[0] != '\0' && strcmp(e, "0") != 0;
        atomic_store(&on, v);
    }
    return v;
}
