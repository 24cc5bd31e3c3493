"""One torchrun worker of `python3 bench/gpu_check.py --ranks N`: every rank generates.

    python -m torch.distributed.run --nproc_per_node=N --standalone --max_restarts=0 \\
        bench/gpu_check_ranks.py --model-dir DIR --workdir DIR [gpu_check's options]

Started by `gpu_check.py --ranks N`, which built the checkpoint. Each rank joins the
engine's process groups (`init_distributed`: NCCL for tensors on GPUs, gloo for every
control message), loads the policy, builds the FSDP2 learner over the N ranks and starts
its own generator, as the engine does. Rank 0 then leads `--cycles` rounds of

    rollout   every rank generates `--requests` requests at once; a follower's main
              thread goes straight back to waiting for rank 0's next command, so its
              generation runs while it waits, as an engine follower's does during a
              rollout (its episodes come from rank 0's router there)
    report    rank 0, its own requests done and `--grace` seconds later, asks every rank
              how many of its requests had finished: a rank short of its count stalled
              behind the wait, and the check fails naming it
    update    rank 0 broadcasts a batch built from its rollout; every rank trains its
              share inside its generator's pause (FSDP2's collectives, the publication)

and a last rollout on the new weights, then "stop". Any exception on any rank fails the
check: torchrun (`--max_restarts=0`) stops the other ranks and exits non-zero.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import (  # noqa: E402  (after the checkout is on sys.path)
    GPUCheckFailed,
    engine_config,
    engine_generator,
    job_for,
    parse_args,
    random_prompts,
    require_finite,
    say,
)


class RankRollout:
    """This rank's requests of one rollout, submitted at once, counted as they end."""

    def __init__(self, generator: Any, prompts: list[list[int]], max_new: int) -> None:
        from ajet.engine.generation.interface import GenerationRequest

        self.submitted = len(prompts)
        self.results: list[Any] = []
        self.errors: list[str] = []
        self.started = time.perf_counter()
        self.finished_at: float | None = None
        self._lock = threading.Lock()
        self._all = threading.Event()
        for prompt in prompts:
            generator.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=max_new,
                                               on_done=self._done))

    def _done(self, outcome: Any) -> None:
        with self._lock:
            if isinstance(outcome, BaseException):
                self.errors.append(repr(outcome))
            else:
                self.results.append(outcome)
            if len(self.results) + len(self.errors) == self.submitted:
                self.finished_at = time.perf_counter()
                self._all.set()

    def wait(self, timeout_s: float) -> bool:
        return self._all.wait(timeout_s)

    def report(self) -> dict[str, Any]:
        with self._lock:
            seconds = (self.finished_at or time.perf_counter()) - self.started
            return {"done": len(self.results), "failed": len(self.errors),
                    "submitted": self.submitted, "seconds": seconds,
                    "tokens": sum(len(r.response_ids) for r in self.results),
                    "error": self.errors[0] if self.errors else None}


def stalled_ranks(rows: list[dict[str, Any]]) -> list[str]:
    """'rank r (k of n done[, failed: ...])' for each rank whose requests did not all
    finish by the report (`RankRollout.report`, in rank order)."""
    return [f"rank {rank} ({r['done']} of {r['submitted']} done"
            + (f", failed: {r['error']}" if r["error"] else "") + ")"
            for rank, r in enumerate(rows) if r["done"] < r["submitted"]]


def main(argv: list[str] | None = None) -> int:
    import torch

    from ajet.engine.learner import Learner
    from ajet.engine.parallel.distributed import init_distributed
    from ajet.engine.planning.memory_plan import model_shape
    from ajet.engine.policy import load_policy

    args = parse_args(argv)
    on_gpu = args.device == "cuda"
    world = int(os.environ["WORLD_SIZE"])
    job = job_for(args, args.model_dir, kl_coef=0.0, world_size=world)
    cfg = engine_config(args, job)
    dist = init_distributed(on_gpu=on_gpu, collective_timeout_s=job.collective_timeout_min * 60)
    if torch.distributed.get_backend(dist.control) != "gloo":
        raise GPUCheckFailed(f"rank {dist.rank}: the control group is not gloo")
    device = f"cuda:{dist.local_rank}" if on_gpu else "cpu"
    policy = load_policy(args.model_dir, device=device, dtype=cfg.dtype, seed=dist.rank)
    learner = Learner(policy, cfg, dist)
    shape = model_shape(str(args.model_dir))
    assert shape is not None
    prompt_tokens = min(128, args.prompt_tokens)
    with engine_generator(policy, cfg) as generator:
        if dist.is_main:
            lead(dist, learner, generator, args, shape.vocab_size, prompt_tokens)
        else:
            follow(dist, learner, generator, args, shape.vocab_size, prompt_tokens)
    return 0


def lead(dist: Any, learner: Any, generator: Any, args: Any, vocab: int,
         prompt_tokens: int) -> None:
    """Rank 0: rollout, report, update, ..., a last rollout, stop."""
    from ajet.engine.learner import TrainSample

    say(f"  {dist.world_size} ranks joined; FSDP2 over all of them, each generating "
        f"{args.requests} requests per rollout")
    for cycle in range(args.cycles + 1):
        label = f"rollout {cycle + 1}" + (" (after the last update)"
                                          if cycle == args.cycles else "")
        dist.broadcast(("rollout", cycle))
        mine = RankRollout(generator, random_prompts(vocab, args.requests, prompt_tokens,
                                                     seed=100 * cycle), args.new_tokens)
        if not mine.wait(240.0):
            raise GPUCheckFailed(f"{label}: rank 0's own requests did not finish in 240 s")
        own = time.perf_counter() - mine.started
        # on the same GPU model the same requests take about as long on every rank
        time.sleep(min(args.grace + own, 120.0))
        dist.broadcast(("report", cycle))
        rows = dist.gather(mine.report())  # each rank's count when the command came
        say(f"  {label}: " + ", ".join(
            f"rank {rank} {r['done']}/{r['submitted']} in {r['seconds']:.1f} s"
            for rank, r in enumerate(rows)))
        stalled = stalled_ranks(rows)
        if stalled:
            raise GPUCheckFailed(
                f"{label}: requests stalled on {', '.join(stalled)} while waiting for rank "
                f"0's next command, {args.grace:.0f} s after rank 0's own were done "
                f"(--grace)")
        if cycle == args.cycles:
            break
        # the update: a GRPO batch from rank 0's rollout, whole groups of --group-size
        samples = [TrainSample(tuple(r.prompt_ids), tuple(r.response_ids), tuple(r.logprobs),
                               1.0 if i % 2 == 0 else -1.0, group=i // args.group_size)
                   for i, r in enumerate(mine.results[:args.groups * args.group_size])]
        t0 = time.perf_counter()
        batch = dist.broadcast(("train", samples))[1]
        with generator.paused():
            stats = learner.update(batch)
        require_finite(f"update {cycle + 1} loss", stats.loss)
        require_finite(f"update {cycle + 1} gradient norm", stats.grad_norm)
        say(f"  update {cycle + 1}: {time.perf_counter() - t0:.2f} s over {dist.world_size} "
            f"ranks, loss {stats.loss:.4f}, gradient norm {stats.grad_norm:.3f}, "
            f"publication {stats.publish_time_s * 1000:.0f} ms / "
            f"{stats.publish_bytes / 2**20:.1f} MiB")
    dist.broadcast(("stop", None))


def follow(dist: Any, learner: Any, generator: Any, args: Any, vocab: int,
           prompt_tokens: int) -> None:
    """Ranks > 0: run rank 0's commands; between them, wait in the control broadcast."""
    current: RankRollout | None = None
    while True:
        command, payload = dist.broadcast(None)
        if command == "stop":
            return
        if command == "rollout":
            # submit, and straight back to the wait: the generation runs meanwhile
            current = RankRollout(generator, random_prompts(
                vocab, args.requests, prompt_tokens, seed=100 * payload + dist.rank),
                args.new_tokens)
            continue
        if command == "report":
            # counted now: what finished while this rank waited for the command
            assert current is not None
            dist.gather(current.report())
            continue
        if command == "train":
            with generator.paused():
                learner.update(payload)


if __name__ == "__main__":
    try:
        code = main()
    except Exception as exc:  # noqa: BLE001 - logged loud with the rank; torchrun stops the rest
        import traceback

        rank = os.environ.get("RANK", "?")
        sys.stderr.write(f"[rank {rank}] " + "".join(
            traceback.format_exception(type(exc), exc, exc.__traceback__)))
        say(f"GPU CHECK FAILED on rank {rank}: {type(exc).__name__}: {exc}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no process-group teardown: a failed peer could leave it waiting
