"""Resume: a run stopped after step 4 continues at step 5 from the saved weights and optimizer.

The step loop (`trainer.train`) runs in process on ajet-tiny with a registry filled by
hand with fixed episodes, so the uninterrupted run and the resumed one see the same data.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ajet.copilot.job import AgentJetJob
from ajet.engine.checkpoints import resume_training, save_checkpoint, step_checkpoint_dir
from ajet.engine.config import EngineConfig, engine_config_from_job
from ajet.engine.learner import Learner
from ajet.engine.metrics import MetricsWriter
from ajet.engine.parallel.distributed import Dist
from ajet.engine.plane.episodes import EpisodeRegistry
from ajet.engine.policy import load_policy
from ajet.engine.tiny import ensure_tiny_model
from ajet.engine.trainer import TrainerParts, finish, train
from ajet.engine.trajectory import Completion
from ajet.protocol import EngineState
from tests.support.engine import spawn_engine

BATCH, REPEAT = 2, 2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("work"), seed=0)


def _cfg(**changes: object) -> EngineConfig:
    job = AgentJetJob(batch_size=BATCH, num_repeat=REPEAT, lr=0.01, save_every=4)
    return dataclasses.replace(engine_config_from_job(job, cuda_devices=0, cpu_count=1),
                               **changes)


def _learner(model_path: Path, cfg: EngineConfig) -> Learner:
    torch.manual_seed(0)
    return Learner(load_policy(model_path, device="cpu", dtype="float32", seed=0), cfg)


def _fill(registry: EpisodeRegistry, step: int) -> None:
    """One step's episodes, the same whoever asks: BATCH groups of REPEAT, fixed tokens."""
    registry.set_state(EngineState.ROLLING, step=step - 1)
    for g in range(BATCH):
        for r in range(REPEAT):
            episode = registry.begin()
            registry.chat_started(episode.uuid)
            response = tuple(10 + (step * 7 + g * 3 + r * 5 + i) % 60 for i in range(6))
            registry.chat_finished(episode.uuid, Completion(
                prompt_ids=(3, 4, 5 + g), response_ids=response,
                logprobs=tuple(-4.0 for _ in response), finish_reason="length",
                policy_step=step - 1))
            registry.end(episode.uuid, task_id=f"s{step}-g{g}", reward=float(r % 2 + g))


def _parts(learner: Learner, run_dir: Path, registry: EpisodeRegistry, *,
           start_step: int) -> TrainerParts:
    run_dir.mkdir(parents=True, exist_ok=True)
    return TrainerParts(cfg=learner.cfg, registry=registry, policy=learner.policy,
                        learner=learner, metrics=MetricsWriter(run_dir / "metrics.jsonl"),
                        run_dir=run_dir, run_id=run_dir.name, stop=threading.Event(),
                        started=time.monotonic(), dist=Dist(), start_step=start_step)


def _registry(cfg: EngineConfig, steps: range) -> EpisodeRegistry:
    registry = EpisodeRegistry(group_size=REPEAT, max_in_flight=BATCH * REPEAT,
                               default_timeout_s=60, batch_size=BATCH,
                               collection_method=cfg.sample_collection_method)
    for step in steps:
        _fill(registry, step)
    return registry


def _params(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.scorer.named_parameters()}


def _moments(learner: Learner) -> list[torch.Tensor]:
    return [s[k].clone() for s in learner.optimizer.state.values()
            for k in ("exp_avg", "exp_avg_sq")]


def test_resumed_run_continues_at_step_5_from_the_saved_state(model_path: Path,
                                                              tmp_path: Path) -> None:
    cfg = _cfg(max_steps=4)
    # --- the first run: four steps, a checkpoint at step 4, stopped there
    first = _learner(model_path, cfg)
    registry = _registry(cfg, range(1, 5))
    parts = _parts(first, tmp_path / "run-a", registry, start_step=0)
    assert train(parts) == 4
    finish(parts, 4)
    saved = step_checkpoint_dir(parts.run_dir, 4)
    assert json.loads((saved / "ajet_checkpoint.json").read_text())["step"] == 4
    # the stop did not write the same state twice: final/ holds the step-4 files, linked
    final = parts.run_dir / "final"
    assert not final.is_symlink() and (final / "model.safetensors").stat().st_ino == \
        (saved / "model.safetensors").stat().st_ino
    at_4, moments_4 = _params(first), _moments(first)

    # --- the uninterrupted process goes on to step 5 with the same learner
    parts.start_step, parts.cfg = 4, dataclasses.replace(cfg, max_steps=5)
    first.cfg = parts.cfg
    _fill(registry, 5)
    assert train(parts) == 5
    uninterrupted = _params(first)

    # --- the resumed run: a fresh learner restored from the checkpoint
    second = _learner(model_path, dataclasses.replace(cfg, max_steps=5))
    assert any(not torch.equal(p, at_4[n]) for n, p in _params(second).items())
    assert resume_training(second, saved) == 4
    loaded = _params(second)
    assert all(torch.equal(loaded[n], at_4[n]) for n in at_4)  # the saved weights, exactly
    assert all(torch.equal(a, b) for a, b in zip(_moments(second), moments_4, strict=True))
    # the generation model (the same object on one CPU process) serves the restored weights
    resumed = _parts(second, tmp_path / "run-b", _registry(second.cfg, range(5, 6)),
                     start_step=4)
    assert train(resumed) == 5
    lines = [json.loads(x) for x in (resumed.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [5]
    after = _params(second)
    for name, value in uninterrupted.items():
        torch.testing.assert_close(after[name], value, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(after[n], at_4[n]) for n in at_4)  # step 5 did update


def test_the_engine_keeps_the_operators_allocator_options() -> None:
    from ajet.engine.runtime import allocator_conf

    assert allocator_conf(None) == "expandable_segments:True"
    assert allocator_conf("max_split_size_mb:128") == \
        "max_split_size_mb:128,expandable_segments:True"
    assert allocator_conf("expandable_segments:False") == "expandable_segments:False"


def test_resume_refuses_a_checkpoint_of_the_other_training_mode(model_path: Path,
                                                                tmp_path: Path) -> None:
    cfg = _cfg()
    full = _learner(model_path, cfg)
    registry = _registry(cfg, range(1, 1))
    parts = _parts(full, tmp_path / "run", registry, start_step=0)
    finish(parts, 0)
    lora = _learner(model_path, dataclasses.replace(cfg, lora_rank=4, lr=1e-3))
    with pytest.raises(ValueError, match="saved without LoRA"):
        resume_training(lora, parts.run_dir / "final")


def test_the_engine_process_resumes_from_the_checkpoint_it_is_given(model_path: Path,
                                                                    tmp_path: Path) -> None:
    """`--resume` (what the server passes for resume_from): the engine restores the
    checkpoint and counts on from its step; with max_steps reached it saves at once."""
    learner = _learner(model_path, _cfg())
    name, weight = next(iter(learner.model.scorer.lm.named_parameters()))
    with torch.no_grad():
        weight.add_(0.25)  # weights no fresh ajet-tiny has
    saved = save_checkpoint(learner, tmp_path / "first" / "checkpoints" / "step_4", step=4,
                            run_id="first")
    job = AgentJetJob(batch_size=BATCH, num_repeat=REPEAT, max_steps=4)
    handle = spawn_engine(tmp_path / "second", job, extra_args=("--resume", str(saved)))
    try:
        assert handle.proc.wait(timeout=180) == 0, handle.log_path.read_text()[-3000:]
    finally:
        handle.stop()
    log = handle.log_path.read_text()
    assert f"resumed from {saved}: step 4" in log
    # the engine's CUDA allocator uses expandable segments (a no-op on CPU)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in log
    final = handle.run_dir / "final"
    assert json.loads((final / "ajet_checkpoint.json").read_text())["step"] == 4
    key = name.removeprefix("lm.")
    torch.testing.assert_close(load_file(final / "model.safetensors")[key], weight.detach())


def test_a_background_save_keeps_the_state_it_began_with_and_the_stop_waits_for_it(
        model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """`async_save`: training changes the weights and AdamW's state while the checkpoint
    is written; the checkpoint holds those of its step, and `finish` (the SIGTERM path)
    waits for it, then names it `final/` too."""
    from ajet.engine import checkpoints

    learner = _learner(model_path, _cfg())
    registry = _registry(learner.cfg, range(1, 2))
    parts = _parts(learner, tmp_path / "run", registry, start_step=0)
    assert train(dataclasses.replace(parts, cfg=dataclasses.replace(parts.cfg, max_steps=1,
                                                                  save_every=0))) == 1
    at_1, moments_1 = _params(learner), _moments(learner)
    writing = threading.Event()
    real_write = checkpoints._write_model_files

    def slow_write(*args: object, **kwargs: object) -> None:
        writing.set()
        time.sleep(1.0)  # a large model's weights take a while to write
        real_write(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoints, "_write_model_files", slow_write)
    target = step_checkpoint_dir(parts.run_dir, 1)
    parts.pending = checkpoints.begin_checkpoint(learner, target, step=1,
                                                 run_id="run", background=True)
    assert writing.wait(10) and not parts.pending.done()
    assert target.with_name("step_1.partial").is_dir() and not target.exists()
    with torch.no_grad():  # training goes on meanwhile
        for p in learner.model.scorer.parameters():
            p.add_(1.0)
        for state in learner.optimizer.state.values():
            state["exp_avg"].add_(1.0)
    with caplog.at_level("INFO", logger="ajet.engine.trainer"):
        finish(parts, 1)
    assert "stopping: waiting for checkpoint" in caplog.text
    assert json.loads((target / "ajet_checkpoint.json").read_text())["step"] == 1
    final = parts.run_dir / "final"
    assert (final / "model.safetensors").stat().st_ino == \
        (target / "model.safetensors").stat().st_ino
    assert not list(parts.run_dir.rglob("*.partial"))
    saved = load_file(target / "model.safetensors")
    for name, value in at_1.items():
        assert torch.equal(saved[name.removeprefix("lm.")], value), name
    fresh = _learner(model_path, _cfg())
    assert resume_training(fresh, target) == 1
    assert all(torch.equal(p, at_1[n]) for n, p in _params(fresh).items())
    assert all(torch.equal(a, b) for a, b in zip(_moments(fresh), moments_1, strict=True))
