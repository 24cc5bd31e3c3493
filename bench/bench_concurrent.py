"""Two runs at once against the same two runs one after the other, until both have trained.

    python -m bench --only concurrent

A real server with two device slots (`--devices 2`, `AJET_SWARM_DEVICES=2`), real tiny
engines: two named runs of the same ajet-tiny job (`max_steps` set, so each engine ends its
run by itself after exactly that many updates), each fed by its own rollout worker
(`RolloutRunner(..., run_id=...)`, the digits workflow). The measured path starts both
with `POST /runs` and times until both have ended with every step trained; the reference
runs the same two, the second started once the first has ended. Boots count in both, as a
research agent waits for them too. Each repetition runs the reference first, then the
pair, so drift on a shared machine hits both alike.

On a GPU host each run gets a GPU of its own and the ratio is the point (two runs cost the
time of one). On a CPU host both engines share the same cores: with 2 cores, as here, the
honest figure is a ratio near 1 (the overlap only hides boots and the workers' waits), and
the row says how many cores the host has.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

from ajet.client import SwarmClient
from ajet.protocol import RunPublic
from ajet.rollout import RolloutRunner, load_workflow
from bench.context import BenchContext
from bench.harness import PROJECT_ROOT, LocalServer, tiny_job
from bench.report import Row

__all__ = ["Pair", "run", "train_runs"]

RERUN = "python -m bench --only concurrent"
WORKFLOW = "examples/digits_workflow.py:workflow"
#: Steps each run trains, and the job's size: a few seconds a step on a 2-core CPU.
STEPS = 6
QUICK_STEPS = 1
JOB = {"batch_size": 2, "num_repeat": 4, "max_new_tokens": 16, "seed": 0}
#: Most seconds one run may take, boot included, before the benchmark gives up on it.
RUN_TIMEOUT_S = 300.0
POLL_S = 0.2


@dataclass(frozen=True)
class Pair:
    """One repetition: the wall seconds of each way, and what the runs reported."""

    together_s: float
    one_after_the_other_s: float
    #: seconds both runs of the pair were running at once (from their start and end)
    overlap_s: float
    devices: tuple[tuple[int, ...], ...]


def _wait_ended(client: SwarmClient, run_ids: list[str], steps: int) -> list[RunPublic]:
    """Poll until every run has ended; raise with its reason if one failed or fell short."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        runs = [client.get_run(r) for r in run_ids]
        if all(r.status in ("ended", "failed") for r in runs):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"runs still going after {RUN_TIMEOUT_S:.0f} s: "
                               + ", ".join(f"{r.run_id} {r.status} step {r.last_step}"
                                           for r in runs))
        time.sleep(POLL_S)
    for r in runs:
        if r.status != "ended" or (r.last_step or 0) < steps:
            raise RuntimeError(f"run {r.run_id} {r.status} after step {r.last_step} of "
                               f"{steps}: {r.reason}; see runs/{r.run_id}/engine.log")
    return runs


def train_runs(client: SwarmClient, names: list[str], steps: int, *, together: bool
               ) -> tuple[float, list[RunPublic], list[list[int]]]:
    """Train one run per name for `steps` steps, at once or one after the other.

    Returns the wall seconds from the first start until the last run ended, the ended
    runs and the device slots each held while it ran.
    """
    workflow, tasks = load_workflow(WORKFLOW, PROJECT_ROOT)
    job = tiny_job(max_steps=steps, **JOB)
    runners: list[RolloutRunner] = []
    ended: list[RunPublic] = []
    devices: list[list[int]] = []
    t0 = time.perf_counter()
    try:
        batches = [names] if together else [[n] for n in names]
        for batch in batches:
            ids = []
            for name in batch:
                started = client.start_run(job, name=name, queue=False)
                devices.append(list(started.devices))
                runner = RolloutRunner(client, workflow, tasks, n_workers=1,
                                       num_repeat=job.num_repeat, run_id=started.run_id)
                runner.start()  # its worker waits while the run boots
                runners.append(runner)
                ids.append(started.run_id)
            ended += _wait_ended(client, ids, steps)
        return time.perf_counter() - t0, ended, devices
    finally:
        for runner in runners:
            runner.stop(timeout=10)


def _overlap(runs: list[RunPublic]) -> float:
    a, b = runs
    return max(0.0, min(a.ended_at or 0.0, b.ended_at or 0.0) - max(a.started_at, b.started_at))


def run(ctx: BenchContext) -> list[Row]:
    steps = QUICK_STEPS if ctx.quick else STEPS
    pairs: list[Pair] = []
    env = {"AJET_SWARM_DEVICES": "2"}
    with LocalServer(ctx.path("concurrent"), env=env) as server, server.client() as client:
        for i in range(ctx.reps):
            apart_s, _, _ = train_runs(client, [f"apart-{i}-a", f"apart-{i}-b"], steps,
                                       together=False)
            together_s, runs, devices = train_runs(client, [f"both-{i}-a", f"both-{i}-b"],
                                                   steps, together=True)
            if len({d for held in devices for d in held}) != sum(map(len, devices)):
                raise RuntimeError(f"the two runs shared a device slot: {devices}")
            pairs.append(Pair(together_s=together_s, one_after_the_other_s=apart_s,
                              overlap_s=_overlap(runs),
                              devices=tuple(tuple(d) for d in devices)))
        pool = client.list_runs(state="active").devices
    kind = pool.kind if pool is not None else "cpu"
    together = statistics.median(p.together_s for p in pairs)
    apart = statistics.median(p.one_after_the_other_s for p in pairs)
    cores = os.cpu_count() or 1
    slots = " and ".join(str(list(d)) for d in pairs[-1].devices)
    host = (f"a GPU host ({pool.total if pool else '?'} GPU slots): each run on its own GPU"
            if kind == "gpu" else
            f"a host with {cores} CPU cores and no GPU: both engines share those cores, so "
            "on 2 cores a ratio near 1 is the honest result (on a GPU host each run has its "
            "own GPU)")
    note = (f"ratio {together / apart:.2f} on {host}; ajet-tiny, batch "
            f"{JOB['batch_size']}x{JOB['num_repeat']}, one rollout worker per run, boots "
            f"included; device slots {slots}; overlap "
            f"{statistics.median(p.overlap_s for p in pairs):.1f} s")
    return [Row(f"two runs at once until both trained {steps} steps (--devices 2)", together,
                "s", "the same two runs one after the other", apart,
                target="< 1x (on a GPU host: about 0.5x)", rerun=RERUN,
                repetitions=len(pairs), met=together < apart, note=note)]
