"""Where the main thread's time goes in one configuration of the CPU fits shape
(``fits_cpu_probe.py``): cProfile of the timed run only, cumulative seconds of the engine's,
cache's, controller's, storage's, tree's and transfer's functions.
``OMP_NUM_THREADS=1 python fits_cpu_profile.py host|host+file``."""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from kvtier.bench import multiturn as mt

PARTS = ("cache/", "controller/", "storage/", "tree/", "transfer/", "engine/llm", "engine/sched")


def main(name: str) -> None:
    torch.set_num_threads(1)
    cfg = mt.MultiTurnConfig(
        device="cpu", clients=8, rounds=4, concurrency=2, system_tokens=512, new_tokens=128,
        output_tokens=16, device_tokens=16384, configs=(name,), progress=False,
    )  # fmt: skip
    run_config, profiles = mt._run_config, {}

    def profiled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        prof = cProfile.Profile()
        prof.enable()
        try:
            return run_config(*args, **kwargs)
        finally:
            prof.disable()
            profiles[args[0]] = prof

    mt._run_config = profiled
    mt.bench_multiturn(cfg)
    stats = pstats.Stats(profiles[name])
    rows = [
        (ct, nc, f.split("/kvtier/")[1] + ":" + fn)
        for (f, _, fn), (_, nc, _, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
        if "/kvtier/" in f and any(p in f for p in PARTS)
    ]
    print(name, "profiled seconds:", round(stats.total_tt, 3))  # type: ignore[attr-defined]
    for ct, nc, where in sorted(rows, reverse=True)[:15]:
        print(f"{ct:7.3f} s {nc:6d} calls  {where}")


if __name__ == "__main__":
    main(sys.argv[1])
