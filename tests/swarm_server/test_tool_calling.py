"""Tool-using agents on the episode plane, with the real clients against a real server.

The engine serves ajet-tiny fine-tuned to call `get_weather` (tests/support/tool_model.py, the
session's `tool_server`), so every tool call here is a real model output parsed by the
engine. Each test ends exactly two episodes (batch_size=2, num_repeat=1: one training
step per test) or aborts them, so a test can read its own metrics line.
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
    history_after_call,
    last_step,
    next_step,
    oai,
    rendered,
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

    tool_worker.report_episode(first.episode_uuid, "weather", 1.0)
    tool_worker.report_episode(second.episode_uuid, "weather-stream", 0.0)
    line = next_step(tool_worker, before)
    assert line["episodes"] == 2 and line["tool_call_parse_errors"] == 0
    # every recorded response token is trained on: the calls, the answer, the stream
    recorded = reply.usage.completion_tokens + answer.usage.completion_tokens + streamed_tokens
    assert line["response_length"] == recorded / 2


def test_a_malformed_call_comes_back_as_content_and_is_counted(
        tool_server: ServerHandle, tool_worker: SwarmClient) -> None:
    before = last_step(tool_worker)
    episodes = [begin(tool_worker), begin(tool_worker)]
    question = [{"role": "user", "content": WEATHER_QUESTION}]
    # the model's call, cut by max_tokens: a <tool_call> block that never closes
    cut = oai(episodes[0]).chat.completions.create(model="m", messages=question,
                                                    tools=[TOOL], max_tokens=20)
    choice = cut.choices[0]
    assert choice.message.content == CALL_TEXT[:20] and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    assert "JSON" in cut.model_extra["ajet"]["tool_call_parse_error"]
    stream = oai(episodes[1]).chat.completions.create(model="m", messages=question,
                                                      tools=[TOOL], max_tokens=20, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == CALL_TEXT[:20]
    for episode in episodes:
        tool_worker.report_episode(episode.episode_uuid, "malformed", 0.5)
    assert next_step(tool_worker, before)["tool_call_parse_errors"] == 2


def test_tool_choice_none_required_named_and_parallel(tool_server: ServerHandle,
                                                      tool_worker: SwarmClient,
                                                      tool_tokenizer: Any) -> None:
    episode = begin(tool_worker)
    client = oai(episode)
    question = [{"role": "user", "content": WEATHER_QUESTION}]
    # none: the tools are not rendered and the reply is not parsed into calls
    plain = client.chat.completions.create(model="m", messages=question, tools=[TOOL],
                                           tool_choice="none", max_tokens=8)
    assert plain.usage.prompt_tokens == rendered(tool_tokenizer, question)
    assert not plain.choices[0].message.tool_calls
    named = client.chat.completions.create(
        model="m", messages=question, tools=[TOOL], max_tokens=96, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert named.model_extra["ajet"]["tool_choice_unmet"] is False
    # required, but the model answers in text (the tool result is there): served, marked
    done = client.chat.completions.create(model="m", messages=history_after_call(),
                                          tools=[TOOL], tool_choice="required", max_tokens=96)
    assert done.choices[0].message.content == WEATHER_ANSWER
    assert done.model_extra["ajet"]["tool_choice_unmet"] is True
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=question, tools=[TOOL],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"
    tool_worker.cancel_episode(episode.episode_uuid)


REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("seed", {"seed": 7}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("presence_penalty", {"presence_penalty": -1.0}),
    ("logit_bias", {"logit_bias": {"5": 10}}),
    ("n", {"n": 2}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 2}),
    ("max_tokens", {"max_tokens": 5000}),
    ("max_completion_tokens", {"max_completion_tokens": 1025}),
    ("functions", {"functions": [{"name": "f"}]}),
    ("frobnicate", {"extra_body": {"frobnicate": True}}),
]


def test_parameters_that_cannot_be_honoured_get_an_openai_400_naming_them(
        tool_server: ServerHandle, tool_worker: SwarmClient) -> None:
    episode = begin(tool_worker)
    client = oai(episode)
    messages = [{"role": "user", "content": "hi"}]
    for name, extra in REFUSED:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="m", messages=messages, **extra)
        body = info.value.body
        assert body["param"] == name, (name, body)
        assert body["type"] == "invalid_request_error" and "hint:" in body["message"]
    limit = openai.BadRequestError
    with pytest.raises(limit, match="max_response_length \\(1024\\)"):
        client.chat.completions.create(model="m", messages=messages, max_tokens=1025)
    # defaults and harmless metadata are accepted; training ignores sampling asks, and says so
    ok = client.chat.completions.create(
        model="any-name", messages=messages, max_tokens=4, n=1, frequency_penalty=0,
        presence_penalty=0, logit_bias={}, response_format={"type": "text"}, user="u",
        metadata={"k": "v"}, store=False, service_tier="auto", top_logprobs=0,
        temperature=0.7, top_p=0.9, stream_options=None)
    assert ok.model == server_model(tool_server)
    assert ok.model_extra["ajet"]["episode_type"] == "train"
    assert ok.model_extra["ajet"]["ignored"] == ["temperature", "top_p"]
    tool_worker.cancel_episode(episode.episode_uuid)


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
    bad = httpx.post(f"{episodes[0].openai_base_url}/chat/completions", json={"messages": []},
                     headers={"Authorization": f"Bearer {episodes[0].openai_api_key}"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "messages"
    for episode in episodes:  # completions are recorded and trained like chats
        tool_worker.report_episode(episode.episode_uuid, "completions", 0.0)
    assert next_step(tool_worker, before)["episodes"] == 2


def test_langchain_bind_tools_and_openai_agents_run_a_tool_agent(
        tool_server: ServerHandle, tool_worker: SwarmClient,
        tool_tokenizer: Any) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
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

    # openai-agents through its chat-completions model, with a function_tool; no tracing
    # (it would send traces, with the episode key, to OpenAI)
    set_tracing_disabled(True)
    agent_episode = begin(tool_worker)
    agent = Agent(
        name="weather", instructions=SYSTEM, tools=[function_tool(get_weather)],
        model=OpenAIChatCompletionsModel(model="ajet", openai_client=openai.AsyncOpenAI(
            base_url=agent_episode.openai_base_url, api_key=agent_episode.openai_api_key,
            max_retries=0)),
        model_settings=ModelSettings(max_tokens=96))
    CALLS.clear()
    result = Runner.run_sync(agent, WEATHER_QUESTION)
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
    time.sleep(0.5)  # the big body is in the engine
    reply = oai(small).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    order.append(f"small {reply.choices[0].finish_reason}")
    thread.join(120)
    assert order[0].startswith("small") and order[1] == "big 400", order
    tool_worker.cancel_episode(big.episode_uuid)
    tool_worker.cancel_episode(small.episode_uuid)
