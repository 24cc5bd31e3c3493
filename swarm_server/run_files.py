"""Reading a run directory: `metrics.jsonl` (points, summary, downsampling), `engine.log`,
and each step's training samples (`samples/samples-<step>.jsonl`).

The engine writes these files (docs/internals.md, "Files in the run dir"); the server
only reads them, at the end of a run (summary into the ledger) and on every API read.
A half-written last line (the engine is mid-write) is skipped, never an error.

A regex log search uses the `regex` module (Python's syntax), never `re`: `re` has no
time limit and holds the GIL while it backtracks, so one pattern such as `(a|aa)+$`
from a worker token froze every thread of the server, `/health` and SIGTERM included.
`regex` matches with the GIL released (`concurrent=True`) and stops at a time budget
(`LogSearchTimeout`); callers run it off the event loop.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import regex

__all__ = [
    "REDACTED",
    "SUMMARY_FIELDS",
    "LogPattern",
    "LogSearchTimeout",
    "compile_log_regex",
    "downsample",
    "read_log_lines",
    "redact_secrets",
    "read_metrics",
    "read_samples",
    "sample_steps",
    "summarize",
]

#: Fields summarised per run (`RunPublic.summary`): best = max, except `loss` = min.
SUMMARY_FIELDS = ("reward_mean", "success_rate", "loss", "response_length")
_LOWER_IS_BETTER = frozenset({"loss"})

#: Only the end of a huge log is scanned; older lines are reported as truncated.
MAX_LOG_SCAN_BYTES = 16 * 1024 * 1024
#: Longer log lines are cut (and searched) at this length.
MAX_LOG_LINE_CHARS = 4000


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete metric points, in file order; each has an integer `step`."""
    try:
        text = path.read_text("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    points: list[dict[str, Any]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            point = json.loads(line)
        except ValueError:
            continue  # the engine is mid-write, or a line was damaged: skip it
        if isinstance(point, dict) and isinstance(point.get("step"), int):
            points.append(point)
    return points


def read_samples(path: Path, *, offset: int, limit: int, max_bytes: int
                 ) -> tuple[list[dict[str, Any]], int, int | None]:
    """One page of a step's samples file: (samples, total, next offset or None).

    The file is read line by line, never whole; a page ends at `limit` samples or once
    it holds `max_bytes` of them (it always holds one, if any is left). Raises
    `FileNotFoundError` when the step has no samples file.
    """
    page: list[dict[str, Any]] = []
    size = total = 0
    next_offset: int | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            index = total
            total += 1
            if index < offset or next_offset is not None:
                continue
            if len(page) >= limit or (page and size + len(line) > max_bytes):
                next_offset = index
                continue
            try:
                sample = json.loads(line)
            except ValueError:
                continue  # damaged line: skipped like a metrics line
            page.append(sample)
            size += len(line)
    return page, total, next_offset


def sample_steps(folder: Path) -> list[int]:
    """Steps that have a samples file, ascending."""
    steps = []
    for path in folder.glob("samples-*.jsonl"):
        number = path.stem.removeprefix("samples-")
        if number.isdigit():
            steps.append(int(number))
    return sorted(steps)


def summarize(points: Iterable[dict[str, Any]],
              fields: Iterable[str] = SUMMARY_FIELDS) -> dict[str, dict[str, float | int | None]]:
    """Per field present in the points: `first`, `last`, `best`, `best_step`."""
    wanted = tuple(fields)
    out: dict[str, dict[str, float | int | None]] = {}
    for name in wanted:
        series = [(p["step"], float(p[name])) for p in points
                  if _is_number(p.get(name))]
        if not series:
            continue
        pick = min if name in _LOWER_IS_BETTER else max
        best_step, best = pick(series, key=lambda sv: sv[1])
        out[name] = {"first": series[0][1], "last": series[-1][1], "best": best,
                     "best_step": best_step}
    return out


def downsample(points: list[dict[str, Any]], max_points: int) -> list[dict[str, Any]]:
    """At most `max_points` evenly spaced points, always keeping the first and the last."""
    n = len(points)
    if max_points >= n:
        return points
    if max_points <= 1:
        return points[-1:]
    # index i*(n-1)/(m-1) hits 0 and n-1 exactly; strictly increasing since m <= n
    indices = sorted({round(i * (n - 1) / (max_points - 1)) for i in range(max_points)})
    return [points[i] for i in indices]


LogPattern = regex.Pattern


class LogSearchTimeout(Exception):
    """A regex log search ran past its time budget."""

    def __init__(self, budget_s: float) -> None:
        super().__init__(f"the regex search ran past its {budget_s:g} s budget")
        self.budget_s = budget_s


def compile_log_regex(pattern: str) -> LogPattern[str]:
    """A pattern in Python's `re` syntax (the `regex` module's VERSION0); `ValueError`
    naming the problem if it is not valid."""
    try:
        return regex.compile(pattern, flags=regex.VERSION0)
    except regex.error as exc:
        raise ValueError(str(exc)) from exc


#: What a configured secret is replaced with in output that reaches a caller.
REDACTED = "[redacted]"


def redact_secrets(text: str, secrets: Sequence[str]) -> str:
    """`text` with every occurrence of each of `secrets` (longest first) replaced.

    A defence in depth: children never get a token in their environment, but a token
    that reached one anyway must not travel on to whoever reads its output.
    """
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def read_log_lines(path: Path, *, tail: int, grep: str | None = None,
                   pattern: LogPattern[str] | None = None,
                   budget_s: float = 1.0, redact: Sequence[str] = ()
                   ) -> tuple[list[str], int, bool]:
    """The last `tail` lines (after filtering by substring `grep` or regex `pattern`).

    Every string of `redact` (the server's tokens) is replaced before filtering, so a
    search cannot tell whether a token was in the log either.

    Returns (lines, total matching lines scanned, truncated). `truncated` is True when
    older matching lines exist than were returned, or the file was too big to scan whole.
    A `pattern` search that takes longer than `budget_s` in all raises `LogSearchTimeout`.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], 0, False
    with open(path, "rb") as f:
        start = max(0, size - MAX_LOG_SCAN_BYTES)
        f.seek(start)
        data = f.read()
    lines = data.decode("utf-8", errors="replace").splitlines()
    scanned_all = start == 0
    if not scanned_all and lines:
        lines = lines[1:]  # the first line was cut by the seek
    lines = [redact_secrets(line, redact)[:MAX_LOG_LINE_CHARS] for line in lines]
    if grep is not None:
        lines = [line for line in lines if grep in line]
    if pattern is not None:
        lines = _search(lines, pattern, budget_s)
    total = len(lines)
    kept = lines[-tail:] if tail > 0 else []
    return kept, total, (len(kept) < total) or not scanned_all


def _search(lines: list[str], pattern: LogPattern[str], budget_s: float) -> list[str]:
    deadline = time.monotonic() + budget_s
    kept: list[str] = []
    for line in lines:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LogSearchTimeout(budget_s)
        try:
            if pattern.search(line, concurrent=True, timeout=remaining):
                kept.append(line)
        except TimeoutError as exc:
            raise LogSearchTimeout(budget_s) from exc
    return kept


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def read_trackers(run_dir: Path) -> dict[str, str]:
    """Where the run's trackers write, from the engine's `trackers.json` ({} without one)."""
    try:
        data = json.loads((run_dir / "trackers.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    places = data.get("trackers") if isinstance(data, dict) else None
    if not isinstance(places, dict):
        return {}
    return {str(k)[:50]: str(v)[:1000] for k, v in list(places.items())[:10]}
