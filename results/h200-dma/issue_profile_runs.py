"""Where a staged 1 GiB transfer's CPU issue time goes (churned host pages): cProfile of the
``device_to_host`` / ``host_to_device`` calls only, per cell. Prints the top entries."""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

from kvtier.bench.host_runs import churned
from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec, tree_page_size
from kvtier.transfer.mover import Mover

DEV = torch.device("cuda")


def run(family: str | None, page_size: int) -> None:
    dtype = torch.bfloat16
    specs = (
        family_pool_set(family, dtype)
        if family
        else [PoolSpec(name="kv", num_layers=32, row_shape=(2, 8, 128), dtype=dtype)]
    )
    page_size = tree_page_size(page_size, specs)
    page_bytes = sum(s.page_bytes(page_size) for s in specs)
    n = (1 << 30) // page_bytes
    dpool = DevicePool(specs, 2 * n, page_size, DEV)
    hpool = HostPool(specs, 4 * n, page_size, layout="page_first", pin=True)
    src, dst = torch.randperm(2 * n)[:n], torch.randperm(2 * n)[n:]
    hp, ho = churned(4 * n, [n, n], page_size, seed=1)
    mover = Mover(dpool, hpool)
    for direction in ("d2h", "h2d"):

        def call():  # noqa: ANN202
            if direction == "d2h":  # noqa: B023
                return mover.device_to_host(src, ho)
            return mover.host_to_device(hp, dst)

        for _ in range(2):
            op = call()
            op.wait()
            if direction == "d2h":
                op.complete()
        prof = cProfile.Profile()
        total = 0.0
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prof.enable()
            op = call()
            prof.disable()
            total += time.perf_counter() - t0
            op.wait()
            if direction == "d2h":
                op.complete()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        print(f"==== {family or 'gqa'} ps{page_size} {direction}: {1e3 * total / 5:.2f} ms/issue")
        print(s.getvalue())


if __name__ == "__main__":
    for fam, ps in ((None, 1), ("dsa", 16)):
        run(fam, ps)
