"""Per-layer backups against backups at insert (``CacheConfig.backup_timing``), in one run.

The same workload runs twice through ``LLM`` on the same model, once per timing, interleaved
A/B ``repeats`` times: ``batch`` requests with ``prompt_tokens``-token prompts decode
``output_tokens`` tokens each. Measured per timing:

* the decode step (steps without a prefill), median wall time: what the copies cost the model;
* the prefill step, median wall time;
* time to host: from a request's end (its output returned by ``step``) until the cache counts
  all its pages as backed up (``host_backup_pages`` in ``stats()``, polled every 0.2 ms):
  how long a finished request's KV is exposed to device eviction without a host copy.

The result holds both sides and the ratio ``per_layer / at_insert`` of each figure.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from kvtier.config import CacheConfig

TIMINGS = ("at_insert", "per_layer")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _run_once(llm: Any, prompts: list[list[int]], output_tokens: int) -> dict[str, Any]:
    from kvtier.engine import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    llm.cache.flush()
    llm.cache.drain()
    base = llm.stats().get("host_backup_pages", 0)
    page = llm.cache.tree_page_tokens
    for p in prompts:
        llm.add_request(p, params)
    decode: list[float] = []
    prefill: list[float] = []
    to_host: list[float] = []
    expected = base
    while llm.has_unfinished():
        _sync()
        t0 = time.perf_counter()
        prefilling = bool(llm.scheduler.waiting)
        outs = llm.step()
        _sync()
        dt = time.perf_counter() - t0
        (prefill if prefilling else decode).append(dt)
        for out in outs:
            expected += (len(out.prompt) + len(out.output_ids) - 1) // page
            t_end = time.perf_counter()
            while llm.stats().get("host_backup_pages", 0) < expected:
                llm.cache.poll()
                if time.perf_counter() - t_end > 10:
                    raise RuntimeError("pages never reached the host")
                time.sleep(0.0002)
            to_host.append(time.perf_counter() - t_end)
    return {"decode": decode, "prefill": prefill, "to_host": to_host}


def run(
    model: str = "small",
    batch: int = 8,
    prompt_tokens: int = 2048,
    output_tokens: int = 64,
    page_size: int = 16,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Both timings on one model; see the module docstring."""
    from kvtier.engine import LLM
    from kvtier.engine.families import build_model, preset

    net = build_model(preset(model))
    pages = batch * (prompt_tokens + output_tokens) // page_size + 64
    base = CacheConfig(page_size=page_size, device_pages=pages, host_ratio=2.0)
    rng = random.Random(seed)
    vocab = net.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_tokens)] for _ in range(batch)]
    llms = {t: LLM(net, replace(base, backup_timing=t), max_running=batch) for t in TIMINGS}
    samples: dict[str, dict[str, list[float]]] = {
        t: {"decode": [], "prefill": [], "to_host": []} for t in TIMINGS
    }
    _run_once(llms["at_insert"], prompts[:1], 2)  # warm-up (kernels, allocator)
    _run_once(llms["per_layer"], prompts[:1], 2)
    for r in range(repeats):
        for t in TIMINGS if r % 2 == 0 else TIMINGS[::-1]:
            got = _run_once(llms[t], prompts, output_tokens)
            for k, v in got.items():
                samples[t][k] += v
        print(f"backup timing: {r + 1}/{repeats}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "model": model,
        "device": str(llms["at_insert"].cache.kv_buffers.device),
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "page_size": page_size,
        "repeats": repeats,
    }
    for t in TIMINGS:
        s = samples[t]
        out[t] = {
            "decode_step_ms_p50": statistics.median(s["decode"]) * 1e3,
            "prefill_step_ms_p50": statistics.median(s["prefill"]) * 1e3,
            "to_host_ms_p50": statistics.median(s["to_host"]) * 1e3,
            "to_host_ms_max": max(s["to_host"]) * 1e3,
            "decode_steps": len(s["decode"]),
        }
    a, b = out["at_insert"], out["per_layer"]
    out["ratio_per_layer_to_at_insert"] = {
        k: (b[k] / a[k] if a[k] else None) for k in a if k.endswith(("p50", "max"))
    }
    for llm in llms.values():
        llm.close()
    return out
