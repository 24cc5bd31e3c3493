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
