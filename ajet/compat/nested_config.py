"""The original AgentJet's nested `ajet:` YAML, converted to and from this project's job.

AgentJet writes a job as a verl-style tree (`ajet.data.train_batch_size`,
`ajet.trainer_common.optim.lr`, ... plus verl's own sections). This module owns the one
table that maps those paths to `AgentJetJob` fields (`NESTED_FIELDS`), and the two
conversions:

- `flatten(tree, known)`: the job fields found in a nested tree, plus every other key
  (nested as it came), kept so that nothing is silently dropped;
- `nest(fields, rest)`: the nested tree for a job (`job.config.to_dict()`,
  `dump_job_as_yaml`), this project's fields that have no original place under
  `ajet.swarm_remote`.

It runs wherever the job model runs, so on the server inside the active snapshot's own
validator (`python -m ajet.copilot.validate`), as docs/design.md requires for conversions.
No pydantic here, and no import of `ajet`: plain dicts in, plain dicts out. The job model
(`ajet/copilot/job.py`) is the one core module that imports it (a named boundary).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["NESTED_FIELDS", "OWN_SECTION", "flatten", "is_nested", "leaf_paths", "nest",
           "get_path", "set_path"]

#: nested path -> job field. The first block is the original AgentJetJob's own table of
#: constructor arguments (two under this project's name of the same setting:
#: max_response_length_in_one_turn is max_new_tokens, total_training_steps max_steps); the second places this project's fields where AgentJet keeps
#: the same setting. A field another part of the project has not added yet (LoRA, the
#: memory settings) is kept as an unapplied key until it exists (`flatten`'s `known`).
NESTED_FIELDS: dict[str, str] = {
    "ajet.experiment_dir": "experiment_dir",
    "ajet.project_name": "project_name",
    "ajet.experiment_name": "experiment_name",
    "ajet.trainer_common.logger": "logging",
    "ajet.model.path": "model",
    "ajet.trainer_common.n_gpus_per_node": "n_gpu",
    "ajet.trainer_common.nnodes": "nnodes",
    "ajet.trainer_common.algorithm.adv_estimator": "algorithm",
    "ajet.rollout.num_repeat": "num_repeat",
    "ajet.data.train_batch_size": "batch_size",
    "ajet.enable_swarm_mode": "swarm_mode",
    "ajet.swarm_mode_sample_collection_method": "swarm_mode_sample_collection_method",
    "ajet.rollout.max_env_worker": "max_env_worker",
    "ajet.backbone": "backbone",
    "ajet.data.max_prompt_length": "max_prompt_length",
    "ajet.data.max_response_length": "max_response_length",
    "ajet.rollout.max_response_length_in_one_turn": "max_new_tokens",
    "ajet.rollout.max_model_len": "max_model_len",
    "ajet.rollout.tensor_model_parallel_size": "tensor_model_parallel_size",
    "ajet.rollout.max_num_seqs": "max_num_seqs",
    "ajet.trainer_common.mini_batch_num": "mini_batch_num",
    "ajet.lora.lora_rank": "lora_rank",
    "ajet.lora.lora_alpha": "lora_alpha",
    "ajet.lora.target_modules": "lora_target_modules",
    "ajet.lora.load_format": "lora_load_format",
    "ajet.lora.layered_summon": "layered_summon",
    "ajet.rollout.gpu_memory_utilization": "gpu_memory_utilization",
    "ajet.trainer_common.optim.lr": "lr",
    "ajet.trainer_common.ppo_epochs": "ppo_epochs",
    "ajet.trainer_common.use_kl_loss": "use_kl_loss",
    "ajet.trainer_common.use_kl_in_reward": "use_kl_in_reward",
    "ajet.trainer_common.kl_penalty_type": "kl_penalty_type",
    "ajet.rollout.compute_madness_checklist": "compute_madness_checklist",
    "ajet.trainer_common.total_training_steps": "max_steps",
    "ajet.trainer_common.val_print_to_markdown_file_path": "val_print_to_markdown_file_path",
    "ajet.trainer_common.train_print_to_markdown_file_path": "train_print_to_markdown_file_path",
    "ajet.context_tracker.timeline_merging_policy.timeline_compare_level":
        "timeline_compare_level",
    # this project's fields at the place AgentJet keeps the same setting
    "ajet.rollout.temperature": "temperature",
    "ajet.rollout.top_p": "top_p",
    "ajet.trainer_common.kl_loss_coef": "kl_coef",
    "ajet.trainer_common.optim.grad_clip": "max_grad_norm",
    "ajet.trainer_common.save_freq": "save_every",
}

#: Where `nest` writes this project's fields that AgentJet has no place for.
OWN_SECTION = ("ajet", "swarm_remote")

def is_nested(data: Mapping[str, Any]) -> bool:
    """True for the original's form: a mapping with an `ajet:` section."""
    return isinstance(data.get("ajet"), Mapping)


def flatten(tree: Mapping[str, Any], known: Iterable[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested tree into (job fields, the rest as a nested tree).

    `known` are the job's field names (and aliases). A mapped path whose field is not
    known, and every unmapped path, stay in the rest. A null value counts as not given.
    """
    known = set(known)
    rest: dict[str, Any] = copy.deepcopy(dict(tree))
    fields: dict[str, Any] = {}
    for path, name in NESTED_FIELDS.items():
        found, value = _pop_path(rest, path.split(".")) if name in known else (False, None)
        if found and value is not None:
            fields[name] = value
    own = rest.get(OWN_SECTION[0], {}).pop(OWN_SECTION[1], None) if is_nested(rest) else None
    if isinstance(own, Mapping):
        for name, value in own.items():
            if name in known:
                fields.setdefault(str(name), value)
            else:
                set_path(rest, [*OWN_SECTION, str(name)], value)
    _prune_empty(rest)
    return fields, rest


def nest(fields: Mapping[str, Any], rest: Mapping[str, Any]) -> dict[str, Any]:
    """The nested tree: `rest` with every job field written at its place."""
    tree: dict[str, Any] = copy.deepcopy(dict(rest))
    placed = set()
    for path, name in NESTED_FIELDS.items():
        if name in fields:
            set_path(tree, path.split("."), fields[name])
            placed.add(name)
    for name, value in fields.items():
        if name not in placed:
            set_path(tree, [*OWN_SECTION, name], value)
    return tree


def leaf_paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of every leaf (a list counts as a leaf)."""
    paths: list[str] = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            paths.extend(leaf_paths(value, f"{path}."))
        else:
            paths.append(path)
    return paths


def get_path(tree: Mapping[str, Any], keys: list[str]) -> tuple[bool, Any]:
    node: Any = tree
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


def set_path(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[keys[-1]] = value


def _pop_path(tree: dict[str, Any], keys: list[str]) -> tuple[bool, Any]:
    found, _ = get_path(tree, keys)
    if not found:
        return False, None
    node = tree
    for key in keys[:-1]:
        node = node[key]
    return True, node.pop(keys[-1])


def _prune_empty(tree: dict[str, Any]) -> None:
    """Drop empty sections (the conversion empties those whose keys all became fields)."""
    for key in list(tree):
        value = tree[key]
        if isinstance(value, dict):
            _prune_empty(value)
            if not value:
                del tree[key]
