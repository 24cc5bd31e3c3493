"""Rows: sync + force_restart until ROLLING under the Ray launcher, against the local
launcher, measured in one run.

    python -m bench --only ray

A local Ray cluster of two raylets on this machine (`bench/ray_cluster.py`, started once
for the module; its start-up is in the note), one swarm server per launcher, the same
one-file edit synced with `force_restart` as in the `restart` row, timed until ROLLING on
the new snapshot:

- one process: the Ray launcher (a Ray job, a placement group of one bundle, one agent,
  the engine reached over TCP) against the local launcher (a subprocess, its Unix socket);
- two processes: two Ray nodes of one rank each (torchrun on each, gloo across them)
  against the local launcher's one node of two ranks (torchrun `--standalone`).

Ray's own share (the job's runtime_env setup, the driver's `ray.init`, the placement, the
agents' start) is what the ratio shows. At most 3 repetitions (a restart under Ray is tens
of seconds on two cores); restarts of the two launchers alternate, so drift hits both.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.bench_restart import restart_once
from bench.context import BenchContext
from bench.harness import LocalServer, tiny_job, wait_rolling_on
from bench.ray_cluster import local_ray_cluster
from bench.report import Row
from bench.tree import restore_tree

__all__ = ["run"]

RERUN = "python -m bench --only ray"
MAX_REPS = 3


def _rolling(server: LocalServer, tree_root: Path, job_fields: dict[str, int]):  # type: ignore[no-untyped-def]
    client = server.client(timeout=300)
    first = client.push_code(tree_root)
    client.submit_config(tiny_job(**job_fields))
    client.start_run()
    return client, wait_rolling_on(client, first.snapshot_id, previous_run=None, timeout=600)


def run(ctx: BenchContext) -> list[Row]:
    tree = ctx.tree
    reps = max(1, min(ctx.reps, MAX_REPS))
    rows: list[Row] = []
    with local_ray_cluster(2) as cluster:
        shapes = [("one process", {"n_proc": 1}, {"n_proc": 1}),
                  ("two processes", {"n_proc": 1, "nnodes": 2}, {"n_proc": 2})]
        for label, ray_job, local_job in shapes:
            restore_tree(tree)
            times: dict[str, list[float]] = {"ray": [], "local": []}
            servers = {
                "ray": LocalServer(ctx.path(f"ray-{label}"), env={
                    "AJET_SWARM_LAUNCHER": "ray", "AJET_SWARM_RAY_ADDRESS": cluster.dashboard_url}),
                "local": LocalServer(ctx.path(f"local-{label}")),
            }
            with servers["ray"] as ray_server, servers["local"] as local_server:
                ray_client, ray_status = _rolling(ray_server, tree.root, ray_job)
                local_client, local_status = _rolling(local_server, tree.root, local_job)
                try:
                    for i in range(reps):
                        done = restart_once(ray_client, tree, f"ray {label} {i}",
                                            previous=ray_status)
                        ray_status = done.status
                        times["ray"].append(done.total_s)
                        done = restart_once(local_client, tree, f"local {label} {i}",
                                            previous=local_status)
                        local_status = done.status
                        times["local"].append(done.total_s)
                finally:
                    ray_client.close()
                    local_client.close()
            rows.append(Row(
                f"sync + force_restart until ROLLING, Ray launcher, {label}"
                + (" on 2 Ray nodes" if "nnodes" in ray_job else ""),
                statistics.median(times["ray"]), "s",
                f"the local launcher, {label}" + (" on 1 node" if "nnodes" in ray_job else ""),
                statistics.median(times["local"]), target="", rerun=RERUN, repetitions=reps,
                note=f"local 2-raylet Ray cluster (started in {cluster.startup_s:.1f} s, once); "
                     "the warm standby off for both"))
    restore_tree(tree)
    return rows
