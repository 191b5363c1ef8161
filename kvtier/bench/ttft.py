"""Time to first token through every tier, for one long prompt on a dense model.

Scenarios, in one process: cold prefill; device hit; host restore without and with per-layer
overlap; storage restore (prefetch included). The peer is the link: the prefix's KV bytes over a
contiguous pinned host → device copy measured in the same run, so ``overlap_ratio`` is the
overlapped host-restore TTFT over max(transfer time at link speed, device-hit TTFT) — the best
a restore can do is to hide one behind the other. The cold scenario times a fresh prompt (no tier
holds it). ``same_first_token`` says whether every restore gave the device hit's first token: a
restore that is not byte-exact shows up as a different token. The prompt is also computed whole
in one forward, untimed (``reference_token``; ``reference_matches``): in bf16 that forward and
the cached-prefix one (a short suffix attending to stored KV) round differently, so with random
weights their argmax may differ with every tier correct; the tests' content oracle
(``tests/test_oracle.py``, float32) is the exactness check against a cold run.

On CUDA ``backup_during_decode`` then times decode steps of a batch of short requests alone and
while device → host backups of the prefix's pages are kept waiting, more than the link moves in a
step: paced (``CacheConfig.backup_share``, the default) with the chosen mechanisms (copy engines
for these page sizes) and with row kernels forced, and queued whole (``unpaced``). The stall is
the step-time ratio; ``backup_gbps_while_decoding`` is the bytes of backups completed during the
timed steps over their time.
"""

from __future__ import annotations

import math
import random
import sys
import tempfile
import time

import torch

from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.engine.model import CausalLM


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
) -> dict:
    """Best-of-``repeats`` TTFT (seconds) per scenario (the cold one runs once); see the module
    docstring. With a ``layer_first`` host pool, loads of page runs go by copy engine."""
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
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        cache = CacheConfig(
            page_size=page_size,
            device_pages=pages + DECODE_PAGES,
            host_pages=2 * pages,
            device=str(dev),
            storage="file",
            storage_dir=tmp,
            storage_bytes=1 << 40,
            prefetch_policy="wait_complete",
            host_layout=host_layout,
        )
        llm = LLM(model, cache, max_running=DECODE_BATCH, max_prefill_tokens=prompt_tokens + 1)
        rng = random.Random(0)
        prompt = [rng.randrange(vocab_size) for _ in range(prompt_tokens)]
        params = SamplingParams(max_tokens=1, ignore_eos=True)

        def fresh() -> list[int]:
            # A prompt no tier holds: the cold scenario never hits anything.
            return [rng.randrange(vocab_size) for _ in range(prompt_tokens)]

        def run(label: str, prepare, make=lambda: prompt, times: int = repeats) -> dict:  # noqa: ANN001
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
            _log(f"{label}: {best['ttft_s'] * 1e3:.1f} ms")
            return best

        mover = llm.cache.controller.mover
        copy_engines = mover is not None and mover.dma

        def overlap(on: bool, engines: bool = True):  # noqa: ANN202
            def prep() -> None:
                llm.scheduler.overlap_loads = on
                if mover is not None:
                    mover.dma = engines and copy_engines
                llm.cache.flush(host=False)

            return prep

        def flush_all() -> None:
            llm.cache.flush()

        res = {"cold": run("cold prefill", lambda: None, fresh, times=1)}
        # The prompt computed whole, cold; its pages stay cached for the scenarios below.
        reference = llm.generate([prompt], params)[0].output_ids[0]
        llm.cache.drain()
        res["device_hit"] = run("device hit", lambda: None)
        res["host_restore"] = run("host restore", overlap(False))
        res["host_restore_overlap"] = run("host restore, per-layer overlap", overlap(True))
        if copy_engines:  # the same with row kernels instead of copy engines, for comparison
            res["host_restore_overlap_kernels"] = run(
                "host restore, per-layer overlap, row kernels", overlap(True, engines=False)
            )
            overlap(False)()
        res["storage_restore"] = run("storage restore", flush_all)
        cached = res["device_hit"]["cached_device"]
        kv_bytes = cached * llm.cache.device_pool.page_bytes // llm.cache.page_size
        link = _link_gbps(kv_bytes, dev)
        stall = (
            _backup_during_decode(llm, rng, vocab_size, pages - 8) if dev.type == "cuda" else None
        )
        llm.close()
    transfer_s = kv_bytes / (link * 1e9) if link else 0.0
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


def _backup_during_decode(llm: LLM, rng: random.Random, vocab: int, num_pages: int) -> dict:
    """Mean decode step time alone and under back-to-back backups of ``num_pages`` pages (into
    host pages taken from the pool for the measurement and returned after)."""
    mover = llm.cache.controller.mover
    host = llm.cache.host_pool
    assert mover is not None and host is not None
    src = torch.arange(num_pages)
    dst = host.allocator.alloc(num_pages)
    if dst is None:
        raise RuntimeError("bench ttft: no free host pages for the backup measurement")
    params = SamplingParams(max_tokens=64, ignore_eos=True)

    def steps(n: int, in_flight: int = 0) -> tuple[float, int]:
        """Mean step time over ``n`` decode steps, and the bytes of the backups (``in_flight``
        of them kept waiting) that completed during them."""
        for _ in range(DECODE_BATCH):
            llm.add_request([rng.randrange(vocab) for _ in range(128)], params)
        llm.step()  # the batch's prefill
        ops: list = []
        backed_up = 0
        total = 0.0
        for _ in range(n):
            ops += [mover.device_to_host(src, dst) for _ in range(in_flight - len(ops))]
            t0 = time.perf_counter()
            llm.step()
            total += time.perf_counter() - t0
            waiting = []
            for op in ops:
                if op.done():
                    backed_up += op.nbytes
                else:
                    waiting.append(op)
            ops = waiting
        for op in ops:
            op.wait()
            op.complete()
        while llm.has_unfinished():
            llm.step()
        llm.cache.drain()
        return total / n, backed_up

    def timed_backup() -> tuple[float, dict[str, str]]:
        """Seconds of one whole backup (after a warm-up one) and the mechanisms it used."""
        mover.device_to_host(src, dst).wait()
        t0 = time.perf_counter()
        op = mover.device_to_host(src, dst)
        op.wait()
        return time.perf_counter() - t0, op.paths

    def under_backups(in_flight: int, use_dma: bool, paced: bool) -> dict:
        saved = mover.dma, mover.pacer
        mover.dma = use_dma and mover.dma
        mover.pacer = mover.pacer if paced else None
        try:
            backup_s, paths = timed_backup()
            step_s, backed_up = steps(DECODE_STEPS, in_flight)
            budget = mover.pacer.budget() if mover.pacer is not None else None
        finally:
            mover.dma, mover.pacer = saved
        return {
            "paths": paths,
            "backup_gbps_alone": nbytes / backup_s / 1e9,
            "decode_step_ms": step_s * 1e3,
            "stall": step_s / alone,
            "backup_gbps_while_decoding": backed_up / (step_s * DECODE_STEPS) / 1e9,
            "pace_budget_mb": None if budget is None else budget / 1e6,
        }

    nbytes = num_pages * llm.cache.device_pool.page_bytes
    try:
        steps(4)  # warm-up
        alone = steps(DECODE_STEPS)[0]
        one = timed_backup()[0]
        # More backup work waiting before each step than the link moves in it.
        in_flight = math.ceil(alone / one) + 1
        runs = {
            "paced": under_backups(in_flight, use_dma=True, paced=True),
            "paced_kernels": under_backups(in_flight, use_dma=False, paced=True),
            "unpaced": under_backups(in_flight, use_dma=True, paced=False),
        }
    finally:
        host.allocator.free(dst)
    _log(
        f"decode step {alone * 1e3:.2f} ms alone; {in_flight} backups waiting: "
        + ", ".join(
            f"{k} {r['decode_step_ms']:.2f} ms ({r['backup_gbps_while_decoding']:.1f} GB/s)"
            for k, r in runs.items()
        )
    )
    return {
        "batch": DECODE_BATCH,
        "steps": DECODE_STEPS,
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
