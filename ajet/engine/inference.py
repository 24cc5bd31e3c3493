"""The generation thread: serves chat completions with continuous batching.

Requests from the private channel's handlers are queued here; one thread owns the
model for inference and, between decoding steps, lets new requests join the batch and
finished ones leave. Each step samples one token for every active row
(`policy.sample_tokens`), so rollout workers that chat at the same time share forward
passes. Results and streamed text deltas are handed back through callbacks, which the
caller makes thread-safe (the FastAPI side uses `loop.call_soon_threadsafe`).

The policy lock is held for one decoding step at a time, so an update never runs in
the middle of a forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ajet.engine.policy import Policy, sample_tokens

__all__ = ["GenerationRequest", "GenerationResult", "InferenceService"]

log = logging.getLogger(__name__)

_GREEDY_TEMPERATURE = 1e-5


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (eos or a stop string) or "length"


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    on_done: Callable[[GenerationResult | BaseException], None]
    on_delta: Callable[[str], None] | None = None
    stop: tuple[str, ...] = ()
    #: None = the run's setting; set only for `eval` episodes (0 = greedy)
    temperature: float | None = None
    top_p: float | None = None


@dataclass
class _Row:
    request: GenerationRequest
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    emitted: int = 0  # characters of text already passed to on_delta


class InferenceService:
    """Owns the decoding loop; `submit` from any thread, `start`/`stop` from the owner."""

    def __init__(self, policy: Policy, *, temperature: float, top_p: float, max_batch: int,
                 seed: int) -> None:
        self.policy = policy
        self.temperature = temperature
        self.top_p = top_p
        self.max_batch = max_batch
        self._generator = torch.Generator().manual_seed(seed)
        self._queue: queue.Queue[GenerationRequest] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ajet-inference", daemon=True)
        self.tokens_generated = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        while True:  # fail what never started, so no caller waits forever
            try:
                request = self._queue.get_nowait()
            except queue.Empty:
                break
            request.on_done(RuntimeError("the engine is shutting down"))

    def submit(self, request: GenerationRequest) -> None:
        if self._stop.is_set():
            raise RuntimeError("the engine is shutting down")
        self._queue.put(request)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        active: list[_Row] = []
        while not self._stop.is_set():
            if not active:
                try:
                    active.append(_Row(self._queue.get(timeout=0.2)))
                except queue.Empty:
                    continue
            while len(active) < self.max_batch:  # rows join between decoding steps
                try:
                    active.append(_Row(self._queue.get_nowait()))
                except queue.Empty:
                    break
            try:
                active = self._decode_step(active)
            except Exception as exc:  # a failed step fails its rows, never the thread
                log.exception("generation step failed for %d request(s)", len(active))
                for row in active:
                    row.request.on_done(exc)
                active = []
        for row in active:
            row.request.on_done(RuntimeError("the engine is shutting down"))

    def _decode_step(self, rows: list[_Row]) -> list[_Row]:
        # one forward pass per sampling setting: rows of eval episodes may ask for their own
        by_setting: dict[tuple[float, float], list[_Row]] = {}
        for row in rows:
            by_setting.setdefault(self._setting(row.request), []).append(row)
        sampled: dict[int, tuple[int, float]] = {}
        with self.policy.lock:
            for (temperature, top_p), group in by_setting.items():
                sequences = [row.request.prompt_ids + row.response_ids for row in group]
                tokens, logprobs = sample_tokens(self.policy, sequences, temperature=temperature,
                                                 top_p=top_p, generator=self._generator)
                sampled.update({id(row): pair for row, pair in
                                zip(group, zip(tokens, logprobs, strict=True), strict=True)})
        self.tokens_generated += len(rows)
        still: list[_Row] = []
        for row in rows:
            token, logprob = sampled[id(row)]
            row.response_ids.append(token)
            row.logprobs.append(logprob)
            finish = self._advance(row, token)
            if finish is None:
                still.append(row)
            else:
                text = self._text(row)[0]
                row.request.on_done(GenerationResult(
                    prompt_ids=row.request.prompt_ids, response_ids=row.response_ids,
                    logprobs=row.logprobs, text=text, finish_reason=finish))
        return still

    def _setting(self, request: GenerationRequest) -> tuple[float, float]:
        temperature = self.temperature if request.temperature is None else request.temperature
        top_p = self.top_p if request.top_p is None else request.top_p
        # temperature 0 means greedy: a temperature this small puts all the mass on the
        # arg-max (log_softmax stays finite), without a second sampling routine
        return max(temperature, _GREEDY_TEMPERATURE), top_p

    def _advance(self, row: _Row, token: int) -> str | None:
        """Stream new text; the finish reason if the row is done, else None."""
        text, stopped = self._text(row)
        done: str | None = None
        if token in self.policy.eos_ids or stopped:
            done = "stop"
        elif (len(row.response_ids) >= row.request.max_new_tokens
              or len(row.request.prompt_ids) + len(row.response_ids) >= self.policy.max_positions):
            done = "length"
        safe = len(text)
        if done is None:
            # hold back text that may still become a stop string, or half a character
            hold = max((len(s) - 1 for s in row.request.stop), default=0)
            safe = max(row.emitted, len(text) - hold)
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
        if row.request.on_delta is not None and safe > row.emitted:
            row.request.on_delta(text[row.emitted:safe])
            row.emitted = safe
        return done

    def _text(self, row: _Row) -> tuple[str, bool]:
        """Decoded response text, cut at the first stop string; and whether one was hit."""
        text = self.policy.decode(row.response_ids)
        cut = min((i for s in row.request.stop if s and (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            return text[:cut], True
        return text, False
