"""The reference generator: no KV cache, every prefix recomputed for every token.

This is the first engine's loop, kept behind the `Generator` interface for two uses:
`make bench` measures the KV-cached backend against it in the same run, and it is the
documented fallback (`AJET_ENGINE_GENERATION=recompute`) for a checkpoint the
continuous-batching engine cannot serve. One thread owns the model for inference;
between decoding steps requests join the batch and finished ones leave, and each step
samples one token for every active row (`policy.sample_tokens`).

The loop holds its step lock (and the policy lock the learner also takes) for one
decoding step at a time, and `pause()` holds the step lock until `resume()`, so an update
never runs in the middle of a forward pass. With no cache there is nothing stale to drop
after an update: the next step simply reads the new weights.
"""

from __future__ import annotations

import logging
import queue
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
    ReplyText,
    effective_sampling,
    token_budget,
)
from ajet.engine.policy import Policy, sample_tokens

__all__ = ["RecomputeGenerator"]

log = logging.getLogger(__name__)


@dataclass
class _Row:
    handle: GenerationHandle
    reply: ReplyText
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def request(self) -> GenerationRequest:
        return self.handle.request


class RecomputeGenerator(Generator):
    """`submit` from any thread; `start`/`stop`/`pause`/`resume` from the owner."""

    def __init__(self, policy: Policy, *, temperature: float, top_p: float, max_batch: int,
                 seed: int) -> None:
        self.policy = policy
        self.temperature = temperature
        self.top_p = top_p
        self.max_batch = max_batch
        self._generator = torch.Generator().manual_seed(seed)
        self._queue: queue.Queue[GenerationHandle] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ajet-recompute", daemon=True)
        #: held by the loop for one step at a time, and by pause() until resume()
        self._step_lock = threading.Lock()
        self._paused = False
        self.tokens_generated = 0
        self.requests = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while True:  # fail what never started, so no caller waits forever
            try:
                handle = self._queue.get_nowait()
            except queue.Empty:
                break
            handle.finish(GenerationInterrupted("the engine is shutting down"))

    def validate(self, request: GenerationRequest) -> None:
        token_budget(request, max_positions=self.policy.max_positions, capacity=None)

    def submit(self, request: GenerationRequest) -> GenerationHandle:
        if self._stop.is_set():
            raise RuntimeError("the engine is shutting down")
        self.validate(request)
        handle = GenerationHandle(request)
        self.requests += 1
        self._queue.put(handle)
        return handle

    def pause(self) -> None:
        if not self._paused:
            self._step_lock.acquire()
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._step_lock.release()

    def stats(self) -> dict[str, Any]:
        return {"backend": "recompute", "requests": self.requests,
                "tokens": self.tokens_generated}

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        active: list[_Row] = []
        while not self._stop.is_set():
            if not active:
                try:
                    active.append(self._row(self._queue.get(timeout=0.2)))
                except queue.Empty:
                    continue
            while len(active) < self.max_batch:  # rows join between decoding steps
                try:
                    active.append(self._row(self._queue.get_nowait()))
                except queue.Empty:
                    break
            active = [row for row in active if not row.handle.done]  # cancelled
            if not active:
                continue
            try:
                active = self._decode_step(active)
            except Exception as exc:  # a failed step fails its rows, never the thread
                log.exception("generation step failed for %d request(s)", len(active))
                for row in active:
                    row.handle.finish(exc)
                active = []
        for row in active:
            row.handle.finish(GenerationInterrupted("the engine is shutting down"))

    def _row(self, handle: GenerationHandle) -> _Row:
        return _Row(handle, ReplyText(self.policy.decode, handle.request.stop))

    def _decode_step(self, rows: list[_Row]) -> list[_Row]:
        # one forward pass per sampling setting: rows of eval episodes may ask for their own
        by_setting: dict[tuple[float, float], list[_Row]] = {}
        for row in rows:
            setting = effective_sampling(row.request, self.temperature, self.top_p)
            by_setting.setdefault(setting, []).append(row)
        with self._step_lock, self.policy.lock:
            sampled = [(group, sample_tokens(
                self.policy, [row.request.prompt_ids + row.response_ids for row in group],
                temperature=temperature, top_p=top_p, generator=self._generator))
                for (temperature, top_p), group in by_setting.items()]
        self.tokens_generated += len(rows)
        for group, (tokens, logprobs) in sampled:
            for row, token, logprob in zip(group, tokens, logprobs, strict=True):
                row.response_ids.append(token)
                row.logprobs.append(logprob)
                self._advance(row, token)
        return [row for row in rows if not row.handle.done]

    def _advance(self, row: _Row, token: int) -> None:
        """Stream new text; finish the row when it is done."""
        done: str | None = None
        delta = row.reply.update(row.response_ids)
        if token in self.policy.eos_ids or row.reply.stopped:
            done = "stop"
        elif (len(row.response_ids) >= row.request.max_new_tokens
              or len(row.request.prompt_ids) + len(row.response_ids) >= self.policy.max_positions):
            done = "length"
        if done is not None:
            delta += row.reply.update(row.response_ids, done=True)
        row.handle.delta(delta)
        if done is not None:
            row.handle.finish(GenerationResult(
                prompt_ids=row.request.prompt_ids, response_ids=row.response_ids,
                logprobs=row.logprobs, text=row.reply.text, finish_reason=done))
