"""Advantage estimation: GRPO, normalised within each task group.

Variant (Shao et al. 2024, "DeepSeekMath", outcome supervision): the episodes of one
group answered the same task (same `task_id`); each episode's advantage is

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

with the population std (divide by n, not n - 1). A group whose rewards are all equal
carries no signal and gets A = 0 for every episode (it still counts towards token
normalisation in the loss). Every token of an episode's responses gets the episode's
advantage. Departures from the paper: no process supervision, no KL in the reward.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence

__all__ = ["grpo_advantages"]


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
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        for i, v in zip(idx, values, strict=True):
            advantages[i] = (v - mean) / (std + eps)
    return advantages
