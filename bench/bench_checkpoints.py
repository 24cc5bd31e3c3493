"""Checkpoint stall: how long a save holds up the step loop, in the background or not.

    python -m bench --only checkpoints

On the ~55M-parameter Qwen2 shape of `bench/train_memory_probe.py` (full fine-tuning,
fp32 on the CPU, one process; `bench/checkpoint_stall_probe.py` in a fresh process):
the time `begin_checkpoint` keeps the step loop waiting with `async_save` (the state
copied to host memory, the files then written by threads) against a synchronous save
(the whole checkpoint written first). The note gives the update's time while a
background save is written against alone: on a CPU the writer shares the cores the
update runs on, next to a GPU it does not.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from bench.context import BenchContext
from bench.harness import PROJECT_ROOT, child_env
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only checkpoints"
PROBE = str(PROJECT_ROOT / "bench" / "checkpoint_stall_probe.py")
MiB = 1024 * 1024


def run(ctx: BenchContext) -> list[Row]:
    work = ctx.path("checkpoints")
    work.mkdir(parents=True)
    from bench.train_memory_probe import build

    model = work / "model"
    build(model, quick=ctx.quick)
    reps = max(1, min(ctx.reps, 3))  # each repetition writes two checkpoints of ~0.9 GB
    subprocess.run([sys.executable, PROBE, str(model), str(work), str(reps)],
                   env=child_env({"HF_HUB_OFFLINE": "1"}), check=True, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    found = json.loads((work / "stall.json").read_text())

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in found[mode])

    size = "quick shape" if ctx.quick else "~55M-parameter Qwen2 shape"
    stall, sync_stall = median("async", "stall_s"), median("sync", "stall_s")
    return [Row(
        "checkpoint stall of the step loop, async_save (state staged, files written "
        "in the background)", stall, "s", "synchronous save", sync_stall,
        rerun=RERUN, repetitions=reps,
        note=f"{size}, full fine-tuning, CPU fp32, one process, checkpoint "
             f"{found['bytes'] / MiB:.0f} MiB; the next update took "
             f"{median('async', 'update_during_s'):.2f} s while it was written, "
             f"{median('async', 'update_alone_s'):.2f} s alone; the rest of the write "
             f"{median('async', 'wait_after_s'):.2f} s after that update")]
