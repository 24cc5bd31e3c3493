"""The OpenAI-compatible routes of the private channel: chat, completions, models.

    POST /v1/chat/completions   header X-Episode-UUID; tools and tool calls, logprobs, SSE
    POST /v1/completions        header X-Episode-UUID; a prompt in, text out (RL clients)
    GET  /v1/models[/{model}]   the run's model

What each body may hold is `openai_requests`; how chats become tokens and replies become
tool calls is `chat_format`; recording is `serving`. Every completion is recorded with
the token ids the model saw and produced, tool-call tokens included; the reply carries an
`ajet` object saying how it was sampled (`episode_type`, `sampling`, `ignored`) and, when
tools were offered, `tool_call_parse_error` and `tool_choice_unmet` (docs/api.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid as uuidlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from ajet.errors import PayloadTooLarge, SwarmHTTPError, SwarmNotFound, SwarmValidationError
from ajet.engine.plane.chat_format import (
    ChatFormat,
    ContentStream,
    FormatError,
    ParsedReply,
    RenderedPrompt,
)
from ajet.engine.generation.interface import GenerationRequest, GenerationResult
from ajet.engine.plane.request_policy import (
    advisory_sent,
    ChatCompletionRequest,
    CompletionRequest,
    PlaneRequest,
    Sampling,
    ToolChoice,
    parse_body,
    resolve_max_tokens,
    resolve_sampling,
    resolve_stop,
    resolve_tool_choice,
)
from ajet.engine.plane.serving import Generation, start_generation
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.protocol import PlanePath
from ajet.engine.trajectory import reply_message


__all__ = [
    "ChatTurn",
    "accept_body",
    "ajet_field",
    "build_turn",
    "chat_request",
    "check_prompt_length",
    "completion_request",
    "episode_header",
    "finish_reason",
    "finish_reply",
    "openai_router",
    "read_body",
    "reply_events",
    "start_chat",
    "stream_error",
    "token_logprobs",
    "usage",
]

BodyT = TypeVar("BodyT", bound=BaseModel)

#: Accepted with no effect, listed in `ajet.ignored` (`request_policy.advisory_sent`).
CHAT_ADVISORY = ("reasoning_effort", "verbosity")
CHAT_PARAMS = frozenset({"messages", "tools", "tool_choice", "parallel_tool_calls", "stream",
                         "stream_options", "max_tokens", "max_completion_tokens", "stop",
                         "temperature", "top_p", "logprobs", *CHAT_ADVISORY})
#: `logprobs` is honoured at 0 only (alternatives are not computed): see the route
COMPLETION_PARAMS = frozenset({"prompt", "stream", "stream_options", "max_tokens", "stop",
                               "temperature", "top_p"})


@dataclass
class ChatTurn:
    """One chat-shaped call (chat completions or Responses), rendered and ready to generate."""

    prompt: RenderedPrompt
    #: tools rendered into the prompt and parsed out of the reply (None: neither)
    tools: list[dict[str, Any]] | None
    choice: ToolChoice
    parallel_tool_calls: bool
    sampling: Sampling
    ask: GenerationRequest
    model_name: str
    extra: dict[str, Any] = field(default_factory=dict)
    #: the agent that asked: the request's `model` name (timelines never mix agents)
    agent: str = ""

    def content_stream(self, fmt: ChatFormat) -> ContentStream | None:
        """Streams content around tool calls; None when no tool call can appear."""
        if self.tools is None:
            return None
        return fmt.content_stream(prompt_text=self.prompt.text, tools=self.tools)


def openai_router(plane: EpisodePlane) -> APIRouter:
    router = APIRouter()

    @router.get(PlanePath.MODELS)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(plane)]}

    @router.get(PlanePath.MODELS + "/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        if model != plane.cfg.model:
            raise SwarmNotFound(404, f"model {model!r} is not served here; this run serves "
                                f"{plane.cfg.model!r}",
                                "any model name works in requests: the run's model answers",
                                param="model")
        return _model_card(plane)

    @router.post(PlanePath.CHAT_COMPLETIONS, response_model=None)
    async def chat_completions(
        request: Request,
        x_episode_uuid: Annotated[str | None, Header(max_length=100)] = None,
    ) -> JSONResponse | StreamingResponse:
        episode_uuid, body = await accept_body(plane, request, x_episode_uuid,
                                               ChatCompletionRequest, accepted=CHAT_PARAMS)
        fmt, generation, turn = await start_chat(plane, episode_uuid, lambda f: prepare_chat(
            plane, f, episode_uuid, body), streaming=body.stream, request=request)
        logprobs = bool(body.logprobs)
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return _sse(_chat_stream(plane, fmt, generation, turn, logprobs=logprobs,
                                     include_usage=include_usage))
        result = await generation.wait()
        reply = finish_reply(fmt, generation, turn, result)
        return JSONResponse(_chat_body(plane, turn, result, reply, logprobs=logprobs))

    @router.post(PlanePath.COMPLETIONS, response_model=None)
    async def completions(
        request: Request,
        x_episode_uuid: Annotated[str | None, Header(max_length=100)] = None,
    ) -> JSONResponse | StreamingResponse:
        episode_uuid, body = await accept_body(
            plane, request, x_episode_uuid, CompletionRequest, accepted=COMPLETION_PARAMS,
            default_only={"logprobs": ((0,), "send logprobs=0 for the sampled tokens' "
                                       "log-probs; alternatives are not computed")})
        fmt, generation, turn = await start_chat(plane, episode_uuid, lambda f: (
            _prepare_completion(plane, f, episode_uuid, body)), streaming=body.stream,
            request=request)
        logprobs = body.logprobs is not None
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return _sse(_completion_stream(plane, fmt, generation, turn, logprobs=logprobs,
                                           include_usage=include_usage))
        result = await generation.wait()
        generation.record(result, agent=turn.agent)
        return JSONResponse(_completion_body(plane, fmt, turn, result, logprobs=logprobs))

    return router


# ---------------------------------------------------------------------------- preparing


async def accept_body(plane: EpisodePlane, request: Request, x_episode_uuid: str | None,
                      model: type[BodyT], *, accepted: frozenset[str],
                      default_only: Mapping[str, tuple[tuple[Any, ...], str]] | None = None
                      ) -> tuple[str, BodyT]:
    """The episode and the checked body of a `/v1/*` POST.

    The size bound holds before anything is read whole; JSON parsing and the parameter
    check run in a worker thread, off the event loop.
    """
    episode_uuid = episode_header(x_episode_uuid)
    raw = await read_body(request, plane)
    body = await asyncio.to_thread(parse_body, raw, model, accepted=accepted,
                                   default_only=default_only)
    return episode_uuid, body


async def read_body(request: Request, plane: EpisodePlane) -> bytes:
    """The body, refused (413) past the chat size bound before any of it is parsed."""
    limit = plane.cfg.max_chat_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _chat_too_large(int(declared), limit, plane.cfg.max_prompt_length)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _chat_too_large(size, limit, plane.cfg.max_prompt_length)
        chunks.append(chunk)
    return b"".join(chunks)


async def start_chat(plane: EpisodePlane, episode_uuid: str,
                     prepare: Callable[[ChatFormat], ChatTurn], *, streaming: bool,
                     request: Request) -> tuple[ChatFormat, Generation, ChatTurn]:
    """Mark the episode busy, render, and queue the generation (shared by every API).

    Rendering and tokenising run in a worker thread: one episode's big chat never holds
    the event loop that serves every other episode. The generation is cancelled when the
    episode is aborted or the client hangs up (`serving.start_generation`).
    """
    fmt, inference = plane.serving()
    registry = plane.registry
    registry.chat_started(episode_uuid)  # 404/409 first: a closed episode is closed
    try:
        turn = await asyncio.to_thread(prepare, fmt)
        generation = start_generation(registry, inference, episode_uuid, turn.ask,
                                      streaming=streaming, request=request,
                                      tracker=plane.generations)
    except BaseException:
        registry.chat_finished(episode_uuid, None)
        raise
    return fmt, generation, turn


def prepare_chat(plane: EpisodePlane, fmt: ChatFormat, episode_uuid: str,
                 body: ChatCompletionRequest) -> ChatTurn:
    """Check a chat body against the run and render it with the checkpoint's template."""
    return build_turn(plane, fmt, episode_uuid, chat_request(plane, body))


def chat_request(plane: EpisodePlane, body: ChatCompletionRequest) -> PlaneRequest:
    """A chat completions body as the plane's request."""
    cfg = plane.cfg
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = resolve_tool_choice(body.tool_choice, [t["function"]["name"] for t in tools])
    asked, param = ((body.max_completion_tokens, "max_completion_tokens")
                    if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
    return PlaneRequest(
        messages=[m.model_dump(exclude_none=True) for m in body.messages], tools=tools,
        choice=choice, parallel=body.parallel_tool_calls is not False,
        max_tokens=resolve_max_tokens(asked, param=param, default=cfg.max_new_tokens,
                                      limit=cfg.max_response_length),
        stop=resolve_stop(body.stop), temperature=body.temperature, top_p=body.top_p,
        ignored=advisory_sent(body, CHAT_ADVISORY), agent=body.model or "")


def build_turn(plane: EpisodePlane, fmt: ChatFormat, episode_uuid: str,
               request: PlaneRequest) -> ChatTurn:
    """Render the plane's request (messages + tools) and decide how to sample it.

    `request.agent` is the name the request called the model by (its `model`): an
    episode's completions are merged into timelines per agent, and the job may train
    some only.
    """
    tools, choice = request.tools, request.choice
    offered = tools if tools and choice.mode != "none" else None
    if offered and not fmt.parses_tool_calls:
        raise SwarmValidationError(
            400, "this checkpoint's tool-call format is unknown, so calls could not be "
            "read back from its replies",
            "add a response_template to the checkpoint's tokenizer_config.json, "
            "or send no tools", param="tools")
    template_kwargs: dict[str, Any] = {}
    if offered:
        template_kwargs = {"tool_choice": choice.name or choice.mode,
                           "parallel_tool_calls": request.parallel}
    prompt = request.prompt
    if prompt is None:
        try:
            prompt = fmt.render(request.messages or [], tools=offered,
                                template_kwargs=template_kwargs)
        except FormatError as exc:
            raise SwarmValidationError(400, str(exc), exc.hint, param=exc.param) from exc
    check_prompt_length(plane, len(prompt.ids), param=request.prompt_param)
    sampling = _sampling(plane, episode_uuid, request.temperature, request.top_p)
    if request.ignored:
        sampling = dataclasses.replace(sampling, ignored=(*sampling.ignored, *request.ignored))
    return ChatTurn(prompt=prompt, tools=offered, choice=choice,
                    parallel_tool_calls=request.parallel, sampling=sampling,
                    ask=_ask(prompt.ids, request.max_tokens, request.stop, sampling),
                    model_name=plane.cfg.model, extra=dict(request.notes), agent=request.agent)


def _prepare_completion(plane: EpisodePlane, fmt: ChatFormat, episode_uuid: str,
                        body: CompletionRequest) -> ChatTurn:
    return build_turn(plane, fmt, episode_uuid, completion_request(plane, fmt, body))


def completion_request(plane: EpisodePlane, fmt: ChatFormat, body: CompletionRequest
                       ) -> PlaneRequest:
    """A completions body (one prompt, text or token ids) as the plane's request."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise SwarmValidationError(
                400, f"{len(prompt)} prompts in one call; one is served per call",
                "send one prompt per call", param="prompt")
        prompt = prompt[0]
    tokenizer = fmt.tokenizer
    if isinstance(prompt, str):
        ids = [int(i) for i in tokenizer(prompt)["input_ids"]]
    else:
        vocab = len(tokenizer)
        if not prompt or any(not isinstance(i, int) or not 0 <= i < vocab for i in prompt):
            raise SwarmValidationError(
                400, f"prompt token ids must be a non-empty list of ids below {vocab}",
                "send the prompt as text, or valid token ids", param="prompt")
        ids = [int(i) for i in prompt]
    cfg = plane.cfg
    text = str(tokenizer.decode(ids, skip_special_tokens=False))
    return PlaneRequest(
        messages=None, tools=[], choice=ToolChoice("none"), parallel=False,
        max_tokens=resolve_max_tokens(body.max_tokens, param="max_tokens",
                                      default=cfg.max_new_tokens, limit=cfg.max_response_length),
        stop=resolve_stop(body.stop), temperature=body.temperature, top_p=body.top_p,
        prompt=RenderedPrompt(ids=ids, text=text), prompt_param="prompt",
        agent=body.model or "")


def check_prompt_length(plane: EpisodePlane, n_tokens: int, *, param: str) -> None:
    limit = plane.cfg.max_prompt_length
    if n_tokens > limit:
        raise SwarmValidationError(
            400, f"the prompt is {n_tokens} tokens; max_prompt_length is {limit}",
            "shorten the conversation or raise max_prompt_length in the job",
            param=param)


def _sampling(plane: EpisodePlane, episode_uuid: str, temperature: float | None,
              top_p: float | None) -> Sampling:
    return resolve_sampling(episode_type=plane.registry.episode_type(episode_uuid),
                            run_temperature=plane.cfg.temperature, run_top_p=plane.cfg.top_p,
                            temperature=temperature, top_p=top_p)


def _ask(ids: list[int], max_tokens: int, stop: tuple[str, ...], sampling: Sampling
         ) -> GenerationRequest:
    t, p = sampling.for_generation()
    return GenerationRequest(prompt_ids=ids, max_new_tokens=max_tokens, stop=stop,
                             temperature=t, top_p=p)


# ---------------------------------------------------------------------------- replies


def finish_reply(fmt: ChatFormat, generation: Generation, turn: ChatTurn,
                 result: GenerationResult) -> ParsedReply:
    """Parse the finished reply into content and tool calls, and record it."""
    try:
        reply = reply_of(fmt, turn, result)
    except BaseException:
        generation.release()
        raise
    generation.record(result, tool_call_parse_error=reply.parse_error is not None,
                      agent=turn.agent, messages=turn.prompt.messages,
                      assistant_spans=turn.prompt.assistant_spans,
                      reply=reply_message(reply.content,
                                          [(c.name, c.arguments) for c in reply.tool_calls]))
    return reply


def reply_of(fmt: ChatFormat, turn: ChatTurn, result: GenerationResult) -> ParsedReply:
    if turn.tools is None:
        return ParsedReply(content=result.text)
    reply = fmt.parse(result.text, prompt_text=turn.prompt.text, tools=turn.tools)
    names = [c.name for c in reply.tool_calls]
    if turn.choice.mode in ("required", "function"):
        # no constrained decoding: the model's own answer is served, marked (docs/api.md)
        turn.extra["tool_choice_unmet"] = not turn.choice.satisfied_by(names)
    if not turn.parallel_tool_calls and len(reply.tool_calls) > 1:
        turn.extra["tool_calls_dropped"] = len(reply.tool_calls) - 1
        reply = ParsedReply(content=reply.content, tool_calls=reply.tool_calls[:1])
    turn.extra["tool_call_parse_error"] = reply.parse_error
    return reply


def ajet_field(turn: ChatTurn) -> dict[str, Any]:
    return {**turn.sampling.public(), **turn.extra}


def finish_reason(result: GenerationResult, reply: ParsedReply) -> str:
    return "tool_calls" if reply.tool_calls else result.finish_reason


def usage(result: GenerationResult) -> dict[str, int]:
    p, c = len(result.prompt_ids), len(result.response_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def token_logprobs(fmt: ChatFormat, result: GenerationResult) -> list[dict[str, Any]]:
    """Every recorded response token (the end-of-turn token included) and its log-prob."""
    out = []
    for token_id, logprob in zip(result.response_ids, result.logprobs, strict=True):
        token = str(fmt.tokenizer.decode([token_id], skip_special_tokens=False))
        out.append({"token": token, "logprob": logprob, "bytes": list(token.encode()),
                    "top_logprobs": []})
    return out


def _tool_calls_json(reply: ParsedReply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]


def _chat_body(plane: EpisodePlane, turn: ChatTurn, result: GenerationResult,
               reply: ParsedReply, *, logprobs: bool) -> dict[str, Any]:
    fmt, _ = plane.serving()
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls_json(reply)
    elif message["content"] is None:
        message["content"] = ""
    return {
        "id": f"chatcmpl-{uuidlib.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": turn.model_name,
        "choices": [{"index": 0, "message": message,
                     "finish_reason": finish_reason(result, reply),
                     "logprobs": {"content": token_logprobs(fmt, result)} if logprobs else None}],
        "usage": usage(result), "ajet": ajet_field(turn),
    }


async def reply_events(fmt: ChatFormat, generation: Generation, turn: ChatTurn
                       ) -> AsyncIterator[tuple[str, Any]]:
    """A streamed chat-shaped reply, for any API's stream.

    `("content", text)` as content can be shown (held back where a tool call may begin),
    then `("done", (result, reply))` once the reply is parsed and recorded, or
    `("error", SwarmHTTPError)` if the episode closed meanwhile.
    """
    stream = turn.content_stream(fmt)
    while True:
        kind, payload = await generation.next_event()
        if kind == "delta":
            text = stream.feed(payload) if stream is not None else payload
            if text:
                yield "content", text
            continue
        result: GenerationResult = payload
        try:
            reply = finish_reply(fmt, generation, turn, result)
        except SwarmHTTPError as exc:
            yield "error", exc
            return
        if stream is not None and (rest := stream.rest(reply, result.text)):
            yield "content", rest
        yield "done", (result, reply)
        return


async def _chat_stream(plane: EpisodePlane, fmt: ChatFormat, generation: Generation,
                       turn: ChatTurn, *, logprobs: bool, include_usage: bool
                       ) -> AsyncIterator[bytes]:
    chunk_id, created = f"chatcmpl-{uuidlib.uuid4().hex}", int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        return _event({"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                       "model": turn.model_name,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                    "logprobs": extra.pop("logprobs", None)}], **extra})

    try:
        yield chunk({"role": "assistant", "content": ""})
        async for kind, payload in reply_events(fmt, generation, turn):
            if kind == "content":
                yield chunk({"content": payload})
            elif kind == "error":
                yield stream_error(payload)
            else:
                result, reply = payload
                for index, call in enumerate(reply.tool_calls):
                    yield chunk({"tool_calls": [{"index": index, "id": call.id,
                                                 "type": "function",
                                                 "function": {"name": call.name,
                                                              "arguments": ""}}]})
                    yield chunk({"tool_calls": [{"index": index,
                                                 "function": {"arguments": call.arguments}}]})
                lp = {"content": token_logprobs(fmt, result)} if logprobs else None
                # `ajet` rides on the last chunk: the usage chunk when one follows
                last = {} if include_usage else {"ajet": ajet_field(turn)}
                yield chunk({}, finish_reason(result, reply), logprobs=lp, **last)
                if include_usage:
                    yield _event({"id": chunk_id, "object": "chat.completion.chunk",
                                  "created": created, "model": turn.model_name, "choices": [],
                                  "usage": usage(result), "ajet": ajet_field(turn)})
        yield b"data: [DONE]\n\n"
    finally:
        generation.release()  # a no-op once recorded; the client may have gone away


def _completion_body(plane: EpisodePlane, fmt: ChatFormat, turn: ChatTurn,
                     result: GenerationResult, *, logprobs: bool) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuidlib.uuid4().hex}", "object": "text_completion",
        "created": int(time.time()), "model": turn.model_name,
        "choices": [{"index": 0, "text": result.text, "finish_reason": result.finish_reason,
                     "logprobs": _completion_logprobs(fmt, result) if logprobs else None}],
        "usage": usage(result), "ajet": ajet_field(turn),
    }


def _completion_logprobs(fmt: ChatFormat, result: GenerationResult) -> dict[str, Any]:
    tokens = [t["token"] for t in token_logprobs(fmt, result)]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": list(result.logprobs), "top_logprobs": None,
            "text_offset": offsets}


async def _completion_stream(plane: EpisodePlane, fmt: ChatFormat, generation: Generation,
                             turn: ChatTurn, *, logprobs: bool, include_usage: bool
                             ) -> AsyncIterator[bytes]:
    chunk_id, created = f"cmpl-{uuidlib.uuid4().hex}", int(time.time())

    def chunk(text: str, finish: str | None = None, **extra: Any) -> bytes:
        return _event({"id": chunk_id, "object": "text_completion", "created": created,
                       "model": turn.model_name,
                       "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                    "logprobs": extra.pop("logprobs", None)}], **extra})

    try:
        while True:
            kind, payload = await generation.next_event()
            if kind == "delta":
                yield chunk(payload)
                continue
            result: GenerationResult = payload
            try:
                generation.record(result, agent=turn.agent)
            except SwarmHTTPError as exc:
                yield stream_error(exc)
                break
            lp = _completion_logprobs(fmt, result) if logprobs else None
            last = {} if include_usage else {"ajet": ajet_field(turn)}
            yield chunk("", result.finish_reason, logprobs=lp, **last)
            if include_usage:
                yield _event({"id": chunk_id, "object": "text_completion", "created": created,
                              "model": turn.model_name, "choices": [],
                              "usage": usage(result), "ajet": ajet_field(turn)})
            break
        yield b"data: [DONE]\n\n"
    finally:
        generation.release()


# ---------------------------------------------------------------------------- helpers


def _chat_too_large(size: int, limit: int, max_prompt_length: int) -> PayloadTooLarge:
    """413: the body is over the chat size bound (EngineConfig.max_chat_bytes)."""
    return PayloadTooLarge(
        413, f"request body of {size} bytes is over this run's chat bound of {limit} bytes "
        f"(derived from max_prompt_length={max_prompt_length}: docs/limits.md)",
        "send a shorter conversation, or raise max_prompt_length in the job")


def _model_card(plane: EpisodePlane) -> dict[str, Any]:
    return {"id": plane.cfg.model, "object": "model", "created": int(plane.started_at),
            "owned_by": "agentjet"}


def episode_header(value: str | None) -> str:
    if not value:
        raise SwarmValidationError(400, "missing X-Episode-UUID header",
                                   "chat through the swarm server with the episode's API key")
    return value


def _event(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def stream_error(exc: SwarmHTTPError) -> bytes:
    """An error after the stream began (the status line is sent): OpenAI's error event."""
    return _event({"error": {"message": f"{exc.detail} (hint: {exc.hint})" if exc.hint
                             else str(exc.detail), "type": "episode_error",
                             "param": exc.param, "code": exc.status}})


def _sse(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

