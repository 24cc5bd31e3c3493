"""The memory planner's estimate against the measured peak.

    python -m bench --only memory_plan

Four rows: ajet-tiny and the ~55M-parameter Qwen2 shape, each in training and in
generation, every one measured in a fresh process by `bench/memory_plan_probe.py` with
the engine's own classes and its own measure (`peak_memory_mb`: on CPU the resident
high-water mark above the resident set after imports and model load). The reference is
the planner's estimate of the same quantity (`MemoryPlan.comparable_bytes`); the goal is
a ratio within 25% (0.75x to 1.25x). One run per row: the resident set does not depend
on the load, but glibc's heap does vary by a few percent from run to run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.context import BenchContext
from bench.harness import PROJECT_ROOT, child_env
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only memory_plan"
PROBE = str(PROJECT_ROOT / "bench" / "memory_plan_probe.py")
#: the estimate is within this share of the measured peak
TOLERANCE = 0.25
MiB = 1024 * 1024


def _probe(models: str, phases: str, work: Path, *, quick: bool) -> list[dict[str, Any]]:
    out = work / f"{models}-{phases}.json".replace(",", "+")
    subprocess.run([sys.executable, PROBE, models, phases, str(work), str(out),
                    *(["--quick"] if quick else [])],
                   env=child_env({"HF_HUB_OFFLINE": "1"}), check=True, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return list(json.loads(out.read_text()))


def run(ctx: BenchContext) -> list[Row]:
    work = ctx.path("memory_plan")
    work.mkdir(parents=True)
    if ctx.quick:  # one process for the four: plumbing only
        found = _probe("tiny,50m", "training,generation", work, quick=True)
    else:  # each peak in a fresh process: the high-water mark never goes down
        found = [r for which in ("tiny", "50m") for phase in ("training", "generation")
                 for r in _probe(which, phase, work, quick=False)]
    labels = {"tiny": "ajet-tiny", "50m": "~55M-parameter Qwen2 shape"}
    rows = []
    for result in found:
        measured = max(result["measured_bytes"], MiB) / MiB
        planned = result["planned_bytes"] / MiB
        ratio = measured / planned if planned else float("inf")
        phase = result["phase"]
        what = (result["setup"] if phase == "training" else
                f"{result['requests']} requests at once, {result['tokens']} tokens")
        rows.append(Row(
            f"peak memory vs the planner's estimate: {labels[result['model']]}, {phase}",
            measured, "MiB", "planner's estimate", planned,
            target=f"{1 - TOLERANCE:.2f}x-{1 + TOLERANCE:.2f}x",
            met=None if ctx.quick else abs(ratio - 1) <= TOLERANCE, rerun=RERUN,
            repetitions=1, note=f"{what}; CPU resident memory above the loaded model"))
    return rows
