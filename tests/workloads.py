"""A multi-turn chat workload for engine tests under pool pressure: conversations sharing a
system prompt, replayed turn by turn, and the cold outputs they must equal."""

from __future__ import annotations

import random
from dataclasses import dataclass

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
STEP_BUDGET = 4000


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    """Generate ``prompts`` together, failing the test instead of spinning past the budget."""
    ids = [llm.add_request(p, params) for p in prompts]
    done: dict = {}
    for _ in range(STEP_BUDGET):
        for out in llm.step():
            done[out.request_id] = out
        if len(done) == len(ids):
            llm.cache.check_integrity()
            return [done[i] for i in ids]
    raise AssertionError(
        f"{len(ids) - len(done)} of {len(ids)} requests unfinished after {STEP_BUDGET} steps "
        f"(waiting {len(llm.scheduler.waiting)}, running {len(llm.scheduler.running)})"
    )


def cold(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Greedy outputs with nothing cached (one engine, a pool that holds everything)."""
    pages = sum(len(p) + params.max_tokens for p in prompts) + 8
    llm = LLM(MODEL, CacheConfig(page_size=1, device_pages=pages, device="cpu", enable_host=False))
    return [o.output_ids for o in run(llm, prompts, params)]


@dataclass(frozen=True)
class Workload:
    page_size: int
    system: list[int]
    turns: list[list[list[int]]]
    """``turns[t][c]``: conversation ``c``'s user message at turn ``t``."""
    max_tokens: int

    def longest(self) -> int:
        per_conv = [
            len(self.system) + sum(len(t[c]) + self.max_tokens for t in self.turns)
            for c in range(len(self.turns[0]))
        ]
        return max(per_conv)


def replay(llm: LLM, w: Workload, upto: int, history: list[list[int]] | None = None):
    """Run turns ``[0, upto)`` of ``w``; returns every turn's prompts and outputs."""
    params = SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)
    convs = [list(w.system) for _ in w.turns[0]]
    record = []
    for t in range(upto):
        prompts = []
        for c, msg in enumerate(w.turns[t]):
            convs[c] += msg
            prompts.append(list(convs[c]))
        outs = run(llm, prompts, params)
        for c, o in enumerate(outs):
            convs[c] += o.output_ids
        record.append((prompts, [o.output_ids for o in outs]))
    return record


def chat_workload(ps: int, sys_len: int, convs: int, turns: int, mt: int, seed: int) -> Workload:
    rng = random.Random(seed)
    system = [rng.randrange(128) for _ in range(sys_len)]
    msgs = [
        [[rng.randrange(128) for _ in range(rng.randint(1, 40))] for _ in range(convs)]
        for _ in range(turns + 1)
    ]
    return Workload(ps, system, msgs, mt)
