from __future__ import annotations

import random
from pathlib import Path

import pytest
from factories import make_llm as _make_llm

from kvtier.engine import LLM, CausalLM, ModelConfig, SamplingParams, save_hf_checkpoint
from kvtier.errors import ConfigError, RequestError

MODEL = ModelConfig(num_layers=2, max_position=512)
PS = 4
GREEDY = SamplingParams(max_tokens=12)


def make_llm(model: object = MODEL, max_running: int = 16, **kw) -> LLM:
    base = dict(page_size=PS, device_pages=96, device="cpu", prefetch_policy="timeout")
    return _make_llm(model, max_running=max_running, **{**base, **kw})


def prompts(n: int, lo: int = 5, hi: int = 30, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_batched_equals_one_by_one() -> None:
    ps = prompts(6)
    together = make_llm().generate(ps, GREEDY)
    alone = [make_llm().generate([p], GREEDY)[0] for p in ps]
    assert [o.output_ids for o in together] == [o.output_ids for o in alone]
    for p, o in zip(ps, together, strict=True):
        assert o.prompt == p and len(o.output_ids) == 12 and o.finish_reason == "length"
        assert o.ttft_s is not None and o.ttft_s > 0
        assert o.recomputed == len(p) and o.cached_tokens == 0


def test_staggered_arrivals_match_one_by_one() -> None:
    ps = prompts(4, seed=1)
    llm = make_llm(max_running=2, max_prefill_tokens=16)
    ids, outs = [], {}
    for p in ps:
        ids.append(llm.add_request(p, GREEDY))
        for o in llm.step():
            outs[o.request_id] = o
    while llm.has_unfinished():
        outs.update((o.request_id, o) for o in llm.step())
    alone = [make_llm().generate([p], GREEDY)[0].output_ids for p in ps]
    assert [outs[i].output_ids for i in ids] == alone


def test_shared_prefix_skips_prefill_and_keeps_tokens() -> None:
    shared = prompts(1, 23, 23, seed=2)[0]
    a, b = shared + [1, 2, 3], shared + [9, 8, 7, 6, 5]
    cold = make_llm().generate([b], GREEDY)[0]
    llm = make_llm()
    llm.generate([a], GREEDY)
    warm = llm.generate([b], GREEDY)[0]
    assert warm.output_ids == cold.output_ids
    assert warm.cached_device == 20  # whole pages of the 23 shared tokens
    assert warm.recomputed == len(b) - 20
    again = llm.generate([b], GREEDY)[0]  # b itself is cached now, all but its last token
    assert again.output_ids == cold.output_ids
    assert again.cached_device == (len(b) - 1) // PS * PS


def test_host_restore_gives_identical_tokens() -> None:
    target = prompts(1, 30, 30, seed=3)[0]
    cold = make_llm().generate([target], GREEDY)[0]
    llm = make_llm(device_pages=24, max_running=1, host_ratio=4.0)
    llm.generate([target], GREEDY)
    llm.generate(prompts(4, 40, 40, seed=4), SamplingParams(max_tokens=4))
    warm = llm.generate([target], GREEDY)[0]
    assert warm.cached_host > 0, warm
    assert warm.output_ids == cold.output_ids
    assert warm.recomputed == len(target) - warm.cached_tokens


def test_storage_restore_in_a_fresh_engine(tmp_path: Path) -> None:
    target = prompts(1, 30, 30, seed=5)[0]
    kw = dict(storage="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete")
    first = make_llm(**kw)
    cold = first.generate([target], GREEDY)[0]
    first.close()
    with make_llm(**kw) as fresh:
        warm = fresh.generate([target], GREEDY)[0]
    assert warm.cached_storage > 0, warm
    assert warm.output_ids == cold.output_ids
    other = make_llm(ModelConfig(num_layers=2, max_position=512, seed=1), **kw)
    assert other.generate([target], GREEDY)[0].cached_storage == 0  # model-specific keys


def test_preemption_under_page_pressure_keeps_tokens() -> None:
    ps = prompts(4, 10, 14, seed=6)
    long = SamplingParams(max_tokens=24)
    want = [o.output_ids for o in make_llm().generate(ps, long)]
    tight = make_llm(device_pages=24, enable_host=False)
    outs = tight.generate(ps, long)
    assert [o.output_ids for o in outs] == want
    assert sum(o.preemptions for o in outs) > 0


def test_sampling_is_reproducible_with_a_seed() -> None:
    ps = prompts(3, seed=7)
    params = [
        SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=s)
        for s in (1, 2, 3)
    ]
    first = [o.output_ids for o in make_llm().generate(ps, params)]
    second = [o.output_ids for o in make_llm().generate(ps, params)]
    assert first == second
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.95, seed=99)
    assert make_llm().generate([ps[0]], other_seed)[0].output_ids != first[0]
    greedy = make_llm().generate([ps[0]], SamplingParams(max_tokens=16))[0].output_ids
    assert greedy != first[0]


def test_stop_tokens_and_eos() -> None:
    p = prompts(1, seed=8)[0]
    free = make_llm().generate([p], SamplingParams(max_tokens=10))[0].output_ids
    stop = free[3]
    out = make_llm().generate([p], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.output_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"
    eos_model = ModelConfig(num_layers=2, max_position=512, eos_token_ids=(stop,))
    assert (
        make_llm(eos_model).generate([p], SamplingParams(max_tokens=10))[0].output_ids
        == out.output_ids
    )
    ignore = SamplingParams(max_tokens=10, ignore_eos=True)
    assert make_llm(eos_model).generate([p], ignore)[0].output_ids == free


def test_request_validation() -> None:
    llm = make_llm()
    with pytest.raises(RequestError, match="empty prompt"):
        llm.add_request([])
    with pytest.raises(RequestError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        llm.add_request([1, 512])
    with pytest.raises(RequestError, match="token id -1"):
        llm.add_request([-1])
    with pytest.raises(RequestError, match="max_position=512"):
        llm.add_request([1] * 500, SamplingParams(max_tokens=13))
    with pytest.raises(RequestError, match="device_pages"):
        make_llm(device_pages=4).add_request([1] * 10, SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="text prompt"):
        llm.add_request("hello")
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(RequestError, match="2 prompts but 1"):
        llm.generate([[1], [2]], [GREEDY])
    with pytest.raises(RequestError):
        llm.generate([[1, 2], []], GREEDY)
    assert not llm.has_unfinished()  # nothing queued when any prompt of a batch is invalid


def test_engine_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match="max_running"):
        make_llm(max_running=0)


def test_engine_from_checkpoint(tmp_path: Path) -> None:
    model = CausalLM(ModelConfig(num_layers=2, max_position=512, qk_norm=True, seed=4))
    save_hf_checkpoint(model, tmp_path)
    llm = make_llm(tmp_path)
    assert llm.tokenizer is None
    assert llm.cache.config.model_fingerprint == llm.model_config.fingerprint()
    p = prompts(1, seed=9)[0]
    want = make_llm(model).generate([p], GREEDY)[0].output_ids
    assert llm.generate([p], GREEDY)[0].output_ids == want


def test_single_token_prompt_and_stats() -> None:
    llm = make_llm()
    out = llm.generate([[42]], SamplingParams(max_tokens=5))[0]
    assert len(out.output_ids) == 5 and out.recomputed == 1
    stats = llm.stats()
    assert stats["recomputed_tokens"] == 1
    # K/V exists for the prompt and 4 outputs (the last output was never fed): one whole page
    # and a valid tail of one token, both cached
    assert stats["device_pages_used"] == stats["device_pages_cached"] == 2
