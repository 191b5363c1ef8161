"""``host`` against ``host+file`` on the CPU fits shape (``fits_cpu_probe.py``), six runs of
each in alternating order, medians: ``OMP_NUM_THREADS=1 python fits_cpu_alternate.py
real|noop [nogc]`` (``noop``: the file backend stores nothing; ``nogc``: the cyclic collector
off)."""

from __future__ import annotations

import gc
import statistics
import sys

import torch

from kvtier.bench import multiturn as mt
from kvtier.storage import file as file_backend


def main(mode: str, collector: str) -> None:
    torch.set_num_threads(1)
    if collector == "nogc":
        gc.disable()
    if mode == "noop":
        file_backend.FileBackend.batch_set = lambda self, keys, buffers: len(keys)
    walls: dict[str, list[float]] = {"host": [], "host+file": []}
    for i in range(6):
        for name in ("host", "host+file") if i % 2 == 0 else ("host+file", "host"):
            cfg = mt.MultiTurnConfig(
                device="cpu", clients=8, rounds=4, concurrency=2, system_tokens=512,
                new_tokens=128, output_tokens=16, device_tokens=16384, configs=(name,),
                progress=False,
            )  # fmt: skip
            walls[name].append(mt.bench_multiturn(cfg)["configs"][name]["wall_s"])
    print(mode, collector, {k: [round(x, 3) for x in v] for k, v in walls.items()})
    ratio = statistics.median(walls["host"]) / statistics.median(walls["host+file"])
    print("median wall host / host+file:", round(ratio, 3))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "gc")
