"""A decode whose batch shrinks and whose contexts grow, as in serving: 32 requests with
prompts of PROMPT tokens finish one by one (max_tokens 64, 64 + STRIDE, ...), on the
Llama-8B-sized model of ``bench compute``. Three sides, each on a fresh engine over the same
weights: ``buckets`` (the graphs as built), ``exact`` (a graph per exact batch size and per 256
context columns, the behaviour before buckets) and ``eager`` (no graphs). Per side: decode wall
time (every step after the prefill), graphs recorded, steps replayed and padded, slowest step,
and how many requests' tokens equal the eager side's. The sides alternate order by round (the
first side of a process pays the kernels' compilation). Then one step's logits of 31
sequences: eager, eager with a 32nd row, a graph of exactly 31 rows and the graph of 32 with a
padding row (``batch_invariance``: max |difference| against eager and rows whose argmax
differs). Writes $OUT/graph_buckets.json.

    PROMPT=1024 STRIDE=24 ROUNDS=2 python3 results/h200-dma/graph_buckets.py
"""

import json
import os
import random
import time

import torch

from kvtier.bench.compute import _DeviceInitLM
from kvtier.bench.decode_stall import release_pools
from kvtier.config import CacheConfig
from kvtier.engine import LLM, ModelConfig, SamplingParams, graphs
from kvtier.engine.model import SeqSlots

out = os.environ.get("OUT", "/tmp")
prompt, stride, batch = (
    int(os.environ.get("PROMPT", "1024")),
    int(os.environ.get("STRIDE", "24")),
    32,
)
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
dev = torch.device("cuda")
with dev:
    model = _DeviceInitLM(cfg)
model.fill_random(0)
rng = random.Random(0)
prompts = [[rng.randrange(32000) for _ in range(prompt)] for _ in range(batch)]
params = [SamplingParams(max_tokens=64 + stride * i, ignore_eos=True) for i in range(batch)]
longest = prompt + 64 + stride * (batch - 1)
pages = batch * -(-longest // 16) + 16
real_b, real_c = graphs.batch_bucket, graphs.context_bucket
res = {"prompt": prompt, "stride": stride, "batch": batch, "sides": {}}


def side(name):
    graphs.batch_bucket, graphs.context_bucket = real_b, real_c
    if name == "exact":
        graphs.batch_bucket = lambda b: b
        graphs.context_bucket = lambda c: -(-c // 256) * 256
    release_pools()
    llm = LLM(
        model,
        CacheConfig(page_size=16, device_pages=pages, device="cuda", enable_host=False),
        max_running=batch,
        max_prefill_tokens=batch * prompt + 1,
        cuda_graphs=name != "eager",
    )
    ids = [llm.add_request(p, q) for p, q in zip(prompts, params, strict=False)]
    llm.step()  # the prefill of every prompt
    torch.cuda.synchronize()
    times, done = [], {}
    while llm.has_unfinished():
        t = time.perf_counter()
        for o in llm.step():
            done[o.request_id] = o.output_ids
        times.append(time.perf_counter() - t)
    g = llm.runner.graphs
    r = {
        "decode_s": sum(times),
        "steps": len(times),
        "slowest_step_ms": max(times) * 1e3,
        "median_step_ms": sorted(times)[len(times) // 2] * 1e3,
        "captures": g.captures if g else 0,
        "replays": g.replays if g else 0,
        "padded": g.padded if g else 0,
    }
    llm.close()
    return r, [done[i] for i in ids]


outs = {}
for rnd in range(int(os.environ.get("ROUNDS", "1"))):
    order = ("buckets", "exact", "eager") if rnd % 2 else ("eager", "exact", "buckets")
    for name in order:
        r, o = side(name)
        outs[name] = o
        res["sides"].setdefault(name, []).append(r)
        print(
            name, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True
        )
        with open(f"{out}/graph_buckets.json", "w") as f:
            json.dump(res, f, indent=1)
    for name in ("buckets", "exact"):
        same = sum(a == b for a, b in zip(outs[name], outs["eager"], strict=False))
        res.setdefault("same_as_eager", {})[name] = same
        print(name, "requests equal to eager:", same, "of", batch, flush=True)
with open(f"{out}/graph_buckets.json", "w") as f:
    json.dump(res, f, indent=1)

# One step of 31 sequences, four ways.

graphs.batch_bucket, graphs.context_bucket = real_b, real_c
release_pools()
llm = LLM(
    model,
    CacheConfig(page_size=16, device_pages=pages, device="cuda", enable_host=False),
    max_running=batch,
    cuda_graphs=True,
)
kv = llm.cache.kv_buffers
n = 31
ctx = [kv.slots(llm.cache.alloc(prompt + 7 * i)) for i in range(n + 1)]  # the last: a 32nd row
ids = [rng.randrange(32000) for _ in range(n + 1)]


def eager(rows):
    c, t = ctx[:rows], ids[:rows]
    return llm.model(
        torch.tensor(t, device=dev),
        torch.tensor([x.numel() - 1 for x in c], device=dev),
        [SeqSlots(1, x[-1:].cuda(), x.cuda()) for x in c],
        kv,
        all_logits=True,
    )[:n].float()


ref = eager(n)
exact = graphs.DecodeGraphs(model, kv, None)
padded = graphs.DecodeGraphs(model, kv, llm.runner.graphs.pad_slot)
ways = {"eager_32_rows": eager(32)}
for name, g in (("graph_31", exact), ("graph_32_padded", padded)):
    g.forward(ctx[:n], ids[:n])
    ways[name] = g.forward(ctx[:n], ids[:n]).float().clone()
res["batch_invariance"] = {
    k: {
        "max_abs_diff": float((v - ref).abs().max()),
        "argmax_rows_differ": int((v.argmax(-1) != ref.argmax(-1)).sum()),
        "logit_std": float(ref.std()),
    }
    for k, v in ways.items()
}
print(res["batch_invariance"], flush=True)
with open(f"{out}/graph_buckets.json", "w") as f:
    json.dump(res, f, indent=1)
