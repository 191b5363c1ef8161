"""The CPU work of a 1 GiB ``Mover.exchange`` (churned host pages) before both directions have
queued their first copy: its wall time unprofiled (median of 9) and a cProfile of that window,
stopped at the second stream's first copy-engine list. ``CELLS="mla:1 dense:16"``. Prints the
profile per cell; ``$OUT/exchange_setup_profile.txt``."""

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

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
CELLS = os.environ.get("CELLS", "mla:1 dense:16").split()
_copy_blocks = dma.copy_blocks
STATE: dict = {"streams": set(), "t0": 0.0, "firsts": [], "prof": None}


def blocks(dst, src, size, stream, single_upto=0):  # noqa: ANN001, ANN201
    if stream.stream_id not in STATE["streams"]:
        STATE["streams"].add(stream.stream_id)
        STATE["firsts"].append((time.perf_counter() - STATE["t0"]) * 1e6)
        if len(STATE["streams"]) == 2 and STATE["prof"] is not None:
            STATE["prof"].disable()
    _copy_blocks(dst, src, size, stream, single_upto)


dma.copy_blocks = blocks


def run(c: ExchangeCase, prof: cProfile.Profile | None) -> list[float]:
    torch.cuda.synchronize()
    STATE.update(streams=set(), firsts=[], prof=prof)
    STATE["t0"] = time.perf_counter()
    if prof is not None:
        prof.enable()
    c.exchange()
    if prof is not None:
        prof.disable()
    torch.cuda.synchronize()
    return STATE["firsts"]


def main() -> None:
    text = io.StringIO()
    for spec in CELLS:
        fam, ps = spec.split(":")
        c = ExchangeCase(fam, int(ps), DEV)
        firsts = [run(c, None) for _ in range(10)][1:]
        one = statistics.median(f[0] for f in firsts)
        two = statistics.median(f[1] for f in firsts)
        text.write(f"{spec}: first copy queued {one:.0f} us, second stream's {two:.0f} us\n")
        prof = cProfile.Profile()
        for _ in range(5):
            run(c, prof)
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(30)
            text.write(s.getvalue())
        del c
        torch.cuda.empty_cache()
    print(text.getvalue())
    with open(f"{OUT}/exchange_setup_profile.txt", "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
