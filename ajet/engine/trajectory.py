"""Trajectories: what one episode sampled, and the training samples made from it.

Recording. Every completion served for an episode is kept as a `Completion`: the prompt
token ids the model saw, the sampled response ids with their log-probs, the agent that
asked (the request's `model` name), and, for chat-shaped calls (chat completions,
Responses, Messages: whatever the episode plane rendered through the chat template), the
plane's own record of the request: its messages as rendered, where each assistant
message sits in the prompt tokens, and the reply parsed back into content and tool calls.

Timelines. An agent calls the model again and again, each time re-sending the growing
history as text, so one sample per call would train the shared prefix over and over and
would train re-tokenised text instead of what was sampled. Once an episode has ended,
`build_samples` groups its completions into timelines, per agent:

1. A re-sent assistant message is *matched* to the earlier completion whose reply it is
   (same content, and the same tool calls by name and argument values: a call sampled
   as `{"a":1}` comes back as `{"a": 1}`).
2. A call *extends* an earlier one when its messages begin with the earlier call's
   messages followed by the earlier call's reply. The earlier call's sampled ids are
   spliced in where the template re-rendered that reply (and so on for every call of
   the chain), and what is between such replies must then match the earlier call's
   sequence token for token (`compare_level="token"`, the default) or only as messages
   (`"text"`: the tokens of the later call are kept where they differ). Calls that are
   not chat-shaped (`/v1/completions`) extend when their prompt begins with the earlier
   sequence, token for token, or as decoded text with `"text"`.
3. Each maximal chain is one sample: the token sequence of its last call with the
   sampled ids spliced in, the loss mask on every token the model sampled in a call of
   the chain, off on prompt, tool and template tokens. A call that extends nothing
   (another agent, a retry whose context was dropped, a fork after an edited history)
   starts its own chain; two calls extending the same one fork it, and the shared part
   is trained once (the mask is on in the first sample that holds it, off in the
   others). A call identical to an earlier one (same prompt, same reply) counts once.

A small example. Brackets are template and environment tokens ([sys], [user] and
[tool] turns, [asst] the assistant header, [end] the end of turn, [nl] the newline the
template writes after it); x, y, z are sampled tokens:

    call 1  prompt   [sys] [user] [asst]
            sampled  x y [end]
    call 2  prompt   [sys] [user] [asst] x' y [end] [nl] [tool] [asst]
            sampled  z [end]

Call 2's messages are call 1's, then call 1's reply (matched by content), then a tool
result; the template re-rendered the reply as x' y (say, `{"a": 1}` for a sampled
`{"a":1}`). Splicing puts the sampled `x y [end]` there; what comes before it matches
call 1 token for token, so the two calls are one sample:

    tokens  [sys] [user] [asst] x y [end] [nl] [tool] [asst] z [end]
    mask      0     0      0    1 1   1    0     0      0    1   1

`retokenisation_drift` counts re-sent replies whose re-rendered tokens were not the
sampled ones (`x'` above): without splicing those would have been trained instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["COMPARE_LEVELS", "ChatMessage", "Completion", "Sample", "Timelines", "Trajectory",
           "build_samples", "chat_message", "reply_message"]

#: How the history between re-sent replies must match (`timeline_compare_level`).
COMPARE_LEVELS = ("token", "text")
CompareLevel = Literal["token", "text"]


# ---------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ChatMessage:
    """One message as the plane rendered it, in a form that compares by value."""

    role: str
    content: str
    #: (function name, arguments as canonical JSON), in order
    tool_calls: tuple[tuple[str, str], ...] = ()

    def is_reply(self, reply: ChatMessage) -> bool:
        """This assistant message re-sends `reply` (content and tool-call values)."""
        return (self.role == "assistant" and self.tool_calls == reply.tool_calls
                and self.content.strip() == reply.content.strip())


def _canonical_arguments(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments  # not JSON: compared as sent
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def chat_message(message: dict[str, Any]) -> ChatMessage:
    """A rendered message (`{"role", "content", "tool_calls": [{"function": ...}]}`)."""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append((str(fn.get("name") or ""), _canonical_arguments(fn.get("arguments"))))
    content = message.get("content")
    return ChatMessage(role=str(message.get("role") or ""),
                       content=content if isinstance(content, str) else "",
                       tool_calls=tuple(calls))


def reply_message(content: str | None, tool_calls: Iterable[tuple[str, Any]] = ()) -> ChatMessage:
    """A parsed reply (content, and (name, arguments) per tool call) as a message."""
    return ChatMessage(role="assistant", content=content or "",
                       tool_calls=tuple((n, _canonical_arguments(a)) for n, a in tool_calls))


@dataclass(frozen=True)
class Completion:
    """One completion of an episode (a chat, completions, responses or messages call)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    #: log-prob of each response token when it was sampled (same length as response_ids)
    logprobs: tuple[float, ...]
    finish_reason: str
    #: engine step (number of finished updates) of the policy that sampled it
    policy_step: int
    #: the reply held a tool call that did not parse (served as content; a step metric)
    tool_call_parse_error: bool = False
    #: who asked: the request's `model` name ("" when it sent none)
    agent: str = ""
    #: chat-shaped calls: the messages as rendered (None: a raw-prompt completion)
    messages: tuple[ChatMessage, ...] | None = None
    #: (message index, start, end): where each assistant message of `messages` sits in
    #: prompt_ids (only those the template renders as a prefix-stable block)
    assistant_spans: tuple[tuple[int, int, int], ...] = ()
    #: the reply as a message (content and tool calls as served)
    reply: ChatMessage | None = None

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.logprobs):
            raise ValueError(
                f"a completion needs one log-prob per response token: "
                f"{len(self.response_ids)} tokens, {len(self.logprobs)} log-probs"
            )


@dataclass
class Trajectory:
    """All completions of one episode, in the order they were served."""

    completions: list[Completion] = field(default_factory=list)

    def add(self, completion: Completion) -> None:
        self.completions.append(completion)

    @property
    def response_tokens(self) -> int:
        return sum(len(c.response_ids) for c in self.completions)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt_ids) for c in self.completions)


# ---------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class Sample:
    """One training sample: a timeline of one agent."""

    agent: str
    token_ids: tuple[int, ...]
    #: 1 on the sampled tokens trained in this sample
    loss_mask: tuple[int, ...]
    #: sampling log-prob at each masked position (0.0 elsewhere)
    logprobs: tuple[float, ...]
    #: indices (in the episode's completions) of the calls merged into it, in order
    completions: tuple[int, ...]

    @property
    def trained_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids) - self.trained_tokens


@dataclass
class Timelines:
    """The samples of one episode and what merging them found."""

    samples: list[Sample]
    #: completions of agents that are trained (before duplicates are dropped)
    completions: int
    #: re-sent replies whose re-rendered tokens were not the sampled ones
    retokenisation_drift: int


@dataclass
class _Node:
    """A completion placed on a timeline: its sequence with the chain's sampled spans."""

    index: int
    parent: int | None
    tokens: list[int]
    #: (start, end, completion index) of every sampled stretch in `tokens`
    spans: list[tuple[int, int, int]]
    text: str = ""


Decode = Callable[[Sequence[int]], str]
Encode = Callable[[str], list[int]]


def build_samples(completions: Sequence[Completion], *, compare_level: CompareLevel = "token",
                  merging: bool = True, agents: Sequence[str] = (),
                  encode: Encode | None = None, decode: Decode | None = None) -> Timelines:
    """The training samples of one episode (module docstring).

    `agents` lists the agent names to train (empty: all). `encode`/`decode` are the
    tokenizer's (text to ids without special tokens added, ids to text with them): they
    place re-sent replies whose text re-encoded differently, and compare raw-prompt
    completions as text; without them those stay separate samples.
    """
    if compare_level not in COMPARE_LEVELS:
        raise ValueError(f"compare level must be one of {COMPARE_LEVELS}, not {compare_level!r}")
    chosen = [i for i, c in enumerate(completions) if not agents or c.agent in agents]
    drift = _drift(completions, chosen, encode)
    if not merging:
        return Timelines([_sample(completions, _root(completions, i), set()) for i in chosen],
                         len(chosen), drift)
    nodes: dict[int, _Node] = {}
    for k in chosen:
        c = completions[k]
        if any(_same_call(completions[j], c) for j in nodes):
            continue  # identical calls count once
        node = None
        # the deepest timeline it extends: the longest sequence first, latest on ties
        for j in sorted(nodes, key=lambda j: (len(nodes[j].tokens), j), reverse=True):
            if completions[j].agent == c.agent:
                node = _extend(completions, nodes, nodes[j], k, compare_level, encode, decode)
                if node is not None:
                    break
        nodes[k] = node or _root(completions, k)
        if decode is not None and c.messages is None:
            nodes[k].text = decode(nodes[k].tokens)
    parents = {n.parent for n in nodes.values()}
    trained: set[int] = set()
    samples = [_sample(completions, nodes[k], trained) for k in nodes if k not in parents]
    return Timelines(samples, len(chosen), drift)


def _same_call(a: Completion, b: Completion) -> bool:
    return (a.agent == b.agent and a.prompt_ids == b.prompt_ids
            and a.response_ids == b.response_ids)


def _root(completions: Sequence[Completion], k: int) -> _Node:
    """A completion on its own: its prompt as it saw it, then what it sampled."""
    c = completions[k]
    tokens = [*c.prompt_ids, *c.response_ids]
    return _Node(k, None, tokens, [(len(c.prompt_ids), len(tokens), k)])


def _chain(nodes: dict[int, _Node], node: _Node) -> list[int]:
    out = [node.index]
    while nodes[out[-1]].parent is not None:
        out.append(nodes[out[-1]].parent)  # type: ignore[arg-type]
    return out[::-1]


def _extend(completions: Sequence[Completion], nodes: dict[int, _Node], parent: _Node, k: int,
            level: CompareLevel, encode: Encode | None, decode: Decode | None) -> _Node | None:
    """`k` placed after `parent` on its timeline, or None if it does not extend it."""
    c, p = completions[k], completions[parent.index]
    if c.messages is not None and p.messages is not None:
        prompt = _splice_chat(completions, _chain(nodes, parent), c, level, encode)
        if prompt is None:
            return None
        tokens, spans = prompt
        if level == "token" and tokens[:len(parent.tokens)] != parent.tokens:
            return None
    elif c.messages is None and p.messages is None:
        if list(c.prompt_ids[:len(parent.tokens)]) == parent.tokens:
            tokens = [*parent.tokens, *c.prompt_ids[len(parent.tokens):]]
        elif level == "text" and encode is not None and decode is not None and parent.text:
            text = decode(c.prompt_ids)
            if not text.startswith(parent.text):
                return None
            tokens = [*parent.tokens, *encode(text[len(parent.text):])]
        else:
            return None
        spans = list(parent.spans)
    else:
        return None
    spans.append((len(tokens), len(tokens) + len(c.response_ids), k))
    return _Node(k, parent.index, [*tokens, *c.response_ids], spans)


def _splice_chat(completions: Sequence[Completion], chain: list[int], c: Completion,
                 level: CompareLevel, encode: Encode | None
                 ) -> tuple[list[int], list[tuple[int, int, int]]] | None:
    """`c`'s prompt with the chain's sampled replies spliced in, and where they sit."""
    assert c.messages is not None
    # each chain call's reply is re-sent right after the messages that call saw
    at: dict[int, int] = {}
    for j in chain:
        m = completions[j].messages
        assert m is not None
        a = len(m)
        reply = completions[j].reply
        if a >= len(c.messages) or reply is None or not c.messages[a].is_reply(reply):
            return None
        if level == "text" and c.messages[:a] != m:
            return None
        at[a] = j
    spans_by_message = {index: (start, end) for index, start, end in c.assistant_spans}
    if any(a not in spans_by_message for a in at):
        return None  # the template did not render that reply as a stable block
    tokens: list[int] = []
    spans: list[tuple[int, int, int]] = []
    cursor = 0
    for a in sorted(at):
        j = at[a]
        start, end = spans_by_message[a]
        glue = _glue(c.prompt_ids[start:end], completions[j], c.messages[a], encode)
        if glue is None:
            return None
        tokens += c.prompt_ids[cursor:start]
        spans.append((len(tokens), len(tokens) + len(completions[j].response_ids), j))
        tokens += [*completions[j].response_ids, *glue]
        cursor = end
    tokens += c.prompt_ids[cursor:]
    return tokens, spans


def _glue(region: Sequence[int], reply: Completion, message: ChatMessage,
          encode: Encode | None) -> list[int] | None:
    """What the template writes after a re-sent reply (`region`) beyond what was sampled.

    In order: the region begins with exactly the sampled tokens (the rest is Qwen's
    newline after `<|im_end|>`, or the whole end of turn after a reply cut by
    max_tokens); the reply ended by itself and its last token, the end of turn, is in
    the region (what follows its last occurrence); the region begins with the message's
    text encoded alone (a cut reply whose text re-encoded differently, or one whose
    special tokens the served text left out). Otherwise it cannot be placed: None.
    """
    sampled = list(reply.response_ids)
    if not sampled:
        return None
    if list(region[:len(sampled)]) == sampled:
        return list(region[len(sampled):])
    end = sampled[-1]
    if reply.finish_reason != "length" and end in region:
        last = len(region) - 1 - list(reversed(region)).index(end)
        return list(region[last + 1:])
    if encode is not None and not message.tool_calls:
        text = encode(message.content)
        if list(region[:len(text)]) == text:
            return list(region[len(text):])
    return None


def _drift(completions: Sequence[Completion], chosen: Sequence[int], encode: Encode | None
           ) -> int:
    """Replies re-sent later whose re-rendered tokens differ from the sampled ones."""
    drifted: set[int] = set()
    for k in chosen:
        c = completions[k]
        if c.messages is None:
            continue
        for index, start, end in c.assistant_spans:
            j = _producer(completions, k, c.messages[index])
            if j is None or j in drifted:
                continue
            region = list(c.prompt_ids[start:end])
            glue = _glue(region, completions[j], c.messages[index], encode)
            rendered = region[:len(region) - len(glue)] if glue is not None else region
            if rendered != list(completions[j].response_ids):
                drifted.add(j)
    return len(drifted)


def _producer(completions: Sequence[Completion], k: int, message: ChatMessage) -> int | None:
    """The latest earlier completion of the same agent whose reply `message` re-sends."""
    for j in range(k - 1, -1, -1):
        reply = completions[j].reply
        if (completions[j].agent == completions[k].agent and reply is not None
                and message.is_reply(reply)):
            return j
    return None


def _sample(completions: Sequence[Completion], node: _Node, trained: set[int]) -> Sample:
    """The node's sequence as a sample; a completion already trained is context here."""
    mask = [0] * len(node.tokens)
    logprobs = [0.0] * len(node.tokens)
    for start, end, j in node.spans:
        if j in trained:
            continue
        mask[start:end] = [1] * (end - start)
        logprobs[start:end] = completions[j].logprobs
    trained.update(j for _, _, j in node.spans)
    return Sample(agent=completions[node.index].agent, token_ids=tuple(node.tokens),
                  loss_mask=tuple(mask), logprobs=tuple(logprobs),
                  completions=tuple(j for _, _, j in node.spans))
