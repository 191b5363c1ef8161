"""Logit cost of the page codecs (``CacheConfig.kv_codec``) for every model family, on CPU.

For each family and codec: greedy outputs after a host restore and after a storage restore (a
fresh engine over the storage the first one wrote) against a cold run with nothing cached
(which an exact restore matches within 1e-4, ``tests/e2e/test_family_oracle.py``), for prompts
cut at 30%, 60% and 95% of a 384-token context. Prints a table (tokens equal, max and mean
|Δlogit| over the steps up to the first differing token, host bytes per page against
``none``) and writes it as JSON next to this script.

Usage: python results/kv-codec/measure.py [--families tiny,mla,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset

FAMILIES = ("tiny", "mla", "dsa", "dsa-compressed", "hybrid", "swa", "tiny-mtp")
CODECS = ("fp8_e4m3", "int8")
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True)
CONTEXT = 384
CUTS = (0.3, 0.6, 0.95)


def make_llm(family: str, codec: str, storage_dir: str | None) -> LLM:
    cfg = CacheConfig(
        page_size=16,
        device_pages=96,
        device="cpu",
        storage="file" if storage_dir else None,
        storage_dir=storage_dir or "unused",
        prefetch_policy="wait_complete",
        kv_codec=codec,
    )
    return LLM(preset(family), cfg, max_running=1)


def prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(5)
    base = [rng.randrange(vocab) for _ in range(CONTEXT)]
    return base, [base[: int(f * CONTEXT)] + [7, int(f * 100) % vocab] for f in CUTS]


def diffs(outs, cold) -> tuple[bool, float, float]:
    """Tokens all equal; max and mean |Δlogit| over the steps up to the first differing token."""
    same, mx, total, n = True, 0.0, 0.0, 0
    for o, c in zip(outs, cold, strict=True):
        k = len(c.output_ids)
        if list(o.output_ids) != list(c.output_ids):
            same = False
            pairs = zip(o.output_ids, c.output_ids, strict=False)
            k = next(i + 1 for i, (a, b) in enumerate(pairs) if a != b)
        d = (o.logits[:k] - c.logits[:k]).abs()
        mx, total, n = max(mx, float(d.max())), total + float(d.sum()), n + d.numel()
    return same, mx, total / n


def measure(family: str) -> list[dict]:
    ref = make_llm(family, "none", None)
    base, ps = prompts(ref.model_config.vocab_size)
    cold = []
    for p in ps:
        ref.cache.flush()
        cold.append(ref.generate([p], GREEDY)[0])
    none_bytes = ref.cache.parts.host_pool.page_bytes
    ref.close()
    rows = []
    for codec in CODECS:
        with tempfile.TemporaryDirectory() as d:
            llm = make_llm(family, codec, d)
            llm.generate([base], GREEDY)
            if llm.cache.window:  # window rows are kept near a request's end: run each once
                llm.generate(ps, GREEDY)
            host = []
            for p in ps:
                llm.cache.flush(host=False)
                host.append(llm.generate([p], GREEDY)[0])
            assert sum(o.cached_host for o in host) > 0, (family, codec)
            page_bytes = llm.cache.parts.host_pool.page_bytes
            llm.close()
            fresh = make_llm(family, codec, d)
            storage = [fresh.generate([p], GREEDY)[0] for p in ps]
            assert sum(o.cached_storage for o in storage) > 0, (family, codec)
            fresh.close()
        for tier, outs in (("host", host), ("storage", storage)):
            same, mx, mean = diffs(outs, cold)
            rows.append(
                {
                    "family": family,
                    "codec": codec,
                    "restore": tier,
                    "tokens_equal": same,
                    "max_abs_dlogit": mx,
                    "mean_abs_dlogit": mean,
                    "host_page_bytes": page_bytes,
                    "host_page_bytes_none": none_bytes,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", default=str(Path(__file__).with_name("measured.json")))
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [r for f in args.families.split(",") for r in measure(f)]
    head = "| family | codec | restore | tokens equal | max abs dlogit | mean abs dlogit | host bytes/page (vs none) |"
    print(head)
    print("|" + "---|" * 7)
    for r in rows:
        ratio = r["host_page_bytes"] / r["host_page_bytes_none"]
        print(
            f"| {r['family']} | {r['codec']} | {r['restore']} | {r['tokens_equal']} | "
            f"{r['max_abs_dlogit']:.2e} | {r['mean_abs_dlogit']:.2e} | "
            f"{r['host_page_bytes']} / {r['host_page_bytes_none']} ({ratio:.3f}) |"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
