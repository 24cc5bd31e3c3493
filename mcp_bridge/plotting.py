"""PNG line plots of per-step metrics, for `read_metrics(plot=True)`.

matplotlib is imported lazily, with the non-interactive Agg backend, so the bridge
starts without it and a plot never opens a window (or needs a display) on a laptop.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["plot_metrics_png"]

#: Small enough for a context window (a few tens of KB), large enough to read.
_FIGSIZE_IN = (6.4, 2.2)
_DPI = 80


def plot_metrics_png(points: Sequence[Mapping[str, Any]], metrics: Sequence[str], *,
                     title: str = "") -> bytes:
    """One panel per metric, value against `step`; returns PNG bytes.

    Missing or non-numeric values are skipped, so a metric that starts late still plots.
    """
    if not metrics:
        raise ValueError("name at least one metric to plot")
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure  # Figure, not pyplot: no global figure registry

    rows = len(metrics)
    fig = Figure(figsize=(_FIGSIZE_IN[0], _FIGSIZE_IN[1] * rows), dpi=_DPI)
    axes = fig.subplots(rows, 1, squeeze=False, sharex=True)
    for ax, name in zip((row[0] for row in axes), metrics, strict=True):
        xs: list[float] = []
        ys: list[float] = []
        for point in points:
            step, value = _number(point.get("step")), _number(point.get(name))
            if step is not None and value is not None:
                xs.append(step)
                ys.append(value)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.2)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_ylabel(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("step", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
