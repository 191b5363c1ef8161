"""Stateful property test: RadixTree against a per-page reference model.

The model maps every cached page-aligned prefix (a token tuple) to its (device page, host page)
ids. Page ids come from small allocators owned by the test, so every id the tree holds must be
allocated exactly once and every id it gives back must have been held.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tree import Node, RadixTree

PS = 2
ALPHABET = st.integers(min_value=0, max_value=1)
PAGE = st.lists(ALPHABET, min_size=PS, max_size=PS)
SEQ = st.lists(PAGE, min_size=1, max_size=4).map(lambda ps: [t for p in ps for t in p])
TAIL = st.lists(ALPHABET, max_size=PS - 1)
TIER = st.sampled_from(["device", "host"])
BOXES: dict[str, Callable[[list[int]], object]] = {
    "list": list,
    "tuple": tuple,
    "array_i": lambda t: array("i", t),
    "array_q": lambda t: array("q", t),
    "numpy_int64": lambda t: np.array(t, dtype=np.int64),
    "numpy_int32": lambda t: np.array(t, dtype=np.int32),
    "tensor_int64": lambda t: torch.tensor(t, dtype=torch.int64),
    "tensor_int32": lambda t: torch.tensor(t, dtype=torch.int32),
}
BOX = st.sampled_from(sorted(BOXES))
"""The token containers engines hold: the tree must answer the same for each."""

Prefix = tuple[int, ...]


class Alloc:
    """Free-list allocator that reuses freed ids first."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.used: set[int] = set()
        self._free: deque[int] = deque()
        self._next = 0

    def alloc(self, n: int) -> torch.Tensor:
        out = []
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:
                p, self._next = self._next, self._next + 1
            out.append(p)
        self.used.update(out)
        return torch.tensor(out, dtype=torch.int64)

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert p in self.used, f"{self.name}: page {p} given back but not held"
            self.used.remove(p)
            self._free.append(p)


@dataclass
class Lock:
    node: Node
    tokens: Prefix
    on_device: list[Prefix]  # page prefixes that were on device when locked


def prefixes(tokens: Prefix) -> list[Prefix]:
    return [tokens[: (i + 1) * PS] for i in range(len(tokens) // PS)]


def path_tokens(node: Node) -> Prefix:
    parts: list[Prefix] = []
    n: Node | None = node
    while n is not None and n.parent is not None:
        parts.append(n.tokens)
        n = n.parent
    return tuple(t for p in reversed(parts) for t in p)


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixTree(PS)
        self.dev = Alloc("device")
        self.host = Alloc("host")
        # prefix -> [device page or None, host page or None]
        self.model: dict[Prefix, list[int | None]] = {}
        self.locks: list[Lock] = []

    # ---- model helpers ------------------------------------------------------------------
    def expected_match(self, tokens: Prefix) -> tuple[int, int, list[tuple]]:
        dev_pages = host_pages = 0
        seen: list[tuple] = []
        for p in prefixes(tokens):
            entry = self.model.get(p)
            if entry is None:
                break
            d, h = entry
            if d is not None:
                assert host_pages == 0, f"device page below a host-only page at {p}"
                dev_pages += 1
            else:
                assert h is not None
                host_pages += 1
            seen.append((d, h))
        return dev_pages * PS, host_pages * PS, seen

    def drop(self, tier: int, pages: list[int]) -> None:
        index = {e[tier]: p for p, e in self.model.items() if e[tier] is not None}
        for pid in pages:
            assert pid in index, f"tier {tier}: page {pid} returned but not in the model"
            entry = self.model[index[pid]]
            entry[tier] = None
            if entry == [None, None]:
                del self.model[index[pid]]

    def covered_by_lock(self, p: Prefix) -> bool:
        return any(lk.tokens[: len(p)] == p and len(lk.tokens) >= len(p) for lk in self.locks)

    def has_extension(self, p: Prefix, tier: int | None = None) -> bool:
        return any(
            len(q) == len(p) + PS and q[: len(p)] == p and (tier is None or e[tier] is not None)
            for q, e in self.model.items()
        )

    # ---- rules --------------------------------------------------------------------------
    def _insert(
        self, start: Node | None, base: Prefix, ext: list[int], tier: str, box: str = "list"
    ) -> None:
        t = 0 if tier == "device" else 1
        alloc = self.dev if tier == "device" else self.host
        pages = alloc.alloc(len(ext) // PS)
        full = base + tuple(ext)
        keys = prefixes(full)[len(base) // PS :]
        dups: list[int] = []
        cached = 0
        leading = True
        for i, p in enumerate(keys):
            entry = self.model.get(p)
            if entry is not None and entry[t] is not None:
                dups.append(int(pages[i]))
                if leading:
                    cached += PS
            else:
                leading = False
        out = self.tree.insert(BOXES[box](ext), pages, tier=tier, start=start)
        assert out.duplicates.tolist() == dups
        assert out.cached_len == cached
        assert path_tokens(out.last) == full
        for i, p in enumerate(keys):
            entry = self.model.setdefault(p, [None, None])
            if entry[t] is None:
                entry[t] = int(pages[i])
        alloc.free(dups)

    @rule(tokens=SEQ, tier=TIER, box=BOX)
    def insert(self, tokens: list[int], tier: str, box: str) -> None:
        self._insert(None, (), tokens, tier, box)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(min_value=0, max_value=7), ext=SEQ, tier=TIER)
    def insert_below_lock(self, i: int, ext: list[int], tier: str) -> None:
        lk = self.locks[i % len(self.locks)]
        on_device = all(self.model[p][0] is not None for p in prefixes(lk.tokens))
        if tier == "device" and not on_device:
            tier = "host"  # device copies only extend device-resident prefixes
        self._insert(lk.node, lk.tokens, ext, tier)

    @rule(tokens=SEQ, ext=SEQ, tier=TIER)
    def extend_matched(self, tokens: list[int], ext: list[int], tier: str) -> None:
        """Insert below whatever part of ``tokens`` is cached, as a fetch or load commit does."""
        m = self.tree.match(tokens)
        node = self.tree.lock(m)
        base = tuple(tokens[: m.matched_len])
        if tier == "device" and m.host_len:
            tier = "host"
        self._insert(node, base, ext, tier)
        self.tree.unlock(node)

    @rule(tokens=SEQ, tail=TAIL, box=BOX)
    def match(self, tokens: list[int], tail: list[int], box: str) -> None:
        m = self.tree.match(BOXES[box](tokens + tail))
        dev_len, host_len, seen = self.expected_match(tuple(tokens))
        assert (m.device_len, m.host_len) == (dev_len, host_len)
        got: list[tuple] = []
        for k, node in enumerate(m.path):
            n = m.last_pages if k == len(m.path) - 1 else node.num_pages(PS)
            for j in range(n):
                d = int(node.device[j]) if node.device is not None else None
                h = int(node.host[j]) if node.host is not None else None
                got.append((d, h))
        assert got == seen

    @rule(tokens=SEQ, tail=TAIL)
    def lock(self, tokens: list[int], tail: list[int]) -> None:
        m = self.tree.match(tokens + tail)
        node = self.tree.lock(m)
        matched = tuple(tokens[: m.matched_len])
        assert node.depth_tokens() == m.matched_len
        assert path_tokens(node) == matched
        on_device = [p for p in prefixes(matched) if self.model[p][0] is not None]
        self.locks.append(Lock(node, matched, on_device))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(min_value=0, max_value=7))
    def unlock(self, i: int) -> None:
        lk = self.locks.pop(i % len(self.locks))
        self.tree.unlock(lk.node)

    @rule(
        n=st.integers(min_value=0, max_value=6),
        mode=st.sampled_from(["plain", "plain", "backup", "refuse_even_ids"]),
    )
    def evict_device(self, n: int, mode: str) -> None:
        backed: list[tuple[Node, list[int]]] = []

        def prepare(node: Node) -> bool:
            assert node.device is not None and node.lock_ref == 0 and node.device_io == 0
            if mode == "refuse_even_ids":
                return node.id % 2 == 1
            if node.host is None:
                pages = self.host.alloc(node.num_pages(PS))
                self.tree.set_host(node, pages)
                backed.append((node, pages.tolist()))
            return True

        ev = self.tree.evict_device(n, prepare=None if mode == "plain" else prepare)
        for node, pages in backed:
            for p, pid in zip(prefixes(path_tokens(node))[-len(pages) :], pages, strict=True):
                self.model[p][1] = pid
        dev = [p for t in ev.device_pages for p in t.tolist()]
        host = [p for t in ev.host_pages for p in t.tolist()]
        assert ev.num_device() == len(dev) and ev.num_host() == len(host)
        self.drop(0, dev)
        self.drop(1, host)
        self.dev.free(dev)
        self.host.free(host)
        if len(dev) < n and mode != "refuse_even_ids":
            # nothing evictable is left: every device leaf is locked
            for p, e in self.model.items():
                if e[0] is not None and not self.has_extension(p, tier=0):
                    assert self.covered_by_lock(p), f"device leaf {p} left unevicted"

    @rule(n=st.integers(min_value=0, max_value=6))
    def evict_host(self, n: int) -> None:
        ev = self.tree.evict_host(n)
        assert ev.device_pages == []
        host = [p for t in ev.host_pages for p in t.tolist()]
        self.drop(1, host)
        self.host.free(host)
        if len(host) < n:
            for p, e in self.model.items():
                if e[1] is None:
                    continue
                assert e[0] is None, f"host copy of device-resident {p} left unevicted"
                if not self.has_extension(p):
                    assert self.covered_by_lock(p), f"host-only leaf {p} left unevicted"

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        self.tree.check_integrity()

    @invariant()
    def tree_equals_model(self) -> None:
        snap: dict[Prefix, list[int | None]] = {}
        stack: list[tuple[Node, Prefix]] = [(c, ()) for c in self.tree.root.children.values()]
        while stack:
            node, base = stack.pop()
            full = base + node.tokens
            assert node.tokens and len(node.tokens) % PS == 0
            for j, p in enumerate(prefixes(full)[len(base) // PS :]):
                d = int(node.device[j]) if node.device is not None else None
                h = int(node.host[j]) if node.host is not None else None
                assert p not in snap
                snap[p] = [d, h]
            stack.extend((c, full) for c in node.children.values())
        assert snap == self.model

    @invariant()
    def pages_held_exactly_once(self) -> None:
        for tier, alloc in (("device", self.dev), ("host", self.host)):
            held = self.tree.held_pages(tier).tolist()
            assert len(held) == len(set(held)), f"{tier} page held twice"
            assert set(held) == alloc.used, f"{tier}: held pages differ from allocated"

    @invariant()
    def locks_hold(self) -> None:
        for lk in self.locks:
            assert lk.node.lock_ref > 0 or (lk.node is self.tree.root and not lk.tokens)
            assert path_tokens(lk.node) == lk.tokens
            for p in prefixes(lk.tokens):
                assert p in self.model, f"locked page {p} lost every copy"
            for p in lk.on_device:
                assert self.model[p][0] is not None, f"locked device page {p} evicted"
        for node in self.tree.nodes():
            path = path_tokens(node)
            want = sum(
                1
                for lk in self.locks
                if len(lk.tokens) >= len(path) and lk.tokens[: len(path)] == path
            )
            assert node.lock_ref == want, f"{node!r}: lock_ref {node.lock_ref}, expected {want}"


TreeMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestTreeMachine = TreeMachine.TestCase
