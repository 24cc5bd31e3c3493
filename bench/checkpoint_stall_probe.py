"""The measurement behind `bench/bench_checkpoints.py`: how long a checkpoint holds up
the step loop, written synchronously and in the background.

    python bench/checkpoint_stall_probe.py <model dir> <out dir> <repetitions>

One process on the CPU, the engine's `Learner` for a full fine-tuning job on the model
(fp32), fixed samples. Each repetition, for each mode in turn: an update (timed alone),
`checkpoints.begin_checkpoint` (the stall: what the step loop waits for), the next
update (timed: with `async_save` the files are written meanwhile), then the wait for
the rest of the save. Writes `stall.json` into the out dir: the list of timings per mode
and the checkpoint's size.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

JOB = dict(lr=1e-5, batch_size=2, num_repeat=2, max_prompt_length=48,
           max_response_length=16, max_new_tokens=16, micro_batch_tokens=1024)


def main(model: str, out: str, repetitions: int) -> None:
    from ajet.copilot.job import AgentJetJob
    from ajet.engine.checkpoints import begin_checkpoint
    from ajet.engine.config import engine_config_from_job
    from ajet.engine.learner import Learner, TrainSample
    from ajet.engine.policy import load_policy

    # one thread trains; the other core is the writer's, as the host CPUs beside a GPU
    torch.set_num_threads(1)
    job = AgentJetJob(model=model, n_gpu=0, **JOB)
    cfg = engine_config_from_job(job, cuda_devices=0, cpu_count=1)
    learner = Learner(load_policy(Path(model), device="cpu", dtype="float32", seed=0), cfg)
    gen = torch.Generator().manual_seed(0)
    vocab = learner.policy.model.config.vocab_size
    samples = [TrainSample(tuple(torch.randint(3, vocab, (job.max_prompt_length,),
                                               generator=gen).tolist()),
                           tuple(torch.randint(3, vocab, (job.max_response_length,),
                                               generator=gen).tolist()),
                           (-1.0,) * job.max_response_length, 1.0 - 2 * (i % 2),
                           group=i // job.num_repeat)
               for i in range(job.batch_size * job.num_repeat)]
    learner.update(samples)  # warm-up: AdamW's state exists from here on
    root = Path(out)
    results: dict[str, Any] = {"sync": [], "async": [], "bytes": 0}
    for rep in range(repetitions):
        for mode in ("sync", "async"):
            start = time.perf_counter()
            learner.update(samples)
            alone = time.perf_counter() - start
            target = root / f"{mode}-{rep}" / "step_1"
            start = time.perf_counter()
            pending = begin_checkpoint(learner, target, step=1, run_id="bench",
                                       background=mode == "async")
            stall = time.perf_counter() - start
            start = time.perf_counter()
            learner.update(samples)
            during = time.perf_counter() - start
            start = time.perf_counter()
            pending.wait()
            rest = time.perf_counter() - start
            results["bytes"] = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
            results[mode].append({"stall_s": stall, "update_alone_s": alone,
                                  "update_during_s": during, "wait_after_s": rest})
            shutil.rmtree(target.parent)
    (root / "stall.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
