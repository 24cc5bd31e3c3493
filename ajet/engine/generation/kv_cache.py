"""KV cache sizing: how many tokens of paged KV cache one rank's generator holds.

This module imports no torch: it turns numbers (the model's geometry from `config.json`,
the job, the memory the device reports) into a `CachePlan`, so the memory planner can
use the same arithmetic ahead of time.

What the cache costs, per token it can hold (transformers' paged cache with SDPA/eager
attention, which is what runs on CPU):

    K and V for every layer       2 * layers * kv_heads * head_dim * dtype bytes
    the attention mask column     max_batch_tokens * dtype bytes  (the mask is
                                  [max_batch_tokens, cache tokens + max_batch_tokens])
    the read index                8 bytes

On CPU the mask column dominates for small models (ajet-tiny: 256 B of KV against 1 KiB
of mask per token at 256 batch tokens), so both the cache and the batch stay small: the
cache holds what `concurrency` requests of the longest allowed length need (each rounded
up to whole pages), capped by `cpu_kv_cache_mb`, and never less than one such request.

On GPU the budget is the job's `gpu_memory_utilization`, the original AgentJet's name
for vLLM's knob, read as vLLM does: the fraction of the device's total memory this
process may hold while it generates. Whatever is allocated when the cache is built
(weights, optimizer state, an inference copy) counts against it, and the cache gets the
rest, handed to transformers as `max_memory_percent` of the free memory so that its own
accounting (masks, activations, logits) decides the final block count. The generator
releases the cache before every update and plans it again afterwards, so the update's
activations may use the whole device and the optimizer state that the first step
allocates is counted from the second rollout on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "GPU_MAX_BATCH_TOKENS",
    "PAGED_CPU_PAGE_SIZE",
    "PAGED_GPU_PAGE_SIZE",
    "CachePlan",
    "CacheTooSmall",
    "ModelGeometry",
    "PoolPlan",
    "generation_concurrency",
    "gpu_cache_budget",
    "paged_working_bytes",
    "plan_cpu_cache",
    "plan_gpu_cache",
    "plan_paged_pool",
]

GiB = 1024**3
MiB = 1024**2
#: Page (block) size in tokens. Small pages waste less per request on CPU, where requests
#: are short; transformers' default on GPU, where the fast decode kernels expect it.
CPU_PAGE_SIZE = 32
GPU_PAGE_SIZE = 256
#: Tokens per forward pass on GPU when the cache is capped: transformers' own default.
#: It must be given whenever `num_blocks` is: given one of the two, transformers (5.17)
#: solves for the other so that its footprint fills `max_memory_percent`, and a solved
#: batch size preallocates attention masks and logits for tens of thousands of tokens
#: (measured on an H200: 46 GiB allocated for a 0.5B model whose plan was 13 GiB).
GPU_MAX_BATCH_TOKENS = 8192
#: Bytes per token of the read index (int64).
_INDEX_BYTES = 8


def _language_model_fields(config: Any) -> Any:
    """`get(name, default)` over a `PretrainedConfig` or a `config.json` dict, inside the
    nested language-model config of a multimodal checkpoint."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text = get("text_config")
    return _language_model_fields(text) if text else get


class CacheTooSmall(ValueError):
    """The memory left for the KV cache cannot hold one request of the longest length."""


@dataclass(frozen=True)
class ModelGeometry:
    """What the KV cache size depends on, read from a model's config."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> ModelGeometry:
        """From a `PretrainedConfig` or the dict of a `config.json`."""
        get = _language_model_fields(config)
        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim") or int(get("hidden_size")) // heads
        return cls(layers=int(get("num_hidden_layers")),
                   kv_heads=int(get("num_key_value_heads") or heads), head_dim=int(head_dim))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class CachePlan:
    """Arguments for transformers' `ContinuousBatchingConfig`, with what they mean."""

    device: str
    page_size: int
    #: Blocks of `page_size` tokens; None lets transformers fit the cache to
    #: `max_memory_percent` of the free memory.
    num_blocks: int | None
    #: Tokens in one forward pass (prefill chunks plus one per decoding request); None is
    #: transformers' default.
    max_batch_tokens: int | None
    max_memory_percent: float | None
    max_requests_per_batch: int
    #: KV bytes per cached token, and the budget the plan was made for.
    kv_bytes_per_token: int
    budget_bytes: int
    #: Longest request (prompt + response) the cache must always hold.
    max_request_tokens: int

    @property
    def tokens(self) -> int | None:
        """Planned capacity in tokens (None: decided by transformers from the budget)."""
        return None if self.num_blocks is None else self.num_blocks * self.page_size

    def summary(self) -> str:
        capacity = (f"{self.tokens} tokens ({self.tokens * self.kv_bytes_per_token / MiB:.1f} "
                    "MiB of KV)" if self.tokens is not None else
                    f"as many tokens as {self.budget_bytes / GiB:.2f} GiB hold")
        return (f"KV cache on {self.device}: {capacity}, pages of {self.page_size} tokens, "
                f"up to {self.max_batch_tokens or 'default'} tokens and "
                f"{self.max_requests_per_batch} requests per forward pass")


def gpu_cache_budget(total_bytes: int, free_bytes: int, gpu_memory_utilization: float
                     ) -> int:
    """What a GPU generator's cache may take: `gpu_memory_utilization` of the device's
    total, less what is allocated when the cache is built (read as vLLM reads its knob)."""
    return int(gpu_memory_utilization * total_bytes) - (total_bytes - free_bytes)


def generation_concurrency(max_generation_batch: int, max_in_flight: int) -> int:
    """Requests one rank's cache is sized for: the episodes open at once, at most
    `max_generation_batch` (the engine's generator and the memory planner both use it)."""
    return max(1, min(max_generation_batch, max_in_flight))


def _blocks(requests: int, request_tokens: int, page_size: int) -> int:
    """Pages for `requests` requests of `request_tokens` each: pages are not shared out
    between requests, so each one rounds up to whole pages."""
    return max(1, requests) * math.ceil(request_tokens / page_size)


def plan_cpu_cache(geometry: ModelGeometry, *, dtype_bytes: int, max_request_tokens: int,
                   concurrency: int, budget_mb: float, max_batch_tokens: int,
                   page_size: int = CPU_PAGE_SIZE) -> CachePlan:
    """The CPU cache: what `concurrency` longest requests need, within `budget_mb`."""
    kv = geometry.kv_bytes_per_token(dtype_bytes)
    per_token = kv + max_batch_tokens * dtype_bytes + _INDEX_BYTES
    budget = int(budget_mb * MiB)
    one_request = _blocks(1, max_request_tokens, page_size)
    affordable = budget // (per_token * page_size)
    blocks = max(min(_blocks(concurrency, max_request_tokens, page_size), affordable),
                 one_request)
    return CachePlan(device="cpu", page_size=page_size, num_blocks=blocks,
                     max_batch_tokens=max_batch_tokens, max_memory_percent=None,
                     max_requests_per_batch=max(1, min(concurrency, max_batch_tokens)),
                     kv_bytes_per_token=kv, budget_bytes=budget,
                     max_request_tokens=max_request_tokens)


def plan_gpu_cache(geometry: ModelGeometry, *, dtype_bytes: int, max_request_tokens: int,
                   concurrency: int, total_bytes: int, free_bytes: int,
                   gpu_memory_utilization: float, page_size: int = GPU_PAGE_SIZE) -> CachePlan:
    """The GPU cache: what `gpu_memory_utilization` of the device leaves after what is used.

    Raises `CacheTooSmall` with the numbers and the fixes when that cannot hold one
    request of `max_request_tokens`.
    """
    kv = geometry.kv_bytes_per_token(dtype_bytes)
    used = total_bytes - free_bytes
    budget = gpu_cache_budget(total_bytes, free_bytes, gpu_memory_utilization)
    one_request = max_request_tokens * kv
    # twice one request's KV: room for transformers' activations and index tensors too
    if budget < 2 * one_request:
        raise CacheTooSmall(
            f"gpu_memory_utilization={gpu_memory_utilization} allows "
            f"{gpu_memory_utilization * total_bytes / GiB:.2f} GiB of this GPU's "
            f"{total_bytes / GiB:.2f} GiB; {used / GiB:.2f} GiB is in use (weights, optimizer "
            f"state), which leaves {max(budget, 0) / GiB:.2f} GiB for the KV cache, but one "
            f"request of max_prompt_length + max_response_length = {max_request_tokens} tokens "
            f"needs {2 * one_request / GiB:.2f} GiB; raise gpu_memory_utilization, shorten "
            "max_prompt_length or max_response_length, use more GPUs or LoRA")
    need = _blocks(concurrency, max_request_tokens, page_size)
    # cap the cache at what the job can use when that is well inside the budget; otherwise
    # transformers fills the budget itself
    num_blocks = need if need * page_size * kv < budget // 2 else None
    return CachePlan(device="cuda", page_size=page_size, num_blocks=num_blocks,
                     max_batch_tokens=None if num_blocks is None else GPU_MAX_BATCH_TOKENS,
                     max_memory_percent=min(1.0, budget / max(free_bytes, 1)),
                     max_requests_per_batch=max(1, concurrency),
                     kv_bytes_per_token=kv, budget_bytes=budget,
                     max_request_tokens=max_request_tokens)


# --------------------------------------------------------------------------- the paged pool

#: Page size of the paged backend's pool (`paged.py`): the Triton decode kernel reads a
#: page per iteration and needs at least 16 rows; a small page shares more of a prompt.
PAGED_CPU_PAGE_SIZE = 16
PAGED_GPU_PAGE_SIZE = 32


@dataclass(frozen=True)
class PoolPlan:
    """The paged backend's KV pool: allocated once, with what it was sized for."""

    device: str
    geometry: ModelGeometry
    page_size: int
    #: pages requests may hold (the pool has one trash page more)
    pages: int
    kv_bytes_per_token: int
    max_request_tokens: int
    #: most requests decoding together: the largest CUDA graph bucket
    max_batch: int
    #: tokens per prefill forward pass
    prefill_tokens: int
    #: the budget the pool was sized within, and the steps' working tensors (graph pool,
    #: prefill scratch: `paged_working_bytes`), which on a GPU come out of that budget
    budget_bytes: int
    working_bytes: int

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def pool_bytes(self) -> int:
        return (self.pages + 1) * self.page_size * self.kv_bytes_per_token

    def summary(self) -> str:
        return (f"paged KV pool on {self.device}: {self.tokens} tokens in {self.pages} pages of "
                f"{self.page_size} ({self.pool_bytes / MiB:.1f} MiB), up to {self.max_batch} "
                f"requests per decode step, {self.prefill_tokens}-token prefill chunks, "
                f"{self.working_bytes / MiB:.0f} MiB for the steps' working tensors")


def plan_paged_pool(config: Any, *, device: str, dtype_bytes: int, max_request_tokens: int,
                    concurrency: int, budget_bytes: int, prefill_tokens: int, kernel: str,
                    page_size: int | None = None) -> PoolPlan:
    """The pool: what `concurrency` longest requests need, within `budget_bytes`, and
    never less than one such request; the generator and the memory planner both call it.

    `config` is the model's `PretrainedConfig` or `config.json` dict. On a GPU the budget
    is `gpu_memory_utilization` of the device less what is allocated (as
    `plan_gpu_cache`), and the steps' working tensors (`paged_working_bytes`) come out of
    it; on a CPU it is `cpu_kv_cache_mb`, for the pool alone. The pool needs no attention
    mask, so unlike transformers' cache it costs only its keys and values. Raises
    `CacheTooSmall` with the numbers when not even one request fits.
    """
    on_gpu = device == "cuda"
    page = page_size or (PAGED_GPU_PAGE_SIZE if on_gpu else PAGED_CPU_PAGE_SIZE)
    geometry = ModelGeometry.from_config(config)
    # the torch kernel (every CPU, or forced) gathers each row's pages; Triton does not
    working = paged_working_bytes(config, dtype_bytes=dtype_bytes, max_batch=concurrency,
                                  prefill_tokens=prefill_tokens,
                                  max_request_tokens=max_request_tokens, page_size=page,
                                  gathered=not on_gpu or kernel == "torch")
    reserved = working if on_gpu else 0
    kv = geometry.kv_bytes_per_token(dtype_bytes)
    one_request = _blocks(1, max_request_tokens, page)
    affordable = (budget_bytes - reserved) // (kv * page) - 1  # less the trash page
    if affordable < one_request:
        raise CacheTooSmall(
            f"the paged KV pool gets {max(budget_bytes - reserved, 0) / GiB:.2f} GiB "
            f"({budget_bytes / GiB:.2f} GiB budget less {reserved / GiB:.2f} GiB for "
            f"the decode and prefill working tensors), but one request of "
            f"max_prompt_length + max_response_length = {max_request_tokens} tokens needs "
            f"{(one_request + 1) * page * kv / GiB:.2f} GiB; raise gpu_memory_utilization "
            "(GPU) or cpu_kv_cache_mb (CPU), or shorten max_prompt_length or "
            "max_response_length")
    pages = min(_blocks(concurrency, max_request_tokens, page), affordable)
    return PoolPlan(device=device, geometry=geometry, page_size=page, pages=pages,
                    kv_bytes_per_token=kv, max_request_tokens=max_request_tokens,
                    max_batch=max(1, concurrency), prefill_tokens=prefill_tokens,
                    budget_bytes=budget_bytes, working_bytes=working)


#: Bytes per (row, vocabulary id) of the decode step's sampling: the logits in the compute
#: dtype and in fp32, the scaled logits, their log-softmax, the noise's int64 hash rounds
#: and its floats; with top-p the sort's values and order, the cumulative mass and the
#: scatter back (sampling.py).
_SAMPLING_BYTES_PER_LOGIT = 4 * 5 + 8 * 3
_TRUNCATION_BYTES_PER_LOGIT = 4 * 4 + 8 + 1


def paged_working_bytes(config: Any, *, dtype_bytes: int, max_batch: int,
                        prefill_tokens: int, max_request_tokens: int, page_size: int,
                        gathered: bool) -> int:
    """What the paged backend's steps hold besides weights and pool: the larger of the
    decode step at `max_batch` rows (its CUDA graph pool) and a prefill chunk.

    Decode: sampling over the vocabulary for every row (the larger, top-p family), one
    layer's activations, and the attention's scratch: the split-KV partials of the
    Triton kernel, or with `gathered` (the torch kernel) every row's keys and values
    gathered to the longest request. Prefill: one layer's activations for the chunk,
    the keys and values of one request's whole context gathered, and the output head on
    the rows it samples. `config` is a `PretrainedConfig` or a `config.json` dict.
    """
    get = _language_model_fields(config)
    geometry = ModelGeometry.from_config(config)
    hidden, vocab = int(get("hidden_size")), int(get("vocab_size"))
    heads = int(get("num_attention_heads"))
    intermediate = int(get("intermediate_size") or 4 * hidden)
    a = dtype_bytes
    per_token = a * (4 * hidden + 3 * intermediate
                     + (heads + 2 * geometry.kv_heads) * geometry.head_dim)
    context = -(-max_request_tokens // page_size) * page_size
    kv_read = 2 * geometry.kv_heads * geometry.head_dim * a
    per_row = vocab * (_SAMPLING_BYTES_PER_LOGIT + _TRUNCATION_BYTES_PER_LOGIT)
    sampling = max_batch * per_row
    splits = max(1, context // page_size)
    attention = (max_batch * context * kv_read if gathered
                 else max_batch * heads * min(splits, 64) * (geometry.head_dim + 2) * 4)
    decode = sampling + max_batch * per_token + attention
    prefill = (prefill_tokens * per_token + context * kv_read
               + min(prefill_tokens, max_batch) * per_row)
    return int(max(decode, prefill))
