"""Per-rank CP node metadata (seed 003): owned pages, host pages of the owned shard only, split
at page boundaries, zero-owned nodes; and the owner-preserving load allocation (seed 004)."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError, IntegrityError
from kvtier.parallel.alloc import (
    OwnerAllocator,
    load_nodes,
    load_shard,
    owned_count,
    verify_owners,
    write_shard,
)
from kvtier.parallel.layout import CPLayout
from kvtier.parallel.meta import CPNodeMeta
from kvtier.pools.allocator import PageAllocator

PS = 4
OWNERS = [0, 1, 0, 1, 0]  # round robin over 2 ranks, 5 pages


def test_build_derives_owned_pages_from_the_owners():
    m = CPNodeMeta.build(node=7, rank=1, page_size=PS, page_owners=OWNERS, host_pages=[10, 4])
    assert m.logical_len == 20 and m.num_pages == 5
    assert m.owned_pages.tolist() == [1, 3] and m.host_pages.tolist() == [10, 4]
    assert m.owned_positions().tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert m.owned_count == 2 and not m.zero_owned
    m.check(logical_len=20)
    with pytest.raises(IntegrityError, match="node 7 rank 1: metadata covers 20 tokens, the node"):
        m.check(logical_len=16)


def test_split_keeps_host_pages_with_their_owned_positions():
    m = CPNodeMeta.build(7, 1, PS, OWNERS, [10, 4])
    parent, child = m.split(2, parent_node=9)
    assert (parent.node, parent.logical_len) == (9, 8)
    assert parent.page_owners.tolist() == [0, 1]
    assert parent.owned_pages.tolist() == [1] and parent.host_pages.tolist() == [10]
    assert (child.node, child.logical_len) == (7, 12)
    assert child.page_owners.tolist() == [0, 1, 0]
    assert child.owned_pages.tolist() == [1] and child.host_pages.tolist() == [4]

    r0 = CPNodeMeta.build(7, 0, PS, OWNERS, [2, 5, 8])
    parent, child = r0.split(3, parent_node=9)
    assert parent.owned_pages.tolist() == [0, 2] and parent.host_pages.tolist() == [2, 5]
    assert child.owned_pages.tolist() == [1] and child.host_pages.tolist() == [8]


def test_split_with_every_owned_page_on_one_side():
    m = CPNodeMeta.build(3, 1, PS, [1, 1, 0, 0], [6, 2])
    parent, child = m.split(2, parent_node=4)
    assert parent.owned_pages.tolist() == [0, 1] and parent.host_pages.tolist() == [6, 2]
    assert child.zero_owned and child.host_pages.tolist() == [] and child.logical_len == 8


def test_zero_owned_node_records_the_node_without_host_pages():
    m = CPNodeMeta.build(5, 2, PS, [0, 1, 1, 0], [])
    assert m.zero_owned and m.owned_count == 0 and m.logical_len == 16
    assert m.owned_positions().tolist() == []
    parent, child = m.split(1, parent_node=6)
    assert parent.zero_owned and child.zero_owned
    assert (parent.logical_len, child.logical_len) == (4, 12)
    assert child.page_owners.tolist() == [1, 1, 0]


@pytest.mark.parametrize("at", [0, 5, -1, 6])
def test_split_outside_the_node_is_refused(at):
    m = CPNodeMeta.build(7, 1, PS, OWNERS, [10, 4])
    with pytest.raises(IntegrityError, match=f"node 7 rank 1: split at page {at} is not inside"):
        m.split(at, parent_node=9)


def test_split_needs_a_page_count():
    m = CPNodeMeta.build(7, 1, PS, OWNERS, [10, 4])
    with pytest.raises(IntegrityError, match="node 7 rank 1: split point must be a page count"):
        m.split(2.0, parent_node=9)  # type: ignore[arg-type]


def test_inconsistent_metadata_names_node_and_rank():
    with pytest.raises(IntegrityError, match="node 7 rank 1: 1 host pages for 2 owned pages"):
        CPNodeMeta.build(7, 1, PS, OWNERS, [10])
    with pytest.raises(IntegrityError, match="node 7 rank 0: host pages must be distinct"):
        CPNodeMeta.build(7, 0, PS, OWNERS, [3, 3, 1])
    m = CPNodeMeta.build(7, 1, PS, OWNERS, [10, 4])
    m.owned_pages = torch.tensor([1, 2])
    with pytest.raises(IntegrityError, match=r"node 7 rank 1: owned_pages \[1, 2\] disagree"):
        m.check()
    m = CPNodeMeta.build(7, 1, PS, OWNERS, [10, 4])
    m.logical_len = 18
    with pytest.raises(IntegrityError, match="node 7 rank 1: logical_len=18 is not 5 pages of 4"):
        m.check()
    m = CPNodeMeta.build(7, 1, PS, OWNERS, [10, 4])
    m.host_pages = m.host_pages.to(torch.int32)
    with pytest.raises(IntegrityError, match="node 7 rank 1: host_pages must be a 1-D int64 CPU"):
        m.check()


# -- owner-preserving load allocation (seed 004) ---------------------------------------------

ZIGZAG = [0, 1, 1, 0]  # zigzag over 2 ranks


def test_plain_allocation_is_refused_for_a_saved_owner_pattern():
    layout = CPLayout(2, 0, "zigzag")
    plain = PageAllocator(8).alloc(4)  # ids 0 1 2 3 → lanes 0 1 0 1
    assert plain is not None and layout.lanes(plain).tolist() == [0, 1, 0, 1]
    msg = (
        r"node 12 rank 0: page 2 was written by rank 1 but logical page 2 lives on rank 0 "
        r"\(pages \[2, 3\] misplaced\)"
    )
    with pytest.raises(IntegrityError, match=msg):
        verify_owners(layout, plain, torch.tensor(ZIGZAG), node=12)
    meta = CPNodeMeta.build(12, 0, PS, ZIGZAG, [5, 6])
    with pytest.raises(IntegrityError, match="node 12 rank 0: page 2 was written by rank 1"):
        load_shard(layout, meta, plain)


def test_owner_allocator_keeps_every_page_on_its_saved_owner():
    layout = CPLayout(2, 0, "zigzag")
    alloc = OwnerAllocator(layout, pages_per_rank=3)
    assert alloc.num_pages == 6
    pages = alloc.alloc(ZIGZAG)
    assert pages is not None and pages.tolist() == [0, 1, 3, 2]
    assert layout.lanes(pages).tolist() == ZIGZAG
    verify_owners(layout, pages, torch.tensor(ZIGZAG), node=12)
    assert (alloc.available(0), alloc.available(1)) == (1, 1)
    # Lane 1 is short by one: nothing is taken, and the shortfall names the lane.
    assert alloc.shortfall([1, 1]) == {1: 1}
    assert alloc.alloc([1, 1]) is None and alloc.available(1) == 1
    alloc.free(torch.tensor([3]))
    assert alloc.alloc([1, 1]).tolist() == [5, 3]  # freed ids go to the back of their lane
    with pytest.raises(IntegrityError, match="cp-device rank 0: free of page 3, which is not"):
        alloc.free(torch.tensor([0, 3, 3]))
    assert alloc.available(0) == 1  # the rejected batch changed nothing
    with pytest.raises(IntegrityError, match="cp-device rank 0: owner 2 outside a group of 2"):
        alloc.alloc([2])
    with pytest.raises(ConfigError, match="cp-device: pages_per_rank must be a positive integer"):
        OwnerAllocator(layout, pages_per_rank=0)


def test_write_then_load_moves_only_the_owned_shard():
    metas, copies = {}, {}
    for rank in (0, 1):
        layout = CPLayout(2, rank, "zigzag")
        alloc = OwnerAllocator(layout, pages_per_rank=4)
        pages = alloc.alloc(ZIGZAG)  # the same ids on both ranks: [0, 1, 3, 2]
        assert pages is not None and pages.tolist() == [0, 1, 3, 2]
        host = PageAllocator(4, name="host")
        meta, copy = write_shard(layout, 12, pages, ZIGZAG, host.alloc, PS)
        metas[rank], copies[rank] = meta, copy
    # Rank 0 owns pages 0 and 3 (logical 0, 2 → physical 0, 1), rank 1 pages 1, 2 (1, 3 → 0, 1).
    assert copies[0].positions.tolist() == [0, 3] and copies[0].device.tolist() == [0, 1]
    assert copies[1].positions.tolist() == [1, 2] and copies[1].device.tolist() == [0, 1]
    assert copies[0].host.tolist() == [0, 1] and metas[1].host_pages.tolist() == [0, 1]

    # Load into a fresh allocator whose lanes are partly used: ids differ, owners do not.
    for rank in (0, 1):
        layout = CPLayout(2, rank, "zigzag")
        alloc = OwnerAllocator(layout, pages_per_rank=4)
        alloc.alloc([0, 0, 1])
        pages, (copy,) = load_nodes(alloc, [metas[rank]])
        assert pages.tolist() == [4, 3, 5, 6] and layout.lanes(pages).tolist() == ZIGZAG
        assert copy.positions.tolist() == metas[rank].owned_pages.tolist()
        assert copy.host.tolist() == metas[rank].host_pages.tolist()
        assert copy.device.tolist() == ([2, 3] if rank == 0 else [1, 2])


def test_zero_owned_write_allocates_no_host_pages():
    layout = CPLayout(3, 2, "round_robin")
    calls: list[int] = []

    def alloc_host(n: int) -> torch.Tensor | None:
        calls.append(n)
        return torch.arange(n)

    owners = [0, 1]  # a two-page node: rank 2 owns nothing of it
    assert owned_count(layout, owners) == 0
    meta, copy = write_shard(layout, 4, torch.tensor([0, 1]), owners, alloc_host, PS)
    assert calls == [] and copy.noop and meta.zero_owned and meta.logical_len == 8
    pages, (load,) = load_nodes(OwnerAllocator(layout, 2), [meta])
    assert pages.tolist() == [0, 1] and load.noop


def test_write_reports_a_short_host_pool_by_physical_pages():
    layout = CPLayout(2, 1, "round_robin")
    assert owned_count(layout, [0, 1, 0, 1]) == 2
    out = write_shard(layout, 4, torch.tensor([0, 1, 2, 3]), [0, 1, 0, 1], lambda n: None, PS)
    assert out is None


def test_load_of_several_nodes_splits_the_allocation_per_node():
    layout = CPLayout(2, 1, "zigzag")
    a = CPNodeMeta.build(1, 1, PS, [0, 1], [7])
    b = CPNodeMeta.build(2, 1, PS, [1, 0, 0], [3])
    alloc = OwnerAllocator(layout, pages_per_rank=3)
    pages, copies = load_nodes(alloc, [a, b])
    assert pages.tolist() == [0, 1, 3, 2, 4]
    assert [(c.node, c.positions.tolist(), c.device.tolist(), c.host.tolist()) for c in copies] == [
        (1, [1], [0], [7]),
        (2, [0], [1], [3]),
    ]
    assert load_nodes(alloc, [a]) is None and alloc.shortfall([0, 1]) == {0: 1}
    with pytest.raises(IntegrityError, match="node 1 rank 0: metadata belongs to rank 1"):
        load_shard(CPLayout(2, 0, "zigzag"), a, torch.tensor([0, 1]))
