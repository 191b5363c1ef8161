"""Time to first token through every tier, for one long prompt on a dense model.

Scenarios, in one process: cold prefill; device hit; host restore without and with per-layer
overlap; storage restore (prefetch included). The peer is the link: the prefix's KV bytes over a
contiguous pinned host → device copy measured in the same run, so ``overlap_ratio`` is the
overlapped host-restore TTFT over max(transfer time at link speed, device-hit TTFT) — the best
a restore can do is to hide one behind the other; the cold scenario's prompt no tier holds.
``storage_ratio``: the storage restore over max(the prefix's bytes at the rate a plain read of
every stored object reached in the same run, the host restore). ``same_first_token``: whether
every restore gave the device hit's first token (a restore not byte-exact shows as another).
The prompt computed whole, untimed (``reference_token``, ``reference_matches``), rounds
differently in bf16, so its argmax may differ; ``tests/test_oracle.py`` checks exactness.

On CUDA ``backup_during_decode`` then times decode steps of a batch of short requests alone and
while device → host backups of prompt-sized prefixes (inserted through the cache's public API,
backed up by its write-through policy) are kept waiting, more than the link moves in a step:
paced (``CacheConfig.backup_share``, the default) with the chosen mechanisms (copy engines for
these page sizes) and with row kernels forced (``transfer_mechanism="kernel"``), and queued whole
(``unpaced``: ``backup_share=0``), each a cache option on a warmed engine of its own. The stall
is the step-time ratio; ``backup_gbps_while_decoding``, backup bytes completed per timed second.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import sys
import tempfile
import time

import torch

from kvtier.bench.raw_read import read_dir
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.engine.model import CausalLM
from kvtier.transfer import dma


def _log(msg: str) -> None:
    print(f"[bench ttft] {msg}", file=sys.stderr, flush=True)


class _DeviceInitLM(CausalLM):
    """The dense model with random weights drawn on its own device (seconds, not minutes, for
    billions of parameters)."""

    def init_random(self, seed: int) -> None:  # filled by fill_random once on the device
        pass

    @torch.no_grad()
    def fill_random(self, seed: int) -> None:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        scale = 1.0 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 1.0 if "embed_tokens" in name else 1.0 / math.sqrt(p.shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= scale
            p.normal_(0.0, std, generator=gen)


def bench_ttft(
    prompt_tokens: int = 32768,
    num_layers: int = 32,
    hidden_size: int = 4096,
    intermediate_size: int = 14336,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    vocab_size: int = 32000,
    dtype: str = "bfloat16",
    page_size: int = 16,
    repeats: int = 3,
    device: str | None = None,
    host_layout: str = "page_first",
    debug_checks: bool = False,
) -> dict:
    """Best-of-``repeats`` TTFT (seconds) per scenario (the cold one runs once); see the module
    docstring. With a ``layer_first`` host pool, loads of page runs go by copy engine.

    Each configuration is its own engine over the one model and one storage directory (what a
    scenario forces is a cache or engine option: ``overlap_loads``,
    ``CacheConfig.transfer_mechanism``, ``CacheConfig.backup_share``); an engine after the first
    gets the prompt's KV by a storage restore. ``debug_checks`` sets
    ``CacheConfig.debug_checks`` (integrity checked at every poll; for tests, not figures).
    """
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position=prompt_tokens + 64,
        dtype=dtype,
    )
    t0 = time.perf_counter()
    with dev:
        model = _DeviceInitLM(cfg)
    model.fill_random(0)
    _log(f"model on {dev} in {time.perf_counter() - t0:.1f} s")
    pages = prompt_tokens // page_size + 8
    page_bytes = sum(s.page_bytes(page_size) for s in model.pool_specs())
    copy_engines = dev.type == "cuda" and dma.available()  # pinned pools, batched-copy driver
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        base = CacheConfig(
            page_size=page_size,
            device_pages=pages + DECODE_PAGES,
            host_pages=2 * pages,
            device=str(dev),
            storage="file",
            storage_dir=tmp,
            storage_bytes=1 << 40,
            prefetch_policy="wait_complete",
            host_layout=host_layout,
            debug_checks=debug_checks,
        )
        rng = random.Random(0)
        prompt = [rng.randrange(vocab_size) for _ in range(prompt_tokens)]
        params = SamplingParams(max_tokens=1, ignore_eos=True)

        def engine(overlap: bool, mechanism: str = "auto") -> LLM:
            _release_pools()
            cache = dataclasses.replace(base, transfer_mechanism=mechanism)
            return LLM(
                model,
                cache,
                max_running=DECODE_BATCH,
                max_prefill_tokens=prompt_tokens + 1,
                overlap_loads=overlap,
            )

        def fresh() -> list[int]:
            # A prompt no tier holds: the cold scenario never hits anything.
            return [rng.randrange(vocab_size) for _ in range(prompt_tokens)]

        def run(llm: LLM, label: str, prepare, make=lambda: prompt, times: int = repeats) -> dict:  # noqa: ANN001
            best = None
            for _ in range(times):
                prepare()
                out = llm.generate([make()], params)[0]
                if best is None or out.ttft_s < best["ttft_s"]:
                    best = {
                        "ttft_s": out.ttft_s,
                        "cached_device": out.cached_device,
                        "cached_host": out.cached_host,
                        "cached_storage": out.cached_storage,
                        "recomputed": out.recomputed,
                        "token": out.output_ids[0],
                    }
                llm.cache.drain()
                llm.cache.check_integrity()
            _log(f"{label}: {best['ttft_s'] * 1e3:.1f} ms")
            return best

        def overlapped(mechanism: str, label: str) -> dict:
            """Host restores with per-layer overlap on an engine of their own."""
            llm = engine(overlap=True, mechanism=mechanism)
            llm.generate([prompt], params)  # storage restore: the prompt is cached again
            llm.cache.drain()
            try:
                return run(llm, label, lambda: llm.cache.flush(host=False))
            finally:
                llm.close()

        def without_overlap() -> tuple[dict, int]:
            """Cold, device hit, host and storage restores on one engine; the reference."""
            llm = engine(overlap=False)
            try:
                res = {"cold": run(llm, "cold prefill", lambda: None, fresh, times=1)}
                # The prompt computed whole, cold; its pages stay cached for the scenarios below.
                reference = llm.generate([prompt], params)[0].output_ids[0]
                llm.cache.drain()
                res["device_hit"] = run(llm, "device hit", lambda: None)
                res["host_restore"] = run(llm, "host restore", lambda: llm.cache.flush(host=False))
                res["storage_restore"] = run(llm, "storage restore", llm.cache.flush)
            finally:
                llm.close()
            return res, reference

        # One engine at a time: each one's pools are gone before the next one's are allocated.
        res, reference = without_overlap()
        raw_bytes, raw_s = read_dir(tmp)  # the objects the storage restore read, plainly
        res["host_restore_overlap"] = overlapped("auto", "host restore, per-layer overlap")
        if copy_engines:  # the same with row kernels instead of copy engines, for comparison
            res["host_restore_overlap_kernels"] = overlapped(
                "kernel", "host restore, per-layer overlap, row kernels"
            )
        cached = res["device_hit"]["cached_device"]
        kv_bytes = cached * page_bytes // page_size
        link = _link_gbps(kv_bytes, dev)
        stall = None
        if dev.type == "cuda":
            stall = _backup_during_decode(model, base, rng, vocab_size, pages - 8)
    transfer_s = kv_bytes / (link * 1e9) if link else 0.0
    raw_gbps = raw_bytes / raw_s / 1e9  # every object of the run: the restore read a part
    bound = max(transfer_s, res["device_hit"]["ttft_s"])
    hit = res["device_hit"]["token"]
    out = {
        "bench": "ttft",
        "device": str(dev),
        "model": {
            k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_kv_heads", "dtype")
        },
        "prompt_tokens": prompt_tokens,
        "host_layout": host_layout,
        "scenarios": res,
        "prefix_kv_bytes": kv_bytes,
        "link_h2d_gbps": link,
        "transfer_at_link_s": transfer_s,
        "overlap_ratio": res["host_restore_overlap"]["ttft_s"] / bound if bound else 0.0,
        "storage_read_raw": {"bytes": raw_bytes, "seconds": raw_s, "gbps": raw_gbps},
        "storage_ratio": res["storage_restore"]["ttft_s"]
        / max(kv_bytes / (raw_gbps * 1e9), res["host_restore"]["ttft_s"]),
        "overlap_ratio_kernels": (
            res["host_restore_overlap_kernels"]["ttft_s"] / bound
            if bound and "host_restore_overlap_kernels" in res
            else None
        ),
        "reference_token": reference,
        "reference_matches": hit == reference,
        "same_first_token": all(r["token"] == hit for k, r in res.items() if k != "cold"),
        "backup_during_decode": stall,
    }
    _log(f"overlap ratio (vs max(transfer, device hit)): {out['overlap_ratio']:.2f}")
    return out


DECODE_BATCH = 32
"""Requests decoding together while backups run."""
DECODE_PAGES = 512
"""Device pages beyond the prompt's, for the decoding batch."""
DECODE_STEPS = 24
"""Decode steps timed per measurement."""


def _release_pools() -> None:
    """Give back the pools of engines already closed before the next one allocates its own:
    an engine's objects form reference cycles (split hooks), and torch keeps freed pinned
    blocks cached, so without this every engine's pinned host pool stays resident."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def _backup_during_decode(
    model: CausalLM,
    base: CacheConfig,
    rng: random.Random,
    vocab: int,
    num_pages: int,
    batch: int = DECODE_BATCH,
    num_steps: int = DECODE_STEPS,
) -> dict:
    """Mean decode step time of ``batch`` requests alone and under back-to-back backups of
    ``num_pages`` pages each, on engines of their own (``base`` without storage; pools sized
    for the backups kept waiting).

    The backups come through the public API: a prefix of fresh tokens is allocated and
    inserted, and the write-through policy backs it up (its bytes are whatever the pages
    hold). Completed backup bytes are the cache's ``backup_bytes`` counter.
    """
    ps = base.page_size

    def engine(in_flight: int, **options: object) -> LLM:
        _release_pools()
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

    def under_backups(in_flight: int, mechanism: str, paced: bool) -> dict:
        share = base.backup_share if paced else 0.0
        llm = engine(in_flight, transfer_mechanism=mechanism, backup_share=share)
        try:
            backup_s = timed_backup(llm)
            steps(llm, 4, in_flight)  # warm-up, as alone: a fresh engine records CUDA graphs
            step_s, done = steps(llm, num_steps, in_flight)
        finally:
            llm.close()
        return {
            "transfer_mechanism": mechanism,
            "backup_share": share,
            "backup_gbps_alone": nbytes / backup_s / 1e9,
            "decode_step_ms": step_s * 1e3,
            "stall": step_s / alone,
            "backup_gbps_while_decoding": done / (step_s * num_steps) / 1e9,
        }

    nbytes = num_pages * sum(s.page_bytes(ps) for s in model.pool_specs())
    llm = engine(1)
    try:
        steps(llm, 4)  # warm-up
        alone = steps(llm, num_steps)[0]
        one = timed_backup(llm)
    finally:
        llm.close()
    del llm
    # More backup work waiting before each step than the link moves in it.
    in_flight = math.ceil(alone / one) + 1
    runs = {
        "paced": under_backups(in_flight, "auto", paced=True),
        "paced_kernels": under_backups(in_flight, "kernel", paced=True),
        "unpaced": under_backups(in_flight, "auto", paced=False),
    }
    _log(
        f"decode step {alone * 1e3:.2f} ms alone; {in_flight} backups waiting: "
        + ", ".join(
            f"{k} {r['decode_step_ms']:.2f} ms ({r['backup_gbps_while_decoding']:.1f} GB/s)"
            for k, r in runs.items()
        )
    )
    return {
        "batch": batch,
        "steps": num_steps,
        "backups_in_flight": in_flight,
        "backup_bytes": nbytes,
        "decode_step_ms": alone * 1e3,
        **runs,
    }


def _link_gbps(nbytes: int, dev: torch.device) -> float:
    """Contiguous pinned host → device copy speed of ``nbytes`` (0 on CPU)."""
    if dev.type != "cuda" or nbytes == 0:
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
