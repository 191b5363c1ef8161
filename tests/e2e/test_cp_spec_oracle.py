"""Speculative decoding with the MTP draft head under context parallelism in real processes
(gloo on 127.0.0.1), at CP=2 and CP=4: a cold run, a device hit, a host restore and a storage
restore in fresh processes give CP=1 greedy tokens with logits within float32 tolerance, the
cold run accepts the drafts a CP=1 run accepts, and every restore exactly those. The demo with speculative
tokens on two ranks passes its oracle."""

from __future__ import annotations

import pytest
from cp_spec_child import SECOND, cold, live, restore
from test_demo import small

from kvtier.demo.run import run_demo
from kvtier.parallel.launch import launch, results

TOL = 1e-4


def _same(got: dict, want: dict, what: str) -> None:
    assert got["tokens"] == want["tokens"], f"{what}: tokens differ"
    diff = float((got["logits"] - want["logits"]).abs().max())
    assert diff <= TOL, f"{what}: logits differ by {diff}"


@pytest.mark.parametrize("cp", [2, 4])
def test_acceptance_after_every_tier_equals_cold(tmp_path, cp):
    want = cold(SECOND)
    solo = cold(SECOND, spec=3)  # the draft head's merged attention drafts what CP=1's does
    store = str(tmp_path / "l3")
    ranks = results(launch(cp, live, store, timeout=30))
    fresh = results(launch(cp, restore, store, timeout=30))
    for r, s in zip(ranks, fresh, strict=True):
        c = r["cold"]
        assert c["cached"] == (0, 0, 0) and 0 < c["drafts"][1] < c["drafts"][0]
        assert c["drafts"] == solo["drafts"]
        assert r["device"]["cached"][0] == 44
        assert r["host"]["cached"][1] == 44
        assert s["cached"][2] >= 44  # FIRST's pages, and SECOND's from the host run
        for what, out in (
            ("cold", c),
            ("device", r["device"]),
            ("host", r["host"]),
            ("storage", s),
        ):
            _same(out, want, what)
            assert out["drafts"] == c["drafts"], what
        assert r["cold"]["drafts"] == ranks[0]["cold"]["drafts"]  # every rank the same


def test_demo_with_speculative_tokens_on_two_ranks(tmp_path):
    """``kvtier demo --cp 2 --model tiny-mtp --speculative-tokens 3``: every tier serves, fresh
    ranks restore from the files, the oracle passes and drafts are accepted in both phases."""
    cfg = small(tmp_path, model="tiny-mtp", conversations=2, cp=2, speculative_tokens=3)
    summary = run_demo(cfg)
    oracle = summary["oracle"]
    assert (oracle["checked"], oracle["mismatches"]) == (2 * 3 + 2, 0)
    tiers = summary["tiers"]
    assert tiers["device_hit_tokens"] > 0 and tiers["storage_hit_tokens"] > 0
    assert summary["phases"][1]["storage_hit_tokens"] > 0  # fresh ranks read the files
    for phase in summary["phases"]:
        assert phase["cache"]["spec_draft_accepted"] > 0, phase["phase"]
