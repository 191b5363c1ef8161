"""Per-rank CP node metadata (seed 003): owned pages, host pages of the owned shard only, split
at page boundaries, zero-owned nodes; and the owner-preserving load allocation (seed 004)."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import IntegrityError
from kvtier.parallel.alloc import verify_owners
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
    with pytest.raises(IntegrityError, match="node 5 rank 0: 3 logical pages for 4 saved owners"):
        verify_owners(layout, torch.tensor([0, 1, 3]), torch.tensor(ZIGZAG), node=5)


def test_a_lane_blind_allocation_is_refused():
    alloc = PageAllocator(8, lanes=2)
    with pytest.raises(IntegrityError, match="plain allocation of 2 pages ignores which rank"):
        alloc.alloc(2)
    assert alloc.available == 8  # nothing taken


def test_lane_allocation_keeps_every_page_on_its_saved_owner():
    for rank in (0, 1):
        layout = CPLayout(2, rank, "zigzag")
        alloc = PageAllocator(3 * layout.cp_size, lanes=layout.cp_size)
        pages = alloc.alloc_owned(ZIGZAG)  # the same ids on every rank
        assert pages is not None and pages.tolist() == [0, 1, 3, 2]
        assert layout.lanes(pages).tolist() == ZIGZAG
        verify_owners(layout, pages, torch.tensor(ZIGZAG), node=12)


def test_a_saved_node_loads_on_its_owners_into_partly_used_lanes():
    layout = CPLayout(2, 1, "zigzag")
    meta = CPNodeMeta.build(12, 1, PS, ZIGZAG, [5, 6])
    alloc = PageAllocator(8, lanes=2)
    alloc.alloc_owned([0, 0, 1])  # takes 0, 2 and 1
    pages = alloc.alloc_owned(meta.page_owners.tolist())
    assert pages is not None and pages.tolist() == [4, 3, 5, 6]  # ids differ, owners do not
    verify_owners(layout, pages, meta.page_owners, meta.node)
    assert layout.physical(pages[meta.owned_pages]).tolist() == [1, 2]
    # A lane short of pages: nothing is taken and the shortfall names the lane.
    assert alloc.shortfall(meta.page_owners.tolist()) == {0: 2, 1: 1}
    assert alloc.alloc_owned(meta.page_owners.tolist()) is None and alloc.available == 1


@pytest.mark.parametrize(("cp", "pattern"), [(2, "round_robin"), (3, "zigzag"), (4, "zigzag")])
@pytest.mark.parametrize("at", [1, 3, 6])
def test_a_tree_split_keeps_each_ranks_record_equal_to_the_seeds_split(cp, pattern, at):
    """A node with host copies on every rank's lane, starting mid-sequence, split in the tree:
    the records each rank derives from the two halves are the seed's ``CPNodeMeta.split`` of
    the record before."""
    from kvtier.parallel.alloc import node_meta
    from kvtier.tree import RadixTree

    layouts = [CPLayout(cp, r, pattern) for r in range(cp)]
    owners = layouts[0].owners(0, 9)
    host = torch.tensor([o + cp * (20 + i) for i, o in enumerate(owners)], dtype=torch.int64)
    tree = RadixTree(PS)
    tokens = list(range(9 * PS))
    tree.insert(tokens[: 2 * PS], host[:2], tier="host")
    tree.insert(tokens, host, tier="host")
    node = tree.match(tokens).path[-1]
    assert node.num_tokens == 7 * PS and node.depth_tokens() == 9 * PS
    before = [node_meta(node, lay, PS) for lay in layouts]
    assert sum(m.owned_count for m in before) == 7  # every page on exactly one rank
    parent = tree.split(node, at)
    tree.check_integrity()
    for lay, m in zip(layouts, before, strict=True):
        want_parent, want_child = m.split(at, parent_node=parent.id)
        for want, got in (
            (want_parent, node_meta(parent, lay, PS)),
            (want_child, node_meta(node, lay, PS)),
        ):
            assert got is not None and (got.node, got.logical_len) == (want.node, want.logical_len)
            assert got.page_owners.tolist() == want.page_owners.tolist()
            assert got.owned_pages.tolist() == want.owned_pages.tolist(), (lay.rank, got, want)
            assert got.host_pages.tolist() == want.host_pages.tolist(), (lay.rank, got, want)
