"""``storage_admission='cost'``: a host copy is written to storage only where computing its pages
again takes at least as long as reading them back, and only with every page before it that
storage lacks. The tier tests' pool (one 8-element KV row per token and layer) gives a
recompute context of 48 tokens, so the first page of a node at depth ``d`` costs
``4 + (d + 2) / 12`` seconds at 1 token/s; a storage page is 256 bytes, read here in 6 s: pages
from depth 24 on are worth writing, shallower ones are not. And the engine: ``cost`` eviction
and admission change what is cached, never a token of the output."""

from __future__ import annotations

import pytest
import torch
from factories import PS, SPEC, make_cache, make_llm, run_request

from kvtier import CacheConfig
from kvtier.controller.storage_admission import StorageAdmission
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.metrics import Metrics
from kvtier.tree import RadixTree
from kvtier.tree.recompute import RecomputeWork

PAGE = SPEC.page_bytes(PS)  # 256
READ_S = 6.0
"""Seconds one storage page takes to read back, once measured."""
A = list(range(100, 132))  # 8 pages
B = A + list(range(500, 516))  # A and 4 pages at depth 32: worth writing
C = A[:8] + list(range(600, 620))  # A's first 2 pages and 5 of its own from depth 8: not worth
D = C + list(range(700, 708))  # C and 2 pages at depth 28: worth alone, but below C


def test_the_pool_set_gives_the_recompute_context() -> None:
    work = RecomputeWork.from_specs([SPEC])
    assert work.context == 48.0
    assert [4 + (d + 2) / 12 for d in (8, 20, 24, 28)] == [
        work.tokens(d, PS) for d in (8, 20, 24, 28)
    ]


@pytest.mark.parametrize("admission", ["all", "cost"])
def test_pages_cheaper_to_compute_than_to_read_are_not_written(tmp_path, admission) -> None:
    c = make_cache(
        tmp_path,
        device_pages=32,
        host_pages=64,
        storage_admission=admission,
        restore_rate_weight=1.0,
        restore_storage_rate=PAGE / READ_S,  # the prior alone would refuse A: not used
        restore_prefill_rate=1.0,
    )
    run_request(c, A)  # no read measured yet: everything is written
    c.drain()
    assert c.stats()["storage_backup_pages"] == 8
    c.restore_cost.model.observe("storage_read", PAGE, READ_S)
    for tokens in (B, C, D):
        run_request(c, tokens)
        c.drain()
        c.tree.check_integrity()
    st = c.stats()
    if admission == "all":
        assert (st["storage_backup_pages"], st["skipped_storage_writes"]) == (19, 0)
        return
    # B's 4 pages written; C's 5 passed over at its backup and again when D used them, then
    # D's 2, which are worth writing but would hang below pages storage lacks
    assert (st["storage_backup_pages"], st["skipped_storage_writes"]) == (12, 5 + 5 + 2)
    nodes = sorted((n.depth, n.num_pages(PS), n.in_storage) for n in c.tree.nodes())
    assert nodes == [(0, 2, True), (8, 5, False), (8, 6, True), (28, 2, False), (32, 4, True)]
    c.check_integrity()
    c.flush()
    assert list(c.tree.nodes()) == []
    # the storage prefix ends where the writes stopped
    assert c.match(B).storage_len == 48
    assert c.match(D).storage_len == 8
    assert c.match(C).storage_len == 8


def test_admission_judges_the_shallowest_page_storage_lacks() -> None:
    """The rule itself, on a tree: a deep node whose own first page is worth writing is passed
    over while a shallower node of its path is not stored and not worth it."""

    class Fixed:
        def seconds(self, path: str, amount: float) -> float:
            return amount if path == "prefill" else READ_S

        def known(self, path: str) -> bool:
            return True

    tree = RadixTree(PS)
    tree.insert(list(range(24)), torch.arange(6))  # 6 pages at depth 0
    tree.insert(list(range(32)), torch.arange(8))  # 2 pages at depth 24
    top, low = sorted(tree.nodes(), key=lambda n: n.depth)
    assert (top.depth, low.depth) == (0, 24)
    metrics = Metrics()
    rule = StorageAdmission(True, RecomputeWork(48.0), Fixed(), PS, metrics)
    assert rule.worth(low, PAGE) and not rule.worth(top, PAGE)
    assert rule.admit([low, top], PAGE) == []
    assert metrics.values(("skipped_storage_writes",)) == [8]
    tree.set_in_storage(top, True)
    assert rule.admit([low], PAGE) == [low]
    tree.check_integrity()


def test_cost_admission_refuses_context_parallelism() -> None:
    with pytest.raises(ConfigError, match="storage_admission='cost' with cp_size=2"):
        CacheConfig(storage_admission="cost", cp_size=2)
    with pytest.raises(ConfigError, match="storage_admission='some'"):
        CacheConfig(storage_admission="some")


@pytest.mark.slow  # two tiny engines
def test_engine_outputs_under_cost_equal_lru_token_by_token(tmp_path) -> None:
    """``LLM`` (tiny preset) over a device tier of 12 pages and a host tier of 16: prompts
    sharing prefixes evict on both tiers. ``cost`` eviction with ``cost`` admission at a
    storage read rate (fixed) at which no page is worth writing generates what ``lru`` with
    every page written (and a storage hit) does."""
    base = list(range(1, 97))
    prompts = [base + [200 + i] * (16 * (i % 3 + 1)) for i in range(6)]
    prompts += [base[:48] + list(range(300, 380)), prompts[0], prompts[4]]
    params = SamplingParams(max_tokens=5)
    slow = dict(restore_rate_weight=0.0, restore_storage_rate=3e5)
    runs, stats = {}, {}
    for i, (eviction, admission, rates) in enumerate((("lru", "all", {}), ("cost", "cost", slow))):
        with make_llm(
            "tiny",
            tmp_path / str(i),
            max_running=1,
            device_pages=12,
            host_pages=16,
            eviction_policy=eviction,
            storage_admission=admission,
            **rates,
        ) as llm:
            runs[eviction] = [llm.generate([p], params)[0].output_ids for p in prompts]
            stats[eviction] = st = llm.stats()
            assert st["evicted_device_pages"] > 0 and st["evicted_host_pages"] > 0
            llm.cache.tree.check_integrity()
    assert runs["cost"] == runs["lru"]
    lru, cost = stats["lru"], stats["cost"]
    assert lru["storage_hit_tokens"] > 0 and lru["skipped_storage_writes"] == 0
    assert (cost["storage_backup_pages"], cost["storage_hit_tokens"]) == (0, 0)
    assert cost["skipped_storage_writes"] > 0
