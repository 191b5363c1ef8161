"""The CPU fits shape (``fits_cpu_probe.py``) with the file backend's ``batch_set`` stubbed
out: ``host`` and ``host+file`` twice each, cProfile of the timed closed loop only, and the
functions whose cumulative seconds grew most from ``host`` to ``host+file`` (means of the two
runs): ``OMP_NUM_THREADS=1 python fits_cpu_profile_diff.py``."""

from __future__ import annotations

import cProfile
import pstats

import torch

from kvtier.bench import multiturn as mt
from kvtier.storage import file as file_backend


def main() -> None:
    torch.set_num_threads(1)
    file_backend.FileBackend.batch_set = lambda self, keys, buffers: len(keys)
    loop = mt.run_closed_loop
    cum: dict[str, dict[str, tuple[int, float]]] = {}
    walls: dict[str, float] = {}
    for name in ("host", "host+file", "host", "host+file"):
        cfg = mt.MultiTurnConfig(
            device="cpu", clients=8, rounds=4, concurrency=2, system_tokens=512,
            new_tokens=128, output_tokens=16, device_tokens=16384, configs=(name,),
            progress=False,
        )  # fmt: skip
        prof = cProfile.Profile()

        def profiled(*args, prof=prof, **kwargs):  # noqa: ANN002, ANN003, ANN202
            prof.enable()
            try:
                return loop(*args, **kwargs)
            finally:
                prof.disable()

        mt.run_closed_loop = profiled
        try:
            wall = mt.bench_multiturn(cfg)["configs"][name]["wall_s"]
        finally:
            mt.run_closed_loop = loop
        walls[name] = walls.get(name, 0.0) + wall / 2
        mine = cum.setdefault(name, {})
        for (f, line, fn), (_, nc, _, ct, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
            key = f"{f.split('/')[-1]}:{line}:{fn}"
            mine[key] = (nc, mine.get(key, (0, 0.0))[1] + ct / 2)
    a, b = cum["host"], cum["host+file"]
    print("mean wall s:", {k: round(v, 3) for k, v in walls.items()})
    grew = sorted(
        ((b.get(k, (0, 0.0))[1] - a.get(k, (0, 0.0))[1], k) for k in set(a) | set(b)),
        reverse=True,
    )
    for diff, key in grew[:25]:
        print(
            f"{diff:+.4f} s  calls {a.get(key, (0, 0))[0]:6d} -> {b.get(key, (0, 0))[0]:6d}  {key}"
        )


if __name__ == "__main__":
    main()
