"""The secrets no process below the server may hold in its environment, and a check."""

from __future__ import annotations

from pathlib import Path

from tests.support.servers import APPROVER_TOKEN, CONTROL_TOKEN, WORKER_TOKEN

__all__ = ["SECRETS", "leaked"]

SECRETS = (CONTROL_TOKEN.encode(), WORKER_TOKEN.encode(), APPROVER_TOKEN.encode(),
           b"AJET_SWARM_TOKEN=", b"AJET_SWARM_WORKER_TOKEN=", b"AJET_SWARM_APPROVER_TOKENS",
           b"approver-tokens-file")


def leaked(pid: int) -> list[bytes]:
    """The secrets found in `/proc/<pid>/environ`."""
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    return [s for s in SECRETS if s in environ]
