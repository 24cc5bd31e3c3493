"""One learner update on a batch whose task groups split unevenly over the ranks.

    python tests/ajet/engine/ddp_probe.py <workdir> <out.pt>            # one process
    python -m torch.distributed.run --nproc_per_node=2 --standalone \\
        tests/ajet/engine/ddp_probe.py <workdir> <out.pt>               # two gloo ranks

Two epochs with micro-batches of 2 and a KL reference: with 2 ranks, rank 0 gets three
groups (5 micro-batches), rank 1 one group (1 micro-batch, then 4 zero-weight ones), so
DDP's `no_sync` accumulation and the padding both run. Rank 0 saves the trained
parameters (flattened) and the `UpdateStats` of each update for the test to compare.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import engine_config_from_job
from ajet.engine.distributed import init_distributed, start_orphan_watchdog
from ajet.engine.learner import Learner, TrainSample
from ajet.engine.policy import load_policy
from ajet.engine.tiny import ensure_tiny_model

#: (task group, completions): groups 0, 2, 4 fall to rank 0 and group 1 to rank 1
GROUPS = [(0, 3), (1, 1), (2, 3), (4, 3)]


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


def main(workdir: Path, out: Path) -> None:
    torch.set_num_threads(1)
    dist = init_distributed(on_gpu=False)
    if dist.world_size > 1:
        start_orphan_watchdog()  # a timed-out torchrun must not leave a rank waiting
    policy = load_policy(ensure_tiny_model(workdir, seed=0), device="cpu", dtype="float32",
                         seed=0)
    job = AgentJetJob(lr=0.01, ppo_epochs=2, kl_coef=0.1)
    cfg = dataclasses.replace(engine_config_from_job(job, cuda_devices=0, cpu_count=1),
                              micro_batch_size=2)
    learner = Learner(policy, cfg, dist)
    stats = [dataclasses.asdict(learner.update(batch(seed))) for seed in (5, 6)]
    if dist.is_main:
        flat = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
        torch.save({"parameters": flat, "stats": stats}, out)
    dist.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
    # Like `python -m ajet.engine`: leave without the interpreter's teardown, which would
    # free the DDP wrapper the engine keeps alive (see `distributed._LIVE_UNTIL_EXIT`).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
