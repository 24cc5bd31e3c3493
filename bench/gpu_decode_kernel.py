"""`python3 bench/gpu_decode_kernel.py`: the Triton paged decode kernel against the torch
reference on a GPU, as milliseconds and effective GB/s.

    python3 bench/gpu_decode_kernel.py                        # both Qwen2.5 shapes, < 2 min
    python3 bench/gpu_decode_kernel.py --shape qwen2.5-7b --page-size 16 --budget-s 60

For each (batch, context) it fills a pool with exactly the pages the batch needs (plus
the trash page), hands every row its pages in shuffled order, and times one decode
step of one layer: `triton_decode.paged_decode` (its default split count) and
`paged_attention.decode_attention_torch` (gather + SDPA). Each figure is the median of
`reps` single calls between CUDA events, after `warmup` calls (the first compiles the
kernel); before each timed call a 256 MiB buffer is overwritten so K and V come from
HBM, not from L2, as they do when a decode step walks every layer's pool.

Effective GB/s counts the bytes a decode step must move, the same for both: K and V of
every readable token, plus q read and the output written. The torch path moves more
(its gather writes and reads a copy), which is what the comparison shows.

`run()` never raises for one case: a case that fails (out of memory, a compile error)
records its error text and the next one runs. When `budget_s` runs out it stops and
returns what it has, with a note row. It needs only torch (and triton for the kernel);
it imports on a machine without a GPU, where `main()` prints a note and exits 0.
`device="cpu"` runs the same loop with wall-clock timing: under TRITON_INTERPRET=1
that is the smoke test of this script (tests/bench/test_gpu_decode_kernel.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:  # a checkout, not an install
    sys.path.insert(0, str(PROJECT_ROOT))

from ajet.engine.generation.paged_attention import decode_attention_torch

#: (heads, kv_heads, head_dim) of the models the paged backend serves
SHAPES: dict[str, tuple[int, int, int]] = {
    "qwen2.5-0.5b": (14, 2, 64),
    "qwen2.5-7b": (28, 4, 128),
    "ajet-tiny": (4, 2, 16),
}
#: overwritten before each timed call: larger than any GPU's L2 cache
_FLUSH_BYTES = 256 << 20


def _time_ms(fn: Callable[[], torch.Tensor], device: torch.device, reps: int, warmup: int,
             flush: torch.Tensor | None) -> float:
    """Median milliseconds of one call of `fn`."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    events = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _case(device: torch.device, dtype: torch.dtype, batch: int, context: int, heads: int,
          kv_heads: int, head_dim: int, page_size: int, reps: int, warmup: int,
          flush: torch.Tensor | None) -> dict[str, Any]:
    """One (batch, context) row: each path's time and GB/s, or its error."""
    row: dict[str, Any] = {"batch": batch, "context": context}
    gen = torch.Generator(device=device).manual_seed(0)
    per_row = math.ceil(context / page_size)
    pages = batch * per_row + 1  # + the trash page
    shape = (pages, page_size, kv_heads, head_dim)
    k_pool = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_pool = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(pages - 1, generator=gen, device=device)
    tables = order.view(batch, per_row).to(torch.int32)  # (B, max_pages), scattered
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)  # (B,)
    q = torch.randn((batch, heads, head_dim), generator=gen, device=device, dtype=dtype)
    scale = head_dim ** -0.5
    element = k_pool.element_size()
    moved = (2 * batch * context * kv_heads * head_dim + 2 * batch * heads * head_dim) * element
    outputs: dict[str, torch.Tensor] = {}

    def triton_path() -> torch.Tensor:
        from ajet.engine.generation.triton_decode import paged_decode

        return paged_decode(q, k_pool, v_pool, tables, lens, scale)

    def torch_path() -> torch.Tensor:
        return decode_attention_torch(q, k_pool, v_pool, tables, lens, scale)

    for name, fn in (("triton", triton_path), ("torch", torch_path)):
        try:
            outputs[name] = fn()
            ms = _time_ms(fn, device, reps, warmup, flush)
            row[f"{name}_ms"] = float(f"{ms:.4g}")
            row[f"{name}_gbps"] = float(f"{moved / (ms * 1e-3) / 1e9:.4g}")
        except Exception as exc:  # noqa: BLE001 - one failed case must not end the run
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:500]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if len(outputs) == 2:
        diff = (outputs["triton"].float() - outputs["torch"].float()).abs().max()
        row["max_abs_diff"] = float(diff)
    if "triton_ms" in row and "torch_ms" in row:
        row["speedup"] = float(f"{row['torch_ms'] / row['triton_ms']:.3g}")
    return row


def run(device: str = "cuda", *, heads: int, kv_heads: int, head_dim: int, page_size: int,
        batches: Sequence[int] = (1, 16, 64, 256), contexts: Sequence[int] = (512, 2048, 8192),
        dtype: torch.dtype = torch.bfloat16, budget_s: float, reps: int = 20,
        warmup: int = 3) -> list[dict[str, Any]]:
    """Time both decode paths for every (batch, context), within `budget_s` seconds."""
    deadline = time.monotonic() + budget_s
    where = torch.device(device)
    shape = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
             "page_size": page_size, "dtype": str(dtype).removeprefix("torch.")}
    if where.type == "cuda" and not torch.cuda.is_available():
        return [{**shape, "note": "no CUDA device: nothing measured"}]
    flush = (torch.empty(_FLUSH_BYTES, dtype=torch.int8, device=where)
             if where.type == "cuda" else None)
    cases = [(b, c) for b in batches for c in contexts]
    rows: list[dict[str, Any]] = []
    for done, (batch, context) in enumerate(cases):
        if time.monotonic() >= deadline:
            rows.append({**shape, "note": f"time budget of {budget_s} s spent: "
                         f"{len(cases) - done} of {len(cases)} cases not run"})
            break
        try:
            row = _case(where, dtype, batch, context, heads, kv_heads, head_dim, page_size,
                        reps, warmup, flush)
        except Exception as exc:  # noqa: BLE001 - e.g. the pool itself does not fit
            row = {"batch": batch, "context": context, "error": f"{type(exc).__name__}: {exc}"}
        rows.append({**shape, **row})
        if where.type == "cuda":
            torch.cuda.empty_cache()  # the next case's pool may need all of it
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "qwen-both", "all"], default="qwen-both",
                        help="model heads to use (default: both Qwen2.5 shapes)")
    parser.add_argument("--page-size", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--budget-s", type=float, default=100.0, help="for all shapes together")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    names = {"all": list(SHAPES), "qwen-both": ["qwen2.5-0.5b", "qwen2.5-7b"]}.get(
        args.shape, [args.shape])
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.budget_s
    for index, name in enumerate(names):
        # An even share of what is left, so a slow first shape cannot starve the others.
        share = max(0.0, deadline - time.monotonic()) / (len(names) - index)
        heads, kv_heads, head_dim = SHAPES[name]
        for row in run(args.device, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       page_size=args.page_size,
                       batches=[int(b) for b in args.batches.split(",")],
                       contexts=[int(c) for c in args.contexts.split(",")],
                       dtype=getattr(torch, args.dtype), budget_s=share, reps=args.reps,
                       warmup=args.warmup):
            rows.append({"shape": name, **row})
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
