"""openai-agents' default model on the default job: a real server, the real engine on
ajet-tiny with every field at its default, and the SDK's `OpenAIResponsesModel` (the
Responses API) with no `max_tokens`, as a new user would write it.

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
