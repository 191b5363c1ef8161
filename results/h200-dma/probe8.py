"""Where a decode step's time goes with backups waiting: alone, paced, paced with row kernels,
and queued whole.

The ``bench ttft`` model and cache (Llama-8B sizes, random bf16 weights) with a short prompt;
32 requests decode while 4 GiB backups of device pages are kept waiting (as ``bench ttft``'s
``backup_during_decode``). Each step's phases are timed by wrappers: schedule, the model call
(kernel launches), the logits read (the rest of ``runner.forward``), poll, sample, update; the
forward's GPU span by events on the compute stream.
"""

import json
import math
import os
import random
import statistics
import time
from collections import defaultdict

import torch

from kvtier.bench.ttft import DECODE_BATCH, DECODE_PAGES, _DeviceInitLM
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
cfg = ModelConfig(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position=4096,
    dtype="bfloat16",
)
with dev:
    model = _DeviceInitLM(cfg)
model.fill_random(0)
pages = 2048 + 8
cache = CacheConfig(
    page_size=16,
    device_pages=pages + DECODE_PAGES,
    host_pages=2 * pages,
    device="cuda",
    host_layout="page_first",
)
llm = LLM(model, cache, max_running=DECODE_BATCH)
mover = llm.cache.controller.mover
pacer = mover.pacer
times: dict[str, list[float]] = defaultdict(list)


def timed(obj, name, key):  # noqa: ANN001, ANN201
    fn = getattr(obj, name)

    def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = fn(*a, **k)
        times[key].append(time.perf_counter() - t0)
        return out

    setattr(obj, name, wrapper)


timed(llm.scheduler, "schedule", "schedule")
timed(llm.scheduler, "update", "update")
timed(llm.runner, "forward", "forward+read")
timed(llm.runner, "sample", "sample")
timed(llm.cache, "poll", "poll")
gpu: list[float] = []
call = llm.runner.model


class Launch:
    def __call__(self, *a, **k):  # noqa: ANN002, ANN003, ANN204
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        out = call(*a, **k)
        e.record()
        times["launch"].append(time.perf_counter() - t0)
        gpu.append((s, e))
        return out

    def __getattr__(self, name):  # noqa: ANN001, ANN204
        return getattr(call, name)


llm.runner.model = Launch()
src = torch.arange(pages - 8)
dst = llm.cache.host_pool.allocator.alloc(pages - 8)
rng = random.Random(0)
params = SamplingParams(max_tokens=40, ignore_eos=True)
res = {}


def run(label, in_flight, use_dma=True, paced=True, n=16):  # noqa: ANN001, ANN201
    mover.dma = use_dma
    mover.pacer = pacer if paced else None
    for _ in range(DECODE_BATCH):
        llm.add_request([rng.randrange(32000) for _ in range(128)], params)
    llm.step()
    times.clear()
    gpu.clear()
    ops = []
    walls = []
    for _ in range(n):
        ops = [op for op in ops if not op.done()]
        ops += [mover.device_to_host(src, dst) for _ in range(in_flight - len(ops))]
        t0 = time.perf_counter()
        llm.step()
        walls.append(time.perf_counter() - t0)
    for op in ops:
        op.wait()
        op.complete()
    torch.cuda.synchronize()
    while llm.has_unfinished():
        llm.step()
    llm.cache.drain()
    out = {"step_ms": round(statistics.mean(walls) * 1e3, 2)}
    for k, v in times.items():
        out[k + "_ms"] = round(statistics.mean(v[:n]) * 1e3, 2)
    out["read_ms"] = round(out["forward+read_ms"] - out["launch_ms"], 2)
    out["gpu_forward_ms"] = round(statistics.mean(s.elapsed_time(e) for s, e in gpu[:n]), 2)
    if pacer is not None and paced:
        out["budget_mb"] = round(pacer.budget() / 1e6, 1)
        out["rate_gbps"] = round(statistics.median(pacer._rates) / 1e9, 2)  # noqa: SLF001
        out["interval_ms"] = round(statistics.median(pacer._intervals) * 1e3, 2)  # noqa: SLF001
    res[label] = out
    print(label, out, flush=True)


run("warm-up", 0, n=4)
run("alone", 0)
t0 = time.perf_counter()
mover.device_to_host(src, dst).wait()
one = time.perf_counter() - t0
k = math.ceil(res["alone"]["step_ms"] / 1e3 / one) + 1
SHARES = [float(x) for x in os.environ.get("SHARES", "").split(",") if x]
if SHARES:  # only the pacer's share varies
    for share in SHARES:
        pacer.share = share
        run(f"paced share {share}", k)
else:
    run("paced", k)
    run("paced kernels", k, use_dma=False)
    run("unpaced", k, paced=False)
with open(f"{OUT}/probe8{'_shares' if SHARES else ''}.json", "w") as fh:
    json.dump(res, fh, indent=1)
