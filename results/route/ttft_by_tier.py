"""TTFT of each front's requests by the tier that served part of their prompt (``storage``
when any token came from the store, else ``host``, else ``device``, else ``none``), from the
per-request records ``kvtier bench multiturn --url`` wrote (``compare.py`` keeps them in its
log directory as ``FRONT-bench.json``): count, p50 and p90 in ms, and which classes the slowest
tenth of all requests were. ``python ttft_by_tier.py DIR``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

FRONTS = ("prefix", "round_robin", "least_loaded", "sglang")


def served_by(rec: dict) -> str:
    for tier in ("storage", "host", "device"):
        if rec[f"cached_{tier}"] > 0:
            return tier
    return "none"


def main(root: Path) -> None:
    for front in FRONTS:
        path = root / f"{front}-bench.json"
        if not path.exists():
            continue
        reqs = json.loads(path.read_text())["configs"]["server"]["requests"]
        by: dict[str, list[float]] = {}
        for rec in reqs:
            by.setdefault(served_by(rec), []).append(rec["ttft_s"])
        cut = sorted(r["ttft_s"] for r in reqs)[int(0.9 * len(reqs))]
        slow: dict[str, int] = {}
        for rec in reqs:
            if rec["ttft_s"] >= cut:
                slow[served_by(rec)] = slow.get(served_by(rec), 0) + 1
        figures = {
            tier: (
                len(t),
                round(statistics.median(t) * 1e3),
                round(sorted(t)[int(0.9 * len(t))] * 1e3),
            )
            for tier, t in sorted(by.items())
        }
        print(f"{front}: (count, p50 ms, p90 ms) {figures}; slowest tenth {slow}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
