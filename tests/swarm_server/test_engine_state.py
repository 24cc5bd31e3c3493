"""EngineController state machine, driven through `FakeSpawner`: no process is spawned.

The fake's processes exit, ignore SIGTERM or answer the status probe exactly when a
test says so, which makes every edge of the state machine reachable deterministically.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ajet
from ajet.copilot.job import AgentJetJob
from ajet.protocol import ENGINE_FAILURE_FILE, SERVER_CODE, EngineFailure, EngineReport, EngineState
from ajet.errors import EngineStateConflict, SwarmValidationError
from swarm_server.engine import LAST_CONFIG_KEY
from swarm_server.ledger import Ledger, RunRecord
from swarm_server.supervisor import FakeProcess, SpawnSpec
from tests.support.harness import FixedSnapshots, Harness, make_harness, serve, wait_until

S = EngineState


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = make_harness(tmp_path)
    yield harness
    harness.ctl.shutdown()
    harness.ledger.close()


def audit_actions(ledger: Ledger) -> list[tuple[str, str]]:
    entries, _ = ledger.list_audit(limit=1000)
    return [(e.action, e.outcome.split(":")[0]) for e in entries]


# ---------------------------------------------------------------------------- transitions


def test_change_state_is_compare_and_set(h: Harness) -> None:
    with pytest.raises(EngineStateConflict) as wrong_source:
        h.ctl.change_state(S.ROLLING, S.OFFLINE)
    assert "ENGINE.OFFLINE" in str(wrong_source.value.detail)
    with pytest.raises(EngineStateConflict, match="cannot go"):
        h.ctl.change_state(S.OFFLINE, S.ROLLING)  # OFFLINE -> ROLLING skips BOOTING
    h.ctl.change_state(S.OFFLINE, S.BOOTING)
    assert h.ctl.state is S.BOOTING


def test_start_without_config_is_refused_and_audited(h: Harness) -> None:
    with pytest.raises(EngineStateConflict) as exc:
        h.ctl.start(role="control")
    assert exc.value.status == 409
    assert "sync_train_config" in exc.value.hint
    assert h.ctl.state is S.OFFLINE
    assert h.spawner.processes == []
    assert audit_actions(h.ledger) == [("start_engine", "refused")]


def test_start_boots_spawns_contract_command_and_follows_reports(h: Harness) -> None:
    h.configure(experiment_name="exp-a")
    run_id = h.ctl.start(role="control")
    assert h.ctl.state is S.BOOTING
    assert h.ctl.current_run_id() is None  # not serving yet: the gateway must not proxy
    proc = h.spawner.latest()
    argv = proc.spec.argv
    run_dir = h.settings.runs_dir / run_id
    assert argv[1:3] == ["-m", "ajet.engine"]
    for flag, value in (("--config", str(run_dir / "job.yaml")), ("--run-dir", str(run_dir)),
                        ("--run-id", run_id), ("--workdir", str(h.settings.workdir))):
        assert argv[argv.index(flag) + 1] == value
    assert proc.spec.cwd == run_dir
    assert "experiment_name: exp-a" in (run_dir / "job.yaml").read_text()
    assert "ISOLATED_AGENTJET_BASE_DIR" not in proc.spec.env  # no snapshot active
    assert "AJET_SWARM_TOKEN" not in proc.spec.env

    serve(proc, S.ROLLING, step=3)
    wait_until(lambda: h.ctl.state is S.ROLLING)
    assert h.ctl.current_run_id() == run_id
    assert h.ctl.serving_socket_of(run_id) == proc.socket_path
    status = h.ctl.status()
    assert (status.run_id, status.pid, status.step, status.experiment_name) == \
        (run_id, proc.pid, 3, "exp-a")
    wait_until(lambda: h.ledger.get_run(run_id).status == "running")  # type: ignore[union-attr]

    serve(proc, S.WEIGHT_SYNCING)
    wait_until(lambda: h.ctl.state is S.WEIGHT_SYNCING)
    serve(proc, S.ROLLING)
    wait_until(lambda: h.ctl.state is S.ROLLING)


def test_illegal_requests_get_409_naming_state_and_next_call(h: Harness) -> None:
    h.configure()
    h.ctl.start(role="control")
    with pytest.raises(EngineStateConflict) as booting:
        h.ctl.start(role="control")
    assert "ENGINE.BOOTING" in booting.value.detail
    assert "stop_engine" in booting.value.hint
    serve(h.spawner.latest())
    wait_until(lambda: h.ctl.state is S.ROLLING)
    with pytest.raises(EngineStateConflict) as config:
        h.ctl.set_config(AgentJetJob().to_yaml(), role="control")
    assert "ENGINE.ROLLING" in config.value.detail and "stop_engine" in config.value.hint
    activated: list[int] = []
    with pytest.raises(EngineStateConflict) as swap:
        h.ctl.swap_code(lambda: activated.append(1), force_restart=False, role="control")
    assert "force_restart=True" in swap.value.hint
    assert activated == []
    assert len(h.spawner.processes) == 1


def test_twenty_concurrent_starts_spawn_exactly_one_engine(h: Harness) -> None:
    h.configure()
    barrier = threading.Barrier(20)
    outcomes: list[str] = []

    def start() -> None:
        barrier.wait()
        try:
            h.ctl.start(role="control")
            outcomes.append("started")
        except EngineStateConflict:
            outcomes.append("409")

    threads = [threading.Thread(target=start) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["409"] * 19 + ["started"]
    assert len(h.spawner.processes) == 1
    assert h.ledger.list_runs()[1] == 1


# ---------------------------------------------------------------------------- failures


def test_crash_at_boot_goes_offline_with_exit_code_and_log_tail(h: Harness) -> None:
    h.configure()
    run_id = h.ctl.start(role="control")
    lines = [f"boot line {i}" for i in range(60)] + ["RuntimeError: no model"]
    h.spawner.latest().exit(1, log_lines=lines)
    wait_until(lambda: h.ctl.state is S.OFFLINE)
    err = h.ctl.status().last_error
    assert err is not None
    assert (err.run_id, err.exit_code) == (run_id, 1)
    assert "ENGINE.BOOTING" in err.reason
    assert len(err.log_tail) == 50 and err.log_tail[-1] == "RuntimeError: no model"
    rec = h.ledger.get_run(run_id)
    assert rec is not None and (rec.status, rec.exit_code) == ("failed", 1)


def test_the_engines_own_failure_record_names_the_rank_and_leads_the_log_tail(
        h: Harness) -> None:
    h.configure()
    run_id, proc = h.start_rolling()
    failure = EngineFailure(rank=1, world_size=2, error="RuntimeError: loss exploded",
                            traceback=["Traceback (most recent call last):",
                                       "RuntimeError: loss exploded"])
    (h.settings.runs_dir / run_id / ENGINE_FAILURE_FILE).write_text(failure.model_dump_json())
    proc.exit(1, log_lines=["torchrun: ChildFailedError"])
    wait_until(lambda: h.ctl.state is S.OFFLINE)
    err = h.ctl.status().last_error
    assert err is not None and err.reason.startswith("the engine exited with code 1 while")
    assert err.reason.endswith(": rank 1 of 2 failed: RuntimeError: loss exploded")
    assert err.log_tail[:2] == ["[rank 1] Traceback (most recent call last):",
                                "[rank 1] RuntimeError: loss exploded"]
    assert err.log_tail[-1] == "torchrun: ChildFailedError"


def test_killed_while_rolling_goes_offline_with_last_error(h: Harness) -> None:
    h.configure()
    run_id, proc = h.start_rolling()
    proc.exit(-signal.SIGKILL)
    wait_until(lambda: h.ctl.state is S.OFFLINE)
    err = h.ctl.status().last_error
    assert err is not None and err.exit_code == -9
    assert "SIGKILL" in err.reason and "ENGINE.ROLLING" in err.reason
    assert h.ctl.serving_socket_of(run_id) is None
    rec = h.ledger.get_run(run_id)
    assert rec is not None and rec.status == "failed" and rec.final_state == "ENGINE.ROLLING"


def test_clean_exit_on_its_own_ends_the_run_without_error(h: Harness) -> None:
    h.configure()
    run_id, proc = h.start_rolling()
    proc.exit(0)
    wait_until(lambda: h.ctl.state is S.OFFLINE)
    assert h.ctl.status().last_error is None
    assert h.ledger.get_run(run_id).status == "ended"  # type: ignore[union-attr]


def test_boot_timeout_stops_the_engine_and_sets_last_error(tmp_path: Path) -> None:
    h = make_harness(tmp_path, boot_timeout_s=0.2)
    h.configure()
    h.ctl.start(role="control")
    proc = h.spawner.latest()
    wait_until(lambda: h.ctl.state is S.OFFLINE)
    err = h.ctl.status().last_error
    assert err is not None and "boot timeout" in err.reason
    assert proc.signals == [signal.SIGTERM] and not proc.alive


def test_spawn_failure_fails_the_run_not_the_server(tmp_path: Path) -> None:
    h = make_harness(tmp_path)

    def broken_start(spec: object) -> object:
        raise FileNotFoundError("no such interpreter")

    h.spawner.start = broken_start  # type: ignore[method-assign,assignment]
    h.configure()
    run_id = h.ctl.start(role="control")
    assert h.ctl.state is S.OFFLINE
    err = h.ctl.status().last_error
    assert err is not None and "no such interpreter" in err.reason
    assert h.ledger.get_run(run_id).status == "failed"  # type: ignore[union-attr]
    assert audit_actions(h.ledger) == [("start_engine", "failed")]


# ---------------------------------------------------------------------------- stop


def test_stop_terms_the_group_and_is_idempotent(h: Harness) -> None:
    h.configure()
    run_id, proc = h.start_rolling()
    first = h.ctl.stop(role="control", reason="enough")
    assert (first.stopped, first.run_id, first.state) == (True, run_id, S.OFFLINE)
    assert proc.signals == [signal.SIGTERM] and not proc.alive
    rec = h.ledger.get_run(run_id)
    assert rec is not None and (rec.status, rec.reason, rec.exit_code) == ("ended", "enough", 0)
    assert h.ctl.status().last_error is None
    second = h.ctl.stop(role="control", reason="again")
    assert (second.stopped, second.run_id, second.state) == (False, None, S.OFFLINE)
    assert audit_actions(h.ledger) == [("start_engine", "ok"), ("stop_engine", "ok"),
                                       ("stop_engine", "ok")]


def test_stop_kills_after_grace_when_sigterm_is_ignored(h: Harness) -> None:
    h.configure()
    _, proc = h.start_rolling()
    proc.term_exit_code = None
    assert h.ctl.stop(role="control", reason="x").stopped
    assert proc.signals == [signal.SIGTERM, signal.SIGKILL]
    assert h.ctl.state is S.OFFLINE


def test_force_restart_stops_then_starts_a_new_run(h: Harness) -> None:
    h.configure()
    old_run, old = h.start_rolling()
    new_run = h.ctl.start(role="control", force_restart=True)
    assert new_run != old_run and not old.alive
    assert h.ctl.state is S.BOOTING
    assert h.ledger.get_run(old_run).status == "ended"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- code


def test_swap_code_stops_activates_and_restarts(h: Harness) -> None:
    assert h.ctl.swap_code(lambda: "idle", force_restart=False, role="control") == \
        ("idle", False, None)
    h.configure()
    old_run, old = h.start_rolling()

    def activate() -> str:
        assert not old.alive  # the engine is down while code changes
        return "swapped"

    result, restarted, new_run = h.ctl.swap_code(activate, force_restart=True, role="control")
    assert (result, restarted) == ("swapped", True)
    assert new_run is not None and new_run != old_run
    assert len(h.spawner.processes) == 2 and h.ctl.state is S.BOOTING


def test_snapshot_env_log_line_and_code_check(tmp_path: Path) -> None:
    snaps = FixedSnapshots(tmp_path)
    h = make_harness(tmp_path, snapshots=snaps)
    h.configure()
    run_id = h.ctl.start(role="control")
    proc = h.spawner.latest()
    assert proc.spec.env["ISOLATED_AGENTJET_BASE_DIR"] == str(snaps.base.resolve())
    assert proc.spec.env["PYTHONPATH"].split(":")[0] == str(snaps.base.resolve())
    log_text = (h.settings.runs_dir / run_id / "engine.log").read_text()
    assert ("[start_engine] Using synced training code from ./ajet_temp/20250101-000000/ajet"
            in log_text)
    assert h.ledger.get_run(run_id).snapshot_id == "a" * 64  # type: ignore[union-attr]

    serve(proc, ajet_file=ajet.__file__)  # the installed ajet, not the snapshot's
    wait_until(lambda: h.ctl.state is S.OFFLINE)
    err = h.ctl.status().last_error
    assert err is not None and "not from the active snapshot" in err.reason
    assert proc.signals == [signal.SIGTERM]

    h.ctl.start(role="control")
    serve(h.spawner.latest(), ajet_file=str(snaps.base / "ajet" / "__init__.py"))
    wait_until(lambda: h.ctl.state is S.ROLLING)
    h.ctl.shutdown()


def test_every_ranks_content_id_must_be_the_active_snapshots_whatever_its_folder(
        tmp_path: Path) -> None:
    snaps = FixedSnapshots(tmp_path)
    h = make_harness(tmp_path, snapshots=snaps)
    h.configure()
    good = "a" * 64  # the active snapshot's id
    # node 1 keeps its copy under another folder name: the same content is accepted
    elsewhere = str(tmp_path / "node1" / "ajet_temp" / "20250102-101010" / "ajet" / "__init__.py")
    h.ctl.start(role="control")
    proc = h.spawner.latest()
    proc.report = EngineReport(state=S.ROLLING, pid=proc.pid,
                               ajet_file=str(snaps.base / "ajet" / "__init__.py"),
                               world_size=2, snapshot_id=good,
                               ranks_ajet_files=[str(snaps.base / "ajet" / "__init__.py"),
                                                 elsewhere],
                               ranks_snapshot_ids=[good, good])
    wait_until(lambda: h.ctl.state is S.ROLLING)
    h.ctl.stop(role="control", reason="test")

    # rank 1 imported other code (say, a stale copy in the right folder): refused
    h.ctl.start(role="control")
    proc = h.spawner.latest()
    proc.report = EngineReport(state=S.ROLLING, pid=proc.pid,
                               ajet_file=str(snaps.base / "ajet" / "__init__.py"),
                               world_size=2, snapshot_id=good,
                               ranks_ajet_files=[str(snaps.base / "ajet" / "__init__.py")] * 2,
                               ranks_snapshot_ids=[good, "b" * 64])
    wait_until(lambda: h.ctl.state is S.OFFLINE)
    err = h.ctl.status().last_error
    assert err is not None and "rank 1 imported ajet bbbbbbbbbbbb" in err.reason
    assert "not from the active snapshot aaaaaaaaaaaa" in err.reason
    assert proc.signals == [signal.SIGTERM]
    h.ctl.shutdown()


# ---------------------------------------------------------------------------- config


def test_set_config_validates_with_the_code_and_changes_nothing_on_error(h: Harness) -> None:
    accepted = h.ctl.set_config("experiment_name: good\nlr: 0.01\n", role="control")
    assert accepted.experiment_name == "good" and accepted.config["lr"] == 0.01
    stored = h.ledger.get_meta(LAST_CONFIG_KEY)
    with pytest.raises(SwarmValidationError) as exc:
        h.ctl.set_config("experiment_name: bad\nlr: 7\n", role="control")
    assert exc.value.detail[0]["loc"] == ["lr"]
    assert "lr" in exc.value.hint
    assert h.ledger.get_meta(LAST_CONFIG_KEY) == stored
    assert audit_actions(h.ledger) == [("sync_config", "ok"), ("sync_config", "refused")]


# ---------------------------------------------------------------------------- recovery


def test_recover_stops_live_orphans_and_closes_vanished_runs(tmp_path: Path) -> None:
    h = make_harness(tmp_path)
    orphan = FakeProcess(pid=777, spec=SpawnSpec(argv=["engine", "--socket", "/nowhere"],
                                                 cwd=tmp_path, env={},
                                                 log_path=tmp_path / "orphan.log"))
    h.spawner.orphans[777] = orphan

    def open_run(run_id: str, pid: int, start_time: float) -> None:
        h.ledger.create_run(RunRecord(
            id=run_id, snapshot_id=SERVER_CODE, config_yaml="{}", config_hash="h",
            experiment_name="e", started_by="control", started_at=time.time(),
            run_dir=str(tmp_path / "runs" / run_id), status="running", pid=pid,
            pid_start_time=start_time))

    open_run("r-alive", 777, 1000.0 + 777)
    open_run("r-gone", 778, 1000.0 + 778)
    open_run("r-recycled", 777, 5.0)  # same pid, other start time: never signalled twice
    h.ctl.recover()
    assert orphan.signals == [signal.SIGTERM]
    alive, gone, recycled = (h.ledger.get_run(r) for r in ("r-alive", "r-gone", "r-recycled"))
    assert alive is not None and alive.status == "ended" and "server restarted" in alive.reason
    assert gone is not None and gone.status == "failed" and "already gone" in gone.reason
    assert recycled is not None and recycled.status == "failed"
    assert h.ledger.open_runs() == []
    assert audit_actions(h.ledger) == [("recover", "ok")] * 3
    assert h.ctl.state is S.OFFLINE
