"""Step by step, the CPU time of a 1 GiB ``Mover.exchange`` (churned host pages) until both
directions have queued their first copy: each traced function's start and duration (µs from
the call, nested calls indented) and the untraced time between them, for the run with the median
window of 9. ``CELLS="mla:1 dense:16"``. Prints the steps; ``$OUT/exchange_setup_steps.txt``."""

from __future__ import annotations

import functools
import os
import sys
import time

import torch

from kvtier.transfer import chunks, component, dma, mechanisms, mover, page_lists, uploads

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
CELLS = os.environ.get("CELLS", "mla:1 dense:16").split()
LOG: list[tuple[int, str, float, float]] = []
STATE = {"t0": 0.0, "depth": 0, "streams": set(), "open": True}


def traced(name: str, fn):  # noqa: ANN001, ANN201
    @functools.wraps(fn)
    def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if not STATE["open"]:
            return fn(*a, **k)
        depth = STATE["depth"]
        STATE["depth"] = depth + 1
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            STATE["depth"] = depth
            end = time.perf_counter()
            LOG.append((depth, name, (t - STATE["t0"]) * 1e6, (end - t) * 1e6))

    return wrapper


def first_copy(fn):  # noqa: ANN001, ANN201
    @functools.wraps(fn)
    def wrapper(dst, src, size, stream, single_upto=0):  # noqa: ANN001, ANN202
        fn(dst, src, size, stream, single_upto)
        if STATE["open"]:
            STATE["streams"].add(stream.stream_id)
            if len(STATE["streams"]) == 2:
                STATE["open"] = False

    return wrapper


def patch() -> None:
    dma.copy_blocks = first_copy(traced("copy_blocks", dma.copy_blocks))
    dma.coalesce = traced("coalesce", dma.coalesce)
    mover.Mover._begin = traced("_begin", mover.Mover._begin)
    mechanisms.choose = traced("choose", mechanisms.choose)
    component.staging_slices = traced("staging_slices", component.staging_slices)
    page_lists.PageLists.on_gpu = traced("on_gpu", page_lists.PageLists.on_gpu)
    uploads.Uploads.upload = traced("upload", uploads.Uploads.upload)
    page_lists.PageLists.host_breaks = traced("host_breaks", page_lists.PageLists.host_breaks)
    page_lists.PageLists.device_on_gpu = traced("device_on_gpu", page_lists.PageLists.device_on_gpu)
    component.slice_blocks = traced("slice_blocks (set-up)", component.slice_blocks)
    uploads.Uploads._take = traced("_take", uploads.Uploads._take)
    component.ComponentRows.stage = traced("stage", component.ComponentRows.stage)
    component.copy_page_rows = traced("copy_page_rows", component.copy_page_rows)
    component.recorded = traced("recorded", component.recorded)
    component.torch.empty = traced("torch.empty", torch.empty)
    chunks.interleave = traced("interleave", chunks.interleave)
    mover.interleave = chunks.interleave


def run(c: ExchangeCase) -> tuple[float, list]:
    torch.cuda.synchronize()
    LOG.clear()
    STATE.update(depth=0, streams=set(), open=True)
    STATE["t0"] = time.perf_counter()
    back, load = c.mover.exchange((c.src, c.ho), (c.hp, c.dst))
    end = max((s + d for _, n, s, d in LOG if n == "copy_blocks"), default=0.0)
    back.wait()
    load.wait()
    back.complete()
    torch.cuda.synchronize()
    return end, sorted(LOG, key=lambda r: r[2])


def main() -> None:
    patch()
    lines: list[str] = []
    for spec in CELLS:
        fam, ps = spec.split(":")
        c = ExchangeCase(fam, int(ps), DEV)
        runs = [run(c) for _ in range(10)][1:]
        runs.sort(key=lambda r: r[0])
        window, log = runs[len(runs) // 2]
        lines.append(
            f"{spec}: both first copies queued by {window:.0f} us "
            f"(min {runs[0][0]:.0f}, max {runs[-1][0]:.0f})"
        )
        seen: list[float] = [0.0]  # starts and ends already passed
        for depth, name, start, dur in log:
            gap = start - max(t for t in seen if t <= start)
            seen += [start, start + dur]
            note = f"   (untraced before: {gap:.1f})" if gap > 5 else ""
            lines.append(f"  {start:7.1f} {'  ' * depth}{name:16s} {dur:7.1f} us{note}")
        del c
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    with open(f"{OUT}/exchange_setup_steps.txt", "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
