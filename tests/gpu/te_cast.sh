#!/usr/bin/env bash
# TE's master-weight cast through amaxd on GPUs (issue 22), in one go:
#   1. tests/gpu/te_cast.py: one amaxd per GPU (CUDA backend, NCCL), one
#      trainer per GPU; amaxd.te's device path (GPU-direct) and packed path
#      give the same bytes as each other, as the numpy transcription of TE
#      and (where transformer_engine is importable) as TE's own kernels,
#      Megatron cuts and random cuts with empty shards, over 1..N ranks;
#      no host sync inside a device-path step
#   2. bench/te_cast_bench.py: the 8B model's weights, DP = N: TE's pattern
#      (partial amax + all_reduce(MAX) x 2 + scales in torch) against the
#      packed and the device path, per recipe, medians over steps
# Usage: tests/gpu/te_cast.sh BUILD_DIR CARRY_DIR [OUT_DIR]
#   (BUILD_DIR and CARRY_DIR as tests/gpu/README.md makes them: .gpu-build .gpu)
#   AMAXD_TE_STEPS (default "1 2"), AMAXD_TE_RANKS (default 4: the GPUs used),
#   AMAXD_TE_BENCH_ARGS (more bench arguments, e.g. "--steps 20 --recipes nvfp4")
source "$(dirname "$0")/env.sh" "$@"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
"$build/amaxd" --version
py=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl || rc=1
# The client under test is this tree's: a bundle made before its amaxd.te
# changed would test the old one (the wheel's generated _gen is kept).
if ! cmp -s "$py/amaxd/te.py" "$root/client/python/amaxd/te.py"; then
  echo "note: the bundle's amaxd wheel is not this tree's client: using the tree's sources"
  cp "$root"/client/python/amaxd/*.py "$py/amaxd/"
fi
export PYTHONPATH="$py:$root/tests/e2e"
export AMAXD_BIN="$build/amaxd"
python3 -c 'import torch, amaxd.device as d; print("torch", torch.__version__, "ipc:", d.ipc().name)'
n=${AMAXD_TE_RANKS:-4}
steps=${AMAXD_TE_STEPS:-1 2}
if [ "$(nvidia-smi -L | grep -c '^GPU')" -lt "$n" ]; then
  echo "te_cast.sh: needs $n GPUs (AMAXD_TE_RANKS), this host has fewer"
  exit 1
fi

if [[ " $steps " == *" 1 "* ]]; then
  echo "== 1. tests/gpu/te_cast.py, $n ranks, paths packed and device"
  python3 tests/gpu/te_cast.py --amaxd "$build/amaxd" --ranks "$n" --steps 3 2>&1 \
    | grep -v '^\[Gloo\]' | tee "$out/te_cast.txt" | tail -30
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ " $steps " == *" 2 "* ]]; then
  echo "== 2. bench/te_cast_bench.py, 8B model shapes, DP = $n"
  python3 bench/te_cast_bench.py --amaxd "$build/amaxd" --ranks "$n" ${AMAXD_TE_BENCH_ARGS:-} 2>&1 \
    | tee "$out/te_cast_bench.txt" | tail -12
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
echo "== TE cast checks: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
