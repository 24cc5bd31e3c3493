"""`OpenaiBaseUrlAndApiKey`: what `SwarmClient.begin_episode()` hands a workflow.

`base_url` ends in `/v1`, as the `openai` client expects, and `api_key` is the
episode's signed key; pass both to any OpenAI-compatible client:

    client = openai.OpenAI(base_url=api.base_url, api_key=api.api_key)

`anthropic_base_url` is the server root (Anthropic clients append `/v1/messages`), for
the Anthropic SDK and harnesses configured with `ANTHROPIC_BASE_URL`:

    client = anthropic.Anthropic(base_url=api.anthropic_base_url, api_key=api.api_key)
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

__all__ = ["OpenaiBaseUrlAndApiKey"]


class OpenaiBaseUrlAndApiKey(BaseModel):
    base_url: str = Field(description="The episode's OpenAI-compatible base URL (ends in /v1)")
    api_key: str = Field(description="The episode's key: only this episode's chats use it")
    anthropic_base_url: str = Field(
        default="", description="The server root for Anthropic clients (no /v1: they append "
                                "/v1/messages); empty when built without one")
    model: str = Field(default="reserved_field", description="Any model name is accepted")
    episode_uuid: str = Field(default="episode_id", description="The episode this key is for")

    def as_raw_openai_sdk_client(self, *args: Any, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` client bound to this episode (needs `openai`)."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(api_key=self.api_key, base_url=self.base_url)

    def as_raw_anthropic_sdk_client(self, *args: Any, **kwargs: Any) -> Any:
        """An `anthropic.AsyncAnthropic` client bound to this episode (needs `anthropic`)."""
        from anthropic import AsyncAnthropic

        return AsyncAnthropic(api_key=self.api_key, base_url=self.anthropic_root())

    def anthropic_root(self) -> str:
        """The server root for Anthropic clients; built by hand with only `base_url`, it is
        `base_url` without its `/v1`."""
        return self.anthropic_base_url or self.base_url.rstrip("/").removesuffix("/v1")

    def as_agentscope_model(self, *args: Any, agent_name: str | None = None,
                            target_tag: str | None = None, **kwargs: Any) -> Any:
        """An AgentScope `OpenAIChatModel` bound to this episode (needs `agentscope`).

        As in the original, an agent may be tagged: its calls then name the model
        `target_tag` (else `agent_name`), which is the agent name the engine trains by
        (the job's `train_agents`, the original's `trainable_targets`) and never merges
        across.
        """
        from agentscope.model import OpenAIChatModel  # type: ignore[import-not-found]

        return OpenAIChatModel(model_name=target_tag or agent_name or "AgentJet-Model",
                               api_key=self.api_key, client_args={"base_url": self.base_url})
