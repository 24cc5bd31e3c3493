"""Reward processing: the rewards workflows reported become the rewards the update uses.

Variant: rewards are taken as sent (the server's end_episode already refuses NaN,
infinities and magnitudes beyond its `max_reward_magnitude`, 1e6 by default),
then optionally clipped to `[-reward_clip, reward_clip]` (`BackendDefaults.reward_clip`,
off by default). No length penalty, no reward model. This is the place to add shaping:
it sees every episode of the batch with its trajectory and metadata.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["process_rewards"]


def process_rewards(raw: Sequence[float], *, clip: float | None = None) -> list[float]:
    """One training reward per episode, same order as `raw`."""
    out: list[float] = []
    for i, value in enumerate(raw):
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(f"episode {i} has a non-finite reward {value!r}")
        if clip is not None:
            reward = max(-clip, min(clip, reward))
        out.append(reward)
    return out
