"""Defaults by model: the job fields a user left unset, chosen for the model and the mode.

A job names its model by a path on the cluster, so only the cluster knows its size. The
client therefore sends only the fields the user set (`AgentJetJob.submit_yaml`, from
pydantic's `model_fields_set`), and the validator that runs from the active snapshot on
the cluster (`ajet/copilot/validate.py`) calls `resolve_job`, which reads the model's
`config.json` (through the memory planner's `model_shape`, no torch) and fills in the
rest. The engine calls it again at boot; on a validated job (every field written out) it
changes nothing.

The table (docs/api.md, "Defaults by model"), P = the model's parameter count:

| field | ajet-tiny | other, P <= 1B | P > 1B |
|---|---|---|---|
| `lr`, full fine-tuning | 3e-3 | 1e-5 | 1e-6 |
| `lr`, LoRA | 3e-2 | 1e-4 | 5e-5 |
| `lora_target_modules` (LoRA) | the seven projections + `lm_head` | `all-linear` | `all-linear` |
| `max_new_tokens` | 16 | `max_response_length` | `max_response_length` |
| `micro_batch_tokens` | 16384 | 16384 | 8192 (P <= 10B), 4096 above; never below one full sample |
| `save_every` | 0 (only `final/`) | 20 | 20 |
| `boot_timeout_s` | the server's | 300 + 60 s per GiB of bf16 weights | same |
| `stop_grace_s` | the server's | 30 + checkpoint bytes / 200 MB/s | same |

Why: 1e-6 is what GRPO recipes for 7B-class full fine-tuning use (verl's Qwen2.5-7B
recipes; OpenRLHF uses 5e-7); LoRA's best rate is about 10x to 50x full fine-tuning's
and the original refuses `lr <= 1e-5` with LoRA, so 5e-5 sits above that floor. A reply
cut short by `max_new_tokens` ends `length`/`incomplete`, which agent frameworks treat as
a failure, so real models may write a whole response. On ajet-tiny the output head
decides which characters come out: adapters on the projections alone learn the digits
task too slowly on a CPU (+0.02 in 90 s), with the head adapted too it passes within
the learning benchmark's 90 s. Boot reads the checkpoint from disk (60 s per GiB is a
slow shared file system); the stop grace covers writing the final checkpoint (bf16
weights, fp32 masters and AdamW's two moments: 14 bytes per trained parameter).

The validator records the fields it chose in the job's `defaults_chosen`, and chooses
those again at every check: a stored config whose `model` or `lora_rank` is then changed
(the MCP bridge's `configure` merges changes into the stored config) gets the new
model's values, not the old model's carried over as if the user had set them.

A value the user set is kept; one far outside the usual range for its model gets a note
naming the range (`notes`, status `unusual`). Each chosen value gets a note too (status
`default`), so the accepted config says what was chosen and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ajet.engine.planning.memory_plan import ModelShape, model_shape
from ajet.engine.tiny import TINY_MODEL_NAME

if TYPE_CHECKING:
    from ajet.copilot.job import AgentJetJob

__all__ = ["BY_MODEL_FIELDS", "ModelFacts", "model_facts", "resolve_job", "usual_lr_range"]

log = logging.getLogger(__name__)

GiB = 1024**3
#: Models above this are "large": full fine-tuning at 1e-6, LoRA at 5e-5.
LARGE_MODEL = 1_000_000_000
#: Above this, half the micro-batch token budget again (activations grow with width).
VERY_LARGE_MODEL = 10_000_000_000
#: Steps between checkpoints for every model but ajet-tiny.
DEFAULT_SAVE_EVERY = 20
#: Boot: a floor (imports, process group, generator warm-up), then reading the weights.
BOOT_BASE_S = 300.0
BOOT_S_PER_GIB = 60.0
#: Stop: a floor (finishing the update in progress), then writing the final checkpoint.
STOP_BASE_S = 30.0
CHECKPOINT_WRITE_BYTES_PER_S = 200 * 1024**2
#: ajet-tiny's LoRA targets: the seven projections of every layer and the output head.
TINY_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj", "lm_head"]

#: The fields `resolve_job` fills in when the user left them unset.
BY_MODEL_FIELDS = ("lr", "lora_target_modules", "max_new_tokens", "micro_batch_tokens",
                   "save_every", "boot_timeout_s", "stop_grace_s")


@dataclass(frozen=True)
class ModelFacts:
    """What the defaults depend on: is it ajet-tiny, and how many parameters."""

    name: str
    tiny: bool
    #: None when the model's `config.json` is not on this machine
    parameters: int | None

    @property
    def large(self) -> bool:
        return self.parameters is not None and self.parameters > LARGE_MODEL

    def describe(self) -> str:
        if self.tiny:
            return TINY_MODEL_NAME
        if self.parameters is None:
            return f"{self.name} (no config.json here)"
        return f"{self.name} ({self.parameters / 1e9:.2f}B parameters)"


def model_facts(model: str) -> ModelFacts:
    """The facts of the job's `model`; raises `ValueError` for an unreadable config.json."""
    if model == TINY_MODEL_NAME:
        return ModelFacts(TINY_MODEL_NAME, True, ModelShape.tiny().parameters)
    shape = model_shape(model)
    name = model.rstrip("/").rsplit("/", 1)[-1] or model
    return ModelFacts(name, False, shape.parameters if shape is not None else None)


def usual_lr_range(facts: ModelFacts, *, lora: bool) -> tuple[float, float] | None:
    """The learning rates usually used for this model and mode (None: no rule)."""
    if facts.tiny or facts.parameters is None:
        return None
    if lora:
        return (1e-5, 5e-4) if facts.large else (1e-5, 1e-3)
    return (1e-7, 1e-5) if facts.large else (1e-7, 1e-4)


def _trained_parameters(job: AgentJetJob, facts: ModelFacts) -> int:
    """Parameters with optimizer state: all of them, or LoRA's adapters (estimated)."""
    p = facts.parameters or 0
    if job.lora_rank <= 0:
        return p
    shape = model_shape(job.model) if not facts.tiny else ModelShape.tiny()
    if shape is None:
        return 0
    return shape.lora_parameters(job.lora_rank, job.lora_target_modules)


def _checkpoint_bytes(job: AgentJetJob, facts: ModelFacts) -> int:
    """Bytes one checkpoint writes: bf16 weights (LoRA: adapters, merged base if asked)
    plus the training state (fp32 masters and AdamW's two moments of what trains)."""
    p = facts.parameters or 0
    trained = _trained_parameters(job, facts)
    if job.lora_rank <= 0:
        weights = 2 * p
    else:  # the adapters as trained (fp32), and the merged base when asked for
        weights = 4 * trained + (2 * p if job.lora_save_merged else 0)
    return weights + 12 * trained


def _chosen(job: AgentJetJob, facts: ModelFacts) -> dict[str, tuple[Any, str]]:
    """Every by-model field's value for this job, and why."""
    lora = job.lora_rank > 0
    mode = "LoRA" if lora else "full fine-tuning"
    size = facts.describe()
    out: dict[str, tuple[Any, str]] = {}
    if facts.tiny:
        out["lr"] = ((3e-2, f"{mode} on {size}: tuned for the learning benchmark") if lora
                     else (3e-3, f"{mode} on {size}: tuned for the learning benchmark"))
        out["max_new_tokens"] = (16, f"{size}: short replies keep a CPU step fast")
        out["micro_batch_tokens"] = (16384, f"{size}")
        out["save_every"] = (0, f"{size}: only the final checkpoint")
        if lora:
            out["lora_target_modules"] = (
                list(TINY_LORA_TARGETS),
                f"LoRA on {size}: the output head decides which characters come out; "
                "projections alone learn too slowly on a CPU")
        return out
    if facts.parameters is None:  # the engine refuses such a model at boot, naming it
        return out
    if lora:
        out["lr"] = ((5e-5, f"LoRA on {size}: an adapter rate above the LoRA floor "
                            "(lr > 1e-5), about 50x full fine-tuning's") if facts.large
                     else (1e-4, f"LoRA on {size} (<= 1B parameters)"))
    else:
        out["lr"] = ((1e-6, f"full fine-tuning of {size}: the rate GRPO recipes use for "
                            "models over 1B parameters") if facts.large
                     else (1e-5, f"full fine-tuning of {size} (<= 1B parameters)"))
    out["max_new_tokens"] = (job.max_response_length,
                             "= max_response_length: a reply is cut only at the response "
                             "limit (agent frameworks treat a cut reply as a failure)")
    budget = 16384 if not facts.large else 8192 if facts.parameters <= VERY_LARGE_MODEL \
        else 4096
    sample = job.max_prompt_length + job.max_response_length
    out["micro_batch_tokens"] = (max(budget, sample),
                                 f"{size}: {budget} tokens per pass, at least one full sample "
                                 f"(max_prompt_length + max_response_length = {sample})")
    out["save_every"] = (DEFAULT_SAVE_EVERY, f"{size}: a checkpoint every "
                         f"{DEFAULT_SAVE_EVERY} steps, so a stop or crash loses little")
    weights_gib = 2 * facts.parameters / GiB
    out["boot_timeout_s"] = (round(BOOT_BASE_S + BOOT_S_PER_GIB * weights_gib),
                             f"{BOOT_BASE_S:g} s + {BOOT_S_PER_GIB:g} s per GiB of bf16 "
                             f"weights ({weights_gib:.1f} GiB); capped by the server's "
                             "max_boot_timeout_s")
    ckpt = _checkpoint_bytes(job, facts)
    out["stop_grace_s"] = (round(STOP_BASE_S + ckpt / CHECKPOINT_WRITE_BYTES_PER_S),
                           f"{STOP_BASE_S:g} s + the final checkpoint ({ckpt / GiB:.1f} GiB) at "
                           f"{CHECKPOINT_WRITE_BYTES_PER_S / 1024**2:.0f} MB/s; capped by the "
                           "server's max_stop_grace_s")
    return out


def resolve_job(job: AgentJetJob) -> tuple[AgentJetJob, list[dict[str, str]]]:
    """Fill the by-model fields the user left unset; returns the job and the notes.

    Raises `ValueError` for a model whose config.json cannot be read, and
    `JobValidationError` when a chosen value breaks a rule (named like any field).
    """
    facts = model_facts(job.model)
    chosen = _chosen(job, facts)
    again = set(job.defaults_chosen)
    unset = {name: value for name, (value, _) in chosen.items()
             if name not in job.model_fields_set or name in again}
    notes = [{"field": name, "status": "default", "reason": f"{value!r}: {chosen[name][1]}"}
             for name, value in unset.items()]
    # chosen for an earlier model but not by this one's rules: back to the plain default
    from ajet.copilot.job import default_job_values

    for name in sorted(again - set(chosen)):
        unset[name] = default_job_values().get(name)
    resolved = job
    if unset:
        from pydantic import ValidationError

        from ajet.copilot.job import AgentJetJob, JobValidationError

        data = {**job.model_dump(exclude_unset=True), **unset,
                "defaults_chosen": sorted(set(unset) & set(chosen))}
        try:
            resolved = AgentJetJob.model_validate(data)
        except ValidationError as exc:
            errors = [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"], "type": e["type"]}
                      for e in exc.errors()]
            raise JobValidationError(
                f"the defaults chosen for {facts.describe()} ({', '.join(unset)}) break a "
                f"rule with the fields set: {exc.errors()[0]['msg']}; set them yourself",
                errors) from exc
    notes += _unusual(resolved, facts)
    return resolved, notes


def _unusual(job: AgentJetJob, facts: ModelFacts) -> list[dict[str, str]]:
    """Notes on set values far outside the usual range for the model."""
    notes = []
    lora = job.lora_rank > 0
    usual = usual_lr_range(facts, lora=lora)
    user_set = job.model_fields_set - set(job.defaults_chosen)
    if usual is not None and "lr" in user_set and not usual[0] <= job.lr <= usual[1]:
        notes.append({"field": "lr", "status": "unusual", "reason": (
            f"lr={job.lr:g} is outside the usual range {usual[0]:g} to {usual[1]:g} for "
            f"{'LoRA' if lora else 'full fine-tuning'} of {facts.describe()}; accepted as set "
            "(leave lr unset to get the default for this model)")})
    if not facts.tiny and facts.parameters is not None and \
            "max_new_tokens" in user_set and job.max_new_tokens < 256:
        notes.append({"field": "max_new_tokens", "status": "unusual", "reason": (
            f"max_new_tokens={job.max_new_tokens}: every reply longer than that is cut "
            "(finish_reason length; the Responses API says incomplete), which agent "
            "frameworks treat as a failure; accepted as set")})
    return notes
