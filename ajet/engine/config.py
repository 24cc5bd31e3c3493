"""Config conversion: a validated `AgentJetJob` becomes the engine's `EngineConfig`.

The job (`ajet/copilot/job.py`) is what users write; `EngineConfig` is what the engine
runs with: the job's fields plus backend defaults that the job does not expose (device,
dtype, CPU threads, generation batch, episode slots, ...). Both live in the synced
snapshot, so a researcher who patches a default here changes the next run.

This module imports no torch: the caller passes what the machine has
(`cuda_devices`, `cpu_count`), which keeps conversion testable anywhere. Nor does it
import the job model (pydantic, yaml) until `runtime.load_engine_config` reads a YAML file:
`engine_config_from_job` reads the job's fields by name, so `bench/gpu_check.py` builds
an `EngineConfig` on a host with only torch, transformers and peft.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ajet.copilot.job import AgentJetJob

__all__ = [
    "BackendDefaults",
    "EngineConfig",
    "describe",
    "engine_config_from_job",
    "episodes_in_flight",
    "generation_backend",
]


@dataclass(frozen=True)
class BackendDefaults:
    """Engine knobs that are not job fields. Change them here; they are logged at boot."""

    #: Episode slots open at once per step, as a multiple of batch_size * num_repeat. A
    #: full batch never needs more; more slots only sample with a policy about to change.
    in_flight_factor: float = 1.0
    #: Most chat completions generated together (continuous batching).
    max_generation_batch: int = 64
    #: Generation backend where the job says `generation_backend: auto`: "paged" (our
    #: paged KV pool, generation/paged.py), "continuous_batching" (transformers' engine,
    #: >= 5.17) or "recompute" (no cache; the reference). On CPU the paged backend is
    #: token-exact against the reference and 1.5-2.5x transformers' throughput
    #: (bench_generation); on GPUs it stays opt-in until a GPU run has measured it
    #: (bench/gpu_generation.py). AJET_ENGINE_GENERATION overrides both.
    cpu_generation_backend: str = "paged"
    gpu_generation_backend: str = "continuous_batching"
    #: Paged backend: capture the decode step in CUDA graphs (GPU only), and its decode
    #: attention kernel ("auto": Triton on a GPU, else torch; "triton", "torch", "flex").
    cuda_graphs: bool = True
    paged_kernel: str = "auto"
    #: Paged backend on GPU: prompt tokens per prefill forward pass.
    gpu_prefill_tokens: int = 4096
    #: CPU KV cache: at most this much memory for the cache and its attention mask (GPU
    #: runs size it from the job's gpu_memory_utilization instead; ajet/engine/generation/kv_cache.py).
    cpu_kv_cache_mb: float = 64.0
    #: CPU: tokens per forward pass (prefill chunk); the mask grows with it.
    cpu_max_batch_tokens: int = 256
    #: Share KV blocks between requests with the same prompt prefix (never across updates).
    prefix_sharing: bool = True
    #: Response tokens per chunk of output-head logits when scoring (scoring.py): the
    #: update never holds more than this many positions' (vocabulary-wide) logits.
    logprob_chunk_tokens: int = 1024
    #: GRPO: added to the group's std before dividing (advantages.py).
    adv_eps: float = 1e-6
    #: Rewards are clipped to [-reward_clip, reward_clip]; None keeps them as sent.
    reward_clip: float | None = None
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.0
    #: How often idle claims are checked against their timeout.
    sweep_interval_s: float = 0.2
    #: A `/v1/*` body over `chat_bytes_per_prompt_token * max_prompt_length +
    #: chat_bytes_allowance` bytes is refused (413) before it is parsed or tokenised. One
    #: token of non-ASCII text can cost 8 bytes of JSON (a `\\uXXXX` escape and more), and
    #: the allowance covers the JSON around the text (message framing, tool schemas).
    chat_bytes_per_prompt_token: int = 8
    chat_bytes_allowance: int = 64 * 1024
    #: Torch intra-op threads on CPU (0 = one per core). The engine shares the machine
    #: with the swarm server and the rollout workers; tiny matrices gain nothing from more.
    cpu_threads: int = 1


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine run needs, flat and immutable."""

    # --- from the job
    experiment_name: str
    model: str
    seed: int
    batch_size: int
    num_repeat: int
    lr: float
    ppo_epochs: int
    clip_ratio: float
    kl_coef: float
    max_grad_norm: float
    max_prompt_length: int
    max_response_length: int
    max_new_tokens: int
    temperature: float
    top_p: float
    save_every: int
    async_save: bool
    max_steps: int
    episode_timeout_s: float
    gpu_memory_utilization: float
    n_gpu: int
    n_proc: int
    #: a tensor collective (NCCL; gloo on CPU) waiting longer than this fails the job
    collective_timeout_s: float
    lora_rank: int
    lora_alpha: int
    lora_target_modules: str | tuple[str, ...]
    lora_save_merged: bool
    micro_batch_tokens: int
    mini_batch_num: int
    #: the PPO ratio's old log-probs from the trainer's own first-epoch forward (learner.py)
    recompute_old_logprobs: bool
    #: when a step's batch is complete (ajet.engine.plane.episodes.COLLECTION_METHODS)
    sample_collection_method: str
    # --- derived / backend
    device: str
    #: compute dtype: what generation and the forward/backward passes run in
    dtype: str
    #: stored dtype of the trained weights and of the optimizer state (fp32 masters)
    master_dtype: str
    activation_checkpointing: bool
    cpu_threads: int
    max_in_flight: int
    max_generation_batch: int
    #: "paged", "continuous_batching" or "recompute" (the job's, or the device's default)
    generation_backend: str
    cuda_graphs: bool
    paged_kernel: str
    gpu_prefill_tokens: int
    cpu_kv_cache_mb: float
    cpu_max_batch_tokens: int
    prefix_sharing: bool
    logprob_chunk_tokens: int
    adv_eps: float
    reward_clip: float | None
    adam_betas: tuple[float, float]
    weight_decay: float
    sweep_interval_s: float
    #: byte bound of a chat body (BackendDefaults.chat_bytes_per_prompt_token)
    max_chat_bytes: int
    # --- timelines (ajet/engine/trajectory.py)
    #: merge an episode's calls that extend each other into one sample
    timeline_merging: bool = True
    #: "token" or "text": how the history between re-sent replies must match
    timeline_compare_level: str = "token"
    #: agent names (requests' `model`) to train; empty: all
    train_agents: tuple[str, ...] = ()

    @property
    def episodes_per_step(self) -> int:
        return self.batch_size * self.num_repeat

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def episodes_in_flight(job: Any, backend: BackendDefaults) -> int:
    """Episodes open at once (`EngineConfig.max_in_flight`; the memory planner sizes the
    KV cache from it too): the original's `max_env_worker` when given, else the batch."""
    return getattr(job, "max_env_worker", None) or max(
        1, round(job.batch_size * job.num_repeat * backend.in_flight_factor))


def engine_config_from_job(job: AgentJetJob, *, cuda_devices: int, cpu_count: int,
                           backend: BackendDefaults | None = None) -> EngineConfig:
    """Convert a job; raises `ValueError` naming the field when the machine cannot run it."""
    backend = backend or BackendDefaults()
    if job.n_gpu > 0 and cuda_devices == 0:
        raise ValueError(
            f"n_gpu={job.n_gpu} but no CUDA device is visible to the engine; "
            "set n_gpu: 0 to train on CPU"
        )
    if job.n_gpu > cuda_devices:
        raise ValueError(
            f"n_gpu={job.n_gpu} but only {cuda_devices} CUDA device(s) are visible; "
            f"set n_gpu to at most {cuda_devices}"
        )
    on_gpu = job.n_gpu > 0
    threads = backend.cpu_threads if backend.cpu_threads > 0 else cpu_count
    return EngineConfig(
        experiment_name=job.experiment_name,
        model=job.model,
        seed=job.seed,
        batch_size=job.batch_size,
        num_repeat=job.num_repeat,
        lr=job.lr,
        ppo_epochs=job.ppo_epochs,
        clip_ratio=job.clip_ratio,
        kl_coef=job.kl_coef if job.use_kl_loss else 0.0,
        max_grad_norm=job.max_grad_norm,
        max_prompt_length=job.max_prompt_length,
        max_response_length=job.max_response_length,
        max_new_tokens=job.max_new_tokens,
        temperature=job.temperature,
        top_p=job.top_p,
        save_every=job.save_every,
        async_save=on_gpu if job.async_save == "auto" else bool(job.async_save),
        max_steps=job.max_steps,
        episode_timeout_s=job.episode_timeout_s,
        gpu_memory_utilization=job.gpu_memory_utilization,
        n_gpu=job.n_gpu,
        n_proc=job.n_proc,
        collective_timeout_s=job.collective_timeout_min * 60.0,
        lora_rank=job.lora_rank,
        lora_alpha=job.lora_alpha,
        lora_target_modules=(job.lora_target_modules if isinstance(job.lora_target_modules, str)
                             else tuple(job.lora_target_modules)),
        lora_save_merged=job.lora_save_merged,
        micro_batch_tokens=job.micro_batch_tokens,
        mini_batch_num=job.mini_batch_num,
        # bf16 training is where the sampler's and the trainer's log-probs part most
        recompute_old_logprobs=(on_gpu if job.recompute_old_logprobs == "auto"
                                else bool(job.recompute_old_logprobs)),
        sample_collection_method=job.swarm_mode_sample_collection_method,
        device="cuda" if on_gpu else "cpu",
        # GPUs compute in bf16 over fp32 master weights and optimizer state (bf16 weights
        # lose small updates: at lr 1e-6 only ~2% of them change); CPUs are slow in bf16.
        dtype="bfloat16" if on_gpu else "float32",
        master_dtype="float32",
        # memory is what GPUs run out of; on CPU the recompute only costs time
        activation_checkpointing=(on_gpu if job.activation_checkpointing == "auto"
                                  else bool(job.activation_checkpointing)),
        cpu_threads=max(1, min(threads, cpu_count)),
        max_in_flight=episodes_in_flight(job, backend),
        max_generation_batch=backend.max_generation_batch,
        generation_backend=generation_backend(job, backend, on_gpu=on_gpu),
        cuda_graphs=backend.cuda_graphs,
        paged_kernel=backend.paged_kernel,
        gpu_prefill_tokens=backend.gpu_prefill_tokens,
        cpu_kv_cache_mb=backend.cpu_kv_cache_mb,
        cpu_max_batch_tokens=backend.cpu_max_batch_tokens,
        prefix_sharing=backend.prefix_sharing,
        logprob_chunk_tokens=backend.logprob_chunk_tokens,
        adv_eps=backend.adv_eps,
        reward_clip=backend.reward_clip,
        adam_betas=(backend.adam_beta1, backend.adam_beta2),
        weight_decay=backend.weight_decay,
        sweep_interval_s=backend.sweep_interval_s,
        max_chat_bytes=backend.chat_bytes_per_prompt_token * job.max_prompt_length
        + backend.chat_bytes_allowance,
        timeline_merging=job.timeline_merging,
        timeline_compare_level=job.timeline_compare_level,
        train_agents=tuple(job.train_agents),
    )


def generation_backend(job: Any, backend: BackendDefaults, *, on_gpu: bool) -> str:
    """The job's `generation_backend`, its `auto` being the device's default (a job object
    without the field, as `bench/gpu_check.py` builds, means `auto`)."""
    chosen = getattr(job, "generation_backend", "auto")
    if chosen != "auto":
        return str(chosen)
    return backend.gpu_generation_backend if on_gpu else backend.cpu_generation_backend


def describe(cfg: EngineConfig) -> dict[str, Any]:
    """The whole config as a dict, for the boot log line."""
    return dataclasses.asdict(cfg)
