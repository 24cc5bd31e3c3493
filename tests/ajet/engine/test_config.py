"""AgentJetJob -> EngineConfig conversion and backend defaults."""

from __future__ import annotations

import pytest

from ajet.copilot.job import AgentJetJob
from ajet.engine.config import BackendDefaults, engine_config_from_job, load_engine_config


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


def test_load_from_yaml_names_a_bad_field(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "job.yaml"
    path.write_text("batch_size: 0\n")
    with pytest.raises(ValueError, match="batch_size"):
        load_engine_config(path, cuda_devices=0, cpu_count=1)
    path.write_text(AgentJetJob(lr=0.01).to_yaml())
    job, cfg = load_engine_config(path, cuda_devices=0, cpu_count=1)
    assert job.lr == cfg.lr == 0.01
