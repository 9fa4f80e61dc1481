#!/usr/bin/env bash
# The main job on its embedded default: installs and builds, starts amaxd on
# a temporary Unix socket (CUDA state backend when a GPU is usable, host
# otherwise), runs a short demo job of 2 trainer ranks against it, prints the
# reconciled scales and the daemon status, then stops the daemon.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/deps.sh" build
venv=${AMAXD_VENV:-$root/.venv}
tmp=$(mktemp -d /tmp/amaxd-demo.XXXXXX)
sock=$tmp/amaxd.sock
"$root/build/amaxd" --socket="$sock" --backend=auto --log-file="$tmp/amaxd.log" &
pid=$!
cleanup() { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
"$venv/bin/python" -m amaxd.demo --socket "$sock"
echo
"$root/build/amaxctl" --socket "$sock" status
kill -TERM "$pid"
rc=0; wait "$pid" || rc=$?
trap - EXIT
[ "$rc" -eq 0 ] || echo "amaxd exited with $rc on SIGTERM (expected 0)" >&2
echo "amaxd stopped (exit $rc); its log:"; sed 's/^/  /' "$tmp/amaxd.log"
rm -rf "$tmp"
exit "$rc"
