"""``bench load-or-recompute``: the throttled file backend holds reads to their rate; bad grids
fail naming the option; a small grid on the tiny model reports every point with the policy's
choice."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.bench import load_or_recompute as lr
from kvtier.config import CacheConfig
from kvtier.errors import ConfigError


def test_a_throttled_file_backend_reads_at_its_rate(tmp_path) -> None:
    from kvtier.keys import Namespace, PageKey
    from kvtier.storage.registry import create_backend

    name = lr.throttled_file(1e6)  # a megabyte per second
    assert lr.throttled_file(1e6) == name  # registered once
    cfg = CacheConfig(storage=name, storage_dir=str(tmp_path), unbound_namespace=True)
    b = create_backend(name, cfg, Namespace("ns"))
    keys = [PageKey("ab" * 16), PageKey("cd" * 16), PageKey("ef" * 16)]
    pages = [torch.full((10_000,), i, dtype=torch.uint8) for i in range(3)]
    assert b.batch_set(keys[:2], pages[:2]) == 2  # the third is never written
    out = [torch.empty(10_000, dtype=torch.uint8) for _ in range(3)]
    t0 = time.perf_counter()
    assert b.batch_get(keys, out) == 2
    assert time.perf_counter() - t0 >= 20_000 / 1e6  # the two read, at the rate
    assert all(torch.equal(o, p) for o, p in zip(out[:2], pages[:2], strict=True))
    b.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"lengths": []}, "at least one"),
        ({"rates_gbps": [0.0]}, "rates_gbps must be positive"),
        ({"lengths": [0]}, "lengths must hold positive integers"),
        ({"repeats": 0}, "repeats must hold positive integers"),
    ],
)
def test_a_bad_grid_fails_naming_the_option(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        lr.bench_load_or_recompute(model="tiny", device="cpu", progress=False, **kw)


def test_a_small_grid_reports_every_point() -> None:
    r = lr.bench_load_or_recompute(
        model="tiny",
        lengths=[64, 128],
        rates_gbps=[1e-4, 1.0],
        repeats=1,
        warmups=3,
        warmup_tokens=32,
        warmup_cold_tokens=64,
        device="cpu",
        progress=False,
    )
    assert [(g["prompt_tokens"], g["storage_gbps"]) for g in r["grid"]] == [
        (64, 1e-4),
        (128, 1e-4),
        (64, 1.0),
        (128, 1.0),
    ]
    for g in r["grid"]:
        assert g["cost_over_best"] == pytest.approx(
            g["cost_s"] / min(g["recompute_s"], g["restore_s"])
        )
        # whole pages restored or computed: the prompt less its last token's page at most
        assert g["restored_tokens"] + g["recomputed_tokens"] == g["prompt_tokens"]
        assert g["restored_tokens"] % 16 == 0
        # each cost engine computed its warm-up prompts (32 + 2 x 64 tokens) whole: none came
        # from the L3 an earlier engine wrote, so the fit saw its long forwards
        assert g["warmup_computed_tokens"] == 32 + 2 * 64
    # at 100 kB/s a 64-token prompt's 3 pages (3 x 16 KiB) take half a second to read: the
    # policy, having measured that rate, computes it instead
    slow = r["grid"][0]
    assert (
        slow["restored_tokens"] == 0
        and slow["policy_rates_before"]["restore_storage_read_bytes_per_s"] < 1e6
    )
    assert r["max_cost_over_best"] == max(g["cost_over_best"] for g in r["grid"])
