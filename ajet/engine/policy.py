"""The policy: a Hugging Face causal LM and its tokenizer, plus the two tensor routines
the engine needs from it, sampling one token with its log-prob and scoring responses.

`model` in the job is either `ajet-tiny` (built locally by `tiny.py`) or a local
checkpoint directory such as `/mnt/models/Qwen2.5-7B-Instruct`; both are loaded by
`AutoModelForCausalLM` / `AutoTokenizer`. `Policy.model` is the model generation runs,
in the compute dtype: fp32 on CPU, bf16 on GPU. The update trains fp32 master weights
(`parallel/training_model.py`) and publishes them into it after every step; `score_responses`
(chunked log-probs, `scoring.py`) is re-exported here.

Log-probs are those of the temperature-scaled distribution `softmax(logits / T)`, both
when sampling and when training, so the ratio in the loss compares like with like.
With `top_p < 1` the token is drawn from the nucleus but its recorded log-prob is the
untruncated one (as in verl); with the default `top_p = 1` the two coincide.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ajet.engine.scoring import score_responses
from ajet.engine.tiny import TINY_MODEL_NAME, ensure_tiny_model

__all__ = ["Policy", "load_policy", "resolve_model_path", "sample_tokens", "score_responses"]

log = logging.getLogger(__name__)


@dataclass
class Policy:
    """A loaded model and tokenizer. `lock` serialises generation against the update."""

    model: PreTrainedModel
    tokenizer: Any
    path: Path
    device: torch.device
    eos_ids: frozenset[int]
    pad_id: int
    max_positions: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def render_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of the chat template applied to `messages`, ready for the reply."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def resolve_model_path(model: str, *, workdir: Path, seed: int) -> Path:
    """`ajet-tiny` -> its built checkpoint; anything else must be a checkpoint directory."""
    if model == TINY_MODEL_NAME:
        return ensure_tiny_model(workdir, seed=seed)
    path = Path(model).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is neither '{TINY_MODEL_NAME}' nor a Hugging Face checkpoint "
            "directory with config.json on the engine's machine; set `model` in the job to a "
            "local checkpoint path"
        )
    return path


def load_policy(path: Path, *, device: str, dtype: str, seed: int) -> Policy:
    """Load tokenizer and model from a checkpoint directory (no network access)."""
    torch_dtype = getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    dev = torch.device(device)
    # on a GPU straight onto the device, tensor by tensor from the (memory-mapped) files:
    # the host holds no copy per rank, only the page cache the node's ranks share
    placement = {"device_map": {"": dev}} if dev.type == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                 **placement)
    model.to(dev)
    model.eval()
    eos: set[int] = set()
    for candidate in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id",
                                                      None)):
        if isinstance(candidate, int):
            eos.add(candidate)
        elif isinstance(candidate, list):
            eos.update(int(c) for c in candidate)
    if not eos:
        raise ValueError(f"checkpoint {path} defines no eos token; set eos_token in its tokenizer")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
    torch.manual_seed(seed)
    policy = Policy(model=model, tokenizer=tokenizer, path=Path(path), device=dev,
                    eos_ids=frozenset(eos), pad_id=int(pad), max_positions=max_positions)
    log.info("policy loaded from %s: %s, %d parameters, %s %s", path, type(model).__name__,
             policy.parameter_count(), device, dtype)
    return policy


@torch.no_grad()
def sample_tokens(policy: Policy, sequences: list[list[int]], *, temperature: float,
                  top_p: float, generator: torch.Generator | None = None
                  ) -> tuple[list[int], list[float]]:
    """One decoding step for a batch of token sequences of any lengths.

    Recomputes each prefix (no KV cache): for short episodes on a small model the step
    is dominated by per-call overhead, and it lets requests join between tokens.
    Returns the sampled token of each row and its log-prob under softmax(logits / T).
    """
    width = max(len(s) for s in sequences)
    batch = len(sequences)
    input_ids = torch.full((batch, width), policy.pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros((batch, width), dtype=torch.long)  # (B, T)
    for row, seq in enumerate(sequences):  # left padding: the last column is the next position
        input_ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention[row, width - len(seq):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    out = policy.model(input_ids=input_ids.to(policy.device),
                       attention_mask=attention.to(policy.device),
                       position_ids=positions.to(policy.device), use_cache=False)
    logits = out.logits[:, -1, :].float() / temperature  # (B, V)
    logprobs = F.log_softmax(logits, dim=-1)  # (B, V)
    probs = logprobs.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # drop a token once the mass before it already reaches top_p (keeps at least one)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B,)
    return tokens.tolist(), chosen.tolist()
