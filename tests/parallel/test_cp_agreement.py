"""CP agreement as a property: random schedules of admissions (match, prefetch, lock, load,
alloc), finishes, whole requests, storage restores (flush, then a request for a stored prompt),
pages the engine holds on one lane, polls, per-rank storage losses and restarts, at CP 2, 3
and 4 (ranks as threads, ``LocalWorld``), with every copy and storage I/O completing after a
per-rank random number of polls (``CacheConfig.test_completion_polls``), and polls at the end
until the work in flight has settled. After every step, before any integrity check, every rank
must hold the same tree (structure, tiers, lock and I/O counts, logical pages), have made the
same matches and allocations, see the same copies and hold the same in-flight records (each
with the nodes it spans and pins); each rank's physical pages must sit on its own lanes, and an
allocation may fail only when the short lanes cannot make room."""

from __future__ import annotations

import tempfile
import threading
from collections import Counter

import pytest
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
    _A[: 7 * PS] + list(range(600, 600 + PS)),
    _A[: 6 * PS] + list(range(700, 700 + PS)),
]
"""Whole pages only (CP caches no partial tails), sharing prefixes of several depths; the last
two leave one-page leaves (one lane each) beside ``_A``'s."""
MAX_WAITING, MAX_RUNNING, MAX_HELD = 3, 2, 4
SEQ_PAGES = 8
"""Sequence pages of the longest prompt."""
SETTLE_POLLS = 12
"""Polls after every schedule, each compared: enough for every copy, storage write and fetch
in flight to complete under ``test_completion_polls=3``."""
COLLECTIVE_TIMEOUT = 3.0

_NEW = st.tuples(st.just("new"), st.integers(0, len(PROMPTS) - 1))
_ADMIT = st.tuples(st.just("admit"), st.integers(0, MAX_WAITING - 1))
_FINISH = st.tuples(st.just("finish"), st.integers(0, MAX_RUNNING - 1))
_POLL = st.tuples(st.just("poll"))
_SERVE = st.tuples(st.just("serve"), st.integers(0, len(PROMPTS) - 1))
_RESTORE = st.tuples(st.just("restore"), st.integers(0, len(PROMPTS) - 1))
_HOLD = st.tuples(st.just("hold"), st.integers(0, SEQ_PAGES - 1))
_FILL = st.tuples(st.just("fill"), st.integers(0, SEQ_PAGES - 1))
_SKEW = st.tuples(
    st.just("skew"),
    st.integers(0, len(PROMPTS) - 1),
    st.integers(0, len(PROMPTS) - 1),
    st.integers(0, SEQ_PAGES - 1),
)
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
    _POLL,
    _SERVE,
    _SERVE,
    _RESTORE,
    _RESTORE,
    _HOLD,
    _FILL,
    _SKEW,
    _SKEW,
    st.tuples(st.just("drop")),
    st.tuples(st.just("flush"), st.booleans()),
    st.tuples(st.just("lose"), st.integers(0, len(PROMPTS) - 1), st.integers(0, 3)),
    st.tuples(st.just("restart")),
)
"""Requests' own steps and polls weigh most, so most schedules have copies in flight across
polls. ``serve`` runs a whole request (its pages reach storage through write-through);
``restore`` flushes both tiers and starts a request for a prompt, so storage hits whose fetches
complete at different polls on each rank are common (and after a ``lose``, storage holds
different pages on each rank); ``hold`` makes the engine hold a fresh page on the lane of one
sequence page, ``fill`` takes every free page of that lane and one more, so the lanes fill
unevenly and eviction must count the short lane's pages, not the other lanes' (an allocation
fails only when that lane's free and evictable pages are too few); ``skew`` serves two prompts,
polls until their copies are idle and fills a lane, so that the least recently used leaves often
hold no page of the lane that is short."""


def _subtree_idle(node) -> bool:
    return all(
        n.lock_ref == 0 and n.device_io == 0 and n.host_io == 0 for n in RadixTree.subtree(node)
    )


def _where(node) -> tuple:
    """A node as every rank names it: where it starts in the sequence and its tokens."""
    return (node.depth_tokens() - len(node.tokens), tuple(node.tokens))


def _spans(spans: list) -> list[tuple]:
    """An in-flight record's spans: each node it covers, and its part (pages, keys or pin)."""
    out = []
    for sp in spans:
        part = sp.part
        if isinstance(part, torch.Tensor):
            part = part.tolist()
        elif isinstance(part, range):
            part = (part.start, part.stop)
        out.append((_where(sp.node), part))
    return out


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
        self.held: list[torch.Tensor] = []
        """Fresh pages the engine holds (``hold``), each on one sequence page's lane."""
        self.events: list[tuple] = []
        """What the step decided: match lengths, allocations (logical slots, in order)."""

    # ---- steps ---------------------------------------------------------------------------
    def step(self, op: tuple) -> None:
        kind = op[0]
        if kind == "new" and len(self.waiting) < MAX_WAITING:
            self._new(PROMPTS[op[1]])
        elif kind == "admit" and self.waiting and len(self.running) < MAX_RUNNING:
            self._admit(*self.waiting.pop(op[1] % len(self.waiting)))
        elif kind == "finish" and self.running:
            tokens, locs, n, handle = self.running.pop(op[1] % len(self.running))
            self.cache.finish(tokens, locs, n, handle)
        elif kind == "serve":
            tokens = PROMPTS[op[1]]
            m = self._match(op[1])
            if self._admit(tokens, self.cache.prefetch(m) if m.storage_len else None):
                self.cache.finish(*self.running.pop())
        elif kind == "restore":
            self.cache.flush(host=True)
            if len(self.waiting) < MAX_WAITING:
                self._new(PROMPTS[op[1]])
        elif kind == "hold" and len(self.held) < MAX_HELD:
            self._hold(op[1])
        elif kind == "fill":
            self._fill(op[1])
        elif kind == "skew":
            for prompt in op[1:3]:
                self.step(("serve", prompt))
            for _ in range(SETTLE_POLLS // 2):
                self.cache.poll()
            self._fill(op[3])
        elif kind == "drop":
            for locs in self.held:
                self.cache.free(locs)
            self.held = []
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
            for locs in self.held:
                self.cache.free(locs)
            self.running, self.waiting, self.held = [], [], []
            self.cache.close()
            self.cache = TieredCache(self.cfg, [SPEC], group=self.g)

    def _match(self, prompt: int):  # noqa: ANN202 - a MatchResult
        m = self.cache.match(PROMPTS[prompt])
        self.events.append(("match", prompt, m.device_len, m.host_len, m.storage_len))
        return m

    def _new(self, tokens: list[int]) -> None:
        m = self._match(PROMPTS.index(tokens))
        self.waiting.append((tokens, self.cache.prefetch(m) if m.storage_len else None))

    def _admit(self, tokens: list[int], pf: object) -> bool:
        """Admit a request; whether it runs (else its allocation failed and it is dropped)."""
        got = self.cache.finish_prefetch(pf)
        m = self.cache.match(tokens, probe_storage=False)
        self.cache.lock(m.handle)
        ld = self.cache.load(m)
        n = ld.locs.numel()
        self.events.append(("admit", got, m.device_len, m.host_len, n))
        fresh = self._alloc(len(tokens) - n, n)
        if fresh is None:
            self.cache.finish(tokens[:n], ld.locs, n, m.handle)
            return False
        self.running.append((tokens, torch.cat([ld.locs, fresh]), n, m.handle))
        return True

    def _hold(self, page: int) -> bool:
        """The engine takes a fresh page for sequence page ``page`` (on its owner's lane);
        whether it got one."""
        locs = self._alloc(PS, page * PS)
        if locs is not None:
            self.held.append(locs)
        return locs is not None

    def _fill(self, page: int) -> None:
        """The engine takes every free page of sequence page ``page``'s lane, and one more."""
        lane = self.layout.owners(page, page + 1)[0]
        for _ in range(self.cache.device_pool.allocator.available_in(lane) + 1):
            if not self._hold(page):
                return

    def _alloc(self, num_tokens: int, at: int) -> torch.Tensor | None:
        """``cache.alloc``; ``None`` when it failed, which it may only when eviction could
        not make room on the short lanes."""
        owners = self.layout.owners(at // PS, (at + num_tokens) // PS)
        room = self._room()
        try:
            fresh = self.cache.alloc(num_tokens, at=at)
        except CapacityError:
            need = Counter(owners)
            assert any(room[lane] < k for lane, k in need.items()), (
                f"rank {self.g.rank}: alloc of sequence pages {at // PS}.. on lanes {owners} "
                f"failed though free + evictable pages per lane were {room}"
            )
            self.events.append(("full", at))
            return None
        self.events.append(("alloc", fresh.tolist()))
        return fresh

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
            "visible": None  # a restart whose close failed leaves the old cache closed
            if self.cache._closed
            else [
                (m.device_len, m.host_len)
                for m in (self.cache.match(p, probe_storage=False) for p in PROMPTS)
            ],
            "events": self._step_events(),
            "loads in flight": [_spans(f.spans) for f in c.loads.flights],
            "backups in flight": [(f.tier, _spans(f.spans)) for f in c.backups.flights],
            "storage writes in flight": [(_spans(w.spans), w.pages.tolist()) for w in c.io._writes],
            # a touch's parts are ranges of this rank's own keys: its nodes must agree
            "touches queued": [_where(sp.node) for sp in c.io._touch_next.spans],
            "touches in flight": [[_where(sp.node) for sp in t.spans] for t in c.io._touches],
            "fetches": [
                (
                    None if op.anchor is None else _where(op.anchor),
                    op.pages.tolist(),
                    len(op.keys),
                    op.agreed_done,
                    op.committed_pages,
                    op.released,
                    op.closed,
                )
                for op in c.prefetcher.ops
            ],
            "pins": sorted(
                (_where(node), tier) for node, tier in c.loads.pinned() + c.backups.pinned()
            ),
            "free device pages": [
                self.cache.device_pool.allocator.available_in(lane) for lane in range(self.cp)
            ],
            "free host pages": [
                self.cache.host_pool.allocator.available_in(lane) for lane in range(self.cp)
            ],
        }

    def _step_events(self) -> list[tuple]:
        """What this step decided (earlier steps' were compared at their snapshots)."""
        out, self.events = self.events, []
        return out

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
    """Run ``steps``, then ``SETTLE_POLLS`` polls, on ``cp`` ranks; after every step compare
    the ranks' snapshots through a barrier of the test's own (not the group's rounds: a rank
    whose state diverged may have issued other collectives, and a step that failed on a
    collective is still compared, so the divergence that caused it is what is reported), and
    only then check each rank's integrity."""
    steps = [*steps, *[("poll",)] * SETTLE_POLLS]
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
            for locs in r.held:
                r.cache.free(locs)
            r.cache.close()
            r.cache.check_integrity()
            failed = False
        finally:
            if failed:  # collectives may be out of step: close without waiting for them
                r.cache._closed = True
                r.cache.controller.io.close()

    with tempfile.TemporaryDirectory() as l3:
        LocalWorld(cp, timeout=COLLECTIVE_TIMEOUT).run(rank)


@pytest.mark.corrupts  # a failing schedule leaves ranks mid-collective; checked here instead
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cp=st.sampled_from([2, 3, 4]),
    pattern=st.sampled_from(["round_robin", "zigzag"]),
    seed=st.integers(0, 2**16),
    steps=st.lists(STEP, min_size=10, max_size=40),
)
def test_ranks_agree_on_every_step(cp, pattern, seed, steps):
    _run(cp, pattern, seed, steps)
