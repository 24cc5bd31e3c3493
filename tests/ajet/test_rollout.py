"""`RolloutRunner` logic against a client double (the engine's side is covered by the
engine and fault suites; here only the runner's own bookkeeping is under test)."""

from __future__ import annotations

import threading
import time
from typing import Any

from ajet.errors import EngineStateConflict
from ajet.protocol import BeginEpisodeResponse, EndEpisodeResponse
from ajet.rollout import RolloutRunner


class EndsAfter:
    """Serves `episodes` claims, then answers 409 forever (the run reached max_steps)."""

    def __init__(self, episodes: int) -> None:
        self.left = episodes
        self.ended: list[str] = []
        self.lock = threading.Lock()

    def open_episode(self, *_: Any, **__: Any) -> BeginEpisodeResponse:
        with self.lock:
            if self.left == 0:
                raise EngineStateConflict(409, "engine is ENGINE.OFFLINE", "start_engine")
            self.left -= 1
            n = self.left
        return BeginEpisodeResponse(episode_uuid=f"e{n}", openai_base_url="http://x/v1",
                                    openai_api_key="k")

    def report_episode(self, episode_uuid: str, task_id: str, reward: float,
                    **_: Any) -> EndEpisodeResponse:
        with self.lock:
            self.ended.append(episode_uuid)
        return EndEpisodeResponse(episode_uuid=episode_uuid, accepted=True)

    def cancel_episode(self, episode_uuid: str, **_: Any) -> None:
        pass


def test_workers_waiting_for_rolling_stop_once_the_quota_is_full() -> None:
    client = EndsAfter(episodes=3)
    # slow episodes: the fourth worker asks while the other three are busy, gets 409s
    def slow_workflow(task: dict[str, Any], episode: BeginEpisodeResponse) -> float:
        time.sleep(0.3)
        return 1.0

    runner = RolloutRunner(client, slow_workflow, [{"task_id": "t"}],  # type: ignore[arg-type]
                           n_workers=4, max_episodes=3)
    runner.start()
    assert runner.join(timeout=10), "a worker kept retrying begin_episode past its quota"
    assert len(client.ended) == 3 and runner.stats().episodes_ended == 3


class Endless(EndsAfter):
    """Serves claims forever."""

    def __init__(self) -> None:
        super().__init__(episodes=10**9)


def test_a_workflow_failing_the_same_way_stops_the_runner_with_the_cause() -> None:
    calls = 0

    def needs_openai(task: dict[str, Any], episode: BeginEpisodeResponse) -> float:
        nonlocal calls
        calls += 1
        import openai_not_installed_here  # type: ignore[import-not-found]  # noqa: F401
        return 1.0

    runner = RolloutRunner(Endless(), needs_openai, [{"task_id": "t"}],  # type: ignore[arg-type]
                           n_workers=2, max_identical_errors=5)
    runner.start()
    assert runner.join(timeout=10), "the runner kept retrying a workflow that always fails"
    stats = runner.stats()
    assert stats.stopped_reason and "identical workflow errors" in stats.stopped_reason, stats
    assert "pip install openai_not_installed_here" in stats.stopped_reason
    assert calls < 20


def test_a_success_between_errors_resets_the_count() -> None:
    calls = 0

    def flaky(task: dict[str, Any], episode: BeginEpisodeResponse) -> float:
        nonlocal calls
        calls += 1
        if calls % 3:
            raise RuntimeError("transient")
        return 1.0

    client = Endless()
    runner = RolloutRunner(client, flaky, [{"task_id": "t"}],  # type: ignore[arg-type]
                           n_workers=1, max_identical_errors=3, max_episodes=4)
    runner.start()
    assert runner.join(timeout=10)
    assert runner.stats().stopped_reason is None and runner.stats().episodes_ended == 4
