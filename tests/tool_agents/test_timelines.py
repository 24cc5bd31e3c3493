"""Multi-turn agents trained as timelines, with the real clients against a real server.

This folder's `tool_server` (ajet-tiny fine-tuned to call `get_weather`, one training
step per two ended episodes) serves every test here, so no engine starts for this
file. Each test runs two multi-turn episodes through a real client, ends them, and
reads the step's samples back (`GET /runs/current/samples`, worker token): one sample
per timeline, its trained tokens and their log-probs exactly the ones each call
returned (`logprobs`), everything else masked out.
"""

from __future__ import annotations

from typing import Any

import pytest

from ajet.client import SwarmClient
from ajet.errors import SwarmNotFound
from ajet.protocol import SamplePublic
from tests.support.episodes import begin
from tests.support.tool_model import (
    CALLS,
    SYSTEM,
    TOOL,
    WEATHER_ANSWER,
    WEATHER_QUESTION,
    get_weather,
    last_step,
    next_step,
    oai,
    run_weather_agent,
)

pytestmark = pytest.mark.slow

FUNCTION = {"type": "function", **TOOL["function"]}
LOGPROBS = ["message.output_text.logprobs"]


def step_samples(worker: SwarmClient, step: int) -> dict[str, list[SamplePublic]]:
    """Every sample of a step, by episode, read page by page (one sample a page)."""
    out: dict[str, list[SamplePublic]] = {}
    offset: int | None = 0
    while offset is not None:
        page = worker.get_samples(step, offset=offset, limit=1)
        assert len(page.samples) == 1
        out.setdefault(page.samples[0].episode_uuid, []).append(page.samples[0])
        offset = page.next_offset
    return out


def trained(sample: SamplePublic, tokenizer: Any) -> tuple[str, list[float]]:
    """The trained tokens (decoded) and their log-probs."""
    ids = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    lps = [lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m]
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    return tokenizer.decode(ids), lps


def sampled(choice: Any) -> tuple[str, list[float]]:
    """What the engine sampled for one chat reply: its tokens and log-probs."""
    content = choice.logprobs.content
    return "".join(t.token for t in content), [t.logprob for t in content]


def test_openai_chat_and_responses_tool_loops_train_as_one_sample_each(
        tool_worker: SwarmClient, tool_tokenizer: Any) -> None:
    before = last_step(tool_worker)
    # chat completions: a tool call, the answer, then a follow-up that quotes the answer
    chat = begin(tool_worker)
    client = oai(chat)
    history: list[Any] = [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": WEATHER_QUESTION}]
    replies = []
    for turn in range(3):
        reply = client.chat.completions.create(model="weather-agent", messages=history,
                                               tools=[TOOL], logprobs=True, max_tokens=96)
        replies.append(reply)
        message = reply.choices[0].message
        history.append(message.model_dump(exclude_none=True))
        # the agent loop: a tool call gets its result, an answer a follow-up quoting it
        for call in message.tool_calls or ():
            history.append({"role": "tool", "tool_call_id": call.id,
                            "content": get_weather("Paris")})
        if not message.tool_calls:
            history.append({"role": "user", "content": f'You said "{message.content}". '
                                                       "Thanks, and tomorrow?"})

    assert replies[0].choices[0].message.tool_calls  # the model called the tool
    assert replies[1].choices[0].message.content == WEATHER_ANSWER

    # Responses: the function call, then its output as input items
    responses = begin(tool_worker)
    rclient = oai(responses)
    called = rclient.responses.create(model="weather-agent", instructions=SYSTEM,
                                      input=WEATHER_QUESTION, tools=[FUNCTION],
                                      max_output_tokens=96)
    items: list[Any] = [{"role": "user", "content": WEATHER_QUESTION}]
    for item in called.output:  # the output items go back as input, calls with results
        if item.type == "function_call":
            items += [{"type": "function_call", "call_id": item.call_id, "name": item.name,
                       "arguments": item.arguments},
                      {"type": "function_call_output", "call_id": item.call_id,
                       "output": get_weather("Paris")}]
        else:
            items += [{"role": "assistant", "content": item.content[0].text},
                      {"role": "user", "content": "And tomorrow?"}]
    answer = rclient.responses.create(model="weather-agent", instructions=SYSTEM, input=items,
                                      tools=[FUNCTION], max_output_tokens=96, include=LOGPROBS)

    tool_worker.report_episode(chat.episode_uuid, "chat-loop", 1.0)
    tool_worker.report_episode(responses.episode_uuid, "responses-loop", 0.0)
    line = next_step(tool_worker, before)
    assert (line["train/episodes"], line["train/completions"], line["train/samples"]) == (2, 5, 2)
    samples = step_samples(tool_worker, line["step"])

    [sample] = samples[chat.episode_uuid]
    assert sample.completions == [0, 1, 2] and sample.agent == "weather-agent"
    text, lps = trained(sample, tool_tokenizer)
    expected = [sampled(r.choices[0]) for r in replies]
    assert text == "".join(t for t, _ in expected)
    assert lps == [lp for _, lp in expected for lp in lp]
    # the first call's prompt once, then the replies as sampled and what came between;
    # the later calls' prompts are not trained again
    first = sample.loss_mask.index(1)
    assert first == replies[0].usage.prompt_tokens
    assert sum(sample.loss_mask) == sum(r.usage.completion_tokens for r in replies)
    assert sample.text is not None and sample.text.count(WEATHER_QUESTION) == 1
    if line["train/retokenisation_drift"] == 0:  # every reply re-rendered as sampled
        last = replies[-1].usage
        assert len(sample.token_ids) == last.prompt_tokens + last.completion_tokens

    [rsample] = samples[responses.episode_uuid]
    assert rsample.completions == [0, 1]
    text, lps = trained(rsample, tool_tokenizer)
    assert sum(rsample.loss_mask) == called.usage.output_tokens + answer.usage.output_tokens
    if answer.output[0].type == "message":  # log-probs come back for text output only
        answer_lps = [t.logprob for t in answer.output[0].content[0].logprobs]
        assert lps[-len(answer_lps):] == answer_lps
    assert line["train/trained_tokens"] == sum(sample.loss_mask) + sum(rsample.loss_mask)
    assert line["train/prompt_tokens"] == (len(sample.token_ids) + len(rsample.token_ids)
                                           - line["train/trained_tokens"])

    with pytest.raises(SwarmNotFound, match="no samples for step"):
        tool_worker.get_samples(line["step"] + 10_000)


def test_a_langchain_retry_that_drops_context_and_an_openai_agents_runner(
        tool_worker: SwarmClient, tool_tokenizer: Any) -> None:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    before = last_step(tool_worker)
    # LangChain: the first call is cut short (a malformed tool call, served as content);
    # the agent asks again with the error in the history, then drops both from it
    lc = begin(tool_worker)
    llm = ChatOpenAI(base_url=lc.openai_base_url, api_key=lc.openai_api_key, model="lc",
                     max_tokens=96, max_retries=0, logprobs=True).bind_tools([get_weather])
    history = [SystemMessage(SYSTEM), HumanMessage(WEATHER_QUESTION)]
    cut = llm.bind(max_tokens=20).invoke(history)
    assert not cut.tool_calls  # cut short: content, whatever the model wrote
    retry = llm.invoke([*history, cut, HumanMessage("That call was cut off. Call again.")])
    kept = [*history, retry]
    if retry.tool_calls:
        kept.append(ToolMessage(get_weather("Paris"), tool_call_id=retry.tool_calls[0]["id"]))
    else:
        kept.append(HumanMessage("Go on."))
    final = llm.invoke(kept)
    lc_calls = [cut, retry, final]

    # openai-agents: a Runner with a function tool, through its chat-completions model
    ag = begin(tool_worker)
    result = run_weather_agent(ag, model="runner")
    assert CALLS == ["Paris"] and result.final_output == WEATHER_ANSWER

    tool_worker.report_episode(lc.episode_uuid, "lc-retry", 1.0)
    tool_worker.report_episode(ag.episode_uuid, "runner", 0.0)
    line = next_step(tool_worker, before)
    samples = step_samples(tool_worker, line["step"])

    # the cut call and the retry are one timeline; the call after the dropped context
    # extends neither (its history never held them), so it is its own sample
    lc_samples = {tuple(s.completions): s for s in samples[lc.episode_uuid]}
    assert set(lc_samples) == {(0, 1), (2,)}
    for calls, sample in lc_samples.items():
        text, lps = trained(sample, tool_tokenizer)
        want = [lc_calls[i].response_metadata["logprobs"]["content"] for i in calls]
        assert text == "".join(t["token"] for w in want for t in w)
        assert lps == [t["logprob"] for w in want for t in w]
    alone = lc_samples[(2,)]  # its prompt as it saw it, then its reply
    assert len(alone.token_ids) == (final.usage_metadata["input_tokens"]
                                    + final.usage_metadata["output_tokens"])
    assert alone.loss_mask.index(1) == final.usage_metadata["input_tokens"]

    # each call of the run re-sends the one before (its tool call and the result)
    [runner] = samples[ag.episode_uuid]
    calls = result.raw_responses
    assert runner.completions == list(range(len(calls))) and runner.agent == "runner"
    assert sum(runner.loss_mask) == sum(r.usage.output_tokens for r in calls)
    assert runner.loss_mask.index(1) == calls[0].usage.input_tokens
    assert len(calls) == 2  # the tool call, then the answer: one timeline
    assert line["train/samples"] == 3 and line["train/completions"] == 5
