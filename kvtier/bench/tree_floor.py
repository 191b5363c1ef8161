"""Memory floors under ``kvtier bench tree``'s ``long`` scenario, measured in its conditions.

``python -m kvtier.bench.tree_floor [SEED]`` builds the scenario's tree (kvtier side of
``kvtier.bench.tree_sides``: page 64, 200 prompts of 32K tokens on a 4K prefix), then times,
with ``time.process_time_ns`` and the collector on, the memory work an op cannot avoid, on
the scenario's own fresh/cached prompts (arrays as cold as the scenario's). The tree is built
from, and stores, int32 tokens (``array('i')``, what the engine holds); the int64 copies of the
same prompts measure what an int64 query would cost:

  ``copy_fresh_bytes``  the 28K new int32 tokens (112 KiB) copied into a fresh ``bytes``
                        object (what a tree keeping tokens in ``bytes`` pays per insert)
  ``copy_arena``        the same tokens copied into the tree's token arena (huge pages)
  ``memcmp_hit``        ``memcmp`` of a cached prompt's 32K int32 tokens against its stored
                        runs (the compare a full-hit match cannot skip)
  ``read_query``        one read of a cached prompt's 32K int64 tokens (``memcmp`` of the
                        array with itself): what any exact full-hit match of an int64 query
                        touches at least, whatever the stored format
  ``int32_hit``         the hit compare with tokens stored as int32 (a copy of each prompt in
                        a huge-page map): the int64 query cast into a scratch array, its range
                        checked (``max`` as uint64, warm by then), ``memcmp`` against the copy
  ``int32_query_hit``   ``memcmp`` of a cached prompt held as int32 (``array('i')``, a query an
                        engine would hand over as int32) against its int32 copy: the hit
                        compare if both sides were int32
  ``int32_store``       the insert copy with tokens stored as int32: range check and cast of
                        a fresh prompt's 28K new tokens into an int32 map (vs ``copy_arena``)

Prints one JSON object: per floor the median and mean microseconds over the ops.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import statistics
import sys
import time

import numpy as np

from kvtier.bench.tree_sides import KvtierSide, Workload, packed
from kvtier.tree.node import Node
from kvtier.tree.tokens import TOKEN_BYTES, memequal


def floors(seed: int = 0, n_ops: int = 40) -> dict:
    w = Workload(seed)
    side = KvtierSide(64)
    prefix = w.draw(4096)
    seqs = [packed(prefix, w.draw(32768 - 4096)) for _ in range(200)]
    queries32 = [packed(s, code="i") for s in seqs]
    for s in queries32:
        side.insert(s, side.pages(s))
    tree = side.tree
    narrow = _int32_map(len(seqs) * 32768 + 2 * n_ops * (32768 - 4096))
    for j, s in enumerate(seqs):  # the int32 copies, written (and gone cold) like the tree's
        narrow[j * 32768 : (j + 1) * 32768] = np.frombuffer(s, np.int64)
    scratch, fill = np.empty(32768, np.int32), len(seqs) * 32768
    scratch_addr, narrow_addr = scratch.ctypes.data, narrow.ctypes.data
    names = ("copy_fresh_bytes", "copy_arena", "memcmp_hit", "read_query", "int32_hit")
    ns: dict[str, list[int]] = {k: [] for k in (*names, "int32_query_hit", "int32_store")}
    # Drawn up front and kept, as the scenario does: no op reuses memory another one freed.
    fresh = [packed(prefix, w.draw(32768 - 4096)) for _ in range(3 * n_ops)]
    fresh32 = [packed(s, code="i") for s in fresh[: 2 * n_ops]]
    half = 32768 // 2
    diverge = [packed(np.asarray(s)[:half], w.draw(32768 - half), code="i") for s in seqs]
    keep: list[object] = []
    cut, page = 4096 * TOKEN_BYTES, 64 * TOKEN_BYTES
    for i in range(n_ops):
        a, b = fresh32[2 * i], fresh32[2 * i + 1]
        t0 = time.process_time_ns()
        keep.append(memoryview(a).cast("B")[cut:].tobytes())
        t1 = time.process_time_ns()
        node = Node(id=-1, parent=None, buf=b"")
        tree.arena.store(node, memoryview(b).cast("B")[cut:])
        t2 = time.process_time_ns()
        keep.append(node)
        ns["copy_fresh_bytes"].append(t1 - t0)
        ns["copy_arena"].append(t2 - t1)
        q = queries32[i % len(seqs)]
        qm = memoryview(q).cast("B")
        # The stored runs, found through first-page keys only (the query's tokens stay cold).
        path, at, n = [], 0, tree.root
        while at < len(qm) and (n := n.children.get(qm[at : at + page].tobytes())) is not None:
            path.append((n, at))
            at += len(n.buf)
        qaddr = q.buffer_info()[0]
        t3 = time.process_time_ns()
        for n, at in path:
            if n.addr:
                memequal(n.addr, qaddr + at, len(n.buf))
            else:
                n.buf.startswith(qm[at : at + len(n.buf)])
        ns["memcmp_hit"].append(time.process_time_ns() - t3)
        tree.match(diverge[(i * 7) % len(seqs)])  # between hits, as the scenario does
        j = (i + len(seqs) // 2) % len(seqs)  # a prompt no op touched yet
        q = seqs[j]
        t4 = time.process_time_ns()
        memequal(q.buffer_info()[0], q.buffer_info()[0], len(q) * q.itemsize)
        t5 = time.process_time_ns()
        ns["read_query"].append(t5 - t4)
        tree.match(diverge[(i * 7 + 1) % len(seqs)])
        j = (i + len(seqs) // 4) % len(seqs)
        a, mine = np.frombuffer(seqs[j], np.int64), narrow_addr + j * 32768 * 4
        t6 = time.process_time_ns()
        np.copyto(scratch, a, casting="unsafe")  # reads the query once; the check reads it warm
        if a.view(np.uint64).max() < 1 << 31:
            memequal(scratch_addr, mine, 32768 * 4)
        t7 = time.process_time_ns()
        ns["int32_hit"].append(t7 - t6)
        tree.match(diverge[(i * 7 + 2) % len(seqs)])
        j = (i + 3 * len(seqs) // 4) % len(seqs)
        q32, mine = queries32[j], narrow_addr + j * 32768 * 4
        t9 = time.process_time_ns()
        memequal(q32.buffer_info()[0], mine, 32768 * 4)
        ns["int32_query_hit"].append(time.process_time_ns() - t9)
        tree.match(diverge[(i * 7 + 3) % len(seqs)])
        new_part = np.frombuffer(fresh[2 * n_ops + i], np.int64)[4096:]
        t8 = time.process_time_ns()
        if new_part.view(np.uint64).max() < 1 << 31:
            np.copyto(narrow[fill : fill + len(new_part)], new_part, casting="unsafe")
        ns["int32_store"].append(time.process_time_ns() - t8)
        fill += len(new_part)
    return {
        k: {"median_us": statistics.median(v) / 1e3, "mean_us": statistics.mean(v) / 1e3}
        for k, v in ns.items()
    }


def _int32_map(n: int) -> np.ndarray:
    """``n`` int32 slots in an anonymous huge-page map, faulted in when first written (like
    the tree's arena chunks)."""
    m = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        with contextlib.suppress(OSError):  # huge pages off: only slower
            m.madvise(advice)
    return np.frombuffer(m, dtype=np.int32)


if __name__ == "__main__":
    print(json.dumps(floors(int(sys.argv[1]) if len(sys.argv) > 1 else 0), indent=1))
