"""Where staged device → host copies lose time: wall clock against GPU span, with the GPU held
back (a sleep kernel ahead of the copy) so that the whole batch is queued before it starts, for
MLA and dense pool sets at page size 16, and the contiguous copy alike."""

import json
import os
import time

import torch

from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools import DevicePool, HostPool
from kvtier.transfer import Mover, plan

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res: dict = {}


def measure(fn, total, hold):
    out = []
    for _ in range(4):
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        if hold:
            torch.cuda._sleep(50_000_000)  # ~25 ms of GPU cycles
        e0.record()
        t0 = time.perf_counter()
        op = fn()
        t1 = time.perf_counter()
        torch.cuda.current_stream().wait_event(op.event) if hasattr(op, "event") else None
        e1.record()
        e1.synchronize()
        t2 = time.perf_counter()
        out.append(
            (total / (e0.elapsed_time(e1) / 1e3) / 1e9, total / (t2 - t0) / 1e9, (t1 - t0) * 1e3)
        )
    best = max(out[1:])
    return [round(x, 2) for x in best]


for fam in ("mla", "dense", "hybrid"):
    specs = family_pool_set(fam, torch.bfloat16)
    ps = 16
    n = (1 << 30) // sum(s.page_bytes(ps) for s in specs)
    dpool = DevicePool(specs, 2 * n, ps, dev)
    hpool = HostPool(specs, 2 * n, ps, layout="page_first", pin=True)
    g = torch.Generator().manual_seed(0)
    src = torch.randperm(2 * n, generator=g)[:n]
    hp = torch.randperm(2 * n, generator=g)[:n]
    total = n * dpool.page_bytes
    cdev = torch.empty(total, dtype=torch.uint8, device=dev)
    chost = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    row = {}
    for hold in (False, True):
        row[f"contig hold={hold}"] = measure(
            lambda: chost.copy_(cdev, non_blocking=True),  # noqa: B023
            total,
            hold,
        )
        for first in (4 << 20, 16 << 20, 1 << 50):
            plan.FIRST_SLICE_BYTES = first
            m = Mover(dpool, hpool)
            row[f"staged first={first >> 20}MiB hold={hold}"] = measure(
                lambda: m.device_to_host(src, hp),  # noqa: B023
                total,
                hold,
            )
    print(fam, json.dumps(row), flush=True)
    res[fam] = row
    dpool = hpool = cdev = chost = None  # freed (the closures above refer to these names)
    torch.cuda.empty_cache()
with open(f"{OUT}/probe4.json", "w") as fh:
    json.dump(res, fh, indent=1)
