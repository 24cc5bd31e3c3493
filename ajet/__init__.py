"""AgentJet: the package a research agent patches and syncs to the swarm server.

Laptop side (light: no torch): `SwarmClient`, `AgentJetJob`, code packaging.
Cluster side: `ajet.engine`, the training engine, run as a subprocess of the swarm
server from the active code snapshot.

`SwarmClient`, `AgentJetJob` and `EngineState` are imported on first use (PEP 562), so
that `import ajet.engine...` needs none of the client's dependencies (httpx, pydantic,
yaml): `bench/gpu_check.py` runs the engine on a host with only torch, transformers and
peft.
"""

# no `from __future__ import annotations` and private aliases only: every public name
# of this module is part of its surface (tests/ajet/test_exported_members.py)
import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

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

if _TYPE_CHECKING:
    from ajet.client import SwarmClient
    from ajet.copilot.job import AgentJetJob
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

#: Public names imported on first use, and the module each comes from.
_LAZY = {"AgentJetJob": "ajet.copilot.job", "EngineState": "ajet.protocol",
         "SwarmClient": "ajet.client"}


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ajet' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
