"""Fail-fast between ranks: the first failure wins, a peer's failure ends this rank.

One process plays several ranks over one real store (torch's HashStore, the same
key-value API as torchrun's TCPStore); exits go to a recorder instead of `os._exit`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch.distributed as torch_dist

from ajet.engine.parallel.failures import RankFailures
from ajet.protocol import ENGINE_FAILURE_FILE, EngineFailure


def _boom(message: str) -> BaseException:
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


def test_the_first_failure_is_the_one_recorded_and_later_ones_point_to_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = torch_dist.HashStore()
    one = RankFailures(rank=1, world_size=2, run_dir=tmp_path, store=store)
    zero = RankFailures(rank=0, world_size=2, run_dir=tmp_path, store=store)
    first = one.report(_boom("loss exploded"))
    assert (first.rank, first.error) == (1, "RuntimeError: loss exploded")
    assert any("rank 1 failed: RuntimeError: loss exploded" in r.getMessage()
               and "Traceback" in r.getMessage() for r in caplog.records)
    # rank 0's own error is a consequence (a broken collective): rank 1 stays the cause
    second = zero.report(_boom("connection closed by peer"))
    assert second.rank == 1
    recorded = EngineFailure.model_validate_json((tmp_path / ENGINE_FAILURE_FILE).read_text())
    assert recorded.describe() == "rank 1 of 2 failed: RuntimeError: loss exploded"
    assert recorded.traceback[-1] == "RuntimeError: loss exploded"
    assert [p.name for p in tmp_path.iterdir()] == [ENGINE_FAILURE_FILE]  # no temp left


def test_a_peers_failure_ends_this_rank_at_once(tmp_path: Path) -> None:
    store = torch_dist.HashStore()
    exited: list[int] = []
    gone = threading.Event()

    def record_exit(code: int) -> None:
        exited.append(code)
        gone.set()

    watcher = RankFailures(rank=0, world_size=3, run_dir=tmp_path, store=store,
                           exit_process=record_exit)
    watcher.start(interval_s=0.02)
    assert not gone.wait(0.2)  # nothing failed: the watch keeps still
    RankFailures(rank=2, world_size=3, run_dir=tmp_path / "elsewhere", store=store
                 ).report(_boom("CUDA out of memory"))
    assert gone.wait(5.0) and exited == [1]
    # rank 0 records the failure in its run directory even when it came from afar
    recorded = EngineFailure.model_validate_json((tmp_path / ENGINE_FAILURE_FILE).read_text())
    assert recorded.rank == 2 and "out of memory" in recorded.error


def test_a_clean_stop_ends_the_watch_and_one_process_needs_no_store(tmp_path: Path) -> None:
    store = torch_dist.HashStore()
    exited: list[int] = []
    watcher = RankFailures(rank=0, world_size=2, run_dir=tmp_path, store=store,
                           exit_process=exited.append)
    watcher.start(interval_s=0.02)
    watcher.stop()
    RankFailures(rank=1, world_size=2, run_dir=tmp_path, store=store).report(_boom("late"))
    threading.Event().wait(0.2)
    assert exited == []
    alone = RankFailures(rank=0, world_size=1, run_dir=tmp_path / "single")
    (tmp_path / "single").mkdir()
    failure = alone.report(_boom("bad config"))
    assert failure.describe() == "the engine failed: RuntimeError: bad config"
    assert (tmp_path / "single" / ENGINE_FAILURE_FILE).exists()
