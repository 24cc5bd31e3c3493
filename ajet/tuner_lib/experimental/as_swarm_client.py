"""The original's earlier name of `ajet.tuner_lib.experimental.swarm_client` (an alias)."""

from ajet.tuner_lib.experimental.swarm_client import (
    SwarmClient,
    SwarmServerOfflineError,
    SwarmThrottlePolicy,
    auto_train_with_dataset,
    run_episodes_until_all_complete,
)

__all__ = [
    "SwarmClient",
    "SwarmServerOfflineError",
    "SwarmThrottlePolicy",
    "auto_train_with_dataset",
    "run_episodes_until_all_complete",
]
