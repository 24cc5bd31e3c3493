"""Paged decode attention in Triton: split-KV (FlashDecoding), GQA in one program.

`paged_decode(q, k_pool, v_pool, block_tables, context_lens, scale)` is the GPU path of
`paged_attention.decode_attention(kernel="triton")` and must match
`decode_attention_torch`: softmax(q . K^T * scale over a row's first `context_len`
tokens) . V for one new query token per request.

Shapes: q (B, H, D) after rotary embedding; k_pool and v_pool (P, page_size, KvH, D),
one layer, the new token's K/V already written; block_tables (B, max_pages) a row's
physical pages in order (entries past its end name the trash page and are never read);
context_lens (B,) tokens readable, >= 1. H = G * KvH: query head h reads kv head h // G.

Algorithm. A decode step is one query token per row, so the work is reading K and V: a
grid of (B, KvH) programs alone leaves most of a GPU idle at small batches. The grid is
(B, KvH, num_splits): each program takes one row, one kv head and one contiguous slice
of the row's block table, and loads the G query heads of that kv head together, so K
and V are read once per kv head instead of once per query head. The G rows are padded to
a block of at least 16 (`tl.dot`'s smallest M) with a mask. The program walks its
slice in blocks of BLOCK_N tokens (one block never crosses a page: BLOCK_N divides
page_size), looks each page up in the block table, and keeps an online softmax in fp32
(running max m, running sum denom, accumulator acc; base 2, with log2(e) folded into
the scale). It writes its normalised partial output acc / denom and its log-sum-exp
lse = m + log2(denom).
A second kernel (grid (B, H)) weighs the splits by exp2(lse - max lse) and sums them.

Split choice: only static shapes decide it (B, KvH, max_pages), never context_lens, so
the grid is fixed and a CUDA graph can capture the call: enough programs for about two
per SM, but no split shorter than _MIN_SPLIT_TOKENS of max_pages (a shorter one costs
more in the reduce than it saves). A split that starts past a row's context runs no
iteration and writes the neutral partial (acc 0, lse -inf), which the reduce gives
weight 0; there is no host synchronisation, no `.item()`, no data-dependent host branch.
With one split the partial is written straight into the output.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # the module is only imported for kernel == "triton"
    raise ImportError("the Triton decode kernel needs the `triton` package; install it or "
                      "use the paged decode kernel \"torch\"") from exc

__all__ = ["paged_decode"]

#: A split shorter than this (tokens of max_pages) is not worth its share of the reduce.
_MIN_SPLIT_TOKENS = 256
#: More splits than this only grow the scratch and the reduce.
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


# Values that change from step to step in eager decoding: specialising on them (== 1,
# divisible by 16) would compile a new variant for each, mid-generation.
@triton.jit(do_not_specialize=["max_pages", "pages_per_split", "stride_tb", "stride_lb",
                               "stride_lh"])
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr,
                  scale_log2, max_pages, pages_per_split,
                  stride_qb, stride_qh, stride_kp, stride_ks, stride_kh,
                  stride_vp, stride_vs, stride_vh, stride_tb,
                  stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g  # (BLOCK_G,)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)  # (BLOCK_G, D)
    q = q.to(k_ptr.dtype.element_ty)
    # Clamped to the block table so a too-long context_len cannot read past its row.
    length = tl.minimum(tl.load(lens_ptr + row), max_pages * PAGE)
    start = split * pages_per_split * PAGE
    end = tl.minimum(start + pages_per_split * PAGE, length)

    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, HEAD_DIM), tl.float32)
    for first in range(start, end, BLOCK_N):
        # int64: page * stride can pass 2**31 elements in a large pool.
        page = tl.load(tables_ptr + row * stride_tb + first // PAGE).to(tl.int64)
        offsets = first % PAGE + n  # (BLOCK_N,)
        ok = first + n < length
        k = tl.load(k_ptr + page * stride_kp + offsets[:, None] * stride_ks
                    + kv_head * stride_kh + d[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + page * stride_vp + offsets[:, None] * stride_vs
                    + kv_head * stride_vh + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # (BLOCK_G, BLOCK_N)
        s = tl.where(ok[None, :], s, float("-inf"))
        # Each block has a readable token, so m_new is finite and alpha never NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new

    empty = denom == 0.0  # a split past the row's context: the neutral partial
    out = acc / tl.where(empty, 1.0, denom)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, denom)))
    tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + split * stride_os
             + d[None, :], out, mask=g_ok[:, None])
    tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit(do_not_specialize=["splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh"])
def _reduce_kernel(part_ptr, lse_ptr, out_ptr, splits, stride_pb, stride_ph, stride_ps,
                   stride_lb, stride_lh, stride_ob, stride_oh,
                   BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + s, mask=s < splits,
                  other=float("-inf"))  # (BLOCK_S,)
    top = tl.max(lse, axis=0)
    # A row with no readable token at all (every lse -inf) gives 0, not NaN.
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    part = tl.load(part_ptr + row * stride_pb + head * stride_ph + s[:, None] * stride_ps
                   + d[None, :], mask=(s < splits)[:, None], other=0.0)  # (BLOCK_S, D)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out)


def _check(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           block_tables: torch.Tensor) -> None:
    """Refuse what the kernel's block shapes cannot take, naming the way out."""
    if q.dim() != 3 or k_pool.dim() != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"paged_decode wants q (B, H, D) and pools (P, page_size, KvH, D); "
                         f"got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, "
                         f"v_pool {tuple(v_pool.shape)}")
    _, page_size, kv_heads, head_dim = k_pool.shape
    heads = q.shape[1]
    if q.shape[2] != head_dim or heads % kv_heads or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} does not fit pools with "
                         f"{kv_heads} kv heads of size {head_dim} and block tables "
                         f"{tuple(block_tables.shape)}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"the Triton decode kernel takes head_dim 16, 32, 64, 128 or 256, not "
                         f"{head_dim}; use the paged decode kernel \"torch\"")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"the Triton decode kernel takes a page size that is a power of two "
                         f">= 16, not {page_size}; change the page size or use the paged "
                         f"decode kernel \"torch\"")


def _default_splits(batch: int, kv_heads: int, max_pages: int, page_size: int,
                    device: torch.device) -> int:
    """About two programs per SM, no split under _MIN_SPLIT_TOKENS (static shapes only)."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 64)  # the device properties are cached: no sync
    wanted = math.ceil(2 * sms / (batch * kv_heads))
    longest = math.ceil(max_pages * page_size / _MIN_SPLIT_TOKENS)
    return max(1, min(wanted, longest, _MAX_SPLITS))


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 *, num_splits: int | None = None) -> torch.Tensor:
    """One query token per request over its pages: q (B, H, D) -> (B, H, D), q's dtype.

    `num_splits` (default: from the static shapes) slices each row's block table into
    that many parts of ceil(max_pages / num_splits) pages; parts past a row's context
    cost one empty program each.
    """
    _check(q, k_pool, v_pool, block_tables)
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_pool.shape
    max_pages = block_tables.shape[1]
    if num_splits is None:
        num_splits = _default_splits(batch, kv_heads, max_pages, page_size, q.device)
        # Recount so no split is empty in every row (ceil rounding can leave a tail).
        num_splits = math.ceil(max_pages / math.ceil(max_pages / num_splits))
    if num_splits < 1:
        raise ValueError(f"paged_decode: num_splits must be >= 1, not {num_splits}")
    pages_per_split = math.ceil(max_pages / num_splits)
    # The kernels index the last dimension with stride 1.
    q = q if q.stride(2) == 1 else q.contiguous()
    k_pool = k_pool if k_pool.stride(3) == 1 else k_pool.contiguous()
    v_pool = v_pool if v_pool.stride(3) == 1 else v_pool.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    context_lens = context_lens.contiguous()  # read as lens_ptr + row
    out = torch.empty((batch, heads, head_dim), dtype=q.dtype, device=q.device)  # (B, H, D)
    if num_splits == 1:
        part = out.unsqueeze(2)  # (B, H, 1, D): the one partial is the answer
    else:
        part = torch.empty((batch, heads, num_splits, head_dim), dtype=torch.float32,
                           device=q.device)  # (B, H, S, D)
    lse = torch.empty((batch, heads, num_splits), dtype=torch.float32,
                      device=q.device)  # (B, H, S)
    group = heads // kv_heads
    # K and V tiles of at most 16 KiB each (64 tokens of bf16 at D=128): with their
    # pipelined copies at most 45 KiB of shared memory for 16-bit pools, no spills
    # (compiled for sm_80 and sm_90 up to D=256, page size 256, G=32).
    block_n = min(page_size, 64, 16384 // (head_dim * k_pool.element_size()))
    # fp32 dots run on FMA units and hold far more in registers: 4 warps spill at D=128.
    warps = 8 if k_pool.element_size() == 4 else 4
    _split_kernel[(batch, kv_heads, num_splits)](
        q, k_pool, v_pool, block_tables, context_lens, part, lse,
        float(scale) * _LOG2E, max_pages, pages_per_split,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), PAGE=page_size,
        BLOCK_N=block_n, HEAD_DIM=head_dim, num_warps=warps, num_stages=2)
    if num_splits > 1:
        _reduce_kernel[(batch, heads)](
            part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, num_warps=4)
    return out
