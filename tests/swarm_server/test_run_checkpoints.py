"""A run's checkpoints on the server: stop grace and boot deadline by job, a stop that
finds a save in progress, the last complete checkpoint in the record, and `resume_from`
(run id, `latest`, path) turned into the engine's `--resume` with the chain recorded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ajet.copilot.job import AgentJetJob
from ajet.protocol import SERVER_CODE, EngineState
from ajet.errors import SwarmValidationError
from swarm_server.engine import EngineController, PinnedJob, run_limits
from swarm_server.run_checkpoints import complete_checkpoints, saves_in_progress
from swarm_server.settings import Settings
from tests.support.harness import Harness, make_harness, serve, wait_until

S = EngineState


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = make_harness(tmp_path)
    yield harness
    harness.ctl.shutdown()
    harness.ledger.close()


def _checkpoint(folder: Path, step: int, run_id: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "ajet_checkpoint.json").write_text(json.dumps({"step": step, "run_id": run_id}))
    return folder


def _run(h: Harness, **job: object) -> tuple[str, object]:
    h.configure(experiment_name="exp", **job)
    run_id = h.ctl.start(role="control")
    proc = h.spawner.latest()
    proc.term_exit_code = 0  # type: ignore[attr-defined]
    serve(proc)  # type: ignore[arg-type]
    wait_until(lambda: h.ctl.state is S.ROLLING)
    return run_id, proc


def test_run_limits_are_the_jobs_capped_by_the_server(tmp_path: Path) -> None:
    settings = Settings(workdir=tmp_path, boot_timeout_s=300, stop_grace_s=10,
                        max_boot_timeout_s=1000, max_stop_grace_s=600)
    assert run_limits(settings, {}) == (300, 10)  # ajet-tiny: the server's own
    assert run_limits(settings, {"boot_timeout_s": None, "stop_grace_s": None}) == (300, 10)
    assert run_limits(settings, {"boot_timeout_s": 1151, "stop_grace_s": 537}) == (1000, 537)
    assert run_limits(settings, {"boot_timeout_s": 20, "stop_grace_s": 5000}) == (20, 600)


def test_stop_waits_for_a_save_and_names_the_last_complete_checkpoint(h: Harness) -> None:
    run_id, _ = _run(h)
    run_dir = h.ctl.run_dir(run_id)
    step_4 = _checkpoint(run_dir / "checkpoints" / "step_4", 4, run_id)
    (run_dir / "final.partial").mkdir()  # the final checkpoint is being written
    assert saves_in_progress(run_dir) == ["final"]
    stopped = h.ctl.stop(role="control", reason="test")
    assert stopped.waited_for == ["final"]
    assert "waited for the checkpoint(s) being written: final" in (stopped.message or "")
    assert stopped.last_checkpoint == str(step_4.resolve())
    record = h.ledger.get_run(run_id)
    assert record is not None and record.last_checkpoint == str(step_4.resolve())


def test_what_a_kill_left_half_written_is_removed_and_the_complete_one_named(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    run_id, _ = _run(h)
    run_dir = h.ctl.run_dir(run_id)
    step_2 = _checkpoint(run_dir / "checkpoints" / "step_2", 2, run_id)
    # a SIGKILL during the step-4 save (in the background) and the final one
    (run_dir / "checkpoints" / "step_4.partial" / "training_state").mkdir(parents=True)
    (run_dir / "final.partial").mkdir()
    with caplog.at_level("WARNING", logger="swarm_server.run_checkpoints"):
        stopped = h.ctl.stop(role="control", reason="test")
    assert stopped.waited_for == ["checkpoints/step_4", "final"]
    assert stopped.last_checkpoint == str(step_2.resolve())
    assert not list(run_dir.rglob("*.partial"))
    said = f"removed incomplete checkpoint(s) checkpoints/step_4, final (.partial: the " \
           f"engine was stopped while writing them); the last complete checkpoint is " \
           f"{step_2.resolve()} (step 2)"
    assert said in caplog.text and said in (run_dir / "engine.log").read_text()
    record = h.ledger.get_run(run_id)
    assert record is not None and record.last_checkpoint == str(step_2.resolve())


def test_a_run_killed_in_its_first_save_has_no_checkpoint_and_no_partial(h: Harness) -> None:
    run_id, _ = _run(h)
    run_dir = h.ctl.run_dir(run_id)
    (run_dir / "checkpoints" / "step_2.partial").mkdir(parents=True)
    stopped = h.ctl.stop(role="control", reason="test")
    assert stopped.last_checkpoint is None and "no complete checkpoint" in stopped.message
    assert not (run_dir / "checkpoints" / "step_2.partial").exists()
    record = h.ledger.get_run(run_id)
    assert record is not None and record.last_checkpoint is None


def test_final_after_a_step_of_the_same_number_is_the_last(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "checkpoints" / "step_2", 2, "r")
    _checkpoint(tmp_path / "checkpoints" / "step_10", 10, "r")
    _checkpoint(tmp_path / "final", 10, "r")
    (tmp_path / "checkpoints" / "step_12.partial").mkdir()
    assert [(c.step, c.path.name) for c in complete_checkpoints(tmp_path)] == [
        (2, "step_2"), (10, "step_10"), (10, "final")]


def test_resume_latest_continues_the_experiments_last_checkpoint(h: Harness) -> None:
    first, _ = _run(h)
    step_4 = _checkpoint(h.ctl.run_dir(first) / "checkpoints" / "step_4", 4, first)
    h.ctl.stop(role="control", reason="test")

    second, proc = _run(h, resume_from="latest")
    argv = proc.spec.argv  # type: ignore[attr-defined]
    assert argv[argv.index("--resume") + 1] == str(step_4.resolve())
    record = h.ledger.get_run(second)
    assert record is not None
    assert (record.resumed_from, record.resume_step) == (first, 4)
    assert record.resume_checkpoint == str(step_4.resolve())
    h.ctl.stop(role="control", reason="test")

    # by run id, and by a path relative to the runs directory
    for value in (first, f"{first}/checkpoints/step_4"):
        third, proc = _run(h, resume_from=value)
        argv = proc.spec.argv  # type: ignore[attr-defined]
        assert argv[argv.index("--resume") + 1] == str(step_4.resolve())
        h.ctl.stop(role="control", reason="test")


def test_resume_latest_is_the_experiments_latest_run_whichever_way_it_started(
        h: Harness) -> None:
    """A run of POST /runs (its own controller, pinned to its job) counts for the default
    run's `latest`, and a newer run of another experiment, beside it, does not."""
    def side_run(run_id: str, experiment: str, step: int) -> None:
        job = AgentJetJob(experiment_name=experiment).to_yaml()
        lane = EngineController(h.settings, h.ledger, h.ctl.snapshots, spawner=h.spawner,
                                probe=h.spawner.probe, pinned=PinnedJob(run_id, SERVER_CODE,
                                                                        job, name=run_id))
        lane.start(role="control")
        serve(h.spawner.latest())
        wait_until(lambda: lane.state is S.ROLLING)
        _checkpoint(lane.run_dir(run_id) / "checkpoints" / f"step_{step}", step, run_id)
        lane.stop(role="control", reason="test")

    side_run("side-exp", "exp", 4)
    side_run("side-other", "other", 9)  # newer, and with a later step: another experiment
    resumed, proc = _run(h, resume_from="latest")
    argv = proc.spec.argv  # type: ignore[attr-defined]
    assert Path(argv[argv.index("--resume") + 1]).parent.parent.name == "side-exp"
    record = h.ledger.get_run(resumed)
    assert record is not None and (record.resumed_from, record.resume_step) == ("side-exp", 4)


def test_resume_from_nothing_is_refused_with_a_hint(h: Harness) -> None:
    h.configure(experiment_name="fresh", resume_from="latest")
    with pytest.raises(SwarmValidationError) as exc:
        h.ctl.start(role="control")
    assert "no run of experiment 'fresh'" in str(exc.value.detail)
    assert "list_runs" in exc.value.hint
    h.configure(experiment_name="fresh", resume_from="no-such-run")
    with pytest.raises(SwarmValidationError, match="neither a run id"):
        h.ctl.start(role="control")
    outside = _checkpoint(h.settings.workdir / "elsewhere", 3, "x")
    h.configure(experiment_name="fresh", resume_from=str(outside))
    with pytest.raises(SwarmValidationError, match="outside the server's runs directory"):
        h.ctl.start(role="control")
    assert h.ctl.state is S.OFFLINE and h.spawner.processes == []
