"""The original AgentJet's task-reader config classes, as rollout scripts import them:

    from ajet.default_config.ajet_config_schema import AjetTaskReader, HuggingfaceDatRepo

Only the task-reader part of the original's schema exists here; the job itself is
`ajet.copilot.job.AgentJetJob`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AjetTaskReader", "HuggingfaceDatRepo", "JsonlDatasetFile", "JsonlTrainingFp"]


@dataclass
class HuggingfaceDatRepo:
    #: a local path: a saved `datasets` directory, a folder of data files, or one file
    dataset_path: str = "gsm8k"
    dataset_name: str | None = None
    training_split: str = "train"
    validation_split: str = "validation"
    http_proxy_address: str = ""


@dataclass
class JsonlTrainingFp:
    file_path: str = ""


@dataclass
class JsonlDatasetFile:
    training: JsonlTrainingFp = field(default_factory=JsonlTrainingFp)
    validation: JsonlTrainingFp = field(default_factory=JsonlTrainingFp)


@dataclass
class AjetTaskReader:
    type: str = "huggingface_dat_repo"
    huggingface_dat_repo: HuggingfaceDatRepo = field(default_factory=HuggingfaceDatRepo)
    jsonl_dataset_file: JsonlDatasetFile = field(default_factory=JsonlDatasetFile)
