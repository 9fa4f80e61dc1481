#!/usr/bin/env bash
# Makes CARRY_DIR for tests/gpu/run.sh: the shared libraries the binaries need
# (gRPC, protobuf-c, libuv, ...; not libc, libstdc++, the CUDA driver or NCCL)
# and wheels of the Python packages a GPU host image usually lacks.
#   tests/gpu/bundle.sh BUILD_DIR CARRY_DIR [PYTHON_VERSION]
set -euo pipefail
build=${1:?build dir}; carry=${2:?carry dir}; pyver=${3:-3.12}
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${AMAXD_VENV:-$root/.venv}
mkdir -p "$carry/lib" "$carry/wheels"
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so|libcuda\.so|libnccl\.so|libnvidia)'
for bin in "$build"/amaxd "$build"/amaxctl "$build"/backend_compare "$build"/bench_kernels \
           "$build"/nccl_floor "$build"/calib_compare "$build"/tests/test_*; do
  [ -e "$bin" ] || continue
  ldd "$bin" | awk '/=>/ && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    [[ $name =~ $skip ]] && continue
    [ -e "$carry/lib/$name" ] || cp -L "$path" "$carry/lib/$name"
  done
done
pyv=$("$venv/bin/python" -c 'import google.protobuf as p; print(p.__version__)')
hcv=$("$venv/bin/python" -m pip show grpcio-health-checking | awk '/^Version/{print $2}')
"$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --platform manylinux2014_x86_64 -d "$carry/wheels" "protobuf==$pyv" ml_dtypes "grpcio-health-checking==$hcv" \
  safetensors prometheus_client h2 hpack hyperframe
"$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$carry/wheels" "$root/client/python"
rm -rf "$root/client/python/build" "$root"/client/python/*.egg-info
echo "bundle: $(ls "$carry/lib" | wc -l) libraries, $(ls "$carry/wheels" | wc -l) wheels, $(du -sh "$carry" | cut -f1)"
