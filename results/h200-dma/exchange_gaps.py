"""Where a 1 GiB ``Mover.exchange`` (churned host pages, page-first host) loses against two
contiguous copies at once: per direction, when its first copy starts on the GPU, when its last
ends, its copies' busy time and the gaps between them (timing events around every copy-engine
list), and the wall time of the call to the final synchronise. The contiguous pair is timed the
same way in the same loop. ``VARIANTS``: ``built`` (as built), ``reversed`` (the interleave's jobs
reversed) and ``first16`` (as built, the first slice beside a copy the other way, and each
job's lead, at 16 MiB). ``CELLS="dsa:16 mla:1"`` picks family:page cells. Prints one block per
cell; ``$OUT/exchange_gaps.json``."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from kvtier.transfer import dma, plan
from kvtier.transfer import mover as mover_module

sys.path.insert(0, os.path.dirname(__file__))
from pair_timing import ContiguousPair, ExchangeCase  # noqa: E402

DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
CELLS = os.environ.get(
    "CELLS", "dsa:16 mla:1 hybrid:1 dsa-compressed:64 dsa:64 swa:16 hybrid:16 dense:16"
).split()
REPS = int(os.environ.get("REPS", "5"))
VARIANTS = os.environ.get("VARIANTS", "built reversed first16").split()
MARKS: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event, float]] = []
T0 = [0.0]
_copy_blocks = dma.copy_blocks
_interleave = mover_module.interleave
SHARED_FIRST = plan.SHARED_FIRST_SLICE_BYTES
ORDER = ["built"]


def interleave(jobs, **kw):  # noqa: ANN001, ANN003, ANN201
    """``Mover.exchange``'s interleave; its jobs reversed for the ``reversed`` variant, the
    shared first slice at 16 MiB for ``first16``."""
    first = 16 << 20 if ORDER[0] == "first16" else SHARED_FIRST
    plan.SHARED_FIRST_SLICE_BYTES = first
    if "lead" in kw:
        kw["lead"] = first
    return _interleave(jobs[::-1] if ORDER[0] == "reversed" else jobs, **kw)


mover_module.interleave = interleave


def blocks(dst, src, size, stream, single_upto=0):  # noqa: ANN001, ANN201
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    _copy_blocks(dst, src, size, stream, single_upto)
    b.record(stream)
    cpu = (time.perf_counter() - T0[0]) * 1e3
    MARKS.append((stream.stream_id, int(size.sum()), a, b, cpu))


dma.copy_blocks = blocks


def summarise(e0: torch.cuda.Event, names: dict[int, str]) -> dict:
    out: dict = {}
    for sid, name in names.items():
        marks = [m for m in MARKS if m[0] == sid]
        rows = [(n, e0.elapsed_time(a), e0.elapsed_time(b)) for _, n, a, b, _ in marks]
        if not rows:
            continue
        gaps = [rows[i + 1][1] - rows[i][2] for i in range(len(rows) - 1)]
        busy = sum(t1 - t0 for _, t0, t1 in rows)
        nbytes = sum(n for n, _, _ in rows)
        out[name] = {
            "copies": len(rows),
            "queued_ms": [round(m[4], 3) for m in marks[:3]],
            "first_start_ms": round(rows[0][1], 3),
            "last_end_ms": round(rows[-1][2], 3),
            "busy_ms": round(busy, 3),
            "busy_gbps": round(nbytes / busy / 1e6, 1),
            "gaps_ms": round(sum(gaps), 3),
            "max_gap_ms": round(max(gaps, default=0.0), 3),
            "big_gaps": [[i, round(g, 3)] for i, g in enumerate(gaps) if g > 0.03],
        }
    return out


def cell(family: str, ps: int) -> dict:
    c = ExchangeCase(family, ps, DEV)
    pair = ContiguousPair(c.nbytes, DEV)
    mover = c.mover
    names = {mover.backup_stream.stream_id: "d2h", mover.load_stream.stream_id: "h2d"}
    runs: list[dict] = []
    sides = [*VARIANTS, "contiguous"]
    for rep in range(REPS + 1):
        for side in sides:
            torch.cuda.synchronize()
            MARKS.clear()
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = T0[0] = time.perf_counter()
            if side != "contiguous":
                ORDER[0] = side
                c.exchange()
            else:
                s, side_s = torch.cuda.current_stream(), pair.side
                side_s.wait_stream(s)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                pair.host[1].copy_(pair.dev[1], non_blocking=True)
                b.record(s)
                MARKS.append((s.stream_id, c.nbytes, a, b, 0.0))
                with torch.cuda.stream(side_s):
                    a2 = torch.cuda.Event(enable_timing=True)
                    b2 = torch.cuda.Event(enable_timing=True)
                    a2.record(side_s)
                    pair.dev[0].copy_(pair.host[0], non_blocking=True)
                    b2.record(side_s)
                MARKS.append((side_s.stream_id, c.nbytes, a2, b2, 0.0))
                s.wait_stream(side_s)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
            if rep == 0:
                continue  # warm-up
            if side != "contiguous":
                per = summarise(e0, names)
            else:
                cur = torch.cuda.current_stream().stream_id
                per = summarise(e0, {cur: "d2h", pair.side.stream_id: "h2d"})
            runs.append({"side": side, "wall_ms": round(wall, 3), **per})
    best = {
        side: min((r for r in runs if r["side"] == side), key=lambda r: r["wall_ms"])
        for side in sides
    }
    ratios = {v: round(best["contiguous"]["wall_ms"] / best[v]["wall_ms"], 4) for v in VARIANTS}
    print(f"{family} ps{ps}: ratio of best walls {ratios}, paths {mover_paths(c)}")
    for side in sides:
        r = best[side]
        print(f"  {side:10s} wall {r['wall_ms']:.2f} ms")
        for d in ("d2h", "h2d"):
            if d in r:
                print(f"    {d} {r[d]}")
    return {"ratios": ratios, "runs": runs}


def mover_paths(c: ExchangeCase) -> dict:
    ORDER[0] = "built"
    back, load = c.mover.exchange((c.src, c.ho), (c.hp, c.dst))
    back.wait()
    load.wait()
    back.complete()
    return {"d2h": dict(back.paths), "h2d": dict(load.paths)}


if __name__ == "__main__":
    res = {}
    for spec in CELLS:
        fam, ps = spec.split(":")
        res[spec] = cell(fam, int(ps))
        torch.cuda.empty_cache()
    with open(f"{OUT}/exchange_gaps.json", "w") as f:
        json.dump(res, f, indent=1)
