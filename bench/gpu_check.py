"""`python3 bench/gpu_check.py` (`make gpu-check`): the engine's GPU paths on one GPU.

    python3 bench/gpu_check.py                     # on a GPU host: the check, < 5 min
    python3 bench/gpu_check.py --device cpu --dtype float32 --shape small \\
        --steps 2 --requests 8 --new-tokens 8      # the CPU smoke run the tests use

Runs on a bare GPU host from a checkout: Python 3.12 with only torch (2.11 or newer),
transformers (5.17 or newer) and peft installed, no network, no install step and no
swarm server. The engine modules it exercises (training: `learner`, `training_model`,
`distributed`, `scoring`, `loss`; generation: `runtime.build_generator`,
`continuous_batching`, `kv_cache`, `inference`; `memory_plan`, `peak_memory`, `tiny`)
import without pydantic, httpx or yaml (`ajet/__init__.py` and `ajet.engine.config`
import those lazily; `tests/bench/test_gpu_check.py` runs this script with them blocked).

What it does, with the engine's own classes:

1. builds a Qwen2-0.5B-shaped checkpoint locally (random weights, bf16, ajet-tiny's
   tokenizer: nothing is downloaded) and loads it as the engine does;
2. joins a one-rank process group (NCCL on the GPU) and trains `--steps` updates of
   GRPO-shaped random batches with the GPU configuration of a multi-GPU job: FSDP2
   (`fully_shard`) over that rank, fp32 master weights and AdamW state with bf16 compute
   (`MixedPrecisionPolicy`), activation checkpointing, chunked log-probs, micro-batches
   by token budget, and the weights published to a bf16 inference copy after each step;
3. submits `--requests` (64) generation requests at once to the engine's generator
   (`runtime.build_generator`: transformers' continuous batching over the paged KV cache
   that `generation/kv_cache.py` sizes from `gpu_memory_utilization`, for all the requests at once);
4. prints the decode tokens/s, the step time, the peak memory
   (`torch.cuda.max_memory_allocated`) and the memory planner's estimate for the same run.

It fails loudly (exit status 1, "GPU CHECK FAILED" and the traceback) on a NaN or
infinite loss, gradient norm, log-prob or weight, on a bf16 or NCCL error, or when the
precision or backend is not what it claims. On a machine without a GPU it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 bench/gpu_check.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--shape", choices=tuple(SHAPES), default=None,
                   help="model shape (default: qwen2-0.5b on cuda, small on cpu)")
    p.add_argument("--steps", type=int, default=3, help="training updates")
    p.add_argument("--groups", type=int, default=4, help="task groups per update")
    p.add_argument("--group-size", type=int, default=4, help="samples per task group")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--requests", type=int, default=64, help="concurrent generation requests")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the checkpoint is built (default: a temporary folder)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.shape = args.shape or ("qwen2-0.5b" if args.device == "cuda" else "small")
    return args


def _job(args: argparse.Namespace, model_dir: Path) -> SimpleNamespace:
    """The job the check runs, as the fields `engine_config_from_job` and the memory
    planner read (a plain namespace: the job model itself needs pydantic)."""
    on_gpu = args.device == "cuda"
    return SimpleNamespace(
        experiment_name="gpu-check", model=str(model_dir), seed=0,
        batch_size=args.groups, num_repeat=args.group_size, lr=1e-5, ppo_epochs=1,
        clip_ratio=0.2, kl_coef=0.0, max_grad_norm=1.0,
        max_prompt_length=args.prompt_tokens,
        max_response_length=max(args.response_tokens, args.new_tokens),
        max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0, save_every=0,
        max_steps=0, episode_timeout_s=600.0, n_gpu=1 if on_gpu else 0, n_proc=1, nnodes=1,
        lora_rank=0, lora_alpha=16, lora_target_modules="all-linear", lora_save_merged=False,
        activation_checkpointing=True, micro_batch_tokens=args.micro_batch_tokens,
        mini_batch_num=1, gpu_memory_gb=80.0, gpu_memory_utilization=0.85, fsdp=True,
        # the original AgentJet's names, at their defaults
        # the episodes open at once: the KV cache is sized for every request together
        use_kl_loss=True, max_env_worker=args.requests,
        swarm_mode_sample_collection_method="rollout_until_finish_enough_tasks")


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


def _samples(job: SimpleNamespace, vocab: int, step: int) -> list[Any]:
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


def _generate(policy: Any, cfg: Any, prompts: list[list[int]], max_new: int
              ) -> tuple[int, float, list[float]]:
    """All prompts submitted at once to the engine's generator: (tokens, seconds, logprobs)."""
    from ajet.engine.runtime import build_generator

    # the engine's own generator: continuous batching over the paged KV cache, sized by
    # generation/kv_cache.py from the job (gpu_memory_utilization on the GPU) for all the requests
    service = build_generator(cfg, policy)
    if type(service).__name__ != "ContinuousBatchingGenerator":
        raise GPUCheckFailed(f"the engine generates with {type(service).__name__}, not the "
                             "KV-cached continuous batching backend (AJET_ENGINE_GENERATION?)")
    service.start()
    started = time.perf_counter()
    try:
        results = generate_all(service, prompts, max_new, timeout_s=240)
        seconds = time.perf_counter() - started
        stats = service.stats()
        say(f"  KV cache: {stats.get('kv_cache_tokens') or 'the rest of gpu_memory_utilization'}"
            f" tokens, {stats.get('cache_rebuilds')} build(s)")
    finally:
        service.stop()
    logprobs = [lp for r in results for lp in r.logprobs]
    return sum(len(r.response_ids) for r in results), seconds, logprobs


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        say("gpu_check: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
            "this check needs one: nothing was run. On CPU: --device cpu --dtype float32.")
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

    from torch.distributed.tensor import DTensor

    from ajet.engine.config import engine_config_from_job
    from ajet.engine.parallel.distributed import init_distributed
    from ajet.engine.learner import Learner
    from ajet.engine.planning.memory_plan import Available, GiB, JobView, model_shape, plan_memory
    from ajet.engine.planning.peak_memory import PeakMemory
    from ajet.engine.policy import load_policy

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ajet-gpu-check-"))
    model_dir = workdir / f"{args.shape}-random"
    dist = None
    try:
        seconds = build_checkpoint(model_dir, args.shape, device=args.device)
        job = _job(args, model_dir)
        cfg = engine_config_from_job(job, cuda_devices=torch.cuda.device_count(),
                                     cpu_count=os.cpu_count() or 1)
        cfg = dataclasses.replace(cfg, dtype=args.dtype, activation_checkpointing=True)
        shape = model_shape(str(model_dir))
        assert shape is not None
        say(f"model: {args.shape} shape, {shape.parameters / 1e6:.2f}M parameters, random "
            f"weights (built in {seconds:.1f} s at {model_dir})")

        if on_gpu:  # the build's own allocations are not the engine's peak
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        dist = init_distributed(on_gpu=on_gpu, single_rank_group=True)
        backend = torch.distributed.get_backend()
        if backend != ("nccl" if on_gpu else "gloo"):
            raise GPUCheckFailed(f"process group backend is {backend}")
        device = f"cuda:{dist.local_rank}" if on_gpu else "cpu"
        policy = load_policy(model_dir, device=device, dtype=cfg.dtype, seed=0)
        memory = PeakMemory(policy.device)
        memory.mark_loaded(policy.model)
        if on_gpu:
            total = torch.cuda.get_device_properties(policy.device).total_memory
            available = Available(int(total), f"torch.cuda: {device_name}")
        else:
            from ajet.engine.planning.memory_plan import detect_available

            available = detect_available(JobView.from_job(job))
        plan = plan_memory(JobView.from_job(job), shape, available)

        # --- training: FSDP2 over a one-rank group, fp32 masters, bf16 compute
        learner = Learner(policy, cfg, dist)
        master = learner.model.params[0]
        if not isinstance(master, DTensor) or master.dtype != torch.float32:
            raise GPUCheckFailed(f"trained weights are {type(master).__name__} "
                                 f"{master.dtype}, expected FSDP2 DTensor shards in float32")
        if policy.model.dtype != getattr(torch, cfg.dtype):
            raise GPUCheckFailed(f"inference copy is {policy.model.dtype}, expected {cfg.dtype}")
        tokens = job.batch_size * job.num_repeat * (job.max_prompt_length
                                                    + job.max_response_length)
        say(f"training: FSDP2 over a 1-rank {backend} group, {cfg.master_dtype} masters + "
            f"{cfg.dtype} compute, activation checkpointing on, {args.steps} update(s) of "
            f"{job.batch_size * job.num_repeat} samples ({tokens} tokens), micro-batches of "
            f"{cfg.micro_batch_tokens} tokens")
        times = []
        for step in range(1, args.steps + 1):
            if on_gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats = learner.update(_samples(job, shape.vocab_size, step))
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            require_finite(f"step {step} loss", stats.loss)
            require_finite(f"step {step} gradient norm", stats.grad_norm)
            require_finite(f"step {step} entropy", stats.entropy)
            say(f"  step {step}: {times[-1]:.2f} s, loss {stats.loss:.4f}, gradient norm "
                f"{stats.grad_norm:.3f}, entropy {stats.entropy:.3f}")
        with torch.no_grad():
            for name, param in policy.model.named_parameters():
                if not bool(torch.isfinite(param).all()):
                    raise GPUCheckFailed(f"published weight {name} holds NaN or inf")
        steady = times[1:] or times
        which = "step 1" if len(times) == 1 else \
            ("step 2" if len(times) == 2 else f"steps 2-{len(times)}")
        say(f"step time: {statistics.median(steady):.2f} s ({which}; step 1 includes warm-up)")

        # --- generation: all requests at once
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, shape.vocab_size, (min(128, job.max_prompt_length),),
                                 generator=gen).tolist() for _ in range(args.requests)]
        generated, gen_s, logprobs = _generate(policy, cfg, prompts, args.new_tokens)
        require_finite("a generated token's log-prob", *logprobs)
        say(f"generation: {args.requests} concurrent requests x {args.new_tokens} new tokens "
            f"({len(prompts[0])}-token prompts): {generated} tokens in {gen_s:.2f} s, decode "
            f"{generated / gen_s:.1f} tokens/s")

        # --- memory: measured against the planner
        measured = memory.peak_bytes()
        estimate = plan.comparable_bytes()
        what = "torch.cuda.max_memory_allocated" if on_gpu else \
            "RSS high-water mark above the loaded model"
        reserved = (f", {torch.cuda.max_memory_reserved(policy.device) / GiB:.2f} GiB reserved"
                    if on_gpu else "")
        say(f"peak memory: {measured / GiB:.3f} GiB ({what}){reserved}")
        say(f"planner: {estimate / GiB:.3f} GiB for the same quantity (estimate / measured "
            f"{estimate / max(measured, 1):.2f}); {plan.summary()}")
        say(f"gpu_check: OK in {time.perf_counter() - started:.0f} s")
        return 0
    finally:
        if dist is not None:
            dist.close()
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
