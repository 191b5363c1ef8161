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
while device → host backups are kept waiting (``kvtier.bench.decode_stall``): the stall is the
step-time ratio; ``backup_gbps_while_decoding``, backup bytes completed per timed second.
"""

from __future__ import annotations

import dataclasses
import math
import random
import tempfile
import time

import torch

from kvtier.bench.decode_stall import (
    DECODE_BATCH,
    DECODE_PAGES,
    backup_during_decode,
    release_pools,
)
from kvtier.bench.helpers import logger
from kvtier.bench.raw_read import read_dir
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.engine.model import CausalLM
from kvtier.transfer import dma

_log = logger("ttft")


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
            release_pools()
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
            stall = backup_during_decode(model, base, rng, vocab_size, pages - 8, log=_log)
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
