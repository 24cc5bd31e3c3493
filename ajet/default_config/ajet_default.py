"""Alias of `ajet.default_config.ajet_config_schema` (the task-reader config classes)."""

from ajet.default_config.ajet_config_schema import (
    AjetTaskReader,
    HuggingfaceDatRepo,
    JsonlDatasetFile,
    JsonlTrainingFp,
)

__all__ = ["AjetTaskReader", "HuggingfaceDatRepo", "JsonlDatasetFile", "JsonlTrainingFp"]
