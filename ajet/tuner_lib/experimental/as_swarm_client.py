"""The original's earlier name of `ajet.tuner_lib.experimental.swarm_client` (an alias)."""

from ajet.tuner_lib.experimental import swarm_client as _swarm_client
from ajet.tuner_lib.experimental.swarm_client import *  # noqa: F403 - an alias, by design

__all__ = _swarm_client.__all__
