/*
 * log.h - one logging macro with a level and a subsystem.
 *
 * Lines go to stderr or to the configured file. Under systemd (JOURNAL_STREAM
 * set and logging to stderr) each line starts with a "<N>" syslog priority
 * and no timestamp, which journald turns into the entry's priority.
 */
#ifndef AMX_LOG_H
#define AMX_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

enum { AMX_LOG_ERROR = 0, AMX_LOG_WARN = 1, AMX_LOG_INFO = 2, AMX_LOG_DEBUG = 3 };

extern int amx_log_level;

/* Logs when `level` is enabled; arguments are not evaluated otherwise.
 * Any thread: each line is written with one write(2). */
#define AMX_LOG(level, subsys, ...)                                                                \
    do {                                                                                           \
        if ((level) <= amx_log_level)                                                              \
            amx_log_write((level), (subsys), __VA_ARGS__);                                         \
    } while (0)

#define AMX_ERROR(subsys, ...) AMX_LOG(AMX_LOG_ERROR, subsys, __VA_ARGS__)
#define AMX_WARN(subsys, ...) AMX_LOG(AMX_LOG_WARN, subsys, __VA_ARGS__)
#define AMX_INFO(subsys, ...) AMX_LOG(AMX_LOG_INFO, subsys, __VA_ARGS__)
#define AMX_DEBUG(subsys, ...) AMX_LOG(AMX_LOG_DEBUG, subsys, __VA_ARGS__)

void amx_log_write(int level, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Parses "error|warn|info|debug"; returns -1 for anything else. */
int amx_log_parse_level(const char *s);

/* Whether AMAXD_PROFILE is set (not empty, not "0"): the engine, the NCCL
 * thread and the CUDA backend then log where each epoch's time went, at
 * info level (docs/OPERATING.md). Read once. */
int amx_log_profiling(void);

/* Opens (or re-opens, on SIGHUP) the log destination: NULL or "" means
 * stderr. Returns 0, or -errno when the file cannot be opened (the previous
 * destination is kept). Loop thread. */
int amx_log_open(const char *path);

void amx_log_close(void);

#ifdef __cplusplus
}
#endif

#endif
