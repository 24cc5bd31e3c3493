"""Task readers over local files: jsonl, Hugging Face `datasets` data, a dummy set.

`HuggingFaceTaskReader` reads what `datasets` reads from disk: a directory saved with
`save_to_disk`, a folder of data files (parquet, jsonl, json, csv; the layout of a
downloaded hub dataset such as `gsm8k/main/train-*.parquet`), or one such file (its
only split, whatever the split name). Each example becomes a `Task`: `main_query` is
its `main_query` or `question`, `task_id` its index in the split, `metadata` the whole
example (the reference `answer` included). Examples come shuffled, as in the original.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ajet.compat.task import Task

__all__ = ["BaseTaskReader", "HuggingFaceTaskReader", "JsonlTaskReader",
           "RandomDummyTaskReader"]

_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


class BaseTaskReader:
    def __init__(self, reader_config: Any) -> None:
        self.reader_config = reader_config

    def get_training_tasks(self) -> list[Task]:
        raise NotImplementedError

    def get_validation_tasks(self) -> list[Task]:
        raise NotImplementedError

    def generate_training_tasks(self) -> Iterator[Task]:
        return iter(self.get_training_tasks())

    def generate_validation_tasks(self) -> Iterator[Task]:
        return iter(self.get_validation_tasks())


class JsonlTaskReader(BaseTaskReader):
    """One task per line of `jsonl_dataset_file.training.file_path` (or `.validation`)."""

    def get_training_tasks(self) -> list[Task]:
        return _read_jsonl(self.reader_config.jsonl_dataset_file.training.file_path)

    def get_validation_tasks(self) -> list[Task]:
        return _read_jsonl(self.reader_config.jsonl_dataset_file.validation.file_path)


def _read_jsonl(file_path: str) -> list[Task]:
    tasks: list[Task] = []
    try:
        with open(file_path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                data = json.loads(line)
                tasks.append(Task(
                    main_query=data.get("main_query", "[not defined]"),
                    init_messages=data.get("init_messages", []),
                    task_id=str(data.get("task_id", f"task_{len(tasks)}")),
                    env_type=data.get("env_type", "no_env"),
                    metadata=data.get("metadata", data)))
    except FileNotFoundError as exc:
        raise ValueError(f"JSONL file not found: {file_path}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"Invalid JSON in file {file_path}: {exc}") from exc
    if not tasks:
        raise ValueError(f"No task found in file: {file_path}")
    return tasks


class HuggingFaceTaskReader(BaseTaskReader):
    """Tasks from a local Hugging Face dataset (`huggingface_dat_repo.dataset_path`)."""

    def __init__(self, reader_config: Any) -> None:
        super().__init__(reader_config)
        repo = reader_config.huggingface_dat_repo
        self.dataset_path = str(repo.dataset_path)
        self.dataset_name = getattr(repo, "dataset_name", None)

    def generate_training_tasks(self) -> Iterator[Task]:
        return self._tasks(self.reader_config.huggingface_dat_repo.training_split)

    def generate_validation_tasks(self) -> Iterator[Task]:
        return self._tasks(self.reader_config.huggingface_dat_repo.validation_split)

    def get_training_tasks(self) -> list[Task]:
        return list(self.generate_training_tasks())

    def get_validation_tasks(self) -> list[Task]:
        return list(self.generate_validation_tasks())

    def _tasks(self, split: str) -> Iterator[Task]:
        rows = self._load(split)
        order = list(range(len(rows)))
        random.shuffle(order)
        for index in order:
            example = dict(rows[index])
            yield Task(main_query=str(example.get("main_query", example.get("question", "Empty"))),
                       init_messages=[], task_id=str(index), env_type="no_env",
                       metadata=example)

    def _load(self, split: str) -> Any:
        path = Path(self.dataset_path).expanduser()
        if not path.exists():
            raise ValueError(
                f"Failed to load dataset '{self.dataset_path}' with split '{split}': this "
                "machine reads local files only, and that is not a local file or directory "
                "(hub names are not downloaded); download the dataset and pass its directory "
                "(saved with save_to_disk, or a folder of parquet/jsonl files)")
        try:
            import datasets
        except ImportError as exc:
            raise ImportError("reading Hugging Face datasets needs the `datasets` package: "
                              "pip install 'agentjet-swarm[datasets]'") from exc
        try:
            if path.is_file():
                builder = _FILE_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise ValueError(f"unsupported data file type {path.suffix!r}; use "
                                     f"{', '.join(_FILE_BUILDERS)}")
                rows = datasets.load_dataset(builder, data_files=str(path), split="train")
            elif (path / "dataset_dict.json").is_file():
                rows = datasets.load_from_disk(str(path))[split]
            elif (path / "state.json").is_file():
                rows = datasets.load_from_disk(str(path))
            else:
                rows = datasets.load_dataset(str(path), name=self.dataset_name, split=split)
        except (KeyError, ValueError, OSError, datasets.exceptions.DatasetNotFoundError) as exc:
            raise ValueError(f"Failed to load dataset '{self.dataset_path}' with split "
                             f"'{split}': {exc}") from exc
        if len(rows) == 0:
            raise ValueError(f"No examples found in dataset '{self.dataset_path}' with split "
                             f"'{split}'")
        return rows


class RandomDummyTaskReader(BaseTaskReader):
    """1000 dummy tasks in a fixed shuffled order (task ids "0".."999")."""

    def get_training_tasks(self) -> list[Task]:
        order = list(range(1000))
        random.Random(42).shuffle(order)
        return [Task(main_query=f"[dummy task @ {i}]", task_id=str(i), env_type="no_env",
                     metadata={"random_number": i}) for i in order]

    def get_validation_tasks(self) -> list[Task]:
        return self.get_training_tasks()
