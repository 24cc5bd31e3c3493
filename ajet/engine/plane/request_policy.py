"""OpenAI request bodies on the episode plane, and what of them the engine honours.

Every parameter of a body is in one of five groups (`docs/api.md` has the table):

- honoured: messages/prompt, tools, tool_choice, parallel_tool_calls, max_tokens (and
  `max_completion_tokens`, `max_output_tokens`) up to the run's `max_response_length`,
  stop, stream, stream_options.include_usage, logprobs;
- sampling (`temperature`, `top_p`): honoured in `eval` episodes; a training episode
  samples with the run's settings, as the original does, so that the recorded log-probs
  are what the update assumes, and the reply says so (`ajet.sampling`, `ajet.ignored`);
- metadata, accepted and ignored: `model` (any name; the run's model answers), `user`,
  `metadata`, `store` (nothing is stored), `service_tier`, prompt-cache and safety ids;
- advisory, accepted with no effect and listed in the reply's `ajet.ignored`: generation
  hints the run's model has no setting for, which clients send by default (`advisory_sent`);
- honoured only at their default value, else a 400 naming them: `n` (1), penalties (0),
  `logit_bias` ({}), `top_logprobs` (0: alternatives are not computed, whatever the
  generation backend), `seed` (unset: the run's seed drives sampling), `response_format`
  (text: no constrained decoding), and the rest listed in `_DEFAULT_ONLY`.

A parameter no group names is refused too (unless null), never silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ajet.errors import SwarmValidationError
from ajet.engine.plane.episodes import EVAL_EPISODE

if TYPE_CHECKING:
    from ajet.engine.plane.chat_format import RenderedPrompt

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "PlaneRequest",
    "RequestBody",
    "Sampling",
    "ToolChoice",
    "Verbosity",
    "advisory_sent",
    "check_parameters",
    "parse_body",
    "resolve_max_tokens",
    "resolve_sampling",
    "resolve_tool_choice",
]


# ---------------------------------------------------------------------------- bodies


#: OpenAI's verbosity levels (advisory wherever it is accepted)
Verbosity = Literal["low", "medium", "high"]


class RequestBody(BaseModel):
    # parameters are checked by `check_parameters` before validation; the rest of the
    # body is kept (extra="allow") so no field is lost between the two
    model_config = ConfigDict(extra="allow")


class FunctionDef(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class CallFunction(RequestBody):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(RequestBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = Field(default=None, max_length=256)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    logprobs: bool | None = None
    #: advisory (`advisory_sent`): any effort, as OpenAI's list of them grows
    reasoning_effort: str | None = None
    verbosity: Verbosity | None = None


class CompletionRequest(RequestBody):
    model: str | None = None
    #: one prompt: text, or token ids
    prompt: str | list[str] | list[int]
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    #: only 0: the sampled tokens' log-probs, without alternatives
    logprobs: int | None = Field(default=None, ge=0)


# ---------------------------------------------------------------------------- parameters

#: Accepted and ignored, in every API.
_IGNORED = frozenset({"model", "user", "metadata", "store", "service_tier", "prompt_cache_key",
                      "prompt_cache_retention", "safety_identifier"})
#: Refused unless null or one of these values; the hint says what to do instead.
_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1,), "send n=1 and call again for another sample"),
    "best_of": ((1,), "send best_of=1 and call again for another sample"),
    "frequency_penalty": ((0,), "drop it: the policy samples from its own distribution, so "
                                "the recorded log-probs match the update"),
    "presence_penalty": ((0,), "drop it: the policy samples from its own distribution, so "
                               "the recorded log-probs match the update"),
    "repetition_penalty": ((1,), "drop it: the policy samples from its own distribution"),
    "logit_bias": (({},), "drop it: the policy samples from its own distribution"),
    "top_logprobs": ((0,), "send logprobs=true alone: the sampled tokens' log-probs come "
                           "back, alternatives are not computed"),
    "seed": ((), "drop it: sampling is seeded by the run (the job's seed)"),
    "response_format": (({"type": "text"},), "constrained decoding is not supported; ask for "
                                             "JSON in the prompt and parse the reply"),
    "modalities": ((["text"],), "only text is served"),
    "audio": ((), "only text is served"),
    "prediction": ((), "predicted outputs are not supported; drop it"),
    "web_search_options": ((), "built-in web search is not available; give the agent a "
                               "function tool instead"),
    "functions": ((), "send tools=[{'type': 'function', 'function': {...}}] instead"),
    "function_call": ((), "send tool_choice instead"),
    "echo": ((False,), "echo is not supported; the prompt is what you sent"),
    "suffix": ((), "suffix (insertion) is not supported"),
}


def check_parameters(body: Mapping[str, Any], *, accepted: frozenset[str],
                     default_only: Mapping[str, tuple[tuple[Any, ...], str]] | None = None
                     ) -> None:
    """Refuse (400, naming it) a parameter the engine cannot honour at its given value."""
    table = {**_DEFAULT_ONLY, **(default_only or {})}
    for name, value in body.items():
        if name in accepted or name in _IGNORED or value is None:
            continue
        if name in table:
            allowed, hint = table[name]
            if value in allowed:
                continue
            raise SwarmValidationError(
                400, f"{name}={json.dumps(value)[:200]} is not supported on the episode "
                "plane", hint, param=name)
        raise SwarmValidationError(400, f"unknown parameter {name!r}",
                                   "remove it; docs/api.md lists what the episode plane accepts",
                                   param=name)


def advisory_sent(body: BaseModel, names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of the advisory fields `names` the body sent (not null), for `ajet.ignored`.

    Advisory: a generation hint (a reasoning effort, a verbosity, a thinking budget) that
    the run's model has no setting for. Clients send them by default (openai-agents'
    default model settings: `reasoning` and `verbosity` on every call), so refusing them
    fails their plainest code, while serving the request without them changes nothing a
    client can rely on; the reply lists them, so the caller can see they had no effect.
    A dotted name is a field of an object (`text.verbosity`).
    """
    def value(name: str) -> Any:
        node: Any = body
        for part in name.split("."):
            node = getattr(node, part, None)
        return node

    return tuple(name for name in names if value(name) is not None)


def parse_body(raw: bytes, model: type[BaseModel], *, accepted: frozenset[str],
               default_only: Mapping[str, tuple[tuple[Any, ...], str]] | None = None
               ) -> Any:
    """JSON -> parameter check -> pydantic model; 400/422 naming the field at fault."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise SwarmValidationError(
            400, f"the body is not valid JSON: {exc}",
            "send a JSON object with Content-Type: application/json") from exc
    if not isinstance(data, dict):
        raise SwarmValidationError(400, "the body must be a JSON object", "send a JSON object")
    check_parameters(data, accepted=accepted, default_only=default_only)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg", ""),
                   "type": e.get("type", "")} for e in exc.errors()]
        fields = ", ".join(_dotted(e["loc"]) for e in errors)
        raise SwarmValidationError(422, errors, f"fix the field(s): {fields}",
                                   param=_dotted(errors[0]["loc"]) if errors else None) from exc


def _dotted(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


# ---------------------------------------------------------------------------- the plane's request


@dataclass(frozen=True)
class PlaneRequest:
    """One call of any API in the plane's own terms: what `openai_api.build_turn` serves.

    Each API turns its body into this exactly once (chat completions: `openai_api.
    chat_request`, completions: `openai_api.completion_request`, Responses:
    `responses_api.responses_request`, Messages: `messages_api.messages_request`); from
    here on rendering, sampling, generation and recording are one path, so an episode
    records the same token ids whichever API a workflow speaks.
    """

    #: OpenAI chat messages (rendered with the checkpoint's template), or None with `prompt`
    messages: list[dict[str, Any]] | None
    #: OpenAI chat tools (`{"type": "function", "function": {...}}`)
    tools: list[dict[str, Any]]
    choice: ToolChoice
    parallel: bool
    max_tokens: int
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    #: a prompt given as tokens already (completions): not rendered
    prompt: RenderedPrompt | None = None
    #: the request field named when the prompt is too long
    prompt_param: str = "messages"
    #: request parameters not applied, besides temperature and top_p (`ajet.ignored`)
    ignored: tuple[str, ...] = ()
    #: what the reply's `ajet` field says about how the request was served
    notes: dict[str, Any] = field(default_factory=dict)
    #: the agent that asked: the request's `model` name (timelines never mix agents)
    agent: str = ""


# ---------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Sampling:
    """How a reply is sampled, and what of the request's ask was not applied."""

    episode_type: str
    temperature: float
    top_p: float
    #: "run" (the job's settings) or "request"
    source: str
    #: request parameters not applied (training episodes sample with the run's settings)
    ignored: tuple[str, ...] = ()

    def for_generation(self) -> tuple[float | None, float | None]:
        """(temperature, top_p) for `GenerationRequest`: None = the run's setting."""
        if self.source == "run":
            return None, None
        return self.temperature, self.top_p

    def public(self) -> dict[str, Any]:
        """The reply's `ajet` field: what sampled this reply."""
        return {"episode_type": self.episode_type,
                "sampling": {"temperature": self.temperature, "top_p": self.top_p,
                             "source": self.source},
                "ignored": list(self.ignored)}


def resolve_sampling(*, episode_type: str, run_temperature: float, run_top_p: float,
                     temperature: float | None, top_p: float | None) -> Sampling:
    if episode_type == EVAL_EPISODE:
        t = run_temperature if temperature is None else temperature
        p = run_top_p if top_p is None else top_p
        return Sampling(episode_type, t, p, "request")
    ignored = tuple(name for name, value, run in (("temperature", temperature, run_temperature),
                                                  ("top_p", top_p, run_top_p))
                    if value is not None and value != run)
    return Sampling(episode_type, run_temperature, run_top_p, "run", ignored)


def resolve_max_tokens(asked: int | None, *, param: str, default: int, limit: int) -> int:
    if asked is None:
        return default
    if asked > limit:
        raise SwarmValidationError(
            400, f"{param}={asked} is over this run's max_response_length ({limit})",
            f"ask for at most {limit} tokens, or raise max_response_length in "
            "the job", param=param)
    return asked


def resolve_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    out = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in out) or len(out) > 4:
        raise SwarmValidationError(
            400, "stop must be up to 4 non-empty strings", "fix the stop field",
            param="stop")
    return out


@dataclass(frozen=True)
class ToolChoice:
    """The request's tool choice, checked against its tools."""

    #: "none" (tools not rendered, reply not parsed), "auto", "required" or "function"
    mode: str
    #: the function a named choice asks for
    name: str | None = None

    def satisfied_by(self, names: list[str]) -> bool:
        if self.mode == "required":
            return bool(names)
        if self.mode == "function":
            return self.name in names
        return True


def resolve_tool_choice(choice: str | dict[str, Any] | None, tool_names: list[str]
                        ) -> ToolChoice:
    """OpenAI's `tool_choice` (chat or Responses shape) against the offered tools."""
    if choice is None:
        return ToolChoice("auto" if tool_names else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise SwarmValidationError(
                400, f"tool_choice={choice!r} is not one of none, auto, required",
                "send none, auto, required or {'type': 'function', ...}",
                param="tool_choice")
        if choice == "required" and not tool_names:
            raise SwarmValidationError(400, "tool_choice='required' but no tools were sent",
                                       "send tools, or drop tool_choice", param="tool_choice")
        return ToolChoice(choice if tool_names else "none")
    fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
    name = fn.get("name") if choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise SwarmValidationError(
            400, f"tool_choice {json.dumps(choice)[:200]} is not a function choice",
            "send {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice")
    if name not in tool_names:
        raise SwarmValidationError(
            400, f"tool_choice names {name!r}, which is not among the tools sent",
            "name one of the tools", param="tool_choice")
    return ToolChoice("function", name)
