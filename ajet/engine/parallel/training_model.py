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
| LoRA, any of these | fp32 adapters on `policy.model`'s frozen base | the same object: one base, in the compute dtype |

LoRA trains its adapters on the generation model itself: the frozen base is held once
per rank, in the compute dtype (bf16 on GPUs: 2 bytes per parameter instead of a 4-byte
fp32 master plus the 2-byte generation copy), replicated on every rank rather than
sharded (it never changes, so there is nothing to reduce or publish), and only the
adapters and their gradients and AdamW moments are fp32 (peft casts adapters of a bf16
base to fp32). Under torchrun each rank's adapter gradients are averaged before the
optimizer step (`average_gradients`), so every rank takes the same step and the
adapters stay identical without a publication.

The refresh is `TrainingModel.publish()` (`distributed.copy_full_weights`), called by the
learner at the end of every update on every rank: each shard is cast to the inference
copy's dtype (bf16 on GPUs) before it is gathered, and parameters are gathered in
buckets of about `PUBLISH_BUCKET_BYTES`, one all-gather each; with LoRA only the adapters
are copied (the base never changes). Its time and bytes are the step metrics'
`publish_time_s` and `publish_bytes`. Memory per rank under FSDP2: the inference copy
(`2 x params` bytes in bf16) plus the shards of the trained model (`16 x params / N`:
fp32 weights, gradients and AdamW's two moments), plus one bucket (and one parameter
being unpacked) while a refresh runs.

Under FSDP2 the trained copy (and the KL reference) is built on the meta device, sharded,
and only then given memory (`to_empty`) and filled from `policy.model`, one tensor at a
time, each rank keeping its slice (`_fill_from`): no rank ever holds a second whole copy,
in host or device memory. `policy.model` itself is loaded straight onto the device
(`policy.load_policy`), so a node's host memory at boot is about one copy of the
checkpoint (the page cache of its files), not one per rank. A checkpoint stored more
precisely than the compute dtype (fp32 on disk, bf16 compute) is read from disk instead,
so the fp32 masters keep its precision.

With LoRA (`cfg.lora_rank > 0`) the one model gets adapters (`lora.apply_lora`, seeded,
so every rank starts from the same ones) and only the adapters train. The KL reference
(`kl_coef > 0`) is the trained model with its adapters disabled; without LoRA it is a
frozen copy of the checkpoint in the compute dtype, sharded like the trained model under
torchrun.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig, AutoModelForCausalLM

from ajet.engine.config import EngineConfig
from ajet.engine.parallel.distributed import (
    Dist,
    Publication,
    average_over_ranks,
    copy_full_weights,
)
from ajet.engine.policy import Policy
from ajet.engine.scoring import ResponseBatch, ResponseScorer

__all__ = ["TrainingModel", "build_training_model", "load_causal_lm"]

log = logging.getLogger(__name__)


def load_causal_lm(path: Path, *, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model.to(device)


def _second_copy(policy: Policy, dtype: torch.dtype, dist: Dist) -> tuple[nn.Module, bool]:
    """Another model of the policy's architecture in `dtype`, and whether it is still
    empty (on the meta device: `_fill_from` gives it the policy's weights once sharded)."""
    stored = _stored_dtype(policy.path)
    exact = stored in (None, policy.model.dtype) or (
        stored.itemsize <= policy.model.dtype.itemsize)
    if not dist.active or not exact:
        if dist.active:
            log.warning("the checkpoint is stored in %s, more precisely than the %s compute "
                        "dtype: every rank reads it into host memory for the fp32 masters",
                        stored, policy.model.dtype)
        return load_causal_lm(policy.path, dtype=dtype,
                              device="cpu" if dist.active else policy.device), False
    config = AutoConfig.from_pretrained(policy.path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype), True


def _stored_dtype(path: Path) -> torch.dtype | None:
    """The dtype the checkpoint's weights are stored in (its config.json), if it says."""
    import json

    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


@torch.no_grad()
def _fill_from(model: nn.Module, source: nn.Module, device: torch.device) -> None:
    """Give a sharded meta-device `model` memory and `source`'s weights (by name), one
    tensor at a time: each full tensor is cast on the device and sliced locally into
    this rank's shard (no collective: every rank has the same source)."""
    model.to_empty(device=device)
    params, buffers = dict(source.named_parameters()), dict(source.named_buffers())
    for name, param in model.named_parameters():
        full = params[name].detach().to(device=device, dtype=param.dtype)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements,
                                      src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)
        del full
    for name, buffer in model.named_buffers():  # rotary frequencies, never in a state dict
        if name in buffers:
            buffer.copy_(buffers[name].to(buffer.dtype))


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
    #: trained the same on every rank, not sharded: gradients are averaged by hand
    replicated: bool = False

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

    def average_gradients(self) -> None:
        """Replicated training under torchrun: every rank's gradients become their mean
        over the ranks (what FSDP's reduce-scatter does for a sharded model). Every rank
        calls it after the backward passes of an optimizer step; a no-op otherwise."""
        if not self.replicated:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = []
        for p in self.params:
            if p.grad is None:  # every rank must send the same layout
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = _flatten_dense_tensors(grads)  # one collective for all adapters
        average_over_ranks(flat)
        for grad, mean in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(mean)

    def train(self, mode: bool = True) -> None:
        self.scorer.train(mode)


def build_training_model(policy: Policy, cfg: EngineConfig, dist: Dist) -> TrainingModel:
    """See the module docstring. Every rank calls it at the same point (FSDP2 collectives)."""
    compute, master = getattr(torch, cfg.dtype), getattr(torch, cfg.master_dtype)
    # the generation model is trained directly when nothing differs (one process, one
    # dtype), and always with LoRA: the base is frozen, only the fp32 adapters train
    shared = cfg.lora or (not dist.active and compute == master)
    empty = False
    if shared:
        lm: nn.Module = policy.model
    else:
        # under FSDP2: empty (meta) until sharded, then filled from the policy's weights
        lm, empty = _second_copy(policy, master, dist)
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
    replicated = cfg.lora and dist.active  # the frozen base is never sharded
    if not replicated:
        dist.shard(scorer, layers, param_dtype=compute if compute != master else None)
    if empty:
        _fill_from(lm, policy.model, policy.device)
    reference = None
    if cfg.kl_coef > 0 and not cfg.lora:
        ref_lm, ref_empty = _second_copy(policy, compute, dist)
        ref_lm.eval()
        ref_lm.requires_grad_(False)
        reference = ResponseScorer(ref_lm, chunk_tokens=cfg.logprob_chunk_tokens)
        dist.shard(reference, list(ref_lm.get_decoder().layers))  # type: ignore[operator]
        if ref_empty:
            _fill_from(ref_lm, policy.model, policy.device)
    scorer.eval()
    model = TrainingModel(scorer=scorer, params=[p for p in scorer.parameters() if p.requires_grad],
                          inference=policy.model, reference=reference, lora=cfg.lora,
                          replicated=replicated)
    model.publish()  # the inference copy starts from exactly the trained weights
    log.info("training model: %s, %s master weights, %s compute, activation checkpointing %s, "
             "%d trainable parameters%s", ("replicated over %d ranks" if replicated
                                            else "FSDP2 over %d ranks") % dist.world_size
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
