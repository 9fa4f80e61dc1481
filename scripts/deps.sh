#!/usr/bin/env bash
# Installs what amaxd needs on Debian 12 and builds it. Idempotent: packages
# already present are not reinstalled, the venv is reused.
#   scripts/deps.sh [BUILD_DIR [extra cmake args...]]
# Environment: AMAXD_VENV (default .venv), AMAXD_CUDA=ON to build the CUDA backend.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

pkgs=(build-essential cmake pkg-config git
      libgrpc-dev libabsl-dev protobuf-compiler-grpc libprotobuf-c-dev protobuf-c-compiler
      libuv1-dev check libinih-dev libcjson-dev libgloo-dev libssl-dev clang
      libsystemd-dev systemd libmicrohttpd-dev libcairo2
      python3 python3-venv python3-pip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

venv=${AMAXD_VENV:-$root/.venv}
if [ ! -x "$venv/bin/python" ]; then
  echo "deps: creating $venv"
  python3 -m venv "$venv"
fi
stamp="$venv/.amaxd-requirements"
if ! cmp -s tests/requirements.txt "$stamp"; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r tests/requirements.txt
  cp tests/requirements.txt "$stamp"
fi
# The client package (its protobuf module is generated at build time).
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps --force-reinstall ./client/python >/dev/null
rm -rf client/python/build client/python/*.egg-info

build=${1:-build}; shift || true
cmake -S . -B "$build" -DAMAXD_PYTHON="$venv/bin/python" -DAMAXD_CUDA="${AMAXD_CUDA:-OFF}" "$@" >/dev/null
cmake --build "$build" -j"$(nproc)" >/dev/null
echo "deps: built $build"
