"""The learner: optimizer state and the policy update over `ppo_epochs`.

One optimizer step per epoch over the whole batch: micro-batches accumulate gradients
of `loss.policy_loss` (normalised by the batch's response-token count, so accumulation
equals one big batch), then the gradient norm is clipped to `max_grad_norm` and AdamW
steps. With `kl_coef > 0` a frozen copy of the initial policy is kept as reference.

Nothing here knows about episodes, HTTP or files: it takes `TrainSample`s and returns
`UpdateStats`. Under torchrun every rank calls `update` with the whole batch and trains
on the task groups with `group % world_size == rank` through the policy wrapped in
DistributedDataParallel (`Dist.data_parallel`), which averages the gradients over the
ranks in the last backward pass of the step (each rank's loss is scaled by the world
size first, so the average is the sum); metric sums are added up the same way, and
every rank then takes the same optimizer step, so the replicas stay identical.

Whole groups make the ranks' micro-batch counts differ, while DDP needs every rank to
run the same number of backward passes: the ranks agree on the largest count, and a
rank with fewer runs zero-weight micro-batches (a real forward and backward of one
sample, loss times 0) so its gradient hooks fire with nothing added. All backward
passes but the last run under `no_sync`, so gradients are reduced once per step. With
one process there is no wrapper and no padding: plain local training.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ajet.engine.config import EngineConfig
from ajet.engine.distributed import Dist
from ajet.engine.loss import LossTerms, policy_loss
from ajet.engine.policy import Policy, score_responses

__all__ = ["Learner", "TrainSample", "UpdateStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSample:
    """One completion to train on, with the advantage of its episode."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantage: float
    #: index of the episode's task group in the batch; ranks split the batch by group
    group: int = 0


@dataclass
class UpdateStats:
    loss: float
    #: mean per-token k3 KL to the initial policy when kl_coef > 0, else to the sampling
    #: policy (0 for on-policy data in the first epoch)
    kl: float
    entropy: float
    clip_frac: float
    grad_norm: float
    tokens: int
    samples: int
    seconds: float


class Learner:
    def __init__(self, policy: Policy, cfg: EngineConfig, dist: Dist | None = None) -> None:
        self.policy = policy
        self.cfg = cfg
        self.dist = dist or Dist()
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.adam_betas,
                                           weight_decay=cfg.weight_decay)
        self.reference = None
        if cfg.kl_coef > 0:
            self.reference = copy.deepcopy(policy.model).eval()
            for p in self.reference.parameters():
                p.requires_grad_(False)
        # after the reference copy, so the copy carries no DDP hooks; generation and
        # checkpoints keep using `policy.model`, which the wrapper shares
        self.train_model: torch.nn.Module = self.dist.data_parallel(policy.model)

    def update(self, samples: Sequence[TrainSample]) -> UpdateStats:
        """Train on this rank's share of `samples` (the whole batch, same on every rank).

        Holds the policy lock so no token is sampled meanwhile.
        """
        start = time.perf_counter()
        samples = [s for s in samples if s.response_ids]
        n_tokens = sum(len(s.response_ids) for s in samples)  # of the whole batch
        if not samples:
            return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, time.perf_counter() - start)
        dist = self.dist
        mine = [s for s in samples if s.group % dist.world_size == dist.rank]
        cfg = self.cfg
        micro_batches = [mine[i:i + cfg.micro_batch_size]
                         for i in range(0, len(mine), cfg.micro_batch_size)]
        # every rank runs as many backward passes as the busiest one (DDP's hooks pair up)
        n_micro = dist.max_int(len(micro_batches), self.policy.device)
        losses: list[float] = []
        kl_sum = entropy_sum = clipped = grad_norm = 0.0
        with self.policy.lock:
            self.train_model.train()
            try:
                for epoch in range(cfg.ppo_epochs):
                    self.optimizer.zero_grad(set_to_none=True)
                    # local sums: loss (already / n_tokens), kl, entropy, clipped tokens
                    sums = [0.0, 0.0, 0.0, 0.0]
                    for index in range(n_micro):
                        real = index < len(micro_batches)
                        # a rank short of micro-batches repeats the batch's first sample
                        # with weight 0: its hooks fire, its gradient adds nothing
                        micro = micro_batches[index] if real else samples[:1]
                        with self._accumulating(last=index == n_micro - 1):
                            terms, entropy = self._micro_batch(
                                micro, n_tokens, with_entropy=real and epoch == 0)
                            # x world_size: DDP averages over the ranks, we want the sum
                            weight = float(dist.world_size) if real else 0.0
                            (terms.loss * weight).backward()
                        if not real:
                            continue
                        sums[0] += float(terms.loss.detach())
                        sums[1] += terms.kl_sum if self.reference is not None \
                            else terms.approx_kl_old_sum
                        sums[2] += entropy
                        sums[3] += terms.clipped_tokens
                    # each rank's loss is its share of the batch loss, scaled by the world
                    # size before DDP's mean: the reduced gradient is the whole batch's
                    sums = dist.sum_floats(sums, self.policy.device)
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params,
                                                                     cfg.max_grad_norm))
                    self.optimizer.step()
                    losses.append(sums[0])
                    kl_sum = sums[1]
                    if epoch == 0:
                        entropy_sum = sums[2]
                    clipped = sums[3]
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                self.train_model.eval()
        return UpdateStats(
            loss=sum(losses) / len(losses), kl=kl_sum / n_tokens, entropy=entropy_sum / n_tokens,
            clip_frac=clipped / n_tokens, grad_norm=grad_norm, tokens=n_tokens,
            samples=len(samples), seconds=time.perf_counter() - start)

    def _accumulating(self, *, last: bool) -> contextlib.AbstractContextManager[object]:
        """DDP's `no_sync` for every backward but the step's last (which reduces)."""
        if last or self.train_model is self.policy.model:
            return contextlib.nullcontext()
        return self.train_model.no_sync()  # type: ignore[operator]

    def _micro_batch(self, micro: Sequence[TrainSample], n_tokens: int, *, with_entropy: bool
                     ) -> tuple[LossTerms, float]:
        cfg, policy = self.cfg, self.policy
        prompts = [list(s.prompt_ids) for s in micro]
        responses = [list(s.response_ids) for s in micro]
        logprobs, mask, entropy = score_responses(
            self.train_model, prompts, responses, pad_id=policy.pad_id,
            temperature=cfg.temperature, device=policy.device, with_entropy=with_entropy)
        width = mask.size(1)
        old = torch.zeros_like(logprobs)  # (B, R)
        for row, s in enumerate(micro):
            old[row, :len(s.old_logprobs)] = torch.tensor(s.old_logprobs[:width])
        advantages = torch.tensor([s.advantage for s in micro], device=policy.device)  # (B,)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref, _, _ = score_responses(self.reference, prompts, responses,
                                            pad_id=policy.pad_id, temperature=cfg.temperature,
                                            device=policy.device)
        terms = policy_loss(logprobs, old, advantages, mask, clip_ratio=cfg.clip_ratio,
                            n_tokens=n_tokens, ref_logprobs=ref, kl_coef=cfg.kl_coef)
        return terms, float(entropy.sum()) if entropy is not None else 0.0
