#!/usr/bin/env bash
# The blocking NCCL communicator (comm_nccl.c), on every GPU of the host:
#   bench   bench/cluster_bench.py with the blocking child (default, 2 runs)
#           and with AMAXD_NCCL_BLOCKING=0 (1 run), each against its floors
#           measured in the same run; the daemons' GPU memory (nvidia-smi)
#   lat     bench/trainer_latency.py on every GPU, blocking then not
#   one     bench/trainer_latency.py --one-daemon: one amaxd for every GPU
#   outside tests/gpu/outside/device_check.py on GPU 0 (written from the docs)
#   cluster the cluster suite over NCCL (kill -9, restart, missing trainer,
#           conflicts): the dead-peer guarantees with the blocking child
#   failover tests/cluster/test_failover.py over NCCL
# Usage: tests/gpu/blocking.sh BUILD_DIR CARRY_DIR OUT_DIR; AMAXD_BLOCKING_STEPS
source "$(dirname "$0")/env.sh" "$@"
n=$(nvidia-smi -L | wc -l)
steps=" ${AMAXD_BLOCKING_STEPS:-bench lat one outside cluster failover} "
py=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl || rc=1
export PYTHONPATH="$py:$root/tests/e2e"
export AMAXD_BIN="$build/amaxd" AMAXCTL_BIN="$build/amaxctl" AMAXD_BUILD_DIR="$build"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
memwatch() { # samples the amaxd processes' GPU memory until killed; prints the max per pid
  local f=$1; : > "$f"
  while sleep 0.5; do nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader >> "$f"; done
}
memsum() { grep amaxd "$1" | awk -F', ' '{gsub(/ MiB/,"",$3); if ($3>m[$1]) m[$1]=$3} END {for (p in m) printf "%s ", m[p]; print "MiB per daemon (max)"}'; }
if [[ $steps == *" bench "* ]]; then
  for mode in blocking blocking nonblocking; do
    echo "== cluster_bench, $n daemons, $mode"
    memwatch "$out/mem.$mode" & w=$!
    if [ $mode = nonblocking ]; then export AMAXD_NCCL_BLOCKING=0; else unset AMAXD_NCCL_BLOCKING; fi
    python3 bench/cluster_bench.py --amaxd "$build/amaxd" --floor "$build/nccl_floor" \
      --daemons "$n" --logs "$out/logs.$mode" 2>&1 | tee -a "$out/cluster_bench.$mode.txt" | sed -n '1,14p' || rc=1
    kill $w; wait $w 2>/dev/null
    memsum "$out/mem.$mode"
    grep -h "NCCL:" "$out/logs.$mode"/*.log 2>/dev/null | head -1
  done
  unset AMAXD_NCCL_BLOCKING
fi
if [[ $steps == *" lat "* ]]; then
  for mode in blocking nonblocking; do
    echo "== trainer_latency, $n GPUs, $mode"
    if [ $mode = nonblocking ]; then export AMAXD_NCCL_BLOCKING=0; else unset AMAXD_NCCL_BLOCKING; fi
    python3 bench/trainer_latency.py --amaxd "$build/amaxd" --gpus "$n" \
      --sizes "${AMAXD_LAT_SIZES:-1000,20000,100000+pc}" --iters "${AMAXD_LAT_ITERS:-30}" \
      --out "$out/trainer_latency.$mode.jsonl" ${AMAXD_LAT_ARGS:---breakdown} 2>&1 | tee "$out/trainer_latency.$mode.txt" || rc=1
  done
  unset AMAXD_NCCL_BLOCKING
fi
if [[ $steps == *" one "* ]]; then
  echo "== trainer_latency, $n GPUs, one amaxd for all of them"
  python3 bench/trainer_latency.py --amaxd "$build/amaxd" --gpus "$n" --one-daemon \
    --sizes "${AMAXD_LAT_SIZES:-1000,20000,100000+pc}" --iters "${AMAXD_LAT_ITERS:-30}" \
    --out "$out/trainer_latency.one.jsonl" ${AMAXD_LAT_ARGS:---breakdown} 2>&1 | tee "$out/trainer_latency.one.txt" || rc=1
fi
if [[ $steps == *" outside "* ]]; then
  echo "== outside check of GPU-direct (written from the docs), GPU 0"
  CUDA_VISIBLE_DEVICES=0 timeout 400 python3 tests/gpu/outside/device_check.py 2>&1 | tee "$out/outside.txt" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ $steps == *" cluster "* ]]; then
  echo "== cluster suite over NCCL, $n daemons (blocking child)"
  AMAXD_CLUSTER_COLLECTIVE=nccl AMAXD_CLUSTER_BACKEND=cuda AMAXD_CLUSTER_GPUS=$n \
    python3 -m pytest -q -rs -p no:cacheprovider tests/cluster 2>&1 | tee "$out/cluster.txt" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
fi
if [[ $steps == *" failover "* && $n -ge 4 ]]; then
  echo "== failover over NCCL"
  (cd tests/cluster && AMAXD_CLUSTER_COLLECTIVE=nccl AMAXD_CLUSTER_BACKEND=cuda AMAXD_CLUSTER_GPUS=$n \
    python3 -m pytest -q -rs -p no:cacheprovider test_failover.py 2>&1 | tee "$out/failover.txt" | tail -4)
fi
echo "== blocking checks: $([ $rc -eq 0 ] && echo passed || echo FAILED)"
exit $rc
