"""The memory planner: each term against what the engine really allocates, on CPU; the
headline refusal; the memory available (nvidia-smi, gpu_memory_gb, the host)."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import engine_config_from_job
from ajet.engine.learner import Learner, TrainSample
from ajet.engine.parallel.lora import apply_lora
from ajet.engine.parallel.training_model import enable_activation_checkpointing
from ajet.engine.planning.memory_plan import (
    GiB,
    MiB,
    Available,
    JobView,
    ModelShape,
    _activation_bytes_per_token,
    detect_available,
    model_shape,
    plan_memory,
)
from ajet.engine.policy import load_policy
from ajet.engine.scoring import ResponseScorer, pack_responses
from ajet.engine.tiny import ensure_tiny_model

QWEN_7B = Path(__file__).parent / "models" / "Qwen2.5-7B-Instruct"
#: the headline job (docs/design.md): Qwen2.5-7B-Instruct, 32 task groups x 4, 2k + 2k tokens
HEADLINE = dict(model=str(QWEN_7B), batch_size=32, num_repeat=4, max_prompt_length=2048,
                max_response_length=2048)
H100 = Available(81559 * MiB, "test: nvidia-smi of an H100 80GB")
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def _model(config: dict[str, object]) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**config, max_position_embeddings=1024))


# ---------------------------------------------------------------------------- parameters


def test_parameter_counts_match_the_models_transformers_builds() -> None:
    # the 7B shape on the meta device: no memory, the exact module tree
    import json

    config = json.loads((QWEN_7B / "config.json").read_text())
    with torch.device("meta"):
        qwen = Qwen2ForCausalLM(Qwen2Config(**config))
    assert model_shape(str(QWEN_7B)).parameters == sum(p.numel() for p in qwen.parameters())
    assert model_shape(str(QWEN_7B)).parameters == 7_615_616_512
    tiny = ModelShape.tiny()
    assert tiny.parameters == sum(p.numel() for p in _model(dict(
        vocab_size=tiny.vocab_size, hidden_size=64, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True)).parameters())


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj", "lm_head"),
                                     r".*\.mlp\..*_proj"])
def test_lora_parameters_match_peft(targets: str | tuple[str, ...]) -> None:
    model = apply_lora(_model(SMALL), rank=8, alpha=16, target_modules=targets, seed=0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = ModelShape.from_config({**SMALL, "model_type": "qwen2"})
    assert shape.lora_parameters(8, targets) == trainable


# ---------------------------------------------------------------------------- activations


def _saved_bytes(model: torch.nn.Module, tokens: tuple[int, int, int], *, autocast: bool
                 ) -> int:
    """Bytes autograd keeps for backward in one scoring pass (weights and their casts
    excluded: those are the planner's separate terms)."""
    rows, prompt, response = tokens
    scorer = ResponseScorer(model, autocast_dtype=torch.bfloat16 if autocast else None)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    batch = pack_responses([torch.randint(3, vocab, (prompt,), generator=gen).tolist()
                            for _ in range(rows)],
                           [torch.randint(3, vocab, (response,), generator=gen).tolist()
                            for _ in range(rows)], pad_id=0, device=torch.device("cpu"))
    seen: dict[int, int] = {}
    # autocast's bf16 copies of the weights have their shapes (or the transposed ones)
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    weight_shapes |= {s[::-1] for s in weight_shapes}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) not in weight_shapes:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        scorer(batch)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in weights)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activation_bytes_per_token_are_what_autograd_saves(mode: str, checkpointing: bool
                                                            ) -> None:
    model = _model(SMALL)
    if mode == "bf16":  # FSDP2's bf16 parameters
        model = model.to(torch.bfloat16)
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
    rows, prompt, response = 2, 40, 24
    measured = _saved_bytes(model, (rows, prompt, response), autocast=mode == "autocast")
    shape = ModelShape.from_config({**SMALL, "model_type": "qwen2"})
    per_token, _ = _activation_bytes_per_token(shape, mode, checkpointing=checkpointing,
                                               response_share=response / (prompt + response))
    planned = per_token * rows * (prompt + response)
    assert abs(planned - measured) <= 0.03 * measured, (planned, measured)


# ---------------------------------------------------------------------------- training state


def test_optimizer_state_and_gradients_are_what_the_learner_holds(tmp_path: Path) -> None:
    model_dir = ensure_tiny_model(tmp_path, seed=0)
    job = AgentJetJob(lr=1e-3, lora_rank=4)
    learner = Learner(load_policy(model_dir, device="cpu", dtype="float32", seed=0),
                      engine_config_from_job(job, cuda_devices=0, cpu_count=1))
    learner.update([TrainSample((5, 6, 7), (8, 9), (-1.0, -1.0), 1.0, group=0),
                    TrainSample((5, 6, 7), (9, 8), (-1.0, -1.0), -1.0, group=0)])
    moments = sum(v.numel() * v.element_size() for s in learner.optimizer.state.values()
                  for v in s.values() if v.dim() > 0)
    trainable = sum(p.numel() * p.element_size() for p in learner.model.params)
    plan = plan_memory(JobView.from_job(job), ModelShape.tiny(), H100)
    terms = {t.name: t.bytes for t in plan.terms}
    assert terms["AdamW moments (fp32)"] == moments
    assert terms["gradients (fp32)"] == trainable  # one gradient per trainable parameter
    # one CPU process trains the generation model itself: no separate master copy
    assert not any(name.startswith("trained weights") for name in terms)


def test_the_planners_job_defaults_are_the_jobs() -> None:
    import dataclasses

    from ajet.copilot.job import default_job_values

    defaults = default_job_values()
    for f in dataclasses.fields(JobView):
        if f.name in defaults:
            assert getattr(JobView(), f.name) == defaults[f.name], f.name
    assert JobView.from_job(AgentJetJob()) == JobView()


# ---------------------------------------------------------------------------- the headline


def test_the_headline_job_is_refused_on_one_gpu_naming_8_gpus_and_lora() -> None:
    shape = model_shape(str(QWEN_7B))
    one = plan_memory(JobView.from_job(AgentJetJob(**HEADLINE, n_gpu=1)), shape, H100)
    assert not one.fits
    text = one.render()
    assert "AdamW moments (fp32)" in text and "activations (16384 tokens, checkpointed)" in text
    assert "available: 79.65 GiB" in text and "short by" in text
    assert "n_gpu: 8 (FSDP2 over 8 GPUs)" in one.hint()
    assert "lora_rank: 16 (LoRA)" in one.hint()
    fixes = {tuple(sorted(f.changes.items())) for f in one.fixes}
    assert (("n_gpu", 8),) in fixes and (("lora_rank", 16),) in fixes
    # full fine-tuning alone needs ~16 bytes per parameter plus the bf16 copies
    assert one.peak_bytes > 16 * shape.parameters

    # nor could the generator's KV cache hold one request next to that state
    assert one.cache_error is not None and "gpu_memory_utilization=0.85" in one.cache_error

    eight = plan_memory(JobView.from_job(AgentJetJob(**HEADLINE, n_gpu=8)), shape, H100)
    assert eight.fits and eight.peak_bytes < 0.8 * H100.bytes and not eight.fixes
    # FSDP2 shards the training state 8 ways; every rank's bf16 inference copy stays whole
    terms = {t.name: t.bytes for t in eight.terms}
    assert terms["AdamW moments (fp32, sharded)"] == 8 * shape.parameters // 8
    assert terms["generation copy (bf16)"] == 2 * shape.parameters
    # the KV cache is the generator's own plan (kv_cache.py) for the 64 requests of a
    # rank, 4096 tokens each, in what gpu_memory_utilization leaves on the GPU
    assert eight.cache is not None and eight.cache.tokens == 64 * 4096
    assert eight.cache.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert terms[f"KV cache ({64 * 4096} tokens, pages of 256)"] >= 64 * 4096 * 57344
    assert eight.phase_bytes("generation") <= 0.85 * H100.bytes


def test_a_gpu_memory_utilization_too_small_for_the_kv_cache_is_refused() -> None:
    shape = model_shape(str(QWEN_7B))
    plan = plan_memory(JobView.from_job(AgentJetJob(**HEADLINE, n_gpu=8,
                                                    gpu_memory_utilization=0.3)), shape, H100)
    assert not plan.fits and plan.peak_bytes < H100.bytes  # the update fits; the cache not
    assert "raise gpu_memory_utilization" in plan.render()
    assert "the KV cache does not fit" in plan.render()
    assert {"gpu_memory_utilization": 0.5} in [f.changes for f in plan.fixes]


def test_the_kv_cache_terms_are_what_the_engines_generator_allocates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's cache is the generator's (same kv_cache.py plan), and its KV and
    decoding terms are transformers' own footprint of that cache."""
    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    from ajet.engine.runtime import build_generator

    footprints: list[int] = []
    measure = PagedAttentionMemoryHandler.compute_memory_footprint

    def recorded(self: PagedAttentionMemoryHandler, *args: int) -> int:
        footprints.append(measure(self, *args))
        return footprints[-1]

    monkeypatch.setattr(PagedAttentionMemoryHandler, "compute_memory_footprint", recorded)
    job = AgentJetJob(max_prompt_length=200, max_response_length=56,
                      generation_backend="continuous_batching")
    cfg = engine_config_from_job(job, cuda_devices=0, cpu_count=1)
    policy = load_policy(ensure_tiny_model(tmp_path, seed=0), device="cpu", dtype="float32",
                         seed=0)
    generator = build_generator(cfg, policy)
    generator.start()
    try:
        tokens = generator.stats()["kv_cache_tokens"]
    finally:
        generator.stop()
    plan = plan_memory(JobView.from_job(job), ModelShape.tiny(), H100)
    assert plan.cache is not None and tokens == plan.cache.tokens == 32 * 256
    cache_terms = [t.bytes for t in plan.terms
                   if t.name.startswith(("KV cache", "decoding pass"))]
    assert len(cache_terms) == 2 and footprints
    assert abs(sum(cache_terms) - footprints[-1]) <= 0.02 * footprints[-1], (
        cache_terms, footprints)


def test_the_paged_pool_is_the_one_the_engines_paged_generator_allocates(
        tmp_path: Path) -> None:
    """The CPU default backend: the planner's pool is the generator's (same
    `kv_cache.plan_paged_pool` call), with no attention mask, kept across updates."""
    from ajet.engine.runtime import build_generator

    job = AgentJetJob(max_prompt_length=200, max_response_length=56)
    cfg = engine_config_from_job(job, cuda_devices=0, cpu_count=1)
    assert cfg.generation_backend == "paged"
    policy = load_policy(ensure_tiny_model(tmp_path, seed=0), device="cpu", dtype="float32",
                         seed=0)
    generator = build_generator(cfg, policy)
    generator.start()
    try:
        stats = generator.stats()
    finally:
        generator.stop()
    plan = plan_memory(JobView.from_job(job), ModelShape.tiny(), H100)
    assert plan.pool is not None and plan.cache is None and plan.pool_kept
    assert stats["backend"] == "paged" and stats["kv_cache_tokens"] == plan.pool.tokens
    assert stats["pool_bytes"] == plan.pool.pool_bytes
    terms = {t.name: t for t in plan.terms}
    pool_term = terms[f"paged KV pool ({plan.pool.tokens} tokens, pages of 16)"]
    assert pool_term.bytes == plan.pool.pool_bytes and "backward" in pool_term.phases
    assert not any("attention mask" in name for name in terms)


def test_smaller_changes_are_offered_when_they_fit() -> None:
    shape = model_shape(str(QWEN_7B))
    job = JobView.from_job(AgentJetJob(**HEADLINE, n_gpu=8, micro_batch_tokens=262_144,
                                       activation_checkpointing=False))
    plan = plan_memory(job, shape, H100)
    assert not plan.fits
    changes = [f.changes for f in plan.fixes]
    assert {"activation_checkpointing": True} in changes
    assert any(set(c) == {"micro_batch_tokens"} for c in changes)


# ---------------------------------------------------------------------------- memory available


def _fake_nvidia_smi(folder: Path, mib: list[int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "nvidia-smi"
    lines = "\\n".join(str(m) for m in mib)
    exe.write_text(f"#!/bin/sh\nprintf '{lines}\\n'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return folder


def test_memory_available_from_nvidia_smi_gpu_memory_gb_and_the_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_job = JobView(n_gpu=2)
    bin_dir = _fake_nvidia_smi(tmp_path / "bin", [81559, 40960, 81559])
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    found = detect_available(gpu_job)
    assert found.bytes == 40960 * MiB and "nvidia-smi" in found.source  # the smallest used
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")  # what the engine will see
    assert detect_available(gpu_job).bytes == 81559 * MiB

    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))  # no nvidia-smi at all
    fallback = detect_available(JobView(n_gpu=1, gpu_memory_gb=24))
    assert fallback.bytes == 24 * GiB and "gpu_memory_gb=24" in fallback.source

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert detect_available(JobView(n_gpu=0, n_proc=1)).bytes <= host
    assert detect_available(JobView(n_gpu=0, n_proc=4)).bytes <= host // 4
    # a launcher's word on its nodes (the Ray launcher: what Ray reports) comes first
    monkeypatch.setenv("AJET_ENGINE_GPU_MEMORY_GB", "40")
    assert detect_available(JobView(n_gpu=1)).bytes == 40 * GiB
    monkeypatch.setenv("AJET_ENGINE_HOST_MEMORY_GB", "8")
    assert detect_available(JobView(n_gpu=0, n_proc=2)).bytes == 4 * GiB


def test_a_job_whose_model_has_no_config_json_here_is_not_planned(tmp_path: Path) -> None:
    from ajet.engine.planning.memory_plan import plan_job

    assert plan_job(AgentJetJob(model=str(tmp_path / "elsewhere"))) is None
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="hidden_size"):
        plan_job(AgentJetJob(model=str(tmp_path / "broken")))


# ---------------------------------------------------------------------------- LoRA and the host


def test_lora_holds_one_bf16_base_shared_by_training_and_generation() -> None:
    shape = model_shape(str(QWEN_7B))
    assert shape is not None
    job = JobView.from_job(AgentJetJob(**HEADLINE, n_gpu=1, lora_rank=16))
    plan = plan_memory(job, shape, H100)
    terms = {t.name: t.bytes for t in plan.terms}
    adapters = shape.lora_parameters(16, "all-linear")
    (model,) = [b for n, b in terms.items() if n.startswith("model: frozen base (bf16")]
    assert model == 2 * shape.parameters + 4 * adapters  # no fp32 copy of the base
    assert not any(n.startswith(("trained weights", "generation copy", "bf16 weight casts"))
                   for n in terms)
    assert terms["AdamW moments (fp32)"] == 8 * adapters
    assert plan.fits and plan.peak_bytes < 45 * 2**30  # was 69 GiB with the fp32 copy
    eight = plan_memory(JobView.from_job(AgentJetJob(**HEADLINE, n_gpu=8, lora_rank=16)),
                        shape, H100)
    assert "the base replicated on every rank" in eight.setup()
    assert not any("FSDP2" in t.name for t in eight.terms)  # never sharded


def test_a_node_without_the_host_memory_is_refused_with_the_numbers() -> None:
    shape = model_shape(str(QWEN_7B))
    assert shape is not None
    job = JobView.from_job(AgentJetJob(**HEADLINE, n_gpu=8))
    small = plan_memory(job, shape, H100, host=Available(32 * 2**30, "test: a small host"))
    assert small.device_fits and not small.fits
    host = {t.name: t.bytes for t in small.host_terms}
    assert host["checkpoint gathered on rank 0 (fp32 masters)"] == 4 * shape.parameters
    # one copy of the checkpoint per node while loading, not one per rank
    assert host["checkpoint files while loading (page cache, one copy per node)"] == \
        2 * shape.parameters
    text = small.render()
    assert "host available: 32.00 GiB (test: a small host); short by" in text
    assert "the GPUs fit, the host does not" in small.hint()
    assert small.to_dict()["host_gib"] == pytest.approx(small.host_bytes / 2**30, abs=1e-3)
    big = plan_memory(job, shape, H100, host=Available(1024 * 2**30, "test: a GPU node"))
    # async_save (on with GPUs): each rank stages its shard of the training state, fp32
    # masters and two moments, 12 bytes per parameter over the node
    staged = {t.name: t.bytes for t in big.host_terms}[
        "training state staged for the background save (async_save; 8 rank(s) of the node)"]
    assert staged == 8 * -(-12 * shape.parameters // 8)
    assert big.fits and big.host_bytes - staged < 64 * 2**30  # was 8 x 30 GiB of fp32 copies
    sync = plan_memory(dataclasses.replace(job, async_save=False), shape, H100,
                       host=Available(1024 * 2**30, "test: a GPU node"))
    assert sync.host_bytes == big.host_bytes - staged
    cpu = plan_memory(JobView.from_job(AgentJetJob()), model_shape("ajet-tiny"),
                      Available(2**34, "test"), host=Available(1, "test: no host"))
    assert cpu.host_terms == [] and cpu.fits  # a CPU job's host is its device, planned above
