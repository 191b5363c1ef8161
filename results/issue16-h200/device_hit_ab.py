"""Device-hit TTFT of a 32K prompt (16-token suffix) on the Llama-8B-sized model, with the
runner's pieces switched one at a time: where a regression of prefill-over-cache comes from."""

from __future__ import annotations

import random
import time

import torch

from kvtier.bench.decode_stall import release_pools as _release_pools
from kvtier.bench.ttft import _DeviceInitLM
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.engine import runner as runner_mod

cfg = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position=33000,
    dtype="bfloat16",
)
with torch.device("cuda"):
    model = _DeviceInitLM(cfg)
model.fill_random(0)
rng = random.Random(0)
prompt = [rng.randrange(32000) for _ in range(32768)]
params = SamplingParams(max_tokens=1, ignore_eos=True)
orig = runner_mod._to_host


def measure(label: str, **kw) -> None:
    _release_pools()
    llm = LLM(
        model,
        CacheConfig(page_size=16, device_pages=2200, device="cuda", enable_host=False),
        max_prefill_tokens=33000,
        **kw,
    )
    llm.generate([prompt[:-16]], params)
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        out = llm.generate([prompt[:-16] + [rng.randrange(32000) for _ in range(16)]], params)[0]
        best = min(best, out.ttft_s)
        wall = time.perf_counter() - t0
    print(
        f"{label}: ttft {best * 1e3:.1f} ms (last wall {wall * 1e3:.1f}), cached {out.cached_device}",
        flush=True,
    )
    llm.close()


measure("current")
measure("no graphs", cuda_graphs=False)
runner_mod._to_host = lambda t: t.cpu()
measure("plain .cpu()")
measure("plain .cpu(), no graphs", cuda_graphs=False)
runner_mod._to_host = orig
measure("current again")
