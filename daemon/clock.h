/*
 * clock.h - the daemon's one clock: CLOCK_MONOTONIC in milliseconds. Every
 * deadline in amaxd (waiters, epochs, rendezvous, peer calls) is a value of
 * this clock. Any thread.
 */
#ifndef AMX_CLOCK_H
#define AMX_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t amx_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline uint64_t amx_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* One step of a busy wait (config busy_poll): tells the core it spins. */
static inline void amx_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

#endif
