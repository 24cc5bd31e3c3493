"""EngineController placeholder (see docs/internals.md); replaced by the server-core work."""

from __future__ import annotations

from swarm_server.ledger import Ledger
from swarm_server.settings import Settings
from swarm_server.snapshots import SnapshotStore


class EngineController:
    def __init__(self, settings: Settings, ledger: Ledger, snapshots: SnapshotStore) -> None:
        self.settings = settings
        self.ledger = ledger
        self.snapshots = snapshots

    def recover(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
