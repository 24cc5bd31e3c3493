"""Smoke test of `bench/`: every benchmark module runs end to end with tiny counts.

No figure is judged here (speed belongs to `make bench`, never to tests): each module
must finish, return well-formed rows (finite medians, a unit, a rerun command) and
leave no server behind. The modules that start the torch engine (or a probe that imports
torch) are marked `bench`: `make bench-smoke` runs them (about 80 s of CPU), `make test`
leaves them out. They check the measuring code, not the product, and `make bench` itself
names a module that fails; docs/testing.md says why.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from bench.__main__ import MODULES, main
from bench.context import BenchContext
from bench.report import Row
from bench.tree import edit_one_file, make_tree, restore_tree

PROJECT_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ctx() -> Iterator[BenchContext]:
    with BenchContext(reps=1, quick=True) as context:
        yield context


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _check(rows: list[Row], name: str) -> None:
    assert rows, f"{name} returned no rows"
    for row in rows:
        assert math.isfinite(row.median), row
        assert row.unit and row.repetitions >= 1, row
        assert row.rerun == f"python -m bench --only {name}", row
        if row.reference is not None:
            assert math.isfinite(row.reference) and row.reference_name, row


def _run_module(name: str, ctx: BenchContext) -> list[Row]:
    before = _children()
    rows = MODULES[name](ctx)
    _check(rows, name)
    assert _children() <= before, f"{name} left processes running"
    return rows


def test_tree_has_the_issue_size_and_one_edit_changes_one_file(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "tree")
    assert tree.files == 150
    assert abs(tree.total_bytes - 1_500_000) < 5_000
    before = tree.edit_target.read_text()
    size = edit_one_file(tree, "x")
    assert size == tree.edit_target.stat().st_size and size > len(before)
    status = subprocess.run(["git", "-C", str(tree.root), "status", "--porcelain"],
                            capture_output=True, text=True, check=True).stdout.split("\n")
    assert [line for line in status if line] == [" M ajet/_bench_filler/mod_000.py"]
    restore_tree(tree)
    assert tree.edit_target.read_text() == before


def test_budgets(ctx: BenchContext) -> None:
    rows = {r.name: r for r in _run_module("budgets", ctx)}
    imports = rows["import ajet + SwarmClient + AgentJetJob"]
    assert "heavy modules imported: none" in imports.note  # the client never imports torch


def test_sync(ctx: BenchContext) -> None:
    rows = {r.name: r for r in _run_module("sync", ctx)}
    # counts, not timings: an unchanged push is one request with no blob bytes
    assert rows["sync unchanged push: HTTP requests"].median == 1
    assert rows["sync unchanged push: blob bytes uploaded"].median == 0


def test_mcp(ctx: BenchContext) -> None:
    _run_module("mcp", ctx)


@pytest.mark.slow
@pytest.mark.bench
def test_episodes(ctx: BenchContext) -> None:
    _run_module("episodes", ctx)


def test_profile_summary_counts_own_and_inclusive_samples() -> None:
    from bench.profile_episodes import top

    raw = ("MainThread (1);run (main.py:10);serve (srv.py:3);send (ch.py:7) 6\n"
           "MainThread (1);run (main.py:10);serve (srv.py:4) 2\n"
           "poll (2);get (client.py:9) 2\n")
    own, inclusive, total = top(raw)
    assert total == 10
    assert own == [("send (ch.py)", 6), ("serve (srv.py)", 2), ("get (client.py)", 2)]
    assert set(inclusive[:2]) == {("run (main.py)", 8), ("serve (srv.py)", 8)}


@pytest.mark.slow
@pytest.mark.bench
def test_restart(ctx: BenchContext) -> None:
    _run_module("restart", ctx)


@pytest.mark.slow
@pytest.mark.bench
def test_generation(ctx: BenchContext) -> None:
    rows = {r.name: r for r in _run_module("generation", ctx)}
    kv = rows["generation ajet-tiny: tokens/s, KV cache + continuous batching"]
    assert kv.reference_name == "recompute every prefix"


@pytest.mark.slow
@pytest.mark.bench
def test_training(ctx: BenchContext) -> None:
    _run_module("training", ctx)


@pytest.mark.slow
@pytest.mark.bench
def test_train_memory(ctx: BenchContext) -> None:
    rows = _run_module("train_memory", ctx)
    shards = rows[0]
    assert shards.ratio is not None and shards.ratio < 0.6  # bytes, not timings: exact


@pytest.mark.slow
@pytest.mark.bench
def test_lora_memory(ctx: BenchContext) -> None:
    rows = _run_module("lora_memory", ctx)
    assert [r.unit for r in rows] == ["MiB"] * len(rows) and len(rows) >= 2


@pytest.mark.slow
@pytest.mark.bench
def test_checkpoints(ctx: BenchContext) -> None:
    (row,) = _run_module("checkpoints", ctx)
    assert row.unit == "s" and row.reference is not None


@pytest.mark.bench
def test_memory_plan(ctx: BenchContext) -> None:
    rows = _run_module("memory_plan", ctx)
    assert len(rows) == 4 and all(r.reference and r.reference > 0 for r in rows)


@pytest.mark.slow
def test_timelines(ctx: BenchContext) -> None:
    rows = _run_module("timelines", ctx)
    tokens = [r for r in rows if "tokens through the forward" in r.name]
    assert len(rows) == 4 and len(tokens) == 2
    # counts, not timings: the merged episode puts fewer tokens through the forward
    assert all(r.ratio is not None and r.ratio < 1 / 3 for r in tokens), tokens


def test_cli_prints_one_table_writes_it_and_reports_a_failed_module(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fine(ctx: BenchContext) -> list[Row]:
        return [Row("stub row", 2.0, "ms", "stub reference", 4.0, target="<= 3 ms",
                    rerun="python -m bench --only fine", repetitions=ctx.reps, met=True)]

    def broken(ctx: BenchContext) -> list[Row]:
        raise RuntimeError("the engine did not boot")

    monkeypatch.setitem(MODULES, "fine", fine)
    monkeypatch.setitem(MODULES, "broken", broken)
    out = tmp_path / "table.md"
    assert main(["--reps", "5", "--only", "broken,fine", "--output", str(out)]) == 1
    printed = capsys.readouterr().out
    assert out.read_text().strip() == printed.strip()
    assert ("| stub row | 2 ms | 4 ms (stub reference) | 0.50x | <= 3 ms | yes | 5 "
            "| `python -m bench --only fine` |") in printed
    assert "**broken FAILED** (`python -m bench --only broken`): RuntimeError: the engine " \
           "did not boot" in printed


def test_cli_rejects_an_unknown_module() -> None:
    result = subprocess.run([sys.executable, "-m", "bench", "--only", "nope"],
                            capture_output=True, text=True, cwd=PROJECT_ROOT, check=False)
    assert result.returncode == 2 and "unknown module(s) nope" in result.stderr


def test_soak_rows_from_a_report() -> None:
    # the soak itself runs in tests/faults/test_soak.py; here only its rows are built
    from collections import Counter

    from bench.bench_soak import lost, p99, rows
    from bench.soak import Episode, RunAccount, SoakReport

    report = SoakReport(episodes=[Episode("r1", "e1", "ended"), Episode("r1", "e2", "aborted")],
                        health_s=[0.001 * i for i in range(1, 101)], rss_mb=[60.0, 75.0, 70.0],
                        wall_s=10.0)
    engine = {"episodes_claimed": 2, "episodes_ended": 1, "episodes_trained": 0,
              "episodes_waiting": 1}
    whole = [RunAccount("r1", Counter(ended=1, aborted=1), 0, 0, engine, [])]
    built = {r.name: r for r in rows(report, whole, idle=[0.001] * 10)}
    _check(list(built.values()), "soak")
    assert built["soak: /health p99 latency during the soak"].median == pytest.approx(99.0)
    assert built["soak: server RSS growth over the soak"].median == 10.0
    assert built["soak: episodes lost"].median == 0 and lost(whole) == 0
    assert p99([5.0]) == 5.0
    short = [RunAccount("r1", Counter(ended=2), 0, 0, {**engine, "episodes_ended": 1}, [])]
    assert lost(short) == 1  # a worker's accepted end the engine never counted
