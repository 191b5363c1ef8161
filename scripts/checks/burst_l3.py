"""How much of what L3 holds a fresh engine uses when stored prompts arrive all at once (a
burst) or in waves of 8, with a host tier far smaller than the working set.

    .venv/bin/python scripts/checks/burst_l3.py   # prints JSON: available, burst, waves_of_8
"""

from __future__ import annotations

import json
import random
import tempfile

from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams

MODEL = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position=1024,
)
PAGE = 16


def main() -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(128) for _ in range(rng.randint(100, 300))] for _ in range(64)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    base = dict(
        page_size=PAGE,
        device_pages=128,
        device="cpu",
        storage="file",
        storage_dir=tempfile.mkdtemp(prefix="kvtier-burst-"),
        prefetch_policy="wait_complete",
    )
    live = LLM(MODEL, CacheConfig(**base, host_pages=4096))
    live.generate(prompts, params)
    live.close()

    def used(wave: int) -> int:
        llm = LLM(MODEL, CacheConfig(**base, host_pages=64), max_running=8)
        outs = []
        for i in range(0, len(prompts), wave):
            outs += llm.generate(prompts[i : i + wave], params)
        llm.close()
        return sum(o.cached_storage for o in outs)

    available = sum((len(p) - 1) // PAGE * PAGE for p in prompts)
    print(json.dumps({"available_l3_tokens": available, "burst": used(64), "waves_of_8": used(8)}))


if __name__ == "__main__":
    main()
