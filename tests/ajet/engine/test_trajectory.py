"""Timelines in process: an episode's calls rendered by the real chat format, merged.

Completions are built the way the episode plane records them (`ChatFormat.render` gives
the prompt ids, the messages and the assistant spans; the reply is parsed back), with
made-up sampled ids, so every case is exact and takes milliseconds. The drift cases use
ajet-tiny's tokenizer with one merge added (`P` + `a` -> `Pa`), so a reply sampled as
`P`, `a`, ... re-encodes differently once it is re-sent as text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ajet.engine.plane.chat_format import ChatFormat
from ajet.engine.trainer import build_samples as batch_samples
from ajet.engine.trainer import write_samples
from ajet.engine.trajectory import Completion, build_samples, reply_message
from swarm_server.run_files import read_samples, sample_steps

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
SYSTEM = {"role": "system", "content": "You are a weather agent."}
QUESTION = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """ajet-tiny's tokenizer (one token per character), and one with a `Pa` merge."""
    from transformers import AutoTokenizer

    from ajet.engine.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def merging_tokenizer(tokenizer: Any) -> Any:
    from transformers import Qwen2Tokenizer

    vocab = dict(tokenizer.get_vocab())
    vocab["Pa"] = len(vocab)
    merged = Qwen2Tokenizer(vocab=vocab, merges=[("P", "a")], unk_token=None, bos_token=None,
                            eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            additional_special_tokens=["<|im_start|>"])
    merged.chat_template = tokenizer.chat_template
    merged.response_template = tokenizer.response_template
    assert merged("Paris", add_special_tokens=False)["input_ids"][0] == vocab["Pa"]
    return merged


class Episode:
    """Calls of one episode as the plane records them; replies sampled as given ids."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.fmt = tok, ChatFormat(tok)
        self.completions: list[Completion] = []
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def ids(self, text: str) -> list[int]:
        return [int(i) for i in self.tok(text, add_special_tokens=False)["input_ids"]]

    def call(self, messages: list[dict[str, Any]], sampled: list[int] | str, *,
             tools: list[dict[str, Any]] | None = None, agent: str = "m",
             end: bool = True) -> Completion:
        prompt = self.fmt.render(messages, tools=tools)
        ids = self.ids(sampled) if isinstance(sampled, str) else list(sampled)
        # the reply as served: special tokens the model sampled are left out of the text
        text = self.tok.decode(ids, skip_special_tokens=True)
        reply = self.fmt.parse(text, prompt_text=prompt.text, tools=tools) if tools else None
        response = [*ids, self.end] if end else ids
        n = len(self.completions)
        c = Completion(tuple(prompt.ids), tuple(response),
                       tuple(-0.01 * (n + 1) - 0.001 * i for i in range(len(response))),
                       "stop" if end else "length", 0, agent=agent, messages=prompt.messages,
                       assistant_spans=prompt.assistant_spans,
                       reply=reply_message(reply.content, [(t.name, t.arguments)
                                                           for t in reply.tool_calls])
                       if reply else reply_message(text))
        self.completions.append(c)
        return c


def sampled_part(sample: Any) -> list[int]:
    return [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]


def call_message(arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": arguments}}]}


SECOND = [SYSTEM, QUESTION, call_message(json.dumps({"city": "Paris"})),
          {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
THIRD = [*SECOND, {"role": "assistant", "content": "It is sunny."},
         {"role": "user", "content": "And tomorrow?"}]


def tool_episode(tok: Any) -> Episode:
    """Call 1 samples a compact tool call; the client re-sends it spaced; call 2 answers;
    a follow-up question quotes the answer; call 3 answers again."""
    ep = Episode(tok)
    first = [SYSTEM, QUESTION]
    ep.call(first, '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n'
                   '</tool_call>', tools=[TOOL])
    ep.call(SECOND, "It is sunny.", tools=[TOOL])
    ep.call(THIRD, "Rain.", tools=[TOOL])
    return ep


def test_a_tool_episode_is_one_sample_with_every_sampled_token_trained(tokenizer: Any) -> None:
    ep = tool_episode(tokenizer)
    c1, c2, c3 = ep.completions
    # the premise: the template re-renders the sampled call with a space, so the later
    # prompts do not start with the first call's tokens
    assert list(c2.prompt_ids[:len(c1.prompt_ids) + len(c1.response_ids)]) != [
        *c1.prompt_ids, *c1.response_ids]
    for level in ("token", "text"):
        timelines = build_samples(ep.completions, compare_level=level)
        assert len(timelines.samples) == 1 and timelines.completions == 3
        sample = timelines.samples[0]
        assert sample.completions == (0, 1, 2)
        # trained: exactly the three sampled replies, as sampled, with their log-probs
        assert sampled_part(sample) == [*c1.response_ids, *c2.response_ids, *c3.response_ids]
        assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [
            *c1.logprobs, *c2.logprobs, *c3.logprobs]
        assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
        # the sequence: the first call's prompt, then the last call's with the replies
        # spliced in; its length is the last call's, less the re-rendered space
        assert sample.token_ids[:len(c1.prompt_ids)] == c1.prompt_ids
        assert sample.token_ids[-len(c3.response_ids):] == c3.response_ids
        assert len(sample.token_ids) == len(c3.prompt_ids) + len(c3.response_ids) - 1
        text = tokenizer.decode(sample.token_ids)
        assert '{"city":"Paris"}' in text and '{"city": "Paris"}' not in text.split("<tools>")[-1]
        assert sample.trained_tokens + sample.prompt_tokens == len(sample.token_ids)
        # the tool call came back re-rendered: one turn of drift
        assert timelines.retokenisation_drift == 1
    # the spans placed from the tokenizer's offsets are those of rendering each prefix
    slow = ChatFormat(tokenizer)
    slow._token_starts = lambda text, ids: None  # type: ignore[method-assign]
    assert c3.assistant_spans and slow.render(THIRD, tools=[TOOL]).assistant_spans == \
        c3.assistant_spans
    # without merging: one sample per call, each with its own prompt as it saw it
    plain = build_samples(ep.completions, merging=False)
    assert [s.completions for s in plain.samples] == [(0,), (1,), (2,)]
    assert plain.samples[1].token_ids == (*c2.prompt_ids, *c2.response_ids)


def test_agents_never_merge_and_only_the_listed_ones_train(tokenizer: Any) -> None:
    ep = Episode(tokenizer)
    first = [SYSTEM, QUESTION]
    ep.call(first, "Let me see.", agent="planner")
    ep.call([{"role": "user", "content": "Summarise: weather"}], "Weather.", agent="side")
    ep.call([*first, {"role": "assistant", "content": "Let me see."},
             {"role": "user", "content": "Go on."}], "Sunny.", agent="planner")
    # the same history under another name: not the planner's timeline
    ep.call([*first, {"role": "assistant", "content": "Let me see."},
             {"role": "user", "content": "Go on."}], "Cloudy.", agent="critic")
    merged = build_samples(ep.completions)
    assert sorted((s.agent, s.completions) for s in merged.samples) == [
        ("critic", (3,)), ("planner", (0, 2)), ("side", (1,))]
    only = build_samples(ep.completions, agents=["planner"])
    assert [(s.agent, s.completions) for s in only.samples] == [("planner", (0, 2))]
    assert only.completions == 2


def test_a_retry_whose_context_was_dropped_forks_and_duplicates_count_once(
        tokenizer: Any) -> None:
    ep = Episode(tokenizer)
    first = [SYSTEM, QUESTION]
    bad = '<tool_call>\n{"name": "get_weather"'
    ep.call(first, bad, tools=[TOOL], end=False)  # cut off: served as content
    retry = [*first, {"role": "assistant", "content": bad},
             {"role": "user", "content": "That call was malformed; try again."}]
    ep.call(retry, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                   '</tool_call>', tools=[TOOL])
    # the framework drops the failed attempt: the good call now follows the question
    kept = [*first, call_message('{"city": "Paris"}'),
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ep.call(kept, "It is sunny.", tools=[TOOL])
    ep.call(kept, "It is sunny.", tools=[TOOL])  # sent twice: counted once
    # and a fork of the first call: another follow-up to the same reply
    ep.call([*first, {"role": "assistant", "content": bad},
             {"role": "user", "content": "Never mind."}], "OK.", tools=[TOOL])
    timelines = build_samples(ep.completions)
    by_calls = {s.completions: s for s in timelines.samples}
    assert set(by_calls) == {(0, 1), (2,), (0, 4)}
    # the first call is trained once, in the first sample that holds it
    assert sum(s.loss_mask.count(1) for s in timelines.samples) == sum(
        len(ep.completions[i].response_ids) for i in (0, 1, 2, 4))
    assert sampled_part(by_calls[(0, 4)]) == list(ep.completions[4].response_ids)
    # the kept call is context (as its prompt rendered it), not trained in sample (2,)
    assert sampled_part(by_calls[(2,)]) == list(ep.completions[2].response_ids)
    assert by_calls[(2,)].token_ids[:len(ep.completions[2].prompt_ids)] == \
        ep.completions[2].prompt_ids


def test_drift_what_each_compare_level_gives(merging_tokenizer: Any) -> None:
    """A reply sampled as `P`,`a`,... re-encodes as `Pa`,... once re-sent as text."""
    tok = merging_tokenizer
    ep = Episode(tok)
    first = [SYSTEM, QUESTION]
    sampled = [tok.convert_tokens_to_ids(c) for c in "Paris"]  # not the canonical `Pa`
    ep.call(first, sampled)
    ep.call([*first, {"role": "assistant", "content": "Paris"},
             {"role": "user", "content": "Sure?"}], "Yes.")
    c1, c2 = ep.completions
    start, end = next((s, e) for i, s, e in c2.assistant_spans if i == 2)
    assert list(c2.prompt_ids[start:start + 4]) == ep.ids("Paris")  # re-encoded: 4 tokens
    # the re-sent reply is spliced at both levels: the trained tokens are the sampled ones
    for level in ("token", "text"):
        timelines = build_samples(ep.completions, compare_level=level)
        assert [s.completions for s in timelines.samples] == [(0, 1)]
        assert sampled_part(timelines.samples[0]) == [*c1.response_ids, *c2.response_ids]
        assert timelines.retokenisation_drift == 1

    # a reply cut by max_tokens that re-encodes differently (here: a special token the
    # served text left out) is placed by encoding the re-sent text alone
    ep = Episode(tok)
    start_token = tok.convert_tokens_to_ids("<|im_start|>")
    cut = [*ep.ids("12"), start_token, *ep.ids("34")]
    ep.call(first, cut, end=False)
    ep.call([*first, {"role": "assistant", "content": "1234"},
             {"role": "user", "content": "More."}], "56")
    assert [s.completions for s in build_samples(ep.completions).samples] == [(0,), (1,)]
    placed = build_samples(ep.completions, encode=ep.ids)
    assert [s.completions for s in placed.samples] == [(0, 1)]
    assert sampled_part(placed.samples[0]) == [*cut, *ep.completions[1].response_ids]
    assert placed.retokenisation_drift == 1

    # a history whose text re-encodes differently: a raw-prompt client appends the reply
    # text to its prompt. token: the prompts do not extend token for token, two samples;
    # text: one sample, the sampled ids kept and only the new text encoded
    raw = Episode(tok)
    prompt = "Q: capital of France?\nA: "
    c1 = Completion(tuple(raw.ids(prompt)), tuple(sampled), (-0.5,) * 5, "length", 0)
    follow = prompt + "Paris\nQ: sure?\nA: "
    c2 = Completion(tuple(raw.ids(follow)), tuple(raw.ids("yes")), (-0.25,) * 3, "length", 0)

    def decode(ids: Any) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=False))

    token = build_samples([c1, c2], compare_level="token", encode=raw.ids, decode=decode)
    assert [s.completions for s in token.samples] == [(0,), (1,)]
    text = build_samples([c1, c2], compare_level="text", encode=raw.ids, decode=decode)
    assert [s.completions for s in text.samples] == [(0, 1)]
    merged = text.samples[0]
    assert merged.token_ids == (*c1.prompt_ids, *sampled, *raw.ids("\nQ: sure?\nA: "),
                                *c2.response_ids)
    assert sampled_part(merged) == [*sampled, *c2.response_ids]

    # the same messages rendered differently (the tools offered changed): token keeps two
    # samples, text merges them with the later call's tokens
    ep = Episode(tok)
    ep.call(first, "Hello.")
    ep.call([*first, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Weather?"}], "Sunny.", tools=[TOOL])
    assert [s.completions for s in build_samples(ep.completions).samples] == [(0,), (1,)]
    merged = build_samples(ep.completions, compare_level="text").samples
    assert [s.completions for s in merged] == [(0, 1)]
    assert len(merged[0].token_ids) == len(ep.completions[1].prompt_ids) + len(
        ep.completions[1].response_ids)


def test_the_trainer_gives_every_sample_the_episode_advantage_and_writes_them(
        tokenizer: Any, tmp_path: Path) -> None:
    from ajet.engine.plane.episodes import Episode as Ep
    from ajet.engine.plane.episodes import Group
    from ajet.engine.trajectory import Trajectory

    episodes = []
    for seed in range(2):
        ep = tool_episode(tokenizer)
        ep.call([SYSTEM, {"role": "user", "content": f"Side {seed}"}], "ok", agent="side")
        episodes.append(Ep(uuid=f"e{seed}", claimed_at=0, last_active=0, timeout_s=1,
                           policy_step=0, trajectory=Trajectory(ep.completions),
                           task_id="t", reward=float(seed)))

    class Cfg:
        timeline_compare_level, timeline_merging, train_agents = "token", True, ("m",)

    batch = batch_samples([Group("t", episodes)], [-1.0, 1.0], cfg=Cfg(),  # type: ignore[arg-type]
                          tokenizer=tokenizer)
    assert [s.advantage for s in batch.samples] == [-1.0, 1.0]
    assert batch.metrics == {
        "train/episodes": 2, "train/completions": 6, "train/samples": 2,
        "train/trained_tokens": sum(s.trained_tokens for s in batch.samples),
        "train/prompt_tokens": sum(len(r["token_ids"]) for r in batch.records)
        - sum(s.trained_tokens for s in batch.samples),
        "train/retokenisation_drift": 2}
    sample = batch.samples[0]
    assert sample.loss_mask[0] == 1 and len(sample.loss_mask) == len(sample.response_ids)
    assert sample.trained_tokens == sum(len(c.response_ids) for c in
                                        episodes[0].trajectory.completions[:3])
    path = write_samples(tmp_path, 3, batch.records)
    assert path.name == "samples-3.jsonl" and sample_steps(path.parent) == [3]
    page, total, next_offset = read_samples(path, offset=0, limit=1, max_bytes=1 << 20)
    assert total == 2 and next_offset == 1 and page[0]["episode_uuid"] == "e0"
    assert page[0]["text"] == tokenizer.decode(page[0]["token_ids"])
    # a byte bound smaller than one sample still returns one, then pages on
    page, _, next_offset = read_samples(path, offset=1, limit=5, max_bytes=10)
    assert [p["episode_uuid"] for p in page] == ["e1"] and next_offset is None
