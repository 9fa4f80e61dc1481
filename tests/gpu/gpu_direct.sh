#!/usr/bin/env bash
# GPU-direct (issue 21) on every GPU of one host, in parts that each fit a
# device call (10 minutes); the 2026-11-27 4 x H200 figures came from it.
#   tests/gpu/gpu_direct.sh BUILD_DIR CARRY_DIR [OUT_DIR]
#   CALL_STEPS, any of (default "tests"):
#     tests   tests/gpu/test_device.py + test_armed.py on 1, 2 and all GPUs
#             (CUDA_VISIBLE_DEVICES), then the outside checks
#             (tests/gpu/outside/armed_check.py, device_check.py)
#     cluster the cluster suite (tests/cluster), one daemon per GPU, NCCL
#             (CLUSTER_LIMIT seconds, default 500; CLUSTER_FILES, default
#             ".", the test files of this call: the whole suite takes more
#             than one call)
#     e2e     tests/e2e files (E2E_FILES, default test_previous.py
#             test_packed.py test_shm.py test_named_wire.py) against daemons
#             on the CUDA backend (GPU 0)
#     lat     bench/trainer_latency.py, LAT_RUNS runs (default "1 2 3"),
#             gRPC, shm, device, async and armed paths, three catalog sizes
#     mps     the same under MPS (a private nvidia-cuda-mps-control -d,
#             quit after), device and armed paths
#     one     one run with one daemon for all GPUs (--one-daemon)
#     cbench  bench/cluster_bench.py three times (the daemon's epoch at
#             10.1M cells against one packed NCCL all-reduce)
#     fused   the fused finish (AMAXD_FUSED_FINISH): backend_compare with it
#             on and off, the same-bytes GPU tests, then cluster_bench with it off and
#             on, alternating, two runs each
#     prof    the armed path's profile under MPS and cluster_bench's profile
source "$(dirname "$0")/env.sh" "$@"
OUT=$out
py=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$py" "$carry"/wheels/*.whl
export PYTHONPATH="$py:$root/tests/e2e" AMAXD_BIN="$build/amaxd" AMAXCTL_BIN="$build/amaxctl" AMAXD_BUILD_DIR="$build"
n=$(nvidia-smi -L | wc -l)
nvidia-smi -L; nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; echo
"$build/amaxd" --version
steps=" ${CALL_STEPS:-tests} "
t0=$(date +%s)
el() { echo "[+$(( $(date +%s) - t0 )) s] $*"; }
mps_on() { export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d); nvidia-cuda-mps-control -d; }
mps_off() { echo quit | nvidia-cuda-mps-control; sleep 1; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
if [[ $steps == *" tests "* ]]; then
  for g in $(printf '%s\n' 1 2 "$n" | awk -v n="$n" '$1 <= n' | sort -un); do
    vis=$(seq -s, 0 $((g-1)))
    el "== test_device.py + test_armed.py on $g GPU(s) (CUDA_VISIBLE_DEVICES=$vis)"
    CUDA_VISIBLE_DEVICES=$vis AMAXD_BACKEND=cuda timeout 240 python3 -m pytest -q -s -rs -p no:cacheprovider \
      tests/gpu/test_device.py tests/gpu/test_armed.py > "$OUT/test_device_${g}gpu.txt" 2>&1
    echo "rc=$?"; grep -E "passed|failed|SKIP|Error" "$OUT/test_device_${g}gpu.txt" | tail -6
  done
  el "== outside armed_check ($n GPUs visible)"
  timeout 200 python3 tests/gpu/outside/armed_check.py > "$OUT/armed_check.txt" 2>&1; echo "rc=$?"
  grep -c "^PASS" "$OUT/armed_check.txt"; grep -E "^FAIL|HANG|overall" "$OUT/armed_check.txt" | head
  el "== outside device_check"
  timeout 150 python3 tests/gpu/outside/device_check.py > "$OUT/device_check.txt" 2>&1; echo "rc=$?"
  grep -c "^PASS" "$OUT/device_check.txt"; grep -E "^FAIL|HANG|overall" "$OUT/device_check.txt" | head
  el done
fi
if [[ $steps == *" cluster "* ]]; then
  el "== cluster suite: $n daemons, NCCL + CUDA"
  cd tests/cluster && AMAXD_CLUSTER_COLLECTIVE=nccl AMAXD_CLUSTER_BACKEND=cuda AMAXD_CLUSTER_GPUS=$n \
    timeout ${CLUSTER_LIMIT:-500} python3 -m pytest -q -rs -p no:cacheprovider --durations=5 ${CLUSTER_FILES:-.} > "$OUT/cluster.txt" 2>&1
  echo "rc=$?"; grep -E "^FAILED|^ERROR" "$OUT/cluster.txt" | head; tail -12 "$OUT/cluster.txt"; cd "$root"; el done
fi
if [[ $steps == *" e2e "* ]]; then
  el "== tests/e2e on the CUDA backend: ${E2E_FILES:=test_previous.py test_packed.py test_shm.py test_named_wire.py}"
  (cd tests/e2e && CUDA_VISIBLE_DEVICES=0 AMAXD_BACKEND=cuda timeout ${E2E_LIMIT:-240} python3 -m pytest -q -rs \
    -p no:cacheprovider $E2E_FILES) > "$OUT/e2e.txt" 2>&1
  echo "rc=$?"; grep -E "^FAILED|^ERROR|^SKIPPED" "$OUT/e2e.txt" | head; tail -3 "$OUT/e2e.txt"; el done
fi
lat() { # tag args...
  local tag=$1; shift
  el "== trainer_latency $tag"
  timeout 300 python3 bench/trainer_latency.py --amaxd "$build/amaxd" --gpus $n --iters 30 --out "$OUT/lat-$tag.jsonl" "$@" > "$OUT/lat-$tag.txt" 2>&1
  echo "rc=$?"; grep -v "^$" "$OUT/lat-$tag.txt" | tail -12
}
if [[ $steps == *" lat "* ]]; then
  for r in ${LAT_RUNS:-1 2 3}; do
    lat "plain-$r" --sizes 1000,20000,100000+pc --paths inproc,grpc,shm,device,async,armed,armasync
  done
fi
if [[ $steps == *" mps "* ]]; then
  mps_on
  for r in ${LAT_RUNS:-1 2 3}; do
    lat "mps-$r" --sizes 1000,20000,100000+pc --paths inproc,device,async,armed,armasync
  done
  mps_off
fi
if [[ $steps == *" one "* ]]; then
  lat "one-daemon" --one-daemon --sizes 1000,20000,100000+pc --paths inproc,grpc,shm,device,armed
fi
if [[ $steps == *" cbench "* ]]; then
  for r in 1 2 3; do
    el "== cluster_bench $r"
    timeout 200 python3 bench/cluster_bench.py --amaxd "$build/amaxd" --floor "$build/nccl_floor" --daemons $n > "$OUT/cluster_bench.$r.txt" 2>&1
    echo "rc=$?"; tail -15 "$OUT/cluster_bench.$r.txt"
  done
fi
if [[ $steps == *" fused "* ]]; then
  el "== backend_compare, fused finish"
  timeout 200 "$build/backend_compare" tests/vectors/recipes.tsv "${AMAXD_COMPARE_N:-2000000}" > "$OUT/backend_compare.txt" 2>&1
  echo "rc=$?"; tail -4 "$OUT/backend_compare.txt"
  el "== backend_compare, two passes (AMAXD_FUSED_FINISH=0)"
  AMAXD_FUSED_FINISH=0 timeout 200 "$build/backend_compare" tests/vectors/recipes.tsv "${AMAXD_COMPARE_N:-2000000}" > "$OUT/backend_compare.unfused.txt" 2>&1
  echo "rc=$?"; tail -1 "$OUT/backend_compare.unfused.txt"
  el "== same-bytes GPU tests ($n GPUs)"
  AMAXD_BACKEND=cuda timeout 150 python3 -m pytest -q -s -p no:cacheprovider -k "same_bytes or packed" \
    tests/gpu/test_device.py tests/gpu/test_armed.py > "$OUT/same_bytes.txt" 2>&1
  echo "rc=$?"; tail -2 "$OUT/same_bytes.txt"
  for r in 1 2; do
    for f in 0 1; do
      el "== cluster_bench run $r, AMAXD_FUSED_FINISH=$f"
      AMAXD_FUSED_FINISH=$f timeout 150 python3 bench/cluster_bench.py --amaxd "$build/amaxd" --floor "$build/nccl_floor" \
        --daemons $n > "$OUT/cluster_bench.fused$f.$r.txt" 2>&1
      echo "rc=$?"; grep -E "amaxd reconcile|its finish|its all-reduce|^\(a\) " "$OUT/cluster_bench.fused$f.$r.txt"
    done
  done
fi
if [[ $steps == *" prof "* ]]; then
  mps_on
  lat "prof-armed-mps" --profile --profile-path armed --sizes 1000,100000+pc --paths inproc,armed
  mps_off
  el "== cluster_bench with AMAXD_PROFILE=1"
  AMAXD_PROFILE=1 timeout 150 python3 bench/cluster_bench.py --amaxd "$build/amaxd" --daemons $n \
    --epochs 5 --logs "$OUT/profile" > "$OUT/cluster_bench.profile.txt" 2>&1; echo "rc=$?"
  tail -12 "$OUT/cluster_bench.profile.txt"; grep -h "profile" "$OUT"/profile/amaxd*.log | tail -8
fi
el "end"
