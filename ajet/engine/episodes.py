"""The episode registry: claims, idle timeouts, and per-task groups for GRPO.

An episode is claimed by `begin` (only while the engine is `ENGINE.ROLLING` and a slot
is free), collects completions while the workflow chats, and closes exactly once:

    CLAIMED --end-->       ENDED      its group gains it; trained once, then forgotten
    CLAIMED --abort-->     ABORTED    completions discarded, the slot is free again
    CLAIMED --idle-->      TIMED_OUT  same as abort, done by `sweep` (re-queue)

A worker learns the task only at `end_episode` (`task_id`), so groups form there: the
first `num_repeat` ended episodes of a task make a complete group, which joins the
ready queue in order; the next episode of that task starts a new group. The trainer
takes whole groups from the front of the queue (`take_groups`), so a group is never
split, never dropped and never trained twice; incomplete groups wait for later steps.

Thread safety: one lock guards everything; the trainer waits on a condition that
every change notifies. The registry also holds the engine state, because whether a
claim is allowed is decided under the same lock as the claim itself.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid as uuidlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ajet.engine.trajectory import Completion, Trajectory
from ajet.protocol import EngineState

__all__ = [
    "EVAL_EPISODE",
    "TRAIN_EPISODE",
    "Episode",
    "EpisodeClosed",
    "EpisodeError",
    "EpisodeRegistry",
    "EpisodeStatus",
    "Group",
    "NotAccepting",
    "UnknownEpisode",
]

log = logging.getLogger(__name__)

#: Episode types: trained on, or served but never trained on (`episode_type`).
TRAIN_EPISODE = "train"
EVAL_EPISODE = "eval"

#: Closed episode ids remembered so that a late call gets 409 "already ended", not 404.
_HISTORY = 100_000


class EpisodeError(Exception):
    """A refused episode call; rendered as `{"detail", "hint"}` with `status`."""

    status = 400

    def __init__(self, detail: str, hint: str = "", *, retry_after_s: float | None = None
                 ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.hint = hint
        self.retry_after_s = retry_after_s


class NotAccepting(EpisodeError):
    """409: no claims now (engine not ROLLING, or every episode slot of the step is taken)."""

    status = 409


class UnknownEpisode(EpisodeError):
    """404: this engine run never issued that episode id."""

    status = 404


class EpisodeClosed(EpisodeError):
    """409: the episode already ended, was aborted, or timed out."""

    status = 409


class EpisodeStatus(str, Enum):
    CLAIMED = "claimed"  # in flight: the workflow may chat, end or abort
    ENDED = "ended"  # reward received; part of a group
    ABORTED = "aborted"  # given up by the worker; nothing kept
    TIMED_OUT = "timed_out"  # idle past its timeout; nothing kept


@dataclass
class Episode:
    uuid: str
    claimed_at: float
    last_active: float
    timeout_s: float
    policy_step: int
    metadata: dict[str, Any] = field(default_factory=dict)
    status: EpisodeStatus = EpisodeStatus.CLAIMED
    #: chat completions being generated right now; a busy episode is never idle
    busy: int = 0
    trajectory: Trajectory = field(default_factory=Trajectory)
    task_id: str | None = None
    reward: float | None = None
    is_success: bool | None = None
    end_metadata: dict[str, Any] = field(default_factory=dict)
    log_metrics: dict[str, float] = field(default_factory=dict)
    ended_at: float | None = None


@dataclass
class Group:
    """Episodes of one task; complete at `num_repeat` episodes."""

    task_id: str
    episodes: list[Episode] = field(default_factory=list)


class EpisodeRegistry:
    """All episodes of one engine run. `clock` is injectable so tests control time."""

    def __init__(self, *, group_size: int, max_in_flight: int, default_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.group_size = group_size
        self.max_in_flight = max_in_flight
        self.default_timeout_s = default_timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._state = EngineState.BOOTING
        self._step = 0
        self._live: dict[str, Episode] = {}
        self._closed: OrderedDict[str, EpisodeStatus] = OrderedDict()
        self._open_groups: dict[str, Group] = {}
        self._ready: deque[Group] = deque()
        self.counters = {"claimed": 0, "ended": 0, "aborted": 0, "timed_out": 0,
                         "trained": 0}

    # ------------------------------------------------------------------ engine state

    @property
    def state(self) -> EngineState:
        with self._cond:
            return self._state

    @property
    def step(self) -> int:
        with self._cond:
            return self._step

    def set_state(self, state: EngineState, *, step: int | None = None) -> None:
        with self._cond:
            if state != self._state:
                log.info("%s -> %s", self._state, state)
            self._state = state
            if step is not None:
                self._step = step
            self._cond.notify_all()

    # ------------------------------------------------------------------ worker calls

    def begin(self, *, timeout_s: float | None = None,
              metadata: dict[str, Any] | None = None) -> Episode:
        """Claim a new episode; raises `NotAccepting` unless ROLLING with a free slot."""
        with self._cond:
            if self._state != EngineState.ROLLING:
                raise NotAccepting(
                    f"engine is {self._state}: no new episodes now",
                    "retry begin_episode in about 1 s; claims reopen at ENGINE.ROLLING "
                    "(see get_engine_status)", retry_after_s=1.0)
            if len(self._live) >= self.max_in_flight:
                raise NotAccepting(
                    f"engine is {self._state} but all {self.max_in_flight} episode slots of "
                    "this step are claimed",
                    "retry begin_episode in about 1 s; a slot frees when an episode ends, "
                    "is aborted or idles past its timeout", retry_after_s=1.0)
            now = self._clock()
            episode = Episode(uuid=uuidlib.uuid4().hex, claimed_at=now, last_active=now,
                              timeout_s=timeout_s or self.default_timeout_s,
                              policy_step=self._step, metadata=dict(metadata or {}))
            self._live[episode.uuid] = episode
            self.counters["claimed"] += 1
            return episode

    def chat_started(self, episode_uuid: str) -> Episode:
        """Mark a completion in progress (the episode cannot time out meanwhile)."""
        with self._cond:
            episode = self._require_live(episode_uuid, "chat")
            episode.busy += 1
            episode.last_active = self._clock()
            return episode

    def episode_type(self, episode_uuid: str) -> str:
        """`"eval"` (served, never trained on) or `"train"`; how the chat plane samples.

        Episodes without a type (the registry before eval episodes) are training ones.
        """
        with self._cond:
            episode = self._live.get(episode_uuid)
            return str(getattr(episode, "episode_type", None) or TRAIN_EPISODE)

    def chat_finished(self, episode_uuid: str, completion: Completion | None) -> bool:
        """Record a finished completion; False if the episode closed meanwhile (dropped)."""
        with self._cond:
            episode = self._live.get(episode_uuid)
            if episode is None:
                return False
            episode.busy = max(0, episode.busy - 1)
            episode.last_active = self._clock()
            if completion is not None:
                episode.trajectory.add(completion)
            self._cond.notify_all()
            return True

    def end(self, episode_uuid: str, *, task_id: str, reward: float,
            is_success: bool | None = None, metadata: dict[str, Any] | None = None,
            log_metrics: dict[str, float] | None = None) -> Episode:
        """Close an episode with its reward; it joins the open group of `task_id`."""
        with self._cond:
            episode = self._require_live(episode_uuid, "end")
            del self._live[episode_uuid]
            episode.status = EpisodeStatus.ENDED
            episode.ended_at = self._clock()
            episode.task_id = task_id
            episode.reward = float(reward)
            episode.is_success = is_success
            episode.end_metadata = dict(metadata or {})
            episode.log_metrics = dict(log_metrics or {})
            self._remember(episode_uuid, EpisodeStatus.ENDED)
            group = self._open_groups.setdefault(task_id, Group(task_id))
            group.episodes.append(episode)
            if len(group.episodes) >= self.group_size:
                del self._open_groups[task_id]
                self._ready.append(group)
            self.counters["ended"] += 1
            self._cond.notify_all()
            return episode

    def abort(self, episode_uuid: str) -> bool:
        """Give an episode up. Returns True if claims are open, so a retry can start now."""
        with self._cond:
            self._require_live(episode_uuid, "abort")
            self._close(episode_uuid, EpisodeStatus.ABORTED)
            self.counters["aborted"] += 1
            return self._state == EngineState.ROLLING

    def sweep(self) -> list[str]:
        """Time out claimed episodes idle past their timeout; returns their ids."""
        with self._cond:
            now = self._clock()
            expired = [e.uuid for e in self._live.values() if self._idle_expired(e, now)]
            for episode_uuid in expired:
                self._close(episode_uuid, EpisodeStatus.TIMED_OUT)
                self.counters["timed_out"] += 1
            if expired:
                log.info("re-queued %d idle episode(s): %s", len(expired), ", ".join(expired))
            return expired

    # ------------------------------------------------------------------ trainer calls

    def wait_until(self, predicate: Callable[[], bool], *, stop: threading.Event,
                   sweep_interval_s: float) -> bool:
        """Block until `predicate()` (evaluated under the lock); sweeps timeouts meanwhile.

        Returns False if `stop` was set first.
        """
        while not stop.is_set():
            self.sweep()
            with self._cond:
                if predicate():
                    return True
                self._cond.wait(timeout=sweep_interval_s)
        return False

    def ready_groups(self) -> int:
        with self._cond:
            return len(self._ready)

    def in_flight(self) -> int:
        with self._cond:
            return len(self._live)

    def take_groups(self, n: int) -> list[Group]:
        """Remove and return the `n` oldest complete groups (fewer if fewer are ready)."""
        with self._cond:
            taken = [self._ready.popleft() for _ in range(min(n, len(self._ready)))]
            self.counters["trained"] += sum(len(g.episodes) for g in taken)
            return taken

    def snapshot(self) -> dict[str, Any]:
        """Counts for `GET /status` (`EngineReport.info`)."""
        with self._cond:
            return {
                "episodes_in_flight": len(self._live),
                "groups_ready": len(self._ready),
                "groups_open": len(self._open_groups),
                "episodes_waiting": sum(len(g.episodes) for g in self._open_groups.values())
                + sum(len(g.episodes) for g in self._ready),
                "max_in_flight": self.max_in_flight,
                **{f"episodes_{k}": v for k, v in self.counters.items()},
            }

    # ------------------------------------------------------------------ private

    def _require_live(self, episode_uuid: str, action: str) -> Episode:
        episode = self._live.get(episode_uuid)
        if episode is not None and self._idle_expired(episode, self._clock()):
            # past its timeout but not swept yet: the call sees what a sweep would leave
            self._close(episode_uuid, EpisodeStatus.TIMED_OUT)
            self.counters["timed_out"] += 1
            episode = None
        if episode is not None:
            return episode
        closed = self._closed.get(episode_uuid)
        if closed is None:
            raise UnknownEpisode(
                f"unknown episode {episode_uuid!r} in this engine run",
                "call begin_episode for a new episode; ids from an earlier run are void")
        what = {EpisodeStatus.ENDED: "has already ended",
                EpisodeStatus.ABORTED: "was aborted",
                EpisodeStatus.TIMED_OUT: "timed out (idle) and was re-queued"}[closed]
        raise EpisodeClosed(f"cannot {action} episode {episode_uuid}: it {what}",
                            "call begin_episode for a new episode")

    @staticmethod
    def _idle_expired(episode: Episode, now: float) -> bool:
        return episode.busy == 0 and now - episode.last_active > episode.timeout_s

    def _close(self, episode_uuid: str, status: EpisodeStatus) -> None:
        episode = self._live.pop(episode_uuid)
        episode.status = status
        episode.ended_at = self._clock()
        self._remember(episode_uuid, status)
        self._cond.notify_all()

    def _remember(self, episode_uuid: str, status: EpisodeStatus) -> None:
        self._closed[episode_uuid] = status
        while len(self._closed) > _HISTORY:
            self._closed.popitem(last=False)
