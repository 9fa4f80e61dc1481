# Sourced by the tests/gpu/*.sh scripts (never run alone): their common
# start. Arguments BUILD_DIR CARRY_DIR [OUT_DIR]; sets rc=0, build, carry,
# out (made), root (the repository, also the working directory) and the
# environment every GPU run needs (NVLink multicast off, the carried
# runtime libraries, unbuffered Python).
set -uo pipefail
rc=0
build=$(realpath "${1:-build-gpu}")
carry=$(realpath "${2:-.gpu}")
out=${3:-${OUT:-/tmp/amaxd-gpu-out}}
mkdir -p "$out"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="$carry/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1
