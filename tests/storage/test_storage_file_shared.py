"""The file backend's directory shared by the ranks of a context-parallel group: each rank
keeps within ``storage_bytes // cp_size``, charging what its start-up scan found a share, so
the directory stays within ``storage_bytes`` through writes, restarts and evictions."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, PageKey
from kvtier.storage import create_backend
from kvtier.storage.file import HEADER_BYTES, FileBackend
from kvtier.storage.file_recency import JOURNAL

NS = Namespace("ns0")
PAGE = 64
OBJ = HEADER_BYTES + PAGE * 4  # one float32 page's object


def page(seed: int) -> torch.Tensor:
    return torch.randn(PAGE, generator=torch.Generator().manual_seed(seed))


def dir_bytes(be: FileBackend) -> int:
    """Bytes of every object file (packs included) in the backend's directory."""
    return sum(
        p.stat().st_size for p in Path(be.dir).rglob("*") if p.is_file() and p.name != JOURNAL
    )


def test_two_ranks_and_a_restart_stay_within_the_directory_budget(tmp_path: Path) -> None:
    budget = 6 * OBJ
    r0 = FileBackend(tmp_path, NS, budget, sharers=2)
    r1 = FileBackend(tmp_path, NS, budget, sharers=2)
    assert r0.budget_bytes == r1.budget_bytes == 3 * OBJ
    assert r0.batch_set([PageKey(k) for k in "abc"], [page(i) for i in range(3)]) == 3
    assert r1.batch_set([PageKey(k) for k in "def"], [page(i) for i in range(3, 6)]) == 3
    assert r0.batch_set([PageKey("g")], [page(6)]) == 1  # r0 evicts its own oldest, "a"
    assert r0.keys() == ["b", "c", "g"] and dir_bytes(r0) == 6 * OBJ
    r0.close(), r1.close()

    # A restart: each rank finds all six objects and is charged half of each.
    s0 = FileBackend(tmp_path, NS, budget, sharers=2)
    s1 = FileBackend(tmp_path, NS, budget, sharers=2)
    for s in (s0, s1):
        assert sorted(s.keys()) == list("bcdefg")
        assert s.stats()["bytes_used"] == 6 * (-(-OBJ // 2)) <= s.budget_bytes
        assert s.stats()["evictions"] == 0
        s.check_integrity()
    dst = torch.empty(PAGE)
    assert s1.batch_get([PageKey("b")], [dst]) == 1 and torch.equal(dst, page(1))

    # A rank's own write now pushes out found objects: two halves make room for one whole.
    before = s0.keys()
    oldest = before[:2]
    assert s0.batch_set([PageKey("h")], [page(7)]) == 1
    assert s0.stats()["evictions"] == 2 and s0.keys() == before[2:] + ["h"]
    assert dir_bytes(s0) == 5 * OBJ
    # s1 still indexes what s0 evicted: a read of it is a counted miss, not an error.
    assert s1.batch_get([PageKey(oldest[0])], [torch.empty(PAGE)]) == 0
    for s in (s0, s1):
        s.check_integrity()


def test_ranks_writing_in_turns_never_overrun_the_directory(tmp_path: Path) -> None:
    """Random rounds of each rank's writes, with the whole group restarted in the middle:
    after every round the directory holds at most ``storage_bytes``, and each rank is within
    its own budget."""
    budget, ranks = 10 * OBJ, 3
    rng = random.Random(0)
    group = [FileBackend(tmp_path, NS, budget, sharers=ranks) for _ in range(ranks)]
    written = 0
    for step in range(60):
        if step == 30:
            for be in group:
                be.close()
            group = [FileBackend(tmp_path, NS, budget, sharers=ranks) for _ in range(ranks)]
        be = group[rng.randrange(ranks)]
        n = rng.randint(1, 3)
        keys = [PageKey(f"k{written + i:04d}") for i in range(n)]
        assert be.batch_set(keys, [page(written + i) for i in range(n)]) == n
        written += n
        assert dir_bytes(be) <= budget
        for b in group:
            assert b.stats()["bytes_used"] <= b.budget_bytes
            b.check_integrity()
    assert dir_bytes(group[0]) > budget // 2  # the budget was used, not just respected


def test_shared_budget_errors_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cp_size must be a positive integer, got 0"):
        FileBackend(tmp_path, NS, 1 << 20, sharers=0)
    with pytest.raises(
        ConfigError, match=r"storage_bytes=3 leaves no budget for each of cp_size=4"
    ):
        FileBackend(tmp_path, NS, 3, sharers=4)


def test_config_shares_the_budget_among_cp_ranks(tmp_path: Path) -> None:
    cfg = CacheConfig(
        storage="file", storage_dir=str(tmp_path), storage_bytes=1 << 20, cp_size=4, cp_rank=1
    )
    be = create_backend("file", cfg, NS)
    assert isinstance(be, FileBackend) and be.budget_bytes == 1 << 18
