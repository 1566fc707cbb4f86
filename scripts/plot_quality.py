"""Quality against size as a figure: KL to the original against bits per weight, one line per
tq setting and one marker per peer, written as a plain SVG (no plotting library).

Usage: python scripts/plot_quality.py POINTS.json OUT.svg [--check]

POINTS.json: {"title": str, "y": "KL" label, "series": [{"name": str, "kind": "line" |
"points", "color": "#rrggbb", "points": [{"bits": float, "kl": float, "label": str?,
"dx": px?, "dy": px?}]}]}.
Every number comes from `tq eval` (docs/results.md gives the command of each). The y axis
is logarithmic. `--check`: exit 1 if OUT.svg is not what POINTS.json gives (a test runs
it, so the figure cannot drift from its numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

W, H = 760, 470
LEFT, RIGHT, TOP, BOTTOM = 70, 230, 40, 60
MARKERS = ("circle", "square", "diamond", "triangle")


def _scale(lo: float, hi: float, a: float, b: float, log: bool = False):  # type: ignore[no-untyped-def]
    f = math.log10 if log else (lambda v: v)
    flo, fhi = f(lo), f(hi)
    return lambda v: a + (f(v) - flo) / (fhi - flo) * (b - a)


def _marker(kind: str, x: float, y: float, color: str) -> str:
    if kind == "square":
        return f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{color}"/>'
    if kind == "diamond":
        return (f'<polygon points="{x:.1f},{y - 5:.1f} {x + 5:.1f},{y:.1f} {x:.1f},{y + 5:.1f} '
                f'{x - 5:.1f},{y:.1f}" fill="{color}"/>')
    if kind == "triangle":
        return (f'<polygon points="{x:.1f},{y - 5:.1f} {x + 5:.1f},{y + 4:.1f} '
                f'{x - 5:.1f},{y + 4:.1f}" fill="{color}"/>')
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}"/>'


def render(doc: dict[str, Any]) -> str:
    pts = [p for s in doc["series"] for p in s["points"]]
    x0 = math.floor(min(p["bits"] for p in pts) * 2) / 2
    x1 = math.ceil(max(p["bits"] for p in pts) * 2) / 2
    y0 = 10 ** math.floor(math.log10(min(p["kl"] for p in pts)))
    top = max(p["kl"] for p in pts)
    y1 = min(m * 10 ** math.floor(math.log10(top)) for m in (1, 2, 5, 10)
             if m * 10 ** math.floor(math.log10(top)) >= top)
    sx = _scale(x0, x1, LEFT, W - RIGHT)
    sy = _scale(y0, y1, H - BOTTOM, TOP, log=True)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14">{doc["title"]}</text>']
    b = x0
    while b <= x1 + 1e-9:
        x = sx(b)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}" '
                   'stroke="#ddd"/>')
        out.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 18}" text-anchor="middle">{b:g}</text>')
        b += 0.5
    decade = y0
    while decade <= y1 * 1.0001:
        for m in (1, 2, 5):
            v = decade * m
            if v > y1 * 1.0001:
                break
            y = sy(v)
            out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" '
                       f'stroke="{"#bbb" if m == 1 else "#eee"}"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{v:g}</text>')
        decade *= 10
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2:.0f}" y="{H - 18}" text-anchor="middle">'
               'bits per weight of the quantized layers (everything stored)</text>')
    out.append(f'<text x="18" y="{(TOP + H - BOTTOM) / 2:.0f}" text-anchor="middle" '
               f'transform="rotate(-90 18 {(TOP + H - BOTTOM) / 2:.0f})">{doc["y"]}</text>')
    ly = TOP + 10
    for i, s in enumerate(doc["series"]):
        color, kind = s["color"], MARKERS[i % len(MARKERS)]
        xy = [(sx(p["bits"]), sy(p["kl"])) for p in sorted(s["points"], key=lambda p: p["bits"])]
        if s["kind"] == "line" and len(xy) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                       'stroke-width="2"/>')
        for (x, y), p in zip(xy, sorted(s["points"], key=lambda p: p["bits"]), strict=True):
            out.append(_marker(kind, x, y, color))
            if p.get("label"):  # dx, dy: where the label sits from the point, in pixels
                dx, dy = p.get("dx", 7), p.get("dy", -6)
                anchor = "end" if dx < 0 else "start"
                out.append(f'<text x="{x + dx:.1f}" y="{y + dy:.1f}" font-size="10" '
                           f'text-anchor="{anchor}" fill="{color}">{p["label"]}</text>')
        lx = W - RIGHT + 16
        out.append(_marker(kind, lx, ly - 4, color))
        out.append(f'<text x="{lx + 10}" y="{ly}" font-size="11">{s["name"]}</text>')
        ly += 18
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("points", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    svg = render(json.loads(args.points.read_text()))
    if args.check:
        if not args.out.is_file() or args.out.read_text() != svg:
            print(f"{args.out}: out of date; run python scripts/plot_quality.py {args.points} "
                  f"{args.out}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(svg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
