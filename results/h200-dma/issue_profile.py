"""Where the CPU time of queueing a 1 GiB copy goes (cProfile, top functions by own time):
staged device → host at page size 16 and 1, block-list host → device at page size 16 (page-first
host, single GQA pool). Writes ``$OUT/issue_profile.txt``."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import torch

from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.transfer.mover import Mover

OUT = os.environ.get("OUT", "/tmp")
text = io.StringIO()
for ps, mech, direction in (
    (16, "copy_engine", "d2h"),
    (1, "copy_engine", "d2h"),
    (16, "auto", "h2d"),
):
    spec = PoolSpec(name="kv", num_layers=32, row_shape=(2, 8, 128), dtype=torch.bfloat16)
    n = (1 << 30) // spec.page_bytes(ps)
    dpool = DevicePool([spec], 2 * n, ps, torch.device("cuda"))
    hpool = HostPool([spec], 2 * n, ps, layout="page_first", pin=True)
    g = torch.Generator().manual_seed(0)
    src, hp = torch.randperm(2 * n, generator=g)[:n], torch.randperm(2 * n, generator=g)[:n]
    m = Mover(dpool, hpool, mechanism=mech)

    def go(m: Mover = m, src: torch.Tensor = src, hp: torch.Tensor = hp) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        op = m.device_to_host(src, hp) if direction == "d2h" else m.host_to_device(hp, src)  # noqa: B023
        dt = time.perf_counter() - t
        op.wait()
        if direction == "d2h":  # noqa: B023
            op.complete()
        return dt

    go(), go()
    pr = cProfile.Profile()
    pr.enable()
    dt = go()
    pr.disable()
    print(f"ps {ps} {mech} {direction}: issue {dt * 1e3:.2f} ms", file=text)
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(14)
    del m, dpool, hpool
    torch.cuda.empty_cache()
print(text.getvalue())
with open(f"{OUT}/issue_profile.txt", "w") as f:
    f.write(text.getvalue())
