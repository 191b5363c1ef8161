"""CPU before each direction's first copy of a staged 1 GiB transfer (dense, page size 1,
churned host pages): unprofiled medians of 20 to the first queued copy, then a profile of the
same span by internal time. ``$OUT/first_chunk_profile.txt``."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

from kvtier.transfer import dma
from kvtier.transfer.streams import on

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
c = ExchangeCase("dense", 1, DEV)
m = c.mover
_blocks = dma.copy_blocks
FIRST = [0.0]


def first_copy(*a):  # noqa: ANN002, ANN201
    _blocks(*a)
    if not FIRST[0]:
        FIRST[0] = time.perf_counter()


dma.copy_blocks = first_copy


def span(direction: str, prof: cProfile.Profile | None) -> float:
    torch.cuda.synchronize()
    FIRST[0] = 0.0
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    op = m.device_to_host(c.src, c.ho) if direction == "d2h" else m.host_to_device(c.hp, c.dst)
    if prof:
        prof.disable()
    op.wait()
    if direction == "d2h":
        op.complete()
    return 1e6 * (FIRST[0] - t0)


text = []
for direction in ("d2h", "h2d"):
    for _ in range(3):
        span(direction, None)
    plain = [span(direction, None) for _ in range(20)]
    text.append(
        f"{direction}: first copy queued {statistics.median(plain):.0f} us after the call "
        f"(min {min(plain):.0f}); whole call profiled below"
    )
    prof = cProfile.Profile()
    for _ in range(20):
        span(direction, prof)
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    text.append(s.getvalue())
_ = on
out = "\n".join(text)
print(out[:7000])
with open(f"{OUT}/first_chunk_profile.txt", "w") as f:
    f.write(out)
