"""The original's other module path of the task-reader config classes (ajet/compat/reader_config.py)."""

from ajet.compat.reader_config import (
    AjetTaskReader,
    HuggingfaceDatRepo,
    JsonlDatasetFile,
    JsonlTrainingFp,
)

__all__ = ["AjetTaskReader", "HuggingfaceDatRepo", "JsonlDatasetFile", "JsonlTrainingFp"]
