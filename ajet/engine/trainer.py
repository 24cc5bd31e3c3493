"""The training step loop: collect groups, drain, update, log, repeat.

One step, top to bottom (docs/internals.md):

    ROLLING         claims open; wait until `batch_size` task groups of `num_repeat`
                    ended episodes are complete
    ROLLING_POST    claims closed; wait until every claimed episode ended, was aborted
                    or timed out (its group may complete too: it waits in the queue)
    WEIGHT_SYNCING  take the `batch_size` oldest complete groups -> rewards ->
                    advantages -> timelines (samples) -> update over ppo_epochs (generation paused: every
                    rank's generator resumes on the new weights with a fresh KV cache)
                    -> samples file -> metrics line -> checkpoint (begun: written in the background)
    (back to ROLLING)

Checkpoints are written in the background with the job's `async_save` (the default with GPUs):
the step loop waits only while the state is taken from the live model (gathered and
staged in host memory, `checkpoints.begin_checkpoint`), and at most one save is in
flight: the next one, and the stop, first wait for it.

A stop request (SIGTERM) abandons a step that is still collecting or draining and
lets an update that has begun finish; the caller then calls `finish`, which waits for a
checkpoint still being written (and logs that it does), then writes the final
checkpoint (or, when the last step was just saved, makes `final/` hard links to that
checkpoint's files instead of writing the same state twice). A resumed run (`start_step` > 0)
counts its steps on from the checkpoint's; `max_steps` counts from the first run.

`train` runs on the process that owns the episode plane (rank 0). Under torchrun the
other ranks run `follow`: rank 0 broadcasts each command, ("train", batch), ("save",
(checkpoint name, step, in the background or not)) or ("stop", None), over the CPU control group (never NCCL: a
follower waits there through the whole rollout while its own generator runs), and they
call the same `Learner.update` on their share, or the same `begin_checkpoint`, until
"stop". The update and the checkpoint are where the ranks meet (FSDP's all-gathers and
reduce-scatters, the metric sums, the gathered checkpoint), so every rank must run each
of them, even an update whose groups all went to other ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ajet.engine import trajectory
from ajet.engine.advantages import grpo_advantages
from ajet.engine.checkpoints import (
    CHECKPOINT_FILE,
    PendingSave,
    begin_checkpoint,
    link_checkpoint,
    step_checkpoint_dir,
)
from ajet.engine.config import EngineConfig
from ajet.engine.parallel.distributed import Dist
from ajet.engine.plane.episodes import EpisodeRegistry, Group
from ajet.engine.generation.interface import Generator
from ajet.engine.learner import Learner, TrainSample
from ajet.engine.metrics import MetricsWriter, step_metrics
from ajet.engine.planning.peak_memory import PeakMemory
from ajet.engine.policy import Policy
from ajet.engine.rewards import process_rewards
from ajet.protocol import EngineState

__all__ = ["SAMPLES_DIR", "BatchSamples", "TrainerParts", "build_samples", "checkpoint",
           "finish", "follow", "train", "wait_for_save", "write_samples"]

log = logging.getLogger(__name__)

#: Where each step's samples are written (`GET /runs/{id}/samples?step=N` reads them).
SAMPLES_DIR = "samples"
#: Steps whose sample files are kept (older ones are removed as new steps are written).
SAMPLE_FILES_KEPT = 100


@dataclass
class TrainerParts:
    cfg: EngineConfig
    registry: EpisodeRegistry
    policy: Policy
    learner: Learner
    metrics: MetricsWriter
    run_dir: Path
    run_id: str | None
    stop: threading.Event
    #: monotonic time the engine process started (wall_time_s counts from it)
    started: float
    dist: Dist
    #: this rank's generator, paused around each update (None: nothing generates here)
    generator: Generator | None = None
    #: the measured peak memory and the planner's estimate, on every metrics line
    memory: PeakMemory | None = None
    #: steps already done: the step of the checkpoint a resumed run started from
    start_step: int = 0
    #: the checkpoint being written in the background, if any
    pending: PendingSave | None = None


@dataclass
class BatchSamples:
    """A step's training samples, what each one is (for samples-<step>.jsonl), and counts."""

    samples: list[TrainSample]
    records: list[dict[str, Any]]
    #: the step's `train/*` metrics
    metrics: dict[str, int]


def build_samples(groups: Sequence[Group], advantages: Sequence[float], *, cfg: EngineConfig,
                  tokenizer: Any = None) -> BatchSamples:
    """The episodes' timelines as samples (`trajectory.build_samples`); every sample of
    an episode gets the episode's advantage, and its task group's index."""
    encode = decode = None
    if tokenizer is not None:
        def encode(text: str) -> list[int]:
            return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]

        def decode(ids: Sequence[int]) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    tagged = [(gi, e) for gi, g in enumerate(groups) for e in g.episodes]
    out = BatchSamples([], [], {"train/episodes": len(tagged), "train/completions": 0,
                                "train/samples": 0, "train/trained_tokens": 0,
                                "train/prompt_tokens": 0, "train/retokenisation_drift": 0})
    for (gi, episode), advantage in zip(tagged, advantages, strict=True):
        timelines = trajectory.build_samples(
            episode.trajectory.completions, compare_level=cfg.timeline_compare_level,  # type: ignore[arg-type]
            merging=cfg.timeline_merging, agents=cfg.train_agents, encode=encode,
            decode=decode)
        out.metrics["train/completions"] += timelines.completions
        out.metrics["train/retokenisation_drift"] += timelines.retokenisation_drift
        for sample in timelines.samples:
            if not sample.trained_tokens:
                continue
            first = sample.loss_mask.index(1)  # everything before it is prompt
            out.samples.append(TrainSample(
                sample.token_ids[:first], sample.token_ids[first:], sample.logprobs[first:],
                advantage, group=gi, loss_mask=sample.loss_mask[first:]))
            out.metrics["train/samples"] += 1
            out.metrics["train/trained_tokens"] += sample.trained_tokens
            out.metrics["train/prompt_tokens"] += sample.prompt_tokens
            out.records.append({
                "episode_uuid": episode.uuid, "task_id": episode.task_id,
                "agent": sample.agent, "advantage": advantage, "reward": episode.reward,
                "completions": list(sample.completions), "token_ids": list(sample.token_ids),
                "text": decode(sample.token_ids) if decode is not None else None,
                "loss_mask": list(sample.loss_mask), "logprobs": list(sample.logprobs)})
    return out


def write_samples(run_dir: Path, step: int, records: Sequence[dict[str, Any]], *,
                  keep: int = SAMPLE_FILES_KEPT) -> Path:
    """`<run_dir>/samples/samples-<step>.jsonl` (one sample a line); older steps beyond
    the last `keep` are removed. Written to a temporary name, then renamed."""
    folder = run_dir / SAMPLES_DIR
    folder.mkdir(exist_ok=True)
    target = folder / f"samples-{step}.jsonl"
    partial = folder / f".samples-{step}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, allow_nan=False, default=float) + "\n")
    partial.replace(target)
    stale = folder / f"samples-{step - keep}.jsonl"
    stale.unlink(missing_ok=True)
    return target


def train(parts: TrainerParts) -> int:
    """Run steps until stopped or `max_steps`; returns the number of finished steps."""
    cfg, registry, stop = parts.cfg, parts.registry, parts.stop
    step = parts.start_step
    while not stop.is_set() and (cfg.max_steps == 0 or step < cfg.max_steps):
        step_start = time.monotonic()

        # ROLLING: claims open until the batch is complete (batch_size complete groups
        # by default; the job's sample-collection method decides, see plane/episodes.py).
        registry.set_state(EngineState.ROLLING, step=step)
        if not registry.wait_until(registry.batch_ready,
                                   stop=stop, sweep_interval_s=cfg.sweep_interval_s):
            break

        # ROLLING_POST: no new claims; in-flight episodes end, abort or time out.
        registry.set_state(EngineState.ROLLING_POST)
        if not registry.wait_until(lambda: registry.in_flight() == 0,
                                   stop=stop, sweep_interval_s=cfg.sweep_interval_s):
            break

        # WEIGHT_SYNCING: whole groups only, oldest first; the rest wait for the next step.
        registry.set_state(EngineState.WEIGHT_SYNCING)
        groups = registry.take_batch()
        episodes = [e for g in groups for e in g.episodes]
        rewards = process_rewards([e.reward or 0.0 for e in episodes], clip=cfg.reward_clip)
        group_ids = [gi for gi, g in enumerate(groups) for _ in g.episodes]
        advantages = grpo_advantages(rewards, group_ids, eps=cfg.adv_eps)
        # timelines: each chain of calls that extend each other is one sample
        batch = build_samples(groups, advantages, cfg=cfg, tokenizer=parts.policy.tokenizer)
        samples = parts.dist.broadcast(("train", batch.samples))[1]
        with _generation_paused(parts.generator):
            update = parts.learner.update(samples)
        step += 1
        write_samples(parts.run_dir, step, batch.records)

        # metrics line, then a checkpoint every save_every steps
        now = time.monotonic()
        line = step_metrics(step=step, episodes=episodes, rewards=rewards, update=update,
                            groups=len(groups), step_time_s=now - step_start,
                            wall_time_s=now - parts.started)
        line.update(batch.metrics)
        if parts.memory is not None:
            line.update(parts.memory.fields())
        parts.metrics.write(line)
        log.info("step %d: reward %.3f, loss %.4f, %d episodes, %.2f s", step,
                 line["reward_mean"], line["loss"], line["episodes"], line["step_time_s"])
        if cfg.save_every and step % cfg.save_every == 0:
            checkpoint(parts, step_checkpoint_dir(parts.run_dir, step), step,
                       background=cfg.async_save)
        elif parts.pending is not None and parts.pending.done():
            wait_for_save(parts)  # a save that failed fails the run now, not at the stop
    registry.set_state(EngineState.ROLLING_POST, step=step)  # no claims while shutting down
    return step


def checkpoint(parts: TrainerParts, target: Path, step: int, *,
               background: bool = False) -> None:
    """Rank 0: have every rank save the checkpoint `target` (inside the run directory),
    after the one still being written, if any."""
    wait_for_save(parts)
    parts.dist.broadcast(("save", (str(target.relative_to(parts.run_dir)), step,
                                   background)))
    parts.pending = begin_checkpoint(parts.learner, target, step=step, run_id=parts.run_id,
                                     background=background)


def wait_for_save(parts: TrainerParts, *, why: str = "") -> None:
    """Rank 0: wait until the checkpoint being written (if any) is complete."""
    pending, parts.pending = parts.pending, None
    if pending is None:
        return
    if why and not pending.done():
        log.info("%s: waiting for checkpoint %s (step %d, begun %.1f s ago) to be "
                 "written", why, pending.target, pending.step,
                 time.monotonic() - pending.started)
    pending.wait()


def finish(parts: TrainerParts, steps: int) -> None:
    """Rank 0, after `train`: the checkpoint being written completes, the final
    checkpoint is written, then the other ranks stop."""
    wait_for_save(parts, why="stopping")
    final, last = parts.run_dir / "final", step_checkpoint_dir(parts.run_dir, steps)
    if steps > parts.start_step and (last / CHECKPOINT_FILE).is_file():
        # the last step was saved a moment ago: final/ is that checkpoint, not a copy
        link_checkpoint(last, final)
        log.info("final checkpoint: step %d, the files of %s", steps, last)
    else:
        checkpoint(parts, final, steps)  # written before the process exits
        wait_for_save(parts)
    parts.dist.broadcast(("stop", None))


def follow(learner: Learner, dist: Dist, *, run_dir: Path, run_id: str | None,
           generator: Generator | None = None) -> int:
    """Ranks other than 0: run each command rank 0 sends, until it says stop."""
    steps = 0
    pending: PendingSave | None = None
    while True:
        command, payload = dist.broadcast(None)
        if command == "stop":
            if pending is not None:
                pending.wait()  # rank 0 waited for it too before it said stop
            return steps
        if command == "save":
            # the name is relative: each node resolves it in its own run directory
            name, step, background = payload
            if pending is not None:
                pending.wait()  # one save at a time, as on rank 0
            pending = begin_checkpoint(learner, run_dir / name, step=step, run_id=run_id,
                                       background=background)
            continue
        with _generation_paused(generator):
            learner.update(payload)
        steps += 1


def _generation_paused(generator: Generator | None) -> contextlib.AbstractContextManager[None]:
    """No token is sampled during the update; afterwards only from the new weights."""
    return generator.paused() if generator is not None else contextlib.nullcontext()
