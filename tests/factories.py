"""How tests build caches, engines and their configurations: one place for the small pools,
the test device and the file L3 every tier test uses, so a test states only what it changes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from kvtier import CacheConfig, PoolSpec, TieredCache

SPEC = PoolSpec("kv", num_layers=2, row_shape=(2, 1, 4), dtype=torch.float32)
"""The tier tests' one KV pool: 2 layers of (k, v) x 1 head x 4 dims, float32."""
PS = 4
"""The tier tests' page size."""
WINDOW_SPECS = (
    SPEC,
    PoolSpec(
        "swa", num_layers=2, row_shape=(2, 1, 4), dtype=torch.float32, kind="window", window=2 * PS
    ),
)
"""A sliding-window pool set at ``PS``: the anchor ``SPEC`` and window rows of two pages."""
DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")
"""Where L1 lives in tests; ``KVTIER_TEST_DEVICE=cuda`` runs the tier tests on a GPU."""


def cache_config(storage_dir: Path | str | None = None, **overrides: object) -> CacheConfig:
    """A cache of 8 device and 16 host pages of ``PS`` tokens on ``DEVICE``, with a file L3 in
    ``storage_dir`` (no L3 without it) whose prefetches wait until complete; ``overrides``
    replace any field."""
    base = CacheConfig(
        page_size=PS,
        device_pages=8,
        host_pages=16,
        device=DEVICE,
        storage="file" if storage_dir is not None else None,
        storage_dir=str(storage_dir) if storage_dir is not None else "kvtier-data",
        model_fingerprint="test-model",
        prefetch_policy="wait_complete",
    )
    return replace(base, **overrides)


def make_cache(
    tmp_path: Path, specs: Sequence[PoolSpec] = (SPEC,), **overrides: object
) -> TieredCache:
    """A ``TieredCache`` over ``specs`` with ``cache_config(tmp_path / "l3", **overrides)``."""
    return TieredCache(cache_config(tmp_path / "l3", **overrides), list(specs))


def engine_config(storage_dir: Path | str | None = None, **overrides: object) -> CacheConfig:
    """The engine tests' cache: 64 device pages of 16 tokens on ``DEVICE``, file L3 in
    ``storage_dir`` (none without it), waiting prefetches and integrity checks at every poll."""
    base = CacheConfig(
        page_size=16,
        device_pages=64,
        device=DEVICE,
        storage="file" if storage_dir is not None else None,
        storage_dir=str(storage_dir) if storage_dir is not None else "kvtier-data",
        prefetch_policy="wait_complete",
        debug_checks=True,
    )
    return replace(base, **overrides)


def make_llm(
    model: object = "tiny",
    storage_dir: Path | str | None = None,
    *,
    max_running: int = 2,
    **kw: object,
):  # noqa: ANN201 - an LLM
    """An ``LLM`` over ``model`` (a preset name or a model config) with
    ``engine_config(storage_dir, **cache_overrides)``; ``kw`` may also hold the ``LLM``'s own
    options (``speculative_tokens``, ``max_prefill_tokens``, ...)."""
    from kvtier.engine import LLM
    from kvtier.engine.families import preset

    llm_options = {
        k: kw.pop(k) for k in ("speculative_tokens", "max_prefill_tokens", "cuda_graphs") if k in kw
    }
    config = preset(model) if isinstance(model, str) else model
    return LLM(config, engine_config(storage_dir, **kw), max_running=max_running, **llm_options)


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


def randomise(buf: torch.Tensor, seed: int) -> None:
    """Fill ``buf`` with seeded random bytes (whatever its dtype)."""
    g = torch.Generator().manual_seed(seed)
    n = buf.numel() * buf.element_size()
    raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    buf.view(-1).view(torch.uint8).copy_(raw.to(buf.device))


def kv_of(cache: TieredCache, locs: torch.Tensor) -> torch.Tensor:
    """The device pool's anchor rows at ``locs``, on CPU."""
    return cache.device_pool.anchor[:, locs].cpu()
