"""The generation backend: transformers' continuous-batching engine with a paged KV cache.

`ContinuousBatchingGenerator` implements `inference.Generator` on top of
`ContinuousBatchingManager` (`model.init_continuous_batching`, transformers >= 5.17):
requests join and leave the running batch between forward passes, each one's keys and
values live in a paged KV cache, so a decoding step costs one token per request instead
of its whole prefix. Prompts that share whole pages (a GRPO group's shared prompt, the
earlier turns of a multi-turn episode) share their cache blocks.

Threads: transformers runs the forward passes in its own thread; one collector thread
of ours reads its outputs (`get_result`), turns them into text deltas and stop-string
checks (`inference.ReplyText`) and calls the request's callbacks.

Sampling follows the training convention: the recorded log-prob of each token is
log softmax(logits / T) under the run's temperature (`policy.score_responses` computes
the same), because transformers returns the log-probs of the processed distribution it
samples from. With `top_p < 1` that distribution is the nucleus renormalised, so the
recorded log-prob is log(p / Z) with Z the nucleus' mass, not the untruncated log p the
first engine recorded; the update's first-epoch ratio is then Z <= 1 instead of 1. With
the default `top_p = 1` the two are the same. Requests may set their own temperature and
top_p (eval episodes), through transformers' per-request logits processors; temperature
0 means greedy (`inference.MIN_TEMPERATURE`).

Fresh weights, no stale KV: `pause()` stops the manager, which discards its KV cache and
its prefix-sharing table with it, and `resume()` builds a new manager (and a new cache,
planned again by `kv_cache`) on the model's current weights. Nothing computed before an
update is ever read after it. Stopping rather than pausing transformers' loop also
frees the cache's memory for the update's activations, and works on every transformers
version with continuous batching (`ContinuousBatchingManager.pause` arrived later); the
price is rebuilding the cache once per step, milliseconds on CPU. Requests in flight at
`pause()` restart from their prompt after `resume()` when they have streamed no text
yet; the others end with `GenerationInterrupted` (in training they belong to episodes
that already closed, because an update starts only once every claimed episode ended).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from dataclasses import dataclass
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
from ajet.engine.generation.kv_cache import (
    CachePlan,
    ModelGeometry,
    plan_cpu_cache,
    plan_gpu_cache,
)

__all__ = ["MIN_TRANSFORMERS", "CacheSettings", "ContinuousBatchingGenerator",
           "require_continuous_batching"]

log = logging.getLogger(__name__)

#: The oldest transformers whose continuous-batching API this module uses.
MIN_TRANSFORMERS = "5.17"
#: How long the collector waits for an output before it checks the manager's health.
_POLL_S = 0.05


def require_continuous_batching() -> None:
    """Raise a clear error when the installed transformers is too old."""
    import transformers
    from packaging.version import Version

    found = Version(transformers.__version__)
    if found < Version(MIN_TRANSFORMERS):
        raise RuntimeError(
            f"KV-cached continuous batching needs transformers >= {MIN_TRANSFORMERS}; this "
            f"engine has {transformers.__version__}. Upgrade transformers on the engine's "
            "machine (pip install 'transformers>=5.17'), or run the slow reference generator "
            "with AJET_ENGINE_GENERATION=recompute")


@dataclass(frozen=True)
class CacheSettings:
    """What the KV cache plan depends on besides the model (from `EngineConfig`)."""

    max_request_tokens: int
    concurrency: int
    gpu_memory_utilization: float
    cpu_kv_cache_mb: float
    cpu_max_batch_tokens: int
    prefix_sharing: bool = True
    #: transformers' own CUDA graphs for its step (None: transformers decides); the
    #: GPU benchmark's A/B (bench/gpu_generation.py)
    use_cuda_graph: bool | None = None

    def plan(self, model: torch.nn.Module) -> CachePlan:
        """The plan for `model`'s device, from the memory it has now."""
        geometry = ModelGeometry.from_config(model.config)
        dtype_bytes = next(model.parameters()).element_size()
        device = next(model.parameters()).device
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the update's activations are free again
            free, total = torch.cuda.mem_get_info(device)
            return plan_gpu_cache(geometry, dtype_bytes=dtype_bytes,
                                  max_request_tokens=self.max_request_tokens,
                                  concurrency=self.concurrency, total_bytes=total,
                                  free_bytes=free,
                                  gpu_memory_utilization=self.gpu_memory_utilization)
        return plan_cpu_cache(geometry, dtype_bytes=dtype_bytes,
                              max_request_tokens=self.max_request_tokens,
                              concurrency=self.concurrency, budget_mb=self.cpu_kv_cache_mb,
                              max_batch_tokens=self.cpu_max_batch_tokens)


@dataclass(eq=False)
class _Live:
    """One request on its way through the generator."""

    request: GenerationRequest
    reply: ReplyText
    #: stream outputs token by token (needed for deltas and for stop strings)
    streaming: bool
    #: tokens it may generate (the request's, within the model's context)
    max_new: int
    handle: GenerationHandle | None = None
    #: transformers' request id while it is inside a manager
    rid: str | None = None


class ContinuousBatchingGenerator(Generator):
    """`submit` from any thread; `start`, `stop`, `pause`, `resume` from the owner."""

    def __init__(self, policy: PolicyView, cache: CacheSettings, *,
                 name: str = "generator") -> None:
        require_continuous_batching()
        self._policy = policy
        self._cache = cache
        self._name = name
        self._lock = threading.Condition()
        #: serialises building managers (the owner's resume, the collector's recovery)
        self._open_lock = threading.Lock()
        self._manager: Any | None = None
        #: set by pause(), cleared by resume(): no manager may start in between
        self._paused = False
        self._plan: CachePlan | None = None
        self._closing = False
        self._live: dict[str, _Live] = {}
        self._waiting: collections.deque[_Live] = collections.deque()
        self._epoch = 0
        self._ids = itertools.count()
        self._collector = threading.Thread(target=self._collect, name=f"ajet-{name}-outputs",
                                           daemon=True)
        self.counters = {"requests": 0, "tokens": 0, "cancelled": 0, "restarted": 0,
                         "interrupted": 0, "failed": 0, "cache_rebuilds": 0}

    # ------------------------------------------------------------------ Generator

    def start(self) -> None:
        self._reopen()
        self._collector.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closing = True
            manager, self._manager = self._manager, None
            orphans = list(self._live.values()) + list(self._waiting)
            self._live.clear()
            self._waiting.clear()
            self._lock.notify_all()
        if manager is not None:
            self._close_manager(manager, timeout=timeout)
        for live in orphans:
            self._finish(live, GenerationInterrupted("the engine is shutting down"))
        if self._collector.is_alive():
            self._collector.join(timeout)

    def validate(self, request: GenerationRequest) -> None:
        self._budget(request)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        max_new = self._budget(request)
        streaming = request.on_delta is not None or bool(request.stop)
        live = _Live(request=request, reply=ReplyText(self._policy.decode, request.stop),
                     streaming=streaming, max_new=max_new)
        live.handle = GenerationHandle(request, on_cancel=lambda _h: self._cancel(live))
        with self._lock:
            if self._closing:
                raise RuntimeError("the engine is shutting down")
            self.counters["requests"] += 1
            if self._manager is None:  # paused: starts after resume
                self._waiting.append(live)
            else:
                self._add(live)
        return live.handle

    def pause(self) -> None:
        with self._lock:
            self._paused = True
            manager, self._manager = self._manager, None
            caught = list(self._live.values())
            self._live.clear()
        if manager is None:
            return
        self._close_manager(manager)
        restart: list[_Live] = []
        for live in caught:
            if live.reply.emitted == 0 and not live.handle.done:  # type: ignore[union-attr]
                live.reply = ReplyText(self._policy.decode, live.request.stop)
                restart.append(live)
            else:
                self.counters["interrupted"] += 1
                self._finish(live, GenerationInterrupted(
                    "the policy was updated while this reply was streamed; retry the request"))
        with self._lock:
            self.counters["restarted"] += len(restart)
            self._waiting.extendleft(reversed(restart))

    def resume(self) -> None:
        with self._lock:
            self._paused = False
        self._reopen()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"backend": "continuous_batching", "in_flight": len(self._live),
                    "waiting": len(self._waiting), **self.counters,
                    "kv_cache_tokens": self._plan.tokens if self._plan else None}

    # ------------------------------------------------------------------ requests

    def _budget(self, request: GenerationRequest) -> int:
        """The request's token budget; refuses what can never be served."""
        return token_budget(request, max_positions=self._policy.max_positions,
                            capacity=self._plan.tokens if self._plan is not None else None)

    def _add(self, live: _Live) -> None:
        """Hand `live` to the current manager (lock held)."""
        manager = self._manager
        assert manager is not None  # the callers checked, under the same lock
        live.rid = f"{self._epoch}-{next(self._ids)}"
        self._live[live.rid] = live
        temperature, top_p = self._policy.sampling_for(live.request)
        overrides: dict[str, float] = {}
        if temperature != self._policy.temperature:
            overrides["temperature"] = temperature
        if top_p != self._policy.top_p:
            overrides["top_p"] = top_p
        added = manager.add_request(
            list(live.request.prompt_ids), request_id=live.rid,
            max_new_tokens=live.max_new, streaming=live.streaming,
            eos_token_id=sorted(self._policy.eos_ids), **overrides)
        if added is None:  # the manager stopped accepting (it crashed): the collector
            del self._live[live.rid]  # restarts it; this request waits for that
            live.rid = None
            self._waiting.append(live)

    def _cancel(self, live: _Live) -> None:
        with self._lock:
            self.counters["cancelled"] += 1
            if live.rid is not None and self._live.pop(live.rid, None) is not None:
                if self._manager is not None:
                    self._manager.cancel_request(live.rid)  # frees its KV blocks
            elif live in self._waiting:
                self._waiting.remove(live)

    def _finish(self, live: _Live, outcome: GenerationResult | BaseException) -> None:
        if isinstance(outcome, BaseException) and not isinstance(outcome,
                                                                 GenerationInterrupted):
            self.counters["failed"] += 1
        live.handle.finish(outcome)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ outputs

    def _collect(self) -> None:
        """The collector thread: outputs -> deltas, stop strings, results."""
        while True:
            with self._lock:
                while self._manager is None and not self._closing:
                    self._lock.wait()
                if self._closing:
                    return
                manager = self._manager
            output = manager.get_result(timeout=_POLL_S)
            if output is not None:
                self._deliver(manager, output)
            elif not manager.is_running():
                self._recover(manager)

    def _deliver(self, manager: Any, output: Any) -> None:
        """One output: the bookkeeping under the lock (so a pause sees it whole or not at
        all), the callbacks after it."""
        outcome: GenerationResult | BaseException | None = None
        stop_early = False
        with self._lock:
            live = self._live.get(output.request_id)
            if live is None:
                return  # cancelled, stopped by a stop string, or from a closed manager
            if output.error is not None:
                del self._live[output.request_id]
                log.warning("%s: request %s failed: %s", self._name, output.request_id,
                            output.error)
                outcome, delta = RuntimeError(f"generation failed: {output.error}"), ""
            else:
                tokens = list(output.generated_tokens)
                finished = output.is_finished()
                delta = live.reply.update(tokens, done=finished) if live.streaming else ""
                if live.reply.stopped and not finished:  # a stop string: the rest of the
                    stop_early = finished = True  # reply is not needed
                if finished:
                    del self._live[output.request_id]
                    if not live.streaming:
                        live.reply.update(tokens, done=True)
                    self.counters["tokens"] += len(tokens)
                    ended = live.reply.stopped or (tokens and tokens[-1] in self._policy.eos_ids)
                    reason = "stop" if ended else "length"
                    outcome = GenerationResult(
                        prompt_ids=list(live.request.prompt_ids), response_ids=tokens,
                        logprobs=[float(x) for x in output.logprobs[:len(tokens)]],
                        text=live.reply.text, finish_reason=reason)
        if stop_early:
            manager.cancel_request(output.request_id)
        live.handle.delta(delta)  # type: ignore[union-attr]
        if outcome is not None:
            self._finish(live, outcome)

    def _recover(self, manager: Any) -> None:
        """transformers' loop died (logged by transformers): fail its requests, restart."""
        with self._lock:
            if self._manager is not manager:
                return  # paused or stopped meanwhile: not a crash
            self._manager = None
            lost = list(self._live.values())
            self._live.clear()
        log.error("%s: the continuous-batching loop stopped unexpectedly; failing %d "
                  "request(s) and starting a fresh one", self._name, len(lost))
        self._close_manager(manager)
        for live in lost:
            self._finish(live, RuntimeError("the generation loop failed; see the engine log"))
        self._reopen()

    def _reopen(self) -> None:
        """Start a manager unless one runs, or the owner paused or stopped us."""
        with self._lock:
            if self._manager is not None or self._closing or self._paused:
                return
        with self._open_lock:
            manager = self._open_manager()
        with self._lock:
            install = self._manager is None and not (self._closing or self._paused)
            if install:
                self._manager = manager
                while self._waiting:
                    self._add(self._waiting.popleft())
                self._lock.notify_all()
        if not install:
            self._close_manager(manager)

    # ------------------------------------------------------------------ managers

    def _open_manager(self) -> Any:
        """A started manager with a fresh KV cache on the model's current weights."""
        from transformers import ContinuousBatchingConfig, GenerationConfig

        policy = self._policy
        model = policy.model_source()
        plan = self._cache.plan(model)
        if plan != self._plan:
            log.info("%s: %s", self._name, plan.summary())
        self._plan = plan
        self._epoch += 1
        self.counters["cache_rebuilds"] += 1
        cb = ContinuousBatchingConfig(
            num_blocks=plan.num_blocks, max_batch_tokens=plan.max_batch_tokens,
            max_memory_percent=plan.max_memory_percent,
            max_requests_per_batch=plan.max_requests_per_batch,
            allow_block_sharing=self._cache.prefix_sharing, return_logprobs=True,
            per_request_processors=True,
            **({} if self._cache.use_cuda_graph is None
               else {"use_cuda_graph": self._cache.use_cuda_graph}),
            # a new seed per manager: one per step, so steps do not replay the same draws
            # (transformers adds the data-parallel rank, so ranks differ too)
            seed=policy.seed + 7919 * self._epoch, **_page_size(ContinuousBatchingConfig,
                                                                plan.page_size))
        generation = GenerationConfig(
            do_sample=True, temperature=policy.temperature, top_p=policy.top_p, top_k=0,
            eos_token_id=sorted(policy.eos_ids), max_new_tokens=plan.max_request_tokens)
        manager = model.init_continuous_batching(generation_config=generation,
                                                 continuous_batching_config=cb)
        # Both samplers are always present, so a request may set its own temperature or
        # top_p (transformers leaves out a processor whose value is 1.0, and then refuses
        # per-request values for it). At 1.0 they change no probability.
        manager.logit_processor = _samplers(policy.temperature, policy.top_p)
        manager.start()
        return manager

    def _close_manager(self, manager: Any, *, timeout: float = 10.0) -> None:
        """Stop `manager` now (its KV cache goes with it) and release the memory."""
        # cancelling an unknown id wakes transformers' idle loop, which would otherwise
        # notice the stop only at its next 0.1 s poll
        manager.cancel_request("__ajet_wake__")
        manager.stop(block=True, timeout=timeout, hard_stop=True)
        destroy = getattr(manager, "destroy", None)
        if destroy is not None:
            destroy()
        del manager
        # transformers' stop() collected garbage already (cheap after the engine's
        # gc.freeze()); hand the cache's device memory back for the update
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _samplers(temperature: float, top_p: float) -> Any:
    """Temperature and top-p with per-request values, as transformers' processor list.

    On CPU a sampler whose value is 1.0 for every row of the step is skipped: it would
    change nothing, and top-p's sort over the vocabulary costs about a millisecond a step
    on a small model (a fifth of ajet-tiny's step). On an accelerator both always run, so
    that the step has no data-dependent branch (CUDA graphs capture one path).
    """
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList,
    )

    class Samplers(ContinuousBatchingLogitsProcessorList):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor,
                     logits_processor_args: torch.Tensor) -> torch.Tensor:
            if scores.device.type != "cpu":
                return super().__call__(input_ids, scores, logits_processor_args)
            rows = scores.size(0)
            # both processors are per-request ones whose argument is a float32 per row
            for index, processor in enumerate(self.logits_processor):
                arg = logits_processor_args[index]
                if not bool((arg[:rows].view(dtype=torch.float32) == 1.0).all()):
                    scores = processor(scores, arg)
            return scores

    return Samplers(LogitsProcessorList([TemperatureLogitsWarper(temperature),
                                         TopPLogitsWarper(top_p=top_p)]),
                    per_request_processors=True, drop_unsupported_processors=True)


def _page_size(config_cls: type, page_size: int) -> dict[str, int]:
    """`page_size=` (transformers >= 5.17's name) or `block_size=` (before)."""
    fields = getattr(config_cls, "__dataclass_fields__", {})
    return {"block_size" if "page_size" not in fields else "page_size": page_size}
