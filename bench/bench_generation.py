"""Rows: generation throughput and first-token latency, KV-cached against recomputed.

    python -m bench --only generation
    python -m bench.bench_generation --reps 5      # the figures alone, as JSON

The workload: 16 concurrent requests, 256-token prompts (random token ids,
each prompt its own), 64 new tokens each (no end-of-sequence token, so every request
runs to its length). Both generators run in one process on the same model, one after
the other, with one torch thread, as the engine runs on CPU (`cpu_threads`):

- `ContinuousBatchingGenerator` (`ajet/engine/generation/continuous_batching.py`): transformers'
  continuous batching with a paged KV cache, sized as the engine sizes it on CPU;
- `PagedGenerator` (`ajet/engine/generation/paged.py`): the engine's own paged pool and
  scheduler over the model's own forward (eager on CPU), the CPU default;
- `RecomputeGenerator` (`ajet/engine/generation/recompute.py`): the first engine's loop, which
  recomputes every prefix for every token.

Models: `ajet-tiny` (built locally) and a ~50M-parameter Qwen2-shaped model with random
weights built here (vocabulary 32,000, hidden 512, 12 layers, 8 heads, 4 key/value
heads). The recompute loop on the 50M model needs about 4 s per token of the batch, so
there it generates the first 8 of the 64 tokens only; its cost per token only grows with
the sequence, so its tokens/s is an upper bound and the ratio a lower bound.

Time to first token: one request with a 256-token prompt on an idle generator, until
its first token is sampled (`max_new_tokens=1`); each repetition a prompt of its own, so
no backend finds it in its prefix cache.

The generation runs in a child process (`python -m bench.bench_generation`), so that
torch's thread setting and the models stay out of the benchmark process.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from bench.context import BenchContext  # noqa: E402
from bench.report import Row  # noqa: E402

__all__ = ["GenerationFigures", "measure_generation", "run"]

RERUN = "python -m bench --only generation"
REQUESTS, PROMPT_TOKENS, NEW_TOKENS = 16, 256, 64
#: The recompute loop on the 50M model generates only this many tokens (see above).
RECOMPUTE_TOKENS_50M = 8
GOALS = {"ajet-tiny": 2.0, "qwen2-50m": 4.0}


@dataclass
class GenerationFigures:
    model: str
    parameters: int
    kv_tokens_per_s: list[float]
    recompute_tokens_per_s: list[float]
    recompute_new_tokens: int
    kv_first_token_s: list[float]
    recompute_first_token_s: list[float]
    kv_cache_tokens: int | None
    paged_tokens_per_s: list[float]
    paged_first_token_s: list[float]


class _NoText:
    """Tokenizer stand-in for the random 50M model: throughput needs no text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def _models(quick: bool) -> list[tuple[str, Any]]:
    """(name, Policy) for ajet-tiny and the ~50M model (a ~1M one in quick mode)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ajet.engine.policy import Policy, load_policy
    from ajet.engine.tiny import ensure_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="ajet-bench-gen-"))
    tiny = load_policy(ensure_tiny_model(tmp, seed=0), device="cpu", dtype="float32", seed=0)
    tiny = dataclasses.replace(tiny, eos_ids=frozenset({-1}))  # every request runs its length
    shape = (dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
             if quick else
             dict(vocab_size=32_000, hidden_size=512, intermediate_size=1408,
                  num_hidden_layers=12))
    config = Qwen2Config(num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    big = Policy(model=model, tokenizer=_NoText(), path=tmp, device=torch.device("cpu"),
                 eos_ids=frozenset({-1}), pad_id=0, max_positions=2048)
    return [("ajet-tiny", tiny), ("qwen2-50m", big)]


def _run_batch(generator: Any, prompts: list[list[int]], new_tokens: int
               ) -> tuple[int, float]:
    """Submit every prompt at once: (tokens generated, seconds until the last is done)."""
    from ajet.engine.generation.interface import GenerationRequest, GenerationResult

    done = threading.Semaphore(0)
    results: list[Any] = []

    def on_done(outcome: Any) -> None:
        results.append(outcome)
        done.release()

    start = time.perf_counter()
    for prompt in prompts:
        generator.submit(GenerationRequest(prompt_ids=prompt, max_new_tokens=new_tokens,
                                           on_done=on_done))
    for _ in prompts:
        done.acquire()
    elapsed = time.perf_counter() - start
    bad = [r for r in results if not isinstance(r, GenerationResult)]
    if bad:
        raise RuntimeError(f"generation failed: {bad[0]!r}")
    return sum(len(r.response_ids) for r in results), elapsed


def _tokens_per_s(generator: Any, prompts: list[list[int]], new_tokens: int) -> float:
    tokens, seconds = _run_batch(generator, prompts, new_tokens)
    return tokens / seconds


def _first_token_s(generator: Any, prompt: list[int]) -> float:
    """One request on an idle generator, until its first (only) token is sampled."""
    return _run_batch(generator, [prompt], 1)[1]


def measure_generation(*, reps: int, quick: bool) -> list[GenerationFigures]:
    import torch

    from ajet.engine.generation.continuous_batching import CacheSettings, ContinuousBatchingGenerator
    from ajet.engine.generation.interface import PolicyView
    from ajet.engine.generation.paged import PagedGenerator, PagedSettings
    from ajet.engine.generation.recompute import RecomputeGenerator

    torch.set_num_threads(1)
    requests, prompt_len, new_tokens = (4, 32, 8) if quick else (REQUESTS, PROMPT_TOKENS,
                                                                 NEW_TOKENS)
    figures = []
    for name, policy in _models(quick):
        gc.freeze()  # as the engine does after loading its model
        rng = random.Random(0)
        vocab = policy.model.config.vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
        firsts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(reps)]
        view = PolicyView.of(policy, temperature=1.0, top_p=1.0, seed=0)
        kv = ContinuousBatchingGenerator(view, CacheSettings(
            max_request_tokens=prompt_len + new_tokens, concurrency=requests,
            gpu_memory_utilization=0.85, cpu_kv_cache_mb=64, cpu_max_batch_tokens=256))
        paged = PagedGenerator(view, PagedSettings(
            max_request_tokens=prompt_len + new_tokens, concurrency=requests,
            gpu_memory_utilization=0.85, cpu_kv_cache_mb=64, cpu_prefill_tokens=256))
        big = name == "qwen2-50m" and not quick
        kv_reps = min(reps, 3) if big else reps  # about 20 s each on the 50M model
        measured = {}
        for label, generator in (("kv", kv), ("paged", paged)):
            generator.start()
            try:
                measured[label] = (
                    [_tokens_per_s(generator, prompts, new_tokens) for _ in range(kv_reps)],
                    [_first_token_s(generator, first) for first in firsts])
                if label == "kv":
                    cache_tokens = generator.stats()["kv_cache_tokens"]
            finally:
                generator.stop()
        old_tokens = RECOMPUTE_TOKENS_50M if big else new_tokens
        old_reps = 1 if big else max(1, min(reps, 3))
        old = RecomputeGenerator(policy, temperature=1.0, top_p=1.0, max_batch=64, seed=0)
        old.start()
        try:
            old_tps = [_tokens_per_s(old, prompts, old_tokens) for _ in range(old_reps)]
            old_ttft = [_first_token_s(old, first) for first in firsts[:old_reps]]
        finally:
            old.stop()
        figures.append(GenerationFigures(
            model=name, parameters=sum(p.numel() for p in policy.model.parameters()),
            kv_tokens_per_s=measured["kv"][0], recompute_tokens_per_s=old_tps,
            recompute_new_tokens=old_tokens, kv_first_token_s=measured["kv"][1],
            recompute_first_token_s=old_ttft, kv_cache_tokens=cache_tokens,
            paged_tokens_per_s=measured["paged"][0],
            paged_first_token_s=measured["paged"][1]))
    return figures


def run(ctx: BenchContext) -> list[Row]:
    import statistics

    cmd = [sys.executable, "-m", "bench.bench_generation", "--reps", str(ctx.reps)]
    if ctx.quick:
        cmd.append("--quick")
    out = subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, check=False,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"bench.bench_generation failed:\n{out.stderr[-2000:]}")
    rows: list[Row] = []
    workload = (f"{REQUESTS} concurrent x {PROMPT_TOKENS}-token prompts x {NEW_TOKENS} new "
                "tokens, 1 thread")
    for f in (GenerationFigures(**d) for d in json.loads(out.stdout)):
        goal = GOALS[f.model]
        kv, old = statistics.median(f.kv_tokens_per_s), statistics.median(f.recompute_tokens_per_s)
        size = f"{f.parameters / 1e6:.2f}M parameters"
        note = f"{size}; {workload}; KV cache {f.kv_cache_tokens} tokens"
        if f.recompute_new_tokens != NEW_TOKENS and not ctx.quick:
            note += f"; recompute over its first {f.recompute_new_tokens} tokens"
        rows.append(Row(
            f"generation {f.model}: tokens/s, KV cache + continuous batching", kv, "tokens/s",
            "recompute every prefix", old, target=f">= {goal:.0f}x the reference",
            met=kv >= goal * old, rerun=RERUN, repetitions=len(f.kv_tokens_per_s), note=note))
        paged = statistics.median(f.paged_tokens_per_s)
        rows.append(Row(
            f"generation {f.model}: tokens/s, paged backend (the CPU default)", paged,
            "tokens/s", "transformers' continuous batching", kv,
            target=">= 1x continuous batching (CPU default)", met=paged >= kv, rerun=RERUN,
            repetitions=len(f.paged_tokens_per_s), note=f"{size}; {workload}"))
        rows.append(Row(
            f"generation {f.model}: time to first token, paged backend", 1000 *
            statistics.median(f.paged_first_token_s), "ms", "transformers' continuous batching",
            1000 * statistics.median(f.kv_first_token_s), rerun=RERUN,
            repetitions=len(f.paged_first_token_s),
            note=f"one request, {PROMPT_TOKENS}-token prompt"))
        first, first_old = (statistics.median(f.kv_first_token_s),
                            statistics.median(f.recompute_first_token_s))
        rows.append(Row(
            f"generation {f.model}: time to first token, idle generator", first * 1000, "ms",
            "recompute every prefix", first_old * 1000, rerun=RERUN,
            repetitions=len(f.kv_first_token_s),
            note=f"one request, {PROMPT_TOKENS}-token prompt"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny counts (smoke test)")
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    figures = measure_generation(reps=args.reps, quick=args.quick)
    sys.stdout.write(json.dumps([dataclasses.asdict(f) for f in figures], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
