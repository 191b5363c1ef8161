"""RadixTree eviction with page_size 4 (exact order, locks, in-flight I/O) and integrity checks."""

from __future__ import annotations

import pytest
import torch
from tree_helpers import PS, L, P, find, flat, page, seq

from kvtier.errors import ConfigError, IntegrityError
from kvtier.tree import Node, RadixTree, make_policy
from kvtier.tree.tokens import TOKEN_BYTES

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
    tree.drop_host(root_node)  # only the device copy remains at the top
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
            tree.set_host(node, P(70))
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
        (lambda t, a, b: setattr(b, "buf", b.buf[: 2 * TOKEN_BYTES]), "not"),
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
    tree.set_host(n, P(1))
    n.device = None
    n.device_io = 1
    with pytest.raises(IntegrityError, match="device I/O"):
        tree.check_integrity()


def test_eviction_queue_follows_accesses_and_locks_between_calls(tree: RadixTree) -> None:
    trunk, a, b, c = three_branches(tree)
    held = tree.lock(tree.match(seq(0, 2)))  # b: locked, and now the most recent
    tree.unlock(tree.lock(tree.match(seq(0, 3))))  # c after b
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[10]]  # a: oldest, unlocked
    tree.check_integrity()
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[30]]  # b is still locked
    assert tree.evict_device(1).device_pages == []  # only locked pages remain
    tree.check_integrity()
    tree.unlock(held)  # b queued again on release; then the trunk once b is gone
    assert [L(p) for p in tree.evict_device(2).device_pages] == [[20], [1]]
    tree.check_integrity()
