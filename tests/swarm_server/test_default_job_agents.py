"""openai-agents' default model on the default job: a real server, the real engine on
ajet-tiny with every field at its default, and the SDK's `OpenAIResponsesModel` (the
Responses API) with no `max_tokens`, as a new user would write it; and its plainest code,
an `Agent` with no model on the episode key as the default client, whose default model
settings send `reasoning` and `verbosity` (advisory: served, listed in `ajet.ignored`).

The untrained tiny model rarely ends a reply by itself, so every reply runs to the
run's `max_new_tokens`. The SDK treats a Responses reply with `status: incomplete` as a
fatal error; a cut at a limit the request never set is a complete reply (docs/api.md,
"Reply length"), and the run completes. A limit the request set itself still ends
`incomplete`, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import BeginEpisodeResponse
from tests.support import WORKER_TOKEN, ServerHandle, rolling_server
from tests.support.episodes import begin

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SwarmClient]:
    job = AgentJetJob(experiment_name="default-job-agents")  # every field at its default
    with rolling_server(Path(tmp_path_factory.mktemp("agents")), job) as handle, \
            SwarmClient(handle.url, token=WORKER_TOKEN, timeout=60) as client:
        yield client


def _agent(episode: BeginEpisodeResponse) -> object:
    from agents import Agent, OpenAIResponsesModel

    return Agent(name="assistant", instructions="You are a helpful assistant.",
                 model=OpenAIResponsesModel(model="ajet", openai_client=openai.AsyncOpenAI(
                     base_url=episode.openai_base_url, api_key=episode.openai_api_key,
                     max_retries=0)))


def test_openai_agents_default_model_runs_complete_on_the_default_job(
        worker: SwarmClient) -> None:
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # else traces, with the episode key, go to OpenAI
    episode = begin(worker)
    result = Runner.run_sync(_agent(episode), "Write a haiku about recursion.")
    assert isinstance(result.final_output, str) and result.final_output
    raw = result.raw_responses[-1]
    assert raw.usage is not None and raw.usage.output_tokens >= 1

    async def streamed() -> str:
        run = Runner.run_streamed(_agent(episode), "And one about the sea.")
        async for _ in run.stream_events():
            pass
        return str(run.final_output)

    assert asyncio.run(streamed())

    # the cut is still visible, and a limit the request sets is honoured and reported
    client = openai.OpenAI(base_url=episode.openai_base_url,
                           api_key=episode.openai_api_key, max_retries=0)
    unset = client.responses.create(model="ajet", input="Count to one hundred.")
    if unset.usage.output_tokens == 16:  # the run's max_new_tokens (ajet-tiny's default)
        assert unset.status == "completed"
        assert unset.model_extra["ajet"]["truncated"] == {"limit": 16, "source": "run"}
    asked = client.responses.create(model="ajet", input="Count to one hundred.",
                                    max_output_tokens=2)
    assert asked.usage.output_tokens <= 2
    if asked.usage.output_tokens == 2:
        assert asked.status == "incomplete"
        assert asked.incomplete_details.reason == "max_output_tokens"
    worker.report_episode(episode.episode_uuid, "agents", 1.0)


@pytest.fixture
def default_client(worker: SwarmClient) -> Iterator[BeginEpisodeResponse]:
    """An episode whose key is openai-agents' default client (the SDK's global, put back
    afterwards so no other test in the process runs on a closed episode)."""
    from agents import set_default_openai_client, set_tracing_disabled
    from agents.models import _openai_shared

    set_tracing_disabled(True)  # else traces, with the episode key, go to OpenAI
    before = _openai_shared.get_default_openai_client()
    episode = begin(worker)
    set_default_openai_client(openai.AsyncOpenAI(
        base_url=episode.openai_base_url, api_key=episode.openai_api_key, max_retries=0),
        use_for_tracing=False)
    yield episode
    _openai_shared.set_default_openai_client(before)  # type: ignore[arg-type]  # None too
    worker.report_episode(episode.episode_uuid, "default-agent", 1.0)


def test_openai_agents_default_agent_runs_and_streams_on_the_default_job(
        default_client: BeginEpisodeResponse) -> None:
    from agents import Agent, RunConfig, Runner
    from agents.models import get_default_model_settings
    from agents.models.openai_provider import OpenAIProvider

    defaults = get_default_model_settings()
    # what makes this the plainest code's case: the SDK's defaults send both
    assert defaults.reasoning is not None and defaults.verbosity is not None

    def agent() -> Any:
        return Agent(name="a", instructions="Answer briefly.")  # no model: the SDK's default

    async def runs() -> list[Any]:
        ran = await Runner.run(agent(), "Say hello.")
        streamed = Runner.run_streamed(agent(), "Say hello again.")
        async for _ in streamed.stream_events():
            pass
        # the same Agent through the chat-completions model (`reasoning_effort`, `verbosity`)
        chat = await Runner.run(agent(), "Say hello.", run_config=RunConfig(
            model_provider=OpenAIProvider(use_responses=False)))
        return [ran, streamed, chat]

    for result in asyncio.run(runs()):
        assert isinstance(result.final_output, str) and result.final_output
        assert result.raw_responses[-1].usage.output_tokens >= 1
