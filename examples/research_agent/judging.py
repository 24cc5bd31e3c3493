"""Run records, verdicts computed from the measured metric, and the best run so far.

A verdict compares one run with the best run before it, on the mean of the task measure
over the last steps (the same number of steps for both). With one run each, a difference
under `margin` is noise and the change is not kept: only a change that beats the best
run by more than the margin becomes the new best.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from examples.research_agent.lab import Idea

if TYPE_CHECKING:
    from examples.research_agent.agent import CallRecord

__all__ = [
    "MARGIN",
    "METRIC",
    "Failure",
    "Recovery",
    "RunRecord",
    "Study",
    "Verdict",
    "judge",
    "verdict_text",
]

#: The task measure: share of digits in the reply, logged by the workflow itself, so it
#: does not depend on how the engine processes rewards or advantages.
METRIC = "log/digit_share"
#: Differences in mean digit share smaller than this count as noise (one run each).
MARGIN = 0.03

Verdict = Literal["held", "rejected", "inconclusive", "failed"]


@dataclass
class Failure:
    """What the tools said about a run that died, and what the agent read from it."""

    reason: str
    exit_code: int | None
    error_line: str | None = None
    error_name: str | None = None
    #: the last traceback frame inside ajet/: path, line number, function
    where: tuple[str, int, str] | None = None
    log_lines: list[str] = field(default_factory=list)
    grep: str | None = None
    #: that line of the module, as the agent's repository holds it
    source: str | None = None
    steps_done: int = 0
    #: the engine_status result that reported the death (empty after a failed start)
    status: dict[str, Any] = field(default_factory=dict, repr=False)
    #: index in the agent's calls of the first one that showed the failure
    first_call: int = 0

    def describe(self) -> str:
        what = self.error_line or self.reason
        if self.where is not None:
            path, line, func = self.where
            what += f" (in {path}, line {line}, {func})"
        return what


@dataclass
class RunRecord:
    """One training run as the agent saw it through the tools."""

    label: str
    idea: Idea | None
    #: what was changed, for the report: the diff, or the config fields sent
    diff: str = ""
    config_change: dict[str, Any] = field(default_factory=dict)
    approval: str | None = None
    run_id: str = ""
    snapshot_id: str = ""
    server_path: str | None = None
    ajet_file: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    #: device slots the run held (runs started beside others, by name)
    devices: list[int] = field(default_factory=list)
    points: dict[int, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0
    status: Literal["ended", "failed"] = "ended"
    failure: Failure | None = None
    mean: float | None = None
    verdict: Verdict | None = None
    compared_with: str | None = None
    decision: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def values(self, metric: str = METRIC) -> list[float | None]:
        return [self.points[s].get(metric) for s in sorted(self.points)]


@dataclass
class Recovery:
    """How the agent got the cluster training again after a run died."""

    failed: RunRecord
    #: the snapshot it rolled back to: the best run's
    rolled_back_to: str
    #: the calls from the first sign of the failure to the restarted run's rollouts
    calls: list[CallRecord] = field(default_factory=list)
    restart: RunRecord | None = None


@dataclass
class Study:
    """Every run so far and the best one; the agent keeps the cluster on the best."""

    runs: list[RunRecord] = field(default_factory=list)
    best: RunRecord | None = None
    recoveries: list[Recovery] = field(default_factory=list)

    def add(self, run: RunRecord) -> None:
        self.runs.append(run)

    def the_best(self) -> RunRecord:
        if self.best is None:
            raise RuntimeError("no baseline yet: the first run that trained is the best so far")
        return self.best


def judge(best: float | None, new: float | None, *, margin: float = MARGIN) -> Verdict:
    """'held', 'rejected' or 'inconclusive' for a change's hypothesis, from two means."""
    if best is None or new is None:
        return "inconclusive"
    if new - best > margin:
        return "held"
    if best - new > margin:
        return "rejected"
    return "inconclusive"


def verdict_text(verdict: Verdict, *, best_label: str, best: float | None, new: float | None,
                 window: int, margin: float = MARGIN) -> str:
    """Two lines: which hypothesis held, and the numbers it rests on."""
    if verdict == "failed":
        return "Verdict: none; the run died before it trained (see the recovery)."
    if best is None or new is None:
        return "Verdict: none; a run has no digit share values (read_logs tells why)."
    numbers = (f"  mean {METRIC} over the last {window} step(s): {best_label} {best:.3f}, "
               f"this run {new:.3f} ({new - best:+.3f})")
    if verdict == "held":
        head = f"Verdict: the hypothesis HELD: it beat {best_label} by more than {margin}."
    elif verdict == "rejected":
        head = (f"Verdict: the null hypothesis HELD: it fell behind {best_label} by more "
                f"than {margin}.")
    else:
        head = (f"Verdict: neither held: the difference is within +-{margin}, noise for one "
                "run each.")
    return f"{head}\n{numbers}"
