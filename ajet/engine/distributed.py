"""Several engine processes under `torchrun`: who is rank 0, and the few collectives used.

`torchrun --nproc_per_node=N -m ajet.engine ...` starts N copies of the engine; each
finds its `RANK`, `WORLD_SIZE` and `LOCAL_RANK` in the environment. Rank 0 owns the
episode plane (private channel, generation), the metrics line and the checkpoints;
every rank holds a replica of the policy and trains on its share of each batch.

The update needs four collectives, all behind `Dist`: broadcast a Python object from
rank 0 (the step's batch, or "stop"), sum a few floats (metrics), sum gradients, and
gather one object per rank (each rank's `ajet.__file__`). With one process `Dist` does
them locally without touching torch.distributed, so the single-process engine has no
"am I distributed?" branches (the null object of nanochat's `DummyWandb`).

Gradients are summed with one `all_reduce` per parameter after local accumulation
rather than by wrapping the model in DistributedDataParallel: ranks get whole task
groups, so their micro-batch counts differ from step to step, which DDP only supports
through `Join`; the reduced gradient is the same. Backend: NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

__all__ = ["Dist", "init_distributed", "start_orphan_watchdog"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Followers wait in a broadcast while rank 0 collects a step; that may take hours.
_COLLECTIVE_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's `obj` on every rank (others pass None)."""
        if not self.active:
            return obj  # type: ignore[return-value]
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def sum_floats(self, values: list[float], device: torch.device) -> list[float]:
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    def sum_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks (missing gradients count as 0)."""
        if not self.active:
            return
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            torch_dist.all_reduce(p.grad, op=torch_dist.ReduceOp.SUM)

    def sync_parameters(self, module: torch.nn.Module) -> None:
        """Make every replica start from rank 0's weights."""
        if not self.active:
            return
        for tensor in [*module.parameters(), *module.buffers()]:
            torch_dist.broadcast(tensor.data, src=0)

    def gather(self, obj: T) -> list[T]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch_dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.active and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def init_distributed(*, on_gpu: bool) -> Dist:
    """Join the process group `torchrun` set up, or return the single-process `Dist`."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(local_rank)
    torch_dist.init_process_group(backend=backend, timeout=_COLLECTIVE_TIMEOUT)
    log.info("rank %d of %d joined (%s, local rank %d)", rank, world_size, backend, local_rank)
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank)


def start_orphan_watchdog(interval_s: float = 0.5) -> None:
    """Exit when the parent (the torchrun agent) goes away.

    torchrun starts each rank in its own session, so a SIGKILL to the agent's process
    group does not reach the ranks; without this a killed agent would leave them behind.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                log.error("the torchrun agent (pid %d) is gone; exiting", parent)
                os._exit(3)

    threading.Thread(target=watch, name="ajet-orphan-watchdog", daemon=True).start()
