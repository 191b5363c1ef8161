#!/usr/bin/env bash
# GPU checks: the tier and oracle tests with L1 on CUDA, the transfer benchmark and the demo.
# Run from the repository root on a CUDA machine whose python3 has torch. JSON results are
# written to $OUT/json and bundled into $OUT/gpu_results.tgz (one file to bring back).
#   SWEEP=1    every family's pool set and the single GQA pool (both host layouts) at page
#              sizes 1, 16 and 64 (PAGE_SIZES), about 1 GiB per copy, host pages churned or
#              random (HOST_PAGES, default churned) (default: families at page size 16);
#              FAMILY_LAYOUT picks the families' host layout, SINGLE_LAYOUTS the single pool's
#   STAGING=1  staging-memory sweep (16, 64, 256 MiB) for the staged families
#   TTFT=1     time to first token of a 32K-token prompt on a Llama-8B-sized model
#   COMPUTE=1  that model's cold 32K prefill and 32-request decode step against the device's
#              matmul rate and copy rate
#   DEMOS=0    skip every family's demo on CUDA
#   TESTS=0    skip the CUDA tests
#   CP=0       skip the context-parallel tests (CP oracle, parallel/, CP engine) on CUDA
set -uo pipefail
OUT=${OUT:-gpu-results}
J="$OUT/json"
mkdir -p "$J"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
if [ "${TESTS:-1}" = 1 ]; then
  KVTIER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -W ignore \
      tests/cache/test_cache_tiers.py tests/cache/test_cache_storage_faults.py \
      tests/cache/test_layer_backup.py tests/cache/test_buffer_only.py tests/pools/test_pool_sets.py \
      tests/controller/test_controller.py tests/transfer/test_transfer.py tests/transfer/test_overlap.py \
      tests/transfer/test_pacer.py tests/transfer/test_translator.py tests/transfer/test_transfer_exchange.py \
      tests/transfer/test_arena_transfer.py tests/transfer/test_host_arena_transfer.py \
      tests/transfer/test_staged_blocks.py tests/controller/test_host_leases.py \
      tests/cache/test_window_load_back.py tests/cache/test_buffer_only_bytes.py \
      tests/transfer/test_row_kernel_variants.py tests/engine/test_engine_attention.py \
      tests/engine/test_decode_kernel.py tests/engine/test_decode_graphs.py tests/engine/test_runner_logits.py \
      tests/engine/test_family_mla.py tests/engine/test_family_hybrid_swa.py tests/engine/test_spec_decode.py \
      tests/e2e/test_oracle.py tests/e2e/test_family_oracle.py \
      2>&1 | tail -3
fi
if [ "${CP:-1}" = 1 ]; then
  # Context parallelism with L1 on CUDA: gloo ranks share the GPU, so copies complete
  # asynchronously for real and ranks see them at different times.
  KVTIER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -W ignore -rs \
      tests/e2e/test_cp_oracle.py tests/e2e/test_cp_spec_oracle.py tests/parallel/ \
      tests/engine/test_cp_engine.py tests/engine/test_cp_spec_decode.py \
      2>&1 | tee "$OUT/cp_tests.log" | tail -3
fi

summary() {  # one line per configuration of a bench transfer JSON file
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for name, run in (r["families"].items() if "families" in r else [(sys.argv[1].rsplit("/", 1)[-1], r)]):
    print(f"{name:30s} page {run['sizes']['page_size']:3d}", *(
        "%s %.1f GB/s (%.2f) %s" % (d, run[d]["gbps"], run[d]["ratio"], run[d]["paths"])
        for d in ("d2h", "h2d", "both", "both_whole") if run.get(d)))
PY
}

if [ "${SWEEP:-0}" = 1 ]; then
  HP=${HOST_PAGES:-churned}
  for ps in ${PAGE_SIZES:-1 16 64}; do
    FL=${FAMILY_LAYOUT:-page_first}
    python3 -m kvtier.cli bench transfer --family all --page-size "$ps" --target-mib 1024 \
        --host-pages "$HP" --host-layout "$FL" --json "$J/transfer_families_${FL}_${HP}_ps$ps.json" \
        > /dev/null 2>&1
    summary "$J/transfer_families_${FL}_${HP}_ps$ps.json"
    for layout in ${SINGLE_LAYOUTS:-page_first layer_first}; do
      python3 -m kvtier.cli bench transfer --page-size "$ps" --host-layout "$layout" \
          --host-pages "$HP" --target-mib 1024 --json "$J/transfer_${layout}_${HP}_ps$ps.json" \
          > /dev/null 2>&1
      summary "$J/transfer_${layout}_${HP}_ps$ps.json"
    done
  done
else
  python3 -m kvtier.cli bench transfer --family all --json "$J/transfer_families.json" > /dev/null 2>&1
  summary "$J/transfer_families.json"
fi
if [ "${STAGING:-0}" = 1 ]; then
  for mib in 16 64 256; do
    for fam in mla dsa dense; do
      python3 -m kvtier.cli bench transfer --family "$fam" --staging-mib "$mib" --target-mib 1024 \
          --json "$J/staging_${fam}_${mib}.json" > /dev/null 2>&1
      echo -n "staging $mib MiB: "; summary "$J/staging_${fam}_${mib}.json"
    done
  done
fi
if [ "${DEMOS:-1}" = 1 ]; then
  for model in tiny mla dsa dsa-compressed hybrid swa; do
    python3 -m kvtier.cli demo --model "$model" --storage-dir "/tmp/kvtier-demo-$model" --json \
        > "$J/demo_cuda_$model.json" 2>/dev/null
    python3 -c "import json; d=json.load(open('$J/demo_cuda_$model.json')); print('demo $model', d['tiers'], d['oracle'])"
  done
fi
if [ "${TTFT:-0}" = 1 ]; then
  python3 -m kvtier.cli bench ttft --json "$J/ttft.json" 2>&1 | grep "bench ttft"
fi
if [ "${COMPUTE:-0}" = 1 ]; then
  python3 -m kvtier.cli bench compute --json "$J/compute.json" 2>&1 | grep "bench compute"
fi
tar -C "$OUT" -czf "$OUT/gpu_results.tgz" json && rm -rf "$J"
exit 0
