"""RadixTree bookkeeping with page_size 4: literal page ids, split shapes, eviction order."""

from __future__ import annotations

import pytest
import torch

from kvtier.errors import ConfigError, IntegrityError
from kvtier.keys import chain_keys, namespace_digest
from kvtier.tree import Node, RadixTree, make_policy

PS = 4


def P(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def L(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else t.tolist()


def page(v: int) -> list[int]:
    """One page of tokens all equal to ``v``."""
    return [v] * PS


def seq(*vals: int) -> list[int]:
    out: list[int] = []
    for v in vals:
        out += page(v)
    return out


def flat(parts: list[torch.Tensor]) -> list[int]:
    return [p for t in parts for p in t.tolist()]


def snapshot(tree: RadixTree) -> list[tuple]:
    return sorted(
        (
            n.id,
            n.parent.id if n.parent is not None else None,
            n.tokens,
            L(n.device),
            L(n.host),
            n.lock_ref,
            n.device_io,
            n.host_io,
            n.last_access,
            n.hits,
        )
        for n in tree.nodes()
    )


def find(tree: RadixTree, tokens: list[int]) -> Node:
    """The node whose path from the root spells exactly ``tokens``."""
    for n in tree.nodes():
        parts, cur = [], n
        while cur is not None and cur is not tree.root:
            parts.append(cur.tokens)
            cur = cur.parent
        if tuple(t for p in reversed(parts) for t in p) == tuple(tokens):
            return n
    raise AssertionError(f"no node spelling {tokens}")


@pytest.fixture
def tree() -> RadixTree:
    return RadixTree(PS)


# ---- match -----------------------------------------------------------------------------


def test_match_on_empty_tree(tree: RadixTree) -> None:
    for q in ([], [1, 2, 3], seq(1, 2)):
        m = tree.match(q)
        assert m.path == [] and m.node is None
        assert (m.last_pages, m.device_len, m.host_len, m.matched_len) == (0, 0, 0, 0)
    assert tree.lock(tree.match(seq(1))) is tree.root
    assert list(tree.nodes()) == []
    tree.check_integrity()


def test_insert_then_match_full_and_partial(tree: RadixTree) -> None:
    tokens = list(range(8))
    out = tree.insert(tokens, P(10, 11))
    assert out.cached_len == 0 and L(out.duplicates) == []
    (node,) = out.taken
    assert out.last is node
    assert node.tokens == tuple(tokens) and L(node.device) == [10, 11] and node.host is None
    assert node.parent is tree.root and tree.root.children == {(0, 1, 2, 3): node}
    tree.check_integrity()

    m = tree.match(tokens)
    assert (m.device_len, m.host_len, m.last_pages) == (8, 0, 2) and m.path == [node]
    m = tree.match(tokens[:7])  # stops at the page boundary
    assert (m.device_len, m.host_len, m.last_pages) == (4, 0, 1) and m.path == [node]
    m = tree.match(tokens + [8, 9, 10, 11, 12])  # longer query, trailing partial page
    assert (m.device_len, m.host_len, m.last_pages) == (8, 0, 2)
    m = tree.match([0, 1, 2, 3, 9, 9, 9, 9])  # diverges in the second page
    assert (m.device_len, m.last_pages) == (4, 1)
    m = tree.match([0, 1, 2, 9, 4, 5, 6, 7])  # diverges inside the first page
    assert m.matched_len == 0 and m.path == []
    assert tree.match(tokens[:3]).matched_len == 0
    tree.check_integrity()


def test_match_never_mutates(tree: RadixTree) -> None:
    tree.insert(seq(1, 2, 3), P(0, 1, 2))
    tree.insert(seq(1, 5), P(9, 3))  # splits [1,2,3] into [1] + [2,3]
    tree.insert(seq(7, 8), P(20, 21), tier="host")
    tree.check_integrity()
    before = snapshot(tree)
    n_nodes = len(before)
    for q in (seq(1, 2), seq(1, 2, 3, 4), seq(1, 5), seq(7), seq(7, 8, 9), seq(1, 2, 9)):
        m = tree.match(q)
        assert m.matched_len > 0
    m = tree.match(seq(1, 2))  # partial match of the [2,3] node does not split it
    assert m.last_pages == 1 and m.node.num_pages(PS) == 2
    assert snapshot(tree) == before and len(list(tree.nodes())) == n_nodes
    tree.check_integrity()


def test_match_reports_device_then_host(tree: RadixTree) -> None:
    tree.insert(seq(1, 2), P(0, 1))
    ext = tree.insert(seq(3, 4), P(50, 51), tier="host", start=find(tree, seq(1, 2)))
    assert ext.cached_len == 0
    m = tree.match(seq(1, 2, 3, 4, 5))
    assert (m.device_len, m.host_len, m.matched_len) == (8, 8, 16)
    m = tree.match(seq(1, 2, 3, 6))
    assert (m.device_len, m.host_len, m.last_pages) == (8, 4, 1)
    tree.check_integrity()


# ---- lock / split ----------------------------------------------------------------------


def test_lock_splits_partially_matched_node(tree: RadixTree) -> None:
    calls: list[tuple[Node, Node, int]] = []
    tree.split_hooks.append(lambda pre, suf, n: calls.append((pre, suf, n)))
    tree.insert(seq(1, 2, 3), P(10, 11, 12))
    x = find(tree, seq(1, 2, 3))
    child = tree.insert(seq(1, 2, 3, 4), P(90, 91, 92, 13)).taken[0]
    assert child.parent is x and L(child.device) == [13]
    x.host = P(70, 71, 72)
    ids_before = {n.id for n in tree.nodes()}

    m = tree.match(seq(1, 2, 9))
    assert m.path == [x] and m.last_pages == 2 and m.device_len == 8
    locked = tree.lock(m)
    tree.check_integrity()

    assert locked is not x and locked.id not in ids_before
    assert m.path == [locked] and m.last_pages == 2
    # the prefix is the new parent
    assert locked.parent is tree.root and tree.root.children == {tuple(page(1)): locked}
    assert locked.tokens == tuple(seq(1, 2))
    assert L(locked.device) == [10, 11] and L(locked.host) == [70, 71]
    assert locked.children == {tuple(page(3)): x}
    # the suffix keeps its object and children
    assert x.parent is locked and x.tokens == tuple(page(3))
    assert L(x.device) == [12] and L(x.host) == [72]
    assert x.children == {tuple(page(4)): child} and child.parent is x
    assert (locked.lock_ref, x.lock_ref, child.lock_ref) == (1, 0, 0)
    assert calls == [(locked, x, 2)]

    tree.unlock(locked)
    assert locked.lock_ref == 0
    tree.check_integrity()


def test_lock_full_match_does_not_split(tree: RadixTree) -> None:
    tree.insert(seq(1, 2), P(0, 1))
    a = find(tree, seq(1, 2))
    b = tree.insert(seq(1, 2, 3), P(5, 6, 2)).taken[0]
    calls: list = []
    tree.split_hooks.append(lambda *args: calls.append(args))
    n = len(list(tree.nodes()))
    locked = tree.lock(tree.match(seq(1, 2, 3, 4)))
    assert locked is b and len(list(tree.nodes())) == n and calls == []
    assert (a.lock_ref, b.lock_ref) == (1, 1)
    assert a.hits == b.hits == 1 and a.last_access == b.last_access
    tree.check_integrity()
    locked2 = tree.lock(tree.match(seq(1, 2, 7)))
    assert locked2 is a and (a.lock_ref, b.lock_ref) == (2, 1)
    tree.unlock(b)
    tree.unlock(a)
    assert (a.lock_ref, b.lock_ref) == (0, 0)
    tree.check_integrity()


def test_unlock_below_zero_raises(tree: RadixTree) -> None:
    node = tree.insert(seq(1), P(0)).last
    with pytest.raises(IntegrityError, match="unlock below zero"):
        tree.unlock(node)
    tree.lock(tree.match(seq(1)))
    tree.unlock(node)
    with pytest.raises(IntegrityError, match="below zero"):
        tree.unlock(node)
    tree.unlock(tree.root)  # the root is never counted
    tree.check_integrity()


def test_lock_of_detached_node_raises(tree: RadixTree) -> None:
    tree.insert(seq(1), P(0))
    m = tree.match(seq(1))
    tree.evict_device(1)
    with pytest.raises(IntegrityError, match="detached"):
        tree.lock(m)


def test_split_hooks_called_by_insert(tree: RadixTree) -> None:
    calls: list[tuple[int, int, int]] = []
    tree.split_hooks.append(lambda pre, suf, n: calls.append((pre.id, suf.id, n)))
    a = tree.insert(seq(1, 2, 3, 4), P(0, 1, 2, 3)).last
    out = tree.insert(seq(1, 2, 3, 9), P(4, 5, 6, 7))
    (pre,) = [n for n in tree.nodes() if n.tokens == tuple(seq(1, 2, 3))]
    assert calls == [(pre.id, a.id, 3)]
    assert L(out.duplicates) == [4, 5, 6] and out.cached_len == 12
    tree.insert(seq(1, 7), P(8, 9))
    (pre2,) = [n for n in tree.nodes() if n.tokens == tuple(page(1))]
    assert calls[1] == (pre2.id, pre.id, 1) and len(calls) == 2
    tree.check_integrity()


# ---- insert ----------------------------------------------------------------------------


def test_insert_returns_cached_len_and_duplicates(tree: RadixTree) -> None:
    tree.insert(seq(1, 2), P(10, 11))
    out = tree.insert(seq(1, 2, 3, 4), P(20, 21, 22, 23))
    assert out.cached_len == 8 and L(out.duplicates) == [20, 21]
    (new,) = out.taken
    assert out.last is new and L(new.device) == [22, 23] and new.tokens == tuple(seq(3, 4))
    # a partial duplicate splits
    out = tree.insert(seq(1, 2, 3, 5), P(30, 31, 32, 33))
    assert out.cached_len == 12 and L(out.duplicates) == [30, 31, 32]
    assert L(find(tree, seq(1, 2, 3)).device) == [22]
    assert L(find(tree, seq(1, 2, 3, 4)).device) == [23]
    assert L(find(tree, seq(1, 2, 3, 5)).device) == [33]
    # everything cached
    out = tree.insert(seq(1, 2, 3), P(40, 41, 42))
    assert out.cached_len == 12 and L(out.duplicates) == [40, 41, 42] and out.taken == []
    assert out.last is find(tree, seq(1, 2, 3))
    # empty insert
    out = tree.insert([], P())
    assert out.cached_len == 0 and L(out.duplicates) == [] and out.last is tree.root
    assert sorted(tree.held_pages("device").tolist()) == [10, 11, 22, 23, 33]
    tree.check_integrity()


def test_insert_rejects_wrong_shapes(tree: RadixTree) -> None:
    with pytest.raises(IntegrityError, match="page_size=4"):
        tree.insert([1, 2, 3], P())
    with pytest.raises(IntegrityError):
        tree.insert(seq(1, 2), P(0))
    with pytest.raises(IntegrityError, match="unknown tier"):
        tree.insert(seq(1), P(0), tier="disk")


def test_insert_device_adopts_host_only_nodes(tree: RadixTree) -> None:
    h = tree.insert(seq(1, 2), P(5, 6), tier="host")
    (hnode,) = h.taken
    assert hnode.device is None and L(hnode.host) == [5, 6]
    m = tree.match(seq(1, 2))
    assert (m.device_len, m.host_len) == (0, 8)

    out = tree.insert(seq(1, 2, 3), P(30, 31, 32))
    assert out.cached_len == 0 and L(out.duplicates) == []
    assert len(out.taken) == 2 and out.taken[0] is hnode
    assert L(hnode.device) == [30, 31] and L(hnode.host) == [5, 6]
    assert L(out.taken[1].device) == [32] and out.taken[1].host is None
    assert out.taken[1].parent is hnode
    m = tree.match(seq(1, 2, 3))
    assert (m.device_len, m.host_len) == (12, 0)
    tree.check_integrity()


def test_insert_adopts_into_split_host_node(tree: RadixTree) -> None:
    tree.insert(seq(1, 2, 3), P(5, 6, 7), tier="host")
    out = tree.insert(seq(1, 9), P(40, 41))
    pre, suf = find(tree, seq(1)), find(tree, seq(1, 2, 3))
    assert out.taken[0] is pre and out.cached_len == 0 and L(out.duplicates) == []
    assert (L(pre.device), L(pre.host)) == ([40], [5])
    assert (suf.device, L(suf.host)) == (None, [6, 7])
    assert L(find(tree, seq(1, 9)).device) == [41]
    tree.check_integrity()


def test_cached_len_counts_only_the_leading_prefix(tree: RadixTree) -> None:
    tree.insert(seq(1, 2, 3), P(0, 1, 2))
    tree.insert(seq(1), P(50), tier="host")  # splits [1,2,3] into [1] + [2,3]
    tree.insert(seq(1, 2, 3), P(7, 8, 9), tier="host")  # [2,3] adopts, then split it
    tree.insert(seq(1, 2, 4), P(7, 8, 3))
    a, b = find(tree, seq(1, 2)), find(tree, seq(1, 2, 3))
    assert (L(a.host), L(b.host)) == ([8], [9])
    a.host = None  # [2] keeps only its device copy; [1] and [3] have host copies
    tree.check_integrity()
    out = tree.insert(seq(1, 2, 3), P(60, 61, 62), tier="host")
    assert out.cached_len == 4 and L(out.duplicates) == [60, 62]
    assert out.taken == [a] and L(a.host) == [61] and out.last is b
    tree.check_integrity()


def test_insert_device_mixed_cached_adopted_new(tree: RadixTree) -> None:
    tree.insert(seq(1), P(1))
    n0 = find(tree, seq(1))
    out = tree.insert(seq(1, 2), P(50, 51), tier="host")
    assert out.cached_len == 0 and L(out.duplicates) == []
    assert L(n0.host) == [50] and len(out.taken) == 2
    out = tree.insert(seq(1, 2, 3), P(60, 61, 62))
    assert out.cached_len == 4 and L(out.duplicates) == [60]
    n1 = find(tree, seq(1, 2))
    assert out.taken[0] is n1 and (L(n1.device), L(n1.host)) == ([61], [51])
    assert L(out.taken[1].device) == [62]
    tree.check_integrity()


def test_insert_host_from_start_node(tree: RadixTree) -> None:
    tree.insert(seq(1, 2), P(0, 1))
    start = tree.lock(tree.match(seq(1, 2)))
    out = tree.insert(seq(3, 4), P(50, 51), tier="host", start=start)
    assert out.cached_len == 0 and L(out.duplicates) == []
    (ext,) = out.taken
    assert ext.parent is start and ext.tokens == tuple(seq(3, 4))
    assert ext.device is None and L(ext.host) == [50, 51]
    # same tokens again from the same start: cached_len is relative to the start
    out = tree.insert(seq(3, 4, 5), P(60, 61, 62), tier="host", start=start)
    assert out.cached_len == 8 and L(out.duplicates) == [60, 61]
    assert L(out.taken[0].host) == [62] and out.taken[0].parent is ext
    # from a start inside the path, with a split
    out = tree.insert(seq(3, 7), P(70, 71), tier="host", start=start)
    assert out.cached_len == 4 and L(out.duplicates) == [70]
    assert L(find(tree, seq(1, 2, 3)).host) == [50]
    assert L(find(tree, seq(1, 2, 3, 7)).host) == [71]
    m = tree.match(seq(1, 2, 3, 4, 5))
    assert (m.device_len, m.host_len) == (8, 12)
    tree.unlock(start)
    tree.check_integrity()


def test_insert_last_is_the_end_of_the_inserted_path(tree: RadixTree) -> None:
    anchor = tree.insert(seq(1), P(1)).last
    assert anchor.tokens == tuple(page(1)) and anchor.parent is tree.root
    # successive inserts continue from the previous one's ``last``, as a chunked commit does
    for i, v in enumerate((2, 3, 4)):
        out = tree.insert(seq(v), P(50 + i), tier="host", start=anchor)
        assert out.last is out.taken[0] and out.last.parent is anchor
        assert out.last.tokens == tuple(page(v))
        anchor = out.last
    m = tree.match(seq(1, 2, 3, 4))
    assert (m.device_len, m.host_len) == (4, 12)
    assert tree.match(seq(1, 3)).matched_len == 4
    # a split inside the path: ``last`` is the new prefix, which ends where the tokens end
    out = tree.insert(seq(1, 2), P(9, 8))
    assert out.last is find(tree, seq(1, 2)) and out.last.depth_tokens() == 8
    tree.check_integrity()


def test_insert_with_keys_marks_storage(tree: RadixTree) -> None:
    ns = namespace_digest(
        model_fingerprint="m",
        dtype="bf16",
        page_size=PS,
        tree_page_size=PS,
        components=["kv"],
        rank=0,
        world_size=1,
    )
    keys = chain_keys(ns, seq(1, 2, 3), PS)
    out = tree.insert(seq(1, 2, 3), P(5, 6, 7), tier="host", keys=keys)
    (n,) = out.taken
    assert n.in_storage and n.keys == keys
    tree.insert(seq(1, 9), P(0, 1))
    pre, suf = find(tree, seq(1)), find(tree, seq(1, 2, 3))
    assert pre.keys == keys[:1] and suf.keys == keys[1:] and pre.in_storage and suf.in_storage
    assert not find(tree, seq(1, 9)).in_storage
    tree.check_integrity()


# ---- keys ------------------------------------------------------------------------------


NS = namespace_digest(
    model_fingerprint="tiny",
    dtype="float32",
    page_size=PS,
    tree_page_size=PS,
    components=["kv"],
    rank=0,
    world_size=1,
)


def test_ensure_keys_matches_chain_keys(tree: RadixTree) -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    node = tree.insert(tokens, P(0, 1, 2)).last
    assert tree.ensure_keys(node, NS) == chain_keys(NS, tokens, PS)
    # a branch node chains after its parent's last key
    branch = tokens[:8] + [7, 7, 7, 7, 0, 0, 0, 0]
    b = tree.insert(branch, P(9, 9, 3, 4)).last
    assert tree.ensure_keys(b, NS) == chain_keys(NS, branch, PS)[2:]
    pre = find(tree, tokens[:8])
    assert pre.keys == chain_keys(NS, tokens, PS)[:2]
    assert node.keys == chain_keys(NS, tokens, PS)[2:]
    # different namespaces never share keys
    ns2 = namespace_digest(
        model_fingerprint="tiny",
        dtype="float32",
        page_size=PS,
        tree_page_size=PS,
        components=["kv"],
        rank=0,
        world_size=1,
        tenant_salt="t",
    )
    t2 = RadixTree(PS)
    n2 = t2.insert(tokens, P(0, 1, 2)).last
    assert set(t2.ensure_keys(n2, ns2)).isdisjoint(chain_keys(NS, tokens, PS))
    tree.check_integrity()


def test_ensure_keys_after_split_without_precomputed_keys(tree: RadixTree) -> None:
    tokens = list(range(16))
    node = tree.insert(tokens, P(0, 1, 2, 3)).last
    tree.lock(tree.match(tokens[:8] + [99] * 4))  # splits before any key exists
    assert node.keys is None and node.tokens == tuple(range(8, 16))
    assert tree.ensure_keys(node, NS) == chain_keys(NS, tokens, PS)[2:]
    assert node.parent.keys == chain_keys(NS, tokens, PS)[:2]
    tree.check_integrity()


# ---- device eviction -------------------------------------------------------------------


def three_branches(tree: RadixTree) -> tuple[Node, Node, Node, Node]:
    """Trunk [0] (page 1) with leaves [1] (10), [2] (20), [3] (30)."""
    assert tree.insert(seq(0, 1), P(1, 10)).cached_len == 0
    assert L(tree.insert(seq(0, 2), P(2, 20)).duplicates) == [2]
    assert L(tree.insert(seq(0, 3), P(3, 30)).duplicates) == [3]
    trunk = find(tree, seq(0))
    a, b, c = (find(tree, seq(0, v)) for v in (1, 2, 3))
    assert (L(trunk.device), L(a.device), L(b.device), L(c.device)) == ([1], [10], [20], [30])
    tree.check_integrity()
    return trunk, a, b, c


def test_lru_eviction_order(tree: RadixTree) -> None:
    trunk, a, b, c = three_branches(tree)
    tree.unlock(tree.lock(tree.match(seq(0, 1))))  # refresh branch [1]
    assert a.last_access > c.last_access > b.last_access
    ev = tree.evict_device(1)
    assert [L(p) for p in ev.device_pages] == [[20]] and ev.host_pages == []
    assert ev.removed_nodes == 1 and b.parent is None
    tree.check_integrity()
    ev = tree.evict_device(4)
    # the trunk becomes a candidate only after its last device child is gone
    assert [L(p) for p in ev.device_pages] == [[30], [10], [1]]
    assert ev.num_device() == 3 and ev.removed_nodes == 3
    assert list(tree.nodes()) == []
    tree.check_integrity()


def test_parent_becomes_candidate_as_soon_as_children_go(tree: RadixTree) -> None:
    tree.insert(seq(1), P(1))
    tree.insert(seq(1, 2), P(9, 2))  # refreshes [1]; [2] is its only child
    tree.insert(seq(3), P(3))  # the most recent leaf
    ev = tree.evict_device(2)
    assert [L(p) for p in ev.device_pages] == [[2], [1]]
    assert [L(n.device) for n in tree.nodes()] == [[3]]
    tree.check_integrity()


def test_evict_device_stops_once_enough_pages(tree: RadixTree) -> None:
    tree.insert(seq(1, 2, 3), P(1, 2, 3))
    tree.insert(seq(4), P(4))
    ev = tree.evict_device(2)  # one 3-page leaf is enough
    assert [L(p) for p in ev.device_pages] == [[1, 2, 3]] and ev.num_device() == 3
    assert tree.held_pages("device").tolist() == [4]
    assert tree.evict_device(0).device_pages == []
    tree.check_integrity()


def test_lfu_eviction_order() -> None:
    orders = {}
    for policy in ("lfu", "lru"):
        tree = RadixTree(PS, policy=policy)
        assert tree.policy.name == policy
        tree.insert(seq(1), P(10))
        tree.insert(seq(2), P(20))
        tree.insert(seq(3), P(30))
        for v in (3, 3, 1):
            tree.unlock(tree.lock(tree.match(seq(v))))
        hits = [find(tree, seq(v)).hits for v in (1, 2, 3)]
        assert hits == [1, 0, 2]
        ev = tree.evict_device(3)
        orders[policy] = [L(p) for p in ev.device_pages]
        tree.check_integrity()
    assert orders["lfu"] == [[20], [10], [30]]
    assert orders["lru"] == [[20], [30], [10]]
    with pytest.raises(ConfigError, match="eviction_policy='fifo'"):
        make_policy("fifo")


def test_locked_nodes_are_never_evicted(tree: RadixTree) -> None:
    trunk, a, b, c = three_branches(tree)
    lock = tree.lock(tree.match(seq(0, 2)))
    assert lock is b
    ev = tree.evict_device(100)
    assert [L(p) for p in ev.device_pages] == [[10], [30]]
    assert {n.id for n in tree.nodes()} == {trunk.id, b.id}
    tree.check_integrity()
    tree.unlock(lock)
    ev = tree.evict_device(100)
    assert [L(p) for p in ev.device_pages] == [[20], [1]]
    tree.check_integrity()


def test_locked_prefix_partial_lock_protects_prefix_only(tree: RadixTree) -> None:
    tree.insert(seq(1, 2, 3), P(1, 2, 3))
    lock = tree.lock(tree.match(seq(1, 9)))
    assert lock.tokens == tuple(page(1))
    ev = tree.evict_device(100)
    assert [L(p) for p in ev.device_pages] == [[2, 3]]
    assert tree.held_pages("device").tolist() == [1]
    tree.unlock(lock)
    tree.check_integrity()


def test_device_io_blocks_eviction(tree: RadixTree) -> None:
    trunk, a, b, c = three_branches(tree)
    a.device_io = 1
    ev = tree.evict_device(100)
    assert [L(p) for p in ev.device_pages] == [[20], [30]]
    assert {n.id for n in tree.nodes()} == {trunk.id, a.id}
    tree.check_integrity()
    a.device_io = 0
    ev = tree.evict_device(100)
    assert [L(p) for p in ev.device_pages] == [[10], [1]]


def test_evict_device_without_host_removes_host_only_subtree(tree: RadixTree) -> None:
    root_node = tree.insert(seq(1), P(1)).last
    out = tree.insert(seq(2, 3), P(51, 52), tier="host", start=root_node)
    assert out.cached_len == 0
    tree.insert(seq(1, 4), P(50, 53), tier="host")  # [1] adopts host 50
    out = tree.insert(seq(1, 4, 5), P(90, 91, 54), tier="host")
    assert out.cached_len == 8 and L(out.duplicates) == [90, 91]
    root_node.host = None  # only the device copy remains at the top
    tree.check_integrity()
    assert sorted(tree.held_pages("host").tolist()) == [51, 52, 53, 54]

    ev = tree.evict_device(1)
    assert [L(p) for p in ev.device_pages] == [[1]]
    assert sorted(flat(ev.host_pages)) == [51, 52, 53, 54] and ev.num_host() == 4
    assert sorted(L(p) for p in ev.host_pages) == [[51, 52], [53], [54]]
    assert ev.removed_nodes == 4
    assert list(tree.nodes()) == [] and tree.root.children == {}
    assert root_node.parent is None
    tree.check_integrity()


def test_evict_device_keeps_node_with_host_copy(tree: RadixTree) -> None:
    tree.insert(seq(1, 2), P(1, 2))
    tree.insert(seq(1, 2, 3), P(0, 50, 51), tier="host")  # [1,2] adopts host, [3] host-only
    ev = tree.evict_device(1)
    assert [L(p) for p in ev.device_pages] == [[1, 2]]
    assert ev.host_pages == [] and ev.removed_nodes == 0
    n = find(tree, seq(1, 2))
    assert n.device is None and L(n.host) == [0, 50]
    m = tree.match(seq(1, 2, 3))
    assert (m.device_len, m.host_len) == (0, 12)
    tree.check_integrity()


def test_host_io_in_subtree_blocks_removal(tree: RadixTree) -> None:
    n = tree.insert(seq(1), P(1)).last
    child = tree.insert(seq(2), P(50), tier="host", start=n).last
    child.host_io = 1
    ev = tree.evict_device(1)
    assert ev.device_pages == [] and L(n.device) == [1]
    child.host_io = 0
    ev = tree.evict_device(1)
    assert [L(p) for p in ev.device_pages] == [[1]] and [L(p) for p in ev.host_pages] == [[50]]
    tree.check_integrity()


def test_evict_device_prepare_refuses_or_backs_up(tree: RadixTree) -> None:
    trunk, a, b, c = three_branches(tree)
    seen: list[int] = []

    def prepare(node: Node) -> bool:
        seen.append(node.id)
        if node is b:
            return False
        if node is c:
            node.host = P(70)
        return True

    ev = tree.evict_device(100, prepare=prepare)
    assert seen == [a.id, b.id, c.id]
    assert [L(p) for p in ev.device_pages] == [[10], [30]]
    assert ev.removed_nodes == 1 and ev.host_pages == []
    assert c.parent is trunk and c.device is None and L(c.host) == [70]
    assert b.device is not None
    tree.check_integrity()


# ---- host eviction ---------------------------------------------------------------------


def test_evict_host(tree: RadixTree) -> None:
    tree.insert(seq(1), P(1))
    tree.insert(seq(1, 2), P(50, 51), tier="host")
    n0, n1 = find(tree, seq(1)), find(tree, seq(1, 2))
    assert (L(n0.host), L(n1.host)) == ([50], [51])
    ev = tree.evict_host(10)
    assert sorted(L(p) for p in ev.host_pages) == [[50], [51]]
    assert ev.device_pages == [] and ev.removed_nodes == 1
    assert list(tree.nodes()) == [n0] and n0.host is None and L(n0.device) == [1]
    assert n1.parent is None
    tree.check_integrity()


def test_evict_host_order_and_leaf_rule(tree: RadixTree) -> None:
    tree.insert(seq(4), P(4))
    tree.insert(seq(4), P(54), tier="host")
    tree.insert(seq(1, 2), P(50, 51), tier="host")  # one host-only node
    tree.insert(seq(1, 3), P(52, 53), tier="host")  # splits: [1] -> [2], [3]
    tree.unlock(tree.lock(tree.match(seq(1, 2))))  # [1],[2] most recent
    a, b, c, d = (find(tree, s) for s in (seq(1), seq(1, 2), seq(1, 3), seq(4)))
    ev = tree.evict_host(1)
    # [4] is on device and oldest; the host-only trunk [1] has children
    assert [L(p) for p in ev.host_pages] == [[54]] and ev.removed_nodes == 0
    assert d.parent is tree.root and d.host is None
    ev = tree.evict_host(2)
    assert [L(p) for p in ev.host_pages] == [[53], [51]] and ev.removed_nodes == 2
    ev = tree.evict_host(1)
    assert [L(p) for p in ev.host_pages] == [[50]] and a.parent is None
    assert list(tree.nodes()) == [d]
    tree.check_integrity()


def test_evict_host_respects_locks_and_io(tree: RadixTree) -> None:
    tree.insert(seq(1), P(1))
    tree.insert(seq(1), P(50), tier="host")
    leaf = tree.insert(seq(1, 2), P(0, 51), tier="host").last
    other = tree.insert(seq(3), P(53), tier="host").last
    lock = tree.lock(tree.match(seq(1, 2)))
    assert lock is leaf
    other.host_io = 1
    ev = tree.evict_host(10)
    # the locked host-only leaf and the busy node stay; a device-resident locked node may
    # drop its host copy because the device copy remains usable
    assert [L(p) for p in ev.host_pages] == [[50]]
    assert L(leaf.host) == [51] and L(other.host) == [53]
    tree.unlock(lock)
    other.host_io = 0
    ev = tree.evict_host(10)
    assert sorted(flat(ev.host_pages)) == [51, 53] and ev.removed_nodes == 2
    assert tree.held_pages("host").tolist() == []
    tree.check_integrity()


# ---- integrity -------------------------------------------------------------------------


def test_held_pages(tree: RadixTree) -> None:
    assert tree.held_pages("device").tolist() == [] and tree.held_pages("host").tolist() == []
    three_branches(tree)
    assert sorted(tree.held_pages("device").tolist()) == [1, 10, 20, 30]
    assert tree.held_pages("device").dtype == torch.int64


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda t, a, b: setattr(b, "device", None), "no copy in any tier"),
        (lambda t, a, b: setattr(b, "device", a.device.clone()), "held by two nodes"),
        (lambda t, a, b: setattr(b, "host", P(7, 7)), "held by two nodes"),
        (lambda t, a, b: setattr(b, "device", P(40, 41)), "device copy has 2 pages"),
        (
            lambda t, a, b: setattr(a, "device", None) or setattr(a, "host", P(8, 9)),
            "parent is not",
        ),
        (lambda t, a, b: setattr(b, "lock_ref", 1), "locked more than its parent"),
        (lambda t, a, b: setattr(a, "host_io", -1), "negative"),
        (lambda t, a, b: setattr(b, "keys", ["k1", "k2"]), "2 keys for 1 pages"),
        (lambda t, a, b: setattr(b, "tokens", b.tokens[:2]), "not"),
        (lambda t, a, b: setattr(b, "parent", t.root), "not linked from its parent"),
    ],
)
def test_check_integrity_detects_corruption(corrupt, match: str) -> None:
    tree = RadixTree(PS)
    tree.insert(seq(1, 2), P(0, 1))
    tree.insert(seq(1, 2, 3), P(0, 0, 2))
    a, b = find(tree, seq(1, 2)), find(tree, seq(1, 2, 3))
    tree.check_integrity()
    corrupt(tree, a, b)
    with pytest.raises(IntegrityError, match=match):
        tree.check_integrity()


def test_check_integrity_detects_device_io_without_copy() -> None:
    tree = RadixTree(PS)
    n = tree.insert(seq(1), P(0)).last
    n.host = P(1)
    n.device = None
    n.device_io = 1
    with pytest.raises(IntegrityError, match="device I/O"):
        tree.check_integrity()
