#!/usr/bin/env bash
# The page codecs on one H200: the GPU tests, then the figures the codec is for.
#
#   tests           the GPU tests of the coded copy (host bytes equal to the CPU path's, loads
#                   decoding to its rows) and the tiny model's restores through each codec
#   families        every family's rows through int8 on the GPU, page sizes 1 and 16, both
#                   host layouts (the codec's decode exactly, the rest byte for byte)
#   transfer_*      `bench transfer --kv-codec C --target-mib 1024`: a 1 GiB logical copy of the
#                   dense and MLA pool sets (bf16) each way, coded against `none` in the same run,
#                   and host bytes per page
#   multiturn       `bench multiturn --configs device,host,host-coded` with a host tier of
#                   --host-bytes that the working set does not fit uncoded
#
# Run from the repository root:   OUT=/some/dir results/kv-codec/run_h200.sh
# Exit status: 0 when every step passed, else 1; every step is attempted.
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-results/kv-codec}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() {
    local name=$1
    shift
    echo "== $name: $*"
    "$@" >"$OUT/$name.log" 2>&1 || { echo "   $name failed (exit $?)"; status=1; }
    tail -n 3 "$OUT/$name.log"
}
step tests $PY -m pytest -q -p no:cacheprovider tests/transfer/test_kv_codec.py \
    tests/e2e/test_kv_codec_oracle.py
step families env KVTIER_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    tests/e2e/test_family_codec.py
for codec in fp8_e4m3 int8; do
    for family in dense mla; do
        step "transfer_${family}_$codec" $PY -m kvtier bench transfer --family "$family" \
            --kv-codec "$codec" --target-mib 1024 --json "$OUT/transfer_${family}_$codec.json"
    done
done
# Llama-8B-sized: 128 KiB of KV a token in bf16; 24 clients x 6 rounds of 512 shared + 4,096
# own + 256 new + 32 generated: 140,288 tokens of working set against a 16K-token device pool
# and 8 GiB of host (65,536 tokens uncoded, about 131K coded).
step multiturn $PY -m kvtier bench multiturn --model llama-8b --device cuda --clients 24 \
    --rounds 6 --concurrency 4 --system-tokens 512 --context-tokens 4096 --new-tokens 256 \
    --output-tokens 32 --device-tokens 16384 --host-bytes $((8 << 30)) \
    --configs device,host,host-coded --json "$OUT/multiturn_h200.json" \
    --plot "$OUT/multiturn_h200.svg"
exit $status
