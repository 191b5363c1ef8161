#!/usr/bin/env bash
# `bench multiturn` on one H200: does the tiered cache pay off end to end?
#
# Runs of the Llama-8B-sized dense model (bf16, random weights drawn on the GPU), each on the
# cache configurations it names against device memory alone, next to the bound from the
# prefill, extend, decode, link and storage rates measured in the same run:
#
#   multiturn_5x    24 clients x 8 rounds, 4 in flight: a 512-token shared system prompt and
#                   an 8,192-token context of each client's own, 256 new + 32 generated tokens
#                   per turn; working set 252,416 tokens, 5.1x the 49,152-token device pool;
#                   every configuration
#   multiturn_16k   the same with a 16,384-token context per client and 12 rounds: working set
#                   476,672 tokens, 4.85x the 98,304-token device pool; device and host
#   prepopulated    12 clients x 2 rounds of the 16K shape, ready turns first in first out (the
#                   first round runs first): device only against a file L3 an earlier engine
#                   filled, host and device empty
#   multiturn_fits  8 clients x 8 rounds of the 8K shape: working set 84,480 tokens in a
#                   98,304-token device pool; device, host, host+file
#
# Run from anywhere inside the repository:   OUT=/some/dir results/multiturn/run_h200.sh
# (RUNS="16k fits", say, runs those.)
# JSON, SVG and one log land in $OUT (default: this folder). The file L3 directories go under
# $L3_DIR (default: $TMPDIR or /tmp; up to ~33 GB at once, removed after each run), never
# under $OUT. The host pool of `host` holds the working set: ~33 GB of pinned memory.
# Exit status: 0 when every run passed its own checks (divergences from device-only within
# the log-probability tolerance, tokens per tier adding up), else 1; every run is attempted.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/multiturn}
PY=${PYTHON:-python3}
L3=${L3_DIR:-${TMPDIR:-/tmp}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/run_h200.log"
: >"$LOG"
status=0

bench() {
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$LOG" >&2
    local t0=$SECONDS
    # the JSON goes to --json; stdout (the same JSON) is dropped
    if ! $PY -m kvtier.bench.multiturn --model llama-8b --device cuda --storage-dir "$L3" \
        --json "$OUT/$name.json" --plot "$OUT/$name.svg" "$@" >/dev/null 2> >(tee -a "$LOG" >&2); then
        echo "== $name failed" | tee -a "$LOG" >&2
        status=1
    fi
    echo "== $name: $((SECONDS - t0)) s" | tee -a "$LOG" >&2
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
$PY -c "import torch; print('torch', torch.__version__, torch.version.cuda)" >>"$LOG" 2>&1

TURNS=(--workload multiturn --rounds 8 --concurrency 4 --system-tokens 512 --context-tokens 8192
    --new-tokens 256 --output-tokens 32)
LONG=(--workload multiturn --rounds 12 --concurrency 4 --system-tokens 512 --context-tokens 16384
    --new-tokens 256 --output-tokens 32)
RUNS=${RUNS:-5x 16k prepopulated fits}  # which of them (each is under 10 minutes)
[[ " $RUNS " == *" 5x "* ]] && bench multiturn_5x "${TURNS[@]}" --clients 24 --device-tokens 49152
[[ " $RUNS " == *" 16k "* ]] && bench multiturn_16k "${LONG[@]}" --clients 24 \
    --device-tokens 98304 --configs device,host
[[ " $RUNS " == *" prepopulated "* ]] && bench prepopulated "${LONG[@]}" --rounds 2 \
    --clients 12 --ready-policy fifo --device-tokens 98304 --configs device,file-prepopulated
[[ " $RUNS " == *" fits "* ]] && bench multiturn_fits "${TURNS[@]}" --clients 8 \
    --device-tokens 98304 --configs device,host,host+file
exit $status
