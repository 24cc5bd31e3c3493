"""Compatibility namespace: `ajet.tuner_lib.experimental.swarm_client`."""
