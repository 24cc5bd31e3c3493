"""Tool-using agents end to end: the real clients, a real server, the real engine.

The engine serves ajet-tiny fine-tuned to call `get_weather` (tests/support/tool_model.py,
this folder's `tool_server`), so every tool call here is real model output parsed by the
engine, through both the chat completions and the Responses API. Each test ends exactly
two episodes (batch_size=2, num_repeat=1: one training step per test) or aborts them, so a
test can read its own metrics line. The chat and Responses routes themselves (rendering,
parsing, streaming shapes, every refusal) are tested in process with a scripted generator
(tests/ajet/engine/test_openai_routes.py, test_responses_routes.py); these tests are kept
to what needs the real model, the frameworks and the server in front of the engine.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from ajet.client import SwarmClient
from tests.support import WORKER_TOKEN, ServerHandle
from tests.support.episodes import begin
from tests.support.tool_model import (
    CALL_TEXT,
    CALLS,
    MAX_PROMPT_LENGTH,
    SYSTEM,
    TOOL,
    WEATHER_ANSWER,
    WEATHER_QUESTION,
    get_weather,
    last_step,
    next_step,
    oai,
    rendered,
    run_weather_agent,
)

pytestmark = pytest.mark.slow


def test_openai_client_calls_a_tool_follows_up_and_the_episodes_train(
        tool_server: ServerHandle, tool_worker: SwarmClient,
        tool_tokenizer: Any) -> None:
    before = last_step(tool_worker)
    first = begin(tool_worker)
    client = oai(first)
    question = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": WEATHER_QUESTION}]
    reply = client.chat.completions.create(model="gpt-4o", messages=question, tools=[TOOL],
                                           logprobs=True, max_tokens=96)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # the tool's schema reached the prompt: the prompt is the template's rendering with it
    assert reply.usage.prompt_tokens == rendered(tool_tokenizer, question, [TOOL])
    assert reply.usage.prompt_tokens >= (rendered(tool_tokenizer, question)
                                         + len(json.dumps(TOOL["function"]["parameters"])))
    # logprobs: one per recorded token (the call's text and the end-of-turn token)
    lp = choice.logprobs.content
    assert len(lp) == reply.usage.completion_tokens == len(CALL_TEXT) + 1
    assert "".join(t.token for t in lp[:-1]) == CALL_TEXT and all(t.logprob <= 0 for t in lp)
    assert reply.model_extra["ajet"]["sampling"] == {"temperature": 0.05, "top_p": 1.0,
                                                     "source": "run"}
    # the follow-up: the assistant's call and the tool's result are rendered into the prompt
    follow = [*question, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    answer = client.chat.completions.create(model="gpt-4o", messages=follow, tools=[TOOL],
                                            max_tokens=96)
    assert answer.choices[0].message.content == WEATHER_ANSWER
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens == rendered(tool_tokenizer, follow, [TOOL])

    # streaming: OpenAI's tool-call deltas, no content
    second = begin(tool_worker)
    stream = oai(second).chat.completions.create(
        model="x", messages=question, tools=[TOOL], stream=True, max_tokens=96,
        stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert parts[0].id.startswith("call_") and parts[0].function.name == "get_weather"
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    streamed_tokens = [c.usage for c in chunks if c.usage][0].completion_tokens
    # the model's call cut by max_tokens: a <tool_call> block that never closes is served
    # as content, marked, and counted at the training step
    cut = oai(second).chat.completions.create(model="m", messages=question, tools=[TOOL],
                                              max_tokens=20)
    assert cut.choices[0].message.content == CALL_TEXT[:20]
    assert not cut.choices[0].message.tool_calls and cut.choices[0].finish_reason == "length"
    assert "JSON" in cut.model_extra["ajet"]["tool_call_parse_error"]

    tool_worker.report_episode(first.episode_uuid, "weather", 1.0)
    tool_worker.report_episode(second.episode_uuid, "weather-stream", 0.0)
    line = next_step(tool_worker, before)
    assert line["episodes"] == 2 and line["tool_call_parse_errors"] == 1
    # every recorded response token is trained on: the calls, the answer, the stream
    recorded = (reply.usage.completion_tokens + answer.usage.completion_tokens
                + streamed_tokens + cut.usage.completion_tokens)
    assert line["response_length"] == recorded / 2


def server_model(tool_server: ServerHandle) -> str:
    job = httpx.get(f"{tool_server.url}/sync_train_config",
                    headers={"Authorization": f"Bearer {WORKER_TOKEN}"}).json()
    return str(job["config"]["model"])


def test_models_completions_and_error_shapes(tool_server: ServerHandle,
                                             tool_worker: SwarmClient,
                                             tool_tokenizer: Any) -> None:
    before = last_step(tool_worker)
    episodes = [begin(tool_worker), begin(tool_worker)]
    client = oai(episodes[0])
    model = server_model(tool_server)
    assert [m.id for m in client.models.list().data] == [model]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError, match="any model name works"):
        client.models.retrieve("gpt-4o")
    prompt = "<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n"
    text = client.completions.create(model="m", prompt=prompt, max_tokens=6, logprobs=0)
    choice = text.choices[0]
    assert text.usage.prompt_tokens == len(tool_tokenizer(prompt)["input_ids"])
    assert len(choice.logprobs.token_logprobs) == text.usage.completion_tokens <= 6
    assert "".join(choice.logprobs.tokens).startswith(choice.text)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="m", prompt=prompt, logprobs=2)
    assert info.value.body["param"] == "logprobs"
    streamed = list(oai(episodes[1]).completions.create(model="m", prompt=prompt, max_tokens=6,
                                                        stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    # OpenAI-shaped errors on every /v1 path: unknown route, missing and foreign keys
    with pytest.raises(openai.NotFoundError, match="not served on the episode plane"):
        client.embeddings.create(model="m", input="x")
    for key in ("", "sk-nope"):
        r = httpx.get(f"{episodes[0].openai_base_url}/models",
                      headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error" and r.json()["hint"]
    # a parameter the engine refuses, in OpenAI's shape (the server converts the engine's)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                       seed=7)
    assert refused.value.body["param"] == "seed"
    assert refused.value.body["type"] == "invalid_request_error"
    assert "hint:" in refused.value.body["message"]
    bad = httpx.post(f"{episodes[0].openai_base_url}/chat/completions", json={"messages": []},
                     headers={"Authorization": f"Bearer {episodes[0].openai_api_key}"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "messages"
    for episode in episodes:  # completions are recorded and trained like chats
        tool_worker.report_episode(episode.episode_uuid, "completions", 0.0)
    assert next_step(tool_worker, before)["episodes"] == 2


def test_langchain_bind_tools_and_openai_agents_run_a_tool_agent(
        tool_server: ServerHandle, tool_worker: SwarmClient,
        tool_tokenizer: Any) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    before = last_step(tool_worker)
    # LangChain: bind_tools, the call comes back as tool_calls, the follow-up answers
    lc_episode = begin(tool_worker)
    llm = ChatOpenAI(base_url=lc_episode.openai_base_url, api_key=lc_episode.openai_api_key,
                     model="ajet", max_tokens=96, max_retries=0).bind_tools([get_weather])
    history = [SystemMessage(SYSTEM), HumanMessage(WEATHER_QUESTION)]
    called = llm.invoke(history)
    assert called.tool_calls[0]["name"] == "get_weather"
    assert called.tool_calls[0]["args"] == {"city": "Paris"}
    question = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": WEATHER_QUESTION}]
    assert called.usage_metadata["input_tokens"] >= rendered(tool_tokenizer, question) + len(
        "Get the weather of a city.")
    history += [called, ToolMessage(get_weather("Paris"),
                                    tool_call_id=called.tool_calls[0]["id"])]
    answer = llm.invoke(history)
    assert answer.content == WEATHER_ANSWER and not answer.tool_calls

    # openai-agents through its chat-completions model, with a function_tool
    agent_episode = begin(tool_worker)
    result = run_weather_agent(agent_episode)
    assert CALLS == ["Paris"]  # the tool ran, on the model's call
    assert result.final_output == WEATHER_ANSWER
    first, second = (r.usage.input_tokens for r in result.raw_responses)
    assert first >= rendered(tool_tokenizer, question) + len("Get the weather of a city.")
    assert second > first  # the call and its result are in the follow-up's prompt

    tool_worker.report_episode(lc_episode.episode_uuid, "langchain", 1.0)
    tool_worker.report_episode(agent_episode.episode_uuid, "agents", 1.0)
    line = next_step(tool_worker, before)
    assert line["episodes"] == 2 and line["tool_call_parse_errors"] == 0


def test_an_oversized_chat_is_refused_unread_and_a_big_one_never_stalls_another_episode(
        tool_server: ServerHandle, tool_worker: SwarmClient) -> None:
    big, small = begin(tool_worker), begin(tool_worker)
    url = f"{big.openai_base_url}/chat/completions"
    headers = {"Authorization": f"Bearer {big.openai_api_key}"}
    bound = 8 * MAX_PROMPT_LENGTH + 64 * 1024  # docs/limits.md
    # over the bound: refused from its size alone, before anything is parsed or tokenised
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (15 << 20)}]})
    r = httpx.post(url, content=huge, headers={**headers, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and f"{bound} bytes" in r.json()["error"]["message"]
    assert r.json()["hint"]
    # under the bound but over max_prompt_length: seconds of template rendering and
    # tokenising, off the event loop, so the other episode's chat is answered meanwhile
    order: list[str] = []

    def send_big() -> None:
        answer = httpx.post(url, headers=headers, timeout=120, json={
            "messages": [{"role": "user", "content": "x" * (bound - 1000)}]})
        order.append(f"big {answer.status_code}")

    thread = threading.Thread(target=send_big)
    thread.start()
    # the big body crosses loopback in milliseconds; its rendering and tokenising take
    # about half a second even on a quick machine, so the small chat goes in soon after
    time.sleep(0.1)
    reply = oai(small).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    order.append(f"small {reply.choices[0].finish_reason}")
    thread.join(120)
    assert order[0].startswith("small") and order[1] == "big 400", order
    tool_worker.cancel_episode(big.episode_uuid)
    tool_worker.cancel_episode(small.episode_uuid)


# ---------------------------------------------------------------------------- Responses

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


def test_openai_agents_default_model_and_langchain_responses_run_a_tool_agent(
        tool_worker: SwarmClient) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    before = last_step(tool_worker)
    agent_episode = begin(tool_worker)
    result = run_weather_agent(agent_episode, responses=True)
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
