"""compare_runs shows a resumed run's line: resumed_from, resume_step and the chain of runs."""

from __future__ import annotations

from typing import Any

from ajet.errors import SwarmNotFound
from ajet.protocol import MetricsResponse, RunPublic
from ajet.run_compare import compare_runs


class _Runs:
    """The two calls compare_runs makes, answered from a dict of runs."""

    def __init__(self, runs: dict[str, RunPublic]) -> None:
        self.runs = runs

    def get_run(self, run_id: str) -> RunPublic:
        if run_id not in self.runs:
            raise SwarmNotFound(404, f"no run {run_id!r}", "call list_runs")
        return self.runs[run_id]

    def get_metrics(self, run_id: str, fields: list[str] | None = None) -> MetricsResponse:
        step = self.runs[run_id].resume_step or 0
        return MetricsResponse(run_id=run_id, total_steps=2, points=[
            {"step": step + 1, "reward_mean": 0.1}, {"step": step + 2, "reward_mean": 0.2}])


def _run(run_id: str, resumed_from: str | None = None, step: int | None = None) -> RunPublic:
    return RunPublic(run_id=run_id, snapshot_id="server", experiment_name="e", config_hash="h",
                     config_yaml="lr: 0.01\n", started_by="control", started_at=0.0,
                     status="ended", resumed_from=resumed_from, resume_step=step,
                     last_checkpoint=f"/runs/{run_id}/checkpoints/step_{(step or 0) + 2}")


def test_the_chain_of_a_resumed_run_goes_back_to_its_first_run() -> None:
    client: Any = _Runs({"a": _run("a"), "b": _run("b", "a", 2), "c": _run("c", "b", 4)})
    result = compare_runs(client, ["a", "c"])
    a, c = result["runs"]
    assert (a["chain"], a["resumed_from"]) == (["a"], None)
    assert (c["chain"], c["resumed_from"], c["resume_step"]) == (["a", "b", "c"], "b", 4)
    assert c["metric"]["first"] == 0.1 and c["last_checkpoint"].endswith("step_6")


def test_a_chain_stops_at_a_run_the_server_no_longer_has() -> None:
    client: Any = _Runs({"c": _run("c", "gone", 4)})
    assert compare_runs(client, ["c"])["runs"][0]["chain"] == ["gone", "c"]
