"""`kvtier demo` end to end on a reduced workload: every tier serves tokens, the restart phase
runs in a fresh process, and every output equals its cold run."""

from __future__ import annotations

import json

from kvtier.cli import main
from kvtier.demo import DemoConfig, format_table, run_demo


def test_demo_hits_every_tier_and_passes_the_oracle(tmp_path):
    cfg = DemoConfig(
        storage_dir=str(tmp_path / "demo"),
        conversations=4,
        turns=3,
        system_tokens=64,
        user_tokens=(16, 32),
        max_tokens=6,
        device_pages=16,
        max_running=2,
    )
    summary = run_demo(cfg)
    tiers, oracle = summary["tiers"], summary["oracle"]
    assert tiers["device_hit_tokens"] > 0
    assert tiers["host_hit_tokens"] > 0
    assert tiers["storage_hit_tokens"] > 0
    assert {k: oracle[k] for k in ("checked", "mismatches", "logit_mismatches")} == {
        "checked": 4 * 3 + 4,
        "mismatches": 0,
        "logit_mismatches": 0,
    }
    assert oracle["token_mismatches"] == 0
    assert oracle["logit_tolerance"] == 1e-4  # the tiny model is float32
    assert 0 <= oracle["max_logit_diff"] <= 1e-4
    assert [p["phase"] for p in summary["phases"]] == ["live", "restart"]
    assert summary["phases"][1]["storage_hit_tokens"] > 0  # the fresh process read files
    assert "oracle: PASS" in format_table(summary)
    json.dumps(summary)


def test_demo_refuses_a_foreign_directory(tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep")
    try:
        main(["demo", "--storage-dir", str(foreign)])
    except SystemExit as e:
        assert "was not created by the demo" in str(e)
    else:
        raise AssertionError("the demo must not wipe a directory it did not create")
    assert (foreign / "precious.txt").read_text() == "keep"
