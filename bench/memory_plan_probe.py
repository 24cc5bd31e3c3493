"""The measurements behind `bench/bench_memory_plan.py`, each model in a fresh process.

    python bench/memory_plan_probe.py {tiny,50m} {training,generation} <workdir> <out.json>
    python bench/memory_plan_probe.py tiny,50m training,generation <workdir> <out.json> --quick

Loads the model as the engine does (`load_policy`), marks the resident set after the
imports and the load (`PeakMemory.mark_loaded`, as the engine's `peak_memory_mb`), and
runs one phase of a step through the engine's own classes, each in a fresh process
(the resident set's high-water mark never goes down, and freed heap stays resident):

- training: `Learner.update` on a batch of the job's shape (`batch_size` x `num_repeat`
  samples of `max_prompt_length` + `max_response_length` tokens), twice, because the
  second update is the steady state (AdamW's moments exist during its passes);
- generation: the episodes of one step (`max_in_flight` requests of
  `max_prompt_length` tokens, up to `max_response_length` new tokens each) submitted at
  once to the engine's generator (`runtime.build_generator`: the continuous-batching
  backend with the paged KV cache `generation/kv_cache.py` sizes), as a run's first rollout (no
  optimizer state yet).

The peak (`PeakMemory.peak_bytes()`) is written to out.json with the memory planner's
estimate of the same quantity (`MemoryPlan.comparable_bytes`). `tiny` is
ajet-tiny with the default job; `50m` the ~55M-parameter Qwen2 shape of
`bench/train_memory_probe.py`. `--quick` shrinks the batches, and the smoke test runs
all four in one process to save start-ups (so only the first peak means anything).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # run as a script: import ajet and bench from here
    sys.path.insert(0, str(PROJECT_ROOT))

import torch  # noqa: E402

from ajet.copilot.job import AgentJetJob  # noqa: E402
from ajet.engine.config import engine_config_from_job  # noqa: E402
from ajet.engine.learner import Learner, TrainSample  # noqa: E402
from ajet.engine.planning.memory_plan import (  # noqa: E402
    JobView,
    MemoryPlan,
    detect_available,
    model_shape,
    plan_memory,
)
from ajet.engine.planning.peak_memory import PeakMemory  # noqa: E402
from ajet.engine.policy import load_policy  # noqa: E402
from ajet.engine.runtime import build_generator  # noqa: E402
from ajet.engine.tiny import ensure_tiny_model  # noqa: E402
from bench.gpu_check import generate_all  # noqa: E402

#: the jobs measured: ajet-tiny's default batch with the short episodes the examples run
#: (the planner plans for the longest ones the job allows, so the samples are that long);
#: the 50M model with two micro-batches a step
JOBS: dict[tuple[str, bool], dict[str, Any]] = {
    ("tiny", False): {"max_prompt_length": 256, "max_response_length": 32},
    ("tiny", True): {"batch_size": 2, "num_repeat": 2, "max_prompt_length": 24,
                     "max_response_length": 8, "max_new_tokens": 8},
    ("50m", False): {"batch_size": 2, "num_repeat": 4, "max_prompt_length": 200,
                     "max_response_length": 56, "max_new_tokens": 16,
                     "micro_batch_tokens": 1024},
    ("50m", True): {"batch_size": 1, "num_repeat": 2, "max_prompt_length": 24,
                    "max_response_length": 8, "max_new_tokens": 8},
}


def _reset_high_water_mark() -> None:
    # "5" resets VmHWM to the current resident set (Linux, proc(5))
    Path("/proc/self/clear_refs").write_text("5")


def _samples(job: AgentJetJob, vocab: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(job.batch_size * job.num_repeat):
        prompt = torch.randint(3, vocab, (job.max_prompt_length,), generator=gen).tolist()
        response = torch.randint(3, vocab, (job.max_response_length,), generator=gen).tolist()
        out.append(TrainSample(tuple(prompt), tuple(response), (-1.0,) * len(response),
                               1.0 - 2 * (i % 2), group=i // job.num_repeat))
    return out


def _setup(which: str, workdir: Path, *, quick: bool
           ) -> tuple[Path, AgentJetJob, Any, MemoryPlan]:
    if which == "tiny":
        model_dir = ensure_tiny_model(workdir, seed=0)
    else:
        from bench.train_memory_probe import build

        model_dir = workdir / "model-50m"
        if not (model_dir / "config.json").is_file():
            build(model_dir, quick=quick)
    job = AgentJetJob(model=str(model_dir) if which != "tiny" else "ajet-tiny", lr=1e-4,
                      **JOBS[(which, quick)])
    cfg = engine_config_from_job(job, cuda_devices=0, cpu_count=1)
    view = JobView.from_job(job)
    shape = model_shape(view.model)
    assert shape is not None
    return model_dir, job, cfg, plan_memory(view, shape, detect_available(view))


def measure(which: str, phase: str, workdir: Path, *, quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    model_dir, job, cfg, plan = _setup(which, workdir, quick=quick)
    policy = load_policy(model_dir, device="cpu", dtype="float32", seed=0)
    memory = PeakMemory(policy.device)
    memory.mark_loaded(policy.model)
    vocab = plan.shape.vocab_size
    started = time.perf_counter()
    result: dict[str, Any] = {"model": which, "phase": phase, "setup": plan.setup(),
                              "parameters": plan.shape.parameters,
                              "terms_mb": {t.name: t.bytes / 2**20 for t in plan.terms}}
    if phase == "training":
        learner = Learner(policy, cfg)
        samples = _samples(job, vocab)
        for _ in range(2):
            learner.update(samples)
        result["planned_bytes"] = max(plan.comparable_bytes(p)
                                      for p in ("forward", "backward", "optimizer step"))
    else:
        inference = build_generator(cfg, policy)
        inference.start()
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, vocab, (job.max_prompt_length,), generator=gen).tolist()
                   for _ in range(cfg.max_in_flight)]
        try:
            # each request as long as the job allows (the planner's worst case)
            done = generate_all(inference, prompts, job.max_response_length, timeout_s=600)
            result["tokens"] = sum(len(r.response_ids) for r in done)
        finally:
            inference.stop()
        result["requests"] = len(prompts)
        # the first rollout of a run: no optimizer state exists yet
        result["planned_bytes"] = plan.comparable_bytes("generation", first_rollout=True)
    result["measured_bytes"] = memory.peak_bytes()
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str]) -> None:
    quick = "--quick" in argv
    models, phases, workdir, out = (a for a in argv if a != "--quick")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # several in one process only for the smoke test: then only the first peak is clean
    results = [measure(which, phase, Path(workdir), quick=quick)
               for which in models.split(",") for phase in phases.split(",")]
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's teardown, as the engine does
