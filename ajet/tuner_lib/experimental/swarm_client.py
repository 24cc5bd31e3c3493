"""Compatibility path of the original AgentJet client module.

    from ajet.tuner_lib.experimental.swarm_client import SwarmClient

`SwarmClient` is this project's client (ajet/client.py), which also carries the
original's methods; the rest are the original module's other public names.
"""

from ajet.client import SwarmClient
from ajet.errors import SwarmServerOfflineError
from ajet.original_rollouts import auto_train_with_dataset, run_episodes_until_all_complete
from ajet.tuner_lib.experimental.interchange_utils import SwarmThrottlePolicy

__all__ = [
    "SwarmClient",
    "SwarmServerOfflineError",
    "SwarmThrottlePolicy",
    "auto_train_with_dataset",
    "run_episodes_until_all_complete",
]
