"""Host pages as a busy host tier hands them out, for the transfer benchmarks.

A transfer's host pages are never a random permutation of the pool in practice: every backup
allocates one tree node's pages at a time from ``PageAllocator``'s free list, and every eviction
frees one node's pages, in order. ``churned`` replays that: nodes of chat-like lengths fill the
pool, the least recently used ones (with random hits moving nodes to the front) are evicted to
make room for new ones, and after several turnovers of the pool the batches asked for are
allocated node by node. The runs of consecutive host pages they come out in are what a
copy-engine or staged transfer sees; ``mean_run`` reports them.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

import torch

from kvtier.pools.allocator import PageAllocator
from kvtier.transfer.plan import mean_run_length

NODE_TOKENS_MEDIAN = 512
"""Median tokens of a tree node (a chat turn); lengths are log-normal around it."""
NODE_TOKENS_SIGMA = 1.2
"""Spread of the log-normal node lengths (about 50 to 5,000 tokens within two sigmas)."""
HIT_SHARE = 0.3
"""Share of steps that touch a random cached node instead of adding a new one."""
TURNOVERS = 4
"""How many times the pool's pages are replaced before the batches are taken."""


def churned(
    pool_pages: int, batches: list[int], page_size: int, seed: int = 0
) -> list[torch.Tensor]:
    """Host page lists of ``batches[i]`` pages each (int64), allocated node by node from a
    ``pool_pages``-page allocator after ``TURNOVERS`` turnovers of node churn; the pool must
    hold every batch at once."""
    if sum(batches) > pool_pages:
        raise ValueError(f"batches of {sum(batches)} pages do not fit {pool_pages} pages")
    rng = random.Random(seed)
    alloc = PageAllocator(pool_pages, "host")
    cached: OrderedDict[int, torch.Tensor] = OrderedDict()  # LRU first
    next_id = 0

    def node_pages() -> int:
        tokens = math.exp(rng.gauss(math.log(NODE_TOKENS_MEDIAN), NODE_TOKENS_SIGMA))
        return max(1, min(pool_pages // 8, math.ceil(tokens / page_size)))

    def take(n: int) -> torch.Tensor:
        while alloc.available < n:
            _, pages = cached.popitem(last=False)
            alloc.free(pages)
        pages = alloc.alloc(n)
        if pages is None:  # cannot happen: evicted until it fits
            raise RuntimeError(f"host_runs: {n} pages do not fit after eviction")
        return pages

    added = 0
    while added < TURNOVERS * pool_pages:
        if cached and rng.random() < HIT_SHARE:
            cached.move_to_end(rng.choice(list(cached)))
            continue
        n = node_pages()
        cached[next_id] = take(n)
        next_id += 1
        added += n
    out = []
    for size in batches:
        parts, left = [], size
        while left:
            n = min(left, node_pages())
            parts.append(take(n))
            left -= n
        out.append(torch.cat(parts))
    # The batches stay allocated: evicting for a later batch never reuses an earlier one's pages.
    return out


def mean_run(pages: torch.Tensor) -> float:
    """Mean length of the runs of consecutive page ids in ``pages``, in order."""
    return mean_run_length(pages) if pages.numel() else 0.0
