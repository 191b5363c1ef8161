"""``kvtier bench window`` runs through the public API and reports both sides."""

from __future__ import annotations

import os

from kvtier.bench.window_memory import run


def test_bench_window_reports_bytes_per_token_of_both_sides() -> None:
    r = run(
        context=512,
        output_tokens=3,
        window=48,
        page_size=16,
        device=os.environ.get("KVTIER_TEST_DEVICE", "cpu"),
    )
    assert r["tokens_equal"]
    full, win = r["full"], r["window_pool"]
    # 515 tokens on 33 pages; every row kept: 4 layers of every page
    unit = 16 * 2 * 2 * 32 * 4  # one layer of one page of the swa preset
    assert full["decode_bytes"] == 33 * 4 * unit
    # window pool: 2 anchor layers of every page, 2 sliding layers of the pages the next
    # query (at 513) reads, 466..513 (pages 29..32), and of the prompt's resume window:
    # resuming at 496 reads 449..495 (pages 28..30)
    assert win["decode_bytes"] == (33 * 2 + 5 * 2) * unit
    assert r["ratio_decode_bytes"] == (33 * 2 + 5 * 2) / (33 * 4)
    assert 0 < r["ratio_predicted"] < 1
