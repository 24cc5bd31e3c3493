"""Scoring responses for the update: per-token log-probs and entropy, in chunks.

The update needs, for every response token, `log softmax(logits / T)` at that token,
and (for the metrics) the entropy of the same distribution. Computing them from the
model's full `(B, T, V)` logits keeps a vocabulary-wide tensor per position alive for
backward, in fp32 as well: for 16 x 2k tokens of a 152k-vocabulary model that alone is
~20 GB per copy. Here instead:

- the decoder runs once and only its last hidden states at the response positions are
  kept, `(B, R, H)`;
- the output head, the fp32 cast, the log-softmax and the entropy run over chunks of
  about `chunk_tokens` response tokens each, every chunk under activation checkpointing,
  so backward recomputes that chunk's logits instead of storing them: at any time at
  most one chunk's `(B, C, V)` logits exist, and none is kept between forward and
  backward.

`ResponseScorer` is an `nn.Module` whose `forward` does all of this, so that under FSDP2
it is the root module (`fully_shard` gathers the head and embeddings around its forward
and backward); with one process it is a thin wrapper that owns no parameter of its own.
It assumes, as Qwen2, Llama and Mistral do, that logits are `lm_head(last_hidden)`
(no final soft-capping or scaling); `tests/ajet/engine/test_policy.py` checks it against
the model's own logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["ResponseBatch", "ResponseScorer", "pack_responses", "score_responses"]


@dataclass
class ResponseBatch:
    """Right-padded prompt + response rows and where each response token sits."""

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    #: position whose logits predict response token r (its index minus one)  (B, R)
    gather_at: torch.Tensor
    targets: torch.Tensor  # (B, R) the response tokens
    mask: torch.Tensor  # (B, R) float, 1 on the response tokens trained (loss mask)


def pack_responses(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                   pad_id: int, device: torch.device,
                   masks: Sequence[Sequence[int] | None] | None = None) -> ResponseBatch:
    """Rows of prompt + response; `masks` (one per row, None: all 1) marks the response
    tokens that count (a merged timeline's tool results and template tokens do not)."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    resp_width = max(1, max(len(r) for r in responses))
    batch = len(prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((batch, width), dtype=torch.long)  # (B, T), right padding
    gather_at = torch.zeros((batch, resp_width), dtype=torch.long)  # (B, R)
    targets = torch.full((batch, resp_width), pad_id, dtype=torch.long)  # (B, R)
    mask = torch.zeros((batch, resp_width), dtype=torch.float32)  # (B, R)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        seq = [*prompt, *response]
        input_ids[row, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[row, :len(seq)] = 1
        n = len(response)
        # the logits at position t predict token t + 1
        gather_at[row, :n] = torch.arange(len(prompt) - 1, len(prompt) - 1 + n)
        targets[row, :n] = torch.tensor(list(response), dtype=torch.long)
        row_mask = masks[row] if masks is not None else None
        if row_mask is None:
            mask[row, :n] = 1.0
        else:
            mask[row, :n] = torch.tensor(list(row_mask), dtype=torch.float32)
    return ResponseBatch(input_ids.to(device), attention.to(device), gather_at.to(device),
                         targets.to(device), mask.to(device))


def _chunk_scores(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                  temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target and the entropy, for one chunk. hidden (B, C, H)."""
    logits = head(hidden).float() / temperature  # (B, C, V), fp32 for the softmax
    logp_all = F.log_softmax(logits, dim=-1)  # (B, C, V)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, C)
    with torch.no_grad():  # entropy is a metric: no gradient, nothing kept for it
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, C)
    return logp, entropy


class ResponseScorer(nn.Module):
    """`forward(batch)` -> `(logprobs, entropy)`, each (B, R), masked; see the module doc."""

    def __init__(self, lm: nn.Module, *, chunk_tokens: int = 1024,
                 autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = max(1, chunk_tokens)
        #: bf16 compute with fp32 weights on one GPU (under FSDP2 the mixed-precision
        #: policy casts instead, and on CPU everything is fp32): None = no autocast
        self.autocast_dtype = autocast_dtype

    def forward(self, batch: ResponseBatch, *, temperature: float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        with self._compute():
            decoder = self.lm.get_decoder()
            hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                             use_cache=False).last_hidden_state  # (B, T, H)
            index = batch.gather_at.unsqueeze(-1).expand(-1, -1, hidden.size(-1))  # (B, R, H)
            picked = hidden.gather(1, index)  # (B, R, H)
            head = self.lm.get_output_embeddings()
            rows, width = batch.targets.shape
            step = max(1, self.chunk_tokens // max(1, rows))  # positions per chunk
            logps, entropies = [], []
            for start in range(0, width, step):
                part = slice(start, start + step)
                if torch.is_grad_enabled():
                    # recompute this chunk's logits in backward instead of keeping them
                    logp, entropy = checkpoint(_chunk_scores, head, picked[:, part],
                                               batch.targets[:, part], temperature,
                                               use_reentrant=False)
                else:
                    logp, entropy = _chunk_scores(head, picked[:, part], batch.targets[:, part],
                                                  temperature)
                logps.append(logp)
                entropies.append(entropy)
        logprobs = torch.cat(logps, dim=1) * batch.mask  # (B, R)
        entropy = torch.cat(entropies, dim=1) * batch.mask  # (B, R)
        return logprobs, entropy

    def _compute(self) -> contextlib.AbstractContextManager[object]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(self.lm.parameters()).device.type
        return torch.autocast(device, dtype=self.autocast_dtype)


def score_responses(model: nn.Module, prompts: list[list[int]], responses: list[list[int]], *,
                    pad_id: int, temperature: float, device: torch.device,
                    chunk_tokens: int = 1024
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs of each response token given its prompt under softmax(logits / T).

    `model` is a causal LM or a `ResponseScorer`. Returns `(logprobs, mask, entropy)`,
    each (B, R) with R the longest response; `mask` is 1 on real response tokens.
    Gradients flow through `logprobs` when grad mode is on.
    """
    scorer = model if isinstance(model, ResponseScorer) else ResponseScorer(
        model, chunk_tokens=chunk_tokens)
    batch = pack_responses(prompts, responses, pad_id=pad_id, device=device)
    logprobs, entropy = scorer(batch, temperature=temperature)
    return logprobs, batch.mask, entropy
