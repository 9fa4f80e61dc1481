#!/usr/bin/env bash
# Every test, each tier once, all through CTest (tests/CMakeLists.txt): the
# Check unit tests and the end-to-end pytest suites against the real daemon,
# in a normal build and with ASan+UBSan; the ModelOpt tier and, with the same
# venv, the TransformerEngine tier (tests/te: amaxd.te against TE's
# master-weight cast in numpy, torch on CPU), both in the normal build only
# (.venv-modelopt; AMAXD_SKIP_MODELOPT=1 leaves them out); the fuzzer; and,
# where nvcc is, the CUDA build (its GPU tests skipped with the reason when no
# GPU is usable).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# Why CTest skipped what it skipped (tests/skip_unless.sh), from its log.
skipped() {
  grep -h '^SKIPPED: ' "$1/Testing/Temporary/LastTest.log" 2>/dev/null | sed 's/^/   /' || true
}
echo "== layers of daemon/ (docs/ARCHITECTURE.md)"
python3 scripts/check_layers.py
scripts/deps.sh build
if [ "${AMAXD_SKIP_MODELOPT:-0}" != 1 ]; then
  echo "== ModelOpt venv (.venv-modelopt: torch + nvidia-modelopt on CPU, the amaxd client)"
  scripts/modelopt-venv.sh >/dev/null
fi
echo "== tests (build/): unit, end-to-end, cluster, ModelOpt and TE tiers"
ctest --test-dir build --output-on-failure
skipped build
echo "== tests under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
scripts/deps.sh build-asan -DCMAKE_BUILD_TYPE=Debug -DAMAXD_SANITIZE=address,undefined
# The ModelOpt and TE tiers ran above, against build/amaxd.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -LE '^(modelopt|te)$'
skipped build-asan
echo "== fuzzing request decoding and validation (build-fuzz/, libFuzzer, ${AMAXD_FUZZ_SECONDS:-60} s)"
scripts/deps.sh build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DAMAXD_FUZZ=ON \
  -DAMAXD_GLOO=OFF -DAMAXD_TESTS=OFF
"${AMAXD_VENV:-.venv}/bin/python" tests/fuzz/make_seeds.py build-fuzz/fuzz_requests build-fuzz/corpus
(cd build-fuzz && ./fuzz_requests -max_total_time="${AMAXD_FUZZ_SECONDS:-60}" -timeout=10 \
  -rss_limit_mb=2048 -print_final_stats=1 corpus 2>&1 | grep -E "^stat::|^Done|ERROR|SUMMARY")
if command -v nvcc >/dev/null 2>&1; then
  echo "== CUDA build (build-cuda/): the CUDA state backend must compile; unit tests of that"
  echo "   build, and host vs CUDA backend (gpu.backend_compare: skipped without a GPU)"
  AMAXD_CUDA=ON scripts/deps.sh build-cuda
  ctest --test-dir build-cuda -L 'unit|gpu' --output-on-failure
  skipped build-cuda
  if nvidia-smi -L >/dev/null 2>&1; then
    echo "== GPU present: the end-to-end suite on the CUDA backend"
    AMAXD_BACKEND=cuda ctest --test-dir build-cuda -L e2e --output-on-failure
  else
    echo "== no GPU here: the CUDA backend's GPU tests run with tests/gpu/run.sh on a GPU host"
  fi
fi
echo "== all tests passed"
