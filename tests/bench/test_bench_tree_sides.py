"""``kvtier bench tree``'s per-process scenarios, shrunk (the peer is optional)."""

from __future__ import annotations

import sys

import pytest

from kvtier.bench.tree_peer import bench_tree_sides
from kvtier.errors import ConfigError

OPS = (
    "long_insert_32k",
    "long_match_hit_32k",
    "long_match_diverge_16k",
    "long_match_lock_unlock_32k",
    "chat_evict_256",
    "chat_insert_768",
    "chat_match_768",
    "chat_match_lock_unlock_768",
)


@pytest.mark.slow
def test_kvtier_side_reports_every_scenario_and_its_memory() -> None:
    out = bench_tree_sides(rounds=1, scale=64)
    assert sorted(out["kvtier"]) == sorted(OPS)
    assert all(v > 0 for v in out["kvtier"].values())
    assert "speedup" not in out and "sglang" not in out
    for scenario in ("long", "chat"):
        mem = out["kvtier_memory"][scenario]
        # 4 bytes a token (int32) plus per-node overhead, far below a tuple of ints.
        assert 4 <= mem["traced_bytes_per_token"] < 20


def test_each_side_gets_the_same_tokens_in_its_engines_container() -> None:
    from kvtier.bench import tree_sides as ts
    from kvtier.engine.request import Request
    from kvtier.engine.sampling import SamplingParams

    req = Request(0, [1, 2], SamplingParams(), 0.0, None)
    assert ts.KvtierSide.TYPECODE == req.tokens.typecode == "i"
    assert ts.SglangSide.TYPECODE == "q"
    parts = [ts.Workload(3).draw(100), ts.Workload(4).draw(28)]
    mine, theirs = ts.packed(*parts, code="i"), ts.packed(*parts, code="q")
    assert (mine.itemsize, theirs.itemsize) == (4, 8)
    assert mine.tolist() == theirs.tolist() == [int(x) for p in parts for x in p]


@pytest.mark.slow
def test_a_peer_interpreter_without_sglang_fails_loudly() -> None:
    with pytest.raises(RuntimeError, match="sglang long exited"):
        bench_tree_sides(peer_python=sys.executable, rounds=1, scale=64)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError):
        bench_tree_sides(rounds=0)
