"""`python3 bench/gpu_generation.py`: the paged generation backend on a GPU, measured.

    python3 bench/gpu_generation.py --out DIR [--budget-s 300]        # on a GPU host
    python3 bench/gpu_generation.py --device cpu --shape small --vocab 512 --out DIR

Runs from a checkout with only torch, transformers (and triton, as torch ships it) on a
bare GPU host, no network: the models are Qwen2.5-shaped with random weights, built on
the device (`bench/gpu_model.py`'s geometry; nothing is downloaded). Each item has its
own time limit and writes its figures to `<out>/gpu_generation.json` as soon as it ends,
so a budget cut short still leaves everything measured so far; an item that fails
records its error and the next one runs. Items, in order:

1. `versions`: torch, transformers, triton, CUDA device, FlexAttention and the Triton
   kernel's availability;
2. `cb_cuda_graph`: the zero-code A/B of today's backend (transformers' continuous
   batching) with and without its own `use_cuda_graph`, decode tokens/s at 1 and 64;
3. `kernel`: the split-KV paged decode kernel against the torch gather (B 1/16/64/256 x
   context 512/2k/8k; ms and GB/s: `bench/gpu_decode_kernel.py`);
4. `capture`: graph capture time and graph pool bytes for every bucket;
5. `step`: one decode step eager against its graph replay (B = 1, 16, 64);
6. `greedy`: greedy tokens identical between the eager and the graphed generator;
7. `logprob_gap`: the sampler-trainer log-prob gap (bf16), today's backend and the new
   one, against the trainer's scoring; today's figure from the engine was 0.0074;
8. `weights`: after weights change in place the next replies carry the new weights'
   log-probs (not the old ones'), with no capture; a parameter that moved triggers one
   capture again;
9. `e2e`: old vs new backend behind `Generator`: 64 concurrent requests, 256-token
   prompts, 128 new tokens: time to first token, aggregate tokens/s, peak memory
   against the pool's plan; the same for one request;
10. `profile`: a torch.profiler view of today's backend at B = 64 (the top kernels and
    host functions, kernel launches per decode step);
11. `e2e_7b`: item 9 on the 7B geometry, if the budget leaves time.

Exit status 0 when every item that ran passed its checks, 1 otherwise; the JSON says
which. On a host without a GPU (and no `--device cpu`) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # run from a checkout
    sys.path.insert(0, str(PROJECT_ROOT))

import torch  # noqa: E402

from bench.gpu_model import QWEN25_VOCAB_SIZE, SHAPES  # noqa: E402

log = logging.getLogger("bench.gpu_generation")

#: Qwen2.5-7B's geometry, for the last item (not in gpu_model: no checkpoint is built).
SHAPE_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4, intermediate_size=18944,
                max_position_embeddings=32768, tie_word_embeddings=False)
PROMPT_TOKENS, NEW_TOKENS, CONCURRENT = 256, 128, 64
#: the engine's sampler-trainer gap on the 0.5B shape with today's backend (2026-12-04)
TODAYS_GAP = 0.0074


class Report:
    """The items' figures, written to disk after each item."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: dict[str, dict[str, Any]] = {}
        self.failed: list[str] = []

    def record(self, name: str, figures: dict[str, Any]) -> None:
        self.items[name] = figures
        self.path.write_text(json.dumps({"items": self.items, "failed": self.failed},
                                        indent=1, default=str))
        log.info("%s: %s", name, json.dumps(figures, default=str)[:2000])

    def run(self, name: str, limit_s: float, deadline: float,
            fn: Callable[[float], dict[str, Any]]) -> None:
        """Run one item with `min(limit_s, what is left)` seconds; errors are recorded."""
        left = deadline - time.monotonic()
        if left < 5:
            self.record(name, {"skipped": f"{left:.0f} s of the budget left"})
            return
        began = time.monotonic()
        try:
            figures = fn(time.monotonic() + min(limit_s, left))
        except Exception as exc:  # noqa: BLE001 - one item's failure never stops the others
            self.failed.append(name)
            figures = {"error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-3000:]}
        figures["seconds"] = round(time.monotonic() - began, 1)
        if figures.get("ok") is False and name not in self.failed:
            self.failed.append(name)
        self.record(name, figures)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- the model


class _Ids:
    """A tokenizer stand-in: the figures need token ids, not text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def build_model(shape: str, device: str, dtype: torch.dtype, *,
                vocab: int = QWEN25_VOCAB_SIZE) -> torch.nn.Module:
    """A random-weight Qwen2.5-shaped model, initialised on the device."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    geometry = SHAPE_7B if shape == "qwen2.5-7b" else SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab, **geometry)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model.eval()


def generator(model: torch.nn.Module, backend: str, *, concurrency: int = CONCURRENT,
              cuda_graphs: bool = True, temperature: float = 1.0, seed: int = 0,
              use_cuda_graph: bool | None = None) -> Any:
    """A started generator of `backend` on `model`, sized for the workload."""
    from ajet.engine.generation.continuous_batching import (
        CacheSettings,
        ContinuousBatchingGenerator,
    )
    from ajet.engine.generation.interface import PolicyView
    from ajet.engine.generation.paged import PagedGenerator, PagedSettings

    view = PolicyView(model_source=lambda: model, decode=_Ids().decode, eos_ids=frozenset({-1}),
                      max_positions=int(model.config.max_position_embeddings),
                      temperature=temperature, top_p=1.0, seed=seed)
    tokens = PROMPT_TOKENS + NEW_TOKENS
    if backend == "paged":
        gen: Any = PagedGenerator(view, PagedSettings(
            max_request_tokens=tokens, concurrency=concurrency, gpu_memory_utilization=0.85,
            cpu_kv_cache_mb=64, cpu_prefill_tokens=256, cuda_graphs=cuda_graphs))
    else:
        gen = ContinuousBatchingGenerator(view, CacheSettings(
            max_request_tokens=tokens, concurrency=concurrency, gpu_memory_utilization=0.85,
            cpu_kv_cache_mb=64, cpu_max_batch_tokens=256, use_cuda_graph=use_cuda_graph))
    gen.start()
    return gen


@contextlib.contextmanager
def started(model: torch.nn.Module, backend: str, **kwargs: Any) -> Iterator[Any]:
    gen = generator(model, backend, **kwargs)
    try:
        yield gen
    finally:
        gen.stop()


def prompts(count: int, vocab: int, *, seed: int = 0, length: int = PROMPT_TOKENS
            ) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=rng).tolist()


def run_requests(gen: Any, batch: list[list[int]], new_tokens: int, deadline: float,
                 **fields: Any) -> dict[str, Any]:
    """Submit `batch` at once, streamed: results, first-token times, tokens/s."""
    from ajet.engine.generation.interface import GenerationRequest, GenerationResult

    done = threading.Semaphore(0)
    results: list[Any] = [None] * len(batch)
    first: list[float | None] = [None] * len(batch)
    start = time.perf_counter()

    def callbacks(i: int) -> tuple[Callable[[str], None], Callable[[Any], None]]:
        def on_delta(_text: str) -> None:
            if first[i] is None:
                first[i] = time.perf_counter() - start

        def on_done(outcome: Any) -> None:
            results[i] = outcome
            done.release()

        return on_delta, on_done

    for i, ids in enumerate(batch):
        on_delta, on_done = callbacks(i)
        gen.submit(GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens,
                                     on_done=on_done, on_delta=on_delta, **fields))
    for _ in batch:
        if not done.acquire(timeout=max(1.0, deadline - time.monotonic())):
            raise TimeoutError("the requests did not finish within the item's limit")
    elapsed = time.perf_counter() - start
    bad = [r for r in results if not isinstance(r, GenerationResult)]
    if bad:
        raise RuntimeError(f"generation failed: {bad[0]!r}")
    tokens = sum(len(r.response_ids) for r in results)
    ttft = [t for t in first if t is not None]
    return {"results": results, "seconds": elapsed, "tokens": tokens,
            "tokens_per_s": tokens / elapsed,
            "ttft_median_s": statistics.median(ttft) if ttft else None}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- items


def item_versions(_deadline: float) -> dict[str, Any]:
    import transformers

    figures: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                               "transformers": transformers.__version__,
                               "cuda": torch.version.cuda,
                               "device": torch.cuda.get_device_name(0)
                               if torch.cuda.is_available() else "cpu"}
    try:
        import triton

        figures["triton"] = triton.__version__
        import ajet.engine.generation.triton_decode  # noqa: F401

        figures["triton_kernel"] = "importable"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        figures["triton"] = figures.get("triton") or f"absent ({exc})"
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        figures["flex_attention"] = "importable"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        figures["flex_attention"] = f"absent ({exc})"
    return figures


def item_cb_cuda_graph(model: torch.nn.Module, deadline: float) -> dict[str, Any]:
    vocab = model.config.vocab_size
    figures: dict[str, Any] = {}
    for graphs in (False, True):
        with started(model, "continuous_batching", use_cuda_graph=graphs) as gen:
            one = run_requests(gen, prompts(1, vocab, seed=1), 64, deadline)
            many = run_requests(gen, prompts(CONCURRENT, vocab, seed=2), 64, deadline)
        figures[f"use_cuda_graph={graphs}"] = {
            "tok_s_1": round(one["tokens_per_s"], 1),
            "tok_s_64": round(many["tokens_per_s"], 1),
            "ttft_64_s": many["ttft_median_s"]}
    return figures


def item_kernel(model: torch.nn.Module, deadline: float) -> dict[str, Any]:
    from bench import gpu_decode_kernel

    config = model.config
    rows = gpu_decode_kernel.run(
        str(next(model.parameters()).device), heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads, page_size=32,
        budget_s=max(5.0, deadline - time.monotonic() - 2))
    return {"cases": rows}


def item_capture(model: torch.nn.Module, _deadline: float) -> dict[str, Any]:
    _sync()
    began = time.monotonic()
    with started(model, "paged") as gen:
        stats = gen.stats()
    return {"start_s": round(time.monotonic() - began, 2), "captures": stats["captures"],
            "capture_s": stats["capture_s"], "graphs": stats["graphs"],
            "graph_pool_mib": round(stats["graph_pool_bytes"] / 2**20, 1),
            "pool_mib": round(stats["pool_bytes"] / 2**20, 1), "kernel": stats["kernel"],
            "ok": stats["captures"] > 0 or not torch.cuda.is_available()}


def item_step(model: torch.nn.Module, _deadline: float) -> dict[str, Any]:
    from ajet.engine.generation.paged_runner import DecodeRow, Sampling

    figures: dict[str, Any] = {}
    with started(model, "paged") as gen:
        runner = gen._runner
        with gen.paused():
            for rows in (1, 16, 64):
                pages_each = -(-(PROMPT_TOKENS + 2) // runner.plan.page_size)
                owned = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(rows)]
                batch = [DecodeRow(token=7, position=PROMPT_TOKENS, pages=pages,
                                   table=runner.table_row(pages),
                                   sampling=Sampling(1.0, 1.0, 0, i), counter=0)
                         for i, pages in enumerate(owned)]
                timings = {}
                for mode in ("eager", "graph"):
                    runner.cuda_graphs = mode == "graph" and torch.cuda.is_available()
                    for _ in range(3):
                        runner.decode(batch)
                    _sync()
                    began = time.perf_counter()
                    for _ in range(20):
                        runner.decode(batch)
                    _sync()
                    timings[mode] = (time.perf_counter() - began) / 20
                runner.cuda_graphs = torch.cuda.is_available()
                figures[f"B={rows}"] = {"eager_ms": round(1000 * timings["eager"], 2),
                                        "graph_ms": round(1000 * timings["graph"], 2),
                                        "speedup": round(timings["eager"] / timings["graph"], 2)}
    return figures


def item_greedy(model: torch.nn.Module, deadline: float) -> dict[str, Any]:
    batch = prompts(16, model.config.vocab_size, seed=3, length=100)
    replies = {}
    for graphs in (False, True):
        with started(model, "paged", cuda_graphs=graphs) as gen:
            out = run_requests(gen, batch, 64, deadline, temperature=0.0)
        replies[graphs] = [r.response_ids for r in out["results"]]
    same = sum(a == b for a, b in zip(replies[False], replies[True], strict=True))
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                  for a, b in zip(replies[False], replies[True], strict=True)]
    return {"identical_requests": f"{same}/{len(batch)}", "first_divergence": first_diff,
            "ok": same == len(batch)}


def item_logprob_gap(model: torch.nn.Module, deadline: float) -> dict[str, Any]:
    batch = prompts(16, model.config.vocab_size, seed=4)
    figures: dict[str, Any] = {}
    for backend in ("continuous_batching", "paged"):
        with started(model, backend) as gen:
            results = run_requests(gen, batch, NEW_TOKENS, deadline)["results"]
            with gen.paused():
                scored = _score(model, results)
        gaps = [abs(a - b) for a, b in zip([x for r in results for x in r.logprobs], scored,
                                           strict=True)]
        figures[backend] = {"mean_abs_gap": round(statistics.mean(gaps), 5),
                            "max_abs_gap": round(max(gaps), 4)}
    figures["engine_today"] = TODAYS_GAP
    figures["ok"] = figures["paged"]["mean_abs_gap"] <= max(
        TODAYS_GAP, figures["continuous_batching"]["mean_abs_gap"]) * 1.1
    return figures


def _score(model: torch.nn.Module, results: list[Any]) -> list[float]:
    """The trainer's log-probs of `results` (the engine's scoring) under `model` now."""
    from ajet.engine.scoring import score_responses

    with torch.no_grad():
        lp, _, _ = score_responses(model, [r.prompt_ids for r in results],
                                   [r.response_ids for r in results], pad_id=0,
                                   temperature=1.0, device=next(model.parameters()).device)
    return [x for row, r in enumerate(results) for x in lp[row, :len(r.response_ids)].tolist()]


def _mean_gap(a: list[float], b: list[float]) -> float:
    return statistics.mean(abs(x - y) for x, y in zip(a, b, strict=True))


def item_weights(model: torch.nn.Module, deadline: float) -> dict[str, Any]:
    """Weights changed in place: the next replies' log-probs are the new weights' (not
    the old ones'), with no capture; a parameter that moved: one capture again."""
    batch = prompts(4, model.config.vocab_size, seed=5, length=64)
    with started(model, "paged") as gen:
        run_requests(gen, batch, 16, deadline)
        captures = gen.stats()["captures"]
        saved = [p.detach().clone() for p in model.parameters()]
        with gen.paused(), torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        after = run_requests(gen, batch, 16, deadline)["results"]
        in_place_captures = gen.stats()["captures"] - captures
        drawn = [x for r in after for x in r.logprobs]
        with gen.paused():
            fresh = _mean_gap(drawn, _score(model, after))
            moved = next(model.parameters())
            moved.data = moved.data.clone()  # the parameter moves: graphs must follow
        run_requests(gen, batch, 4, deadline)
        moved_captures = gen.stats()["captures"] - captures - in_place_captures
        with gen.paused(), torch.no_grad():
            for p, s in zip(model.parameters(), saved, strict=True):
                p.copy_(s)
            stale = _mean_gap(drawn, _score(model, after))
    graphs = torch.cuda.is_available()
    return {"gap_to_the_new_weights": round(fresh, 5), "gap_to_the_old_weights": round(stale, 5),
            "captures_after_in_place_update": in_place_captures,
            "captures_after_a_parameter_moved": moved_captures,
            "ok": stale > 5 * fresh and in_place_captures == 0
            and (moved_captures > 0 or not graphs)}


def item_e2e(model: torch.nn.Module, deadline: float) -> dict[str, Any]:
    vocab = model.config.vocab_size
    figures: dict[str, Any] = {}
    for backend in ("continuous_batching", "paged"):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with started(model, backend) as gen:
            one = run_requests(gen, prompts(1, vocab, seed=6), NEW_TOKENS, deadline)
            many = run_requests(gen, prompts(CONCURRENT, vocab, seed=7), NEW_TOKENS, deadline)
            stats = gen.stats()
            runner = getattr(gen, "_runner", None)  # the paged backend's pool plan
        row = {"tok_s_1": round(one["tokens_per_s"], 1), "ttft_1_s": one["ttft_median_s"],
               f"tok_s_{CONCURRENT}": round(many["tokens_per_s"], 1),
               f"ttft_{CONCURRENT}_s": many["ttft_median_s"]}
        if torch.cuda.is_available():
            row["peak_mib_above_weights"] = round((torch.cuda.max_memory_allocated() - base)
                                                  / 2**20, 1)
            if runner is not None:
                planned = runner.plan.pool_bytes + runner.plan.working_bytes
                row["planned_mib"] = round(planned / 2**20, 1)
                row["peak_vs_plan"] = round((torch.cuda.max_memory_allocated() - base)
                                            / planned, 3)
        row["stats"] = {k: stats.get(k) for k in ("kv_cache_tokens", "captures", "kernel",
                                                  "prefix_tokens", "decode_steps")}
        figures[backend] = row
    old, new = figures["continuous_batching"], figures["paged"]
    figures["speedup_64"] = round(new[f"tok_s_{CONCURRENT}"] / old[f"tok_s_{CONCURRENT}"], 2)
    figures["speedup_1"] = round(new["tok_s_1"] / old["tok_s_1"], 2)
    return figures


def item_profile(model: torch.nn.Module, deadline: float) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    with started(model, "continuous_batching") as gen:
        batch = prompts(CONCURRENT, model.config.vocab_size, seed=8)
        run_requests(gen, batch[:4], 8, deadline)  # warm
        with profile(activities=activities) as prof:
            out = run_requests(gen, batch, 16, deadline)
    events = prof.key_averages()
    by_device = sorted(events, key=lambda e: getattr(e, "device_time_total", 0.0),
                       reverse=True)[:12]
    by_host = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel",
                                                        "cuLaunchKernel"))
    steps = 16 + 1  # decode steps of the profiled batch (and its prefill)
    return {"tokens_per_s": round(out["tokens_per_s"], 1),
            "kernel_launches_per_step": round(launches / steps),
            "top_device": [(e.key, round(getattr(e, "device_time_total", 0.0) / 1000, 1))
                           for e in by_device],
            "top_host_self": [(e.key, round(e.self_cpu_time_total / 1000, 1))
                              for e in by_host]}


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    p.add_argument("--vocab", type=int, default=QWEN25_VOCAB_SIZE,
                   help="vocabulary size (Qwen2.5's by default; smaller for a CPU smoke run)")
    p.add_argument("--skip", default="", help="comma-separated items to leave out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        log.warning("no CUDA device: nothing to measure (use --device cpu for a smoke run)")
        return 0
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out / "gpu_generation.json")
    skip = set(filter(None, args.skip.split(",")))
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    report.run("versions", 20, deadline, item_versions)
    model = build_model(args.shape, args.device, dtype, vocab=args.vocab)
    items: list[tuple[str, float, Callable[[torch.nn.Module, float], dict[str, Any]]]] = [
        ("cb_cuda_graph", 45, item_cb_cuda_graph), ("kernel", 30, item_kernel),
        ("capture", 30, item_capture), ("step", 20, item_step), ("greedy", 30, item_greedy),
        ("logprob_gap", 30, item_logprob_gap), ("weights", 20, item_weights),
        ("e2e", 45, item_e2e), ("profile", 25, item_profile)]
    for name, limit, fn in items:
        if name not in skip:
            report.run(name, limit, deadline, lambda d, fn=fn, m=model: fn(m, d))
    del model
    if "e2e_7b" not in skip and args.device == "cuda":
        def e2e_7b(d: float) -> dict[str, Any]:
            return item_e2e(build_model("qwen2.5-7b", args.device, dtype), d)

        report.run("e2e_7b", 90, deadline, e2e_7b)
    log.info("done: %d item(s), failed: %s", len(report.items), report.failed or "none")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
