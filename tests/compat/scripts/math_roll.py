"""A math rollout loop written the way AgentJet's skill file writes it (only the model,
the dataset path and the batch sizes changed): a dataset read with RouterTaskReader,
auto_sync_train_config_and_start_engine, begin_episode / end_episode per task."""

import os
import re
from textwrap import dedent

import httpx

from ajet.copilot.job import AgentJetJob
from ajet.default_config.ajet_config_schema import AjetTaskReader, HuggingfaceDatRepo
from ajet.schema.task import Task, WorkflowOutput
from ajet.task_reader import RouterTaskReader
from ajet.tuner_lib.as_oai_baseurl_apikey import OpenaiBaseUrlAndApiKey
from ajet.tuner_lib.experimental.swarm_client import SwarmClient
from ajet.utils.thread_executors import PeriodicDrainThreadPoolExecutor

LOCAL_GRPO_N = 2  # grpo num_repeat (rollout.n)
LOCAL_DATASET_PATH = os.environ["LOCAL_DATASET_PATH"]
REMOTE_SWARM_URL = os.getenv("AJET_SWARM_URL", "http://localhost:10086")
REMOTE_BATCH_SIZE = 2
REMOTE_ALLOCATE_GPU_PER_NODE = 0
REMOTE_TRAIN_MODEL_01 = "ajet-tiny"


def execute_agent(task: Task, api_baseurl_key: OpenaiBaseUrlAndApiKey):
    base_url, api_key = (api_baseurl_key.base_url, api_baseurl_key.api_key)
    query, reference_answer = (task.main_query, task.metadata["answer"])
    messages = [
        {"role": "system", "content": dedent("""You are an agent specialized in solving math
            problems. You should return your final answer within \\boxed{{}}.""")},
        {"role": "user", "content": query},
    ]
    response = httpx.post(f"{base_url}/chat/completions",
                          json={"model": "fill_whatever_model", "messages": messages},
                          headers={"Authorization": f"Bearer {api_key}"}, timeout=300)
    final_answer = response.json()["choices"][0]["message"]["content"]
    reference_answer = reference_answer.split("####")[-1].strip()
    match = re.search(r"\\boxed\{([^}]*)\}", final_answer)
    is_success = bool(match) and match.group(1) == reference_answer
    raw_reward = 1.0 if is_success else float(len(final_answer) % 3) / 2  # some signal
    return WorkflowOutput(reward=raw_reward, metadata={"final_answer": final_answer},
                          log_metrics={"answer_length": [len(final_answer)]})


def main():
    dataset = RouterTaskReader(
        reader_type="huggingface_dat_repo",
        reader_config=AjetTaskReader(
            huggingface_dat_repo=HuggingfaceDatRepo(dataset_path=LOCAL_DATASET_PATH)
        ),
    )
    swarm_worker = SwarmClient(REMOTE_SWARM_URL)
    swarm_worker.auto_sync_train_config_and_start_engine(
        AgentJetJob(
            algorithm="grpo",
            project_name="ajet-swarm",
            experiment_name="test",
            n_gpu=REMOTE_ALLOCATE_GPU_PER_NODE,
            model=REMOTE_TRAIN_MODEL_01,
            batch_size=REMOTE_BATCH_SIZE,
            num_repeat=LOCAL_GRPO_N,
        )
    )

    def rollout(task) -> float | None:
        episode_uuid, api_baseurl_key = swarm_worker.begin_episode()
        workflow_output = execute_agent(task, api_baseurl_key)
        swarm_worker.end_episode(task, episode_uuid, workflow_output)
        swarm_worker.print_rollout_stat()
        return workflow_output.reward

    executor = PeriodicDrainThreadPoolExecutor(workers=REMOTE_BATCH_SIZE * LOCAL_GRPO_N,
                                               max_parallel=64, auto_retry=True)
    for _, task in enumerate(dataset.generate_training_tasks()):
        for _ in range(LOCAL_GRPO_N):
            executor.submit_with_periodic_drain(fn=rollout, task=task)
    print("global step:", swarm_worker.get_global_step())
    return None


if __name__ == "__main__":
    main()
