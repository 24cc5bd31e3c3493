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
- `rng/rank_<r>.pt`: each rank's random state (torch CPU and CUDA, Python's `random`).
- `ajet_checkpoint.json`: step, run id, source checkpoint, LoRA or not.

`resume_training` restores a checkpoint into a fresh learner for a run that continues
an earlier one (the job's `resume_from`): master weights and AdamW state (then the
inference copy, as after an update), the random state, and the step, from which the new
run counts on. The episodes themselves come from the rollout clients: the order of the
tasks is theirs; what the engine owns of the data order is its sampling, whose seed
follows the step (`generation_seed`), so a resumed run does not replay the draws of
the run's first steps.

Written to `<name>.partial` and renamed by rank 0 once every rank is done, so a directory
without that suffix is always complete. `save_checkpoint` and `begin_checkpoint` are
collective: under torchrun every rank calls them (the trainer sends followers a "save"
command).

In the background (`begin_checkpoint(background=True)`, the job's `async_save`): what
must come from the live model is taken before it returns (the gathered weights, a
private copy; the training state staged in host memory by `dcp.async_save`; the random
state), then DCP's thread writes each rank's shards, on the gloo group of checkpoints
(`Dist.checkpoint_group`), and rank 0's writer thread, once its upload completes (after
every rank's shards and DCP's metadata are written), writes the model files and renames
the folder. `PendingSave.wait` joins it. Every path can be written so: LoRA's adapters
and their AdamW state are a small DCP state like any other, and the merged model is
written by the writer thread (docs/distributed.md, "Written in the background").
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ajet.engine.learner import Learner

__all__ = ["CHECKPOINT_FILE", "TRAINING_STATE_DIR", "PendingSave", "begin_checkpoint",
           "generation_seed", "link_checkpoint", "load_training_state", "resume_training",
           "save_checkpoint", "step_checkpoint_dir"]

log = logging.getLogger(__name__)
# DCP warns that one process "assumes" one process, even with no_dist=True, and does so
# on the writer thread of a background save too, where a scoped filter does not reach
warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                        module="torch.distributed.checkpoint")

TRAINING_STATE_DIR = "training_state"
CHECKPOINT_FILE = "ajet_checkpoint.json"
RNG_DIR = "rng"
#: Seed stride per step of the generator of a resumed run (a prime: no two (seed,
#: step) pairs of nearby runs meet).
_SEED_STRIDE = 1_000_003


def generation_seed(seed: int, step: int) -> int:
    """The generator's seed for a run whose steps start at `step` (0: the job's seed)."""
    return seed + _SEED_STRIDE * step


def step_checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


@dataclass(eq=False)
class PendingSave:
    """A checkpoint `begin_checkpoint` started: complete once `wait()` returns.

    Written in the background, rank 0's writer thread waits for every rank's shards of the
    training state (DCP's upload completes on all ranks only after its metadata is
    written), then writes the model files and renames `.partial`; the other ranks'
    part is their upload alone.
    """

    target: Path
    step: int
    #: time.monotonic() when the save began
    started: float
    #: this rank's training-state upload (background saves)
    upload: Future[Any] | None = None
    #: rank 0's writer thread (background saves)
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def done(self) -> bool:
        if self.thread is not None:
            return not self.thread.is_alive()
        return self.upload is None or self.upload.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the save is complete; raises what the writer raised."""
        if self.thread is not None:
            self.thread.join(timeout)
            if self.thread.is_alive():
                raise TimeoutError(f"checkpoint {self.target} still being written "
                                   f"after {timeout} s")
        elif self.upload is not None:
            self.upload.result(timeout)
        if self.error is not None:
            raise RuntimeError(f"writing checkpoint {self.target} failed: "
                               f"{self.error!r}") from self.error
        return self.target


def save_checkpoint(learner: Learner, target: Path, *, step: int, run_id: str | None) -> Path:
    """Save model (or adapter), tokenizer and training state to `target` atomically;
    returns once it is complete on every rank."""
    return begin_checkpoint(learner, target, step=step, run_id=run_id).wait()


def begin_checkpoint(learner: Learner, target: Path, *, step: int, run_id: str | None,
                     background: bool = False) -> PendingSave:
    """Start saving a checkpoint to `target` (collective: every rank calls it).

    What has to be taken from the live model happens before this returns, on every
    rank: the full weights gathered to rank 0's host memory (a private copy), the
    training state staged to host memory (`torch.distributed.checkpoint.async_save`'s
    stager), the random state. With `background` the files are then written by
    threads while training goes on (`PendingSave.wait` for the end); without, they
    are written before it returns, and every rank leaves once the folder is complete.
    """
    dist, policy, model = learner.dist, learner.policy, learner.model
    partial = target.with_name(target.name + ".partial")
    started = time.monotonic()
    if dist.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()  # the folder exists before any rank writes its shard into it
    # every rank's random state is on disk before its shards are: rank 0 renames the
    # folder only once every shard is written
    _save_rng(partial / RNG_DIR, rank=dist.rank)
    with policy.lock:
        # both collective: every rank gathers and writes (or stages) its part
        state = dist.full_state_dict(model.lm)
        files = _model_state(learner, state, private=background) if dist.is_main else {}
        del state
        upload = _save_training_state(learner, partial / TRAINING_STATE_DIR,
                                      background=background)
    if dist.is_main:
        policy.tokenizer.save_pretrained(partial)  # here: the generator reads the tokenizer
    pending = PendingSave(target, step, started, upload=upload)

    def complete() -> None:
        if upload is not None:
            upload.result()  # rank 0: every rank's shards and the metadata are written
        if dist.is_main:
            _write_model_files(learner, partial, files, step=step, run_id=run_id)
            files.clear()  # the host copy of the weights goes as soon as it is written
            if target.exists():
                shutil.rmtree(target)
            partial.rename(target)
            log.info("checkpoint for step %d saved to %s (%.1f s%s)", step, target,
                     time.monotonic() - started, ", written in the background"
                     if background else "")

    if not background:
        complete()
        dist.barrier()  # every rank returns once the checkpoint is complete
        return pending
    if dist.is_main:
        def run() -> None:
            try:
                complete()
            except BaseException as exc:  # noqa: BLE001 - raised again by wait()
                pending.error = exc
                log.error("writing checkpoint %s failed: %r", target, exc)

        # a daemon: a failed engine exits at once, a clean stop waits for it (trainer)
        pending.thread = threading.Thread(target=run, daemon=True,
                                          name=f"checkpoint-{target.name}")
        pending.thread.start()
    log.info("checkpoint for step %d: staged in %.2f s, written in the background while "
             "training goes on", step, time.monotonic() - started)
    return pending


def _model_state(learner: Learner, state: dict[str, torch.Tensor], *, private: bool
                 ) -> dict[str, torch.Tensor]:
    """Rank 0: the tensors of the model files (full fine-tuning: in the compute dtype).

    `private`: none of them may share memory with the live model, which trains on while
    they are written. Gathered or moved off a GPU they are copies already; one process
    on the CPU gets the parameters themselves, so those are cloned.
    """
    dtype = getattr(torch, learner.cfg.dtype)
    live = {t.untyped_storage().data_ptr() for t in learner.model.lm.state_dict().values()
            } if private and not learner.dist.active else set()

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.untyped_storage().data_ptr() in live else t

    if learner.model.lora:
        return {k: own(v) for k, v in state.items()}
    # the generation model's class and config; the weights are the trained masters
    return {k: own(v.to(dtype)) for k, v in state.items()}


def _write_model_files(learner: Learner, partial: Path, files: dict[str, torch.Tensor], *,
                       step: int, run_id: str | None) -> None:
    """Rank 0: model (or adapter, and with `lora_save_merged` the merged model) and the
    checkpoint's metadata into `partial`."""
    policy, model, dist = learner.policy, learner.model, learner.dist
    if model.lora:
        from ajet.engine.parallel.lora import save_adapter, save_merged

        save_adapter(model.lm, files, partial, base_path=policy.path)  # type: ignore[arg-type]
        if learner.cfg.lora_save_merged:
            save_merged(partial, partial / "merged", base_path=policy.path,
                        dtype=getattr(torch, learner.cfg.dtype))
    else:
        policy.model.save_pretrained(partial, state_dict=files, is_main_process=True)
    (partial / CHECKPOINT_FILE).write_text(json.dumps(
        {"step": step, "run_id": run_id, "saved_at": time.time(),
         "source": str(policy.path), "lora": model.lora,
         "training_state": TRAINING_STATE_DIR, "world_size": dist.world_size}, indent=2))


def link_checkpoint(source: Path, target: Path) -> Path:
    """`target` as a second name of the complete checkpoint `source`: the same files, hard
    linked (no bytes written; copied where the file system cannot link), through
    `<target>.partial` and a rename like any checkpoint. Rank 0 only."""
    import os

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for path in sorted(source.rglob("*")):
        dest = partial / path.relative_to(source)
        if path.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dest)
        except OSError:
            shutil.copy2(path, dest)
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    return target


def _state_options(learner: Learner, *, loading: bool = False) -> StateDictOptions:
    # LoRA: the frozen base is the source checkpoint already; keep only what trains (and
    # on load do not ask for the base weights the state leaves out)
    lora = learner.model.lora
    return StateDictOptions(ignore_frozen_params=lora, strict=not (loading and lora))


def _save_training_state(learner: Learner, path: Path, *, background: bool
                         ) -> Future[Any] | None:
    """Write this rank's shards of the training state; `background`: stage them in host
    memory now and return the upload (`dcp.async_save`, on the checkpoint group)."""
    model_state, optim_state = get_state_dict(learner.model.scorer, learner.optimizer,
                                              options=_state_options(learner))
    state = {"model": model_state, "optimizer": optim_state}
    dist = learner.dist
    if not background:
        dcp.save(state, checkpoint_id=path, no_dist=not dist.active)
        return None
    response = dcp.async_save(state, checkpoint_id=path, no_dist=not dist.active,
                              process_group=dist.checkpoint_group)
    return response.upload_completion if isinstance(response, AsyncSaveResponse) \
        else response


def load_training_state(learner: Learner, checkpoint: Path) -> None:
    """Restore master weights and optimizer state saved by `save_checkpoint` (collective).

    Publishes the restored weights to the inference model, like an update.
    """
    model_state, optim_state = get_state_dict(learner.model.scorer, learner.optimizer,
                                              options=_state_options(learner))
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=checkpoint / TRAINING_STATE_DIR,
             no_dist=not learner.dist.active)
    set_state_dict(learner.model.scorer, learner.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   options=_state_options(learner, loading=True))
    with learner.policy.lock:
        learner.model.publish()


def resume_training(learner: Learner, checkpoint: Path) -> int:
    """Restore a checkpoint for a continuing run (collective); returns its step.

    Raises `ValueError` naming the checkpoint when it is not a complete one of this
    kind of training (full fine-tuning or LoRA).
    """
    meta_path = checkpoint / CHECKPOINT_FILE
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"resume_from: {checkpoint} is not a complete checkpoint "
                         f"({meta_path} unreadable: {exc})") from exc
    if bool(meta.get("lora")) != learner.model.lora:
        raise ValueError(f"resume_from: {checkpoint} was saved with"
                         f"{'' if meta.get('lora') else 'out'} LoRA, this job trains "
                         f"{'with' if learner.model.lora else 'without'} it; "
                         "set lora_rank as the resumed run had it")
    load_training_state(learner, checkpoint)
    _load_rng(checkpoint / RNG_DIR, rank=learner.dist.rank)
    log.info("resumed from %s: step %d (run %s), weights and optimizer state restored",
             checkpoint, step, meta.get("run_id"))
    return step


def _save_rng(folder: Path, *, rank: int) -> None:
    import random

    folder.mkdir(parents=True, exist_ok=True)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    torch.save(state, folder / f"rank_{rank}.pt")


def _load_rng(folder: Path, *, rank: int) -> None:
    """This rank's random state; a rank the saving run did not have keeps its own."""
    import random

    path = folder / f"rank_{rank}.pt"
    if not path.is_file():
        log.info("no random state for rank %d in %s; it keeps its own", rank, folder)
        return
    state = torch.load(path, weights_only=True)  # tensors, ints and tuples only
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] and torch.cuda.is_available() and \
            len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
