"""`python -m bench` (`make bench`): every benchmark in one process, one table of ratios.

    python -m bench                       # all, 5 repetitions; writes bench/results/latest.md
    python -m bench --only sync,mcp       # some (printed; written only with --output)
    python -m bench --reps 9              # more repetitions behind each median
    python -m bench --quick --reps 1      # the smoke test's tiny run: plumbing, not figures

Modules run one after the other on the same generated tree (150 files, 1.5 MB), each
with its own real servers on loopback. A module that fails is reported under the table
with its error and the others still run; the exit status is then 1. Figures on a shared
2-core machine are noisy, which is why every row carries its reference measured in the
same run and the ratio to it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from bench import (
    bench_budgets,
    bench_checkpoints,
    bench_concurrent,
    bench_episodes,
    bench_generation,
    bench_lora_memory,
    bench_mcp,
    bench_memory_plan,
    bench_ray,
    bench_restart,
    bench_soak,
    bench_sync,
    bench_timelines,
    bench_train_memory,
    bench_training,
)
from bench.context import BenchContext
from bench.report import Row, render

__all__ = ["MODULES", "main", "run_modules"]

log = logging.getLogger("bench")

#: Name (for --only and each row's rerun command) -> the module's `run(ctx)`.
MODULES: dict[str, Callable[[BenchContext], list[Row]]] = {
    "budgets": bench_budgets.run,
    "sync": bench_sync.run,
    "mcp": bench_mcp.run,
    "episodes": bench_episodes.run,
    "restart": bench_restart.run,
    "ray": bench_ray.run,
    "generation": bench_generation.run,
    "training": bench_training.run,
    "train_memory": bench_train_memory.run,
    "timelines": bench_timelines.run,
    "checkpoints": bench_checkpoints.run,
    "memory_plan": bench_memory_plan.run,
    "lora_memory": bench_lora_memory.run,
    "soak": bench_soak.run,
    "concurrent": bench_concurrent.run,
}
PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = PROJECT_ROOT / "bench" / "results" / "latest.md"


def run_modules(names: list[str], ctx: BenchContext
                ) -> tuple[list[Row], dict[str, str], dict[str, float]]:
    """Run the named modules in order: (rows, errors by module, seconds by module)."""
    rows: list[Row] = []
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name in names:
        log.warning("bench: running %s ...", name)
        t0 = time.perf_counter()
        try:
            rows += MODULES[name](ctx)
        except Exception as exc:  # noqa: BLE001 (one broken module must not hide the others)
            log.error("bench: %s failed:\n%s", name, traceback.format_exc())
            errors[name] = f"{type(exc).__name__}: {str(exc).strip()[:600]}"
        seconds[name] = time.perf_counter() - t0
    return rows, errors, seconds


def _git_head() -> str:
    try:
        head = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(PROJECT_ROOT), "status", "--porcelain"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _header(ctx: BenchContext, started: dt.datetime, load_before: str) -> str:
    return "\n".join([
        "# Benchmarks (`make bench`)",
        "",
        (f"{started:%Y-%m-%d %H:%M} UTC on {platform.node()}: {os.cpu_count()} CPUs, "
         f"Python {platform.python_version()}, {platform.system()} {platform.machine()}; "
         f"commit {_git_head()}; load average {load_before} before, {_load()} after."),
        (f"Medians over {ctx.reps} repetition(s) unless `reps` says otherwise; `ratio` = "
         "median / reference, both measured in this run. Rerun a row with its command."),
    ])


def _footer(errors: dict[str, str], seconds: dict[str, float]) -> str:
    lines = ["", "Time per module: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())]
    for name, error in errors.items():
        lines += ["", f"**{name} FAILED** (`python -m bench --only {name}`): {error}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5,
                   help="repetitions behind each median (default 5; the issue asks >= 5)")
    p.add_argument("--only", default="",
                   help=f"comma-separated modules out of: {', '.join(MODULES)}")
    p.add_argument("--quick", action="store_true",
                   help="shrink uploads, episode counts and training (smoke test only)")
    p.add_argument("--output", type=Path, default=None,
                   help=f"write the table here (default for a full run: {DEFAULT_OUTPUT})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown or args.reps < 1:
        p.error(f"unknown module(s) {', '.join(unknown)}; choose from {', '.join(MODULES)}"
                if unknown else "--reps must be at least 1")
    if args.reps < 5 and not args.quick:
        log.warning("bench: --reps %d is below the 5 repetitions the figures call for",
                    args.reps)

    started, load_before = dt.datetime.now(dt.timezone.utc), _load()
    with BenchContext(reps=args.reps, quick=args.quick) as ctx:
        rows, errors, seconds = run_modules(names, ctx)
        text = render(rows, header=_header(ctx, started, load_before)) + _footer(errors, seconds)
    sys.stdout.write("\n" + text)
    output = args.output
    if output is None and set(names) == set(MODULES) and not args.quick:
        output = DEFAULT_OUTPUT
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
        sys.stderr.write(f"written to {output}\n")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
