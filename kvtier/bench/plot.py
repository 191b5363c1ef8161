"""SVG bar charts of benchmark JSON (no plotting library needed).

``kvtier plot OUT.svg RESULT.json...`` recognises a result by its keys and draws:

- ``bench transfer`` (single pool or ``--family all``; several files): the scattered/contiguous
  ratio per direction for every configuration, the 0.9 and 0.8 targets marked;
- ``bench ttft`` (one file): TTFT of the device-hit and host-restore scenarios with the transfer
  time at link speed marked (cold prefill and storage restore, an order of magnitude longer, are
  in the title);
- ``bench tree`` (one file: the command's JSON, or ``bench_tree_sides`` or ``bench_tree`` alone):
  µs per op of kvtier and SGLang's ``RadixCache``, the speedup with its target ticked (5x for
  the ``long_*`` ops, 2x for ``chat_*``), and the tree against the flat hash table when present;
- ``bench storage`` (file or mooncake; several files): GB/s of set and get for kvtier, the plain
  peer, plain I/O on the backend's thread count and SGLang's ``HiCacheFile`` when they ran, 0.9
  of the plain peer ticked per group;
- ``bench compute`` (several files): cold prefill TFLOP/s as a fraction of the matmul rate
  against the 0.40 target, and the decode step against its bound with 2x the bound ticked;
- ``bench multiturn`` (one file): TTFT p50 and p90, wall time next to the bound, and
  requests/s per cache configuration.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvtier.bench.plot_svg import Group, Mark, Panel, bars_svg, panels_svg

__all__ = ["bars_svg", "kind_of", "multiturn_panels", "panels_svg", "plot"]

PLAIN_SHARE = 0.9
"""Storage: kvtier's GB/s should reach this share of the plain peer's."""
PREFILL_SHARE = 0.40
"""Compute: cold prefill TFLOP/s should reach this share of the matmul rate."""
DECODE_BOUND_X = 2.0
"""Compute: a decode step should take at most this many times its bound."""
TREE_SPEEDUP = {"long_": 5.0, "chat_": 2.0}
"""Tree: SGLang µs / kvtier µs targets by op-name prefix."""
KINDS = ("transfer", "ttft", "tree", "storage", "compute", "multiturn")
SINGLE = ("ttft", "tree", "multiturn")
"""Kinds drawn from one file only."""


def kind_of(r: object) -> str | None:
    """Which bench wrote ``r`` (one of ``KINDS``), from its keys; ``None`` if none did."""
    if not isinstance(r, dict):
        return None
    bench = r.get("bench")
    if bench == "transfer" and ("families" in r or "sizes" in r):
        return "transfer"
    if bench == "ttft" and "scenarios" in r and "transfer_at_link_s" in r:
        return "ttft"
    if bench == "tree" and (_tree_sides(r) is not None or _tree_flat(r) is not None):
        return "tree"
    if bench is None and _tree_sides(r) is not None:
        return "tree"
    if bench == "storage" and ("runs" in r or "mooncake_backend" in r):
        return "storage"
    if bench == "compute" and "prefill" in r and "decode" in r:
        return "compute"
    if bench == "multiturn" and isinstance(r.get("configs"), dict) and "workload" in r:
        return "multiturn"
    return None


def _tree_sides(r: dict) -> dict | None:
    """The ``bench_tree_sides`` part: the command nests it under ``scenarios``."""
    sides = r.get("scenarios", r)
    if isinstance(sides, dict) and isinstance(sides.get("kvtier"), dict) and "timer" in sides:
        return sides
    return None


def _tree_flat(r: dict) -> dict | None:
    """The ``bench_tree`` part (tree against a flat table): the command nests it under
    ``flat_table``, alone it is the whole result."""
    flat = r.get("flat_table")
    if isinstance(flat, dict) and "ops" in flat:
        return flat
    if "ops" in r and isinstance(flat, dict):
        return r
    return None


def _transfer_groups(results: Sequence[dict]) -> list[Group]:
    groups = []
    for r in results:
        runs = r["families"].items() if "families" in r else [(None, r)]
        for family, run in runs:
            s = run["sizes"]
            label = f"{family or s['host_layout']} ps{s['page_size']}"
            vals = {d: run[d]["ratio"] for d in ("d2h", "h2d", "both") if run.get(d)}
            groups.append((label, vals))
    return groups


def _ttft(r: dict) -> list[Panel]:
    groups = [
        (name.replace("_", " "), {"TTFT ms": s["ttft_s"] * 1e3})
        for name, s in r["scenarios"].items()
        if name not in ("cold", "storage_restore")
    ]
    ms = {k: f"{r['scenarios'][k]['ttft_s'] * 1e3:.0f} ms" for k in ("cold", "storage_restore")}
    title = (
        f"TTFT, {r['prompt_tokens']}-token prompt (cold prefill {ms['cold']}, "
        f"storage restore {ms['storage_restore']})"
    )
    return [
        Panel(title, groups, "ms", [(r["transfer_at_link_s"] * 1e3, "prefix KV at link speed")])
    ]


def _speedup_target(op: str) -> list[Mark]:
    return [(t, f"{t:g}x") for prefix, t in TREE_SPEEDUP.items() if op.startswith(prefix)]


def _tree(r: dict) -> list[Panel]:
    panels = []
    sides = _tree_sides(r)
    if sides is not None:
        kv, peer = sides["kvtier"], sides.get("sglang")
        groups = [
            (op, {"kvtier": v, **({"SGLang RadixCache": peer[op]} if peer and op in peer else {})})
            for op, v in kv.items()
        ]
        n = sides.get("rounds")
        rounds = f"median of {n} round{'s' * (n != 1)}" if n else "median"
        vs = "kvtier vs SGLang RadixCache" if peer else "kvtier (no SGLang peer in this run)"
        panels.append(Panel(f"Radix tree CPU µs per op, {vs}, {rounds}", groups, "µs"))
        if "speedup" in sides:
            ops = list(sides["speedup"])
            panels.append(
                Panel(
                    "Speedup: SGLang µs / kvtier µs (targets: 5x long_*, 2x chat_*)",
                    [(op, {"speedup": sides["speedup"][op]}) for op in ops],
                    "x",
                    marks=[(1.0, "1x")],
                    group_marks=[_speedup_target(op) for op in ops],
                )
            )
    flat = _tree_flat(r)
    if flat is not None:
        groups = [
            (op, {"tree": flat["ops"][op]["mean_us"], "flat table": f["mean_us"]})
            for op, f in flat["flat_table"].items()
            if op in flat["ops"]
        ]
        title = f"kvtier tree vs a flat hash table of page prefixes, {flat.get('num_pages')} pages"
        panels.append(Panel(f"{title}, mean µs per op", groups, "µs"))
    return panels


def _size(nbytes: int) -> str:
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= n and nbytes % n == 0:
            return f"{nbytes // n} {unit}"
    return f"{nbytes} B"


def _storage(results: Sequence[tuple[str, dict]]) -> list[Panel]:
    groups: list[Group] = []
    ticks: list[list[Mark]] = []
    notes: set[str] = set()
    plain_names = set()
    for name, r in results:
        if "runs" in r:
            runs, ours, plain, plain_name = r["runs"], "file_backend", "plain_io", "plain I/O"
        else:
            runs, ours, plain, plain_name = [r], "mooncake_backend", "raw_client", "raw client"
        plain_names.add(plain_name)
        for run in runs:
            peer = run.get("sglang_hicache_file")
            if peer is not None and "error" in peer:
                notes.add("SGLang peer did not run")
                peer = None
            elif peer is None and "runs" in r:
                notes.add("no SGLang peer")
            label = f"{name}{run['num_pages']} x {_size(run['page_bytes'])}"
            for d, op in (("write", "set"), ("read", "get")):
                vals = {"kvtier": run[ours][f"{d}_gbps"], plain_name: run[plain][f"{d}_gbps"]}
                if "parallel_plain_io" in run:
                    side = f"{plain_name} on {run['io_threads']} threads"
                    vals[side] = run["parallel_plain_io"][f"{d}_gbps"]
                if d == "read" and "verified_read_ceiling" in run:
                    side = f"{plain_name} on {run['io_threads']} threads, digested"
                    vals[side] = run["verified_read_ceiling"]["read_gbps"]
                if peer is not None:
                    vals["SGLang HiCacheFile"] = peer[f"{d}_gbps"]
                groups.append((f"{label} {op}", vals))
                ticks.append([(PLAIN_SHARE * vals[plain_name], f"{PLAIN_SHARE:g} {plain_name}")])
    what = " / ".join(sorted(plain_names))
    title = f"Storage GB/s (ticks: {PLAIN_SHARE:g} of {what}"
    title += "".join(f"; {n}" for n in sorted(notes)) + ")"
    return [Panel(title, groups, "GB/s", group_marks=ticks)]


def _compute(results: Sequence[tuple[str, dict]]) -> list[Panel]:
    pre: list[Group] = []
    dec: list[Group] = []
    dec_ticks: list[list[Mark]] = []
    for name, r in results:
        p, d = r["prefill"], r["decode"]
        pre.append(
            (f"{name}{p['prompt_tokens']} tokens", {"TFLOP/s / matmul rate": p["ratio_to_matmul"]})
        )
        dec.append(
            (
                f"{name}{d['batch']} x ~{d['mean_context']:.0f} tokens",
                {"step ms": d["step_s"] * 1e3, "bound ms": d["bound_s"] * 1e3},
            )
        )
        dec_ticks.append([(DECODE_BOUND_X * d["bound_s"] * 1e3, f"{DECODE_BOUND_X:g}x bound")])
    first = results[0][1]
    rates = f"matmul {first['matmul_tflops']:.0f} TFLOP/s on {first['device']}"
    return [
        Panel(
            f"Cold prefill TFLOP/s as a share of the matmul rate ({rates})",
            pre,
            "share",
            marks=[(PREFILL_SHARE, f"target {PREFILL_SHARE:.2f}")],
        ),
        Panel(
            f"Decode step against its bound (target: at most {DECODE_BOUND_X:g}x the bound)",
            dec,
            "ms",
            group_marks=dec_ticks,
        ),
    ]


def multiturn_panels(r: dict) -> list[Panel]:
    """``bench multiturn``: TTFT p50/p90 (ms), wall time and bound (s) and requests/s per
    configuration, in the order they ran."""
    w, runs = r["workload"], r["configs"]
    what = (
        f"{w['clients']} clients x {w['rounds']} rounds"
        if w["workload"] == "multiturn"
        else f"{w['documents']} documents x {w['rounds']} questions"
    )
    head = f"{what}, {w['concurrency']} in flight, working set {w['working_set_over_device']:.1f}x the device pool"
    return [
        Panel(
            f"TTFT per configuration ({head})",
            [
                (name, {"p50 ms": c["ttft_s"]["p50"] * 1e3, "p90 ms": c["ttft_s"]["p90"] * 1e3})
                for name, c in runs.items()
            ],
            "ms",
        ),
        Panel(
            "Wall time against the bound from the rates measured in the same run",
            [(name, {"wall s": c["wall_s"], "bound s": c["bound_s"]}) for name, c in runs.items()],
            "s",
        ),
        Panel(
            "Throughput",
            [(name, {"requests/s": c["requests_per_s"]}) for name, c in runs.items()],
            "requests/s",
        ),
    ]


def _load(f: str | Path) -> dict:
    try:
        r = json.loads(Path(f).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not JSON ({e})") from e
    if kind_of(r) is None:
        raise ValueError(
            f"{f}: not a result plot draws (bench {', '.join(KINDS)} JSON): "
            f"bench={r.get('bench') if isinstance(r, dict) else None!r}"
        )
    return r


def plot(out: str | Path, files: Sequence[str | Path]) -> str:
    """Write the chart of ``files`` (results of one kind; ``ttft`` and ``tree`` one file) to
    ``out``; returns the SVG text. Raises ``ValueError`` naming the file for one that is not
    JSON or not a result of a kind in ``KINDS``, and for mixed kinds or too many files."""
    if not files:
        raise ValueError("plot needs at least one result file")
    results = [_load(f) for f in files]
    kinds = {kind_of(r) for r in results}
    if len(kinds) > 1:
        got = ", ".join(f"{f} ({kind_of(r)})" for f, r in zip(files, results, strict=True))
        raise ValueError(f"plot draws results of one kind at a time, got {got}")
    kind = kinds.pop()
    if kind in SINGLE and len(results) > 1:
        raise ValueError(f"plot draws one {kind} result at a time, got {len(results)} files")
    # Several files of a kind: each group's label starts with its file's name.
    named = [
        (f"{Path(f).stem}: " if len(files) > 1 else "", r)
        for f, r in zip(files, results, strict=True)
    ]
    if kind == "transfer":
        svg = bars_svg(
            "Scattered page copies / contiguous pinned copy (same run)",
            _transfer_groups(results),
            "ratio",
            marks=[(0.8, "0.8"), (0.9, "0.9")],
        )
    elif kind == "ttft":
        svg = panels_svg(_ttft(results[0]))
    elif kind == "tree":
        svg = panels_svg(_tree(results[0]))
    elif kind == "storage":
        svg = panels_svg(_storage(named))
    elif kind == "multiturn":
        svg = panels_svg(multiturn_panels(results[0]))
    else:
        svg = panels_svg(_compute(named))
    Path(out).write_text(svg, encoding="utf-8")
    return svg
