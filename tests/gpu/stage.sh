#!/usr/bin/env bash
# Copies what tests/gpu/run.sh and cluster.sh need from a CUDA build into a
# small folder (the whole build tree is larger than a transfer to a GPU host
# may be): the binaries, the Check tests and the generated systemd unit.
#   tests/gpu/stage.sh BUILD_DIR STAGE_DIR
set -euo pipefail
build=${1:?build dir}; stage=${2:?stage dir}
rm -rf "$stage"
mkdir -p "$stage/tests"
cp "$build"/{amaxd,amaxctl,backend_compare,bench_kernels,nccl_floor,amaxd.service} "$stage/"
cp "$build"/tests/test_* "$stage/tests/"
# The calibrators' arithmetic alone, for tests/e2e/test_calib.py, and the
# device's histogram methods against it (issue 23).
[ -e "$build/libamaxd_calib.so" ] && cp "$build/libamaxd_calib.so" "$stage/"
[ -e "$build/calib_compare" ] && cp "$build/calib_compare" "$stage/"
echo "stage: $(du -sh "$stage" | cut -f1) in $stage"
