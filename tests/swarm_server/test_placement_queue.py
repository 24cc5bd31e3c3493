"""Under the Ray launcher the server counts no device slots: Ray's placement decides. A run
the cluster cannot hold now waits in the run pool's queue (its place and Ray's words
shown) and is tried again, first in first out; one that not even the idle cluster could
hold, or one started with `queue: false`, is refused. A launcher that refuses stands in
for Ray (`PlacementRefused`, what `RaySpawner.start` raises); the rest is real: the run
pool, its controllers on fake processes, the ledger and the snapshot's own validator.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ajet.copilot.job import AgentJetJob
from ajet.protocol import SERVER_CODE, EngineState, StartRunRequest
from swarm_server.devices import DevicePool
from swarm_server.engine import EngineController
from swarm_server.ledger import Ledger
from swarm_server.run_pool import RunPool
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore
from swarm_server.supervisor import FakeSpawner, PlacementRefused, ProcessHandle, SpawnSpec
from tests.support.harness import wait_until

JOB = AgentJetJob(experiment_name="ray-sweep").to_yaml()
FREE = "the Ray cluster cannot hold this run: 1 of its 2 alive node(s) have that"


class RefusingLauncher(FakeSpawner):
    """Refuses the next `refuse` starts, as Ray does when its free resources fall short."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = 0
        self.never = False
        self.refused: list[str] = []  # run ids, in the order they were tried

    def start(self, spec: SpawnSpec) -> ProcessHandle:
        if self.refuse:
            self.refuse -= 1
            self.refused.append(spec.argv[spec.argv.index("--run-id") + 1])
            raise PlacementRefused(FREE, "free resources on the Ray cluster",
                                   never=self.never)
        return super().start(spec)

    def started(self) -> list[str]:
        return [p.spec.argv[p.spec.argv.index("--run-id") + 1] for p in self.processes]


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[RunPool, RefusingLauncher]]:
    settings = Settings(workdir=tmp_path, status_poll_s=0.005, stop_grace_s=0.2,
                        boot_timeout_s=30.0)
    ledger = Ledger(settings.ledger_path)
    snapshots = SnapshotStore(settings, ledger)
    launcher = RefusingLauncher()
    devices = DevicePool.for_ray()
    default = EngineController(settings, ledger, snapshots, spawner=launcher,
                               probe=launcher.probe, devices=devices)
    runs = RunPool(settings, ledger, snapshots, default.approvals, default, devices)
    runs.placement_retry_s = 0.3
    yield runs, launcher
    runs.shutdown()
    ledger.close()


def _start(runs: RunPool, name: str, **extra: object) -> str:
    return runs.start(StartRunRequest(snapshot_id=SERVER_CODE, yaml=JOB, name=name,
                                      **extra), role="control")  # type: ignore[arg-type]


def test_a_run_ray_cannot_place_now_waits_and_starts_in_its_turn(
        pool: tuple[RunPool, RefusingLauncher]) -> None:
    runs, launcher = pool
    runs.placement_retry_s = 3600  # here the tries follow the runs' ends only
    first, filler = _start(runs, "first"), _start(runs, "filler")
    launcher.refuse = 2  # the cluster is full for the next two tries
    second = _start(runs, "second")
    third = _start(runs, "third")  # behind it, never tried ahead of it
    assert launcher.refused == [second] and launcher.started() == [first, filler]
    status = runs.status("second")
    assert (status.state, status.queue_position) == (EngineState.OFFLINE, 1)
    assert FREE in (status.queue_reason or "") and "tried again" in (status.queue_reason or "")
    assert status.last_error is None  # a refusal for now is no failure
    record = runs.ledger.get_run(second)
    assert record is not None and (record.status, record.ended_at) == ("queued", None)
    behind = runs.status("third")
    assert behind.queue_position == 2 and "1 run(s) ahead of it" in (behind.queue_reason or "")
    assert runs.devices_status().queued == [second, third]

    runs.stop("first", role="control", reason="test")  # a run's end: a try, refused again
    wait_until(lambda: launcher.refused == [second, second])
    assert runs.devices_status().queued == [second, third]
    assert launcher.started() == [first, filler]  # the refused try started no other try
    runs.stop("filler", role="control", reason="test")  # the next end: both placed, in order
    wait_until(lambda: launcher.started() == [first, filler, second, third])
    assert runs.devices_status().queued == []
    record = runs.ledger.get_run(second)
    assert record is not None and record.status == "booting" and record.ended_at is None


def test_an_unplaced_run_is_tried_again_by_the_clock_too(
        pool: tuple[RunPool, RefusingLauncher]) -> None:
    """Other users of a shared cluster free resources without any run of ours ending."""
    runs, launcher = pool
    runs.placement_retry_s = 0.2
    launcher.refuse = 1
    alone = _start(runs, "alone")
    wait_until(lambda: launcher.started() == [alone])
    assert launcher.refused == [alone] and runs.controller(alone) is not None


def test_a_run_no_idle_cluster_could_hold_or_one_that_may_not_wait_is_refused(
        pool: tuple[RunPool, RefusingLauncher]) -> None:
    runs, launcher = pool
    launcher.refuse, launcher.never = 1, True
    with pytest.raises(PlacementRefused) as never:
        _start(runs, "huge")
    assert never.value.status == 409 and FREE in str(never.value.detail)
    launcher.refuse, launcher.never = 1, False
    with pytest.raises(PlacementRefused):
        _start(runs, "impatient", queue=False)
    assert runs.devices_status().queued == []
    for name in ("huge", "impatient"):
        status = runs.status(name)
        assert status.queue_position is None and status.last_error is not None
