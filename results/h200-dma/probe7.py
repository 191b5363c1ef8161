"""What waits behind a queued backup, block-size sweep of both mechanisms, and the mover's CPU
cost per call.

1. With a 1 GiB backup queued (copy engines, then row kernels) on the mover's backup stream, the
   wall time of small operations on the compute stream: a 4-byte device → host read, a pageable
   and a pinned host → device upload of 8 KiB, a one-element kernel.
2. Rows of 2 KiB to 256 KiB, half of 2 GiB chosen at random, moved by copy-engine block lists
   (``dma.copy_blocks``) and by the row kernel (``rows.copy_rows``), both directions, next to a
   contiguous pinned copy; best of 5.
3. cProfile of the mover's calls (layer-first ps16 GQA pool: kernel d2h, block-list h2d).
"""

import cProfile
import json
import os
import pstats
import time

import numpy as np
import torch

from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools import DevicePool, HostPool, PoolSpec
from kvtier.transfer import Mover, dma, rows
from kvtier.transfer.mapped import map_pinned

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res: dict = {}

# 1. -------------------------------------------------------------------------------------------
specs = family_pool_set("dense", torch.bfloat16)
n = (1 << 30) // sum(s.page_bytes(16) for s in specs)
dpool = DevicePool(specs, 2 * n, 16, dev)
hpool = HostPool(specs, 2 * n, 16, layout="page_first", pin=True)
src = torch.randperm(2 * n)[:n]
hp = torch.randperm(2 * n)[:n]
x = torch.ones(1, device=dev)
data = list(range(1024))
pinned = torch.arange(1024, dtype=torch.int64).pin_memory()


def timed(fn):  # noqa: ANN001, ANN201
    t0 = time.perf_counter()
    fn()
    torch.cuda.current_stream().synchronize()
    return round((time.perf_counter() - t0) * 1e3, 3)


smalls = {
    "read 4 B d2h": lambda: x.cpu(),
    "pageable 8 KiB h2d": lambda: torch.tensor(data, device=dev),
    "pinned 8 KiB h2d": lambda: pinned.to(dev, non_blocking=True),
    "kernel": lambda: x.add_(1),
}
m = Mover(dpool, hpool)
for blocker, use_dma in (("none", None), ("copy engines", True), ("kernels", False)):
    for name, fn in smalls.items():
        fn()
        torch.cuda.synchronize()
        op = None
        if use_dma is not None:
            m.dma = use_dma
            m.device_to_host(src, hp).wait()
            torch.cuda.synchronize()
            op = m.device_to_host(src, hp)
        res[f"{name} behind {blocker}"] = timed(fn)
        if op is not None:
            res[f"{name} behind {blocker} paths"] = op.paths
            op.wait()
        print(name, "behind", blocker, res[f"{name} behind {blocker}"], "ms", flush=True)
m.dma = True

# 2. -------------------------------------------------------------------------------------------
TOTAL = 2 << 30
side = torch.cuda.Stream()
a = torch.empty(TOTAL // 2, dtype=torch.uint8, device=dev)
b = torch.empty(TOTAL // 2, dtype=torch.uint8, pin_memory=True)


def best(fn, nbytes):  # noqa: ANN001, ANN201
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return round(nbytes / min(out) / 1e9, 2)


res["contiguous d2h"] = best(lambda: b.copy_(a, non_blocking=True), TOTAL // 2)
res["contiguous h2d"] = best(lambda: a.copy_(b, non_blocking=True), TOTAL // 2)
a = b = None  # freed (the closures above refer to these names)
print("contiguous", res["contiguous d2h"], res["contiguous h2d"], flush=True)
dbuf = torch.empty(TOTAL // 8, dtype=torch.int64, device=dev)
hbuf = torch.empty(TOTAL // 8, dtype=torch.int64, pin_memory=True)
mview = map_pinned(hbuf, dev)
for kib in (2, 4, 8, 16, 32, 64, 128, 256):
    words = kib * 128
    nrows = TOTAL // (kib << 10)
    dv, hv, mv = (t.view(nrows, words) for t in (dbuf, hbuf, mview))
    dr, hr = torch.randperm(nrows)[: nrows // 2], torch.randperm(nrows)[: nrows // 2]
    rb = np.uint64(kib << 10)
    da = np.uint64(dv.data_ptr()) + dr.numpy().astype(np.uint64) * rb
    ha = np.uint64(hv.data_ptr()) + hr.numpy().astype(np.uint64) * rb
    z = np.full(da.size, rb, dtype=np.uint64)
    drg, hrg = dr.to(dev), hr.to(dev)
    nb = TOTAL // 2
    r = {
        "blocks d2h": best(lambda: dma.copy_blocks(ha, da, z, side), nb),  # noqa: B023
        "blocks h2d": best(lambda: dma.copy_blocks(da, ha, z, side), nb),  # noqa: B023
        "kernel d2h": best(lambda: rows.copy_rows(dv, drg, mv, hrg, rows.PCIE_CTAS), nb),  # noqa: B023
        "kernel h2d": best(lambda: rows.copy_rows(mv, hrg, dv, drg, rows.PCIE_CTAS), nb),  # noqa: B023
    }
    res[f"rows {kib} KiB"] = r
    print(f"rows {kib} KiB", r, flush=True)

# 3. -------------------------------------------------------------------------------------------
spec = PoolSpec("kv", 32, (2, 8, 128), torch.bfloat16)
dp2 = DevicePool([spec], 1024, 16, dev)
hp2 = HostPool([spec], 1024, 16, layout="layer_first", pin=True)
m2 = Mover(dp2, hp2)
dpg, hpg = torch.randperm(1024)[:512], torch.randperm(1024)[:512]
for direction in ("d2h", "h2d"):
    call = (
        (lambda: m2.device_to_host(dpg, hpg))
        if direction == "d2h"
        else (lambda: m2.host_to_device(hpg, dpg))
    )
    call().wait()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    calls = []
    for _ in range(10):
        t0 = time.perf_counter()
        prof.enable()
        op = call()
        prof.disable()
        calls.append((time.perf_counter() - t0) * 1e3)
        op.wait()
    res[f"mover {direction} call ms"] = [round(c, 3) for c in calls]
    print(direction, op.paths, "call ms", res[f"mover {direction} call ms"], flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
with open(f"{OUT}/probe7.json", "w") as fh:
    json.dump(res, fh, indent=1)
