"""Does a small device → host read on the compute stream wait behind queued backups?

Queues ``k`` backups of 1 GiB (dense pool set, page size 16) on the mover's backup stream, then
times ``x.cpu()`` of 4 bytes on the compute stream, with copy-engine (chosen) and kernel backups.
"""

import json
import os
import time

import torch

from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools import DevicePool, HostPool
from kvtier.transfer import Mover

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
specs = family_pool_set("dense", torch.bfloat16)
n = (1 << 30) // sum(s.page_bytes(16) for s in specs)
dpool = DevicePool(specs, 2 * n, 16, dev)
hpool = HostPool(specs, 2 * n, 16, layout="page_first", pin=True)
src = torch.randperm(2 * n)[:n]
hp = torch.randperm(2 * n)[:n]
x = torch.ones(1, device=dev)
res = {}
for dma in (True, False):
    m = Mover(dpool, hpool)
    m.dma = m.dma and dma
    m.device_to_host(src, hp).wait()
    for k in (0, 1, 4):
        torch.cuda.synchronize()
        ops = [m.device_to_host(src, hp) for _ in range(k)]
        t0 = time.perf_counter()
        x.cpu()
        t1 = time.perf_counter()
        for op in ops:
            op.wait()
        t2 = time.perf_counter()
        res[f"{'chosen' if dma else 'kernels'} backups={k}"] = {
            "readback_ms": round((t1 - t0) * 1e3, 3),
            "backups_ms": round((t2 - t0) * 1e3, 2),
        }
        print(res, flush=True)
json.dump(res, open(f"{OUT}/probe5.json", "w"), indent=1)
