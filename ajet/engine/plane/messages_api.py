"""`POST /v1/messages`: Anthropic's Messages API on the episode plane, stateless.

    POST /v1/messages                 header X-Episode-UUID; Anthropic message (or its SSE)
    POST /v1/messages/count_tokens    header X-Episode-UUID; {"input_tokens": n}

For the agents that speak Anthropic's API: the official `anthropic` SDK, harnesses
pointed at the plane with `ANTHROPIC_BASE_URL` (Claude Code, the Claude Agent SDK), and
frameworks' Anthropic model classes (LangChain's `ChatAnthropic`). A body is converted
once into the plane's own request (`messages_request` -> `PlaneRequest`): `system` (a
string or text blocks) becomes the system turn, `text` blocks become message text,
assistant `tool_use` blocks become tool calls, user `tool_result` blocks become tool
results (`is_error` marks the result as an error), `tools` (`input_schema`) become
function tools and `tool_choice` (`auto`, `any`, `tool`, `none`) the chat choice. From
there it is the chat path (`openai_api.build_turn`): the checkpoint's own template, the
same tool-call parsing and the same recording, so an episode records the same token ids
whichever API a workflow uses.

The reply is a `message` with `text` and `tool_use` blocks (`input` a JSON object),
`stop_reason` (`end_turn`, `max_tokens`, `stop_sequence` with `stop_sequence` set,
`tool_use`) and `usage` (`input_tokens`, `output_tokens`). Streamed, it is the event
sequence the SDK reads: `message_start`, `ping`, per block `content_block_start`,
`content_block_delta` (`text_delta` token by token; a tool call's `input_json_delta`
once it is parsed), `content_block_stop`, then `message_delta` (stop reason, usage) and
`message_stop`; `ping` again while the model is silent (a long prompt's prefill), and an
`error` event if the episode closes meanwhile.

What harnesses send besides (Claude Code: `thinking`, `context_management`,
`output_config`, `cache_control` on blocks and tools, `metadata.user_id`) is accepted
and has no effect (the first three are advisory: listed in the reply's `ajet.ignored`);
`max_tokens` above the run's `max_response_length` is served at that limit (the reply's
`usage.max_tokens_clamped` and `ajet` field say so). What would change
the meaning of the request is refused with a 400 naming the field: image and document
blocks, server tools (`web_search_...`, `bash_...`), `mcp_servers`, `container`, a final
assistant turn (prefill), and `top_k` in an eval episode (the sampler has no top-k).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid as uuidlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from ajet.errors import SwarmHTTPError, SwarmValidationError
from ajet.engine.generation.interface import GenerationResult
from ajet.engine.plane.chat_format import ChatFormat, FormatError, ParsedReply, ToolCall
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.protocol import PlanePath
from ajet.engine.plane.episodes import EVAL_EPISODE
from ajet.engine.plane.openai_api import (
    ChatTurn,
    accept_body,
    ajet_field,
    build_turn,
    finish_reply,
    reply_events,
    start_chat,
)
from ajet.engine.plane.request_policy import (
    PlaneRequest,
    RequestBody,
    ToolChoice,
    advisory_sent,
)
from ajet.engine.plane.serving import Generation

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "anthropic_messages_to_chat",
    "anthropic_tools_to_chat",
    "messages_request",
    "messages_router",
    "resolve_anthropic_tool_choice",
    "stop_reason",
]

#: Honoured, or accepted with no effect (`thinking`, `context_management`, `output_config`:
#: advisory, listed in `ajet.ignored` (`request_policy.advisory_sent`); `metadata`,
#: `service_tier` and `model` are in the shared ignored set).
_ADVISORY = ("thinking", "context_management", "output_config")
MESSAGES_PARAMS = frozenset({"messages", "system", "max_tokens", "stop_sequences", "stream",
                             "temperature", "top_p", "top_k", "tools", "tool_choice",
                             *_ADVISORY})
COUNT_TOKENS_PARAMS = frozenset({"messages", "system", "tools", "tool_choice", *_ADVISORY})
#: Fields that would change what the request means; refused (400) unless null.
_MESSAGES_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "mcp_servers": ((), "MCP connectors run on Anthropic's side; give the agent the tools "
                        "as client tools instead"),
    "container": ((), "code-execution containers are not available; give the agent a "
                      "client tool instead"),
    "inference_geo": ((), "drop it: the run's engine serves every request"),
}
#: Seconds without an event after which a stream sends `ping` (keeps proxies and
#: harnesses from timing out while a long prompt is prefilled).
PING_INTERVAL_S = 10.0
_TEXT_ONLY = ("this run's model reads text only; send the content as text, or leave "
              "the block out")


class MessagesRequest(RequestBody):
    model: str | None = None
    #: required, as in Anthropic's API
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=256)
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)


class CountTokensRequest(RequestBody):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=256)
    tool_choice: dict[str, Any] | None = None


def messages_router(plane: EpisodePlane) -> APIRouter:
    router = APIRouter()

    @router.post(PlanePath.MESSAGES, response_model=None)
    async def messages(
        request: Request,
        x_episode_uuid: Annotated[str | None, Header(max_length=100)] = None,
    ) -> JSONResponse | StreamingResponse:
        episode_uuid, body = await accept_body(plane, request, x_episode_uuid, MessagesRequest,
                                               accepted=MESSAGES_PARAMS,
                                               default_only=_MESSAGES_DEFAULT_ONLY)
        fmt, generation, turn = await start_chat(
            plane, episode_uuid, lambda f: build_turn(plane, f, episode_uuid, messages_request(
                plane, body, episode_type=plane.registry.episode_type(episode_uuid))),
            streaming=body.stream, request=request)
        stop = tuple(body.stop_sequences or ())
        if body.stream:
            return StreamingResponse(message_events(fmt, generation, turn, stop=stop),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await generation.wait()
        reply = finish_reply(fmt, generation, turn, result)
        return JSONResponse(message_body(fmt, turn, result, reply, stop=stop))

    @router.post(PlanePath.COUNT_TOKENS)
    async def count_tokens(
        request: Request,
        x_episode_uuid: Annotated[str | None, Header(max_length=100)] = None,
    ) -> dict[str, int]:
        episode_uuid, body = await accept_body(plane, request, x_episode_uuid,
                                               CountTokensRequest, accepted=COUNT_TOKENS_PARAMS,
                                               default_only=_MESSAGES_DEFAULT_ONLY)
        del episode_uuid  # checked by the swarm server's key; counting records nothing
        fmt, _ = plane.serving()
        return {"input_tokens": await asyncio.to_thread(_count, plane, fmt, body)}

    return router


def _count(plane: EpisodePlane, fmt: ChatFormat, body: CountTokensRequest) -> int:
    """The prompt tokens the same body would have in `/v1/messages` (nothing generated)."""
    request = messages_request(plane, MessagesRequest.model_validate(
        {**body.model_dump(exclude_none=True), "max_tokens": 1}), episode_type="count")
    tools, choice = request.tools, request.choice
    offered = tools if tools and choice.mode != "none" else None
    kwargs = ({"tool_choice": choice.name or choice.mode,
               "parallel_tool_calls": request.parallel} if offered else {})
    try:
        return len(fmt.render(request.messages or [], tools=offered,
                              template_kwargs=kwargs).ids)
    except FormatError as exc:
        raise _refused(str(exc), exc.hint, param=exc.param) from exc


# ---------------------------------------------------------------------------- the request


def _refused(detail: str, hint: str, *, param: str | None) -> SwarmValidationError:
    """400 naming the field at fault (`param`), with what to send instead."""
    return SwarmValidationError(400, detail, hint, param=param)


def messages_request(plane: EpisodePlane, body: MessagesRequest, *, episode_type: str
                     ) -> PlaneRequest:
    """A Messages body as the plane's request (the one conversion of this API)."""
    cfg = plane.cfg
    tools = anthropic_tools_to_chat(body.tools or [])
    choice, parallel = resolve_anthropic_tool_choice(body.tool_choice,
                                                     [t["function"]["name"] for t in tools])
    ignored: tuple[str, ...] = ()
    if body.top_k is not None:
        if episode_type == EVAL_EPISODE:
            raise _refused(f"top_k={body.top_k} cannot be applied: the engine samples with "
                             "temperature and top_p only", "drop top_k, or use top_p",
                             param="top_k")
        ignored = ("top_k",)  # training episodes sample with the run's settings anyway
    notes: dict[str, Any] = {}
    max_tokens = body.max_tokens
    if max_tokens > cfg.max_response_length:
        # harnesses send their own ceiling (Claude Code: 32000); serve at the run's
        notes["max_tokens_clamped"] = {"requested": max_tokens,
                                       "served": cfg.max_response_length}
        max_tokens = cfg.max_response_length
    return PlaneRequest(
        messages=anthropic_messages_to_chat(body.system, body.messages), tools=tools,
        choice=choice, parallel=parallel, max_tokens=max_tokens,
        stop=_stop_sequences(body.stop_sequences), temperature=body.temperature,
        top_p=body.top_p, ignored=(*ignored, *advisory_sent(body, _ADVISORY)), notes=notes,
        agent=body.model or "")


def _stop_sequences(stop: list[str] | None) -> tuple[str, ...]:
    out = tuple(stop or ())
    if any(not s for s in out) or len(out) > 8:
        raise _refused("stop_sequences must be up to 8 non-empty strings",
                         "fix the stop_sequences field", param="stop_sequences")
    return out


def anthropic_tools_to_chat(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Client tools (`name`, `description`, `input_schema`) as chat function tools."""
    out = []
    for index, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _refused(f"tools[{index}] is a server tool of type {kind!r}, which is not "
                             "served on the episode plane", "give the agent a client tool "
                             "(name, description, input_schema) instead",
                             param=f"tools[{index}].type")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _refused(f"tools[{index}] has no name", "name every tool",
                             param=f"tools[{index}].name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _refused(f"tools[{index}] ({name}) has no input_schema object",
                             "send input_schema as a JSON schema object",
                             param=f"tools[{index}].input_schema")
        # the order OpenAI clients send (templates render the dict as it comes)
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    return out


def resolve_anthropic_tool_choice(choice: dict[str, Any] | None, tool_names: list[str]
                                  ) -> tuple[ToolChoice, bool]:
    """Anthropic's `tool_choice` as the chat choice, and whether parallel calls are allowed."""
    if choice is None:
        return ToolChoice("auto" if tool_names else "none"), True
    kind = choice.get("type")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "none" or not tool_names and kind == "auto":
        return ToolChoice("none"), parallel
    if not tool_names:
        raise _refused(f"tool_choice {kind!r} but no tools were sent",
                         "send tools, or drop tool_choice", param="tool_choice")
    if kind == "auto":
        return ToolChoice("auto"), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "tool":
        name = choice.get("name")
        if name not in tool_names:
            raise _refused(f"tool_choice names {name!r}, which is not among the tools sent",
                             "name one of the tools", param="tool_choice.name")
        return ToolChoice("function", name), parallel
    raise _refused(f"tool_choice type {kind!r} is not one of auto, any, tool, none",
                     "send {'type': 'auto'}, {'type': 'any'}, {'type': 'tool', 'name': ...} "
                     "or {'type': 'none'}", param="tool_choice.type")


def anthropic_messages_to_chat(system: str | list[dict[str, Any]] | None,
                               messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`system` and Messages turns as OpenAI chat messages (what the template renders).

    A user turn's `tool_result` blocks become `tool` messages and its text a user message,
    in the order sent; an assistant turn's text is its content and its `tool_use` blocks
    its tool calls. Thinking blocks of earlier assistant turns are left out, as
    Anthropic's API leaves them out of the context of later turns.
    """
    chat: list[dict[str, Any]] = []
    system_text = _system_text(system)
    if system_text:
        chat.append({"role": "system", "content": system_text})
    for index, message in enumerate(messages):
        role = message.get("role")
        where = f"messages[{index}]"
        if role == "user":
            chat += _user_turn(message.get("content"), where)
        elif role == "assistant":
            chat.append(_assistant_turn(message.get("content"), where))
        else:
            raise _refused(f"{where} has role {role!r}", "use user or assistant (system "
                             "goes in the top-level system field)", param=f"{where}.role")
    if messages[-1].get("role") == "assistant":
        raise _refused("the last message is an assistant turn (a prefill), which this "
                         "episode plane does not continue", "end the conversation with a "
                         "user message", param=f"messages[{len(messages) - 1}].role")
    return chat


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for index, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
                block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise _refused(f"system[{index}] is a block of type {kind!r}",
                             "send system as text blocks", param=f"system[{index}].type")
        parts.append(block["text"])
    return "\n\n".join(parts)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _refused(f"{where}.content is neither text nor a list of blocks",
                         "send a string or content blocks", param=f"{where}.content")
    return content


def _refuse_block(kind: Any, param: str) -> SwarmValidationError:
    if kind in ("image", "document", "search_result", "container_upload"):
        return _refused(f"{param} is a content block of type {kind!r}", _TEXT_ONLY,
                          param=f"{param}.type")
    return _refused(f"{param} is a content block of type {kind!r}, which is not served "
                      "here", "send text, tool_use (assistant) and tool_result (user) blocks",
                      param=f"{param}.type")


def _text_of(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _refused(f"{param} is a text block without text", "send its text",
                         param=f"{param}.text")
    return text


def _user_turn(content: Any, where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
            texts.clear()

    for j, block in enumerate(_blocks(content, where)):
        param = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, param))
        elif kind == "tool_result":
            flush()
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": _tool_result_text(block, param)})
        else:
            raise _refuse_block(kind, param)
    flush()
    if not out:  # an empty turn still takes its place in the conversation
        out.append({"role": "user", "content": ""})
    return out


def _tool_result_text(block: dict[str, Any], param: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise _refuse_block(kind, f"{param}.content[{k}]")
            parts.append(_text_of(part, f"{param}.content[{k}]"))
        text = "\n\n".join(parts)
    else:
        raise _refused(f"{param}.content is neither text nor text blocks",
                         "send the tool's output as text", param=f"{param}.content")
    # the template has no error flag: the model reads it in the result itself
    return f"Error: {text}" if block.get("is_error") else text


def _assistant_turn(content: Any, where: str) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, where)):
        param = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, param))
        elif kind == "tool_use":
            name, tool_input = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(tool_input, dict):
                raise _refused(f"{param} needs a name and an input object",
                                 "send tool_use blocks as the API returned them",
                                 param=param)
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": name,
                                       "arguments": json.dumps(tool_input,
                                                               ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # not part of a later turn's context (see the function's docstring)
        else:
            raise _refuse_block(kind, param)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


# ---------------------------------------------------------------------------- the reply


def stop_reason(fmt: ChatFormat, result: GenerationResult, reply: ParsedReply,
                stop: tuple[str, ...]) -> tuple[str, str | None]:
    """`(stop_reason, stop_sequence)` of a finished reply."""
    if reply.tool_calls:
        return "tool_use", None
    if result.finish_reason == "length":
        return "max_tokens", None
    if stop:
        # the reply text is cut before the stop string; the recorded tokens end with it
        raw = str(fmt.tokenizer.decode(result.response_ids, skip_special_tokens=False))
        tail = raw[len(result.text):] if raw.startswith(result.text) else raw
        for sequence in sorted(stop, key=len, reverse=True):
            if tail.startswith(sequence):
                return "stop_sequence", sequence
    return "end_turn", None


def _tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": _tool_use_id(call), "name": call.name,
            "input": json.loads(call.arguments)}


def _usage(turn: ChatTurn, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    usage: dict[str, Any] = {"input_tokens": input_tokens, "output_tokens": output_tokens,
                             "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                             "service_tier": "standard"}
    if "max_tokens_clamped" in turn.extra:
        usage["max_tokens_clamped"] = turn.extra["max_tokens_clamped"]
    return usage


def message_body(fmt: ChatFormat, turn: ChatTurn, result: GenerationResult,
                 reply: ParsedReply, *, stop: tuple[str, ...]) -> dict[str, Any]:
    reason, sequence = stop_reason(fmt, result, reply, stop)
    content: list[dict[str, Any]] = []
    if reply.content or not reply.tool_calls:
        content.append({"type": "text", "text": reply.content or ""})
    content += [_tool_use_block(call) for call in reply.tool_calls]
    return {"id": f"msg_{uuidlib.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": turn.model_name, "content": content, "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": _usage(turn, len(result.prompt_ids), len(result.response_ids)),
            "ajet": ajet_field(turn)}


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def stream_error(exc: SwarmHTTPError) -> bytes:
    """An error after the stream began (the status line is sent): Anthropic's error event."""
    message = f"{exc.detail} (hint: {exc.hint})" if exc.hint else str(exc.detail)
    kind = "invalid_request_error" if exc.status < 500 else "api_error"
    return _sse("error", {"error": {"type": kind, "message": message}})


async def _with_pings(events: AsyncIterator[tuple[str, Any]]
                      ) -> AsyncIterator[tuple[str, Any]]:
    """`events`, with `("ping", None)` whenever none arrived for `PING_INTERVAL_S`."""
    pending: asyncio.Future[tuple[str, Any]] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            # asyncio.wait, not wait_for: a timeout must not cancel the pending read
            done, _ = await asyncio.wait({pending}, timeout=PING_INTERVAL_S)
            if not done:
                yield "ping", None
                continue
            pending, task = None, pending
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending


async def message_events(fmt: ChatFormat, generation: Generation, turn: ChatTurn, *,
                         stop: tuple[str, ...]) -> AsyncIterator[bytes]:
    """The streamed reply as Anthropic's event sequence (module docstring)."""
    message_id = f"msg_{uuidlib.uuid4().hex[:24]}"
    index = 0  # of the next content block
    text_open = False

    def open_text() -> bytes:
        nonlocal text_open
        text_open = True
        return _sse("content_block_start", {"index": index,
                                            "content_block": {"type": "text", "text": ""}})

    def close_text() -> bytes:
        nonlocal text_open, index
        text_open = False
        index += 1
        return _sse("content_block_stop", {"index": index - 1})

    try:
        yield _sse("message_start", {"message": {
            "id": message_id, "type": "message", "role": "assistant", "content": [],
            "model": turn.model_name, "stop_reason": None, "stop_sequence": None,
            "usage": _usage(turn, len(turn.prompt.ids), 0)}})
        yield _sse("ping", {})
        async for kind, payload in _with_pings(reply_events(fmt, generation, turn)):
            if kind == "ping":
                yield _sse("ping", {})
            elif kind == "content":
                if not text_open:
                    yield open_text()
                yield _sse("content_block_delta", {
                    "index": index, "delta": {"type": "text_delta", "text": payload}})
            elif kind == "error":
                yield stream_error(payload)
                return
            else:
                result, reply = payload
                if not text_open and not reply.tool_calls:
                    yield open_text()  # an empty reply is one empty text block
                if text_open:
                    yield close_text()
                for call in reply.tool_calls:
                    block = _tool_use_block(call)
                    yield _sse("content_block_start", {
                        "index": index, "content_block": {**block, "input": {}}})
                    yield _sse("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": call.arguments}})
                    yield _sse("content_block_stop", {"index": index})
                    index += 1
                reason, sequence = stop_reason(fmt, result, reply, stop)
                yield _sse("message_delta", {
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": _usage(turn, len(result.prompt_ids), len(result.response_ids)),
                    "ajet": ajet_field(turn)})
                yield _sse("message_stop", {})
                return
    finally:
        generation.release()  # a no-op once recorded; the client may have gone away
