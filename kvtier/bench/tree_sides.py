"""One side of ``kvtier bench tree``'s A/B runs: a script run in its own process.

``python tree_sides.py SIDE SCENARIO SEED SCALE`` builds one tree (``SIDE``: ``kvtier`` for
``kvtier.tree.RadixTree``, ``sglang`` for SGLang's own ``RadixCache`` imported from the running
interpreter), times the ``SCENARIO``'s operations and prints one JSON object: per-op CPU times
(``time.process_time_ns``, the cyclic collector left on), the token lengths each op matched or
found cached (the caller compares them across sides: same tokens, same answers) and the
memory the built tree took.

Both sides draw the same tokens: numpy's PCG64 from ``SEED`` in one fixed order, handed to
each tree in the container its engine holds (``TYPECODE``), built before any timing:
``array('i')`` for kvtier (``Request.tokens`` is int32, compared and stored without
conversion), ``array('q')`` for SGLang (what its ``RadixKey`` holds). ``SCALE`` divides the sizes
(1 for the measured run; larger for tests). Only the standard library, numpy and torch are
imported at module level, so any interpreter with those runs it.

Scenarios:
  ``long``  page 64: a 4K-token prefix shared by 200 prompts of 32K tokens (~10^5 pages), then
            insert a new 32K prompt, match a cached one (full hit), match one diverging at 16K,
            match + lock + unlock a cached one.
  ``chat``  page 16: 2,000 conversations of 768 tokens on 8 system prompts of 256 tokens (2,000
            leaves); evict 256 tokens (then one new conversation is inserted, untimed, so the
            leaf count holds), insert a new 768-token conversation, match a cached one, match +
            lock + unlock.

Memory: bytes per cached token from ``tracemalloc`` (Python-heap allocations made while the tree
was built and still live after; torch tensor storage is not traced), plus the memory a side
maps outside the heap for the tree (``untraced_bytes``: kvtier's token arena chunks, whole), and
from the resident set size (``/proc/self/statm``) growth over the build, which includes both.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable

import numpy as np
import torch

VOCAB = 50_000
_DTYPES = {"i": np.int32, "q": np.int64}


class Workload:
    """Token runs drawn in one fixed order from ``seed``."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def draw(self, n: int) -> np.ndarray:
        return self.rng.integers(0, VOCAB, n, dtype=np.int64)


def packed(*parts: np.ndarray, code: str = "q") -> array:
    """``parts`` joined into one ``array(code)``."""
    out = array(code)
    for p in parts:
        out.frombytes(np.ascontiguousarray(p, dtype=_DTYPES[code]).tobytes())
    return out


class KvtierSide:
    TYPECODE = "i"
    """Tokens as kvtier's engine holds them (``Request.tokens``: int32)."""

    def __init__(self, page_size: int) -> None:
        from kvtier.tree.radix import RadixTree

        self.ps = page_size
        self.tree = RadixTree(page_size)
        self._next = 0

    def pages(self, tokens: array) -> torch.Tensor:
        n = -(-len(tokens) // self.ps)
        self._next += n
        return torch.arange(self._next - n, self._next, dtype=torch.int64)

    def insert(self, tokens: array, pages: torch.Tensor) -> int:
        return self.tree.insert(tokens, pages).cached_len

    def match(self, tokens: array) -> int:
        return self.tree.match(tokens).matched_len

    def match_lock_unlock(self, tokens: array) -> int:
        m = self.tree.match(tokens)
        self.tree.unlock(self.tree.lock(m))
        return m.matched_len

    def evict(self, num_tokens: int) -> int:
        return self.tree.evict_device(-(-num_tokens // self.ps)).num_device() * self.ps

    def untraced_bytes(self) -> int:
        return self.tree.arena.held_bytes()


class _Allocator:
    """What SGLang's simulated ``RadixCache`` asks of an allocator: a device and a free."""

    device = "cpu"

    def free_segment(self, indices: torch.Tensor, start_pos: int = 0) -> None:
        return None

    def free(self, indices: torch.Tensor) -> None:
        return None


class SglangSide:
    TYPECODE = "q"
    """Tokens as handed to SGLang's tree so far (int64, what ``RadixKey`` holds)."""

    def __init__(self, page_size: int) -> None:
        from sglang.srt.mem_cache import radix_cache as rc
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )

        self.ps = page_size
        self.key, self.insert_p, self.match_p, self.evict_p = (
            rc.RadixKey,
            InsertParams,
            MatchPrefixParams,
            EvictParams,
        )
        self.cache = rc.RadixCache.create_simulated(
            mock_allocator=_Allocator(), page_size=page_size
        )
        self._next = 0

    def pages(self, tokens: array) -> torch.Tensor:
        # SGLang's tree holds one KV index per token.
        n = len(tokens)
        self._next += n
        return torch.arange(self._next - n, self._next, dtype=torch.int64)

    def insert(self, tokens: array, pages: torch.Tensor) -> int:
        return self.cache.insert(self.insert_p(key=self.key(tokens), value=pages)).prefix_len

    def match(self, tokens: array) -> int:
        return self.cache.match_prefix(self.match_p(key=self.key(tokens))).device_prefix_len

    def match_lock_unlock(self, tokens: array) -> int:
        r = self.cache.match_prefix(self.match_p(key=self.key(tokens)))
        self.cache.inc_lock_ref(r.last_device_node)
        self.cache.dec_lock_ref(r.last_device_node)
        return r.device_prefix_len

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(self.evict_p(num_tokens=num_tokens)).num_tokens_evicted

    def untraced_bytes(self) -> int:
        return 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Recorder:
    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = {}
        self.lens: dict[str, list[int]] = {}

    def time(self, name: str, op: Callable[[], int]) -> None:
        a = time.process_time_ns()
        n = op()
        self.ns.setdefault(name, []).append(time.process_time_ns() - a)
        self.lens.setdefault(name, []).append(int(n))


def _build(side: KvtierSide | SglangSide, seqs: list[array]) -> dict:
    gc.collect()
    rss0 = _rss()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for s in seqs:
        side.insert(s, side.pages(s))
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base + side.untraced_bytes()
    tracemalloc.stop()
    gc.collect()
    cached = sum(len(s) for s in seqs)  # upper bound; shared prefixes counted once below
    return {"traced_bytes": traced, "rss_bytes": _rss() - rss0, "inserted_tokens": cached}


def run_long(side_cls: type, w: Workload, scale: int) -> dict:
    ps, prefix_len, prompt_len = 64, 4096 // scale, 32768 // scale
    n_prompts, n_ops = max(4, 200 // scale), max(2, 20 // scale)
    side = side_cls(ps)
    code = side_cls.TYPECODE
    prefix = w.draw(prefix_len)
    seqs = [packed(prefix, w.draw(prompt_len - prefix_len), code=code) for _ in range(n_prompts)]
    mem = _build(side, seqs)
    mem["cached_tokens"] = prefix_len + n_prompts * (prompt_len - prefix_len)
    rec = Recorder()
    fresh = [packed(prefix, w.draw(prompt_len - prefix_len), code=code) for _ in range(n_ops)]
    half = prompt_len // 2
    diverge = [packed(np.asarray(s)[:half], w.draw(prompt_len - half), code=code) for s in seqs]
    for i in range(n_ops):
        s = fresh[i]
        pages = side.pages(s)
        rec.time("long_insert_32k", lambda s=s, p=pages: side.insert(s, p))
    for i in range(n_ops):
        hit, div = seqs[i % n_prompts], diverge[(i * 7) % n_prompts]
        rec.time("long_match_hit_32k", lambda s=hit: side.match(s))
        rec.time("long_match_diverge_16k", lambda s=div: side.match(s))
        rec.time("long_match_lock_unlock_32k", lambda s=hit: side.match_lock_unlock(s))
    return {"memory": mem, "ns": rec.ns, "lens": rec.lens}


def run_chat(side_cls: type, w: Workload, scale: int) -> dict:
    ps, sys_len, conv_len = 16, 256, 768
    n_convs, n_ops = max(40, 2000 // scale), max(10, 200 // scale)
    side = side_cls(ps)
    systems = [w.draw(sys_len) for _ in range(8)]

    def conversation(i: int) -> array:
        return packed(systems[i % 8], w.draw(conv_len - sys_len), code=side_cls.TYPECODE)

    seqs = [conversation(i) for i in range(n_convs)]
    mem = _build(side, seqs)
    mem["cached_tokens"] = 8 * sys_len + n_convs * (conv_len - sys_len)
    rec = Recorder()
    for i in range(n_ops):
        rec.time("chat_evict_256", lambda: side.evict(256))
        s = conversation(i)
        side.insert(s, side.pages(s))
        seqs.append(s)
    fresh = [conversation(i) for i in range(n_ops)]
    for i in range(n_ops):
        s = fresh[i]
        pages = side.pages(s)
        rec.time("chat_insert_768", lambda s=s, p=pages: side.insert(s, p))
    for i in range(n_ops):
        hit = seqs[-1 - (i * 13) % n_convs]
        rec.time("chat_match_768", lambda s=hit: side.match(s))
        rec.time("chat_match_lock_unlock_768", lambda s=hit: side.match_lock_unlock(s))
    return {"memory": mem, "ns": rec.ns, "lens": rec.lens}


SCENARIOS = {"long": run_long, "chat": run_chat}
SIDES = {"kvtier": KvtierSide, "sglang": SglangSide}


def main(argv: list[str]) -> int:
    side, scenario, seed, scale = argv[0], argv[1], int(argv[2]), int(argv[3])
    out = SCENARIOS[scenario](SIDES[side], Workload(seed), scale)
    out["side"], out["scenario"] = side, scenario
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
