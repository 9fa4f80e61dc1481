#!/usr/bin/env bash
# Every test: Check unit tests and the end-to-end pytest suite against the
# real daemon, once in a normal build and once with ASan+UBSan.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/deps.sh build
echo "== tests (build/)"
ctest --test-dir build --output-on-failure
echo "== tests under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
scripts/deps.sh build-asan -DCMAKE_BUILD_TYPE=Debug -DAMAXD_SANITIZE=address,undefined
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure
echo "== all tests passed"
