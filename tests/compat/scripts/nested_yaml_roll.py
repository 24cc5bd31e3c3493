"""A job built from the original's nested YAML (`base_yaml_config`), synced and started
by hand (stop_engine, sync_train_config, start_engine), then one batch of episodes."""

import json
import os
import sys

from openai import OpenAI

from ajet.copilot.job import AgentJetJob
from ajet.schema.task import Task, WorkflowOutput
from ajet.tuner_lib.experimental.swarm_client import (
    SwarmClient,
    run_episodes_until_all_complete,
)

swarm_worker = SwarmClient(os.getenv("AJET_SWARM_URL", "http://localhost:10086"))


def rollout(task: Task) -> float:
    episode_uuid, api = swarm_worker.begin_episode()
    OpenAI(base_url=api.base_url, api_key=api.api_key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": task.main_query}])
    output = WorkflowOutput(reward=float(task.task_id == "n0"), log_metrics={"turns": [1, 3]})
    swarm_worker.end_episode(task, episode_uuid, output)
    return output.reward


def main() -> None:
    job = AgentJetJob(base_yaml_config=sys.argv[1])
    job.config.ajet.rollout.max_env_worker = 4
    swarm_worker.stop_engine()
    accepted = swarm_worker.sync_train_config(job)
    swarm_worker.start_engine()
    tasks = [Task(task_id=f"n{i}", main_query=f"q{i}") for i in range(2) for _ in range(2)]
    run_episodes_until_all_complete(tasks, func=rollout)
    print(json.dumps({"success": accepted["success"],
                      "experiment_name": accepted["experiment_name"],
                      "max_in_flight_source": accepted["config"]["max_env_worker"],
                      "ignored": [n["field"] for n in accepted["notes"]
                                  if n["status"] == "ignored"]}))


if __name__ == "__main__":
    main()
