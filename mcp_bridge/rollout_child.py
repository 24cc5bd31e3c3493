"""The child process that runs a rollout workflow for the bridge: `python -m mcp_bridge.rollout_child`.

A workflow is the agent's own code; it never runs in the bridge, which holds the control
token and writes the approvals folder. This process gets neither: its environment has no
`AJET_*` variable, and everything it needs comes over its stdin as
JSON lines (`mcp_bridge.rollouts` is the other end):

    -> {"type": "start", "workflow", "repo", "n_workers", "num_repeat", "max_episodes",
        "mode": "worker" | "relay", "swarm_url", "worker_token", "run_id"}
    <- {"type": "ready", "tasks": [...]}   or   {"type": "error", "error": "..."}

- `worker` mode (the bridge has a worker token): this process claims and ends episodes
  itself with the worker token (`ajet.rollout.RolloutRunner`) and reports
  `{"type": "stats", ..., "oldest_workflow_s"}` twice a second, until `{"type": "stop"}`
  or the end of its stdin. Episodes come from run `run_id` (an id or name; null: the
  server's default run).
- `relay` mode (no worker token): the bridge claims each episode and sends
  `{"type": "episode", "id", "task", "episode"}` (the episode's base URL and key); this
  process runs the workflow and answers `{"type": "result", "id", "output" | "error"}`.

Which `ajet` it imports: the bridge's own installed one (same interpreter, started in an
empty temp folder so nothing shadows it), imported before the workflow; the repository is
then put first on `sys.path` for the workflow's own modules, and the working directory
becomes the repository. The repository's `ajet/` (the code being trained) is never what
this process imports. Protocol output goes to a private copy of fd 1; the workflow's own
prints go to stderr, its stdin is /dev/null.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from ajet.client import SwarmClient
from ajet.protocol import BeginEpisodeResponse
# _as_output: the runner's own check of a workflow's result, so relay mode judges it alike
from ajet.rollout import RolloutRunner, WorkflowFn, _as_output, load_workflow

__all__ = ["main"]

log = logging.getLogger("mcp_bridge.rollout_child")

_STATS_EVERY_S = 0.5


class _Channel:
    """JSON lines to the bridge, one writer at a time."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._lock = threading.Lock()

    def send(self, **message: Any) -> None:
        line = json.dumps(message, default=str)
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


class _InFlight:
    """When each running workflow call started, so the bridge can stop a hung one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[int, float] = {}

    def wrap(self, fn: WorkflowFn) -> WorkflowFn:
        def timed(task: dict[str, Any], episode: BeginEpisodeResponse) -> Any:
            key = threading.get_ident()
            with self._lock:
                self._started[key] = time.monotonic()
            try:
                return fn(task, episode)
            finally:
                with self._lock:
                    self._started.pop(key, None)

        return timed

    def oldest_s(self) -> float:
        with self._lock:
            return max((time.monotonic() - t for t in self._started.values()), default=0.0)


def main() -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="%(asctime)s %(levelname)s rollout-child: %(message)s")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    os.dup2(2, 1)  # the workflow's prints must not corrupt the protocol
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    channel = _Channel(proto_out)
    start = json.loads(proto_in.readline() or "{}")
    repo = Path(start["repo"])
    try:
        os.chdir(repo)
        fn, tasks = load_workflow(start["workflow"], repo)
        json.dumps(tasks)  # tasks cross the pipe (relay mode): JSON only
    except Exception as exc:  # noqa: BLE001 - the workflow's import may raise anything
        channel.send(type="error", error=f"{type(exc).__name__}: {exc}"[:2000])
        return 1
    channel.send(type="ready", tasks=tasks)
    if start.get("mode") == "worker":
        return _run_worker(start, fn, tasks, proto_in, channel)
    return _run_relay(start, fn, proto_in, channel)


def _run_worker(start: dict[str, Any], fn: WorkflowFn, tasks: list[dict[str, Any]],
                proto_in: IO[str], channel: _Channel) -> int:
    inflight = _InFlight()
    client = SwarmClient(start["swarm_url"], token=start.get("worker_token"))
    runner = RolloutRunner(client, inflight.wrap(fn), tasks, n_workers=start["n_workers"],
                           num_repeat=start["num_repeat"], max_episodes=start.get("max_episodes"),
                           run_id=start.get("run_id"))
    stop = threading.Event()

    def listen() -> None:
        for line in proto_in:
            if json.loads(line).get("type") == "stop":
                break
        stop.set()  # "stop", or the bridge went away

    threading.Thread(target=listen, daemon=True, name="rollout-child-stdin").start()
    runner.start()
    while runner.running() and not stop.wait(_STATS_EVERY_S):
        channel.send(type="stats", oldest_workflow_s=inflight.oldest_s(),
                     **_stats(runner))
    runner.stop(10.0)
    channel.send(type="stats", oldest_workflow_s=0.0, **_stats(runner))
    client.close()
    return 0


def _run_relay(start: dict[str, Any], fn: WorkflowFn, proto_in: IO[str],
               channel: _Channel) -> int:
    def run(message: dict[str, Any]) -> None:
        try:
            episode = BeginEpisodeResponse.model_validate(message["episode"])
            output = _as_output(fn(message["task"], episode))
        except Exception as exc:  # noqa: BLE001 - reported to the bridge, which aborts it
            channel.send(type="result", id=message["id"], error=f"{type(exc).__name__}: {exc}")
            return
        channel.send(type="result", id=message["id"], output={
            "reward": output.reward, "is_success": output.is_success,
            "log_metrics": output.log_metrics, "metadata": output.metadata})

    # Not a `with` block: its exit would wait for a hung workflow; main() ends with _exit.
    pool = ThreadPoolExecutor(max_workers=start["n_workers"], thread_name_prefix="rollout-child")
    for line in proto_in:
        message = json.loads(line)
        if message.get("type") == "stop":
            break
        if message.get("type") == "episode":
            pool.submit(run, message)
    pool.shutdown(wait=False, cancel_futures=True)
    return 0


def _stats(runner: RolloutRunner) -> dict[str, Any]:
    stats = runner.stats()
    return {k: getattr(stats, k) for k in stats.__dataclass_fields__}


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a hung workflow thread must not block the exit
