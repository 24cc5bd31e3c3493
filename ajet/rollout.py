"""Rollout workers: run a workflow function over tasks with N concurrent threads.

    def workflow(task: dict, episode: BeginEpisodeResponse) -> float | WorkflowOutput:
        client = openai.OpenAI(base_url=episode.openai_base_url,
                               api_key=episode.openai_api_key)
        ...                                  # chat as often as the task needs
        return WorkflowOutput(reward=..., is_success=..., log_metrics={...})

    stats = run_workflow(SwarmClient(url), workflow, tasks, n_workers=4, num_repeat=8)

Each task dict has a `task_id`. The runner sends every task `num_repeat` times in a
row (one GRPO group) and cycles through the tasks until stopped or `max_episodes`
episodes have ended. Per episode: `begin_episode`, the workflow, `end_episode`. A
workflow exception aborts the episode and the task is retried (at most
`max_attempts` times); 409 from `begin_episode` (engine not ROLLING) backs off and
retries; an episode the engine re-queued (idle timeout) is redone, so groups complete.
A workflow that fails the same way `max_identical_errors` times in a row (a missing
package, a wrong URL) stops the runner: `stats().stopped_reason` names the error and
what to do, instead of retrying forever.

With `run_id` (a run id or name of `POST /runs`) every episode is claimed from that run
(its key works only there); without it, from the default run. A run the server does not
know (a wrong name, or one that ended and left no record under that name), or one that has
ended (neither serving, booting nor queued), stops the runner with the reason in
`stopped_reason`: its workers never move on to another run.

No torch here: this runs on the laptop (`ajet.rollout` is imported by the MCP bridge).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet.client import SwarmClient
# A boundary import: the runner also takes the original's WorkflowOutput (ajet.schema.task)
from ajet.compat.boundary import workflow_output_fields
from ajet.errors import (
    EngineStateConflict,
    SwarmConnectionError,
    SwarmError,
    SwarmHTTPError,
    SwarmNotFound,
)
from ajet.protocol import BeginEpisodeResponse, EngineState

__all__ = ["RolloutRunner", "RolloutStats", "WorkflowFn", "WorkflowOutput", "load_workflow",
           "run_workflow"]

log = logging.getLogger(__name__)


@dataclass
class WorkflowOutput:
    reward: float
    is_success: bool | None = None
    log_metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)


WorkflowFn = Callable[[dict[str, Any], BeginEpisodeResponse], "float | WorkflowOutput"]


@dataclass
class RolloutStats:
    running: bool
    episodes_ended: int
    episodes_aborted: int
    episodes_requeued: int
    workflow_errors: int
    tasks_given_up: int
    begin_retries: int
    reward_mean: float | None
    recent_reward_mean: float | None
    elapsed_s: float
    last_error: str | None
    #: set when the runner stopped itself: the repeated error and the fix, or its run's end
    stopped_reason: str | None = None
    #: the runner stopped because its run (`run_id`) ended: no fault of the workflow
    run_ended: bool = False


@dataclass
class _Item:
    task: dict[str, Any]
    attempts: int = 0


class _TaskFeed:
    """Tasks in GRPO order (each `num_repeat` times in a row), retries first."""

    def __init__(self, tasks: Sequence[dict[str, Any]], num_repeat: int) -> None:
        self._order = self._cycle(list(tasks), num_repeat)
        self._retry: deque[_Item] = deque()
        self._lock = threading.Lock()

    @staticmethod
    def _cycle(tasks: list[dict[str, Any]], num_repeat: int) -> Iterator[_Item]:
        while True:
            for task in tasks:
                for _ in range(num_repeat):
                    yield _Item(task)

    def next(self) -> _Item:
        with self._lock:
            return self._retry.popleft() if self._retry else next(self._order)

    def retry(self, item: _Item) -> None:
        with self._lock:
            self._retry.append(item)


class RolloutRunner:
    """Background worker threads; `start()`, `stop(timeout)`, `stats()`, `join()`."""

    def __init__(self, client: SwarmClient, workflow: WorkflowFn,
                 tasks: Sequence[dict[str, Any]], *, n_workers: int = 4, num_repeat: int = 1,
                 max_episodes: int | None = None, max_attempts: int = 3,
                 max_identical_errors: int = 20, run_id: str | None = None) -> None:
        if not tasks:
            raise ValueError("no tasks: pass at least one task dict with a task_id")
        missing = [i for i, t in enumerate(tasks) if "task_id" not in t]
        if missing:
            raise ValueError(f"task(s) at index {missing[:5]} have no 'task_id'")
        if n_workers < 1 or num_repeat < 1:
            raise ValueError("n_workers and num_repeat must be at least 1")
        self.client = client
        self.workflow = workflow
        self.n_workers = n_workers
        self.num_repeat = num_repeat
        self.max_episodes = max_episodes
        self.max_attempts = max_attempts
        self.max_identical_errors = max_identical_errors
        #: the run the episodes are claimed from (id or name); None: the default run
        self.run_id = run_id
        self._feed = _TaskFeed(tasks, num_repeat)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._started = 0.0
        self._ended = self._aborted = self._requeued = self._errors = 0
        self._given_up = self._begin_retries = 0
        self._reward_sum = 0.0
        self._recent: deque[float] = deque(maxlen=100)
        self._last_error: str | None = None
        #: (signature, count) of the workflow errors in a row; a success resets it
        self._error_streak: tuple[str, int] = ("", 0)
        self._stopped_reason: str | None = None
        self._ended_run = False  # stopped because run `run_id` ended

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("this RolloutRunner was started already; create a new one")
        self._started = time.monotonic()
        for i in range(self.n_workers):
            thread = threading.Thread(target=self._worker, name=f"ajet-rollout-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the workers to finish; an episode in progress is aborted. Waits `timeout`."""
        self._stop.set()
        self.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the workers; True if all have finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            thread.join(left)
        return not self.running()

    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def stats(self) -> RolloutStats:
        with self._lock:
            return RolloutStats(
                running=self.running(), episodes_ended=self._ended,
                episodes_aborted=self._aborted, episodes_requeued=self._requeued,
                workflow_errors=self._errors, tasks_given_up=self._given_up,
                begin_retries=self._begin_retries,
                reward_mean=self._reward_sum / self._ended if self._ended else None,
                recent_reward_mean=sum(self._recent) / len(self._recent) if self._recent
                else None,
                elapsed_s=time.monotonic() - self._started if self._started else 0.0,
                last_error=self._last_error, stopped_reason=self._stopped_reason,
                run_ended=self._ended_run)

    # ------------------------------------------------------------------ worker

    def _quota_left(self) -> bool:
        with self._lock:
            return self.max_episodes is None or self._ended < self.max_episodes

    def _worker(self) -> None:
        while not self._stop.is_set() and self._quota_left():
            item = self._feed.next()
            episode = self._begin()
            if episode is None:  # stopping, or the quota is full
                self._feed.retry(item)
                return
            try:
                self._run_episode(item, episode)
            except Exception as exc:  # never let one episode kill the worker
                self._note_error(f"episode {episode.episode_uuid}: {exc!r}")
                self._feed.retry(item)

    def _begin(self) -> BeginEpisodeResponse | None:
        delay = 0.05
        # the quota is checked here too: other workers may fill it while this one waits
        # for ROLLING, and a run that ended (max_steps) never answers anything but 409
        while not self._stop.is_set() and self._quota_left():
            try:
                return self.client.open_episode(run_id=self.run_id)
            except SwarmNotFound as exc:
                # a run that is not there will not appear by waiting: stop, say why
                which = f"run {self.run_id!r}" if self.run_id else "the default run"
                self._stop_for(f"{which} is not on the server ({exc.detail}); start it (or "
                               "pick a run that list_runs shows) and start the rollouts again")
                return None
            except (EngineStateConflict, SwarmConnectionError) as exc:
                # not ROLLING (or the server is briefly away): wait and try again
                with self._lock:
                    self._begin_retries += 1
                if isinstance(exc, SwarmConnectionError):
                    self._note_error(str(exc))
                elif self.run_id and delay >= 1.0 and self._run_ended():
                    return None  # once a second at most: waiting would not bring it back
                self._stop.wait(delay)
                delay = min(delay * 2, 1.0)
        return None

    def _run_ended(self) -> bool:
        """Whether run `run_id` has ended (then the runner stops, saying why)."""
        try:
            status = self.client.run_status(str(self.run_id))
        except SwarmError:  # unreadable now: keep waiting, the next 409 asks again
            return False
        if status.state is not EngineState.OFFLINE or status.queue_position is not None:
            return False
        why = f": {status.last_error.reason[:300]}" if status.last_error else ""
        with self._lock:
            self._ended_run = True
        # a run that ended well (max_steps, a stop) is the usual end of its rollouts
        self._stop_for(f"run {self.run_id!r} ({status.run_id}) has ended{why}; its episodes "
                       "go nowhere else: start a run and start the rollouts again for it",
                       level=logging.ERROR if status.last_error else logging.INFO)
        return True

    def _run_episode(self, item: _Item, episode: BeginEpisodeResponse) -> None:
        task_id = str(item.task["task_id"])
        try:
            output = _as_output(self.workflow(item.task, episode))
        except Exception as exc:
            self._abort(episode, f"workflow raised {type(exc).__name__}: {exc}")
            item.attempts += 1
            with self._lock:
                self._errors += 1
                self._last_error = f"task {task_id}: {exc!r}"
                give_up = item.attempts >= self.max_attempts
                self._given_up += give_up
            if self._count_identical(exc):
                return
            if give_up:
                log.warning("task %s failed %d times; giving it up: %r", task_id, item.attempts,
                            exc)
            else:
                self._feed.retry(item)
            return
        if self._stop.is_set():
            self._abort(episode, "rollout runner stopped")
            self._feed.retry(item)
            return
        try:
            self.client.report_episode(episode.episode_uuid, task_id, output.reward,
                                    is_success=output.is_success, metadata=output.metadata,
                                    log_metrics=output.log_metrics)
        except SwarmHTTPError as exc:
            if exc.status in (404, 409):
                # the engine re-queued it (idle timeout) or a new run began: redo the task
                with self._lock:
                    self._requeued += 1
                self._feed.retry(item)
                return
            raise
        with self._lock:
            self._error_streak = ("", 0)
            self._ended += 1
            self._reward_sum += output.reward
            self._recent.append(output.reward)

    def _abort(self, episode: BeginEpisodeResponse, reason: str) -> None:
        try:
            self.client.cancel_episode(episode.episode_uuid, reason=reason[:500])
        except SwarmError as exc:  # already closed, or the engine is gone: nothing to free
            log.debug("abort of %s not needed: %s", episode.episode_uuid, exc)
        with self._lock:
            self._aborted += 1

    def _count_identical(self, exc: Exception) -> bool:
        """Count `exc` in the streak; at the bound, stop the runner. True once stopped."""
        signature = f"{type(exc).__name__}: {exc}"
        with self._lock:
            same, count = self._error_streak
            count = count + 1 if signature == same else 1
            self._error_streak = (signature, count)
            if count < self.max_identical_errors or self._stopped_reason:
                return self._stopped_reason is not None
            self._stopped_reason = (f"{_fix_for(exc)} (stopped after {count} identical "
                                    f"workflow errors: {signature[:150]})")
        log.error("rollouts: %s", self._stopped_reason)
        self._stop.set()
        return True

    def _stop_for(self, reason: str, *, level: int = logging.ERROR) -> None:
        with self._lock:
            if self._stopped_reason is None:
                self._stopped_reason = reason
                log.log(level, "rollouts: %s", reason)
        self._stop.set()

    def _note_error(self, text: str) -> None:
        log.warning("%s", text)
        with self._lock:
            self._last_error = text


def _fix_for(exc: Exception) -> str:
    """What to do about a workflow error that repeats."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        return (f"the workflow needs {top!r}: pip install {top} where it runs "
                "('agentjet-swarm[laptop]' has what the examples need)")
    return "fix the workflow (run it by hand on one task)"


def _as_output(result: float | WorkflowOutput) -> WorkflowOutput:
    if isinstance(result, WorkflowOutput):
        output = result
    elif (original := workflow_output_fields(result)) is not None:  # ajet.schema.task's
        output = WorkflowOutput(**original)
    elif isinstance(result, (int, float)) and not isinstance(result, bool):
        output = WorkflowOutput(reward=float(result))
    else:
        raise TypeError(
            f"a workflow returns a float or WorkflowOutput (ajet.rollout or ajet.schema.task), "
            f"not {type(result).__name__}")
    if not math.isfinite(output.reward):
        raise ValueError(f"the workflow returned a non-finite reward {output.reward!r}")
    return output


def run_workflow(client: SwarmClient, workflow: WorkflowFn, tasks: Sequence[dict[str, Any]], *,
                 n_workers: int = 4, num_repeat: int = 1,
                 max_episodes: int | None = None, run_id: str | None = None) -> RolloutStats:
    """Run until `max_episodes` episodes ended (or forever without it; Ctrl-C stops);
    episodes come from run `run_id` (id or name), or the default run."""
    runner = RolloutRunner(client, workflow, tasks, n_workers=n_workers, num_repeat=num_repeat,
                           max_episodes=max_episodes, run_id=run_id)
    runner.start()
    try:
        runner.join()
    except KeyboardInterrupt:
        runner.stop()
    return runner.stats()


def load_workflow(spec: str, repo: Path) -> tuple[WorkflowFn, list[dict[str, Any]]]:
    """Import `package.module:function` (or `path/to/file.py:function`) from `repo`.

    Tasks come from the module's `TASKS` list or its `tasks()` function.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr.isidentifier():
        raise ValueError(f"workflow spec {spec!r} must look like 'package.module:function'")
    repo = Path(repo).resolve()
    if module_name.endswith(".py"):
        path = (repo / module_name).resolve()
        if not path.is_relative_to(repo) or not path.is_file():
            raise ValueError(f"workflow file {module_name!r} is not a file inside {repo}")
        unique = f"_ajet_workflow_{abs(hash(str(path)))}"
        loader_spec = importlib.util.spec_from_file_location(unique, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"cannot import {path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[unique] = module
        loader_spec.loader.exec_module(module)
    else:
        if str(repo) not in sys.path:
            sys.path.insert(0, str(repo))
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {attr!r}")
    if hasattr(module, "TASKS"):
        tasks = list(module.TASKS)
    elif callable(getattr(module, "tasks", None)):
        tasks = list(module.tasks())
    else:
        raise ValueError(f"{module_name} defines neither TASKS nor tasks(); add a list of task "
                         "dicts, each with a task_id")
    if not tasks or not all(isinstance(t, dict) and "task_id" in t for t in tasks):
        raise ValueError(f"{module_name}: every task must be a dict with a task_id")
    return fn, tasks
