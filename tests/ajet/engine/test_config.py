"""AgentJetJob -> EngineConfig conversion and backend defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from ajet.copilot.job import AgentJetJob
from ajet.copilot.model_defaults import resolve_job
from ajet.engine.config import BackendDefaults, engine_config_from_job
from ajet.engine.runtime import load_engine_config


def test_cpu_job_gets_fp32_and_slots_for_one_batch() -> None:
    cfg = engine_config_from_job(AgentJetJob(batch_size=3, num_repeat=5), cuda_devices=0,
                                 cpu_count=8)
    assert (cfg.device, cfg.dtype) == ("cpu", "float32")
    assert cfg.max_in_flight == 15 == cfg.episodes_per_step
    assert cfg.model == "ajet-tiny" and cfg.num_repeat == 5
    assert 1 <= cfg.cpu_threads <= 8


def test_gpu_job_gets_bf16_and_too_many_gpus_is_refused_naming_both_numbers() -> None:
    cfg = engine_config_from_job(AgentJetJob(n_gpu=1), cuda_devices=2, cpu_count=4)
    assert (cfg.device, cfg.dtype) == ("cuda", "bfloat16")
    with pytest.raises(ValueError, match=r"n_gpu=4.*2 CUDA"):
        engine_config_from_job(AgentJetJob(n_gpu=4), cuda_devices=2, cpu_count=4)
    with pytest.raises(ValueError, match="n_gpu: 0"):
        engine_config_from_job(AgentJetJob(n_gpu=1), cuda_devices=0, cpu_count=4)


def test_backend_defaults_are_applied() -> None:
    backend = BackendDefaults(in_flight_factor=2.0, cpu_threads=0, reward_clip=3.0)
    cfg = engine_config_from_job(AgentJetJob(batch_size=2, num_repeat=2), cuda_devices=0,
                                 cpu_count=4, backend=backend)
    assert cfg.max_in_flight == 8
    assert cfg.cpu_threads == 4
    assert cfg.reward_clip == 3.0


def test_the_generation_backend_is_the_jobs_or_the_devices_default(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu = engine_config_from_job(AgentJetJob(), cuda_devices=0, cpu_count=2)
    gpu = engine_config_from_job(AgentJetJob(n_gpu=1), cuda_devices=1, cpu_count=2)
    assert (cpu.generation_backend, gpu.generation_backend) == ("paged", "continuous_batching")
    chosen = engine_config_from_job(AgentJetJob(n_gpu=1, generation_backend="paged"),
                                    cuda_devices=1, cpu_count=2)
    assert chosen.generation_backend == "paged"
    with pytest.raises(ValueError, match="generation_backend"):
        AgentJetJob(generation_backend="vllm")
    # the engine's machine overrides the job for one run
    from ajet.engine.generation.recompute import RecomputeGenerator
    from ajet.engine.policy import load_policy
    from ajet.engine.runtime import build_generator
    from ajet.engine.tiny import ensure_tiny_model

    policy = load_policy(ensure_tiny_model(tmp_path, seed=0), device="cpu", dtype="float32",
                         seed=0)
    assert type(build_generator(cpu, policy)).__name__ == "PagedGenerator"
    monkeypatch.setenv("AJET_ENGINE_GENERATION", "recompute")
    assert isinstance(build_generator(cpu, policy), RecomputeGenerator)
    monkeypatch.setenv("AJET_ENGINE_GENERATION", "vllm")
    with pytest.raises(ValueError, match="paged, continuous_batching or recompute"):
        build_generator(cpu, policy)


def test_load_from_yaml_names_a_bad_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.yaml"
    path.write_text("batch_size: 0\n")
    with pytest.raises(ValueError, match="batch_size"):
        load_engine_config(path, cuda_devices=0, cpu_count=1)
    path.write_text(AgentJetJob(lr=0.01).to_yaml())
    job, cfg = load_engine_config(path, cuda_devices=0, cpu_count=1)
    assert job.lr == cfg.lr == 0.01


def test_scale_fields_reach_the_engine_config_with_their_defaults() -> None:
    cpu = engine_config_from_job(AgentJetJob(), cuda_devices=0, cpu_count=1)
    gpu = engine_config_from_job(AgentJetJob(n_gpu=1), cuda_devices=1, cpu_count=1)
    assert (cpu.activation_checkpointing, gpu.activation_checkpointing) == (False, True)
    assert cpu.master_dtype == gpu.master_dtype == "float32"  # fp32 masters under bf16
    assert (cpu.lora, cpu.mini_batch_num, cpu.lora_target_modules) == (False, 1, "all-linear")
    forced = engine_config_from_job(AgentJetJob(activation_checkpointing=True, lora_rank=4,
                                                lora_target_modules=["q_proj", "v_proj"]),
                                    cuda_devices=0, cpu_count=1)
    assert forced.activation_checkpointing and forced.lora_rank == 4
    assert forced.lora_target_modules == ("q_proj", "v_proj")


def test_lora_gets_an_adapter_rate_unless_lr_is_given() -> None:
    job, notes = resolve_job(AgentJetJob(lora_rank=8))
    assert job.lr == 3e-2 and "lm_head" in job.lora_target_modules  # ajet-tiny's
    assert {n["field"] for n in notes} >= {"lr", "lora_target_modules"}
    assert resolve_job(AgentJetJob(lora_rank=8, lr=5e-5))[0].lr == 5e-5
    with pytest.raises(ValueError, match="greater than 1e-5"):  # the original's floor
        AgentJetJob(lora_rank=8, lr=1e-5)
    again, notes = resolve_job(job)  # chosen again at every check: the same values
    assert again == job and {n["field"] for n in notes} == set(job.defaults_chosen)
    assert AgentJetJob.from_yaml(job.to_yaml()) == job
    with pytest.raises(ValueError, match="activation_checkpointing"):
        AgentJetJob.from_yaml("activation_checkpointing: sometimes\n")


def test_a_stored_config_gets_the_new_models_defaults_when_its_model_changes() -> None:
    """The MCP bridge merges changes into the stored (resolved) config: the values the
    server chose for the old model must not pass for the user's own."""
    qwen = str(Path(__file__).parent / "models" / "Qwen2.5-7B-Instruct")
    stored, _ = resolve_job(AgentJetJob(model=qwen))
    assert stored.lr == 1e-6 and "lr" in stored.defaults_chosen
    assert stored.boot_timeout_s is not None
    back = AgentJetJob.from_yaml(stored.to_yaml())
    back.model = "ajet-tiny"
    tiny, _ = resolve_job(back)
    assert (tiny.lr, tiny.max_new_tokens, tiny.save_every) == (3e-3, 16, 0)
    assert tiny.boot_timeout_s is None  # the server's own again
    mine = AgentJetJob.from_yaml(stored.to_yaml())
    mine.lr = 2e-6  # set by the user: kept, and no longer the server's choice
    assert "lr" not in mine.defaults_chosen and resolve_job(mine)[0].lr == 2e-6
