"""Chat format: OpenAI chats rendered with the checkpoint's own chat template, and the
generated text parsed back into content and tool calls.

Rendering. Messages are put in the shape Hugging Face chat templates expect (an assistant
call's `arguments` as a dict, `developer` as `system`, text parts joined, a tool result's
`name` filled in from the call it answers), then rendered by
`tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)` with
`sanitize_control_tokens=True`: a control token inside a message or a tool result (a fake
`<|im_start|>system`) is encoded as plain text, so only the template writes turns. A
template that renders the same prompt with and without the tools ignores them, and that
is refused (`FormatError`) rather than silently dropped.

Parsing. With transformers' response parsing (`tokenizer.parse_response` and its streaming
`ResponseParser`): the tokenizer's own `response_template` when it defines one, otherwise
the documented format of the template's family. The one family known here is Qwen2.5
(and ajet-tiny, which uses it): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, with content around them. A transformers too old for response parsing falls back
to matching those blocks directly. A block that does not parse (bad JSON, no name,
arguments that are not an object, a block cut off by `max_tokens`) makes the whole reply
plain content with `parse_error` set: the caller counts it (`tool_call_parse_errors`),
never fails the request.

Streaming. `ContentStream` passes content deltas through until a tool-call block may be
starting (the parser holds back a partial `<tool_call`), then holds everything; once the
reply is complete the caller parses it whole and emits the rest (`ContentStream.rest`).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ajet.engine.trajectory import ChatMessage, chat_message

__all__ = [
    "QWEN25_RESPONSE_TEMPLATE",
    "ChatFormat",
    "ContentStream",
    "FormatError",
    "ParsedReply",
    "RenderedPrompt",
    "ToolCall",
    "new_call_id",
    "normalize_messages",
    "text_content",
]

log = logging.getLogger(__name__)

#: The Qwen2.5 family's tool-call format as a transformers `response_template`: content
#: (whitespace kept, so a streamed prefix stays a prefix) around `<tool_call>` blocks of
#: JSON `{"name", "arguments"}`.
QWEN25_RESPONSE_TEMPLATE: dict[str, Any] = {
    "version": 1,
    "start_anchor": "<|im_start|>assistant\n",
    "defaults": {"role": "assistant"},
    "fields": {
        "content": {"content": "text", "content_args": {"strip": False}, "repeats": True,
                    "join": ""},
        "tool_calls": {
            "open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
            "transform": {"type": "function", "function": {"name": "{content.name}",
                                                           "arguments": "{content.arguments}"}},
        },
    },
}
#: What marks a template of that family.
_QWEN25_MARKER = "<tool_call>"
_QWEN25_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)



@functools.cache
def _response_parsing() -> tuple[Any, Any]:
    """transformers' `(ResponseParser, parse_response)`, or Nones where it has none.

    Imported on first use, so that `tiny` can read the template above without transformers.
    """
    try:  # response parsing arrived in transformers 5; older ones use the fallback below
        from transformers.utils.chat_parsing import ResponseParser, parse_response
    except ImportError:  # pragma: no cover - depends on the installed transformers
        return None, None
    return ResponseParser, parse_response


class FormatError(ValueError):
    """The chat cannot be rendered or its tools cannot be served by this checkpoint.

    `param` names the request field at fault (OpenAI's `error.param`).
    """

    def __init__(self, message: str, hint: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    #: JSON text of an object, as OpenAI sends `function.arguments`
    arguments: str


@dataclass(frozen=True)
class ParsedReply:
    """The reply as a message: content and tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    #: why the text was not taken as tool calls (then `content` is the whole text)
    parse_error: str | None = None


@dataclass(frozen=True)
class RenderedPrompt:
    ids: list[int]
    #: the prompt as text (what the response parser reads as its prefix)
    text: str
    #: the messages as rendered, for the trajectory record (None: not a chat)
    messages: tuple[ChatMessage, ...] | None = None
    #: (message index, start, end) of each assistant message in `ids` (`assistant_spans`)
    assistant_spans: tuple[tuple[int, int, int], ...] = ()


def new_call_id() -> str:
    return f"call_{uuidlib.uuid4().hex[:24]}"


class ChatFormat:
    """Rendering and parsing for one tokenizer (built once per loaded policy)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        #: transformers renders control tokens in messages as text itself (5.2x and later)
        self.sanitizes = _has_sanitize(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        own = getattr(tokenizer, "response_template", None)
        if own is not None:
            self.response_template: dict[str, Any] | None = own
            self.source = "tokenizer response_template"
        elif isinstance(template, str) and _QWEN25_MARKER in template:
            self.response_template = QWEN25_RESPONSE_TEMPLATE
            self.source = "Qwen2.5 <tool_call> format"
        else:
            self.response_template = None
            self.source = "none"

    @property
    def parses_tool_calls(self) -> bool:
        return self.response_template is not None

    # ------------------------------------------------------------------ rendering

    def render(self, messages: Sequence[dict[str, Any]], *,
               tools: Sequence[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> RenderedPrompt:
        """Token ids (and text) of the chat, ready for the assistant's reply."""
        chat = normalize_messages(messages)
        tool_list = list(tools) if tools else None
        ids = self._apply(chat, tool_list, template_kwargs or {})
        if tool_list and ids == self._apply(chat, None, template_kwargs or {}):
            raise FormatError(
                "this checkpoint's chat template does not render tools, so the model would "
                "never see them", "send no tools, or use a checkpoint whose chat template "
                "takes `tools` (apply_chat_template(..., tools=...))", param="tools")
        text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        return RenderedPrompt(ids=ids, text=text,
                              messages=tuple(chat_message(m) for m in chat),
                              assistant_spans=self.assistant_spans(chat, tool_list, ids,
                                                                   template_kwargs or {}))

    def assistant_spans(self, chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        ids: list[int], kwargs: dict[str, Any]
                        ) -> tuple[tuple[int, int, int], ...]:
        """Where each assistant message sits in the rendered prompt `ids`.

        The message's block starts where the chat before it, rendered with the generation
        prompt, ends, and ends where the chat up to it ends; both must be prefixes of the
        prompt. A message for which either is not (a template that re-renders earlier
        turns, such as one that drops old reasoning) has no span, and the trajectory
        keeps its tokens as they were rendered. The prefixes are rendered as text and
        placed with the fast tokenizer's offsets (one tokenisation of the whole prompt);
        where the prompt's ids are not that tokenisation (a control token written as
        text) each prefix is tokenised instead.
        """
        indices = [i for i, m in enumerate(chat) if m.get("role") == "assistant" and i > 0]
        if not indices:
            return ()
        text = str(self.tokenizer.decode(ids, skip_special_tokens=False))
        starts = self._token_starts(text, ids)
        spans = []
        for index in indices:
            try:
                if starts is None:
                    head_ids = self._apply(chat[:index], tools, kwargs)
                    block_ids = self._apply(chat[:index + 1], tools, kwargs,
                                            generation_prompt=False)
                    before, upto = len(head_ids), len(block_ids)
                    placed = ids[:before] == head_ids and ids[:upto] == block_ids
                else:
                    head = self._render_text(chat[:index], tools, kwargs, True)
                    block = self._render_text(chat[:index + 1], tools, kwargs, False)
                    placed = (text.startswith(head) and text.startswith(block)
                              and len(head) in starts and len(block) in starts)
                    before = starts.get(len(head), 0)
                    upto = starts.get(len(block), 0)
            except FormatError:
                continue
            if placed and before <= upto:
                spans.append((index, before, upto))
        return tuple(spans)

    def _token_starts(self, text: str, ids: list[int]) -> dict[int, int] | None:
        """Character offset -> index of the token starting there (the end: len(ids))."""
        if not getattr(self.tokenizer, "is_fast", False):
            return None
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if [int(i) for i in encoded["input_ids"]] != ids:
            return None
        starts: dict[int, int] = {}
        for index, (begin, _) in enumerate(encoded["offset_mapping"]):
            starts.setdefault(int(begin), index)
        starts[len(text)] = len(ids)
        return starts

    def _render_text(self, chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     kwargs: dict[str, Any], generation_prompt: bool) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(
                chat, tools=tools, add_generation_prompt=generation_prompt, tokenize=False,
                **kwargs))
        except Exception as exc:  # as in _apply: whatever the template raises
            raise FormatError(f"the model's chat template cannot render these messages: {exc}",
                              "send messages in the roles and shapes the template accepts",
                              param="messages") from exc

    def _apply(self, chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any], *, generation_prompt: bool = True) -> list[int]:
        try:
            if self.sanitizes:
                encoded = self.tokenizer.apply_chat_template(
                    chat, tools=tools, add_generation_prompt=generation_prompt, tokenize=True,
                    return_dict=True, sanitize_control_tokens=True, **kwargs)
                return [int(i) for i in encoded["input_ids"]]
            return self._apply_marked(chat, tools, kwargs, generation_prompt=generation_prompt)
        except Exception as exc:  # jinja's TemplateError and whatever the template raises
            raise FormatError(f"the model's chat template cannot render these messages: {exc}",
                              "send messages in the roles and shapes the template accepts",
                              param="messages") from exc

    def _apply_marked(self, chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      kwargs: dict[str, Any], *, generation_prompt: bool = True) -> list[int]:
        """`sanitize_control_tokens` for transformers releases without it (before 5.2x):
        control tokens inside the messages and tools become one private-use character
        each, the template renders, and those characters are encoded back as the control
        token's text, never as the token; only the template's own control tokens stay
        tokens."""
        tok = self.tokenizer
        controls = sorted({*tok.all_special_tokens,
                           *(t.content for t in tok.added_tokens_decoder.values())},
                          key=len, reverse=True)
        marks = {control: chr(_MARK_BASE + i) for i, control in enumerate(controls)}
        unmark = {mark: control for control, mark in marks.items()}
        pattern = re.compile("|".join(re.escape(c) for c in controls)) if controls else None

        def mark(value: Any) -> Any:
            if isinstance(value, str):
                if any(ch in unmark for ch in value):
                    raise ValueError("the messages hold characters from the private-use "
                                     f"range U+{_MARK_BASE:X}.. that this server reserves")
                return pattern.sub(lambda m: marks[m.group(0)], value) if pattern else value
            if isinstance(value, list):
                return [mark(v) for v in value]
            if isinstance(value, dict):
                return {k: mark(v) for k, v in value.items()}
            return value

        text = tok.apply_chat_template(mark(chat), tools=mark(tools),
                                       add_generation_prompt=generation_prompt, tokenize=False,
                                       **kwargs)
        ids: list[int] = []
        for piece in re.split(f"([{''.join(unmark)}])", text) if unmark else [text]:
            if not piece:
                continue
            if piece in unmark:
                ids += tok(unmark[piece], add_special_tokens=False,
                           split_special_tokens=True)["input_ids"]
            else:
                ids += tok(piece, add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    # ------------------------------------------------------------------ parsing

    def parse(self, text: str, *, prompt_text: str,
              tools: Sequence[dict[str, Any]] | None) -> ParsedReply:
        """Content and tool calls of a complete reply (tools offered: `tools`)."""
        if self.response_template is None:
            return ParsedReply(content=text)
        try:
            message = self._parse_message(text, prompt_text, tools)
            content = message.get("content")
            if content is not None and not isinstance(content, str):
                raise ValueError(f"content parsed as {type(content).__name__}, not text")
            calls = tuple(_tool_call(raw) for raw in message.get("tool_calls") or ())
        except (ValueError, KeyError, TypeError) as exc:
            return ParsedReply(content=text, parse_error=_one_line(exc))
        content = (content or "").strip()
        return ParsedReply(content=content or None, tool_calls=calls)

    def _parse_message(self, text: str, prompt_text: str,
                       tools: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
        tool_list = list(tools or [])
        parse_response = _response_parsing()[1]
        if parse_response is not None:
            return dict(parse_response(text, self.response_template, prefix=prompt_text,
                                       tools=tool_list))
        return _parse_qwen25_blocks(text)  # pragma: no cover - old transformers only

    def content_stream(self, *, prompt_text: str, tools: Sequence[dict[str, Any]] | None
                       ) -> ContentStream:
        return ContentStream(self, prompt_text=prompt_text, tools=tools)


class ContentStream:
    """Streamed content deltas of a reply that may contain tool calls (module docstring)."""

    def __init__(self, fmt: ChatFormat, *, prompt_text: str,
                 tools: Sequence[dict[str, Any]] | None) -> None:
        self.streamed = ""
        self._parser: Any = None
        self._content_field = "content"
        parser_class = _response_parsing()[0]
        if fmt.response_template is not None and parser_class is not None:
            try:
                self._parser = parser_class(fmt.response_template, prefix=prompt_text,
                                              tools=list(tools or []))
            except ValueError as exc:
                log.warning("no streaming parser for this template (%s); content is held "
                            "until the reply is complete", exc)

    def feed(self, delta: str) -> str:
        """The part of the content that can be shown now ("" once a tool call may start)."""
        if self._parser is None:
            return ""
        try:
            events = self._parser.feed(delta)
        except ValueError:  # a malformed block: the final parse decides what it becomes
            self._parser = None
            return ""
        out = []
        for event in events:
            if event["type"] == "region_open" and event["field"] != self._content_field:
                self._parser = None  # a tool call: hold the rest until the reply is complete
                break
            if event["type"] == "region_chunk" and event["field"] == self._content_field:
                out.append(event["text"])
        text = "".join(out)
        self.streamed += text
        return text

    def rest(self, reply: ParsedReply, raw_text: str) -> str:
        """The content still to send once the reply is complete and parsed."""
        final = raw_text if reply.parse_error else (reply.content or "")
        if final.startswith(self.streamed):
            return final[len(self.streamed):]
        return ""  # what was streamed already covers the (stripped) content


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages in the shape Hugging Face chat templates read."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from earlier assistant calls
    chat: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": text_content(message.get("content"),
                                                       param=f"messages[{index}].content")}
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                fn = call.get("function") or {}
                if call.get("id"):
                    names[str(call["id"])] = str(fn.get("name", ""))
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": fn.get("name"),
                                           "arguments": _arguments_dict(fn.get("arguments"))}})
            out["tool_calls"] = calls
        if role == "tool":
            call_id = message.get("tool_call_id")
            out["tool_call_id"] = call_id
            out["name"] = message.get("name") or names.get(str(call_id), "")
        chat.append(out)
    return chat


def text_content(content: Any, *, param: str) -> str:
    """A message's text: a string, or text parts joined (`param` names it in errors)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FormatError("content is neither text nor a list of parts", "send text",
                          param=param)
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text") or not isinstance(
                part.get("text"), str):
            raise FormatError(f"content part of type {kind!r} is not supported",
                              "send text content only", param=param)
        parts.append(part["text"])
    return "".join(parts)


def _arguments_dict(arguments: Any) -> Any:
    """Templates expect arguments as a dict; OpenAI sends JSON text. Kept as sent if not JSON."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments if arguments is not None else {}


def _tool_call(raw: Any) -> ToolCall:
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(fn, dict):
        raise ValueError(f"a tool call parsed as {type(raw).__name__}, not an object")
    name, arguments = fn.get("name"), fn.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call has no function name")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of {name!r} are not a JSON object")
    call_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    return ToolCall(id=call_id or new_call_id(), name=name,
                    arguments=json.dumps(arguments, ensure_ascii=False))


def _parse_qwen25_blocks(text: str) -> dict[str, Any]:  # pragma: no cover - old transformers
    calls = []
    for match in _QWEN25_BLOCK.finditer(text):
        if not match.group(0).endswith("</tool_call>"):
            raise ValueError("a <tool_call> block is not closed")
        calls.append(json.loads(match.group(1)))
    return {"content": _QWEN25_BLOCK.sub("", text), "tool_calls": calls}


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


#: First of the private-use characters that stand for control tokens while a chat
#: renders without `sanitize_control_tokens` (supplementary private-use area A).
_MARK_BASE = 0xF0000


def _has_sanitize(tokenizer: Any) -> bool:
    """Whether this transformers' `apply_chat_template` takes `sanitize_control_tokens`."""
    import inspect

    return "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters
