"""``bench load-or-recompute``: the throttled backend holds reads to their rate and passes
everything else through; bad grids fail naming the option; a small grid on the tiny model
reports every point with the policy's choice."""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.bench import load_or_recompute as lr
from kvtier.errors import ConfigError


class _Inner:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def batch_get(self, keys, buffers) -> int:  # noqa: ANN001
        self.calls.append("get")
        return len(keys) - 1  # the last key missing

    def batch_exists(self, keys) -> list[bool]:  # noqa: ANN001
        self.calls.append("exists")
        return [True] * len(keys)


def test_throttled_reads_take_what_they_read_at_the_rate() -> None:
    inner = _Inner()
    t = lr.ThrottledReads(inner, rate=1e6)  # a megabyte per second
    bufs = [torch.zeros(10_000, dtype=torch.uint8) for _ in range(3)]
    t0 = time.perf_counter()
    assert t.batch_get(["a", "b", "c"], bufs) == 2
    assert time.perf_counter() - t0 >= 20_000 / 1e6  # the two read, not the missing one
    assert t.batch_exists(["a"]) == [True]  # passed through, not throttled
    assert inner.calls == ["get", "exists"]


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
    # at 100 kB/s a 64-token prompt's 3 pages (3 x 16 KiB) take half a second to read: the
    # policy, having measured that rate, computes it instead
    slow = r["grid"][0]
    assert (
        slow["restored_tokens"] == 0
        and slow["policy_rates_before"]["restore_storage_read_bytes_per_s"] < 1e6
    )
    assert r["max_cost_over_best"] == max(g["cost_over_best"] for g in r["grid"])
