"""`bench/gpu_check_ranks.py` with rank 1's generation held back while it waits.

    python -m torch.distributed.run --nproc_per_node=2 --standalone --max_restarts=0 \\
        tests/bench/stall_probe.py --device cpu ... --model-dir DIR --workdir DIR

What an NCCL command wait would do to a follower's generator (its forwards queued
behind the wait until the command arrives), done by hand on CPU: rank 1 pauses its
generator as soon as it has submitted a rollout's requests. The check must fail and name
rank 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench.gpu_check_ranks as ranks  # noqa: E402

_submit = ranks.RankRollout.__init__


def held_back(self: Any, generator: Any, prompts: list[list[int]], max_new: int) -> None:
    if os.environ.get("RANK") == "1":
        generator.pause()
    _submit(self, generator, prompts, max_new)


ranks.RankRollout.__init__ = held_back  # type: ignore[method-assign]

if __name__ == "__main__":
    try:
        code = ranks.main()
    except Exception as exc:  # noqa: BLE001 - as the worker reports it
        print(f"GPU CHECK FAILED on rank {os.environ.get('RANK')}: {exc}", flush=True)
        code = 1
    sys.stdout.flush()
    os._exit(code)
