"""Greedy speculative decoding with the MTP draft head, and its draft KV through every tier."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from factories import engine_config

from kvtier.config import CacheConfig
from kvtier.engine import LLM, CausalLM, ModelConfig, SamplingParams, speculative
from kvtier.engine.families import build_model, preset
from kvtier.engine.mtp import DRAFT_HIDDEN, DRAFT_KV, MTPCausalLM
from kvtier.errors import ConfigError

MODEL = preset("tiny-mtp", max_position=512)
GREEDY = SamplingParams(max_tokens=20)


def cache_cfg(page_size: int = 4, **kw) -> CacheConfig:
    base = dict(page_size=page_size, device_pages=384 // page_size, prefetch_policy="timeout")
    return engine_config(**{**base, **kw})


def prompts(n: int, lo: int = 5, hi: int = 30, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def rate(outs) -> float:
    return sum(o.draft_accepted for o in outs) / sum(o.draft_proposed for o in outs)


def test_preset_and_fingerprint() -> None:
    model = build_model(MODEL)
    assert isinstance(model, MTPCausalLM) and MODEL.mtp_layers == 1
    assert [s.name for s in model.pool_specs()] == ["kv", DRAFT_KV, DRAFT_HIDDEN]
    # the option is new: configs without a head keep their digests, and the target's
    # weights are those of the same config without a head
    assert ModelConfig().fingerprint() == ModelConfig(mtp_layers=0).fingerprint()
    assert MODEL.fingerprint() != preset("tiny", max_position=512).fingerprint()
    plain = CausalLM(preset("tiny", max_position=512))
    assert torch.equal(plain.lm_head.weight, model.lm_head.weight)
    with pytest.raises(ConfigError, match="mtp_layers"):
        ModelConfig(mtp_layers=-1)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_outputs_equal_plain_greedy_decoding(page_size: int) -> None:
    ps = prompts(4, seed=page_size)
    ps[0] = ps[0][:1]  # a one-token prompt: draft from the first decode step
    mixed = [GREEDY, SamplingParams(max_tokens=7), GREEDY, SamplingParams(max_tokens=1)]
    want = LLM(MODEL, cache_cfg(page_size)).generate(ps, mixed)
    for k in (1, 3):
        llm = LLM(MODEL, cache_cfg(page_size), speculative_tokens=k)
        outs = llm.generate(ps, mixed)
        assert [o.output_ids for o in outs] == [o.output_ids for o in want], k
        assert [len(o.output_ids) for o in outs] == [20, 7, 20, 1]
        assert outs[3].draft_proposed == 0 and outs[3].acceptance_rate is None
        assert 0 < rate(outs) < 1, k
        st = llm.stats()
        assert st["spec_draft_proposed"] == sum(o.draft_proposed for o in outs)
        assert st["spec_draft_accepted"] == sum(o.draft_accepted for o in outs)


def test_stop_tokens_logits_and_sampled_requests() -> None:
    p = prompts(1, 12, 12, seed=9)[0]
    want = LLM(MODEL, cache_cfg()).generate([p], SamplingParams(max_tokens=20))[0].output_ids
    stop = SamplingParams(max_tokens=20, stop_token_ids=(want[6],), return_logits=True)
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    plain = LLM(MODEL, cache_cfg()).generate([p, p], [stop, sampled])
    outs = LLM(MODEL, cache_cfg(), speculative_tokens=3).generate([p, p], [stop, sampled])
    assert outs[0].output_ids == plain[0].output_ids == want[: want.index(want[6]) + 1]
    assert outs[0].logits.shape == plain[0].logits.shape
    assert torch.allclose(outs[0].logits, plain[0].logits, atol=1e-4)
    # sampled requests decode one token at a time
    assert outs[1].output_ids == plain[1].output_ids and outs[1].draft_proposed == 0


def test_draft_steps_write_only_draft_kv() -> None:
    llm = LLM(MODEL, cache_cfg(), speculative_tokens=3)
    llm.add_request(prompts(1, 9, 9, seed=4)[0], GREEDY)
    assert llm.step() == []  # the prefill
    work = llm.scheduler.schedule()
    assert [(w.num_new, w.spec_k) for w in work] == [(1, 3)]
    assert work[0].req.locs.numel() >= 10 + 3  # slots reserved for the drafts
    bufs = llm.cache.device_pool.buffers
    before = {name: b.clone() for name, b in bufs.items()}
    speculative.propose(llm.model, llm.cache.kv_buffers, work)
    assert len(work[0].draft) == 3 and work[0].num_new == 4
    assert torch.equal(bufs["kv"], before["kv"])
    assert torch.equal(bufs[DRAFT_HIDDEN], before[DRAFT_HIDDEN])
    assert not torch.equal(bufs[DRAFT_KV], before[DRAFT_KV])


def test_preemption_for_draft_slots_keeps_tokens() -> None:
    ps = prompts(4, 10, 14, seed=6)
    long = SamplingParams(max_tokens=24)
    want = [o.output_ids for o in LLM(MODEL, cache_cfg()).generate(ps, long)]
    tight = LLM(MODEL, cache_cfg(device_pages=24, enable_host=False), speculative_tokens=3)
    outs = tight.generate(ps, long)
    assert [o.output_ids for o in outs] == want
    assert sum(o.preemptions for o in outs) > 0


SHARED = prompts(1, 45, 45, seed=11)[0]
FIRST, SECOND = SHARED + [1, 2, 3], SHARED + [9, 8, 7, 6]
LONG = SamplingParams(max_tokens=24)


def scrub_device(llm: LLM) -> None:
    """Overwrite every device row of the draft components: what the next request reads of a
    restored prefix must have come from the lower tier."""
    for name in (DRAFT_KV, DRAFT_HIDDEN):
        llm.cache.device_pool.buffers[name].normal_()


def test_acceptance_survives_every_tier(tmp_path: Path) -> None:
    cold = LLM(MODEL, cache_cfg(), speculative_tokens=3).generate([SECOND], LONG)[0]
    assert cold.cached_tokens == 0 and 0 < cold.acceptance_rate < 1

    llm = LLM(MODEL, cache_cfg(), speculative_tokens=3)
    llm.generate([FIRST], LONG)
    device = llm.generate([SECOND], LONG)[0]
    assert device.cached_device == 44

    llm = LLM(MODEL, cache_cfg(), speculative_tokens=3)
    llm.generate([FIRST], LONG)
    llm.cache.flush(host=False)
    scrub_device(llm)
    host = llm.generate([SECOND], LONG)[0]
    assert host.cached_host == 44

    kw = dict(storage="file", storage_dir=str(tmp_path), prefetch_policy="wait_complete")
    with LLM(MODEL, cache_cfg(**kw), speculative_tokens=3) as first:
        first.generate([FIRST], LONG)
    with LLM(MODEL, cache_cfg(**kw), speculative_tokens=3) as fresh:
        scrub_device(fresh)
        storage = fresh.generate([SECOND], LONG)[0]
    assert storage.cached_storage == 44

    for warm in (device, host, storage):
        assert warm.output_ids == cold.output_ids
        assert (warm.draft_proposed, warm.draft_accepted) == (
            cold.draft_proposed,
            cold.draft_accepted,
        )


@pytest.mark.parametrize("tier", ["device", "host"])
def test_corrupt_draft_rows_change_acceptance_only(tier: str) -> None:
    """The negative control of the test above: the restored draft rows are really read."""
    cold = LLM(MODEL, cache_cfg(), speculative_tokens=3).generate([SECOND], LONG)[0]
    llm = LLM(MODEL, cache_cfg(), speculative_tokens=3)
    llm.generate([FIRST], LONG)
    torch.manual_seed(0)
    if tier == "host":
        llm.cache.flush(host=False)
        llm.cache.host_pool.buffers[DRAFT_KV].normal_(std=3.0)
    else:
        llm.cache.device_pool.buffers[DRAFT_KV].normal_(std=3.0)
    bad = llm.generate([SECOND], LONG)[0]
    assert (bad.cached_host if tier == "host" else bad.cached_device) == 44
    assert bad.output_ids == cold.output_ids
    assert bad.draft_accepted != cold.draft_accepted


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_option_values(bad) -> None:
    with pytest.raises(ConfigError, match="speculative_tokens"):
        LLM(MODEL, cache_cfg(), speculative_tokens=bad)


def test_option_needs_a_draft_head() -> None:
    with pytest.raises(ConfigError, match="speculative_tokens=2 needs a model with a draft head"):
        LLM(preset("tiny", max_position=512), cache_cfg(), speculative_tokens=2)
    assert LLM(preset("tiny"), cache_cfg(), speculative_tokens=0).speculative_tokens == 0
    # context parallelism is no reason to refuse (tests/engine/test_cp_spec_decode.py)
    assert speculative.check_option(1, build_model(MODEL)) == 1
