/*
 * absl_tune.cc - the one setting of Abseil (gRPC's mutexes) amaxd makes.
 *
 * Debian's Abseil is built without NDEBUG, so every absl::Mutex that gRPC
 * takes also maintains a lock-order graph for deadlock detection
 * (GraphCycles): a debugging aid that took ~2% of the daemon's CPU
 * samples under small unary calls (perf, bench/NOTES.md "Unary calls").
 */
#include <absl/synchronization/mutex.h>

extern "C" void amx__absl_tune(void)
{
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}
