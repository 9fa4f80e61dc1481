#!/usr/bin/env bash
# One device call of a session: the calibrator checks on the GPUs
# (calib_nccl.sh steps 1 and 3), then GPU-direct's tests and its benchmark
# on every GPU of the machine (device.sh steps 1 and 3).
#   tests/gpu/session.sh BUILD_DIR CARRY_DIR OUT_DIR
set -uo pipefail
here=$(dirname "$0")
n=$(nvidia-smi -L | wc -l)
rc=0
AMAXD_GPU_STEPS="${AMAXD_CALIB_STEPS:-1 3}" AMAXD_CLUSTER_GPUS=$n "$here/calib_nccl.sh" "$@" || rc=1
AMAXD_DEVICE_STEPS="1 3" AMAXD_GPUS=$n AMAXD_LAT_ARGS=--breakdown "$here/device.sh" "$@" || rc=1
exit $rc
