"""Training memory at scale: FSDP2 shards, and one long micro-batch.

    python -m bench --only train_memory

Rows, on a ~55M-parameter Qwen2-shaped model built locally with random weights
(`bench/train_memory_probe.py`, each measurement in fresh processes):

1. Parameters + gradients + AdamW state held per rank for the trained model, FSDP2 on
   2 gloo ranks against 1 process, counted in bytes of the local shards after a real
   `Learner.update` (goal <= 0.6x). Under torchrun each rank also keeps a full
   inference copy for generation; the note gives it (bf16 on GPUs, fp32 here).
2. Peak resident memory above the start for scoring and backpropagating one micro-batch
   of 8 x 1k tokens: the chunked log-probs with activation checkpointing against the
   former path (whole logits in fp32, no checkpointing). CPU resident memory stands in
   for GPU memory here; both paths run the same fp32 model.

Byte counts are exact and do not depend on load; the peak is one run per path.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ajet.engine.planning.memory_plan import Available, JobView, model_shape, plan_memory
from bench.context import BenchContext
from bench.harness import PROJECT_ROOT, child_env
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only train_memory"
PROBE = str(PROJECT_ROOT / "bench" / "train_memory_probe.py")
GOAL = 0.6


def _probe(model: Path, steps: str, *, quick: bool, ranks: int = 1) -> dict[str, Any]:
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
        "--standalone"]
    out = model.parent / f"{steps.replace(',', '-')}-{ranks}.json"
    subprocess.run([*launcher, PROBE, str(model), str(out), steps,
                    *(["--quick"] if quick else [])],
                   env=child_env({"HF_HUB_OFFLINE": "1"}), check=True, timeout=900,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return dict(json.loads(out.read_text()))


def _state_bytes(result: dict[str, int]) -> int:
    return result["parameters"] + result["gradients"] + result["optimizer"]


def run(ctx: BenchContext) -> list[Row]:
    work = ctx.path("train_memory")
    work.mkdir(parents=True)
    model, quick = work / "model", ctx.quick
    # each peak in a fresh process (resident memory never shrinks); quick: one process
    if quick:
        found = _probe(model, "build,state,peak-old,peak-new", quick=True)
    else:
        found = _probe(model, "build,state", quick=False)
        for path in ("peak-old", "peak-new"):
            found.update(_probe(model, path, quick=False))
    single = found["state"][0]
    ranks = _probe(model, "state", quick=quick, ranks=2)["state"]
    peaks = {path: found[f"peak-{path}"] for path in ("old", "new")}
    per_rank = max(_state_bytes(r) for r in ranks)
    mb = 1024 * 1024
    # the memory planner's terms for the same state (ajet/engine/planning/memory_plan.py)
    shape = model_shape(str(model))
    assert shape is not None
    plan = plan_memory(JobView(model=str(model), n_proc=2), shape, Available(1 << 50, "bench"))
    planned = sum(t.bytes for t in plan.terms if t.name.startswith(
        ("trained weights", "gradients", "AdamW moments")))
    size = f"{single['numel'] / 1e6:.0f}M-parameter Qwen2 shape" if not quick \
        else "quick shape"
    rows = [Row(
        "FSDP2 training state per rank (params + grads + AdamW), 2 gloo ranks",
        per_rank / mb, "MiB", "1 process", _state_bytes(single) / mb, target=f"<= {GOAL}x",
        met=per_rank <= GOAL * _state_bytes(single), rerun=RERUN, repetitions=1,
        note=f"{size}; the memory planner counts {planned / mb:.0f} MiB; plus a full "
             f"inference copy per rank: {ranks[0]['inference_copy'] / mb:.0f} MiB in fp32 "
             "here, half in bf16 on GPUs")]
    tokens = peaks["new"]["tokens"]
    rows.append(Row(
        f"peak training memory, one micro-batch of {tokens} tokens: chunked log-probs + "
        "activation checkpointing", max(peaks["new"]["peak_above_start_mb"], 1.0), "MiB",
        "whole fp32 logits, no checkpointing", max(peaks["old"]["peak_above_start_mb"], 1.0),
        target="< 1x", met=peaks["new"]["peak_above_start_mb"]
        < peaks["old"]["peak_above_start_mb"], rerun=RERUN, repetitions=1,
        note=f"{size}; resident memory above the start, CPU, fp32"))
    return rows

