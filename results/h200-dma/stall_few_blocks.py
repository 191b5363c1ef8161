"""The decode stall under paced backups (``bench ttft``'s backup-during-decode part) with
copy-engine lists of up to ``dma.FEW_BLOCKS`` blocks queued as single copies (as built) and
with every list batched (``FEW_BLOCKS`` 0), alternated REPEATS times (default 3) on one model.
Prints one line per run; ``$OUT/stall_few_blocks.json``. Since then backups outside
``Mover.exchange`` go as batched lists whatever ``FEW_BLOCKS`` is, so both columns measure
batched lists."""

from __future__ import annotations

import json
import os
import random

import torch

from kvtier.bench import ttft as bt
from kvtier.bench.decode_stall import backup_during_decode
from kvtier.config import CacheConfig
from kvtier.engine import ModelConfig
from kvtier.transfer import dma

OUT = os.environ.get("OUT", "/tmp")
PS, PAGES = 16, 2048


def main() -> None:
    cfg = ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position=4096, dtype="bfloat16",
    )  # fmt: skip
    with torch.device("cuda"):
        model = bt._DeviceInitLM(cfg)
    model.fill_random(0)
    base = CacheConfig(page_size=PS, device_pages=PAGES + 512, host_pages=2 * PAGES, device="cuda")
    built = dma.FEW_BLOCKS
    out: list[dict] = []
    for rep in range(int(os.environ.get("REPEATS", "3"))):
        for few in (built, 0):
            dma.FEW_BLOCKS = few
            r = backup_during_decode(model, base, random.Random(rep), 32000, PAGES, rounds=1)
            row = {
                "few_blocks": few,
                "rep": rep,
                "alone_ms": r["decode_step_ms"],
                **{f"{k}_stall": r[k]["stall"] for k in ("paced", "paced_kernels", "unpaced")},
                "paced_gbps": r["paced"]["backup_gbps_while_decoding"],
            }
            print(
                {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True
            )
            out.append(row)
    dma.FEW_BLOCKS = built
    with open(os.path.join(OUT, "stall_few_blocks.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
