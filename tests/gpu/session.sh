#!/usr/bin/env bash
# One device call of a session: the calibrator checks on the GPUs
# (calib_nccl.sh, steps AMAXD_CALIB_STEPS, default "1 3"), GPU-direct's
# tests and its benchmark on every GPU of the machine (device.sh steps 1
# and 3), and, on 4 GPUs or more, coordinator failover over NCCL
# (tests/cluster/test_failover.py, one daemon per GPU).
#   tests/gpu/session.sh BUILD_DIR CARRY_DIR OUT_DIR
#   AMAXD_SESSION_STEPS (default "calib device failover")
set -uo pipefail
here=$(dirname "$0")
n=$(nvidia-smi -L | wc -l)
steps=" ${AMAXD_SESSION_STEPS:-calib device failover} "
rc=0
if [[ $steps == *" calib "* ]]; then
  AMAXD_GPU_STEPS="${AMAXD_CALIB_STEPS:-1 3}" AMAXD_CLUSTER_GPUS=$n "$here/calib_nccl.sh" "$@" || rc=1
fi
if [[ $steps == *" failover "* && $n -ge 4 ]]; then
  (
    source "$here/env.sh" "$@"
    py=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl
    echo "== coordinator failover over NCCL: tests/cluster/test_failover.py, $n GPUs"
    cd "$root/tests/cluster" && PYTHONPATH="$py:$root/tests/e2e" AMAXD_BIN="$build/amaxd" \
      AMAXD_CLUSTER_COLLECTIVE=nccl AMAXD_CLUSTER_BACKEND=cuda AMAXD_CLUSTER_GPUS=$n \
      python3 -m pytest -q -rs -p no:cacheprovider test_failover.py 2>&1 \
      | tee "$out/failover_nccl.txt" | tail -6
    grep -q " passed" "$out/failover_nccl.txt" && ! grep -q "failed\|error" "$out/failover_nccl.txt"
  ) || rc=1
fi
if [[ $steps == *" device "* ]]; then
  AMAXD_DEVICE_STEPS="1 3" AMAXD_GPUS=$n AMAXD_LAT_ARGS=--breakdown "$here/device.sh" "$@" || rc=1
fi
exit $rc
