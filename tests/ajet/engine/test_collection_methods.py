"""The registry's original AgentJet features: the five sample-collection methods, eval
episodes, episode owners, active clients and agreements, and the pool statistics."""

from __future__ import annotations

import pytest

from ajet.errors import SwarmAuthError
from ajet.engine.plane.episodes import CLIENT_ACTIVE_TIMEOUT_S, EpisodeRegistry
from ajet.protocol import EngineState
from tests.support.engine import FakeClock


def make(method: str, *, batch_size: int = 2, group_size: int = 2
         ) -> tuple[EpisodeRegistry, FakeClock]:
    clock = FakeClock()
    reg = EpisodeRegistry(group_size=group_size, max_in_flight=100, default_timeout_s=10.0,
                          batch_size=batch_size, collection_method=method, clock=clock)
    reg.set_state(EngineState.ROLLING)
    return reg, clock


def run(reg: EpisodeRegistry, task_id: str, reward: float, client: str | None = "c1",
        episode_type: str = "train") -> str:
    episode = reg.begin(client_uuid=client, episode_type=episode_type)
    reg.end(episode.uuid, task_id=task_id, reward=reward, client_uuid=client)
    return episode.uuid


def test_enough_tasks_waits_for_complete_groups_and_trains_the_oldest() -> None:
    reg, _ = make("rollout_until_finish_enough_tasks")
    for task in ("a", "a", "b", "c"):
        run(reg, task, 1.0)
    assert not reg.batch_ready()  # one complete group of two
    run(reg, "b", 0.0)
    run(reg, "c", 1.0)  # three complete groups now
    assert reg.batch_ready()
    assert [g.task_id for g in reg.take_batch()] == ["a", "b"]
    assert [g.task_id for g in reg.current_batch()[0]] == ["c"]


def test_non_dummy_tasks_counts_only_groups_whose_rewards_differ() -> None:
    reg, _ = make("rollout_until_finish_enough_non_dummy_tasks")
    for task, reward in (("a", 1), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("c", 0)):
        run(reg, task, reward)
    assert not reg.batch_ready()  # only b differs
    run(reg, "d", 0.2)
    run(reg, "d", 0.7)
    assert reg.batch_ready()
    assert reg.pool_statistics()["completed_non_dummy_tasks"] == 2
    assert sorted(g.task_id for g in reg.take_batch()) == ["a", "b", "c", "d"]


def test_enough_episodes_ignores_groups_and_trains_everything_ended() -> None:
    reg, _ = make("rollout_until_finish_enough_episodes")
    for task in ("a", "b", "c"):
        run(reg, task, 1.0)
    assert not reg.batch_ready()
    run(reg, "d", 1.0)  # 4 = batch_size * num_repeat episodes, no group complete
    assert reg.batch_ready()
    taken = reg.take_batch()
    assert sorted(g.task_id for g in taken) == ["a", "b", "c", "d"]
    assert reg.current_batch() == ([], [])


@pytest.mark.parametrize("method", ["rollout_until_any_client_agree_sync_weight",
                                    "rollout_until_all_clients_agree_sync_weight"])
def test_agree_methods_wait_for_the_active_clients(method: str) -> None:
    reg, _ = make(method)
    ok, why = reg.agree_sync_weight("c1")
    assert not ok and "not in the active list" in why  # no rewarded episode yet
    run(reg, "a", 1.0, client="c1")
    run(reg, "b", 1.0, client="c2")
    assert not reg.batch_ready()
    assert reg.agree_sync_weight("c1") == (True, "")
    assert reg.batch_ready() == (method.startswith("rollout_until_any"))
    assert reg.agree_sync_weight("c2")[0]
    assert reg.batch_ready()
    clients = reg.pool_statistics()["swarm_client_instruction"]["active_clients"]
    assert {c["client_uuid"]: c["allowed_sync_weight"] for c in clients} == {"c1": True,
                                                                              "c2": True}
    assert len(reg.take_batch()) == 2
    reg.set_state(EngineState.WEIGHT_SYNCING)  # leaving ROLLING clears the agreements
    assert reg.pool_statistics()["swarm_client_instruction"]["active_clients"] == []


def test_agree_is_refused_under_another_method_and_clients_expire() -> None:
    reg, clock = make("rollout_until_finish_enough_tasks")
    assert "only valid when" in reg.agree_sync_weight("c1")[1]
    reg, clock = make("rollout_until_any_client_agree_sync_weight")
    run(reg, "a", 1.0, client="c1")
    clock.now += CLIENT_ACTIVE_TIMEOUT_S + 1
    reg.sweep()
    assert not reg.agree_sync_weight("c1")[0]


def test_eval_episodes_are_served_but_never_trained() -> None:
    reg, _ = make("rollout_until_finish_enough_tasks", batch_size=1)
    episode = reg.begin(episode_type="eval", client_uuid="c1")
    assert reg.episode_type(episode.uuid) == "eval"
    reg.chat_started(episode.uuid)
    reg.chat_finished(episode.uuid, None)
    reg.end(episode.uuid, task_id="a", reward=1.0, client_uuid="c1")
    run(reg, "a", 1.0, client="c1", episode_type="eval")
    assert reg.current_batch() == ([], []) and not reg.batch_ready()
    assert reg.pool_statistics()["completed_episodes"] == 0
    assert reg.episode_type(episode.uuid) == "train"  # closed: the default


def test_only_the_claiming_client_ends_or_aborts_its_episode() -> None:
    reg, _ = make("rollout_until_finish_enough_tasks")
    episode = reg.begin(client_uuid="owner")
    for call in (lambda c: reg.end(episode.uuid, task_id="a", reward=1.0, client_uuid=c),
                 lambda c: reg.abort(episode.uuid, client_uuid=c)):
        for intruder in ("intruder", None):
            with pytest.raises(SwarmAuthError) as info:
                call(intruder)
            assert info.value.status == 403
    assert reg.can_continue(episode.uuid, "owner")
    assert not reg.can_continue(episode.uuid, "intruder")
    reg.abort(episode.uuid, client_uuid="owner")
    assert not reg.can_continue(episode.uuid, "owner")
    unowned = reg.begin()
    reg.end(unowned.uuid, task_id="a", reward=0.0)  # typed callers name no client


def test_pool_statistics_and_buffer_have_the_original_keys() -> None:
    reg, clock = make("rollout_until_finish_enough_tasks")
    done = run(reg, "t1", 0.5, client="c1")
    live = reg.begin(client_uuid="c2", task_id="t2", timeout_s=30)
    reg.chat_started(live.uuid)
    reg.chat_finished(live.uuid, None)
    clock.now += 2.5
    stats = reg.pool_statistics()
    assert stats["completed_tasks_details"] == {"t1": [done]}
    assert stats["completed_tasks_rewards"] == {"t1": [0.5]}
    assert stats["completed_tasks_client_uuids"] == {"t1": ["c1"]}
    assert (stats["completed_episodes"], stats["completed_episode_target"],
            stats["completed_tasks"], stats["completed_task_target"],
            stats["task_expected_num_repeat"]) == (1, 4, 0, 2, 2)
    running = stats["running_episode_details"][live.uuid]
    assert running == {"episode_status": "claimed", "time_since_last_activity": "2.5s",
                       "discard_episode_timeout": "30.0s", "llm_call_count": "1",
                       "client_uuid": "c2", "optional_task_id": "t2", "episode_type": "train"}
    (entry,) = reg.episode_buffer()
    assert entry["episode_uuid"] == live.uuid and entry["llm_call_count"] == 1
    assert "openai_api_key" not in entry  # another client's key is never listed
