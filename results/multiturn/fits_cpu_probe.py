"""What the file L3 costs when the working set fits the device pool, on CPU: ``bench
multiturn`` (tiny preset, 8 clients x 4 rounds, a 16K-token device pool) on ``device``,
``host`` and ``host+file``, three times, medians; with ``noop`` the file backend's
``batch_set`` stores nothing (returns at once), which separates the writes themselves from
the rest of the L3 path. ``OMP_NUM_THREADS=1 python fits_cpu_probe.py real|noop``."""

from __future__ import annotations

import statistics
import sys

import torch

from kvtier.bench import multiturn as mt
from kvtier.storage import file as file_backend


def main(mode: str) -> None:
    torch.set_num_threads(1)
    if mode == "noop":
        file_backend.FileBackend.batch_set = lambda self, keys, buffers: len(keys)
    cfg = mt.MultiTurnConfig(
        device="cpu", clients=8, rounds=4, concurrency=2, system_tokens=512, new_tokens=128,
        output_tokens=16, device_tokens=16384, configs=("device", "host", "host+file"),
        progress=False,
    )  # fmt: skip
    walls: dict[str, list[float]] = {name: [] for name in cfg.configs}
    for _ in range(3):
        for name, c in mt.bench_multiturn(cfg)["configs"].items():
            walls[name].append(c["wall_s"])
    med = {name: statistics.median(v) for name, v in walls.items()}
    print(mode, {n: round(w, 3) for n, w in med.items()})
    print("device-only wall / wall:", {n: round(med["device"] / w, 3) for n, w in med.items()})


if __name__ == "__main__":
    main(sys.argv[1])
