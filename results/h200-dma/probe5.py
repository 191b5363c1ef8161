"""Small reads behind queued backups, with and without the feeder thread.

Queues ``k`` backups of 1 GiB (dense pool set, page size 16) on the mover's backup stream, then
times ``x.cpu()`` of 4 bytes on the compute stream (a sampler's token read), with copy-engine
backups queued whole by the caller (``feed_backups=False``), fed a window at a time by the
feeder thread, and with row-kernel backups. Then the feeder's backup rate while the calling
thread runs Python without pause (as a CPU-bound scheduler does) against it waiting idle.
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
for name, feed, dma in (("whole", False, True), ("fed", True, True), ("kernels", True, False)):
    m = Mover(dpool, hpool, feed_backups=feed)
    m.dma = m.dma and dma
    m.device_to_host(src, hp).wait()
    for k in (1, 4):
        torch.cuda.synchronize()
        ops = [m.device_to_host(src, hp) for _ in range(k)]
        t0 = time.perf_counter()
        x.cpu()
        t1 = time.perf_counter()
        for op in ops:
            op.wait()
        t2 = time.perf_counter()
        res[f"{name} backups={k}"] = {
            "readback_ms": round((t1 - t0) * 1e3, 3),
            "backups_gbps": round(k * n * dpool.page_bytes / (t2 - t0) / 1e9, 2),
        }
        print(name, k, res[f"{name} backups={k}"], flush=True)
    if name == "fed":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ops = [m.device_to_host(src, hp) for _ in range(4)]
        spins = 0
        while not all(op.done() for op in ops):
            for _ in range(20000):  # pure Python, as a scheduler step is
                spins += 1
        t2 = time.perf_counter()
        res["fed backups=4, caller busy"] = {
            "backups_gbps": round(4 * n * dpool.page_bytes / (t2 - t0) / 1e9, 2)
        }
        print(res["fed backups=4, caller busy"], flush=True)
    m.close()
with open(f"{OUT}/probe5.json", "w") as fh:
    json.dump(res, fh, indent=1)
