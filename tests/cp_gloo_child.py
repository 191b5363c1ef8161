"""One rank of the two-process gloo acknowledgement test (``test_cp_acks``).

Each rank backs up three nodes, retires acks by MIN agreement over three steps, then rank 1
dies (``dead``) or stops answering while alive (``stuck``), and rank 0 must fail within the
timeout with an error naming it. Each rank writes what it saw to
``<out>/rank<r>.json`` (rank 1 before it dies).
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

from kvtier.parallel.acks import AckQueue, all_ranks, usable_prefix
from kvtier.parallel.alloc import OwnerAllocator, write_shard
from kvtier.parallel.group import GlooGroup, RankError
from kvtier.parallel.layout import CPLayout
from kvtier.pools.allocator import PageAllocator

NODES = {1: [0, 0], 2: [1], 3: [0, 1]}
"""Saved owners per node: rank 1 owns nothing of node 1, rank 0 nothing of node 2."""


def worker(rank: int, port: int, out: str, mode: str, timeout: float) -> None:
    group = GlooGroup.init(rank, 2, f"tcp://127.0.0.1:{port}", timeout=timeout)
    layout = CPLayout(2, rank, "round_robin")
    devices, host = OwnerAllocator(layout, pages_per_rank=4), PageAllocator(8, name="host")
    writes = AckQueue(group, "write")
    acks, seen = {}, {"rank": rank, "pages": {}, "retired": []}
    for node, owners in NODES.items():
        pages = devices.alloc(owners)
        if pages is None:
            raise RuntimeError("device lanes too small for the test")
        shard = write_shard(layout, node, pages, owners, host.alloc, 4)
        if shard is None:
            raise RuntimeError("host pool too small for the test")
        meta, copy = shard
        acks[node] = writes.open(node, copy.positions.numel())
        seen["pages"][node] = [acks[node].pages, acks[node].done, meta.host_pages.tolist()]
    # Step 1 rank 0 finishes node 1; step 2 rank 1 finishes node 2; step 3 both finish node 3.
    for finish in ({0: 1}, {1: 2}, {0: 3, 1: 3}):
        if rank in finish:
            writes.complete(acks[finish[rank]])
        seen["retired"].append([a.node for a in writes.agree()])
    seen["usable"] = usable_prefix(group, 3 if rank == 0 else 1)
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
    writes.open(4, 1)
    start = time.monotonic()
    try:
        writes.agree()
        seen["error"] = None
    except RankError as e:
        seen["error"] = {"ranks": list(e.ranks), "message": str(e)}
    seen["waited"] = time.monotonic() - start
    _write(out, rank, seen)
    os._exit(0)  # the group is broken: skip the teardown that would talk to the dead rank


def _write(out: str, rank: int, seen: dict) -> None:
    path = Path(out) / f"rank{rank}.json"
    path.write_text(json.dumps(seen))
