"""HTML pieces the console's templates cannot make themselves: highlighted, escaped diff
lines, and reward curves as inline SVG (no script library; the page runs no JavaScript).

Diff lines come from `ajet.code_review` with their raw text. Pygments highlights a line and
HTML-escapes it; then every character `escape_text` would escape (control characters,
escape sequences, bidi overrides, zero-width and unusual spaces) is replaced by a marked
`<span class="ctl">\\x1b</span>`. That is safe after escaping: such characters never occur
in the markup Pygments writes, only in the text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from html import escape

from markupsafe import Markup
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_for_filename
from pygments.util import ClassNotFound

from ajet.code_review import DiffLine, escape_char, is_unsafe

__all__ = ["PYGMENTS_CSS", "diff_line_html", "nice_ticks", "svg_chart"]

#: CSS for Pygments' classes under `.hl`, generated from the installed package. Its
#: `Error` token (`.err`, a red box) marks what the lexer could not place, such as a
#: backtick in a docstring or a `$` in a comment: plain text, not a problem, so it is
#: drawn as plain text. Real hazards (control characters) are marked by `.ctl` instead.
PYGMENTS_CSS = (HtmlFormatter(style="default").get_style_defs(".hl")
                + "\n.hl .err { border: none; color: inherit; background: none; }\n")
_FORMATTER = HtmlFormatter(nowrap=True)
_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
            "#e377c2")


@lru_cache(maxsize=64)
def _lexer(path: str) -> Lexer:
    try:
        return get_lexer_for_filename(path, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return TextLexer(stripnl=False, ensurenl=False)


def _mark_controls(html_text: str) -> str:
    if not any(is_unsafe(ch) for ch in html_text):
        return html_text
    return "".join(
        f'<span class="ctl" title="control character U+{ord(ch):04X}">{escape_char(ch)}</span>'
        if is_unsafe(ch) else ch for ch in html_text)


def diff_line_html(line: DiffLine, path: str) -> Markup:
    """One diff line as safe HTML: highlighted code, control characters marked."""
    if line.kind in ("add", "del", "ctx"):
        # lines never hold "\n" (code_review splits on it); the formatter ends with one
        body = highlight(line.text, _lexer(path), _FORMATTER).removesuffix("\n") \
            if line.text else ""
    else:
        body = escape(line.text)
    return Markup(_mark_controls(body))


def _nice(x: float, *, round_it: bool) -> float:
    """A "nice" number near `x` (1, 2 or 5 times a power of ten)."""
    exp = math.floor(math.log10(x))
    f = x / 10 ** exp
    if round_it:
        nf = 1 if f < 1.5 else 2 if f < 3 else 5 if f < 7 else 10
    else:
        nf = 1 if f <= 1 else 2 if f <= 2 else 5 if f <= 5 else 10
    return nf * 10 ** exp


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi]: 0, 0.2, 0.4, ..., not 0.312.

    The step is 1, 2 or 5 times a power of ten (the "nice numbers" of graph labels);
    the first tick is at or below `lo`, the last at or above `hi`.
    """
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("ticks need finite bounds")
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    span = _nice(hi - lo, round_it=False)
    step = _nice(span / max(1, count - 1), round_it=True)
    first = math.floor(lo / step) * step
    last = math.ceil(hi / step) * step
    n = int(round((last - first) / step))
    # rounding to the step's decimals keeps 0.30000000000000004 out of the labels
    digits = max(0, -math.floor(math.log10(step)))
    return [round(first + i * step, digits) for i in range(n + 1)]


def _tick_label(value: float, step: float) -> str:
    digits = max(0, -math.floor(math.log10(step))) if step > 0 else 0
    return f"{value:.{digits}f}" if digits <= 6 else f"{value:.3g}"


def svg_chart(series: dict[str, Sequence[tuple[float, float]]], *, metric: str,
              width: int = 760, height: int = 280) -> Markup:
    """Curves of `metric` per run (run id -> [(step, value)]), overlaid, with a legend."""
    points = [p for pts in series.values() for p in pts
              if math.isfinite(p[0]) and math.isfinite(p[1])]
    if not points:
        return Markup(f'<p class="muted">No values of {escape(metric)} yet.</p>')
    # the legend has a band of its own above the plot, so it never hides a curve
    left, right, top, bottom = 56, 16, 14 + 16 * len(series), 34
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x1 = x0 + 1
    ticks = nice_ticks(min(ys), max(ys))
    y0, y1 = ticks[0], ticks[-1]  # the axis spans whole ticks
    step = ticks[1] - ticks[0]

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom)

    label = (f"{metric} per step for {', '.join(series)}: from {ticks[0]:g} to "
             f"{ticks[-1]:g} over steps {x0:g} to {x1:g}")
    parts = [f'<svg class="chart" role="img" aria-label="{escape(label)}" '
             f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
             f'xmlns="http://www.w3.org/2000/svg">',
             f'<title>{escape(label)}</title>',
             f'<rect x="{left}" y="{top}" width="{width - left - right}" '
             f'height="{height - top - bottom}" fill="#fff" stroke="#ccc"/>']
    for y in ticks:
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(y):.1f}" '
                     f'y2="{sy(y):.1f}" stroke="#eee"/>'
                     f'<text class="ytick" x="{left - 6}" y="{sy(y) + 4:.1f}" '
                     f'text-anchor="end" font-size="11">{_tick_label(y, step)}</text>')
    for x in (x0, x1):
        parts.append(f'<text x="{sx(x):.1f}" y="{height - 16}" text-anchor="middle" '
                     f'font-size="11">{x:g}</text>')
    parts.append(f'<text x="{(width + left) / 2:.0f}" y="{height - 3}" text-anchor="middle" '
                 f'font-size="11">step</text>')
    for i, (run_id, pts) in enumerate(series.items()):
        colour = _COLOURS[i % len(_COLOURS)]
        good = [(x, y) for x, y in pts if math.isfinite(x) and math.isfinite(y)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in good)
        parts.append(f'<polyline class="curve" data-run="{escape(run_id)}" fill="none" '
                     f'stroke="{colour}" stroke-width="2" points="{coords}"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>'
                  for x, y in good]
        ly = 16 + 16 * i
        parts.append(f'<rect x="{left + 10}" y="{ly - 9}" width="12" height="3" '
                     f'fill="{colour}"/><text x="{left + 28}" y="{ly - 5}" font-size="11">'
                     f'{escape(run_id)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
