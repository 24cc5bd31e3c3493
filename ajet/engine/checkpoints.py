"""Checkpoints: Hugging Face checkpoint directories in the run directory.

`checkpoints/step_<n>/` every `save_every` steps and `final/` at stop, each a complete
`save_pretrained` of model and tokenizer that `AutoModelForCausalLM.from_pretrained`
loads (and that a later job can name as its `model`). Written to `<name>.partial` and
renamed, so a directory without that suffix is always complete.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from ajet.engine.policy import Policy

__all__ = ["save_checkpoint", "step_checkpoint_dir"]

log = logging.getLogger(__name__)


def step_checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


def save_checkpoint(policy: Policy, target: Path, *, step: int, run_id: str | None) -> Path:
    """Save model and tokenizer to `target` atomically; replaces an older `target`."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with policy.lock:
        policy.model.save_pretrained(partial)
    policy.tokenizer.save_pretrained(partial)
    (partial / "ajet_checkpoint.json").write_text(json.dumps(
        {"step": step, "run_id": run_id, "saved_at": time.time(),
         "source": str(policy.path)}, indent=2))
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    log.info("checkpoint for step %d saved to %s", step, target)
    return target
