"""Speculative decoding with the MTP draft head under context parallelism, ranks as threads
(``LocalWorld``): the draft rows live with their anchor page on its owner, the head's attention
merges partials like the target's, and every rank proposes, verifies and accepts the same tokens.
Outputs equal CP=1 greedy decoding, and the acceptance after a device hit, a host restore and a
storage restore equals a cold run's. (``tests/e2e/test_cp_spec_oracle.py`` runs the same in gloo
processes.)"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from factories import engine_config

from kvtier.engine import LLM, SamplingParams, speculative
from kvtier.engine.families import build_model, preset
from kvtier.engine.mtp import DRAFT_HIDDEN, DRAFT_KV
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner
from kvtier.engine.scheduler import Work
from kvtier.parallel.group import LocalWorld
from kvtier.parallel.layout import CPLayout
from kvtier.pools.allocator import PageAllocator
from kvtier.pools.device import DevicePool
from kvtier.transfer.translate import DeviceKV, IdentityTranslator

MODEL = preset("tiny-mtp", max_position=512)
LONG = SamplingParams(max_tokens=20, return_logits=True)
PAGE = 4
DEVICE_PAGES = 96
CASES = [(2, "round_robin"), (4, "zigzag")]
CPU = torch.device("cpu")


def prompts(n: int, lo: int = 5, hi: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def cfg(cp: int = 1, rank: int = 0, pattern: str = "round_robin", **kw):  # noqa: ANN201
    base = dict(page_size=PAGE, device_pages=-(-DEVICE_PAGES // cp), prefetch_policy="timeout")
    if cp > 1:
        base.update(cp_size=cp, cp_rank=rank, cp_pattern=pattern)
    return engine_config(**{**base, **kw})


def counts(outs) -> list[tuple[int, int]]:  # noqa: ANN001
    return [(o.draft_proposed, o.draft_accepted) for o in outs]


def same_outputs(outs, want) -> None:  # noqa: ANN001
    for o, w in zip(outs, want, strict=True):
        assert o.output_ids == w.output_ids
        torch.testing.assert_close(o.logits, w.logits, rtol=0, atol=1e-4)


# --- the draft head alone: rows, drafts and ownership ------------------------------------

PROMPT, K, PAGES_PER_RANK = 30, 3, 16


def _logical_locs(layout: CPLayout, n: int) -> torch.Tensor:
    pages = -(-n // PAGE)
    ids = PageAllocator(PAGES_PER_RANK * layout.cp_size, lanes=layout.cp_size).alloc_owned(
        layout.owners(0, pages)
    )
    assert ids is not None
    return (ids[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n]


def _prefill_and_propose(model, kv, locs: torch.Tensor) -> list[int]:  # noqa: ANN001
    """Prefill ``PROMPT`` tokens through the runner, then propose ``K`` drafts."""
    tokens = prompts(1, PROMPT, PROMPT, seed=5)[0]
    req = Request(0, tokens, SamplingParams(), 0.0, None, tokens=tokens)
    req.locs = locs
    ModelRunner(model, kv, PAGE).forward([Work(req, PROMPT - 1)])
    req.num_computed = PROMPT - 1
    w = Work(req, 1, K)
    speculative.propose(model, kv, [w])
    return w.draft


@pytest.mark.parametrize(("cp_size", "pattern"), CASES)
def test_draft_rows_and_drafts_match_single_rank(cp_size: int, pattern: str) -> None:
    """The target forward's draft rows and the draft steps' rows land on each page's owner,
    equal CP=1's, and the drafts are CP=1's on every rank."""
    model = build_model(MODEL)
    layout = CPLayout(cp_size, 0, pattern)
    locs = _logical_locs(layout, PROMPT - 1 + K)
    ref_pool = DevicePool(model.pool_specs(), layout.logical_pages(PAGES_PER_RANK), PAGE, CPU)
    ref_draft = _prefill_and_propose(model, DeviceKV(ref_pool, IdentityTranslator()), locs)

    def rank(group):  # noqa: ANN001, ANN202
        lay = CPLayout(cp_size, group.rank, pattern)
        pool = DevicePool(model.pool_specs(), PAGES_PER_RANK, PAGE, CPU)
        draft = _prefill_and_propose(
            model, DeviceKV(pool, lay.translator(PAGES_PER_RANK, 0), group), locs
        )
        return pool, draft

    used = sorted({int(p) for p in locs // PAGE})
    for r, (pool, draft) in enumerate(LocalWorld(cp_size, timeout=60).run(rank)):
        assert draft == ref_draft and len(draft) == K
        held = [p for p in used if p % cp_size == r]
        assert held
        for name in (DRAFT_KV, DRAFT_HIDDEN):
            spec = next(s for s in model.pool_specs() if s.name == name)
            mine = pool.buffers[name].reshape(spec.num_layers, PAGES_PER_RANK, -1)
            ref = ref_pool.buffers[name].reshape(spec.num_layers, ref_pool.num_pages, -1)
            for p in held:
                torch.testing.assert_close(mine[:, p // cp_size], ref[:, p], rtol=0, atol=1e-5)
            untouched = sorted(set(range(PAGES_PER_RANK)) - {p // cp_size for p in held})
            assert not mine[:, untouched].any(), (name, r)


# --- the engine: outputs, acceptance and agreement ---------------------------------------


@pytest.mark.parametrize(("cp", "pattern"), CASES)
def test_outputs_equal_cp1_greedy(cp: int, pattern: str) -> None:
    ps = prompts(4, seed=cp)
    ps[0] = ps[0][:1]  # a one-token prompt: draft from the first decode step
    mixed = [LONG, SamplingParams(max_tokens=7, return_logits=True), LONG, LONG]
    want = LLM(MODEL, cfg()).generate(ps, mixed)
    spec1 = LLM(MODEL, cfg(), speculative_tokens=3).generate(ps, mixed)

    def rank(group):  # noqa: ANN001, ANN202
        llm = LLM(MODEL, cfg(cp, group.rank, pattern), speculative_tokens=3, group=group)
        outs = llm.generate(ps, mixed)
        return outs, llm.stats()

    for outs, st in LocalWorld(cp, timeout=60).run(rank):
        same_outputs(outs, want)
        # the draft head's merged attention drafts what CP=1's does
        assert counts(outs) == counts(spec1)
        assert 0 < sum(a for _, a in counts(outs)) < sum(p for p, _ in counts(outs))
        assert st["spec_draft_accepted"] == sum(o.draft_accepted for o in outs)


SHARED = prompts(1, 45, 45, seed=11)[0]
FIRST, SECOND = SHARED + [1, 2, 3], SHARED + [9, 8, 7, 6]


def _scrub(llm: LLM) -> None:
    """Overwrite this rank's device rows of the draft components: what the next request reads
    of a restored prefix must have come from the lower tier."""
    for name in (DRAFT_KV, DRAFT_HIDDEN):
        llm.cache.device_pool.buffers[name].normal_()


def _tiers(group, cp: int, pattern: str, store: str) -> dict:  # noqa: ANN001
    """Device hit and host restore of ``SECOND`` after ``FIRST``, and ``FIRST``'s pages
    written to storage at ``store``."""
    r = group.rank
    out = {}
    llm = LLM(MODEL, cfg(cp, r, pattern), speculative_tokens=3, group=group)
    out["cold"] = llm.generate([SECOND], LONG)[0]
    llm = LLM(MODEL, cfg(cp, r, pattern), speculative_tokens=3, group=group)
    llm.generate([FIRST], LONG)
    out["device"] = llm.generate([SECOND], LONG)[0]
    llm = LLM(MODEL, cfg(cp, r, pattern), speculative_tokens=3, group=group)
    llm.generate([FIRST], LONG)
    llm.cache.flush(host=False)
    _scrub(llm)
    out["host"] = llm.generate([SECOND], LONG)[0]
    kw = dict(storage="file", storage_dir=store, prefetch_policy="wait_complete")
    with LLM(MODEL, cfg(cp, r, pattern, **kw), speculative_tokens=3, group=group) as first:
        first.generate([FIRST], LONG)
    return out


def _storage(group, cp: int, pattern: str, store: str):  # noqa: ANN001, ANN202
    kw = dict(storage="file", storage_dir=store, prefetch_policy="wait_complete")
    with LLM(MODEL, cfg(cp, group.rank, pattern, **kw), speculative_tokens=3, group=group) as llm:
        _scrub(llm)
        return llm.generate([SECOND], LONG)[0]


@pytest.mark.parametrize(
    ("cp", "pattern"), [CASES[0], pytest.param(*CASES[1], marks=pytest.mark.slow)]
)
def test_acceptance_survives_every_tier(tmp_path: Path, cp: int, pattern: str) -> None:
    want = LLM(MODEL, cfg()).generate([SECOND], LONG)[0]
    store = str(tmp_path / "l3")
    ranks = LocalWorld(cp, timeout=60).run(lambda g: _tiers(g, cp, pattern, store))
    # fresh ranks whose device and host tiers are empty: storage alone
    storage = LocalWorld(cp, timeout=60).run(lambda g: _storage(g, cp, pattern, store))
    for r, s in zip(ranks, storage, strict=True):
        cold = r["cold"]
        assert cold.cached_tokens == 0 and 0 < cold.acceptance_rate < 1
        assert r["device"].cached_device == 44
        assert r["host"].cached_host == 44
        assert s.cached_storage == 44
        for warm in (cold, r["device"], r["host"], s):
            same_outputs([warm], [want])
            assert counts([warm]) == counts([cold])


def test_corrupt_host_draft_rows_change_acceptance_only() -> None:
    """The negative control: one rank's restored draft rows are really read."""
    want = LLM(MODEL, cfg()).generate([SECOND], LONG)[0]

    def rank(group):  # noqa: ANN001, ANN202
        cold = LLM(MODEL, cfg(2, group.rank), speculative_tokens=3, group=group)
        cold = cold.generate([SECOND], LONG)[0]
        llm = LLM(MODEL, cfg(2, group.rank), speculative_tokens=3, group=group)
        llm.generate([FIRST], LONG)
        llm.cache.flush(host=False)
        if group.rank == 1:
            torch.manual_seed(0)
            llm.cache.host_pool.buffers[DRAFT_KV].normal_(std=3.0)
        return cold, llm.generate([SECOND], LONG)[0]

    results = LocalWorld(2, timeout=60).run(rank)
    for cold, bad in results:
        assert bad.cached_host == 44
        same_outputs([bad], [want])
        assert bad.draft_accepted != cold.draft_accepted
        assert counts([bad]) == counts([results[0][1]])  # still the same on every rank


def test_agreement_of_drafts_and_accepted_tokens() -> None:
    """Ranks that propose or accept differently (or fail) still append the same tokens: the
    drafts' elementwise minimum, the fewest accepted, the minimum token at each place."""

    def rank(group):  # noqa: ANN001, ANN202
        r = group.rank
        req = Request(0, [1], SamplingParams(), 0.0, None, tokens=[1])
        work = [Work(req, 4, 3, [5, 6, 8]), Work(req, 4, 3, [[1, 2, 3], []][r]), Work(req, 1)]
        speculative.agree_drafts(group, work)
        drafts = [(w.draft, w.num_new) for w in work]
        # item 0: rank 0 accepted both drafts' first two, rank 1 only the first
        sampled = [[[5, 6, 7], [5, 3]][r], [[4], [-1]][r], [[9], [2]][r]]
        return drafts, speculative.agree_tokens(group, sampled, [3, 0, 0])

    for drafts, tokens in LocalWorld(2, timeout=30).run(rank):
        assert drafts == [([5, 6, 8], 4), ([], 1), ([], 1)]
        assert tokens == [[5, 3], [-1], [2]]
    solo = [[5, 6, 7], [-1]]
    assert speculative.agree_tokens(None, solo, [3, 0]) is solo
