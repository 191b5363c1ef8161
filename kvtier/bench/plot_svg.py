"""Horizontal grouped bar charts as SVG text, stacked in panels (no plotting library needed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")
BAR, GAP, LEFT, TOP, WIDTH = 14, 10, 190, 40, 760
TARGET = "#c00"
"""Colour of the per-group target ticks (the panel-wide reference lines are dark grey)."""

Group = tuple[str, dict[str, float]]
Mark = tuple[float, str]


@dataclass(frozen=True, slots=True)
class Panel:
    """One chart: a group of bars per ``(label, {series: value})``, on one linear axis."""

    title: str
    """Drawn above the legend."""
    groups: Sequence[Group]
    """Top to bottom; a series missing from a group leaves its slot empty."""
    unit: str
    """Written at the bottom right: what the axis counts."""
    marks: Sequence[Mark] = ()
    """Dashed reference lines ``(value, label)`` across the whole panel."""
    group_marks: Sequence[Sequence[Mark]] = ()
    """Per group, in the order of ``groups`` (may be shorter): solid ticks ``(value, label)``
    across that group only, for a target that differs between groups."""


def _num(v: float) -> str:
    """Three significant digits, without an exponent for values in the thousands and up."""
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def _panel(p: Panel, y: float) -> tuple[list[str], float]:
    """The elements of ``p`` drawn from height ``y`` down, and the height they take."""
    series = list(dict.fromkeys(s for _, vals in p.groups for s in vals))
    values = [v for _, vals in p.groups for v in vals.values()]
    values += [m for m, _ in p.marks] + [m for gm in p.group_marks for m, _ in gm]
    scale = (WIDTH - LEFT - 60) / (max(values + [1e-9]) * 1.05)
    group_h = len(series) * BAR + GAP
    top = y + TOP
    bottom = top + len(p.groups) * group_h
    out = [f'<text x="{LEFT}" y="{y + 18}" font-size="14">{escape(p.title)}</text>']
    for i, s in enumerate(series):
        x = LEFT + i * 150
        out.append(f'<rect x="{x}" y="{y + 24}" width="10" height="10" fill="{COLORS[i % 4]}"/>')
        out.append(f'<text x="{x + 14}" y="{y + 33}">{escape(s)}</text>')
    for g, (label, vals) in enumerate(p.groups):
        y0 = top + g * group_h
        out.append(
            f'<text x="{LEFT - 6}" y="{y0 + group_h / 2}" text-anchor="end">{escape(label)}</text>'
        )
        for i, s in enumerate(series):
            if s not in vals:
                continue
            v, yb = vals[s], y0 + i * BAR
            out.append(
                f'<rect x="{LEFT}" y="{yb}" width="{v * scale:.1f}" height="{BAR - 2}" '
                f'fill="{COLORS[i % 4]}"/>'
            )
            out.append(f'<text x="{LEFT + v * scale + 3:.1f}" y="{yb + BAR - 4}">{_num(v)}</text>')
        for value, mark in p.group_marks[g] if g < len(p.group_marks) else ():
            x = LEFT + value * scale
            out.append(
                f'<line x1="{x:.1f}" y1="{y0 - 2}" x2="{x:.1f}" y2="{y0 + group_h - GAP}" '
                f'stroke="{TARGET}" stroke-width="2"/>'
            )
            out.append(
                f'<text x="{x + 3:.1f}" y="{y0 + group_h - 1}" font-size="9" fill="{TARGET}">'
                f"{escape(mark)}</text>"
            )
    for value, mark in p.marks:
        x = LEFT + value * scale
        out.append(
            f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{bottom}" stroke="#333" '
            'stroke-dasharray="4 3"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">{escape(mark)}</text>'
        )
    out.append(
        f'<text x="{WIDTH - 10}" y="{bottom + 28}" text-anchor="end">{escape(p.unit)}</text>'
    )
    return out, bottom + 40 - y


def panels_svg(panels: Sequence[Panel]) -> str:
    """One SVG document with ``panels`` stacked top to bottom, each on its own axis."""
    body: list[str] = []
    height = 0.0
    for p in panels:
        elems, h = _panel(p, height)
        body += elems
        height += h
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:g}" '
        'font-family="sans-serif" font-size="11">'
    )
    return "\n".join([head, *body, "</svg>"]) + "\n"


def bars_svg(title: str, groups: Sequence[Group], unit: str, marks: Sequence[Mark] = ()) -> str:
    """One panel of horizontal grouped bars (see ``Panel``)."""
    return panels_svg([Panel(title, groups, unit, marks)])
