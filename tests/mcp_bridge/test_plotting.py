"""The metrics plot is a real, small PNG and tolerates gaps."""

from __future__ import annotations

import io

import pytest

from mcp_bridge.plotting import plot_metrics_png


def test_png_of_two_metrics_with_gaps() -> None:
    points = [{"step": i, "reward_mean": i / 10, "loss": None if i % 3 else 1.0 / (i + 1)}
              for i in range(40)]
    png = plot_metrics_png(points, ["reward_mean", "loss", "absent"], title="run r1")
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert 2_000 < len(png) < 200_000
    from matplotlib import image

    pixels = image.imread(io.BytesIO(png), format="png")
    assert pixels.shape[0] > pixels.shape[1] / 2  # three stacked panels


def test_needs_a_metric() -> None:
    with pytest.raises(ValueError, match="at least one metric"):
        plot_metrics_png([], [])
