"""The paged backend's tensor side: the model, the KV pool, the prefill and decode steps,
and the CUDA graphs around the decode step.

`PagedRunner` owns what lives on the device. The scheduler (`paged.py`) decides which
tokens go through a step; the runner packs them, runs the model and returns sampled
tokens with their log-probs.

- Prefill runs eagerly: chunks of prompts packed into one row, attention per request
  (`paged_attention.prefill_attention`), the output head only on the last token of the
  prompts the chunk completes (`logits_to_keep`).
- Decode packs every row's inputs into one int32 slab (`DecodeSlab`): one host-to-device
  copy in, one (2, B) float32 tensor of tokens and log-probs back, one device-to-host
  copy. The step itself (forward, KV write, output head on the B rows, sampling) is one
  function of the slab. On a GPU with `cuda_graphs` it is captured once per batch-size
  bucket and replayed; rows beyond the batch are padding that reads and writes only the
  pool's trash page. Elsewhere the same function runs eagerly on the exact batch, so
  the CPU tests run the very packing and step code a replay runs.
- The optimizer updates weights in place, so replays see new weights without a new
  capture. The runner records every parameter's and buffer's address, and the pool's,
  at capture; `refresh()` (the scheduler's resume) captures again, with a log line, if
  any of them moved.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ajet.engine.generation.kv_cache import PoolPlan
from ajet.engine.generation.paged_attention import (
    KVPool,
    PagedBatch,
    Segment,
    attention_mode,
    register,
)
from ajet.engine.generation.sampling import sample

__all__ = ["DecodeRow", "DecodeSlab", "PagedRunner", "PrefillRow", "Sampling", "graph_buckets"]

log = logging.getLogger(__name__)

#: Batch sizes that get their own CUDA graph (then every 64 rows up to the maximum): a
#: batch runs in the smallest bucket that holds it, the rest of the bucket is padding.
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The captured batch sizes for a run whose batches reach `max_batch` rows."""
    sizes = [b for b in _BUCKETS if b < max_batch]
    sizes += list(range(_BUCKETS[-1] + 64, max_batch, 64))
    return (*sizes, max_batch)


@dataclass(frozen=True)
class Sampling:
    """One row's sampling settings."""

    temperature: float
    top_p: float
    top_k: int
    #: the request's own noise seed (the counter is its token index: `DecodeRow`)
    seed: int

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


@dataclass(frozen=True)
class DecodeRow:
    """One request in a decode step: its last token goes in at `position`."""

    token: int
    position: int
    pages: Sequence[int]
    #: `pages` as the (max_pages,) int32 page-table row (`PagedRunner.table_row`): a
    #: request's pages never change while it runs, so the row is built once
    table: torch.Tensor
    sampling: Sampling
    #: tokens the request generated so far: the counter of its noise
    counter: int


@dataclass(frozen=True)
class PrefillRow:
    """One request's part of a prefill chunk: `tokens` go in from `position` on."""

    tokens: Sequence[int]
    position: int
    pages: Sequence[int]
    table: torch.Tensor  # as `DecodeRow.table`
    #: sample its first token (the chunk ends its prompt), with these settings
    sampling: Sampling | None


class DecodeSlab:
    """The int32 layout of a decode step's inputs: nine fields of B values, then the
    (B, max_pages) page table. Temperature and top_p travel as float32 bit patterns."""

    FIELDS = ("ids", "positions", "slots", "context_lens", "seeds", "counters", "top_k",
              "temperature", "top_p")

    def __init__(self, rows: int, max_pages: int) -> None:
        self.rows, self.max_pages = rows, max_pages

    def pack(self, rows: Sequence[DecodeRow], *, page_size: int, trash_row: torch.Tensor
             ) -> torch.Tensor:
        """The host slab for `rows`, padded to `self.rows` with rows of the trash page
        (`trash_row`: a table row of it)."""
        pad = self.rows - len(rows)
        trash = int(trash_row[0])
        ints = torch.tensor(
            [r.token for r in rows] + [0] * pad
            + [r.position for r in rows] + [0] * pad
            + [r.pages[r.position // page_size] * page_size + r.position % page_size
               for r in rows] + [trash * page_size] * pad
            + [r.position + 1 for r in rows] + [1] * pad
            + [r.sampling.seed for r in rows] + [0] * pad
            + [r.counter for r in rows] + [0] * pad
            + [r.sampling.top_k for r in rows] + [0] * pad, dtype=torch.int32)
        floats = torch.tensor([r.sampling.temperature for r in rows] + [1.0] * pad
                              + [r.sampling.top_p for r in rows] + [1.0] * pad,
                              dtype=torch.float32).view(torch.int32)
        tables = torch.stack([r.table[:self.max_pages] for r in rows]
                             + [trash_row[:self.max_pages]] * pad)  # (B, max_pages)
        return torch.cat([ints, floats, tables.reshape(-1)])

    def unpack(self, slab: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of a (device) slab, by field name, plus "tables" (B, max_pages)."""
        b = self.rows
        fields = {name: slab[i * b:(i + 1) * b] for i, name in enumerate(self.FIELDS)}
        fields["temperature"] = fields["temperature"].view(torch.float32)
        fields["top_p"] = fields["top_p"].view(torch.float32)
        fields["tables"] = slab[len(self.FIELDS) * b:].view(b, self.max_pages)
        return fields


@dataclass
class _Graph:
    graph: Any
    slab: torch.Tensor  # the static input the replay reads
    out: torch.Tensor  # the static output it writes
    #: pinned host buffers of both: the copies in and out are asynchronous
    host_slab: torch.Tensor
    host_out: torch.Tensor


class PagedRunner:
    """The model over a paged pool; see the module docstring."""

    def __init__(self, model: torch.nn.Module, plan: PoolPlan, *, kernel: str,
                 cuda_graphs: bool) -> None:
        register()
        self.model = model
        self.plan = plan
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.kernel = _choose_kernel(kernel, self.device)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.max_pages = -(-plan.max_request_tokens // plan.page_size)
        self.pool: KVPool | None = None
        self._graphs: dict[tuple[int, bool], _Graph] = {}
        self._graph_pool: Any = None
        self._addresses: tuple[int, ...] = ()
        self._trash_row = self.table_row(())
        self.captures = 0
        self.capture_s = 0.0
        self.graph_pool_bytes = 0
        self.allocate()

    # ------------------------------------------------------------------ memory

    def allocate(self) -> None:
        """The pool, once (again after `release_pool`)."""
        if self.pool is None:
            geometry = self.plan.geometry
            self.pool = KVPool.allocate(layers=geometry.layers, pages=self.plan.pages,
                                        page_size=self.plan.page_size,
                                        kv_heads=geometry.kv_heads,
                                        head_dim=geometry.head_dim, dtype=self.dtype,
                                        device=self.device)

    def release_pool(self) -> None:
        """Free the pool and the graphs (their addresses die with it) for an update."""
        self.pool = None
        self._drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_pool = None
        self.graph_pool_bytes = 0

    def refresh(self, model: torch.nn.Module) -> None:
        """After an update: the pool back if released, graphs captured again if the
        model or any weight moved (in-place updates keep them valid)."""
        self.model = model
        self.allocate()
        if self._graphs and self._current_addresses() != self._addresses:
            log.info("paged generator: weights or the KV pool moved since the CUDA graphs "
                     "were captured; capturing them again")
            self._drop_graphs()

    def _current_addresses(self) -> tuple[int, ...]:
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        pool = (self.pool.k.data_ptr(),) if self.pool is not None else ()
        return (*pool, *(t.data_ptr() for t in tensors))

    def bind_thread(self) -> None:
        """Make the runner's device current in the calling thread: Triton launches and
        graph captures go to the current device, and a new thread's is device 0."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def table_row(self, pages: Sequence[int]) -> torch.Tensor:
        """A request's (max_pages,) int32 page-table row, the trash page past its end."""
        trash = self.plan.pages  # the pool's last page (KVPool.trash_page)
        row = list(pages[:self.max_pages]) + [trash] * (self.max_pages - len(pages))
        return torch.tensor(row, dtype=torch.int32)

    # ------------------------------------------------------------------ steps

    @torch.no_grad()
    def prefill(self, rows: Sequence[PrefillRow]) -> list[tuple[int, float] | None]:
        """One eager forward over the rows' chunks; (token, log-prob) where sampled."""
        assert self.pool is not None
        page_size = self.pool.page_size
        ids, positions, slots, segments, keep = [], [], [], [], []
        for i, row in enumerate(rows):
            start = len(ids)
            span = range(row.position, row.position + len(row.tokens))
            ids.extend(row.tokens)
            positions.extend(span)
            slots.extend(row.pages[p // page_size] * page_size + p % page_size for p in span)
            segments.append(Segment(query_start=start, query_len=len(row.tokens),
                                    context_len=span.stop, row=i))
            if row.sampling is not None:
                keep.append(len(ids) - 1)
        tables = torch.stack([r.table for r in rows]).to(self.device)  # (R, max_pages)
        batch = PagedBatch(self.pool, slots=self._tensor(slots, torch.int64),
                           block_tables=tables, segments=tuple(segments), kernel=self.kernel)
        if not keep:
            self._forward(ids, positions, batch, logits_to_keep=1)
            return [None] * len(rows)
        logits = self._forward(ids, positions, batch,
                               logits_to_keep=self._tensor(keep, torch.int64))  # (K, V)
        settings = [r.sampling for r in rows if r.sampling is not None]
        tokens, logprobs = self._sample(logits, settings)
        drawn = iter(zip(tokens, logprobs, strict=True))
        return [next(drawn) if r.sampling is not None else None for r in rows]

    @torch.no_grad()
    def decode(self, rows: Sequence[DecodeRow]) -> list[tuple[int, float]]:
        """One decode step: a replay of the bucket's graph, or the same step eagerly."""
        assert self.pool is not None
        truncate = any(r.sampling.truncates for r in rows)
        if self.cuda_graphs:
            bucket = next(b for b in graph_buckets(self.plan.max_batch) if b >= len(rows))
            graph = self._graph(bucket, truncate)
            if graph is not None:
                slab = DecodeSlab(bucket, self.max_pages)
                graph.host_slab.copy_(slab.pack(rows, page_size=self.pool.page_size,
                                                trash_row=self._trash_row))
                graph.slab.copy_(graph.host_slab, non_blocking=True)  # the one copy in
                graph.graph.replay()
                graph.host_out.copy_(graph.out, non_blocking=True)  # the one copy out
                torch.cuda.current_stream(self.device).synchronize()
                return _pairs(graph.host_out, len(rows))
        # eagerly, the batch's own widest context (pages reserved for later tokens unread)
        page_size = self.pool.page_size
        slab = DecodeSlab(len(rows), max(r.position // page_size + 1 for r in rows))
        host = slab.pack(rows, page_size=page_size, trash_row=self._trash_row)
        out = self.decode_step(host.to(self.device), slab, truncate).to("cpu")
        return _pairs(out, len(rows))

    def decode_step(self, slab_tensor: torch.Tensor, slab: DecodeSlab, truncate: bool
                    ) -> torch.Tensor:
        """Forward, KV write, output head and sampling: (2, B) tokens and log-probs.

        This is what a CUDA graph captures, so it reads nothing back to the host and
        builds no tensor from host data: every value comes from `slab_tensor`.
        """
        assert self.pool is not None
        f = slab.unpack(slab_tensor)
        batch = PagedBatch(self.pool, slots=f["slots"].long(), block_tables=f["tables"],
                           context_lens=f["context_lens"], kernel=self.kernel)
        logits = self._forward(f["ids"], f["positions"], batch, logits_to_keep=0)  # (B, V)
        tokens, logprobs = sample(logits, temperature=f["temperature"], top_p=f["top_p"],
                                  top_k=f["top_k"], seeds=f["seeds"], counters=f["counters"],
                                  truncate=truncate)
        return torch.stack([tokens.to(torch.float32), logprobs])

    def _forward(self, ids: Sequence[int] | torch.Tensor, positions: Sequence[int] |
                 torch.Tensor, batch: PagedBatch, *, logits_to_keep: int | torch.Tensor
                 ) -> torch.Tensor:
        """The model's own forward on one packed row, with paged attention: (K, V)."""
        ids_t = self._tensor(ids, torch.int64)
        positions_t = self._tensor(positions, torch.int64)
        with attention_mode(self.model):
            out = self.model(input_ids=ids_t[None], position_ids=positions_t[None],
                             use_cache=False, logits_to_keep=logits_to_keep,
                             ajet_paged=batch)
        return out.logits[0]

    def _sample(self, logits: torch.Tensor, settings: Sequence[Sampling]
                ) -> tuple[list[int], list[float]]:
        def column(name: str, dtype: torch.dtype) -> torch.Tensor:
            return self._tensor([getattr(s, name) for s in settings], dtype)

        tokens, logprobs = sample(logits, temperature=column("temperature", torch.float32),
                                  top_p=column("top_p", torch.float32),
                                  top_k=column("top_k", torch.int64),
                                  seeds=column("seed", torch.int64),
                                  # a prompt's last token samples its reply's first
                                  counters=torch.zeros(len(settings), dtype=torch.int64,
                                                       device=self.device),
                                  truncate=any(s.truncates for s in settings))
        return tokens.tolist(), logprobs.float().tolist()

    def _tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.to(dtype)
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ graphs

    def capture_all(self) -> None:
        """Capture every bucket's graph without truncation (the default sampling) now, the
        largest first so the smaller ones reuse its memory; the top-p family on demand."""
        if self.cuda_graphs:
            for bucket in reversed(graph_buckets(self.plan.max_batch)):
                if self._graph(bucket, False) is None:
                    return

    def _graph(self, rows: int, truncate: bool) -> _Graph | None:
        """The captured graph for (rows, truncate); None (eager from then on) if capture
        fails, with the reason logged once."""
        key = (rows, truncate)
        if key in self._graphs or not self.cuda_graphs:
            return self._graphs.get(key)
        try:
            self._graphs[key] = self._capture(rows, truncate)
        except Exception:  # a model whose forward cannot be captured still generates
            log.exception("paged generator: CUDA graph capture failed for %d rows; decoding "
                          "eagerly from now on", rows)
            self.cuda_graphs = False
            self._drop_graphs()
            return None
        return self._graphs[key]

    def _capture(self, rows: int, truncate: bool) -> _Graph:
        assert self.pool is not None
        self.bind_thread()
        began = time.monotonic()
        reserved = torch.cuda.memory_reserved(self.device)
        slab = DecodeSlab(rows, self.max_pages)
        host = slab.pack([], page_size=self.pool.page_size,  # all padding rows
                         trash_row=self._trash_row)
        static = host.to(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: lazy initialisation happens outside capture
            for _ in range(2):
                self.decode_step(static, slab, truncate)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture on the scheduler thread (the top-p family, on first use)
        # must not fail because another thread of the engine touches the device meanwhile
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = self.decode_step(static, slab, truncate)
        torch.cuda.synchronize(self.device)
        self._addresses = self._current_addresses()
        self.captures += 1
        self.capture_s += time.monotonic() - began
        self.graph_pool_bytes += torch.cuda.memory_reserved(self.device) - reserved
        return _Graph(graph=graph, slab=static, out=out, host_slab=host.pin_memory(),
                      host_out=torch.empty(out.shape, dtype=out.dtype, pin_memory=True))

    def stats(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "cuda_graphs": self.cuda_graphs,
                "graphs": sorted(f"{rows}{'+top_p' if t else ''}"
                                 for rows, t in self._graphs),
                "captures": self.captures, "capture_s": round(self.capture_s, 3),
                "graph_pool_bytes": self.graph_pool_bytes,
                "pool_bytes": self.pool.nbytes if self.pool is not None else 0}


def _pairs(out: torch.Tensor, rows: int) -> list[tuple[int, float]]:
    tokens, logprobs = out[0, :rows].tolist(), out[1, :rows].tolist()
    return [(int(t), float(lp)) for t, lp in zip(tokens, logprobs, strict=True)]


def _choose_kernel(kernel: str, device: torch.device) -> str:
    """"auto": the Triton kernel on a GPU where triton imports, else the torch path."""
    if kernel != "auto":
        if kernel not in ("triton", "torch", "flex"):
            raise ValueError(f"unknown paged decode kernel {kernel!r}; use auto, triton, "
                             "torch or flex")
        return kernel
    if device.type != "cuda":
        return "torch"
    try:
        import ajet.engine.generation.triton_decode  # noqa: F401
    except ImportError as exc:
        log.warning("paged generator: no Triton (%s); decoding with the torch kernel", exc)
        return "torch"
    return "triton"
