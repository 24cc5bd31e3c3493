"""The original AgentJet's batch helpers: `run_episodes_until_all_complete` and
`auto_train_with_dataset` (imported from `ajet.tuner_lib.experimental.swarm_client`).

Both run a rollout function over tasks in threads. As in the original, a call that
raises is retried when `auto_retry` is set; unlike it, at most `max_attempts` times
(a function that always fails would otherwise loop forever), and the original's
5-second pause after a batch is left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ajet.compat.openai_endpoint import OpenaiBaseUrlAndApiKey
from ajet.compat.task import Task, WorkflowOutput
from ajet.compat.thread_executors import PeriodicDrainThreadPoolExecutor, retrying

if TYPE_CHECKING:
    from ajet.compat.client import SwarmClient

__all__ = ["auto_train_with_dataset", "run_episodes_until_all_complete"]

log = logging.getLogger(__name__)


def run_episodes_until_all_complete(tasks: Sequence[Any], func: Callable[[Any], Any],
                                    max_workers: int | None = None, auto_retry: bool = True,
                                    *, max_attempts: int = 20) -> list[Any]:
    """Run `func(task)` for every task, all at once (or `max_workers` at a time), until
    every one has completed; returns the results in the order of `tasks`."""
    if not tasks:
        return []
    target = retrying(func, max_attempts) if auto_retry else func
    with ThreadPoolExecutor(max_workers=max_workers or len(tasks)) as pool:
        results = list(pool.map(target, tasks))
    log.info("*** Batch results: Finished %d Episodes. ***", len(results))
    return results


def auto_train_with_dataset(dataset: Any, swarm_worker: SwarmClient,
                            execute_agent: Callable[[Task, OpenaiBaseUrlAndApiKey],
                                                    WorkflowOutput],
                            local_grpo_n: int = 2, remote_batch_size: int = 8) -> None:
    """Roll every training task of `dataset` out `local_grpo_n` times, one batch of
    `remote_batch_size` tasks at a time; returns when all have been reported."""

    def rollout(task: Task) -> float | list[float] | None:
        episode_uuid, api_baseurl_key = swarm_worker.begin_episode()
        workflow_output = execute_agent(task, api_baseurl_key)
        swarm_worker.end_episode(task, episode_uuid, workflow_output)
        swarm_worker.print_rollout_stat()
        return workflow_output.reward

    executor = PeriodicDrainThreadPoolExecutor(workers=remote_batch_size * local_grpo_n,
                                               max_parallel=64, auto_retry=True)
    try:
        for task in dataset.generate_training_tasks():
            for _ in range(local_grpo_n):
                executor.submit_with_periodic_drain(fn=rollout, task=task)
        executor.drain()
    finally:
        executor.shutdown(wait=True)
