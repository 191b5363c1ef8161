"""Acknowledgements of CP transfers, and the MIN-reduced decisions built on them.

Every rank issues the same tree operations in the same order, so a backup (or a load) of a node
opens exactly one acknowledgement per node on every rank, even on a rank that owns none of the
node's pages: its ack is created already completed (a no-op ack). An ack queue is FIFO; each
step every rank counts its *leading* completed acks and the group takes the minimum. That many
acks are then retired on every rank at once, which is when their copies may become visible
(contract 3): a node is matchable at a tier only after every rank finished its shard.

    issue order              A        B        C
    rank 0 (owns A, C)       done     no-op    pending     leading done: 2
    rank 1 (owns B)          no-op    pending  no-op       leading done: 1
    agree() on both ranks → MIN = 1 → A retired everywhere; B and C stay pending

Because the count is the same on every rank, ranks never diverge on which nodes are visible,
and the queues stay equal (checked when ``check`` is on: a mismatch means a rank skipped,
doubled or reordered an ack, and raises ``IntegrityError`` naming the rank).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import IntegrityError
from kvtier.parallel.group import Group

_DIGEST_BASE = 1_000_003
_DIGEST_MOD = (1 << 61) - 1  # prime; digests and their negations fit in int64

ACK_KINDS = ("write", "load")
"""What an :class:`AckQueue` acknowledges: backups (device → host) or loads (host → device)."""


@dataclass(slots=True)
class Ack:
    """One node's acknowledgement on one rank."""

    seq: int
    """Issue number in its queue, the same on every rank."""
    node: int
    """Tree node id."""
    pages: int
    """Pages this rank copies for the node (0: a no-op ack, completed at creation)."""
    done: bool = False
    """The rank's shard of the copy finished."""


class AckQueue:
    """One rank's acknowledgements of one kind, in issue order.

    With ``check`` on, :meth:`agree` first verifies that every rank holds the same pending acks
    (count, then an order-sensitive digest of their nodes: four more reduces per call); off,
    it costs one reduce.
    """

    def __init__(self, group: Group, kind: str, check: bool = True) -> None:
        if kind not in ACK_KINDS:
            raise IntegrityError(f"rank {group.rank}: ack kind {kind!r} not in {ACK_KINDS}")
        self.group = group
        self.kind = kind
        self.check = check
        self._queue: deque[Ack] = deque()
        self._open: dict[int, Ack] = {}
        self._seq = 0

    @property
    def pending(self) -> int:
        """Acks issued and not yet retired."""
        return len(self._queue)

    def open(self, node: int, pages: int) -> Ack:
        """The ack of a ``kind`` copy of ``node`` that moves ``pages`` pages on this rank; with
        ``pages == 0`` it is already done. One pending ack per node: a second is a bug."""
        if node in self._open:
            raise IntegrityError(
                f"node {node} rank {self.group.rank}: a {self.kind} ack is already pending "
                f"(seq {self._open[node].seq})"
            )
        if pages < 0:
            raise IntegrityError(f"node {node} rank {self.group.rank}: ack of {pages} pages")
        ack = Ack(seq=self._seq, node=node, pages=pages, done=pages == 0)
        self._seq += 1
        self._queue.append(ack)
        self._open[node] = ack
        return ack

    def complete(self, ack: Ack) -> None:
        """This rank's copy for ``ack`` finished."""
        if self._open.get(ack.node) is not ack or ack.done:
            state = "already done" if ack.done else "not pending"
            raise IntegrityError(
                f"node {ack.node} rank {self.group.rank}: {self.kind} ack seq {ack.seq} "
                f"completed twice or unknown ({state})"
            )
        ack.done = True

    def agree(self) -> list[Ack]:
        """Collective: retire, on every rank, the acks every rank completed; returns them in
        issue order (their copies may become visible now). Every rank calls it at the same
        point of its step."""
        if self.check:
            self._check_lengths()
        local = 0
        for ack in self._queue:
            if not ack.done:
                break
            local += 1
        n = self.group.all_reduce_min(local)
        out = [self._queue.popleft() for _ in range(n)]
        for ack in out:
            del self._open[ack.node]
        return out

    def _check_lengths(self) -> None:
        n = len(self._queue)
        low = self.group.all_reduce_min(n)
        high = -self.group.all_reduce_min(-n)
        if low != high:
            raise IntegrityError(
                f"rank {self.group.rank}: {n} pending {self.kind} acks here, between {low} and "
                f"{high} across ranks: a rank skipped or doubled an ack (nodes "
                f"{[a.node for a in self._queue][:16]})"
            )
        # Same count but other nodes (or another order) means the ranks' trees diverged.
        digest = 0
        for a in self._queue:
            digest = (digest * _DIGEST_BASE + a.node + 1) % _DIGEST_MOD
        if self.group.all_reduce_min(digest) != -self.group.all_reduce_min(-digest):
            raise IntegrityError(
                f"rank {self.group.rank}: the {n} pending {self.kind} acks name other nodes "
                f"than on another rank (here {[a.node for a in self._queue][:16]})"
            )


def agree_min(group: Group, value: int) -> int:
    """The value every rank can vouch for: the minimum over ranks."""
    return group.all_reduce_min(value)


def all_ranks(group: Group, flag: bool) -> bool:
    """True only when ``flag`` is true on every rank (e.g. a backup completed everywhere)."""
    return group.all_reduce_min(1 if flag else 0) == 1


def ready_pages(rank: int, page_owners: Sequence[int], arrived: Sequence[bool]) -> int:
    """Leading pages of a fetch this rank has nothing left to wait for: page ``i`` is ready
    when another rank owns it or ``arrived[i]`` (its own shard landed)."""
    n = 0
    for owner, landed in zip(page_owners, arrived, strict=True):
        if owner == rank and not landed:
            break
        n += 1
    return n


def usable_prefix(group: Group, ready_pages: int) -> int:
    """Logical pages of a prefetch usable on every rank: the MIN of what each rank has ready.

    A rank counts a page ready once its own shard of it arrived, or when another rank owns it
    (it waits for nothing there), so a rank that owns none of the prefix reports its full length
    and never holds the others back nor lets them run ahead.
    """
    if ready_pages < 0:
        raise IntegrityError(f"rank {group.rank}: {ready_pages} ready pages")
    return group.all_reduce_min(ready_pages)
