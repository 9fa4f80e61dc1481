#!/usr/bin/env bash
# GPU checks of the CUDA state backend, for a GPU host without the -dev
# packages (see tests/gpu/README.md for how the carried folder is made):
#   1. Check unit tests (host code of the CUDA build)
#   2. backend_compare: conformance vectors on the device, and 10^7 random
#      amax values per recipe through the host and CUDA backends, compared
#      byte for byte; calib_compare: the histogram methods on the device
#      against the host's, bit for bit
#   3. the end-to-end pytest suite against amaxd on the CUDA backend
#   4. bench_kernels: merge and NVFP4 scale kernels vs a device copy
# Usage: tests/gpu/run.sh BUILD_DIR CARRY_DIR [OUT_DIR]
source "$(dirname "$0")/env.sh" "$@"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$build/amaxd" --version

echo "== 1. unit tests"
export AMAXD_VECTORS="$root/tests/vectors"
for t in "$build"/tests/test_*; do
  printf '%-16s ' "${t##*/test_}"; "$t" 2>/dev/null | tail -1 || rc=1
done

echo "== 2. host vs CUDA backend"
"$build/backend_compare" tests/vectors/recipes.tsv "${AMAXD_COMPARE_N:-10000000}" 2>&1 | tee "$out/backend_compare.txt" || rc=1
"$build/calib_compare" "${AMAXD_CALIB_COMPARE_N:-20000}" 2>&1 | tee "$out/calib_compare.txt" || rc=1

echo "== 3. end-to-end suite, daemon on the CUDA backend"
py=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl || rc=1
export PYTHONPATH="$py:$root/tests/e2e"
export AMAXD_BIN="$build/amaxd" AMAXCTL_BIN="$build/amaxctl" AMAXD_BACKEND=cuda AMAXD_BUILD_DIR="$build"
python3 -m pytest -q -p no:cacheprovider tests/e2e 2>&1 | tee "$out/e2e.txt" | tail -5 || rc=1

echo "== 4. kernel benchmark"
"$build/bench_kernels" "${AMAXD_BENCH_N:-268435456}" 20 2>&1 | tee "$out/bench_kernels.txt" || rc=1
echo "== gpu checks: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
