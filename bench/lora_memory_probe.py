"""The measurement behind `bench/bench_lora_memory.py`: one LoRA rank's memory.

    python bench/lora_memory_probe.py <model dir> <out.json>
    python -m torch.distributed.run --nproc_per_node=2 --standalone \\
        bench/lora_memory_probe.py <model dir> <out.json>

Imports `ajet` from `PYTHONPATH` (the bench runs it on this tree and on the tree from
before LoRA shared its base), builds the engine's `Learner` for a LoRA job (rank 8 on
every linear layer) on CPU, as the engine does (`load_policy`, then `Learner`), and runs
two updates. Rank 0 writes, for itself:

- `held_bytes`: every tensor the rank holds for the model, counted once by storage: the
  generation model's parameters and buffers, the trained model's, their gradients and
  AdamW's state;
- `peak_bytes`: the resident high-water mark above the resident set before the model
  was loaded (what the rank's memory comes to, the boot's transient copies included);
- `measured_bytes` and `planned_bytes`: the engine's own peak measure
  (`PeakMemory.peak_bytes`, above the set after the load) and the memory planner's
  estimate of it (`MemoryPlan.comparable_bytes`), when this tree has the planner's
  LoRA rule.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

JOB = dict(lora_rank=8, lr=1e-4, batch_size=2, num_repeat=2, max_prompt_length=64,
           max_response_length=16, max_new_tokens=16, micro_batch_tokens=1024)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _held_bytes(*modules: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is None:
            return
        local = getattr(t, "_local_tensor", t)  # an FSDP2 shard: its local part
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    for module in modules:
        for p in module.parameters():
            add(p)
            add(p.grad)
        for b in module.buffers():
            add(b)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    return sum(seen.values())


def main(model: str, out: str) -> None:
    from ajet.copilot.job import AgentJetJob
    from ajet.engine.config import engine_config_from_job
    from ajet.engine.learner import Learner, TrainSample
    from ajet.engine.parallel.distributed import init_distributed
    from ajet.engine.planning.peak_memory import PeakMemory
    from ajet.engine.policy import load_policy

    torch.set_num_threads(1)
    dist = init_distributed(on_gpu=False)
    job = AgentJetJob(model=model, n_proc=dist.world_size, **JOB)
    cfg = engine_config_from_job(job, cuda_devices=0, cpu_count=1)
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident set
    policy = load_policy(Path(model), device="cpu", dtype="float32", seed=0)
    memory = PeakMemory(policy.device)
    memory.mark_loaded(policy.model)
    learner = Learner(policy, cfg, dist)
    gen = torch.Generator().manual_seed(0)
    vocab = policy.model.config.vocab_size
    samples = [TrainSample(tuple(torch.randint(3, vocab, (job.max_prompt_length,),
                                               generator=gen).tolist()),
                           tuple(torch.randint(3, vocab, (job.max_response_length,),
                                               generator=gen).tolist()),
                           (-1.0,) * job.max_response_length, 1.0 - 2 * (i % 2),
                           group=i // job.num_repeat)
               for i in range(job.batch_size * job.num_repeat)]
    for _ in range(2):
        learner.update(samples)
    result: dict[str, Any] = {
        "ranks": dist.world_size,
        "held_bytes": _held_bytes(policy.model, learner.model.scorer,
                                  optimizer=learner.optimizer),
        "peak_bytes": (_status_kb("VmHWM") - before) * 1024,
        "measured_bytes": memory.peak_bytes(),
    }
    try:
        from ajet.engine.planning.memory_plan import (
            Available,
            JobView,
            model_shape,
            plan_memory,
        )

        shape = model_shape(model)
        if shape is not None:
            plan = plan_memory(JobView.from_job(job), shape, Available(1 << 50, "bench"))
            result["planned_bytes"] = max(plan.comparable_bytes(p) for p in
                                          ("forward", "backward", "optimizer step"))
            result["planned_peak_bytes"] = plan.peak_bytes
    except ImportError:  # a tree without the planner
        pass
    if dist.is_main:
        Path(out).write_text(json.dumps(result))
    dist.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's teardown, as the engine does
