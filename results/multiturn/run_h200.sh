#!/usr/bin/env bash
# `bench multiturn` on one H200: does the tiered cache pay off end to end?
#
# Three runs of the Llama-8B-sized dense model (bf16, random weights drawn on the GPU), each
# on every cache configuration against device memory alone, next to the bound from the
# prefill, decode, link and storage rates measured in the same run:
#
#   multiturn_4x    54 clients x 8 rounds, 8 in flight: an 8192-token shared system prompt,
#                   256 new + 32 generated tokens per turn; working set 132,608 tokens,
#                   4.05x the 32,768-token device pool (4 GiB of KV)
#   multiturn_fits  the same workload with a 147,456-token device pool: it all fits
#   longdoc         16 documents of 10,000 tokens x 3 questions of 64 tokens (the first
#                   round warms up, the other two are shuffled), 16 generated, 4 in flight;
#                   working set 163,840 tokens, 4x the 40,960-token device pool
#
# Each run should take under ~3 minutes. Run from anywhere inside the repository:
#   OUT=/some/dir results/multiturn/run_h200.sh
# JSON, SVG and one log land in $OUT (default: this folder). The file L3 directories go under
# $L3_DIR (default: $TMPDIR or /tmp; up to ~21 GiB at once, removed after each run), never
# under $OUT. The host pool of `host` holds the working set: up to ~21 GiB of pinned memory.
# Exit status: 0 when every run passed its own checks (outputs equal to device-only's, tokens
# per tier adding up), else 1; every run is attempted.
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

TURNS=(--workload multiturn --clients 54 --rounds 8 --concurrency 8 --system-tokens 8192
    --new-tokens 256 --output-tokens 32)
bench multiturn_4x "${TURNS[@]}" --device-tokens 32768
bench multiturn_fits "${TURNS[@]}" --device-tokens 147456 --configs device,host,host+file
bench longdoc --workload longdoc --documents 16 --document-tokens 10000 --question-tokens 64 \
    --rounds 3 --output-tokens 16 --concurrency 4 --device-tokens 40960
exit $status
