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

The ended episodes not yet trained are *the current batch* (`current_batch`): pool
statistics, batch readiness and `take_batch` all read it. When it is complete is the
job's sample-collection method, the original AgentJet's five (`COLLECTION_METHODS`):

    rollout_until_finish_enough_tasks            batch_size complete groups (the default);
                                                 the batch_size oldest are trained
    rollout_until_finish_enough_non_dummy_tasks  batch_size complete groups whose rewards
                                                 are not all equal; every complete group
                                                 is trained (equal ones add nothing)
    rollout_until_finish_enough_episodes         batch_size * num_repeat ended episodes;
                                                 everything ended is trained, groups of
                                                 fewer than num_repeat included
    rollout_until_any_client_agree_sync_weight   an active client called agree_sync_weight
    rollout_until_all_clients_agree_sync_weight  every active client did (at least one);
                                                 both train everything ended

A client is *active* once it ended a train episode (with `declare_client_active`) since
the last update; it falls off after `CLIENT_ACTIVE_TIMEOUT_S` without a claim or chat,
and the list is cleared whenever the engine leaves ROLLING/ROLLING_POST, as in the
original. An episode may name its client (`client_uuid`): only that client may end or
abort it. `eval` episodes are served like others but never join a group.

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

from ajet.errors import EngineStateConflict, SwarmAuthError, SwarmNotFound
from ajet.engine.trajectory import Completion, Trajectory
from ajet.protocol import EngineState

__all__ = [
    "CLIENT_ACTIVE_TIMEOUT_S",
    "COLLECTION_METHODS",
    "EVAL_EPISODE",
    "TRAIN_EPISODE",
    "Episode",
    "EpisodeRegistry",
    "EpisodeStatus",
    "Group",
]

log = logging.getLogger(__name__)

#: Episode types: trained on, or served but never trained on (`episode_type`).
TRAIN_EPISODE = "train"
EVAL_EPISODE = "eval"

#: Closed episode ids remembered so that a late call gets 409 "already ended", not 404.
_HISTORY = 100_000

#: A client with no claim or chat for this long is no longer active (as in the original).
CLIENT_ACTIVE_TIMEOUT_S = 10 * 60

_TASKS = "rollout_until_finish_enough_tasks"
_NON_DUMMY = "rollout_until_finish_enough_non_dummy_tasks"
_EPISODES = "rollout_until_finish_enough_episodes"
_AGREE_ANY = "rollout_until_any_client_agree_sync_weight"
_AGREE_ALL = "rollout_until_all_clients_agree_sync_weight"
COLLECTION_METHODS = (_TASKS, _NON_DUMMY, _EPISODES, _AGREE_ANY, _AGREE_ALL)
_AGREE_METHODS = (_AGREE_ANY, _AGREE_ALL)


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
    #: TRAIN_EPISODE or EVAL_EPISODE (served, never trained on)
    episode_type: str = TRAIN_EPISODE
    #: the claiming client, if it named itself; only it may end or abort the episode
    client_uuid: str | None = None
    #: the task the client said it will run (throttle policies count it)
    optional_task_id: str = ""
    #: chat completions requested so far
    llm_calls: int = 0


@dataclass
class _ActiveClient:
    last_activity: float
    agreed: bool = False


@dataclass
class Group:
    """Episodes of one task; complete at `num_repeat` episodes."""

    task_id: str
    episodes: list[Episode] = field(default_factory=list)


class EpisodeRegistry:
    """All episodes of one engine run. `clock` is injectable so tests control time."""

    def __init__(self, *, group_size: int, max_in_flight: int, default_timeout_s: float,
                 batch_size: int = 1, collection_method: str = _TASKS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if collection_method not in COLLECTION_METHODS:
            raise ValueError(f"unknown sample collection method {collection_method!r}")
        self.group_size = group_size
        self.max_in_flight = max_in_flight
        self.default_timeout_s = default_timeout_s
        self.batch_size = batch_size
        self.collection_method = collection_method
        self._clock = clock
        self._active_clients: dict[str, _ActiveClient] = {}
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
            rolling = (EngineState.ROLLING, EngineState.ROLLING_POST)
            if self._state in rolling and state not in rolling:
                self._active_clients.clear()  # agreements hold for one batch only
            self._state = state
            if step is not None:
                self._step = step
            self._cond.notify_all()

    # ------------------------------------------------------------------ worker calls

    def begin(self, *, timeout_s: float | None = None,
              metadata: dict[str, Any] | None = None, episode_type: str = "train",
              client_uuid: str | None = None, task_id: str | None = None) -> Episode:
        """Claim a new episode; raises `EngineStateConflict` unless ROLLING with a free slot."""
        with self._cond:
            if self._state != EngineState.ROLLING:
                raise EngineStateConflict(409,
                    f"engine is {self._state}: no new episodes now",
                    "retry begin_episode in about 1 s; claims reopen at ENGINE.ROLLING "
                    "(see get_engine_status)", retry_after_s=1.0)
            if len(self._live) >= self.max_in_flight:
                raise EngineStateConflict(409,
                    f"engine is {self._state} but all {self.max_in_flight} episode slots of "
                    "this step are claimed",
                    "retry begin_episode in about 1 s; a slot frees when an episode ends, "
                    "is aborted or idles past its timeout", retry_after_s=1.0)
            now = self._clock()
            episode = Episode(uuid=uuidlib.uuid4().hex, claimed_at=now, last_active=now,
                              timeout_s=timeout_s or self.default_timeout_s,
                              policy_step=self._step, metadata=dict(metadata or {}),
                              episode_type=episode_type, client_uuid=client_uuid or None,
                              optional_task_id=task_id or "")
            self._live[episode.uuid] = episode
            self._touch_client(client_uuid, now)
            self.counters["claimed"] += 1
            return episode

    def chat_started(self, episode_uuid: str) -> Episode:
        """Mark a completion in progress (the episode cannot time out meanwhile)."""
        with self._cond:
            episode = self._require_live(episode_uuid, "chat")
            episode.busy += 1
            episode.llm_calls += 1
            episode.last_active = self._clock()
            self._touch_client(episode.client_uuid, episode.last_active)
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
            log_metrics: dict[str, float] | None = None, client_uuid: str | None = None,
            declare_client_active: bool = True) -> Episode:
        """Close an episode with its reward; a train episode joins the open group of `task_id`."""
        with self._cond:
            episode = self._require_live(episode_uuid, "end", client_uuid)
            del self._live[episode_uuid]
            episode.status = EpisodeStatus.ENDED
            episode.ended_at = self._clock()
            episode.task_id = task_id
            episode.reward = float(reward)
            episode.is_success = is_success
            episode.end_metadata = dict(metadata or {})
            episode.log_metrics = dict(log_metrics or {})
            self._remember(episode_uuid, EpisodeStatus.ENDED)
            self.counters["ended"] += 1
            self._cond.notify_all()
            if episode.episode_type != TRAIN_EPISODE:
                return episode  # eval: served, never trained on
            if declare_client_active and episode.client_uuid:
                self._active_clients.setdefault(
                    episode.client_uuid, _ActiveClient(episode.ended_at)
                ).last_activity = episode.ended_at
            group = self._open_groups.setdefault(task_id, Group(task_id))
            group.episodes.append(episode)
            if len(group.episodes) >= self.group_size:
                del self._open_groups[task_id]
                self._ready.append(group)
            return episode

    def abort(self, episode_uuid: str, *, client_uuid: str | None = None) -> bool:
        """Give an episode up. Returns True if claims are open, so a retry can start now."""
        with self._cond:
            self._require_live(episode_uuid, "abort", client_uuid)
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
            for client in [c for c, a in self._active_clients.items()
                           if now - a.last_activity > CLIENT_ACTIVE_TIMEOUT_S]:
                del self._active_clients[client]
            return expired

    # ------------------------------------------------------------------ original AgentJet calls

    def can_continue(self, episode_uuid: str, client_uuid: str | None = None) -> bool:
        """The episode is live, its client's, and the engine still takes its result."""
        with self._cond:
            episode = self._live.get(episode_uuid)
            return (episode is not None
                    and self._state in (EngineState.ROLLING, EngineState.ROLLING_POST)
                    and not self._idle_expired(episode, self._clock())
                    and (episode.client_uuid is None or episode.client_uuid == client_uuid))

    def agree_sync_weight(self, client_uuid: str) -> tuple[bool, str]:
        """Record that an active client agrees to the next update; (accepted, why not)."""
        with self._cond:
            if self.collection_method not in _AGREE_METHODS:
                return False, (
                    "agree_sync_weight is only valid when swarm_mode_sample_collection_method "
                    f"is one of {_AGREE_METHODS}, but this run uses "
                    f"'{self.collection_method}'")
            client = self._active_clients.get(client_uuid)
            if client is None:
                return False, (
                    f"Client {client_uuid} is not in the active list -- it must have completed "
                    "at least one rewarded (non-abort) episode since the last weight sync "
                    "before agreeing.")
            client.agreed = True
            self._cond.notify_all()
            return True, ""

    def batch_ready(self) -> bool:
        """True once the current batch is complete under the collection method."""
        with self._cond:
            ready, open_groups = self.current_batch()
            if self.collection_method == _TASKS:
                return len(ready) >= self.batch_size
            if self.collection_method == _NON_DUMMY:
                return sum(not _uniform(g) for g in ready) >= self.batch_size
            ended = sum(len(g.episodes) for g in (*ready, *open_groups))
            if self.collection_method == _EPISODES:
                return ended >= self.batch_size * self.group_size
            agreed = [c.agreed for c in self._active_clients.values()]
            if self.collection_method == _AGREE_ANY:
                return ended > 0 and any(agreed)
            return ended > 0 and bool(agreed) and all(agreed)

    def take_batch(self) -> list[Group]:
        """Remove and return the groups the collection method trains on now."""
        with self._cond:
            if self.collection_method == _TASKS:
                return self.take_groups(self.batch_size)
            taken = list(self._ready)
            self._ready.clear()
            if self.collection_method != _NON_DUMMY:  # episodes, agree: everything ended
                taken.extend(self._open_groups.values())
                self._open_groups.clear()
            self.counters["trained"] += sum(len(g.episodes) for g in taken)
            return taken

    def current_batch(self) -> tuple[list[Group], list[Group]]:
        """The ended train episodes not yet trained: (complete groups, open groups).

        The one notion of "the current batch" (pool statistics and batch readiness
        read it; `take_batch` empties it).
        """
        with self._cond:
            return list(self._ready), list(self._open_groups.values())

    def pool_statistics(self) -> dict[str, Any]:
        """The original's rollout-pool statistics of the current batch."""
        with self._cond:
            ready, open_groups = self.current_batch()
            details: dict[str, list[str]] = {}
            rewards: dict[str, list[float]] = {}
            clients: dict[str, list[str]] = {}
            for group in (*ready, *open_groups):
                for e in group.episodes:
                    details.setdefault(group.task_id, []).append(e.uuid)
                    rewards.setdefault(group.task_id, []).append(float(e.reward or 0.0))
                    clients.setdefault(group.task_id, []).append(e.client_uuid or "")
            now, wall = self._clock(), time.time()
            running = {e.uuid: {
                "episode_status": "claimed",
                "time_since_last_activity": f"{now - e.last_active:.1f}s",
                "discard_episode_timeout": f"{e.timeout_s:.1f}s",
                "llm_call_count": str(e.llm_calls),
                "client_uuid": e.client_uuid or "",
                "optional_task_id": e.optional_task_id,
                "episode_type": e.episode_type,
            } for e in self._live.values()}
            return {
                "sample_collection_method": self.collection_method,
                "completed_episodes": sum(len(v) for v in details.values()),
                "completed_episode_target": self.batch_size * self.group_size,
                "completed_tasks": len(ready),
                "completed_task_target": self.batch_size,
                "completed_non_dummy_tasks": sum(not _uniform(g) for g in ready),
                "completed_non_dummy_task_target": self.batch_size,
                "task_expected_num_repeat": self.group_size,
                "completed_tasks_details": details,
                "completed_tasks_rewards": rewards,
                "completed_tasks_client_uuids": clients,
                "running_episode_details": running or None,
                "engine_status": self._state.value,
                "global_step": self._step,
                "swarm_client_instruction": {"active_clients": [
                    {"client_uuid": c, "last_activity_at": wall - (now - a.last_activity),
                     "allowed_sync_weight": a.agreed}
                    for c, a in self._active_clients.items()]},
            }

    def episode_buffer(self) -> list[dict[str, Any]]:
        """The claimed episodes, as the original's `EpisodeStatus` (never their keys)."""
        with self._cond:
            now, wall = self._clock(), time.time()
            return [{"episode_uuid": e.uuid, "episode_status": "claimed",
                     "episode_type": e.episode_type, "client_uuid": e.client_uuid or "",
                     "latest_activity_timestamp": wall - (now - e.last_active),
                     "discard_episode_timeout": e.timeout_s, "llm_call_count": e.llm_calls,
                     "optional_task_id": e.optional_task_id}
                    for e in self._live.values()]

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

    def _touch_client(self, client_uuid: str | None, now: float) -> None:
        # activity keeps an active client active; only an ended episode makes one active
        active = self._active_clients.get(client_uuid) if client_uuid else None
        if active is not None:
            active.last_activity = now

    def _require_live(self, episode_uuid: str, action: str,
                      client_uuid: str | None = None) -> Episode:
        episode = self._live.get(episode_uuid)
        if episode is not None and episode.client_uuid is not None and \
                action != "chat" and client_uuid != episode.client_uuid:
            raise SwarmAuthError(
                403, f"cannot {action} episode {episode_uuid}: it was claimed by another "
                "client", "only the client that called begin_episode may end or "
                "abort it")
        if episode is not None and self._idle_expired(episode, self._clock()):
            # past its timeout but not swept yet: the call sees what a sweep would leave
            self._close(episode_uuid, EpisodeStatus.TIMED_OUT)
            self.counters["timed_out"] += 1
            episode = None
        if episode is not None:
            return episode
        closed = self._closed.get(episode_uuid)
        if closed is None:
            raise SwarmNotFound(404,
                f"unknown episode {episode_uuid!r} in this engine run",
                "call begin_episode for a new episode; ids from an earlier run are void")
        what = {EpisodeStatus.ENDED: "has already ended",
                EpisodeStatus.ABORTED: "was aborted",
                EpisodeStatus.TIMED_OUT: "timed out (idle) and was re-queued"}[closed]
        raise EngineStateConflict(409, f"cannot {action} episode {episode_uuid}: it {what}",
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


def _uniform(group: Group) -> bool:
    """All rewards of the group equal: GRPO gives it zero advantage (a "dummy" task)."""
    return len({e.reward for e in group.episodes}) <= 1
