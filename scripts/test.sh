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
if command -v nvcc >/dev/null 2>&1; then
  echo "== CUDA build (build-cuda/): the CUDA state backend must compile; unit tests of that build"
  AMAXD_CUDA=ON scripts/deps.sh build-cuda
  ctest --test-dir build-cuda -L unit --output-on-failure
  if nvidia-smi -L >/dev/null 2>&1; then
    echo "== GPU present: host vs CUDA backend, and the end-to-end suite on the CUDA backend"
    build-cuda/backend_compare tests/vectors/recipes.tsv
    AMAXD_BACKEND=cuda ctest --test-dir build-cuda -L e2e --output-on-failure
  else
    echo "== no GPU here: the CUDA backend's GPU tests run with tests/gpu/run.sh on a GPU host"
  fi
fi
echo "== all tests passed"
