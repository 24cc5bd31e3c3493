"""Checkpoints: Hugging Face checkpoint directories in the run directory, plus resumable state.

`checkpoints/step_<n>/` every `save_every` steps and `final/` at stop. Each holds:

- full fine-tuning: a complete `save_pretrained` of model and tokenizer that
  `AutoModelForCausalLM.from_pretrained` loads (and that a later job can name as its
  `model`), in the compute dtype (bf16 on GPU, fp32 on CPU). Under FSDP2 the weights are
  gathered from the shards onto rank 0's host memory
  (`get_model_state_dict(..., full_state_dict=True, cpu_offload=True)`, `Dist.full_state_dict`).
- LoRA: the adapter (`adapter_model.safetensors`, `adapter_config.json` naming the base
  checkpoint) and the tokenizer; `from_pretrained` on the folder loads base + adapter
  (transformers' peft integration). With `lora_save_merged` also `merged/`, the base with
  the adapter merged in, a plain checkpoint.
- `training_state/`: the fp32 master weights (LoRA: the adapters only) and the AdamW
  state, sharded as they are trained, through `torch.distributed.checkpoint` (one file
  per rank; on several nodes the run directory must be on a shared file system for this
  folder to be whole). `load_training_state` restores it into a learner of the same
  world size or another one (DCP reshards on load).
- `ajet_checkpoint.json`: step, run id, source checkpoint, LoRA or not.

Written to `<name>.partial` and renamed by rank 0 once every rank is done, so a directory
without that suffix is always complete. `save_checkpoint` is collective: under torchrun
every rank calls it (the trainer sends followers a "save" command).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ajet.engine.learner import Learner

__all__ = ["TRAINING_STATE_DIR", "load_training_state", "save_checkpoint",
           "step_checkpoint_dir"]

log = logging.getLogger(__name__)

TRAINING_STATE_DIR = "training_state"


def step_checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


def save_checkpoint(learner: Learner, target: Path, *, step: int, run_id: str | None) -> Path:
    """Save model (or adapter), tokenizer and training state to `target` atomically."""
    dist, policy, cfg, model = learner.dist, learner.policy, learner.cfg, learner.model
    partial = target.with_name(target.name + ".partial")
    if dist.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()  # the folder exists before any rank writes its shard into it
    with policy.lock:
        # both collective: every rank gathers and writes its part
        state = dist.full_state_dict(model.lm)
        _save_training_state(learner, partial / TRAINING_STATE_DIR)
    if dist.is_main:
        compute = getattr(torch, cfg.dtype)
        if model.lora:
            from ajet.engine.parallel.lora import save_adapter, save_merged

            save_adapter(model.lm, state, partial, base_path=policy.path)  # type: ignore[arg-type]
            if cfg.lora_save_merged:
                save_merged(partial, partial / "merged", base_path=policy.path, dtype=compute)
        else:
            # the generation model's class and config; the weights are the trained masters
            policy.model.save_pretrained(
                partial, state_dict={k: v.to(compute) for k, v in state.items()},
                is_main_process=True)
        policy.tokenizer.save_pretrained(partial)
        (partial / "ajet_checkpoint.json").write_text(json.dumps(
            {"step": step, "run_id": run_id, "saved_at": time.time(),
             "source": str(policy.path), "lora": model.lora,
             "training_state": TRAINING_STATE_DIR, "world_size": dist.world_size}, indent=2))
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
        log.info("checkpoint for step %d saved to %s", step, target)
    del state
    dist.barrier()  # every rank returns once the checkpoint is complete
    return target


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that one process "assumes" one process, even with no_dist=True."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state_options(learner: Learner, *, loading: bool = False) -> StateDictOptions:
    # LoRA: the frozen base is the source checkpoint already; keep only what trains (and
    # on load do not ask for the base weights the state leaves out)
    lora = learner.model.lora
    return StateDictOptions(ignore_frozen_params=lora, strict=not (loading and lora))


def _save_training_state(learner: Learner, path: Path) -> None:
    model_state, optim_state = get_state_dict(learner.model.scorer, learner.optimizer,
                                              options=_state_options(learner))
    with _quiet_single_process():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=path,
                 no_dist=not learner.dist.active)


def load_training_state(learner: Learner, checkpoint: Path) -> None:
    """Restore master weights and optimizer state saved by `save_checkpoint` (collective).

    Publishes the restored weights to the inference model, like an update.
    """
    model_state, optim_state = get_state_dict(learner.model.scorer, learner.optimizer,
                                              options=_state_options(learner))
    state = {"model": model_state, "optimizer": optim_state}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=checkpoint / TRAINING_STATE_DIR,
                 no_dist=not learner.dist.active)
    set_state_dict(learner.model.scorer, learner.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   options=_state_options(learner, loading=True))
    with learner.policy.lock:
        learner.model.publish()
