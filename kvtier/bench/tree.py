"""Radix tree operation costs against a flat hash table of page prefixes run in the same process.

The peer is the "flat hash table" index: page ``i`` of a sequence is keyed by
``hash((key(i-1), tokens of page i))`` in one dict, and a lookup walks the query page by page
until the first missing key, returning the page ids it found.

``kvtier bench tree [--json OUT.json]`` prints the result as JSON (and writes it to
``OUT.json``).
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvtier.bench.helpers import logger
from kvtier.errors import ConfigError
from kvtier.tree.node import Node
from kvtier.tree.radix import RadixTree

_log = logger("tree")

VOCAB = 50_000
"""Token ids are drawn from ``[0, VOCAB)``."""
SYSTEM_PROMPTS = 8
"""Distinct shared prefixes the conversations start from."""
MATCH_OPS = 5_000
MISS_OPS = 2_000
INSERT_OPS = 2_000
"""At most; fewer on small trees (one per 50 cached pages, at least 100)."""
LOCK_OPS = 5_000
EVICT_OPS = 200
"""At most; fewer on small trees (one per 500 cached pages, at least 20)."""
EVICT_BATCH = 16
PROMPT_REPEATS = 10

FlatTable = dict[int, int]


@contextmanager
def _no_gc() -> Iterator[None]:
    """Keep the cyclic collector out of the timed region."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _stats(ns: Sequence[int], pages: Sequence[int] | None = None) -> dict:
    """Mean/p50/p99 microseconds per op; with ``pages`` also pages per op and µs per page."""
    s = sorted(ns)
    n = len(s)

    def pct(q: float) -> float:
        return s[min(n - 1, round(q * (n - 1)))] / 1e3

    out = {"ops": n, "mean_us": sum(s) / n / 1e3, "p50_us": pct(0.5), "p99_us": pct(0.99)}
    if pages is not None:
        total = sum(pages)
        out["pages_per_op"] = total / n
        out["us_per_page"] = sum(s) / max(total, 1) / 1e3
    return out


def _flat_match(table: FlatTable, tokens: Sequence[int], ps: int) -> list[int]:
    """Page ids of the longest prefix of ``tokens`` whose chained page keys are all in ``table``."""
    out: list[int] = []
    get = table.get
    h = 0
    for i in range(0, len(tokens) - ps + 1, ps):
        h = hash((h, tuple(tokens[i : i + ps])))
        p = get(h)
        if p is None:
            break
        out.append(p)
    return out


def _flat_insert(table: FlatTable, tokens: Sequence[int], pages: Sequence[int], ps: int) -> int:
    """Record one page id per whole page of ``tokens``; returns how many pages were present."""
    present = 0
    h = 0
    for j, i in enumerate(range(0, len(tokens) - ps + 1, ps)):
        h = hash((h, tuple(tokens[i : i + ps])))
        if h in table:
            present += 1
        else:
            table[h] = pages[j]
    return present


def _path_tokens(node: Node, root: Node, parents: dict[Node, Node | None]) -> list[int]:
    """Tokens from the root to the end of ``node``; ``parents`` supplies links of detached nodes."""
    parts: list[tuple[int, ...]] = []
    n: Node | None = node
    while n is not None and n is not root:
        parts.append(n.tokens)
        n = parents.get(n, n.parent)
    return [t for part in reversed(parts) for t in part]


def bench_tree(
    num_pages: int = 100_000, page_size: int = 16, prompt_tokens: int = 32_768, seed: int = 0
) -> dict:
    """Measure ``RadixTree`` match/insert/lock/evict costs on a tree of ~``num_pages`` pages.

    The tree holds conversations built on ``SYSTEM_PROMPTS`` shared system prompts, each
    conversation inserted turn by turn (random tokens from ``seed``; device page ids from a
    counter). Part (a) times matches (hits of varying depth, hits diverging into random tokens,
    misses), inserts extending existing prefixes, lock+unlock of a match, and
    ``evict_device(EVICT_BATCH)`` (evicted sequences are re-inserted untimed so the size stays
    steady). Part (b) times a ``prompt_tokens`` prompt: cold match and insert, full-hit match,
    and match and insert of a prompt diverging at its middle page. Last, every node is given a
    host copy and ``evict_host(EVICT_BATCH)`` is timed (evicted copies given back untimed). Matches and inserts are also
    run through the flat hash table peer on the same inputs; a matched length that differs
    between the two raises ``RuntimeError``. The tree is trimmed back to ~``num_pages`` pages
    (untimed) after phases that grow it. Times are per op with the garbage collector paused;
    ``us_per_page`` is per matched page for matches (absent when nothing matched), per page
    passed for inserts and per page freed for evictions.

    Returns a JSON-ready dict with per-op stats, the peer's stats and
    ``ratio[op] = tree mean time / flat table mean time``. Raises ``ConfigError`` unless
    ``num_pages`` and ``page_size`` are positive and ``prompt_tokens`` holds at least two pages.
    """
    if num_pages <= 0 or page_size <= 0 or prompt_tokens < 2 * page_size:
        raise ConfigError(
            f"num_pages={num_pages}, page_size={page_size} and prompt_tokens={prompt_tokens}:"
            " need positive sizes and a prompt of at least two pages"
        )
    ps = page_size
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tree = RadixTree(ps)
    table: FlatTable = {}
    counter = 0
    cached = 0

    def tokens(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    def new_pages(n: int) -> torch.Tensor:
        nonlocal counter
        counter += n
        return torch.arange(counter - n, counter, dtype=torch.int64)

    def check(what: str, tree_pages: int, flat_pages: int, expect: int | None = None) -> None:
        if tree_pages != flat_pages or (expect is not None and tree_pages != expect):
            raise RuntimeError(
                f"{what}: tree matched {tree_pages} pages, flat table {flat_pages},"
                f" expected {expect}"
            )

    def trim() -> None:
        nonlocal cached
        if cached > num_pages:
            cached -= tree.evict_device(cached - num_pages).num_device()

    # ---- fill ----------------------------------------------------------------------------
    t0 = time.perf_counter()
    sys_max = max(1, min(128, num_pages // 200))
    system = [
        tokens(rng.randint(max(1, sys_max // 4), sys_max) * ps) for _ in range(SYSTEM_PROMPTS)
    ]
    convs: list[list[int]] = []
    while cached < num_pages:
        seq = list(rng.choice(system))
        for _ in range(rng.randint(1, 8)):
            seq = seq + tokens(rng.randint(2, 48) * ps)
            pages = new_pages(len(seq) // ps)
            cached += pages.numel() - tree.insert(seq, pages).duplicates.numel()
            _flat_insert(table, seq, pages.tolist(), ps)
            if cached >= num_pages:
                break
        convs.append(seq)
    nodes = sum(1 for _ in tree.nodes())
    fill = {
        "pages": cached,
        "nodes": nodes,
        "conversations": len(convs),
        "system_prompts": SYSTEM_PROMPTS,
        "fill_s": time.perf_counter() - t0,
    }
    gc.collect()
    _log(f"filled {cached} pages in {nodes} nodes ({len(convs)} conversations)")

    tree_ns: dict[str, list[int]] = {}
    flat_ns: dict[str, list[int]] = {}
    op_pages: dict[str, list[int]] = {}

    def run_matches(
        name: str, queries: list[tuple[list[int], int | None]], log: bool = True
    ) -> None:
        tn, fn, pg = tree_ns.setdefault(name, []), flat_ns.setdefault(name, []), []
        with _no_gc():
            for q, expect in queries:
                a = time.perf_counter_ns()
                m = tree.match(q)
                b = time.perf_counter_ns()
                f = _flat_match(table, q, ps)
                c = time.perf_counter_ns()
                tn.append(b - a)
                fn.append(c - b)
                got = m.matched_len // ps
                check(name, got, len(f), expect)
                pg.append(got)
        if any(pg):
            op_pages.setdefault(name, []).extend(pg)
        if log:
            _log(
                f"{name}: tree {_stats(tn)['mean_us']:.2f} us, flat {_stats(fn)['mean_us']:.2f} us"
            )

    def run_inserts(name: str, seqs: list[list[int]]) -> None:
        nonlocal cached
        tn, fn = tree_ns.setdefault(name, []), flat_ns.setdefault(name, [])
        pg = op_pages.setdefault(name, [])
        with _no_gc():
            for s in seqs:
                pages = new_pages(len(s) // ps)
                plist = pages.tolist()
                a = time.perf_counter_ns()
                out = tree.insert(s, pages)
                b = time.perf_counter_ns()
                present = _flat_insert(table, s, plist, ps)
                c = time.perf_counter_ns()
                tn.append(b - a)
                fn.append(c - b)
                pg.append(len(plist))
                check(name, out.cached_len // ps, present)
                cached += len(plist) - out.duplicates.numel()

    # ---- (a) matches ------------------------------------------------------------------------
    def hit_query() -> list[int]:
        c = rng.choice(convs)
        return c[: rng.randint(ps, len(c))]

    hits = [(q, len(q) // ps) for q in (hit_query() for _ in range(MATCH_OPS))]
    diverging = [(q + tokens(rng.randint(1, 64 * ps)), None) for q, _ in hits[:MISS_OPS]]
    misses = [(tokens(rng.randint(1, 128) * ps), 0) for _ in range(MISS_OPS)]
    run_matches("match_hit", hits)
    run_matches("match_diverge", diverging)
    run_matches("match_miss", misses)

    # ---- (a) lock + unlock ------------------------------------------------------------------
    lock_ns: list[int] = []
    with _no_gc():
        for _ in range(LOCK_OPS):
            m = tree.match(hit_query())
            a = time.perf_counter_ns()
            node = tree.lock(m)
            tree.unlock(node)
            lock_ns.append(time.perf_counter_ns() - a)
    _log(f"lock_unlock: {_stats(lock_ns)['mean_us']:.2f} us")

    # ---- (a) inserts extending existing prefixes --------------------------------------------
    def extension() -> list[int]:
        c = rng.choice(convs)
        return c[: rng.randint(1, len(c) // ps) * ps] + tokens(rng.randint(1, 16) * ps)

    n_insert = min(INSERT_OPS, max(100, num_pages // 50))
    run_inserts("insert", [extension() for _ in range(n_insert)])
    _log(
        f"insert: tree {_stats(tree_ns['insert'])['mean_us']:.2f} us, "
        f"flat {_stats(flat_ns['insert'])['mean_us']:.2f} us"
    )
    trim()

    # ---- (b) long prompts ---------------------------------------------------------------
    n_prompt = prompt_tokens // ps
    mid = n_prompt // 2 * ps
    for _ in range(PROMPT_REPEATS):
        p = tokens(n_prompt * ps)
        run_matches("prompt_cold_match", [(p, 0)], log=False)
        run_inserts("prompt_cold_insert", [p])
        run_matches("prompt_hit_match", [(p, n_prompt)], log=False)
        d = p[:mid] + tokens(n_prompt * ps - mid)
        run_matches("prompt_diverge_match", [(d, mid // ps)], log=False)
        run_inserts("prompt_diverge_insert", [d])
    for name in (
        "prompt_cold_match",
        "prompt_cold_insert",
        "prompt_hit_match",
        "prompt_diverge_match",
    ):
        _log(
            f"{name} ({n_prompt} pages): tree {_stats(tree_ns[name])['mean_us']:.1f} us, "
            f"flat {_stats(flat_ns[name])['mean_us']:.1f} us"
        )
    trim()

    # ---- (a) eviction of a small batch, re-inserted to keep the size steady ----------------
    evict_ns: list[int] = []
    evict_pages: list[int] = []
    for _ in range(min(EVICT_OPS, max(20, num_pages // 500))):
        parents: dict[Node, Node | None] = {}

        def record(node: Node, parents: dict[Node, Node | None] = parents) -> bool:
            parents[node] = node.parent
            return True

        with _no_gc():
            a = time.perf_counter_ns()
            ev = tree.evict_device(EVICT_BATCH, prepare=record)
            evict_ns.append(time.perf_counter_ns() - a)
        freed = ev.num_device()
        evict_pages.append(freed)
        cached -= freed
        for node in parents:
            seq = _path_tokens(node, tree.root, parents)
            out = tree.insert(seq, new_pages(len(seq) // ps))
            cached += len(seq) // ps - out.duplicates.numel()
    _log(f"evict_device({EVICT_BATCH}): {_stats(evict_ns, evict_pages)['mean_us']:.1f} us")
    tree.check_integrity()

    # ---- (b) host eviction: every node gets a host copy, evicted ones get one back ----------
    def give_host_copies() -> None:
        for node in tree.nodes():
            if node.host is None:
                tree.set_host(node, new_pages(node.num_pages(ps)))

    give_host_copies()
    host_ns: list[int] = []
    host_pages: list[int] = []
    for _ in range(min(EVICT_OPS, max(20, num_pages // 500))):
        with _no_gc():
            a = time.perf_counter_ns()
            ev = tree.evict_host(EVICT_BATCH)
            host_ns.append(time.perf_counter_ns() - a)
        host_pages.append(ev.num_host())
        give_host_copies()
    _log(f"evict_host({EVICT_BATCH}): {_stats(host_ns, host_pages)['mean_us']:.1f} us")
    tree.check_integrity()

    ops = {name: _stats(ns, op_pages.get(name)) for name, ns in tree_ns.items()}
    ops["lock_unlock"] = _stats(lock_ns)
    ops["evict_device"] = _stats(evict_ns, evict_pages)
    ops["evict_host"] = _stats(host_ns, host_pages)
    flat = {name: _stats(ns, op_pages.get(name)) for name, ns in flat_ns.items()}
    ratio = {name: ops[name]["mean_us"] / flat[name]["mean_us"] for name in flat}
    out = {
        "bench": "tree",
        "num_pages": num_pages,
        "page_size": ps,
        "prompt_tokens": n_prompt * ps,
        "seed": seed,
        "tree": {**fill, "final_pages": cached, "final_nodes": sum(1 for _ in tree.nodes())},
        "ops": ops,
        "flat_table": flat,
        "ratio": ratio,
    }
    _log("ratio tree/flat: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items()))
    return out
