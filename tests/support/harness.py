"""An `EngineController` on fake processes: the engine's lifecycle without any subprocess.

`make_harness` builds the controller with a `FakeSpawner` (its processes are driven by the
test: `serve` makes one report a state) over a real ledger and snapshot store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ajet
from ajet.copilot.job import AgentJetJob
from ajet.protocol import EngineReport, EngineState
from swarm_server.engine import LAST_CONFIG_KEY, EngineController
from swarm_server.ledger import Ledger, SnapshotRecord
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore
from swarm_server.supervisor import FakeProcess, FakeSpawner

__all__ = ["FixedSnapshots", "Harness", "make_harness", "serve", "wait_until"]

S = EngineState


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def serve(proc: FakeProcess, state: EngineState = S.ROLLING, ajet_file: str | None = None,
          step: int = 0) -> None:
    proc.report = EngineReport(state=state, pid=proc.pid, ajet_file=ajet_file or ajet.__file__,
                               step=step)


@dataclass
class Harness:
    ctl: EngineController
    spawner: FakeSpawner
    ledger: Ledger
    settings: Settings

    def configure(self, **fields: object) -> None:
        job = AgentJetJob(**fields)  # type: ignore[arg-type]
        self.ledger.set_meta(LAST_CONFIG_KEY, job.to_yaml())

    def start_rolling(self) -> tuple[str, FakeProcess]:
        run_id = self.ctl.start(role="control")
        proc = self.spawner.latest()
        serve(proc)
        wait_until(lambda: self.ctl.state is S.ROLLING)
        return run_id, proc


class FixedSnapshots:
    """A snapshot store with one active snapshot folder (what the code routes would set)."""

    def __init__(self, workdir: Path) -> None:
        self.base = workdir / "ajet_temp" / "20250101-000000"
        (self.base / "ajet").mkdir(parents=True)
        (self.base / "ajet" / "__init__.py").write_text("")
        self.record = SnapshotRecord(id="a" * 64, path="ajet_temp/20250101-000000/ajet",
                                     created=0.0, file_count=1, total_bytes=0, manifest=[],
                                     provenance={})

    def active(self) -> SnapshotRecord:
        return self.record

    def active_id(self) -> str:
        return self.record.id

    def base_dir(self, record: SnapshotRecord) -> Path:
        return self.base


def make_harness(tmp_path: Path, *, snapshots: object | None = None, **settings_kw: object
                 ) -> Harness:
    kw: dict[str, object] = {"status_poll_s": 0.005, "stop_grace_s": 0.2,
                             "boot_timeout_s": 30.0}
    kw.update(settings_kw)
    settings = Settings(workdir=tmp_path, **kw)  # type: ignore[arg-type]
    ledger = Ledger(settings.ledger_path)
    spawner = FakeSpawner()
    store = snapshots if snapshots is not None else SnapshotStore(settings, ledger)
    ctl = EngineController(settings, ledger, store, spawner=spawner,  # type: ignore[arg-type]
                           probe=spawner.probe)
    return Harness(ctl, spawner, ledger, settings)


