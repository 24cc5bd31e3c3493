"""On-device sampling for the paged backend: one token per row, with its log-prob.

What it implements, for logits (B, V) and per-row settings:

- temperature: the distribution is softmax(logits / T); T at or below
  `interface.MIN_TEMPERATURE` is greedy and takes the arg-max exactly;
- top-k (0 = off) and top-p (1 = off) truncate it, with the rule `policy.sample_tokens`
  uses: a token is dropped once the mass before it already reaches top_p. Truncation
  needs a sort over the vocabulary; `truncate=False` leaves the sort out, so a CUDA
  graph captured for rows that all have top_p = 1 and top_k = 0 never pays for it;
- the draw is Gumbel-max: arg-max of (scores + Gumbel noise), which samples exactly from
  softmax(scores). The noise is counter-based, a hash of (the request's seed, the
  request's token index, the vocabulary id), so a request's tokens depend on its own
  logits only, never on which requests share its batch or on the order they joined.
  The hash is plain integer arithmetic on tensors: no generator state, nothing a CUDA
  graph would have to capture or advance;
- the recorded log-prob is the engine's convention (`policy`, `scoring`): log
  softmax(logits / T) of the token, untruncated, which is what the trainer computes.
"""

from __future__ import annotations

import torch

from ajet.engine.generation.interface import MIN_TEMPERATURE

__all__ = ["sample", "uniform_noise"]

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a product with a 32-bit value stays under 2**63, so the
# int64 arithmetic never overflows on any device.
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_MUL_VOCAB = 0x632BE5AB
#: greedy rows: at most this temperature (a little above MIN_TEMPERATURE for rounding)
_GREEDY_T = MIN_TEMPERATURE * 1.0001


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds), on int64 values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, V) float32 uniforms in (0, 1), a function of (seed, counter, vocab id) only."""
    row = _mix32((seeds.long() & _MASK32) ^ _mix32(counters.long() & _MASK32))  # (B,)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64) * _MUL_VOCAB  # (V,)
    # one round over (B, V): the row's key is already a full hash, and this is the step's
    # widest elementwise work (about 12 passes over B x V int64 values)
    bits = _mix32((row[:, None] + ids[None, :]) & _MASK32)  # (B, V)
    # the top 24 bits, centred in their interval: never exactly 0 or 1
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, *, temperature: torch.Tensor, top_p: torch.Tensor,
           top_k: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
           truncate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (B,) int64 and their log-probs (B,) float32; see the module docstring."""
    scaled = logits.float() / temperature.float()[:, None]  # (B, V)
    logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V)
    scores = scaled
    if truncate:
        sorted_scores, order = scaled.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_scores.softmax(dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p.float()[:, None]
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        drop |= (top_k[:, None] > 0) & (rank[None, :] >= top_k[:, None])
        sorted_scores = sorted_scores.masked_fill(drop, -float("inf"))
        scores = torch.empty_like(scaled).scatter_(-1, order, sorted_scores)
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, counters, scaled.shape[-1])))
    tokens = (scores + gumbel).argmax(dim=-1)  # (B,)
    tokens = torch.where(temperature <= _GREEDY_T, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
