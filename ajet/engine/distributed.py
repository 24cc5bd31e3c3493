"""Several engine processes under `torchrun`: who is rank 0, DDP, and the few collectives.

`torchrun --nproc_per_node=N -m ajet.engine ...` starts N copies of the engine; each
finds its `RANK`, `WORLD_SIZE` and `LOCAL_RANK` in the environment. Rank 0 owns the
episode plane (private channel, generation), the metrics line and the checkpoints;
every rank holds a replica of the policy and trains on its share of each batch.

Gradients go through `torch.nn.parallel.DistributedDataParallel` (`Dist.data_parallel`;
NCCL on GPUs, gloo on CPU) with its built-in reduction, the mean over the ranks. Each
rank's loss is its share of the whole batch's loss (normalised by the batch's token
count) and is scaled by the world size before backward, so the mean DDP takes is the
sum over the ranks: the gradient of the whole batch, exactly as in one process. (A
Python communication hook summing instead was tried and dropped: its future callback
needs the GIL on gloo's worker thread, and a rank deadlocked when DDP was freed.) Besides DDP the engine needs a few
collectives, all behind `Dist`: broadcast a Python object from rank 0 (the step's batch,
or "stop"), sum a few floats (metrics), the largest of one integer (the step's
micro-batch count, so every rank runs as many backward passes as DDP expects), and
gather one object per rank (each rank's `ajet.__file__`). With one process `Dist` does
them locally without touching torch.distributed and never wraps the model in DDP, so
the single-process engine has no "am I distributed?" branches and no DDP overhead (the
null object of nanochat's `DummyWandb`).
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
from torch.nn.parallel import DistributedDataParallel

__all__ = ["Dist", "init_distributed", "start_orphan_watchdog"]

log = logging.getLogger(__name__)

#: DDP wrappers are never freed: freeing one with gloo can deadlock the rank (the
#: Reducer's destructor joins gloo's worker thread while holding the GIL, and that thread
#: may need the GIL to release its last tensors; seen about one run in six here). The
#: engine leaves with `os._exit` (`ajet/engine/__main__.py`), so they die with it.
_LIVE_UNTIL_EXIT: list[torch.nn.Module] = []

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

    def max_int(self, value: int, device: torch.device) -> int:
        """The largest `value` over the ranks."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
        return int(t.item())

    def data_parallel(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module` wrapped in DDP (gradients averaged over the ranks); `module` itself alone.

        Call it on every rank at the same point (the constructor broadcasts rank 0's
        parameters and buffers). Train through the wrapper; generate and save through
        `module`, which the wrapper shares (`ddp.module is module`).
        """
        if not self.active:
            return module
        on_gpu = next(module.parameters()).device.type == "cuda"
        ddp = DistributedDataParallel(
            module, device_ids=[self.local_rank] if on_gpu else None,
            # a micro-batch may leave parameters unused (mixture-of-experts routing); their
            # gradient then counts as 0 on that rank instead of DDP failing the next step
            find_unused_parameters=True)
        _LIVE_UNTIL_EXIT.append(ddp)
        return ddp

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
