"""Row kernels both ways at once: programs and tile width per direction.

A backup (device → host) and a load (host → device) of 1 GiB each by row kernels, issued
backup first, with the kernel's program count and rows per iteration set per direction; against
contiguous copies both ways at once (pinned buffers). Writes ``$OUT/both_ways_kernels.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import time

import torch

from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec
from kvtier.transfer import component
from kvtier.transfer.mover import Mover
from kvtier.transfer.rows import ONE_BLOCK, TILE_WORDS

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
SETTINGS = [
    (64, ONE_BLOCK),
    (132, ONE_BLOCK),
    (264, ONE_BLOCK),
    (64, TILE_WORDS),
    (132, TILE_WORDS),
]
CELLS = {
    "gqa page_first ps1": (1, "page_first"),
    "gqa layer_first ps16": (16, "layer_first"),
}


def best(fn, reps: int = 3) -> float:  # noqa: ANN001
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    res: dict = {}
    orig = component.queue_rows
    for cell, (ps, layout) in CELLS.items():
        spec = PoolSpec(name="kv", num_layers=32, row_shape=(2, 8, 128), dtype=torch.bfloat16)
        n = (1 << 30) // spec.page_bytes(ps)
        dpool = DevicePool([spec], 2 * n, ps, DEV)
        hpool = HostPool([spec], 2 * n, ps, layout=layout, pin=True)
        g = torch.Generator().manual_seed(0)
        perm, hperm = torch.randperm(2 * n, generator=g), torch.randperm(2 * n, generator=g)
        src, dst, hpages, hother = perm[:n], perm[n:], hperm[:n], hperm[n:]
        total = n * spec.page_bytes(ps)
        a = torch.empty(total, dtype=torch.uint8, device=DEV)
        b = torch.empty(total, dtype=torch.uint8, device=DEV)
        ha = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        hb = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        side = torch.cuda.Stream()

        def contiguous_both(a=a, b=b, ha=ha, hb=hb, side=side) -> None:  # noqa: ANN001
            side.wait_stream(torch.cuda.current_stream())
            a.copy_(ha, non_blocking=True)
            with torch.cuda.stream(side):
                hb.copy_(b, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)

        contiguous_both()
        cb = 2 * total / best(contiguous_both) / 1e9
        mover = Mover(dpool, hpool, mechanism="kernel")
        mapped = {id(r.mapped) for r in mover.rows.values()}
        row: dict = {"contiguous_both_gbps": round(cb, 1)}
        for d2h_set, h2d_set in itertools.product(SETTINGS, SETTINGS):

            def qr(s, si, d, di, op, ctas=None, tile=ONE_BLOCK, d2h_set=d2h_set, h2d_set=h2d_set):  # noqa: ANN001, ANN202
                if ctas is None:
                    ctas, tile = d2h_set if id(d) in mapped else h2d_set  # noqa: B023
                return orig(s, si, d, di, op, ctas, tile)

            component.queue_rows = qr

            def both(mover: Mover = mover) -> None:
                bk = mover.device_to_host(src, hother)  # noqa: B023
                ld = mover.host_to_device(hpages, dst)  # noqa: B023
                bk.wait(), ld.wait(), bk.complete()

            both()
            gb = 2 * total / best(both) / 1e9
            key = f"d2h {d2h_set[0]}x{d2h_set[1]} h2d {h2d_set[0]}x{h2d_set[1]}"
            row[key] = round(gb / cb, 3)
            print(cell, key, round(gb, 1), round(gb / cb, 3), flush=True)
        component.queue_rows = orig
        res[cell] = row
        with open(f"{OUT}/both_ways_kernels.json", "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
