"""Shared fixtures: a tiny cache, a helper that plays one request through it, and an empty
radix tree with the tree tests' page size."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kvtier import CacheConfig, PoolSpec, TieredCache

SPEC = PoolSpec("kv", num_layers=2, row_shape=(2, 1, 4), dtype=torch.float32)
PS = 4
DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")
"""Where L1 lives in tests; ``KVTIER_TEST_DEVICE=cuda`` runs the tier tests on a GPU."""


def make_cache(tmp_path, **overrides) -> TieredCache:
    base = CacheConfig(
        page_size=PS,
        device_pages=8,
        host_pages=16,
        device=DEVICE,
        storage="file",
        storage_dir=str(tmp_path / "l3"),
        model_fingerprint="test-model",
        prefetch_policy="wait_complete",
    )
    return TieredCache(replace(base, **overrides), [SPEC])


def run_request(cache: TieredCache, tokens: list[int], seed: int = 0) -> dict:
    """Match, lock, load, allocate, write deterministic KV for the new tokens, finish.

    Returns ``{"load": LoadResult, "locs": slots of every token}``.
    """
    m = cache.match(tokens)
    cache.lock(m.handle)
    ld = cache.load(m)
    prefix = ld.locs.numel()
    new = cache.alloc(len(tokens) - prefix)[: len(tokens) - prefix]
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn((SPEC.num_layers, new.numel(), *SPEC.row_shape), generator=g)
    cache.device_pool.anchor[:, new] = rows.to(cache.device)
    locs = torch.cat([ld.locs, new])
    cache.finish(tokens, locs, prefix, m.handle)
    return {"load": ld, "locs": locs}


def kv_of(cache: TieredCache, locs: torch.Tensor) -> torch.Tensor:
    return cache.device_pool.anchor[:, locs].cpu()


@pytest.fixture
def cache(tmp_path):
    c = make_cache(tmp_path)
    yield c
    c.close()


@pytest.fixture
def tree():  # noqa: ANN201 - a RadixTree
    from tree_helpers import PS as TREE_PS

    from kvtier.tree import RadixTree

    return RadixTree(TREE_PS)
