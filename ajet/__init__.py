"""AgentJet: the package a research agent patches and syncs to the swarm server.

Laptop side (light: no torch): `SwarmClient`, `AgentJetJob`, code packaging.
Cluster side: `ajet.engine`, the training engine, run as a subprocess of the swarm
server from the active code snapshot.
"""

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.errors import (
    EngineStateConflict,
    PackagingError,
    PayloadTooLarge,
    SwarmAuthError,
    SwarmConnectionError,
    SwarmError,
    SwarmHTTPError,
    SwarmNotFound,
    SwarmServerOfflineError,
    SwarmStateError,
    SwarmTimeout,
    SwarmValidationError,
)
from ajet.protocol import EngineState

__all__ = [
    "AgentJetJob",
    "EngineState",
    "EngineStateConflict",
    "PackagingError",
    "PayloadTooLarge",
    "SwarmAuthError",
    "SwarmClient",
    "SwarmConnectionError",
    "SwarmError",
    "SwarmHTTPError",
    "SwarmNotFound",
    "SwarmServerOfflineError",
    "SwarmStateError",
    "SwarmTimeout",
    "SwarmValidationError",
]
