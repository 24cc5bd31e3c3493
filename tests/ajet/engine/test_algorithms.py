"""Reward processing, GRPO advantages and the clipped policy-gradient loss."""

from __future__ import annotations

import math

import pytest
import torch

from ajet.engine.advantages import grpo_advantages
from ajet.engine.loss import policy_loss
from ajet.engine.rewards import process_rewards


def test_rewards_pass_through_or_clip_and_refuse_non_finite() -> None:
    assert process_rewards([0.5, -2.0, 3]) == [0.5, -2.0, 3.0]
    assert process_rewards([0.5, -2.0, 3.0], clip=1.0) == [0.5, -1.0, 1.0]
    with pytest.raises(ValueError, match="non-finite"):
        process_rewards([1.0, math.nan])


def test_grpo_normalises_within_each_group_only() -> None:
    rewards = [1.0, 0.0, 10.0, 20.0, 5.0, 5.0]
    groups = ["a", "a", "b", "b", "c", "c"]
    adv = grpo_advantages(rewards, groups, eps=0.0)
    assert adv[:4] == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert adv[4:] == [0.0, 0.0]  # zero-variance group: no signal


def test_grpo_population_std_and_mean_zero() -> None:
    rewards = [0.1, 0.4, 0.7, 0.2]
    adv = grpo_advantages(rewards, [0] * 4)
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    assert adv == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        grpo_advantages([1.0], [0, 1])


def _loss(logp: list[float], old: list[float], adv: float, **kw: object) -> float:
    t = torch.tensor([logp])
    return float(policy_loss(t, torch.tensor([old]), torch.tensor([adv]),
                             torch.ones_like(t), clip_ratio=0.2, n_tokens=len(logp),
                             **kw).loss)  # type: ignore[arg-type]


def test_on_policy_loss_is_minus_advantage_and_token_normalised() -> None:
    assert _loss([-1.0, -2.0], [-1.0, -2.0], 0.5) == pytest.approx(-0.5)
    # a masked-out token neither counts nor contributes
    t = torch.tensor([[-1.0, -9.0]])
    out = policy_loss(t, t.clone(), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]),
                      clip_ratio=0.2, n_tokens=1)
    assert float(out.loss) == pytest.approx(-1.0)


def test_ratio_is_clipped_in_the_direction_of_the_advantage() -> None:
    # ratio e^1 ~ 2.7 with a positive advantage: clipped to 1.2
    assert _loss([0.0], [-1.0], 1.0) == pytest.approx(-1.2)
    # negative advantage with a large ratio: the unclipped (worse) term is kept
    assert _loss([0.0], [-1.0], -1.0) == pytest.approx(math.e)
    logp = torch.tensor([[0.0]], requires_grad=True)
    out = policy_loss(logp, torch.tensor([[-1.0]]), torch.tensor([1.0]), torch.ones(1, 1),
                      clip_ratio=0.2, n_tokens=1)
    out.loss.backward()
    assert logp.grad is not None and float(logp.grad) == 0.0  # clipped: no gradient
    assert out.clipped_tokens == 1.0


def test_kl_term_is_zero_at_the_reference_and_positive_away() -> None:
    base = _loss([-1.0], [-1.0], 0.0, ref_logprobs=torch.tensor([[-1.0]]), kl_coef=1.0)
    away = _loss([-1.0], [-1.0], 0.0, ref_logprobs=torch.tensor([[-2.0]]), kl_coef=1.0)
    assert base == pytest.approx(0.0)
    assert away == pytest.approx(math.exp(-1.0) + 1.0 - 1.0)
