"""SVG bar charts of benchmark JSON (no plotting library needed).

``kvtier plot OUT.svg RESULT.json...`` draws, for ``bench transfer`` results (single pool or
``--family all``), the scattered/contiguous ratio per direction for every configuration with the
0.9 and 0.8 targets marked; for a ``bench ttft`` result, TTFT of the device-hit and host-restore
scenarios with the transfer time at link speed marked (cold prefill and storage restore, an order
of magnitude longer, are in the title).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from html import escape
from pathlib import Path

COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
BAR, GAP, LEFT, TOP, WIDTH = 14, 10, 190, 40, 760


def bars_svg(
    title: str,
    groups: Sequence[tuple[str, dict[str, float]]],
    unit: str,
    marks: Sequence[tuple[float, str]] = (),
) -> str:
    """Horizontal grouped bars: one group per ``(label, {series: value})``; ``marks`` are
    vertical reference lines ``(value, label)``."""
    series = list(dict.fromkeys(s for _, vals in groups for s in vals))
    top = max([v for _, vals in groups for v in vals.values()] + [m for m, _ in marks] + [1e-9])
    scale = (WIDTH - LEFT - 60) / (top * 1.05)
    group_h = len(series) * BAR + GAP
    height = TOP + len(groups) * group_h + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{LEFT}" y="18" font-size="14">{escape(title)}</text>',
    ]
    for i, s in enumerate(series):
        x = LEFT + i * 110
        out.append(f'<rect x="{x}" y="24" width="10" height="10" fill="{COLORS[i % 4]}"/>')
        out.append(f'<text x="{x + 14}" y="33">{escape(s)}</text>')
    for g, (label, vals) in enumerate(groups):
        y0 = TOP + g * group_h
        out.append(
            f'<text x="{LEFT - 6}" y="{y0 + group_h / 2}" text-anchor="end">{escape(label)}</text>'
        )
        for i, s in enumerate(series):
            if s not in vals:
                continue
            v, y = vals[s], y0 + i * BAR
            out.append(
                f'<rect x="{LEFT}" y="{y}" width="{v * scale:.1f}" height="{BAR - 2}" '
                f'fill="{COLORS[i % 4]}"/>'
            )
            out.append(f'<text x="{LEFT + v * scale + 3:.1f}" y="{y + BAR - 4}">{v:.3g}</text>')
    bottom = TOP + len(groups) * group_h
    for value, label in marks:
        x = LEFT + value * scale
        out.append(
            f'<line x1="{x:.1f}" y1="{TOP - 4}" x2="{x:.1f}" y2="{bottom}" stroke="#333" '
            'stroke-dasharray="4 3"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{escape(label)}</text>'
        )
    out.append(f'<text x="{WIDTH - 10}" y="{height - 6}" text-anchor="end">{escape(unit)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _transfer_groups(results: Sequence[dict]) -> list[tuple[str, dict[str, float]]]:
    groups = []
    for r in results:
        runs = r["families"].items() if "families" in r else [(None, r)]
        for family, run in runs:
            s = run["sizes"]
            label = f"{family or s['host_layout']} ps{s['page_size']}"
            vals = {d: run[d]["ratio"] for d in ("d2h", "h2d", "both") if run.get(d)}
            groups.append((label, vals))
    return groups


def plot(out: str | Path, files: Sequence[str | Path]) -> str:
    """Write the chart of ``files`` (all ``transfer`` results, or one ``ttft`` result) to ``out``;
    returns the SVG text."""
    results = [json.loads(Path(f).read_text()) for f in files]
    kinds = {r.get("bench") for r in results}
    if kinds == {"transfer"}:
        svg = bars_svg(
            "Scattered page copies / contiguous pinned copy (same run)",
            _transfer_groups(results),
            "ratio",
            marks=[(0.8, "0.8"), (0.9, "0.9")],
        )
    elif kinds == {"ttft"} and len(results) == 1:
        r = results[0]
        groups = [
            (name.replace("_", " "), {"TTFT ms": s["ttft_s"] * 1e3})
            for name, s in r["scenarios"].items()
            if name not in ("cold", "storage_restore")
        ]
        ms = {k: f"{r['scenarios'][k]['ttft_s'] * 1e3:.0f} ms" for k in ("cold", "storage_restore")}
        svg = bars_svg(
            f"TTFT, {r['prompt_tokens']}-token prompt (cold prefill {ms['cold']}, "
            f"storage restore {ms['storage_restore']})",
            groups,
            "ms",
            marks=[(r["transfer_at_link_s"] * 1e3, "prefix KV at link speed")],
        )
    else:
        raise ValueError(
            f"plot takes transfer results or one ttft result, got {sorted(map(str, kinds))}"
        )
    Path(out).write_text(svg)
    return svg
