"""Row 2: a one-file code change synced with `force_restart` until the engine is ROLLING
again on the new snapshot, against the floor of importing torch and loading the model.

    python -m bench --only restart

The measured path is what a user waits for: edit one file of the 150-file tree, call
`push_code(tree, force_restart=True)` (package, manifest, upload,
commit, stop the running engine, start a new one on the snapshot), then poll
`engine_status()` until ENGINE.ROLLING with the new snapshot id and a new run id.

The floor is a bare interpreter doing only what no engine start can avoid:
`import torch, transformers` and loading the already built ajet-tiny checkpoint with the
engine's own loader (`ajet.engine.policy.load_policy`), timed from spawn to exit. Target:
at most 1.3 times the floor. Floor and restart alternate, so drift on a shared machine
hits both alike.

Also reported (DESIGN "Budgets"): the engine's resident memory once ROLLING with
ajet-tiny (< 600 MB), next to the floor process's RSS once it has loaded the model.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ajet.client import SwarmClient
from ajet.protocol import EngineStatus
from bench.context import BenchContext
from bench.harness import (
    STANDBY_ON,
    LocalServer,
    child_env,
    rss_mb,
    tiny_job,
    wait_rolling_on,
)
from bench.report import Row
from bench.tree import BenchTree, edit_one_file, restore_tree

__all__ = ["Restart", "floor_once", "restart_once", "run", "start_rolling"]

RERUN = "python -m bench --only restart"
TARGET_RATIO = 1.3
ENGINE_RSS_BUDGET_MB = 600.0

# Prints the process's RSS in MiB once loaded (not ru_maxrss: Linux carries that over
# from the parent across exec, so it would report the benchmark process's peak).
_FLOOR_CODE = """
import sys
from pathlib import Path
import torch, transformers
from ajet.engine.policy import load_policy
load_policy(Path(sys.argv[1]), device="cpu", dtype="float32", seed=0)
import psutil
print(psutil.Process().memory_info().rss / 2**20)
"""


def floor_once(model_dir: Path) -> tuple[float, float]:
    """(seconds from spawn to exit, RSS MiB once loaded) of the import-and-load floor."""
    env = child_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _FLOOR_CODE, str(model_dir)], env=env,
                         capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"the floor process failed:\n{out.stderr[-2000:]}")
    return elapsed, float(out.stdout.strip().splitlines()[-1])


def _tiny_dir(workdir: Path) -> Path:
    found = sorted((workdir / "models" / "ajet-tiny").glob("seed*/config.json"))
    if not found:
        raise RuntimeError(f"no ajet-tiny checkpoint under {workdir}/models after a start")
    return found[0].parent


def start_rolling(client: SwarmClient, tree: BenchTree) -> EngineStatus:
    """Sync `tree`, configure ajet-tiny, start the engine; return once it is ROLLING."""
    first = client.push_code(tree.root)
    client.submit_config(tiny_job())
    client.start_run()
    return wait_rolling_on(client, first.snapshot_id, previous_run=None)  # builds ajet-tiny


@dataclass(frozen=True)
class Restart:
    total_s: float  # from the sync call until ROLLING on the new snapshot
    sync_s: float  # until the sync call returned (upload, stop, spawn of the new engine)
    status: EngineStatus  # the engine's status once ROLLING


def restart_once(client: SwarmClient, tree: BenchTree, marker: str, *,
                 previous: EngineStatus) -> Restart:
    """Edit one file, sync with force_restart, wait until ROLLING on the new snapshot."""
    edit_one_file(tree, marker)
    t0 = time.perf_counter()
    result = client.push_code(tree.root, force_restart=True)
    sync_s = time.perf_counter() - t0
    status = wait_rolling_on(client, result.snapshot_id, previous_run=previous.run_id)
    total_s = time.perf_counter() - t0
    if not result.restarted:
        raise RuntimeError("sync with force_restart=True did not restart the engine")
    return Restart(total_s=total_s, sync_s=sync_s, status=status)


def run(ctx: BenchContext) -> list[Row]:
    tree = ctx.tree
    restore_tree(tree)
    restart: list[float] = []
    sync_part: list[float] = []
    floor: list[float] = []
    floor_rss: list[float] = []
    engine_rss: list[float] = []
    # the warm standby on, as a server runs by default: the restart a user waits for
    with LocalServer(ctx.path("restart"), env=STANDBY_ON) as server, server.client() as client:
        status = start_rolling(client, tree)
        model_dir = _tiny_dir(server.workdir)
        for i in range(ctx.reps):
            done = restart_once(client, tree, f"restart {i}", previous=status)
            status = done.status
            restart.append(done.total_s)
            sync_part.append(done.sync_s)
            rss = rss_mb(status.pid)
            if rss is not None:
                engine_rss.append(rss)
            floor_s, floor_mb = floor_once(model_dir)
            floor.append(floor_s)
            floor_rss.append(floor_mb)
    restore_tree(tree)

    ratio = statistics.median(restart) / statistics.median(floor)
    rss = statistics.median(engine_rss) if engine_rss else float("nan")
    return [
        Row("sync + force_restart until ROLLING on the new snapshot", statistics.median(restart),
            "s", "floor: python -c 'import torch, transformers' + load ajet-tiny",
            statistics.median(floor), target=f"<= {TARGET_RATIO}x floor", rerun=RERUN,
            repetitions=ctx.reps, met=ratio <= TARGET_RATIO,
            note=f"one-file edit; the sync call returned after "
                 f"{statistics.median(sync_part):.2f} s (upload, stop, spawn), the rest is boot"),
        Row("engine RSS with ajet-tiny, ROLLING", rss, "MB", "floor process RSS",
            statistics.median(floor_rss), target=f"< {ENGINE_RSS_BUDGET_MB:.0f} MB",
            rerun=RERUN, repetitions=len(engine_rss), met=rss < ENGINE_RSS_BUDGET_MB),
    ]
