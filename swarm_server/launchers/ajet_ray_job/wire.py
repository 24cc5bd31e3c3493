"""The driver's word to the swarm server: marker lines in the Ray job's log.

The server reads the job's log (Ray's Jobs API) to fill the run's `engine.log`; a line
that starts with `MARK` is not log text but one JSON event:

- `placed`: the placement group holds one bundle per node; `nodes` lists each node's
  index, Ray node id, address and host name, and the pid and start time of its torchrun;
- `refused`: the cluster cannot hold the run; `reason` says why and what is free,
  `never` whether not even the nodes' total resources would hold it;
- `channel`: rank 0's private channel listens on `host`:`port` (TCP, bearer token);
- `exit`: the driver's verdict as it ends: `code` (its exit code), `detail` (which node
  and rank ended the run, and how), `stopped` (it ended on a stop request).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MARK", "SPEC_ENV", "marker", "parse_marker"]

#: Prefix of a marker line; no engine line starts with it.
MARK = "@@ajet-ray "
#: The run's spec (JSON) in the driver's environment (the job's runtime_env env_vars).
SPEC_ENV = "AJET_RAY_RUN_SPEC"


def marker(event: str, **fields: Any) -> str:
    return MARK + json.dumps({"event": event, **fields}, sort_keys=True)


def parse_marker(line: str) -> dict[str, Any] | None:
    """The event of a marker line, or None for a log line (or a torn marker)."""
    if not line.startswith(MARK):
        return None
    try:
        data = json.loads(line[len(MARK):])
    except ValueError:
        return None
    return data if isinstance(data, dict) and isinstance(data.get("event"), str) else None
