"""Background rollout workers started by the bridge, addressed by a short handle.

Each `start_rollouts` call loads a workflow `package.module:function` (and its tasks)
from the user's repository with `ajet.rollout.load_workflow` and runs it with
`ajet.rollout.RolloutRunner`: N worker threads that claim episodes on the swarm server,
call the workflow, and report rewards. The bridge only keeps the handles; the runner
owns the threads.

Loading a workflow puts the user's repository first on `sys.path` (the workflow imports
its own helpers). Every `ajet` module the bridge itself uses is therefore imported when
the bridge starts, never lazily afterwards, so the bridge never picks up the agent's
patched copy of `ajet/` from the repository.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ajet.client import SwarmClient
from ajet.rollout import RolloutRunner, load_workflow

__all__ = ["RolloutHandle", "RolloutManager"]

log = logging.getLogger(__name__)


@dataclass
class RolloutHandle:
    """One background rollout job."""

    handle: str
    workflow: str
    n_workers: int
    num_repeat: int
    tasks: int
    max_episodes: int | None
    started_at: float
    runner: RolloutRunner
    client: SwarmClient
    stopped_at: float | None = None

    def running(self) -> bool:
        return self.stopped_at is None and self.runner.running()

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.runner.stats())


class RolloutManager:
    """Start, list and stop rollout jobs against one swarm server."""

    def __init__(self, swarm_url: str, *, token: str | None, repo: Path) -> None:
        self._swarm_url = swarm_url
        self._token = token
        self._repo = repo
        self._lock = threading.Lock()
        self._handles: dict[str, RolloutHandle] = {}

    def start(self, workflow: str, *, n_workers: int, num_repeat: int,
              max_episodes: int | None = None) -> RolloutHandle:
        """Load `workflow` from the repo and start its workers in the background.

        `load_workflow`'s errors (bad spec, the module's own import errors, no tasks) pass
        through for the caller to report.
        """
        fn, tasks = load_workflow(workflow, self._repo)
        client = SwarmClient(self._swarm_url, token=self._token)
        try:
            runner = RolloutRunner(client, fn, tasks, n_workers=n_workers, num_repeat=num_repeat,
                                   max_episodes=max_episodes)
            runner.start()
        except BaseException:
            client.close()
            raise
        handle = RolloutHandle(
            handle=f"ro-{secrets.token_hex(3)}", workflow=workflow, n_workers=n_workers,
            num_repeat=num_repeat, tasks=len(tasks), max_episodes=max_episodes,
            started_at=time.time(), runner=runner, client=client,
        )
        with self._lock:
            self._handles[handle.handle] = handle
        log.info("rollouts %s started: %s, %d workers, %d tasks x %d", handle.handle, workflow,
                 n_workers, len(tasks), num_repeat)
        return handle

    def get(self, handle: str) -> RolloutHandle | None:
        with self._lock:
            return self._handles.get(handle)

    def all(self) -> list[RolloutHandle]:
        with self._lock:
            return sorted(self._handles.values(), key=lambda h: h.started_at)

    def stop(self, handle: str, *, timeout: float = 30.0) -> RolloutHandle | None:
        """Stop one job (idempotent); None if the handle is unknown."""
        job = self.get(handle)
        if job is None:
            return None
        if job.stopped_at is None:
            try:
                job.runner.stop(timeout)
            finally:
                job.stopped_at = time.time()
                job.client.close()
            log.info("rollouts %s stopped", handle)
        return job

    def stop_all(self, *, timeout: float = 30.0) -> list[RolloutHandle]:
        return [job for h in [j.handle for j in self.all()]
                if (job := self.stop(h, timeout=timeout)) is not None]
