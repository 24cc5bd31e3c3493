"""LoRA memory per rank: one frozen base shared by training and generation.

    python -m bench --only lora_memory

On the ~55M-parameter Qwen2 shape of `bench/train_memory_probe.py`, a LoRA job (rank 8
on every linear layer) trained by the engine's `Learner` on 2 gloo ranks (CPU, fp32),
measured by `bench/lora_memory_probe.py` in fresh processes:

1. the rank's peak resident memory above the set before the model was loaded, with this
   tree's code against the code from before LoRA shared its base (`BEFORE`, checked out
   with `git worktree` from this repository's history: a separate fp32 copy of the
   whole model, sharded by FSDP2, next to the generation copy, and a full fp32 copy at
   boot). Goal <= 0.5x. On GPUs the gap is wider (the base is bf16, the removed copy
   fp32: 2 bytes per parameter instead of 2 + 4 / N), which the note gives from the
   memory planner for Qwen2.5-7B on one GPU;
2. the tensors the rank holds (model, gradients, AdamW state, counted once by storage),
   the same two codes;
3. the memory planner's estimate of the engine's own peak measure against what the
   probe measured (goal within 25%).

Quick mode (the smoke test) measures a small shape with this tree only.
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

RERUN = "python -m bench --only lora_memory"
PROBE = str(PROJECT_ROOT / "bench" / "lora_memory_probe.py")
#: The last commit whose LoRA kept a separate trained copy of the whole model.
BEFORE = "7b85425"
GOAL = 0.5
TOLERANCE = 0.25
MiB = 1024 * 1024
QWEN_7B = PROJECT_ROOT / "tests" / "ajet" / "engine" / "models" / "Qwen2.5-7B-Instruct"


def _probe(model: Path, out: Path, *, code: Path) -> dict[str, Any]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                "--standalone"]
    env = child_env({"HF_HUB_OFFLINE": "1"})
    env["PYTHONPATH"] = str(code)  # which ajet the probe imports
    subprocess.run([*launcher, PROBE, str(model), str(out)], env=env, check=True,
                   timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return dict(json.loads(out.read_text()))


def _before_tree(work: Path) -> Path | None:
    """The code from before the change, checked out; None when history lacks it."""
    target = work / "before"
    done = subprocess.run(["git", "-C", str(PROJECT_ROOT), "worktree", "add", "--detach",
                           str(target), BEFORE], capture_output=True, check=False)
    return target if done.returncode == 0 else None


def _remove_tree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(PROJECT_ROOT), "worktree", "remove", "--force",
                    str(tree)], capture_output=True, check=False)


def _gpu_note() -> str:
    """The planner's figures for the 7B LoRA job on one 80 GB GPU, this code's layout."""
    from ajet.engine.planning.memory_plan import Available, JobView, model_shape, plan_memory

    shape = model_shape(str(QWEN_7B))
    if shape is None:
        return ""
    plan = plan_memory(JobView(model=str(QWEN_7B), n_gpu=1, lora_rank=16, batch_size=32,
                               num_repeat=4, max_prompt_length=2048,
                               max_response_length=2048), shape, Available(80 << 30, "bench"))
    model = next(t.bytes for t in plan.terms if t.name.startswith("model:"))
    return (f"; Qwen2.5-7B LoRA on one GPU (planner): base + adapters {model / 2**30:.1f} "
            f"GiB where a bf16 generation copy and an fp32 trained copy took "
            f"{6 * shape.parameters / 2**30:.1f} GiB; peak {plan.peak_bytes / 2**30:.1f} GiB")


def run(ctx: BenchContext) -> list[Row]:
    work = ctx.path("lora_memory")
    work.mkdir(parents=True)
    from bench.train_memory_probe import build

    model = work / "model"
    build(model, quick=ctx.quick)
    after = _probe(model, work / "after.json", code=PROJECT_ROOT)
    before: dict[str, Any] | None = None
    tree = None if ctx.quick else _before_tree(work)
    if tree is not None:
        try:
            before = _probe(model, work / "before.json", code=tree)
        finally:
            _remove_tree(tree)
    size = "quick shape" if ctx.quick else "~55M-parameter Qwen2 shape"
    reference = f"before (commit {BEFORE})" if before else ""
    rows = [
        Row("LoRA peak memory per rank, 2 gloo ranks (resident, from before the load)",
            after["peak_bytes"] / MiB, "MiB", reference,
            before["peak_bytes"] / MiB if before else None, target=f"<= {GOAL}x",
            met=after["peak_bytes"] <= GOAL * before["peak_bytes"] if before else None,
            rerun=RERUN, repetitions=1,
            note=f"{size}, LoRA rank 8, CPU fp32" + ("" if ctx.quick else _gpu_note())),
        Row("LoRA tensors held per rank (model, gradients, AdamW), 2 gloo ranks",
            after["held_bytes"] / MiB, "MiB", reference,
            before["held_bytes"] / MiB if before else None, rerun=RERUN, repetitions=1,
            note=f"{size}; counted once by storage"),
    ]
    if "planned_bytes" in after:
        measured, planned = after["measured_bytes"], after["planned_bytes"]
        rows.append(Row(
            "memory planner, LoRA training on 2 ranks: estimate / measured peak",
            planned / MiB, "MiB", "measured (peak_memory_mb)", measured / MiB,
            target=f"within {TOLERANCE:.0%}",
            met=abs(planned - measured) <= TOLERANCE * measured, rerun=RERUN,
            repetitions=1, note=f"{size}; resident memory above the set after the load"))
    return rows
