"""Both directions at once with the host pages a busy host tier hands out.

For every family's pool set (and the single GQA pool, both host layouts) at page sizes 1, 16
and 64: a backup and a load of about 1 GiB each issued together (backup first, one thread: the
order ``bench transfer`` uses), against two contiguous copies at once, with host pages

- ``random``: a random permutation of the pool (what ``bench transfer`` uses), and
- ``churned``: as ``kvtier.bench.host_runs.churned`` allocates them (node by node after churn).

Under ``auto`` and with the mechanism forced per direction (``d2h/h2d`` pairs of kernel,
direct, staged; staged falls back to direct where a component cannot be staged). Also each
direction alone under ``auto``. Writes ``$OUT/both_ways_runs.json``.
"""

from __future__ import annotations

import json
import os

import torch
from pair_timing import ContiguousPair, best_of

from kvtier.bench.host_runs import churned, mean_run
from kvtier.bench.pool_sets import family_pool_set
from kvtier.pools.device import DevicePool
from kvtier.pools.host import HostPool
from kvtier.pools.spec import PoolSpec, tree_page_size
from kvtier.transfer import mechanisms as mover_mod
from kvtier.transfer import plan
from kvtier.transfer.mover import Mover

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
REPEATS = int(os.environ.get("REPEATS", "3"))
PAIRS = [("kernel", "kernel"), ("staged", "staged"), ("staged", "direct"), ("direct", "direct")]
FORCED: dict[str, str] = {}
original_choose = plan.choose


def forced_choose(
    geo,
    direction,
    host_pages,
    device_pages,
    per_layer=False,
    dma=True,
    mechanism="auto",
    shared_link=False,
):  # noqa: ANN001, ANN201, E501
    want = FORCED.get(direction)
    if want is None or per_layer:
        return original_choose(geo, direction, host_pages, device_pages, per_layer, dma, mechanism)
    if want == plan.STAGED and not (
        geo.host_layout == "page_first" and not geo.envelope and geo.layers > 1
    ):
        return plan.DIRECT
    return want


mover_mod.choose = forced_choose


def cell(page_size: int, layout: str, family: str | None) -> dict:
    dtype = torch.bfloat16
    if family:
        specs = family_pool_set(family, dtype)
        page_size = tree_page_size(page_size, specs)
    else:
        specs = [PoolSpec(name="kv", num_layers=32, row_shape=(2, 8, 128), dtype=dtype)]
    page_bytes = sum(s.page_bytes(page_size) for s in specs)
    n = max(1, (1 << 30) // page_bytes)
    dpool = DevicePool(specs, 2 * n, page_size, DEV)
    hpool = HostPool(specs, 4 * n, page_size, layout=layout, pin=True)
    for b in dpool.buffers.values():
        b.view(-1).view(torch.uint8).random_()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(2 * n, generator=g)
    src, dst = perm[:n], perm[n:]
    hperm = torch.randperm(4 * n, generator=g)
    patterns = {"random": (hperm[:n], hperm[n : 2 * n])}
    patterns["churned"] = tuple(churned(4 * n, [n, n], page_size, seed=1))
    total = n * page_bytes
    pair = ContiguousPair(total, DEV)

    def timed(fn) -> float:  # noqa: ANN001
        return best_of(fn, REPEATS)

    cb = 2 * total / timed(pair.both) / 1e9
    c1 = total / timed(pair.d2h) / 1e9
    out: dict = {"pages": n, "page_size": page_size, "page_bytes": page_bytes}
    out["contiguous_both_gbps"], out["contiguous_d2h_gbps"] = round(cb, 1), round(c1, 1)
    mover = Mover(dpool, hpool)
    for pname, (hpages, hother) in patterns.items():
        res: dict = {"mean_run": [round(mean_run(hpages), 1), round(mean_run(hother), 1)]}
        FORCED.clear()

        def alone_d2h(hp=hother) -> None:  # noqa: ANN001
            op = mover.device_to_host(src, hp)
            op.wait(), op.complete()
            res["paths_d2h"] = op.paths  # noqa: B023

        def alone_h2d(hp=hpages) -> None:  # noqa: ANN001
            op = mover.host_to_device(hp, dst)
            op.wait()
            res["paths_h2d"] = op.paths  # noqa: B023

        res["alone_auto"] = {
            "d2h": round(total / timed(alone_d2h) / 1e9 / c1, 3),
            "h2d": round(total / timed(alone_h2d) / 1e9 / c1, 3),
        }

        def both(hp=hpages, ho=hother) -> None:  # noqa: ANN001
            b = mover.device_to_host(src, ho)
            ld = mover.host_to_device(hp, dst)
            b.wait(), ld.wait(), b.complete()

        res["both_auto"] = round(2 * total / timed(both) / 1e9 / cb, 3)
        for d2h, h2d in PAIRS:
            FORCED.update(d2h=d2h, h2d=h2d)
            res[f"both_{d2h}/{h2d}"] = round(2 * total / timed(both) / 1e9 / cb, 3)
        FORCED.clear()
        # The roundtrip is byte-exact under the last pattern's auto choice.
        op = mover.device_to_host(src, hpages)
        op.wait(), op.complete()
        mover.host_to_device(hpages, dst).wait()
        torch.cuda.synchronize()
        res["verified"] = all(
            torch.equal(
                dpool.page_bytes_view(s.name)[:, dst.to(DEV)],
                dpool.page_bytes_view(s.name)[:, src.to(DEV)],
            )
            for s in specs
        )
        out[pname] = res
    mover = dpool = hpool = None  # freed (the closures above refer to these names)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    cells = [(None, "page_first"), (None, "layer_first")] + [
        (f, "page_first") for f in ("dense", "mla", "dsa", "dsa-compressed", "hybrid", "swa")
    ]
    only = os.environ.get("FAMILIES")
    res: dict = {"cells": {}}
    for ps in (1, 16, 64):
        for fam, layout in cells:
            name = f"{fam or 'gqa'} {layout} ps{ps}"
            if only and (fam or "gqa") not in only.split(","):
                continue
            if fam == "dsa-compressed" and ps != 64:
                continue  # its pages are 64 tokens whatever is asked
            res["cells"][name] = r = cell(ps, layout, fam)
            print(name, json.dumps({k: v for k, v in r.items()}), flush=True)
            with open(f"{OUT}/both_ways_runs.json", "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
