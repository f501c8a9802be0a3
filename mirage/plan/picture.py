"""The plan's picture: throughput against peak memory, one dot per point that ran, the Pareto
front joined and marked, each profile's capacity a dashed line.

The HTML is standalone (an inline SVG, a tooltip per dot, the table of points beneath): mirage adds
no dependency for it. The PNG is drawn with matplotlib when it is importable (not a dependency of
mirage: `pip install matplotlib`); without it only the HTML is written, and the plan says so.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from mirage.plan.report import Row

WIDTH, HEIGHT = 760, 460
LEFT, RIGHT, TOP, BOTTOM = 80, 30, 40, 60


def _ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round tick values covering [low, high]."""
    span = (high - low) or abs(high) or 1.0
    step = 10 ** math.floor(math.log10(span / count))
    for factor in (1, 2, 5, 10):
        if span / (step * factor) <= count:
            step *= factor
            break
    first = math.floor(low / step) * step
    return [first + i * step for i in range(int(math.ceil((high - first) / step)) + 1)]


def _front(rows: list[Row]) -> list[Row]:
    return sorted((r for r in rows if r.pareto), key=lambda r: r.peak_bytes)


def _svg(rows: list[Row], y_label: str) -> str:
    ran = [r for r in rows if r.ok]
    capacities: dict[int, list[str]] = {}
    for r in ran:
        names = capacities.setdefault(r.capacity_bytes, [])
        if r.profile not in names:
            names.append(r.profile)
    xs = [r.peak_bytes / 2**30 for r in ran] + [c / 2**30 for c in capacities]
    ys = [r.throughput for r in ran]
    x_ticks, y_ticks = _ticks(0, max(xs, default=1)), _ticks(0, max(ys, default=1))

    def x_of(v: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * v / x_ticks[-1]

    def y_of(v: float) -> float:
        return HEIGHT - BOTTOM - (HEIGHT - TOP - BOTTOM) * v / y_ticks[-1]

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>']
    for t in x_ticks:
        parts.append(f'<line x1="{x_of(t):.1f}" y1="{TOP}" x2="{x_of(t):.1f}" y2="{HEIGHT - BOTTOM}" stroke="#eee"/>'
                     f'<text x="{x_of(t):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{t:g}</text>')
    for t in y_ticks:
        parts.append(f'<line x1="{LEFT}" y1="{y_of(t):.1f}" x2="{WIDTH - RIGHT}" y2="{y_of(t):.1f}" stroke="#eee"/>'
                     f'<text x="{LEFT - 6}" y="{y_of(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 18}" text-anchor="middle">'
                 'peak memory per GPU (GiB, reserved)</text>')
    parts.append(f'<text transform="translate(18 {(TOP + HEIGHT - BOTTOM) / 2}) rotate(-90)" '
                 f'text-anchor="middle">{html.escape(y_label)}</text>')
    for capacity, names in sorted(capacities.items()):
        x = x_of(capacity / 2**30)
        parts.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" stroke="#c33" '
                     f'stroke-dasharray="5 4"/><text x="{x - 4:.1f}" y="{TOP - 6}" text-anchor="end" fill="#c33">'
                     f'{html.escape(", ".join(names))} capacity</text>')
    front = _front(ran)
    if len(front) > 1:
        path = " ".join(f"{x_of(r.peak_bytes / 2**30):.1f},{y_of(r.throughput):.1f}" for r in front)
        parts.append(f'<polyline points="{path}" fill="none" stroke="#1f6fb4" stroke-width="1.5"/>')
    for r in ran:
        x, y = x_of(r.peak_bytes / 2**30), y_of(r.throughput)
        tip = html.escape(f"#{r.rank} {r.label}: {r.throughput:,.2f} {y_label}, step {r.step_ms:.3f} ms, "
                          f"MFU {100 * r.mfu:.1f}%, peak {r.peak_bytes / 2**30:.2f} GiB")
        fill = "#1f6fb4" if r.pareto else "#999"
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{6 if r.pareto else 4}" fill="{fill}"><title>{tip}</title></circle>')
        if r.pareto:
            parts.append(f'<text x="{x + 8:.1f}" y="{y - 6:.1f}" fill="#1f6fb4">{html.escape(r.label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_html(rows: list[Row], y_label: str, table_text: str, path: Path) -> None:
    body = (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>mirage plan</title></head>\n"
            f"<body style='font-family:sans-serif'>\n<h2>mirage plan: {html.escape(y_label)} against peak memory</h2>\n"
            f"<p>Blue: the Pareto front (no other point has more throughput with less memory). "
            f"Hover a dot for its figures.</p>\n{_svg(rows, y_label)}\n<pre>{html.escape(table_text)}</pre>\n"
            f"</body></html>\n")
    path.write_text(body)


def write_png(rows: list[Row], y_label: str, path: Path) -> bool:
    """The same picture with matplotlib; False (nothing written) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError:
        return False
    ran = [r for r in rows if r.ok]
    figure, axes = pyplot.subplots(figsize=(WIDTH / 100, HEIGHT / 100), dpi=100)
    others = [r for r in ran if not r.pareto]
    axes.scatter([r.peak_bytes / 2**30 for r in others], [r.throughput for r in others], color="#999", s=16)
    front = _front(ran)
    axes.plot([r.peak_bytes / 2**30 for r in front], [r.throughput for r in front], "o-", color="#1f6fb4",
              label="Pareto front")
    for r in front:
        axes.annotate(r.label, (r.peak_bytes / 2**30, r.throughput), textcoords="offset points", xytext=(6, 4),
                      fontsize=8, color="#1f6fb4")
    for capacity in sorted({r.capacity_bytes for r in ran}):
        names = ", ".join(sorted({r.profile for r in ran if r.capacity_bytes == capacity}))
        axes.axvline(capacity / 2**30, color="#c33", linestyle="--", linewidth=1, label=f"{names} capacity")
    axes.set_xlim(left=0)
    axes.set_ylim(bottom=0)
    axes.set_xlabel("peak memory per GPU (GiB, reserved)")
    axes.set_ylabel(y_label)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return True
