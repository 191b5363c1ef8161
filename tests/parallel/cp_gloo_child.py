"""One rank of the two-process gloo agreement test (``test_cp_acks``).

Each rank agrees on a few MIN reductions, on the usable prefix of a fetch and on two flags, then
rank 1 dies (``dead``) or stops answering while alive (``stuck``), and rank 0 must fail within
the timeout with an error naming it. Each rank writes what it saw to ``<out>/rank<r>.json``
(rank 1 before it dies).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kvtier.parallel.acks import all_ranks, ready_pages, usable_prefix
from kvtier.parallel.group import GlooGroup, RankError

VALUES = [(3, 5), (7, 2), (4, 4)]
"""Per round, the value each rank offers to ``all_reduce_min``."""
OWNERS = [0, 1, 1, 0, 1]
"""Owners of a five-page fetch."""
ARRIVED = {0: [True, False, False, True, False], 1: [False, True, False, False, False]}
"""Which pages of the fetch landed on each rank (only a rank's own pages matter)."""


def worker(rank: int, port: int, out: str, mode: str, timeout: float) -> None:
    group = GlooGroup.init(rank, 2, f"tcp://127.0.0.1:{port}", timeout=timeout)
    seen: dict = {"rank": rank}
    seen["mins"] = [group.all_reduce_min(v[rank]) for v in VALUES]
    seen["ready"] = ready_pages(rank, OWNERS, ARRIVED[rank])
    seen["usable"] = usable_prefix(group, seen["ready"])
    seen["all"] = [all_ranks(group, True), all_ranks(group, rank == 0)]
    if rank == 1:
        _write(out, rank, seen)
        if mode == "stuck":
            # Alive with its connections open, but not joining: rank 0 must give up on its own
            # clock. Blocked on a message rank 0 never sends, until rank 0 exits (its connection
            # closes) or six timeouts passed, so this rank never outlives the test.
            never = dist.irecv(torch.zeros(1, dtype=torch.int64), src=0, tag=99)
            with contextlib.suppress(RuntimeError):
                never.wait(timedelta(seconds=6 * timeout))
        os._exit(0)  # leaves without joining the next collective
    start = time.monotonic()
    try:
        group.all_reduce_min(1)
        seen["error"] = None
    except RankError as e:
        seen["error"] = {"ranks": list(e.ranks), "message": str(e)}
    seen["waited"] = time.monotonic() - start
    _write(out, rank, seen)
    os._exit(0)  # the group is broken: skip the teardown that would talk to the dead rank


def _write(out: str, rank: int, seen: dict) -> None:
    path = Path(out) / f"rank{rank}.json"
    path.write_text(json.dumps(seen))
