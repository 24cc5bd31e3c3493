"""Attention over a paged KV pool, as a transformers attention function.

The paged backend (`paged.py`) runs the model's own Hugging Face code with one change:
the attention function. `register()` adds `ajet_paged` to transformers'
`AttentionInterface`; `attention_mode(model)` switches the model to it for one forward
pass (the trainer's forward passes keep the model's own attention). transformers builds
no mask for an implementation it has no mask function for, so a forward pass costs no
dense mask at all; what each query may read is the request's page table instead.

Every forward pass packs its tokens into one row, (1, N) tokens, with explicit position
ids, and hands the pool's addresses for them in a `PagedBatch` keyword argument that
transformers passes through to every attention layer. The layer writes the new keys and
values into the pool (`slots`, one flat slot per token), then reads:

- decode (one token per request, the batch as N rows): `decode_attention`, the Triton
  split-KV kernel on a GPU (`triton_decode.py`), else `decode_attention_torch`, which
  gathers each row's pages and runs SDPA with a length mask (the reference, and the CPU
  path). `decode_attention_flex` is FlexAttention over the same pages, a cross-check;
- prefill (chunks of prompts): one SDPA call per request over its pages so far, causal
  within the chunk (`prefill_attention`); prefill runs eagerly, outside CUDA graphs.

Sliding-window layers (transformers passes the layer's `sliding_window`) read only the
last `window` tokens, as transformers' own mask has it: position q sees keys k with
q - window < k <= q. The Triton kernel has no window, so such layers decode with the
torch kernel; their pages are kept whole (a window saves no memory here).

Shapes: pool tensors are (pages, page_size, kv_heads, head_dim) per layer, in the
compute dtype; one page (the last) is the trash page that padding rows write to and
read from, so a CUDA graph's padding never touches a real request's pages.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_NAME",
    "KVPool",
    "PagedBatch",
    "Segment",
    "attention_mode",
    "decode_attention",
    "decode_attention_flex",
    "decode_attention_torch",
    "paged_attention_forward",
    "prefill_attention",
    "register",
]

#: The name under which the attention function is registered with transformers.
ATTENTION_NAME = "ajet_paged"


@dataclass
class KVPool:
    """Every layer's keys and values, in pages, allocated once.

    `k` and `v` are (layers, pages, page_size, kv_heads, head_dim). The last page is the
    trash page: never handed to a request.
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, *, layers: int, pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> KVPool:
        shape = (layers, pages + 1, page_size, kv_heads, head_dim)  # + the trash page
        both = torch.zeros((2, *shape), dtype=dtype, device=device)
        return cls(k=both[0], v=both[1])

    @property
    def page_size(self) -> int:
        return int(self.k.shape[2])

    @property
    def pages(self) -> int:
        """Pages a request may own (the trash page excluded)."""
        return int(self.k.shape[1]) - 1

    @property
    def trash_page(self) -> int:
        return self.pages

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass(frozen=True)
class Segment:
    """One request's part of a prefill chunk (Python ints: prefill runs eagerly)."""

    #: where its tokens start in the packed row, and how many there are
    query_start: int
    query_len: int
    #: tokens readable after this chunk: what was cached before plus `query_len`
    context_len: int
    #: its row of `PagedBatch.block_tables`
    row: int


@dataclass
class PagedBatch:
    """Where one forward pass's tokens go in the pool and what each query reads."""

    pool: KVPool
    #: (N,) int64 flat slot (page * page_size + offset) of each packed token's K/V
    slots: torch.Tensor
    #: (R, max_pages) int32 each request's pages in order (trash page past its end)
    block_tables: torch.Tensor
    #: decode: (R,) int32 tokens each request may read, the new one included
    context_lens: torch.Tensor | None = None
    #: prefill: each request's segment of the packed row; None: a decode step (R == N)
    segments: tuple[Segment, ...] | None = None
    #: decode kernel: "triton", "torch" or "flex"
    kernel: str = "torch"


def register() -> None:
    """Add the paged attention function to transformers' registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


@contextlib.contextmanager
def attention_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` with paged attention inside the block, its own attention after it.

    The model is shared with the trainer, so the switch is per forward pass; inside a
    CUDA graph only the captured kernels run, so a replay needs no switch at all.
    """
    config: Any = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (1, H, N, D), key and value
    (1, KvH, N, D), after rotary embedding; returns (1, N, H, D) and no weights."""
    batch: PagedBatch | None = kwargs.get("ajet_paged")
    if batch is None:
        raise RuntimeError("the paged attention function ran without a PagedBatch; the "
                           "model was left in paged mode outside attention_mode()")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    k_pool, v_pool = batch.pool.k[layer], batch.pool.v[layer]
    _write(k_pool, v_pool, batch.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    q = query[0].transpose(0, 1)  # (N, H, D)
    window = kwargs.get("sliding_window")
    if batch.segments is None:
        assert batch.context_lens is not None
        kernel = "torch" if window and batch.kernel == "triton" else batch.kernel
        out = decode_attention(q, k_pool, v_pool, batch.block_tables, batch.context_lens,
                               scale, kernel=kernel, window=window)
    else:
        out = prefill_attention(q, k_pool, v_pool, batch.block_tables, batch.segments, scale,
                                window=window)
    return out.unsqueeze(0), None  # (1, N, H, D)


def _write(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
           k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the new tokens' keys and values (N, KvH, D) at their flat slots."""
    pages, page_size, kv_heads, head_dim = k_pool.shape
    k_pool.view(pages * page_size, kv_heads, head_dim).index_copy_(0, slots, k.to(k_pool.dtype))
    v_pool.view(pages * page_size, kv_heads, head_dim).index_copy_(0, slots, v.to(v_pool.dtype))


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     *, kernel: str = "torch", window: int | None = None) -> torch.Tensor:
    """One query token per request over its pages: q (B, H, D) -> (B, H, D)."""
    if kernel == "triton" and not window:
        from ajet.engine.generation.triton_decode import paged_decode

        return paged_decode(q, k_pool, v_pool, block_tables, context_lens, scale)
    if kernel == "flex":
        return decode_attention_flex(q, k_pool, v_pool, block_tables, context_lens, scale,
                                     window=window)
    return decode_attention_torch(q, k_pool, v_pool, block_tables, context_lens, scale,
                                  window=window)


def _gather(pool: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Each row's pages in order: (B, KvH, max_pages * page_size, D)."""
    rows, max_pages = block_tables.shape
    _, page_size, kv_heads, head_dim = pool.shape
    pages = pool.index_select(0, block_tables.reshape(-1).long())  # (B * P, ps, KvH, D)
    return pages.view(rows, max_pages * page_size, kv_heads, head_dim).transpose(1, 2)


def decode_attention_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, *, window: int | None = None) -> torch.Tensor:
    """The reference decode: gather the pages, SDPA with a length mask (any device)."""
    k, v = _gather(k_pool, block_tables), _gather(v_pool, block_tables)  # (B, KvH, L, D)
    positions = torch.arange(k.shape[2], device=q.device)
    lengths = context_lens[:, None].to(positions.dtype)
    readable = positions[None, :] < lengths  # (B, L)
    if window:  # the query is at length - 1: it sees keys after length - 1 - window
        readable &= positions[None, :] >= lengths - window
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v.to(q.dtype),
                                         attn_mask=readable[:, None, None, :], scale=scale,
                                         enable_gqa=True)  # (B, H, 1, D)
    return out.squeeze(2)


def decode_attention_flex(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor,
                          scale: float, *, window: int | None = None) -> torch.Tensor:
    """The same decode through FlexAttention (a cross-check of the other two)."""
    from torch.nn.attention.flex_attention import flex_attention

    k, v = _gather(k_pool, block_tables), _gather(v_pool, block_tables)  # (B, KvH, L, D)
    lengths = context_lens.to(torch.int64)
    oldest = lengths - window if window else torch.zeros_like(lengths)

    def within_context(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor,
                       q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        seen = (kv_idx < lengths[b]) & (kv_idx >= oldest[b])
        return torch.where(seen, score, -float("inf"))

    out = flex_attention(q.unsqueeze(2), k, v.to(q.dtype), score_mod=within_context,
                         scale=scale, enable_gqa=True)
    return out.squeeze(2)  # type: ignore[union-attr]


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                      block_tables: torch.Tensor, segments: tuple[Segment, ...],
                      scale: float, *, window: int | None = None) -> torch.Tensor:
    """Each request's chunk over its pages so far, causal: q (N, H, D) -> (N, H, D).

    A chunk of `n` queries over `c` readable tokens sees its cached prefix whole and
    itself causally: query i (position c - n + i) reads keys 0 .. c - n + i (with a
    window, only the last `window` of them).
    """
    out = torch.empty_like(q)
    page_size = k_pool.shape[1]
    for seg in segments:
        pages = block_tables[seg.row, :math.ceil(seg.context_len / page_size)].long()
        k = k_pool.index_select(0, pages).flatten(0, 1)[:seg.context_len]  # (c, KvH, D)
        v = v_pool.index_select(0, pages).flatten(0, 1)[:seg.context_len]
        chunk = q[seg.query_start:seg.query_start + seg.query_len]  # (n, H, D)
        causal = seg.context_len == seg.query_len and not window
        mask = None if causal else _prefill_mask(seg.query_len, seg.context_len, window,
                                                 q.device)
        att = F.scaled_dot_product_attention(
            chunk.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=True)  # (1, H, n, D)
        out[seg.query_start:seg.query_start + seg.query_len] = att[0].transpose(0, 1)
    return out


def _prefill_mask(queries: int, keys: int, window: int | None, device: torch.device
                  ) -> torch.Tensor:
    """(queries, keys) bool: the last `queries` positions of `keys`, causal (windowed)."""
    ones = torch.ones(queries, keys, dtype=torch.bool, device=device)
    offset = keys - queries
    mask = ones.tril(offset)
    if window:
        mask &= ~ones.tril(offset - window)
    return mask
