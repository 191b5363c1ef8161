"""Burst vs waves: L3 tokens used by a fresh engine when 64 stored prompts arrive at once."""
import random, tempfile, sys, json
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams
MODEL = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, max_position=1024)
d = tempfile.mkdtemp()
rng = random.Random(3)
prompts = [[rng.randrange(128) for _ in range(rng.randint(100, 300))] for _ in range(64)]
params = SamplingParams(max_tokens=4, ignore_eos=True)
base = dict(page_size=16, device_pages=128, device="cpu", storage="file", storage_dir=d, prefetch_policy="wait_complete", model_fingerprint="m")
try:
    base_cfg = CacheConfig(**base)
except Exception:
    base.pop("model_fingerprint"); base_cfg = CacheConfig(**base)
live = LLM(MODEL, CacheConfig(**base, host_pages=4096))
live.generate(prompts, params); live.close()
avail = sum((len(p) - 1) // 16 * 16 for p in prompts)
def run(waves):
    llm = LLM(MODEL, CacheConfig(**base, host_pages=64), max_running=8)
    outs = []
    for i in range(0, len(prompts), waves):
        outs += llm.generate(prompts[i:i + waves], params)
    llm.close()
    return sum(o.cached_storage for o in outs)
print(json.dumps({"available_l3_tokens": avail, "burst": run(64), "waves_of_8": run(8)}))
