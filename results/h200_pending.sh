#!/usr/bin/env bash
# The H200 measurements still missing, in calls that each fit the device's 10-minute limit.
#
#   STEP=1   the page codecs: GPU tests, 1 GiB coded copies, multiturn with a coded host tier
#            (results/kv-codec/run_h200.sh)
#   STEP=2   multiturn: a pre-populated file L3's first round, and the working set that fits
#            (results/multiturn/run_h200.sh RUNS="prepopulated fits")
#   STEP=3   multiturn with 16K-token contexts (RUNS=16k)
#   STEP=4   the load-or-recompute grid at 0.2/1/5/10 GB/s (GRID=full: the default 6x6 grid)
#
# Run from the repository root on the device machine:   STEP=1 OUT=$OUT results/h200_pending.sh
# Each step's JSON and logs land under $OUT/<what>; the exit status is 1 when any part failed.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
case "${STEP:-1}" in
1)
    OUT="$OUT/kv-codec" PYTHON="$PY" results/kv-codec/run_h200.sh || status=1
    ;;
2)
    OUT="$OUT/multiturn" RUNS="prepopulated fits" PYTHON="$PY" results/multiturn/run_h200.sh \
        || status=1
    ;;
3)
    OUT="$OUT/multiturn" RUNS=16k PYTHON="$PY" results/multiturn/run_h200.sh || status=1
    ;;
4)
    mkdir -p "$OUT/load-or-recompute"
    rates=(--rates 0.2,1,5,10)
    [[ "${GRID:-}" == full ]] && rates=()
    $PY -m kvtier bench load-or-recompute "${rates[@]}" \
        --json "$OUT/load-or-recompute/grid.json" >"$OUT/load-or-recompute/grid.log" 2>&1 \
        || status=1
    ;;
*)
    echo "STEP must be 1, 2, 3 or 4" >&2
    exit 2
    ;;
esac
exit $status
