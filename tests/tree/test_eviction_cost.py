"""``eviction_policy='cost'``: GreedyDual-Size per tier, with page size 4 and a recompute
context of 4 tokens, so that a node of ``k`` pages at depth ``d`` saves ``4 + d + 2k`` token
units per page (``kvtier.tree.recompute``) and a one-page node ``d + 6``. Exact orders, credits
and inflation values; integrity after every scenario."""

from __future__ import annotations

import pytest
from tree_helpers import PS, L, P, find, seq

from kvtier.errors import ConfigError
from kvtier.tree import RadixTree, make_policy
from kvtier.tree.eviction_order import GreedyDualSize
from kvtier.tree.recompute import RecomputeWork


def cost_tree() -> tuple[RadixTree, GreedyDualSize]:
    policy = GreedyDualSize(RecomputeWork(4.0), {"device": 1.0, "host": 1.0}, PS)
    return RadixTree(PS, policy), policy


def test_the_work_of_a_run_of_tokens_grows_with_its_depth() -> None:
    work = RecomputeWork(4.0)
    assert [work.tokens(d, 4) for d in (0, 4, 8)] == [6.0, 10.0, 14.0]
    assert work.tokens(0, 8) == 8 * (1 + 4 / 4)
    with pytest.raises(ConfigError, match="context must be positive"):
        RecomputeWork(0.0)


def test_the_cheaper_leaf_goes_first_where_lru_takes_the_older() -> None:
    """A deep leaf inserted first, then a shallow one: LRU evicts the deep (older) one, cost the
    shallow one, which saves less per byte."""
    orders = {}
    for name in ("lru", "cost"):
        tree = RadixTree(PS, name)
        assert tree.policy.name == name
        tree.insert(seq(1, 1, 1), P(10, 11, 12))  # trunk: 3 pages at depth 0
        tree.insert(seq(1, 1, 1, 2), P(10, 11, 12, 20))  # deep leaf at depth 12
        tree.insert(seq(3), P(30))  # shallow leaf at depth 0, newer
        ev = tree.evict_device(1)
        orders[name] = [L(p) for p in ev.device_pages]
        tree.check_integrity()
    assert orders == {"lru": [[20]], "cost": [[30]]}


def test_credits_follow_depth_and_bytes() -> None:
    tree, policy = cost_tree()
    tree.insert(seq(1, 1), P(10, 11))
    tree.insert(seq(1, 1, 2), P(10, 11, 20))
    tree.insert(seq(3), P(30))
    trunk, deep, shallow = find(tree, seq(1, 1)), find(tree, seq(1, 1, 2)), find(tree, seq(3))
    assert (trunk.depth, deep.depth, shallow.depth) == (0, 8, 0)
    # per page: 4 + d + 2k
    assert (trunk.device_credit, deep.device_credit, shallow.device_credit) == (8.0, 14.0, 6.0)
    # a split: the rest keeps its depth-consistent place and its credit; the head is used by
    # the insert that split it, so it is credited anew (one page at depth 0)
    tree.insert(seq(1, 5), P(10, 50))
    head = find(tree, seq(1))
    assert (head.depth, trunk.depth, find(tree, seq(1, 5)).depth) == (0, 4, 4)
    assert (head.device_credit, trunk.device_credit) == (6.0, 8.0)
    tree.check_integrity()
    with pytest.raises(ConfigError, match="no page bytes for the host tier"):
        GreedyDualSize(RecomputeWork(4.0), {"device": 1.0}, PS)
    with pytest.raises(ConfigError, match="one of lru, lfu, cost"):
        make_policy("fifo")


def test_inflation_lets_a_recently_used_cheap_leaf_outlive_an_old_expensive_one() -> None:
    """An old expensive leaf E (credit 14) and a cheap leaf A (saves 6) used again and again:
    at first A goes even right after its use (6 < 14); each eviction raises L to the evicted
    credit, so A re-inserted is worth L + 6, and from L = 12 on it outlives E."""
    tree, policy = cost_tree()
    tree.insert(seq(1, 1), P(10, 11))  # trunk T: credit 8
    tree.insert(seq(1, 1, 2), P(10, 11, 20))  # E: depth 8, credit 14
    tree.insert(seq(3), P(30))  # A: credit 6
    tree.unlock(tree.lock(tree.match(seq(3))))  # A hit: credit L + 6 = 6
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[30]]
    assert policy.inflation == {"device": 6.0, "host": 0.0}
    tree.insert(seq(3), P(31))  # A again: 6 + 6
    assert find(tree, seq(3)).device_credit == 12.0
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[31]]
    assert policy.inflation["device"] == 12.0
    tree.insert(seq(3), P(32))  # A again: 12 + 6 = 18 > 14
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[20]]
    assert policy.inflation["device"] == 14.0
    # T is a leaf now, at its old credit 8: it goes next, and L never decreases
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[10, 11]]
    assert policy.inflation["device"] == 14.0
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[32]]
    assert policy.inflation["device"] == 18.0
    assert list(tree.nodes()) == []
    tree.check_integrity()


def test_each_tier_keeps_its_own_inflation() -> None:
    """Device eviction raises the device tier's L only: a copy made afterwards in each tier is
    credited from that tier's own L."""
    tree, policy = cost_tree()
    tree.insert(seq(1), P(10))  # X: saves 6
    tree.insert(seq(2, 2), P(20, 21))  # Y: saves 8
    x, y = find(tree, seq(1)), find(tree, seq(2, 2))
    tree.set_host(x, P(100))
    tree.set_host(y, P(200, 201))
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[10]]  # X keeps its host copy
    assert policy.inflation == {"device": 6.0, "host": 0.0}
    tree.insert(seq(3), P(30))  # Z: saves 6
    z = find(tree, seq(3))
    tree.set_host(z, P(300))
    assert (z.device_credit, z.host_credit) == (12.0, 6.0)
    # host: X and Z tie at 6, X is older; X has no device copy, so its node goes
    ev = tree.evict_host(1)
    assert [L(p) for p in ev.host_pages] == [[100]] and ev.removed_nodes == 1
    assert policy.inflation == {"device": 6.0, "host": 6.0}
    assert [L(p) for p in tree.evict_host(1).host_pages] == [[300]]
    # device: Y (8) before Z (12)
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[20, 21]]
    assert policy.inflation == {"device": 8.0, "host": 6.0}
    tree.check_integrity()
    assert [L(p) for p in tree.evict_host(2).host_pages] == [[200, 201]]
    assert [L(p) for p in tree.evict_device(1).device_pages] == [[30]]
    assert policy.inflation == {"device": 12.0, "host": 8.0}
    tree.check_integrity()
