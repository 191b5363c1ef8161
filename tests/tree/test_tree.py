"""RadixTree bookkeeping with page_size 4: match, lock and split, insert, keys."""

from __future__ import annotations

import pytest
from tree_helpers import NS, PS, L, P, find, kids, page, seq, snapshot

from kvtier.errors import IntegrityError
from kvtier.keys import chain_keys, namespace_digest
from kvtier.tree import Node, RadixTree

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
    assert node.parent is tree.root and kids(tree.root) == {(0, 1, 2, 3): node}
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
    tree.set_host(x, P(70, 71, 72))
    ids_before = {n.id for n in tree.nodes()}

    m = tree.match(seq(1, 2, 9))
    assert m.path == [x] and m.last_pages == 2 and m.device_len == 8
    locked = tree.lock(m)
    tree.check_integrity()

    assert locked is not x and locked.id not in ids_before
    assert m.path == [locked] and m.last_pages == 2
    # the prefix is the new parent
    assert locked.parent is tree.root and kids(tree.root) == {tuple(page(1)): locked}
    assert locked.tokens == tuple(seq(1, 2))
    assert L(locked.device) == [10, 11] and L(locked.host) == [70, 71]
    assert kids(locked) == {tuple(page(3)): x}
    # the suffix keeps its object and children
    assert x.parent is locked and x.tokens == tuple(page(3))
    assert L(x.device) == [12] and L(x.host) == [72]
    assert kids(x) == {tuple(page(4)): child} and child.parent is x
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
    tree.drop_host(a)  # [2] keeps only its device copy; [1] and [3] have host copies
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
    keys = chain_keys(NS, seq(1, 2, 3), PS)
    out = tree.insert(seq(1, 2, 3), P(5, 6, 7), tier="host", keys=keys)
    (n,) = out.taken
    assert n.in_storage and n.keys == keys
    tree.insert(seq(1, 9), P(0, 1))
    pre, suf = find(tree, seq(1)), find(tree, seq(1, 2, 3))
    assert pre.keys == keys[:1] and suf.keys == keys[1:] and pre.in_storage and suf.in_storage
    assert not find(tree, seq(1, 9)).in_storage
    tree.check_integrity()


# ---- keys ------------------------------------------------------------------------------


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
