"""kvtier on a real Mooncake Store: the content oracle across processes (dense and a model with
a state pool), prefixes shared between engine processes, and a master outage mid-workload."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from childproc import run_json
from mooncake_harness import MooncakeCluster, mooncake_cluster  # noqa: F401 - fixture

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.families import preset

pytestmark = pytest.mark.mooncake

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def make_llm(family: str, url: str | None, **cache) -> LLM:
    cfg = CacheConfig(
        page_size=16,
        device_pages=64,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
        storage="mooncake" if url else None,
        storage_url=url,
        prefetch_policy="wait_complete",
        debug_checks=True,
        **cache,
    )
    return LLM(preset(family), cfg, max_running=2)


def prompts(vocab: int, n: int = 4, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(160)]
    return [shared[: 40 * (i + 1)] + [rng.randrange(vocab) for _ in range(9)] for i in range(n)]


def cold(family: str, ps: list[list[int]]) -> list[list[int]]:
    llm = make_llm(family, None)
    outs = []
    for p in ps:
        llm.cache.flush()
        outs.append(list(llm.generate([p], GREEDY)[0].output_ids))
    llm.close()
    return outs


def run_child(family: str, url: str, case: dict, tmp_path: Path) -> dict:
    path = tmp_path / f"case-{random.random()}.pt"
    torch.save(case, path)
    return run_json("e2e/mooncake_child.py", family, url, str(path))


@pytest.mark.parametrize("family", ["tiny", "hybrid"])
def test_mooncake_oracle_and_cross_instance_sharing(
    mooncake_cluster: MooncakeCluster,  # noqa: F811
    tmp_path: Path,
    family: str,
) -> None:
    url = mooncake_cluster.url(timeout_s=5)
    vocab = preset(family).vocab_size
    ps = prompts(vocab)
    extra = prompts(vocab, seed=2)
    expected, expected_extra = cold(family, ps), cold(family, extra)

    # Process A (this one) computes the prompts; its pages go to the store.
    a = make_llm(family, url)
    assert [list(o.output_ids) for o in a.generate(ps, GREEDY)] == expected
    a.cache.drain()
    assert a.cache.stats()["storage_backup_pages"] > 0

    # Process B (fresh: empty device and host) restores them from the store, then writes its own.
    b = run_child(family, url, {"prompts": ps, "write": extra}, tmp_path)
    assert b["outputs"] == expected
    assert sum(b["storage_tokens"]) > 0 and b["errors"] == {}
    assert b["backed_up"] > 0

    # A, with its own tiers emptied, reuses what B wrote (B has exited).
    a.cache.flush()
    outs = [a.generate([p], GREEDY)[0] for p in extra]
    assert [list(o.output_ids) for o in outs] == expected_extra
    assert sum(o.cached_storage for o in outs) > 0
    a.close()


def test_master_outage_mid_workload(
    mooncake_cluster: MooncakeCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    url = mooncake_cluster.url(timeout_s=1)
    vocab = preset("tiny").vocab_size
    # Four prompts around the outage, then two with fresh content after it.
    ps = prompts(vocab, n=4, seed=3) + prompts(vocab, n=2, seed=4)
    expected = cold("tiny", ps)
    llm = make_llm("tiny", url)
    backend = llm.cache.storage

    outs = [llm.generate([p], GREEDY)[0] for p in ps[:2]]
    llm.cache.drain()
    mooncake_cluster.kill_master()
    llm.cache.flush()  # every later hit would have to come from the store
    outs += [llm.generate([p], GREEDY)[0] for p in ps[2:4]]
    llm.cache.drain()
    assert [list(o.output_ids) for o in outs] == expected[:4]
    st = llm.cache.stats()
    assert st["storage_healthy"] == 0.0 and st["storage_outages"] >= 1
    assert sum(st["storage_errors"].values()) >= 1
    assert st["dropped_storage_backups"] > 0
    assert all(o.cached_storage == 0 for o in outs[2:])

    mooncake_cluster.start_master()
    assert backend.wait_healthy(timeout_s=15)
    outs = [llm.generate([p], GREEDY)[0] for p in ps[4:]]
    assert [list(o.output_ids) for o in outs] == expected[4:]
    llm.cache.drain()
    llm.cache.flush()
    again = [llm.generate([p], GREEDY)[0] for p in ps[4:]]
    assert [list(o.output_ids) for o in again] == expected[4:]
    assert sum(o.cached_storage for o in again) > 0  # hits resumed after the restart

    # Pages whose backup was dropped during the outage are written once they are used again.
    stored = llm.cache.stats()["storage_backup_pages"]
    llm.generate([ps[3]], GREEDY)
    llm.cache.drain()
    assert llm.cache.stats()["storage_backup_pages"] > stored
    llm.close()
