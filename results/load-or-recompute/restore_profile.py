"""Where a storage restore's time goes: one prompt's TTFT recomputed and restored from a file L3
(device and host empty), then one restore under cProfile (cumulative time, top entries).

    python results/load-or-recompute/restore_profile.py --model llama-8b --lengths 1024,4096
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import random
import sys
import tempfile
import time

from kvtier.bench.load_or_recompute import file_l3_config
from kvtier.bench.multiturn import MultiTurnConfig, build_bench_model
from kvtier.config import resolve_device
from kvtier.engine import LLM, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--top", type=int, default=45)
    a = ap.parse_args()
    dev = resolve_device(a.device)
    lengths = [int(x) for x in a.lengths.split(",")]
    n_max = max(lengths)
    net = build_bench_model(MultiTurnConfig(model=a.model, device=str(dev)), dev, n_max + 64)
    rng = random.Random(0)
    vocab = net.config.vocab_size
    prompts = {n: [rng.randrange(vocab) for _ in range(n)] for n in lengths}
    warm = [rng.randrange(vocab) for _ in range(64)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    pages = 2 * n_max // 16 + 64
    with tempfile.TemporaryDirectory() as tmp:
        base = file_l3_config(16, pages, str(dev), tmp)
        llm = LLM(net, base, max_running=1, max_prefill_tokens=n_max + 1)
        for p in [warm, *prompts.values()]:
            llm.generate([p], one)
        llm.cache.drain()
        rec = LLM(
            net,
            dataclasses.replace(base, enable_host=False, storage=None),
            max_running=1,
            max_prefill_tokens=n_max + 1,
        )
        rec.generate([warm], one)
        for n, p in prompts.items():
            for name, engine in (("recompute", rec), ("restore", llm)):
                for _ in range(3):
                    engine.cache.flush()
                    t = time.perf_counter()
                    o = engine.generate([p], one)[0]
                    wall = time.perf_counter() - t
                    print(
                        f"{n} {name}: ttft {o.ttft_s * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms, "
                        f"storage tokens {o.cached_storage}",
                        flush=True,
                    )
            print({k: v for k, v in llm.stats().items() if k.startswith("restore_")}, flush=True)
            llm.cache.flush()
            prof = cProfile.Profile()
            prof.enable()
            o = llm.generate([p], one)[0]
            prof.disable()
            print(f"{n} restore under cProfile: ttft {o.ttft_s * 1e3:.1f} ms")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(a.top)
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        llm.close()
        rec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
