"""Time to the first request with a large host tier, after the weights are on the device.

The Llama-8B-sized model (bf16, random weights drawn on the GPU) is built first; then, timed:
the engine with a ``--host-gb`` host tier (``CacheConfig.host_bytes``) and a device pool of
``--device-tokens`` is constructed, and one request of ``--prompt-tokens`` tokens runs to its
first token. Prints JSON: seconds to construct, to the first token (from the start of the
construction), the host pages ready then, a second request's TTFT (a prompt of its own: the
engine's one-time set-up is paid by the first), and the seconds the background pinning took in
all (waited for after the requests). ``--pace`` sets how long the pinning thread leaves the
driver alone after each chunk (``kvtier.pools.pinning.DEFAULT_PACE``).

    python results/startup/first_request.py --host-gb 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kvtier.bench.multiturn import MultiTurnConfig, build_bench_model
from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.pools import pinning


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host-gb", type=float, default=100.0, help="host tier, GB (1e9 bytes)")
    ap.add_argument("--device-tokens", type=int, default=65536, help="device pool, tokens")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="the first request's prompt")
    ap.add_argument("--pace", type=float, default=pinning.DEFAULT_PACE, help="pinning pace")
    a = ap.parse_args()
    pinning.DEFAULT_PACE = a.pace
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    model = build_bench_model(MultiTurnConfig(model="llama-8b", device="cuda"), dev, 4096)
    torch.cuda.synchronize()
    weights_s = time.perf_counter() - t0
    print(f"weights on the device in {weights_s:.1f} s", file=sys.stderr)
    cache = CacheConfig(
        page_size=16,
        device_pages=a.device_tokens // 16,
        host_bytes=int(a.host_gb * 1e9),
        device="cuda",
    )
    t0 = time.perf_counter()
    llm = LLM(model, cache, max_running=4)
    built_s = time.perf_counter() - t0
    out = llm.generate([list(range(1, a.prompt_tokens + 1))], SamplingParams(max_tokens=1))[0]
    first_s = time.perf_counter() - t0
    stats = llm.stats()
    ready_then = stats.get("host_pages_ready")
    second = [a.prompt_tokens + 1 + i for i in range(a.prompt_tokens)]
    out2 = llm.generate([second], SamplingParams(max_tokens=1))[0]
    ready_second = llm.stats().get("host_pages_ready")
    pinner = llm.cache.host_pool.pinner
    if pinner is not None:
        pinner.wait()
    stats = llm.stats()
    result = {
        "host_gb": a.host_gb,
        "host_pages_total": stats.get("host_pages_total"),
        "host_bytes_total": stats.get("host_bytes_total"),
        "weights_on_device_s": weights_s,
        "engine_constructed_s": built_s,
        "first_token_s": first_s,
        "first_request_ttft_s": out.ttft_s,
        "host_pages_ready_at_first_token": ready_then,
        "second_request_ttft_s": out2.ttft_s,
        "host_pages_ready_after_second": ready_second,
        "pace": a.pace,
        "host_pin_seconds": stats.get("host_pin_seconds"),
        "host_pages_ready_at_end": stats.get("host_pages_ready"),
    }
    llm.close()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
