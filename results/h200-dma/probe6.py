"""Row kernels and copy-engine blocks for 64 KiB rows to and from a layer-first host pool.

The single GQA pool at page size 16 (32 layers, 64 KiB rows), 512 random pages of 1024 each side
(1 GiB): the bench's ``layer_first`` ps16 cell. Times, best of 7, ``rows.copy_rows`` over the
device view of pinned memory with programs x words-per-iteration variants, copy-engine blocks
(``dma.copy_blocks``), the Mover end to end (kernel forced), and a contiguous pinned copy.
"""

import json
import os
import time

import numpy as np
import torch

from kvtier.pools import DevicePool, HostPool, PoolSpec
from kvtier.transfer import Mover, dma, rows
from kvtier.transfer.component import ComponentRows

OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
spec = PoolSpec("kv", 32, (2, 8, 128), torch.bfloat16)
N, P = 512, 1024
dpool = DevicePool([spec], P, 16, dev)
hpool = HostPool([spec], P, 16, layout="layer_first", pin=True)
dp = torch.randperm(P)[:N]
hp = torch.randperm(P)[:N]
r = ComponentRows.of(dpool, hpool, "kv", mapped=True)
nbytes = N * dpool.page_bytes
hrows = r.geo.host_rows(hp).to(dev)
drows = r.geo.device_rows(dp).to(dev)


def best(fn, reps=7):  # noqa: ANN001, ANN201
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return round(nbytes / min(out) / 1e9, 2), round(nbytes / sorted(out)[reps // 2] / 1e9, 2)


res = {}
a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
res["contiguous d2h"] = best(lambda: b.copy_(a, non_blocking=True))
res["contiguous h2d"] = best(lambda: a.copy_(b, non_blocking=True))
print(res, flush=True)
SWEEP = os.environ.get("SWEEP", "1") == "1"
for block in (512, 1024, 2048, 4096) if SWEEP else ():
    rows.BLOCK_WORDS = block
    for ctas in (32, 64, 128, 264, 528):
        for tile in (block, 4 * block):
            k = f"kernel block {block * 8 >> 10} KiB ctas {ctas} tile {tile * 8 >> 10} KiB"
            res[k + " d2h"] = best(
                lambda c=ctas, t=tile: rows.copy_rows(r.device, drows, r.mapped, hrows, c, t)
            )
            res[k + " h2d"] = best(
                lambda c=ctas, t=tile: rows.copy_rows(r.mapped, hrows, r.device, drows, c, t)
            )
            print(k, res[k + " d2h"], res[k + " h2d"], flush=True)
rows.BLOCK_WORDS = 1024
rb = r.geo.row_bytes
h = np.uint64(r.host.data_ptr()) + r.geo.host_rows(hp).numpy().astype(np.uint64) * np.uint64(rb)
d = np.uint64(r.device.data_ptr()) + r.geo.device_rows(dp).numpy().astype(np.uint64) * np.uint64(rb)
z = np.full(h.size, rb, dtype=np.uint64)
s = torch.cuda.Stream()  # copy-engine lists refuse the legacy default stream
res["blocks d2h"] = best(lambda: dma.copy_blocks(h, d, z, s))
res["blocks h2d"] = best(lambda: dma.copy_blocks(d, h, z, s))
m = Mover(dpool, hpool)
m.dma = False
res["mover kernel d2h"] = best(lambda: m.device_to_host(dp, hp).wait())
res["mover kernel h2d"] = best(lambda: m.host_to_device(hp, dp).wait())
m.dma = True
res["mover chosen d2h"] = best(lambda: m.device_to_host(dp, hp).wait())
res["mover chosen h2d"] = best(lambda: m.host_to_device(hp, dp).wait())
for k in (
    "blocks d2h",
    "blocks h2d",
    "mover kernel d2h",
    "mover kernel h2d",
    "mover chosen d2h",
    "mover chosen h2d",
):
    print(k, res[k], flush=True)
# Where the mover's time goes: wall time of the call, of the wait, and the GPU ops it ran.
m.dma = False
for _ in range(3):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    op = m.device_to_host(dp, hp)
    t1 = time.perf_counter()
    op.wait()
    t2 = time.perf_counter()
    print(f"mover kernel d2h: call {(t1 - t0) * 1e3:.3f} ms, total {(t2 - t0) * 1e3:.3f} ms")
with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
) as prof:
    m.device_to_host(dp, hp).wait()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
with open(f"{OUT}/probe6.json", "w") as fh:
    json.dump(res, fh, indent=1)
