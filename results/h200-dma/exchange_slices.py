"""GPU timeline of every copy and staging kernel of a 1 GiB ``Mover.exchange`` (churned host
pages), from timing events recorded around each on its stream: per-slice start, end and
GB/s, and the gaps between a stream's slices. Each direction alone too. Dense and hybrid at
page size 1. Prints a summary per case; ``$OUT/exchange_slices.json``."""

from __future__ import annotations

import json
import os
import sys

import torch

from kvtier.transfer import component, dma

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
MARKS: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []
_copy_blocks, _copy_page_rows = dma.copy_blocks, component.copy_page_rows


def _timed(kind: str, nbytes: int, stream: torch.cuda.Stream, fn) -> None:  # noqa: ANN001
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    fn()
    b.record(stream)
    MARKS.append((f"{kind} s{stream.stream_id}", nbytes, a, b))


def blocks(dst, src, size, stream):  # noqa: ANN001, ANN201
    _timed("dma", int(size.sum()), stream, lambda: _copy_blocks(dst, src, size, stream))


def page_rows(src, dst, pages, layers, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN201
    nbytes = pages.numel() * layers * src.shape[1] * src.element_size()
    s = torch.cuda.current_stream()
    _timed("rows", nbytes, s, lambda: _copy_page_rows(src, dst, pages, layers, *a, **k))


component.dma.copy_blocks = blocks
component.copy_page_rows = page_rows


def case(family: str, ps: int) -> dict:
    c = ExchangeCase(family, ps, DEV)
    mover, src, dst, hp, ho = c.mover, c.src, c.dst, c.hp, c.ho
    out: dict = {}
    for rep in range(3):
        for name in ("d2h", "h2d", "exchange"):
            torch.cuda.synchronize()
            MARKS.clear()
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            if name == "d2h":
                ops = [mover.device_to_host(src, ho)]
            elif name == "h2d":
                ops = [mover.host_to_device(hp, dst)]
            else:
                ops = list(mover.exchange((src, ho), (hp, dst)))
            for op in ops:
                op.wait()
            if ops[0].direction == "d2h":
                ops[0].complete()
            torch.cuda.synchronize()
            rows = []
            for what, nbytes, a, b in MARKS:
                t0, t1 = e0.elapsed_time(a), e0.elapsed_time(b)
                rows.append([what, nbytes, round(t0, 3), round(t1, 3)])
            if rep == 2:
                out[name] = rows
    for name, rows in out.items():
        print(family, ps, name)
        last: dict[str, float] = {}
        for what, nbytes, t0, t1 in rows:
            gap = t0 - last.get(what, t0)
            last[what] = t1
            gbps = nbytes / max(t1 - t0, 1e-6) / 1e6
            print(
                f"  {what:9s} {nbytes / 2**20:7.1f} MiB  {t0:7.3f}-{t1:7.3f} ms  {gbps:6.1f} GB/s  gap {gap:6.3f}"
            )
    return out


if __name__ == "__main__":
    res = {f"{f} ps{p}": case(f, p) for f, p in (("hybrid", 1), ("dense", 1))}
    with open(f"{OUT}/exchange_slices.json", "w") as f:
        json.dump(res, f, indent=1)
