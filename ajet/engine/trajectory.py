"""Trajectory recording: what one episode sampled, token by token.

Every chat completion served for an episode is kept with its prompt token ids (the
chat template applied to the messages the workflow sent), the sampled response token
ids and the log-prob of each response token under the sampling policy. The update
trains on exactly these tokens, so what the workflow saw as text never has to be
re-tokenised. Each completion is its own training sample: in a multi-turn episode the
history (earlier replies, tool calls, tool results) is prompt of the next completion,
and only the tokens the policy sampled are trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Completion", "Trajectory"]


@dataclass(frozen=True)
class Completion:
    """One completion of an episode (a chat, completions or responses call)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    #: log-prob of each response token when it was sampled (same length as response_ids)
    logprobs: tuple[float, ...]
    finish_reason: str
    #: engine step (number of finished updates) of the policy that sampled it
    policy_step: int
    #: the reply held a tool call that did not parse (served as content; a step metric)
    tool_call_parse_error: bool = False

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
