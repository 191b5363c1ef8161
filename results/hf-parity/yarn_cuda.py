"""A YaRN dense model on CUDA (float32 and bfloat16, with CUDA graphs) against the same weights
run eagerly in float32 on the CPU: how many greedy tokens agree before the first difference,
for a prompt past the pretraining context (where YaRN's interpolated dims matter) and two
shorter ones, each generated twice so the second run is a cache hit (it must give the same
tokens as the first). The same weights with plain RoPE are the control for bfloat16's own drift.

    python3 results/hf-parity/yarn_cuda.py
"""

from __future__ import annotations

import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, CausalLM, ModelConfig, SamplingParams
from kvtier.engine.common import yarn_attention_factor


def run(model: CausalLM, device: str, prompts: list[list[int]], graphs: bool) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    cfg = CacheConfig(device=device, page_size=16, device_pages=512)
    with LLM(model, cfg, cuda_graphs=graphs) as llm:
        first = [o.output_ids for o in llm.generate(prompts, greedy)]
        again = [o.output_ids for o in llm.generate(prompts, greedy)]  # served from cache
        assert first == again, "a cache hit changed the tokens"
        return first


def main() -> None:
    base = dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        max_position=8192,
        rope_theta=1e6,
        rope_type="yarn",
        rope_factor=4.0,
        rope_original_max_position=512,
        rope_attention_factor=yarn_attention_factor(4.0),
        seed=3,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (1500, 700, 33)]
    # the control: the same weights with plain RoPE, to tell bf16's own drift from YaRN's
    plain = {**base, "rope_type": "default", "rope_attention_factor": 1.0}
    for name, fields in (("yarn", base), ("plain RoPE", plain)):
        ref = run(CausalLM(ModelConfig(**fields, dtype="float32")), "cpu", prompts, graphs=False)
        for dtype in ("float32", "bfloat16"):
            got = run(CausalLM(ModelConfig(**fields, dtype=dtype)), "cuda", prompts, graphs=True)
            same = [
                next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), len(r))
                for g, r in zip(got, ref, strict=True)
            ]
            print(
                f"{name}, {dtype} on CUDA: tokens before the first difference from the float32 "
                f"CPU run, per prompt (1500, 700, 33 tokens): {same} of 24"
            )


if __name__ == "__main__":
    main()
