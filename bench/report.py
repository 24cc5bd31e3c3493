"""Rows of the benchmark table and their Markdown rendering."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Row:
    name: str
    median: float
    unit: str
    reference_name: str = ""
    reference: float | None = None
    target: str = ""
    rerun: str = "make bench"
    repetitions: int = 0
    note: str = ""
    #: Whether the figure meets `target` (None: no target, or not decidable).
    met: bool | None = None

    @property
    def ratio(self) -> float | None:
        if self.reference in (None, 0):
            return None
        return self.median / self.reference  # type: ignore[operator]


def median_of(fn: Callable[[], float], repetitions: int) -> tuple[float, list[float]]:
    """Run `fn` (which returns one measurement) `repetitions` times; median and samples."""
    samples = [fn() for _ in range(repetitions)]
    return statistics.median(samples), samples


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def render(rows: list[Row], *, header: str) -> str:
    lines = [
        header,
        "",
        "| benchmark | median | reference | ratio | target | met | reps | rerun |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ref = f"{r.reference:.4g} {r.unit} ({r.reference_name})" if r.reference is not None else "-"
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        note = f" ({r.note})" if r.note else ""
        met = {True: "yes", False: "**no**", None: "-"}[r.met]
        lines.append(
            f"| {r.name}{note} | {r.median:.4g} {r.unit} | {ref} | {ratio} | {r.target or '-'} "
            f"| {met} | {r.repetitions} | `{r.rerun}` |"
        )
    return "\n".join(lines) + "\n"
