"""`AgentJetJob`: the validated description of one training job.

A job is what a user or agent writes on the laptop and sends with
`SwarmClient.submit_config(job)`; the server stores its YAML and the engine turns it
into its own config (`ajet.engine.config`). Defaults live in
`ajet/default_config/job.yaml` and run on a CPU with the built-in `ajet-tiny` model.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["LORA_LR_SCALE", "AgentJetJob", "JobValidationError", "default_job_values"]


@functools.cache
def default_job_values() -> dict[str, Any]:
    """The defaults from `ajet/default_config/job.yaml`."""
    text = resources.files("ajet").joinpath("default_config/job.yaml").read_text("utf-8")
    return dict(yaml.safe_load(text))


def _default(name: str) -> Any:
    return default_job_values()[name]


#: With LoRA and no `lr` given, lr = this x the full fine-tuning default (LoRA's best
#: learning rate is about 10x full fine-tuning's across model sizes; "LoRA Without
#: Regret", Schulman et al. 2025).
LORA_LR_SCALE = 10.0


class JobValidationError(ValueError):
    """A job's YAML is malformed or a field is invalid; `errors` names each field."""

    def __init__(self, message: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.errors = errors


class AgentJetJob(BaseModel):
    """One GRPO training job. Unknown keys are rejected, so a typo never goes unnoticed."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    experiment_name: str = Field(
        default_factory=lambda: _default("experiment_name"),
        min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
        description="Name that groups runs; letters, digits, '_', '-', '.'",
    )
    algorithm: Literal["grpo"] = Field(default="grpo", description="Only GRPO is implemented")
    model: str = Field(
        default_factory=lambda: _default("model"), min_length=1, max_length=1000,
        description="'ajet-tiny' (built locally) or a Hugging Face checkpoint directory on the server",
    )
    n_gpu: int = Field(default_factory=lambda: _default("n_gpu"), ge=0, le=1024,
                       description="GPUs per node; >1 launches torchrun; 0 runs on CPU")
    n_proc: int = Field(default_factory=lambda: _default("n_proc"), ge=1, le=1024,
                        description="Processes per node when n_gpu is 0 (CPU, gloo)")
    nnodes: int = Field(default_factory=lambda: _default("nnodes"), ge=1, le=1024)
    node_rank: int = Field(default_factory=lambda: _default("node_rank"), ge=0)
    rdzv_endpoint: str | None = Field(default_factory=lambda: _default("rdzv_endpoint"),
                                      description="host:port of the torchrun rendezvous (nnodes > 1)")
    batch_size: int = Field(default_factory=lambda: _default("batch_size"), ge=1, le=100_000,
                            description="Task groups per training step")
    num_repeat: int = Field(default_factory=lambda: _default("num_repeat"), ge=1, le=1024,
                            description="Episodes per task group (GRPO group size)")
    lr: float = Field(default_factory=lambda: _default("lr"), gt=0, le=1.0)
    ppo_epochs: int = Field(default_factory=lambda: _default("ppo_epochs"), ge=1, le=100)
    clip_ratio: float = Field(default_factory=lambda: _default("clip_ratio"), gt=0, le=10)
    kl_coef: float = Field(default_factory=lambda: _default("kl_coef"), ge=0, le=100)
    max_grad_norm: float = Field(default_factory=lambda: _default("max_grad_norm"), gt=0)
    max_prompt_length: int = Field(default_factory=lambda: _default("max_prompt_length"),
                                   ge=1, le=1_000_000)
    max_response_length: int = Field(default_factory=lambda: _default("max_response_length"),
                                     ge=1, le=1_000_000)
    max_new_tokens: int = Field(default_factory=lambda: _default("max_new_tokens"), ge=1,
                                le=1_000_000, description="Tokens sampled per completion")
    temperature: float = Field(default_factory=lambda: _default("temperature"), gt=0, le=10)
    top_p: float = Field(default_factory=lambda: _default("top_p"), gt=0, le=1)
    seed: int = Field(default_factory=lambda: _default("seed"), ge=0)
    save_every: int = Field(default_factory=lambda: _default("save_every"), ge=0,
                            description="Checkpoint every N steps; 0 = only at stop")
    max_steps: int = Field(default_factory=lambda: _default("max_steps"), ge=0,
                           description="Stop after N steps; 0 = until stopped")
    episode_timeout_s: float = Field(default_factory=lambda: _default("episode_timeout_s"),
                                     gt=0, le=86_400,
                                     description="A claimed episode idle this long is re-queued")
    # --- generation (issue 17): KV cache sizing
    gpu_memory_utilization: float = Field(
        default_factory=lambda: _default("gpu_memory_utilization"), gt=0, le=1,
        description="GPU only: fraction of each GPU's memory the engine may hold while it "
                    "generates (weights, optimizer state, KV cache); the KV cache gets what is "
                    "left. As in the original AgentJet (vLLM's knob). Ignored on CPU")

    # --- training at scale (issue 16: LoRA, activation checkpointing, micro-batches);
    # --- the engine side is ajet/engine/config.py, docs/distributed.md
    lora_rank: int = Field(
        default_factory=lambda: _default("lora_rank"), ge=0, le=4096,
        description="LoRA rank; 0 = full fine-tuning. With LoRA only the adapters train "
                    f"(peft), and `lr` defaults to {LORA_LR_SCALE:g}x its full fine-tuning "
                    "default when not given")
    lora_alpha: int = Field(default_factory=lambda: _default("lora_alpha"), gt=0, le=1_000_000,
                              description="LoRA scaling: adapters add (alpha / rank) * B A")
    lora_target_modules: str | list[str] = Field(
        default_factory=lambda: _default("lora_target_modules"),
        description="Modules that get adapters: 'all-linear' (every linear layer but the "
                    "output head), a list of module names such as [q_proj, v_proj], or a "
                    "regex, as peft's LoraConfig.target_modules")
    lora_save_merged: bool = Field(
        default_factory=lambda: _default("lora_save_merged"),
        description="Checkpoints also hold the base model with the adapters merged in "
                    "(merged/); the adapter alone is always saved")
    activation_checkpointing: bool | Literal["auto"] = Field(
        default_factory=lambda: _default("activation_checkpointing"),
        description="Recompute each decoder layer's activations in backward instead of "
                    "keeping them; 'auto' = on for GPU jobs, off on CPU")
    micro_batch_tokens: int = Field(
        default_factory=lambda: _default("micro_batch_tokens"), ge=1, le=100_000_000,
        description="Most (padded) prompt + response tokens per forward/backward pass; "
                    "gradients accumulate over micro-batches, so this bounds the update's "
                    "peak memory whatever the response lengths")
    mini_batch_num: int = Field(
        default_factory=lambda: _default("mini_batch_num"), ge=1, le=10_000,
        description="Optimizer steps per batch and epoch: the batch's task groups are "
                    "split into this many mini-batches, each one optimizer step")

    @model_validator(mode="before")
    @classmethod
    def _lora_learning_rate(cls, data: Any) -> Any:
        # adapters need a larger step than full fine-tuning; only when lr is not given
        if isinstance(data, dict) and "lr" not in data and (data.get("lora_rank") or 0) > 0:
            return {**data, "lr": _default("lr") * LORA_LR_SCALE}
        return data

    @model_validator(mode="after")
    def _check_consistency(self) -> AgentJetJob:
        if self.max_new_tokens > self.max_response_length:
            raise ValueError("max_new_tokens must not exceed max_response_length")
        if self.node_rank >= self.nnodes:
            raise ValueError("node_rank must be smaller than nnodes")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("rdzv_endpoint (host:port) is required when nnodes > 1")
        return self

    # ------------------------------------------------------------------ YAML

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def dump_yaml(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml(), encoding="utf-8")

    @classmethod
    def from_yaml(cls, text: str) -> AgentJetJob:
        """Parse and validate; raises `JobValidationError` naming each bad field."""
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
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            errors = [
                {"loc": [str(p) for p in e["loc"]], "msg": e["msg"], "type": e["type"]}
                for e in exc.errors()
            ]
            fields = ", ".join(".".join(e["loc"]) or "(job)" for e in errors)
            raise JobValidationError(f"invalid job field(s): {fields}", errors) from exc

    @classmethod
    def load_yaml(cls, path: str | Path) -> AgentJetJob:
        return cls.from_yaml(Path(path).read_text(encoding="utf-8"))
