"""The KV-cached generators on ajet-tiny: log-probs, streaming, stop, cancel, fresh weights.

The `Generator` contract, for each KV-cached backend: transformers' continuous-batching
engine (`ContinuousBatchingGenerator`) and the paged backend (`PagedGenerator`). Real
parts: the tiny checkpoint built locally, the engine's own learner for the update. One
generator per backend is shared by the module's tests (building the KV cache takes
milliseconds, but loading the model does not).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import engine_config_from_job
from ajet.engine.generation.continuous_batching import CacheSettings, ContinuousBatchingGenerator
from ajet.engine.generation.interface import (
    GenerationCancelled,
    GenerationInterrupted,
    GenerationRefused,
    GenerationRequest,
    GenerationResult,
    Generator,
    PolicyView,
    ReplyText,
)
from ajet.engine.generation.paged import PagedGenerator, PagedSettings
from ajet.engine.learner import Learner, TrainSample
from ajet.engine.policy import Policy, load_policy, score_responses
from ajet.engine.tiny import ensure_tiny_model

TEMPERATURE = 0.7


@dataclass
class Reply:
    """Collects one request's callbacks."""

    deltas: list[str] = field(default_factory=list)
    outcome: GenerationResult | BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def on_done(self, outcome: GenerationResult | BaseException) -> None:
        assert self.outcome is None, "on_done called twice"
        self.outcome = outcome
        self.done.set()

    def result(self, timeout: float = 60.0) -> GenerationResult:
        assert self.done.wait(timeout), "no reply"
        assert isinstance(self.outcome, GenerationResult), self.outcome
        return self.outcome


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    path = ensure_tiny_model(tmp_path_factory.mktemp("work"), seed=0)
    return load_policy(path, device="cpu", dtype="float32", seed=0)


BACKENDS = ("continuous_batching", "paged")


def make_generator(backend: str, policy: Policy, *, temperature: float,
                   max_request_tokens: int, concurrency: int, cache_mb: float,
                   batch_tokens: int) -> Generator:
    """A generator of `backend` on the policy's model, its cache sized by the arguments."""
    view = PolicyView.of(policy, temperature=temperature, top_p=1.0, seed=0)
    if backend == "paged":
        return PagedGenerator(view, PagedSettings(
            max_request_tokens=max_request_tokens, concurrency=concurrency,
            gpu_memory_utilization=0.9, cpu_kv_cache_mb=cache_mb,
            cpu_prefill_tokens=batch_tokens))
    return ContinuousBatchingGenerator(view, CacheSettings(
        max_request_tokens=max_request_tokens, concurrency=concurrency,
        gpu_memory_utilization=0.9, cpu_kv_cache_mb=cache_mb,
        cpu_max_batch_tokens=batch_tokens))


@pytest.fixture(scope="module", params=BACKENDS)
def generator(request: pytest.FixtureRequest, policy: Policy) -> Iterator[Generator]:
    gc.freeze()  # as the engine does: cache rebuilds stay cheap
    gen = make_generator(request.param, policy, temperature=TEMPERATURE,
                         max_request_tokens=512, concurrency=16, cache_mb=32,
                         batch_tokens=256)
    gen.start()
    yield gen
    gen.stop()


def ask(gen: Generator, prompt: list[int], *, stream: bool = False,
        **fields: object) -> tuple[Reply, object]:
    reply = Reply()
    request = GenerationRequest(prompt_ids=prompt, max_new_tokens=int(fields.pop("n", 12)),
                                on_done=reply.on_done,
                                on_delta=reply.deltas.append if stream else None,
                                **fields)  # type: ignore[arg-type]
    return reply, gen.submit(request)


def prompt_of(policy: Policy, text: str) -> list[int]:
    return policy.render_chat([{"role": "user", "content": text}])


def scored(policy: Policy, generator: Generator, result: GenerationResult,
           temperature: float = TEMPERATURE) -> list[float]:
    """The training side's log-probs of `result`. The generator is paused meanwhile: the
    model must never run in two threads at once (transformers < 5.24 even switches its
    attention to the paged kind while a generator serves)."""
    with generator.paused(), torch.no_grad():
        lp, _, _ = score_responses(policy.model, [result.prompt_ids], [result.response_ids],
                                   pad_id=policy.pad_id, temperature=temperature,
                                   device=policy.device)
    return lp[0, :len(result.response_ids)].tolist()


def test_concurrent_replies_carry_the_training_log_probs(
        policy: Policy, generator: Generator) -> None:
    prompts = [prompt_of(policy, "x" * n) for n in (1, 40, 7, 90, 3, 64, 12, 25)]
    asked = [ask(generator, p, n=10 + i) for i, p in enumerate(prompts)]
    results = [reply.result() for reply, _ in asked]
    for i, result in enumerate(results):
        assert result.prompt_ids == prompts[i]
        assert 1 <= len(result.response_ids) <= 10 + i
        assert len(result.logprobs) == len(result.response_ids)
        assert result.logprobs == pytest.approx(scored(policy, generator, result), abs=1e-4)
        assert result.text == policy.decode(result.response_ids)
        eos = result.response_ids[-1] in policy.eos_ids
        assert result.finish_reason == ("stop" if eos else "length")


def test_streamed_deltas_make_the_text_and_a_stop_string_ends_the_reply(
        policy: Policy, generator: Generator) -> None:
    reply, _ = ask(generator, prompt_of(policy, "stream"), stream=True, n=24)
    result = reply.result()
    assert "".join(reply.deltas) == result.text and result.text
    # the reply's own second character, as a stop string: a fresh sample differs, so
    # stop at a character the model is sure to produce soon: any of the printable ones
    stops = tuple(chr(c) for c in range(33, 127))[:4]
    reply, _ = ask(generator, prompt_of(policy, "stop"), stream=True, n=200,
                   stop=stops)
    result = reply.result()
    assert result.finish_reason == "stop"
    assert not any(s in result.text for s in stops)
    assert "".join(reply.deltas) == result.text
    assert len(result.response_ids) < 200


def test_cancel_and_refusals(policy: Policy, generator: Generator) -> None:
    reply, handle = ask(generator, prompt_of(policy, "long"), n=400)
    handle.cancel()  # type: ignore[attr-defined]
    assert reply.done.wait(10) and isinstance(reply.outcome, GenerationCancelled)
    handle.cancel()  # type: ignore[attr-defined]  # idempotent
    with pytest.raises(GenerationRefused, match="context"):
        ask(generator, [5] * policy.max_positions, n=10)
    with pytest.raises(GenerationRefused, match="empty"):
        ask(generator, [], n=10)
    backend = "paged" if isinstance(generator, PagedGenerator) else "continuous_batching"
    small = make_generator(backend, policy, temperature=1.0, max_request_tokens=64,
                           concurrency=1, cache_mb=1, batch_tokens=64)
    generator.pause()  # one generator runs the model at a time
    small.start()
    try:
        assert small.stats()["kv_cache_tokens"] == 64
        with pytest.raises(GenerationRefused, match="KV cache"):
            ask(small, [5] * 60, n=10)
    finally:
        small.stop()
        generator.resume()
    deadline = time.monotonic() + 10
    while generator.stats()["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_request_may_set_its_own_temperature(
        policy: Policy, generator: Generator) -> None:
    prompt = prompt_of(policy, "greedy")
    greedy = [ask(generator, prompt, n=8, temperature=0.0)[0] for _ in range(2)]
    a, b = (r.result() for r in greedy)
    assert a.response_ids == b.response_ids  # temperature 0: the most likely token
    with generator.paused(), torch.no_grad():
        logits = policy.model(torch.tensor([prompt])).logits[0, -1]
    assert a.response_ids[0] == int(logits.argmax())
    hot, _ = ask(generator, prompt, n=8, temperature=1.5)
    result = hot.result()
    assert result.logprobs == pytest.approx(scored(policy, generator, result, 1.5), abs=1e-4)


def test_requests_wait_while_paused_and_start_after_resume(
        policy: Policy, generator: Generator) -> None:
    generator.pause()
    try:
        reply, _ = ask(generator, prompt_of(policy, "later"), n=4)
        assert not reply.done.wait(0.3)
    finally:
        generator.resume()
    assert reply.result().response_ids
    # caught in flight by a pause: restarts from its prompt when nothing was streamed,
    # interrupted when text was already streamed
    quiet, _ = ask(generator, prompt_of(policy, "q"), n=300)
    loud, _ = ask(generator, prompt_of(policy, "l"), n=300, stream=True)
    deadline = time.monotonic() + 10
    while not loud.deltas:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with generator.paused():
        pass
    assert isinstance(loud.outcome, GenerationInterrupted) or loud.done.wait(10)
    if not isinstance(loud.outcome, GenerationResult):
        assert isinstance(loud.outcome, GenerationInterrupted)
    assert quiet.result().response_ids


def test_after_an_update_no_kv_from_the_old_weights_is_reused(
        policy: Policy, generator: Generator) -> None:
    """GRPO groups repeat prompts: the repeat after an update is scored by the new weights."""
    # longer than a few 32-token pages, so prefix sharing has whole blocks to reuse
    prompt = prompt_of(policy, "the same task prompt, repeated by every episode " * 3)
    first = ask(generator, prompt, n=6)[0].result()
    again = ask(generator, prompt, n=6)[0].result()  # shares the cached prompt blocks
    assert again.logprobs == pytest.approx(scored(policy, generator, again), abs=1e-4)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    cfg = engine_config_from_job(AgentJetJob(lr=0.05, ppo_epochs=3), cuda_devices=0,
                                 cpu_count=1)
    learner = Learner(policy, cfg)
    sample = TrainSample(tuple(first.prompt_ids), tuple(first.response_ids),
                         tuple(first.logprobs), 1.0)
    try:
        with generator.paused():  # what the trainer does around every update
            learner.update([sample])
        after = ask(generator, prompt, n=6)[0].result()
        new_scores = scored(policy, generator, after)
        assert after.logprobs == pytest.approx(new_scores, abs=1e-4)
        # the test would catch stale KV: the old weights score this reply differently
        updated = {k: v.clone() for k, v in policy.model.state_dict().items()}
        with generator.paused():
            policy.model.load_state_dict(before)
        old_scores = scored(policy, generator, after)
        with generator.paused():
            policy.model.load_state_dict(updated)
        assert max(abs(a - b) for a, b in zip(new_scores, old_scores, strict=True)) > 1e-2
    finally:
        with generator.paused():
            policy.model.load_state_dict(before)


def test_reply_text_holds_back_what_may_become_a_stop_string() -> None:
    decode = "".join  # one character per token
    reply = ReplyText(lambda ids: decode(chr(i) for i in ids), stop=("END",))
    ids = [ord(c) for c in "abcEN"]
    assert reply.update(ids[:3]) == "a"  # "bc" might start "END"
    assert reply.update(ids) == "bc"
    assert not reply.stopped
    assert reply.update([*ids, ord("D"), ord("x")]) == "" and reply.stopped
    assert reply.text == "abc"
    bytes_reply = ReplyText(lambda ids: bytes(ids).decode("utf-8", "replace"), stop=())
    euro = list("€".encode())  # three tokens, one character
    assert bytes_reply.update(euro[:1]) == "" and bytes_reply.update(euro[:2]) == ""
    assert bytes_reply.update(euro) == "€"
    assert bytes_reply.update([*euro, *b"ok"], done=True) == "ok"
