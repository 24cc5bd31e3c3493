"""The original AgentJet's task readers, for local datasets:

    dataset = RouterTaskReader(
        reader_type="huggingface_dat_repo",
        reader_config=AjetTaskReader(huggingface_dat_repo=HuggingfaceDatRepo(
            dataset_path="/data/gsm8k/main")))
    for task in dataset.generate_training_tasks(): ...

Reader types: `huggingface_dat_repo` (a local saved `datasets` directory, a folder of
parquet/jsonl/csv files, or one such file; needs the `datasets` package, extra
`agentjet-swarm[datasets]`), `jsonl_dataset_file` and `random_dummy`. This machine
reads local files only: a hub name gets an error saying so. The original's
`env_service`, `tracing` and `data_generation` readers need services this project does
not have and are refused with that reason.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from ajet.compat.local_readers import (
    BaseTaskReader,
    HuggingFaceTaskReader,
    JsonlTaskReader,
    RandomDummyTaskReader,
)
from ajet.compat.task import Task

__all__ = ["BaseTaskReader", "HuggingFaceTaskReader", "JsonlTaskReader",
           "RandomDummyTaskReader", "RouterTaskReader", "dict_to_ajet_task"]

_READERS: dict[str, type[BaseTaskReader]] = {
    "huggingface_dat_repo": HuggingFaceTaskReader,
    "jsonl_dataset_file": JsonlTaskReader,
    "random_dummy": RandomDummyTaskReader,
}
_NEEDS_SERVICES = ("env_service", "tracing", "data_generation", "deep_finance")


class RouterTaskReader(BaseTaskReader):
    """The reader of `reader_type`, configured by `reader_config` (an `AjetTaskReader`)."""

    def __init__(self, reader_type: str, reader_config: Any) -> None:
        super().__init__(reader_config)
        if reader_type in _NEEDS_SERVICES:
            raise ValueError(f"task reader type {reader_type!r} needs an environment or "
                             "tracing service that this project does not run; use "
                             f"one of {sorted(_READERS)}")
        if reader_type not in _READERS:
            raise ValueError(f"Unsupported task reader type: {reader_type}; use one of "
                             f"{sorted(_READERS)}")
        self.task_reader = _READERS[reader_type](reader_config)

    def get_training_tasks(self) -> list[Task]:
        tasks = self.task_reader.get_training_tasks()
        random.shuffle(tasks)
        return tasks

    def get_validation_tasks(self) -> list[Task]:
        tasks = self.task_reader.get_validation_tasks()
        random.shuffle(tasks)
        return tasks

    def generate_training_tasks(self) -> Iterator[Task]:
        return self.task_reader.generate_training_tasks()

    def generate_validation_tasks(self) -> Iterator[Task]:
        return self.task_reader.generate_validation_tasks()


def dict_to_ajet_task(task_dict: dict[str, Any]) -> Task:
    """A `Task` from a dict that has every Task key."""
    for key in ("main_query", "task_id", "env_type", "metadata", "init_messages"):
        if key not in task_dict:
            raise ValueError(f"Key {key} not found in task.raw_task")
    return Task.model_validate({k: task_dict[k] for k in Task.model_fields})
