"""The policy-gradient loss: PPO's clipped ratio with an optional KL to the initial policy.

Variant, per response token t of an episode with advantage A:

    ratio_t = exp(logp_t - logp_old_t)                 logp_old: recorded when sampled
    pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   ("k3", Schulman 2020), >= 0
    loss    = sum_t (pg_t + kl_coef * kl_t) / N

Token-level normalisation: N is the number of trained tokens (the loss mask's ones: a
merged timeline's sampled tokens, each counted once) in the whole batch (all
micro-batches of one optimizer step), so long responses weigh more than short ones and
no per-sequence mean is taken (as in DAPO and nanochat, unlike the GRPO paper's
per-sequence average). Departures from GRPO: the KL term is off unless `kl_coef > 0`,
and then it is a loss term, not a reward penalty. With `ppo_epochs = 1` and on-policy
episodes the ratio is 1 and clipping never triggers; it matters for episodes that were
sampled before the previous update (carried over in a group) and for later epochs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossTerms", "policy_loss"]


@dataclass
class LossTerms:
    """The loss to backpropagate and detached sums for metrics (divide by N to average)."""

    loss: torch.Tensor
    pg_sum: float
    kl_sum: float
    clipped_tokens: float
    approx_kl_old_sum: float


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, clip_ratio: float, n_tokens: int,
                ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0) -> LossTerms:
    """Loss of one micro-batch. Shapes: logprobs, old_logprobs, mask, ref (B, R); advantages (B,).

    `n_tokens` is the response-token count of the whole batch (token-level normalisation).
    """
    adv = advantages.unsqueeze(-1)  # (B, 1)
    log_ratio = (logprobs - old_logprobs) * mask  # (B, R)
    ratio = log_ratio.exp()  # (B, R)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio) * adv
    pg = -torch.minimum(unclipped, clipped) * mask  # (B, R)
    total = pg.sum()
    kl_sum = 0.0
    if ref_logprobs is not None and kl_coef > 0:
        delta = (ref_logprobs - logprobs) * mask  # (B, R)
        kl = (delta.exp() - delta - 1.0) * mask  # (B, R), k3 estimator
        total = total + kl_coef * kl.sum()
        kl_sum = float(kl.detach().sum())
    denom = max(1, n_tokens)
    with torch.no_grad():
        was_clipped = ((unclipped - clipped).abs() > 0).float() * mask
        # k3 estimate of KL(sampling policy || current policy), for the metric when no
        # reference model is kept
        approx = (ratio - 1.0 - log_ratio) * mask
    return LossTerms(loss=total / denom, pg_sum=float(pg.detach().sum()), kl_sum=kl_sum,
                     clipped_tokens=float(was_clipped.sum()),
                     approx_kl_old_sum=float(approx.sum()))
