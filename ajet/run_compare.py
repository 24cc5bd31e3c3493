"""`compare_runs`: what differed between runs (code, config) and how one metric came out.

A run that resumed another (`resume_from`) shows where it came from: `resumed_from`,
`resume_step`, and `chain`, the run ids from the first run of the line to this one.
Runs of a sweep ran side by side (`POST /runs`, each on devices of its own): `overlaps`
names each pair that ran at the same time and for how long, so a comparison says which
runs shared the cluster's conditions (time, load, rollout workers) and which ran apart.
Runs are named by id or by name; each run counts once.

Used by `SwarmClient.compare_runs(ids, metric)` and the MCP bridge's `compare_runs` tool.
Everything comes from the server's runs API (`GET /runs/{id}`, `GET /runs/{id}/metrics`);
nothing is computed on the cluster. Laptop side: no heavy imports.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import yaml
from pydantic import BaseModel, Field

from ajet.protocol import MetricsResponse, RunPublic

__all__ = ["LOWER_IS_BETTER", "ComparedRun", "MetricOutcome", "RunComparison", "RunOverlap",
           "RunsReader", "compare_runs", "overlaps"]

#: Metrics for which the best value is the smallest; every other metric is maximised.
LOWER_IS_BETTER = frozenset({"loss", "kl", "step_time_s", "wall_time_s"})


class RunsReader(Protocol):
    """The two runs-API calls a comparison needs; `ajet.client.SwarmClient` has them (this
    module does not import it, as `SwarmClient.compare_runs` calls this one)."""

    def get_run(self, run_id: str) -> RunPublic: ...

    def get_metrics(self, run_id: str = "current", *, since_step: int | None = None,
                    fields: list[str] | None = None, max_points: int | None = None
                    ) -> MetricsResponse: ...


class MetricOutcome(BaseModel):
    first: float | None = None
    last: float | None = None
    best: float | None = None
    best_step: int | None = None
    points: int = Field(default=0, description="Steps that carried the metric")


class ComparedRun(BaseModel):
    run_id: str
    name: str | None = None
    started_at: float | None = None
    ended_at: float | None = Field(default=None, description="None while it runs")
    devices: list[int] = Field(default_factory=list)
    snapshot_id: str
    experiment_name: str
    status: str
    reason: str | None = None
    config_hash: str
    git_head: str | None = None
    dirty: bool | None = None
    config: dict[str, Any] = Field(description="This run's values of the differing fields")
    metric: MetricOutcome
    resumed_from: str | None = Field(default=None, description="The run this one continued")
    resume_step: int | None = Field(default=None, description="The step it continued from")
    chain: list[str] = Field(default_factory=list,
                             description="Run ids from the first run of its line to this one "
                                         "(one id when it resumed nothing)")
    last_checkpoint: str | None = None


class RunOverlap(BaseModel):
    runs: tuple[str, str]
    seconds: float = Field(description="How long both ran at once")


class RunComparison(BaseModel):
    metric: str
    higher_is_better: bool
    runs: list[ComparedRun]
    same_code: bool = Field(description="All runs used the same snapshot")
    config_differences: dict[str, dict[str, Any]] = Field(
        description="field -> run id -> value, for every field whose values differ"
    )
    best_run: str | None = Field(description="The run with the best value of the metric")
    overlaps: list[RunOverlap] = Field(
        default_factory=list, description="Pairs of runs that ran at the same time")


def compare_runs(client: RunsReader, run_ids: Sequence[str], metric: str = "reward_mean"
                 ) -> dict[str, Any]:
    """Per run: snapshot, config differences between the runs, metric first/last/best.

    Returns `RunComparison` as a JSON-ready dict. Raises `SwarmNotFound` for an unknown id.
    """
    if not run_ids:
        raise ValueError("compare_runs needs at least one run id; list_runs() gives them")
    runs: list[RunPublic] = []
    for ref in run_ids:
        run = client.get_run(ref)
        if all(r.run_id != run.run_id for r in runs):  # a name and an id of one run
            runs.append(run)
    configs = {run.run_id: _flatten(_load(run.config_yaml)) for run in runs}
    differences = _differences(configs)
    higher_is_better = metric not in LOWER_IS_BETTER

    compared: list[ComparedRun] = []
    for run in runs:
        points = client.get_metrics(run.run_id, fields=[metric]).points
        prov = run.provenance
        compared.append(ComparedRun(
            run_id=run.run_id, name=run.name, started_at=run.started_at, ended_at=run.ended_at,
            devices=run.devices, snapshot_id=run.snapshot_id, experiment_name=run.experiment_name,
            status=run.status, reason=run.reason, config_hash=run.config_hash,
            git_head=prov.git_head if prov else None, dirty=prov.dirty if prov else None,
            config={key: values[run.run_id] for key, values in differences.items()},
            metric=_outcome(points, metric, higher_is_better),
            resumed_from=run.resumed_from, resume_step=run.resume_step,
            chain=_chain(client, run), last_checkpoint=run.last_checkpoint,
        ))
    scored = [c for c in compared if c.metric.best is not None]
    best = (max if higher_is_better else min)(scored, key=lambda c: c.metric.best or 0.0,
                                              default=None)
    return RunComparison(
        metric=metric, higher_is_better=higher_is_better, runs=compared,
        same_code=len({run.snapshot_id for run in runs}) == 1,
        config_differences=differences, best_run=best.run_id if best else None,
        overlaps=overlaps(runs),
    ).model_dump(mode="json")


def overlaps(runs: Sequence[RunPublic], *, now: float | None = None) -> list[RunOverlap]:
    """Each pair of `runs` that ran at the same time, longest overlap first (a run still
    going counts until `now`; a run still queued never started, so it overlaps nothing)."""
    now = time.time() if now is None else now
    spans = [(r.run_id, r.started_at, _end(r, now)) for r in runs if r.status != "queued"]
    out = []
    for i, (a, a0, a1) in enumerate(spans):
        for b, b0, b1 in spans[i + 1:]:
            both = min(a1, b1) - max(a0, b0)
            if both > 0:
                out.append(RunOverlap(runs=(a, b), seconds=round(both, 1)))
    return sorted(out, key=lambda o: -o.seconds)


def _end(run: RunPublic, now: float) -> float:
    if run.ended_at is not None:
        return run.ended_at
    # an ended run without an end time (an older record) is not taken as still running
    return run.started_at if run.status in ("ended", "failed") else now


#: Most runs `_chain` follows back (a longer line is cut at its oldest end).
_MAX_CHAIN = 50


def _chain(client: SwarmClient, run: Any) -> list[str]:
    """Run ids from the oldest ancestor (through `resumed_from`) to `run`."""
    from ajet.errors import SwarmNotFound

    chain, current = [run.run_id], run
    while current.resumed_from and len(chain) < _MAX_CHAIN and \
            current.resumed_from not in chain:
        chain.append(current.resumed_from)
        try:
            current = client.get_run(current.resumed_from)
        except SwarmNotFound:  # the ancestor's record is gone; its id is what is known
            break
    return chain[::-1]


def _load(text: str | None) -> dict[str, Any]:
    data = yaml.safe_load(text or "") or {}
    return data if isinstance(data, dict) else {}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _differences(configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    keys = sorted(set().union(*configs.values())) if configs else []
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        values = {run_id: config.get(key) for run_id, config in configs.items()}
        # compare as JSON text so lists and dicts compare too; a missing key is a difference
        seen = {json.dumps(config.get(key, "<missing>"), sort_keys=True, default=str)
                for config in configs.values()}
        if len(seen) > 1:
            out[key] = values
    return out


def _outcome(points: list[dict[str, Any]], metric: str, higher_is_better: bool
             ) -> MetricOutcome:
    series = [(int(p["step"]), float(p[metric])) for p in points
              if isinstance(p.get(metric), (int, float)) and not isinstance(p.get(metric), bool)
              and math.isfinite(p[metric])]
    if not series:
        return MetricOutcome()
    pick = max if higher_is_better else min
    best_step, best = pick(series, key=lambda sv: sv[1])
    return MetricOutcome(first=series[0][1], last=series[-1][1], best=best, best_step=best_step,
                         points=len(series))
