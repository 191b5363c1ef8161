"""Where a decode step under paced backups loses time: per-phase CPU time of ``LLM.step``
(schedule, forward up to the logits read, the read's wait, poll, sample, update) and the GPU
time of the forward (events around the graph replay), alone and with backups kept waiting.
SHARE (default 0.8) is the pacer's share. Writes ``$OUT/stall_phases.json``."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections import defaultdict

import torch

from kvtier.bench import ttft as bt
from kvtier.bench.decode_stall import release_pools
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams, graphs, runner
from kvtier.engine import llm as llm_mod

OUT = os.environ.get("OUT", "/tmp")
PS, PAGES, BATCH, STEPS = 16, 2048, 32, 24
acc: dict = defaultdict(float)
gpu: list = []


def timed(obj, name: str, key: str) -> None:  # noqa: ANN001
    fn = getattr(obj, name)

    def wrap(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(obj, name, wrap)


def main() -> None:
    cfg = ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position=4096, dtype="bfloat16",
    )  # fmt: skip
    with torch.device("cuda"):
        model = bt._DeviceInitLM(cfg)
    model.fill_random(0)
    orig_to_host = runner._to_host

    def to_host(t):  # noqa: ANN001, ANN202
        s = time.perf_counter()
        out = orig_to_host(t)
        acc["read_wait"] += time.perf_counter() - s
        return out

    runner._to_host = to_host
    orig_replay = torch.cuda.CUDAGraph.replay

    def replay(self):  # noqa: ANN001, ANN202
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        orig_replay(self)
        b.record()
        gpu.append((a, b))

    torch.cuda.CUDAGraph.replay = replay
    res = {}
    rng = random.Random(0)
    for label, share, in_flight in (
        ("alone", 0.8, 0),
        ("paced", float(os.environ.get("SHARE", "0.8")), 2),
    ):
        release_pools()
        c = CacheConfig(
            page_size=PS, device_pages=(in_flight + 1) * PAGES + 512,
            host_pages=(in_flight + 2) * PAGES, device="cuda", write_policy="write_through",
            backup_share=share, host_layout="page_first",
        )  # fmt: skip
        llm = LLM(model, c, max_running=BATCH, max_prefill_tokens=BATCH * 128)
        for name, key in (("poll", "poll"),):
            timed(llm.cache, name, key)
        timed(llm.scheduler, "schedule", "schedule")
        timed(llm.scheduler, "update", "update")
        timed(llm.runner, "forward", "forward_incl_read")
        timed(llm.runner, "sample", "sample")
        nbytes = PAGES * sum(s.page_bytes(PS) for s in model.pool_specs())

        def queue_backup(llm: LLM = llm) -> None:
            tokens = [rng.randrange(32000) for _ in range(PAGES * PS)]
            locs = llm.cache.alloc(len(tokens))
            cached = llm.cache.insert(tokens, locs).cached_len
            if cached:
                llm.cache.free(locs[:cached])

        for rep in range(2):
            params = SamplingParams(max_tokens=STEPS + 2, ignore_eos=True)
            for _ in range(BATCH):
                llm.add_request([rng.randrange(32000) for _ in range(128)], params)
            llm.step()
            acc.clear()
            gpu.clear()
            total, queued = 0.0, 0
            s0 = llm.cache.stats()
            done0 = s0["backup_bytes"]
            for _ in range(STEPS):
                s = llm.cache.stats()
                dropped = s["dropped_host_backups"] * nbytes // PAGES
                while queued - (s["backup_bytes"] - done0) - dropped < in_flight * nbytes:
                    queue_backup()
                    queued += nbytes
                t = time.perf_counter()
                llm.step()
                total += time.perf_counter() - t
            torch.cuda.synchronize()
            row = {k: round(v / STEPS * 1e3, 3) for k, v in acc.items()}
            row["step_ms"] = round(total / STEPS * 1e3, 3)
            row["graph_gpu_ms"] = round(
                sum(a.elapsed_time(b) for a, b in gpu) / max(1, len(gpu)), 3
            )
            row["graphs_replayed"] = len(gpu)
            row["backup_gbps"] = round((llm.cache.stats()["backup_bytes"] - done0) / total / 1e9, 1)
            print(label, rep, row, flush=True)
            res[f"{label} {rep}"] = row
            while llm.has_unfinished():
                llm.step()
            llm.cache.drain()
        llm.close()
        del llm
    with open(f"{OUT}/stall_phases.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    _ = (dataclasses, graphs, llm_mod)
    main()
