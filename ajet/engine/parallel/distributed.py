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
rank (each rank's code id and generation endpoint), full weights out of the shards
(`full_state_dict` for checkpoints, `copy_full_weights` for the inference model). With
one process `Dist` does them locally without touching torch.distributed and never
shards the model, so the single-process engine has no "am I distributed?" branches and
no FSDP overhead (the null object of nanochat's `DummyWandb`).

Three process groups. The default group (NCCL on GPUs, gloo on CPU) carries tensors only:
FSDP's all-gathers and reduce-scatters, the publication, the checkpoint gathers. Its
timeout (`collective_timeout_min`, 30 minutes) is sized for the longest real collective,
and NCCL's async error handling tears a rank down when one fails or times out. Every
control message (rank 0's commands and batches, the metric sums, the micro-batch count,
the boot gathers) goes over a second, CPU group (gloo, `Dist.control`) with a long
timeout: a follower waits there for rank 0's next command for as long as rank 0 takes to
collect a step. Had that wait been an NCCL broadcast, it would sit on the follower's
device stream, and the follower's own generator, whose forwards run on the same stream,
would queue behind it until the batch was complete. The third, also gloo, carries only
the planning collectives of checkpoints written in the background
(`Dist.checkpoint_group`, `checkpoints.py`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["CONTROL_TIMEOUT", "DEFAULT_COLLECTIVE_TIMEOUT_S", "PUBLISH_BUCKET_BYTES", "Dist",
           "Publication", "average_over_ranks", "clip_grad_norm", "copy_full_weights", "gather_full_weights",
           "group_store", "init_distributed", "start_orphan_watchdog"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Rank 0's command path: a follower waits here while rank 0 collects a step, which may
#: take hours (the CPU group only; tensor collectives have `collective_timeout_s`).
CONTROL_TIMEOUT = timedelta(hours=24)
#: The default for tensor collectives (the job's `collective_timeout_min`).
DEFAULT_COLLECTIVE_TIMEOUT_S = 30 * 60.0


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
    #: the CPU (gloo) group of every control message; None only when not `active`
    control: Any = field(default=None, compare=False, repr=False)
    #: the CPU (gloo) group of background checkpoint writes (`checkpoints.py`): their
    #: planning collectives run on a writer thread while the main thread trains, so they
    #: get a group of their own (two threads on one group could interleave differently on
    #: different ranks); None only when not `active`
    checkpoint_group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1 or self.single_rank_group

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's `obj` on every rank (others pass None), over the CPU group."""
        if not self.active:
            return obj  # type: ignore[return-value]
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[return-value]

    def sum_floats(self, values: list[float], device: object = None) -> list[float]:
        """The sums over the ranks (the CPU group: the values are host floats already).

        `device` is not used: callers once put these tensors on the model's device.
        """
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM, group=self.control)
        return [float(v) for v in t.tolist()]

    def max_int(self, value: int, device: object = None) -> int:
        """The largest `value` over the ranks (the CPU group; `device` is not used)."""
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=self.control)
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
            torch_dist.barrier(group=self.control)

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, over the CPU group."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch_dist.all_gather_object(out, obj, group=self.control)
        return out

    def close(self) -> None:
        if self.active and torch_dist.is_initialized():
            torch_dist.destroy_process_group()


#: Bytes of full (gathered) weights per publication collective: parameters are gathered
#: in buckets of about this size (a larger parameter goes alone), so a 7B model takes a
#: few dozen calls instead of one per parameter, and the extra device memory while
#: publishing is one bucket (plus one parameter being unpacked).
PUBLISH_BUCKET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Publication:
    """What one publication of full weights did (the step metrics' `publish_*` fields)."""

    #: wall time of the gather and the copy
    seconds: float = 0.0
    #: bytes of full weights produced, in the dtype they were gathered in
    bytes: int = 0
    #: parameters published
    tensors: int = 0


def gather_full_weights(named: Iterable[tuple[str, torch.Tensor]], *,
                        dtype: Callable[[str, torch.Tensor], torch.dtype] | torch.dtype | None
                        = None, bucket_bytes: int = PUBLISH_BUCKET_BYTES,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each `(name, full tensor)` of `named`, gathered whole if it is an FSDP2 shard.

    The building block of every "full weights out of the shards" path (the inference
    copy, a shared LoRA base, a bf16 export). Collective when anything is sharded: every
    rank iterates it to the end, over the same names in the same order, with the same
    dtypes. `dtype` (one dtype, or a function of the name and the source tensor) is the
    dtype each tensor is gathered in: a shard is cast *before* the all-gather, so a bf16
    publication of fp32 masters moves half the bytes; None keeps the stored dtype.

    Dim-0 shards (FSDP2's `Shard(0)` on a 1-D mesh, torch.chunk's split) are packed into
    one buffer per bucket of about `bucket_bytes` full bytes, each rank's chunk padded to
    the longest one, and gathered with one flat all-gather; anything else
    (another placement, a plain tensor) is taken one tensor at a time. A yielded tensor
    may be a view of the bucket's buffer: use or copy it before asking for the next one.
    """
    def dtype_of(name: str, tensor: torch.Tensor) -> torch.dtype:
        if dtype is None:
            return tensor.dtype
        return dtype if isinstance(dtype, torch.dtype) else dtype(name, tensor)

    bucket: list[tuple[str, DTensor]] = []
    bucket_key: tuple[Any, torch.dtype] | None = None
    filled = 0
    for name, tensor in named:
        want = dtype_of(name, tensor)
        if not _dim0_sharded(tensor):
            yield from _gather_bucket(bucket, bucket_key)
            bucket, bucket_key, filled = [], None, 0
            if isinstance(tensor, DTensor):  # another layout: its own gather, cast first
                yield name, tensor.detach().to(want).full_tensor()
            else:
                yield name, tensor.detach().to(want)
            continue
        assert isinstance(tensor, DTensor)
        key = (tensor.device_mesh.get_group(), want)
        size = tensor.numel() * want.itemsize
        if bucket and (key != bucket_key or filled + size > bucket_bytes):
            yield from _gather_bucket(bucket, bucket_key)
            bucket, filled = [], 0
        bucket.append((name, tensor))
        bucket_key = key
        filled += size
    yield from _gather_bucket(bucket, bucket_key)


def _dim0_sharded(tensor: torch.Tensor) -> bool:
    return (isinstance(tensor, DTensor) and tensor.device_mesh.ndim == 1
            and tuple(tensor.placements) == (Shard(0),) and tensor.dim() > 0)


def _gather_bucket(bucket: list[tuple[str, DTensor]], key: tuple[Any, torch.dtype] | None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """One all-gather for a bucket of dim-0 shards; their full tensors, in order."""
    if not bucket or key is None:
        return
    group, want = key
    world = bucket[0][1].device_mesh.size()
    # each parameter's slot: its largest chunk (torch.chunk: ceil(rows / world) rows),
    # so every rank sends the same number of elements; rank r's rows start at r * chunk
    slots = []
    offset = 0
    for _name, param in bucket:
        rows = param.shape[0]
        chunk = -(-rows // world)
        row_numel = param.numel() // rows if rows else 0
        slots.append((offset, chunk, row_numel))
        offset += chunk * row_numel
    local0 = bucket[0][1].to_local()
    send = torch.empty(offset, dtype=want, device=local0.device)  # (S,): padding unread
    for (_name, param), (start, _chunk, _row) in zip(bucket, slots, strict=True):
        local = param.to_local().detach()
        send[start:start + local.numel()].copy_(local.reshape(-1))  # the cast happens here
    received = torch.empty(world * offset, dtype=want, device=local0.device)  # (N * S,)
    # torch 2.13 renamed all_gather_into_tensor (the old name warns); older ones lack it
    gather = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
    gather(received, send, group=group)
    del send
    by_rank = received.view(world, offset)  # (N, S)
    for (name, param), (start, chunk, row_numel) in zip(bucket, slots, strict=True):
        rows = param.shape[0]
        # (N, chunk * row) -> (N * chunk, *rest): rank-ordered chunks; the padding is the tail
        full = by_rank[:, start:start + chunk * row_numel].reshape(
            world * chunk, *param.shape[1:])[:rows]
        yield name, full


def average_over_ranks(flat: torch.Tensor) -> None:
    """In place: a tensor's mean over the ranks (replicated gradients), on the tensor
    group, named: NCCL on GPUs carries tensors, never a control message."""
    torch_dist.all_reduce(flat, group=torch_dist.group.WORLD)
    flat /= torch_dist.get_world_size()


def copy_full_weights(source: nn.Module, target: nn.Module | None, *,
                      trainable_only: bool = False, dtype: torch.dtype | None = None,
                      bucket_bytes: int = PUBLISH_BUCKET_BYTES) -> Publication:
    """Copy `source`'s weights, gathered whole if sharded, into `target` (by name).

    The one way to get full (unsharded) weights for inference out of the trained model:
    `target` is a plain module of the same architecture (any dtype, any device). Each
    weight is gathered in `dtype`, else in the target parameter's dtype (bf16 for a bf16
    inference copy of fp32 masters: the shards are cast before the gather), else in its
    own; ranks without a target pass None and then must pass `dtype` (every rank gathers
    in the same dtype). Collective when `source` is sharded: every rank calls it, in the
    same order; parameters go in buckets of about `bucket_bytes` (`gather_full_weights`).
    `trainable_only` skips frozen parameters (LoRA: only the adapters change in an
    update). `source is target` does nothing. Returns what was published.
    """
    if source is target:
        return Publication()
    start = time.perf_counter()
    targets = dict(target.named_parameters()) if target is not None else {}

    def dtype_of(name: str, tensor: torch.Tensor) -> torch.dtype:
        if dtype is not None:
            return dtype
        return targets[name].dtype if name in targets else tensor.dtype

    named = [(n, p) for n, p in source.named_parameters()
             if not (trainable_only and not p.requires_grad)]
    total = tensors = 0
    with torch.no_grad():
        for name, full in gather_full_weights(named, dtype=dtype_of, bucket_bytes=bucket_bytes):
            total += full.numel() * full.element_size()
            tensors += 1
            if target is not None:
                targets[name].copy_(full)
    return Publication(seconds=time.perf_counter() - start, bytes=total, tensors=tensors)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """`clip_grad_norm_` whose norm is over the whole model, sharded or not."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):  # sharded gradients: the norm is a DTensor, reduced here
        norm = norm.full_tensor()
    return float(norm)


def init_distributed(*, on_gpu: bool, single_rank_group: bool = False,
                     collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> Dist:
    """Join the process group `torchrun` set up, or return the single-process `Dist`.

    The default group (NCCL on GPUs, gloo on CPU) waits `collective_timeout_s` in a
    tensor collective; the control group (gloo) made next to it waits `CONTROL_TIMEOUT`.
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
        # A failed or timed-out NCCL collective tears the process down without aborting
        # the communicators first (an abort can itself hang on a broken peer).
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        torch.cuda.set_device(local_rank)
    torch_dist.init_process_group(backend=backend,
                                  timeout=timedelta(seconds=collective_timeout_s))
    # The CPU group of every control message (see the module docstring). new_group is
    # collective: every rank makes it, right after the default group.
    control = torch_dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    # torch.distributed.checkpoint.async_save needs a CPU group; a save's collectives
    # wait at most as long as a tensor collective
    checkpoint_group = torch_dist.new_group(backend="gloo",
                                            timeout=timedelta(seconds=collective_timeout_s))
    log.info("rank %d of %d joined (%s for tensors, %s timeout; gloo for control, "
             "local rank %d)", rank, world_size, backend,
             timedelta(seconds=collective_timeout_s), local_rank)
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank,
                device_type="cuda" if on_gpu else "cpu",
                single_rank_group=world_size <= 1, control=control,
                checkpoint_group=checkpoint_group)


def group_store() -> Any:
    """The default process group's key-value store (torchrun's agent hosts it).

    torch exposes no public getter; `_get_default_store` has been there since torch 1.x.
    """
    return torch_dist.distributed_c10d._get_default_store()


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
