"""A small in-process fake of the server's concurrent-runs contract, for laptop-side unit
tests (the client's requests, the bridge's tool logic) that need no engine.

It answers through `httpx.MockTransport`: `POST /runs` (device slots, queue, unique
names, never-fits), `POST /runs/{run}/stop`, `GET /runs?state=`, `GET /runs/{run}`,
`/status`, `/metrics`, `/logs`, `/begin_episode` and the default run's
`/start_engine`, `/stop_engine` and `/get_engine_status`. Runs are named by id, by name (the active run of that name, else
the newest) or 'current'. The real server is tested against the same tools in
tests/mcp_bridge/test_sweep_runs.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from ajet.client import SwarmClient
from ajet.errors import SwarmHTTPError, error_body
from ajet.protocol import (
    BeginEpisodeResponse,
    DevicePoolStatus,
    EngineState,
    EngineStatus,
    LogsResponse,
    MetricsResponse,
    RunPublic,
    RunsPage,
    StartRunRequest,
    StopEngineResponse,
)

ACTIVE = ("queued", "booting", "running")


@dataclass
class FakeRun:
    run: RunPublic
    points: list[dict[str, Any]] = field(default_factory=list)
    need: int = 1


class FakeRunsServer:
    """The contract's state: `slots` device slots, runs, a queue; `requests` records
    every request as (method, path, query, json body)."""

    def __init__(self, slots: int = 2, *, stored_config: dict[str, Any] | None = None) -> None:
        self.slots = slots
        self.stored_config = stored_config if stored_config is not None else {
            "experiment_name": "sweep", "num_repeat": 2, "lora_rank": 4}
        self.runs: dict[str, FakeRun] = {}
        self.queue: list[str] = []
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self._n = 0

    # ------------------------------------------------------------------ helpers

    def client(self) -> SwarmClient:
        return SwarmClient("http://fake-swarm", transport=httpx.MockTransport(self.handle))

    def held(self) -> dict[str, list[int]]:
        return {rid: r.run.devices for rid, r in self.runs.items()
                if r.run.status in ("booting", "running")}

    def free(self) -> list[int]:
        used = {d for slots in self.held().values() for d in slots}
        return [d for d in range(self.slots) if d not in used]

    def resolve(self, ref: str) -> FakeRun:
        if ref == "current":
            defaults = [r for r in self.runs.values() if r.run.default_run]
            if defaults:
                return defaults[-1]
        if ref in self.runs:
            return self.runs[ref]
        named = [r for r in self.runs.values() if r.run.name == ref]
        active = [r for r in named if r.run.status in ACTIVE]
        if active or named:
            return (active or named)[-1]
        raise SwarmHTTPError(404, f"no run {ref!r}", "call list_runs (GET /runs) for the run ids")

    def set_metrics(self, ref: str, points: list[dict[str, Any]]) -> None:
        run = self.resolve(ref)
        run.points = points
        run.run.last_step = points[-1]["step"] if points else None

    def _place(self, run: FakeRun) -> None:
        free = self.free()
        run.run.devices = free[:run.need]
        run.run.status = "running"
        run.run.engine_state = EngineState.ROLLING

    def _promote(self) -> None:
        while self.queue and len(self.free()) >= self.runs[self.queue[0]].need:
            run = self.runs[self.queue.pop(0)]
            run.run.queue_position = run.run.queue_reason = None
            self._place(run)
        for i, rid in enumerate(self.queue, 1):
            self.runs[rid].run.queue_position = i

    def add_default_run(self) -> FakeRun:
        self._n += 1
        rid = f"run-{self._n:03d}"
        run = FakeRun(RunPublic(run_id=rid, snapshot_id="server", experiment_name="default",
                                config_hash="h0", config_yaml=yaml.safe_dump(self.stored_config),
                                started_by="control", started_at=time.time(), status="booting",
                                default_run=True))
        self.runs[rid] = run
        self._place(run)
        return run

    # ------------------------------------------------------------------ routes

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        query = dict(request.url.params)
        self.requests.append((request.method, request.url.path, query, body))
        try:
            return self._route(request.method, request.url.path.strip("/").split("/"), query,
                               body)
        except SwarmHTTPError as exc:
            return httpx.Response(exc.status, json=error_body(exc))

    def _route(self, method: str, parts: list[str], query: dict[str, str],
               body: Any) -> httpx.Response:
        if parts == ["runs"] and method == "POST":
            return self._json(self._start(StartRunRequest.model_validate(body or {})))
        if parts == ["runs"]:
            return self._json(self._list(query))
        if parts == ["sync_train_config"]:
            return self._json({"experiment_name": "sweep", "config_hash": "h",
                               "config": self.stored_config})
        if parts == ["get_engine_status"]:
            return self._json(self._status(self.resolve("current")) if any(
                r.run.default_run for r in self.runs.values()) else EngineStatus(
                state=EngineState.OFFLINE, since=time.time(), has_config=True))
        if parts == ["start_engine"]:
            return self._json(self._status(self.add_default_run()))
        if parts == ["stop_engine"]:
            defaults = [r for r in self.runs.values() if r.run.default_run]
            if not defaults:
                return self._json(StopEngineResponse(stopped=False, state=EngineState.OFFLINE))
            return self._json(self._stop(defaults[-1], (body or {}).get("reason", "")))
        if parts == ["begin_episode"]:
            run = self.resolve((body or {}).get("run_id") or "current")
            if run.run.status != "running":
                raise SwarmHTTPError(409, f"run {run.run.run_id} is {run.run.status}", "wait")
            return self._json(BeginEpisodeResponse(
                episode_uuid=f"ep-{len(self.requests)}", run_id=run.run.run_id,
                openai_base_url="http://fake-swarm/v1", openai_api_key=f"key-{run.run.run_id}"))
        if len(parts) >= 2 and parts[0] == "runs":
            run = self.resolve(parts[1])
            tail = parts[2:]
            if tail == ["stop"] and method == "POST":
                return self._json(self._stop(run, (body or {}).get("reason", "")))
            if tail == ["status"]:
                return self._json(self._status(run))
            if tail == ["metrics"]:
                points = run.points
                if "max_points" in query:
                    points = points[-int(query["max_points"]):]
                return self._json(MetricsResponse(
                    run_id=run.run.run_id, points=points, total_steps=len(run.points),
                    last_step=run.points[-1]["step"] if run.points else None))
            if tail == ["logs"]:
                return self._json(LogsResponse(run_id=run.run.run_id, lines=["booting"],
                                               total_lines=1, truncated=False))
            if not tail:
                return self._json(run.run)
        raise SwarmHTTPError(404, f"no route {method} /{'/'.join(parts)} in the fake", "")

    def _json(self, model: Any) -> httpx.Response:
        data = model.model_dump(mode="json") if hasattr(model, "model_dump") else model
        return httpx.Response(200, json=data)

    def _start(self, req: StartRunRequest) -> RunPublic:
        config = dict(self.stored_config)
        if req.yaml is not None:
            config = yaml.safe_load(req.yaml)
            if not isinstance(config, dict) or int(config.get("lora_rank", 1)) < 1:
                raise SwarmHTTPError(422, [{"loc": ["body", "yaml", "lora_rank"],
                                            "msg": "must be >= 1", "type": "value_error"}],
                                     "fix the field(s): lora_rank")
        need = int(config.get("n_gpu", 1))
        if req.name and any(r.run.name == req.name and r.run.status in ACTIVE
                            for r in self.runs.values()):
            raise SwarmHTTPError(409, f"a run named {req.name!r} is active",
                                 "pick another name, or stop that run first")
        if need > self.slots:
            raise SwarmHTTPError(409, f"the run needs {need} device slots and the server has "
                                      f"{self.slots}", "ask for fewer devices (n_gpu)")
        if len(self.free()) < need and not req.queue:
            raise SwarmHTTPError(409, "no free devices", "pass queue=true to wait")
        self._n += 1
        rid = f"run-{self._n:03d}"
        run = FakeRun(RunPublic(
            run_id=rid, snapshot_id=req.snapshot_id or "snap-active",
            experiment_name=str(config.get("experiment_name", "sweep")),
            config_hash=f"h{self._n}", config_yaml=yaml.safe_dump(config),
            started_by="control", started_at=time.time(), status="queued", name=req.name),
            need=need)
        self.runs[rid] = run
        if len(self.free()) >= need and not self.queue:
            self._place(run)
            run.run.status = "booting"  # what POST /runs answers; status reads ROLLING next
            answer = run.run.model_copy()
            run.run.status = "running"
            return answer
        self.queue.append(rid)
        run.run.queue_reason = f"needs {need} device slot(s), {len(self.free())} free"
        self._promote()
        return run.run

    def _stop(self, run: FakeRun, reason: str) -> StopEngineResponse:
        r = run.run
        if r.status == "queued":
            self.queue.remove(r.run_id)
            r.status, r.reason, r.ended_at = "ended", reason, time.time()
            r.queue_position = r.queue_reason = None
            self._promote()
            return StopEngineResponse(stopped=False, run_id=r.run_id, state=EngineState.OFFLINE,
                                      message="Removed from the queue")
        if r.status not in ACTIVE:
            return StopEngineResponse(stopped=False, run_id=r.run_id, state=EngineState.OFFLINE)
        r.status, r.reason, r.ended_at, r.engine_state = "ended", reason, time.time(), None
        r.devices = []
        self._promote()
        return StopEngineResponse(stopped=True, run_id=r.run_id, state=EngineState.OFFLINE)

    def _status(self, run: FakeRun) -> EngineStatus:
        r = run.run
        state = r.engine_state or EngineState.OFFLINE
        return EngineStatus(state=state if r.status in ACTIVE else EngineState.OFFLINE,
                            run_id=r.run_id, snapshot_id=r.snapshot_id, step=r.last_step,
                            has_config=True, experiment_name=r.experiment_name,
                            since=r.started_at, name=r.name, devices=r.devices,
                            queue_position=r.queue_position, queue_reason=r.queue_reason)

    def _list(self, query: dict[str, str]) -> RunsPage:
        runs = sorted((r.run for r in self.runs.values()), key=lambda r: -r.started_at)
        state = query.get("state", "all")
        if state == "active":
            runs = [r for r in runs if r.status in ACTIVE]
        elif state == "ended":
            runs = [r for r in runs if r.status not in ACTIVE]
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", 20))
        return RunsPage(runs=runs[offset:offset + limit], total=len(runs), offset=offset,
                        limit=limit, devices=DevicePoolStatus(
                            kind="cpu", total=self.slots, free=self.free(), held=self.held(),
                            queued=list(self.queue)))
