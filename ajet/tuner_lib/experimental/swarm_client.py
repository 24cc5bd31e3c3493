"""The original's module path of its swarm client (ajet/compat/client.py).

    from ajet.tuner_lib.experimental.swarm_client import SwarmClient

This `SwarmClient` is the typed `ajet.client.SwarmClient` plus the original's methods;
the rest are the original module's other public names.
"""

from ajet.compat.client import SwarmClient
from ajet.compat.rollouts import auto_train_with_dataset, run_episodes_until_all_complete
from ajet.compat.wire import SwarmThrottlePolicy
from ajet.errors import SwarmServerOfflineError

__all__ = [
    "SwarmClient",
    "SwarmServerOfflineError",
    "SwarmThrottlePolicy",
    "auto_train_with_dataset",
    "run_episodes_until_all_complete",
]
