"""What the person who ran (and approved) the loop reads: a table, a plot, `demo_report.md`.

Every figure here comes from a tool result: the runs' metrics (`read_metrics`,
`compare_runs`), their code and config (`start_engine`, `configure`, `compare_runs`), the
failure (`engine_status`, `read_logs`), and the size of every tool result the agent read.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from examples.research_agent.agent import CallRecord
from examples.research_agent.judging import METRIC, RunRecord, Study, verdict_text

__all__ = ["LoopResult", "config_differences", "results_table", "side_by_side_section",
           "write_plot", "write_report"]

#: The budget the issue sets for one tool result (what the model reads).
RESULT_BUDGET_BYTES = 8 * 1024


@dataclass
class LoopResult:
    """Everything the report is written from."""

    study: Study
    compared: dict[str, Any]
    calls: list[CallRecord]
    approvals: list[dict[str, str]]
    job: dict[str, Any]
    steps: int
    window: int
    margin: float
    n_workers: int
    enforcing: bool
    final_snapshot: str
    final_config: dict[str, Any]
    seconds: float
    plot: Path


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}"


def config_differences(compared: dict[str, Any], run: RunRecord, base: RunRecord
                       ) -> dict[str, tuple[Any, Any]]:
    """field -> (baseline's value, this run's) for the fields `compare_runs` found differing."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, values in compared.get("config_differences", {}).items():
        mine, theirs = values.get(run.run_id), values.get(base.run_id)
        if mine != theirs:
            out[name] = (theirs, mine)
    return out


def _config_text(diff: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {a} -> {b}" for k, (a, b) in diff.items()) or "none"


def results_table(result: LoopResult) -> str:
    """All runs side by side: code snapshot, config difference, digit share, verdict."""
    study, compared = result.study, result.compared
    rows = {r["run_id"]: r for r in compared["runs"]}
    base = study.runs[0]
    job = result.job
    config = (f"{job['model']}, batch {job['batch_size']}x{job['num_repeat']}, lr {job['lr']}, "
              f"max_new_tokens {job['max_new_tokens']}, seed {job['seed']}, {result.steps} "
              f"steps, {result.n_workers} rollout worker{'s' if result.n_workers > 1 else ''}")
    span = (f"steps {result.steps - result.window + 1}-{result.steps}" if result.window > 1
            else f"step {result.steps}")
    width = max(len(r.label) for r in study.runs)
    head = (f"{'run':{width}} {'run id':22} {'snapshot':12} {'status':6} {'first':>6} "
            f"{'last':>6} {'best':>6} {'mean':>6}  verdict (mean = digit share over {span})")
    lines = [f"baseline config: {config}", "", head, "-" * len(head)]
    for run in study.runs:
        row = rows.get(run.run_id, {})
        best = " <- best" if run is study.best else ""
        lines.append(f"{run.label:{width}} {run.run_id or '-':22} {run.snapshot_id[:12]:12} "
                     f"{run.status:6} {_fmt(row.get('first')):>6} {_fmt(row.get('last')):>6} "
                     f"{_fmt(row.get('best')):>6} {_fmt(run.mean):>6}  "
                     f"{run.verdict or '-'}{best}")
    lines.append("")
    for run in study.runs:
        lines.append(f"{run.label:{width}} config vs baseline: "
                     f"{_config_text(config_differences(compared, run, base))}")
    return "\n".join(lines)


def write_plot(study: Study, path: Path) -> None:
    """Every run's digit share per step in one PNG, without a display; a crash is marked."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8.0, 4.2), dpi=100)
    ax = fig.subplots()
    for run in study.runs:
        what = run.idea.title if run.idea is not None else (
            "GRPO as found" if run is study.runs[0] else "restart after the rollback")
        label = f"{run.label}: {what} ({run.snapshot_id[:8]})"
        if run.failed:
            at = (run.failure.steps_done if run.failure else 0) + 1
            ax.plot([at], [0.0], marker="X", markersize=11, linestyle="none", color="red",
                    label=f"{label}: engine died at step {at}")
            continue
        steps = sorted(run.points)
        style = "--" if run.idea is None and run is not study.runs[0] else "-"
        ax.plot(steps, run.values(), marker="o", linestyle=style, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(f"{METRIC} (= reward)")
    ax.set_title("ajet-tiny on the digits task: every run of the research loop")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


# ---------------------------------------------------------------------------- markdown


def _sizes(calls: list[CallRecord]) -> tuple[list[str], CallRecord]:
    by_tool: dict[str, list[CallRecord]] = defaultdict(list)
    for call in calls:
        by_tool[call.tool].append(call)
    rows = ["| tool | calls | errors | largest result (bytes) | median (bytes) |",
            "|---|---:|---:|---:|---:|"]
    for tool in sorted(by_tool, key=lambda t: -max(c.bytes for c in by_tool[t])):
        got = by_tool[tool]
        sizes = [c.bytes for c in got]
        rows.append(f"| `{tool}` | {len(got)} | {sum(c.error for c in got)} | {max(sizes)} | "
                    f"{int(statistics.median(sizes))} |")
    return rows, max(calls, key=lambda c: c.bytes)


def _overlaps(compared: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(run id, run id, seconds) of each pair `compare_runs` found running at the same time."""
    return [(o["runs"][0], o["runs"][1], float(o["seconds"]))
            for o in compared.get("side_by_side", []) if len(o.get("runs", [])) == 2]


def _how_ideas_ran(study: Study, compared: dict[str, Any]) -> str:
    labels = {r.run_id: r.label for r in study.runs}
    pairs = [f"{labels.get(a, a)} and {labels.get(b, b)}" for a, b, _ in _overlaps(compared)]
    if not pairs:
        return "one at a time"
    return f"{'; '.join(pairs)} side by side (two runs at once), the others one at a time"


def side_by_side_section(study: Study, compared: dict[str, Any]) -> list[str]:
    """Which runs ran together: from `compare_runs` (start, end, devices, overlaps)."""
    rows = {r["run_id"]: r for r in compared.get("runs", [])}
    by_id = {r.run_id: r for r in study.runs}
    out = ["## Side by side", ""]
    overlaps = _overlaps(compared)
    if not overlaps:
        return out + ["No two runs overlapped in time: every run ran alone.", ""]
    for a, b, seconds in overlaps:
        names = " and ".join(f"`{by_id[r].label if r in by_id else r}`" for r in (a, b))
        out.append(f"- {names} ran at the same time for {seconds:.0f} s (`compare_runs` "
                   "`side_by_side`), each on device slots of its own.")
    out += ["", "| run | run id | snapshot | device slots | started | ended |",
            "|---|---|---|---|---|---|"]
    for run in study.runs:
        row = rows.get(run.run_id, {})
        devices = row.get("devices") or run.devices
        out.append(f"| {run.label} | `{run.run_id or '-'}` | `{run.snapshot_id[:12]}` | "
                   f"{', '.join(map(str, devices)) or '-'} | {row.get('started') or '-'} | "
                   f"{row.get('ended') or '-'} |")
    out += ["", "The runs side by side started together on a server with two device slots "
            "(`--devices 2`), each pinned to its own snapshot: the code idea to the snapshot "
            "its sync made, the config idea to the baseline's with its changed fields. Both "
            "met the same first batches (same seed, one rollout worker each), and on a "
            "2-core host they shared the CPU, so their step times are not the baseline's.",
            ""]
    return out


def _names(compared: dict[str, Any]) -> set[str]:
    return {r["name"] for r in compared.get("runs", []) if r.get("name")}


def _run_sentence(run: RunRecord) -> str:
    if run.failed:
        return ("the engine died before its first step ended, so the idea itself was not "
                "tested")
    if run.verdict is None:
        return f"mean digit share {_fmt(run.mean)}"
    return {"held": "the hypothesis held", "rejected": "the null hypothesis held",
            "inconclusive": "neither hypothesis held (a difference within the noise margin)",
            }[run.verdict]


def write_report(result: LoopResult, path: Path) -> None:
    """`demo_report.md`: plain sentences first, then every run, the plot and the numbers."""
    study, compared = result.study, result.compared
    base, best = study.runs[0], study.the_best()
    rows = {r["run_id"]: r for r in compared["runs"]}
    ideas = [r for r in study.runs if r.idea is not None]
    span = (f"the last {result.window} steps" if result.window > 1 else "the last step")
    out: list[str] = [
        "# Research loop report",
        "",
        f"Written by `examples/research_loop.py` (`make demo`) on "
        f"{datetime.now().strftime('%Y-%m-%d %H:%M')}: {len(study.runs)} runs of ajet-tiny on "
        f"the digits task, {result.steps} steps each, in {result.seconds:.0f} s. A script "
        "played the research agent: every action on the cluster was an MCP tool call to "
        "`ajet-mcp`, and each next call was chosen from what the last result said.",
        "",
        "## In short",
        "",
        f"The agent trained a baseline (GRPO as found) and then tested {len(ideas)} ideas, "
        f"{_how_ideas_ran(study, compared)}, each against the best run before it. It judged "
        f"each by the mean share of digits in the replies (`{METRIC}`, logged by the "
        f"workflow) over {span}; with one run each, a difference under {result.margin} "
        "counts as noise and the change is not kept.",
        "",
    ]
    for run in ideas:
        out.append(f"- **{run.label}, {run.idea.title}** (run `{run.run_id}`): "
                   f"{_run_sentence(run)}. {run.decision}")
    out.append("")
    for rec in study.recoveries:
        fail = rec.failed.failure
        restart = rec.restart
        out.append(
            f"The engine of run `{rec.failed.run_id}` died: "
            f"{fail.describe() if fail else 'no reason recorded'}. The agent learnt of it "
            f"from `engine_status` (`ENGINE.OFFLINE` with `last_error`), found the error "
            f"with a literal `read_logs` search for `{fail.grep if fail else '?'}`, rolled "
            f"the cluster back to snapshot `{rec.rolled_back_to[:12]}` (the best run's code) "
            f"with `activate_snapshot`, and restarted: run "
            f"`{restart.run_id if restart else '-'}` trained "
            f"{len(restart.points) if restart else 0} step(s) on it. The edit was undone in "
            "the repository; fixing it and testing the idea again is the next iteration.")
        out.append("")
    out += [
        f"**The best run is `{best.label}`** (run `{best.run_id}`, snapshot "
        f"`{best.snapshot_id[:12]}`, mean digit share {_fmt(best.mean)}). Its code and its "
        f"config are what the cluster has active now: the active snapshot is "
        f"`{result.final_snapshot[:12]}` and the stored config has lr "
        f"{result.final_config.get('lr')}, batch {result.final_config.get('batch_size')} x "
        f"{result.final_config.get('num_repeat')}; the next `start_engine` trains it.",
        "",
        f"You approved {len(result.approvals)} code sync(s), "
        + ("each on the server with your approver token (`ajet-swarm approvals approve`)."
           if result.enforcing else "each in the MCP client (elicitation)."),
        "",
        "## Runs",
        "",
        f"| run | idea | run id | snapshot | config vs baseline | status | digit share "
        f"first / last / best | mean of {span} | verdict (vs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in study.runs:
        row = rows.get(run.run_id, {})
        what = (run.idea.title if run.idea is not None else
                "GRPO as found: the baseline" if run is base else
                "restart on the best code after the crash")
        verdict = (f"{run.verdict} (vs {run.compared_with})" if run.verdict and run.compared_with
                   else run.verdict or "-")
        mark = " **best**" if run is best else ""
        out.append(
            f"| {run.label}{mark} | {what} | `{run.run_id or '-'}` | `{run.snapshot_id[:12]}` | "
            f"{_config_text(config_differences(compared, run, base))} | {run.status} | "
            f"{_fmt(row.get('first'))} / {_fmt(row.get('last'))} / {_fmt(row.get('best'))} | "
            f"{_fmt(run.mean)} | {verdict} |")
    out += ["", f"![digit share of every run]({_relative(result.plot, path)})", ""]
    out += side_by_side_section(study, compared)
    out += ["## Each idea", ""]
    for run in ideas:
        idea = run.idea
        out += [f"### {run.label}: {idea.title}", "",
                f"- Hypothesis: {idea.hypothesis}", f"- Null: {idea.null}"]
        if idea.kind == "code":
            out.append(f"- Change: `{idea.module}`, synced as snapshot `{run.snapshot_id[:12]}` "
                       f"({run.approval or 'approval not recorded'}).")
        else:
            sent = ", ".join(f"{k}={v}" for k, v in run.config_change.items())
            how = (f"`start_engine(name={run.label!r}, config={run.config_change})` beside "
                   "the other run" if run.devices or run.label in _names(compared)
                   else f"`configure({sent})`")
            out.append(f"- Change: {how}, no sync: the code stayed `{run.snapshot_id[:12]}`.")
        if run.failed and run.failure is not None:
            fail = run.failure
            out.append(f"- Outcome: the engine died ({fail.reason}). {fail.describe()}.")
            if fail.source:
                out.append(f"- The line the traceback names, in the repository: "
                           f"`{fail.source.strip()}`")
        else:
            best_before = next((r for r in study.runs if r.label == run.compared_with), None)
            out.append("- Outcome: " + verdict_text(
                run.verdict or "inconclusive", best_label=run.compared_with or "-",
                best=best_before.mean if best_before else None, new=run.mean,
                window=result.window, margin=result.margin).replace("\n  ", " "))
        out.append(f"- Decision: {run.decision}")
        if run.diff:
            out += ["", "```diff", run.diff.rstrip(), "```"]
        out.append("")
    for rec in study.recoveries:
        out += ["### The recovery, call by call", "",
                "From the first sign of the failure to the restarted run's rollouts: each "
                "call, the start of what its result said, and which earlier result named the "
                "call (after its \"Next:\").", ""]
        for i, c in enumerate(rec.calls):
            by = next((j for j in range(i - 1, -1, -1) if c.tool in rec.calls[j].next_calls),
                      None)
            source = (f"named by {by + 1}" if by is not None else
                      "the poll" if c.tool in ("engine_status", "read_metrics") else
                      "engine_status listed rollouts still running" if c.tool == "stop_rollouts"
                      else "not named")
            out.append(f"{i + 1}. `{c.call_text()}` ({source}): {c.said[:220]}")
        fail = rec.failed.failure
        if fail and fail.log_lines:
            out += ["", f"What `read_logs(grep={fail.grep!r})` returned:", "", "```"]
            out += [line[:200] for line in fail.log_lines[-6:]]
            out.append("```")
        out.append("")
    out += ["## Approvals", ""]
    for i, approval in enumerate(result.approvals, 1):
        shown = approval.get("shown", "")
        summary = next((ln for ln in shown.splitlines()
                        if ln.startswith(("Diff against", "Changes:"))), "")
        out.append(f"{i}. {approval['how']}: {summary.strip() or 'see the console output'}")
    rows_sizes, largest = _sizes(result.calls)
    errors = [c for c in result.calls if c.error]
    budget = ("within" if largest.bytes <= RESULT_BUDGET_BYTES else "OVER")
    out += ["", "## Tool results", "",
            f"The agent made {len(result.calls)} tool calls. The largest result was "
            f"{largest.bytes} bytes (`{largest.tool}`), {budget} the 8 KB budget for one "
            "result; sizes are of the text the model reads (the result's JSON).", ""]
    if errors:
        named = all(c.next_calls for c in errors)
        out.append(f"{len(errors)} result(s) were errors; "
                   + ("each named the next call: " if named else "NOT all named a next call: ")
                   + "; ".join(f"`{c.tool}` -> {', '.join(c.next_calls) or 'nothing'}"
                               for c in errors) + ".")
    else:
        out.append("No tool call returned an error: the crash reached the agent as data "
                   "(`engine_status`' `last_error`), and that message named the next calls.")
    # every call's size, folded: the table above is what a person reads, this the evidence
    out += ["", *rows_sizes, "", "<details><summary>The size of every tool result, call by "
            "call</summary>", "", "| # | call | bytes | error |", "|---:|---|---:|---|"]
    # a pipe inside a table cell, code span included, is written \| (GitHub's tables)
    out += [f"| {i} | `{c.call_text().replace('|', chr(92) + '|')}` | {c.bytes} | "
            f"{'yes' if c.error else ''} |" for i, c in enumerate(result.calls, 1)]
    out += ["", "</details>", "", "## Run it again", "",
            "`make demo` (or `.venv/bin/python examples/research_loop.py --help` for the "
            "flags: `--steps`, `--approvers`, `--report`, `--plot`, `--keep`). The numbers "
            "come from the run; on another CPU they can differ, and so can the verdicts.", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out), encoding="utf-8")


def _relative(target: Path, report: Path) -> str:
    try:
        return str(target.resolve().relative_to(report.resolve().parent))
    except ValueError:
        return str(target.resolve())
