"""CP readiness and decisions by MIN over ranks: pages owned elsewhere count as ready, zero-owned
ranks never hold the group back; a rank that does not join fails the others with its name. Ranks
run as threads (``LocalWorld``) and as two gloo processes."""

from __future__ import annotations

import json

import cp_gloo_child
import pytest
import torch.multiprocessing as mp

from kvtier.errors import ConfigError, IntegrityError
from kvtier.parallel.acks import all_ranks, ready_pages, usable_prefix
from kvtier.parallel.group import GlooGroup, LocalGroup, LocalWorld, RankError, SoloGroup
from kvtier.parallel.ports import free_port


def test_decisions_agree_by_min():
    def rank_body(g: LocalGroup) -> list:
        return [
            g.all_reduce_min([5, 3, 9][g.rank]),
            all_ranks(g, True),
            all_ranks(g, g.rank != 1),
            usable_prefix(g, [4, 2, 4][g.rank]),
        ]

    assert LocalWorld(3).run(rank_body) == [[3, True, False, 2]] * 3


def test_ready_pages_count_pages_owned_elsewhere_as_ready():
    owners = [0, 1, 1, 0, 1]
    assert ready_pages(0, owners, [True, False, False, False, False]) == 3
    assert ready_pages(1, owners, [False, True, False, False, False]) == 2
    assert ready_pages(2, owners, [False] * 5) == 5  # owns nothing: never holds the group back
    with pytest.raises(IntegrityError, match="rank 0: -1 ready pages"):
        usable_prefix(SoloGroup(), -1)


def test_a_rank_that_never_joins_is_named():
    world = LocalWorld(3, timeout=0.2)

    def rank_body(g: LocalGroup) -> int:
        if g.rank == 2:
            return -1  # dead before the collective
        return g.all_reduce_min(g.rank)

    with pytest.raises(RankError, match=r"rank 0: rank\(s\) \[2\] did not join all_reduce_min #0"):
        world.run(rank_body)


def test_gloo_group_needs_torch_distributed():
    with pytest.raises(ConfigError, match="GlooGroup: torch.distributed is not initialised"):
        GlooGroup()


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "timeout"), [("dead", 5.0), ("stuck", 1.0)])
def test_two_gloo_processes_agree_and_a_lost_rank_is_named(tmp_path, mode, timeout):
    args = (free_port(), str(tmp_path), mode, timeout)
    ctx = mp.spawn(cp_gloo_child.worker, args=args, nprocs=2, join=False)
    for p in ctx.processes:
        p.join(timeout=60)
    stuck = [p for p in ctx.processes if p.is_alive()]
    for p in stuck:
        p.kill()
    assert not stuck, "a rank hung"
    assert [p.exitcode for p in ctx.processes] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["mins"] == r1["mins"] == [3, 2, 4]
    # Rank 0's own pages landed (5 ready); rank 1 waits on page 2 (2 ready): MIN 2 everywhere.
    assert (r0["ready"], r1["ready"]) == (5, 2)
    assert r0["usable"] == r1["usable"] == 2
    assert r0["all"] == r1["all"] == [True, False]
    assert r0["error"]["ranks"] == [1]
    assert f"rank 0: rank 1 did not join all_reduce_min within {timeout}s" in r0["error"]["message"]
    # A dead peer is noticed when its connection closes; a stuck one after the timeout.
    assert r0["waited"] < timeout + 2
    if mode == "stuck":
        assert r0["waited"] >= timeout * 0.9
