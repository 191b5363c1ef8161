"""Per-page readiness of CP fetches, and the MIN-reduced decisions built on it.

The leading-done MIN agreement on completions lives in ``kvtier.controller.records.finished``.
This module keeps the per-page rules: a rank counts a page ready once its own shard landed or
when another rank owns the page, so a rank that owns none of a prefix never holds the group
back; the group then uses the MIN of what every rank has ready.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.errors import IntegrityError
from kvtier.parallel.group import Group


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


def shard_ready(rank: int, page_owners: Sequence[int], got: int) -> int:
    """``ready_pages`` when the first ``got`` of this rank's own pages arrived (a backend
    call over the rank's shard stops at its first miss)."""
    arrived = [False] * len(page_owners)
    mine = [i for i, o in enumerate(page_owners) if o == rank]
    for i in mine[:got]:
        arrived[i] = True
    return ready_pages(rank, page_owners, arrived)


def usable_prefix(group: Group, ready_pages: int) -> int:
    """Logical pages of a prefetch usable on every rank: the MIN of what each rank has ready.

    A rank counts a page ready once its own shard of it arrived, or when another rank owns it
    (it waits for nothing there), so a rank that owns none of the prefix reports its full length
    and never holds the others back nor lets them run ahead.
    """
    if ready_pages < 0:
        raise IntegrityError(f"rank {group.rank}: {ready_pages} ready pages")
    return group.all_reduce_min(ready_pages)
