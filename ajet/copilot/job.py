"""`AgentJetJob`: the validated description of one training job.

A job is what a user or agent writes on the laptop and sends with
`SwarmClient.submit_config(job)` (or the original `sync_train_config(job)`); the server
stores its YAML and the engine turns it into its own config (`ajet.engine.config`).
Defaults live in `ajet/default_config/job.yaml` and run on a CPU with the built-in
`ajet-tiny` model.

Every constructor argument of the original AgentJet job is accepted. Each one either
drives the engine, or is stored and reported as having no effect here (`NO_EFFECT`,
returned as `notes` when the server accepts the job), or is refused with the reason
(`backbone="trinity"`, `swarm_mode=False`, `use_kl_in_reward=True`); docs/compat.md
has the table. Two YAML forms are read: this project's flat one (`to_yaml`,
`from_yaml`) and the original's nested `ajet:` tree (`job.config`, `dump_job_as_yaml`,
`build_job_from_yaml`), converted by `ajet.compat.nested_config`. Keys of the nested
tree with no meaning here are kept in `nested_extras` and listed, never dropped.
"""

from __future__ import annotations

import copy
import functools
import logging
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

# A boundary import: the job reads and writes the original's nested YAML too
from ajet.compat import nested_config

__all__ = ["BY_MODEL", "NO_EFFECT", "AgentJetJob", "JobValidationError",
           "default_job_values"]

log = logging.getLogger(__name__)

SampleCollectionMethod = Literal[
    "rollout_until_finish_enough_episodes",
    "rollout_until_finish_enough_tasks",
    "rollout_until_finish_enough_non_dummy_tasks",
    "rollout_until_any_client_agree_sync_weight",
    "rollout_until_all_clients_agree_sync_weight",
]

#: Original arguments stored with the job but without effect here, and why. A value
#: other than the default comes back as a note when the server accepts the job.
NO_EFFECT: dict[str, str] = {
    "project_name": "stored with the job; runs are grouped by experiment_name",
    "experiment_dir": "runs are written under the server's workdir (runs/<run_id>); "
                      "server_experiment_dir() says where",
    "tensor_model_parallel_size": "generation keeps one model copy per process; "
                                  "no tensor parallelism",
    "max_num_seqs": "the generation batch is a backend default "
                    "(ajet/engine/config.py, BackendDefaults.max_generation_batch)",
    "lora_load_format": "only checked by the original's LoRA rules; adapters load their own way",
    "layered_summon": "only checked by the original's LoRA rules; adapters load their own way",
    "kl_penalty_type": "only used with use_kl_in_reward, which is not supported",
    "compute_madness_checklist": "no madness checks run; rewards are taken as sent",
    "val_print_to_markdown_file_path": "no markdown report; read GET /runs/{id}/metrics",
    "train_print_to_markdown_file_path": "no markdown report; read GET /runs/{id}/metrics",
}

#: Said of every field whose default follows the model (ajet/copilot/model_defaults.py).
BY_MODEL = ("Unset: chosen on the server from the model's size and the training mode "
            "(docs/api.md, 'Defaults by model'); the value here is ajet-tiny's")

#: Nested keys listed one by one in the notes; the rest are counted.
_MAX_LISTED_KEYS = 40


@functools.cache
def default_job_values() -> dict[str, Any]:
    """The defaults from `ajet/default_config/job.yaml`, beside this module: the code that
    reads the defaults and the defaults come from the same tree, even when another `ajet`
    is first on `sys.path` (a synced snapshot that lacks the file, say)."""
    text = (Path(__file__).resolve().parents[1] / "default_config" / "job.yaml").read_text(
        "utf-8")
    return dict(yaml.safe_load(text))


def _default(name: str) -> Any:
    return default_job_values()[name]


def _d(name: str) -> Callable[[], Any]:
    return lambda: copy.deepcopy(_default(name))


class JobValidationError(ValueError):
    """A job's YAML is malformed or a field is invalid; `errors` names each field."""

    def __init__(self, message: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.errors = errors


class _EitherMethod:
    """A method that works on the class (returns a new job) and on a job (updates it)."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.__doc__ = func.__doc__

    def __get__(self, obj: Any, owner: type) -> Callable[..., Any]:
        return functools.partial(self.func, owner, obj)


class AgentJetJob(BaseModel):
    """One GRPO training job. Unknown keys are rejected, so a typo never goes unnoticed."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              ignored_types=(_EitherMethod,))

    experiment_name: str = Field(
        default_factory=_d("experiment_name"),
        min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
        description="Name that groups runs; letters, digits, '_', '-', '.'",
    )
    algorithm: Literal["grpo"] = Field(default="grpo", description="Only GRPO is implemented")
    model: str = Field(
        default_factory=_d("model"), min_length=1, max_length=1000,
        description="'ajet-tiny' (built locally) or a Hugging Face checkpoint directory on the server",
    )
    n_gpu: int = Field(default_factory=_d("n_gpu"), ge=0, le=1024,
                       description="GPUs per node; >1 launches torchrun; 0 runs on CPU")
    n_proc: int = Field(default_factory=_d("n_proc"), ge=1, le=1024,
                        description="Processes per node when n_gpu is 0 (CPU, gloo)")
    nnodes: int = Field(default_factory=_d("nnodes"), ge=1, le=1024)
    node_rank: int = Field(default_factory=_d("node_rank"), ge=0)
    rdzv_endpoint: str | None = Field(default_factory=_d("rdzv_endpoint"),
                                      description="host:port of the torchrun rendezvous (nnodes > 1)")
    collective_timeout_min: float = Field(
        default_factory=_d("collective_timeout_min"), gt=0, le=10_080,
        description="Several processes: a rank waiting this long in a tensor collective "
                    "(FSDP's gathers, the weight publication) fails the job; rank 0's "
                    "commands travel on a CPU group that waits as long as a step takes")
    batch_size: int = Field(default_factory=_d("batch_size"), ge=1, le=100_000,
                            description="Task groups per training step")
    num_repeat: int = Field(default_factory=_d("num_repeat"), ge=1, le=1024,
                            description="Episodes per task group (GRPO group size)")
    lr: float = Field(default_factory=_d("lr"), gt=0, le=1.0,
                      description=f"AdamW learning rate. {BY_MODEL}")
    ppo_epochs: int = Field(default_factory=_d("ppo_epochs"), ge=1, le=100)
    clip_ratio: float = Field(default_factory=_d("clip_ratio"), gt=0, le=10)
    kl_coef: float = Field(default_factory=_d("kl_coef"), ge=0, le=100,
                           description="Weight of the KL loss term (applied when use_kl_loss)")
    max_grad_norm: float = Field(default_factory=_d("max_grad_norm"), gt=0)
    max_prompt_length: int = Field(default_factory=_d("max_prompt_length"),
                                   ge=1, le=1_000_000)
    max_response_length: int = Field(default_factory=_d("max_response_length"),
                                     ge=1, le=1_000_000)
    max_new_tokens: int = Field(
        default_factory=_d("max_new_tokens"), ge=1, le=1_000_000,
        validation_alias=AliasChoices("max_new_tokens", "max_response_length_in_one_turn"),
        description="Tokens sampled per completion when the request sets no limit (the "
                    "original's max_response_length_in_one_turn: one setting, two names). "
                    f"{BY_MODEL}")
    temperature: float = Field(default_factory=_d("temperature"), gt=0, le=10)
    top_p: float = Field(default_factory=_d("top_p"), gt=0, le=1)
    seed: int = Field(default_factory=_d("seed"), ge=0)
    save_every: int = Field(default_factory=_d("save_every"), ge=0,
                            description=f"Checkpoint every N steps; 0 = only at stop. {BY_MODEL}")
    async_save: bool | Literal["auto"] = Field(
        default_factory=_d("async_save"),
        description="Write each step checkpoint in the background while training goes on "
                    "(torch.distributed.checkpoint.async_save); training waits only while "
                    "the state is copied to host memory. false: written before the next "
                    "step; 'auto' = on with GPUs, off on the CPU (the writer would share "
                    "the update's cores)")
    max_steps: int = Field(
        default_factory=_d("max_steps"), ge=0,
        validation_alias=AliasChoices("max_steps", "total_training_steps"),
        description="Stop after N steps; 0 = until stopped (the original's total_training_steps)")
    episode_timeout_s: float = Field(default_factory=_d("episode_timeout_s"),
                                     gt=0, le=86_400,
                                     description="A claimed episode idle this long is re-queued")
    boot_timeout_s: float | None = Field(
        default_factory=_d("boot_timeout_s"), gt=0, le=86_400,
        description="Seconds the engine may take to boot before the server fails the run; "
                    "capped by the server's max_boot_timeout_s; None = the server's "
                    f"boot_timeout_s. {BY_MODEL}")
    stop_grace_s: float | None = Field(
        default_factory=_d("stop_grace_s"), ge=0, le=86_400,
        description="Seconds a stop waits (after SIGTERM) for the final checkpoint before "
                    "SIGKILL; capped by the server's max_stop_grace_s; None = the server's "
                    f"stop_grace_s. {BY_MODEL}")
    resume_from: str | None = Field(
        default_factory=_d("resume_from"), min_length=1, max_length=1000,
        description="Continue an earlier run: its run id, 'latest' (the latest run of this "
                    "experiment_name with a complete checkpoint), or a checkpoint directory of "
                    "one of the server's runs. "
                    "Restores weights, optimizer state, the step counter and the sampling "
                    "random state; the run records what it resumed from")
    recompute_old_logprobs: bool | Literal["auto"] = Field(
        default_factory=_d("recompute_old_logprobs"),
        description="Take the PPO ratio's old log-probs from the trainer's own forward "
                    "(first epoch: the ratio is exactly 1) instead of the sampler's; 'auto' = "
                    "on when training computes in bf16 (GPUs). Recorded samples keep the "
                    "sampled log-probs either way")
    defaults_chosen: list[str] = Field(
        default_factory=_d("defaults_chosen"), max_length=50,
        description="Fields the server chose for the model (written by its validator): "
                    "chosen again whenever the job is checked, so a job whose model or "
                    "training mode changed gets that model's values; setting a field takes "
                    "it off this list")
    # --- generation: KV cache sizing
    gpu_memory_utilization: float = Field(
        default_factory=_d("gpu_memory_utilization"), gt=0, le=1,
        description="GPU only: fraction of each GPU's memory the engine may hold while it "
                    "generates (weights, optimizer state, KV cache); the KV cache gets what is "
                    "left. As in the original AgentJet (vLLM's knob). Ignored on CPU")
    generation_backend: Literal["auto", "paged", "continuous_batching", "recompute"] = Field(
        default_factory=_d("generation_backend"),
        description="How the engine generates: 'paged' (its own paged KV pool; CUDA graphs "
                    "on a GPU), 'continuous_batching' (transformers' engine), 'recompute' (no "
                    "KV cache: the slow reference); 'auto' = the engine's default for the "
                    "device (ajet/engine/config.py, BackendDefaults). "
                    "AJET_ENGINE_GENERATION on the engine's machine overrides it")

    # --- training at scale (LoRA, activation checkpointing, micro-batches);
    # --- the engine side is ajet/engine/config.py, docs/distributed.md
    lora_rank: int = Field(
        default_factory=_d("lora_rank"), ge=0, le=4096,
        description="LoRA rank; 0 = full fine-tuning. With LoRA only the adapters train "
                    "(peft), and an unset `lr` gets an adapter rate (docs/api.md, 'Defaults "
                    "by model')")
    lora_alpha: int = Field(default_factory=_d("lora_alpha"), gt=0, le=1_000_000,
                              description="LoRA scaling: adapters add (alpha / rank) * B A")
    lora_target_modules: str | list[str] = Field(
        default_factory=_d("lora_target_modules"),
        description="Modules that get adapters: 'all-linear' (every linear layer but the "
                    "output head), a list of module names such as [q_proj, v_proj], or a "
                    "regex, as peft's LoraConfig.target_modules. Unset on ajet-tiny: the "
                    "projections and lm_head")
    lora_save_merged: bool = Field(
        default_factory=_d("lora_save_merged"),
        description="Checkpoints also hold the base model with the adapters merged in "
                    "(merged/); the adapter alone is always saved")
    activation_checkpointing: bool | Literal["auto"] = Field(
        default_factory=_d("activation_checkpointing"),
        description="Recompute each decoder layer's activations in backward instead of "
                    "keeping them; 'auto' = on for GPU jobs, off on CPU")
    micro_batch_tokens: int = Field(
        default_factory=_d("micro_batch_tokens"), ge=1, le=100_000_000,
        description="Most (padded) prompt + response tokens per forward/backward pass; "
                    "gradients accumulate over micro-batches, so this bounds the update's "
                    "peak memory whatever the response lengths. " + BY_MODEL)
    mini_batch_num: int = Field(
        default_factory=_d("mini_batch_num"), ge=1, le=10_000,
        description="Optimizer steps per batch and epoch: the batch's task groups are "
                    "split into this many mini-batches, each one optimizer step")

    # --- the memory planner (ajet/engine/planning/memory_plan.py, docs/distributed.md)
    gpu_memory_gb: float = Field(
        default_factory=_d("gpu_memory_gb"), gt=0, le=100_000,
        description="Memory of one GPU in GiB, used by the memory planner where no GPU is "
                    "visible when the config is checked (no nvidia-smi); visible GPUs are "
                    "measured instead")
    memory_check: Literal["refuse", "warn"] = Field(
        default_factory=_d("memory_check"),
        description="A job the memory planner estimates will not fit is refused (422, with "
                    "the estimate and the changes that fit), or only warned about ('warn': "
                    "accepted, the warning in the config response and the engine log)")


    # --- the original AgentJet's arguments (docs/compat.md)
    project_name: str = Field(default_factory=_d("project_name"), max_length=200,
                              description="Stored; no effect here (NO_EFFECT)")
    experiment_dir: str = Field(default_factory=_d("experiment_dir"), max_length=1000,
                                description="Stored; no effect here (NO_EFFECT)")
    logging: str | list[str] = Field(
        default_factory=_d("logging"),
        description="Experiment trackers that mirror every step's metrics: tensorboard, "
                    "wandb, mlflow, swanlab (one, comma-separated, or a list); console = "
                    "metrics.jsonl only (ajet/engine/tracking/trackers.py)")
    swarm_mode: bool = Field(default_factory=_d("swarm_mode"),
                             description="Must be true: this server trains in swarm mode only")
    swarm_mode_sample_collection_method: SampleCollectionMethod = Field(
        default_factory=_d("swarm_mode_sample_collection_method"),
        description="When a step's batch is complete (see docs/compat.md)")
    max_env_worker: int | None = Field(
        default_factory=_d("max_env_worker"), ge=1, le=1_000_000,
        description="Episodes claimed at once, all clients together; null = "
                    "batch_size * num_repeat")
    backbone: str = Field(default_factory=_d("backbone"), max_length=50,
                          description="'verl' or 'debug': both run this project's engine")
    max_model_len: int | None = Field(
        default_factory=_d("max_model_len"), ge=1, le=10_000_000,
        description="Longest prompt + response; must be at least their sum")
    tensor_model_parallel_size: int = Field(default_factory=_d("tensor_model_parallel_size"),
                                            ge=1, le=1024)
    max_num_seqs: int = Field(default_factory=_d("max_num_seqs"), ge=1, le=1_000_000)
    lora_load_format: str = Field(default_factory=_d("lora_load_format"), max_length=50)
    layered_summon: bool = Field(default_factory=_d("layered_summon"))
    use_kl_loss: bool = Field(default_factory=_d("use_kl_loss"),
                              description="Add the KL term (weight kl_coef) to the loss")
    use_kl_in_reward: bool = Field(default_factory=_d("use_kl_in_reward"),
                                   description="Must be false: no KL penalty in the reward")
    kl_penalty_type: str = Field(default_factory=_d("kl_penalty_type"), max_length=50)
    compute_madness_checklist: list[str] = Field(
        default_factory=_d("compute_madness_checklist"), max_length=100)
    val_print_to_markdown_file_path: str | None = Field(
        default_factory=_d("val_print_to_markdown_file_path"), max_length=1000)
    train_print_to_markdown_file_path: str | None = Field(
        default_factory=_d("train_print_to_markdown_file_path"), max_length=1000)
    timeline_compare_level: Literal["text", "token"] = Field(
        default_factory=_d("timeline_compare_level"),
        description="How an episode's calls merge into one timeline: 'token' (the history "
                    "between re-sent replies must match token for token) or 'text' (as "
                    "messages; the later call's tokens are kept where they differ)")
    timeline_merging: bool = Field(
        default_factory=_d("timeline_merging"),
        description="Merge calls that extend each other into one sample (false: one sample "
                    "per completion)")
    train_agents: list[str] = Field(
        default_factory=_d("train_agents"), max_length=100,
        validation_alias=AliasChoices("train_agents", "trainable_targets"),
        description="Agent names to train: the `model` each request names. Empty: all. "
                    "Calls under other names are served, never trained (side calls)")
    nested_extras: dict[str, Any] = Field(
        default_factory=_d("nested_extras"),
        description="Keys of the original's nested YAML with no meaning here, kept as given")
    # constructor-only arguments of the original (never written to YAML)
    ensure_new_experiment: bool = Field(
        default=False, exclude=True,
        description="Append a timestamp to experiment_name (done once, at construction)")
    base_yaml_config: str | None = Field(
        default=None, exclude=True, max_length=4096,
        description="A YAML file (nested or flat) read first; the other arguments override it")

    # ------------------------------------------------------------------ validation

    @model_validator(mode="before")
    @classmethod
    def _original_arguments(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("base_yaml_config"):
            base = _read_job_file(Path(str(data["base_yaml_config"])))
            data = {**base, **{k: v for k, v in data.items() if v is not None}}
        # the original's arguments default to None, meaning "not given"; a field that
        # takes None (max_model_len, ...) keeps it
        data = {k: v for k, v in data.items() if v is not None or _nullable(k)}
        for alias, name in _FIELD_OF.items():
            if alias in data and name in data and data[alias] != data[name]:
                raise ValueError(f"{alias} and {name} are one setting under two names; "
                                 f"got {data[alias]} and {data[name]}: pass one of them")
        lengths = ("max_prompt_length", "max_response_length", "max_model_len",
                   "max_response_length_in_one_turn")
        named = {n for n in lengths if data.get(n) is not None}
        given = named | ({"max_response_length_in_one_turn"}
                         if data.get("max_new_tokens") is not None else set())
        # The original's rule holds once one of its own length names is given; this
        # project's form (max_prompt_length, max_response_length, max_new_tokens) stays.
        if named & {"max_model_len", "max_response_length_in_one_turn"} and \
                given != set(lengths):
            raise ValueError(
                "(`max_prompt_length`, `max_response_length`, `max_model_len`, "
                "`max_response_length_in_one_turn`) must all be None or all be non-None; "
                f"missing: {', '.join(sorted(set(lengths) - given))}")
        if data.pop("ensure_new_experiment", False):
            name = str(data.get("experiment_name") or _default("experiment_name"))
            data["experiment_name"] = f"{name}_{time.strftime('%Y%m%d-%H%M%S')}"
        return data

    @field_validator("logging")
    @classmethod
    def _check_logging(cls, value: str | list[str]) -> str | list[str]:
        from ajet.engine.tracking.trackers import parse_logging

        if isinstance(value, list) and len(value) > 10:
            raise ValueError("logging: at most 10 trackers")
        if isinstance(value, str) and len(value) > 100:
            raise ValueError("logging: at most 100 characters")
        parse_logging(value)  # ValueError names an unknown tracker
        return value

    @field_validator("backbone")
    @classmethod
    def _check_backbone(cls, value: str) -> str:
        if value == "trinity":
            raise ValueError("Trinity backbone is not yet supported in AgentJetJob; this "
                             "server runs its own engine: use backbone='verl' (the default)")
        if value not in ("verl", "debug"):
            raise ValueError(f"unknown backbone {value!r}; use 'verl' (the default)")
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> AgentJetJob:
        if self.max_new_tokens > self.max_response_length:
            raise ValueError("max_new_tokens (max_response_length_in_one_turn) must not exceed "
                             "max_response_length")
        if self.max_model_len is not None and (
                self.max_prompt_length + self.max_response_length > self.max_model_len):
            raise ValueError(
                f"illegal token length: max_prompt_length + max_response_length = "
                f"{self.max_prompt_length + self.max_response_length} exceeds max_model_len "
                f"{self.max_model_len}")
        if self.node_rank >= self.nnodes:
            raise ValueError("node_rank must be smaller than nnodes")
        # rdzv_endpoint for nnodes > 1 is the server's rule: its launcher decides (the
        # local one needs it, the Ray launcher refuses it), swarm_server/config_check.py
        if not self.swarm_mode:
            raise ValueError("swarm_mode=False is not supported: this server trains in swarm "
                             "mode only (rollouts come from clients); leave swarm_mode unset")
        if self.use_kl_in_reward:
            raise ValueError("use_kl_in_reward=True is not supported: the KL term is a loss "
                             "term here; set use_kl_loss=True and kl_coef instead")
        # the original's LoRA learning-rate rule; its load_format and layered_summon rules
        # are verl's adapter loading, which has no counterpart here (NO_EFFECT)
        if self.lora_rank > 0:
            if self.lr <= 1e-5:
                raise ValueError("lr should usually be greater than 1e-5 for lora training, "
                                 f"got {self.lr}")
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        # a field the user sets is theirs, even if the server had chosen it before
        if name != "defaults_chosen" and name in self.defaults_chosen:
            self.defaults_chosen = [f for f in self.defaults_chosen if f != name]

    # ------------------------------------------------------------------ original names

    @property
    def max_response_length_in_one_turn(self) -> int:
        """The original's name of `max_new_tokens`."""
        return self.max_new_tokens

    @max_response_length_in_one_turn.setter
    def max_response_length_in_one_turn(self, value: int) -> None:
        self.max_new_tokens = value

    @property
    def total_training_steps(self) -> int | None:
        """The original's name of `max_steps` (None = until stopped)."""
        return self.max_steps or None

    @total_training_steps.setter
    def total_training_steps(self, value: int | None) -> None:
        self.max_steps = value or 0

    @property
    def config(self) -> JobConfigView:
        """The nested `ajet:` view: `job.config.ajet.rollout.max_env_worker = 64`."""
        return JobConfigView(self, ())

    def nested(self) -> dict[str, Any]:
        """The job as the original's nested tree (what `dump_job_as_yaml` writes)."""
        fields = self.model_dump(mode="json", exclude={"nested_extras"})
        fields["max_steps"] = fields["max_steps"] or None  # the original's null = unlimited
        return nested_config.nest(fields, self.nested_extras)

    def compat_notes(self) -> list[dict[str, str]]:
        """Settings accepted without effect here, and nested keys with no meaning here."""
        try:
            defaults = default_job_values()
        except OSError:  # a synced tree without the defaults file: list every such setting
            defaults = {}
        notes = [{"field": name, "status": "no_effect", "reason": reason}
                 for name, reason in NO_EFFECT.items()
                 if getattr(self, name) != defaults.get(name)]
        keys = nested_config.leaf_paths(self.nested_extras)
        for path in keys[:_MAX_LISTED_KEYS]:
            notes.append({"field": path, "status": "ignored",
                          "reason": "no meaning in this project's engine; kept in the job"})
        if len(keys) > _MAX_LISTED_KEYS:
            notes.append({"field": "(more)", "status": "ignored",
                          "reason": f"{len(keys) - _MAX_LISTED_KEYS} more nested keys with no "
                                    "meaning here; all are kept in nested_extras"})
        return notes

    # ------------------------------------------------------------------ YAML

    def to_yaml(self) -> str:
        """This project's flat YAML, every field written out (`dump_yaml`)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def submit_yaml(self) -> str:
        """The flat YAML of the fields the user set (what `submit_config` sends).

        The server's validator fills in the rest, some of them from the model's size
        (`ajet.copilot.model_defaults`), which only the cluster can read.
        """
        return yaml.safe_dump(self.model_dump(mode="json", exclude_unset=True),
                              sort_keys=False)

    def dump_yaml(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml(), encoding="utf-8")

    def dump_job_as_yaml(self, yaml_path: str) -> str:
        """Write the original's nested YAML to `yaml_path`; returns the path."""
        path = Path(yaml_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.nested(), sort_keys=False), encoding="utf-8")
        log.info("Saved training config to %s", yaml_path)
        return yaml_path

    @_EitherMethod
    def build_job_from_yaml(cls, self: AgentJetJob | None, yaml_path: str | Path) -> Any:
        """Read a job YAML (nested or flat).

        On the class, returns a new job: `AgentJetJob.build_job_from_yaml(path)`. On a
        job, applies the file as an override of it and returns the nested dict, as the
        original's instance method returns its config dict.
        """
        loaded = cls.load_yaml(yaml_path)
        if self is None:
            return loaded
        for name in loaded.model_fields_set:
            setattr(self, name, getattr(loaded, name))
        return self.nested()

    @classmethod
    def from_yaml(cls, text: str) -> AgentJetJob:
        """Parse and validate flat or nested YAML; raises `JobValidationError` naming each bad field."""
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise JobValidationError(
                f"not valid YAML: {exc}", [{"loc": [], "msg": f"not valid YAML: {exc}"}]
            ) from exc
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise JobValidationError(
                "the job YAML must be a mapping of field: value",
                [{"loc": [], "msg": "expected a mapping of field: value"}],
            )
        nested = nested_config.is_nested(data)
        if nested:
            data = _from_nested(data)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            errors = [
                {"loc": _nested_loc(e["loc"]) if nested else [str(p) for p in e["loc"]],
                 "msg": e["msg"], "type": e["type"]}
                for e in exc.errors()
            ]
            fields = ", ".join(".".join(e["loc"]) or "(job)" for e in errors)
            raise JobValidationError(f"invalid job field(s): {fields}", errors) from exc

    @classmethod
    def load_yaml(cls, path: str | Path) -> AgentJetJob:
        return cls.from_yaml(Path(path).read_text(encoding="utf-8"))


class JobConfigView:
    """Attribute access to a job's nested tree; assignments write through to the job.

    A path that maps to a job field sets that field (validated); any other path is kept
    in `nested_extras` and has no effect (the server lists it in its notes).
    """

    __slots__ = ("_job", "_path")

    def __init__(self, job: AgentJetJob, path: tuple[str, ...]) -> None:
        object.__setattr__(self, "_job", job)
        object.__setattr__(self, "_path", path)

    def to_dict(self) -> dict[str, Any]:
        found, node = nested_config.get_path(self._job.nested(), list(self._path))
        return copy.deepcopy(node) if found and isinstance(node, dict) else {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        keys = [*self._path, name]
        found, node = nested_config.get_path(self._job.nested(), keys)
        if not found:
            raise AttributeError(f"the job's config has no key {'.'.join(keys)}")
        return JobConfigView(self._job, tuple(keys)) if isinstance(node, dict) else node

    def __setattr__(self, name: str, value: Any) -> None:
        keys = [*self._path, name]
        field = nested_config.NESTED_FIELDS.get(".".join(keys))
        if field is None and tuple(keys[:-1]) == nested_config.OWN_SECTION:
            field = name
        if field is not None and (field in AgentJetJob.model_fields or field in _FIELD_OF):
            setattr(self._job, field, value)
            return
        extras = copy.deepcopy(self._job.nested_extras)
        nested_config.set_path(extras, keys, value)
        self._job.nested_extras = extras
        log.info("config key %s has no meaning in this project's engine; kept in the job",
                 ".".join(keys))

    def __repr__(self) -> str:
        return f"JobConfigView({'.'.join(self._path) or '<root>'}: {self.to_dict()!r})"


#: The original's names of this project's fields (alias -> field).
_FIELD_OF = {"max_response_length_in_one_turn": "max_new_tokens",
             "total_training_steps": "max_steps"}


def _nullable(name: str) -> bool:
    field = AgentJetJob.model_fields.get(_FIELD_OF.get(name, name))
    return field is None or type(None) in typing.get_args(field.annotation)


def _known_names() -> set[str]:
    return set(AgentJetJob.model_fields) | set(_FIELD_OF)


def _from_nested(tree: dict[str, Any]) -> dict[str, Any]:
    fields, rest = nested_config.flatten(tree, _known_names())
    extras = fields.pop("nested_extras", None)
    if isinstance(extras, dict):  # a nested file written by an older dump
        rest = {**extras, **rest}
    return {**fields, "nested_extras": rest} if rest else fields


def _read_job_file(path: Path) -> dict[str, Any]:
    """A YAML file as flat job fields (for `base_yaml_config`)."""
    if not path.is_file():
        raise ValueError(f"Configuration yaml is absent! {path}")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the job YAML must be a mapping")
    return _from_nested(data) if nested_config.is_nested(data) else data


def _nested_loc(loc: tuple[Any, ...]) -> list[str]:
    """A field's error location, named by its nested path when it has one."""
    names = [str(p) for p in loc]
    if not names:
        return names
    by_field = {v: k for k, v in nested_config.NESTED_FIELDS.items()}
    field = _FIELD_OF.get(names[0], names[0])
    path = by_field.get(names[0]) or by_field.get(field)
    return [path, *names[1:]] if path else names
