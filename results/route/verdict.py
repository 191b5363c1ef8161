"""Run by run, whether kvtier route was ahead of every other front on both measures the fleet
issue asks for: device+host hit tokens (more is better) and TTFT p90 (less is better).

Usage::

    python results/route/verdict.py RUN.json [RUN.json ...]

Each ``RUN.json`` is one ``compare.py --json`` output (``ab.sh`` writes ``head_<i>.json`` and
``base_<i>.json``); a run with ``--repeat`` holds several runs, told apart by ``run``. Prints
one line per front of each run, then the verdict of each run that has kvtier route
(``prefix``) and another front.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

NAMES = {"prefix": "kvtier route", "round_robin": "round-robin", "sglang": "SGLang router"}


def device_host(front: dict) -> int:
    return front["served"]["device"] + front["served"]["host"]


def runs(path: Path) -> dict[str, list[dict]]:
    """The fronts of each run in one ``compare.py`` JSON, keyed ``FILE`` or ``FILE#RUN``."""
    doc = json.loads(path.read_text())
    out: dict[str, list[dict]] = {}
    for front in doc["fronts"]:
        if "error" in front or "skipped" in front:
            continue
        key = path.stem + (f"#{front['run']}" if "run" in front else "")
        out.setdefault(key, []).append(front)
    return out


def verdict(fronts: list[dict]) -> str | None:
    """``ahead`` or what kvtier route lost on, against each other front; ``None`` without
    kvtier route or another front."""
    ours = next((f for f in fronts if f["front"] == "prefix"), None)
    others = [f for f in fronts if f["front"] != "prefix"]
    if ours is None or not others:
        return None
    lost = []
    for o in others:
        name = NAMES.get(o["front"], o["front"])
        if device_host(ours) <= device_host(o):
            lost.append(f"device+host to {name}")
        if ours["ttft_p90_s"] >= o["ttft_p90_s"]:
            lost.append(f"p90 to {name}")
    return "ahead of every other front on both" if not lost else "behind on " + ", ".join(lost)


def main(paths: list[Path]) -> None:
    for path in paths:
        for key, fronts in runs(path).items():
            for f in fronts:
                print(
                    f"{key:<12} {NAMES.get(f['front'], f['front']):<14}"
                    f" device+host {device_host(f):>9,}  p90 {f['ttft_p90_s'] * 1e3:6.1f} ms"
                    f"  p50 {f['ttft_p50_s'] * 1e3:6.1f} ms  {f['requests_per_s']:6.2f} req/s"
                )
            v = verdict(fronts)
            if v is not None:
                print(f"{key:<12} -> {v}")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
