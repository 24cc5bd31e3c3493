"""Compatibility path for `SwarmClient` (AgentJet Swarm documents import it from here)."""

from ajet.client import SwarmClient

__all__ = ["SwarmClient"]
