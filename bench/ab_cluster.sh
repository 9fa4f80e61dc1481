#!/usr/bin/env bash
# Two amaxd builds, alternating, through bench/cluster_bench.py on the same
# GPUs in one run (to bisect a change in reconcile latency):
#   bench/ab_cluster.sh OLD_AMAXD NEW_AMAXD CARRY_DIR [RUNS] [DAEMONS]
# NCCL floor from the new build's folder (nccl_floor beside NEW_AMAXD).
set -u
old=${1:?old amaxd}; new=${2:?new amaxd}; carry=$(realpath "${3:?carry dir}")
runs=${4:-2}; daemons=${5:-2}
export NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$carry/lib:${LD_LIBRARY_PATH:-}" PYTHONUNBUFFERED=1
py=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl
export PYTHONPATH="$py:$(cd "$(dirname "$0")/.." && pwd)/tests/e2e"
for r in $(seq 1 "$runs"); do
  for v in old new; do
    b=$new; [ $v = old ] && b=$old
    echo "== $v ($b), run $r"
    python3 "$(dirname "$0")/cluster_bench.py" --amaxd "$b" --floor "$(dirname "$new")/nccl_floor" \
      --daemons "$daemons" 2>&1 | grep -E "amaxd reconcile:|engine thread|its all-reduce|its finish|\(a\) one"
  done
done
