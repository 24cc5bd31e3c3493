"""The trained model: precision, LoRA, activation checkpointing, FSDP2, and the way its
weights reach the inference model.

`build_training_model(policy, cfg, dist)` returns a `TrainingModel` whose `scorer` the
learner trains. How it relates to `policy.model` (the model generation uses, full
weights in the compute dtype, on every rank):

| case | trained weights | `policy.model` |
|---|---|---|
| one process, CPU (fp32) | `policy.model` itself | the same object: no copy, no sync |
| one process, GPU | a separate fp32 copy, bf16 autocast | bf16 copy, refreshed after each update |
| torchrun (FSDP2) | fp32, sharded over the ranks, bf16 compute on GPUs | a full copy on every rank, refreshed after each update |

The refresh is `TrainingModel.publish()` (`distributed.copy_full_weights`), called by the
learner at the end of every update on every rank: each shard is cast to the inference
copy's dtype (bf16 on GPUs) before it is gathered, and parameters are gathered in
buckets of about `PUBLISH_BUCKET_BYTES`, one all-gather each; with LoRA only the adapters
are copied (the base never changes). Its time and bytes are the step metrics'
`publish_time_s` and `publish_bytes`. Memory per rank under FSDP2: the inference copy
(`2 x params` bytes in bf16) plus the shards of the trained model (`16 x params / N`:
fp32 weights, gradients and AdamW's two moments), plus one bucket (and one parameter
being unpacked) while a refresh runs.

With LoRA (`cfg.lora_rank > 0`) both models get the same adapters (`lora.apply_lora`,
seeded) and only the adapters train. The KL reference (`kl_coef > 0`) is the trained
model with its adapters disabled; without LoRA it is a frozen copy of the checkpoint in
the compute dtype, sharded like the trained model under torchrun.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ajet.engine.config import EngineConfig
from ajet.engine.parallel.distributed import Dist, Publication, copy_full_weights
from ajet.engine.policy import Policy
from ajet.engine.scoring import ResponseBatch, ResponseScorer

__all__ = ["TrainingModel", "build_training_model", "load_causal_lm"]

log = logging.getLogger(__name__)


def load_causal_lm(path: Path, *, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device)


@dataclass
class TrainingModel:
    #: forward(batch) -> (logprobs, entropy); the FSDP2 root under torchrun
    scorer: ResponseScorer
    #: the trainable parameters (sharded `DTensor`s under FSDP2)
    params: list[nn.Parameter]
    #: this rank's generation model (`policy.model`)
    inference: nn.Module | None
    #: frozen initial policy for the KL term (full fine-tuning with kl_coef > 0)
    reference: ResponseScorer | None
    lora: bool

    @property
    def lm(self) -> nn.Module:
        """The trained causal LM (a `PeftModel` with LoRA)."""
        return self.scorer.lm

    @property
    def hf_model(self) -> nn.Module:
        """The trained Hugging Face model, whose parameter names match `policy.model`'s."""
        lm: Any = self.scorer.lm
        return lm.get_base_model() if self.lora else lm

    def reference_logprobs(self, batch: ResponseBatch, *, temperature: float
                           ) -> torch.Tensor | None:
        """Log-probs under the initial policy (no gradient), or None without a reference."""
        if self.reference is None and not self.lora:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return self.reference(batch, temperature=temperature)[0]
            with self._adapters_off():
                return self.scorer(batch, temperature=temperature)[0]

    def _adapters_off(self) -> contextlib.AbstractContextManager[object]:
        lm: Any = self.scorer.lm
        return lm.disable_adapter()  # type: ignore[no-any-return]

    def publish(self) -> Publication:
        """Copy the trained weights into the inference model; every rank calls it.

        Each weight is gathered in the inference copy's dtype (bf16 on GPUs: the fp32
        shards are cast before the all-gather), in buckets (`copy_full_weights`).
        """
        return copy_full_weights(self.hf_model, self.inference, trainable_only=self.lora)

    def train(self, mode: bool = True) -> None:
        self.scorer.train(mode)


def build_training_model(policy: Policy, cfg: EngineConfig, dist: Dist) -> TrainingModel:
    """See the module docstring. Every rank calls it at the same point (FSDP2 collectives)."""
    compute, master = getattr(torch, cfg.dtype), getattr(torch, cfg.master_dtype)
    # the generation model is trained directly when nothing differs: one process, one dtype
    shared = not dist.active and compute == master
    if shared:
        lm: nn.Module = policy.model
    else:
        # under FSDP2 each rank reads the checkpoint into host memory and keeps its shard
        # on the device (fully_shard moves it); one process loads it onto the device
        lm = load_causal_lm(policy.path, dtype=master,
                            device="cpu" if dist.active else policy.device)
    if cfg.lora:
        from ajet.engine.parallel.lora import apply_lora

        lora_args = dict(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                         target_modules=cfg.lora_target_modules, seed=cfg.seed)
        lm = apply_lora(lm, **lora_args)
        if not shared:
            apply_lora(policy.model, **lora_args)  # same structure; weights come by publish
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(lm)
    scorer = ResponseScorer(lm, chunk_tokens=cfg.logprob_chunk_tokens,
                            autocast_dtype=compute if not shared and not dist.active else None)
    layers = list(lm.get_decoder().layers)  # type: ignore[operator, union-attr]
    dist.shard(scorer, layers, param_dtype=compute if compute != master else None)
    reference = None
    if cfg.kl_coef > 0 and not cfg.lora:
        ref_lm = load_causal_lm(policy.path, dtype=compute,
                                device="cpu" if dist.active else policy.device).eval()
        ref_lm.requires_grad_(False)
        reference = ResponseScorer(ref_lm, chunk_tokens=cfg.logprob_chunk_tokens)
        dist.shard(reference, list(ref_lm.get_decoder().layers))  # type: ignore[operator]
    scorer.eval()
    model = TrainingModel(scorer=scorer, params=[p for p in scorer.parameters() if p.requires_grad],
                          inference=policy.model, reference=reference, lora=cfg.lora)
    model.publish()  # the inference copy starts from exactly the trained weights
    log.info("training model: %s, %s master weights, %s compute, activation checkpointing %s, "
             "%d trainable parameters%s", "FSDP2 over %d ranks" % dist.world_size
             if dist.active else "one process", cfg.master_dtype, cfg.dtype,
             "on" if cfg.activation_checkpointing else "off",
             sum(p.numel() for p in model.params), "" if shared else
             "; generation uses its own full copy")
    return model


def enable_activation_checkpointing(lm: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward pass, non-reentrant (it works with
    frozen inputs, as LoRA's, and with FSDP2's hooks). transformers 5.2x names it
    `activation_checkpointing_enable`; earlier releases (5.17 among them) only
    `gradient_checkpointing_enable`."""
    enable = getattr(lm, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
