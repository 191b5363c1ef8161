"""Context-parallel attention in the reference engine: every rank of a CP group holds only its
lane's pages, computes local partials and merges them; the result must equal a CP=1 run."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.engine import cp
from kvtier.engine.attention import paged_attention
from kvtier.engine.batch import SeqSlots
from kvtier.engine.families import build_model, preset
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Work
from kvtier.errors import ConfigError
from kvtier.parallel.group import LocalWorld
from kvtier.parallel.layout import CPLayout
from kvtier.pools.allocator import PageAllocator
from kvtier.pools.device import DevicePool
from kvtier.transfer.translate import DeviceKV, IdentityTranslator

CPU = torch.device("cpu")
PROMPT, DECODE = 70, 5
PAGES_PER_RANK = 24
SMALL = {"num_layers": 2}
# dsa-compressed groups of 2 * 2 = 4 tokens, so pages of 4 and 16 tokens hold whole groups
PRESETS = {
    "tiny": SMALL,
    "mla": SMALL,
    "dsa": {**SMALL, "index_topk": 12},
    "dsa-compressed": {**SMALL, "index_page_size": 2, "index_kpool": 2, "index_topk_groups": 3},
}
CASES = [(2, "round_robin", 4), (3, "zigzag", 16), (4, "round_robin", 4), (4, "zigzag", 16)]

_models: dict[str, object] = {}


def model_of(name: str):  # noqa: ANN201 - any family's model
    if name not in _models:
        _models[name] = build_model(preset(name, **PRESETS[name]))
    return _models[name]


def prompt(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(PROMPT)]


def logical_locs(layout: CPLayout, page: int, n: int) -> torch.Tensor:
    """Logical slots of ``n`` tokens whose sequence page ``i`` lives on ``layout.owner(i)``."""
    pages = -(-n // page)
    cp_size = layout.cp_size
    ids = PageAllocator(PAGES_PER_RANK * cp_size, lanes=cp_size).alloc_owned(
        layout.owners(0, pages)
    )
    assert ids is not None
    return (ids[:, None] * page + torch.arange(page)).reshape(-1)[:n]


def generate(model, kv, locs: torch.Tensor, ids: list[int]):  # noqa: ANN001, ANN201
    """Prefill ``ids`` (all logits), then ``DECODE`` greedy steps; ``(logits, tokens)``."""
    tokens, rows, start = list(ids), [], 0
    for _ in range(DECODE + 1):
        end = len(tokens)
        if getattr(kv, "group", None) is None:
            seq = SeqSlots(end - start, locs[start:end], locs[:end])
        else:
            seq = cp.seq_slots(kv, locs[:end], start, CPU)
        out = model(torch.tensor(tokens[start:end]), torch.arange(start, end), [seq], kv, True)
        rows.append(out)
        tokens.append(int(out[-1].argmax()))
        start = end
    return torch.cat(rows), tokens[len(ids) :]


def reference(name: str, layout: CPLayout, page: int):  # noqa: ANN201
    """CP=1 run over one pool holding every logical page (logical id = physical id)."""
    model = model_of(name)
    locs = logical_locs(layout, page, PROMPT + DECODE)
    pool = DevicePool(model.pool_specs(), layout.logical_pages(PAGES_PER_RANK), page, CPU)
    logits, tokens = generate(model, pool, locs, prompt())
    return pool, locs, logits, tokens


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize(("cp_size", "pattern", "page"), CASES)
def test_cp_matches_single_rank(name: str, cp_size: int, pattern: str, page: int) -> None:
    model = model_of(name)
    ref_pool, locs, ref_logits, ref_tokens = reference(name, CPLayout(cp_size, 0, pattern), page)

    def rank(group):  # noqa: ANN001, ANN202
        layout = CPLayout(cp_size, group.rank, pattern)
        pool = DevicePool(model.pool_specs(), PAGES_PER_RANK, page, CPU)
        kv = DeviceKV(pool, layout.translator(PAGES_PER_RANK, 0), group)
        logits, tokens = generate(model, kv, locs, prompt())
        return pool, logits, tokens

    results = LocalWorld(cp_size, timeout=60).run(rank)
    used = sorted({int(p) for p in locs // page})
    for r, (pool, logits, tokens) in enumerate(results):
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
        assert tokens == ref_tokens
        assert torch.equal(logits, results[0][1])  # the merge is identical on every rank
        for spec in model.pool_specs():
            mine = pool.buffers[spec.name].reshape(spec.num_layers, PAGES_PER_RANK, -1)
            ref = ref_pool.buffers[spec.name].reshape(spec.num_layers, ref_pool.num_pages, -1)
            held = [p for p in used if p % cp_size == r]
            assert held, "every rank holds pages of this sequence"
            for p in held:
                # layer 0 sees only embeddings: its rows are bitwise those of CP=1
                assert torch.equal(mine[0, p // cp_size], ref[0, p]), (spec.name, r, p)
                torch.testing.assert_close(mine[:, p // cp_size], ref[:, p], rtol=0, atol=1e-5)
            # nothing was written outside the pages this rank holds
            untouched = sorted(set(range(PAGES_PER_RANK)) - {p // cp_size for p in held})
            assert not mine[:, untouched].any(), (spec.name, r)


def test_sequence_slots_cover_the_context_once() -> None:
    layout = CPLayout(3, 0, "zigzag")
    locs = logical_locs(layout, 4, 30)
    pool = DevicePool(model_of("tiny").pool_specs(), PAGES_PER_RANK, 4, CPU)
    got = []
    for r in range(3):
        lay = CPLayout(3, r, "zigzag")
        kv = DeviceKV(pool, lay.translator(PAGES_PER_RANK, 0), object())
        s = cp.seq_slots(kv, locs, 22, CPU)
        assert s.seq_len == 30 and s.num_new == 8
        assert [layout.owner(int(c) // 4) for c in s.ctx_cols] == [r] * len(s.ctx_cols)
        assert torch.equal(s.ctx_locs[len(s.ctx_locs) - len(s.out_locs) :], s.out_locs)
        assert torch.equal(s.ctx_cols[s.ctx_cols >= 22] - 22, s.out_rows)
        got += s.ctx_cols.tolist()
    assert sorted(got) == list(range(30))


def test_merge_when_a_rank_sees_no_visible_column() -> None:
    """Queries 0..3 see only page 0 (rank 0): rank 1's partial is lse -inf, out 0, and the
    merge still equals full attention without NaNs."""
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads, d = 8, 4, 2, 8
    q = torch.randn(n, heads, d, generator=gen)
    k = torch.randn(n, kv_heads, d, generator=gen)
    v = torch.randn(n, kv_heads, d, generator=gen)
    pos = torch.arange(n)
    full = paged_attention(q, k, v, pos)

    def rank(group):  # noqa: ANN001, ANN202
        cols = torch.arange(4) + 4 * group.rank  # page of 4 tokens per rank
        out, lse = cp.partial_attention(q, k[cols], v[cols], pos, cols)
        return out, lse, cp.merge_partials(group, out, lse)

    (o0, l0, (m0, t0)), (o1, l1, (m1, t1)) = LocalWorld(2, timeout=30).run(rank)
    assert torch.isneginf(l1[:4]).all() and not torch.isinf(l1[4:]).any()
    assert torch.equal(o1[:4], torch.zeros_like(o1[:4])) and not o1.isnan().any()
    assert torch.isfinite(l0).all()
    assert torch.equal(m0, m1) and torch.equal(t0, t1)
    torch.testing.assert_close(m0, full, rtol=0, atol=1e-6)
    assert torch.equal(m0[:4], o0[:4])  # exp(0) * out_0 + exp(-inf) * 0: exactly rank 0's


def test_merge_of_a_query_no_rank_sees_is_zero() -> None:
    def rank(group):  # noqa: ANN001, ANN202
        out, lse = torch.zeros(1, 2, 3), torch.full((1, 2), float("-inf"))
        return cp.merge_partials(group, out, lse)

    for out, lse in LocalWorld(3, timeout=30).run(rank):
        assert torch.equal(out, torch.zeros(1, 2, 3)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("name", ["hybrid", "swa"])
def test_families_without_cp_refuse(name: str) -> None:
    model = build_model(preset(name))
    pool = DevicePool(model.pool_specs(), 4, 4, CPU)
    layout = CPLayout(2, 0)
    kv = DeviceKV(pool, layout.translator(4, 0), LocalWorld(2).group(0))
    with pytest.raises(ConfigError, match=r"cp_size=2") as err:
        ModelRunner(model, kv, 4)
    assert name in str(err.value) or type(model).__name__ in str(err.value)
    state = model.zero_state() if model.stateful else None
    seq = SeqSlots(1, torch.tensor([0]), torch.tensor([0]), state=state)
    with pytest.raises(ConfigError, match=r"cp_size=2"):
        model(torch.tensor([1]), torch.tensor([0]), [seq], kv)


def test_runner_forward_and_token_agreement() -> None:
    """The runner's CP forward equals CP=1's; ranks whose sampled tokens differ (and an item
    that failed on one rank, -1) agree on the step's tokens."""
    model, page = model_of("tiny"), 4
    layout = CPLayout(2, 0, "zigzag")
    locs = logical_locs(layout, page, PROMPT)

    def work() -> list[Work]:
        req = Request(0, prompt(), SamplingParams(), 0.0, None, tokens=prompt())
        req.locs = locs
        return [Work(req, PROMPT)]

    pool = DevicePool(model.pool_specs(), layout.logical_pages(PAGES_PER_RANK), page, CPU)
    ref = ModelRunner(model, DeviceKV(pool, IdentityTranslator()), page).forward(work())
    assert ModelRunner(model, DeviceKV(pool, IdentityTranslator()), page).agree([5, 2]) == [5, 2]

    def rank(group):  # noqa: ANN001, ANN202
        lay = CPLayout(2, group.rank, "zigzag")
        p = DevicePool(model.pool_specs(), PAGES_PER_RANK, page, CPU)
        runner = ModelRunner(model, DeviceKV(p, lay.translator(PAGES_PER_RANK, 0), group), page)
        mine = [[7, 3, 9], [4, -1, 9]][group.rank]
        return runner.forward(work()), runner.agree(mine)

    for logits, agreed in LocalWorld(2, timeout=60).run(rank):
        torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)
        assert agreed == [4, -1, 9]
