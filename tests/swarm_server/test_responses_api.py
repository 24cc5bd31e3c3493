"""`POST /v1/responses` with the real clients against a real server (stateless).

Same engine as the chat tests (the session's `tool_server`, ajet-tiny fine-tuned to call
`get_weather`), so tool calls are real model output. Each test ends two episodes (one
training step) or cancels them.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from ajet.client import SwarmClient
from tests.support.episodes import begin
from tests.support.tool_model import (
    CALL_TEXT,
    CALLS,
    SYSTEM,
    TOOL,
    WEATHER_ANSWER,
    WEATHER_QUESTION,
    get_weather,
    last_step,
    next_step,
    oai,
    rendered,
)

pytestmark = pytest.mark.slow

#: TOOL in the Responses API's flat shape
FUNCTION = {"type": "function", **TOOL["function"]}
LOGPROBS = ["message.output_text.logprobs"]


def test_responses_call_a_function_follow_up_stream_and_record_like_chat(
        tool_worker: SwarmClient, tool_tokenizer: Any) -> None:
    before = last_step(tool_worker)
    episode = begin(tool_worker)
    client = oai(episode)
    called = client.responses.create(model="gpt-4.1", instructions=SYSTEM,
                                     input=WEATHER_QUESTION, tools=[FUNCTION],
                                     max_output_tokens=96, store=True)
    assert called.status == "completed" and called.store is False  # nothing is stored
    call = called.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and json.loads(call.arguments) == {"city": "Paris"}
    question = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": WEATHER_QUESTION}]
    assert called.usage.input_tokens == rendered(tool_tokenizer, question, [TOOL])
    assert called.usage.output_tokens == len(CALL_TEXT) + 1
    # the follow-up: the function call and its output as input items
    items: list[Any] = [{"role": "user", "content": WEATHER_QUESTION},
                        {"type": "function_call", "call_id": call.call_id,
                         "name": call.name, "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id,
                         "output": "sunny, 24 C"}]
    answer = client.responses.create(model="m", instructions=SYSTEM, input=items,
                                     tools=[FUNCTION], max_output_tokens=96, include=LOGPROBS)
    assert answer.output_text == WEATHER_ANSWER and answer.output[0].type == "message"
    # the same conversation through chat: the same prompt, the same sampled tokens
    chat = client.chat.completions.create(model="m", tools=[TOOL], max_tokens=96,
                                          logprobs=True, messages=[
        *question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 24 C"}])
    assert chat.usage.prompt_tokens == answer.usage.input_tokens
    assert [t.token for t in chat.choices[0].logprobs.content] == [
        t.token for t in answer.output[0].content[0].logprobs]

    # streaming, with the events clients read
    second = begin(tool_worker)
    events = list(oai(second).responses.create(model="m", instructions=SYSTEM,
                                               input=WEATHER_QUESTION, tools=[FUNCTION],
                                               max_output_tokens=96, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.function_call_arguments.delta",
                 "response.output_item.done"):
        assert kind in kinds, kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    assert events[-1].response.output[0].name == "get_weather"
    text = list(oai(second).responses.create(model="m", instructions=SYSTEM, input=items,
                                             max_output_tokens=96, stream=True))
    assert "".join(e.delta for e in text if e.type == "response.output_text.delta") == \
        WEATHER_ANSWER
    incomplete = client.responses.create(model="m", input="hi", max_output_tokens=2)
    assert incomplete.status == "incomplete"
    assert incomplete.incomplete_details.reason == "max_output_tokens"

    tool_worker.report_episode(episode.episode_uuid, "responses", 1.0)
    tool_worker.report_episode(second.episode_uuid, "responses-stream", 0.0)
    line = next_step(tool_worker, before)
    assert line["episodes"] == 2 and line["tool_call_parse_errors"] == 0


STATEFUL: list[tuple[str, dict[str, Any]]] = [
    ("previous_response_id", {"previous_response_id": "resp_123"}),
    ("conversation", {"conversation": "conv_1"}),
    ("background", {"background": True}),
    ("include", {"include": ["file_search_call.results"]}),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ("tools[0].type", {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}),
    ("max_output_tokens", {"max_output_tokens": 4096}),
    ("input[0].type", {"input": [{"type": "item_reference", "id": "msg_1"}]}),
]


def test_fields_that_need_state_get_a_400_naming_them(tool_worker: SwarmClient) -> None:
    episode = begin(tool_worker)
    client = oai(episode)
    for param, extra in STATEFUL:
        kwargs: dict[str, Any] = {"model": "m", "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(**kwargs)
        assert info.value.body["param"] == param, (param, info.value.body)
        assert "hint:" in info.value.body["message"]
    tool_worker.cancel_episode(episode.episode_uuid)


def test_openai_agents_default_model_and_langchain_responses_run_a_tool_agent(
        tool_worker: SwarmClient) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    before = last_step(tool_worker)
    set_tracing_disabled(True)  # else traces, with the episode key, go to OpenAI
    agent_episode = begin(tool_worker)
    agent = Agent(
        name="weather", instructions=SYSTEM, tools=[function_tool(get_weather)],
        model=OpenAIResponsesModel(model="ajet", openai_client=openai.AsyncOpenAI(
            base_url=agent_episode.openai_base_url, api_key=agent_episode.openai_api_key,
            max_retries=0)),
        model_settings=ModelSettings(max_tokens=96))
    CALLS.clear()
    result = Runner.run_sync(agent, WEATHER_QUESTION)
    assert CALLS == ["Paris"] and result.final_output == WEATHER_ANSWER

    lc_episode = begin(tool_worker)
    llm = ChatOpenAI(base_url=lc_episode.openai_base_url, api_key=lc_episode.openai_api_key,
                     model="ajet", max_tokens=96, max_retries=0,
                     use_responses_api=True).bind_tools([get_weather])
    history = [SystemMessage(SYSTEM), HumanMessage(WEATHER_QUESTION)]
    called = llm.invoke(history)
    assert called.tool_calls[0]["name"] == "get_weather"
    assert called.tool_calls[0]["args"] == {"city": "Paris"}
    history += [called, ToolMessage("sunny, 24 C", tool_call_id=called.tool_calls[0]["id"])]
    answer = llm.invoke(history)
    assert answer.text == WEATHER_ANSWER and not answer.tool_calls

    tool_worker.report_episode(agent_episode.episode_uuid, "agents-responses", 1.0)
    tool_worker.report_episode(lc_episode.episode_uuid, "langchain-responses", 1.0)
    line = next_step(tool_worker, before)
    assert line["episodes"] == 2 and line["tool_call_parse_errors"] == 0
