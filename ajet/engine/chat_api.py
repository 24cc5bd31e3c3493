"""The private channel's routes: what the swarm server calls on the engine's Unix socket.

    GET  /status                -> protocol.EngineReport
    POST /begin_episode         BeginEpisodeRequest -> {"episode_uuid", "timeout_s"};
                                409 unless ROLLING
    POST /v1/chat/completions   header X-Episode-UUID; OpenAI body; "stream": true -> SSE
    POST /end_episode           EndEpisodeRequest -> EndEpisodeResponse; 404 unknown, 409 closed
    POST /abort_episode         AbortEpisodeRequest -> {"episode_uuid", "requeued"}

Errors are `{"detail", "hint"}` like the public API. Authentication is not done here:
only the swarm server can reach the socket (0600, in the run directory), and it checks
tokens and signed episode keys before forwarding.

Chat completions follow the OpenAI schema closely enough for the official client. In
training episodes the run's config decides sampling: `temperature` and `top_p` of the
request are ignored (so recorded log-probs match what the update assumes); `max_tokens`
(or `max_completion_tokens`) may ask for up to `max_response_length` tokens, default
`max_new_tokens`; `stop` strings end the reply; `n` must be 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid as uuidlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ajet.engine.config import EngineConfig
from ajet.engine.episodes import EpisodeClosed, EpisodeError, EpisodeRegistry
from ajet.engine.inference import (
    GenerationCancelled,
    GenerationHandle,
    GenerationInterrupted,
    GenerationRefused,
    GenerationRequest,
    GenerationResult,
    Generator,
)
from ajet.engine.policy import Policy
from ajet.engine.trajectory import Completion
from ajet.protocol import (
    AbortEpisodeRequest,
    BeginEpisodeRequest,
    EndEpisodeRequest,
    EndEpisodeResponse,
    EngineReport,
)

__all__ = ["ChatCompletionRequest", "EpisodePlane", "create_channel_app"]

log = logging.getLogger(__name__)


class BadChatRequest(EpisodeError):
    """400: the chat body is well-formed JSON but cannot be served."""

    status = 400


class EngineUnavailable(EpisodeError):
    """503: no policy loaded yet, shutting down, or generation failed (see the log)."""

    status = 503


class ClientGone(EpisodeError):
    """499 (nobody reads it): the client closed the connection before the reply was done."""

    status = 499


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(max_length=64)
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """The OpenAI chat body; unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = 1
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None


@dataclass
class EpisodePlane:
    """What the channel serves. `policy` and `inference` arrive once the model is loaded."""

    cfg: EngineConfig
    registry: EpisodeRegistry
    run_id: str | None
    ajet_file: str
    world_size: int = 1
    #: `ajet.__file__` of every rank (rank 0 first), for the server's snapshot check
    ranks_ajet_files: list[str] = field(default_factory=list)
    policy: Policy | None = None
    inference: Generator | None = None
    started_at: float = field(default_factory=time.time)
    info: dict[str, Any] = field(default_factory=dict)
    #: generations in progress per episode, cancelled when the episode is aborted
    generating: dict[str, set[GenerationHandle]] = field(default_factory=dict)

    def cancel_generations(self, episode_uuid: str) -> int:
        """Cancel the episode's generations in progress (their KV cache is freed)."""
        handles = self.generating.pop(episode_uuid, set())
        for handle in handles:
            handle.cancel()
        return len(handles)

    def report(self) -> EngineReport:
        snap = self.registry.snapshot()
        return EngineReport(
            state=self.registry.state, pid=os.getpid(), ajet_file=self.ajet_file,
            step=self.registry.step, run_id=self.run_id, world_size=self.world_size,
            ranks_ajet_files=self.ranks_ajet_files or [self.ajet_file],
            episodes_in_flight=snap["episodes_in_flight"],
            info={**self.info, **snap, "uptime_s": round(time.time() - self.started_at, 3),
                  **({"generation": self.inference.stats()} if self.inference else {})},
        )


def create_channel_app(plane: EpisodePlane) -> FastAPI:
    app = FastAPI(title="AgentJet engine (private channel)", docs_url=None, redoc_url=None)
    _install_error_handlers(app)
    registry = plane.registry
    # The handlers are async: registry calls hold its lock for microseconds, so they run
    # on the event loop instead of paying a thread-pool hop per request.

    @app.get("/status")
    async def status() -> EngineReport:
        return plane.report()

    @app.post("/begin_episode")
    async def begin_episode(body: BeginEpisodeRequest) -> dict[str, Any]:
        episode = registry.begin(timeout_s=body.discard_episode_timeout, metadata=body.metadata)
        return {"episode_uuid": episode.uuid, "timeout_s": episode.timeout_s}

    @app.post("/end_episode")
    async def end_episode(body: EndEpisodeRequest) -> EndEpisodeResponse:
        registry.end(body.episode_uuid, task_id=body.task_id, reward=body.reward,
                     is_success=body.is_success, metadata=body.metadata,
                     log_metrics=body.log_metrics)
        return EndEpisodeResponse(episode_uuid=body.episode_uuid, accepted=True,
                                  step=registry.step)

    @app.post("/abort_episode")
    async def abort_episode(body: AbortEpisodeRequest) -> dict[str, Any]:
        requeued = registry.abort(body.episode_uuid)
        cancelled = plane.cancel_generations(body.episode_uuid)
        log.info("episode %s aborted: %s%s", body.episode_uuid, body.reason,
                 f" ({cancelled} generation(s) cancelled)" if cancelled else "")
        return {"episode_uuid": body.episode_uuid, "requeued": requeued}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        x_episode_uuid: Annotated[str | None, Header(max_length=100)] = None,
    ) -> JSONResponse | StreamingResponse:
        if not x_episode_uuid:
            raise BadChatRequest("missing X-Episode-UUID header",
                                 "chat through the swarm server with the episode's API key")
        policy, inference = plane.policy, plane.inference
        if policy is None or inference is None:
            raise EngineUnavailable(f"engine is {registry.state}: no policy loaded",
                                    "wait for ENGINE.ROLLING and call begin_episode")
        registry.chat_started(x_episode_uuid)  # 404/409 first: a closed episode is closed
        try:
            prompt_ids, max_new, stop = _prepare(plane.cfg, policy, body)
            events, handle = _submit(inference, prompt_ids, max_new, stop,
                                     streaming=body.stream, session=x_episode_uuid)
        except GenerationRefused as exc:
            registry.chat_finished(x_episode_uuid, None)
            raise BadChatRequest(f"cannot generate for this prompt: {exc}",
                                 "shorten the conversation") from exc
        except BaseException:
            registry.chat_finished(x_episode_uuid, None)
            raise
        plane.generating.setdefault(x_episode_uuid, set()).add(handle)
        model_name = body.model or plane.cfg.model
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(
                _stream(plane, x_episode_uuid, events, handle, model_name, include_usage),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        result = await _finish(plane, x_episode_uuid, events, handle, request)
        return JSONResponse(_completion_body(result, model_name))

    return app


# ---------------------------------------------------------------------------- chat helpers


def _prepare(cfg: EngineConfig, policy: Policy, body: ChatCompletionRequest
             ) -> tuple[list[int], int, tuple[str, ...]]:
    if body.n != 1:
        raise BadChatRequest(f"n={body.n} is not supported", "send n=1 (one episode, one reply)")
    messages = [{"role": m.role, "content": _text_of(m)} for m in body.messages]
    try:
        prompt_ids = policy.render_chat(messages)
    except Exception as exc:  # the checkpoint's own chat template refused the messages
        raise BadChatRequest(f"the model's chat template cannot render these messages: {exc}",
                             "send role/content messages the template accepts") from exc
    if len(prompt_ids) > cfg.max_prompt_length:
        raise BadChatRequest(
            f"the prompt is {len(prompt_ids)} tokens; max_prompt_length is "
            f"{cfg.max_prompt_length}",
            "shorten the conversation or raise max_prompt_length in the job")
    asked = body.max_completion_tokens or body.max_tokens
    max_new = min(asked, cfg.max_response_length) if asked else cfg.max_new_tokens
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if any(not s for s in stop) or len(stop) > 4:
        raise BadChatRequest("stop must be up to 4 non-empty strings", "fix the stop field")
    return prompt_ids, max_new, stop


def _text_of(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadChatRequest(f"content part of type {part.get('type')!r} is not supported",
                                 "send text content only")
        parts.append(part["text"])
    return "".join(parts)


def _submit(inference: Generator, prompt_ids: list[int], max_new: int,
            stop: tuple[str, ...], *, streaming: bool, session: str
            ) -> tuple[asyncio.Queue[tuple[str, Any]], GenerationHandle]:
    """Queue a generation; its deltas and result arrive on the returned asyncio queue."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def post(kind: str, payload: Any) -> None:
        # a closed event loop (RuntimeError) means the engine is shutting down
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))

    def on_done(result: GenerationResult | BaseException) -> None:
        post("done", result)

    def on_delta(text: str) -> None:
        post("delta", text)

    handle = inference.submit(GenerationRequest(
        prompt_ids=prompt_ids, max_new_tokens=max_new, on_done=on_done,
        on_delta=on_delta if streaming else None, stop=stop, session=session))
    return events, handle


def _forget(plane: EpisodePlane, episode_uuid: str, handle: GenerationHandle) -> None:
    handles = plane.generating.get(episode_uuid)
    if handles is not None:
        handles.discard(handle)
        if not handles:
            del plane.generating[episode_uuid]


def _record(plane: EpisodePlane, episode_uuid: str, result: GenerationResult | BaseException
            ) -> GenerationResult:
    """Attach the completion to its episode; the chat fails if the episode closed meanwhile."""
    if isinstance(result, GenerationCancelled):
        plane.registry.chat_finished(episode_uuid, None)
        raise EpisodeClosed(f"the reply for episode {episode_uuid} was cancelled (the episode "
                            "was aborted)", "call begin_episode for a new episode")
    if isinstance(result, GenerationInterrupted):
        plane.registry.chat_finished(episode_uuid, None)
        raise EngineUnavailable(f"generation was interrupted: {result}",
                                "retry the request", retry_after_s=1.0)
    if isinstance(result, BaseException):
        plane.registry.chat_finished(episode_uuid, None)
        raise EngineUnavailable(f"generation failed: {result}",
                                "see the engine log (GET /runs/current/logs)")
    completion = Completion(prompt_ids=tuple(result.prompt_ids),
                            response_ids=tuple(result.response_ids),
                            logprobs=tuple(result.logprobs), finish_reason=result.finish_reason,
                            policy_step=plane.registry.step)
    if not plane.registry.chat_finished(episode_uuid, completion):
        raise EpisodeClosed(
            f"episode {episode_uuid} was closed (aborted or timed out) while its reply was "
            "generated; the reply is discarded", "call begin_episode for a new episode")
    return result


async def _finish(plane: EpisodePlane, episode_uuid: str,
                  events: asyncio.Queue[tuple[str, Any]], handle: GenerationHandle,
                  request: Request) -> GenerationResult:
    """Wait for the reply; a client that hangs up first cancels the generation."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            got = asyncio.ensure_future(events.get())
            await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not got.done():  # the client went away: stop generating for it
                got.cancel()
                handle.cancel()
                plane.registry.chat_finished(episode_uuid, None)
                raise ClientGone("the client closed the connection", "")
            kind, payload = got.result()
            if kind == "done":
                return _record(plane, episode_uuid, payload)
    except asyncio.CancelledError:
        handle.cancel()
        plane.registry.chat_finished(episode_uuid, None)
        raise
    finally:
        gone.cancel()
        _forget(plane, episode_uuid, handle)


async def _disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(plane: EpisodePlane, episode_uuid: str,
                  events: asyncio.Queue[tuple[str, Any]], handle: GenerationHandle,
                  model_name: str, include_usage: bool) -> AsyncIterator[bytes]:
    chunk_id, created = f"chatcmpl-{uuidlib.uuid4().hex}", int(time.time())
    recorded = False

    def chunk(delta: dict[str, Any], finish: str | None, **extra: Any) -> bytes:
        body = {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                             "logprobs": None}], **extra}
        return f"data: {json.dumps(body)}\n\n".encode()

    try:
        yield chunk({"role": "assistant", "content": ""}, None)
        while True:
            kind, payload = await events.get()
            if kind == "delta":
                yield chunk({"content": payload}, None)
                continue
            recorded = True
            try:
                result = _record(plane, episode_uuid, payload)
            except EpisodeError as exc:
                error = {"error": {"message": exc.detail, "type": "episode_error",
                                   "code": exc.status}}
                yield f"data: {json.dumps(error)}\n\n".encode()
                break
            yield chunk({}, result.finish_reason)
            if include_usage:
                usage = _usage(result)
                body = {"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                        "model": model_name, "choices": [], "usage": usage}
                yield f"data: {json.dumps(body)}\n\n".encode()
            break
        yield b"data: [DONE]\n\n"
    finally:
        _forget(plane, episode_uuid, handle)
        if not recorded:  # the client went away before the reply finished
            handle.cancel()
            plane.registry.chat_finished(episode_uuid, None)


def _usage(result: GenerationResult) -> dict[str, int]:
    p, c = len(result.prompt_ids), len(result.response_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _completion_body(result: GenerationResult, model_name: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuidlib.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                     "finish_reason": result.finish_reason, "logprobs": None}],
        "usage": _usage(result),
    }


# ---------------------------------------------------------------------------- errors


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(EpisodeError)
    async def _episode_error(_: Request, exc: EpisodeError) -> JSONResponse:
        headers = None
        if exc.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return JSONResponse({"detail": exc.detail, "hint": exc.hint}, status_code=exc.status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""),
                   "type": e.get("type", "")} for e in exc.errors()]
        fields = ", ".join(".".join(e["loc"][1:] or e["loc"]) for e in errors)
        return JSONResponse({"detail": errors, "hint": f"fix the field(s): {fields}"},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "hint": ""}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": "internal engine error",
                             "hint": "see the engine log (GET /runs/current/logs)"},
                            status_code=500)
