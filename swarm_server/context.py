"""`ServerContext`: the objects one server process owns, built once by `create_app`.

Passed to handlers through `swarm_server.deps`; no module keeps global state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm_server.ledger import Ledger
from swarm_server.settings import Settings

if TYPE_CHECKING:
    from swarm_server.approvals import Approvals
    from swarm_server.engine import EngineController
    from swarm_server.episodes import EpisodeGateway
    from swarm_server.run_pool import RunPool
    from swarm_server.snapshots import SnapshotStore

__all__ = ["ServerContext"]


@dataclass
class ServerContext:
    settings: Settings
    ledger: Ledger
    snapshots: SnapshotStore
    engine: EngineController  # the default run's (the single-engine surface)
    runs: RunPool  # every active run, the default one included; the device slots
    episodes: EpisodeGateway
    approvals: Approvals
