"""The paged backend on ajet-tiny, against the reference and the trainer.

Greedy replies are token-exact against `RecomputeGenerator` (which recomputes every
prefix, with no cache to get wrong) in the cases a paged cache can get wrong: prompt
lengths around page boundaries, requests joining and cancelled mid-run, prompts longer
than a prefill chunk, groups sharing a prompt, EOS, stop strings, max_new_tokens, the
model's context, and sliding-window layers. Sampled replies carry the trainer's log-probs
to 1e-5 (fp32). The decode step's CUDA-graph layout (padding rows) is run eagerly here:
padding touches only the trash page, and the step a graph captures runs on the meta
device, where a read back to the host would fail. Weights changed in place change the
next replies, a pool released for an update comes back whole, and PEFT adapters run
unmerged.

The contract tests shared with transformers' backend are in test_generation.py.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ajet.engine.generation.interface import (
    GenerationCancelled,
    GenerationRequest,
    GenerationResult,
    PolicyView,
)
from ajet.engine.generation.paged import PagedGenerator, PagedSettings
from ajet.engine.generation.paged_runner import DecodeRow, DecodeSlab, PagedRunner, Sampling
from ajet.engine.generation.recompute import RecomputeGenerator
from ajet.engine.policy import Policy, load_policy, score_responses
from ajet.engine.tiny import ensure_tiny_model

PAGE = 16
#: prompt tokens per prefill chunk: small, so long prompts take several chunks
CHUNK = 40


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    path = ensure_tiny_model(tmp_path_factory.mktemp("work"), seed=0)
    return load_policy(path, device="cpu", dtype="float32", seed=0)


def paged(policy: Policy, *, temperature: float = 1.0, top_p: float = 1.0,
          max_request_tokens: int = 512, concurrency: int = 16, **settings: Any
          ) -> PagedGenerator:
    """The paged backend on `policy`; `settings` replace `PagedSettings` fields."""
    return PagedGenerator(
        PolicyView.of(policy, temperature=temperature, top_p=top_p, seed=0),
        dataclasses.replace(PagedSettings(
            max_request_tokens=max_request_tokens, concurrency=concurrency,
            gpu_memory_utilization=0.9, cpu_kv_cache_mb=8, cpu_prefill_tokens=CHUNK,
            page_size=PAGE), **settings))


@pytest.fixture(scope="module")
def generator(policy: Policy) -> Iterator[PagedGenerator]:
    gen = paged(policy)
    gen.start()
    yield gen
    gen.stop()


class Replies:
    """Submits requests and collects their outcomes."""

    def __init__(self, generator: object) -> None:
        self.generator = generator
        self.outcomes: dict[int, GenerationResult | BaseException] = {}
        self.done: dict[int, threading.Event] = {}
        self.handles: dict[int, object] = {}

    def ask(self, key: int, prompt: list[int], n: int, **fields: object) -> None:
        self.done[key] = threading.Event()

        def on_done(outcome: GenerationResult | BaseException) -> None:
            self.outcomes[key] = outcome
            self.done[key].set()

        request = GenerationRequest(prompt_ids=prompt, max_new_tokens=n, on_done=on_done,
                                    **fields)  # type: ignore[arg-type]
        self.handles[key] = self.generator.submit(request)  # type: ignore[attr-defined]

    def result(self, key: int) -> GenerationResult:
        assert self.done[key].wait(60), f"no reply for {key}"
        outcome = self.outcomes[key]
        assert isinstance(outcome, GenerationResult), outcome
        return outcome


def reference(policy: Policy, prompts: dict[int, list[int]], n: int,
              **fields: object) -> dict[int, GenerationResult]:
    """Greedy replies of the recompute generator (the paged generator must be paused:
    one generator runs the model at a time)."""
    ref = RecomputeGenerator(policy, temperature=1.0, top_p=1.0, max_batch=16, seed=0)
    ref.start()
    try:
        replies = Replies(ref)
        for key, prompt in prompts.items():
            replies.ask(key, prompt, n, temperature=0.0, **fields)
        return {key: replies.result(key) for key in prompts}
    finally:
        ref.stop()


def prompt(policy: Policy, chars: int, *, fill: str = "x") -> list[int]:
    """A chat prompt; ajet-tiny's tokenizer gives one token per character."""
    return policy.render_chat([{"role": "user", "content": (fill * chars)[:chars]}])


def trainer_logprobs(policy: Policy, model: torch.nn.Module, results: list[GenerationResult],
                     *, temperature: float = 1.0) -> list[float]:
    """What the trainer computes for the replies' tokens with `model`, reply by reply."""
    with torch.no_grad():
        lp, _, _ = score_responses(model, [r.prompt_ids for r in results],
                                   [r.response_ids for r in results], pad_id=policy.pad_id,
                                   temperature=temperature, device=policy.device)
    return [x for row, r in enumerate(results) for x in lp[row, :len(r.response_ids)].tolist()]


def exact_then_sampled(policy: Policy, model: torch.nn.Module, lengths: list[int], *,
                       fill: str, new_tokens: int) -> list[GenerationResult]:
    """`model` behind the paged backend: greedy replies to prompts of `lengths` are
    token-exact against the reference on it; returns one sampled reply per prompt."""
    variant = dataclasses.replace(policy, model=model)
    prompts = {i: prompt(variant, n, fill=f"{i}{fill}") for i, n in enumerate(lengths)}
    gen = paged(variant)
    gen.start()
    try:
        replies = Replies(gen)
        for key, ids in prompts.items():
            replies.ask(key, ids, new_tokens, temperature=0.0)
            replies.ask(10 + key, ids, new_tokens)  # sampled
        got = {key: replies.result(key).response_ids for key in prompts}
        sampled = [replies.result(10 + key) for key in prompts]
    finally:
        gen.stop()
    want = reference(variant, prompts, new_tokens)
    assert got == {key: w.response_ids for key, w in want.items()}
    return sampled


def test_greedy_replies_are_token_exact_around_page_boundaries_and_chunks(
        policy: Policy, generator: PagedGenerator) -> None:
    base = len(prompt(policy, 0))
    # prompt lengths of k pages and one token either side, and prompts over several
    # prefill chunks, with distinct contents so nothing is shared but the template
    lengths = [PAGE * k + d - base for k in (1, 2, 3) for d in (-1, 0, 1)] + [3 * CHUNK, 150]
    prompts = {i: prompt(policy, n, fill=chr(97 + i % 26) + "q") for i, n in
               enumerate(lengths)}
    replies = Replies(generator)
    for key, ids in prompts.items():
        replies.ask(key, ids, 2 * PAGE + 3, temperature=0.0)
    got = {key: replies.result(key) for key in prompts}
    with generator.paused():
        want = reference(policy, prompts, 2 * PAGE + 3)
    for key in prompts:
        assert got[key].response_ids == want[key].response_ids, key
        assert got[key].text == want[key].text
        assert got[key].finish_reason == want[key].finish_reason
    stats = generator.stats()
    assert stats["backend"] == "paged" and stats["prefill_tokens"] > 0


def test_joins_and_cancels_mid_run_leave_the_others_exact(
        policy: Policy, generator: PagedGenerator) -> None:
    prompts = {i: prompt(policy, 10 + 7 * i, fill=f"{i}z") for i in range(6)}
    replies = Replies(generator)
    for key in (0, 1, 2):
        replies.ask(key, prompts[key], 60, temperature=0.0)
    deadline = time.monotonic() + 10
    while generator.stats()["tokens"] < 20:  # they are decoding
        assert time.monotonic() < deadline
        time.sleep(0.002)
    replies.ask(3, prompts[3], 60, temperature=0.0)  # joins a running batch
    replies.handles[1].cancel()  # type: ignore[attr-defined]
    replies.ask(4, prompts[4], 60, temperature=0.0)
    replies.ask(5, prompts[5], 60, temperature=0.0)
    replies.handles[5].cancel()  # type: ignore[attr-defined]  # cancelled before it ran
    assert replies.done[1].wait(10) and isinstance(replies.outcomes[1], GenerationCancelled)
    assert replies.done[5].wait(10) and isinstance(replies.outcomes[5], GenerationCancelled)
    got = {key: replies.result(key) for key in (0, 2, 3, 4)}
    with generator.paused():
        want = reference(policy, {key: prompts[key] for key in got}, 60)
    assert {k: g.response_ids for k, g in got.items()} == {
        k: w.response_ids for k, w in want.items()}
    deadline = time.monotonic() + 10
    while generator.stats()["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert generator.stats()["free_pages"] == generator.stats()["kv_cache_tokens"] // PAGE


def test_a_group_computes_its_shared_prompt_once_and_stays_exact(
        policy: Policy, generator: PagedGenerator) -> None:
    shared = prompt(policy, 5 * PAGE, fill="the task ")
    prompts = {i: shared for i in range(4)}  # a GRPO group: one prompt, four episodes
    prompts |= {4 + i: shared[:3 * PAGE] + prompt(policy, 9 + i, fill="y")
                for i in range(2)}  # the same first pages, then their own
    before = generator.stats()
    replies = Replies(generator)
    for key, ids in prompts.items():
        replies.ask(key, ids, 12, temperature=0.0)
    got = {key: replies.result(key) for key in prompts}
    after = generator.stats()
    # each of the group's later three found at least the prompt's whole pages but one
    reused = after["prefix_tokens"] - before["prefix_tokens"]
    assert reused >= 3 * ((len(shared) - 1) // PAGE) * PAGE + 2 * 3 * PAGE
    computed = after["prefill_tokens"] - before["prefill_tokens"]
    assert computed < sum(len(ids) for ids in prompts.values()) - reused + 1
    with generator.paused():
        want = reference(policy, prompts, 12)
    for key in prompts:
        assert got[key].response_ids == want[key].response_ids, key


def test_eos_stop_strings_max_new_tokens_and_the_context_end_a_reply_as_the_reference(
        policy: Policy) -> None:
    probe = prompt(policy, 20, fill="stop ")
    gen = paged(policy)
    gen.start()
    try:
        replies = Replies(gen)
        replies.ask(0, probe, 30, temperature=0.0)
        free = replies.result(0)
    finally:
        gen.stop()
    assert len(free.response_ids) == 30 and free.finish_reason == "length"
    # an EOS id the greedy reply reaches, a stop string it produces, a short context
    eos = free.response_ids[9]
    short = dataclasses.replace(policy, max_positions=len(probe) + 14)
    stop = free.text[12:14]
    ended = {}
    for name, variant, fields in (
            ("eos", dataclasses.replace(policy, eos_ids=frozenset({eos})), {}),
            ("stop string", policy, {"stop": (stop,)}), ("context", short, {})):
        gen = paged(variant)
        gen.start()
        try:
            replies = Replies(gen)
            replies.ask(0, probe, 30, temperature=0.0, **fields)
            replies.ask(1, probe, 30, temperature=0.0, on_delta=lambda _t: None, **fields)
            got = [replies.result(0), replies.result(1)]
        finally:
            gen.stop()
        want = reference(variant, {0: probe}, 30, **fields)[0]
        for result in got:
            assert result.response_ids == want.response_ids, name
            assert result.text == want.text and result.finish_reason == want.finish_reason
        ended[name] = (want.finish_reason, len(want.response_ids))
    assert ended["eos"] == ("stop", free.response_ids.index(eos) + 1)
    assert ended["stop string"][0] == "stop" and ended["stop string"][1] < 30
    assert ended["context"] == ("length", 14)


def test_sampled_log_probs_are_the_trainers_and_a_request_draws_the_same_in_any_batch(
        policy: Policy) -> None:
    gen = paged(policy, temperature=0.7)
    gen.start()
    try:
        prompts = {i: prompt(policy, 5 + 9 * i, fill="lp") for i in range(5)}
        replies = Replies(gen)
        for key, ids in prompts.items():
            replies.ask(key, ids, 20)
        sampled = {key: replies.result(key) for key in prompts}
        with gen.paused():
            scored = trainer_logprobs(policy, policy.model, list(sampled.values()),
                                      temperature=0.7)
        assert [x for r in sampled.values() for x in r.logprobs] == pytest.approx(scored,
                                                                                 abs=1e-5)
    finally:
        gen.stop()
    # counter-based noise: the same admission order gives the same draws whether a
    # request runs alone or in a batch (a new generator numbers requests from one again)
    alone = paged(policy, temperature=0.7)
    alone.start()
    try:
        replies = Replies(alone)
        replies.ask(0, prompts[0], 20)
        assert replies.result(0).response_ids == sampled[0].response_ids
    finally:
        alone.stop()


def test_padding_rows_of_a_graph_bucket_touch_only_the_trash_page(
        policy: Policy, generator: PagedGenerator) -> None:
    """The decode step as a CUDA graph replays it: a slab of 8 rows holding 2 real ones."""
    runner = generator._runner
    assert runner is not None and runner.pool is not None
    with generator.paused():
        pool = runner.pool
        pool.k.normal_()
        pool.v.normal_()
        before_k, before_v = pool.k.clone(), pool.v.clone()
        settings = Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=1)
        rows = [DecodeRow(token=5, position=20, pages=[3, 7], table=runner.table_row([3, 7]),
                          sampling=settings, counter=0),
                DecodeRow(token=6, position=3, pages=[9], table=runner.table_row([9]),
                          sampling=settings, counter=0)]
        slab = DecodeSlab(8, 4)
        host = slab.pack(rows, page_size=pool.page_size, trash_row=runner.table_row([]))
        out = runner.decode_step(host, slab, truncate=False)
        assert out.shape == (2, 8)
        changed = (pool.k != before_k).any(-1).any(-1) | (pool.v != before_v).any(-1).any(-1)
        written = {(page, slot) for _, page, slot in changed.nonzero().tolist()}
        trash = pool.trash_page
        assert written - {(p, s) for p, s in written if p == trash} == {(7, 20 % PAGE),
                                                                          (9, 3)}
        eager = runner.decode(rows)  # the same two rows without padding
        assert [t for t, _ in eager] == out[0, :2].long().tolist()


@pytest.mark.parametrize("truncate", [False, True], ids=["plain", "top_p"])
def test_the_captured_decode_step_never_syncs_with_the_host(policy: Policy,
                                                             truncate: bool) -> None:
    """A CUDA graph cannot hold a read back to the host (`.item()`, `.tolist()`, a
    data-dependent shape) or a tensor built from host data; on the meta device, which has
    no data, either fails, so the step a graph captures runs here as it would be captured
    (both graph families, a padded bucket of 8 rows)."""
    model = copy.deepcopy(policy.model).to("meta")
    settings = PagedSettings(max_request_tokens=128, concurrency=8, gpu_memory_utilization=0.9,
                             cpu_kv_cache_mb=8, cpu_prefill_tokens=CHUNK, page_size=PAGE)
    runner = PagedRunner(model, settings.plan(model), kernel="torch", cuda_graphs=False)
    slab = DecodeSlab(8, runner.max_pages)
    host = slab.pack([], page_size=PAGE, trash_row=runner.table_row([]))  # all padding
    out = runner.decode_step(host.to("meta"), slab, truncate)
    assert out.device.type == "meta" and out.shape == (2, 8)


def test_weights_changed_in_place_change_the_next_replies(
        policy: Policy, generator: PagedGenerator) -> None:
    ids = prompt(policy, 30, fill="w")
    replies = Replies(generator)
    replies.ask(0, ids, 16, temperature=0.0)
    before = replies.result(0).response_ids
    weights = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    try:
        with generator.paused(), torch.no_grad():  # what an optimizer step does
            for p in policy.model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        replies.ask(1, ids, 16, temperature=0.0)
        after = replies.result(1).response_ids
        with generator.paused():
            want = reference(policy, {1: ids}, 16)[1].response_ids
        assert after == want and after != before
    finally:
        with generator.paused(), torch.no_grad():
            for name, p in policy.model.named_parameters():
                p.copy_(weights[name])


def test_sliding_window_layers_read_only_their_window_as_the_reference(
        policy: Policy, tmp_path: Path) -> None:
    """Every layer sees the last 24 tokens (transformers' own mask in the reference)."""
    from transformers import AutoModelForCausalLM

    windowed = AutoModelForCausalLM.from_pretrained(
        policy.path, dtype=torch.float32, use_sliding_window=True, sliding_window=24,
        max_window_layers=0, layer_types=["sliding_attention"] * 2).eval()
    sampled = exact_then_sampled(policy, windowed, [30, 47, 64], fill="window ",
                                 new_tokens=20)
    drawn = [x for r in sampled for x in r.logprobs]
    assert drawn == pytest.approx(trainer_logprobs(policy, windowed, sampled), abs=1e-5)
    # the window matters for these prompts: the full-attention model scores them apart
    base = trainer_logprobs(policy, policy.model, sampled)
    assert max(abs(a - b) for a, b in zip(drawn, base, strict=True)) > 1e-3


def test_a_pool_released_for_an_update_comes_back_and_serves_the_same(policy: Policy) -> None:
    """`keep_pool=False` (the memory plan says the pool does not fit beside the update):
    pause frees the pool, resume allocates it again, replies stay exact."""
    gen = paged(policy, max_request_tokens=256, concurrency=4, cpu_kv_cache_mb=2,
                page_size=None, keep_pool=False)
    ids = {0: prompt(policy, 40, fill="pool ")}
    gen.start()
    try:
        replies = Replies(gen)
        replies.ask(0, ids[0], 16, temperature=0.0)
        first = replies.result(0).response_ids
        held = gen.stats()["pool_bytes"]
        with gen.paused():
            assert held > 0 and gen.stats()["pool_bytes"] == 0
        replies.ask(1, ids[0], 16, temperature=0.0)
        assert replies.result(1).response_ids == first
        assert gen.stats()["pool_bytes"] == held
    finally:
        gen.stop()
    assert first == reference(policy, ids, 16)[0].response_ids


def test_a_peft_adapter_runs_unmerged_inside_the_step_as_the_reference(
        policy: Policy) -> None:
    """LoRA as the engine trains it: adapters on the projections, not merged."""
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(copy.deepcopy(policy.model), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])).eval()
    with torch.no_grad():  # peft starts B at zero: give the adapters an effect
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    sampled = exact_then_sampled(policy, adapted, [20, 31, 42], fill="lora ", new_tokens=16)
    drawn = [x for r in sampled for x in r.logprobs]
    assert drawn == pytest.approx(trainer_logprobs(policy, adapted, sampled), abs=1e-5)
    base = trainer_logprobs(policy, policy.model, sampled)
    # the adapters change what the model says
    assert max(abs(a - b) for a, b in zip(drawn, base, strict=True)) > 1e-2
