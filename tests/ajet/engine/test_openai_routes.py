"""The OpenAI-compatible routes of the private channel, in process, with a scripted generator.

Real parts: the channel app (`create_channel_app`) with the engine's episode registry, the
ajet-tiny checkpoint's tokenizer and chat template, and the tool-call parsing. The model
is replaced by `ScriptedGenerator`, so each test says what the "model" answers and checks
what the routes make of it: the rendered prompt, the reply's OpenAI shape, streaming,
tool calls, refusals, and what is recorded for training. One end-to-end test with the
real engine and a fine-tuned model stays in tests/tool_agents/test_tool_calling.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.engine import SCRIPTED_LOGPROB
from tests.support.plane import PlaneApp, begin, end, recorded, sse_events
from tests.support.tool_model import CALL_TEXT, TOOL, WEATHER_ANSWER, WEATHER_QUESTION

QUESTION = [{"role": "user", "content": WEATHER_QUESTION}]
TWO_CALLS = CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")


def chat(plane: PlaneApp, uuid: str, **body: Any) -> Any:
    body.setdefault("messages", QUESTION)
    return plane.http.post("/v1/chat/completions", headers={"X-Episode-UUID": uuid}, json=body)


def test_a_chat_answers_the_generators_text_and_records_the_tokens_it_saw(
        plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(WEATHER_ANSWER)
    r = chat(plane, uuid, model="gpt-4o", logprobs=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == plane.model
    assert choice["message"] == {"role": "assistant", "content": WEATHER_ANSWER}
    assert choice["finish_reason"] == "stop"
    # the prompt is the checkpoint template's rendering; the reply ends with end-of-turn
    request = plane.generator.requests[-1]
    assert request.prompt_ids == plane.render(QUESTION) and request.session == uuid
    reply_ids = plane.encode(WEATHER_ANSWER) + [plane.generator.end_of_turn]
    assert body["usage"] == {"prompt_tokens": len(request.prompt_ids),
                             "completion_tokens": len(reply_ids),
                             "total_tokens": len(request.prompt_ids) + len(reply_ids)}
    tokens = choice["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == WEATHER_ANSWER + "<|im_end|>"
    assert {t["logprob"] for t in tokens} == {SCRIPTED_LOGPROB}
    # a training episode samples with the run's settings, and says what it ignored
    assert body["ajet"] == {"episode_type": "train", "ignored": [],
                            "sampling": {"temperature": plane.cfg.temperature,
                                         "top_p": plane.cfg.top_p, "source": "run"}}
    (completion,) = recorded(plane, end(plane, uuid))
    assert list(completion.prompt_ids) == request.prompt_ids
    assert list(completion.response_ids) == reply_ids
    assert completion.finish_reason == "stop" and not completion.tool_call_parse_error


def test_a_tool_call_is_parsed_from_the_reply_and_its_result_rendered_into_the_follow_up(
        plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(CALL_TEXT, WEATHER_ANSWER)
    first = chat(plane, uuid, tools=[TOOL]).json()
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    asked = plane.generator.requests[-1].prompt_ids
    assert asked == plane.render(QUESTION, tools=[TOOL])
    assert len(asked) > len(plane.render(QUESTION))  # the tool's schema is in the prompt
    follow = [*QUESTION, choice["message"],
              {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 24 C"}]
    second = chat(plane, uuid, messages=follow, tools=[TOOL]).json()
    assert second["choices"][0]["message"]["content"] == WEATHER_ANSWER
    assert second["choices"][0]["finish_reason"] == "stop"
    prompt = plane.decode(plane.generator.requests[-1].prompt_ids)
    assert "<tool_response>" in prompt and "sunny, 24 C" in prompt
    completions = recorded(plane, end(plane, uuid))
    # the call's tokens are recorded (and trained on) like any reply
    assert [list(c.response_ids) for c in completions] == [
        plane.encode(CALL_TEXT) + [plane.generator.end_of_turn],
        plane.encode(WEATHER_ANSWER) + [plane.generator.end_of_turn]]


def test_a_streamed_tool_call_comes_as_openai_deltas_without_content(plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(CALL_TEXT)
    r = chat(plane, uuid, tools=[TOOL], stream=True, stream_options={"include_usage": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    parts = [t for d in deltas for t in d.get("tool_calls") or []]
    assert parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(p["function"]["arguments"] for p in parts)) == {"city": "Paris"}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(
        plane.encode(CALL_TEXT)) + 1
    assert len({c["id"] for c in chunks}) == 1
    end(plane, uuid)


def test_streamed_content_stops_at_a_stop_string_and_never_shows_it(plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say("Sunny today. STOP and more text")
    events = sse_events(chat(plane, uuid, stream=True, stop=["STOP"]).text)
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in events[:-1] if c["choices"])
    assert text == "Sunny today. "
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert plane.generator.requests[-1].stop == ("STOP",)
    end(plane, uuid)


def test_a_cut_or_malformed_call_is_served_as_content_and_marked(plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(CALL_TEXT, CALL_TEXT)
    cut = chat(plane, uuid, tools=[TOOL], max_tokens=20).json()
    choice = cut["choices"][0]
    assert choice["message"]["content"] == CALL_TEXT[:20] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length" and cut["usage"]["completion_tokens"] == 20
    assert "JSON" in cut["ajet"]["tool_call_parse_error"]
    streamed = sse_events(chat(plane, uuid, tools=[TOOL], max_tokens=20, stream=True).text)
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in streamed[:-1] if c["choices"])
    assert text == CALL_TEXT[:20]
    completions = recorded(plane, end(plane, uuid))
    assert [c.tool_call_parse_error for c in completions] == [True, True]
    assert [c.finish_reason for c in completions] == ["length", "length"]


def test_tool_choice_none_required_named_and_parallel(plane: PlaneApp) -> None:
    uuid = begin(plane)
    # none: the tools are not rendered, and the reply is not read as calls
    plane.generator.say(CALL_TEXT)
    plain = chat(plane, uuid, tools=[TOOL], tool_choice="none").json()
    assert plane.generator.requests[-1].prompt_ids == plane.render(QUESTION)
    assert plain["choices"][0]["message"]["content"] == CALL_TEXT
    # named and satisfied
    plane.generator.say(CALL_TEXT)
    named = chat(plane, uuid, tools=[TOOL],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).json()
    assert named["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert named["ajet"]["tool_choice_unmet"] is False
    # required, answered in text: served, marked
    plane.generator.say(WEATHER_ANSWER)
    text = chat(plane, uuid, tools=[TOOL], tool_choice="required").json()
    assert text["choices"][0]["message"]["content"] == WEATHER_ANSWER
    assert text["ajet"]["tool_choice_unmet"] is True
    # two calls: both by default, one when parallel calls are off
    plane.generator.say(TWO_CALLS, TWO_CALLS)
    both = chat(plane, uuid, tools=[TOOL], max_tokens=200).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["city"] for c in both] == ["Paris", "Rome"]
    one = chat(plane, uuid, tools=[TOOL], parallel_tool_calls=False, max_tokens=200).json()
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1
    assert one["ajet"]["tool_calls_dropped"] == 1
    unknown = chat(plane, uuid, tools=[TOOL],
                   tool_choice={"type": "function", "function": {"name": "nope"}})
    assert unknown.status_code == 400 and unknown.json()["param"] == "tool_choice"
    end(plane, uuid)


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
    ("frobnicate", {"frobnicate": True}),
]


@pytest.mark.parametrize(("param", "extra"), REFUSED, ids=[p for p, _ in REFUSED])
def test_a_parameter_that_cannot_be_honoured_is_a_400_naming_it(
        plane: PlaneApp, param: str, extra: dict[str, Any]) -> None:
    uuid = begin(plane)
    before = len(plane.generator.requests)
    r = chat(plane, uuid, **extra)
    assert r.status_code == 400 and r.json()["param"] == param, r.json()
    assert r.json()["hint"]
    assert len(plane.generator.requests) == before  # refused before anything is generated
    end(plane, uuid)


def test_a_reply_longer_than_the_runs_bound_is_refused_naming_the_bound(plane: PlaneApp) -> None:
    uuid = begin(plane)
    limit = plane.cfg.max_response_length
    r = chat(plane, uuid, max_tokens=limit + 1)
    assert r.status_code == 400 and f"max_response_length ({limit})" in r.json()["detail"]
    end(plane, uuid)


def test_defaults_are_accepted_and_an_eval_episode_samples_as_asked(plane: PlaneApp) -> None:
    uuid = begin(plane)
    ok = chat(plane, uuid, model="any-name", max_tokens=4, n=1, frequency_penalty=0,
              presence_penalty=0, logit_bias={}, response_format={"type": "text"}, user="u",
              metadata={"k": "v"}, store=False, service_tier="auto", top_logprobs=0,
              temperature=0.7, top_p=0.9, stream_options=None).json()
    assert ok["model"] == plane.model
    assert ok["ajet"]["episode_type"] == "train" and ok["ajet"]["ignored"] == [
        "temperature", "top_p"]
    train = plane.generator.requests[-1]
    assert (train.temperature, train.top_p, train.max_new_tokens) == (None, None, 4)
    end(plane, uuid)
    evaluation = begin(plane, episode_type="eval")
    reply = chat(plane, evaluation, temperature=0, top_p=0.5).json()
    assert reply["ajet"]["sampling"]["source"] == "request" and reply["ajet"]["ignored"] == []
    asked = plane.generator.requests[-1]
    assert asked.top_p == 0.5 and asked.temperature is not None and asked.temperature < 1e-3
    end(plane, evaluation)


def test_reasoning_effort_and_verbosity_are_advisory_served_as_without_them_and_listed(
        plane: PlaneApp) -> None:
    uuid = begin(plane)
    plane.generator.say(*[WEATHER_ANSWER] * 3)
    assert chat(plane, uuid).json()["ajet"]["ignored"] == []
    asked = plane.last_ask()
    # what openai-agents' default model settings send through its chat-completions model
    reply = chat(plane, uuid, model="gpt-5.6-luna", reasoning_effort="none",
                 verbosity="low").json()
    assert reply["choices"][0]["message"]["content"] == WEATHER_ANSWER
    assert reply["ajet"]["ignored"] == ["reasoning_effort", "verbosity"]
    assert plane.last_ask() == asked  # no effect on what is generated
    streamed = sse_events(chat(plane, uuid, stream=True, reasoning_effort="xhigh",
                               verbosity="high").text)
    assert streamed[-2]["ajet"]["ignored"] == ["reasoning_effort", "verbosity"]
    bad = chat(plane, uuid, verbosity="loud")
    assert bad.status_code == 422 and bad.json()["param"] == "verbosity"
    assert len(recorded(plane, end(plane, uuid))) == 3


def test_completions_take_text_or_token_ids_and_give_logprobs(plane: PlaneApp) -> None:
    uuid = begin(plane)
    headers = {"X-Episode-UUID": uuid}
    prompt = "<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n"
    plane.generator.say("Sunny", "Rainy", "Snowy")
    text = plane.http.post("/v1/completions", headers=headers,
                           json={"prompt": prompt, "max_tokens": 6, "logprobs": 0}).json()
    choice = text["choices"][0]
    assert text["object"] == "text_completion" and choice["text"] == "Sunny"
    assert plane.generator.requests[-1].prompt_ids == plane.encode(prompt)
    assert choice["logprobs"]["tokens"] == [*"Sunny", "<|im_end|>"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4, 5]
    assert choice["logprobs"]["token_logprobs"] == [SCRIPTED_LOGPROB] * 6
    ids = plane.encode("hello")
    by_ids = plane.http.post("/v1/completions", headers=headers, json={"prompt": ids})
    assert by_ids.json()["choices"][0]["text"] == "Rainy"
    assert plane.generator.requests[-1].prompt_ids == ids
    streamed = sse_events(plane.http.post("/v1/completions", headers=headers, json={
        "prompt": [prompt], "stream": True, "stream_options": {"include_usage": True}}).text)
    assert "".join(c["choices"][0]["text"] for c in streamed[:-2]) == "Snowy"
    assert streamed[-3]["choices"][0]["finish_reason"] == "stop"
    assert streamed[-2]["usage"]["completion_tokens"] == 6 and streamed[-1] == "[DONE]"
    for bad, param in (({"prompt": [prompt, prompt]}, "prompt"),
                       ({"prompt": [10 ** 9]}, "prompt"), ({"prompt": []}, "prompt"),
                       ({"prompt": prompt, "logprobs": 2}, "logprobs")):
        r = plane.http.post("/v1/completions", headers=headers, json=bad)
        assert r.status_code == 400 and r.json()["param"] == param, (bad, r.json())
    assert len(recorded(plane, end(plane, uuid))) == 3  # completions train like chats


def test_models_and_the_errors_of_the_episode_plane(plane: PlaneApp) -> None:
    assert [m["id"] for m in plane.http.get("/v1/models").json()["data"]] == [plane.model]
    assert plane.http.get(f"/v1/models/{plane.model}").json()["id"] == plane.model
    missing = plane.http.get("/v1/models/gpt-4o")
    assert missing.status_code == 404 and "any model name works" in missing.json()["hint"]
    assert missing.json()["param"] == "model"
    no_header = plane.http.post("/v1/chat/completions", json={"messages": QUESTION})
    assert no_header.status_code == 400 and "X-Episode-UUID" in no_header.json()["detail"]
    assert chat(plane, "never-issued").status_code == 404
    uuid = begin(plane)
    empty = chat(plane, uuid, messages=[])
    assert empty.status_code == 422 and empty.json()["param"] == "messages"
    limit = plane.cfg.max_chat_bytes
    huge = plane.http.post("/v1/chat/completions", headers={"X-Episode-UUID": uuid,
                                                            "Content-Type": "application/json"},
                           content=b"x" * (limit + 1))
    assert huge.status_code == 413 and f"{limit} bytes" in huge.json()["detail"]
    too_long = chat(plane, uuid, messages=[
        {"role": "user", "content": "x" * (plane.cfg.max_prompt_length + 10)}])
    assert too_long.status_code == 400 and "max_prompt_length" in too_long.json()["detail"]
    end(plane, uuid)
    closed = chat(plane, uuid)
    assert closed.status_code == 409 and closed.json()["hint"]


def test_without_a_loaded_policy_the_routes_answer_503(bare_plane: PlaneApp) -> None:
    uuid = begin(bare_plane)
    r = chat(bare_plane, uuid)
    assert r.status_code == 503 and "no policy loaded" in r.json()["detail"]
    assert "ENGINE.ROLLING" in r.json()["hint"]
