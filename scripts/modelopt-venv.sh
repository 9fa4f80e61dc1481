#!/usr/bin/env bash
# Makes the venv of the ModelOpt test tier (torch + nvidia-modelopt from PyPI,
# tests/requirements-modelopt.txt) and installs the amaxd client into it.
# Idempotent: an existing venv whose requirements have not changed is kept.
# The client's protobuf module is generated at install time, so run
# scripts/deps.sh first (it installs grpcio-tools into the main venv; this
# venv has its own).
#   scripts/modelopt-venv.sh          prints the venv's python on its last line
# Environment: AMAXD_MODELOPT_VENV (default .venv-modelopt).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${AMAXD_MODELOPT_VENV:-$root/.venv-modelopt}
req=tests/requirements-modelopt.txt
if [ ! -x "$venv/bin/python" ]; then
  echo "modelopt-venv: creating $venv" >&2
  python3 -m venv "$venv"
fi
stamp="$venv/.amaxd-requirements"
if ! cmp -s "$req" "$stamp"; then
  start=$(date +%s)
  echo "modelopt-venv: installing $req (torch and its CUDA libraries: a few GB)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q --progress-bar off -r "$req" >&2
  cp "$req" "$stamp"
  echo "modelopt-venv: installed in $(( $(date +%s) - start )) s" >&2
fi
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps --force-reinstall ./client/python >/dev/null
rm -rf client/python/build client/python/*.egg-info
echo "$venv/bin/python"
