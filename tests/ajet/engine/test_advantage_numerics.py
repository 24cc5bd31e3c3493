"""GRPO advantages and the reward statistics are numerically safe for every value the
server accepts (one reward of 1e308 raised OverflowError in the update and
killed the run), and agree with the textbook formula where it does not overflow.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ajet.engine.advantages import grpo_advantages, mean_std
from ajet.engine.learner import UpdateStats
from ajet.engine.metrics import step_metrics
from swarm_server.settings import Settings

LIMIT = Settings().max_reward_magnitude  # the server's default bound, 1e6
HUGE = 1.7e308  # near the largest float


def textbook(rewards: list[float], eps: float = 1e-6) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


@pytest.mark.parametrize("group", [
    [LIMIT, -LIMIT, LIMIT, 0.0],
    [LIMIT, LIMIT * (1 - 1e-15), LIMIT, LIMIT],  # nearly equal at the limit
    [1e-300, 0.0, -1e-300, 5e-324],  # subnormal
    [HUGE, -HUGE, HUGE, -HUGE],  # beyond any limit: (r - mean) ** 2 overflowed here
    [HUGE, 0.0, 1.0, -1.0],
    [1e308, 1e308, 1e308, 1e307],
])
def test_advantages_are_finite_centred_and_unit_scale_at_the_limits(group: list[float]) -> None:
    adv = grpo_advantages(group, [0] * len(group))
    assert all(math.isfinite(a) for a in adv), adv
    assert abs(math.fsum(adv)) < 1e-6 * len(adv)
    if mean_std(group)[1] > 1e-3:  # eps is negligible at this scale
        spread = math.sqrt(math.fsum(a * a for a in adv) / len(adv))
        assert spread == pytest.approx(1.0, rel=1e-3)


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.floats(min_value=-LIMIT, max_value=LIMIT, allow_nan=False), min_size=2,
                max_size=8))
def test_advantages_match_the_formula_for_every_accepted_reward(rewards: list[float]) -> None:
    adv = grpo_advantages(rewards, [0] * len(rewards))
    if max(rewards) == min(rewards):
        assert adv == [0.0] * len(rewards)
        return
    assert adv == pytest.approx(textbook(rewards), rel=1e-6, abs=1e-6)


def test_groups_are_normalised_separately_and_the_stats_never_overflow() -> None:
    rng = random.Random(3)
    rewards = [rng.choice([HUGE, -HUGE, 0.5, -LIMIT]) for _ in range(32)]
    groups = [i % 8 for i in range(32)]
    adv = grpo_advantages(rewards, groups)
    assert all(math.isfinite(a) for a in adv)
    mean, std = mean_std(rewards)
    assert math.isfinite(mean) and math.isfinite(std) and std > 0
    assert mean_std([]) == (0.0, 0.0) and mean_std([0.0, 0.0]) == (0.0, 0.0)
    assert mean_std([1.0, 3.0]) == pytest.approx((2.0, 1.0))
    update = UpdateStats(loss=0.0, kl=0.0, entropy=0.0, clip_frac=0.0, grad_norm=0.0,
                         tokens=0, samples=0, seconds=0.0)
    line = step_metrics(step=1, episodes=[_Episode() for _ in rewards], rewards=rewards,
                        update=update, groups=8, step_time_s=1.0, wall_time_s=1.0)
    assert math.isfinite(line["reward_std"]) and math.isfinite(line["reward_mean"])


class _Episode:
    """What `step_metrics` reads of an episode."""

    is_success = None
    log_metrics: dict[str, float] = {}

    class trajectory:  # noqa: N801 - mirrors Episode.trajectory
        response_tokens = 1
        completions: list[object] = []
