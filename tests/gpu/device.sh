#!/usr/bin/env bash
# GPU-direct on a GPU host (issue 21), in one go:
#   1. tests/gpu/test_device.py: same bytes as the packed path, no host sync
#      behind a long kernel, kill -9 of a trainer frees its mappings, bad input
#   2. the end-to-end suite on the CUDA backend (the packed and named paths
#      unchanged)
#   3. bench/trainer_latency.py: gRPC packed, shm packed, device and the
#      in-process all_reduce(MAX) baseline, per sync from the trainer's seat
# Usage: tests/gpu/device.sh BUILD_DIR CARRY_DIR [OUT_DIR]
#   AMAXD_GPUS (default 1): GPUs for the benchmark (one daemon and one trainer each)
#   AMAXD_LAT_SIZES (default 1000,20000,100000+pc), AMAXD_LAT_ITERS (default 30)
#   AMAXD_DEVICE_STEPS (default "1 2 3"), AMAXD_LAT_ARGS (more arguments, e.g. --breakdown)
source "$(dirname "$0")/env.sh" "$@"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
"$build/amaxd" --version
py=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl || rc=1
export PYTHONPATH="$py:$root/tests/e2e"
export AMAXD_BIN="$build/amaxd" AMAXCTL_BIN="$build/amaxctl" AMAXD_BUILD_DIR="$build"
python3 -c 'import torch, amaxd.device as d; print("torch", torch.__version__, "ipc:", d.ipc().name)'
steps=${AMAXD_DEVICE_STEPS:-1 2 3}

if [[ " $steps " == *" 1 "* ]]; then
  echo "== 1. tests/gpu/test_device.py (daemon on the CUDA backend)"
  python3 tests/gpu/diag_cai.py 2>&1 | tee "$out/diag_cai.txt"
  AMAXD_BACKEND=cuda python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_device.py tests/gpu/test_armed.py 2>&1 \
    | tee "$out/test_device.txt" | grep -v "^$" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ " $steps " == *" 2 "* ]]; then
  echo "== 2. end-to-end suite, daemon on the CUDA backend"
  AMAXD_BACKEND=cuda python3 -m pytest -q -p no:cacheprovider tests/e2e 2>&1 | tee "$out/e2e.txt" | tail -4
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ " $steps " == *" 3 "* ]]; then
  echo "== 3. bench/trainer_latency.py on ${AMAXD_GPUS:-1} GPU(s)"
  python3 bench/trainer_latency.py --amaxd "$build/amaxd" --gpus "${AMAXD_GPUS:-1}" \
    --sizes "${AMAXD_LAT_SIZES:-1000,20000,100000+pc}" --iters "${AMAXD_LAT_ITERS:-30}" \
    --out "$out/trainer_latency.jsonl" ${AMAXD_LAT_ARGS:-} 2>&1 | tee "$out/trainer_latency.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
echo "== device checks: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
