"""`POST /v1/responses`: the OpenAI Responses API, stateless, on the episode plane.

For the clients that default to it (the openai-agents SDK's `OpenAIResponsesModel`,
LangChain's `ChatOpenAI(use_responses_api=True)`). The input (a string, or items:
`message` with text parts, `function_call`, `function_call_output`) and `instructions`
become chat messages, `tools` of type `function` become chat tools, and from there it is
the chat path (`openai_api.build_turn`): the same template rendering, tool-call parsing
and recording, so an episode's trajectory has the same token ids whichever API a workflow
uses. The reply has `message` (with `output_text`) and `function_call` output items,
`usage`, and `status`: `incomplete` (`incomplete_details.reason` `max_output_tokens`)
when the reply was cut at the `max_output_tokens` the request set, else `completed`.
A reply cut at a limit the request did not set (the run's `max_new_tokens`, or the
context window) is `completed`, with `ajet.truncated` saying where it was cut: the
client asked for no limit, and agent frameworks (openai-agents) treat `incomplete` as a
fatal error, so a run's own reply budget would otherwise fail every run of a workflow
that sets none. The cut is recorded for training either way (`finish_reason` `length`).

`reasoning` (any effort or summary) and `text.verbosity` are advisory: the run's model has
no such setting, so they have no effect and the reply lists them in `ajet.ignored`
(openai-agents' default model settings send both on every call). `text.format` other
than text would need constrained decoding, and is refused.

Nothing is stored: `store` is accepted and the reply says `"store": false`; whatever needs
a stored response or conversation (`previous_response_id`, `conversation`, item
references, `background`, `prompt` templates) and the built-in tools (web and file search,
computer use, ...) get a 400 naming the field. `include` honours
`message.output_text.logprobs` (the sampled tokens' log-probs); other values need state
or tools not served here, and are refused by name.
"""

from __future__ import annotations

import json
import time
import uuid as uuidlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ConfigDict, Field

from ajet.errors import SwarmValidationError
from ajet.engine.plane.chat_format import ChatFormat, FormatError, ParsedReply, text_content
from ajet.engine.generation.interface import GenerationResult
from ajet.engine.plane.openai_api import (
    ChatTurn,
    accept_body,
    ajet_field,
    build_turn,
    finish_reply,
    reply_events,
    start_chat,
    stream_error,
    token_logprobs,
)
from ajet.engine.plane.request_policy import (
    advisory_sent,
    PlaneRequest,
    RequestBody,
    Verbosity,
    resolve_max_tokens,
    resolve_tool_choice,
)
from ajet.engine.plane.serving import Generation
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.protocol import PlanePath


__all__ = ["ResponsesRequest", "responses_request", "responses_router", "responses_to_messages"]

#: Accepted with no effect, listed in `ajet.ignored` (`request_policy.advisory_sent`).
RESPONSES_ADVISORY = ("reasoning", "text.verbosity")
RESPONSES_PARAMS = frozenset({"input", "instructions", "tools", "tool_choice",
                              "parallel_tool_calls", "max_output_tokens", "stream",
                              "stream_options", "temperature", "top_p", "include", "text",
                              "reasoning"})
_STATE = "the episode plane is stateless: nothing is stored between calls"
#: Parameters honoured at their default only (the shared table has the rest).
_RESPONSES_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((), f"{_STATE}; send the whole conversation as input items"),
    "conversation": ((), f"{_STATE}; send the whole conversation as input items"),
    "background": ((False,), "background responses need stored state; call without it"),
    "prompt": ((), "stored prompt templates need state; send instructions and input"),
    "max_tool_calls": ((), "drop it; the workflow decides when to stop calling tools"),
    "truncation": (("disabled",), "the prompt is never truncated; shorten the input"),
    "context_management": ((), f"{_STATE}; drop it"),
    "prompt_cache_options": ((), "drop it"),
}
_LOGPROBS = "message.output_text.logprobs"


class ResponseText(RequestBody):
    """`text`: the reply's format (text only: `_check_format`) and verbosity (advisory)."""

    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: Verbosity | None = None


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=256)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    include: list[str] | None = None
    text: ResponseText | None = None
    #: advisory, whatever it holds (`effort`, `summary`, ...): no reasoning is produced
    reasoning: dict[str, Any] | None = None


def responses_router(plane: EpisodePlane) -> APIRouter:
    router = APIRouter()

    @router.post(PlanePath.RESPONSES, response_model=None)
    async def responses(
        request: Request,
        x_episode_uuid: Annotated[str | None, Header(max_length=100)] = None,
    ) -> JSONResponse | StreamingResponse:
        episode_uuid, body = await accept_body(plane, request, x_episode_uuid, ResponsesRequest,
                                               accepted=RESPONSES_PARAMS,
                                               default_only=_RESPONSES_DEFAULT_ONLY)
        logprobs = _check_include(body.include)
        fmt, generation, turn = await start_chat(
            plane, episode_uuid, lambda f: _prepare(plane, f, episode_uuid, body),
            streaming=body.stream, request=request)
        if body.stream:
            return StreamingResponse(_stream(fmt, generation, turn, body, logprobs=logprobs),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        result = await generation.wait()
        reply = finish_reply(fmt, generation, turn, result)
        return JSONResponse(_response(fmt, turn, body, result, reply, logprobs=logprobs,
                                      response_id=f"resp_{uuidlib.uuid4().hex}"))

    return router


# ---------------------------------------------------------------------------- input


def _check_include(include: list[str] | None) -> bool:
    for value in include or []:
        if value != _LOGPROBS:
            raise SwarmValidationError(
                400, f"include={value!r} is not served: it needs stored state or a "
                "built-in tool", f"include only {_LOGPROBS!r}, or nothing",
                param="include")
    return _LOGPROBS in (include or [])


def _check_format(text: ResponseText | None) -> None:
    form = text.format if text is not None else None
    if form is not None and form != {"type": "text"}:
        raise SwarmValidationError(
            400, f"text.format={json.dumps(form)[:200]} is not supported on the episode "
            "plane", "constrained decoding is not supported; ask for JSON in the "
            "instructions", param="text.format")


def _prepare(plane: EpisodePlane, fmt: ChatFormat, episode_uuid: str, body: ResponsesRequest
             ) -> ChatTurn:
    return build_turn(plane, fmt, episode_uuid, responses_request(plane, body))


def responses_request(plane: EpisodePlane, body: ResponsesRequest) -> PlaneRequest:
    """A Responses body as the plane's request (input items as chat messages)."""
    _check_format(body.text)
    tools = [_chat_tool(tool, i) for i, tool in enumerate(body.tools or [])]
    choice = resolve_tool_choice(body.tool_choice, [t["function"]["name"] for t in tools])
    cfg = plane.cfg
    return PlaneRequest(
        messages=responses_to_messages(body.instructions, body.input), tools=tools,
        choice=choice, parallel=body.parallel_tool_calls is not False,
        max_tokens=resolve_max_tokens(body.max_output_tokens, param="max_output_tokens",
                                      default=cfg.max_new_tokens,
                                      limit=cfg.max_response_length),
        temperature=body.temperature, top_p=body.top_p,
        ignored=advisory_sent(body, RESPONSES_ADVISORY), agent=body.model or "")


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """A Responses `function` tool as a chat tool; built-in tools are refused by name."""
    kind = tool.get("type")
    if kind != "function":
        raise SwarmValidationError(
            400, f"tools[{index}] is a built-in {kind!r} tool, which is not served on "
            "the episode plane", "give the agent a function tool instead",
            param=f"tools[{index}].type")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise SwarmValidationError(400, f"tools[{index}] has no name", "name every function tool",
                                   param=f"tools[{index}].name")
    function = {"name": name, "description": tool.get("description"),
                "parameters": tool.get("parameters"), "strict": tool.get("strict")}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def responses_to_messages(instructions: str | None, items: str | list[dict[str, Any]]
                          ) -> list[dict[str, Any]]:
    """Responses input items as chat messages (consecutive function calls: one turn)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for index, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise SwarmValidationError(400, f"input[{index}] has role {role!r}",
                                           "use system, developer, user or assistant",
                                           param=f"input[{index}].role")
            messages.append({"role": role, "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments",
                                                                                 "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), index)})
        else:
            raise SwarmValidationError(
                400, f"input[{index}] is an item of type {kind!r}, which needs state "
                "or a built-in tool", "send message, function_call and "
                "function_call_output items", param=f"input[{index}].type")
    if not messages:
        raise SwarmValidationError(
            400, "input is empty", "send the conversation as input", param="input")
    return messages


def _text(content: Any, index: int) -> str:
    try:
        return text_content(content, param=f"input[{index}].content")
    except FormatError as exc:
        raise SwarmValidationError(400, str(exc), exc.hint, param=exc.param) from exc


# ---------------------------------------------------------------------------- output


def _status(result: GenerationResult, body: ResponsesRequest
            ) -> tuple[str, dict[str, str] | None]:
    """`incomplete` only for a cut at the request's own `max_output_tokens` (module doc)."""
    if result.finish_reason == "length" and body.max_output_tokens is not None:
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _truncated(turn: ChatTurn, body: ResponsesRequest, result: GenerationResult | None
               ) -> dict[str, Any] | None:
    """Where a reply was cut at a limit the request did not set (`ajet.truncated`)."""
    if result is None or result.finish_reason != "length" or body.max_output_tokens is not None:
        return None
    limit = turn.ask.max_new_tokens
    if len(result.response_ids) >= limit:
        return {"limit": limit, "source": "run"}  # the job's max_new_tokens
    return {"limit": len(result.prompt_ids) + len(result.response_ids), "source": "context"}


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None
                  ) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}


def _call_items(reply: ParsedReply) -> list[dict[str, Any]]:
    return [{"type": "function_call", "id": f"fc_{uuidlib.uuid4().hex[:24]}", "call_id": c.id,
             "name": c.name, "arguments": c.arguments, "status": "completed"}
            for c in reply.tool_calls]


def _response(fmt: ChatFormat, turn: ChatTurn, body: ResponsesRequest,
              result: GenerationResult | None, reply: ParsedReply | None, *, logprobs: bool,
              response_id: str, output: list[dict[str, Any]] | None = None,
              created: int | None = None) -> dict[str, Any]:
    """The response object; `result` None: still in progress (the stream's first events)."""
    status, details = _status(result, body) if result is not None else ("in_progress", None)
    if output is None and result is not None and reply is not None:
        output = []
        if reply.content or not reply.tool_calls:
            lp = token_logprobs(fmt, result) if logprobs else None
            output.append(_message_item(f"msg_{uuidlib.uuid4().hex[:24]}", reply.content or "",
                                        status, lp))
        output += _call_items(reply)
    usage = None
    if result is not None:
        p, c = len(result.prompt_ids), len(result.response_ids)
        usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": p + c}
    return {
        "id": response_id, "object": "response", "created_at": created or int(time.time()),
        "status": status, "error": None, "incomplete_details": details,
        "instructions": body.instructions, "model": turn.model_name, "output": output or [],
        "parallel_tool_calls": turn.parallel_tool_calls,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [], "temperature": turn.sampling.temperature,
        "top_p": turn.sampling.top_p, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": None, "reasoning": None,
        "store": False,  # accepted, and nothing is stored: the plane is stateless
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": {},
        "usage": usage, "ajet": _ajet(turn, body, result),
    }


def _ajet(turn: ChatTurn, body: ResponsesRequest, result: GenerationResult | None
          ) -> dict[str, Any]:
    out = ajet_field(turn)
    truncated = _truncated(turn, body, result)
    if truncated is not None:
        out["truncated"] = truncated
    return out


async def _stream(fmt: ChatFormat, generation: Generation, turn: ChatTurn,
                  body: ResponsesRequest, *, logprobs: bool) -> AsyncIterator[bytes]:
    response_id, created = f"resp_{uuidlib.uuid4().hex}", int(time.time())
    sequence = 0
    output: list[dict[str, Any]] = []
    message_id = f"msg_{uuidlib.uuid4().hex[:24]}"
    message_open = False
    text = ""

    def event(kind: str, **data: Any) -> bytes:
        nonlocal sequence
        sequence += 1
        payload = json.dumps({"type": kind, "sequence_number": sequence - 1, **data})
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def snapshot(result: GenerationResult | None = None) -> dict[str, Any]:
        return _response(fmt, turn, body, result, None, logprobs=logprobs,
                         response_id=response_id, output=output, created=created)

    def open_message() -> list[bytes]:
        nonlocal message_open
        message_open = True
        return [event("response.output_item.added", output_index=len(output),
                      item=_message_item(message_id, "", "in_progress", None) | {"content": []}),
                event("response.content_part.added", item_id=message_id,
                      output_index=len(output), content_index=0,
                      part={"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []})]

    def text_delta(delta: str) -> list[bytes]:
        nonlocal text
        out = [] if message_open else open_message()
        text += delta
        return [*out, event("response.output_text.delta", item_id=message_id,
                            output_index=len(output), content_index=0, delta=delta,
                            logprobs=[])]

    try:
        yield event("response.created", response=snapshot())
        yield event("response.in_progress", response=snapshot())
        async for kind, payload in reply_events(fmt, generation, turn):
            if kind == "content":
                for chunk in text_delta(payload):
                    yield chunk
                continue
            if kind == "error":
                yield stream_error(payload)
                break
            result, reply = payload
            if not message_open and not reply.tool_calls:
                for chunk in open_message():  # an empty reply is an empty message
                    yield chunk
            status, _ = _status(result, body)
            if message_open:
                lp = token_logprobs(fmt, result) if logprobs else None
                item = _message_item(message_id, text, status, lp)
                part = item["content"][0]
                yield event("response.output_text.done", item_id=message_id,
                            output_index=len(output), content_index=0, text=text,
                            logprobs=part["logprobs"])
                yield event("response.content_part.done", item_id=message_id,
                            output_index=len(output), content_index=0, part=part)
                yield event("response.output_item.done", output_index=len(output), item=item)
                output.append(item)
            for item in _call_items(reply):
                index = len(output)
                yield event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=item["arguments"], name=item["name"])
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
            final = snapshot(result)
            yield event("response.completed" if status == "completed" else "response.incomplete",
                        response=final)
            break
    finally:
        generation.release()  # a no-op once recorded; the client may have gone away
