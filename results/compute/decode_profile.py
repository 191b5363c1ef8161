"""Where a decode step of the Llama-8B-sized model goes on CUDA: wall time of whole steps and of
the model forward alone, and the top operators by device and host time (torch.profiler)."""

from __future__ import annotations

import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvtier.bench.decode_stall import release_pools as _release_pools
from kvtier.bench.ttft import _DeviceInitLM
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams


def main(batch: int = 32, context: int = 2048) -> None:
    dev = torch.device("cuda")
    cfg = ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=context + 64,
        dtype="bfloat16",
    )
    with dev:
        model = _DeviceInitLM(cfg)
    model.fill_random(0)
    _release_pools()
    pages = batch * (context // 16 + 4) + 8
    llm = LLM(
        model,
        CacheConfig(page_size=16, device_pages=pages, device="cuda", enable_host=False),
        max_running=batch,
        max_prefill_tokens=batch * context + 1,
    )
    rng = random.Random(0)
    for _ in range(batch):
        llm.add_request(
            [rng.randrange(32000) for _ in range(context - 2)],
            SamplingParams(max_tokens=40, ignore_eos=True),
        )
    llm.step()
    llm.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        llm.step()
    torch.cuda.synchronize()
    print(f"step {(time.perf_counter() - t0) / 5 * 1e3:.1f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            llm.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    llm.close()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
