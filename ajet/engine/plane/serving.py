"""Serving one completion of an episode: what every `/v1/*` API shares.

A route marks the episode busy (`registry.chat_started`: 404/409 first, a closed episode
is closed), turns its body into token ids (`chat_format`), then calls `start_generation`,
which submits the request to the generator (`inference.Generator`) and returns a
`Generation`: an asyncio queue of text deltas and the final result. `Generation.record`
puts the completion in the episode's trajectory exactly once (prompt ids, response ids,
sampling log-probs): the token ids the model saw and produced, whichever API served them.
A failed generation, or a client that goes away before the end, releases the episode
without recording anything (`Generation.release`), and releasing cancels the generation,
which frees its KV cache. A non-streamed reply watches its connection for that (a
streamed one is closed by the server when its client goes); `GenerationTracker` cancels
an episode's generations when the episode is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ajet.errors import EngineStateConflict, SwarmHTTPError, SwarmValidationError
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.generation.interface import (
    GenerationCancelled,
    GenerationHandle,
    GenerationInterrupted,
    GenerationRefused,
    GenerationRequest,
    GenerationResult,
    Generator,
)
from ajet.engine.trajectory import ChatMessage, Completion

__all__ = ["Generation", "GenerationTracker", "start_generation"]


@dataclass(eq=False)  # one object per generation: hashed by identity
class Generation:
    """A queued generation for one episode; record with `result()` or `events()`."""

    registry: EpisodeRegistry
    episode_uuid: str
    queue: asyncio.Queue[tuple[str, Any]]
    #: recorded or released: nothing more to do for the episode
    finished: bool = False
    #: the generator's handle (cancel frees the KV cache); None until submitted
    handle: GenerationHandle | None = None
    #: the watcher of a non-streamed reply's connection, and the tracker it is in
    watcher: asyncio.Future[None] | None = None
    tracker: GenerationTracker | None = None

    async def next_event(self) -> tuple[str, Any]:
        """`("delta", text)` while generating, then `("done", GenerationResult)`."""
        try:
            kind, payload = await self.queue.get()
        except asyncio.CancelledError:
            self.release()
            raise
        if kind == "done" and isinstance(payload, BaseException):
            self.release()
            if isinstance(payload, GenerationCancelled):
                raise EngineStateConflict(
                    409, f"the reply for episode {self.episode_uuid} was cancelled "
                    "(the episode was aborted, or its client went away)",
                    "call begin_episode for a new episode")
            if isinstance(payload, GenerationInterrupted):
                raise SwarmHTTPError(503, f"generation was interrupted: {payload}",
                                     "retry the request", retry_after_s=1.0)
            raise SwarmHTTPError(503, f"generation failed: {payload}",
                                 "see the engine log (GET /runs/current/logs)")
        return kind, payload

    async def wait(self) -> GenerationResult:
        """The finished generation (not yet recorded)."""
        while True:
            kind, payload = await self.next_event()
            if kind == "done":
                return payload  # type: ignore[no-any-return]

    def record(self, result: GenerationResult, *, tool_call_parse_error: bool = False,
               agent: str = "", messages: tuple[ChatMessage, ...] | None = None,
               assistant_spans: tuple[tuple[int, int, int], ...] = (),
               reply: ChatMessage | None = None) -> None:
        """Attach the completion to its episode; raises if the episode closed meanwhile.

        Chat-shaped calls pass the plane's record of the request (`messages` as rendered,
        `assistant_spans`) and the parsed `reply`: the trajectory merges an episode's
        calls into timelines with them (`ajet.engine.trajectory`).
        """
        completion = Completion(prompt_ids=tuple(result.prompt_ids),
                                response_ids=tuple(result.response_ids),
                                logprobs=tuple(result.logprobs),
                                finish_reason=result.finish_reason,
                                policy_step=self.registry.step,
                                tool_call_parse_error=tool_call_parse_error, agent=agent,
                                messages=messages, assistant_spans=assistant_spans,
                                reply=reply)
        self._close()
        if not self.registry.chat_finished(self.episode_uuid, completion):
            raise EngineStateConflict(409,
                f"episode {self.episode_uuid} was closed (aborted or timed out) while its "
                "reply was generated; the reply is discarded",
                "call begin_episode for a new episode")

    def release(self) -> None:
        """The reply will not be recorded (failed, or the client went away); stops it."""
        if not self.finished:
            self._close()
            if self.handle is not None:
                self.handle.cancel()  # nothing if it is done; else its KV cache is freed
            self.registry.chat_finished(self.episode_uuid, None)

    def _close(self) -> None:
        self.finished = True
        if self.watcher is not None:
            self.watcher.cancel()
        if self.tracker is not None:
            self.tracker.forget(self)


class GenerationTracker:
    """The generations in progress per episode (event loop only), to cancel on abort."""

    def __init__(self) -> None:
        self._by_episode: dict[str, set[Generation]] = {}

    def add(self, generation: Generation) -> None:
        generation.tracker = self
        self._by_episode.setdefault(generation.episode_uuid, set()).add(generation)

    def forget(self, generation: Generation) -> None:
        generations = self._by_episode.get(generation.episode_uuid)
        if generations is not None:
            generations.discard(generation)
            if not generations:
                del self._by_episode[generation.episode_uuid]

    def cancel(self, episode_uuid: str) -> int:
        """Cancel the episode's generations; how many there were."""
        generations = list(self._by_episode.pop(episode_uuid, ()))
        for generation in generations:
            if generation.handle is not None:
                generation.handle.cancel()  # its waiter sees GenerationCancelled: 409
        return len(generations)


async def _release_when_gone(request: Request, generation: Generation) -> None:
    """Release (cancel) a non-streamed generation once its client closed the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.release()


def start_generation(registry: EpisodeRegistry, inference: Generator, episode_uuid: str,
                     ask: GenerationRequest, *, streaming: bool,
                     request: Request | None = None,
                     tracker: GenerationTracker | None = None) -> Generation:
    """Submit `ask` for the episode (its callbacks and session set here); its deltas and
    result arrive on the Generation's queue.

    The episode must be marked busy by the caller (`registry.chat_started`) first. With
    `request` (a non-streamed reply, whose body is read), the generation is cancelled if
    the client hangs up; with `tracker`, if the episode is aborted.
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
        generation.handle = inference.submit(dataclasses.replace(
            ask, on_done=on_done, on_delta=on_delta if streaming else None,
            session=episode_uuid))
    except GenerationRefused as exc:
        generation.release()
        raise SwarmValidationError(400, f"cannot generate for this prompt: {exc}",
                                   "shorten the conversation", param="messages") from exc
    except RuntimeError as exc:
        generation.release()
        raise SwarmHTTPError(503, str(exc), "retry once the engine is ENGINE.ROLLING") from exc
    if tracker is not None:
        tracker.add(generation)
    if request is not None and not streaming:
        generation.watcher = asyncio.ensure_future(_release_when_gone(request, generation))
    return generation
