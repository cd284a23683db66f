"""Small SVG helpers for the dashboard: a plot of points against an axis, and a timeline of rows.

Why our own and not matplotlib: the plots are drawn on every poll of a page (every 2 s per open
browser), as text inside the HTML; a few hundred lines of string building cost well under a
millisecond and need no import of a plotting stack into the coordinator. Everything written
into the SVG from data goes through ``html.escape``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Sequence

__all__ = ["OKABE_ITO", "EVAL_COLOUR", "Mark", "Bar", "Overlay", "colour", "plot", "timeline", "ticks", "label_lanes"]

# Okabe & Ito's colour-blind-safe palette (black left out: it is the axes' colour).
OKABE_ITO = ("#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442")
# Points of a second series over a run's own (eval loss over training loss): black, the palette's left-out colour,
# drawn as hollow diamonds, so they differ from the run's circles by shape as well as by colour.
EVAL_COLOUR = "#000000"


def colour(index: int) -> str:
    """The run colour of the run at ``index`` (in the order of submission)."""
    return OKABE_ITO[index % len(OKABE_ITO)]


@dataclass(frozen=True)
class Mark:
    """A vertical line at ``x`` with a short label (a pause, a resume, a snapshot...)."""

    x: float
    label: str
    colour: str = "#555555"


@dataclass(frozen=True)
class Overlay:
    """A second series drawn over a plot's own as unjoined hollow diamonds (eval loss over training loss)."""

    points: Sequence[tuple[float, float]]
    label: str
    colour: str = EVAL_COLOUR


@dataclass(frozen=True)
class Bar:
    """A span ``[start, end)`` on row ``row`` of a timeline, filled ``fill``; ``shade`` draws it as a hatched band."""

    row: int
    start: float
    end: float
    label: str
    fill: str
    shade: bool = False


def ticks(lo: float, hi: float, count: int = 5, *, min_step: float = 0.0) -> list[float]:
    """About ``count`` round tick values covering ``[lo, hi]``, at least ``min_step`` apart (1 for a clock in s)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = max((hi - lo) / max(1, count), min_step)
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(value: float) -> str:
    if 1e3 <= abs(value) < 1e7:
        return f"{value:.0f}"
    if value == 0 or 1e-3 <= abs(value) < 1e3:
        return f"{value:.4g}"
    return f"{value:.2e}"


def _span(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


_W, _H, _L, _R, _T, _B = 640, 240, 56, 12, 12, 36  # size and margins of a plot


def _frame(title: str, x_label: str, y_label: str, xs: tuple[float, float], ys: tuple[float, float], x_fmt) -> list[str]:
    sx = lambda x: _L + (x - xs[0]) / (xs[1] - xs[0]) * (_W - _L - _R)  # noqa: E731
    sy = lambda y: _H - _B - (y - ys[0]) / (ys[1] - ys[0]) * (_H - _T - _B)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" viewBox="0 0 {_W} {_H}" role="img" '
           f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
           f'<rect x="{_L}" y="{_T}" width="{_W - _L - _R}" height="{_H - _T - _B}" class="area"/>']
    for t in ticks(*ys):
        if ys[0] <= t <= ys[1]:
            out.append(f'<line class="grid" x1="{_L}" x2="{_W - _R}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                       f'<text class="tick" x="{_L - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in ticks(*xs, min_step=0.0 if x_fmt is _fmt else 1.0):  # another formatter: a clock, in whole seconds
        if xs[0] <= t <= xs[1]:
            out.append(f'<text class="tick" x="{sx(t):.1f}" y="{_H - _B + 14}" text-anchor="middle">{escape(x_fmt(t))}</text>')
    out.append(f'<text class="label" x="{(_W + _L) / 2}" y="{_H - 4}" text-anchor="middle">{escape(x_label)}</text>'
               f'<text class="label" x="12" y="{_T + (_H - _T - _B) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 12 {_T + (_H - _T - _B) / 2})">{escape(y_label)}</text>')
    return out


_CHAR_W = 6.5  # px per character of an 11 px label, a little over the average: a label's width estimated server-side
_LANES = 5  # rows of mark labels down a plot
_LANE_H = 14  # an 11 px label's box is about 13 px high


def label_lanes(xs: Sequence[float], labels: Sequence[str], *, left: float = _L, right: float = _W - _R,
                lanes: int = _LANES, gap: float = 4.0) -> list[tuple[float, str, int] | None]:
    """Where each mark's label goes: ``(x, text-anchor, lane)``, or None where it would overprint others (thinned).

    Marks are placed in x order; a label sits right of its line (left of it where it would run off the plot) in
    the first lane where it overlaps no label already placed. Marks close in time get labels in lanes down the
    plot; past ``lanes`` of them the rest are left unlabelled (their line and its tooltip stay).
    """
    placed: list[list[tuple[float, float]]] = [[] for _ in range(lanes)]
    out: list[tuple[float, str, int] | None] = [None] * len(xs)
    for i in sorted(range(len(xs)), key=lambda i: xs[i]):
        width = _CHAR_W * len(labels[i])
        x, anchor, lo, hi = xs[i] + 3, "start", xs[i] + 3, xs[i] + 3 + width
        if hi > right:
            x, anchor, lo, hi = xs[i] - 3, "end", max(left, xs[i] - 3 - width), xs[i] - 3
        for lane in range(lanes):
            if all(hi + gap <= a or lo >= b + gap for a, b in placed[lane]):
                placed[lane].append((lo, hi))
                out[i] = (x, anchor, lane)
                break
    return out


def _diamond(x: float, y: float, r: float = 4.5) -> str:
    return f"M{x:.1f},{y - r:.1f} L{x + r:.1f},{y:.1f} L{x:.1f},{y + r:.1f} L{x - r:.1f},{y:.1f} Z"


def plot(points: Sequence[tuple[float, float]], *, title: str, x_label: str, y_label: str, colour: str = "#0072B2",
         marks: Sequence[Mark] = (), x_fmt=_fmt, step: bool = False, overlay: Overlay | None = None,
         label: str = "") -> str:
    """An SVG line plot with a circle at each point, and vertical marks.

    Args:
        points: (x, y) pairs, in x order; none (and no overlay points): the plot says "no data yet".
        step: draw the line as a staircase (a count that holds until it changes, like peers).
        x_fmt: formats an x tick (a time axis passes a clock formatter).
        overlay: a second series drawn as diamonds; with it, a legend names both (``label`` names ``points``).
    """
    extra = list(overlay.points) if overlay is not None else []
    if not points and not extra:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" viewBox="0 0 {_W} 60" role="img" '
                f'aria-label="{escape(title)}: no data yet"><text x="{_W / 2}" y="34" text-anchor="middle">'
                f'{escape(title)}: no data yet</text></svg>')
    xs = _span([p[0] for p in points] + [p[0] for p in extra] + [m.x for m in marks])
    ys = _span([p[1] for p in points] + [p[1] for p in extra])
    out = _frame(title, x_label, y_label, xs, ys, x_fmt)
    sx = lambda x: _L + (x - xs[0]) / (xs[1] - xs[0]) * (_W - _L - _R)  # noqa: E731
    sy = lambda y: _H - _B - (y - ys[0]) / (ys[1] - ys[0]) * (_H - _T - _B)  # noqa: E731
    # labels in lanes down the plot: marks close in time do not overprint; a label with no room is left out
    # (class "unlabelled"), its line and tooltip kept
    places = label_lanes([sx(m.x) for m in marks], [m.label for m in marks])
    for m, place in zip(marks, places):
        out.append(f'<g class="mark{" unlabelled" if place is None else ""}"><title>{escape(m.label)}</title>'
                   f'<line x1="{sx(m.x):.1f}" x2="{sx(m.x):.1f}" y1="{_T}" y2="{_H - _B}" '
                   f'stroke="{m.colour}" stroke-dasharray="4 3"/></g>')
    if any(place is not None for place in places):  # after every line: a label's halo (CSS) covers the lines it crosses
        out.append('<g class="marklabels">' + "".join(
            f'<text class="marklabel" x="{place[0]:.1f}" y="{_T + 10 + place[2] * _LANE_H}" text-anchor="{place[1]}" '
            f'fill="{m.colour}"><title>{escape(m.label)}</title>{escape(m.label)}</text>'
            for m, place in zip(marks, places) if place is not None) + "</g>")
    if points:
        path, prev = [], None
        for x, y in points:
            if step and prev is not None:
                path.append(f"{sx(x):.1f},{sy(prev):.1f}")
            path.append(f"{sx(x):.1f},{sy(y):.1f}")
            prev = y
        out.append(f'<polyline class="series" fill="none" stroke="{colour}" points="{" ".join(path)}"/>')
        for x, y in points:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}">'
                       f'<title>{escape(x_fmt(x))}: {_fmt(y)}</title></circle>')
    if overlay is not None:
        for x, y in extra:
            out.append(f'<path class="overlay" d="{_diamond(sx(x), sy(y))}" fill="#ffffff" stroke="{overlay.colour}" '
                       f'stroke-width="1.5"><title>{escape(overlay.label)} {escape(x_fmt(x))}: {_fmt(y)}</title></path>')
        y, own = _H - 8, label or y_label  # the legend: in the bottom margin, left of the x axis' label
        second = _L + 30 + _CHAR_W * len(own)
        out.append(f'<g class="legend"><line x1="{_L}" x2="{_L + 18}" y1="{y - 4}" y2="{y - 4}" stroke="{colour}" '
                   f'stroke-width="2"/><text class="legendlabel" x="{_L + 22}" y="{y}">{escape(own)}</text>'
                   f'<path d="{_diamond(second + 5, y - 4)}" fill="#ffffff" stroke="{overlay.colour}" stroke-width="1.5"/>'
                   f'<text class="legendlabel" x="{second + 14:.1f}" y="{y}">{escape(overlay.label)}</text></g>')
    out.append("</svg>")
    return "".join(out)


def timeline(rows: Sequence[str], bars: Sequence[Bar], *, start: float, end: float, title: str, x_fmt) -> str:
    """An SVG of rows (workers) against time: a rectangle per bar, hatched bars for shaded spans."""
    row_h, left, width, right = 28, 140, 900, 40  # the right margin holds the last tick's label
    height = _T + row_h * max(1, len(rows)) + 30
    span = max(end - start, 1e-9)
    sx = lambda t: left + (min(max(t, start), end) - start) / span * (width - left - right)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="timeline" viewBox="0 0 {width} {height}" role="img" '
           f'aria-label="{escape(title)}"><title>{escape(title)}</title>',
           '<defs><pattern id="resident" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" fill="#dddddd"/>'
           '<line x1="0" y1="0" x2="0" y2="6" stroke="#777777" stroke-width="2"/></pattern></defs>']
    for i, name in enumerate(rows):
        y = _T + i * row_h
        out.append(f'<text class="row" x="{left - 6}" y="{y + row_h / 2 + 4}" text-anchor="end">{escape(name)}</text>'
                   f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y + row_h}" y2="{y + row_h}"/>')
    for b in sorted(bars, key=lambda b: not b.shade):  # shaded spans under the runs' bars
        y = _T + b.row * row_h + (2 if b.shade else 6)
        h = row_h - (4 if b.shade else 12)
        fill = 'url(#resident)' if b.shade else b.fill
        x0, x1 = sx(b.start), sx(b.end)
        out.append(f'<rect class="{"resident" if b.shade else "bar"}" x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" '
                   f'height="{h}" fill="{fill}" opacity="{0.6 if b.shade else 1}"><title>{escape(b.label)}</title></rect>')
        if not b.shade and x1 - x0 > 8 * len(b.label):
            out.append(f'<text class="barlabel" x="{x0 + 4:.1f}" y="{y + h / 2 + 4}">{escape(b.label)}</text>')
    for t in ticks(start, end, 6, min_step=1.0):
        if start <= t <= end:
            out.append(f'<text class="tick" x="{sx(t):.1f}" y="{height - 8}" text-anchor="middle">{escape(x_fmt(t))}</text>')
    out.append("</svg>")
    return "".join(out)
