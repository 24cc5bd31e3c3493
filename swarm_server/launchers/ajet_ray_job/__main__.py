"""`python -m ajet_ray_job`: the driver of one engine run's Ray job.

The swarm server submits it with the run's spec in `$AJET_RAY_RUN_SPEC` (`wire.SPEC_ENV`).
It:

1. checks that the cluster has `nnodes` nodes each with a bundle's resources free, and
   reserves one bundle per node in a `STRICT_SPREAD` placement group (`SPREAD` may put two
   bundles on one node); if it cannot, it prints a `refused` marker saying what is free
   and exits 3 (nothing was started);
2. starts one `NodeAgent` per bundle, which runs that node's torchrun; the rendezvous is
   a free port on node 0's address; prints `placed` with every node's torchrun;
3. forwards every node's output (prefixed with node and rank) to its own stdout, which is
   the job's log the server reads, and the `channel` marker once rank 0 serves;
4. ends the run on SIGTERM (the server's stop: Ray's `stop_job`), on the end of any node's
   torchrun, or on the loss of a node's agent: every other node is terminated (TERM, the
   run's grace, KILL), the placement group removed, and an `exit` marker names the node
   and rank that ended it. Its exit code is that node's torchrun's (0 after a stop).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .agent import NodeAgent
from .verdict import verdict, where
from .wire import SPEC_ENV, marker

#: A drain slower than this means the agent's node is gone or wedged.
_DRAIN_TIMEOUT_S = 60.0
#: How often the driver collects the nodes' output.
_POLL_S = 0.2
#: Grace for the other nodes once one node's torchrun has ended by itself.
_AFTER_FAILURE_GRACE_S = 5.0
#: Exit code when the run could not be placed.
REFUSED = 3


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _fmt(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU", "memory")
             or not (k.startswith("node:") or k.startswith("accelerator_type")
                     or k == "object_store_memory")}
    parts = []
    for key, value in sorted(shown.items()):
        parts.append(f"{key} {value / 2**30:.1f} GiB" if key == "memory" else f"{key} {value:g}")
    return ", ".join(parts) or "nothing"


def _free_per_node() -> list[tuple[str, str, dict[str, float]]]:
    """(node id, address, free resources) of each alive node."""
    try:  # Ray has no public per-node view of free resources; the cluster's totals are
        # public (ray.nodes) and used when this private one moves
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # noqa: BLE001
        free = {}
    out = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        out.append((node_id, node.get("NodeManagerAddress", "?"),
                    dict(free.get(node_id, node.get("Resources", {})))))
    return out


def _holds(resources: dict[str, float], bundle: dict[str, float]) -> bool:
    """Whether a node with `resources` holds one bundle."""
    return all(resources.get(k, 0.0) >= v for k, v in bundle.items())


def _could_ever_hold(bundle: dict[str, float], nnodes: int) -> bool:
    """Whether the alive nodes' total resources (everything free) could hold the run."""
    totals = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    return sum(_holds(t, bundle) for t in totals) >= nnodes


def _capacity_problem(bundle: dict[str, float], nnodes: int) -> str | None:
    nodes = _free_per_node()
    fitting = [n for n in nodes if _holds(n[2], bundle)]
    if len(fitting) >= nnodes:
        return None
    free = "; ".join(f"node {node_id[:8]} ({addr}): {_fmt(res)}" for node_id, addr, res in nodes)
    return (f"the Ray cluster cannot hold this run: it needs {nnodes} node(s) each with "
            f"{_fmt(bundle)} free (one bundle per node, STRICT_SPREAD), and {len(fitting)} of "
            f"its {len(nodes)} alive node(s) have that; free now: {free or 'no node'}")


def _forward(states: list[dict[str, Any]]) -> None:
    out = []
    for i, state in enumerate(states):
        if state["dropped"]:
            out.append(f"[node {i}] ({state['dropped']} line(s) dropped: the log came faster "
                       "than it was read)")
        out.extend(state["lines"])
    if out:
        sys.stdout.write("\n".join(out) + "\n")
        sys.stdout.flush()


def main() -> int:
    spec = json.loads(os.environ.pop(SPEC_ENV))
    stopping = threading.Event()
    # the agents' lines reach us through drain(), so Ray's own forwarding stays off
    ray.init(log_to_driver=False)
    # after ray.init, which installs a SIGTERM handler that ends the driver at once: the
    # stop must instead end every node within the run's grace
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    nnodes = int(spec["nnodes"])
    bundle: dict[str, float] = {"CPU": float(spec["bundle_cpus"])}
    if spec["n_gpu"] > 0:
        bundle["GPU"] = float(spec["n_gpu"])
    problem = _capacity_problem(bundle, nnodes)
    if problem is not None:
        # `never`: not even an idle cluster of these nodes holds it (the server refuses it
        # instead of queueing it)
        _say(marker("refused", reason=problem, never=not _could_ever_hold(bundle, nnodes)))
        return REFUSED
    pg = placement_group([dict(bundle) for _ in range(nnodes)], strategy="STRICT_SPREAD",
                         name=f"ajet-{spec['run_id']}")
    try:
        if not pg.wait(float(spec["placement_timeout_s"])):
            again = _capacity_problem(bundle, nnodes) or (
                f"the placement group was not ready within {spec['placement_timeout_s']:g} s")
            _say(marker("refused", reason=again, never=not _could_ever_hold(bundle, nnodes)))
            return REFUSED
        return _run(spec, pg, bundle, stopping)
    finally:
        remove_placement_group(pg)


def _run(spec: dict[str, Any], pg: Any, bundle: dict[str, float],
         stopping: threading.Event) -> int:
    nnodes = int(spec["nnodes"])
    actor = ray.remote(NodeAgent)
    agents = [actor.options(  # type: ignore[attr-defined]
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=4,
        max_restarts=0, name=f"ajet-{spec['run_id']}-node{i}",
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=i)).remote(i, spec) for i in range(nnodes)]
    infos = ray.get([a.describe.remote() for a in agents], timeout=_DRAIN_TIMEOUT_S)
    port = ray.get(agents[0].free_port.remote(), timeout=_DRAIN_TIMEOUT_S)
    try:
        started = ray.get([a.start.remote(infos[0]["ip"], port) for a in agents],
                          timeout=_DRAIN_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - one node could not start: end the others
        _terminate(agents, 5.0)
        _say(marker("exit", code=1, detail=f"could not start every node: {exc}", stopped=False))
        return 1
    _say(marker("placed", nodes=[{**info, **st} for info, st in zip(infos, started)]))
    channel_sent = False
    while True:
        try:
            states = ray.get([a.drain.remote() for a in agents], timeout=_DRAIN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - an agent (its node) is gone
            lost = _lost_nodes(agents, infos, int(spec["nproc_per_node"]))
            _terminate(agents, _AFTER_FAILURE_GRACE_S)
            detail = f"{lost or 'a node'} was lost: {type(exc).__name__}: {str(exc)[:300]}"
            _say(marker("exit", code=1, detail=detail, stopped=stopping.is_set()))
            return 1
        _forward(states)
        if not channel_sent and states[0]["channel"]:
            _say(marker("channel", **states[0]["channel"]))
            channel_sent = True
        if stopping.is_set():
            codes = _terminate(agents, float(spec["grace_s"]))
            _say(marker("exit", code=0, detail=f"stopped on request (torchrun exit codes "
                                                f"{codes})", stopped=True))
            return 0
        if any(s["exit_code"] is not None for s in states):
            code, detail = verdict(states, infos)
            _terminate(agents, _AFTER_FAILURE_GRACE_S)
            _say(marker("exit", code=code, detail=detail, stopped=False))
            return code
        stopping.wait(_POLL_S)


def _lost_nodes(agents: list[Any], infos: list[dict[str, Any]], per_node: int) -> str:
    """The nodes whose agent no longer answers, each with the ranks it ran."""
    lost = []
    for agent, info in zip(agents, infos):
        try:
            ray.get(agent.drain.remote(), timeout=5)
        except Exception:  # noqa: BLE001
            lost.append(f"{_ranks_of(info['index'], per_node)} on {where(info)}")
    return ", ".join(lost)


def _ranks_of(index: int, per_node: int) -> str:
    first = index * per_node
    return f"rank {first}" if per_node == 1 else f"ranks {first}-{first + per_node - 1}"


def _terminate(agents: list[Any], grace_s: float) -> list[int | None]:
    """Every node's torchrun ended (in parallel), then their last lines forwarded."""
    refs = [a.terminate.remote(grace_s) for a in agents]
    codes: list[int | None] = []
    deadline = time.monotonic() + grace_s + 20
    for ref in refs:
        try:
            codes.append(ray.get(ref, timeout=max(1.0, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - a lost node: its processes died with it
            codes.append(None)
    for agent in agents:
        try:
            _forward([ray.get(agent.drain.remote(), timeout=5)])
        except Exception:  # noqa: BLE001
            pass
    return codes


if __name__ == "__main__":
    sys.exit(main())
