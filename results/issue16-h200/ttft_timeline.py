"""Where the TTFT of a 32K-token device hit and of an overlapped host restore goes, and what a
decode step under paced backups loses to the backup mechanism.

1. Device hit and host restore with per-layer overlap (the ``bench ttft`` model and cache):
   cProfile's top functions by cumulative time for one run of each, and for the restore the
   timeline of its load: when the load was issued after ``generate`` began (CPU), when its
   first and last layer arrived on the GPU (CUDA events from an event at ``generate``'s start).
2. ``bench ttft``'s decode-under-backups measurement with the backup mechanism varied:
   VARIANTS (comma list): ``auto`` (as built), ``direct`` (copy-engine blocks for every
   backup, no staging), ``ctas4`` (staging gathers with 4 programs).
Writes ``$OUT/ttft_timeline.json``.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import random
import tempfile
import time

import torch

from kvtier.bench import ttft as bt
from kvtier.bench.decode_stall import backup_during_decode, release_pools
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams
from kvtier.transfer import component, mover, plan

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
TOKENS = 32768
PS = 16
res: dict = {}


def profiled(fn) -> tuple[object, str]:  # noqa: ANN001
    pr = cProfile.Profile()
    pr.enable()
    out = fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(28)
    return out, s.getvalue()[-6000:]


def ttft_part(model) -> None:  # noqa: ANN001
    pages = TOKENS // PS + 8
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CacheConfig(
            page_size=PS,
            device_pages=pages + 64,
            host_pages=2 * pages,
            device="cuda",
            storage=None,
            storage_dir=tmp,
            host_layout="page_first",
        )
        rng = random.Random(0)
        prompt = [rng.randrange(32000) for _ in range(TOKENS)]
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        release_pools()
        llm = LLM(model, cfg, max_running=32, max_prefill_tokens=TOKENS + 1, overlap_loads=True)
        llm.generate([prompt], params)
        llm.cache.drain()
        for _ in range(2):
            llm.generate([prompt], params)
        out, prof = profiled(lambda: llm.generate([prompt], params)[0])
        res["device_hit"] = {"ttft_ms": out.ttft_s * 1e3, "profile": prof}
        print("device hit", out.ttft_s * 1e3, flush=True)
        print(prof, flush=True)
        seen: list = []
        orig = mover.Mover.host_to_device

        def spy(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            t = time.perf_counter()
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(self.load_stream)
            op = orig(self, *a, **k)
            end = torch.cuda.Event(enable_timing=True)
            end.record(self.load_stream)
            seen.append((t, time.perf_counter(), op, begin, end))
            return op

        mover.Mover.host_to_device = spy
        timeline = []
        for r in range(4):
            llm.cache.flush(host=False)
            seen.clear()
            start = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            if r == 3:
                out, prof = profiled(lambda: llm.generate([prompt], params)[0])
            else:
                out = llm.generate([prompt], params)[0]
            torch.cuda.synchronize()
            row = {"ttft_ms": out.ttft_s * 1e3, "loads": []}
            for tc, tr, op, begin, end in seen:
                row["loads"].append(
                    {
                        "issued_ms": (tc - t0) * 1e3,
                        "issue_cpu_ms": (tr - tc) * 1e3,
                        "pages": op.num_pages,
                        "paths": op.paths,
                        "load_begin_gpu_ms": start.elapsed_time(begin),
                        "load_end_gpu_ms": start.elapsed_time(end),
                    }
                )
            timeline.append(row)
            print("overlap", row, flush=True)
        mover.Mover.host_to_device = orig
        res["host_overlap"] = {"runs": timeline, "profile": prof}
        print(prof, flush=True)
        llm.close()


def stall_part(model) -> None:  # noqa: ANN001
    base = CacheConfig(
        page_size=PS, device_pages=16, host_pages=16, device="cuda", host_layout="page_first"
    )
    chosen = mover.choose
    ctas = component.STAGING_CTAS

    def direct(geo, direction, hp, dp, per_layer=False, dma=True, mechanism="auto"):  # noqa: ANN001, ANN202
        if direction == "d2h" and not per_layer and dma and mechanism == "auto":
            return plan.DIRECT
        return chosen(geo, direction, hp, dp, per_layer, dma, mechanism)

    out = {}
    for v in os.environ.get("VARIANTS", "auto,direct,ctas4").split(","):
        mover.choose = direct if v == "direct" else chosen
        component.STAGING_CTAS = 4 if v == "ctas4" else ctas
        r = backup_during_decode(model, base, random.Random(1), 32000, TOKENS // PS)
        out[v] = r
        print(v, {k: r[k] for k in ("decode_step_ms",)}, r["paced"], r["unpaced"], flush=True)
        res["stall"] = out
        dump()
    mover.choose = chosen
    component.STAGING_CTAS = ctas


def dump() -> None:
    with open(f"{OUT}/ttft_timeline.json", "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    cfg = ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        max_position=TOKENS + 64,
        dtype="bfloat16",
    )
    with DEV:
        model = bt._DeviceInitLM(cfg)
    model.fill_random(0)
    if os.environ.get("TTFT", "1") == "1":
        ttft_part(model)
        dump()
    if os.environ.get("STALL", "1") == "1":
        stall_part(model)
    dump()


if __name__ == "__main__":
    main()
