"""CP agreement as a property: random schedules of admissions (match, prefetch, lock, load,
alloc), finishes, polls, flushes, per-rank storage losses and restarts, at CP 2, 3 and 4 (ranks
as threads, ``LocalWorld``), with every copy and storage I/O completing after a per-rank random
number of polls (``CacheConfig.test_completion_polls``). After every step every rank must hold
the same tree (structure, tiers, lock and I/O counts, logical pages), have made the same
allocations and see the same copies; each rank's physical pages must sit on its own lanes, and
an allocation may fail only when the short lanes cannot make room."""

from __future__ import annotations

import tempfile
import threading
from collections import Counter

import torch
from factories import PS, SPEC, cache_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import TieredCache
from kvtier.errors import CapacityError
from kvtier.keys import chain_keys
from kvtier.parallel.group import LocalWorld
from kvtier.parallel.layout import CPLayout
from kvtier.tree.radix import RadixTree

_A = list(range(100, 100 + 8 * PS))
PROMPTS = [
    _A,
    _A[: 5 * PS] + list(range(300, 300 + 2 * PS)),
    _A[: 2 * PS] + list(range(400, 400 + 4 * PS)),
    list(range(500, 500 + 6 * PS)),
    _A[: 3 * PS],
]
"""Whole pages only (CP caches no partial tails), sharing prefixes of several depths."""
MAX_WAITING, MAX_RUNNING = 3, 2
COLLECTIVE_TIMEOUT = 3.0

_NEW = st.tuples(st.just("new"), st.integers(0, len(PROMPTS) - 1))
_ADMIT = st.tuples(st.just("admit"), st.integers(0, MAX_WAITING - 1))
_FINISH = st.tuples(st.just("finish"), st.integers(0, MAX_RUNNING - 1))
_POLL = st.tuples(st.just("poll"))
STEP = st.one_of(
    _NEW,
    _NEW,
    _ADMIT,
    _ADMIT,
    _FINISH,
    _FINISH,
    _POLL,
    _POLL,
    _POLL,
    st.tuples(st.just("flush"), st.booleans()),
    st.tuples(st.just("lose"), st.integers(0, len(PROMPTS) - 1), st.integers(0, 3)),
    st.tuples(st.just("restart")),
)
"""Requests' own steps weigh most, so most schedules have copies in flight across polls."""


def _subtree_idle(node) -> bool:
    return all(
        n.lock_ref == 0 and n.device_io == 0 and n.host_io == 0 for n in RadixTree.subtree(node)
    )


class Rank:
    """One rank's side of a schedule: its cache and the requests in progress."""

    def __init__(self, g, cp: int, pattern: str, seed: int, l3: str) -> None:
        self.g, self.cp = g, cp
        self.cfg = cache_config(
            l3,
            device_pages=6,
            host_pages=10,
            cp_size=cp,
            cp_rank=g.rank,
            cp_pattern=pattern,
            test_completion_polls=3,
            test_completion_seed=seed,
        )
        self.layout = CPLayout(cp, g.rank, pattern)
        self.cache = TieredCache(self.cfg, [SPEC], group=g)
        self.waiting: list[tuple[list[int], object]] = []
        self.running: list[tuple[list[int], torch.Tensor, int, object]] = []
        self.events: list[tuple] = []
        """What each step decided: match lengths, allocations (logical slots, in order)."""

    # ---- steps ---------------------------------------------------------------------------
    def step(self, op: tuple) -> None:
        kind = op[0]
        if kind == "new" and len(self.waiting) < MAX_WAITING:
            tokens = PROMPTS[op[1]]
            m = self.cache.match(tokens)
            self.events.append(("match", op[1], m.device_len, m.host_len, m.storage_len))
            self.waiting.append((tokens, self.cache.prefetch(m) if m.storage_len else None))
        elif kind == "admit" and self.waiting and len(self.running) < MAX_RUNNING:
            self._admit(*self.waiting.pop(op[1] % len(self.waiting)))
        elif kind == "finish" and self.running:
            tokens, locs, n, handle = self.running.pop(op[1] % len(self.running))
            self.cache.finish(tokens, locs, n, handle)
        elif kind == "poll":
            self.cache.poll()
        elif kind == "flush":
            self.cache.flush(host=op[1])
        elif kind == "lose" and op[2] % self.cp == self.g.rank:
            self._lose(PROMPTS[op[1]])
        elif kind == "restart":
            for tokens, locs, n, handle in self.running:
                self.cache.finish(tokens, locs, n, handle)
            for _, pf in self.waiting:
                self.cache.finish_prefetch(pf)
            self.running, self.waiting = [], []
            self.cache.close()
            self.cache = TieredCache(self.cfg, [SPEC], group=self.g)

    def _admit(self, tokens: list[int], pf: object) -> None:
        got = self.cache.finish_prefetch(pf)
        m = self.cache.match(tokens, probe_storage=False)
        self.cache.lock(m.handle)
        ld = self.cache.load(m)
        n = ld.locs.numel()
        self.events.append(("admit", got, m.device_len, m.host_len, n))
        owners = self.layout.owners(n // PS, len(tokens) // PS)
        room = self._room()
        try:
            fresh = self.cache.alloc(len(tokens) - n, at=n)
        except CapacityError:
            need = Counter(owners)
            assert any(room[lane] < k for lane, k in need.items()), (
                f"rank {self.g.rank}: alloc of sequence pages {n // PS}.. on lanes {owners} "
                f"failed though free + evictable pages per lane were {room}"
            )
            self.events.append(("full", n))
            self.cache.finish(tokens[:n], ld.locs, n, m.handle)
            return
        self.events.append(("alloc", fresh.tolist()))
        self.running.append((tokens, torch.cat([ld.locs, fresh]), n, m.handle))

    def _room(self) -> dict[int, int]:
        """Per lane: free device pages plus those of subtrees nothing locks or pins (fewer
        than eviction may find: an allocation that fits in these must succeed)."""
        alloc = self.cache.device_pool.allocator
        room = {lane: alloc.available_in(lane) for lane in range(self.cp)}
        for node in self.cache.tree.nodes():
            if node.device is not None and _subtree_idle(node):
                for lane in (node.device % self.cp).tolist():
                    room[lane] += 1
        return room

    def _lose(self, tokens: list[int]) -> None:
        """This rank's storage loses its objects of ``tokens`` (a fault only it sees)."""
        backend = self.cache.storage
        keys = chain_keys(self.cache.namespace, tokens, PS)
        owners = self.layout.owners(0, len(keys))
        for key, owner in zip(keys, owners, strict=True):
            if owner == self.g.rank:
                backend._forget(key, True)

    # ---- what must agree -----------------------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        tree, nodes = [], []
        stack = [(self.cache.tree.root, 0)]
        while stack:
            node, depth = stack.pop()
            for key in sorted(node.children, reverse=True):
                stack.append((node.children[key], depth + 1))
            if node.parent is None:
                continue
            nodes.append(node)
            tree.append(
                (
                    depth,
                    node.tokens[:1],
                    len(node.tokens),
                    None if node.device is None else node.device.tolist(),
                    None if node.host is None else node.host.tolist(),
                    node.in_storage,
                    node.lock_ref,
                    node.device_io,
                    node.host_io,
                )
            )
        self._lanes(nodes)
        c = self.cache.controller
        return {
            "tree": tree,
            "visible": [
                (m.device_len, m.host_len)
                for m in (self.cache.match(p, probe_storage=False) for p in PROMPTS)
            ],
            "events": list(self.events),
            "loads in flight": len(c.loads.flights),
            "backups in flight": len(c.backups.flights),
            "storage writes in flight": len(c.io._writes),
            "touches in flight": len(c.io._touches),
            "fetches": [(op.committed_pages, op.closed) for op in c.prefetcher.ops],
            "free device pages": [
                self.cache.device_pool.allocator.available_in(lane) for lane in range(self.cp)
            ],
        }

    def _lanes(self, nodes: list) -> None:
        """Every node's pages sit on their sequence owners' lanes; this rank translates
        exactly its own lane's pages, to physical pages inside its pools."""
        tr = self.cache.controller.mover.translator
        for node in nodes:
            first = (node.depth_tokens() - len(node.tokens)) // PS
            owners = self.layout.owners(first, first + len(node.tokens) // PS)
            for side, pages in (("device", node.device), ("host", node.host)):
                if pages is None:
                    continue
                assert (pages % self.cp).tolist() == owners, (
                    f"rank {self.g.rank}: node {node.id} {side} pages {pages.tolist()} not on "
                    f"their owners' lanes {owners}"
                )
                mine = pages % self.cp == self.g.rank
                if side == "device":
                    assert torch.equal(tr.device_owned(pages).reshape(-1).cpu(), mine)
                    phys = tr.device_physical(pages[mine])
                    limit = self.cache.device_pool.num_pages
                else:
                    phys = tr.host_physical(pages[mine])
                    limit = self.cache.host_pool.num_pages
                assert bool(((phys >= 0) & (phys < limit)).all()), (
                    f"rank {self.g.rank}: node {node.id} {side} physical pages {phys.tolist()} "
                    f"outside this rank's pool of {limit}"
                )


def _run(cp: int, pattern: str, seed: int, steps: list[tuple]) -> None:
    """Run ``steps`` on ``cp`` ranks; after every step compare the ranks' snapshots through a
    barrier of the test's own (not the group's rounds: a rank whose state diverged may have
    issued other collectives, and a step that failed on a collective is still compared, so
    the divergence that caused it is what is reported)."""
    snaps: list[list[dict | None]] = [[None] * cp for _ in range(len(steps) + 1)]
    barrier = threading.Barrier(cp, timeout=4 * COLLECTIVE_TIMEOUT)

    def rank(g) -> None:
        r = Rank(g, cp, pattern, seed, l3)
        failed = True
        try:
            for k, op in enumerate([("start",), *steps]):
                err: BaseException | None = None
                if k:
                    try:
                        r.step(op)
                    except Exception as e:  # compared first, raised after
                        err = e
                snaps[k][g.rank] = r.snapshot()
                barrier.wait()
                for other in range(1, cp):
                    a, b = snaps[k][0], snaps[k][other]
                    for what in a:
                        assert a[what] == b[what], (
                            f"step {k} {op}: rank {other} disagrees with rank 0 on {what}: "
                            f"{b[what]} != {a[what]}"
                        )
                if err is not None:
                    raise err
                r.cache.check_integrity()
            failed = False
        finally:
            if failed:  # collectives may be out of step: close without waiting for them
                r.cache._closed = True
                r.cache.controller.io.close()
            else:
                r.cache.close()

    with tempfile.TemporaryDirectory() as l3:
        LocalWorld(cp, timeout=COLLECTIVE_TIMEOUT).run(rank)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cp=st.sampled_from([2, 3, 4]),
    pattern=st.sampled_from(["round_robin", "zigzag"]),
    seed=st.integers(0, 2**16),
    steps=st.lists(STEP, min_size=10, max_size=40),
)
def test_ranks_agree_on_every_step(cp, pattern, seed, steps):
    _run(cp, pattern, seed, steps)
