"""The content oracle under context parallelism, in real processes (gloo on 127.0.0.1).

For the dense, MLA and DSA families at CP=2 and CP=4: the first run, a device hit and a host restore
give the tokens of a CP=1 cold run with logits within float32 tolerance, and the restored bytes
equal the ones first written. Fresh processes at the same CP size, and at other CP sizes (1 and 4) reading
the objects CP=2 wrote, restore from storage alone with the same outputs and bytes. A rank that
dies inside a storage write makes the other fail within the timeout, naming it. Cross-size
reuse runs on the file backend and on a real Mooncake Store.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from cp_oracle_child import cold, die_mid_write, live, restore, restore_solo
from mooncake_harness import mooncake_cluster  # noqa: F401 - fixture

from kvtier.parallel.launch import launch, results

TOL = 1e-4
FAMILIES = ["tiny", "mla", "dsa"]


def _prompts(vocab: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(3)
    base = [rng.randrange(vocab) for _ in range(100)]
    # cuts sweep page boundaries (16) and the owner pattern; each ends in its own question
    return base, [base[:cut] + [5, cut % vocab] for cut in (37, 64, 100)]


def _vocab(family: str) -> int:
    from kvtier.engine.families import preset

    return preset(family).vocab_size


def _same(outs: list[dict], ref: list[dict], what: str) -> None:
    for k, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert o["tokens"] == r["tokens"], f"{what}: prompt {k} tokens differ"
        diff = float((o["logits"] - r["logits"]).abs().max())
        assert diff <= TOL, f"{what}: prompt {k} logits differ by {diff}"


def _rows_equal(got: dict, want: dict) -> int:
    """Assert every page in ``got`` equals ``want``'s (byte-exact); returns pages compared."""
    for page, rows in got.items():
        for name, t in rows.items():
            assert torch.equal(t, want[page][name]), f"page {page} {name} differs"
    return len(got)


def _union(rank_rows: list[dict]) -> dict:
    out: dict = {}
    for rows in rank_rows:
        assert not set(rows) & set(out), "two ranks hold the same page"
        out.update(rows)
    return out


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_tier_matches_cp1_cold(tmp_path, family, cp):
    base, prompts = _prompts(_vocab(family))
    ref = cold(family, prompts)
    store = str(tmp_path / "l3")
    ranks = results(launch(cp, live, family, store, prompts, base, timeout=30))
    written = _union([r["rows"] for r in ranks])
    assert sorted(written) == list(range(100 // 16))  # every page of the prefix, once
    for r in ranks:
        _same(r["first"], ref, "first run")
        _same(r["device"], ref, "device hit")
        _same(r["host"], ref, "host restore")
        assert all(o["cached"][0] > 0 for o in r["device"])
        assert all(o["cached"][1] > 0 for o in r["host"])
        assert _rows_equal(r["restored"], written) == len(r["rows"])
    # fresh processes at the same CP size restore from storage alone
    again = results(launch(cp, restore, family, store, prompts, base, timeout=30))
    assert sum(_rows_equal(r["rows"], written) for r in again) == len(written)
    for r in again:
        _same(r["outs"], ref, "storage restore")
        assert r["outs"][0]["cached"][2] > 0


def _cross_size(store: str, family: str) -> None:
    base, prompts = _prompts(_vocab(family))
    ref = cold(family, prompts)
    written = _union([r["rows"] for r in results(launch(2, live, family, store, prompts, base))])
    solo = restore_solo(family, store, prompts, base)
    assert _rows_equal(solo["rows"], written) == len(written)
    _same(solo["outs"], ref, "CP=1 from CP=2 storage")
    assert solo["outs"][0]["cached"][2] > 0
    four = results(launch(4, restore, family, store, prompts, base, timeout=30))
    assert sum(_rows_equal(r["rows"], written) for r in four) == len(written)
    for r in four:
        _same(r["outs"], ref, "CP=4 from CP=2 storage")


def test_file_l3_written_at_cp2_restores_at_cp1_and_cp4(tmp_path):
    _cross_size(str(tmp_path / "l3"), "mla")


@pytest.mark.mooncake
def test_mooncake_l3_written_at_cp2_restores_at_cp1_and_cp4(mooncake_cluster):  # noqa: F811
    _cross_size(mooncake_cluster.url(timeout_s=5), "dsa")


def test_a_rank_dying_mid_transfer_is_named(tmp_path):
    base, prompts = _prompts(_vocab("tiny"))
    t0 = time.monotonic()
    outcomes = launch(2, die_mid_write, str(tmp_path / "l3"), prompts[:1], timeout=3, deadline=60)
    elapsed = time.monotonic() - t0
    assert outcomes[1].error == "process exited with code 17"
    assert outcomes[0].error_type == "RankError", outcomes[0].error
    assert "rank 1" in outcomes[0].error
    assert elapsed < 45  # spawn + imports + two timeouts, never a hang
