"""LoRA through `peft`, driven by the job's `lora_rank`, `lora_alpha`, `lora_target_modules`.

With `lora_rank > 0` every target module gets a low-rank adapter, `W x + (alpha / r) B A x`
(Hu et al. 2021; B starts at zero, so the adapted model starts as the base model), and
only A and B train: the base weights are frozen, so gradients and AdamW state exist only
for the adapters. No dropout on the adapters (RL updates are already noisy). The KL
reference is the same model with its adapters switched off (`disable_adapter()`), not a
second copy of the base. `target_modules="all-linear"` is peft's: every linear layer
except the output head.

Checkpoints hold the adapter (`adapter_model.safetensors` + `adapter_config.json`, which
`AutoModelForCausalLM.from_pretrained` loads on top of the base named in the config, or
`PeftModel.from_pretrained`) and, with `lora_save_merged`, the base with the adapter
merged in, a plain checkpoint under `merged/`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

__all__ = ["apply_lora", "save_adapter", "save_merged"]

log = logging.getLogger(__name__)


def apply_lora(model: nn.Module, *, rank: int, alpha: int,
               target_modules: str | tuple[str, ...], seed: int) -> PeftModel:
    """Inject adapters into `model` (in place) and return the `PeftModel` around it.

    Seeded, so that every rank (and the inference copy) starts from the same adapters.
    """
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                        target_modules=list(target_modules) if isinstance(target_modules, tuple)
                        else target_modules, task_type="CAUSAL_LM")
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info("LoRA rank %d, alpha %d on %s: %d of %d parameters train", rank, alpha,
             target_modules, trainable, total)
    return peft_model


def save_adapter(lm: PeftModel, state_dict: dict[str, torch.Tensor], target: Path, *,
                 base_path: Path) -> None:
    """Write the adapter out of a full `state_dict` of `lm` (keys as `lm.state_dict()`)."""
    lm.peft_config["default"].base_model_name_or_path = str(base_path)
    lm.save_pretrained(str(target), state_dict=state_dict)


def save_merged(adapter_dir: Path, target: Path, *, base_path: Path, dtype: torch.dtype) -> None:
    """Load the base on CPU, merge the adapter saved in `adapter_dir` into it, save it."""
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype, local_files_only=True)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(target)
