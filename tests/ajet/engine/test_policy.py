"""ajet-tiny, the policy's sampling and scoring, and one learner update, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from ajet.copilot.job import AgentJetJob
from ajet.engine.checkpoints import save_checkpoint
from ajet.engine.config import engine_config_from_job
from ajet.engine.learner import Learner, TrainSample
from ajet.engine.policy import (
    Policy,
    load_policy,
    resolve_model_path,
    sample_tokens,
    score_responses,
)
from ajet.engine.tiny import ensure_tiny_model, tiny_model_dir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("work")


@pytest.fixture
def policy(workdir: Path) -> Policy:
    return load_policy(ensure_tiny_model(workdir, seed=0), device="cpu", dtype="float32", seed=0)


def test_tiny_is_small_deterministic_and_built_atomically(workdir: Path, tmp_path: Path) -> None:
    path = ensure_tiny_model(workdir, seed=0)
    assert path == tiny_model_dir(workdir, seed=0)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".partial")]
    info = json.loads((path / "ajet_tiny.json").read_text())
    assert 10_000 < info["parameters"] < 1_000_000
    again = ensure_tiny_model(tmp_path, seed=0)
    other = ensure_tiny_model(tmp_path, seed=1)
    a, b, c = (load_file(p / "model.safetensors") for p in (path, again, other))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(workdir, seed=0) == path  # built once, then reused
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_tokenizer_is_character_level_with_a_chat_template(workdir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model(workdir, seed=0))
    text = "Hi 12,\nthere!\t~"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "2+2?"}],
                                       add_generation_prompt=True, tokenize=False)
    assert rendered == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_resolve_model_path_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint directory"):
        resolve_model_path(str(tmp_path / "missing"), workdir=tmp_path, seed=0)


def test_sampled_logprobs_match_training_scores(policy: Policy) -> None:
    prompts = [policy.render_chat([{"role": "user", "content": "x" * n}]) for n in (1, 9, 4)]
    seqs = [list(p) for p in prompts]
    recorded: list[list[float]] = [[] for _ in seqs]
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):  # rows of different lengths, left-padded together
        tokens, logps = sample_tokens(policy, seqs, temperature=0.7, top_p=1.0, generator=gen)
        for row, (t, lp) in enumerate(zip(tokens, logps, strict=True)):
            seqs[row].append(t)
            recorded[row].append(lp)
    responses = [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]
    with torch.no_grad():
        scored, mask, entropy = score_responses(policy.model, prompts, responses,
                                                pad_id=policy.pad_id, temperature=0.7,
                                                device=policy.device)
    assert torch.allclose(scored, torch.tensor(recorded), atol=1e-4)
    assert mask.sum() == 18 and entropy is not None and float(entropy.min()) > 0


def test_chunked_scores_match_whole_logits_and_micro_batches_keep_the_budget(
        policy: Policy) -> None:
    from ajet.engine.learner import micro_batches, mini_batches
    from ajet.engine.scoring import ResponseScorer, pack_responses

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    responses = [[20, 21, 22, 23, 24], [25], [26, 27, 28]]
    batch = pack_responses(prompts, responses, pad_id=policy.pad_id, device=policy.device)
    with torch.no_grad():
        whole = ResponseScorer(policy.model, chunk_tokens=10_000)(batch)
        chunked = ResponseScorer(policy.model, chunk_tokens=3)(batch)  # one position a chunk
    assert torch.allclose(whole[0], chunked[0], atol=1e-6)
    assert torch.allclose(whole[1], chunked[1], atol=1e-6)
    samples = [TrainSample(tuple(range(n)), (1,) * n, (0.0,) * n, 0.0, group=n % 3)
               for n in (1, 7, 3, 12, 2, 5)]
    micros = micro_batches(samples, token_budget=16)
    assert sorted(s.length for m in micros for s in m) == sorted(s.length for s in samples)
    assert all(len(m) * max(s.length for s in m) <= 16 or len(m) == 1 for m in micros)
    # lengths 24 (over budget), 14, 10, 6, 4, 2: longest first, rows x widest <= 16
    assert [len(m) for m in micros] == [1, 1, 1, 2, 1]
    parts = mini_batches(samples, 2)
    assert len(parts) == 2 and {s.group for s in parts[0]}.isdisjoint(s.group for s in parts[1])


def test_top_p_keeps_only_the_nucleus(policy: Policy) -> None:
    seq = [policy.render_chat([{"role": "user", "content": "a"}])]
    gen = torch.Generator().manual_seed(1)
    picks = {sample_tokens(policy, seq, temperature=0.05, top_p=0.01, generator=gen)[0][0]
             for _ in range(20)}
    assert len(picks) == 1


def test_an_update_raises_the_logprob_of_a_good_reply(policy: Policy, tmp_path: Path) -> None:
    cfg = engine_config_from_job(AgentJetJob(lr=0.01, ppo_epochs=2), cuda_devices=0,
                                 cpu_count=1)
    learner = Learner(policy, cfg)
    prompt = tuple(policy.render_chat([{"role": "user", "content": "digits?"}]))
    good = tuple(policy.tokenizer("12345", add_special_tokens=False)["input_ids"])
    bad = tuple(policy.tokenizer("abcde", add_special_tokens=False)["input_ids"])

    def score(resp: tuple[int, ...]) -> list[float]:
        with torch.no_grad():
            lp, _, _ = score_responses(policy.model, [list(prompt)], [list(resp)],
                                       pad_id=policy.pad_id, temperature=1.0,
                                       device=policy.device)
        return lp[0].tolist()

    before_good, before_bad = sum(score(good)), sum(score(bad))
    stats = learner.update([TrainSample(prompt, good, tuple(score(good)), 1.0),
                            TrainSample(prompt, bad, tuple(score(bad)), -1.0)])
    assert stats.tokens == 10 and stats.samples == 2 and stats.entropy > 0
    assert sum(score(good)) > before_good and sum(score(bad)) < before_bad
    saved = save_checkpoint(learner, tmp_path / "final", step=1, run_id="r")
    reloaded = load_policy(saved, device="cpu", dtype="float32", seed=0)
    with torch.no_grad():
        lp, _, _ = score_responses(reloaded.model, [list(prompt)], [list(good)],
                                   pad_id=policy.pad_id, temperature=1.0, device=policy.device)
    assert lp[0].tolist() == pytest.approx(score(good), abs=1e-5)


def test_a_merged_sample_trains_only_its_masked_tokens(workdir: Path) -> None:
    """Tokens the loss mask leaves out (a tool result between two replies) get no loss and
    are not counted by the token-level normalisation."""
    from ajet.engine.scoring import pack_responses

    cfg = engine_config_from_job(AgentJetJob(lr=0.01), cuda_devices=0, cpu_count=1)
    prompt = tuple(range(3, 9))
    # reply, tool result (masked out), reply
    response, mask = (20, 21, 30, 31, 32, 22), (1, 1, 0, 0, 0, 1)
    losses = []
    for tool_logprob in (0.0, -50.0):  # what sits at masked positions must not matter
        policy = load_policy(ensure_tiny_model(workdir), device="cpu", dtype="float32", seed=0)
        learner = Learner(policy, cfg)
        old = (-1.0, -1.0, tool_logprob, tool_logprob, tool_logprob, -1.0)
        stats = learner.update([TrainSample(prompt, response, old, 1.0, loss_mask=mask)])
        assert stats.tokens == 3 and stats.samples == 1
        losses.append(stats.loss)
        with torch.no_grad():
            batch = pack_responses([prompt], [response], pad_id=policy.pad_id,
                                   device=policy.device, masks=[mask])
        assert batch.mask[0].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert losses[0] == pytest.approx(losses[1])
