"""``bench ttft``'s decode stall: decode steps of a batch of short requests alone and while
device → host backups of prompt-sized prefixes are kept waiting, more than the link moves in a
step (the prefixes inserted through the cache's public API, backed up by its write-through
policy).

Variants, each a cache option on a warmed engine of its own: ``paced``
(``CacheConfig.backup_share``, the default) with the chosen mechanisms, ``paced_kernels`` (row
kernels forced: ``transfer_mechanism="kernel"``), ``unpaced`` (queued whole:
``backup_share=0``). The stall is the step-time ratio to the batch alone. A step's time moves
by several percent between engines and machines, so the batch alone and ``paced`` are measured
in ``rounds`` alternating pairs and ``paced``'s stall is the median of the pairs' ratios; the
other variants run once, against the median step alone.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, SamplingParams
from kvtier.engine.model import CausalLM

DECODE_BATCH = 32
"""Requests decoding together while backups run."""
DECODE_PAGES = 512
"""Device pages beyond the prompt's, for the decoding batch."""
DECODE_STEPS = 24
"""Decode steps timed per measurement."""
STALL_ROUNDS = 3
"""Alternating (alone, paced) pairs the paced stall is the median of."""


def release_pools() -> None:
    """Give back the pools of engines already closed before the next one allocates its own:
    an engine's objects form reference cycles (split hooks), and torch keeps freed pinned
    blocks cached, so without this every engine's pinned host pool stays resident."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def backup_during_decode(
    model: CausalLM,
    base: CacheConfig,
    rng: random.Random,
    vocab: int,
    num_pages: int,
    batch: int = DECODE_BATCH,
    num_steps: int = DECODE_STEPS,
    rounds: int = STALL_ROUNDS,
    log: Callable[[str], None] | None = None,
    others: bool = True,
    in_flight: int | None = None,
) -> dict:
    """Mean decode step time of ``batch`` requests alone and under back-to-back backups of
    ``num_pages`` pages each, on engines of their own (``base`` without storage; pools sized
    for the backups kept waiting); see the module docstring. Completed backup bytes are the
    cache's ``backup_bytes`` counter. ``log``, when given, is called with a summary line.
    ``others=False`` leaves out the variants other than ``paced`` (for probes). ``in_flight``
    fixes how many backups wait before each step; ``None`` measures it (more than the link moves
    in one step), which on a loaded host with fast backups can mean hundreds."""
    ps = base.page_size

    def engine(in_flight: int, **options: object) -> LLM:
        release_pools()
        cfg = dataclasses.replace(
            base,
            storage=None,
            write_policy="write_through",
            device_pages=(in_flight + 1) * num_pages + DECODE_PAGES,
            host_pages=(in_flight + 2) * num_pages,
            **options,
        )
        return LLM(model, cfg, max_running=batch, max_prefill_tokens=batch * 128)

    def queue_backup(llm: LLM) -> None:
        tokens = [rng.randrange(vocab) for _ in range(num_pages * ps)]
        locs = llm.cache.alloc(len(tokens))
        cached = llm.cache.insert(tokens, locs).cached_len
        if cached:  # a page that happened to be cached already: ours is a duplicate
            llm.cache.free(locs[:cached])

    def backed_up(llm: LLM) -> tuple[int, int]:
        """Backup bytes completed and dropped (host tier full) so far."""
        s = llm.cache.stats()
        page_bytes = sum(sp.page_bytes(ps) for sp in llm.cache.specs)
        return s["backup_bytes"], s["dropped_host_backups"] * page_bytes

    def steps(llm: LLM, n: int, in_flight: int = 0) -> tuple[float, int]:
        """Mean step time over ``n`` decode steps, and the bytes of the backups (``in_flight``
        of them kept waiting) that completed during them."""
        # Requests decode through every timed step; what runs after them is not timed.
        params = SamplingParams(max_tokens=n + 2, ignore_eos=True)
        for _ in range(batch):
            llm.add_request([rng.randrange(vocab) for _ in range(128)], params)
        llm.step()  # the batch's prefill
        done0, _ = backed_up(llm)
        queued = 0
        total = 0.0
        for _ in range(n):
            done, dropped = backed_up(llm)
            while queued - (done - done0) - dropped < in_flight * nbytes:
                queue_backup(llm)
                queued += nbytes
            t0 = time.perf_counter()
            llm.step()
            total += time.perf_counter() - t0
        done = backed_up(llm)[0] - done0
        while llm.has_unfinished():
            llm.step()
        llm.cache.drain()
        llm.cache.check_integrity()
        return total / n, done

    def timed_backup(llm: LLM) -> float:
        """Seconds of one whole backup (after a warm-up one), insert to visible."""
        queue_backup(llm)
        llm.cache.drain()
        t0 = time.perf_counter()
        queue_backup(llm)
        llm.cache.drain()
        return time.perf_counter() - t0

    def alone_step() -> float:
        llm = engine(1)
        try:
            steps(llm, 4)  # warm-up: a fresh engine records CUDA graphs
            return steps(llm, num_steps)[0]
        finally:
            llm.close()

    def under_backups(in_flight: int, mechanism: str, paced: bool) -> dict:
        share = base.backup_share if paced else 0.0
        llm = engine(in_flight, transfer_mechanism=mechanism, backup_share=share)
        try:
            backup_s = timed_backup(llm)
            steps(llm, 4, in_flight)  # warm-up, as alone
            step_s, done = steps(llm, num_steps, in_flight)
        finally:
            llm.close()
        return {
            "transfer_mechanism": mechanism,
            "backup_share": share,
            "backup_gbps_alone": nbytes / backup_s / 1e9,
            "decode_step_ms": step_s * 1e3,
            "backup_gbps_while_decoding": done / (step_s * num_steps) / 1e9,
        }

    nbytes = num_pages * sum(s.page_bytes(ps) for s in model.pool_specs())
    llm = engine(1)
    try:
        steps(llm, 4)  # warm-up
        first_alone = steps(llm, num_steps)[0]
        one = timed_backup(llm)
    finally:
        llm.close()
    del llm
    if in_flight is None:
        # More backup work waiting before each step than the link moves in it.
        in_flight = math.ceil(first_alone / one) + 1
    alone_s: list[float] = []
    paced_runs: list[dict] = []
    for r in range(max(1, rounds)):
        alone_s.append(first_alone if r == 0 else alone_step())
        paced_runs.append(under_backups(in_flight, "auto", paced=True))
    ratios = [p["decode_step_ms"] / (a * 1e3) for p, a in zip(paced_runs, alone_s, strict=True)]
    alone = statistics.median(alone_s)
    paced = {
        k: statistics.median(p[k] for p in paced_runs) if isinstance(v, float) else v
        for k, v in paced_runs[0].items()
    }
    paced["stall"] = statistics.median(ratios)
    paced["stall_rounds"] = ratios
    runs = {"paced": paced}
    for name, mechanism, is_paced in (
        (("paced_kernels", "kernel", True), ("unpaced", "auto", False)) if others else ()
    ):
        runs[name] = under_backups(in_flight, mechanism, is_paced)
        runs[name]["stall"] = runs[name]["decode_step_ms"] / (alone * 1e3)
    if log is not None:
        log(
            f"decode step {alone * 1e3:.2f} ms alone (median of {len(alone_s)}); {in_flight} "
            "backups waiting: "
            + ", ".join(
                f"{k} {r['decode_step_ms']:.2f} ms ({r['backup_gbps_while_decoding']:.1f} GB/s)"
                for k, r in runs.items()
            )
            + f"; paced stall {paced['stall']:.3f} (rounds "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + ")"
        )
    return {
        "batch": batch,
        "steps": num_steps,
        "backups_in_flight": in_flight,
        "backup_bytes": nbytes,
        "decode_step_ms": alone * 1e3,
        "decode_step_ms_rounds": [a * 1e3 for a in alone_s],
        **runs,
    }
