"""Where a 1 GiB ``Mover.exchange`` (churned host pages) spends its time, per direction: the
CPU time of each copy-engine list and kernel launch queued (from the call), and on the GPU the
end of each direction's work (timing events recorded on its stream after the call). Also each
direction alone. Prints one line per case; ``$OUT/exchange_timeline.json``."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvtier.transfer import component, dma

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
LOG: list[tuple[float, str, int]] = []
T0 = [0.0]
_copy_blocks, _queue_rows = dma.copy_blocks, component.queue_rows
_copy_page_rows = component.copy_page_rows


def logged_blocks(dst, src, size, stream):  # noqa: ANN001, ANN201
    _copy_blocks(dst, src, size, stream)
    LOG.append((time.perf_counter() - T0[0], f"dma s{stream.stream_id}", int(size.sum())))


def logged_rows(src, si, dst, di, op, *a, **k):  # noqa: ANN001, ANN201
    _queue_rows(src, si, dst, di, op, *a, **k)
    LOG.append((time.perf_counter() - T0[0], f"rows s{torch.cuda.current_stream().stream_id}", 0))


def logged_page_rows(*a, **k):  # noqa: ANN002, ANN003, ANN201
    _copy_page_rows(*a, **k)
    LOG.append((time.perf_counter() - T0[0], f"rows s{torch.cuda.current_stream().stream_id}", 0))


component.dma.copy_blocks = logged_blocks
component.queue_rows = logged_rows
component.copy_page_rows = logged_page_rows


def case(family: str, ps: int) -> dict:
    c = ExchangeCase(family, ps, DEV)
    mover, src, dst, hp, ho = c.mover, c.src, c.dst, c.hp, c.ho
    out: dict = {}
    for name in ("d2h", "h2d", "exchange", "d2h", "h2d", "exchange"):
        torch.cuda.synchronize()
        LOG.clear()
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        T0[0] = time.perf_counter()
        ops = []
        if name == "d2h":
            ops = [mover.device_to_host(src, ho)]
        elif name == "h2d":
            ops = [mover.host_to_device(hp, dst)]
        else:
            ops = list(mover.exchange((src, ho), (hp, dst)))
        call = time.perf_counter() - T0[0]
        ends = {}
        for sname, st in (("backup", mover.backup_stream), ("load", mover.load_stream)):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(st)
            ends[sname] = ev
        for op in ops:
            op.wait()
        ops[0].complete() if ops[0].direction == "d2h" else None
        torch.cuda.synchronize()
        out[name] = {
            "call_ms": round(1e3 * call, 2),
            "gpu_end_ms": {k: round(e0.elapsed_time(v), 2) for k, v in ends.items()},
            "first": {},
            "queued": len(LOG),
        }
        for t, what, _nbytes in LOG:
            out[name]["first"].setdefault(what, round(1e3 * t, 2))
        print(family, ps, name, json.dumps(out[name]), flush=True)
    return out


if __name__ == "__main__":
    cases = (("dense", 1), ("dsa", 1), ("hybrid", 1), ("dense", 16))
    res = {f"{f} ps{p}": case(f, p) for f, p in cases}
    with open(f"{OUT}/exchange_timeline.json", "w") as f:
        json.dump(res, f, indent=1)
