"""`/v1/messages` with the real clients against a real server and engine, and training.

Same engine as the chat and Responses tests (this folder's `tool_server`, ajet-tiny
fine-tuned to call `get_weather`), so tool calls are real model output: the official
`anthropic` SDK (create, `messages.stream` and its final message, a `tool_result`
follow-up, `count_tokens`, its error types) and LangChain's `ChatAnthropic` with
`base_url`. The episodes end with rewards and the engine trains a step on them.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from ajet.client import SwarmClient
from ajet.protocol import BeginEpisodeResponse
from tests.support.episodes import begin
from tests.support.tool_model import (
    CALL_TEXT,
    SYSTEM,
    TOOL,
    TOOL_RESULT,
    WEATHER_ANSWER,
    WEATHER_QUESTION,
    get_weather,
    last_step,
    next_step,
    rendered,
)

pytestmark = pytest.mark.slow

#: TOOL in Anthropic's shape
WEATHER = {"name": TOOL["function"]["name"], "description": TOOL["function"]["description"],
           "input_schema": TOOL["function"]["parameters"]}
QUESTION = {"role": "user", "content": WEATHER_QUESTION}


def _sdk(episode: BeginEpisodeResponse) -> anthropic.Anthropic:
    assert episode.anthropic_base_url is not None
    return anthropic.Anthropic(base_url=episode.anthropic_base_url,
                               api_key=episode.openai_api_key, max_retries=0)


def test_anthropic_sdk_tool_agent_stream_count_tokens_and_it_trains(
        tool_worker: SwarmClient, tool_tokenizer: Any) -> None:
    before = last_step(tool_worker)
    episode = begin(tool_worker)
    client = _sdk(episode)
    called = client.messages.create(model="claude-sonnet-4-5", system=SYSTEM, max_tokens=96,
                                    tools=[WEATHER], messages=[QUESTION])
    assert called.stop_reason == "tool_use"
    (use,) = [b for b in called.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    chat = [{"role": "system", "content": SYSTEM}, QUESTION]
    assert called.usage.input_tokens == rendered(tool_tokenizer, chat, [TOOL])
    assert called.usage.output_tokens == len(CALL_TEXT) + 1
    counted = client.messages.count_tokens(model="m", system=SYSTEM, tools=[WEATHER],
                                           messages=[QUESTION])
    assert counted.input_tokens == called.usage.input_tokens
    follow_up: list[Any] = [
        QUESTION, {"role": "assistant", "content": called.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": TOOL_RESULT}]}]
    answer = client.messages.create(model="m", system=SYSTEM, max_tokens=96, tools=[WEATHER],
                                    messages=follow_up)
    assert answer.content[0].type == "text" and answer.content[0].text == WEATHER_ANSWER
    assert answer.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=96, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "a report"}}]}])
    assert refused.value.body["param"] == "messages[0].content[0].type"

    # streaming, in a second episode of the same task
    second = begin(tool_worker)
    with _sdk(second).messages.stream(model="m", system=SYSTEM, max_tokens=96,
                                      tools=[WEATHER], messages=follow_up) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == WEATHER_ANSWER and final.content[0].text == WEATHER_ANSWER
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == answer.usage.input_tokens
    assert final.usage.output_tokens == len(WEATHER_ANSWER) + 1

    tool_worker.report_episode(episode.episode_uuid, "messages", 1.0)
    tool_worker.report_episode(second.episode_uuid, "messages", 0.0)
    line = next_step(tool_worker, before)
    assert line["episodes"] == 2 and line["tool_call_parse_errors"] == 0


def test_langchain_chat_anthropic_runs_a_tool_agent(tool_worker: SwarmClient) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage

    before = last_step(tool_worker)
    episodes = [begin(tool_worker), begin(tool_worker)]
    for index, episode in enumerate(episodes):
        llm = ChatAnthropic(base_url=episode.anthropic_base_url, api_key=episode.openai_api_key,
                            model="claude-sonnet-4-5", max_tokens=96, max_retries=0,
                            streaming=index == 1).bind_tools([get_weather])
        history: list[Any] = [SystemMessage(SYSTEM), HumanMessage(WEATHER_QUESTION)]
        called = llm.invoke(history)
        assert called.tool_calls[0]["name"] == "get_weather"
        assert called.tool_calls[0]["args"] == {"city": "Paris"}
        history += [called, ToolMessage(TOOL_RESULT, tool_call_id=called.tool_calls[0]["id"])]
        answer = llm.invoke(history)
        assert answer.text == WEATHER_ANSWER and not answer.tool_calls
        tool_worker.report_episode(episode.episode_uuid, "langchain-anthropic", 1.0)
    line = next_step(tool_worker, before)
    assert line["episodes"] == 2 and line["tool_call_parse_errors"] == 0
