"""The original's module path of its task readers (ajet/compat/task_readers.py)."""

from ajet.compat.task_readers import (
    BaseTaskReader,
    HuggingFaceTaskReader,
    JsonlTaskReader,
    RandomDummyTaskReader,
    RouterTaskReader,
    dict_to_ajet_task,
)

__all__ = ["BaseTaskReader", "HuggingFaceTaskReader", "JsonlTaskReader",
           "RandomDummyTaskReader", "RouterTaskReader", "dict_to_ajet_task"]
