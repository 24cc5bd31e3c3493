"""Row 5: training throughput and learning of ajet-tiny with 4 concurrent rollout workers.

    python -m bench --only training
    python -m bench.bench_learning        # the learning criterion alone, with its figures

Runs of `bench.bench_learning.measure_learning` (the engine engineer's benchmark of the
issue-3 criterion: `batch_size=4`, `num_repeat=8`, the digits workflow, 4 workers, 90 s
budget from `start_engine`), each in a work directory kept until the end so that its
`metrics.jsonl` can be read here: first with the generator that recomputes every prefix
(`AJET_ENGINE_GENERATION=recompute`, the engine before generation: the reference of the
throughput rows), then with the default KV-cached one, then with LoRA. Steps per minute
and tokens per second are medians over a run's steps (the first step, which waits for
the workers to start, is left out): each step is one repetition. A run stops once the
criterion holds, which takes at least 6 steps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench.bench_learning import GAIN, LearningFigures, measure_learning
from bench.context import BenchContext
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only training"
BUDGET_S = 90.0
ENGINE_RSS_BUDGET_MB = 600.0
#: LoRA with the defaults ajet-tiny gets by model (lr and targets chosen by the server)
LORA_JOB = {"lora_rank": 8}
#: quick runs end after this many steps (a steady line beside the first, which waits for
#: the workers), instead of running out the 15 s
QUICK_STEPS = 3


def _metric_lines(workdir: Path) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for path in sorted(workdir.glob("runs/*/metrics.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def _learn(ctx: BenchContext, name: str, *, job: dict[str, Any] | None = None,
           env: dict[str, str] | None = None) -> tuple[LearningFigures, Path]:
    workdir = ctx.path(name)
    workdir.mkdir(parents=True)
    if ctx.quick:  # a few small steps: proves the plumbing, not the learning
        return measure_learning(duration_s=15.0, batch_size=2, num_repeat=2,
                                stop_when_met=False, workdir=workdir, job_overrides=job,
                                env=env, stop_after_steps=QUICK_STEPS), workdir
    return measure_learning(duration_s=BUDGET_S, workdir=workdir, job_overrides=job,
                            env=env), workdir


def _throughput(workdir: Path) -> tuple[list[dict[str, Any]], float, float]:
    """A run's steady metrics lines, its steps per minute and tokens per second."""
    lines = _metric_lines(workdir)
    steady = lines[1:] or lines
    if not steady:
        raise RuntimeError(f"the training run wrote no metrics line in {BUDGET_S:.0f} s; "
                           f"see {workdir}/server.log and {workdir}/runs/*/engine.log")
    step_s = statistics.median(float(line["step_time_s"]) for line in steady)
    tokens = statistics.median(float(line["tokens_per_s"]) for line in steady)
    return steady, 60.0 / step_s, tokens


def run(ctx: BenchContext) -> list[Row]:
    before = None
    if not ctx.quick:  # the smoke test proves the plumbing with the default generator
        _, before_dir = _learn(ctx, "training-recompute",
                               env={"AJET_ENGINE_GENERATION": "recompute"})
        before = _throughput(before_dir)
    figures, workdir = _learn(ctx, "training")
    lora, _ = _learn(ctx, "training-lora", job=LORA_JOB)
    steady, steps_per_min, tokens = _throughput(workdir)
    cfg = figures.config
    setup = (f"bs {cfg['batch_size']} x {cfg['num_repeat']}, {cfg['n_workers']} workers, "
             f"{figures.steps} steps")
    reference = "recompute generator, before generation" if before else ""
    if before:
        setup += f"; reference {len(before[0]) + 1} steps"
    rows = [
        Row("training ajet-tiny: steps per minute", steps_per_min, "steps/min", reference,
            before[1] if before else None, rerun=RERUN, repetitions=len(steady), note=setup),
        Row("training ajet-tiny: tokens per second", tokens, "tokens/s", reference,
            before[2] if before else None, rerun=RERUN, repetitions=len(steady),
            note="response tokens / step time, metrics.jsonl"),
    ]
    if not ctx.quick:
        seconds = figures.seconds_to_criterion
        rows.append(Row(
            f"learning: reward gain >= {GAIN} (last 3 vs first 3 steps), from start_engine",
            seconds if seconds is not None else figures.wall_s, "s", "budget", BUDGET_S,
            target=f"<= {BUDGET_S:.0f} s", met=figures.criterion_met, rerun=RERUN,
            repetitions=1, note=f"gain {figures.gain:.2f}" if figures.gain is not None
            else "not enough steps"))
    seconds = lora.seconds_to_criterion
    rows.append(Row(
        f"learning with LoRA (rank 8, lr {lora.config['lr']:g}): reward gain >= {GAIN}",
        seconds if seconds is not None else lora.wall_s, "s", "budget", BUDGET_S,
        target=f"<= {BUDGET_S:.0f} s", met=lora.criterion_met if not ctx.quick else None,
        rerun=RERUN, repetitions=1, note=f"gain {lora.gain:.2f}, {lora.steps} steps"
        if lora.gain is not None else f"{lora.steps} steps"))
    if figures.engine_peak_rss_mb is not None:
        rows.append(Row(
            "engine peak RSS while training", figures.engine_peak_rss_mb, "MB",
            target=f"< {ENGINE_RSS_BUDGET_MB:.0f} MB",
            met=figures.engine_peak_rss_mb < ENGINE_RSS_BUDGET_MB, rerun=RERUN, repetitions=1))
    return rows
