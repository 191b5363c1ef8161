"""Greedy tokens and logit drift of the page codecs on checkpoints transformers saves, on CPU.

For Llama and Qwen2 (``LlamaConfig``/``Qwen2Config`` models built by transformers, every
parameter set to an order-one random value as ``tests/engine/test_hf_parity.py`` does, since
transformers' own init leaves logits nearly flat, then written by ``save_pretrained``) and the
dtypes float32 and bfloat16: kvtier loads the checkpoint, computes a shared context once, and
serves requests that reuse a prefix of it after a host restore (the device tier emptied
before each), greedy, ``--steps`` tokens each. Each codec's run is compared with the ``none``
run, request by request: steps equal = the outputs' common prefix (a step after the first
difference counts as unequal, whatever follows); |Δlogit| over the steps of that prefix; how
many first differences chose a token whose logit in the ``none`` run equals the maximum (an
exact tie there, common in bfloat16: 8 bits of mantissa); and teacher-forced, each step's
token after the ``none`` run's earlier tokens (``forced``), which a single early difference
does not spoil for the rest of the request.

Usage: python results/kv-codec/measure_hf.py [--steps 32] [--requests 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams

CODECS = ("fp8_e4m3", "int8")
SHAPES = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
CASES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}
CONTEXT = 768


@torch.no_grad()
def save(case: str, dtype: torch.dtype, directory: Path) -> None:
    cfg = getattr(transformers, CASES[case])(**SHAPES)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    gen = torch.Generator().manual_seed(len(case))
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith("bias"):
            p.copy_(0.3 * noise)
        elif "embed_tokens" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)
    model.to(dtype).save_pretrained(directory)


def serve(directory: Path, codec: str, requests: list[list[int]], context: list[int], steps: int):
    cfg = CacheConfig(page_size=16, device_pages=256, host_pages=512, device="cpu", kv_codec=codec)
    params = SamplingParams(max_tokens=steps, ignore_eos=True, return_logits=True)
    llm = LLM(str(directory), cfg, max_running=1, max_prefill_tokens=4096)
    try:
        llm.generate([context], SamplingParams(max_tokens=1, ignore_eos=True))
        outs = []
        for p in requests:
            llm.cache.flush(host=False)  # device empty: the prefix comes back from the host tier
            out = llm.generate([p], params)[0]
            assert out.cached_host > 0, "no host restore"
            outs.append(out)
        llm.check_integrity()
    finally:
        llm.close()
    return outs


def forced(
    directory: Path, codec: str, requests: list[list[int]], context: list[int], ref: list[Any]
) -> tuple[int, int]:
    """Teacher-forced: for every request and step ``t``, the codec's greedy token after the
    request and the ``none`` run's first ``t`` tokens (its prefix restored from the host tier,
    device emptied first) against the ``none`` run's token ``t``: (equal, steps)."""
    cfg = CacheConfig(page_size=16, device_pages=256, host_pages=512, device="cpu", kv_codec=codec)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm = LLM(str(directory), cfg, max_running=1, max_prefill_tokens=4096)
    equal = total = 0
    try:
        llm.generate([context], one)
        for p, r in zip(requests, ref, strict=True):
            want = list(r.output_ids)
            for t in range(len(want)):
                llm.cache.flush(host=False)
                got = llm.generate([p + want[:t]], one)[0].output_ids[0]
                equal, total = equal + (got == want[t]), total + 1
    finally:
        llm.close()
    return equal, total


def compare(outs: list[Any], ref: list[Any]) -> dict[str, Any]:
    equal = total = 0
    mx, acc, n = 0.0, 0.0, 0
    firsts = []
    ties = 0
    for o, r in zip(outs, ref, strict=True):
        a, b = list(o.output_ids), list(r.output_ids)
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(b))
        firsts.append(k)
        if k < len(b):  # the reference's own logits there: was the codec's token a tie?
            row = r.logits[k].float()
            ties += bool(row[a[k]] == row.max())
        equal, total = equal + k, total + len(b)
        if k:
            d = (o.logits[:k].float() - r.logits[:k].float()).abs()
            mx, acc, n = max(mx, float(d.max())), acc + float(d.sum()), n + d.numel()
    return {
        "steps_equal": equal,
        "steps": total,
        "fraction_equal": equal / total,
        "first_difference_per_request": firsts,
        "first_differences_at_an_exact_tie": ties,
        "max_abs_dlogit": mx,
        "mean_abs_dlogit": acc / n if n else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--out", default=str(Path(__file__).with_name("measured_hf.json")))
    args = ap.parse_args()
    rng = random.Random(11)
    context = [rng.randrange(SHAPES["vocab_size"]) for _ in range(CONTEXT)]
    cuts = [CONTEXT * (i + 1) // (args.requests + 1) for i in range(args.requests)]
    requests = [context[:c] + [rng.randrange(SHAPES["vocab_size"]) for _ in range(8)] for c in cuts]
    rows = []
    for case in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            with tempfile.TemporaryDirectory() as d:
                save(case, dtype, Path(d))
                ref = serve(Path(d), "none", requests, context, args.steps)
                for codec in CODECS:
                    got = compare(serve(Path(d), codec, requests, context, args.steps), ref)
                    eq, n = forced(Path(d), codec, requests, context, ref)
                    got.update(forced_steps_equal=eq, forced_fraction_equal=eq / n)
                    row = {"checkpoint": case, "dtype": str(dtype).removeprefix("torch.")}
                    rows.append({**row, "codec": codec, **got})
                    print(
                        f"| {case} | {row['dtype']} | {codec} | {got['steps_equal']} / "
                        f"{got['steps']} ({got['fraction_equal']:.3f}) | "
                        f"{got['max_abs_dlogit']:.2e} | {got['mean_abs_dlogit']:.2e} | "
                        f"{got['first_differences_at_an_exact_tie']} of "
                        f"{sum(k < args.steps for k in got['first_difference_per_request'])} | "
                        f"{eq} / {n} ({eq / n:.3f}) |",
                        flush=True,
                    )
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
