"""`kvtier demo` end to end on a reduced workload: every tier serves tokens, the restart phase
runs in a fresh process, and every output equals its cold run (tokens and logits); corrupted
restores fail the oracle even where the tokens survive them."""

from __future__ import annotations

import json

import pytest
from test_oracle_corruption import corrupted_loads

from kvtier.cli import main
from kvtier.demo.run import DemoConfig, run_demo, run_live, summarize
from kvtier.demo.table import format_table
from kvtier.errors import ConfigError


def small(tmp_path, **kw) -> DemoConfig:
    base = dict(
        storage_dir=str(tmp_path / "demo"),
        conversations=4,
        turns=3,
        system_tokens=64,
        user_tokens=(16, 32),
        max_tokens=6,
        device_pages=16,
        max_running=2,
    )
    return DemoConfig(**{**base, **kw})


def test_demo_hits_every_tier_and_passes_the_oracle(tmp_path):
    cfg = small(tmp_path)
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


def test_demo_oracle_fails_on_corrupted_restores_the_tokens_survive(tmp_path, monkeypatch):
    cfg = small(tmp_path)
    with corrupted_loads(monkeypatch, "flip") as loads:  # one value negated per load
        live, _ = run_live(cfg)
    assert len(loads) > 0 and live.host_hit_tokens > 0
    summary = summarize(cfg, [live])
    oracle = summary["oracle"]
    assert oracle["logit_mismatches"] > 0
    assert oracle["mismatches"] == live.mismatches >= oracle["logit_mismatches"]
    assert oracle["logit_mismatches"] > oracle["token_mismatches"]  # tokens alone miss some
    assert oracle["max_logit_diff"] > 10 * oracle["logit_tolerance"]
    table = format_table(summary)
    assert "oracle: FAIL" in table and "MISMATCH" in table
    assert f"{oracle['logit_mismatches']} with a logit more than 1.0e-04 off" in table


def test_demo_logit_tolerance_is_checked_and_overrides_the_default(tmp_path):
    with pytest.raises(ConfigError, match="logit_tolerance must be None or a finite number"):
        DemoConfig(logit_tolerance=float("nan"))
    with pytest.raises(ConfigError, match="got -1"):
        DemoConfig(logit_tolerance=-1)
    cfg = small(tmp_path, conversations=2, turns=2, logit_tolerance=0.0)
    live, _ = run_live(cfg)
    assert live.logit_tolerance == 0.0
    # a tolerance of zero flags the requests whose logits moved at all (batched decoding rounds
    # differently from the cold runs), and only those
    assert (live.logit_mismatches > 0) == (live.max_logit_diff > 0)
    assert live.token_mismatches == 0
    assert live.mismatches == live.logit_mismatches
