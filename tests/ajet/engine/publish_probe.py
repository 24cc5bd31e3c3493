"""Bucketed bf16 publication out of FSDP2 shards, on two gloo ranks.

    python -m torch.distributed.run --nproc_per_node=2 --standalone \\
        tests/ajet/engine/publish_probe.py <out.json>

A module whose parameters split unevenly over two ranks (5 rows, 1 row: rank 1's chunk
is empty, a 1-D bias, a 3-D tensor) is sharded with `fully_shard` (fp32), then published
into a bf16 copy with several bucket sizes. Every all-gather is recorded (dtype and
element count), so the test sees the cast happen before the gather. Rank 0 writes what it
found as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn

from ajet.engine.parallel import distributed
from ajet.engine.parallel.distributed import copy_full_weights, init_distributed


class Awkward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.five = nn.Parameter(torch.randn(5, 3))
        self.one = nn.Parameter(torch.randn(1, 4))
        self.bias = nn.Parameter(torch.randn(7))
        self.cube = nn.Parameter(torch.randn(3, 2, 2))
        self.frozen = nn.Parameter(torch.randn(2, 2), requires_grad=False)


def main(out: Path) -> None:
    torch.manual_seed(0)  # the same weights on every rank, as the engine loads them
    dist = init_distributed(on_gpu=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    source = Awkward()
    expected = {n: p.detach().clone().to(torch.bfloat16) for n, p in source.named_parameters()}
    fully_shard(source, mesh=init_device_mesh("cpu", (dist.world_size,)))
    calls: list[dict[str, Any]] = []

    def recording(real: Any) -> Any:
        def gather(output: torch.Tensor, tensor: torch.Tensor, **kwargs: Any) -> Any:
            calls.append({"dtype": str(tensor.dtype), "numel": tensor.numel()})
            return real(output, tensor, **kwargs)
        return gather

    for name in ("all_gather_single", "all_gather_into_tensor"):  # whichever torch has
        if hasattr(torch_dist, name):
            setattr(distributed.torch_dist, name, recording(getattr(torch_dist, name)))
    results: dict[str, Any] = {}
    for label, bucket in (("alone", 1), ("pairs", 40), ("one", 1 << 30)):
        calls.clear()
        target = Awkward().to(torch.bfloat16)
        published = copy_full_weights(source, target, bucket_bytes=bucket)
        equal = {n: torch.equal(p.detach(), expected[n]) for n, p in target.named_parameters()}
        results[label] = {"equal": equal, "calls": list(calls), "bytes": published.bytes,
                          "tensors": published.tensors}
    calls.clear()
    target = Awkward().to(torch.bfloat16)
    only = copy_full_weights(source, target, trainable_only=True)
    results["trainable_only"] = {"tensors": only.tensors,
                                 "frozen_equal": torch.equal(target.frozen.detach(),
                                                             expected["frozen"])}
    if dist.is_main:
        out.write_text(json.dumps(results))
    dist.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
