"""Pooled TTFT quantiles and hit tokens of several comparison runs, from their per-request
records (a single run's 288 requests give a p90 that moves by 10-20 ms between runs).

Usage::

    # keep the records of some runs (compare.py's log dirs, each with FRONT-bench.json)
    python results/route/pooled.py pack OUT.json DIR[:TAG] [DIR[:TAG] ...]
    # pooled figures per front
    python results/route/pooled.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from kvtier.bench.serve import LOOP_REQUEST_KEYS

FIELDS = LOOP_REQUEST_KEYS
"""Kept per request: the bench's record (a key missing in an older record is kept as
``None``)."""


def pack(out: Path, dirs: list[str]) -> None:
    """Every ``FRONT-bench.json`` of each directory, as one run per directory; a directory
    given as ``PATH:TAG`` names its fronts ``FRONT:TAG`` (two trees' runs of one front kept
    apart)."""
    runs = {}
    for arg in dirs:
        path, _, tag = arg.partition(":")
        d = Path(path)
        fronts = {}
        for f in sorted(d.glob("*-bench.json")):
            reqs = json.loads(f.read_text())["configs"]["server"]["requests"]
            name = f.name.removesuffix("-bench.json") + (f":{tag}" if tag else "")
            fronts[name] = [[r.get(k) for k in FIELDS] for r in reqs]
        runs[d.name + (f":{tag}" if tag else "")] = fronts
    out.write_text(json.dumps({"fields": FIELDS, "runs": runs}) + "\n")


def pool(rows: list[dict]) -> dict:
    """The figures of one front's requests pooled over runs (bench records: ``ttft_s`` and
    ``cached_*`` as ``kvtier bench multiturn`` writes them)."""
    t = sorted(r["ttft_s"] for r in rows)

    def q(p: float) -> float:
        return t[min(int(len(t) * p), len(t) - 1)]

    served = {k: sum(r[f"cached_{k}"] for r in rows) for k in ("device", "host", "storage")}
    return {
        "requests": len(rows),
        "ttft_p50_s": q(0.5),
        "ttft_p90_s": q(0.9),
        "ttft_p99_s": q(0.99),
        "served": served | {"recomputed": sum(r["recomputed"] for r in rows)},
    }


def report(path: Path) -> None:
    doc = json.loads(path.read_text())
    fields = doc["fields"]
    pooled: dict[str, list[dict]] = {}
    for fronts in doc["runs"].values():
        for front, rows in fronts.items():
            recs = [dict(zip(fields, r, strict=True)) for r in rows]
            pooled.setdefault(front, []).extend(with_ahead(recs))
    print(f"{'front':<18} requests  p50 ms  p90 ms  p99 ms  device+host  storage")
    for front, rows in pooled.items():
        p = pool(rows)
        dh = p["served"]["device"] + p["served"]["host"]
        print(
            f"{front:<18} {p['requests']:>8} {p['ttft_p50_s'] * 1e3:>7.1f}"
            f" {p['ttft_p90_s'] * 1e3:>7.1f} {p['ttft_p99_s'] * 1e3:>7.1f}"
            f" {dh:>12,} {p['served']['storage']:>8,}"
        )
    for front, rows in pooled.items():
        predicted = sorted(
            (r["expected_s"], r["ttft_s"]) for r in rows if r.get("expected_s") is not None
        )
        if predicted:
            calibration(front, predicted)
    for front, rows in pooled.items():
        contention(front, rows)
    for front, rows in pooled.items():
        by_phase(front, rows)
    for front, rows in pooled.items():
        behind_prefill(front, rows)
    matched(pooled)


def with_ahead(rows: list[dict]) -> list[dict]:
    """One run's records, each with ``ahead``: how many requests sent to the same instance
    were still in flight when it was sent (``None`` where a record lacks the instance or the
    times)."""
    timed = [r for r in rows if r.get("instance") and r.get("sent_s") is not None]
    for r in rows:
        r["ahead"] = None
    for r in timed:
        r["_ahead"] = [
            o
            for o in timed
            if o is not r
            and o["instance"] == r["instance"]
            and o["sent_s"] < r["sent_s"] < o["finished_s"]
        ]
        r["ahead"] = len(r["_ahead"])
    return rows


def tier(r: dict) -> str:
    """The slowest tier that served part of the request's prompt (``none``: nothing)."""
    for t in ("storage", "host", "device"):
        if r[f"cached_{t}"]:
            return t
    return "none"


def contention(front: str, rows: list[dict]) -> None:
    """Measured TTFT by the requests in flight on the same instance when each was sent, per
    slowest tier served."""
    timed = [r for r in rows if r.get("ahead") is not None]
    if not timed:
        return
    print(f"{front}: TTFT p50/p90 (ms) [requests] by requests ahead on the instance")
    for t in ("device", "host", "storage", "none", "all"):
        cells = []
        for a in range(4):
            m = sorted(
                r["ttft_s"]
                for r in timed
                if min(r["ahead"], 3) == a and (t == "all" or tier(r) == t)
            )
            cells.append(
                f"{a}{'+' if a == 3 else ' '}: "
                + (
                    f"{m[len(m) // 2] * 1e3:5.1f}/{m[int(len(m) * 0.9)] * 1e3:5.1f} [{len(m):3}]"
                    if m
                    else " " * 17
                )
            )
        print(f"  {t:<8} " + "  ".join(cells))


def by_phase(front: str, rows: list[dict]) -> None:
    """Measured TTFT of the requests sent with nothing ahead on their instance, with one
    request ahead that was still in its prefill (its first token came after this one was
    sent), with one that streamed already, and with more, per slowest tier served."""
    timed = [r for r in rows if r.get("ahead") is not None]
    if not timed:
        return
    print(f"{front}: TTFT p50/p90 (ms) [requests] by the request ahead: none, one in its")
    print("  prefill, one streaming, two or more")
    for t in ("device", "host", "storage", "all"):
        cells: dict[str, list[float]] = {"none": [], "prefill": [], "streaming": [], "2+": []}
        for r in timed:
            if t != "all" and tier(r) != t:
                continue
            if r["ahead"] != 1:
                cells["none" if r["ahead"] == 0 else "2+"].append(r["ttft_s"])
                continue
            cells["prefill" if left_to_first(r) > 0 else "streaming"].append(r["ttft_s"])
        out = []
        for k, m in cells.items():
            m.sort()
            got = f"{m[len(m) // 2] * 1e3:5.1f}/{m[int(len(m) * 0.9)] * 1e3:5.1f} [{len(m):3}]"
            out.append(f"{k}: " + (got if m else " " * 17))
        print(f"  {t:<8} " + "  ".join(out))


def alone(rows: list[dict]) -> dict[tuple[str, int], list[float]]:
    """The TTFTs (sorted) of the requests sent with nothing ahead on their instance, by
    slowest tier served and round."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if r.get("ahead") == 0:
            out.setdefault((tier(r), r["round"]), []).append(r["ttft_s"])
    return {k: sorted(v) for k, v in out.items()}


def left_to_first(r: dict) -> float:
    """For a request sent behind exactly one other: how long that one still had to its first
    token when this one was sent (<= 0: it streamed already)."""
    (o,) = r["_ahead"]
    return o["sent_s"] + o["ttft_s"] - r["sent_s"]


def behind_prefill(front: str, rows: list[dict]) -> None:
    """For the requests sent behind exactly one request still in its prefill: their excess
    (TTFT less the median TTFT of the requests of the same tier and round sent with nothing
    ahead) by how long the request ahead still had to its first token, in quartiles."""
    base = {k: statistics.median(v) for k, v in alone(rows).items() if len(v) >= 3}
    pts = []
    for r in rows:
        key = (tier(r), r["round"])
        if r.get("ahead") != 1 or key not in base:
            continue
        left = left_to_first(r)
        if left > 0:
            pts.append((left, r["ttft_s"] - base[key]))
    if len(pts) < 8:
        return
    pts.sort()
    print(f"{front}: behind one request in its prefill, excess (ms) by its time left to its")
    print("  first token (quartiles)")
    q = len(pts) // 4
    for i in range(4):
        part = pts[i * q : (i + 1) * q] if i < 3 else pts[3 * q :]
        ex = sorted(e for _, e in part)
        print(
            f"  left {part[0][0] * 1e3:5.1f}-{part[-1][0] * 1e3:5.1f}: median"
            f" {ex[len(ex) // 2] * 1e3:5.1f} p90 {ex[int(len(ex) * 0.9)] * 1e3:5.1f} [{len(ex)}]"
        )


def matched(pooled: dict[str, list[dict]]) -> None:
    """Median TTFT of the requests that found nothing ahead on their instance, by slowest tier
    served and round, per front: the same work in the same conditions, so a difference is the
    front's own (its proxy, its process), not where it sent the requests."""
    fronts = [f for f in pooled if any(r.get("ahead") is not None for r in pooled[f])]
    if len(fronts) < 2:
        return
    print("median TTFT (ms) [requests] with nothing ahead, by tier and round: " + ", ".join(fronts))
    rounds = sorted({r["round"] for f in fronts for r in pooled[f]})
    by_front = {f: alone(pooled[f]) for f in fronts}
    for t in ("device", "host", "storage"):
        for rd in rounds:
            cells = []
            for f in fronts:
                m = by_front[f].get((t, rd), [])
                cells.append(
                    f"{m[len(m) // 2] * 1e3:5.1f} [{len(m):3}]" if len(m) >= 5 else " " * 11
                )
            if any(c.strip() for c in cells):
                print(f"  {t:<8} round {rd}: " + "  ".join(cells))


def calibration(front: str, pairs: list[tuple[float, float]], bins: int = 5) -> None:
    """Measured TTFT against the router's expected time, by quantile bins of the latter."""
    print(f"{front}: expected vs measured TTFT (ms), {len(pairs)} requests chosen by time")
    for b in range(bins):
        part = pairs[b * len(pairs) // bins : (b + 1) * len(pairs) // bins]
        if not part:
            continue
        e = sum(x for x, _ in part) / len(part) * 1e3
        m = sorted(y for _, y in part)
        print(
            f"  expected {part[0][0] * 1e3:6.1f}-{part[-1][0] * 1e3:6.1f} (mean {e:6.1f}):"
            f" measured p50 {m[len(m) // 2] * 1e3:6.1f} p90 {m[int(len(m) * 0.9)] * 1e3:6.1f}"
        )


if __name__ == "__main__":
    if sys.argv[1] == "pack":
        pack(Path(sys.argv[2]), sys.argv[3:])
    else:
        report(Path(sys.argv[1]))
