"""`read_metrics`' trend: its `change` and `direction` never contradict each other."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ajet.protocol import MetricsResponse
from mcp_bridge import tools


class _Metrics:
    """What `read_metrics` asks of the client: a run's points, filtered as the server does."""

    def __init__(self, values: list[float]) -> None:
        self.points = [{"step": i + 1, "reward_mean": v} for i, v in enumerate(values)]

    def get_metrics(self, run_id: str, *, since_step: int | None = None,
                    fields: Any = None, max_points: int | None = None) -> MetricsResponse:
        points = [p for p in self.points if since_step is None or p["step"] >= since_step]
        if max_points == 1:
            points = points[-1:]
        return MetricsResponse(run_id="r1", points=points, total_steps=len(self.points),
                               last_step=self.points[-1]["step"])


def _trend(values: list[float]) -> Any:
    bridge = SimpleNamespace(client=_Metrics(values), run_ref=lambda run: run or "current")
    result, _ = tools.read_metrics(bridge, metrics=["reward_mean"])  # type: ignore[arg-type]
    (trend,) = result.trend
    return trend


def test_change_follows_the_direction() -> None:
    up_in_the_middle = _trend([0.0, 0.5, 0.6, 0.7, 0.0])  # last == first, fitted rise > 0
    assert up_in_the_middle.direction == "up" and up_in_the_middle.change > 0
    flat = _trend([0.4, 0.1, 0.4])
    assert flat.direction == "flat"
    falling = _trend([0.9, 0.7, 0.5, 0.3])
    assert falling.direction == "down" and falling.change < 0
