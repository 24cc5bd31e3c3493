"""SnapshotStore placeholder (see docs/internals.md); replaced by the code-sync work."""

from __future__ import annotations

from pathlib import Path

from ajet.protocol import SERVER_CODE
from swarm_server.ledger import Ledger, SnapshotRecord
from swarm_server.settings import Settings


class SnapshotStore:
    def __init__(self, settings: Settings, ledger: Ledger) -> None:
        self.settings = settings
        self.ledger = ledger

    def recover(self) -> None:
        pass

    def active(self) -> SnapshotRecord | None:
        return None

    def active_id(self) -> str:
        return SERVER_CODE

    def base_dir(self, record: SnapshotRecord) -> Path:
        return (self.settings.workdir / record.path).parent
