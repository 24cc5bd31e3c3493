"""Serving one completion of an episode: what every `/v1/*` API shares.

A route marks the episode busy (`registry.chat_started`: 404/409 first, a closed episode
is closed), turns its body into token ids (`chat_format`), then calls `start_generation`,
which queues the request on the generation thread and returns a `Generation`: an asyncio
queue of text deltas and the final result. `Generation.record` puts the completion in the
episode's trajectory exactly once (prompt ids, response ids, sampling log-probs): the
token ids the model saw and produced, whichever API served them. A failed generation, or
a client that goes away before the end, releases the episode without recording anything
(`Generation.release`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from ajet.engine.episodes import EpisodeClosed, EpisodeError, EpisodeRegistry
from ajet.engine.inference import GenerationRequest, GenerationResult, InferenceService
from ajet.engine.trajectory import Completion

__all__ = ["EngineUnavailable", "Generation", "GenerationAsk", "start_generation"]


class EngineUnavailable(EpisodeError):
    """503: no policy loaded yet, shutting down, or generation failed (see the log)."""

    status = 503


@dataclass(frozen=True)
class GenerationAsk:
    """What to generate, in the generation loop's terms."""

    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    #: None = the run's setting (always, in training episodes)
    temperature: float | None = None
    top_p: float | None = None


@dataclass
class Generation:
    """A queued generation for one episode; record with `result()` or `events()`."""

    registry: EpisodeRegistry
    episode_uuid: str
    queue: asyncio.Queue[tuple[str, Any]]
    #: recorded or released: nothing more to do for the episode
    finished: bool = False

    async def next_event(self) -> tuple[str, Any]:
        """`("delta", text)` while generating, then `("done", GenerationResult)`."""
        try:
            kind, payload = await self.queue.get()
        except asyncio.CancelledError:
            self.release()
            raise
        if kind == "done" and isinstance(payload, BaseException):
            self.release()
            raise EngineUnavailable(f"generation failed: {payload}",
                                    "see the engine log (GET /runs/current/logs)")
        return kind, payload

    async def wait(self) -> GenerationResult:
        """The finished generation (not yet recorded)."""
        while True:
            kind, payload = await self.next_event()
            if kind == "done":
                return payload  # type: ignore[no-any-return]

    def record(self, result: GenerationResult, *, tool_call_parse_error: bool = False) -> None:
        """Attach the completion to its episode; raises if the episode closed meanwhile."""
        completion = Completion(prompt_ids=tuple(result.prompt_ids),
                                response_ids=tuple(result.response_ids),
                                logprobs=tuple(result.logprobs),
                                finish_reason=result.finish_reason,
                                policy_step=self.registry.step,
                                tool_call_parse_error=tool_call_parse_error)
        self.finished = True
        if not self.registry.chat_finished(self.episode_uuid, completion):
            raise EpisodeClosed(
                f"episode {self.episode_uuid} was closed (aborted or timed out) while its "
                "reply was generated; the reply is discarded",
                "call begin_episode for a new episode")

    def release(self) -> None:
        """The reply will not be recorded (failed, or the client went away)."""
        if not self.finished:
            self.finished = True
            self.registry.chat_finished(self.episode_uuid, None)


def start_generation(registry: EpisodeRegistry, inference: InferenceService,
                     episode_uuid: str, ask: GenerationAsk, *, streaming: bool) -> Generation:
    """Queue `ask` for the episode; its deltas and result arrive on the Generation's queue.

    The episode must be marked busy by the caller (`registry.chat_started`) first.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    generation = Generation(registry=registry, episode_uuid=episode_uuid, queue=events)

    def post(kind: str, payload: Any) -> None:
        # a closed event loop (RuntimeError) means the engine is shutting down
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

    def on_done(result: GenerationResult | BaseException) -> None:
        post("done", result)

    def on_delta(text: str) -> None:
        post("delta", text)

    try:
        inference.submit(GenerationRequest(
            prompt_ids=ask.prompt_ids, max_new_tokens=ask.max_new_tokens, on_done=on_done,
            on_delta=on_delta if streaming else None, stop=ask.stop,
            temperature=ask.temperature, top_p=ask.top_p))
    except RuntimeError as exc:
        generation.release()
        raise EngineUnavailable(str(exc), "retry once the engine is ENGINE.ROLLING") from exc
    return generation
