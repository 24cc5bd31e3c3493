"""The paged backend's on-device sampler: the distribution, truncation, greedy rows, and
noise that depends on the request only (its seed and token index), never on the batch."""

from __future__ import annotations

import torch

from ajet.engine.generation.interface import MIN_TEMPERATURE
from ajet.engine.generation.sampling import sample, uniform_noise


def _draw(logits: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0,
          top_k: int = 0, seeds: torch.Tensor, counter: int = 0,
          truncate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rows = logits.shape[0]
    return sample(logits, temperature=torch.full((rows,), temperature),
                  top_p=torch.full((rows,), top_p), top_k=torch.full((rows,), top_k),
                  seeds=seeds, counters=torch.full((rows,), counter), truncate=truncate)


def test_draws_follow_softmax_of_logits_over_temperature_and_log_probs_are_untruncated(
        ) -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    rows = 20_000
    tokens, logprobs = _draw(logits.expand(rows, 4), temperature=0.8,
                             seeds=torch.arange(rows))
    share = torch.bincount(tokens, minlength=4).float() / rows
    assert torch.allclose(share, torch.softmax(logits / 0.8, -1), atol=0.015)
    assert torch.allclose(logprobs, torch.log_softmax(logits / 0.8, -1)[tokens])
    # top-p 0.8 keeps two tokens (softmax 0.64, 0.24, ...: the mass before the third is
    # 0.88 >= 0.8)
    kept, lp = _draw(logits.expand(rows, 4), top_p=0.8, seeds=torch.arange(rows),
                     truncate=True)
    assert set(kept.tolist()) == {0, 1}
    assert torch.allclose(lp, torch.log_softmax(logits, -1)[kept])  # untruncated
    top1, _ = _draw(logits.expand(rows, 4), top_k=1, seeds=torch.arange(rows), truncate=True)
    assert set(top1.tolist()) == {0}


def test_greedy_rows_take_the_arg_max_and_others_in_the_same_batch_still_sample() -> None:
    logits = torch.tensor([[0.0, 0.1, 0.0]]).expand(4000, 3)
    temperature = torch.tensor([MIN_TEMPERATURE, 1.0]).repeat(2000)
    tokens, _ = sample(logits, temperature=temperature, top_p=torch.ones(4000),
                       top_k=torch.zeros(4000, dtype=torch.long), seeds=torch.arange(4000),
                       counters=torch.zeros(4000, dtype=torch.long), truncate=False)
    assert set(tokens[0::2].tolist()) == {1}
    assert set(tokens[1::2].tolist()) == {0, 1, 2}


def test_noise_is_a_function_of_seed_counter_and_token_only() -> None:
    seeds, counters = torch.tensor([7, 8, 7]), torch.tensor([0, 0, 1])
    noise = uniform_noise(seeds, counters, 1000)
    assert ((noise > 0) & (noise < 1)).all()
    assert torch.equal(uniform_noise(seeds[1:2], counters[1:2], 1000), noise[1:2])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert abs(noise.mean().item() - 0.5) < 0.02
