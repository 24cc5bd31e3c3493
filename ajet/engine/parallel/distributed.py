"""Several engine processes under `torchrun`: who is rank 0, FSDP2, and the few collectives.

`torchrun --nproc_per_node=N -m ajet.engine ...` starts N copies of the engine; each
finds its `RANK`, `WORLD_SIZE` and `LOCAL_RANK` in the environment. Rank 0 owns the
episode plane (private channel, generation), the metrics line and the checkpoints;
every rank trains on its share of each batch.

The trained model is sharded with FSDP2 (`torch.distributed.fsdp.fully_shard`,
`Dist.shard`): one unit per decoder layer and one at the root (embeddings, final norm
and output head, so tied embeddings stay one parameter in one unit). Each rank keeps
1/N of the parameters, gradients and optimizer state; a unit's full weights exist only
while its forward or backward runs. On GPUs the mixed-precision policy is
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: fp32 master weights and
optimizer state, bf16 compute, gradients reduced in fp32. On CPU (gloo) it is fp32
throughout, through the same code. Gradients are reduce-scattered in every backward
(so they stay sharded while they accumulate over micro-batches) with FSDP's default
reduction, the mean over the ranks; each rank's loss is its share of the whole batch's
loss and is scaled by the world size before backward, so the mean is the sum: the
gradient of the whole batch, exactly as in one process.

Besides FSDP the engine needs a few collectives, all behind `Dist`: broadcast a Python
object from rank 0 (the step's batch, a checkpoint request, or "stop"), sum a few floats
(metrics), the largest of one integer (the step's micro-batch count, so every rank runs
as many forward and backward passes as FSDP's all-gathers expect), gather one object per
rank (each rank's `ajet.__file__`), full weights out of the shards (`full_state_dict` for
checkpoints, `copy_full_weights` for the inference model). With one process `Dist` does
them locally without touching torch.distributed and never shards the model, so the
single-process engine has no "am I distributed?" branches and no FSDP overhead (the
null object of nanochat's `DummyWandb`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Dist", "clip_grad_norm", "copy_full_weights", "init_distributed",
           "start_orphan_watchdog"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Followers wait in a broadcast while rank 0 collects a step; that may take hours.
_COLLECTIVE_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    #: where the shards live: "cuda" with NCCL, "cpu" with gloo (even on a GPU machine)
    device_type: str = "cpu"
    #: a process group even with one rank, so FSDP2 and the collectives run through
    #: torch.distributed (`bench/gpu_check.py` exercises FSDP2 and NCCL on one GPU);
    #: otherwise one process never shards
    single_rank_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1 or self.single_rank_group

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

    def shard(self, root: nn.Module, units: list[nn.Module], *,
              param_dtype: torch.dtype | None = None) -> nn.Module:
        """FSDP2 over `units` (the decoder layers) and `root`; `root` itself alone.

        Call it on every rank at the same point, with the same weights on every rank
        (each rank keeps its own slice). `param_dtype` is the compute dtype when it
        differs from the stored one (bf16 over fp32 masters on GPUs); gradients are then
        reduced in fp32. Create the optimizer afterwards: sharding replaces the
        parameters with `DTensor`s.
        """
        if not self.active:
            return root
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # an explicit mesh: fully_shard's default picks CUDA whenever it is available
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                      reduce_dtype=torch.float32 if param_dtype else None)
        for unit in units:
            fully_shard(unit, mesh=mesh, mp_policy=policy)
        # the root last; it moves whatever is left (embeddings, head) to the mesh's device
        fully_shard(root, mesh=mesh, mp_policy=policy)
        return root

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict on CPU on rank 0, `{}` on the others.

        Collective under FSDP: every rank calls it. Memory: the whole model in its stored
        dtype in rank 0's host memory while the caller holds the dict.
        """
        if not self.active:
            return {k: v.detach().cpu() for k, v in module.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))

    def barrier(self) -> None:
        if self.active:
            torch_dist.barrier()

    def gather(self, obj: T) -> list[T]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch_dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.active and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


def copy_full_weights(source: nn.Module, target: nn.Module | None, *,
                      trainable_only: bool = False) -> None:
    """Copy `source`'s weights, gathered whole if sharded, into `target` (by name).

    The one way to get full (unsharded) weights for inference out of the trained model:
    `target` is a plain module of the same architecture (any dtype, any device); ranks
    without one pass None. Collective when `source` is sharded: every rank calls it, in
    the same order. One parameter is gathered at a time, so the extra memory is that of
    the largest parameter (the embedding). `trainable_only` skips frozen parameters
    (LoRA: only the adapters change in an update). `source is target` does nothing.
    """
    if source is target:
        return
    targets = dict(target.named_parameters()) if target is not None else {}
    with torch.no_grad():
        for name, param in source.named_parameters():
            if trainable_only and not param.requires_grad:
                continue
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if target is not None:
                targets[name].copy_(full)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm_` whose norm is over the whole model, sharded or not."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):  # sharded gradients: the norm is a DTensor, reduced here
        norm = norm.full_tensor()
    return float(norm)


def init_distributed(*, on_gpu: bool, single_rank_group: bool = False) -> Dist:
    """Join the process group `torchrun` set up, or return the single-process `Dist`.

    `single_rank_group` makes a one-process group of one rank instead (on a free local
    port unless MASTER_ADDR/MASTER_PORT are set), so that FSDP2 shards over it.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 and not single_rank_group:
        return Dist()
    if world_size <= 1:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(local_rank)
    torch_dist.init_process_group(backend=backend, timeout=_COLLECTIVE_TIMEOUT)
    log.info("rank %d of %d joined (%s, local rank %d)", rank, world_size, backend, local_rank)
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank,
                device_type="cuda" if on_gpu else "cpu",
                single_rank_group=world_size <= 1)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
