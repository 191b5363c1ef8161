"""CPU cost of each step a staged 1 GiB backup takes before its first copy is queued (dense,
page size 1, churned host pages; medians of 20 warm repetitions, in µs)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kvtier.bench.host_runs import churned
from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.transfer import dma
from kvtier.transfer.component import _addresses, _record, queue_rows
from kvtier.transfer.mover import Mover
from kvtier.transfer.plan import STAGING_BYTES, choose, staging_slices

DEV = torch.device("cuda")
specs = family_pool_set("dense", torch.bfloat16)
pb = sum(s.page_bytes(1) for s in specs)
n = (1 << 30) // pb
dpool = DevicePool(specs, 2 * n, 1, DEV)
hpool = HostPool(specs, 4 * n, 1, layout="page_first", pin=True)
src = torch.randperm(2 * n)[:n]
ho = churned(4 * n, [n], 1, seed=1)[0]
mover = Mover(dpool, hpool)
r = mover.rows["kv"]
geo = r.geo
stream, helper = mover.backup_stream, mover.helpers["d2h"]
times: dict[str, list[float]] = {}


def step(name, fn):  # noqa: ANN001, ANN201
    t0 = time.perf_counter()
    out = fn()
    times.setdefault(name, []).append(1e6 * (time.perf_counter() - t0))
    return out


for _ in range(22):
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    pages, op = step("begin", lambda: mover._begin("d2h", src, ho))
    part = pages["kv"]
    step("choose", lambda: choose(geo, "d2h", part.host, part.device))  # noqa: B023
    with torch.cuda.stream(stream):
        layers, page_bytes = geo.layers, geo.layers * geo.row_bytes
        slices = step("slices", lambda: staging_slices(n, page_bytes, STAGING_BYTES, "d2h"))  # noqa: B023
        hg, dg = step("on_gpu", lambda: part.on_gpu(DEV, op))  # noqa: B023
        rows = step("device_rows", lambda: geo.device_rows(dg, page_major=True))  # noqa: B023
        largest = max(slices)
        st = step("stage_rows", lambda: torch.arange(largest * layers, device=DEV))  # noqa: B023
        words = r.device.shape[1]
        bufs = step(
            "buffers",
            lambda: [
                torch.empty((largest * layers, words), dtype=r.device.dtype, device=DEV)  # noqa: B023
                for _ in range(2)
            ],
        )
        step("wait_stream", lambda: helper.wait_stream(stream))
        k = slices[0]

        def first() -> None:
            host_at = _addresses(r.host, part.host[:k], page_bytes)  # noqa: B023
            stage_at = np.uint64(bufs[0].data_ptr()) + np.arange(k, dtype=np.uint64) * np.uint64(  # noqa: B023
                page_bytes  # noqa: B023
            )
            sizes = np.full(k, page_bytes, dtype=np.uint64)  # noqa: B023
            with torch.cuda.stream(helper):
                queue_rows(r.device, rows[: k * layers], bufs[0], st[: k * layers], op, 64)  # noqa: B023
                ready = _record(helper)
            stream.wait_event(ready)
            dma.copy_blocks(*dma.coalesce(host_at, stage_at, sizes), stream)

        step("first_slice", first)
    times.setdefault("total", []).append(1e6 * (time.perf_counter() - t_all))
    torch.cuda.synchronize()
    op.release()
for name, v in times.items():
    print(f"{name:12s} {statistics.median(v[2:]):9.1f} us")
