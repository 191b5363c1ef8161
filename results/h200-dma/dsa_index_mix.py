"""Both directions at once for DSA at page size 1 with a layer-first host, with the indexer
component's mechanism forced each way beside the other direction.

    python3 results/h200-dma/dsa_index_mix.py [--repeats 7] [--family dsa] [--page-size 1]

Under ``auto`` the 256-byte indexer rows back up staged (123 KB copy-engine blocks per layer and
host run) and load by row kernel (blocks under ``plan.SHARED_H2D_DMA_MIN_BYTES``). This runs
``bench_transfer`` once per (backup, load) pair of mechanisms for the sidecar component (the
latent cache keeps its ``auto`` choice) and prints best / median of ``both`` against two
contiguous copies in the same run, as JSON lines.
"""

from __future__ import annotations

import argparse
import json

import torch

from kvtier.bench.transfer import bench_transfer
from kvtier.transfer import mechanisms
from kvtier.transfer.plan import KERNEL, STAGED

AUTO = mechanisms.choose


def forced(backup: str | None, load: str | None, row_bytes: int):  # noqa: ANN201
    def choose(geo, direction, *args, shared_link=False, **kw):  # noqa: ANN001, ANN202
        pick = AUTO(geo, direction, *args, shared_link=shared_link, **kw)
        if shared_link and geo.row_bytes == row_bytes:
            want = backup if direction == "d2h" else load
            return want or pick
        return pick

    return choose


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--family", default="dsa")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--sidecar-row-bytes", type=int, default=256)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("dsa_index_mix: both directions at once need CUDA")
    pairs = [(None, None), (STAGED, STAGED), (KERNEL, KERNEL), (KERNEL, STAGED), (STAGED, KERNEL)]
    for backup, load in pairs:
        mechanisms.choose = forced(backup, load, args.sidecar_row_bytes)
        out = bench_transfer(
            family=args.family,
            page_size=args.page_size,
            host_layout="layer_first",
            target_mib=1024,
            repeats=args.repeats,
        )
        b = out["both"]
        row = {
            "sidecar_backup": backup or "auto",
            "sidecar_load": load or "auto",
            "paths": b["paths"],
            "ratio": round(b["ratio"], 3),
            "median_ratio": round(b["median_ratio"], 3),
            "gbps": round(b["gbps"], 1),
            "contiguous_gbps": round(b["contiguous_gbps"], 1),
        }
        print(json.dumps(row), flush=True)
    mechanisms.choose = AUTO


if __name__ == "__main__":
    main()
