#!/usr/bin/env bash
# GPU checks: the tier and oracle tests with L1 on CUDA, the transfer benchmark and the demo.
# Run from the repository root on a CUDA machine whose python3 has torch; results go to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
KVTIER_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
    tests/test_cache_tiers.py tests/test_cache_storage_faults.py tests/test_oracle.py \
    tests/test_pool_sets.py tests/test_family_oracle.py tests/test_transfer.py tests/test_overlap.py \
    2>&1 | tail -15
python3 -m kvtier.cli bench transfer --family all --json "$OUT/transfer_families.json" > /dev/null
python3 - "$OUT/transfer_families.json" <<'PY'
import json, sys
for name, r in json.load(open(sys.argv[1]))["families"].items():
    print(f"{name:15s} page {r['sizes']['page_size']:3d}",
          *("%s %.1f GB/s (ratio %.2f) %s" % (d, r[d]["gbps"], r[d]["ratio"], r[d]["paths"]) for d in ("d2h", "h2d", "both")))
PY
# Single-pool sweeps over layouts and page sizes: set SWEEP=1 (writes six more JSON files).
[ "${SWEEP:-0}" = 1 ] && for layout in page_first layer_first; do
  for ps in 1 16 64; do
    # About 1 GiB per batch at every page size (512 pages of 16 tokens).
    python3 -m kvtier.cli bench transfer --page-size "$ps" --host-layout "$layout" --num-pages $((8192 / ps)) \
        --json "$OUT/transfer_${layout}_ps${ps}.json" > /dev/null
    python3 - "$OUT/transfer_${layout}_ps${ps}.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[1].rsplit("/", 1)[-1],
      *("%s %.1f GB/s (ratio %.2f) %s" % (d, r[d]["gbps"], r[d]["ratio"], r[d]["paths"]) for d in ("d2h", "h2d", "both")))
PY
  done
done
# Every family's demo on CUDA: set DEMOS=0 to skip.
[ "${DEMOS:-1}" = 1 ] && for model in tiny mla dsa dsa-compressed hybrid swa; do
  python3 -m kvtier.cli demo --model "$model" --storage-dir "/tmp/kvtier-demo-$model" --json \
      > "/tmp/demo_cuda_$model.json" 2>/dev/null
  python3 -c "import json; d=json.load(open('/tmp/demo_cuda_$model.json')); print('demo $model', d['tiers'], d['oracle'])"
done
# Staging memory sweep for the staged families (device → host is the one below 0.9): STAGING=1.
[ "${STAGING:-0}" = 1 ] && for mib in 16 64 256; do for fam in mla dsa dense; do
  python3 -m kvtier.cli bench transfer --family "$fam" --staging-mib "$mib" 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin)
print('staging', $mib, 'MiB', '$fam', *('%s %.2f' % (d, r[d]['ratio']) for d in ('d2h', 'h2d', 'both')))"
done; done
# Time to first token of a 32K-token prompt on a Llama-8B-sized model: set TTFT=1.
[ "${TTFT:-0}" = 1 ] && python3 -m kvtier.cli bench ttft --json "$OUT/ttft.json" 2>&1 | grep "bench ttft"
exit 0
