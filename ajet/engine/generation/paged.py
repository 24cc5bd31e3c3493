"""The paged generation backend: our own scheduler over the model's own code.

`PagedGenerator` implements `interface.Generator` with one paged KV pool allocated once
(`paged_attention.KVPool`, its pages tracked by `page_pool.PagePool`), the model's own
Hugging Face forward with a paged attention function, and on a GPU one CUDA graph per
batch-size bucket for the decode step (`paged_runner.PagedRunner`). Any causal LM whose
attention goes through transformers' attention interface works, PEFT adapters included
(unmerged: the adapters' matmuls are part of the captured step).

One scheduler thread owns the model while it serves. Each round it

1. drops cancelled requests and admits waiting ones: a request gets the pages of its
   longest ready prefix (prefix sharing, `page_pool`) plus pages for the rest of its
   prompt and all of its `max_new_tokens`, so a running request never runs out of pages
   (and nothing is ever preempted); a request whose prefix another request is computing
   right now waits for it;
2. runs one prefill chunk (up to `prefill_tokens` prompt tokens, eagerly) and one decode
   step for every request past its prompt;
3. books the tokens: stop at EOS, `max_new_tokens`, the context, or a stop string.

Text is decoded only where it is needed: incrementally for requests that stream or have
stop strings (`interface.ReplyText`), once at the end for the others.

Fresh weights, no stale KV: `pause()` waits for the round in flight, then every request
in flight restarts from its prompt if it has streamed no text yet, or ends with
`GenerationInterrupted`, and the page table forgets every prefix. The pool's memory is
kept across the update (`keep_pool`) when the memory plan says it fits beside the update,
so the CUDA graphs stay valid; `resume()` captures again only if a weight or the pool
moved. Sampling follows the engine's convention (`sampling.py`): the recorded log-prob
is log softmax(logits / T), untruncated, as the trainer computes it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ajet.engine.generation.interface import (
    GenerationHandle,
    GenerationInterrupted,
    GenerationRequest,
    GenerationResult,
    Generator,
    PolicyView,
    ReplyText,
    token_budget,
)
from ajet.engine.generation.kv_cache import MiB, PoolPlan, gpu_cache_budget, plan_paged_pool
from ajet.engine.generation.page_pool import PagePool, page_keys
from ajet.engine.generation.paged_runner import (
    DecodeRow,
    PagedRunner,
    PrefillRow,
    Sampling,
)

__all__ = ["PagedGenerator", "PagedSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PagedSettings:
    """What the pool and the steps depend on besides the model (from `EngineConfig`)."""

    max_request_tokens: int
    concurrency: int
    gpu_memory_utilization: float
    cpu_kv_cache_mb: float
    #: prompt tokens per prefill forward pass, on a CPU and on a GPU
    cpu_prefill_tokens: int
    gpu_prefill_tokens: int = 4096
    prefix_sharing: bool = True
    cuda_graphs: bool = True
    #: decode attention: "auto" (Triton on a GPU), "triton", "torch" or "flex"
    kernel: str = "auto"
    #: keep the pool (and the graphs) allocated across updates
    keep_pool: bool = True
    #: None: the device's (`kv_cache.PAGED_CPU_PAGE_SIZE`, `PAGED_GPU_PAGE_SIZE`)
    page_size: int | None = None

    def plan(self, model: torch.nn.Module) -> PoolPlan:
        """The pool for `model`'s device, from the memory it has now."""
        parameter = next(model.parameters())
        device = parameter.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            budget = gpu_cache_budget(total, free, self.gpu_memory_utilization)
            prefill = self.gpu_prefill_tokens
        else:
            budget, prefill = int(self.cpu_kv_cache_mb * MiB), self.cpu_prefill_tokens
        return plan_paged_pool(model.config, device=device.type,
                               dtype_bytes=parameter.element_size(),
                               max_request_tokens=self.max_request_tokens,
                               concurrency=self.concurrency, budget_bytes=budget,
                               prefill_tokens=prefill, kernel=self.kernel,
                               page_size=self.page_size)


@dataclass(eq=False)
class _Live:
    """One request on its way through the generator."""

    handle: GenerationHandle
    max_new: int
    sampling: Sampling
    #: incremental text, for requests that stream or have stop strings; else None
    reply: ReplyText | None
    tokens: list[int]
    prompt_len: int
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    #: `pages` as a page-table row for the decode step (built once, at admission)
    table: torch.Tensor | None = None
    #: tokens whose keys and values are in the pool
    computed: int = 0
    #: chain keys of its whole pages so far (prefix sharing), and how many of its
    #: pages are marked ready
    keys: list[bytes] = field(default_factory=list)
    marked: int = 0
    #: the chain keys of its prompt's whole pages, computed at its first admission
    prompt_keys: list[bytes] | None = None
    cancelled: bool = False

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def decoding(self) -> bool:
        return len(self.tokens) > self.prompt_len

    @property
    def emitted(self) -> int:
        return self.reply.emitted if self.reply is not None else 0


class PagedGenerator(Generator):
    """`submit` from any thread; `start`, `stop`, `pause`, `resume` from the owner."""

    def __init__(self, policy: PolicyView, settings: PagedSettings, *,
                 name: str = "generator") -> None:
        self._policy = policy
        self._settings = settings
        self._name = name
        self._runner: PagedRunner | None = None
        self._pages: PagePool | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Live] = collections.deque()
        self._running: list[_Live] = []
        self._paused = False
        self._closing = False
        #: a round (admission, steps, booking) is in progress in the scheduler thread
        self._busy = False
        self._admitted = 0
        self._thread = threading.Thread(target=self._serve, name=f"ajet-{name}-paged",
                                        daemon=True)
        self.counters = {"requests": 0, "tokens": 0, "prefill_tokens": 0,
                         "prefix_tokens": 0, "cancelled": 0, "restarted": 0,
                         "interrupted": 0, "failed": 0, "decode_steps": 0}

    # ------------------------------------------------------------------ Generator

    def start(self) -> None:
        model = self._policy.model_source()
        plan = self._settings.plan(model)
        log.info("%s: %s", self._name, plan.summary())
        self._runner = PagedRunner(model, plan, kernel=self._settings.kernel,
                                   cuda_graphs=self._settings.cuda_graphs)
        self._pages = PagePool(plan.pages)
        self._runner.capture_all()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._cond:
            orphans = self._running + list(self._waiting)
            self._running, self._waiting = [], collections.deque()
        for live in orphans:
            live.handle.finish(GenerationInterrupted("the engine is shutting down"))

    def validate(self, request: GenerationRequest) -> None:
        self._budget(request)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        max_new = self._budget(request)
        temperature, top_p = self._policy.sampling_for(request)
        streaming = request.on_delta is not None or bool(request.stop)
        handle = GenerationHandle(request, on_cancel=lambda h: self._cancel(live))
        live = _Live(handle=handle, max_new=max_new,
                     sampling=Sampling(temperature=temperature, top_p=top_p, top_k=0, seed=0),
                     reply=ReplyText(self._policy.decode, request.stop) if streaming else None,
                     tokens=list(request.prompt_ids), prompt_len=len(request.prompt_ids))
        with self._cond:
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self.counters["requests"] += 1
            self._waiting.append(live)
            self._cond.notify_all()
        return handle

    def pause(self) -> None:
        with self._cond:
            if self._paused:
                return
            self._paused = True
            while self._busy:
                self._cond.wait()
            caught, self._running = self._running, []
            restart = [live for live in caught if not live.handle.done and live.emitted == 0]
            interrupted = [live for live in caught
                           if not live.handle.done and live.emitted > 0]
            for live in restart:
                self._rewind(live)
            self._waiting.extendleft(reversed(restart))
            self.counters["restarted"] += len(restart)
            self.counters["interrupted"] += len(interrupted)
            if self._pages is not None:
                self._pages.reset()  # no KV computed with the old weights is read again
        for live in interrupted:
            live.handle.finish(GenerationInterrupted(
                "the policy was updated while this reply was streamed; retry the request"))
        if self._runner is not None and not self._settings.keep_pool:
            self._runner.release_pool()

    def resume(self) -> None:
        with self._cond:
            if not self._paused:
                return
        if self._runner is not None:
            self._runner.refresh(self._policy.model_source())
            self._runner.capture_all()
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            runner = self._runner.stats() if self._runner is not None else {}
            plan = self._runner.plan if self._runner is not None else None
            return {"backend": "paged", "in_flight": len(self._running),
                    "waiting": len(self._waiting), **self.counters, **runner,
                    "kv_cache_tokens": plan.tokens if plan else None,
                    "free_pages": self._pages.available if self._pages else None}

    # ------------------------------------------------------------------ requests

    def _budget(self, request: GenerationRequest) -> int:
        """The request's token budget; refuses what can never be served (longer than a
        request's share of the pool: its pages in the decode step's page table)."""
        plan = self._runner.plan if self._runner is not None else None
        return token_budget(request, max_positions=self._policy.max_positions,
                            capacity=min(plan.tokens, plan.max_request_tokens) if plan else None)

    def _cancel(self, live: _Live) -> None:
        """Another thread's cancel: the scheduler frees the pages at its next round."""
        with self._cond:
            self.counters["cancelled"] += 1
            live.cancelled = True
            if live in self._waiting:
                self._waiting.remove(live)
            self._cond.notify_all()

    def _rewind(self, live: _Live) -> None:
        """Back to its prompt, holding no pages (the pool was reset or it failed)."""
        del live.tokens[live.prompt_len:]
        live.logprobs.clear()
        live.pages, live.keys, live.computed, live.marked = [], [], 0, 0
        live.table = None
        if live.reply is not None:
            live.reply = ReplyText(self._policy.decode, live.request.stop)

    # ------------------------------------------------------------------ the scheduler

    def _serve(self) -> None:
        """The scheduler thread: rounds until stopped."""
        assert self._runner is not None
        self._runner.bind_thread()
        while True:
            with self._cond:
                while not self._closing and (self._paused or not (self._waiting
                                                                  or self._running)):
                    self._cond.wait()
                if self._closing:
                    return
                self._drop_cancelled()
                self._admit()
                prefill = self._prefill_rows()
                decoding = [live for live in self._running if live.decoding]
                if not (prefill or decoding):  # all waiting on pages or on a prefix
                    self._cond.wait(0.05)
                    continue
                self._busy = True
            finished: list[tuple[_Live, GenerationResult | BaseException]] = []
            deltas: list[tuple[_Live, str]] = []
            try:
                self._round(prefill, decoding, finished, deltas)
            except Exception as exc:  # a failed step fails its requests, never the thread
                log.exception("%s: generation step failed for %d request(s)", self._name,
                              len(prefill) + len(decoding))
                failed = {id(live): live for live, _ in prefill}
                failed |= {id(live): live for live in decoding}
                with self._cond:
                    self.counters["failed"] += len(failed)
                    for live in failed.values():
                        self._release(live)
                        finished.append((live, RuntimeError(f"generation failed: {exc}")))
            for live, text in deltas:
                live.handle.delta(text)
            for live, outcome in finished:
                live.handle.finish(outcome)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        for live in [live for live in self._running if live.cancelled or live.handle.done]:
            self._release(live)

    def _release(self, live: _Live) -> None:
        """Out of the running set, its pages back (lock held)."""
        if live in self._running:
            self._running.remove(live)
        if live.pages and self._pages is not None:
            self._pages.release(live.pages)
        live.pages = []

    def _admit(self) -> None:
        """Waiting requests into the running set while pages and batch slots last."""
        assert self._pages is not None and self._runner is not None
        plan = self._runner.plan
        deferred: list[_Live] = []
        while self._waiting and len(self._running) < plan.max_batch:
            live = self._waiting.popleft()
            page_size = plan.page_size
            if self._settings.prefix_sharing and live.prompt_keys is None:  # once: a
                # request that waits for a prefix or for pages is looked at every round
                live.prompt_keys = page_keys(live.tokens[:live.prompt_len], page_size)
            keys = live.prompt_keys or []
            # at least the prompt's last token is computed: its logits give the first token
            shareable = keys[:(live.prompt_len - 1) // page_size]
            match = (self._pages.match(shareable) if self._settings.prefix_sharing
                     else None)
            if match is not None and match.wait:
                deferred.append(live)  # another request computes this prefix right now
                continue
            shared = match.pages if match is not None else []
            need = -(-(live.prompt_len + live.max_new) // page_size) - len(shared)
            pages = self._pages.allocate(need)
            if pages is None:
                self._waiting.appendleft(live)  # first come, first served: wait for pages
                break
            self._pages.hold(shared)
            live.pages = shared + pages
            live.table = self._runner.table_row(live.pages)
            live.keys = list(keys)
            live.computed = len(shared) * page_size
            live.marked = len(shared)
            self.counters["prefix_tokens"] += live.computed
            if self._settings.prefix_sharing:
                for index in range(len(shared), len(keys)):
                    self._pages.register(live.pages[index], keys[index], ready=False)
            self._admitted += 1
            live.sampling = _seeded(live.sampling, self._policy.seed, self._admitted)
            self._running.append(live)
        self._waiting.extendleft(reversed(deferred))

    def _prefill_rows(self) -> list[tuple[_Live, PrefillRow]]:
        """The next chunk of prompt tokens, oldest requests first."""
        assert self._runner is not None
        budget = self._runner.plan.prefill_tokens
        rows = []
        for live in self._running:
            if live.computed >= live.prompt_len or budget == 0:
                continue
            count = min(live.prompt_len - live.computed, budget)
            budget -= count
            ends = live.computed + count == live.prompt_len
            rows.append((live, PrefillRow(
                tokens=live.tokens[live.computed:live.computed + count],
                position=live.computed, pages=live.pages,
                table=live.table,  # type: ignore[arg-type]
                sampling=live.sampling if ends else None)))
        return rows

    def _round(self, prefill: list[tuple[_Live, PrefillRow]], decoding: list[_Live],
               finished: list[tuple[_Live, GenerationResult | BaseException]],
               deltas: list[tuple[_Live, str]]) -> None:
        """Run the steps, then book their tokens under the lock."""
        assert self._runner is not None
        drawn: list[tuple[_Live, int, tuple[int, float] | None]] = []
        if prefill:
            sampled = self._runner.prefill([row for _, row in prefill])
            drawn += [(live, len(row.tokens), out)
                      for (live, row), out in zip(prefill, sampled, strict=True)]
            self.counters["prefill_tokens"] += sum(len(row.tokens) for _, row in prefill)
        if decoding:
            rows = [DecodeRow(token=live.tokens[-1], position=len(live.tokens) - 1,
                              pages=live.pages, table=live.table,  # type: ignore[arg-type]
                              sampling=live.sampling, counter=len(live.logprobs))
                    for live in decoding]
            sampled_decode = self._runner.decode(rows)
            drawn += [(live, 1, out) for live, out in zip(decoding, sampled_decode,
                                                           strict=True)]
            self.counters["decode_steps"] += 1
        with self._cond:
            for live, computed, out in drawn:
                if live.cancelled or live.handle.done:
                    continue
                live.computed += computed
                self._mark_pages(live)
                if out is not None:
                    self._book(live, *out, finished, deltas)

    def _mark_pages(self, live: _Live) -> None:
        """Whole pages just computed: ready for requests waiting on them, and filed
        under their keys (a multi-turn episode's next call finds its reply pages too)."""
        if not self._settings.prefix_sharing:
            return
        assert self._pages is not None and self._runner is not None
        page_size = self._runner.plan.page_size
        full = live.computed // page_size
        if full > len(live.keys):
            live.keys += page_keys(live.tokens[:full * page_size], page_size,
                                   start=len(live.keys),
                                   previous=live.keys[-1] if live.keys else b"")
        for index in range(live.marked, full):
            self._pages.register(live.pages[index], live.keys[index], ready=True)
            self._pages.mark_ready(live.pages[index])
        live.marked = max(live.marked, full)

    def _book(self, live: _Live, token: int, logprob: float,
              finished: list[tuple[_Live, GenerationResult | BaseException]],
              deltas: list[tuple[_Live, str]]) -> None:
        """One sampled token: text, stop conditions, the result (lock held)."""
        live.tokens.append(token)
        live.logprobs.append(logprob)
        self.counters["tokens"] += 1
        stopped = False
        if live.reply is not None:  # the only requests whose text is needed per token
            deltas.append((live, live.reply.update(live.generated)))
            stopped = live.reply.stopped
        if token in self._policy.eos_ids or stopped:
            reason = "stop"
        elif (len(live.logprobs) >= live.max_new
              or len(live.tokens) >= self._policy.max_positions):
            reason = "length"
        else:
            return
        generated = live.generated
        if live.reply is not None:
            deltas.append((live, live.reply.update(generated, done=True)))
            text = live.reply.text
        else:
            text = self._policy.decode(generated)
        self._release(live)
        finished.append((live, GenerationResult(
            prompt_ids=list(live.request.prompt_ids), response_ids=generated,
            logprobs=list(live.logprobs), text=text, finish_reason=reason)))


def _seeded(sampling: Sampling, seed: int, index: int) -> Sampling:
    """The request's own noise seed: the generator's seed and its admission number."""
    mixed = (seed * 1_000_003 + index * 7_919 + 12_345) & 0x7FFFFFFF
    return dataclasses.replace(sampling, seed=mixed)
