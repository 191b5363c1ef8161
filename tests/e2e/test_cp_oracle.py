"""The content oracle under context parallelism, in real processes (gloo on 127.0.0.1).

For the dense and DSA families at CP=2 and CP=4, MLA and compressed-index DSA at CP=2: the first run, a device hit and a host restore
give the tokens of a CP=1 cold run with logits within float32 tolerance, and the restored bytes
equal the ones first written. Fresh processes at the same CP size, and at other CP sizes (1 and 4) reading
the objects CP=2 wrote, restore from storage alone with the same outputs and bytes. Every turn
ends mid-page: a follow-up turn (prompt, answer, question) resumes from the valid partial tail
its first turn cached, restored from host and from storage (at CP 1, 2 and 4). A rank that
dies inside a storage write makes the other fail within the timeout, naming it. Cross-size
reuse runs on the file backend and on a real Mooncake Store.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from cp_oracle_child import PAGE, cold, die_mid_write, live, restore, restore_solo
from mooncake_harness import mooncake_cluster  # noqa: F401 - fixture

from kvtier.parallel.launch import launch, results

TOL = 1e-4


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


def _follow_ups(prompts: list[list[int]], ref: list[dict]) -> list[list[int]]:
    """Each prompt, its (cold) answer and a question: the first turn cached a partial tail
    that the follow-up matches whole and extends."""
    return [p + r["tokens"] + [7] for p, r in zip(prompts, ref, strict=True)]


def _tail_hit(outs: list[dict], tier: int) -> bool:
    """Whether some request resumed from a cached partial tail at ``tier`` (0 device, 1 host,
    2 storage): its cached length at that tier is not a whole number of pages."""
    return any(o["cached"][tier] % PAGE for o in outs)


# CP=4 restores of the MLA family run in the cross-size test below.
@pytest.mark.parametrize(
    ("family", "cp"),
    [("tiny", 2), ("tiny", 4), ("mla", 2), ("dsa", 2), ("dsa", 4), ("dsa-compressed", 2)],
)
def test_every_tier_matches_cp1_cold(tmp_path, family, cp):
    base, prompts = _prompts(_vocab(family))
    ref = cold(family, prompts)
    follow = _follow_ups(prompts, ref)
    ref_follow = cold(family, follow)
    store = str(tmp_path / "l3")
    ranks = results(launch(cp, live, family, store, prompts, base, follow, timeout=30))
    written = _union([r["rows"] for r in ranks])
    assert sorted(written) == list(range(100 // 16))  # every page of the prefix, once
    for r in ranks:
        _same(r["first"], ref, "first run")
        _same(r["device"], ref, "device hit")
        _same(r["host"], ref, "host restore")
        assert all(o["cached"][0] > 0 for o in r["device"])
        assert all(o["cached"][1] > 0 for o in r["host"])
        # The turns end mid-page: a follow-up resumes from its first turn's valid tail.
        _same(r["follow"], ref_follow, "follow-up from a host tail")
        assert _tail_hit(r["follow"], 1)
        assert _rows_equal(r["restored"], written) == len(r["rows"])
    # fresh processes at the same CP size restore from storage alone
    again = results(launch(cp, restore, family, store, prompts, base, follow, timeout=30))
    assert sum(_rows_equal(r["rows"], written) for r in again) == len(written)
    for r in again:
        _same(r["outs"], ref, "storage restore")
        _same(r["follow"], ref_follow, "follow-up from a storage tail")
        assert r["follow"][0]["cached"][2] > 0  # the first request after the restore
        assert _tail_hit(r["follow"], 2)


def _cross_size(store: str, family: str) -> None:
    base, prompts = _prompts(_vocab(family))
    ref = cold(family, prompts)
    follow = _follow_ups(prompts, ref)
    ref_follow = cold(family, follow)
    live_ranks = results(launch(2, live, family, store, prompts, base, follow))
    written = _union([r["rows"] for r in live_ranks])
    solo = restore_solo(family, store, prompts, base, follow)
    assert _rows_equal(solo["rows"], written) == len(written)
    _same(solo["outs"], ref, "CP=1 from CP=2 storage")
    _same(solo["follow"], ref_follow, "CP=1 follow-up from a CP=2 storage tail")
    assert solo["follow"][0]["cached"][2] > 0
    assert _tail_hit(solo["follow"], 2)
    four = results(launch(4, restore, family, store, prompts, base, follow, timeout=30))
    assert sum(_rows_equal(r["rows"], written) for r in four) == len(written)
    for r in four:
        _same(r["outs"], ref, "CP=4 from CP=2 storage")
        _same(r["follow"], ref_follow, "CP=4 follow-up from a CP=2 storage tail")
        assert _tail_hit(r["follow"], 2)


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
