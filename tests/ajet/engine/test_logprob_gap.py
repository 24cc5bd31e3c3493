"""The sampler-trainer gap: measured at each sample's first forward, and removed from the
ratio with `recompute_old_logprobs` (ajet-tiny, CPU, fp32)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import EngineConfig, engine_config_from_job
from ajet.engine.learner import Learner, TrainSample
from ajet.engine.policy import Policy, load_policy, score_responses
from ajet.engine.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("work"), seed=0)


def _learner(model_path: Path, **changes: object) -> Learner:
    cfg: EngineConfig = engine_config_from_job(AgentJetJob(lr=0.01, ppo_epochs=2),
                                               cuda_devices=0, cpu_count=1)
    policy = load_policy(model_path, device="cpu", dtype="float32", seed=0)
    return Learner(policy, dataclasses.replace(cfg, **changes))


def _samples(policy: Policy) -> tuple[list[TrainSample], list[list[float]]]:
    """Two samples whose recorded log-probs are the trainer's, shifted: all tokens by
    -0.1 and one token by -0.5 (exp(0.5) - 1 = 0.65, beyond the 0.2 clip)."""
    prompt = tuple(policy.render_chat([{"role": "user", "content": "digits?"}]))
    replies = [tuple(policy.tokenizer(t, add_special_tokens=False)["input_ids"])
               for t in ("12345", "abcde")]
    with torch.no_grad():
        lp, _, _ = score_responses(policy.model, [list(prompt)] * 2, [list(r) for r in replies],
                                   pad_id=policy.pad_id, temperature=1.0, device=policy.device)
    true = [lp[i, :len(r)].tolist() for i, r in enumerate(replies)]
    shifted = [[v - 0.1 for v in row] for row in true]
    shifted[1][2] = true[1][2] - 0.5
    samples = [TrainSample(prompt, r, tuple(s), adv)
               for r, s, adv in zip(replies, shifted, (1.0, -1.0), strict=True)]
    return samples, true


def test_the_gap_is_measured_on_every_update(model_path: Path) -> None:
    learner = _learner(model_path, recompute_old_logprobs=False)
    samples, _ = _samples(learner.policy)
    stats = learner.update(samples)
    assert stats.logprob_gap_mean == pytest.approx((9 * 0.1 + 0.5) / 10, abs=1e-4)
    assert stats.logprob_gap_max == pytest.approx(0.5, abs=1e-4)
    assert stats.logprob_gap_beyond_clip == pytest.approx(0.1)  # 1 token of 10
    # the ratio against the sampled log-probs is exp(0.1) = 1.105 and exp(0.5) = 1.65:
    # the -1 advantage clips the latter
    assert stats.clip_frac_first_epoch == pytest.approx(0.1)


def test_recompute_makes_the_first_epoch_ratio_exactly_one(model_path: Path) -> None:
    learner = _learner(model_path, recompute_old_logprobs=True, ppo_epochs=1)
    samples, _ = _samples(learner.policy)
    recorded = [s.old_logprobs for s in samples]
    stats = learner.update(samples)
    # ratio 1: pg = -A per token, five tokens of +1 and five of -1 -> loss 0
    assert stats.loss == pytest.approx(0.0, abs=1e-7)
    assert stats.clip_frac_first_epoch == 0.0 and stats.kl == pytest.approx(0.0, abs=1e-9)
    assert stats.logprob_gap_max == pytest.approx(0.5, abs=1e-4)  # still measured
    assert [s.old_logprobs for s in samples] == recorded  # the samples keep what was sampled

    sampler = _learner(model_path, recompute_old_logprobs=False, ppo_epochs=1)
    samples, _ = _samples(sampler.policy)
    assert not math.isclose(sampler.update(samples).loss, 0.0, abs_tol=1e-4)


def test_later_epochs_use_the_first_epochs_logprobs(model_path: Path) -> None:
    # a tiny step: the second epoch's policy is almost the first's
    learner = _learner(model_path, recompute_old_logprobs=True, ppo_epochs=2, lr=1e-6)
    samples, _ = _samples(learner.policy)
    kl = learner.update(samples).kl  # k3 of the last epoch's ratio
    assert 0.0 < kl < 1e-4  # against the first epoch's log-probs: the step only
    sampler = _learner(model_path, recompute_old_logprobs=False, ppo_epochs=2, lr=1e-6)
    samples, _ = _samples(sampler.policy)
    # against the sampled ones: the shift, (9 * k3(0.1) + k3(0.5)) / 10
    k3 = [math.exp(d) - 1 - d for d in (0.1, 0.5)]
    assert sampler.update(samples).kl == pytest.approx((9 * k3[0] + k3[1]) / 10, rel=1e-2)


def test_recompute_defaults_on_for_bf16_training() -> None:
    job = AgentJetJob()
    assert not engine_config_from_job(job, cuda_devices=0, cpu_count=1).recompute_old_logprobs
    on_gpu = engine_config_from_job(AgentJetJob(n_gpu=1), cuda_devices=1, cpu_count=1)
    assert on_gpu.dtype == "bfloat16" and on_gpu.recompute_old_logprobs
    off = engine_config_from_job(AgentJetJob(n_gpu=1, recompute_old_logprobs=False),
                                 cuda_devices=1, cpu_count=1)
    assert not off.recompute_old_logprobs
