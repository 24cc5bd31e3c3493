"""`python3 bench/gpu_check.py` (`make gpu-check`): the engine's GPU paths, on real GPUs.

    python3 bench/gpu_check.py                     # on a GPU host: the check, < 5 min
    python3 bench/gpu_check.py --ranks 2           # N ranks under torchrun (NCCL), N GPUs
    python3 bench/gpu_check.py --device cpu --dtype float32 --shape small \\
        --steps 2 --requests 8 --new-tokens 8      # the CPU smoke run the tests use

Runs on a bare GPU host from a checkout: Python 3.12 with only torch (2.11 or newer),
transformers (5.17 or newer) and peft installed, no network, no install step and no
swarm server. The engine modules it exercises (training: `learner`, `training_model`,
`distributed`, `scoring`, `loss`, `checkpoints`; generation: `runtime.build_generator`,
`continuous_batching`, `kv_cache`, `inference`; `memory_plan`, `peak_memory`, `tiny`)
import without pydantic, httpx or yaml (`ajet/__init__.py` and `ajet.engine.config`
import those lazily; `tests/bench/test_gpu_check.py` runs this script with them blocked).

First it compares the GPUs `nvidia-smi -L` lists with those torch can use: fewer in
torch (a driver too old for the wheel, a CPU build of torch) fails the check instead of
passing it on the CPU. Then, with the engine's own classes, on a Qwen2-0.5B-shaped
checkpoint built locally (random weights, bf16, ajet-tiny's tokenizer: nothing is
downloaded), two phases of rollout -> update -> rollout:

1. one process, no process group: the single-GPU path (an fp32 training copy under bf16
   autocast, its weights published to a bf16 inference copy) with LoRA (rank 16) and a
   KL term whose reference is the model with its adapters off; the adapter checkpoint is
   saved, one more update moves the weights on, and loading the checkpoint back must
   publish the very same weights as at the save;
2. a one-rank process group (NCCL): the multi-GPU configuration, FSDP2 (`fully_shard`)
   with fp32 masters and AdamW state, bf16 compute (`MixedPrecisionPolicy`), activation
   checkpointing, chunked log-probs, micro-batches by token budget, a frozen KL
   reference, the bucketed bf16 publication, a full checkpoint saved and loaded back the
   same way; the decode tokens/s, the step time, the peak memory
   (`torch.cuda.max_memory_allocated`) and the memory planner's estimate are printed.

Each rollout submits `--requests` (64) generation requests at once to the engine's
generator (transformers' continuous batching over the paged KV cache that
`generation/kv_cache.py` sizes from `gpu_memory_utilization`), paused around each update
as in the engine.

`--ranks N` runs `bench/gpu_check_ranks.py` under torchrun (`--max_restarts=0`), one rank
per GPU: FSDP2 over the N ranks, every rank generating, rank 0 sending its commands as
the engine does; it fails when a rank's requests stall while that rank waits for rank
0's next command, or when the ranks do not finish in time. It needs N GPUs (NCCL refuses
two ranks on one GPU): with fewer it says so and skips.

It fails loudly (exit status 1, "GPU CHECK FAILED" and the traceback) on a NaN or
infinite loss, gradient norm, log-prob or weight, on a bf16 or NCCL error, or when the
precision or backend is not what it claims. On a machine without a GPU it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # a checkout, not an install
    sys.path.insert(0, str(PROJECT_ROOT))

#: Qwen2-0.5B's architecture (Qwen/Qwen2-0.5B config.json); `small` for the CPU smoke run
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32_768, rope_theta=1_000_000.0,
                       tie_word_embeddings=True),
    "small": dict(vocab_size=1000, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, tie_word_embeddings=True),
}
#: torch and transformers the check is written against (older ones are reported)
MIN_TORCH, MIN_TRANSFORMERS = (2, 11), (5, 17)
#: the torchrun worker of `--ranks N`
RANKS_SCRIPT = Path(__file__).with_name("gpu_check_ranks.py")
#: LoRA rank of the one-process phase (the engine's usual order of magnitude)
LORA_RANK = 16
#: KL coefficient of both phases: large enough that the reference is really computed
KL_COEF = 0.05


class GPUCheckFailed(RuntimeError):
    """Something the check verifies did not hold; the message says what."""


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def require_finite(name: str, *values: float) -> None:
    """Raise `GPUCheckFailed` naming `name` when a value is NaN or infinite."""
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise GPUCheckFailed(f"{name} is not finite: {bad[0]!r}")


def _version(text: str) -> tuple[int, int]:
    parts = (text.split("+")[0].split(".") + ["0", "0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


# ---------------------------------------------------------------------------- GPUs seen


def listed_gpus(smi_output: str) -> int:
    """How many GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H100 ... (UUID: ...)")."""
    return sum(1 for line in smi_output.splitlines() if line.startswith("GPU "))


def expected_visible(listed: int, cuda_visible_devices: str | None) -> int:
    """The GPUs torch should see: those listed, narrowed by CUDA_VISIBLE_DEVICES
    (CUDA stops reading the list at the first invalid entry, such as -1)."""
    if cuda_visible_devices is None:
        return listed
    entries = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return min(listed, len(entries))


def gpu_visibility_problem(listed: int | None, cuda_visible_devices: str | None,
                           torch_count: int, *, torch_version: str = "",
                           torch_cuda: str | None = None) -> str | None:
    """Why torch sees fewer GPUs than `nvidia-smi` lists, or None when it sees them all.

    `listed` is None when `nvidia-smi` is absent or failed (nothing to compare with).
    """
    if listed is None:
        return None
    expected = expected_visible(listed, cuda_visible_devices)
    if torch_count >= expected:
        return None
    narrowed = (f" ({expected} with CUDA_VISIBLE_DEVICES={cuda_visible_devices!r})"
                if expected != listed else "")
    build = f"CUDA {torch_cuda}" if torch_cuda else "a CPU-only build"
    return (f"nvidia-smi lists {listed} GPU(s){narrowed} but torch {torch_version} ({build}) "
            f"can use {torch_count}: the driver is probably older than this torch wheel "
            "needs, or torch is a CPU build; install a torch wheel built for the CUDA "
            "version nvidia-smi's header shows (or update the driver), then run again")


def nvidia_smi_gpus() -> int | None:
    """GPUs `nvidia-smi -L` lists; None without a working nvidia-smi."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return listed_gpus(done.stdout) if done.returncode == 0 else None


def ranks_unavailable(ranks: int, gpus: int) -> str | None:
    """Why `--ranks N` cannot run on a host with `gpus` GPUs (it then skips), or None."""
    if ranks <= gpus:
        return None
    return (f"gpu_check --ranks {ranks}: this host has {gpus} GPU(s), and NCCL refuses two "
            f"ranks on one GPU: the {ranks}-rank check is skipped, nothing was run (on CPU, "
            "the control-path test in tests/ajet/engine/test_distributed.py stands in for it)")


# ---------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 bench/gpu_check.py",
                                description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--shape", choices=tuple(SHAPES), default=None,
                   help="model shape (default: qwen2-0.5b on cuda, small on cpu)")
    p.add_argument("--ranks", type=int, default=0,
                   help="run N ranks under torchrun (NCCL on cuda, gloo on cpu) with "
                        "rollout -> update -> rollout cycles; needs N GPUs on cuda")
    p.add_argument("--cycles", type=int, default=2,
                   help="--ranks: rollout -> update cycles (one more rollout ends them)")
    p.add_argument("--ranks-timeout", type=float, default=420.0,
                   help="--ranks: seconds for the whole torchrun, start to end")
    p.add_argument("--grace", type=float, default=10.0,
                   help="--ranks: seconds another rank's requests may take beyond rank "
                        "0's own before they count as stalled")
    p.add_argument("--steps", type=int, default=3, help="training updates per phase")
    p.add_argument("--groups", type=int, default=4, help="task groups per update")
    p.add_argument("--group-size", type=int, default=4, help="samples per task group")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--requests", type=int, default=64,
                   help="concurrent generation requests (per rank with --ranks)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the checkpoint is built (default: a temporary folder)")
    # internal: the torchrun workers load the checkpoint the launcher built
    p.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.shape = args.shape or ("qwen2-0.5b" if args.device == "cuda" else "small")
    if args.ranks < 0 or args.ranks == 1:
        p.error("--ranks takes 2 or more (the default mode already runs one rank)")
    return args


def job_for(args: argparse.Namespace, model_dir: Path, *, lora_rank: int = 0,
            kl_coef: float = 0.0, world_size: int = 1) -> SimpleNamespace:
    """The job the check runs, as the fields `engine_config_from_job` and the memory
    planner read (a plain namespace: the job model itself needs pydantic)."""
    on_gpu = args.device == "cuda"
    return SimpleNamespace(
        experiment_name="gpu-check", model=str(model_dir), seed=0,
        batch_size=args.groups, num_repeat=args.group_size, lr=1e-5, ppo_epochs=1,
        clip_ratio=0.2, kl_coef=kl_coef, max_grad_norm=1.0,
        max_prompt_length=args.prompt_tokens,
        max_response_length=max(args.response_tokens, args.new_tokens),
        max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, save_every=0,
        max_steps=0, episode_timeout_s=600.0, n_gpu=world_size if on_gpu else 0,
        n_proc=1 if on_gpu else world_size, nnodes=1,
        # a hang in a tensor collective fails the check in minutes, not the job's 30
        collective_timeout_min=5.0,
        lora_rank=lora_rank, lora_alpha=2 * max(lora_rank, 1),
        lora_target_modules="all-linear", lora_save_merged=False,
        activation_checkpointing=True, micro_batch_tokens=args.micro_batch_tokens,
        mini_batch_num=1, gpu_memory_gb=80.0, gpu_memory_utilization=0.85,
        fsdp=world_size > 1 or None, recompute_old_logprobs="auto", async_save="auto",
        timeline_merging=True, timeline_compare_level="token", train_agents=[],
        # the original AgentJet's names, at their defaults
        # the episodes open at once: the KV cache is sized for every request together
        use_kl_loss=True, max_env_worker=args.requests,
        swarm_mode_sample_collection_method="rollout_until_finish_enough_tasks")


def engine_config(args: argparse.Namespace, job: SimpleNamespace) -> Any:
    import torch

    from ajet.engine.config import engine_config_from_job

    cfg = engine_config_from_job(job, cuda_devices=torch.cuda.device_count(),
                                 cpu_count=os.cpu_count() or 1)
    return dataclasses.replace(cfg, dtype=args.dtype, activation_checkpointing=True)


# ---------------------------------------------------------------------------- model, data


def build_checkpoint(target: Path, shape: str, *, device: str) -> float:
    """Write a random-weight Qwen2 checkpoint with ajet-tiny's tokenizer; seconds taken."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ajet.engine.tiny import ensure_tiny_model

    started = time.perf_counter()
    tiny = ensure_tiny_model(target.parent / "tiny-work", seed=0)
    config = Qwen2Config(**SHAPES[shape], pad_token_id=0, eos_token_id=2, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds instead of a minute
        model = Qwen2ForCausalLM(config)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as checkpoints ship
    model.to(dtype).save_pretrained(target, is_main_process=True)
    for name in os.listdir(tiny):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(tiny / name, target / name)
    del model
    return time.perf_counter() - started


def random_samples(job: SimpleNamespace, vocab: int, step: int) -> list[Any]:
    """A GRPO-shaped batch of full-length random samples (advantages +-1 per group)."""
    import torch

    from ajet.engine.learner import TrainSample

    gen = torch.Generator().manual_seed(step)
    out = []
    for i in range(job.batch_size * job.num_repeat):
        prompt = torch.randint(3, vocab, (job.max_prompt_length,), generator=gen).tolist()
        response = torch.randint(3, vocab, (job.max_response_length,), generator=gen).tolist()
        # old log-probs near the policy's (uniform over a random model's vocabulary)
        old = (-math.log(vocab),) * len(response)
        out.append(TrainSample(tuple(prompt), tuple(response), old,
                               1.0 if i % 2 == 0 else -1.0, group=i // job.num_repeat))
    return out


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def generate_all(generator: Any, prompts: list[list[int]], max_new: int, *,
                 timeout_s: float) -> list[Any]:
    """Submit every prompt at once to a started `Generator`; wait for all; the
    `GenerationResult`s (raises `GPUCheckFailed` on a timeout or a failed request).
    `bench/memory_plan_probe.py` generates its rollout with it too."""
    from ajet.engine.generation.interface import GenerationRequest, GenerationResult

    done = threading.Semaphore(0)
    results: list[GenerationResult | BaseException] = []

    def finished(result: GenerationResult | BaseException) -> None:
        results.append(result)
        done.release()

    for prompt in prompts:
        generator.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new,
                                           on_done=finished))
    for _ in prompts:
        if not done.acquire(timeout=timeout_s):
            raise GPUCheckFailed(f"generation did not finish within {timeout_s:.0f} s")
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise GPUCheckFailed(f"generation failed: {errors[0]!r}") from errors[0]
    return results


@contextlib.contextmanager
def engine_generator(policy: Any, cfg: Any) -> Iterator[Any]:
    """The engine's own generator, started: the KV-cached backend the config names (the
    device's default: continuous batching on a GPU, the paged backend on a CPU), sized by
    generation/kv_cache.py from the job (gpu_memory_utilization on the GPU)."""
    from ajet.engine.runtime import build_generator

    service = build_generator(cfg, policy)
    expected = {"continuous_batching": "ContinuousBatchingGenerator",
                "paged": "PagedGenerator"}.get(cfg.generation_backend)
    if type(service).__name__ != expected:
        raise GPUCheckFailed(f"the engine generates with {type(service).__name__}, not the "
                             f"KV-cached {cfg.generation_backend} backend its config names "
                             "(AJET_ENGINE_GENERATION?)")
    service.start()
    try:
        yield service
    finally:
        service.stop()


def rollout(generator: Any, prompts: list[list[int]], max_new: int, label: str
            ) -> tuple[int, float]:
    """One rollout of every prompt at once: (tokens generated, seconds); prints a line."""
    started = time.perf_counter()
    results = generate_all(generator, prompts, max_new, timeout_s=240)
    seconds = time.perf_counter() - started
    require_finite(f"{label}: a generated token's log-prob",
                   *(lp for r in results for lp in r.logprobs))
    tokens = sum(len(r.response_ids) for r in results)
    say(f"  {label}: {len(prompts)} concurrent requests x {max_new} new tokens "
        f"({len(prompts[0])}-token prompts): {tokens} tokens in {seconds:.2f} s, decode "
        f"{tokens / seconds:.1f} tokens/s")
    return tokens, seconds


def train_steps(learner: Any, generator: Any, job: SimpleNamespace, vocab: int, steps: int,
                *, on_gpu: bool) -> list[float]:
    """`steps` updates inside the generator's pause, as the engine runs them; seconds each."""
    import torch

    times = []
    for step in range(1, steps + 1):
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with generator.paused():
            stats = learner.update(random_samples(job, vocab, step))
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        require_finite(f"step {step} loss", stats.loss)
        require_finite(f"step {step} gradient norm", stats.grad_norm)
        require_finite(f"step {step} entropy", stats.entropy)
        require_finite(f"step {step} KL", stats.kl)
        say(f"  step {step}: {times[-1]:.2f} s, loss {stats.loss:.4f}, gradient norm "
            f"{stats.grad_norm:.3f}, entropy {stats.entropy:.3f}, KL {stats.kl:.2e}, "
            f"publication {stats.publish_time_s * 1000:.0f} ms / "
            f"{stats.publish_bytes / 2**20:.1f} MiB")
    return times


def check_finite_weights(model: Any) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not bool(torch.isfinite(param).all()):
                raise GPUCheckFailed(f"published weight {name} holds NaN or inf")


def published(model: Any) -> dict[str, Any]:
    """The inference copy's weights, on the host (what a checkpoint must restore)."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters()}


def checkpoint_round_trip(learner: Any, job: SimpleNamespace, vocab: int, target: Path
                          ) -> None:
    """Save `learner` to `target`, train one more step, load the checkpoint back: the
    learner must publish exactly the weights it had when it saved (the same learner, so
    no second model is loaded: the check stays within its few minutes)."""
    import torch

    from ajet.engine.checkpoints import load_training_state, save_checkpoint

    t0 = time.perf_counter()
    saved = save_checkpoint(learner, target, step=1, run_id="gpu-check")
    before = published(learner.policy.model)
    files = sorted(p.name for p in saved.iterdir())
    want = {"adapter_model.safetensors"} if learner.model.lora else {"model.safetensors"}
    if not want <= set(files) or "training_state" not in files:
        raise GPUCheckFailed(f"checkpoint {saved} holds {files}, expected {sorted(want)} "
                             "and training_state/")
    t1 = time.perf_counter()
    learner.update(random_samples(job, vocab, 99))  # the weights move on
    moved = published(learner.policy.model)
    if all(torch.equal(before[n], moved[n]) for n in before):
        raise GPUCheckFailed("an update after the checkpoint changed no weight")
    t2 = time.perf_counter()
    load_training_state(learner, saved)
    after = published(learner.policy.model)
    differ = [n for n in before if not torch.equal(before[n], after[n])]
    if differ:
        raise GPUCheckFailed(f"a loaded checkpoint publishes other weights: {differ[:3]}")
    say(f"  checkpoint: saved in {t1 - t0:.1f} s ({', '.join(files)}); after one more "
        f"update, loaded back in {time.perf_counter() - t2:.1f} s: the {len(after)} "
        "published weights of the save, exactly")


def free(on_gpu: bool) -> None:
    import torch

    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------- phases


def one_process_phase(args: argparse.Namespace, model_dir: Path, workdir: Path, vocab: int,
                      device: str) -> None:
    """No process group: the single-GPU path, with LoRA and a KL term (adapters off)."""
    import torch

    from ajet.engine.learner import Learner
    from ajet.engine.parallel.distributed import Dist
    from ajet.engine.policy import load_policy

    on_gpu = args.device == "cuda"
    job = job_for(args, model_dir, lora_rank=LORA_RANK, kl_coef=KL_COEF)
    cfg = engine_config(args, job)
    dist = Dist()
    policy = load_policy(model_dir, device=device, dtype=cfg.dtype, seed=0)
    learner = Learner(policy, cfg, dist)
    master = learner.model.params[0]
    shared = learner.model.hf_model is policy.model
    # LoRA keeps one base, the generation model's, and trains fp32 adapters on it
    if on_gpu and (master.dtype != torch.float32 or not shared):
        raise GPUCheckFailed(f"LoRA on one GPU trains {master.dtype} adapters "
                             f"{'on the generation model' if shared else 'on a second copy'}; "
                             "expected fp32 adapters on the one shared base")
    if not learner.model.lora or ".lora_" not in _first_trainable(learner):
        raise GPUCheckFailed("LoRA is not what trains")
    how = (f"fp32 adapters on the {cfg.dtype} generation model itself (one base)" if shared
           else f"an fp32 copy under {cfg.dtype} autocast, published to a {cfg.dtype} "
                "inference copy")
    say(f"phase 1, one process: {how}; LoRA rank {LORA_RANK} "
        f"({sum(p.numel() for p in learner.model.params) / 1e6:.2f}M trainable), KL "
        f"{KL_COEF} to the adapters-off model, {min(args.steps, 2)} update(s)")
    prompts = random_prompts(vocab, args.requests, min(128, args.prompt_tokens), seed=1)
    with engine_generator(policy, cfg) as generator:
        rollout(generator, prompts, args.new_tokens, "rollout before the updates")
        train_steps(learner, generator, job, vocab, min(args.steps, 2), on_gpu=on_gpu)
        rollout(generator, prompts, args.new_tokens, "rollout on the new weights")
    check_finite_weights(policy.model)
    checkpoint_round_trip(learner, job, vocab, workdir / "lora-checkpoint")


def fsdp_phase(args: argparse.Namespace, model_dir: Path, workdir: Path, vocab: int,
               device_name: str) -> None:
    """A one-rank group: FSDP2, the bucketed publication, the planner against the peak."""
    import torch
    from torch.distributed.tensor import DTensor

    from ajet.engine.learner import Learner
    from ajet.engine.parallel.distributed import init_distributed
    from ajet.engine.planning.memory_plan import Available, GiB, JobView, model_shape, plan_memory
    from ajet.engine.planning.peak_memory import PeakMemory
    from ajet.engine.policy import load_policy

    on_gpu = args.device == "cuda"
    job = job_for(args, model_dir, kl_coef=KL_COEF)
    job.fsdp = True
    cfg = engine_config(args, job)
    dist = init_distributed(on_gpu=on_gpu, single_rank_group=True,
                            collective_timeout_s=job.collective_timeout_min * 60)
    try:
        backend = torch.distributed.get_backend()
        if backend != ("nccl" if on_gpu else "gloo"):
            raise GPUCheckFailed(f"process group backend is {backend}")
        if torch.distributed.get_backend(dist.control) != "gloo":
            raise GPUCheckFailed("the control group is not on the CPU (gloo)")
        device = f"cuda:{dist.local_rank}" if on_gpu else "cpu"
        policy = load_policy(model_dir, device=device, dtype=cfg.dtype, seed=0)
        memory = PeakMemory(policy.device)
        memory.mark_loaded(policy.model)
        shape = model_shape(str(model_dir))
        assert shape is not None
        if on_gpu:
            total = torch.cuda.get_device_properties(policy.device).total_memory
            available = Available(int(total), f"torch.cuda: {device_name}")
        else:
            from ajet.engine.planning.memory_plan import detect_available

            available = detect_available(JobView.from_job(job))
        plan = plan_memory(JobView.from_job(job), shape, available)

        learner = Learner(policy, cfg, dist)
        master = learner.model.params[0]
        if not isinstance(master, DTensor) or master.dtype != torch.float32:
            raise GPUCheckFailed(f"trained weights are {type(master).__name__} "
                                 f"{master.dtype}, expected FSDP2 DTensor shards in float32")
        if policy.model.dtype != getattr(torch, cfg.dtype):
            raise GPUCheckFailed(f"inference copy is {policy.model.dtype}, expected {cfg.dtype}")
        if learner.model.reference is None:
            raise GPUCheckFailed("kl_coef > 0 but the learner has no frozen reference")
        tokens = job.batch_size * job.num_repeat * (job.max_prompt_length
                                                    + job.max_response_length)
        say(f"phase 2, FSDP2 over a 1-rank {backend} group (control on gloo): "
            f"{cfg.master_dtype} masters + {cfg.dtype} compute, activation checkpointing on, "
            f"a frozen KL reference ({KL_COEF}), {args.steps} update(s) of "
            f"{job.batch_size * job.num_repeat} samples ({tokens} tokens), micro-batches of "
            f"{cfg.micro_batch_tokens} tokens")
        prompts = random_prompts(vocab, args.requests, min(128, args.prompt_tokens), seed=2)
        with engine_generator(policy, cfg) as generator:
            rollout(generator, prompts, args.new_tokens, "rollout before the updates")
            times = train_steps(learner, generator, job, vocab, args.steps, on_gpu=on_gpu)
            _, decode_s = rollout(generator, prompts, args.new_tokens,
                                  "rollout on the new weights")
            stats = generator.stats()
            say(f"  KV cache: {stats.get('kv_cache_tokens') or 'the rest of '}"
                f"{'' if stats.get('kv_cache_tokens') else 'gpu_memory_utilization'} tokens, "
                f"{stats.get('cache_rebuilds')} build(s)")
        check_finite_weights(policy.model)
        steady = times[1:] or times
        which = "step 1" if len(times) == 1 else \
            ("step 2" if len(times) == 2 else f"steps 2-{len(times)}")
        say(f"step time: {statistics.median(steady):.2f} s ({which}; step 1 includes warm-up)")
        measured = memory.peak_bytes()
        estimate = plan.comparable_bytes()
        what = "torch.cuda.max_memory_allocated" if on_gpu else \
            "RSS high-water mark above the loaded model"
        reserved = (f", {torch.cuda.max_memory_reserved(policy.device) / GiB:.2f} GiB reserved"
                    if on_gpu else "")
        say(f"peak memory: {measured / GiB:.3f} GiB ({what}){reserved}")
        say(f"planner: {estimate / GiB:.3f} GiB for the same quantity (estimate / measured "
            f"{estimate / max(measured, 1):.2f}); {plan.summary()}")
        checkpoint_round_trip(learner, job, vocab, workdir / "fsdp-checkpoint")
    finally:
        dist.close()


def _first_trainable(learner: Any) -> str:
    return next(n for n, p in learner.model.lm.named_parameters() if p.requires_grad)


# ---------------------------------------------------------------------------- --ranks N


def run_ranks(args: argparse.Namespace, workdir: Path, model_dir: Path) -> int:
    """Launch `gpu_check_ranks.py` on `args.ranks` ranks; its exit status is the check's."""
    forward = ["--device", args.device, "--dtype", args.dtype, "--shape", args.shape,
               "--cycles", str(args.cycles), "--grace", str(args.grace),
               "--groups", str(args.groups),
               "--group-size", str(args.group_size),
               "--prompt-tokens", str(args.prompt_tokens),
               "--response-tokens", str(args.response_tokens),
               "--micro-batch-tokens", str(args.micro_batch_tokens),
               "--requests", str(args.requests), "--new-tokens", str(args.new_tokens),
               "--workdir", str(workdir), "--model-dir", str(model_dir)]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
           "--standalone", "--max_restarts=0", str(RANKS_SCRIPT), *forward]
    say(f"ranks: {args.ranks} under torchrun ({'NCCL' if args.device == 'cuda' else 'gloo'} "
        f"for tensors, gloo for control), {args.cycles} rollout -> update cycle(s)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.ranks_timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise GPUCheckFailed(f"the {args.ranks} ranks did not finish within "
                             f"{args.ranks_timeout:.0f} s (--ranks-timeout): a rank stalled "
                             "or hung in a collective") from None
    if code != 0:
        raise GPUCheckFailed(f"torchrun exited with code {code}: a rank failed (its "
                             "traceback is above, prefixed with its rank)")
    return 0


# ---------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    on_gpu = args.device == "cuda"
    if on_gpu:
        problem = gpu_visibility_problem(
            nvidia_smi_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"),
            torch.cuda.device_count(), torch_version=torch.__version__,
            torch_cuda=torch.version.cuda)
        if problem is not None:
            raise GPUCheckFailed(problem)
        if not torch.cuda.is_available():
            say("gpu_check: no CUDA GPU is visible here (torch.cuda.is_available() is "
                "False); this check needs one: nothing was run. On CPU: --device cpu "
                "--dtype float32.")
            return 0
        skipped = ranks_unavailable(args.ranks, torch.cuda.device_count())
        if skipped is not None:
            say(skipped)
            return 0
    started = time.perf_counter()
    try:
        import peft
        peft_version = peft.__version__
    except ImportError:
        peft_version = "not installed (only LoRA needs it)"
    device_name = torch.cuda.get_device_name(0) if on_gpu else platform.processor() or "CPU"
    say(f"gpu_check: {device_name}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, peft {peft_version}, Python {platform.python_version()}")
    if _version(torch.__version__) < MIN_TORCH or \
            _version(transformers.__version__) < MIN_TRANSFORMERS:
        say(f"gpu_check: warning: written for torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} and "
            f"transformers >= {MIN_TRANSFORMERS[0]}.{MIN_TRANSFORMERS[1]}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    from ajet.engine.planning.memory_plan import model_shape

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ajet-gpu-check-"))
    model_dir = workdir / f"{args.shape}-random"
    try:
        seconds = build_checkpoint(model_dir, args.shape, device=args.device)
        shape = model_shape(str(model_dir))
        assert shape is not None
        say(f"model: {args.shape} shape, {shape.parameters / 1e6:.2f}M parameters, random "
            f"weights (built in {seconds:.1f} s at {model_dir})")
        if args.ranks:
            run_ranks(args, workdir, model_dir)
        else:
            free(on_gpu)  # the build's own allocations are not the engine's peak
            one_process_phase(args, model_dir, workdir, shape.vocab_size,
                              device="cuda:0" if on_gpu else "cpu")
            free(on_gpu)
            fsdp_phase(args, model_dir, workdir, shape.vocab_size, device_name)
        say(f"gpu_check: OK in {time.perf_counter() - started:.0f} s")
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except Exception as exc:  # noqa: BLE001 (every failure is reported the same loud way)
        traceback.print_exc()
        say(f"GPU CHECK FAILED: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip torch's teardown (NCCL's can hang after a failure)
