"""`/v1/messages` on the engine's private app, in process, with a scripted generator.

Real parts: the engine's channel app (`create_channel_app`), the registry, ajet-tiny's
tokenizer and chat template (rendering, tool-call parsing), `ReplyText` for stop strings.
The generator replies with scripted text one token at a time (`ScriptedGenerator`), so
the conversion, the reply shapes and the stream's event sequence are checked exactly,
and each completion's record is compared with what the chat route records.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import engine_config_from_job
from ajet.engine.plane import messages_api
from ajet.engine.plane.app import create_channel_app
from ajet.engine.plane.episode_plane import EpisodePlane
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.plane.messages_api import anthropic_messages_to_chat
from ajet.engine.tiny import ensure_tiny_model
from ajet.protocol import EngineState
from tests.support.engine import ScriptedGenerator

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "Get the weather of a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city.",
    "parameters": WEATHER["input_schema"]}}
MAX_RESPONSE = 128


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[TestClient, ScriptedGenerator, EpisodePlane]]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("messages")
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(root, seed=0))
    cfg = engine_config_from_job(AgentJetJob(batch_size=1, num_repeat=2, max_new_tokens=32,
                                             max_response_length=MAX_RESPONSE),
                                 cuda_devices=0, cpu_count=1)
    registry = EpisodeRegistry(group_size=2, max_in_flight=64, default_timeout_s=60)
    registry.set_state(EngineState.ROLLING)
    generator = ScriptedGenerator(tokenizer, eos_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    plane = EpisodePlane(cfg=cfg, registry=registry, run_id="r", ajet_file="x")
    # the chat format needs the tokenizer only; the scripted generator stands for the model
    plane.set_policy(SimpleNamespace(tokenizer=tokenizer), generator)  # type: ignore[arg-type]
    with TestClient(create_channel_app(plane)) as client:
        yield client, generator, plane


def _begin(client: TestClient, **body: Any) -> str:
    return str(client.post("/begin_episode", json=body).json()["episode_uuid"])


def _post(client: TestClient, uuid: str, body: dict[str, Any], path: str = "/v1/messages"
          ) -> Any:
    return client.post(path, headers={"X-Episode-UUID": uuid}, json=body)


def _completions(plane: EpisodePlane, uuid: str) -> list[Any]:
    return list(plane.registry._live[uuid].trajectory.completions)


def _events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


# ---------------------------------------------------------------------------- conversion


def test_blocks_become_the_chat_the_template_renders() -> None:
    chat = anthropic_messages_to_chat(
        [{"type": "text", "text": "You are Claude Code."},
         {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": [
             {"type": "thinking", "thinking": "I should call the tool", "signature": "s"},
             {"type": "text", "text": "Let me look."},
             {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
              "input": {"city": "Paris"}},
             {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
              "input": {"city": "Lyon"}}]},
         {"role": "user", "content": [
             {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
             {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
              "content": [{"type": "text", "text": "no such city"}]},
             {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}])
    assert chat == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "And tomorrow?"}]


def test_a_tool_conversation_records_the_same_tokens_as_the_chat_route(engine: Any) -> None:
    client, generator, plane = engine
    uuid = _begin(client)
    generator.replies += ["It is sunny.", "It is sunny."]
    anthropic = _post(client, uuid, {
        "model": "claude-sonnet-4-5", "max_tokens": 32, "system": "Use the tools.",
        "tools": [WEATHER], "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9",
                                               "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                          "content": "sunny, 24 C"}]}]})
    chat = _post(client, uuid, {"max_tokens": 32, "tools": [CHAT_WEATHER], "messages": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_9", "content": "sunny, 24 C"}]},
        path="/v1/chat/completions")
    assert anthropic.status_code == 200 and chat.status_code == 200, anthropic.text
    first, second = _completions(plane, uuid)
    assert first.prompt_ids == second.prompt_ids and first.response_ids == second.response_ids
    assert first.logprobs == second.logprobs and len(first.logprobs) == len(first.response_ids)
    body = anthropic.json()
    assert body["usage"]["input_tokens"] == len(first.prompt_ids)
    assert body["usage"]["output_tokens"] == len(first.response_ids) == len("It is sunny.") + 1


# ---------------------------------------------------------------------------- replies


def test_plain_reply_shape_and_stop_reasons(engine: Any) -> None:
    client, generator, plane = engine
    uuid = _begin(client)
    generator.replies += ["Hello there.", "one two three", "x" * 200]
    plain = _post(client, uuid, {"max_tokens": 32, "messages": [
        {"role": "user", "content": "hi"}], "metadata": {"user_id": "u"}}).json()
    assert plain["type"] == "message" and plain["role"] == "assistant"
    assert plain["id"].startswith("msg_") and plain["stop_sequence"] is None
    assert plain["content"] == [{"type": "text", "text": "Hello there."}]
    assert plain["stop_reason"] == "end_turn"
    stopped = _post(client, uuid, {"max_tokens": 32, "stop_sequences": [" two", "zzz"],
                                   "messages": [{"role": "user", "content": "count"}]}).json()
    assert stopped["content"][0]["text"] == "one"
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", " two")
    # Claude Code asks for 32000 tokens; the run serves at most max_response_length
    clamped = _post(client, uuid, {"max_tokens": 32000, "messages": [
        {"role": "user", "content": "long"}]}).json()
    assert clamped["stop_reason"] == "max_tokens"
    assert clamped["usage"]["output_tokens"] == MAX_RESPONSE
    assert clamped["usage"]["max_tokens_clamped"] == {"requested": 32000,
                                                      "served": MAX_RESPONSE}
    assert clamped["ajet"]["max_tokens_clamped"]["served"] == MAX_RESPONSE
    # the recorded tokens end with the one that completed the stop string ("one two")
    assert [len(c.response_ids) for c in _completions(plane, uuid)] == [13, 7, MAX_RESPONSE]


def test_a_tool_call_is_a_tool_use_block(engine: Any) -> None:
    client, generator, _ = engine
    uuid = _begin(client)
    generator.replies += [CALL_TEXT, "Checking.\n" + CALL_TEXT]
    body = _post(client, uuid, {"max_tokens": 100, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"}]}).json()
    assert body["stop_reason"] == "tool_use"
    (call,) = body["content"]
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert call["name"] == "get_weather" and call["input"] == {"city": "Paris"}
    assert body["ajet"]["tool_call_parse_error"] is None
    mixed = _post(client, uuid, {"max_tokens": 100, "tools": [WEATHER],
                                 "tool_choice": {"type": "tool", "name": "get_weather"},
                                 "messages": [{"role": "user", "content": "Paris?"}]}).json()
    assert [b["type"] for b in mixed["content"]] == ["text", "tool_use"]
    assert mixed["content"][0]["text"] == "Checking."
    assert mixed["ajet"]["tool_choice_unmet"] is False


def test_stream_events_token_by_token(engine: Any) -> None:
    client, generator, plane = engine
    uuid = _begin(client)
    generator.replies += ["Sunny today.", "Let me check.\n" + CALL_TEXT]
    events = _events(_post(client, uuid, {"max_tokens": 32, "stream": True, "messages": [
        {"role": "user", "content": "weather?"}]}).text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"]
    assert kinds[2] == "content_block_start" and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    deltas = [d["delta"]["text"] for k, d in events if k == "content_block_delta"]
    assert len(deltas) == len("Sunny today.") and "".join(deltas) == "Sunny today."
    start = events[0][1]["message"]
    (completion,) = _completions(plane, uuid)
    assert start["usage"]["input_tokens"] == len(completion.prompt_ids)
    end = dict(events)["message_delta"]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == len(completion.response_ids)

    tool = _events(_post(client, uuid, {"max_tokens": 96, "stream": True, "tools": [WEATHER],
                                        "messages": [{"role": "user", "content": "Paris?"}]}
                         ).text)
    blocks = [d["content_block"] for k, d in tool if k == "content_block_start"]
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == {}
    text = "".join(d["delta"]["text"] for k, d in tool if k == "content_block_delta"
                   and d["delta"]["type"] == "text_delta")
    assert text.strip() == "Let me check."
    arguments = "".join(d["delta"]["partial_json"] for k, d in tool
                        if k == "content_block_delta" and d["index"] == 1)
    assert json.loads(arguments) == {"city": "Paris"}
    assert dict(tool)["message_delta"]["delta"]["stop_reason"] == "tool_use"
    assert [d["index"] for k, d in tool if k == "content_block_stop"] == [0, 1]


def test_a_silent_model_gets_pings(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    client, generator, _ = engine
    monkeypatch.setattr(messages_api, "PING_INTERVAL_S", 0.05)
    monkeypatch.setattr(generator, "delay_s", 0.3)
    uuid = _begin(client)
    kinds = [k for k, _ in _events(_post(client, uuid, {
        "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).text)]
    first_text = kinds.index("content_block_start")
    assert kinds.count("ping") >= 3 and kinds[first_text - 1] == "ping", kinds
    assert kinds[-1] == "message_stop"


def test_count_tokens_is_the_prompt_of_the_same_body(engine: Any) -> None:
    client, _, plane = engine
    uuid = _begin(client)
    body = {"system": [{"type": "text", "text": "Use the tools."}], "tools": [WEATHER],
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    counted = _post(client, uuid, body, path="/v1/messages/count_tokens")
    assert counted.status_code == 200, counted.text
    assert _completions(plane, uuid) == []  # counting generates and records nothing
    _post(client, uuid, {**body, "max_tokens": 8})
    (completion,) = _completions(plane, uuid)
    assert counted.json() == {"input_tokens": len(completion.prompt_ids)}


# ---------------------------------------------------------------------------- refusals


ACCEPTED_ADVISORY: dict[str, Any] = {
    "thinking": {"type": "enabled", "budget_tokens": 31999},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"}, "metadata": {"user_id": "user_abc_session_1"},
    "service_tier": "auto", "temperature": 1, "top_k": 5,
}

REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("messages[0].content[1].type", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}),
    ("messages[0].content[0].type", {"messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]}),
    ("messages[0].content[0].content[0].type", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]}),
    ("tools[0].type", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("tools[0].input_schema", {"tools": [{"name": "t"}]}),
    ("tool_choice.name", {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}),
    ("tool_choice", {"tool_choice": {"type": "any"}}),
    ("messages[1].role", {"messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "{"}]}),
    ("messages[0].role", {"messages": [{"role": "system", "content": "hi"}]}),
    ("system[0].type", {"system": [{"type": "image"}]}),
    ("mcp_servers", {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}),
    ("container", {"container": "c1"}),
    ("stop_sequences", {"stop_sequences": [""]}),
    ("logit_bias", {"logit_bias": {"1": 2}}),
    ("max_tokens", {"max_tokens": None}),
]


def test_advisory_fields_are_accepted_and_meaning_changes_refused(engine: Any) -> None:
    client, _, _ = engine
    uuid = _begin(client)
    base = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    ok = _post(client, uuid, {**base, **ACCEPTED_ADVISORY})
    assert ok.status_code == 200, ok.text
    # top_k: training episodes sample as the run; the rest is advisory
    assert ok.json()["ajet"]["ignored"] == ["top_k", "thinking", "context_management",
                                            "output_config"]
    for param, extra in REFUSED:
        body = {k: v for k, v in {**base, **extra}.items() if v is not None}
        r = _post(client, uuid, body)
        assert r.status_code in (400, 422), (param, r.text)
        assert r.json()["param"] == param, (param, r.json())
        assert r.json()["hint"], param
    evaluated = _begin(client, episode_type="eval")
    r = _post(client, evaluated, {**base, "top_k": 5})
    assert r.status_code == 400 and r.json()["param"] == "top_k"
    assert _post(client, evaluated, {**base, "temperature": 0}).status_code == 200


def test_a_prompt_over_the_model_context_is_a_400(engine: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    client, generator, _ = engine
    monkeypatch.setattr(generator, "max_positions", 40)
    uuid = _begin(client)
    r = _post(client, uuid, {"max_tokens": 8, "messages": [{"role": "user", "content": "x" * 50}]})
    assert r.status_code == 400 and "context" in r.json()["detail"]


def test_messages_route_needs_the_episode_header(engine: Any) -> None:
    client, _, _ = engine
    r = client.post("/v1/messages", json={"max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "X-Episode-UUID" in r.json()["detail"]


def test_a_multi_turn_messages_episode_is_one_timeline(engine: Any) -> None:
    from ajet.engine.trajectory import build_samples

    client, generator, plane = engine
    uuid = _begin(client)
    generator.replies += [CALL_TEXT, "It is sunny."]
    question = {"role": "user", "content": "Weather in Paris?"}
    called = _post(client, uuid, {"model": "claude-x", "max_tokens": 100, "tools": [WEATHER],
                                  "system": "Use the tools.", "messages": [question]}).json()
    (use,) = called["content"]
    _post(client, uuid, {"model": "claude-x", "max_tokens": 100, "tools": [WEATHER],
                         "system": "Use the tools.", "messages": [
        question, {"role": "assistant", "content": called["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                      "content": "sunny, 24 C"}]}]})
    first, second = _completions(plane, uuid)
    assert first.agent == second.agent == "claude-x" and first.messages is not None
    (sample,) = build_samples([first, second]).samples
    # both replies trained, with the log-probs they were sampled with; the rest masked
    assert sample.trained_tokens == len(first.response_ids) + len(second.response_ids)
    assert sample.token_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert sample.completions == (0, 1)
