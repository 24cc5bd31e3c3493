"""Advantage estimation: GRPO, normalised within each task group.

Variant (Shao et al. 2024, "DeepSeekMath", outcome supervision): the episodes of one
group answered the same task (same `task_id`); each episode's advantage is

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

with the population std (divide by n, not n - 1). A group whose rewards are all equal
carries no signal and gets A = 0 for every episode (it still counts towards token
normalisation in the loss). Every token of an episode's responses gets the episode's
advantage. Departures from the paper: no process supervision, no KL in the reward.

Numerics: float64 throughout, and every finite reward is safe. `(r - mean) ** 2` on raw
rewards overflowed (an OverflowError from one reward above ~1e154 killed the run), so
each group is centred first: on its first reward, which is exact for close rewards,
so nearly equal rewards keep their differences (or, if that difference overflows, on
zero). The offsets are then scaled by their largest magnitude `u` into [-1, 1] before
the mean and std are taken; A is scale-free, so only eps moves with the scale:
`(x_i - mean(x)) / (std(x) + eps / u)`. The server refuses rewards beyond
`max_reward_magnitude` (1e6 by default) before they get here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence

__all__ = ["grpo_advantages", "mean_std"]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std of finite values, without overflow for any of them."""
    if not values or max(values) == min(values):
        return (float(values[0]) if values else 0.0), 0.0
    pivot, unit, xs = _unit_offsets([float(v) for v in values])
    mean, std = _mean_std(xs)
    return pivot + mean * unit, std * unit


def _unit_offsets(values: list[float]) -> tuple[float, float, list[float]]:
    """(pivot, unit, xs) with values[i] == pivot + xs[i] * unit and every |xs[i]| <= 1.

    The values must not all be equal (then unit > 0).
    """
    pivot = values[0]
    offsets = [v - pivot for v in values]  # exact for values within a factor 2 of pivot
    if not all(math.isfinite(d) for d in offsets):  # e.g. 1.7e308 - (-1.7e308)
        pivot, offsets = 0.0, values
    unit = max(abs(d) for d in offsets)
    return pivot, unit, [d / unit for d in offsets]


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    # |x| <= 1: sums, differences and squares stay far from overflow
    mean = math.fsum(xs) / len(xs)
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / len(xs))


def grpo_advantages(rewards: Sequence[float], group_ids: Sequence[Hashable], *,
                    eps: float = 1e-6) -> list[float]:
    """Advantage per episode; `group_ids[i]` names the group of `rewards[i]`."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"{len(rewards)} rewards but {len(group_ids)} group ids")
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, gid in enumerate(group_ids):
        members[gid].append(i)
    advantages = [0.0] * len(rewards)
    for idx in members.values():
        values = [float(rewards[i]) for i in idx]
        if max(values) == min(values):
            continue  # zero-variance group: no preference among its episodes
        _, unit, xs = _unit_offsets(values)
        mean, std = _mean_std(xs)
        for i, x in zip(idx, xs, strict=True):
            advantages[i] = (x - mean) / (std + eps / unit)
    return advantages
