"""Background rollout jobs started by the bridge; each workflow runs in its own child process.

A workflow `package.module:function` (or `path/file.py:function`) is the agent's own code,
so it never runs in the bridge, which holds the control token and writes the approvals
folder. `start` launches `python -m mcp_bridge.rollout_child` (same interpreter) in an
empty temp folder, with an environment that has no `AJET_*` variable (nor a copy of
one's value under another name), and talks to it over its stdin/stdout (JSON lines; the protocol and which
`ajet` the child imports are in `mcp_bridge.rollout_child`):

- with a worker token, the child claims and ends episodes itself with that token (sent
  over the pipe, never in its environment);
- without one, the bridge claims each episode with its own client (`ajet.rollout.
  RolloutRunner`) and passes the episode's base URL and key to the child, which runs the
  workflow and answers with the reward.

A workflow that crashes the child, hangs past `workflow_timeout_s`, or fails to import is
stopped (the child's whole process group) and reported in the job's `error`; the bridge
carries on.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ajet.client import SwarmClient
from ajet.protocol import BeginEpisodeResponse
from ajet.rollout import RolloutRunner, WorkflowOutput

__all__ = ["RolloutHandle", "RolloutManager", "child_environment"]

log = logging.getLogger(__name__)

#: A workflow call running longer than this is taken as hung: its child is stopped.
DEFAULT_WORKFLOW_TIMEOUT_S = 600.0
#: How long the child may take to import the workflow and list its tasks.
LOAD_TIMEOUT_S = 120.0
_STDERR_TAIL = 40
#: Environment variables a workflow must never see: every `AJET_*` one (tokens, the
#: approvals folder, the approver's own token, names not thought of yet).
_SECRET_PREFIX = "AJET_"
#: A value this short is no secret worth hunting for under other names ("1", "info").
_MIN_SECRET_CHARS = 8


def child_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The bridge's environment without any `AJET_*` variable, nor any other variable
    whose value holds one of theirs (`MY_TOKEN=$AJET_SWARM_TOKEN`); the rest of the
    user's environment (PATH, HOME, proxies, their own keys) stays."""
    source = dict(os.environ if env is None else env)
    secrets = [v for k, v in source.items()
               if k.upper().startswith(_SECRET_PREFIX) and len(v) >= _MIN_SECRET_CHARS]
    return {k: v for k, v in source.items()
            if not k.upper().startswith(_SECRET_PREFIX) and not any(s in v for s in secrets)}


class _Child:
    """One `rollout_child` process and its pipes."""

    def __init__(self, start: dict[str, Any]) -> None:
        self._cwd = Path(tempfile.mkdtemp(prefix="ajet-rollout-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mcp_bridge.rollout_child"], cwd=self._cwd,
            env=child_environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, encoding="utf-8", start_new_session=True)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL)
        self._write_lock = threading.Lock()
        threading.Thread(target=self._drain_stderr, daemon=True,
                         name=f"rollout-child-{self.proc.pid}-stderr").start()
        self.send(start)

    def send(self, message: dict[str, Any]) -> bool:
        stdin = self.proc.stdin
        if stdin is None:
            return False
        with self._write_lock:
            try:
                stdin.write(json.dumps(message) + "\n")
                stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def lines(self) -> IO[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float) -> None:
        """Ask it to stop, then signal its whole group (TERM, then KILL)."""
        self.send({"type": "stop"})
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._close()

    def kill(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.proc.wait(3.0)
                break
            except subprocess.TimeoutExpired:
                continue
        self._close()

    def exit_text(self) -> str:
        try:
            code: int | None = self.proc.wait(5.0)  # its stdout closed: it is exiting
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(0.05)  # let its last stderr lines arrive
        tail = " | ".join(list(self.stderr_tail)[-5:])
        return f"the workflow process exited with code {code}" + (f": {tail}" if tail else "")

    def _close(self) -> None:
        for stream in (self.proc.stdin,):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        shutil.rmtree(self._cwd, ignore_errors=True)

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.stderr_tail.append(line[:500])
            log.debug("workflow %s: %s", self.proc.pid, line)


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
    mode: str  # "worker": the child claims episodes; "relay": the bridge claims for it
    child: _Child
    #: the run its episodes come from, as given (id or name); None: the default run
    run: str | None = None
    #: that run's id when the job started (a name can later mean a newer run)
    run_id: str | None = None
    runner: RolloutRunner | None = None  # relay mode: the bridge's runner
    client: SwarmClient | None = None
    child_stats: dict[str, Any] = field(default_factory=dict)
    stopped_at: float | None = None
    stop_requested: bool = False  # set before the child is asked to stop: its exit is no fault
    error: str | None = None
    #: worker mode: set once the child's last line was read and its exit judged
    followed: threading.Event = field(default_factory=threading.Event)

    def running(self) -> bool:
        if self.stopped_at is not None:
            return False
        if self.runner is not None:
            return self.runner.running()
        return not self.followed.is_set() and bool(self.child_stats.get("running", True))

    def stats(self) -> dict[str, Any]:
        if self.runner is not None:
            stats = self.runner.stats()
            data = {k: getattr(stats, k) for k in stats.__dataclass_fields__}
        else:
            data = {k: v for k, v in self.child_stats.items() if k != "type"}
        data["running"] = self.running()
        if self.error:
            data["last_error"] = self.error
        return data


class RolloutManager:
    """Start, list and stop rollout jobs against one swarm server."""

    def __init__(self, swarm_url: str, *, token: str | None, worker_token: str | None = None,
                 repo: Path, workflow_timeout_s: float = DEFAULT_WORKFLOW_TIMEOUT_S) -> None:
        self._swarm_url = swarm_url
        self._token = token  # the bridge's own (control) token: never given to a child
        self._worker_token = worker_token
        self._repo = repo
        self._workflow_timeout_s = workflow_timeout_s
        self._lock = threading.Lock()
        self._handles: dict[str, RolloutHandle] = {}

    def start(self, workflow: str, *, n_workers: int, num_repeat: int,
              max_episodes: int | None = None, run: str | None = None,
              run_id: str | None = None) -> RolloutHandle:
        """Start `workflow` in a child process; raises ValueError if it cannot be loaded.

        Episodes come from `run` (a run id or name; None: the default run, followed across
        its restarts); `run_id` is that run's id as the caller resolved it: the workers
        claim from that id, so a later run given the same name never gets their episodes
        (they stop when the run ends)."""
        mode = "worker" if self._worker_token else "relay"
        child = _Child({"type": "start", "workflow": workflow, "repo": str(self._repo),
                        "n_workers": n_workers, "num_repeat": num_repeat,
                        "max_episodes": max_episodes, "mode": mode,
                        "swarm_url": self._swarm_url, "worker_token": self._worker_token,
                        "run_id": _claim_from(run, run_id)})
        first = _read_first(child)
        if first.get("type") != "ready":
            child.kill()
            raise ValueError(first.get("error") or child.exit_text())
        tasks = list(first.get("tasks") or [])
        handle = RolloutHandle(
            handle=f"ro-{secrets.token_hex(3)}", workflow=workflow, n_workers=n_workers,
            num_repeat=num_repeat, tasks=len(tasks), max_episodes=max_episodes,
            started_at=time.time(), mode=mode, child=child, run=run, run_id=run_id)
        if mode == "relay":
            self._start_relay(handle, tasks)
        else:
            threading.Thread(target=self._follow_worker, args=(handle,), daemon=True,
                             name=f"{handle.handle}-stats").start()
        with self._lock:
            self._handles[handle.handle] = handle
        log.info("rollouts %s started (%s mode, child pid %s) for %s: %s, %d workers, "
                 "%d tasks x %d", handle.handle, mode, child.proc.pid, run or "the default run",
                 workflow, n_workers, len(tasks), num_repeat)
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
            job.stop_requested = True
            try:
                if job.runner is not None:
                    job.runner.stop(timeout)
                job.child.stop(timeout)
            finally:
                job.stopped_at = time.time()
                if job.client is not None:
                    job.client.close()
            log.info("rollouts %s stopped", handle)
        return job

    def stop_all(self, *, timeout: float = 30.0) -> list[RolloutHandle]:
        return [job for h in [j.handle for j in self.all()]
                if (job := self.stop(h, timeout=timeout)) is not None]

    # ------------------------------------------------------------------ worker mode

    def _follow_worker(self, job: RolloutHandle) -> None:
        """Thread: read the child's stats; stop it if a workflow call hangs."""
        try:
            self._read_worker(job)
        finally:
            job.followed.set()

    def _read_worker(self, job: RolloutHandle) -> None:
        for line in job.child.lines():
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("type") == "stats":
                job.child_stats = message
                if float(message.get("oldest_workflow_s") or 0) > self._workflow_timeout_s:
                    self._fail(job, f"a workflow call ran over {self._workflow_timeout_s:g}s "
                                    "(hung?); its process was stopped")
                    return
        if not job.stop_requested and job.child.proc.wait() != 0:
            self._fail(job, job.child.exit_text())

    # ------------------------------------------------------------------ relay mode

    def _start_relay(self, job: RolloutHandle, tasks: list[dict[str, Any]]) -> None:
        results: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        results_lock = threading.Lock()
        counter = iter(range(1, 1 << 62))

        def read_results() -> None:
            for line in job.child.lines():
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                with results_lock:
                    slot = results.get(message.get("id"))
                if message.get("type") == "result" and slot is not None:
                    slot[1].append(message)
                    slot[0].set()
            if not job.stop_requested:
                self._fail(job, job.child.exit_text())
            with results_lock:  # wake every waiting worker: the child is gone
                for event, _ in results.values():
                    event.set()

        def relay(task: dict[str, Any], episode: BeginEpisodeResponse) -> WorkflowOutput:
            key = next(counter)
            event: threading.Event = threading.Event()
            box: list[dict[str, Any]] = []
            with results_lock:
                results[key] = (event, box)
            try:
                sent = job.child.send({"type": "episode", "id": key, "task": task,
                                       "episode": episode.model_dump(mode="json")})
                if not sent or not event.wait(self._workflow_timeout_s):
                    if sent:
                        self._fail(job, f"a workflow call ran over {self._workflow_timeout_s:g}s "
                                        "(hung?); its process was stopped")
                    raise RuntimeError(job.error or job.child.exit_text())
                if not box:
                    raise RuntimeError(job.error or job.child.exit_text())
                answer = box[0]
                if "error" in answer:
                    raise RuntimeError(f"workflow raised {answer['error']}")
                return WorkflowOutput(**answer["output"])
            finally:
                with results_lock:
                    results.pop(key, None)

        job.client = SwarmClient(self._swarm_url, token=self._token)
        job.runner = RolloutRunner(job.client, relay, tasks, n_workers=job.n_workers,
                                   num_repeat=job.num_repeat, max_episodes=job.max_episodes,
                                   run_id=_claim_from(job.run, job.run_id))
        threading.Thread(target=read_results, daemon=True, name=f"{job.handle}-results").start()
        job.runner.start()

        def reap() -> None:  # the runner met max_episodes (or was stopped): end the child
            assert job.runner is not None
            job.runner.join()
            if not job.stop_requested:
                job.stop_requested = True
                job.child.stop(10.0)

        threading.Thread(target=reap, daemon=True, name=f"{job.handle}-reap").start()

    def _fail(self, job: RolloutHandle, reason: str) -> None:
        """Stop a job whose workflow crashed or hung; the reason shows in its status."""
        if job.error is None:
            job.error = reason
            log.warning("rollouts %s: %s", job.handle, reason)
        if job.runner is not None:
            threading.Thread(target=job.runner.stop, args=(10.0,), daemon=True).start()
        job.child.kill()


def _read_first(child: _Child) -> dict[str, Any]:
    """The child's first message (ready or error), within LOAD_TIMEOUT_S."""
    box: list[dict[str, Any]] = []

    def read() -> None:
        line = child.lines().readline()
        try:
            box.append(json.loads(line) if line else {})
        except ValueError:
            box.append({"type": "error", "error": f"unreadable answer: {line[:200]!r}"})

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(LOAD_TIMEOUT_S)
    if not box:
        return {"type": "error", "error": f"the workflow did not load within {LOAD_TIMEOUT_S:g}s"}
    if not box[0]:
        time.sleep(0.2)  # let stderr's last lines arrive
        return {"type": "error", "error": child.exit_text()}
    return box[0]


def _claim_from(run: str | None, run_id: str | None) -> str | None:
    """The run a job's workers claim episodes from: the resolved id of a named run (a name
    can pass to a later run), None for the default run."""
    return None if run is None else (run_id or run)
