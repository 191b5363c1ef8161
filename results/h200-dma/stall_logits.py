"""The decode stall under paced backups (``bench ttft``'s backup-during-decode part, paced only)
with every row's logits read back each step (as before: ``ModelRunner.needs_logits`` forced
true) and with a greedy batch reading only its argmax (as built), alternated REPEATS times
(default 1) on one model per vocabulary size in VOCABS (default "32000 128256"); each run's
stall is the median of ROUNDS (default 1) alternating (alone, paced) pairs. Prints one line
per run and rewrites ``$OUT/stall_logits.json`` after each."""

from __future__ import annotations

import json
import os
import random

import torch

from kvtier.bench import ttft as bt
from kvtier.bench.decode_stall import backup_during_decode, release_pools
from kvtier.config import CacheConfig
from kvtier.engine import ModelConfig
from kvtier.engine.runner import ModelRunner

OUT = os.environ.get("OUT", "/tmp")
PS, PAGES = 16, 2048


def main() -> None:
    built = ModelRunner.__dict__["needs_logits"]  # the staticmethod itself
    out: list[dict] = []
    rounds = int(os.environ.get("ROUNDS", "1"))
    for vocab in (int(v) for v in os.environ.get("VOCABS", "32000 128256").split()):
        cfg = ModelConfig(
            vocab_size=vocab, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, max_position=4096, dtype="bfloat16",
        )  # fmt: skip
        with torch.device("cuda"):
            model = bt._DeviceInitLM(cfg)
        model.fill_random(0)
        base = CacheConfig(
            page_size=PS, device_pages=PAGES + 512, host_pages=2 * PAGES, device="cuda"
        )
        for rep in range(int(os.environ.get("REPEATS", "1"))):
            for variant in ("all_logits", "argmax_only"):
                ModelRunner.needs_logits = (
                    staticmethod(lambda work: True) if variant == "all_logits" else built
                )
                r = backup_during_decode(
                    model, base, random.Random(rep), vocab, PAGES, rounds=rounds, others=False
                )
                row = {
                    "vocab": vocab,
                    "variant": variant,
                    "rep": rep,
                    "alone_ms": r["decode_step_ms"],
                    "paced_ms": r["paced"]["decode_step_ms"],
                    "paced_stall": r["paced"]["stall"],
                    "stall_rounds": r["paced"]["stall_rounds"],
                    "paced_gbps": r["paced"]["backup_gbps_while_decoding"],
                }
                print(
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                    flush=True,
                )
                out.append(row)
                with open(os.path.join(OUT, "stall_logits.json"), "w") as f:
                    json.dump(out, f, indent=1)
        ModelRunner.needs_logits = built
        del model
        release_pools()


if __name__ == "__main__":
    main()
