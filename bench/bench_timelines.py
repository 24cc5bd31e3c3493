"""Timelines: a 6-turn tool episode trained as merged samples against one sample per call.

    python -m bench --only timelines

A scripted workflow (no generation: the replies are fixed texts, recorded the way the
episode plane records them) calls a tool five times and then answers; every call
re-sends the growing history, rendered by the checkpoint's chat template, and each
tool call comes back re-rendered (`{"city":"X"}` sampled, `{"city": "X"}` re-sent).
The same episodes are turned into samples twice, with `timeline_merging` on (one sample
an episode) and off (one sample a call), and each set is put through the learner's
update (`Learner.update`: forward, backward, optimizer step) on ajet-tiny and on a
~50M-parameter Qwen2-shaped model with ajet-tiny's tokenizer. Rows: tokens through the
trainer's forward per episode, and the update's time per step, merged against per call.
Budget: >= 3x fewer tokens and >= 2x faster steps at 6 turns.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bench.context import BenchContext
from bench.report import Row

__all__ = ["run"]

RERUN = "python -m bench --only timelines"
TURNS = 6
CITIES = ["Paris", "Lyon", "Nice", "Lille", "Brest"]
SYSTEM = "You are a weather agent. Call get_weather for each city, then answer briefly."
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
#: the ~50M-parameter Qwen2 shape (quick: a tiny one, for the smoke test)
SHAPES = {
    False: dict(vocab_size=32_000, hidden_size=640, intermediate_size=1728,
                num_hidden_layers=8, num_attention_heads=10, num_key_value_heads=2),
    True: dict(vocab_size=2_000, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}


def episode(fmt: Any, tokenizer: Any, *, seed: int) -> list[Any]:
    """The six completions of one scripted episode, as the plane records them."""
    from ajet.engine.trajectory import Completion, reply_message

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Weather in {', '.join(CITIES)}? (trip {seed})"}]
    out = []
    for turn in range(TURNS):
        prompt = fmt.render(history, tools=[TOOL])
        if turn < TURNS - 1:
            city = CITIES[turn]
            text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"'
                    f'{city}"}}}}\n</tool_call>')
            reply = reply_message(None, [("get_weather", json.dumps({"city": city}))])
        else:
            text = "Sunny in Paris and Nice, rain in Lyon, Lille and Brest."
            reply = reply_message(text)
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], end]
        out.append(Completion(tuple(prompt.ids), tuple(ids), tuple(-0.5 for _ in ids), "stop",
                              0, agent="bench", messages=prompt.messages,
                              assistant_spans=prompt.assistant_spans, reply=reply))
        if turn < TURNS - 1:
            call_id = f"call_{turn}"
            history += [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps({"city": CITIES[turn]})}}]},
                {"role": "tool", "tool_call_id": call_id,
                 "content": f"{CITIES[turn]}: {'sunny' if turn % 2 == 0 else 'rain'}, "
                            f"{18 + turn} C, wind {3 + turn} km/h"}]
    return out


def samples(episodes: list[list[Any]], *, merging: bool) -> list[Any]:
    """TrainSamples of the episodes (advantages +1/-1 in one group), as the trainer makes."""
    from ajet.engine.learner import TrainSample
    from ajet.engine.trajectory import build_samples

    out = []
    for index, completions in enumerate(episodes):
        for s in build_samples(completions, merging=merging).samples:
            first = s.loss_mask.index(1)
            out.append(TrainSample(s.token_ids[:first], s.token_ids[first:],
                                   s.logprobs[first:], 1.0 if index % 2 == 0 else -1.0,
                                   loss_mask=s.loss_mask[first:]))
    return out


def _models(ctx: BenchContext) -> list[tuple[str, Path]]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ajet.engine.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(ctx.path("tiny"), seed=0)
    big = ctx.path("qwen2-50m")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**SHAPES[ctx.quick], max_position_embeddings=4096,
                                 tie_word_embeddings=True, pad_token_id=0, eos_token_id=2)
                     ).save_pretrained(big)
    for name in os.listdir(tiny):  # ajet-tiny's tokenizer and chat template
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(tiny / name, big / name)
    return [("ajet-tiny", tiny), ("qwen2-50m", big)]


def _measure(path: Path, episodes_per_step: int, reps: int, *, warm_up: bool
             ) -> dict[str, Any]:
    from ajet.copilot.job import AgentJetJob
    from ajet.engine.config import engine_config_from_job
    from ajet.engine.learner import Learner
    from ajet.engine.plane.chat_format import ChatFormat
    from ajet.engine.policy import load_policy

    policy = load_policy(path, device="cpu", dtype="float32", seed=0)
    cfg = engine_config_from_job(AgentJetJob(model=str(path), lr=1e-6),
                                 cuda_devices=0, cpu_count=os.cpu_count() or 1)
    fmt = ChatFormat(policy.tokenizer)
    episodes = [episode(fmt, policy.tokenizer, seed=i) for i in range(episodes_per_step)]
    figures: dict[str, Any] = {"parameters": sum(p.numel() for p in policy.model.parameters())}
    for merging in (False, True):
        batch = samples(episodes, merging=merging)
        learner = Learner(policy, cfg)
        if warm_up:
            learner.update(batch)  # allocator, optimizer state
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            learner.update(batch)
            times.append(time.perf_counter() - start)
        key = "merged" if merging else "per_call"
        figures[key] = {"samples": len(batch) / len(episodes),
                        "tokens": sum(s.length for s in batch) / len(episodes),
                        "trained": sum(s.trained_tokens for s in batch) / len(episodes),
                        "step_s": statistics.median(times), "times": times}
    return figures


def run(ctx: BenchContext) -> list[Row]:
    import torch

    threads = torch.get_num_threads()
    rows: list[Row] = []
    try:
        for name, path in _models(ctx):
            big = name != "ajet-tiny"
            # the 50M model's per-call step takes minutes on 2 cores: one episode, one rep
            reps = 1 if ctx.quick or big else ctx.reps
            figures = _measure(path, 1 if big or ctx.quick else 4, reps,
                               warm_up=not (big or ctx.quick))
            merged, per_call = figures["merged"], figures["per_call"]
            assert merged["trained"] == per_call["trained"], "merging changed what is trained"
            note = (f"{figures['parameters'] / 1e6:.1f}M parameters, {TURNS} turns, "
                    f"{per_call['samples']:.0f} samples -> {merged['samples']:.0f} an episode, "
                    f"{merged['trained']:.0f} trained tokens either way")
            token_ratio = per_call["tokens"] / merged["tokens"]
            speedup = per_call["step_s"] / merged["step_s"]
            rows.append(Row(
                name=f"timelines {name}: tokens through the forward per episode, merged",
                median=merged["tokens"], unit="tokens", reference_name="one sample per call",
                reference=per_call["tokens"], target=">= 3x fewer at 6 turns", rerun=RERUN,
                repetitions=1, note=f"{token_ratio:.2f}x fewer; {note}",
                met=token_ratio >= 3.0))
            rows.append(Row(
                name=f"timelines {name}: update step, merged",
                median=merged["step_s"], unit="s", reference_name="one sample per call",
                reference=per_call["step_s"], target=">= 2x faster at 6 turns", rerun=RERUN,
                repetitions=reps, note=f"{speedup:.2f}x faster; {note}", met=speedup >= 2.0))
    finally:
        torch.set_num_threads(threads)
    return rows


if __name__ == "__main__":  # pragma: no cover - a manual run of this module alone
    with BenchContext(reps=3) as context:
        for row in run(context):
            print(row.name, row.median, row.reference, row.note)  # noqa: T201
