"""One of two ranks with the `nccl` backend configured, on a machine without GPUs.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/ajet/engine/control_probe.py <out.json>

`init_distributed(on_gpu=True)` runs as on a GPU host, except that the default group's
backend is torch's fake process group where NCCL was asked for (its collectives return at
once and move no data) and `torch.cuda.set_device` does nothing. The rendezvous store is
a real TCPStore across both processes, so the gloo group made next to the default one is
real. Whatever crosses between the ranks here therefore went over the CPU group: a
command sent over the default group would arrive as None. Rank 1 runs the followers' real
command loop (`trainer.follow`) on a stand-in learner; each rank writes what it saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

from ajet.engine.learner import TrainSample, UpdateStats
from ajet.engine.parallel import distributed
from ajet.engine.trainer import follow

SAMPLES = [TrainSample((1, 2), (3,), (-0.5,), 1.0, group=0),
           TrainSample((4,), (5, 6), (-0.1, -0.2), -1.0, group=1)]


class RecordingLearner:
    def __init__(self) -> None:
        self.batches: list[list[TrainSample]] = []

    def update(self, samples: list[TrainSample]) -> UpdateStats:
        self.batches.append(list(samples))
        return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0, len(samples), 0.0)


def main(out: Path) -> None:
    asked: dict[str, Any] = {}
    real_init = torch_dist.init_process_group

    def init(backend: str, **kwargs: Any) -> None:
        asked.update(backend=backend, timeout_s=kwargs["timeout"].total_seconds())
        if backend == "nccl":
            # init_process_group would give the fake group a FakeStore, on which the gloo
            # group cannot rendezvous: the real TCPStore torchrun's env:// would make
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                        world, is_master=rank == 0, timeout=kwargs["timeout"])
            kwargs.update(rank=rank, world_size=world, store=store)
            backend = "fake"
        real_init(backend, **kwargs)

    groups: list[dict[str, Any]] = []
    real_new_group = torch_dist.new_group

    def new_group(**kwargs: Any) -> Any:
        groups.append({"backend": kwargs.get("backend"),
                       "timeout_s": kwargs["timeout"].total_seconds()})
        return real_new_group(**kwargs)

    torch_dist.init_process_group = init  # type: ignore[assignment]
    torch_dist.new_group = new_group  # type: ignore[assignment]
    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    dist = distributed.init_distributed(on_gpu=True)
    found: dict[str, Any] = {
        "asked": asked,
        "default_backend": str(torch_dist.get_backend()),
        "control_backend": str(torch_dist.get_backend(dist.control)),
        "groups": groups,
        "device_type": dist.device_type,
        "async_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
        "gathered": dist.gather((dist.rank, f"endpoint-{dist.rank}")),
        "max_int": dist.max_int(dist.rank + 5),
        "sum_floats": dist.sum_floats([dist.rank + 1.0, 0.5]),
    }
    if dist.rank == 0:
        dist.broadcast(("train", SAMPLES))
        dist.broadcast(("train", SAMPLES[:1]))
        dist.broadcast(("stop", None))
    else:
        learner = RecordingLearner()
        found["steps"] = follow(learner, dist,  # type: ignore[arg-type]
                                run_dir=out.parent, run_id="probe")
        found["batches"] = [[list(s.response_ids) for s in b] for b in learner.batches]
    out.write_text(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
