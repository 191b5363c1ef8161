"""Both directions at once by mechanism pairing.

``bench transfer`` cells whose both-at-once ratio was lowest, with the mechanism forced per
direction: as chosen, row kernels both ways, copy engines both ways (staged for page-first host
pools, block lists for layer-first). Ratios are to contiguous copies in the same run.
"""

import json
import os

from kvtier.bench.transfer import bench_transfer
from kvtier.transfer import mechanisms as mover_mod
from kvtier.transfer.plan import DIRECT, KERNEL, STAGED

OUT = os.environ.get("OUT", "/tmp")
chosen = mover_mod.choose
cells = {
    "dense ps1": {"family": "dense", "page_size": 1},
    "layer_first ps16": {"page_size": 16, "host_layout": "layer_first"},
    "hybrid ps64": {"family": "hybrid", "page_size": 64},
}


def forced(kind):  # noqa: ANN001, ANN201
    def pick(geo, direction, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        if kind == "kernels":
            return KERNEL
        return STAGED if geo.host_layout == "page_first" and geo.layers > 1 else DIRECT

    return pick


res = {}
for cell, kw in cells.items():
    for kind in ("chosen", "kernels", "copy engines"):
        mover_mod.choose = chosen if kind == "chosen" else forced(kind)
        r = bench_transfer(target_mib=1024, repeats=3, **kw)
        runs = r.get("families", {cell: r})
        for name, run in runs.items():
            row = {d: (round(run[d]["ratio"], 2), run[d]["paths"]) for d in ("d2h", "h2d", "both")}
            res[f"{cell} {name} {kind}"] = row
            print(cell, name, kind, row, flush=True)
with open(f"{OUT}/probe9.json", "w") as fh:
    json.dump(res, fh, indent=1)
