"""`success_rate` counts only what workflows said: null when none sent `is_success`."""

from __future__ import annotations

from types import SimpleNamespace

from ajet.engine.learner import UpdateStats
from ajet.engine.metrics import step_metrics

UPDATE = UpdateStats(loss=0.0, kl=0.0, entropy=0.0, clip_frac=0.0, grad_norm=0.0, tokens=0,
                     samples=0, seconds=0.0)


def _episodes(*said: bool | None) -> list[SimpleNamespace]:
    trajectory = SimpleNamespace(response_tokens=1, completions=[])
    return [SimpleNamespace(is_success=s, log_metrics={}, trajectory=trajectory) for s in said]


def _rate(*said: bool | None) -> float | None:
    rewards = [1.0] * len(said)  # every reward positive: no success may be inferred from it
    return step_metrics(step=1, episodes=_episodes(*said), rewards=rewards, update=UPDATE,
                        groups=1, step_time_s=1.0, wall_time_s=1.0)["success_rate"]


def test_no_workflow_said_so_the_rate_is_null() -> None:
    assert _rate(None, None, None) is None


def test_the_rate_is_over_the_episodes_that_said() -> None:
    assert _rate(True, False, None, None) == 0.5
    assert _rate(False, False) == 0.0
