"""metrics.jsonl: one JSON object per training step, written and flushed by the engine.

Fields (docs/internals.md, "metrics.jsonl fields"): step, reward_mean, reward_std,
reward_min, reward_max, success_rate, loss, kl, entropy, response_length, episodes,
tokens_per_s, step_time_s, wall_time_s, and each workflow `log_metrics` key averaged
over the step's episodes, prefixed `log/`. A few extra diagnostics follow (groups,
grad_norm, clip_frac, update_time_s, publish_time_s, publish_bytes, policy_lag,
tool_call_parse_errors), the sampler-trainer gap (learner.py): `train/logprob_gap_mean`,
`train/logprob_gap_max`, `train/logprob_gap_beyond_clip` and `train/clip_frac_first_epoch`,
and the trainer adds the timelines' counts (`train/episodes`, `train/completions`,
`train/samples`, `train/trained_tokens`, `train/prompt_tokens`,
`train/retokenisation_drift`; `trainer.build_samples`).

`success_rate` is the share of true `is_success` among the episodes whose workflow sent
one, and null when none did (a success rate made up from rewards would read 1.0 for any
run whose rewards are positive).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol

from ajet.engine.advantages import mean_std
from ajet.engine.plane.episodes import Episode
from ajet.engine.learner import UpdateStats

__all__ = ["REQUIRED_FIELDS", "MetricsWriter", "step_metrics"]

REQUIRED_FIELDS = (
    "step", "reward_mean", "reward_std", "reward_min", "reward_max", "success_rate", "loss",
    "kl", "entropy", "response_length", "episodes", "tokens_per_s", "step_time_s",
    "wall_time_s",
)


def step_metrics(*, step: int, episodes: Sequence[Episode], rewards: Sequence[float],
                 update: UpdateStats, groups: int, step_time_s: float, wall_time_s: float
                 ) -> dict[str, Any]:
    """The metrics line of one step (rewards after reward processing)."""
    n = len(episodes)
    mean, std = mean_std(rewards)  # overflow-safe for any finite reward
    reported = [e.is_success for e in episodes if e.is_success is not None]
    response_tokens = sum(e.trajectory.response_tokens for e in episodes)
    # updates between sampling and this one (0 = on-policy: sampled after step - 1 updates)
    lag = [(step - 1) - c.policy_step for e in episodes for c in e.trajectory.completions]
    line: dict[str, Any] = {
        "step": step,
        "reward_mean": mean,
        "reward_std": std,
        "reward_min": min(rewards) if n else 0.0,
        "reward_max": max(rewards) if n else 0.0,
        "success_rate": sum(reported) / len(reported) if reported else None,
        "loss": update.loss,
        "kl": update.kl,
        "entropy": update.entropy,
        "response_length": response_tokens / n if n else 0.0,
        "episodes": n,
        "tokens_per_s": response_tokens / step_time_s if step_time_s > 0 else 0.0,
        "step_time_s": step_time_s,
        "wall_time_s": wall_time_s,
        "groups": groups,
        "grad_norm": update.grad_norm,
        "clip_frac": update.clip_frac,
        "update_time_s": update.seconds,
        # the new weights' way to the inference model (docs/distributed.md, "Publication")
        "publish_time_s": update.publish_time_s,
        "publish_bytes": update.publish_bytes,
        "policy_lag": sum(lag) / len(lag) if lag else 0.0,
        # replies whose tool-call block did not parse (served as content; chat_format)
        "tool_call_parse_errors": sum(c.tool_call_parse_error for e in episodes
                                      for c in e.trajectory.completions),
        "train/logprob_gap_mean": update.logprob_gap_mean,
        "train/logprob_gap_max": update.logprob_gap_max,
        "train/logprob_gap_beyond_clip": update.logprob_gap_beyond_clip,
        "train/clip_frac_first_epoch": update.clip_frac_first_epoch,
    }
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for e in episodes:
        for key, value in e.log_metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                sums[key] += float(value)
                counts[key] += 1
    for key in sorted(sums):
        line[f"log/{key}"] = sums[key] / counts[key]
    return line


class Mirror(Protocol):
    """Where else each line goes (the job's trackers, `ajet.engine.tracking`)."""

    def log(self, line: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsWriter:
    """Appends one line per step to `<run_dir>/metrics.jsonl`, flushes it, then mirrors
    it to the trackers (which never fail the write: they turn themselves off)."""

    def __init__(self, path: Path, mirror: Mirror | None = None) -> None:
        self.path = path
        self.mirror = mirror
        self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)

    def write(self, line: dict[str, Any]) -> None:
        self._file.write(json.dumps(line, allow_nan=False, default=float) + "\n")
        self._file.flush()
        if self.mirror is not None:
            self.mirror.log(line)

    def close(self) -> None:
        self._file.close()
        if self.mirror is not None:
            self.mirror.close()
