"""`POST /v1/responses` of the private channel, in process, with a scripted generator.

The Responses input becomes a chat rendered with the checkpoint's template and the reply
is parsed as on the chat route (tests/ajet/engine/test_openai_routes.py), so here: the
conversion of input items, the response object and its stream of events, and the fields
that need state or built-in tools, refused by name. The end-to-end test with the real
engine and the agent frameworks is tests/swarm_server/test_responses_api.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.engine import SCRIPTED_LOGPROB
from tests.support.plane import PlaneApp, begin, end, recorded
from tests.support.tool_model import CALL_TEXT, TOOL, WEATHER_ANSWER, WEATHER_QUESTION

#: get_weather as a Responses function tool (flat, not nested under "function")
FUNCTION = {"type": "function", **TOOL["function"]}


def respond(plane: PlaneApp, uuid: str, **body: Any) -> Any:
    body.setdefault("input", WEATHER_QUESTION)
    return plane.http.post("/v1/responses", headers={"X-Episode-UUID": uuid}, json=body)


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n", 1)
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_text_reply_is_a_completed_message_with_usage(plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(WEATHER_ANSWER)
    body = respond(plane, uuid, instructions="Be brief.", store=True,
                   include=["message.output_text.logprobs"]).json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["store"] is False and body["incomplete_details"] is None  # nothing is stored
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    part = message["content"][0]
    assert part["type"] == "output_text" and part["text"] == WEATHER_ANSWER
    assert [t["logprob"] for t in part["logprobs"]] == [SCRIPTED_LOGPROB] * (
        len(plane.encode(WEATHER_ANSWER)) + 1)
    # instructions are the system turn; the input string the user's
    asked = plane.generator.requests[-1].prompt_ids
    assert asked == plane.render([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": WEATHER_QUESTION}])
    assert body["usage"]["input_tokens"] == len(asked)
    assert body["usage"]["output_tokens"] == len(plane.encode(WEATHER_ANSWER)) + 1
    (completion,) = recorded(plane, end(plane, uuid))
    assert list(completion.prompt_ids) == asked


def test_a_function_call_and_its_output_items_make_the_follow_up(plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(CALL_TEXT, WEATHER_ANSWER)
    called = respond(plane, uuid, tools=[FUNCTION]).json()
    (call,) = called["output"]  # a call and no text: no empty message item
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["status"] == "completed"
    assert call["call_id"].startswith("call_")
    # the same chat as on the chat route: the function tool rendered like a chat tool
    assert plane.generator.requests[-1].prompt_ids == plane.render(
        [{"role": "user", "content": WEATHER_QUESTION}], tools=[TOOL])
    follow = [{"type": "message", "role": "user", "content": [
                  {"type": "input_text", "text": WEATHER_QUESTION}]},
              {"type": "function_call", "call_id": call["call_id"], "name": "get_weather",
               "arguments": call["arguments"]},
              {"type": "function_call_output", "call_id": call["call_id"],
               "output": "sunny, 24 C"}]
    answer = respond(plane, uuid, input=follow, tools=[FUNCTION]).json()
    assert answer["output"][0]["content"][0]["text"] == WEATHER_ANSWER
    prompt = plane.decode(plane.generator.requests[-1].prompt_ids)
    assert "<tool_response>" in prompt and "sunny, 24 C" in prompt and "get_weather" in prompt
    assert len(recorded(plane, end(plane, uuid))) == 2


def test_the_stream_is_the_responses_event_sequence(plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(WEATHER_ANSWER, CALL_TEXT)
    text = events(respond(plane, uuid, stream=True).text)
    kinds = [k for k, _ in text]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert "".join(d["delta"] for k, d in text if k == "response.output_text.delta") == (
        WEATHER_ANSWER)
    assert [d["sequence_number"] for _, d in text] == list(range(len(text)))
    final = text[-1][1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == (
        WEATHER_ANSWER)
    calls = events(respond(plane, uuid, stream=True, tools=[FUNCTION]).text)
    kinds = [k for k, _ in calls]
    assert "response.output_text.delta" not in kinds
    assert kinds[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]
    done = dict(calls)["response.function_call_arguments.done"]
    assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Paris"}
    assert calls[-1][1]["response"]["output"][0]["type"] == "function_call"
    end(plane, uuid)


def test_a_reply_cut_by_max_output_tokens_is_incomplete(plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(WEATHER_ANSWER, WEATHER_ANSWER)
    cut = respond(plane, uuid, max_output_tokens=5).json()
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == WEATHER_ANSWER[:5]
    streamed = events(respond(plane, uuid, max_output_tokens=5, stream=True).text)
    assert streamed[-1][0] == "response.incomplete"
    assert streamed[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    end(plane, uuid)


def test_a_reply_cut_at_the_runs_limit_is_completed_and_says_where(plane: PlaneApp) -> None:
    # no max_output_tokens: the run's max_new_tokens cuts it, and agent frameworks
    # (openai-agents) would fail the whole run on `incomplete`
    limit = plane.cfg.max_new_tokens
    long = "Paris is sunny. " * limit
    uuid = begin(plane)
    plane.generator.say(long, long)
    reply = respond(plane, uuid).json()
    assert reply["status"] == "completed" and reply["incomplete_details"] is None
    assert reply["output"][0]["status"] == "completed"
    assert reply["usage"]["output_tokens"] == limit
    assert reply["ajet"]["truncated"] == {"limit": limit, "source": "run"}
    streamed = events(respond(plane, uuid, stream=True).text)
    assert streamed[-1][0] == "response.completed"
    assert streamed[-1][1]["response"]["ajet"]["truncated"] == {"limit": limit, "source": "run"}
    end(plane, uuid)
    assert [c.finish_reason for c in recorded(plane, uuid)] == ["length", "length"]


REFUSED: list[tuple[str, dict[str, Any]]] = [  # (the field named, the body)
    ("previous_response_id", {"previous_response_id": "resp_1"}),
    ("conversation", {"conversation": "conv_1"}),
    ("background", {"background": True}),
    ("text.format", {"text": {"format": {"type": "json_object"}}}),
    ("text.format", {"text": {"format": {"type": "json_schema", "name": "out", "schema": {}},
                              "verbosity": "low"}}),
    ("include", {"include": ["file_search_call.results"]}),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ("tools[0].type", {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}),
    ("max_output_tokens", {"max_output_tokens": 4096}),
    ("tools[0].name", {"tools": [{"type": "function"}]}),
    ("input[0].type", {"input": [{"type": "item_reference", "id": "x"}]}),
    ("input[0].role", {"input": [{"type": "message", "role": "tool", "content": "x"}]}),
    ("input", {"input": []}),
]


@pytest.mark.parametrize(("param", "extra"), REFUSED, ids=[p for p, _ in REFUSED])
def test_what_needs_state_or_a_built_in_tool_is_a_400_naming_it(
        plane: PlaneApp, param: str, extra: dict[str, Any]) -> None:
    uuid = begin(plane)
    before = len(plane.generator.requests)
    r = respond(plane, uuid, **extra)
    assert r.status_code == 400 and r.json()["param"] == param, r.json()
    assert r.json()["hint"]
    assert len(plane.generator.requests) == before
    end(plane, uuid)


#: what openai-agents' default model settings add to every call of an Agent with no model
AGENTS_DEFAULTS: dict[str, Any] = {"model": "gpt-5.6-luna", "include": [], "tools": [],
                                   "reasoning": {"effort": "none"},
                                   "text": {"verbosity": "low"}}
ADVISORY = ["reasoning", "text.verbosity"]


def test_reasoning_and_verbosity_are_advisory_served_as_without_them_and_listed(
        plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(*[WEATHER_ANSWER] * 4)
    plain = respond(plane, uuid, instructions="Answer briefly.").json()
    assert plain["ajet"]["ignored"] == []
    asked = plane.last_ask()
    for extra in (AGENTS_DEFAULTS, {
            "reasoning": {"effort": "xhigh", "summary": "detailed", "context": "all_turns"},
            "text": {"format": {"type": "text"}, "verbosity": "high"}}):
        reply = respond(plane, uuid, instructions="Answer briefly.", **extra).json()
        assert reply["status"] == "completed", reply
        assert reply["output"][0]["content"][0]["text"] == WEATHER_ANSWER
        assert reply["ajet"]["ignored"] == ADVISORY
        assert plane.last_ask() == asked  # no effect on what is generated
    streamed = events(respond(plane, uuid, instructions="Answer briefly.", stream=True,
                              **AGENTS_DEFAULTS).text)
    assert streamed[-1][0] == "response.completed"
    assert streamed[-1][1]["response"]["ajet"]["ignored"] == ADVISORY
    for text, param in (({"verbosity": "loud"}, "text.verbosity"),
                        ({"verbosity": "low", "stop": "x"}, "text.stop")):
        r = respond(plane, uuid, text=text)
        assert r.status_code == 422 and r.json()["param"] == param, r.json()
    assert len(recorded(plane, end(plane, uuid))) == 4
