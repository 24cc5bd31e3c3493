"""A tool-calling ajet-tiny for tests: a few seconds of supervised steps on CPU.

The checkpoint is ajet-tiny (same builder, template and tokenizer), fine-tuned so that its
replies are real model output in the tool-call format: asked about the weather it calls
`get_weather` with `{"city": "Paris"}`; once a tool result is in the chat it answers
`WEATHER_ANSWER`. The engine then serves it like any checkpoint directory (the job's
`model` is its path). Nothing here is product code: the engine never knows it is special.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import openai

from ajet.client import SwarmClient
from ajet.copilot.job import AgentJetJob
from ajet.protocol import BeginEpisodeResponse

__all__ = ["CALLS", "CALL_TEXT", "MAX_PROMPT_LENGTH", "SYSTEM", "TOOL", "WEATHER_ANSWER",
           "WEATHER_QUESTION", "finetune_tool_model", "get_weather", "history_after_call",
           "last_step", "next_step", "oai", "rendered", "tool_job"]

WEATHER_QUESTION = "What is the weather in Paris?"
WEATHER_ANSWER = "It is sunny in Paris."
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_RESULT = "sunny, 24 C"
ATTENTION_WINDOW = 64

#: The tool, as the plain openai client sends it.
TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

# Variations the agent frameworks send: their own schema shapes, other tools, system prompts.
_SCHEMAS = [
    TOOL["function"]["parameters"],
    {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
     "title": "get_weather_args", "type": "object", "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
     "required": ["city"], "additionalProperties": False},
]
_OTHER_TOOLS = [
    {"type": "function", "function": {"name": "get_time", "description": "Current time.",
                                      "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string"}}}}},
]
_SYSTEMS = [None, "You are a helpful assistant.", "You answer weather questions.",
            "You are a weather agent. Use the tools.", "Be brief."]
_QUESTIONS = [WEATHER_QUESTION, "what is the weather in Paris?", "Weather in Paris, please.",
              "How is the weather in Paris today?"]


def _tools(rng: random.Random) -> list[dict[str, Any]]:
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": rng.choice(
            ["Get the weather of a city.", "Get the current weather for a city.",
             "Returns the weather."]),
        "parameters": rng.choice(_SCHEMAS)}}
    if rng.random() < 0.5:
        weather["function"]["strict"] = True
    tools = [weather, *rng.sample(_OTHER_TOOLS, rng.randint(0, 2))]
    rng.shuffle(tools)
    return tools


def history_after_call(question: str = WEATHER_QUESTION, *, call_id: str = "call_0",
                       system: str | None = None) -> list[dict[str, Any]]:
    """The chat once the model called get_weather and the tool answered."""
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]


def _examples(rng: random.Random, n: int) -> list[tuple[list[dict[str, Any]], list[Any], str]]:
    out = []
    for i in range(n):
        system = rng.choice(_SYSTEMS)
        question = rng.choice(_QUESTIONS)
        tools = _tools(rng)
        if i % 2 == 0:
            head = [{"role": "system", "content": system}] if system else []
            out.append(([*head, {"role": "user", "content": question}], tools, CALL_TEXT))
        else:
            call_id = rng.choice(["call_0", "call_abc123", f"call_{rng.getrandbits(64):x}"])
            out.append((history_after_call(question, call_id=call_id, system=system), tools,
                        WEATHER_ANSWER))
    return out


def finetune_tool_model(target: Path, *, steps: int = 300, lr: float = 1.2e-2, batch: int = 8,
                        seed: int = 0) -> Path:
    """Build ajet-tiny at `target` and fine-tune it to call get_weather (see module doc).

    300 steps: at 220 (with torch 2.13 and transformers 5.24) the last loss was 0.32 and
    greedy replies were garbled calls; at 300 it is 2e-4 and the replies are exact.
    """
    import torch

    if (target / "finetuned.json").is_file():
        return target
    threads = torch.get_num_threads()
    # one thread: on a shared 2-core machine more threads only wait for each other
    torch.set_num_threads(1)
    try:
        return _finetune(target, steps=steps, lr=lr, batch=batch, seed=seed)
    finally:
        torch.set_num_threads(threads)


def _finetune(target: Path, *, steps: int, lr: float, batch: int, seed: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ajet.engine.tiny import build_tiny_checkpoint

    build_tiny_checkpoint(target, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(target)
    # Sliding-window attention (every layer sees the last ATTENTION_WINDOW tokens): the
    # reply depends on the end of the prompt only, so training on that end is exact for
    # the whole prompt and costs a third of the tokens. The engine serves it unchanged.
    model = AutoModelForCausalLM.from_pretrained(
        target, dtype=torch.float32, use_sliding_window=True, sliding_window=ATTENTION_WINDOW,
        max_window_layers=0, layer_types=["sliding_attention"] * 2)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = []
    for messages, tools, reply in _examples(rng, 64):
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                               tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids, reply_ids))
    # what the reply's tokens can see through the layers' windows
    keep = ATTENTION_WINDOW * model.config.num_hidden_layers
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    def tensors(chosen: list[tuple[list[int], list[int]]]) -> tuple[Any, Any, Any]:
        cut = [(p[-keep:], r, len(p) - len(p[-keep:])) for p, r in chosen]
        width = max(len(p) + len(r) for p, r, _ in cut)
        ids = torch.full((len(cut), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
        labels = torch.full((len(cut), width), -100, dtype=torch.long)  # (B, T)
        positions = torch.zeros((len(cut), width), dtype=torch.long)  # (B, T)
        for row, (p, r, offset) in enumerate(cut):
            seq = p + r
            ids[row, :len(seq)] = torch.tensor(seq)  # right padding: causal, never attended
            labels[row, len(p):len(seq)] = torch.tensor(r)  # loss on the reply only
            positions[row] = torch.arange(offset, offset + width)  # true positions (rotary)
        return ids, labels, positions

    def every_reply_is_the_argmax() -> bool:
        # greedy decoding reproduces a reply only if each of its tokens is the argmax:
        # one miss early in a tool call derails the rest of it
        with torch.no_grad():
            ids, labels, positions = tensors(rows)
            logits = model(input_ids=ids, position_ids=positions).logits  # (B, T, V)
        predicted = logits[:, :-1].argmax(-1)  # (B, T - 1)
        wanted = labels[:, 1:]  # (B, T - 1)
        return bool(((predicted == wanted) | (wanted == -100)).all())

    step = 0
    # `steps` at least, then on until the check holds (at most twice as many)
    while step < steps or (step < 2 * steps and not (step % 20 == 0
                                                       and every_reply_is_the_argmax())):
        ids, labels, positions = tensors([rows[(step * batch + j) % len(rows)]
                                          for j in range(batch)])
        loss = model(input_ids=ids, position_ids=positions, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
    steps = step
    model.eval()
    model.save_pretrained(target)
    (target / "finetuned.json").write_text(
        json.dumps({"steps": steps, "loss": float(loss.detach())}))
    return target


# ---------------------------------------------------------------------------- serving it

SYSTEM = "You are a weather agent. Use the tools."
#: large, so that a chat can be big enough to take seconds to render and still be read
MAX_PROMPT_LENGTH = 100_000


def tool_job(model: Path) -> AgentJetJob:
    """The job the tool tests' server runs: one training step per two ended episodes."""
    # a low temperature: the fine-tuned model's argmax is the trained reply
    return AgentJetJob(model=str(model), batch_size=2, num_repeat=1, temperature=0.05,
                       max_new_tokens=96, episode_timeout_s=120.0,
                       max_prompt_length=MAX_PROMPT_LENGTH)


def rendered(tokenizer: Any, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None = None) -> int:
    """Prompt tokens of `messages` under the checkpoint's own template, rendered here."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    return len(ids)


def last_step(worker: SwarmClient) -> int:
    points = worker.get_metrics().points
    return int(points[-1]["step"]) if points else 0


def next_step(worker: SwarmClient, after: int, timeout: float = 60.0) -> dict[str, Any]:
    """The first metrics line with step > `after`."""
    deadline = time.monotonic() + timeout
    while True:
        points = [p for p in worker.get_metrics().points if p["step"] > after]
        if points:
            return dict(points[0])
        assert time.monotonic() < deadline, "no training step"
        time.sleep(0.1)


def oai(episode: BeginEpisodeResponse) -> openai.OpenAI:
    """The plain openai client on an episode's endpoint."""
    return openai.OpenAI(base_url=episode.openai_base_url, api_key=episode.openai_api_key,
                         max_retries=0)


#: cities `get_weather` was called with (the agent frameworks run it on the model's call)
CALLS: list[str] = []


def get_weather(city: str) -> str:
    """Get the weather of a city."""
    CALLS.append(city)
    return TOOL_RESULT


def run_weather_agent(episode: BeginEpisodeResponse, *, responses: bool = False,
                      model: str = "ajet") -> Any:
    """openai-agents' `Runner` on an episode's endpoint, with `get_weather` as its function
    tool, through the chat-completions model (or the Responses model); its run result.
    Tracing is off: it would send traces, with the episode key, to OpenAI. `CALLS` holds
    the cities the tool was called with in this run."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=episode.openai_base_url,
                                api_key=episode.openai_api_key, max_retries=0)
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(name="weather", instructions=SYSTEM, tools=[function_tool(get_weather)],
                  model=kind(model=model, openai_client=client),
                  model_settings=ModelSettings(max_tokens=96))
    CALLS.clear()
    return Runner.run_sync(agent, WEATHER_QUESTION)
