"""The checkpoints a run directory holds, and what a job's `resume_from` points at.

The engine writes `checkpoints/step_<n>/` and `final/` under its run directory, each
first as `<name>.partial` and renamed once complete, with an `ajet_checkpoint.json`
(step, run id). The server reads only those files (it never imports the engine): to
name a run's last complete checkpoint in the ledger, to tell a stop that a save is in
progress, and to turn `resume_from` (a run id, `latest`, or a checkpoint directory of one
of this server's runs) into the checkpoint directory the engine restores. Once a run's
engine is gone, a `.partial` folder is what a SIGKILL cut short: `discard_partials`
removes it (it can never be loaded, and a large model's is tens of GB), saying so in
the server's log and the run's `engine.log`, with the checkpoint that stands instead.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ajet.errors import SwarmValidationError
from swarm_server.ledger import Ledger

__all__ = ["Checkpoint", "ResumePoint", "complete_checkpoints", "discard_partials",
           "last_checkpoint", "resolve_resume", "saves_in_progress"]

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "ajet_checkpoint.json"
PARTIAL_SUFFIX = ".partial"
#: How many of an experiment's newest runs `resume_from: latest` looks through.
_LATEST_RUNS = 50


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    run_id: str | None


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes from: the checkpoint directory, its step, and its run."""

    checkpoint: Checkpoint
    #: what the job said (`latest`, a run id, a path), for the record
    requested: str


def _read(path: Path) -> Checkpoint | None:
    """A complete checkpoint directory, or None."""
    if path.name.endswith(PARTIAL_SUFFIX):
        return None
    try:
        meta = json.loads((path / CHECKPOINT_FILE).read_text(encoding="utf-8"))
        return Checkpoint(step=int(meta["step"]), path=path.resolve(),
                          run_id=meta.get("run_id") if isinstance(meta.get("run_id"), str)
                          else None)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def complete_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of a run, oldest step first (`final/` after a step of the
    same number: it is the same weights, saved at the stop)."""
    candidates = [run_dir / "final"]
    folder = run_dir / "checkpoints"
    if folder.is_dir():
        candidates += sorted(folder.iterdir())
    found = [c for c in (_read(p) for p in candidates if p.is_dir()) if c is not None]
    return sorted(found, key=lambda c: (c.step, c.path.name == "final"))


def last_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def saves_in_progress(run_dir: Path) -> list[str]:
    """Checkpoints being written now (their `.partial` folders), relative to the run."""
    names = [p for p in [run_dir / f"final{PARTIAL_SUFFIX}"] if p.is_dir()]
    folder = run_dir / "checkpoints"
    if folder.is_dir():
        names += [p for p in folder.iterdir()
                  if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir()]
    return sorted(str(p.relative_to(run_dir)).removesuffix(PARTIAL_SUFFIX) for p in names)


def discard_partials(run_dir: Path, *, run_id: str) -> list[str]:
    """Remove the `.partial` checkpoints of a run whose engine has exited (nothing writes
    them any more); returns their names, relative to the run. Call only once the run's
    processes are gone."""
    names = saves_in_progress(run_dir)
    if not names:
        return []
    last = last_checkpoint(run_dir)
    stands = (f"the last complete checkpoint is {last.path} (step {last.step})" if last
              else "the run has no complete checkpoint")
    for name in names:
        shutil.rmtree(run_dir / f"{name}{PARTIAL_SUFFIX}", ignore_errors=True)
    line = (f"removed incomplete checkpoint(s) {', '.join(names)} ({PARTIAL_SUFFIX}: the "
            f"engine was stopped while writing them); {stands}")
    log.warning("run %s: %s", run_id, line)
    try:
        with open(run_dir / "engine.log", "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [server] {line}\n")
    except OSError as exc:  # the server's log has it; the run's log is a courtesy
        log.warning("run %s: could not note it in engine.log: %s", run_id, exc)
    return names


def resolve_resume(value: str, *, ledger: Ledger, experiment_name: str,
                   runs_dir: Path) -> ResumePoint:
    """The checkpoint `resume_from: <value>` names; `SwarmValidationError` (422) when there is none."""
    if value == "latest":
        runs, _ = ledger.list_runs(experiment_name=experiment_name, limit=_LATEST_RUNS)
        for rec in runs:  # newest first
            found = last_checkpoint(Path(rec.run_dir))
            if found is not None:
                return ResumePoint(found, value)
        raise SwarmValidationError(422, f"resume_from: latest, but no run of experiment "
                                   f"{experiment_name!r} has a complete checkpoint",
                       "start without resume_from, or name a run id or checkpoint directory; "
                       "list_runs shows the runs and their last_checkpoint")
    rec = ledger.get_run(value)
    if rec is not None:
        found = last_checkpoint(Path(rec.run_dir))
        if found is None:
            raise SwarmValidationError(422, f"resume_from: run {value} left no complete checkpoint",
                           "resume from an earlier run (list_runs shows each run's "
                           "last_checkpoint) or start without resume_from")
        return ResumePoint(found, value)
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = runs_dir / path  # e.g. <run id>/checkpoints/step_20
    try:
        # only what this server's runs wrote: a checkpoint's training state is read with
        # torch.distributed.checkpoint, whose metadata is a pickle
        path.resolve().relative_to(runs_dir.resolve())
    except ValueError:
        raise SwarmValidationError(
            422, f"resume_from: {value!r} is outside the server's runs directory "
            f"{runs_dir}",
            "name a run id, 'latest', or a checkpoint of one of its runs; "
            "to start from other weights, set model to their directory") from None
    found = _read(path) if path.is_dir() else None
    if found is None:
        raise SwarmValidationError(
            422, f"resume_from: {value!r} is neither a run id, 'latest', nor a "
            f"complete checkpoint directory (one holding {CHECKPOINT_FILE})",
            "pass a run id from list_runs, 'latest', or a checkpoint directory "
            "such as <run id>/checkpoints/step_20")
    return ResumePoint(found, value)
