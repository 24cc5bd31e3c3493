"""The memory planner: will a job fit on its devices, and if not, what would make it fit.

Run at config time by the active snapshot's validator (`ajet/copilot/validate.py`), so a
synced patch changes it, and at boot by the engine, which logs the estimate. It imports
neither torch nor pydantic: the model's shape comes from its checkpoint's `config.json`
read as JSON (`ajet-tiny` has a known shape), and the job is read attribute by attribute,
so `bench/gpu_check.py` uses it on a host with only torch, transformers and peft.

What it counts, per GPU (or per process on CPU), term by term, each matched to what the
engine allocates (docs/distributed.md, "How the planner counts"; checked on CPU by
`tests/ajet/engine/test_memory_plan.py` and `make bench`):

    model        the generation copy `policy.model`, in the compute dtype
    state        fp32 master weights (a separate copy on GPUs, sharded under FSDP2),
                 gradients and AdamW's two moments for the trainable parameters, sharded;
                 the frozen KL reference (full fine-tuning with kl_coef > 0)
    transient    activations kept for backward at the micro-batch token budget (with or
                 without activation checkpointing), the log-prob chunk's vocabulary-wide
                 logits, bf16 weight casts (autocast on one GPU), FSDP2's gathered units
                 and unsharded gradients, AdamW's step temporaries, and while generating
                 the KV cache (the generator's own plan: `kv_cache.py`, same call, same
                 numbers) and transformers' decoding tensors around it
    runtime      the CUDA context (and NCCL's buffers) on GPUs; on CPU the pages torch's
                 kernels keep from the first update and the first decoding passes

The peak is the largest of five phases (boot, forward, backward, optimizer step,
generation), each the resident terms plus that phase's transients plus the allocator's
slack (`MemoryPlan.slack_share`). The job fits when the peak is
within the memory available (`detect_available`): the visible GPUs' memory from
`nvidia-smi`, else the job's `gpu_memory_gb`; for `n_gpu: 0` the host's memory shared
by the node's processes. A plan that does not fit names the smallest changes that do.

GPU jobs also need host memory, per node (`host_terms`): each process's runtime (torch,
the CUDA and NCCL host side), the checkpoint's files while the ranks load them (the page
cache: one copy per node, as every rank reads the same memory-mapped files straight
onto its GPU), on rank 0's node the full weights a checkpoint gathers there, and with
`async_save` every rank's training state staged for the background write. A job
whose node needs more than the host has (`detect_host`: the machine's memory or the
container's limit, or `AJET_ENGINE_HOST_MEMORY_GB` where the config is checked on another
machine than the GPU nodes) does not fit either, and the refusal says so with the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet.engine.config import BackendDefaults, episodes_in_flight, generation_backend
from ajet.engine.generation.kv_cache import (
    CachePlan,
    CacheTooSmall,
    ModelGeometry,
    PoolPlan,
    generation_concurrency,
    gpu_cache_budget,
    plan_cpu_cache,
    plan_gpu_cache,
    plan_paged_pool,
)
from ajet.engine.tiny import TINY_MODEL_NAME, TinySpec, tiny_vocab_size

__all__ = [
    "Available",
    "Fix",
    "JobView",
    "MemoryPlan",
    "ModelShape",
    "Term",
    "detect_available",
    "detect_host",
    "model_shape",
    "plan_job",
    "plan_memory",
]

log = logging.getLogger(__name__)

GiB = 1024**3
MiB = 1024**2
#: bytes of fp32 (master weights, gradients, optimizer state, the log-softmax)
_FP32 = 4
#: One GPU process: the CUDA context, cuBLAS workspaces and kernels (not in
#: `torch.cuda.max_memory_allocated`; about 0.5-0.8 GiB on H100-class GPUs with torch 2.x).
_CUDA_CONTEXT = 1 * GiB
#: NCCL's communicator buffers on each rank of a multi-GPU job.
_NCCL_BUFFERS = GiB // 2
#: Full bytes per all-gather when the weights are published (the same number as
#: `parallel.distributed.PUBLISH_BUCKET_BYTES`, which this torch-free module cannot import).
PUBLISH_BUCKET_BYTES = 256 * MiB
#: The caching allocator's reserved-but-unallocated share (fragmentation) on GPUs: a
#: share of the tensors of each phase.
_GPU_ALLOCATOR_SLACK = 0.05
#: CPU, above the resident set measured after imports and model load: the pages torch's
#: kernels and autograd's bookkeeping add in the first update, and the heap glibc's
#: malloc keeps resident after tensors are freed (its mmap threshold adapts upwards, so
#: most tensors come from the heap): the resident high-water mark is 1.31-1.38x the live
#: malloc bytes for ajet-tiny and the 50M model (`mallinfo2`, Linux, glibc 2.36).
_CPU_RUNTIME = 40 * MiB
_CPU_ALLOCATOR_SLACK = 0.38
#: CPU: what the first decoding passes page in (the generator's kernels and threads),
#: measured as the resident set above transformers' own footprint of the paged cache
#: (bench/memory_plan_probe.py, ajet-tiny and the 50M model: 5-6 MiB after the slack).
_CPU_DECODING_RUNTIME = 6 * MiB
#: CPU, the paged backend: the same for its scheduler thread (its own malloc arena) and
#: its first steps, measured as the resident peak above its pool and working tensors
#: (bench/memory_plan_probe.py: 10-13 MiB for ajet-tiny, 5-9 MiB for the 50M model).
#: Its tensors carry no heap slack: the pool is allocated once and every step allocates
#: the same sizes again, so glibc reuses the freed blocks exactly (measured: the peak is
#: the pool, the working tensors and this, with nothing proportional to them on top).
_CPU_PAGED_RUNTIME = 10 * MiB
#: Bytes per batch token of transformers' input and output index tensors (the bulk
#: input, the output ids, the write and read indices): ~60 B; a rounded upper bound.
_CB_IO_BYTES_PER_TOKEN = 64
#: transformers' default tokens per forward pass when the cache plan leaves it open
#: (`PagedAttentionMemoryHandler._default_max_batch_tokens`).
_CB_DEFAULT_BATCH_TOKENS = 8192
#: Tensors alive at once while one log-prob chunk is scored (scoring._chunk_scores):
#: the scaled fp32 logits, their log-softmax, and its exp and product for the entropy;
#: in backward the log-softmax, the gathered gradient and the log-softmax gradient.
_LOGIT_COPIES = 4
#: Host memory of one GPU process outside its tensors: torch and CUDA's libraries, the
#: CUDA context's host side, NCCL's host buffers, Python (1.5-2.5 GiB measured on H100
#: hosts with torch 2.x; the upper end).
_HOST_PER_GPU_PROCESS = 5 * GiB // 2
#: Environment override of the host memory the planner assumes (GiB).
HOST_MEMORY_ENV = "AJET_ENGINE_HOST_MEMORY_GB"
#: Environment override of one GPU's memory (GiB): the smallest GPU of the nodes a launcher
#: places runs on (the Ray launcher sets both from what Ray reports of its nodes).
GPU_MEMORY_ENV = "AJET_ENGINE_GPU_MEMORY_GB"
_HOST_PHASES = ("boot", "checkpoint save")
#: Candidates for "more GPUs" (per node), and nodes of 8 GPUs after that.
_GPU_COUNTS = (2, 4, 8)
_GPUS_PER_NODE = 8
_NODE_COUNTS = (2, 4, 8, 16)
#: LoRA rank suggested when a full fine-tuning job does not fit.
_SUGGESTED_LORA_RANK = 16
#: gpu_memory_utilization values suggested when the KV cache does not fit.
_GPU_MEMORY_UTILIZATIONS = (0.5, 0.7, 0.85, 0.9, 0.95)
#: Smallest micro-batch token budget suggested.
_MIN_TOKEN_BUDGET = 1024

PHASES = ("boot", "forward", "backward", "optimizer step", "generation")
_ALL = PHASES
_UPDATE = ("forward", "backward")
#: AdamW creates its moments in the first optimizer step: absent while the engine boots
_TRAINING = PHASES[1:]


def _size(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


# ---------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers the planner needs (a Qwen2/Llama/Mistral-style decoder)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    #: q, k and v projections carry a bias (Qwen2), or not (Llama, Mistral)
    qkv_bias: bool

    def as_config(self) -> dict[str, Any]:
        """The `config.json` fields the generation planners read (`kv_cache`)."""
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim}

    @classmethod
    def from_config(cls, config: dict[str, Any], *, name: str = "") -> ModelShape:
        """From the dict of a Hugging Face `config.json`."""
        if isinstance(config.get("text_config"), dict):  # multimodal: the language model
            return cls.from_config(config["text_config"], name=name)
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            model_type = str(config.get("model_type", ""))
            return cls(
                name=name or model_type or "model",
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                tied_embeddings=bool(config.get("tie_word_embeddings", False)),
                qkv_bias=bool(config.get("attention_bias", model_type.startswith("qwen2"))),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"config.json lacks a decoder shape the planner reads ({exc}); "
                             "it needs hidden_size, intermediate_size, num_hidden_layers, "
                             "num_attention_heads and vocab_size") from exc

    @classmethod
    def tiny(cls, spec: TinySpec | None = None) -> ModelShape:
        spec = spec or TinySpec()
        return cls(name=TINY_MODEL_NAME, vocab_size=tiny_vocab_size(),
                   hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                   layers=spec.num_hidden_layers, heads=spec.num_attention_heads,
                   kv_heads=spec.num_key_value_heads,
                   head_dim=spec.hidden_size // spec.num_attention_heads,
                   tied_embeddings=True, qkv_bias=True)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_modules(self) -> list[tuple[str, int, int]]:
        """(module name, in features, out features) of every linear layer, head last."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        out: list[tuple[str, int, int]] = []
        for n in range(self.layers):
            attn, mlp = f"model.layers.{n}.self_attn", f"model.layers.{n}.mlp"
            out += [(f"{attn}.q_proj", h, q), (f"{attn}.k_proj", h, kv),
                    (f"{attn}.v_proj", h, kv), (f"{attn}.o_proj", q, h),
                    (f"{mlp}.gate_proj", h, i), (f"{mlp}.up_proj", h, i),
                    (f"{mlp}.down_proj", i, h)]
        out.append(("lm_head", h, self.vocab_size))
        return out

    @property
    def layer_parameters(self) -> int:
        h = self.hidden_size
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        linear = sum(a * b for name, a, b in self.linear_modules()
                     if name.startswith("model.layers.0."))
        return linear + bias + 2 * h  # + the two RMSNorm weights

    @property
    def embedding_parameters(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def root_parameters(self) -> int:
        """Embeddings, final norm and (untied) output head: FSDP2's root unit."""
        head = 0 if self.tied_embeddings else self.embedding_parameters
        return self.embedding_parameters + head + self.hidden_size

    @property
    def parameters(self) -> int:
        return self.layers * self.layer_parameters + self.root_parameters

    def lora_parameters(self, rank: int, target_modules: str | Iterable[str]) -> int:
        """Adapter parameters peft adds: rank x (in + out) per targeted linear layer."""
        modules = self.linear_modules()
        if target_modules == "all-linear":  # peft: every linear layer but the output head
            chosen = modules[:-1]
        elif isinstance(target_modules, str):  # a regex, matched whole (peft's rule)
            chosen = [m for m in modules if re.fullmatch(target_modules, m[0])]
        else:  # names: a module whose name is, or ends with, one of them
            names = set(target_modules)
            chosen = [m for m in modules
                      if m[0] in names or m[0].rsplit(".", 1)[-1] in names]
        return sum(rank * (a + b) for _, a, b in chosen)

    def describe(self) -> str:
        return (f"{self.name}: {_count(self.parameters)} parameters (hidden "
                f"{self.hidden_size}, intermediate {self.intermediate_size}, {self.layers} "
                f"layers, {self.heads} heads, {self.kv_heads} KV heads, vocabulary "
                f"{self.vocab_size}{', tied embeddings' if self.tied_embeddings else ''})")


def model_shape(model: str) -> ModelShape | None:
    """The shape of the job's `model`: ajet-tiny's, or read from `<model>/config.json`.

    None when there is no `config.json` there (the engine refuses such a model at boot,
    naming it); raises `ValueError` when the file is unreadable or not a decoder config.
    """
    if model == TINY_MODEL_NAME:
        return ModelShape.tiny()
    path = Path(model).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return ModelShape.from_config(config, name=Path(model).name)


# ---------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class JobView:
    """The job fields the planner reads (from an `AgentJetJob` or any object with them).

    The defaults are `ajet/default_config/job.yaml`'s (test_memory_plan.py checks it).
    """

    model: str = TINY_MODEL_NAME
    n_gpu: int = 0
    n_proc: int = 1
    nnodes: int = 1
    batch_size: int = 4
    num_repeat: int = 8
    max_prompt_length: int = 8192
    max_response_length: int = 1024
    kl_coef: float = 0.0
    max_env_worker: int | None = None
    gpu_memory_utilization: float = 0.85
    lora_rank: int = 0
    lora_target_modules: str | tuple[str, ...] = "all-linear"
    activation_checkpointing: bool | str = "auto"
    micro_batch_tokens: int = 16384
    mini_batch_num: int = 1
    gpu_memory_gb: float = 80.0
    async_save: bool | str = "auto"
    generation_backend: str = "auto"
    #: FSDP2 even with one rank (`bench/gpu_check.py`); None: the engine's rule, FSDP2
    #: exactly when there are several ranks
    fsdp: bool | None = None

    @classmethod
    def from_job(cls, job: Any) -> JobView:
        values = {}
        for f in dataclasses.fields(cls):
            if hasattr(job, f.name):
                value = getattr(job, f.name)
                values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)

    @property
    def on_gpu(self) -> bool:
        return self.n_gpu > 0

    @property
    def saves_in_background(self) -> bool:
        """`async_save` as the engine resolves it (auto: with GPUs)."""
        return self.on_gpu if self.async_save == "auto" else bool(self.async_save)

    @property
    def procs_per_node(self) -> int:
        return self.n_gpu if self.on_gpu else self.n_proc

    @property
    def world_size(self) -> int:
        return self.procs_per_node * self.nnodes

    @property
    def sharded(self) -> bool:
        return self.world_size > 1 if self.fsdp is None else self.fsdp

    @property
    def checkpointing(self) -> bool:
        if self.activation_checkpointing == "auto":
            return self.on_gpu  # as ajet.engine.config does
        return bool(self.activation_checkpointing)

    @property
    def sample_tokens(self) -> int:
        """The longest training sample: a full prompt plus the longest response."""
        return self.max_prompt_length + self.max_response_length


# ---------------------------------------------------------------------------- memory available


@dataclass(frozen=True)
class Available:
    """Memory one device (GPU) or one process (CPU, its share of the host) may use."""

    bytes: int
    source: str

    def describe(self) -> str:
        return f"{_size(self.bytes)} ({self.source})"


def _nvidia_smi_totals(timeout_s: float) -> list[int] | None:
    """Each visible GPU's total memory in bytes, from nvidia-smi; None without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=True)
        totals = [int(float(line.strip())) * MiB for line in out.stdout.splitlines()
                  if line.strip()]
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("nvidia-smi did not report GPU memory (%s); using gpu_memory_gb", exc)
        return None
    # nvidia-smi lists every GPU; the engine sees only those CUDA_VISIBLE_DEVICES names
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and totals:
        picked = []
        for item in (v.strip() for v in visible.split(",") if v.strip()):
            if not item.isdigit():  # UUIDs or MIG names: cannot map them; keep the list
                return totals
            if int(item) < len(totals):
                picked.append(totals[int(item)])
        return picked
    return totals or None


def _host_memory() -> tuple[int, str]:
    """Physical memory, or the container's cgroup limit when that is smaller."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    source = "host memory"
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, source = int(text), "the container's memory limit"
        break
    return total, source


def detect_host() -> Available:
    """The memory of one node's host: `AJET_ENGINE_HOST_MEMORY_GB` when set (a config checked
    away from the GPU nodes), else this machine's (or its container's limit)."""
    value = os.environ.get(HOST_MEMORY_ENV)
    if value:
        try:
            return Available(int(float(value) * GiB), f"{HOST_MEMORY_ENV}={value}")
        except ValueError:
            log.warning("%s=%r is not a number of GiB; measuring the host", HOST_MEMORY_ENV,
                        value)
    return Available(*_host_memory())


def detect_available(job: JobView, *, smi_timeout_s: float = 10.0,
                     gpu_totals: Callable[[float], list[int] | None] = _nvidia_smi_totals
                     ) -> Available:
    """What one of the job's processes may use, read without torch.

    GPU jobs: the smallest total memory among the GPUs it uses, from `nvidia-smi`
    (restricted to `CUDA_VISIBLE_DEVICES`); where no GPU is visible (a CPU host, or a
    config checked ahead of time) the job's `gpu_memory_gb`. CPU jobs: the host's memory
    (or the container's limit) divided among the node's `n_proc` processes.
    """
    if not job.on_gpu:
        host = detect_host()  # the nodes' own, where a launcher names it
        total, source = host.bytes, host.source
        share = total // max(1, job.procs_per_node)
        if job.procs_per_node > 1:
            source += f", shared by {job.procs_per_node} processes"
        return Available(share, source)
    given = os.environ.get(GPU_MEMORY_ENV)
    if given:
        try:
            return Available(int(float(given) * GiB), f"{GPU_MEMORY_ENV}={given}")
        except ValueError:
            log.warning("%s=%r is not a number of GiB; ignored", GPU_MEMORY_ENV, given)
    totals = gpu_totals(smi_timeout_s)
    if totals:
        used = totals[:job.n_gpu] if len(totals) >= job.n_gpu else totals
        return Available(min(used), f"nvidia-smi, {len(totals)} GPU(s) visible")
    return Available(int(job.gpu_memory_gb * GiB),
                     f"gpu_memory_gb={job.gpu_memory_gb:g}: no GPU visible here")


# ---------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Term:
    """One line of the estimate: bytes per device that exist during `phases`."""

    name: str
    bytes: int
    #: "model" (the generation copy, loaded at boot), "state" (resident training state),
    #: "transient" (one phase), "runtime" (outside torch's tensor accounting on GPUs)
    kind: str
    phases: tuple[str, ...]
    #: made by the first update (AdamW's moments, autograd's pages): absent from a run's
    #: first rollout, which comes before it
    steady: bool = False
    #: CPU: glibc's retained heap (`_CPU_ALLOCATOR_SLACK`) comes on top; False for
    #: tensors allocated once or at the same sizes every step (the paged backend's)
    cpu_heap_slack: bool = True


@dataclass(frozen=True)
class Fix:
    """A change to the job that fits, with the peak it leads to."""

    changes: dict[str, Any]
    peak_bytes: int
    text: str


@dataclass
class MemoryPlan:
    job: JobView
    shape: ModelShape
    available: Available
    terms: list[Term]
    #: micro-batch tokens and log-prob chunk positions the transients were sized for
    micro_tokens: int
    chunk_positions: int
    #: the generator's KV cache plan (`kv_cache.py`), or None where it cannot hold one
    #: request (`cache_error` then says why, in kv_cache's words)
    cache: CachePlan | None = None
    cache_error: str | None = None
    #: the paged backend's pool instead (`kv_cache.plan_paged_pool`), and whether it stays
    #: allocated across updates (it does where it fits beside the update's peak)
    pool: PoolPlan | None = None
    pool_kept: bool = True
    fixes: list[Fix] = field(default_factory=list)
    #: GPU jobs: host memory per node (the busiest node, rank 0's), and what a node has
    host_terms: list[Term] = field(default_factory=list)
    host_available: Available | None = None

    def host_phase_bytes(self, phase: str) -> int:
        return sum(t.bytes for t in self.host_terms if phase in t.phases)

    @property
    def host_bytes(self) -> int:
        return max((self.host_phase_bytes(p) for p in _HOST_PHASES), default=0)

    @property
    def host_fits(self) -> bool:
        return self.host_available is None or self.host_bytes <= self.host_available.bytes

    @property
    def slack_share(self) -> float:
        """The allocator's share on top of each phase's tensors: the caching allocator's
        fragmentation on GPUs, glibc's retained heap on CPU (of what is above the model)."""
        return _GPU_ALLOCATOR_SLACK if self.job.on_gpu else _CPU_ALLOCATOR_SLACK

    def _present(self, phase: str, first_rollout: bool) -> list[Term]:
        return [t for t in self.terms
                if phase in t.phases and not (first_rollout and t.steady)]

    def slack_bytes(self, phase: str, *, first_rollout: bool = False) -> int:
        gpu = self.job.on_gpu
        kinds = ("model", "state", "transient") if gpu else ("state", "transient")
        return int(self.slack_share * sum(t.bytes for t in self._present(phase, first_rollout)
                                          if t.kind in kinds and (gpu or t.cpu_heap_slack)))

    def phase_bytes(self, phase: str, *, first_rollout: bool = False) -> int:
        """Every term of `phase` plus the allocator's slack (`first_rollout`: before the
        first update, without what it creates)."""
        return (sum(t.bytes for t in self._present(phase, first_rollout))
                + self.slack_bytes(phase, first_rollout=first_rollout))

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phase_bytes(self.peak_phase)

    @property
    def device_fits(self) -> bool:
        return self.cache_error is None and self.peak_bytes <= self.available.bytes

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    def comparable_bytes(self, phase: str | None = None, *, first_rollout: bool = False
                         ) -> int:
        """What the engine's `peak_memory_mb` measures, for the same phase (default: peak).

        GPU: `torch.cuda.max_memory_allocated`, every tensor (not the CUDA context nor
        the allocator's slack). CPU: the RSS high-water mark minus the RSS after imports
        and model load, so without the loaded generation copy, with the slack.
        `first_rollout`: a run's first rollout, before the first update made AdamW's
        moments and autograd's pages.
        """
        phase = phase or self.peak_phase
        present = self._present(phase, first_rollout)
        if self.job.on_gpu:
            return sum(t.bytes for t in present if t.kind != "runtime")
        return (sum(t.bytes for t in present if t.kind != "model")
                + self.slack_bytes(phase, first_rollout=first_rollout))

    @property
    def unit(self) -> str:
        return "GPU" if self.job.on_gpu else "process"

    def setup(self) -> str:
        j = self.job
        where = (f"{j.world_size} GPU(s) ({j.n_gpu} per node x {j.nnodes} node(s))"
                 if j.on_gpu else f"CPU, {j.world_size} process(es)")
        lora = j.lora_rank > 0
        training = f"LoRA rank {j.lora_rank}" if lora else "full fine-tuning"
        sharding = ("one process" if not j.sharded else
                    "the base replicated on every rank" if lora else "FSDP2")
        precision = ("fp32" if not j.on_gpu else
                     "bf16 base, fp32 adapters" if lora else "bf16 compute over fp32 masters")
        return (f"{training}, {where}, {sharding}, {precision}, activation checkpointing "
                f"{'on' if j.checkpointing else 'off'}, micro-batches of {self.micro_tokens} "
                "tokens")

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        host = (f"; host ~{_size(self.host_bytes)} per node of "
                f"{self.host_available.describe()}"
                if self.host_terms and self.host_available is not None else "")
        return (f"memory plan: {verdict}: peak ~{_size(self.peak_bytes)} per {self.unit} "
                f"({self.peak_phase}) of {self.available.describe()}{host}")

    def render(self) -> str:
        """The estimate term by term, as the refusal and the boot log show it."""
        width = max(len(t.name) for t in self.terms)
        lines = [f"estimated memory per {self.unit} for {self.shape.describe()}; "
                 f"{self.setup()}:"]
        for t in self.terms:
            phases = "all phases" if t.phases == _ALL else ", ".join(t.phases)
            lines.append(f"  {t.name:<{width}}  {_size(t.bytes):>10}  ({phases})")
        slack = "the tensors" if self.job.on_gpu else "what is above the loaded model"
        lines.append(f"  {'allocator slack':<{width}}  {self.slack_share:>9.0%}  "
                     f"(of {slack}, each phase)")
        for phase in PHASES:
            mark = "  <- peak" if phase == self.peak_phase else ""
            lines.append(f"  {'= ' + phase:<{width}}  {_size(self.phase_bytes(phase)):>10}{mark}")
        if self.cache is not None:
            lines.append(self.cache.summary())
        if self.pool is not None:
            lines.append(self.pool.summary() + ("; kept across updates" if self.pool_kept
                                                else "; released for every update"))
        if self.cache_error is not None:
            lines.append(f"KV cache: {self.cache_error}")
        short = self.peak_bytes - self.available.bytes
        lines.append(f"available: {self.available.describe()}; "
                     + ("fits" if self.device_fits else f"short by {_size(short)}"
                        if short > 0 else "the KV cache does not fit"))
        if self.host_terms:
            lines.append("host memory per node (rank 0's):")
            hw = max(len(t.name) for t in self.host_terms)
            for t in self.host_terms:
                lines.append(f"  {t.name:<{hw}}  {_size(t.bytes):>10}  ({', '.join(t.phases)})")
            for phase in _HOST_PHASES:
                lines.append(f"  {'= ' + phase:<{hw}}  {_size(self.host_phase_bytes(phase)):>10}")
            if self.host_available is not None:
                over = self.host_bytes - self.host_available.bytes
                lines.append(f"host available: {self.host_available.describe()}; "
                             + ("fits" if over <= 0 else f"short by {_size(over)}"))
        return "\n".join(lines)

    def hint(self) -> str:
        if self.fits:
            return ""
        if self.device_fits:  # only the host is short
            return (f"the GPUs fit, the host does not ({_size(self.host_bytes)} per node): "
                    "fewer GPUs per node (n_gpu, more nnodes), or a host with more memory; "
                    f"{HOST_MEMORY_ENV} if this machine is not a GPU node")
        if not self.fixes:
            return ("no single change of n_gpu, lora_rank, micro_batch_tokens, "
                    "activation_checkpointing or gpu_memory_utilization fits; use a smaller "
                    "model or larger GPUs" + ("; for the KV cache: shorten max_prompt_length "
                                              "or max_response_length"
                                              if self.cache_error else ""))
        return "smallest changes that fit: " + "; ".join(f.text for f in self.fixes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "unit": self.unit,
            "model": self.shape.describe(),
            "parameters": self.shape.parameters,
            "setup": self.setup(),
            "terms_gib": {t.name: round(t.bytes / GiB, 4) for t in self.terms},
            "phases_gib": {p: round(self.phase_bytes(p) / GiB, 4) for p in PHASES},
            "peak_phase": self.peak_phase,
            "peak_gib": round(self.peak_bytes / GiB, 3),
            "available_gib": round(self.available.bytes / GiB, 3),
            "available_source": self.available.source,
            "kv_cache_tokens": (self.cache.tokens if self.cache is not None else
                                self.pool.tokens if self.pool is not None else None),
            "kv_cache_error": self.cache_error,
            "host_gib": round(self.host_bytes / GiB, 3) if self.host_terms else None,
            "host_available_gib": round(self.host_available.bytes / GiB, 3)
            if self.host_available is not None and self.host_terms else None,
            "host_terms_gib": {t.name: round(t.bytes / GiB, 4) for t in self.host_terms},
            "fixes": [{"changes": f.changes, "peak_gib": round(f.peak_bytes / GiB, 3)}
                      for f in self.fixes],
        }


def _activation_bytes_per_token(shape: ModelShape, mode: str, *, checkpointing: bool,
                                response_share: float) -> tuple[int, int]:
    """(bytes kept for backward per token, bytes one layer's recompute adds per token).

    Counted from what autograd saves in a transformers Qwen2/Llama decoder layer with
    SDPA attention (checked per dtype with `saved_tensors_hooks`, test_memory_plan.py):
    each RMSNorm keeps its input, the normalised and the scaled output; attention keeps
    q, k, v after the rotary embedding and its output; the MLP keeps gate, up, their
    SiLU and product. `mode` is "fp32" (CPU), "bf16" (FSDP2's bf16 parameters; the
    norms upcast their input to fp32) or "autocast" (one GPU: fp32 weights, so the
    residual stream and the norms stay fp32, and every linear layer keeps a bf16 cast
    of its input).
    """
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim
    if mode == "fp32":
        layer, residual, final = 4 * (6 * h + 2 * q + 2 * kv + 4 * i), 4 * h, 12 * h
        picked = 4 * h
    elif mode == "bf16":
        layer, residual, final = 16 * h + 4 * q + 4 * kv + 8 * i, 2 * h, 8 * h
        picked = 2 * h
    else:  # autocast
        layer, residual, final = 26 * h + 4 * q + 4 * kv + 8 * i, 4 * h, 12 * h
        picked = 4 * h
    fixed = final + int(picked * response_share)  # final norm, response hidden states
    if checkpointing:  # each layer keeps its input; backward recomputes one at a time
        return shape.layers * residual + fixed, layer
    return shape.layers * layer + fixed, 0


def plan_memory(job: JobView, shape: ModelShape, available: Available, *,
                backend: BackendDefaults | None = None, with_fixes: bool = True,
                host: Available | None = None) -> MemoryPlan:
    """The estimate for `job` on `shape`, per GPU (or per CPU process); see the module doc."""
    backend = backend or BackendDefaults()
    lora = job.lora_rank > 0
    # LoRA trains fp32 adapters on the generation model's frozen base, replicated on
    # every rank, never sharded (training_model.py); FSDP2 shards full fine-tuning only
    sharded = job.sharded and not lora
    world = job.world_size if sharded else 1
    p = shape.parameters
    adapters = shape.lora_parameters(job.lora_rank, job.lora_target_modules) if lora else 0
    trainable = adapters if lora else p
    compute = 2 if job.on_gpu else _FP32  # bf16 on GPUs, fp32 on CPU
    mode = "fp32" if not job.on_gpu else ("bf16" if sharded or lora else "autocast")
    # one CPU process, and LoRA anywhere, train the generation model itself (`shared`)
    shared = lora or (not sharded and not job.on_gpu)

    def per_rank(n: int) -> int:
        return math.ceil(n / world)

    if lora:
        terms = [Term(f"model: frozen base ({'bf16' if compute == 2 else 'fp32'}, shared by "
                      "generation and training) + fp32 adapters",
                      p * compute + adapters * _FP32, "model", _ALL)]
    else:
        terms = [Term(f"generation copy ({'bf16' if compute == 2 else 'fp32'})",
                      p * compute, "model", _ALL)]
    if not shared:
        terms.append(Term("trained weights (fp32 masters" + (", sharded)" if sharded else ")"),
                          per_rank((p + adapters) * _FP32), "state", _ALL))
    terms.append(Term("AdamW moments (fp32" + (", sharded)" if sharded else ")"),
                      per_rank(trainable * 2 * _FP32), "state", _TRAINING, steady=True))
    if job.kl_coef > 0 and not lora:
        terms.append(Term(f"KL reference ({'bf16' if compute == 2 else 'fp32'})",
                          per_rank(p * compute), "state", _ALL))

    # --- the micro-batch: the token budget, unless a step never gathers that many
    groups = math.ceil(math.ceil(job.batch_size / max(1, job.mini_batch_num)) / job.world_size)
    rank_tokens = groups * job.num_repeat * job.sample_tokens
    micro = min(max(job.micro_batch_tokens, job.sample_tokens), rank_tokens)
    response_share = job.max_response_length / job.sample_tokens
    rows = max(1, micro // job.sample_tokens)
    # scoring.py: chunks of chunk_tokens // rows positions per row, over the responses
    chunk = min(rows * max(1, backend.logprob_chunk_tokens // rows),
                rows * job.max_response_length)
    # gradients accumulate over micro-batches: all of them exist during later passes
    accumulating = rank_tokens > micro
    head_grad = 0 if lora else per_rank(shape.embedding_parameters * _FP32)
    grads = per_rank(trainable * _FP32)
    terms.append(Term("gradients (fp32" + (", sharded)" if sharded else ")"), grads, "state",
                      ("forward", "backward", "optimizer step") if accumulating
                      else ("optimizer step",)))
    if not accumulating and head_grad:
        terms.append(Term("output head gradient (first in backward)", head_grad,
                          "transient", ("backward",)))

    saved, recompute = _activation_bytes_per_token(
        shape, mode, checkpointing=job.checkpointing, response_share=response_share)
    terms.append(Term(f"activations ({micro} tokens"
                      + (", checkpointed)" if job.checkpointing else ")"),
                      micro * saved, "transient", _UPDATE))
    if recompute:
        terms.append(Term("one layer recomputed in backward", micro * recompute, "transient",
                          ("backward",)))
    terms.append(Term(f"log-prob chunk ({chunk} x {shape.vocab_size} fp32 logits)",
                      _LOGIT_COPIES * chunk * shape.vocab_size * _FP32, "transient", _UPDATE))
    if job.on_gpu and not sharded and not lora:
        # autocast caches a bf16 copy of every trainable weight for the forward (LoRA's
        # base is bf16 already and its adapters compute in fp32: no casts)
        terms.append(Term("bf16 weight casts (autocast)", 2 * p, "transient", _UPDATE))
    if sharded:
        # FSDP2: the root unit (embeddings, head) stays gathered from forward to
        # backward, two decoder layers are gathered at a time (prefetch); in backward the
        # output head's unsharded gradient (compute dtype) waits for the root's
        # reduce-scatter at the very end, and each layer's unsharded gradient is cast to
        # fp32 for its own. (The root's reduce-scatter itself runs once the activations
        # are gone, so it does not raise the peak.)
        gathered = compute * (shape.root_parameters + 2 * shape.layer_parameters)
        terms.append(Term("FSDP2 gathered parameters", gathered, "transient", _UPDATE))
        if not lora:
            head = shape.embedding_parameters  # tied or not: the head's weight
            # GPUs reduce in fp32 (MixedPrecisionPolicy.reduce_dtype): a cast copy
            reduce = compute + (_FP32 if job.on_gpu else 0)
            terms.append(Term("FSDP2 unsharded gradients (head, one layer)",
                              compute * head + reduce * shape.layer_parameters,
                              "transient", ("backward",)))
    largest_adapter = job.lora_rank * max(
        shape.intermediate_size, shape.vocab_size)  # an adapter's A or B, at most
    if sharded:
        # publish() after the step: shards cast to the generation dtype, gathered in
        # buckets of PUBLISH_BUCKET_BYTES (a larger parameter alone), one parameter at a
        # time unpacked out of the bucket
        published = adapters * compute if lora else p * compute
        largest_full = (shape.embedding_parameters if not lora else largest_adapter) * compute
        bucket = min(published, max(PUBLISH_BUCKET_BYTES, largest_full))
        terms.append(Term("weights publish (one bucket gathered, one parameter unpacked)",
                          bucket + largest_full, "transient", ("optimizer step",)))
    # AdamW's step: foreach on GPUs (a sqrt of every second moment at once), one
    # parameter at a time on CPU (two temporaries of the largest)
    largest = shape.embedding_parameters if not lora else largest_adapter
    step_temp = per_rank(trainable * _FP32) if job.on_gpu else 2 * per_rank(largest) * _FP32
    terms.append(Term("AdamW step temporaries", step_temp, "transient", ("optimizer step",)))

    if job.on_gpu:
        several = job.world_size > 1
        terms.append(Term("CUDA context" + (" and NCCL buffers" if several else ""),
                          _CUDA_CONTEXT + (_NCCL_BUFFERS if several else 0), "runtime", _ALL))
    else:
        terms.append(Term("torch kernels and autograd (CPU, from the first update)",
                          _CPU_RUNTIME, "runtime", _TRAINING, steady=True))
    plan = MemoryPlan(job=job, shape=shape, available=available, terms=terms,
                      micro_tokens=micro, chunk_positions=chunk,
                      host_terms=_host_terms(job, shape, adapters, world=world)
                      if job.on_gpu else [],
                      host_available=host)
    _add_generation_terms(plan, compute, backend)
    if with_fixes and not plan.fits:
        plan.fixes = _fixes(job, shape, available, backend)
    return plan


def _host_terms(job: JobView, shape: ModelShape, adapters: int, *, world: int
                ) -> list[Term]:
    """Host memory of the busiest node (rank 0's) of a GPU job."""
    p = shape.parameters
    lora = job.lora_rank > 0
    staged = []
    if job.saves_in_background:
        # async_save stages each rank's training state (fp32 masters and AdamW's two
        # moments: 12 bytes per trained parameter, its shard of them) in host memory,
        # where it stays until the background write is done
        trained = adapters if lora else p
        staged = [Term("training state staged for the background save (async_save; "
                       f"{job.procs_per_node} rank(s) of the node)",
                       job.procs_per_node * math.ceil(3 * _FP32 * trained / world),
                       "transient", ("checkpoint save",))]
    return [
        Term(f"process runtime ({job.procs_per_node} x {_size(_HOST_PER_GPU_PROCESS)})",
             job.procs_per_node * _HOST_PER_GPU_PROCESS, "runtime", _HOST_PHASES),
        # every rank reads the same memory-mapped files onto its GPU (policy.load_policy);
        # FSDP2's trained copy is filled from that copy, on the device
        Term("checkpoint files while loading (page cache, one copy per node)", 2 * p,
             "transient", ("boot",)),
        # save_checkpoint gathers the full state on rank 0's host (Dist.full_state_dict)
        Term("checkpoint gathered on rank 0 (" + ("bf16 base + fp32 adapters)" if lora
                                                 else "fp32 masters)"),
             2 * p + _FP32 * adapters if lora else _FP32 * p, "transient",
             ("checkpoint save",)),
        *staged,
    ]


def _add_generation_terms(plan: MemoryPlan, compute: int, backend: BackendDefaults) -> None:
    """While generating: the KV cache the engine's generator plans (`kv_cache.py`, the
    same call with the same numbers) and transformers' working tensors around it.

    GPU: the cache gets `gpu_memory_utilization` of the device minus what is allocated
    when it is built (this plan's generation-phase tensors, the CUDA context, the slack);
    where that cannot hold one request the plan does not fit, with kv_cache's message.
    Where the cache fills that budget, transformers fits its working tensors into it too,
    so the budget is the term. CPU: the cache kv_cache sizes within `cpu_kv_cache_mb`.
    """
    job, shape = plan.job, plan.shape
    geometry = ModelGeometry(layers=shape.layers, kv_heads=shape.kv_heads,
                             head_dim=shape.head_dim)
    concurrency = generation_concurrency(backend.max_generation_batch,
                                         episodes_in_flight(job, backend))
    if generation_backend(job, backend, on_gpu=job.on_gpu) == "paged":
        _add_paged_pool_terms(plan, compute, backend, geometry, concurrency)
        return
    if job.on_gpu:
        used = plan.phase_bytes("generation")  # before the cache: all of it is allocated
        try:
            cache = plan_gpu_cache(geometry, dtype_bytes=compute,
                                   max_request_tokens=job.sample_tokens,
                                   concurrency=concurrency, total_bytes=plan.available.bytes,
                                   free_bytes=max(0, plan.available.bytes - used),
                                   gpu_memory_utilization=job.gpu_memory_utilization)
        except CacheTooSmall as exc:
            plan.cache_error = str(exc)
            plan.terms.append(Term("KV cache: one request, at least", 2 * job.sample_tokens
                                   * geometry.kv_bytes_per_token(compute), "transient",
                                   ("generation",)))
            return
    else:
        cache = plan_cpu_cache(geometry, dtype_bytes=compute,
                               max_request_tokens=job.sample_tokens, concurrency=concurrency,
                               budget_mb=backend.cpu_kv_cache_mb,
                               max_batch_tokens=backend.cpu_max_batch_tokens)
    plan.cache = cache
    if cache.num_blocks is None:  # transformers sizes cache + working tensors to the budget
        plan.terms.append(Term(f"KV cache and decoding tensors (the rest of "
                               f"gpu_memory_utilization={job.gpu_memory_utilization:g})",
                               cache.budget_bytes, "transient", ("generation",)))
        return
    kv, working = paged_cache_footprint(shape, cache, dtype_bytes=compute)
    plan.terms.append(Term(f"KV cache ({cache.tokens} tokens, pages of {cache.page_size})",
                           kv, "transient", ("generation",)))
    batch = cache.max_batch_tokens or _CB_DEFAULT_BATCH_TOKENS
    plan.terms.append(Term(f"decoding pass ({batch}-token forwards: attention mask, "
                           "keys and values read)", working, "transient", ("generation",)))
    if not job.on_gpu:
        plan.terms.append(Term("torch kernels for decoding (CPU)", _CPU_DECODING_RUNTIME,
                               "runtime", ("generation",)))


def _add_paged_pool_terms(plan: MemoryPlan, compute: int, backend: BackendDefaults,
                          geometry: ModelGeometry, concurrency: int) -> None:
    """The paged backend (`generation/paged.py`): its pool and its steps' working tensors
    (the CUDA graph pool, the prefill scratch), from the call the generator makes
    (`kv_cache.plan_paged_pool`); no attention mask. On a GPU the pool and the graphs stay
    allocated across updates when they fit beside the update's peak (then they count in
    every training phase), else they are released for each update and count while
    generating only."""
    job, shape = plan.job, plan.shape
    if job.on_gpu:  # as the generator: less what is allocated when it plans
        total = plan.available.bytes
        budget = gpu_cache_budget(total, total - plan.phase_bytes("generation"),
                                  job.gpu_memory_utilization)
    else:
        budget = int(backend.cpu_kv_cache_mb * MiB)
    try:
        pool = plan_paged_pool(
            shape.as_config(), device="cuda" if job.on_gpu else "cpu", dtype_bytes=compute,
            max_request_tokens=job.sample_tokens, concurrency=concurrency,
            budget_bytes=budget, kernel=backend.paged_kernel,
            prefill_tokens=backend.gpu_prefill_tokens if job.on_gpu
            else backend.cpu_max_batch_tokens)
    except CacheTooSmall as exc:
        plan.cache_error = str(exc)
        plan.terms.append(Term("KV cache: one request, at least", 2 * job.sample_tokens
                               * geometry.kv_bytes_per_token(compute), "transient",
                               ("generation",)))
        return
    plan.pool = pool
    update_peak = max(plan.phase_bytes(p) for p in _TRAINING if p != "generation")
    plan.pool_kept = (not job.on_gpu or update_peak + pool.pool_bytes + pool.working_bytes
                      <= plan.available.bytes)
    phases = _TRAINING if plan.pool_kept else ("generation",)
    plan.terms.append(Term(f"paged KV pool ({pool.tokens} tokens, pages of "
                           f"{pool.page_size})", pool.pool_bytes, "transient", phases,
                           cpu_heap_slack=False))
    plan.terms.append(Term("paged decode step (CUDA graph pool) or prefill chunk",
                           pool.working_bytes, "transient", phases, cpu_heap_slack=False))
    if not job.on_gpu:
        plan.terms.append(Term("scheduler thread and torch kernels for decoding (CPU)",
                               _CPU_PAGED_RUNTIME, "runtime", ("generation",)))


def paged_cache_footprint(shape: ModelShape, cache: CachePlan, *, dtype_bytes: int,
                          flash_attention: bool = False) -> tuple[int, int]:
    """(the KV cache tensor, the working tensors) transformers allocates for `cache`.

    transformers' own account of its paged cache (`PagedAttentionMemoryHandler.
    compute_memory_footprint`, transformers 5.x; test_memory_plan.py checks the two
    agree): the cache tensor is whole sectors (a sector holds one page of every layer,
    aligned to 128 bytes) plus two trash sectors; each forward pass of M batch tokens
    over N readable cache tokens holds the attention mask [M, N + M] (not with flash
    attention), the keys and values read back for every readable token (repeated to
    every query head, with SDPA), the largest per-token activation (hidden states, the
    query, the new keys and values and their repeated copies), the index tensors, and
    one fp32 vocabulary row of logits per request (the model keeps only those logits).
    """
    a = dtype_bytes
    h, hd = shape.hidden_size, shape.head_dim
    page = cache.page_size
    block = shape.layers * 2 * shape.kv_heads * hd * a * page  # one page of every layer
    sector = math.lcm(block, 128)
    tokens_per_sector = sector // block * page
    sectors = max(1, math.ceil((cache.num_blocks or 1) * block / sector))
    kv = (sectors + 2) * sector  # two trash sectors first
    batch = cache.max_batch_tokens or _CB_DEFAULT_BATCH_TOKENS
    readable = sectors * tokens_per_sector
    heads_at_peak = 2 * shape.kv_heads if flash_attention else 2 * shape.heads + shape.kv_heads
    attention_peak = a * (h + shape.heads * hd + 2 * shape.kv_heads * hd + heads_at_peak * hd)
    per_batch_token = attention_peak + _CB_IO_BYTES_PER_TOKEN
    per_cache_token = heads_at_peak * hd * a + 8  # the keys and values read, the read index
    mask = 0 if flash_attention else a * batch * (readable + batch)
    logits = cache.max_requests_per_batch * (h * a + shape.vocab_size * _FP32)
    return kv, batch * per_batch_token + readable * per_cache_token + mask + logits


def _fixes(job: JobView, shape: ModelShape, available: Available,
           backend: BackendDefaults) -> list[Fix]:
    """The smallest single changes that fit; more GPUs combined with LoRA if none does."""

    def attempt(text: str, **changes: Any) -> Fix | None:
        changed = dataclasses.replace(job, **changes)
        plan = plan_memory(changed, shape, available, backend=backend, with_fixes=False)
        if not plan.device_fits:
            return None
        return Fix(changes, plan.peak_bytes,
                   f"{text}: ~{_size(plan.peak_bytes)} per {plan.unit}")

    fixes: list[Fix] = []
    if job.on_gpu:
        for n in (c for c in _GPU_COUNTS if c > job.n_gpu):  # the smallest first, and a node
            fix = attempt(f"n_gpu: {n} (FSDP2 over {n * job.nnodes} GPUs)", n_gpu=n)
            if fix is not None:
                fixes.append(fix)
        if not fixes and job.n_gpu >= 1:
            for nodes in (c for c in _NODE_COUNTS if c > job.nnodes):
                fix = attempt(f"n_gpu: {_GPUS_PER_NODE}, nnodes: {nodes} (FSDP2 over "
                              f"{_GPUS_PER_NODE * nodes} GPUs)", n_gpu=_GPUS_PER_NODE,
                              nnodes=nodes)
                if fix is not None:
                    fixes.append(fix)
                    break
    if job.lora_rank == 0:
        fix = attempt(f"lora_rank: {_SUGGESTED_LORA_RANK} (LoRA)",
                      lora_rank=_SUGGESTED_LORA_RANK)
        if fix is None and job.on_gpu:
            for n in (c for c in _GPU_COUNTS if c > job.n_gpu):
                fix = attempt(f"lora_rank: {_SUGGESTED_LORA_RANK} with n_gpu: {n} (LoRA, "
                              "FSDP2)", lora_rank=_SUGGESTED_LORA_RANK, n_gpu=n)
                if fix is not None:
                    break
        if fix is not None:
            fixes.append(fix)
    if not job.checkpointing:
        fix = attempt("activation_checkpointing: true", activation_checkpointing=True)
        if fix is not None:
            fixes.append(fix)
    if job.on_gpu:  # the KV cache's budget: the smallest raise that holds the requests
        for share in _GPU_MEMORY_UTILIZATIONS:
            if share > job.gpu_memory_utilization:
                fix = attempt(f"gpu_memory_utilization: {share:g}",
                              gpu_memory_utilization=share)
                if fix is not None:
                    fixes.append(fix)
                    break
    budget = job.micro_batch_tokens // 2
    while budget >= _MIN_TOKEN_BUDGET:
        fix = attempt(f"micro_batch_tokens: {budget}", micro_batch_tokens=budget)
        if fix is not None:
            fixes.append(fix)
            break
        budget //= 2
    return fixes


def plan_job(job: Any, *, available: Available | None = None) -> MemoryPlan | None:
    """Plan an `AgentJetJob` (or any object with its fields): None when the model's
    `config.json` is not on this machine (the engine names that at boot)."""
    view = JobView.from_job(job)
    shape = model_shape(view.model)
    if shape is None:
        return None
    return plan_memory(view, shape, available or detect_available(view),
                       host=detect_host() if view.on_gpu else None)
