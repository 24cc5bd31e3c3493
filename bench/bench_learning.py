"""Learning benchmark: does the engine visibly improve ajet-tiny on a CPU, and how fast?

The criterion: with `model=ajet-tiny`, `batch_size=4`, `num_repeat=8` and 4
concurrent rollout workers (the digits workflow, `examples/digits_workflow.py`), the mean
reward of the last 3 steps exceeds that of the first 3 by at least 0.3 within 90 s of
wall time, counted from the `start_engine` call (boot included), and every metrics line
holds every required field. Everything is real: a swarm server subprocess, the engine it
spawns, the official openai client in the workflow.

    python -m bench.bench_learning            # stops once the criterion holds
    python -m bench.bench_learning --full     # runs the whole 90 s

`measure_learning()` returns the figures; `main()` prints them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from ajet.client import SwarmClient  # noqa: E402
from ajet.copilot.job import AgentJetJob  # noqa: E402
from ajet.protocol import EngineState  # noqa: E402
from ajet.rollout import RolloutRunner, load_workflow  # noqa: E402
from bench.harness import STANDBY_OFF, child_env, free_port, rss_mb  # noqa: E402

__all__ = ["LearningFigures", "main", "measure_learning"]

REQUIRED_FIELDS = (
    "step", "reward_mean", "reward_std", "reward_min", "reward_max", "success_rate", "loss",
    "kl", "entropy", "response_length", "episodes", "tokens_per_s", "step_time_s",
    "wall_time_s",
)
GAIN = 0.3
WINDOW = 3


@dataclass
class LearningFigures:
    criterion_met: bool
    seconds_to_criterion: float | None = field(
        metadata={"help": "from the start_engine call until a metrics line showed the gain"})
    steps: int
    first3_reward: float | None
    last3_reward: float | None
    gain: float | None
    boot_s: float
    wall_s: float
    step_time_median_s: float | None
    episodes: int
    engine_peak_rss_mb: float | None
    lines_missing_fields: int
    rewards: list[float]
    config: dict[str, Any]


def _gain(rewards: list[float]) -> tuple[float | None, float | None, float | None]:
    if len(rewards) < 2 * WINDOW:
        return None, None, None
    first = sum(rewards[:WINDOW]) / WINDOW
    last = sum(rewards[-WINDOW:]) / WINDOW
    return first, last, last - first


def measure_learning(*, duration_s: float = 90.0, batch_size: int = 4, num_repeat: int = 8,
                     n_workers: int = 4, stop_when_met: bool = True,
                     job_overrides: dict[str, Any] | None = None,
                     workdir: Path | None = None,
                     env: dict[str, str] | None = None,
                     stop_after_steps: int | None = None) -> LearningFigures:
    """Run server + engine + workers and measure the learning criterion.

    `stop_after_steps` ends the run once that many metrics lines are in, whatever the
    budget left (the smoke test's quick run: plumbing, not learning).

    `env` adds to the server's (and so the engine's) environment, e.g.
    `AJET_ENGINE_GENERATION=recompute` for the generator without KV cache.
    """
    job = AgentJetJob(model="ajet-tiny", batch_size=batch_size, num_repeat=num_repeat,
                      **(job_overrides or {}))
    workflow, tasks = load_workflow("examples/digits_workflow.py:workflow", PROJECT_ROOT)
    with tempfile.TemporaryDirectory(prefix="ajet-bench-learning-") as tmp:
        root = workdir or Path(tmp)
        port = free_port()
        # no warm standby: its background import of torch would slow the first steps
        server_env = child_env({**STANDBY_OFF, **(env or {})})
        log = open(root / "server.log", "ab")  # noqa: SIM115 (closed below)
        server = subprocess.Popen(
            [sys.executable, "-m", "swarm_server", "start", f"--swarm-port={port}",
             "--workdir", str(root), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=server_env,
            cwd=root)
        client = SwarmClient(f"http://127.0.0.1:{port}", timeout=60)
        runner: RolloutRunner | None = None
        try:
            deadline = time.monotonic() + 30
            while not client.health():
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"swarm server did not start; see {root / 'server.log'}")
                time.sleep(0.05)
            accepted = client.submit_config(job).config  # with the defaults chosen by model
            t0 = time.monotonic()
            client.start_run()
            runner = RolloutRunner(client, workflow, tasks, n_workers=n_workers,
                                   num_repeat=num_repeat)
            runner.start()  # workers retry begin_episode until the engine serves
            status = client.wait_for_state((EngineState.ROLLING, EngineState.ROLLING_POST,
                                             EngineState.WEIGHT_SYNCING), timeout=duration_s)
            boot_s = time.monotonic() - t0
            points: list[dict[str, Any]] = []
            met_at: float | None = None
            peak = rss_mb(status.pid)
            while time.monotonic() - t0 < duration_s:
                time.sleep(0.25)
                peak = max(filter(None, (peak, rss_mb(status.pid))), default=None)
                points = client.get_metrics().points
                rewards = [float(p["reward_mean"]) for p in points]
                _, _, gain = _gain(rewards)
                if met_at is None and gain is not None and gain >= GAIN:
                    met_at = time.monotonic() - t0
                    if stop_when_met:
                        break
                if stop_after_steps is not None and len(points) >= stop_after_steps:
                    break
            wall_s = time.monotonic() - t0
            runner.stop(timeout=30)
            client.stop_run(reason="bench finished")
        finally:
            if runner is not None:
                runner.stop(timeout=5)
            client.close()
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
            log.close()
    rewards = [float(p["reward_mean"]) for p in points]
    first, last, gain = _gain(rewards)
    step_times = [float(p["step_time_s"]) for p in points[1:]]  # step 1 waits for workers
    return LearningFigures(
        criterion_met=met_at is not None and met_at <= duration_s, seconds_to_criterion=met_at,
        steps=len(points), first3_reward=first, last3_reward=last, gain=gain, boot_s=boot_s,
        wall_s=wall_s, step_time_median_s=statistics.median(step_times) if step_times else None,
        episodes=sum(int(p["episodes"]) for p in points), engine_peak_rss_mb=peak,
        lines_missing_fields=sum(1 for p in points if not set(REQUIRED_FIELDS) <= set(p)),
        rewards=[round(r, 3) for r in rewards],
        config={"model": job.model, "batch_size": batch_size, "num_repeat": num_repeat,
                "n_workers": n_workers, "lr": accepted["lr"],
                "lora_target_modules": accepted.get("lora_target_modules"),
                "cpus": os.cpu_count()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=90.0, help="wall-time budget, seconds")
    p.add_argument("--full", action="store_true", help="run the whole duration")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    figures = measure_learning(duration_s=args.duration, stop_when_met=not args.full)
    if args.json:
        sys.stdout.write(json.dumps(dataclasses.asdict(figures), indent=2) + "\n")
        return 0 if figures.criterion_met else 1
    f = figures
    lines = [
        f"learning criterion (gain >= {GAIN} of last {WINDOW} over first {WINDOW} steps "
        f"within {args.duration:.0f} s): {'MET' if f.criterion_met else 'NOT MET'}",
        f"  seconds to criterion (from start_engine): {f.seconds_to_criterion}",
        f"  steps {f.steps}, episodes {f.episodes}, boot {f.boot_s:.1f} s, wall {f.wall_s:.1f} s",
        f"  reward first {WINDOW}: {f.first3_reward}, last {WINDOW}: {f.last3_reward}, "
        f"gain {f.gain}",
        f"  median step time {f.step_time_median_s} s, engine peak RSS "
        f"{f.engine_peak_rss_mb} MB, metrics lines missing fields: {f.lines_missing_fields}",
        f"  rewards per step: {f.rewards}",
        f"  config: {f.config}",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if f.criterion_met else 1


if __name__ == "__main__":
    raise SystemExit(main())
