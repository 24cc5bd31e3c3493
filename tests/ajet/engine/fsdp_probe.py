"""Learner updates on batches whose task groups split unevenly over the ranks, under FSDP2.

    python tests/ajet/engine/fsdp_probe.py <workdir> <out.pt>            # one process
    python -m torch.distributed.run --nproc_per_node=2 --standalone \\
        tests/ajet/engine/fsdp_probe.py <workdir> <out.pt>               # two gloo ranks

Two jobs, one after the other, each with two epochs, two mini-batches per epoch, a
token budget that cuts micro-batches of one to three rows, and a KL term:

- `full`: full fine-tuning with activation checkpointing and a frozen reference. Two
  updates, a checkpoint (the full model gathered from the shards, and the sharded
  training state) written in the background while a third update runs; then a fresh learner restores the training state
  and repeats the third update (a resumed run must take the same step).
- `lora`: LoRA rank 4 on every linear layer, the reference being the adapters switched
  off. Two updates and a checkpoint with the merged model.

With 2 ranks, rank 0 gets groups 0, 2, 4 and rank 1 group 1, so rank 1 runs zero-weight
micro-batches. Rank 0 saves, per job, the trained parameters (flattened), the
`UpdateStats`, and what the test checks beyond them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ajet.copilot.job import AgentJetJob
from ajet.engine.checkpoints import begin_checkpoint, load_training_state
from ajet.engine.config import engine_config_from_job
from ajet.engine.parallel.distributed import Dist, init_distributed, start_orphan_watchdog
from ajet.engine.learner import Learner, TrainSample
from ajet.engine.policy import load_policy
from ajet.engine.tiny import ensure_tiny_model

#: (task group, completions): groups 0, 2, 4 fall to rank 0 and group 1 to rank 1
GROUPS = [(0, 3), (1, 1), (2, 3), (4, 3)]
JOBS = {
    "full": dict(kl_coef=0.1, activation_checkpointing=True),
    "lora": dict(kl_coef=0.1, lora_rank=4, lora_save_merged=True),
}


def batch(seed: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for group, n in GROUPS:
        for _ in range(n):
            prompt = torch.randint(3, 40, (4,), generator=gen).tolist()
            length = int(torch.randint(1, 6, (1,), generator=gen))
            response = torch.randint(3, 40, (length,), generator=gen).tolist()
            old = (-torch.rand(length, generator=gen) * 3).tolist()
            advantage = float(torch.randn(1, generator=gen))
            samples.append(TrainSample(tuple(prompt), tuple(response), tuple(old), advantage,
                                       group=group))
    return samples


def learner(model: Path, dist: Dist, **job: Any) -> Learner:
    cfg = engine_config_from_job(AgentJetJob(lr=0.01, ppo_epochs=2, mini_batch_num=2,
                                             micro_batch_tokens=24, **job),
                                 cuda_devices=0, cpu_count=1)
    # logits in chunks of 4 positions: several chunks per micro-batch
    cfg = dataclasses.replace(cfg, logprob_chunk_tokens=4)
    return Learner(load_policy(model, device="cpu", dtype="float32", seed=0), cfg, dist)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def run_full(model: Path, dist: Dist, out: Path) -> dict[str, Any]:
    first = learner(model, dist, **JOBS["full"])
    stats = [dataclasses.asdict(first.update(batch(seed))) for seed in (5, 6)]
    # written in the background (the job's async_save) while the third update runs
    pending = begin_checkpoint(first, out.with_name(out.stem + "-full"), step=2,
                               run_id="p", background=True)
    at_checkpoint = flat(first.policy.model)
    stats.append(dataclasses.asdict(first.update(batch(7))))
    checkpoint = pending.wait()
    resumed = learner(model, dist, **JOBS["full"])
    load_training_state(resumed, checkpoint)
    again = dataclasses.asdict(resumed.update(batch(7)))
    return {"parameters": flat(first.policy.model), "stats": stats, "checkpoint": checkpoint,
            "checkpoint_parameters": at_checkpoint, "resumed_stats": again, "resumed_parameters": flat(resumed.policy.model)}


def run_lora(model: Path, dist: Dist, out: Path) -> dict[str, Any]:
    lora = learner(model, dist, **JOBS["lora"])
    base = {n: p.detach().clone() for n, p in lora.policy.model.named_parameters()}
    stats = [dataclasses.asdict(lora.update(batch(seed))) for seed in (5, 6)]
    changed = sorted(n for n, p in lora.policy.model.named_parameters()
                     if not torch.equal(p.detach(), base[n]))
    checkpoint = begin_checkpoint(lora, out.with_name(out.stem + "-lora"), step=2,
                                  run_id="p", background=True).wait()
    adapters = {n: p.detach().clone() for n, p in lora.policy.model.named_parameters()
                if "lora_" in n}
    return {"parameters": flat(lora.policy.model), "stats": stats, "changed": changed,
            "adapters": adapters, "checkpoint": checkpoint,
            "trainable": sum(p.numel() for p in lora.model.params)}


def main(workdir: Path, out: Path) -> None:
    torch.set_num_threads(1)
    model = ensure_tiny_model(workdir, seed=0)  # before the group forms, as the engine does
    dist = init_distributed(on_gpu=False)
    if dist.world_size > 1:
        start_orphan_watchdog()  # a timed-out torchrun must not leave a rank waiting
    results = {"full": run_full(model, dist, out), "lora": run_lora(model, dist, out)}
    if dist.is_main:
        torch.save(results, out)
    dist.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # Like `python -m ajet.engine`: skip the interpreter's teardown of torch (seconds).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
