#!/usr/bin/env bash
# The cluster on GPUs: one amaxd per GPU, CUDA state backend, NCCL between
# the daemons. For a GPU host without the -dev packages (tests/gpu/README.md):
#   1. unit tests of the CUDA build
#   2. backend_compare: host vs CUDA backend, byte for byte
#   3. the single-daemon end-to-end suite on the CUDA backend
#   4. the cluster suite over NCCL (three layouts vs numpy, kill -9 and
#      restart, a missing trainer, a conflict, a peer without the secret);
#      the whole-tensor digest is the CPU run's (it is checked against the
#      same numpy reference)
#   5. bench/cluster_bench.py (AMAXD_BENCH_RUNS runs, default 3): reconcile
#      latency vs one packed NCCL all-reduce and vs one all-reduce per
#      quantizer; 6. one run with AMAXD_PROFILE=1 for the breakdown
# Usage: tests/gpu/cluster.sh BUILD_DIR CARRY_DIR [OUT_DIR]
# AMAXD_GPU_STEPS="1 2 3 4 5 6" picks the steps to run.
source "$(dirname "$0")/env.sh" "$@"
# AMAXD_CLUSTER_GPUS=2 on a larger host: a cluster of 2 (devices 0 and 1).
ngpu=${AMAXD_CLUSTER_GPUS:-$(nvidia-smi -L | wc -l)}
step() { [[ " ${AMAXD_GPU_STEPS:-1 2 3 4 5 6} " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5
"$build/amaxd" --version

if step 1; then
  echo "== 1. unit tests"
  export AMAXD_VECTORS="$root/tests/vectors"
  for t in "$build"/tests/test_*; do
    printf '%-16s ' "${t##*/test_}"; "$t" 2>/dev/null | tail -1 || rc=1
  done
fi
if step 2; then
  echo "== 2. host vs CUDA backend"
  "$build/backend_compare" tests/vectors/recipes.tsv "${AMAXD_COMPARE_N:-10000000}" 2>&1 \
    | tee "$out/backend_compare.txt" || rc=1
fi

py=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl || rc=1
export PYTHONPATH="$py:$root/tests/e2e"
export AMAXD_BIN="$build/amaxd" AMAXCTL_BIN="$build/amaxctl"

if step 3; then
  echo "== 3. end-to-end suite, one daemon on the CUDA backend"
  AMAXD_BACKEND=cuda AMAXD_BUILD_DIR="$build" python3 -m pytest -q -p no:cacheprovider tests/e2e 2>&1 \
    | tee "$out/e2e.txt" | tail -3 || rc=1
fi
if step 4; then
  echo "== 4. cluster suite: $ngpu daemons, one per GPU, NCCL + CUDA backend"
  AMAXD_CLUSTER_COLLECTIVE=nccl AMAXD_CLUSTER_BACKEND=cuda AMAXD_CLUSTER_GPUS=$ngpu \
    AMAXD_DIGEST_FILE="$out/digest.txt" \
    python3 -m pytest -q -rs -p no:cacheprovider tests/cluster 2>&1 \
    | tee "$out/cluster.txt" | tail -8 || rc=1
  cat "$out/digest.txt" 2>/dev/null
fi
runs=${AMAXD_BENCH_RUNS:-3}
if step 5; then
  echo "== 5. benchmark: $ngpu daemons over NCCL, $runs runs"
  for r in $(seq 1 "$runs"); do
    python3 bench/cluster_bench.py --amaxd "$build/amaxd" --floor "$build/nccl_floor" \
      --daemons "$ngpu" ${AMAXD_BENCH_ARGS:-} 2>&1 | tee "$out/cluster_bench.$r.txt" || rc=1
  done
fi
if step 6; then
  echo "== 6. one more run with AMAXD_PROFILE=1: where an epoch's time goes (daemon logs)"
  AMAXD_PROFILE=1 python3 bench/cluster_bench.py --amaxd "$build/amaxd" --daemons "$ngpu" \
    --epochs 5 --logs "$out/profile" ${AMAXD_BENCH_ARGS:-} > "$out/cluster_bench.profile.txt" 2>&1 || rc=1
  grep -h "profile" "$out"/profile/amaxd*.log | tail -12
fi
echo "== gpu cluster checks: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
