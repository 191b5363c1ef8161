"""CP acknowledgements: one ack per node on every rank, completed no-op acks on zero-owned ranks,
retirement by MIN over ranks; a rank that does not join fails the others with its name. Ranks
run as threads (``LocalWorld``) and as two gloo processes."""

from __future__ import annotations

import json
import socket

import cp_gloo_child
import pytest
import torch.multiprocessing as mp

from kvtier.errors import ConfigError, IntegrityError
from kvtier.parallel.acks import AckQueue, agree_min, all_ranks, ready_pages, usable_prefix
from kvtier.parallel.group import GlooGroup, LocalGroup, LocalWorld, RankError, SoloGroup


@pytest.mark.parametrize("kind", ["write", "load"])
def test_zero_owned_ranks_ack_and_retirement_is_the_min_over_ranks(kind):
    # Node 1 owned by rank 0 only, node 2 by rank 1 only, node 3 by both.
    owned = {0: {1: 2, 2: 0, 3: 1}, 1: {1: 0, 2: 3, 3: 1}}

    def rank_body(g: LocalGroup) -> dict:
        q = AckQueue(g, kind)
        acks = {node: q.open(node, pages) for node, pages in owned[g.rank].items()}
        out = {"noop": [n for n, a in acks.items() if a.done], "pending": q.pending}
        steps = []
        for finish in ({0: 1}, {1: 2}, {}, {0: 3, 1: 3}):
            if g.rank in finish:
                q.complete(acks[finish[g.rank]])
            steps.append([a.node for a in q.agree()])
        out["steps"], out["left"] = steps, q.pending
        return out

    r0, r1 = LocalWorld(2).run(rank_body)
    assert r0["noop"] == [2] and r1["noop"] == [1]
    assert r0["pending"] == r1["pending"] == 3  # the same ack count on every rank
    # Step 1: rank 0 has 1 done + 2 no-op, rank 1 has 1 no-op: MIN 1 → node 1 retires.
    assert r0["steps"] == r1["steps"] == [[1], [2], [], [3]]
    assert r0["left"] == r1["left"] == 0


def test_an_ack_per_node_and_completion_once():
    q = AckQueue(SoloGroup(), "load")
    a = q.open(8, 2)
    assert (a.seq, a.node, a.pages, a.done) == (0, 8, 2, False)
    with pytest.raises(IntegrityError, match="node 8 rank 0: a load ack is already pending"):
        q.open(8, 1)
    q.complete(a)
    with pytest.raises(IntegrityError, match="node 8 rank 0: load ack seq 0 completed twice"):
        q.complete(a)
    assert [x.node for x in q.agree()] == [8]
    b = q.open(8, 0)  # retired: the node may be copied again, here as a no-op
    assert (b.seq, b.done) == (1, True)
    with pytest.raises(IntegrityError, match="rank 0: ack kind 'read' not in"):
        AckQueue(SoloGroup(), "read")


def test_a_rank_that_skipped_an_ack_is_caught():
    def rank_body(g: LocalGroup) -> None:
        q = AckQueue(g, "write")
        q.open(1, 0)
        if g.rank == 0:
            q.open(2, 0)  # rank 1 never opens node 2's ack
        q.agree()

    with pytest.raises(IntegrityError, match="rank 0: 2 pending write acks here, between 1 and 2"):
        LocalWorld(2).run(rank_body)


def test_ranks_acking_other_nodes_are_caught():
    def rank_body(g: LocalGroup) -> None:
        q = AckQueue(g, "load")
        for node in [(1, 2), (2, 1)][g.rank]:  # same count, other order
            q.open(node, 0)
        q.agree()

    with pytest.raises(IntegrityError, match=r"rank 0: the 2 pending load acks name other nodes"):
        LocalWorld(2).run(rank_body)


def test_decisions_agree_by_min():
    def rank_body(g: LocalGroup) -> list:
        return [
            agree_min(g, [5, 3, 9][g.rank]),
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("mode", "timeout"), [("dead", 5.0), ("stuck", 1.0)])
def test_two_gloo_processes_agree_and_a_lost_rank_is_named(tmp_path, mode, timeout):
    args = (_free_port(), str(tmp_path), mode, timeout)
    ctx = mp.spawn(cp_gloo_child.worker, args=args, nprocs=2, join=False)
    for p in ctx.processes:
        p.join(timeout=60)
    stuck = [p for p in ctx.processes if p.is_alive()]
    for p in stuck:
        p.kill()
    assert not stuck, "a rank hung"
    assert [p.exitcode for p in ctx.processes] == [0, 0]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # [pages moved, done at creation, host pages]: the zero-owned rank acks with a no-op.
    assert r0["pages"] == {"1": [2, False, [0, 1]], "2": [0, True, []], "3": [1, False, [2]]}
    assert r1["pages"] == {"1": [0, True, []], "2": [1, False, [0]], "3": [1, False, [1]]}
    assert r0["retired"] == r1["retired"] == [[1], [2], [3]]
    assert r0["usable"] == r1["usable"] == 1
    assert r0["all"] == r1["all"] == [True, False]
    assert r0["error"]["ranks"] == [1]
    assert f"rank 0: rank 1 did not join all_reduce_min within {timeout}s" in r0["error"]["message"]
    # A dead peer is noticed when its connection closes; a stuck one after the timeout.
    assert r0["waited"] < timeout + 2
    if mode == "stuck":
        assert r0["waited"] >= timeout * 0.9
