#!/bin/sh
# Runs a CTest command only where what it needs is here; otherwise prints
# why and exits 77, which tests/CMakeLists.txt declares as the tests'
# SKIP_RETURN_CODE (CTest then reports the test as skipped, not failed).
#
#   tests/skip_unless.sh gpu -- CMD [ARG...]
#       CMD runs when `nvidia-smi -L` lists a GPU.
#   tests/skip_unless.sh modelopt VENV -- ARG...
#       `VENV/bin/python ARG...` runs when that venv exists (AMAXD_MODELOPT_VENV,
#       when set, names another one, as for scripts/modelopt-venv.sh) and
#       AMAXD_SKIP_MODELOPT is not 1.
set -u
skip() {
    echo "SKIPPED: $*"
    exit 77
}
what=${1:?gpu or modelopt}
shift
case "$what" in
gpu)
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        skip "no usable GPU: nvidia-smi is not installed (tests/gpu/run.sh runs this on a GPU host)"
    fi
    gpus=$(nvidia-smi -L 2>&1)
    if [ $? -ne 0 ] || ! printf '%s\n' "$gpus" | grep -q '^GPU [0-9]'; then
        skip "no usable GPU: nvidia-smi -L says: $(printf '%s' "$gpus" | head -n 1)"
    fi
    ;;
modelopt)
    venv=${AMAXD_MODELOPT_VENV:-${1:?venv}}
    shift
    if [ "${AMAXD_SKIP_MODELOPT:-0}" = 1 ]; then
        skip "the tiers of the ModelOpt venv are turned off (AMAXD_SKIP_MODELOPT=1)"
    fi
    if [ ! -x "$venv/bin/python" ]; then
        skip "no ModelOpt venv at $venv (make it with scripts/modelopt-venv.sh; about 7 GB)"
    fi
    ;;
*)
    echo "skip_unless.sh: unknown requirement '$what' (gpu or modelopt)" >&2
    exit 2
    ;;
esac
[ "${1:-}" = "--" ] && shift
if [ "$what" = modelopt ]; then
    exec "$venv/bin/python" "$@"
fi
exec "$@"
