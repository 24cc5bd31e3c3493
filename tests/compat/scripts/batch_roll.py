"""A batch loop in the style of AgentJet's earlier tutorials: run_episodes_until_all_complete
over one batch of tasks, the openai client as the agent, plus an eval episode and an
aborted one. The engine is already ROLLING, so auto_sync_... does nothing."""

import json
import os

from openai import OpenAI

from ajet.copilot.job import AgentJetJob
from ajet.schema.task import Task, WorkflowOutput
from ajet.tuner_lib.experimental.swarm_client import (
    SwarmClient,
    run_episodes_until_all_complete,
)

GRPO_N = 2
REMOTE_BATCH_SIZE = 2
swarm_worker = SwarmClient(os.getenv("AJET_SWARM_URL", "http://localhost:10086"))


def rollout(task: Task) -> float:
    episode_uuid, api_baseurl_key = swarm_worker.begin_episode(discard_episode_timeout=60)
    client = OpenAI(base_url=api_baseurl_key.base_url, api_key=api_baseurl_key.api_key)
    reply = client.chat.completions.create(
        model="whatever", messages=[{"role": "user", "content": task.main_query}])
    reward = 1.0 if "7" in (reply.choices[0].message.content or "") else 0.0
    swarm_worker.end_episode(task, episode_uuid, WorkflowOutput(reward=reward, is_success=reward > 0))
    return reward


def main() -> None:
    status, status_json = swarm_worker.get_engine_status()
    step_before = swarm_worker.get_global_step()
    swarm_worker.auto_sync_train_config_and_start_engine(
        AgentJetJob(experiment_name="ignored_while_rolling", algorithm="grpo", n_gpu=0,
                    model="ajet-tiny", batch_size=REMOTE_BATCH_SIZE, num_repeat=GRPO_N))
    next_batch = []
    for i in range(REMOTE_BATCH_SIZE):
        task = Task(task_id=f"batch-{i}", main_query=f"Say a number near {i + 5}.")
        next_batch += [task] * GRPO_N
    results = run_episodes_until_all_complete(next_batch, func=rollout, auto_retry=True)

    eval_uuid, eval_key = swarm_worker.begin_episode(episode_type="eval")
    OpenAI(base_url=eval_key.base_url, api_key=eval_key.api_key).chat.completions.create(
        model="whatever", messages=[{"role": "user", "content": "eval"}])
    swarm_worker.end_episode(Task(task_id="eval-task"), eval_uuid, WorkflowOutput(reward=1.0))
    aborted, _ = swarm_worker.begin_episode()
    can_before = swarm_worker.can_continue_episode(aborted)
    swarm_worker.abort_episode(aborted)
    stat = swarm_worker.get_rollout_stat()
    print(json.dumps({
        "status": status, "global_step_key": "global_step" in status_json,
        "detail_key": "engine_status_detail" in status_json, "step_before": step_before,
        "results": results, "can_before": can_before,
        "can_after": swarm_worker.can_continue_episode(aborted),
        "eval_task_in_pool": "eval-task" in stat.completed_tasks_details,
        "experiment_dir": swarm_worker.server_experiment_dir(),
        "engine_status": stat.engine_status,
    }))


if __name__ == "__main__":
    main()
