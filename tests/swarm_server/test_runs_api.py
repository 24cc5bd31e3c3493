"""Runs API against a real server: listing, one run, metrics, logs, and compare_runs.

One server for the module; three runs are made once (two configs that differ, one crash)
with the fake engine writing their `metrics.jsonl`, then every test only reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import SwarmNotFound
from ajet.protocol import EngineState
from tests.support import ServerHandle, make_ajet_repo, start_server
from tests.support.fake_engine import server_env, set_behaviour

A_METRICS = [{"step": s, "reward_mean": r, "loss": l, "success_rate": 0.1 * s}
             for s, r, l in [(1, 0.1, 2.0), (2, 0.4, 1.5), (3, 0.9, 1.7), (4, 0.5, 0.8),
                             (5, 0.6, 1.1), (6, 0.7, 0.9)]]
B_METRICS = [{"step": s, "reward_mean": r, "loss": 1.0} for s, r in [(1, 0.2), (2, 0.3)]]


@dataclass
class Runs:
    server: ServerHandle
    client: SwarmClient
    a: str
    b: str
    c: str
    snapshot: str  # runs b and c used this synced snapshot; a the server's own code
    git_head: str | None


def _run(client: SwarmClient, workdir: Path, job: AgentJetJob, **behaviour: object) -> str:
    set_behaviour(workdir, **behaviour)
    client.submit_config(job)
    client.start_run()
    run_id = client.get_run("current").run_id  # the status may already be OFFLINE again
    if behaviour.get("mode") == "crash_at_boot":
        deadline = time.monotonic() + 30
        while client.get_run(run_id).status != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.02)
    else:
        client.wait_for_state(EngineState.ROLLING, timeout=30)
        client.stop_run(reason=f"done with {job.experiment_name}")
    time.sleep(0.01)  # distinct started_at for the newest-first order
    return run_id


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("runs")
    workdir = root / "swarm"
    repo = make_ajet_repo(root / "repo")
    server = start_server(workdir, env=server_env())
    client = SwarmClient(server.url)
    try:
        a = _run(client, workdir, AgentJetJob(experiment_name="cmp-a", lr=0.01), metrics=A_METRICS)
        synced = client.push_code(repo)
        b = _run(client, workdir, AgentJetJob(experiment_name="cmp-b", lr=0.02, batch_size=8),
                 metrics=B_METRICS)
        c = _run(client, workdir, AgentJetJob(experiment_name="cmp-a", lr=0.01),
                 mode="crash_at_boot")
        active = client.get_active_code()
        git_head = active.provenance.git_head if active else None
        yield Runs(server, client, a, b, c, synced.snapshot_id, git_head)
    finally:
        client.close()
        server.stop()


def _ids(page: dict[str, object]) -> list[str]:
    return [r["run_id"] for r in page["runs"]]  # type: ignore[index, union-attr]


def test_list_runs_newest_first_filtered_and_paginated(runs: Runs) -> None:
    url = f"{runs.server.url}/runs"
    page = httpx.get(url).json()
    assert (_ids(page), page["total"]) == ([runs.c, runs.b, runs.a], 3)
    assert page["runs"][0]["config_yaml"] is None  # the full config only in GET /runs/{id}
    assert _ids(httpx.get(url, params={"experiment_name": "cmp-a"}).json()) == [runs.c, runs.a]
    assert _ids(httpx.get(url, params={"status": "failed"}).json()) == [runs.c]
    assert _ids(httpx.get(url, params={"status": "ended"}).json()) == [runs.b, runs.a]
    second = httpx.get(url, params={"offset": 1, "limit": 1}).json()
    assert (_ids(second), second["total"], second["offset"], second["limit"]) == \
        ([runs.b], 3, 1, 1)
    assert httpx.get(url, params={"status": "bogus"}).status_code == 422
    assert httpx.get(url, params={"limit": 0}).status_code == 422
    listed = runs.client.list_runs(experiment_name="cmp-b")
    assert [r.run_id for r in listed.runs] == [runs.b]


def test_run_detail_has_config_snapshot_status_and_summary(runs: Runs) -> None:
    run = runs.client.get_run(runs.a)
    assert run.snapshot_id == "server" and run.provenance is None
    assert run.config_yaml is not None and "lr: 0.01" in run.config_yaml
    assert AgentJetJob.from_yaml(run.config_yaml).experiment_name == "cmp-a"
    assert (run.status, run.reason, run.exit_code, run.last_step) == \
        ("ended", "done with cmp-a", 0, 6)
    assert run.started_by == "open" and run.ended_at is not None
    assert run.summary["reward_mean"] == {"first": 0.1, "last": 0.7, "best": 0.9, "best_step": 3}
    assert run.summary["loss"] == {"first": 2.0, "last": 0.9, "best": 0.8, "best_step": 4}
    assert run.summary["success_rate"]["best_step"] == 6
    synced = runs.client.get_run(runs.b)
    assert synced.snapshot_id == runs.snapshot
    assert synced.provenance is not None and synced.provenance.git_head == runs.git_head
    failed = runs.client.get_run(runs.c)
    assert (failed.status, failed.exit_code) == ("failed", 3)
    assert "exited with code 3" in (failed.reason or "")


def test_current_means_the_last_run_when_none_is_live(runs: Runs) -> None:
    assert runs.client.get_run("current").run_id == runs.c
    assert runs.client.get_run_logs("current").run_id == runs.c


def test_metrics_since_step_fields_and_downsampling(runs: Runs) -> None:
    full = runs.client.get_metrics(runs.a)
    assert [p["step"] for p in full.points] == [1, 2, 3, 4, 5, 6]
    assert (full.total_steps, full.last_step, full.downsampled) == (6, 6, False)
    assert full.points[2] == A_METRICS[2]
    since = runs.client.get_metrics(runs.a, since_step=3)
    assert [p["step"] for p in since.points] == [4, 5, 6] and since.total_steps == 6
    fields = runs.client.get_metrics(runs.a, fields=["loss"])
    assert all(set(p) == {"step", "loss"} for p in fields.points)
    down = runs.client.get_metrics(runs.a, max_points=3)
    assert len(down.points) == 3 and down.downsampled
    assert down.points[0]["step"] == 1 and down.points[-1]["step"] == 6  # the last is kept
    assert [p["step"] for p in runs.client.get_metrics(runs.a, max_points=1).points] == [6]
    combined = runs.client.get_metrics(runs.a, since_step=1, fields=["reward_mean"],
                                       max_points=2)
    assert combined.points == [{"step": 2, "reward_mean": 0.4}, {"step": 6, "reward_mean": 0.7}]
    assert runs.client.get_metrics(runs.c).points == []


def test_logs_tail_grep_and_regex(runs: Runs) -> None:
    url = f"{runs.server.url}/runs/{runs.a}/logs"
    every = runs.client.get_run_logs(runs.a, tail=1000)
    assert every.lines[0].startswith("fake engine pid") and not every.truncated
    last = runs.client.get_run_logs(runs.a, tail=1)
    assert last.lines == ["fake engine stopped cleanly"]
    assert last.truncated and last.total_lines == every.total_lines
    grep = runs.client.get_run_logs(runs.a, grep="config:")
    assert grep.lines == ["config: experiment_name: cmp-a"] and grep.total_lines == 1
    regex = httpx.get(url, params={"grep": r"pid \d+ run", "regex": "true"}).json()
    assert len(regex["lines"]) == 1 and runs.a in regex["lines"][0]
    plain = httpx.get(url, params={"grep": r"pid \d+ run"}).json()
    assert plain["lines"] == []  # without regex=true the pattern is a plain substring
    bad = httpx.get(url, params={"grep": "(unclosed", "regex": "true"})
    assert bad.status_code == 400 and "regex" in bad.json()["detail"]
    long = httpx.get(url, params={"grep": "a" * 201, "regex": "true"})
    assert long.status_code == 400 and bad.json()["hint"]
    crash = runs.client.get_run_logs(runs.c, grep="RuntimeError")
    assert crash.lines == ["RuntimeError: fake boot failure"]


def test_unknown_runs_are_404_with_a_hint(runs: Runs) -> None:
    for path in ("/runs/nope", "/runs/nope/metrics", "/runs/nope/logs"):
        r = httpx.get(f"{runs.server.url}{path}")
        assert r.status_code == 404 and "list_runs" in r.json()["hint"], path
    assert httpx.get(f"{runs.server.url}/runs/bad id!").status_code == 422
    with pytest.raises(SwarmNotFound) as exc:
        runs.client.get_run("nope")
    assert exc.value.hint


def test_compare_runs_names_config_and_code_differences_and_outcomes(runs: Runs) -> None:
    out = runs.client.compare_runs([runs.a, runs.b], "reward_mean")
    assert out["metric"] == "reward_mean" and out["higher_is_better"] is True
    assert out["config_differences"] == {
        "batch_size": {runs.a: 4, runs.b: 8},
        "experiment_name": {runs.a: "cmp-a", runs.b: "cmp-b"},
        "lr": {runs.a: 0.01, runs.b: 0.02},
    }
    assert out["same_code"] is False
    a, b = out["runs"]
    assert (a["run_id"], a["snapshot_id"], a["config"]["lr"]) == (runs.a, "server", 0.01)
    assert (b["run_id"], b["snapshot_id"], b["config"]["lr"]) == (runs.b, runs.snapshot, 0.02)
    assert runs.git_head and b["git_head"] == runs.git_head and a["git_head"] is None
    assert a["metric"] == {"first": 0.1, "last": 0.7, "best": 0.9, "best_step": 3, "points": 6}
    assert b["metric"] == {"first": 0.2, "last": 0.3, "best": 0.3, "best_step": 2, "points": 2}
    assert out["best_run"] == runs.a
    by_loss = runs.client.compare_runs([runs.a, runs.b], "loss")
    assert by_loss["higher_is_better"] is False
    assert by_loss["runs"][0]["metric"]["best"] == 0.8 and by_loss["best_run"] == runs.a
    with pytest.raises(SwarmNotFound):
        runs.client.compare_runs([runs.a, "nope"])
