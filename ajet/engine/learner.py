"""The learner: optimizer state and the policy update over `ppo_epochs` and mini-batches.

Per epoch the batch's task groups are split into `mini_batch_num` mini-batches (whole
groups, in order), and each mini-batch is one optimizer step: its micro-batches
accumulate gradients of `loss.policy_loss` (normalised by the mini-batch's trained-token
count, the loss masks' ones, so accumulation equals one big batch), then the gradient norm is clipped to
`max_grad_norm` and AdamW steps. Micro-batches are cut by a token budget
(`micro_batch_tokens`: rows x longest prompt + response, padding included), not by a
row count, so long responses make more micro-batches instead of a higher peak; a sample
longer than the budget goes alone. The trained model (`parallel/training_model.py`: fp32 master
weights, LoRA, activation checkpointing, FSDP2) scores responses in chunks
(`scoring.py`), so no micro-batch ever holds its whole vocabulary-wide logits.

Nothing here knows about episodes, HTTP or files: it takes `TrainSample`s and returns
`UpdateStats`. Under torchrun every rank calls `update` with the whole batch and trains
on the task groups with `group % world_size == rank` through the FSDP2-sharded model,
whose backward reduce-scatters the gradients (FSDP's mean; each rank's loss is scaled
by the world size first, so the mean is the sum); metric sums are added up the same way,
and every rank then takes its part of the same optimizer step.

Whole groups make the ranks' micro-batch counts differ, while FSDP needs every rank to
run the same number of forward and backward passes (each gathers and reduces over all
ranks): the ranks agree on the largest count, and a rank with fewer runs zero-weight
micro-batches (a real forward and backward of the batch's shortest sample, loss times 0)
that add nothing. At the end of `update` the new weights are published to the
inference model (`TrainingModel.publish`). With one process there is no sharding and no
padding: plain local training.

The sampler-trainer gap. The old log-probs of the PPO ratio are the sampler's (recorded
with each completion), but the generator and the trainer compute them differently (bf16
kernels, batch shapes, the KV cache), so even on-policy the ratio is not exactly 1. At
each sample's first forward (epoch 0) the learner measures the gap, |trainer log p -
sampled log p| per token (its mean and max, and the share of tokens whose ratio against
the sampled log-probs lies outside the clip range), for the step's metrics. With
`recompute_old_logprobs` the ratio's old log-probs are the trainer's own instead: at epoch
0 `old = new.detach()` from the same forward (so the first epoch's ratio is exactly 1 and
nothing is clipped there), kept for the later epochs. That costs no extra forward pass,
only the kept log-probs (4 bytes per response token). The samples keep the sampled
log-probs either way; only the loss uses the trainer's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ajet.engine.config import EngineConfig
from ajet.engine.parallel.distributed import Dist, clip_grad_norm
from ajet.engine.loss import LossTerms, policy_loss
from ajet.engine.policy import Policy
from ajet.engine.scoring import pack_responses
from ajet.engine.parallel.training_model import TrainingModel, build_training_model

__all__ = ["Learner", "TrainSample", "UpdateStats", "micro_batches", "mini_batches"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSample:
    """One sequence to train on (a timeline of an episode), with its episode's advantage.

    `response_ids` runs from the first trained token to the end; `loss_mask` (None: all
    1) is off on the tokens in it the model did not sample (tool results, template
    tokens between the merged calls' replies), and `old_logprobs` is 0 there.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantage: float
    #: index of the episode's task group in the batch; ranks split the batch by group
    group: int = 0
    loss_mask: tuple[int, ...] | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def trained_tokens(self) -> int:
        """Tokens the loss counts (token-level normalisation counts each once)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


def mini_batches(samples: Sequence[TrainSample], count: int) -> list[list[TrainSample]]:
    """Split into at most `count` parts of whole task groups, in group order."""
    groups = sorted({s.group for s in samples})
    count = max(1, min(count, len(groups)))
    parts: list[list[TrainSample]] = []
    for i in range(count):  # group i * n // count ... as evenly as whole groups allow
        chosen = set(groups[i * len(groups) // count:(i + 1) * len(groups) // count])
        parts.append([s for s in samples if s.group in chosen])
    return parts


def micro_batches(samples: Sequence[TrainSample], token_budget: int) -> list[list[TrainSample]]:
    """Cut into micro-batches of at most `token_budget` padded tokens (rows x longest row).

    Samples are taken longest first, so rows of similar length share a micro-batch and
    little is padding; a sample longer than the budget gets a micro-batch of its own.
    """
    out: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    for sample in sorted(samples, key=lambda s: s.length, reverse=True):
        # longest first: the first row of a micro-batch is its widest
        if current and (len(current) + 1) * current[0].length > token_budget:
            out.append(current)
            current = []
        current.append(sample)
    if current:
        out.append(current)
    return out


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
    #: the publication of the new weights to the inference model (part of `seconds`)
    publish_time_s: float = 0.0
    #: bytes of full weights it produced, in the inference model's dtype
    publish_bytes: int = 0
    #: sampler-trainer gap at each sample's first forward: mean and max |delta log p|
    logprob_gap_mean: float = 0.0
    logprob_gap_max: float = 0.0
    #: share of tokens whose ratio against the sampled log-probs is outside the clip range
    logprob_gap_beyond_clip: float = 0.0
    #: share of tokens the loss clipped in the first epoch (0 with recompute_old_logprobs
    #: and one mini-batch)
    clip_frac_first_epoch: float = 0.0


class Learner:
    def __init__(self, policy: Policy, cfg: EngineConfig, dist: Dist | None = None) -> None:
        self.policy = policy
        self.cfg = cfg
        self.dist = dist or Dist()
        self.model: TrainingModel = build_training_model(policy, cfg, self.dist)
        self.optimizer = torch.optim.AdamW(self.model.params, lr=cfg.lr, betas=cfg.adam_betas,
                                           weight_decay=cfg.weight_decay)
        #: within one update: each sample's first-epoch trainer log-probs (by sample id),
        #: the ratio's old log-probs of the later epochs with recompute_old_logprobs
        self._first_forward: dict[int, torch.Tensor] = {}
        #: within one update: the gap's sums (|delta| sum, tokens, beyond clip) and max
        self._gap = [0.0, 0.0, 0.0]
        self._gap_max = 0.0

    def update(self, samples: Sequence[TrainSample]) -> UpdateStats:
        """Train on this rank's share of `samples` (the whole batch, same on every rank).

        Holds the policy lock so no token is sampled meanwhile, and publishes the new
        weights to the inference model before it returns.
        """
        start = time.perf_counter()
        samples = [s for s in samples if s.trained_tokens]
        n_tokens = sum(s.trained_tokens for s in samples)  # of the whole batch
        if not samples:
            return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, time.perf_counter() - start)
        dist, cfg = self.dist, self.cfg
        # a rank short of micro-batches repeats this one with weight 0 (see the docstring)
        filler = min(samples, key=lambda s: s.length)
        losses: list[float] = []
        kl_sum = entropy_sum = clipped = grad_norm = first_clipped = 0.0
        self._first_forward, self._gap, self._gap_max = {}, [0.0, 0.0, 0.0], 0.0
        with self.policy.lock:
            self.model.train()
            try:
                for epoch in range(cfg.ppo_epochs):
                    kl_sum = clipped = 0.0
                    for part in mini_batches(samples, cfg.mini_batch_num):
                        part_tokens = sum(s.trained_tokens for s in part)
                        mine = [s for s in part if s.group % dist.world_size == dist.rank]
                        micros = micro_batches(mine, cfg.micro_batch_tokens)
                        # every rank runs as many passes as the busiest one (FSDP collectives)
                        n_micro = dist.max_int(len(micros))
                        self.optimizer.zero_grad(set_to_none=True)
                        # local sums: loss (already / part_tokens), kl, entropy, clipped tokens
                        sums = [0.0, 0.0, 0.0, 0.0]
                        for index in range(n_micro):
                            real = index < len(micros)
                            terms, entropy = self._micro_batch(
                                micros[index] if real else [filler], part_tokens,
                                epoch=epoch if real else -1)
                            # x world_size: FSDP averages over the ranks, we want the sum
                            weight = float(dist.world_size) if real else 0.0
                            (terms.loss * weight).backward()
                            if not real:
                                continue
                            sums[0] += float(terms.loss.detach())
                            sums[1] += terms.kl_sum if cfg.kl_coef > 0 else terms.approx_kl_old_sum
                            sums[2] += entropy
                            sums[3] += terms.clipped_tokens
                        sums = dist.sum_floats(sums)
                        self.model.average_gradients()  # replicated (LoRA under torchrun)
                        grad_norm = clip_grad_norm(self.model.params, cfg.max_grad_norm)
                        self.optimizer.step()
                        losses.append(sums[0])
                        kl_sum += sums[1]
                        clipped += sums[3]
                        if epoch == 0:
                            entropy_sum += sums[2]
                            first_clipped += sums[3]
            finally:
                self.optimizer.zero_grad(set_to_none=True)
                self.model.train(False)
                self._first_forward = {}
            published = self.model.publish()
        gap_sum, gap_tokens, beyond = dist.sum_floats(self._gap)
        gap_max = max(dist.gather(self._gap_max))
        return UpdateStats(
            loss=sum(losses) / len(losses), kl=kl_sum / n_tokens, entropy=entropy_sum / n_tokens,
            clip_frac=clipped / n_tokens, grad_norm=grad_norm, tokens=n_tokens,
            samples=len(samples), seconds=time.perf_counter() - start,
            publish_time_s=published.seconds, publish_bytes=published.bytes,
            logprob_gap_mean=gap_sum / max(1.0, gap_tokens), logprob_gap_max=gap_max,
            logprob_gap_beyond_clip=beyond / max(1.0, gap_tokens),
            clip_frac_first_epoch=first_clipped / n_tokens)

    def _micro_batch(self, micro: Sequence[TrainSample], n_tokens: int, *, epoch: int = 0
                     ) -> tuple[LossTerms, float]:
        """Loss terms and entropy sum of one micro-batch; `epoch` -1 for a filler pass."""
        cfg, policy = self.cfg, self.policy
        batch = pack_responses([s.prompt_ids for s in micro], [s.response_ids for s in micro],
                               pad_id=policy.pad_id, device=policy.device,
                               masks=[s.loss_mask for s in micro])
        # the reference first: no graph of the training forward is pending meanwhile
        ref = self.model.reference_logprobs(batch, temperature=cfg.temperature) \
            if cfg.kl_coef > 0 else None
        logprobs, entropy = self.model.scorer(batch, temperature=cfg.temperature)  # (B, R)
        width = batch.mask.size(1)
        sampled = torch.zeros_like(logprobs)  # (B, R)
        for row, s in enumerate(micro):
            sampled[row, :len(s.old_logprobs)] = torch.tensor(s.old_logprobs[:width])
        old = self._old_logprobs(micro, logprobs, sampled, batch.mask, epoch=epoch)
        advantages = torch.tensor([s.advantage for s in micro], device=policy.device)  # (B,)
        terms = policy_loss(logprobs, old, advantages, batch.mask, clip_ratio=cfg.clip_ratio,
                            n_tokens=n_tokens, ref_logprobs=ref, kl_coef=cfg.kl_coef)
        return terms, float(entropy.detach().sum())

    def _old_logprobs(self, micro: Sequence[TrainSample], logprobs: torch.Tensor,
                      sampled: torch.Tensor, mask: torch.Tensor, *, epoch: int
                      ) -> torch.Tensor:
        """The ratio's old log-probs (B, R); at epoch 0 also adds up the sampler-trainer gap."""
        if epoch < 0:  # a filler pass: weight 0, measures nothing
            return sampled
        new = logprobs.detach()  # (B, R)
        if epoch == 0:
            with torch.no_grad():
                gap = (new - sampled).abs() * mask  # (B, R)
                beyond = ((new - sampled).exp() - 1.0).abs() > self.cfg.clip_ratio
                self._gap[0] += float(gap.sum())
                self._gap[1] += float(mask.sum())
                self._gap[2] += float((beyond.float() * mask).sum())
                self._gap_max = max(self._gap_max, float(gap.max()) if gap.numel() else 0.0)
        if not self.cfg.recompute_old_logprobs:
            return sampled
        if epoch == 0:  # the first forward of these samples: the ratio is exactly 1
            for row, s in enumerate(micro):
                self._first_forward[id(s)] = new[row].clone()
            return new
        old = torch.zeros_like(new)  # later epochs: the first epoch's log-probs
        for row, s in enumerate(micro):
            kept = self._first_forward[id(s)]
            n = min(kept.numel(), old.size(1))
            old[row, :n] = kept[:n]
        return old
