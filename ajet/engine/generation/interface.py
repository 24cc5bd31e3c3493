"""The generation interface: what the episode plane asks of whatever generates tokens.

The chat routes (`plane/openai_api.py`, `plane/responses_api.py`) build a
`GenerationRequest` and hand it to a `Generator`; its deltas and its one
`GenerationResult` come back through the request's callbacks.
Behind the interface sits one backend module (the job's `generation_backend`):

    paged.py                 our paged KV pool, scheduler and CUDA-graphed decode step
                             over the model's own Hugging Face code (docs/generation.md)
    continuous_batching.py   transformers' continuous-batching engine: paged KV cache,
                             requests join and leave between forward passes
    recompute.py             the first engine's loop, recomputing every prefix per token;
                             kept as the benchmark's reference and as a fallback
                             (`AJET_ENGINE_GENERATION=recompute`)
    ranks.py                 every rank generates: rank 0 routes each episode to one rank

A vLLM backend would be one more module implementing `Generator`; the episode plane and
the trainer only see this file. Nothing here imports torch, so the interface (and the
text and stop-string handling shared by the backends) loads anywhere.

Contract of a `Generator`, for backends and callers alike:

- `submit` may be called from any thread and returns at once. It raises
  `GenerationRefused` (a `ValueError`) for a request no backend state could serve (a
  prompt longer than the model's context or the KV cache), `RuntimeError` when stopped.
- `on_delta` receives the reply's text in order, holding back what may still turn into a
  stop string; `on_done` is called exactly once, with the `GenerationResult` or with an
  exception: `GenerationCancelled` after `cancel()`, `GenerationInterrupted` when a policy
  update or a shutdown cut the reply short, any other exception when generation failed.
  Callbacks run on a backend thread: they must be quick and thread-safe.
- `pause()` returns once no forward pass runs and none will until `resume()`: the trainer
  updates the weights in between. After `resume()` nothing computed with the old weights
  is reused (no KV cache block, no half-generated reply). Requests submitted while paused
  wait and start after `resume()`; requests caught in flight restart from their prompt if
  they had not streamed any text yet, and are interrupted otherwise.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ajet.engine.policy import Policy

__all__ = [
    "GenerationCancelled",
    "GenerationHandle",
    "GenerationInterrupted",
    "GenerationRefused",
    "GenerationRequest",
    "GenerationResult",
    "Generator",
    "MIN_TEMPERATURE",
    "PolicyView",
    "ReplyText",
    "effective_sampling",
    "token_budget",
]

#: A request's temperature 0 (greedy, in OpenAI's convention) samples from
#: softmax(logits / MIN_TEMPERATURE): a temperature this small puts all the mass on the
#: arg-max (log_softmax stays finite), without a second sampling routine.
MIN_TEMPERATURE = 1e-5


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (eos or a stop string) or "length"


def _unobserved(_: GenerationResult | BaseException) -> None:
    """`on_done` of a request nobody has attached to yet (the plane sets its own)."""


@dataclass
class GenerationRequest:
    """What to generate, and where its deltas and result go.

    The episode plane builds one from a chat with the callbacks unset, then attaches its
    own (`serving.start_generation`, with `dataclasses.replace`) when it submits it.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    on_done: Callable[[GenerationResult | BaseException], None] = _unobserved
    on_delta: Callable[[str], None] | None = None
    stop: tuple[str, ...] = ()
    #: None = the run's setting; set only for `eval` episodes (0 = greedy)
    temperature: float | None = None
    top_p: float | None = None
    #: Requests with the same session (the episode uuid) go to the same rank, so a
    #: multi-turn episode finds its conversation in that rank's prefix cache.
    session: str | None = None


class GenerationRefused(ValueError):
    """The request cannot be served at all (too long for the context or the KV cache)."""


class GenerationCancelled(Exception):
    """`on_done` of a request whose handle was cancelled (client gone, episode aborted)."""


class GenerationInterrupted(RuntimeError):
    """`on_done` of a reply cut short by a policy update or a shutdown; retry it."""


class GenerationHandle:
    """What `submit` returns: `cancel()` stops the request and frees its KV cache.

    `cancel` is idempotent and safe from any thread; after the request finished it does
    nothing. `finish` is the backends' side: it delivers `on_done` exactly once.
    """

    def __init__(self, request: GenerationRequest,
                 on_cancel: Callable[[GenerationHandle], None] | None = None) -> None:
        self.request = request
        self._on_cancel = on_cancel
        self._lock = threading.Lock()
        self._done = False

    @property
    def done(self) -> bool:
        with self._lock:
            return self._done

    def finish(self, outcome: GenerationResult | BaseException) -> bool:
        """Deliver `on_done` unless already delivered; True if this call delivered it."""
        with self._lock:
            if self._done:
                return False
            self._done = True
        self.request.on_done(outcome)
        return True

    def delta(self, text: str) -> None:
        """Pass streamed text on (nothing once the request is done, or without on_delta)."""
        if text and self.request.on_delta is not None and not self.done:
            self.request.on_delta(text)

    def cancel(self) -> None:
        if self.done:
            return
        if self._on_cancel is not None:
            self._on_cancel(self)
        self.finish(GenerationCancelled("the request was cancelled"))


class Generator(abc.ABC):
    """Generates completions for the episode plane (see the module docstring)."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start serving (load what the backend needs: threads, the KV cache)."""

    @abc.abstractmethod
    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving; every request not yet done gets `GenerationInterrupted`."""

    @abc.abstractmethod
    def submit(self, request: GenerationRequest) -> GenerationHandle:
        """Queue `request`; see the module docstring for what comes back and when."""

    def validate(self, request: GenerationRequest) -> None:
        """Raise `GenerationRefused` for a request this generator can never serve."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Return once no forward pass runs; none starts until `resume`."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Serve again with the model's current weights; no old KV is reused."""

    def stats(self) -> dict[str, Any]:
        """Counters for the engine's status report (`GET /status` info)."""
        return {}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """`pause()` ... `resume()` around a weight update."""
        self.pause()
        try:
            yield
        finally:
            self.resume()


@dataclass(frozen=True)
class PolicyView:
    """What a KV-cached backend takes from the policy: the model, its tokenizer's decode,
    its EOS ids and context, and the job's sampling for requests that set none."""

    #: the module to generate with, asked again at every start and resume (an FSDP run
    #: hands its unsharded inference copy here; otherwise it is the policy's model)
    model_source: Callable[[], Any]
    decode: Callable[[list[int]], str]
    eos_ids: frozenset[int]
    max_positions: int
    temperature: float
    top_p: float
    seed: int

    @classmethod
    def of(cls, policy: Policy, *, temperature: float, top_p: float, seed: int
           ) -> PolicyView:
        return cls(model_source=lambda: policy.model, decode=policy.decode,
                   eos_ids=policy.eos_ids, max_positions=policy.max_positions,
                   temperature=temperature, top_p=top_p, seed=seed)

    def sampling_for(self, request: GenerationRequest) -> tuple[float, float]:
        """(temperature, top_p) for `request`: `effective_sampling` with the job's."""
        return effective_sampling(request, self.temperature, self.top_p)


def token_budget(request: GenerationRequest, *, max_positions: int,
                 capacity: int | None) -> int:
    """The new tokens `request` may generate: its own, within the model's context.

    Raises `GenerationRefused` for a request no backend state could serve: an empty
    prompt, one as long as the context, or one that with its new tokens does not fit the
    `capacity` tokens a backend's KV cache holds for one request (None: no cache limit).
    """
    prompt = len(request.prompt_ids)
    if prompt == 0:
        raise GenerationRefused("the prompt is empty")
    if prompt >= max_positions:
        raise GenerationRefused(f"the prompt is {prompt} tokens; the model's context is "
                                f"{max_positions}")
    max_new = max(1, min(request.max_new_tokens, max_positions - prompt))
    if capacity is not None and prompt + max_new > capacity:
        raise GenerationRefused(
            f"the prompt ({prompt} tokens) plus {max_new} new tokens do not fit the KV "
            f"cache ({capacity} tokens); shorten the conversation, or raise "
            "max_prompt_length + max_response_length in the job (the cache is sized "
            "for them)")
    return max_new


def effective_sampling(request: GenerationRequest, temperature: float, top_p: float
                       ) -> tuple[float, float]:
    """(temperature, top_p) for `request`: its own values where set, else the run's."""
    t = temperature if request.temperature is None else request.temperature
    p = top_p if request.top_p is None else request.top_p
    return max(float(t), MIN_TEMPERATURE), min(max(float(p), 1e-6), 1.0)


class ReplyText:
    """The text of a reply as its tokens arrive: stop strings and safe streaming deltas.

    `update(response_ids)` detokenizes incrementally, as vLLM and TGI do: it decodes a
    short window from the last settled token and keeps only what the new tokens added,
    so a long reply costs O(n), and a tokenizer that merges bytes across tokens still
    yields whole characters (a window ending in half a character, U+FFFD, waits for the
    next token). It cuts the text at the first stop string and returns what may be
    streamed now, holding back the last `len(longest stop) - 1` characters, which may
    still become a stop string, until the reply is done.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) - 1 for s in self._stop), default=0)
        self._raw = ""  # everything decoded so far, before the stop cut
        self._prefix = 0  # window start: tokens before it are settled
        self._read = 0  # tokens whose text is in _raw
        self._scanned = 0  # characters of _raw already searched for stop strings
        self.text = ""
        self.stopped = False
        self.emitted = 0

    def update(self, response_ids: list[int], *, done: bool = False) -> str:
        """The new text safe to stream; sets `stopped` once a stop string appears."""
        if not self.stopped and len(response_ids) > self._read:
            settled = self._decode(response_ids[self._prefix:self._read])
            window = self._decode(response_ids[self._prefix:])
            if len(window) > len(settled) and (done or not window.endswith("\ufffd")):
                self._raw += window[len(settled):]
                self._prefix, self._read = self._read, len(response_ids)
        text = self._raw
        if not self.stopped and self._stop:
            start = max(0, self._scanned - self._hold)
            cut = min((i for s in self._stop if (i := text.find(s, start)) >= 0), default=-1)
            self._scanned = len(text)
            if cut >= 0:
                self._raw, self.stopped = text[:cut], True
        self.text = self._raw
        safe = len(self.text)
        if not (done or self.stopped):
            safe = max(self.emitted, safe - self._hold)
        if safe <= self.emitted:
            return ""
        delta, self.emitted = self.text[self.emitted:safe], safe
        return delta
