"""kvtier's radix tree against SGLang's ``RadixCache``, each in its own process, A/B interleaved.

``bench_tree_sides`` runs ``kvtier.bench.tree_sides`` (see there for the scenarios, the tokens
and the memory figures) once per side, scenario and round, alternating which side goes first
each round so that a noisy neighbour hurts both alike. A side's figure for an op is the median
over rounds of its per-process median CPU time (collector on). The peer runs under the
interpreter given as ``peer_python`` (one where ``import sglang`` works); without it only
kvtier's side runs.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from kvtier.errors import ConfigError

SIDES_SCRIPT = Path(__file__).with_name("tree_sides.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("long", "chat")


def _run_side(python: str, side: str, scenario: str, seed: int, scale: int) -> dict:
    """One side's process; raises ``RuntimeError`` with its stderr if it fails."""
    env = dict(os.environ)
    if side == "kvtier":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [python, str(SIDES_SCRIPT), side, scenario, str(seed), str(scale)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{side} {scenario} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_tree_sides(
    peer_python: str | None = None, rounds: int = 3, seed: int = 0, scale: int = 1
) -> dict:
    """Per-op median CPU microseconds of each side and ``speedup[op] = peer / kvtier``.

    Every round of a scenario draws the same tokens on both sides (``seed`` + round); a matched
    or cached length that differs between them raises ``RuntimeError``. ``scale`` > 1 shrinks
    the workload (tests). Raises ``ConfigError`` for ``rounds`` < 1 or ``scale`` < 1.
    """
    if rounds < 1 or scale < 1:
        raise ConfigError(f"rounds={rounds} and scale={scale} must both be at least 1")
    sides = {"kvtier": sys.executable}
    if peer_python:
        sides["sglang"] = peer_python
    per_round: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
    memory: dict[str, dict[str, list[dict]]] = {s: {} for s in sides}
    for r in range(rounds):
        for scenario in SCENARIOS:
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            outs = {s: _run_side(sides[s], s, scenario, seed + r, scale) for s in order}
            if len(outs) == 2 and outs["kvtier"]["lens"] != outs["sglang"]["lens"]:
                diff = [
                    k
                    for k in outs["kvtier"]["lens"]
                    if outs["kvtier"]["lens"][k] != outs["sglang"]["lens"].get(k)
                ]
                raise RuntimeError(f"{scenario} round {r}: the sides disagree on {diff}")
            for s, out in outs.items():
                for op, ns in out["ns"].items():
                    per_round[s].setdefault(op, []).append(statistics.median(ns) / 1e3)
                memory[s].setdefault(scenario, []).append(out["memory"])
    result: dict = {"rounds": rounds, "scale": scale, "timer": "time.process_time_ns, gc on"}
    for s in sides:
        result[s] = {op: statistics.median(v) for op, v in per_round[s].items()}
        result[f"{s}_memory"] = {
            sc: {
                "traced_bytes_per_token": statistics.median(
                    m["traced_bytes"] / m["cached_tokens"] for m in ms
                ),
                "rss_bytes_per_token": statistics.median(
                    m["rss_bytes"] / m["cached_tokens"] for m in ms
                ),
            }
            for sc, ms in memory[s].items()
        }
    if peer_python:
        result["speedup"] = {
            op: result["sglang"][op] / result["kvtier"][op] for op in result["kvtier"]
        }
    return result
