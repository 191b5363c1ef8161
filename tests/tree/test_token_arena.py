"""The token arena: long runs live in shared chunks, and the tree behaves exactly as with bytes."""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from tree_helpers import NS, PS, snapshot

from kvtier.errors import IntegrityError
from kvtier.tree import RadixTree
from kvtier.tree.token_arena import TokenArena
from kvtier.tree.tokens import TOKEN_BYTES


def arena_tree(min_run: int = 2 * PS * TOKEN_BYTES, chunk: int = 64 * TOKEN_BYTES) -> RadixTree:
    """A tree whose runs of two pages or more go to small chunks (eight pages each)."""
    tree = RadixTree(PS)
    tree.arena = TokenArena(min_run=min_run, chunk=chunk)
    return tree


def bytes_tree() -> RadixTree:
    tree = RadixTree(PS)
    tree.arena = TokenArena(min_run=1 << 62)
    return tree


def arena_nodes(tree: RadixTree) -> int:
    return sum(1 for n in tree.nodes() if n.addr)


def test_long_runs_live_in_the_arena_and_splits_share_it() -> None:
    tree = arena_tree()
    toks = list(range(1, 6 * PS + 1))
    tree.insert(array("i", toks), torch.arange(6))
    (node,) = tree.root.children.values()
    assert isinstance(node.buf, memoryview) and node.addr and node.tokens == tuple(toks)
    tree.insert(toks[: 2 * PS] + [99] * PS, torch.arange(6, 9))
    (first,), rest = tree.root.children.values(), node
    assert rest.parent is first and first.addr + len(first.buf) == rest.addr
    assert first.tokens + rest.tokens == tuple(toks)
    assert tree.arena.live_bytes() == len(first.buf) + len(rest.buf)
    tree.check_integrity()


def test_memory_of_dead_runs_is_given_back() -> None:
    tree = arena_tree()
    for i in range(12):
        tree.insert([1000 * i + j for j in range(6 * PS)], torch.arange(6 * i, 6 * i + 6))
    assert arena_nodes(tree) == 12 and tree.arena.held_bytes() >= 12 * 6 * PS * TOKEN_BYTES
    tree.evict_device(12 * 6)
    assert not list(tree.nodes())
    assert tree.arena.live_bytes() == 0 and tree.arena.held_bytes() <= 64 * TOKEN_BYTES
    tree.check_integrity()


def test_a_chunk_mostly_dead_moves_its_survivors_to_bytes() -> None:
    tree = arena_tree(chunk=12 * PS * TOKEN_BYTES)
    a, b = list(range(1, 6 * PS + 1)), list(range(500, 500 + 6 * PS))
    tree.insert(a, torch.arange(6))
    tree.insert(b, torch.arange(6, 12))
    tree.insert(a[:PS] + [7] * PS, torch.arange(12, 14))  # splits a: one page survives a's run
    m = tree.match(a[:PS])
    keep = tree.lock(m)
    tree.insert(list(range(900, 900 + 6 * PS)), torch.arange(14, 20))  # a second chunk
    tree.evict_device(20)  # all but the locked page: a's chunk keeps PS tokens of 12 pages
    assert keep.tokens == tuple(a[:PS]) and not keep.addr and isinstance(keep.buf, bytes)
    assert tree.arena.live_bytes() == 0
    tree.check_integrity()
    tree.unlock(keep)


def test_the_arena_changes_nothing_the_tree_does() -> None:
    rng = random.Random(7)
    trees = [arena_tree(), bytes_tree()]
    stems = [[rng.randrange(50) for _ in range(rng.randint(1, 6) * PS)] for _ in range(4)]
    nxt = 0
    for _ in range(300):
        op = rng.random()
        seq = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randint(0, 9 * PS))]
        seq = seq[: rng.randint(1, len(seq))]
        if op < 0.5:
            n = -(-len(seq) // PS)
            outs = [t.insert(array("i", seq), torch.arange(nxt, nxt + n)) for t in trees]
            nxt += n
            assert outs[0].cached_len == outs[1].cached_len
            assert outs[0].duplicates.tolist() == outs[1].duplicates.tolist()
        elif op < 0.75:
            ms = [t.match(seq) for t in trees]
            assert [m.matched_len for m in ms] == [ms[1].matched_len] * 2
            if rng.random() < 0.5:
                for t, m in zip(trees, ms, strict=True):
                    t.unlock(t.lock(m))
        elif op < 0.9:
            k = rng.randint(1, 12)
            assert trees[0].evict_device(k).num_device() == trees[1].evict_device(k).num_device()
        else:
            pick = rng.randrange(3)
            for t in trees:
                for node in list(t.nodes()):
                    if node.host is None and node.id % 3 == pick:
                        base = 10**6 + 100 * node.id
                        t.set_host(node, torch.arange(base, base + node.num_pages(PS)))
        for t in trees:
            t.check_integrity()
        assert snapshot(trees[0]) == snapshot(trees[1])
    assert arena_nodes(trees[0]) and not arena_nodes(trees[1])


def test_keys_of_arena_runs_equal_keys_of_bytes_runs() -> None:
    toks = [2**30 + i for i in range(5 * PS)] + [3]
    got = []
    for t in (arena_tree(), bytes_tree()):
        out = t.insert(toks, torch.arange(6))
        got.append(t.ensure_keys(out.last, NS))
    assert got[0] == got[1]


def test_check_integrity_sees_a_wrong_arena_address() -> None:
    tree = arena_tree()
    tree.insert(list(range(6 * PS)), torch.arange(6))
    (node,) = tree.root.children.values()
    node.addr += 8
    with pytest.raises(IntegrityError, match="address"):
        tree.check_integrity()


def test_a_dead_chunk_is_dropped_when_filling_moves_past_it() -> None:
    tree = arena_tree(chunk=8 * PS * TOKEN_BYTES)
    tree.insert(list(range(6 * PS)), torch.arange(6))
    tree.evict_device(6)  # dead, but its chunk is still being filled
    assert tree.arena.live_bytes() == 0 and tree.arena.held_bytes() == 8 * PS * TOKEN_BYTES
    tree.insert(list(range(100, 100 + 6 * PS)), torch.arange(6, 12))  # does not fit: new chunk
    assert (
        tree.arena.held_bytes() == 8 * PS * TOKEN_BYTES
        and tree.arena.live_bytes() == 6 * PS * TOKEN_BYTES
    )
    tree.check_integrity()
