#!/usr/bin/env bash
# Every test: Check unit tests and the end-to-end pytest suite against the
# real daemon, once in a normal build and once with ASan+UBSan; the ModelOpt
# tier (torch + nvidia-modelopt in .venv-modelopt; AMAXD_SKIP_MODELOPT=1
# leaves it out) and, with the same venv, the TransformerEngine tier
# (tests/te: amaxd.te against TE's master-weight cast in numpy, torch on CPU).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
echo "== layers of daemon/ (docs/ARCHITECTURE.md)"
python3 scripts/check_layers.py
scripts/deps.sh build
echo "== tests (build/)"
ctest --test-dir build --output-on-failure
if [ "${AMAXD_SKIP_MODELOPT:-0}" != 1 ]; then
  echo "== ModelOpt tier: amaxd.modelopt against nvidia-modelopt on CPU (.venv-modelopt)"
  modelopt_py=$(scripts/modelopt-venv.sh | tail -n 1)
  AMAXD_BIN="$root/build/amaxd" "$modelopt_py" -m pytest -q -p no:cacheprovider tests/modelopt
  echo "== TE tier: amaxd.te against TransformerEngine's master-weight cast (torch on CPU)"
  AMAXD_BIN="$root/build/amaxd" "$modelopt_py" -m pytest -q -p no:cacheprovider tests/te
else
  echo "== ModelOpt and TE tiers skipped (AMAXD_SKIP_MODELOPT=1)"
fi
echo "== tests under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
scripts/deps.sh build-asan -DCMAKE_BUILD_TYPE=Debug -DAMAXD_SANITIZE=address,undefined
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure
echo "== fuzzing request decoding and validation (build-fuzz/, libFuzzer, ${AMAXD_FUZZ_SECONDS:-60} s)"
scripts/deps.sh build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DAMAXD_FUZZ=ON \
  -DAMAXD_GLOO=OFF -DAMAXD_TESTS=OFF
"${AMAXD_VENV:-.venv}/bin/python" tests/fuzz/make_seeds.py build-fuzz/fuzz_requests build-fuzz/corpus
(cd build-fuzz && ./fuzz_requests -max_total_time="${AMAXD_FUZZ_SECONDS:-60}" -timeout=10 \
  -rss_limit_mb=2048 -print_final_stats=1 corpus 2>&1 | grep -E "^stat::|^Done|ERROR|SUMMARY")
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
